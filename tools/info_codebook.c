/* info_codebook.c — `kvpq info FILE.safetensors`: what a kvpq codebook file holds. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char *const config_keys[] = {
    "kvpq.format_version", "n_layer", "n_head_kv", "head_dim", "k.M", "k.nbits",
    "k.granularity",       "v.M",     "v.nbits",   "v.granularity", "v.rotate", "k.norm", "v.norm",
    "k.stages",            "k2.M",        "k.rope_dims", "k.rope",
};

static int is_config_key(const char *k) {
    if (!strncmp(k, "k.M.", 4) || !strncmp(k, "v.M.", 4) || !strncmp(k, "k.stages.", 9))
        return 1; /* per-layer M and stages, printed with the layers */
    for (size_t i = 0; i < sizeof config_keys / sizeof config_keys[0]; i++)
        if (!strcmp(k, config_keys[i])) return 1;
    return 0;
}

/* A metadata value of the file (dflt when absent), escaped (cli_fput_escaped: issue 14). */
static void put_meta(const char *s, const char *dflt) {
    if (!s) fputs(dflt, stdout);
    else cli_fput_escaped(stdout, s, strlen(s), 200);
}

/* A cell of the allocation table: " %*s" when s is printable ASCII, else escaped (unaligned). */
static void put_cell(const char *s, int width) {
    for (const unsigned char *c = (const unsigned char *)s; *c; c++)
        if (*c < 0x20 || *c >= 0x7f || *c == '\\') {
            fputc(' ', stdout);
            cli_fput_escaped(stdout, s, strlen(s), 64);
            return;
        }
    printf(" %*s", width, s);
}

static void print_pq(const char *what, const kvpq_pq_params *q) {
    int dsub = q->d / q->M;
    printf("%-6s M=%d dsub=%d nbits=%d ksub=%d granularity=%s  %.3f bits/element\n", what, q->M, dsub, q->nbits,
           1 << q->nbits,
           q->granularity == KVPQ_CODEBOOK_SUBSPACE ? "subspace" : q->granularity == KVPQ_CODEBOOK_HEAD ? "head" : "shared",
           (double)q->M * q->nbits / q->d);
}

/* "[a,b]" or "[a,b,c]" of a codebook tensor. */
static void book_shape(const kvpq_pq_params *q, char *buf, size_t cap) {
    if (q->granularity == KVPQ_CODEBOOK_SUBSPACE)
        snprintf(buf, cap, "[%d,%d,%d]", q->M, 1 << q->nbits, q->d / q->M);
    else if (q->granularity == KVPQ_CODEBOOK_HEAD)
        snprintf(buf, cap, "[%d,%d,%d]", q->n_head, 1 << q->nbits, q->d / q->M);
    else
        snprintf(buf, cap, "[%d,%d]", 1 << q->nbits, q->d / q->M);
}

/* Root mean square of the n floats. */
static double rms(const float *x, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return n ? sqrt(s / (double)n) : 0;
}

static int layer_M(const kvpq_codebook *cb, int w, int l) {
    return w ? kvpq_codebook_layer_value_M(cb, l) : kvpq_codebook_layer_key_M(cb, l);
}

/* The keys' (w = 0) or values' (w = 1) quantizer, then the layers whose M differs from k.M / v.M
 * (per-layer bit allocation) as runs of equal M. Returns the code bits per vector summed over
 * layers. */
static double print_kind(const kvpq_codebook *cb, const kvpq_codebook_params *p, int w) {
    const kvpq_pq_params *base = w ? &p->value : &p->key;
    double bits = 0;
    print_pq(w ? "value" : "key", base);
    for (int l = 0; l < p->n_layer; l++) bits += (double)layer_M(cb, w, l) * base->nbits;
    for (int l = 0; l < p->n_layer;) {
        int M = layer_M(cb, w, l), e = l;
        while (e + 1 < p->n_layer && layer_M(cb, w, e + 1) == M) e++;
        if (M != base->M) {
            char what[48];
            snprintf(what, sizeof what, "  %s layers %d-%d", w ? "value" : "key", l, e);
            kvpq_pq_params q = *base;
            q.M = M;
            print_pq(what, &q);
        }
        l = e + 1;
    }
    return bits;
}

