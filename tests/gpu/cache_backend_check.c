/* cache_backend_check.c — kvpq_cache's CUDA backend (the VQ kind on the GPU through the one cache
 * API, src/cache/cache_vq_cuda.c) on a GPU machine. Registered in ctest (CUDA builds; exit 77 without
 * a device) and run by tests/gpu/run_gpu_tests.sh, also under compute-sanitizer memcheck.
 *
 * For each configuration (tensor-core and LUT attention kernels, plain and norm-explicit codebooks,
 * GQA and MHA, windows 0 / 32 / 64, 0 to 2 attention sinks, keys coded before RoPE in both layouts,
 * whole and partial), one layer pair of caches, CPU and CUDA,
 * made from the same params and codebook, gets the same K/V/q in chunks of 1 to 80 positions through
 * kvpq_cache_append_attend. Checks:
 *   cpu:   the two outputs agree to CPU_REL (relative L2 over every query whose cache view is the
 *          same on both backends: the CPU codes positions as they leave its window in batches of 32,
 *          the GPU codes them all and keeps the newest `window` in float32, so the views match when
 *          the positions past the window are a multiple of 32). K and V are float16-exact, so the
 *          CPU's fp16 window holds what the GPU's float32 one does, and both code the same inputs.
 *   read:  attention of a new query equals float64 attention over what kvpq_cache_read returns
 *          (the cache's own view: decoded codes, float32 window, sinks) to READ_REL (max-abs error
 *          over the largest output, rel_err_f64).
 *   save:  kvpq_cache_save then kvpq_cache_load (CUDA) gives the same read-back and the same
 *          attention bits; loading that file into a CPU cache is refused naming the backend.
 *   trunc: inside the window, truncate then append equals a fresh cache fed the same positions,
 *          bit for bit; below it (positions that left the float32 window come back decoded), the
 *          read check holds and kvpq_cache_exact_prefix does not call the cut exact.
 *   batch: several queries at once beyond the window are refused (KVPQ_ERR_UNSUPPORTED), naming
 *          kvpq_cache_append_attend.
 *   pool:  (kvpq_cuda_cache, device pointers) the default page pool grows on demand: a cache of 8
 *          sequences of 2^30 positions (an up-front pool: 2^25 pages, 32 TiB) is made, holds up to
 *          4 pages per sequence appended in pieces, and attends with the same bits as a cache whose
 *          explicit pool was allocated whole.
 * Fresh random inputs every run (the seed is printed; KVPQ_SEED=... replays one); KVPQ_QUICK=1
 * shortens the sequences; KVPQ_CONFIGS=PREFIX runs only the configs whose name starts with it. Exit 0 pass, 1 fail, 77 no device. */
#define _GNU_SOURCE /* mkstemp */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "fp16.h"
#include "gpu_testutil.h"

/* CPU vs GPU: the GPU's float16 centroid images and LUT entries (docs/CUDA.md: a few 1e-4 relative
 * at these lengths) plus float32 summation orders */
#define CPU_REL 3e-3
/* GPU vs float64 over its own read-back: the same kernel error terms */
#define READ_REL 3e-3

static int g_fail;

typedef struct {
    const char *name;
    const char *preset; /* key and value quantizer preset */
    int norm, head_dim, n_head, n_head_kv, window, sinks;
    int n_rot, neox;    /* keys coded before RoPE (key_rope_dims, key_rope_neox); 0: as given */
} config;

/* RoPE frequencies of a layer: base^(-2i / n_rot), layer 0 base 10^4; layer 1 base 10^6 with the
 * NeoX layout and none (keys as given) without, so both kinds of layer meet in one cache. */
static void set_rope(const config *c, kvpq_codebook *cb) {
    for (int l = 0; l < 2; l++) {
        float *f = kvpq_codebook_key_rope_freq(cb, l);
        const double base = l == 0 ? 1e4 : c->neox ? 1e6 : 0.0;
        for (int i = 0; i < c->n_rot / 2; i++) f[i] = base > 0 ? (float)pow(base, -2.0 * i / c->n_rot) : 0.f;
    }
}

/* A 2-layer codebook: d4b8 keys as given from tests/cache_testutil.h (trained on N(0, 1), directions
 * with norm), other presets with random N(0, 1) centroids; lambda in [0.5, 2), mu in [-0.5, 0.5). */
