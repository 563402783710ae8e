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

int cmd_bench_attend(int argc, char **argv) {
    long ctx_only = 0, threads = 0, reps = 0, layers_opt = 0;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--ctx")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 1 << 20, &ctx_only)) return 2;
        } else if (!strcmp(a, "--layers")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 1024, &layers_opt)) return 2;
        } else if (!strcmp(a, "--threads")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 0, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--repeats")) {
            if (!cli_parse_int(a, i + 1 < argc ? argv[++i] : NULL, 1, 512, &reps)) return 2;
        } else if (!strcmp(a, "--backend")) {
            const char *b = i + 1 < argc ? argv[++i] : "(missing)";
            if (strcmp(b, "cpu")) return cli_usage_error("bench attend: --backend %s: only cpu is benchmarked here", b);
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
        } else {
            return cli_unknown_option("bench attend", a, OPTS);
        }
    }
    int ctxs[8], n_ctx = 0;
    if (ctx_only) ctxs[n_ctx++] = (int)ctx_only;
    else
        for (size_t i = 0; i < sizeof default_ctx / sizeof default_ctx[0]; i++) ctxs[n_ctx++] = default_ctx[i];

    cJSON *settings = NULL, *rows = NULL, *root = cli_json_new("bench.attend", &settings, &rows);
    if (!root) return cli_usage_error("bench attend: out of memory");
    cJSON_AddStringToObject(settings, "backend", "cpu");
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    cJSON_AddNumberToObject(settings, "threads", (double)threads);
    cJSON_AddNumberToObject(settings, "repeats", (double)reps);
    cJSON *jctx = cJSON_AddArrayToObject(settings, "ctx");
    for (int i = 0; i < n_ctx; i++) cJSON_AddItemToArray(jctx, cJSON_CreateNumber(ctxs[i]));
    cJSON_AddNumberToObject(settings, "window", 128);
    cli_progress pr;
    cli_progress_begin(&pr, "bench attend", "contexts", (double)n_ctx * (sizeof shapes / sizeof shapes[0]));
    int n_done = 0;
    if (!json)
        printf("decode attention, 1 query x all heads of a layer, layers in turn; median of repeats, us per layer;\n"
               "simd %s; threads %ld (0 = default)\n"
               "%-13s %7s %6s  %-8s %10s %9s %10s %9s %9s\n",
               kvpq_simd_name(kvpq_simd_get()), threads, "shape", "ctx", "layers", "cache", "us/layer",
               "GB/s", "bytes", "vs fp32", "vs fp16");
    int rc = 0;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0] && !rc; si++) {
        const bench_shape *s = &shapes[si];
        const int d = s->head_dim, nkv = s->n_head_kv;
        const size_t row = (size_t)nkv * d;
        int max_ctx = 0;
        for (int i = 0; i < n_ctx; i++) max_ctx = ctxs[i] > max_ctx ? ctxs[i] : max_ctx;
        int L = (int)layers_opt;
        if (!L) { /* the model's layers, as many as keep the fp32 cache within 2 GiB at max_ctx */
            double per_layer = (double)max_ctx * row * 2 * 4;
            L = (int)fmin(s->n_layer, fmax(1.0, floor(2147483648.0 / per_layer)));
        }
        kvpq_codebook *cb = NULL, *cb_ne = NULL;
        kvpq_cache *caches[N_KINDS] = {0};
        float *k = NULL, *v = NULL, *q = NULL, *out = NULL;
        kvpq_status st = make_codebook(s, L, 0, &cb);
        if (st == KVPQ_OK) st = make_codebook(s, L, 1, &cb_ne);
        for (int kind = 0; kind < N_KINDS && st == KVPQ_OK; kind++) {
            kvpq_cache_params p = kvpq_cache_params_default();
            p.type = kind == K_FP32 ? KVPQ_CACHE_FP32 : kind == K_FP16 ? KVPQ_CACHE_FP16 : KVPQ_CACHE_VQ;
            p.n_layer = L;
            p.n_head = s->n_head;
            p.n_head_kv = nkv;
            p.head_dim = d;
            p.max_seq = max_ctx;
            p.window = 128;
            p.page_tokens = 256;
            p.codebook = kind == K_VQNE ? cb_ne : cb;
            p.n_threads = (int)threads;
            p.backend = KVPQ_BACKEND_CPU;
            p.vq_fast_scan = kind == K_VQFS;
            st = kvpq_cache_new(&caches[kind], &p);
        }
        const int chunk = 1024;
        k = malloc((size_t)chunk * row * sizeof(float));
        v = malloc((size_t)chunk * row * sizeof(float));
        q = malloc((size_t)s->n_head * d * sizeof(float));
        out = malloc((size_t)s->n_head * d * sizeof(float));
        if (st == KVPQ_OK && (!k || !v || !q || !out)) st = KVPQ_ERR_NOMEM;
        if (st != KVPQ_OK) {
            rc = cli_fail("bench attend (setup)", st);
        } else {
            for (int i = 0; i < s->n_head * d; i++) q[i] = gauss();
        }
        int held = 0;
        for (int ci = 0; ci < n_ctx && !rc; ci++) {
            int ctx = ctxs[ci];
            /* Grow every cache to ctx with the same tokens (contexts in increasing order reuse them). */
            if (ctx < held) {
                for (int kind = 0; kind < N_KINDS; kind++) kvpq_cache_truncate(caches[kind], 0);
                held = 0;
            }
            while (held < ctx && !rc) {
                int n = ctx - held < chunk ? ctx - held : chunk;
                for (size_t i = 0; i < (size_t)n * row; i++) {
                    k[i] = gauss();
                    v[i] = gauss();
                }
                for (int kind = 0; kind < N_KINDS && !rc; kind++)
                    for (int l = 0; l < L && !rc; l++)
                        if ((st = kvpq_cache_append(caches[kind], l, n, k, v)) != KVPQ_OK)
                            rc = cli_fail("bench attend (append)", st);
                held += n;
            }
            if (rc) break;
            double us[N_KINDS], bytes[N_KINDS];
            time_attend(caches, N_KINDS, L, q, out, (int)reps, us, &st);
            if (st != KVPQ_OK) rc = cli_fail("bench attend", st);
            for (int kind = 0; kind < N_KINDS && !rc; kind++) {
                kvpq_cache_stats cs;
                kvpq_cache_get_stats(caches[kind], &cs);
                if (kind == K_FP32) bytes[kind] = (double)ctx * row * 2 * 4;
                else if (kind == K_FP16) bytes[kind] = (double)ctx * row * 2 * 2;
                else {
                    const kvpq_pq *kq = kvpq_codebook_pq_const(cb, 0, 0), *vq = kvpq_codebook_pq_const(cb, 0, 1);
                    /* stats count every layer's tokens: one layer's share */
                    bytes[kind] = (double)cs.tokens_coded / L * nkv * (kvpq_pq_code_size(kq) + kvpq_pq_code_size(vq)) +
                                  (double)cs.tokens_window / L * row * 2 * 2 +
                                  (double)(kvpq_pq_centroids_size(kq) + kvpq_pq_centroids_size(vq)) * 4;
                    if (kind == K_VQNE) bytes[kind] += (double)cs.tokens_coded / L * nkv * 2 * 2; /* scales */
                }
            }
            if (rc) break;
            /* How far fast-scan moves the output: max |o_fs - o_exact| over all heads, beside max |o|. */
            double fs_diff = 0.0, o_max = 0.0;
            float *o2 = malloc((size_t)s->n_head * d * sizeof(float));
            if (o2 && kvpq_cache_attend(caches[K_VQ], 0, 1, q, out) == KVPQ_OK &&
                kvpq_cache_attend(caches[K_VQFS], 0, 1, q, o2) == KVPQ_OK)
                for (int i = 0; i < s->n_head * d; i++) {
                    fs_diff = fmax(fs_diff, fabs((double)o2[i] - out[i]));
                    o_max = fmax(o_max, fabs((double)out[i]));
                }
            free(o2);
            for (int kind = 0; kind < N_KINDS; kind++) {
                cJSON *jr = cJSON_CreateObject();
                cJSON_AddStringToObject(jr, "model", s->model);
                cJSON_AddNumberToObject(jr, "n_head", s->n_head);
                cJSON_AddNumberToObject(jr, "n_head_kv", nkv);
                cJSON_AddNumberToObject(jr, "head_dim", d);
                cJSON_AddNumberToObject(jr, "layers", L);
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
                    printf("%-13s %7d %6d  %-8s %10.1f %9.2f %10.0f %8.2fx %8.2fx\n", s->model, ctx, L, kind_names[kind], us[kind],
                           bytes[kind] / (us[kind] * 1e3), bytes[kind], us[K_FP32] / us[kind], us[K_FP16] / us[kind]);
            }
            if (!json) printf("%-13s %7d  fast-scan vs exact VQ output: max |diff| %.3g (max |o| %.3g)\n", s->model, ctx, fs_diff, o_max);
            cli_progress_update(&pr, ++n_done, s->model);
        }
        for (int kind = 0; kind < N_KINDS; kind++) kvpq_cache_free(caches[kind]);
        kvpq_codebook_free(cb);
        kvpq_codebook_free(cb_ne);
        free(k);
        free(v);
        free(q);
        free(out);
    }
    cli_progress_end(&pr, n_done, NULL);
    if (json && !rc) return cli_json_print(root);
    cJSON_Delete(root);
    return rc;
}