/* The residual second stage of the keys (key_stages 2), and the layers that have it. Returns its
 * code bits per vector summed over those layers. */
static double print_key2(const kvpq_codebook *cb, const kvpq_codebook_params *p) {
    print_pq("key2", &p->key2);
    int n2 = 0;
    for (int l = 0; l < p->n_layer; l++) n2 += kvpq_codebook_layer_key_stages(cb, l) == 2;
    if (n2 < p->n_layer) {
        printf("  key2 in layers:");
        for (int l = 0; l < p->n_layer; l++)
            if (kvpq_codebook_layer_key_stages(cb, l) == 2) printf(" %d", l);
        printf(" (%d of %d)\n", n2, p->n_layer);
    }
    return (double)n2 * p->key2.M * p->key2.nbits;
}

/* Keys coded before RoPE (format version 5): the rotation and the layers that use it. */
static void print_key_rope(const kvpq_codebook *cb, const kvpq_codebook_params *p) {
    if (!p->key_rope_dims) return;
    int on = 0;
    for (int l = 0; l < p->n_layer; l++) {
        const float *f = kvpq_codebook_key_rope_freq_const(cb, l);
        int any = 0;
        for (int i = 0; i < p->key_rope_dims / 2; i++) any |= f[i] != 0.0f;
        on += any;
    }
    printf("keys before RoPE: %d rotated dims, pairs %s, in %d of %d layers (the others code keys as given)\n",
           p->key_rope_dims, p->key_rope_neox ? "(x[i], x[i + n/2]) (neox)" : "(x[2i], x[2i+1]) (norm)", on, p->n_layer);
}

/* The quantizers and the bits per element: codes, plus one scale per vector of a norm-explicit
 * quantizer: float16, or 8 bits in the layers kvpq_codebook_layer_scale_bits names (metadata
 * k.norm_bits / v.norm_bits = "8"). */
static void print_quantizers(const kvpq_codebook *cb, const kvpq_codebook_params *p) {
    double bits = print_kind(cb, p, 0) + print_kind(cb, p, 1);
    if (p->key_stages == 2) bits += print_key2(cb, p);
    double sbits = 0;
    int n8[2] = {0, 0};
    for (int l = 0; l < p->n_layer; l++)
        for (int w = 0; w < 2; w++) {
            const int b = kvpq_codebook_layer_scale_bits(cb, l, w);
            sbits += b > 0 ? b : 0;
            n8[w] += b == 8;
        }
    if (n8[0] || n8[1])
        printf("norm scales:     8-bit in %d of %d layers' keys, %d of %d layers' values (float16 elsewhere)\n",
               n8[0], p->n_layer, n8[1], p->n_layer);
    printf("bits/element (K and V together, codes and per-vector scales): %.3f\n",
           (bits + sbits) / p->n_layer / (2.0 * p->head_dim));
    print_key_rope(cb, p);
}

/* The joint check of the whole file (calibrate --verify-ctx), whose held-out KL is hk; pred: the
 * predicted KL (or NULL). */
static void print_joint_check(const kvpq_codebook *cb, const char *hk, const char *pred) {
    const char *h[] = {"alloc.holdout_top1", "alloc.verify_ctx", "alloc.verify_scored", "alloc.verify_start",
                       "alloc.holdout_ppl", "alloc.holdout_ppl_base"};
    const char *hv[6];
    for (int i = 0; i < 6; i++) hv[i] = kvpq_codebook_get_meta(cb, h[i]);
    printf("  joint check: KL(fp16 || file) mean %.6g, top-1 %.2f%%, ppl ", atof(hk),
           hv[0] ? 100.0 * atof(hv[0]) : NAN);
    put_meta(hv[4], "?");
    fputs(" (fp16 ", stdout);
    put_meta(hv[5], "?");
    fputs(") on ", stdout);
    put_meta(hv[2], "?");
    fputs(" scored tokens of a ", stdout);
    put_meta(hv[1], "?");
    fputs("-token chunk (text tokens ", stdout);
    put_meta(hv[3], "?");
    fputs("..)", stdout);
    if (pred && atof(hk) > 0) printf("; predicted / held-out %.2f", atof(pred) / atof(hk));
    printf("\n");
}