static kvpq_codebook *make_codebook(const config *c, uint64_t seed) {
    if (!strcmp(c->preset, "d4b8") && !c->n_rot) {
        test_codebook_spec s = {.n_layer = 2, .n_head_kv = c->n_head_kv, .head_dim = c->head_dim, .norm = c->norm,
                                .seed = seed, .seed_step = 1, .scale = 1.f, .train_points = -1, .smooth = 1};
        return test_codebook(&s);
    }
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = 2;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    p.key_norm = p.value_norm = c->norm;
    p.key_rope_dims = c->n_rot;
    p.key_rope_neox = c->neox;
    KV_OK(kvpq_pq_params_preset(&p.key, c->preset, c->head_dim));
    KV_OK(kvpq_pq_params_preset(&p.value, c->preset, c->head_dim));
    kvpq_codebook *cb = NULL;
    KV_OK(kvpq_codebook_new(&cb, &p));
    for (int l = 0; l < 2; l++) {
        for (int w = 0; w < 2; w++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb, l, w);
            const size_t n = kvpq_pq_centroids_size(pq);
            float *x = rand_vec(n, seed + (uint64_t)(2 * l + w), 1.f);
            KV_OK(kvpq_pq_set_centroids(pq, x, n));
            free(x);
        }
        float *lam = kvpq_codebook_key_smooth(cb, l), *mu = kvpq_codebook_key_mean(cb, l);
        for (int i = 0; i < c->n_head_kv * c->head_dim; i++) {
            lam[i] = (float)(0.5 + 1.5 * rng_unif(&seed));
            mu[i] = (float)(rng_unif(&seed) - 0.5);
        }
    }
    if (c->n_rot) set_rope(c, cb);
    return cb;
}

static kvpq_cache *make_cache(const config *c, const kvpq_codebook *cb, int max_seq, kvpq_backend b) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = 2;
    p.n_head = c->n_head;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    p.max_seq = max_seq;
    p.window = c->window;
    p.sinks = c->sinks;
    p.codebook = cb;
    p.backend = b;
    kvpq_cache *cache = NULL;
    KV_OK(kvpq_cache_new(&cache, &p));
    return cache;
}

/* n x w floats N(0, scale) rounded to float16 (exact in both backends' windows) */
static float *rand_f16(size_t n, uint64_t seed, float scale) {
    float *x = rand_vec(n, seed, scale);
    for (size_t i = 0; i < n; i++) x[i] = kvpq__h2f(kvpq__f2h(x[i]));
    return x;
}

static double rel_l2(const float *a, const float *b, size_t n) {
    double num = 0.0, den = 1e-300;
    for (size_t i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += (double)b[i] * b[i];
    }
    return sqrt(num / den);
}

/* Whether the query at position p sees the same cache on both backends (see the top). */
static int same_view(const config *c, int p) {
    const int inner = p + 1 - c->sinks; /* positions the kind holds */
    if (inner <= c->window) return 1;
    return inner >= c->window + 32 && (inner - c->window) % 32 == 0;
}

/* Attention of query q (1, n_head, hd) against float64 attention over the cache's read-back. */
static double read_check(const config *c, kvpq_cache *cache, int layer, const float *q) {
    const int L = kvpq_cache_seq_len(cache, layer), hd = c->head_dim;
    const size_t kvw = (size_t)c->n_head_kv * hd, qw = (size_t)c->n_head * hd;
    float *k = malloc((size_t)L * kvw * sizeof *k), *v = malloc((size_t)L * kvw * sizeof *v);
    float *out = malloc(qw * sizeof *out);
    double *ref = malloc(qw * sizeof *ref);
    KV_OK(kvpq_cache_read(cache, layer, 0, L, k, v));
    KV_OK(kvpq_cache_attend(cache, layer, 1, q, out));
    ref_attend(L, 1, c->n_head, c->n_head_kv, hd, k, v, q, ref);
    double e = rel_err_f64(out, ref, qw);
    free(k), free(v), free(out), free(ref);
    return e;
}

