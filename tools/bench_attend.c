/* bench_attend.c — `kvpq bench attend`: decode attention (n_q = 1, every query head of one layer)
 * from the 2-bit VQ cache (PQ d4b8: dsub 4, 8-bit codes, window 128 in fp16) beside the fp32 and
 * fp16 caches, run side by side in the same process on the same keys, values and queries.
 * As in a decode step, one timed call attends every layer of the cache in turn (`--layers`,
 * default: the model's layer count, fewer where the fp32 cache would pass 2 GiB), so each layer's
 * K/V comes from memory rather than from a cache the previous call warmed; times are per layer.
 * `--layers 1` times one layer over and over (its K/V stays in the CPU's caches when it fits).
 * Median of repeats, the caches taking turns within each repeat (a shared machine's slow moments
 * hit all alike); GB/s counts the bytes of stored K/V (and codebooks) one layer's call reads.
 * Uses the public header only. */
#include <cjson/cJSON.h>

#include "cli_json.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

typedef struct {
    int n_head, n_head_kv, head_dim, n_layer;
    const char *model;
} bench_shape;

static const bench_shape shapes[] = {
    {9, 3, 64, 30, "SmolLM2-135M"},
    {32, 8, 128, 32, "Llama-3-8B"},
};
static const int default_ctx[] = {1024, 4096, 8192, 32768};
enum { K_FP32, K_FP16, K_VQ, K_VQFS, K_VQNE, N_KINDS };
/* vq-d4b8-fs: the same VQ cache with kvpq_cache_params.vq_fast_scan (approximate key scores);
 * vq-d4b8-ne: norm-explicit keys and values (a float16 scale per vector, kvpq calibrate's default). */
static const char *const kind_names[N_KINDS] = {"fp32", "fp16", "vq-d4b8", "vq-d4b8-fs", "vq-d4b8-ne"};

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static float gauss(void) {
    /* Irwin-Hall sum of 4 uniforms, scaled to unit variance: cheap and good enough for timing data. */
    float s = 0.0f;
    for (int i = 0; i < 4; i++) {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        s += (float)(rng >> 40) / 16777216.0f;
    }
    return (s - 2.0f) * 1.7320508f;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* An n_layer codebook (d4b8, shared codebook as in VecInfer, rotated values) trained on Gaussian
 * data, the same centroids in every layer: the timing does not depend on what they are. */
static kvpq_status make_codebook(const bench_shape *s, int n_layer, int norm, kvpq_codebook **out) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.key_norm = p.value_norm = norm;
    p.n_layer = n_layer;
    p.n_head_kv = s->n_head_kv;
    p.head_dim = s->head_dim;
    kvpq_status st = kvpq_pq_params_preset(&p.key, "d4b8", s->head_dim);
    if (st == KVPQ_OK) st = kvpq_pq_params_preset(&p.value, "d4b8", s->head_dim);
    if (st != KVPQ_OK) return st;
    p.key.granularity = p.value.granularity = KVPQ_CODEBOOK_SHARED;
    p.value_rotate = 1;
    kvpq_codebook *cb = NULL;
    if ((st = kvpq_codebook_new(&cb, &p)) != KVPQ_OK) return st;
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 4;
    size_t n = 4096;
    float *x = malloc(n * (size_t)s->head_dim * sizeof(float));
    if (!x) {
        kvpq_codebook_free(cb);
        return KVPQ_ERR_NOMEM;
    }
    for (size_t i = 0; i < n * (size_t)s->head_dim; i++) x[i] = gauss();
    if (norm) st = kvpq_normalize_rows(x, n, s->head_dim, NULL); /* norm-explicit codebooks: directions */
    for (int w = 0; w < 2 && st == KVPQ_OK; w++) st = kvpq_pq_train(kvpq_codebook_pq(cb, 0, w), &kp, n, x, NULL);
    free(x);
    /* Every layer gets layer 0's centroids (lambda = 1, mu = 0 as created). */
    for (int l = 1; l < n_layer && st == KVPQ_OK; l++)
        for (int w = 0; w < 2 && st == KVPQ_OK; w++) {
            const kvpq_pq *src = kvpq_codebook_pq_const(cb, 0, w);
            st = kvpq_pq_set_centroids(kvpq_codebook_pq(cb, l, w), kvpq_pq_centroids(src), kvpq_pq_centroids_size(src));
        }
    if (st != KVPQ_OK) {
        kvpq_codebook_free(cb);
        return st;
    }
    *out = cb;
    return KVPQ_OK;
}