/* "  <label><the value of key>" when the file has key. */
static void print_meta_line(const kvpq_codebook *cb, const char *key, const char *label) {
    const char *v = kvpq_codebook_get_meta(cb, key);
    if (!v) return;
    fputs(label, stdout);
    put_meta(v, "?");
    fputc('\n', stdout);
}

/* Each layer's presets with the KL they were predicted to cost: cur = alloc.k, alloc.v,
 * alloc.kl.k, alloc.kl.v (comma-separated, a field per layer). */
static void print_alloc_table(int n_layer, const char *cur[4]) {
    printf("  %5s %8s %10s %8s %10s\n", "layer", "keys", "key KL", "values", "value KL");
    for (int l = 0; l < n_layer; l++) {
        char f[4][32];
        for (int j = 0; j < 4; j++) {
            size_t n = strcspn(cur[j], ",");
            snprintf(f[j], sizeof f[j], "%.*s", (int)(n < 31 ? n : 31), cur[j]);
            cur[j] += n + (cur[j][n] == ',');
        }
        printf("  %5d", l);
        put_cell(f[0], 8);
        put_cell(f[2], 10);
        put_cell(f[1], 8);
        put_cell(f[3], 10);
        fputc('\n', stdout);
    }
}

/* An allocation by `kvpq calibrate --bits` (docs/allocation.md; ab: its alloc.bits): the budget,
 * the prediction, and each layer's presets with the KL they were predicted to cost. The values
 * are the file's strings: printed escaped (issue 14), "?" where absent. */
static void print_allocation(const kvpq_codebook *cb, int n_layer, const char *ab) {
    const char *g[] = {"alloc.ctx", "alloc.window", "alloc.sinks", "alloc.effective_bits", "alloc.predicted_kl",
                       "alloc.k", "alloc.v", "alloc.kl.k", "alloc.kl.v"};
    const char *v[9];
    for (int i = 0; i < 9; i++) v[i] = kvpq_codebook_get_meta(cb, g[i]);
    fputs("allocation:      --bits ", stdout);
    put_meta(ab, "?");
    fputs(" at ctx ", stdout);
    put_meta(v[0], "?");
    fputs(" (window ", stdout);
    put_meta(v[1], "?");
    fputs(", sinks ", stdout);
    put_meta(v[2], "0");
    fputs("): effective bits ", stdout);
    put_meta(v[3], "?");
    fputs(", predicted KL ", stdout);
    put_meta(v[4], "?");
    /* the joint check of the whole file (calibrate --verify-ctx; absent in files before 2026-12-02) */
    const char *hk = kvpq_codebook_get_meta(cb, "alloc.holdout_kl");
    if (hk) printf(", held-out KL %.6g", atof(hk));
    printf("\n");
    if (hk) print_joint_check(cb, hk, v[4]);
    print_meta_line(cb, "alloc.window_measured_kl", "  window chosen among (window:held-out KL): ");
    print_meta_line(cb, "alloc.window_predicted_kl", "  window chosen among (window:predicted KL): ");
    const char *cur[4] = {v[5], v[6], v[7], v[8]};
    if (cur[0] && cur[1] && cur[2] && cur[3]) print_alloc_table(n_layer, cur);
}

/* The metadata that is not configuration (names, training settings, ...). */
static void print_free_meta(const kvpq_codebook *cb) {
    size_t n_free = 0;
    for (size_t i = 0; i < kvpq_codebook_meta_count(cb); i++) {
        const char *k = kvpq_codebook_meta_key(cb, i);
        if (is_config_key(k)) continue;
        if (!n_free++) printf("metadata:\n");
        const char *v = kvpq_codebook_get_meta(cb, k);
        size_t len = strlen(v);
        /* Long values (a whole text's name list, say) are cut for display; keys and values are
         * the file's strings: escaped. */
        fputs("  ", stdout);
        for (size_t w = cli_fput_escaped(stdout, k, strlen(k), 100); w < 20; w++) fputc(' ', stdout);
        fputc(' ', stdout);
        cli_fput_escaped(stdout, v, len, 100);
        printf("%s\n", len > 100 ? " ..." : "");
    }
}