/* Feed positions [0, L) to both caches in chunks, comparing the outputs of equal views. */
static void check_cpu(const config *c, kvpq_cache *cpu, kvpq_cache *gpu, int L, const float *k, const float *v,
                      const float *q) {
    const size_t kvw = (size_t)c->n_head_kv * c->head_dim, qw = (size_t)c->n_head * c->head_dim;
    float *oc = malloc((size_t)L * qw * sizeof *oc), *og = malloc((size_t)L * qw * sizeof *og);
    const int steps[] = {80, 1, 7, 1, 33, 1, 1, 16};
    for (int l = 0; l < 2; l++) {
        for (int t = 0, i = 0; t < L; i++) {
            int n = steps[i % 8];
            if (n > L - t) n = L - t;
            KV_OK(kvpq_cache_append_attend(cpu, l, n, k + t * kvw, v + t * kvw, q + t * qw, oc + t * qw));
            KV_OK(kvpq_cache_append_attend(gpu, l, n, k + t * kvw, v + t * kvw, q + t * qw, og + t * qw));
            t += n;
        }
        double num = 0.0, den = 1e-300;
        int rows = 0;
        for (int p = 0; p < L; p++) {
            if (!same_view(c, p)) continue;
            const double e = rel_l2(og + p * qw, oc + p * qw, qw);
            double nb = 0.0;
            for (size_t j = 0; j < qw; j++) nb += (double)oc[p * qw + j] * oc[p * qw + j];
            num += e * e * nb;
            den += nb;
            rows++;
        }
        const double e = sqrt(num / den);
        printf("  %s layer %d: GPU vs CPU relative L2 %.3g over %d of %d queries (tolerance %.0e)\n", c->name, l, e,
               rows, L, CPU_REL);
        CHECK(e <= CPU_REL && rows > 0, "%s layer %d: GPU vs CPU %.3g > %g", c->name, l, e, CPU_REL);
        for (size_t j = 0; j < (size_t)L * qw; j++) CHECK(isfinite(og[j]), "%s: output %zu not finite", c->name, j);
    }
    free(oc), free(og);
}

/* Save, load on the GPU and on the CPU. */
static void check_save(const config *c, const kvpq_codebook *cb, kvpq_cache *gpu, int max_seq, const float *q) {
    char path[] = "/tmp/kvpq_cache_backend_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    close(fd);
    KV_OK(kvpq_cache_save(gpu, path, "u", 1));
    kvpq_cache_params p;
    KV_OK(kvpq_cache_get_params(gpu, &p));
    p.codebook = cb;
    kvpq_cache *back = NULL;
    void *user = NULL;
    size_t ul = 0;
    KV_OK(kvpq_cache_load(&back, &p, path, &user, &ul));
    CHECK(ul == 1 && user && ((char *)user)[0] == 'u', "%s: user blob", c->name);
    free(user);
    const size_t kvw = (size_t)c->n_head_kv * c->head_dim, qw = (size_t)c->n_head * c->head_dim;
    for (int l = 0; l < 2; l++) {
        const int L = kvpq_cache_seq_len(gpu, l);
        CHECK(kvpq_cache_seq_len(back, l) == L, "%s: loaded length", c->name);
        float *a = malloc(2 * (size_t)L * kvw * sizeof *a), *b = malloc(2 * (size_t)L * kvw * sizeof *b);
        KV_OK(kvpq_cache_read(gpu, l, 0, L, a, a + L * kvw));
        KV_OK(kvpq_cache_read(back, l, 0, L, b, b + L * kvw));
        CHECK(!memcmp(a, b, 2 * (size_t)L * kvw * sizeof *a), "%s layer %d: read-back differs after load", c->name, l);
        float *o1 = malloc(qw * sizeof *o1), *o2 = malloc(qw * sizeof *o2);
        KV_OK(kvpq_cache_attend(gpu, l, 1, q, o1));
        KV_OK(kvpq_cache_attend(back, l, 1, q, o2));
        CHECK(!memcmp(o1, o2, qw * sizeof *o1), "%s layer %d: attention differs after load", c->name, l);
        free(a), free(b), free(o1), free(o2);
    }
    kvpq_cache_free(back);
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_status s = kvpq_cache_load(&back, &p, path, NULL, NULL);
    CHECK(s == KVPQ_ERR_MISMATCH && strstr(kvpq_last_error(), "cuda backend"), "%s: CPU load of a GPU file: %d %s",
          c->name, s, kvpq_last_error());
    kvpq_cache_free(back);
    unlink(path);
    (void)max_seq;
}