/* Median microseconds per layer of one decode attention step over layers 0..n_layer-1, for every
 * cache: the caches take turns within each repeat (fp32, fp16, VQ, ... then again), so a slow
 * moment of a shared machine falls on all of them alike. Repeats until ~0.25 s per cache or
 * `reps`, at least 5. */
static void time_attend(kvpq_cache *const *c, int n_kinds, int n_layer, const float *q, float *out, int reps,
                        double *us, kvpq_status *err) {
    static double t[N_KINDS][512];
    *err = KVPQ_OK;
    for (int kind = 0; kind < n_kinds; kind++)
        for (int i = 0; i < 2; i++) /* warm up threads (and, with one layer, the CPU caches) */
            for (int l = 0; l < n_layer; l++)
                if ((*err = kvpq_cache_attend(c[kind], l, 1, q, out)) != KVPQ_OK) return;
    int n = 0;
    double start = cli_now();
    while (n < 512) {
        for (int kind = 0; kind < n_kinds; kind++) {
            double t0 = cli_now();
            for (int l = 0; l < n_layer; l++)
                if ((*err = kvpq_cache_attend(c[kind], l, 1, q, out)) != KVPQ_OK) return;
            t[kind][n] = (cli_now() - t0) * 1e6 / n_layer;
        }
        n++;
        if (reps > 0 ? n >= reps : (n >= 5 && cli_now() - start > 0.25 * n_kinds)) break;
    }
    for (int kind = 0; kind < n_kinds; kind++) {
        qsort(t[kind], n, sizeof t[kind][0], cmp_double);
        us[kind] = n % 2 ? t[kind][n / 2] : 0.5 * (t[kind][n / 2 - 1] + t[kind][n / 2]);
    }
}

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq bench attend [--ctx N] [--layers N] [--backend cpu] [--threads N] [--repeats N] [--json]\n"
            "  decode attention (1 query, all heads of one layer) from the 2-bit VQ cache (d4b8, window 128)\n"
            "  beside the fp32 and fp16 caches, for shapes (n_head 9, n_head_kv 3, head_dim 64) and\n"
            "  (32, 8, 128); contexts 1024 4096 8192 32768 unless --ctx. Median of repeats, per layer.\n"
            "  --layers N: layers attended in turn per timed step, as in decode (default: the model's 30 / 32,\n"
            "  fewer where the fp32 cache would exceed 2 GiB); 1 re-reads one layer (warm CPU caches).\n"
            "  --json prints the rows as JSON (schema kvpq.bench.attend/1, docs/json.md); --quiet: no progress.\n"
            "  Rows: fp32, fp16, vq-d4b8 (codes only), vq-d4b8-fs (fast-scan), vq-d4b8-ne (norm-explicit:\n"
            "  a float16 scale per vector, kvpq calibrate's default; speedup_ne_vs_fp32 in the JSON).\n");
}

static const char *const OPTS[] = {"--help", "-h", "--quiet", "-q", "--ctx", "--layers", "--threads", "--repeats", "--backend",
                                   "--json", NULL};

typedef struct {
    long ctx_only, threads, reps, layers_opt; /* 0: not given */
    int json;
    int ctxs[8], n_ctx; /* the contexts timed, in this order */
} attend_opts;

