/* cache_vq_cuda.c — the VQ kind of kvpq_cache on the GPU (params.backend = KVPQ_BACKEND_CUDA).
 *
 * Each layer is one device-resident kvpq_cuda_cache of one sequence (src/cuda/cache_cuda.cu), made
 * here from the layer's quantizers, key smoothing factors, key mean and value rotation of the
 * borrowed kvpq_codebook (the codebook is uploaded by the library; no caller glue). The calls take
 * host arrays, as every kvpq_cache does: K, V and q are copied to the device, the output back.
 *
 * What it holds differs from the CPU VQ kind (cache_vq.c) in three ways (docs/CUDA.md, "One cache
 * API"): every position is coded when appended and the newest `window` positions are also kept in
 * float32 (the CPU keeps them in fp16 and codes them in batches of 32 as they leave), so attention
 * sees coded positions [0, L - window) and float32 ones after; norm-explicit scales are float16
 * whatever the codebook's k.norm_bits / v.norm_bits say; pages are page_tokens rounded up to a
 * power of two >= 32. vq_fast_scan is ignored (the GPU kernels' own scores).
 *
 * Attention: one kernel launch per query (the kernel takes one query per sequence), the query at
 * position p reading lengths p + 1 from a device array, so a query sees its own window state while
 * the ring holds it: kvpq_cache_append_attend feeds queries inside the first `window` positions
 * together and the later ones one append at a time (coded_of). The log-sum-exp that cache.c merges
 * attention sinks with comes from the kernel's split merge, plus q . mu / sqrt(head_dim) (the
 * kernel scores centered keys).
 *
 * Truncation keeps the codes of the positions it keeps; positions that must return to the float32
 * window after they left it (a cut below L - window) come back as their decoded codes, as the CPU
 * kind keeps codes there ("lossy" below counts them, so kvpq_cache_exact_prefix stays right).
 *
 * Saved form (kvpq_cache_save; cache_file.c marks the file as the CUDA backend's): per layer, the
 * i32 count of positions without an exact float32 copy, the key and value codes of every position,
 * the float16 scales of norm-explicit quantizers, then the float32 window rows. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"
#include "internal.h"
#include "pq/pq_impl.h"

typedef struct {
    int n_layer, n_head, n_head_kv, head_dim, window, value_rotate;
    const kvpq_codebook *cb;
    kvpq_cuda_cache **layer;
    int *lossy;     /* (n_layer) positions [0, lossy) have no exact float32 copy (coded or decoded) */
} vqc_state;

static void vqc_destroy(void *state) {
    vqc_state *st = state;
    if (!st) return;
    for (int l = 0; l < st->n_layer && st->layer; l++) kvpq_cuda_cache_free(st->layer[l]);
    free(st->layer);
    free(st->lossy);
    free(st);
}

/* The device cache of one layer, from the codebook's quantizers and transforms of that layer. */
static kvpq_status vqc_layer_new(vqc_state *st, const kvpq_cache_params *p, int l) {
    if (kvpq_codebook_key_pq2_const(st->cb, l))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache vq (cuda) layer %d: two key stages (residual VQ) run on the CPU "
                         "backend only", l);
    KVPQ_TRY(kvpq__codebook_check_rope(st->cb, l, "cache vq (cuda)"));
    kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
    cp.n_head = p->n_head;
    cp.n_head_kv = p->n_head_kv;
    cp.head_dim = p->head_dim;
    cp.n_seq = 1;
    cp.max_seq = p->max_seq;
    cp.window = p->window;
    int pt = 32; /* the GPU's pages: a power of two >= 32 (the tensor-core kernel needs one) */
    while (pt < p->page_tokens) pt *= 2;
    cp.page_tokens = pt;
    cp.key = kvpq_codebook_pq_const(st->cb, l, 0);
    cp.value = kvpq_codebook_pq_const(st->cb, l, 1);
    cp.key_smooth = kvpq_codebook_key_smooth_const(st->cb, l);
    cp.key_mean = kvpq_codebook_key_mean_const(st->cb, l);
    cp.value_rotate = st->value_rotate;
    const kvpq_codebook_params cbp = kvpq_codebook_get_params(st->cb);
    cp.key_rope_freq = kvpq__codebook_layer_rope(st->cb, l); /* NULL: this layer codes keys as given */
    cp.key_rope_dims = cp.key_rope_freq ? cbp.key_rope_dims : 0;
    cp.key_rope_neox = cbp.key_rope_neox;
    cp.key_rope_pos0 = p->sinks; /* the kind's position 0 follows the sinks (as cache_vq.c's) */
    kvpq_status s = kvpq_cuda_cache_new(&st->layer[l], &cp);
    if (s != KVPQ_OK) kvpq__err_prefix("cache vq (cuda) layer %d", l);
    return s;
}