/* Truncation inside the window (exact) and below it (decoded positions return to the window). */
static void check_truncate(const config *c, const kvpq_codebook *cb, const float *k, const float *v, const float *k2,
                           const float *v2, const float *q, int L) {
    const size_t kvw = (size_t)c->n_head_kv * c->head_dim, qw = (size_t)c->n_head * c->head_dim;
    const int W = c->window + c->sinks;
    if (c->window > 8) { /* inside: fed W - 2, cut to W / 2, then W / 2 more from k2 */
        kvpq_cache *b = make_cache(c, cb, L, KVPQ_BACKEND_CUDA), *f = make_cache(c, cb, L, KVPQ_BACKEND_CUDA);
        const int h = W / 2;
        float *o1 = malloc(qw * sizeof *o1), *o2 = malloc(qw * sizeof *o2);
        for (int l = 0; l < 2; l++) {
            KV_OK(kvpq_cache_append(b, l, W - 2, k, v));
            KV_OK(kvpq_cache_append(f, l, h, k, v));
            KV_OK(kvpq_cache_append(f, l, h, k2, v2));
        }
        KV_OK(kvpq_cache_truncate(b, h));
        for (int l = 0; l < 2; l++) {
            KV_OK(kvpq_cache_append(b, l, h, k2, v2));
            KV_OK(kvpq_cache_attend(b, l, 1, q, o1));
            KV_OK(kvpq_cache_attend(f, l, 1, q, o2));
            CHECK(!memcmp(o1, o2, qw * sizeof *o1), "%s layer %d: truncate inside the window is not exact", c->name, l);
        }
        free(o1), free(o2);
        kvpq_cache_free(b), kvpq_cache_free(f);
    }
    kvpq_cache *a = make_cache(c, cb, L, KVPQ_BACKEND_CUDA);
    const int cut = L - c->window - 20 > W ? L - c->window - 20 : W;
    for (int l = 0; l < 2; l++) KV_OK(kvpq_cache_append(a, l, L, k, v));
    KV_OK(kvpq_cache_truncate(a, cut));
    CHECK(kvpq_cache_exact_prefix(a, cut) < cut || c->window == 0, "%s: a cut below the window called exact",
          c->name);
    for (int l = 0; l < 2; l++) {
        KV_OK(kvpq_cache_append(a, l, 10, k2, v2));
        const double e = read_check(c, a, l, q);
        printf("  %s layer %d: after truncate %d -> %d (+10): vs float64 over its read-back %.3g\n", c->name, l, L,
               cut, e);
        CHECK(e <= READ_REL, "%s layer %d: truncated cache vs read-back %.3g", c->name, l, e);
    }
    kvpq_cache_free(a);
    (void)kvw;
}

static void run_config(const config *c, uint64_t seed, int L) {
    printf("%s: head_dim %d, heads %d/%d, %s%s, window %d, sinks %d, %d positions", c->name, c->head_dim, c->n_head,
           c->n_head_kv, c->preset, c->norm ? " norm-explicit" : "", c->window, c->sinks, L);
    if (c->n_rot) printf(", keys before RoPE (%d channels, %s)", c->n_rot, c->neox ? "neox" : "norm");
    printf("\n");
    kvpq_codebook *cb = make_codebook(c, seed);
    if (!cb) {
        printf("FAIL %s: codebook: %s\n", c->name, kvpq_last_error());
        g_fail = 1;
        return;
    }
    const size_t kvw = (size_t)c->n_head_kv * c->head_dim, qw = (size_t)c->n_head * c->head_dim;
    float *k = rand_f16((size_t)L * kvw, seed + 11, 1.f), *v = rand_f16((size_t)L * kvw, seed + 12, 1.f);
    float *k2 = rand_f16((size_t)L * kvw, seed + 13, 1.f), *v2 = rand_f16((size_t)L * kvw, seed + 14, 1.f);
    float *q = rand_vec((size_t)(L + 1) * qw, seed + 15, 1.f);
    kvpq_cache *cpu = make_cache(c, cb, L + 1, KVPQ_BACKEND_CPU), *gpu = make_cache(c, cb, L + 1, KVPQ_BACKEND_CUDA);
    kvpq_cache_stats st;
    KV_OK(kvpq_cache_get_stats(gpu, &st));
    CHECK(st.backend == KVPQ_BACKEND_CUDA && st.resident_bytes > 0, "%s: stats backend %d, %zu bytes", c->name,
          st.backend, st.resident_bytes);
    check_cpu(c, cpu, gpu, L, k, v, q);
    for (int l = 0; l < 2; l++) {
        const double e = read_check(c, gpu, l, q + (size_t)L * qw);
        printf("  %s layer %d: vs float64 over its read-back %.3g (tolerance %.0e)\n", c->name, l, e, READ_REL);
        CHECK(e <= READ_REL, "%s layer %d: vs read-back %.3g", c->name, l, e);
    }
    if (c->window > 0 && L > c->window + c->sinks + 2) {
        float *o = malloc(2 * qw * sizeof *o);
        kvpq_status s = kvpq_cache_attend(gpu, 0, 2, q, o);
        CHECK(s == KVPQ_ERR_UNSUPPORTED && strstr(kvpq_last_error(), "kvpq_cache_append_attend"),
              "%s: 2 queries beyond the window: %d %s", c->name, s, kvpq_last_error());
        free(o);
    }
    check_save(c, cb, gpu, L + 1, q + (size_t)L * qw);
    check_truncate(c, cb, k, v, k2, v2, q + (size_t)L * qw, L);
    kvpq_cache_free(cpu), kvpq_cache_free(gpu);
    free(k), free(v), free(k2), free(v2), free(q);
    kvpq_codebook_free(cb);
}