/* argv into *o: -1 to go on, else the exit code (0 after --help). */
static int parse_opts(int argc, char **argv, attend_opts *o) {
    memset(o, 0, sizeof *o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--ctx")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 1 << 20, &o->ctx_only)) return 2;
        } else if (!strcmp(a, "--layers")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 1024, &o->layers_opt)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 0, 1024, &o->threads)) return 2;
        } else if (!strcmp(a, "--repeats")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 512, &o->reps)) return 2;
        } else if (!strcmp(a, "--backend")) {
            const char *b = i + 1 < argc ? argv[++i] : "(missing)";
            if (strcmp(b, "cpu")) return cli_usage_error("bench attend: --backend %s: only cpu is benchmarked here", b);
        } else if (!strcmp(a, "--json")) {
            o->json = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
        } else {
            return cli_unknown_option("bench attend", a, OPTS);
        }
    }
    if (o->ctx_only) o->ctxs[o->n_ctx++] = (int)o->ctx_only;
    else
        for (size_t i = 0; i < sizeof default_ctx / sizeof default_ctx[0]; i++) o->ctxs[o->n_ctx++] = default_ctx[i];
    return -1;
}

/* The settings of the JSON document, and the table's head. */
static void print_settings(const attend_opts *o, cJSON *settings) {
    cJSON_AddStringToObject(settings, "backend", "cpu");
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    cJSON_AddNumberToObject(settings, "threads", (double)o->threads);
    cJSON_AddNumberToObject(settings, "repeats", (double)o->reps);
    cJSON *jctx = cJSON_AddArrayToObject(settings, "ctx");
    for (int i = 0; i < o->n_ctx; i++) cJSON_AddItemToArray(jctx, cJSON_CreateNumber(o->ctxs[i]));
    cJSON_AddNumberToObject(settings, "window", 128);
    if (!o->json)
        printf("decode attention, 1 query x all heads of a layer, layers in turn; median of repeats, us per layer;\n"
               "simd %s; threads %ld (0 = default)\n"
               "%-13s %7s %6s  %-8s %10s %9s %10s %9s %9s\n",
               kvpq_simd_name(kvpq_simd_get()), o->threads, "shape", "ctx", "layers", "cache", "us/layer",
               "GB/s", "bytes", "vs fp32", "vs fp16");
}

#define CHUNK 1024 /* tokens appended per call while the caches grow */

/* One shape's caches (every kind, L layers, room for the longest context) and buffers. */
typedef struct {
    const bench_shape *s;
    int L, held;    /* layers; tokens every cache holds */
    size_t row;     /* n_head_kv * head_dim */
    kvpq_codebook *cb, *cb_ne;
    kvpq_cache *caches[N_KINDS];
    float *k, *v;   /* (CHUNK, row) */
    float *q, *out; /* (n_head * head_dim) */
} shape_run;

/* The layers attended per step: --layers, else the model's, as many as keep the fp32 cache within
 * 2 GiB at the longest context. */
static int shape_layers(const attend_opts *o, const bench_shape *s, size_t row, int *max_ctx) {
    *max_ctx = 0;
    for (int i = 0; i < o->n_ctx; i++) *max_ctx = o->ctxs[i] > *max_ctx ? o->ctxs[i] : *max_ctx;
    if (o->layers_opt) return (int)o->layers_opt;
    double per_layer = (double)*max_ctx * row * 2 * 4;
    return (int)fmin(s->n_layer, fmax(1.0, floor(2147483648.0 / per_layer)));
}

/* Codebooks, caches, buffers and the query: 0, or 1 (message printed). */
static int shape_open(shape_run *r, const attend_opts *o, const bench_shape *s) {
    memset(r, 0, sizeof *r);
    r->s = s;
    r->row = (size_t)s->n_head_kv * s->head_dim;
    int max_ctx;
    r->L = shape_layers(o, s, r->row, &max_ctx);
    kvpq_status st = make_codebook(s, r->L, 0, &r->cb);
    if (st == KVPQ_OK) st = make_codebook(s, r->L, 1, &r->cb_ne);
    for (int kind = 0; kind < N_KINDS && st == KVPQ_OK; kind++) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = kind == K_FP32 ? KVPQ_CACHE_FP32 : kind == K_FP16 ? KVPQ_CACHE_FP16 : KVPQ_CACHE_VQ;
        p.n_layer = r->L;
        p.n_head = s->n_head;
        p.n_head_kv = s->n_head_kv;
        p.head_dim = s->head_dim;
        p.max_seq = max_ctx;
        p.window = 128;
        p.page_tokens = 256;
        p.codebook = kind == K_VQNE ? r->cb_ne : r->cb;
        p.n_threads = (int)o->threads;
        p.backend = KVPQ_BACKEND_CPU;
        p.vq_fast_scan = kind == K_VQFS;
        st = kvpq_cache_new(&r->caches[kind], &p);
    }
    const size_t nq = (size_t)s->n_head * s->head_dim;
    r->k = malloc((size_t)CHUNK * r->row * sizeof(float));
    r->v = malloc((size_t)CHUNK * r->row * sizeof(float));
    r->q = malloc(nq * sizeof(float));
    r->out = malloc(nq * sizeof(float));
    if (st == KVPQ_OK && (!r->k || !r->v || !r->q || !r->out)) st = KVPQ_ERR_NOMEM;
    if (st != KVPQ_OK) return cli_fail("bench attend (setup)", st);
    for (size_t i = 0; i < nq; i++) r->q[i] = gauss();
    return 0;
}