/* The tensors of a layer, then per layer the range of the key smoothing and the sizes of the key
 * mean and centroids. */
static void print_tensors(const kvpq_codebook *cb, const kvpq_codebook_params *p) {
    char ks[48], vs[48], ss[48];
    snprintf(ss, sizeof ss, "[%d,%d]", p->n_head_kv, p->head_dim);
    book_shape(&p->key, ks, sizeof ks); /* k.M's; layers listed above with their own M differ */
    book_shape(&p->value, vs, sizeof vs);
    char k2s[64] = "";
    if (p->key_stages == 2) {
        char b2[40];
        book_shape(&p->key2, b2, sizeof b2);
        snprintf(k2s, sizeof k2s, "  k.codebook2 %s", b2);
    }
    char rs[48] = "";
    if (p->key_rope_dims) snprintf(rs, sizeof rs, "  k.rope_freq [%d]", p->key_rope_dims / 2);
    printf("tensors per layer: k.smooth %s  k.mean %s  k.codebook %s%s  v.codebook %s%s  (F32)\n", ss, ss, ks, k2s, vs,
           rs);
    printf("%5s %12s %12s %12s %12s %14s %14s\n", "layer", "smooth.min", "smooth.max", "smooth.mean", "k.mean.rms",
           "k.centroid.rms", "v.centroid.rms");
    const size_t n = (size_t)p->n_head_kv * p->head_dim;
    for (int l = 0; l < p->n_layer; l++) {
        const float *sm = kvpq_codebook_key_smooth_const(cb, l);
        double mn = INFINITY, mx = -INFINITY, sum = 0;
        for (size_t i = 0; i < n; i++) {
            mn = fmin(mn, sm[i]);
            mx = fmax(mx, sm[i]);
            sum += sm[i];
        }
        const kvpq_pq *kq = kvpq_codebook_pq_const(cb, l, 0), *vq = kvpq_codebook_pq_const(cb, l, 1);
        printf("%5d %12.4g %12.4g %12.4g %12.4g %14.4g %14.4g\n", l, mn, mx, sum / (double)n,
               rms(kvpq_codebook_key_mean_const(cb, l), n),
               rms(kvpq_pq_centroids(kq), kvpq_pq_centroids_size(kq)),
               rms(kvpq_pq_centroids(vq), kvpq_pq_centroids_size(vq)));
    }
    int centered = 0;
    for (int l = 0; l < p->n_layer && !centered; l++) centered = rms(kvpq_codebook_key_mean_const(cb, l), n) > 0;
    if (!centered)
        printf("note: every k.mean is 0: keys are not centered (a format version 1 file, or calibrate --center 0)\n");
}

int cmd_info_codebook(int argc, char **argv, const char *path) {
    (void)argc;
    (void)argv;
    kvpq_codebook *cb;
    kvpq_status s = kvpq_codebook_load(&cb, path);
    if (s != KVPQ_OK) return cli_fail("info", s);
    kvpq_codebook_params p = kvpq_codebook_get_params(cb);

    printf("file:            %s\n", path);
    printf("format:          kvpq codebook (safetensors), version %s\n",
           kvpq_codebook_get_meta(cb, "kvpq.format_version"));
    printf("n_layer=%d n_head_kv=%d head_dim=%d value_rotate=%d key_norm=%d value_norm=%d\n", p.n_layer, p.n_head_kv,
           p.head_dim, p.value_rotate, p.key_norm, p.value_norm);
    print_quantizers(cb, &p);
    const char *ab = kvpq_codebook_get_meta(cb, "alloc.bits");
    if (ab) print_allocation(cb, p.n_layer, ab);
    print_free_meta(cb);
    print_tensors(cb, &p);
    kvpq_codebook_free(cb);
    return 0;
}