/* kvpq_cuda_cache with keys before RoPE, several sequences of unequal lengths (one inside the
 * window, one of a single position: splits with no coded position) at group sizes 5..8 and 12:
 * each sequence's output against float64 attention over its read-back. */
static void check_rope_batch(uint64_t seed) {
    const struct { int n_head, n_head_kv, head_dim, neox; const char *preset; } shapes[] = {
        {5, 1, 128, 0, "d4b8"}, {14, 2, 64, 1, "d8b8"}, {16, 2, 128, 0, "d2b8"}, {12, 1, 256, 1, "d4b12"}};
    const int S = 5, lens[5] = {1, 37, 700, quick() ? 900 : 2500, 130}, max_seq = 2600, W = 64;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        const int NH = shapes[i].n_head, H = shapes[i].n_head_kv, D = shapes[i].head_dim;
        const config c = {"rope-batch", shapes[i].preset, 0, D, NH, H, W, 0, D, shapes[i].neox};
        kvpq_codebook *cb = make_codebook(&c, seed + i);
        CHECK(cb != NULL, "rope-batch: codebook: %s", kvpq_last_error());
        if (!cb) return;
        kvpq_cuda_cache_params p = kvpq_cuda_cache_params_default();
        p.n_head = NH, p.n_head_kv = H, p.head_dim = D, p.n_seq = S, p.max_seq = max_seq, p.window = W;
        p.key = kvpq_codebook_pq_const(cb, 0, 0), p.value = kvpq_codebook_pq_const(cb, 0, 1);
        p.key_smooth = kvpq_codebook_key_smooth_const(cb, 0), p.key_mean = kvpq_codebook_key_mean_const(cb, 0);
        p.key_rope_dims = D, p.key_rope_neox = shapes[i].neox, p.key_rope_pos0 = 3;
        p.key_rope_freq = kvpq_codebook_key_rope_freq_const(cb, 0);
        kvpq_cuda_cache *cc = NULL;
        KV_OK(kvpq_cuda_cache_new(&cc, &p));
        const size_t kvw = (size_t)H * D, qw = (size_t)NH * D, nkv = (size_t)max_seq * kvw;
        float *k = rand_f16(nkv, seed + 10 * i + 1, 1.f), *v = rand_f16(nkv, seed + 10 * i + 2, 1.f);
        float *q = rand_vec(S * qw, seed + 10 * i + 3, 1.f), *o = malloc(S * qw * sizeof *o);
        double *ref = malloc(qw * sizeof *ref);
        float *dk, *dv, *dq, *dout;
        CUDA_OK(cudaMalloc((void **)&dk, nkv * sizeof(float)));
        CUDA_OK(cudaMalloc((void **)&dv, nkv * sizeof(float)));
        CUDA_OK(cudaMalloc((void **)&dq, S * qw * sizeof(float)));
        CUDA_OK(cudaMalloc((void **)&dout, S * qw * sizeof(float)));
        CUDA_OK(cudaMemcpy(dk, k, nkv * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv, v, nkv * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dq, q, S * qw * sizeof(float), cudaMemcpyHostToDevice));
        for (int b = 0; b < S; b++) KV_OK(kvpq_cuda_cache_append(cc, b, lens[b], dk, dv));
        KV_OK(kvpq_cuda_cache_attend(cc, S, dq, dout));
        CUDA_OK(cudaMemcpy(o, dout, S * qw * sizeof(float), cudaMemcpyDeviceToHost));
        double worst = 0.0;
        for (int b = 0; b < S; b++) {
            KV_OK(kvpq_cuda_cache_read(cc, b, 0, lens[b], 0, dk, dv, NULL));
            CUDA_OK(cudaMemcpy(k, dk, lens[b] * kvw * sizeof(float), cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(v, dv, lens[b] * kvw * sizeof(float), cudaMemcpyDeviceToHost));
            ref_attend(lens[b], 1, NH, H, D, k, v, q + b * qw, ref);
            const double e = rel_err_f64(o + b * qw, ref, qw);
            CHECK(e <= READ_REL, "rope-batch G %d D %d seq %d (%d positions): vs read-back %.3g", NH / H, D, b, lens[b], e);
            if (e > worst) worst = e;
        }
        printf("  rope-batch: %s, heads %d/%d (group %d), head_dim %d, %s, lengths 1..%d: vs float64 over the "
               "read-back <= %.3g\n", shapes[i].preset, NH, H, NH / H, D, shapes[i].neox ? "neox" : "norm", lens[3], worst);
        cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(dout);
        kvpq_cuda_cache_free(cc);
        free(k), free(v), free(q), free(o), free(ref);
        kvpq_codebook_free(cb);
    }
}