static void shape_close(shape_run *r) {
    for (int kind = 0; kind < N_KINDS; kind++) kvpq_cache_free(r->caches[kind]);
    kvpq_codebook_free(r->cb);
    kvpq_codebook_free(r->cb_ne);
    free(r->k);
    free(r->v);
    free(r->q);
    free(r->out);
}

/* Grow every cache to ctx tokens with the same random keys and values (contexts in increasing
 * order reuse them; a shorter one starts over): 0, or 1 (message printed). */
static int shape_grow(shape_run *r, int ctx) {
    if (ctx < r->held) {
        for (int kind = 0; kind < N_KINDS; kind++) kvpq_cache_truncate(r->caches[kind], 0);
        r->held = 0;
    }
    while (r->held < ctx) {
        int n = ctx - r->held < CHUNK ? ctx - r->held : CHUNK;
        for (size_t i = 0; i < (size_t)n * r->row; i++) {
            r->k[i] = gauss();
            r->v[i] = gauss();
        }
        for (int kind = 0; kind < N_KINDS; kind++)
            for (int l = 0; l < r->L; l++) {
                kvpq_status st = kvpq_cache_append(r->caches[kind], l, n, r->k, r->v);
                if (st != KVPQ_OK) return cli_fail("bench attend (append)", st);
            }
        r->held += n;
    }
    return 0;
}

/* The bytes one layer's call reads, per kind: stored K/V (and the codebooks, and the scales of a
 * norm-explicit cache). */
static void shape_bytes(const shape_run *r, int ctx, double *bytes) {
    const int L = r->L, nkv = r->s->n_head_kv;
    const kvpq_pq *kq = kvpq_codebook_pq_const(r->cb, 0, 0), *vq = kvpq_codebook_pq_const(r->cb, 0, 1);
    for (int kind = 0; kind < N_KINDS; kind++) {
        kvpq_cache_stats cs;
        kvpq_cache_get_stats(r->caches[kind], &cs);
        if (kind == K_FP32) bytes[kind] = (double)ctx * r->row * 2 * 4;
        else if (kind == K_FP16) bytes[kind] = (double)ctx * r->row * 2 * 2;
        else {
            /* stats count every layer's tokens: one layer's share */
            bytes[kind] = (double)cs.tokens_coded / L * nkv * (kvpq_pq_code_size(kq) + kvpq_pq_code_size(vq)) +
                          (double)cs.tokens_window / L * r->row * 2 * 2 +
                          (double)(kvpq_pq_centroids_size(kq) + kvpq_pq_centroids_size(vq)) * 4;
            if (kind == K_VQNE) bytes[kind] += (double)cs.tokens_coded / L * nkv * 2 * 2; /* scales */
        }
    }
}

/* How far fast-scan moves the output: max |o_fs - o_exact| over all heads (returned), beside
 * max |o| (*o_max). */
static double fast_scan_diff(shape_run *r, double *o_max) {
    const int n = r->s->n_head * r->s->head_dim;
    double fs_diff = 0.0;
    *o_max = 0.0;
    float *o2 = malloc((size_t)n * sizeof(float));
    if (o2 && kvpq_cache_attend(r->caches[K_VQ], 0, 1, r->q, r->out) == KVPQ_OK &&
        kvpq_cache_attend(r->caches[K_VQFS], 0, 1, r->q, o2) == KVPQ_OK)
        for (int i = 0; i < n; i++) {
            fs_diff = fmax(fs_diff, fabs((double)o2[i] - r->out[i]));
            *o_max = fmax(*o_max, fabs((double)r->out[i]));
        }
    free(o2);
    return fs_diff;
}