static kvpq_status vqc_create(void **state, const kvpq_cache_params *p) {
    vqc_state *st = calloc(1, sizeof *st);
    if (!st || !(st->layer = calloc((size_t)p->n_layer, sizeof *st->layer)) ||
        !(st->lossy = calloc((size_t)p->n_layer, sizeof *st->lossy))) {
        vqc_destroy(st);
        return kvpq__err(KVPQ_ERR_NOMEM, "cache vq (cuda): out of memory");
    }
    st->n_layer = p->n_layer;
    st->n_head = p->n_head;
    st->n_head_kv = p->n_head_kv;
    st->head_dim = p->head_dim;
    st->window = p->window;
    st->cb = p->codebook;
    st->value_rotate = kvpq_codebook_get_params(p->codebook).value_rotate;
    for (int l = 0; l < p->n_layer; l++) {
        kvpq_status s = vqc_layer_new(st, p, l);
        if (s != KVPQ_OK) {
            vqc_destroy(st);
            return s;
        }
    }
    *state = st;
    return KVPQ_OK;
}

static int vqc_coded_of(const void *state, int len) {
    const vqc_state *st = state;
    return len > st->window ? len - st->window : 0;
}

static int vqc_n_coded(const void *state, int layer) { return ((const vqc_state *)state)->lossy[layer]; }

static kvpq_status vqc_append(void *state, int layer, int len, int n, const float *k, const float *v) {
    vqc_state *st = state;
    KVPQ_TRY(kvpq__cuda_cache_append_host(st->layer[layer], n, k, v));
    const int c = vqc_coded_of(st, len + n);
    if (c > st->lossy[layer]) st->lossy[layer] = c;
    return KVPQ_OK;
}

static kvpq_status vqc_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    vqc_state *st = state;
    (void)len;
    KVPQ_TRY(kvpq__cuda_cache_attend_host(st->layer[layer], n_q, q, out, lse));
    const float *mu = kvpq_codebook_key_mean_const(st->cb, layer);
    if (!lse || !mu || kvpq__codebook_layer_rope(st->cb, layer)) return KVPQ_OK;
    /* the kernel scored k - mu (but for keys before RoPE, scored whole): the true log-sum-exp adds
     * q . mu / sqrt(head_dim) */
    const int hd = st->head_dim, g = st->n_head / st->n_head_kv;
    const double scale = 1.0 / sqrt((double)hd);
    for (int r = 0; r < n_q * st->n_head; r++) {
        const float *qr = q + (size_t)r * hd, *m = mu + (size_t)(r % st->n_head / g) * hd;
        double dot = 0.0;
        for (int j = 0; j < hd; j++) dot += (double)qr[j] * m[j];
        lse[r] += (float)(dot * scale);
    }
    return KVPQ_OK;
}

static kvpq_status vqc_read(const void *state, int layer, int len, int pos0, int n, float *k, float *v) {
    const vqc_state *st = state;
    (void)len; /* the codes before the float32 ring, the ring after: as the GPU reads them */
    return kvpq__cuda_cache_read_host(st->layer[layer], pos0, n, 0, k, v);
}