static void check_lazy_pool(uint64_t seed) {
    const int S = 8, H = 2, NH = 8, D = 128, maxn = 1000;
    test_codebook_spec cs = {.n_layer = 1, .n_head_kv = H, .head_dim = D, .norm = 1, .seed = seed, .seed_step = 1,
                             .scale = 1.f, .train_points = -1, .smooth = 1};
    kvpq_codebook *cb = test_codebook(&cs);
    if (!cb) {
        printf("FAIL pool: codebook: %s\n", kvpq_last_error());
        g_fail = 1;
        return;
    }
    kvpq_cuda_cache_params p = kvpq_cuda_cache_params_default();
    p.n_head = NH, p.n_head_kv = H, p.head_dim = D, p.n_seq = S, p.window = 64, p.page_tokens = 256;
    p.key = kvpq_codebook_pq_const(cb, 0, 0), p.value = kvpq_codebook_pq_const(cb, 0, 1);
    p.key_smooth = kvpq_codebook_key_smooth_const(cb, 0), p.key_mean = kvpq_codebook_key_mean_const(cb, 0);
    kvpq_cuda_cache_params w = p;
    p.max_seq = 1 << 30;                    /* default pool: grows */
    w.max_seq = 4096, w.n_pages = S * 16;   /* explicit pool: allocated whole */
    size_t f0, f1, total;
    CUDA_OK(cudaMemGetInfo(&f0, &total));
    kvpq_cuda_cache *lazy = NULL, *whole = NULL;
    KV_OK(kvpq_cuda_cache_new(&lazy, &p));
    CUDA_OK(cudaMemGetInfo(&f1, &total));
    KV_OK(kvpq_cuda_cache_new(&whole, &w));
    const size_t kvw = (size_t)H * D, qw = (size_t)NH * D;
    float *k = rand_f16((size_t)maxn * kvw, seed + 1, 1.f), *v = rand_f16((size_t)maxn * kvw, seed + 2, 1.f);
    float *q = rand_vec((size_t)S * qw, seed + 3, 1.f), *o1 = malloc(S * qw * sizeof *o1), *o2 = malloc(S * qw * sizeof *o2);
    float *dk, *dv, *dq, *do1, *do2;
    CUDA_OK(cudaMalloc((void **)&dk, maxn * kvw * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dv, maxn * kvw * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dq, S * qw * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&do1, S * qw * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&do2, S * qw * sizeof(float)));
    CUDA_OK(cudaMemcpy(dk, k, maxn * kvw * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, v, maxn * kvw * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dq, q, S * qw * sizeof(float), cudaMemcpyHostToDevice));
    for (int b = 0; b < S; b++) { /* 300 .. 979 positions, in two pieces (the second crosses pages) */
        const int n = 300 + 97 * b, a = n / 3;
        for (int part = 0; part < 2; part++) {
            const int t0 = part ? a : 0, m = part ? n - a : a;
            KV_OK(kvpq_cuda_cache_append(lazy, b, m, dk + t0 * kvw, dv + t0 * kvw));
            KV_OK(kvpq_cuda_cache_append(whole, b, m, dk + t0 * kvw, dv + t0 * kvw));
        }
    }
    KV_OK(kvpq_cuda_cache_attend(lazy, S, dq, do1));
    KV_OK(kvpq_cuda_cache_attend(whole, S, dq, do2));
    CUDA_OK(cudaMemcpy(o1, do1, S * qw * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o2, do2, S * qw * sizeof(float), cudaMemcpyDeviceToHost));
    int finite = 1;
    for (size_t i = 0; i < S * qw; i++) finite &= isfinite(o1[i]) != 0;
    CHECK(finite && !memcmp(o1, o2, S * qw * sizeof *o1), "pool: a grown pool attends differently from a whole one");
    /* resident bytes count the page tables, sized by max_seq: (max_pages + 1) ints per sequence */
    const size_t tl = (size_t)S * ((size_t)(p.max_seq / 256) + 1) * sizeof(int), tw = (size_t)S * (4096 / 256 + 1) * sizeof(int);
    CHECK(kvpq_cuda_cache_resident_bytes(lazy) - tl == kvpq_cuda_cache_resident_bytes(whole) - tw,
          "pool: resident %zu vs %zu beside the page tables", kvpq_cuda_cache_resident_bytes(lazy) - tl,
          kvpq_cuda_cache_resident_bytes(whole) - tw);
    printf("pool: 8 sequences of max_seq 2^30 made with %.1f MiB of device memory (page table %.1f MiB of it); "
           "300..979 positions each attend as with a whole pool (same bits)\n",
           (double)(f0 - f1) / 1048576.0, (double)S * (p.max_seq / 256) * sizeof(int) / 1048576.0);
    cudaFree(dk), cudaFree(dv), cudaFree(dq), cudaFree(do1), cudaFree(do2);
    kvpq_cuda_cache_free(lazy), kvpq_cuda_cache_free(whole);
    free(k), free(v), free(q), free(o1), free(o2);
    kvpq_codebook_free(cb);
}