/* A context's rows: into the JSON results, and printed unless --json. */
static void print_rows(const shape_run *r, int ctx, const double *us, const double *bytes, double fs_diff, double o_max,
                       int json, cJSON *rows) {
    const bench_shape *s = r->s;
    for (int kind = 0; kind < N_KINDS; kind++) {
        cJSON *jr = cJSON_CreateObject();
        cJSON_AddStringToObject(jr, "model", s->model);
        cJSON_AddNumberToObject(jr, "n_head", s->n_head);
        cJSON_AddNumberToObject(jr, "n_head_kv", s->n_head_kv);
        cJSON_AddNumberToObject(jr, "head_dim", s->head_dim);
        cJSON_AddNumberToObject(jr, "layers", r->L);
        cJSON_AddNumberToObject(jr, "ctx", ctx);
        cJSON_AddStringToObject(jr, "cache", kind_names[kind]);
        cli_json_num(jr, "us_per_call", us[kind]); /* per layer */
        cli_json_num(jr, "bytes_read", bytes[kind]);
        cli_json_num(jr, "gb_per_s", bytes[kind] / (us[kind] * 1e3));
        cli_json_num(jr, "speedup_vs_fp32", us[K_FP32] / us[kind]);
        cli_json_num(jr, "speedup_vs_fp16", us[K_FP16] / us[kind]);
        /* fast-scan rows: how far its output moves from the exact VQ cache's */
        if (kind == K_VQFS) cli_json_num(jr, "fast_scan_max_abs_diff", fs_diff);
        cJSON_AddItemToArray(rows, jr);
        if (!json)
            printf("%-13s %7d %6d  %-8s %10.1f %9.2f %10.0f %8.2fx %8.2fx\n", s->model, ctx, r->L, kind_names[kind],
                   us[kind], bytes[kind] / (us[kind] * 1e3), bytes[kind], us[K_FP32] / us[kind], us[K_FP16] / us[kind]);
    }
    if (!json)
        printf("%-13s %7d  fast-scan vs exact VQ output: max |diff| %.3g (max |o| %.3g)\n", s->model, ctx, fs_diff, o_max);
}

/* One context of a shape: grow, time, rows. 0, or 1 (message printed). */
static int shape_ctx(shape_run *r, const attend_opts *o, int ctx, cJSON *rows) {
    if (shape_grow(r, ctx)) return 1;
    double us[N_KINDS], bytes[N_KINDS], o_max;
    kvpq_status st;
    time_attend(r->caches, N_KINDS, r->L, r->q, r->out, (int)o->reps, us, &st);
    if (st != KVPQ_OK) return cli_fail("bench attend", st);
    shape_bytes(r, ctx, bytes);
    double fs_diff = fast_scan_diff(r, &o_max);
    print_rows(r, ctx, us, bytes, fs_diff, o_max, o->json, rows);
    return 0;
}

int cmd_bench_attend(int argc, char **argv) {
    attend_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0) return rc;
    cJSON *settings = NULL, *rows = NULL, *root = cli_json_new("bench.attend", &settings, &rows);
    if (!root) return cli_usage_error("bench attend: out of memory");
    print_settings(&o, settings);
    cli_progress pr;
    cli_progress_begin(&pr, "bench attend", "contexts", (double)o.n_ctx * (sizeof shapes / sizeof shapes[0]));
    int n_done = 0;
    rc = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0] && !rc; si++) {
        shape_run r;
        rc = shape_open(&r, &o, &shapes[si]);
        for (int ci = 0; ci < o.n_ctx && !rc; ci++) {
            rc = shape_ctx(&r, &o, o.ctxs[ci], rows);
            if (!rc) cli_progress_update(&pr, ++n_done, shapes[si].model);
        }
        shape_close(&r);
    }
    cli_progress_end(&pr, n_done, NULL);
    if (o.json && !rc) return cli_json_print(root);
    cJSON_Delete(root);
    return rc;
}