/* Subtract the layer's key mean from n key rows (as the ring holds keys). */
static void vqc_sub_mean(const vqc_state *st, int layer, float *k, int n) {
    const float *mu = kvpq_codebook_key_mean_const(st->cb, layer);
    const size_t row = (size_t)st->n_head_kv * st->head_dim;
    for (size_t i = 0; mu && i < (size_t)n * row; i++) k[i] -= mu[i % row];
}

/* Truncate one layer from len to n < len: positions [max(0, n - window), min(n, len - window)) left
 * the ring and return to it decoded from their codes. */
static kvpq_status vqc_truncate_layer(vqc_state *st, int l, int len, int n) {
    const int W = st->window, a = n > W ? n - W : 0, b = len - W < n ? len - W : n;
    float *k = NULL, *v = NULL;
    kvpq_status s = KVPQ_OK;
    if (W > 0 && b > a) {
        const size_t row = (size_t)st->n_head_kv * st->head_dim;
        k = malloc((size_t)(b - a) * row * sizeof *k);
        v = malloc((size_t)(b - a) * row * sizeof *v);
        if (!k || !v) s = kvpq__err(KVPQ_ERR_NOMEM, "cache vq (cuda): out of memory truncating layer %d", l);
        if (s == KVPQ_OK) s = kvpq__cuda_cache_read_host(st->layer[l], a, b - a, 1, k, v); /* from their codes */
        if (s == KVPQ_OK) vqc_sub_mean(st, l, k, b - a); /* keys as the ring holds them: k - mu */
    }
    if (s == KVPQ_OK) s = kvpq__cuda_cache_truncate(st->layer[l], n);
    if (s == KVPQ_OK && b > a) s = kvpq__cuda_cache_write_window(st->layer[l], a, b - a, k, v);
    free(k), free(v);
    if (s == KVPQ_OK && st->lossy[l] > n) st->lossy[l] = n;
    return s;
}

static kvpq_status vqc_truncate(void *state, const int *lens, int n_pos) {
    vqc_state *st = state;
    for (int l = 0; l < st->n_layer; l++)
        if (lens[l] > n_pos) KVPQ_TRY(vqc_truncate_layer(st, l, lens[l], n_pos));
    return KVPQ_OK;
}

static size_t vqc_resident_bytes(const void *state, const int *lens) {
    const vqc_state *st = state;
    (void)lens;
    size_t b = 0;
    for (int l = 0; l < st->n_layer; l++) b += kvpq_cuda_cache_resident_bytes(st->layer[l]);
    return b;
}

static void vqc_stats(const void *state, const int *lens, kvpq_cache_stats *s) {
    const vqc_state *st = state;
    for (int l = 0; l < st->n_layer; l++) {
        const int c = vqc_coded_of(st, lens[l]);
        s->tokens_coded += c;
        s->tokens_window += lens[l] - c;
    }
}