int main(void) {
    char why[256];
    if (!kvpq_cuda_available(why, sizeof why)) {
        printf("cache_backend_check: skipped: %s\n", why);
        return 77;
    }
    uint64_t seed = (uint64_t)time(NULL) * 2654435761u;
    const char *e = getenv("KVPQ_SEED");
    if (e && *e) seed = strtoull(e, NULL, 10);
    printf("cache_backend_check: seed %llu (KVPQ_SEED replays it)\n", (unsigned long long)seed);
    const int L = quick() ? 200 : 420;
    const config cfgs[] = {
        {"tc", "d4b8", 0, 128, 8, 2, 64, 0, 0, 0},   /* tensor-core kernel, GQA */
        {"tc-ne", "d4b8", 1, 64, 9, 3, 64, 1, 0, 0}, /* norm-explicit scales, one sink */
        {"lut", "d8b8", 0, 128, 4, 4, 32, 2, 0, 0},  /* LUT kernel, MHA, two sinks */
        {"lut-w0", "d2b8", 0, 64, 4, 2, 0, 1, 0, 0}, /* no window: every position from codes */
        /* keys coded before RoPE (src/cuda/rope.cu): GQA 4, norm layout, layer 1 as given */
        {"rope", "d8b8", 0, 128, 8, 2, 32, 1, 128, 0},
        /* partial rotation, NeoX layout (layer 1 another base), norm-explicit, 3 heads per KV head */
        {"rope-ne", "d2b8", 1, 64, 9, 3, 64, 2, 48, 1},
        /* head_dim 256, no window, MQA 4 */
        {"rope-w0", "d4b12", 0, 256, 4, 1, 0, 0, 256, 1},
    };
    const char *only = getenv("KVPQ_CONFIGS"); /* a name prefix: only those configs, no pool check (sanitizers) */
    for (size_t i = 0; i < sizeof cfgs / sizeof cfgs[0]; i++)
        if (!only || !strncmp(cfgs[i].name, only, strlen(only))) run_config(&cfgs[i], seed + 1000 * i, L);
    if (!only || !strncmp("rope-batch", only, strlen(only))) check_rope_batch(seed + 77);
    if (!only) check_lazy_pool(seed + 99);
    printf("cache_backend_check: %s\n", g_fail ? "FAILED" : "passed");
    return g_fail ? 1 : 0;
}