/* One layer's saved form (see the top of the file), len positions held. */
static kvpq_status vqc_serial_layer(vqc_state *st, int l, int len, kvpq__stream *io, int load) {
    const int H = st->n_head_kv, nw = len < st->window ? len : st->window;
    const kvpq_codebook_params cp = kvpq_codebook_get_params(st->cb);
    const size_t rows = (size_t)len * H, kcs = kvpq_pq_code_size(kvpq_codebook_pq_const(st->cb, l, 0)),
                 vcs = kvpq_pq_code_size(kvpq_codebook_pq_const(st->cb, l, 1)), wf = (size_t)nw * H * st->head_dim;
    int32_t lossy = st->lossy[l];
    KVPQ_TRY(kvpq__stream_io(io, &lossy, sizeof lossy));
    if (load && (lossy < 0 || lossy > len))
        return kvpq__err(KVPQ_ERR_FORMAT, "cache vq (cuda) layer %d: %d positions without float32 copies of %d", l,
                         (int)lossy, len);
    uint8_t *kc = malloc(rows * kcs + 1), *vc = malloc(rows * vcs + 1);
    uint16_t *ks = cp.key_norm ? malloc(rows * 2 + 2) : NULL, *vs = cp.value_norm ? malloc(rows * 2 + 2) : NULL;
    float *kw = malloc(wf * sizeof *kw + 4), *vw = malloc(wf * sizeof *vw + 4);
    kvpq_status s = KVPQ_OK;
    if (!kc || !vc || !kw || !vw || (cp.key_norm && !ks) || (cp.value_norm && !vs))
        s = kvpq__err(KVPQ_ERR_NOMEM, "cache vq (cuda): out of memory saving layer %d", l);
    if (s == KVPQ_OK && !load) s = kvpq__cuda_cache_read_codes(st->layer[l], 0, kc, vc, ks, vs);
    if (s == KVPQ_OK && !load) s = kvpq__cuda_cache_read_window(st->layer[l], len - nw, nw, kw, vw);
    if (s == KVPQ_OK) s = kvpq__stream_io(io, kc, rows * kcs);
    if (s == KVPQ_OK) s = kvpq__stream_io(io, vc, rows * vcs);
    if (s == KVPQ_OK && ks) s = kvpq__stream_io(io, ks, rows * 2);
    if (s == KVPQ_OK && vs) s = kvpq__stream_io(io, vs, rows * 2);
    if (s == KVPQ_OK) s = kvpq__stream_io(io, kw, wf * sizeof *kw);
    if (s == KVPQ_OK) s = kvpq__stream_io(io, vw, wf * sizeof *vw);
    if (s == KVPQ_OK && load && (!kvpq__all_finite(kw, wf) || !kvpq__all_finite(vw, wf)))
        s = kvpq__err(KVPQ_ERR_FORMAT, "cache vq (cuda) layer %d: the float32 window holds NaN or Inf", l);
    for (size_t i = 0; s == KVPQ_OK && load && i < rows * 2; i++) {
        const uint16_t h = i < rows ? (ks ? ks[i] : 0) : (vs ? vs[i - rows] : 0);
        if ((h & 0x7c00u) == 0x7c00u)
            s = kvpq__err(KVPQ_ERR_FORMAT, "cache vq (cuda) layer %d: a norm-explicit scale is not a finite fp16", l);
    }
    if (s == KVPQ_OK && load) s = kvpq__cuda_cache_write(st->layer[l], len, kc, vc, ks, vs, kw, vw);
    if (s == KVPQ_OK && load) st->lossy[l] = lossy;
    free(kc), free(vc), free(ks), free(vs), free(kw), free(vw);
    return s;
}

static kvpq_status vqc_serial(void *state, const int *lens, const int *lo, kvpq__stream *s, int load) {
    vqc_state *st = state;
    for (int l = 0; l < st->n_layer; l++) {
        if (lo[l] != 0)
            return kvpq__err(KVPQ_ERR_FORMAT, "cache vq (cuda) layer %d: first position %d (no sliding window here)", l,
                             lo[l]);
        KVPQ_TRY(vqc_serial_layer(st, l, lens[l], s, load));
    }
    return KVPQ_OK;
}

const kvpq_cache_ops kvpq_cache_ops_vq_cuda = {
    .name = "vq (cuda)",
    .create = vqc_create,
    .destroy = vqc_destroy,
    .append = vqc_append,
    .attend = vqc_attend,
    .truncate = vqc_truncate,
    .read = vqc_read,
    .resident_bytes = vqc_resident_bytes,
    .stats = vqc_stats,
    .drop = NULL, /* no sliding window on the GPU: kvpq_cache_new refuses it */
    .serial = vqc_serial,
    .coded_of = vqc_coded_of,
    .n_coded = vqc_n_coded,
};
