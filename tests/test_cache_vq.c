/* test_cache_vq.c — the VQ cache: attention from codes against exact fp64 attention over the
 * cache's own dequantized keys and values (kvpq_cache_read), which isolates the lookup-table path
 * from the quantization error; the encode path against the quantizer's public API; window and page
 * edges; GQA ratios; head_dim, nbits, dsub, codebook granularity, value rotation; truncation;
 * codebook mismatches; SIMD kernels against their scalar reference. KVPQ_QUICK=1 shrinks sizes. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpq.h"
#include "cpu/vq_kernels.h"

/* Tokens encoded per window overflow (VQ_FLUSH in src/cache/cache_vq.c, documented there). */
#define FLUSH 32
/* Attention from codes vs fp64 over read(): float32 LUT sums (M terms), the online-softmax
 * rescaling and the SIMD exp (relative error < 2e-7) stay far below this; a wrong smoothing
 * factor, rotation, causal limit or merge is off by 1e-2 or more. */
#define ATTEND_TOL 2e-4

static int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && *q && strcmp(q, "0");
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}
static float grand(void) {
    double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}
static float *randn(size_t n, float scale) {
    float *x = malloc(n * sizeof(float));
    cr_assert_not_null(x);
    for (size_t i = 0; i < n; i++) x[i] = grand() * scale;
    return x;
}

typedef struct {
    int n_head, n_head_kv, head_dim;
    const char *kpreset, *vpreset;
    kvpq_codebook_granularity gran;
    int rotate;
} cfg;

/* A codebook trained on Gaussian data through the public API, with per-(head, channel) smoothing
 * factors in [0.5, 2] and key means in [-1.5, 1.5] so that a query head using the wrong KV head's
 * factors shows, and so does a coded score that misses the q . mu the centering removed. */
static kvpq_codebook *make_codebook_m(int n_layer, const cfg *c, const int *key_M);
static kvpq_codebook *make_codebook(int n_layer, const cfg *c) { return make_codebook_m(n_layer, c, NULL); }

/* Norm-explicit quantizers of the codebooks make_codebook builds: bit 0 keys, bit 1 values. */
static int g_norm = 0;
/* 8: the codebooks make_codebook builds get k.norm_bits / v.norm_bits = "8" (8-bit scales). */
static int g_norm_bits = 16;
/* (n_layer) each layer's value M for the codebooks make_codebook builds, or NULL (c->vpreset's). */
static const int *g_value_M = NULL;
/* Preset of a residual second key stage for the codebooks make_codebook builds, or NULL (one stage). */
static const char *g_key2 = NULL;
/* (n_layer) each layer's key stages (with g_key2), or NULL (two everywhere). */
static const int *g_key_stages = NULL;

/* key_M: (n_layer) each layer's key M (per-layer bit allocation), or NULL for c->kpreset's. */
static kvpq_codebook *make_codebook_m(int n_layer, const cfg *c, const int *key_M) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = n_layer;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    cr_assert_eq(kvpq_pq_params_preset(&p.key, c->kpreset, c->head_dim), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_params_preset(&p.value, c->vpreset, c->head_dim), KVPQ_OK, "%s", kvpq_last_error());
    p.key.granularity = p.value.granularity = c->gran;
    p.value_rotate = c->rotate;
    p.key_norm = g_norm & 1;
    p.value_norm = (g_norm >> 1) & 1;
    if (g_key2) {
        p.key_stages = 2;
        cr_assert_eq(kvpq_pq_params_preset(&p.key2, g_key2, c->head_dim), KVPQ_OK, "%s", kvpq_last_error());
        p.key2.granularity = c->gran;
    }
    kvpq_codebook *cb = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK, "%s", kvpq_last_error());
    if (g_norm_bits == 8) {
        cr_assert_eq(kvpq_codebook_set_meta(cb, "k.norm_bits", "8"), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_set_meta(cb, "v.norm_bits", "8"), KVPQ_OK, "%s", kvpq_last_error());
    }
    for (int l = 0; key_M && l < n_layer; l++)
        cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, l, key_M[l]), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; g_key_stages && l < n_layer; l++)
        cr_assert_eq(kvpq_codebook_set_layer_key_stages(cb, l, g_key_stages[l]), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; g_value_M && l < n_layer; l++)
        cr_assert_eq(kvpq_codebook_set_layer_value_M(cb, l, g_value_M[l]), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 2;
    kp.max_points_per_centroid = 2;
    kp.n_threads = 1;
    for (int l = 0; l < n_layer; l++) {
        for (int w = 0; w < 3; w++) {
            /* w = 2: the stage-two key quantizer (residual VQ), trained on smaller vectors */
            kvpq_pq *pq = w == 2 ? kvpq_codebook_key_pq2(cb, l) : kvpq_codebook_pq(cb, l, w);
            if (!pq) continue;
            kvpq_pq_params pp = kvpq_pq_get_params(pq);
            int ksub = 1 << pp.nbits;
            if (pp.nbits > 8) {
                /* 4096 centroids: k-means would dominate the test's time; random centroids serve
                 * the table path just as well (set through the public API). */
                size_t nc = kvpq_pq_centroids_size(pq);
                float *cent = randn(nc, 1.0f);
                cr_assert_eq(kvpq_pq_set_centroids(pq, cent, nc), KVPQ_OK, "%s", kvpq_last_error());
                free(cent);
                continue;
            }
            /* Enough vectors for k-means: n*M >= ksub (shared) or n >= ksub (per sub-space). */
            /* HEAD: rows interleave the heads; each head's book needs ksub sub-vectors of its rows. */
            size_t n = pp.granularity == KVPQ_CODEBOOK_SHARED     ? (size_t)(2 * ksub + pp.M - 1) / pp.M
                       : pp.granularity == KVPQ_CODEBOOK_SUBSPACE ? (size_t)2 * ksub
                                                                  : (size_t)pp.n_head * ((2 * ksub + pp.M - 1) / pp.M);
            float *x = randn(n * pp.d, w == 2 ? 0.3f : 1.0f);
            if (w < 2 && ((g_norm >> w) & 1)) /* norm-explicit: trained on directions, as kvpq calibrate does */
                cr_assert_eq(kvpq_normalize_rows(x, n, pp.d, NULL), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_pq_train(pq, &kp, n, x, NULL), KVPQ_OK, "%s", kvpq_last_error());
            free(x);
        }
        float *lam = kvpq_codebook_key_smooth(cb, l);
        for (int i = 0; i < c->n_head_kv * c->head_dim; i++) lam[i] = (float)(0.5 + 1.5 * urand());
        float *mu = kvpq_codebook_key_mean(cb, l);
        for (int i = 0; i < c->n_head_kv * c->head_dim; i++) mu[i] = (float)(3.0 * urand() - 1.5);
    }
    return cb;
}

static kvpq_cache *make_cache(const kvpq_codebook *cb, int n_layer, const cfg *c, int window, int page_tokens,
                              int max_seq) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = n_layer;
    p.n_head = c->n_head;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    p.max_seq = max_seq;
    p.window = window;
    p.page_tokens = page_tokens;
    p.codebook = cb;
    p.n_threads = 2;
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *cache = NULL;
    cr_assert_eq(kvpq_cache_new(&cache, &p), KVPQ_OK, "%s", kvpq_last_error());
    return cache;
}

/* Exact causal attention in fp64 over k, v (len, n_head_kv, d) for queries q (n_q, n_head, d) at
 * positions len - n_q + i; returns the largest |out - ref|. */
static double max_err_vs_fp64(int len, int n_q, int n_head, int n_head_kv, int d, const float *q, const float *k,
                              const float *v, const float *out) {
    double err = 0.0, *s = malloc((size_t)len * sizeof(double)), *o = malloc((size_t)d * sizeof(double));
    int G = n_head / n_head_kv;
    for (int i = 0; i < n_q; i++) {
        int pos = len - n_q + i;
        for (int h = 0; h < n_head; h++) {
            const float *qh = q + ((size_t)i * n_head + h) * d;
            int kv = h / G;
            double mx = -INFINITY, sum = 0.0;
            for (int t = 0; t <= pos; t++) {
                double a = 0.0;
                for (int j = 0; j < d; j++) a += (double)qh[j] * k[((size_t)t * n_head_kv + kv) * d + j];
                s[t] = a / sqrt((double)d);
                if (s[t] > mx) mx = s[t];
            }
            for (int j = 0; j < d; j++) o[j] = 0.0;
            for (int t = 0; t <= pos; t++) {
                double p = exp(s[t] - mx);
                sum += p;
                for (int j = 0; j < d; j++) o[j] += p * v[((size_t)t * n_head_kv + kv) * d + j];
            }
            for (int j = 0; j < d; j++) {
                double e = fabs(o[j] / sum - out[((size_t)i * n_head + h) * d + j]);
                if (e > err || isnan(e)) err = isnan(e) ? INFINITY : e;
            }
        }
    }
    free(s);
    free(o);
    return err;
}

/* Attend the newest n_q positions of `layer` and compare with fp64 over read(). */
static void check_attend_layer(kvpq_cache *cache, const cfg *c, int layer, int n_q, const char *what) {
    int len = kvpq_cache_seq_len(cache, layer), d = c->head_dim;
    size_t kvn = (size_t)len * c->n_head_kv * d;
    float *kh = malloc(kvn * sizeof(float) + 1), *vh = malloc(kvn * sizeof(float) + 1);
    cr_assert_eq(kvpq_cache_read(cache, layer, 0, len, kh, vh), KVPQ_OK, "%s", kvpq_last_error());
    float *q = randn((size_t)n_q * c->n_head * d, 2.0f);
    float *out = malloc((size_t)n_q * c->n_head * d * sizeof(float));
    cr_assert_eq(kvpq_cache_attend(cache, layer, n_q, q, out), KVPQ_OK, "%s", kvpq_last_error());
    double err = max_err_vs_fp64(len, n_q, c->n_head, c->n_head_kv, d, q, kh, vh, out);
    cr_assert(err <= ATTEND_TOL,
              "%s: layer %d len %d n_q %d (heads %d/%d d %d k %s v %s gran %d rot %d simd %s): max error %g", what,
              layer, len, n_q, c->n_head, c->n_head_kv, d, c->kpreset, c->vpreset, (int)c->gran, c->rotate,
              kvpq_simd_name(kvpq_simd_get()), err);
    free(kh);
    free(vh);
    free(q);
    free(out);
}

static void check_attend(kvpq_cache *cache, const cfg *c, int n_q, const char *what) {
    check_attend_layer(cache, c, 0, n_q, what);
}

static void append_random(kvpq_cache *cache, int layer, const cfg *c, int n, float **keep_k, float **keep_v) {
    size_t sz = (size_t)n * c->n_head_kv * c->head_dim;
    float *k = randn(sz, 1.0f), *v = randn(sz, 1.0f);
    /* Outlier channels in the keys, as in real models (what smoothing is for). */
    for (int t = 0; t < n; t++)
        for (int h = 0; h < c->n_head_kv; h++) k[((size_t)t * c->n_head_kv + h) * c->head_dim + 3] *= 8.0f;
    cr_assert_eq(kvpq_cache_append(cache, layer, n, k, v), KVPQ_OK, "%s", kvpq_last_error());
    if (keep_k) *keep_k = k; else free(k);
    if (keep_v) *keep_v = v; else free(v);
}

static int expected_coded(int len, int window) { return len < window + FLUSH ? 0 : (len - window) / FLUSH * FLUSH; }

// ---- attention from codes vs fp64 ----------------------------------------------------------------

static void run_config_layers(const cfg *c, int len, int window, int page_tokens, int n_layer, const int *key_M);
static void run_config(const cfg *c, int len, int window, int page_tokens) {
    run_config_layers(c, len, window, page_tokens, 1, NULL);
}

/* n_layer layers with key M key_M[l] (NULL: c->kpreset's everywhere); every layer is filled and
 * attended at each step. */
static void run_config_layers(const cfg *c, int len, int window, int page_tokens, int n_layer, const int *key_M) {
    kvpq_codebook *cb = make_codebook_m(n_layer, c, key_M);
    kvpq_cache *cache = make_cache(cb, n_layer, c, window, page_tokens, len + 64);
    /* Prefill in uneven chunks, attending each chunk causally, then decode steps. */
    int done = 0, chunk = 0;
    while (done < len - 3) {
        int n = 37 + 53 * (chunk++ % 3);
        if (n > len - 3 - done) n = len - 3 - done;
        for (int l = 0; l < n_layer; l++) append_random(cache, l, c, n, NULL, NULL);
        done += n;
        /* 8 queries attend through lookup tables, 24 (every other chunk) densely to decoded rows */
        const int nq = chunk % 2 ? (n < 24 ? n : 24) : (n < 8 ? n : 8);
        for (int l = 0; l < n_layer; l++) check_attend_layer(cache, c, l, nq, nq >= 16 ? "dense prefill" : "prefill");
    }
    for (; done < len; done++)
        for (int l = 0; l < n_layer; l++) {
            append_random(cache, l, c, 1, NULL, NULL);
            check_attend_layer(cache, c, l, 1, "decode");
        }
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(cache, &st), KVPQ_OK);
    cr_assert_eq(st.tokens_coded, (int64_t)n_layer * expected_coded(len, window));
    cr_assert_eq(st.tokens_window, (int64_t)n_layer * (len - expected_coded(len, window)));
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* At every SIMD level (the kernels are also checked one by one against *_ref below). */
static void for_each_simd(const cfg *c, int len, int window, int page_tokens) {
    kvpq_simd_level best = kvpq_simd_get();
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
        run_config(c, len, window, page_tokens);
    }
    kvpq_simd_set(best);
}

Test(cache_vq, gqa_ratios_match_fp64) {
    const int ratios[][2] = {{4, 4}, {9, 3}, {8, 2}, {16, 2}, {16, 1}, {6, 3}};
    int len = quick() ? 300 : 600;
    for (size_t i = 0; i < sizeof ratios / sizeof ratios[0]; i++) {
        cfg c = {ratios[i][0], ratios[i][1], 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
        if (i == 1 || i == 3) for_each_simd(&c, len, 64, 96);
        else run_config(&c, len, 64, 96);
    }
}

/* Long enough that decode splits each head's coded context across the 2 threads (>= 512 tokens
 * per split), so the split partial states are merged. */
Test(cache_vq, split_context_matches_fp64) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 1};
    run_config(&c, quick() ? 1300 : 2100, 64, 256);
    cfg c2 = {8, 1, 128, "d4b8", "d8b8", KVPQ_CODEBOOK_SHARED, 0};
    run_config(&c2, quick() ? 1300 : 2100, 128, 200);
}

Test(cache_vq, head_dims_match_fp64) {
    const int dims[] = {64, 128, 256};
    int len = quick() ? 250 : 500;
    for (size_t i = 0; i < 3; i++) {
        cfg c = {8, 2, dims[i], "d4b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 1};
        if (i == 1) for_each_simd(&c, len, 32, 64);
        else run_config(&c, len, 32, 64);
    }
}

Test(cache_vq, nbits_dsub_granularity_rotation_match_fp64) {
    const char *presets[][2] = {{"d8b12", "d8b12"}, {"d2b8", "d8b8"}, {"d8b8", "d2b8"}, {"d4b8", "d8b12"},
                                {"d1b8", "d4b12"}, {"d4b12", "d1b8"}};
    int len = quick() ? 200 : 400;
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        for (int gran = 0; gran < 2; gran++)
            for (int rot = 0; rot < 2; rot++) {
                if (quick() && (gran + rot) % 2) continue;
                cfg c = {6, 2, 64, presets[i][0], presets[i][1], (kvpq_codebook_granularity)gran, rot};
                run_config(&c, len, 48, 80);
            }
}

// ---- encode path, window and page edges ----------------------------------------------------------

/* read() of coded positions equals the quantizer's own reconstruction through the public API:
 * lambda * H(decode(encode(H((fp16(k) - mu) / lambda)))) + mu for keys, H(decode(encode(H v))) for
 * values. */
Test(cache_vq, read_equals_public_reconstruction) {
    cfg c = {9, 3, 64, "d4b8", "d2b8", KVPQ_CODEBOOK_SUBSPACE, 1};
    kvpq_codebook *cb = make_codebook(2, &c);
    const int W = 16, len = 200, d = 64, nkv = 3;
    kvpq_cache *cache = make_cache(cb, 2, &c, W, 48, 256);
    float *k, *v;
    append_random(cache, 1, &c, len, &k, &v);
    int nc = expected_coded(len, W);
    size_t row = (size_t)nkv * d, tot = (size_t)len * row;
    float *kh = malloc(tot * sizeof(float)), *vh = malloc(tot * sizeof(float));
    cr_assert_eq(kvpq_cache_read(cache, 1, 0, len, kh, vh), KVPQ_OK, "%s", kvpq_last_error());
    const kvpq_pq *kq = kvpq_codebook_pq_const(cb, 1, 0), *vq = kvpq_codebook_pq_const(cb, 1, 1);
    const float *lam = kvpq_codebook_key_smooth_const(cb, 1), *mu = kvpq_codebook_key_mean_const(cb, 1);
    float *x = malloc(tot * sizeof(float)), *y = malloc(tot * sizeof(float));
    uint8_t *codes = malloc((size_t)len * nkv * 64);
    for (int w = 0; w < 2; w++) {
        const float *src = w ? v : k;
        for (size_t i = 0; i < tot; i++) {
            /* fp16 rounding through the public fp16 cache would need another cache; use the
             * round trip the window applies: the F16C/IEEE round-to-nearest-even. */
            x[i] = src[i];
        }
        const kvpq_vq_kernels *K = kvpq__vq_kernels(KVPQ_SIMD_SCALAR);
        uint16_t *h = malloc(tot * sizeof(uint16_t));
        K->f32_to_f16(tot, x, h);
        K->f16_to_f32(tot, h, x);
        free(h);
        /* Window positions come back as the fp16-rounded input, exactly. */
        for (size_t i = (size_t)nc * row; i < tot; i++)
            cr_assert_eq((w ? vh : kh)[i], x[i], "%s window element %zu", w ? "v" : "k", i);
        if (!w)
            for (size_t i = 0; i < tot; i++) x[i] = (x[i] - mu[i % row]) / lam[i % row];
        if (!w || c.rotate) kvpq_hadamard(x, (size_t)len * nkv, d);
        cr_assert_eq(kvpq_pq_encode(w ? vq : kq, (size_t)nc * nkv, x, codes), KVPQ_OK);
        cr_assert_eq(kvpq_pq_decode(w ? vq : kq, (size_t)nc * nkv, codes, y), KVPQ_OK);
        if (!w || c.rotate) kvpq_hadamard(y, (size_t)nc * nkv, d);
        for (size_t i = 0; i < (size_t)nc * row; i++) {
            float want = w ? y[i] : y[i] * lam[i % row] + mu[i % row];
            cr_assert_float_eq((w ? vh : kh)[i], want, 1e-5f * (1.0f + fabsf(want)), "%s coded element %zu: %g vs %g",
                               w ? "v" : "k", i, (double)(w ? vh : kh)[i], (double)want);
        }
    }
    /* Layer 0 is untouched. */
    cr_assert_eq(kvpq_cache_seq_len(cache, 0), 0);
    free(x);
    free(y);
    free(codes);
    free(k);
    free(v);
    free(kh);
    free(vh);
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* Lengths around the window and page edges: token-by-token appends give the same cache (read()
 * bit for bit, stats) as one append, and attention matches fp64 at each length. */
Test(cache_vq, window_and_page_edges) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    kvpq_codebook *cb = make_codebook(1, &c);
    const int W = 40, PT = 16;
    const int lens[] = {0, 1, W - 1, W, W + 1, W + FLUSH - 1, W + FLUSH, W + FLUSH + 1, W + 2 * FLUSH + PT,
                        W + 3 * FLUSH, W + 3 * FLUSH + 1};
    size_t row = (size_t)c.n_head_kv * c.head_dim;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        int len = lens[li];
        kvpq_cache *a = make_cache(cb, 1, &c, W, PT, 512), *b = make_cache(cb, 1, &c, W, PT, 512);
        float *k = randn((size_t)len * row + 1, 1.0f), *v = randn((size_t)len * row + 1, 1.0f);
        if (len) cr_assert_eq(kvpq_cache_append(a, 0, len, k, v), KVPQ_OK, "%s", kvpq_last_error());
        for (int t = 0; t < len; t++)
            cr_assert_eq(kvpq_cache_append(b, 0, 1, k + t * row, v + t * row), KVPQ_OK, "%s", kvpq_last_error());
        kvpq_cache_stats sa, sb;
        kvpq_cache_get_stats(a, &sa);
        kvpq_cache_get_stats(b, &sb);
        cr_assert_eq(sa.tokens_coded, expected_coded(len, W), "len %d", len);
        cr_assert_eq(sa.tokens_coded + sa.tokens_window, len);
        cr_assert(sa.tokens_window >= (len < W ? len : W), "len %d: the newest W tokens stay in full precision", len);
        cr_assert_eq(sb.tokens_coded, sa.tokens_coded);
        cr_assert_eq(sa.resident_bytes, sb.resident_bytes);
        float *ka = malloc((size_t)len * row * 4 + 4), *kb = malloc((size_t)len * row * 4 + 4);
        float *va = malloc((size_t)len * row * 4 + 4), *vb = malloc((size_t)len * row * 4 + 4);
        cr_assert_eq(kvpq_cache_read(a, 0, 0, len, ka, va), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(b, 0, 0, len, kb, vb), KVPQ_OK);
        cr_assert(!memcmp(ka, kb, (size_t)len * row * 4) && !memcmp(va, vb, (size_t)len * row * 4), "len %d", len);
        /* A read of a sub-range crossing the coded/window edge equals the slice of the full read. */
        if (len > 2) {
            int p0 = len / 3, n = len - len / 3 - 1;
            float *ks = malloc((size_t)n * row * 4);
            cr_assert_eq(kvpq_cache_read(a, 0, p0, n, ks, NULL), KVPQ_OK);
            cr_assert(!memcmp(ks, ka + p0 * row, (size_t)n * row * 4));
            free(ks);
        }
        if (len > 0) {
            check_attend(a, &c, 1, "edge decode");
            check_attend(a, &c, len < 7 ? len : 7, "edge prefill");
        }
        free(ka);
        free(kb);
        free(va);
        free(vb);
        free(k);
        free(v);
        kvpq_cache_free(a);
        kvpq_cache_free(b);
    }
    kvpq_codebook_free(cb);
}

/* Per-layer key bit allocation: layers with different key M (dsub 4, 2, 8, 1 / 8, 4, 16) in one
 * cache, each attended from its own codes and compared with fp64 over its own read-back. A layer
 * using another layer's code size, page offsets or LUT shape would read the wrong codes. */
Test(cache_vq, mixed_key_M_match_fp64) {
    int len = quick() ? 200 : 400;
    const int m8[] = {16, 32, 8, 64};
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    kvpq_simd_level best = kvpq_simd_get();
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
        run_config_layers(&c, len, 48, 80, 4, m8);
    }
    kvpq_simd_set(best);
    /* 12-bit codes (unpacked path), per-sub-space books, unrotated values. */
    const int m12[] = {8, 16, 4};
    cfg c12 = {8, 2, 64, "d8b12", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 0};
    run_config_layers(&c12, len, 32, 64, 3, m12);
}

/* Fast-scan with mixed key M: each layer's 8-bit LUT has its own M; the outputs stay within the
 * fast-scan error of the exact cache's over the same codes (and are not identical: quantized). */
Test(cache_vq, mixed_key_M_fast_scan) {
    const int M[] = {16, 64, 32}, n_layer = 3, len = 300;
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    kvpq_codebook *cb = make_codebook_m(n_layer, &c, M);
    kvpq_cache *ex = make_cache(cb, n_layer, &c, 32, 64, 512);
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = n_layer;
    p.n_head = c.n_head;
    p.n_head_kv = c.n_head_kv;
    p.head_dim = c.head_dim;
    p.max_seq = 512;
    p.window = 32;
    p.page_tokens = 64;
    p.codebook = cb;
    p.n_threads = 2;
    p.backend = KVPQ_BACKEND_CPU;
    p.vq_fast_scan = 1;
    kvpq_cache *fs = NULL;
    cr_assert_eq(kvpq_cache_new(&fs, &p), KVPQ_OK, "%s", kvpq_last_error());
    const size_t nq = (size_t)4 * c.n_head * c.head_dim;
    float *q = randn(nq, 2.0f), *o1 = malloc(nq * 4), *o2 = malloc(nq * 4);
    for (int l = 0; l < n_layer; l++) {
        float *k, *v;
        append_random(ex, l, &c, len, &k, &v);
        cr_assert_eq(kvpq_cache_append(fs, l, len, k, v), KVPQ_OK, "%s", kvpq_last_error());
        free(k);
        free(v);
        cr_assert_eq(kvpq_cache_attend(ex, l, 4, q, o1), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_attend(fs, l, 4, q, o2), KVPQ_OK, "%s", kvpq_last_error());
        double err = 0.0;
        for (size_t i = 0; i < nq; i++) err = fmax(err, fabs((double)o1[i] - o2[i]));
        cr_assert(err > 0.0 && err < 0.2, "layer %d (key M %d): fast-scan vs exact max difference %g", l, M[l], err);
    }
    free(q);
    free(o1);
    free(o2);
    kvpq_cache_free(ex);
    kvpq_cache_free(fs);
    kvpq_codebook_free(cb);
}

/* resident_bytes and bits_per_element with per-layer key code sizes: layer 0 keys M = 16 (16-byte
 * codes), layer 1 M = 32 (32 bytes), values M = 16 in both. */
Test(cache_vq, mixed_key_M_resident_bytes) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    const int n_layer = 2, W = 32, PT = 64, d = 64, nkv = 3, M[] = {16, 32};
    kvpq_codebook *cb = make_codebook_m(n_layer, &c, M);
    kvpq_cache *cache = make_cache(cb, n_layer, &c, W, PT, 1024);
    /* Key books: (256, 4) and (256, 2) floats; value books (256, 4) each. */
    size_t books = (256 * 4 + 256 * 2 + 2 * 256 * 4) * 4 + n_layer * 2 * (size_t)nkv * d * 4;
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books);
    size_t ring = 2 * (size_t)(W + FLUSH) * nkv * d * 2;
    size_t page0 = (size_t)nkv * PT * (16 + 16), page1 = (size_t)nkv * PT * (32 + 16);
    append_random(cache, 0, &c, W + 2 * FLUSH, NULL, NULL); /* 64 coded: one page */
    append_random(cache, 1, &c, W + 3 * FLUSH, NULL, NULL); /* 96 coded: two pages */
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books + 2 * ring + page0 + 2 * page1);
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(cache, &st), KVPQ_OK);
    cr_assert_eq(st.tokens_coded, 64 + 96);
    double elems = 2.0 * (W + 2 * FLUSH + W + 3 * FLUSH) * nkv * d;
    cr_assert_float_eq(st.bits_per_element, (double)(books + 2 * ring + page0 + 2 * page1) * 8 / elems, 1e-12);
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* resident_bytes: codebooks, smoothing factors and key means once, fp16 window ring of (window + FLUSH) slots per
 * layer once written, and whole pages of codes. */
Test(cache_vq, resident_bytes_accounting) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    const int n_layer = 2, W = 32, PT = 64, d = 64, nkv = 3;
    kvpq_codebook *cb = make_codebook(n_layer, &c);
    kvpq_cache *cache = make_cache(cb, n_layer, &c, W, PT, 1024);
    size_t books = 0;
    for (int l = 0; l < n_layer; l++)
        books += (kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, l, 0)) +
                  kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, l, 1))) * 4 + 2 * (size_t)nkv * d * 4;
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books);
    size_t ring = 2 * (size_t)(W + FLUSH) * nkv * d * 2, page = (size_t)nkv * PT * (16 + 16);
    append_random(cache, 0, &c, W + FLUSH, NULL, NULL); /* 32 coded: one page */
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books + ring + page);
    append_random(cache, 0, &c, 2 * FLUSH, NULL, NULL); /* 96 coded: two pages */
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books + ring + 2 * page);
    kvpq_cache_stats st;
    kvpq_cache_get_stats(cache, &st);
    cr_assert_eq(st.tokens_coded, 96);
    cr_assert_eq(st.tokens_window, W);
    cr_assert_eq(kvpq_cache_truncate(cache, 50), KVPQ_OK);
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books + ring + page);
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* One layer with norm-explicit keys and values and norm_bits-bit scales (8 or 16), as make_codebook builds. */
static kvpq_codebook *make_norm_codebook(const cfg *c, int norm_bits) {
    g_norm = 3;
    g_norm_bits = norm_bits;
    kvpq_codebook *cb = make_codebook(1, c);
    g_norm = 0;
    g_norm_bits = 16;
    return cb;
}

// ---- norm-explicit quantizers (a float16 scale per vector) ----------------------------------------

/* Attention from codes with per-vector key and/or value scales equals exact attention over read()
 * (which applies the scales), over GQA ratios, head_dim 64/128/256, nbits 8 and 12, shared and
 * sub-space codebooks, value rotation, at every SIMD level for one shape. */
Test(cache_vq, norm_explicit_matches_fp64) {
    const cfg cs[] = {
        {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0},
        {32, 8, 128, "d4b8", "d2b8", KVPQ_CODEBOOK_SHARED, 1},
        {4, 4, 256, "d8b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 0},
        {8, 2, 64, "d8b12", "d8b12", KVPQ_CODEBOOK_SHARED, 1},
    };
    const int len = quick() ? 260 : 420;
    for (int f = 1; f < 4; f++) {
        g_norm = f;
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) run_config(&cs[i], len, 32, 64);
    }
    g_norm = 3;
    for_each_simd(&cs[0], len, 32, 48);
    /* Per-layer key M (4-bit keys in layer 1) with scales; odd code sizes (nbits 12, M 8: 12 bytes;
     * d8b8 values: 8 bytes) and a page size that is not a multiple of 4. */
    const int key_M[3] = {16, 32, 16};
    run_config_layers(&cs[0], len, 32, 33, 3, key_M);
    run_config(&cs[3], len, 16, 33);
    g_norm = 0;
}

/* Head granularity and two key stages: attention from codes within 2e-4 of exact fp64 attention
 * over what read() decodes (the two stages' reconstruction r1 + r2; each head's own books), for
 * GQA groups 3 and 1, both dsub mixes, nbits 8 and 12 (the unpacked-index path), with and without
 * norm-explicit scales, at every SIMD level for one shape; fast-scan over the joined tables too. */
Test(cache_vq, head_granularity_and_two_stage_keys_match_fp64) {
    const int len = quick() ? 230 : 380;
    struct { cfg c; const char *k2; } cs[] = {
        {{9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_HEAD, 0}, NULL},
        {{8, 2, 128, "d8b8", "d2b8", KVPQ_CODEBOOK_HEAD, 1}, NULL},
        {{9, 3, 64, "d8b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0}, "d8b8"},
        {{6, 2, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 1}, "d8b8"},
        {{9, 3, 64, "d4b8", "d8b8", KVPQ_CODEBOOK_HEAD, 0}, "d8b8"},
        {{4, 4, 64, "d8b12", "d8b12", KVPQ_CODEBOOK_SHARED, 0}, "d8b12"},
    };
    for (int f = 0; f < 4; f += 3)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            g_norm = f;
            g_key2 = cs[i].k2;
            if (i == 4) for_each_simd(&cs[i].c, len, 32, 48);
            else run_config(&cs[i].c, len, 32, 48);
            g_key2 = NULL;
        }
    /* Per-layer stages (layer 1 without stage two) beside per-layer key M: each layer's code size
     * and table rows are its own. */
    const int stages[3] = {2, 1, 2}, key_M[3] = {8, 16, 16};
    g_key2 = "d8b8";
    g_key_stages = stages;
    for (int f = 0; f < 4; f += 3) {
        g_norm = f;
        run_config_layers(&cs[2].c, len, 32, 40, 3, key_M);
    }
    g_key_stages = NULL;
    g_key2 = NULL;
    g_norm = 0;
    /* fast-scan scores over the joined (M1 + M2) tables: within its own bound, so only checked to run
     * and give finite output close to the exact path. */
    cfg c = {9, 3, 64, "d8b8", "d4b8", KVPQ_CODEBOOK_HEAD, 0};
    g_key2 = "d8b8";
    kvpq_codebook *cb = make_codebook(1, &c);
    g_key2 = NULL;
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = 1;
    p.n_head = 9;
    p.n_head_kv = 3;
    p.head_dim = 64;
    p.max_seq = 512;
    p.window = 16;
    p.codebook = cb;
    p.n_threads = 1;
    kvpq_cache *a, *b;
    cr_assert_eq(kvpq_cache_new(&a, &p), KVPQ_OK, "%s", kvpq_last_error());
    p.vq_fast_scan = 1;
    cr_assert_eq(kvpq_cache_new(&b, &p), KVPQ_OK, "%s", kvpq_last_error());
    float *k, *v;
    append_random(a, 0, &c, 300, &k, &v);
    cr_assert_eq(kvpq_cache_append(b, 0, 300, k, v), KVPQ_OK);
    float *q = randn(9 * 64, 1.0f), oa[9 * 64], ob[9 * 64];
    cr_assert_eq(kvpq_cache_attend(a, 0, 1, q, oa), KVPQ_OK);
    cr_assert_eq(kvpq_cache_attend(b, 0, 1, q, ob), KVPQ_OK);
    double e = 0;
    for (int i = 0; i < 9 * 64; i++) e = fmax(e, fabs((double)oa[i] - ob[i]));
    cr_assert(e < 0.05, "fast-scan vs exact over two-stage head codes: %g", e);
    free(q);
    free(k);
    free(v);
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    kvpq_codebook_free(cb);
}

/* read() of coded keys equals a reconstruction built here from the public API alone: per KV head h,
 * a plain SHARED quantizer holding only head h's books (head granularity), and residual VQ spelled
 * out (encode, decode, subtract, encode the error with stage two, add). The heads' books differ, and
 * decoding with a neighbour head's books does not reproduce read(): a cache that used one head's
 * books for all heads fails. A second stage lowers the key reconstruction error. */
Test(cache_vq, head_books_and_two_stages_read_equals_public_reconstruction) {
    const int nkv = 3, d = 64, len = 160, W = 16;
    for (int two = 0; two < 2; two++) {
        cfg c = {9, nkv, d, "d8b8", "d4b8", KVPQ_CODEBOOK_HEAD, 0};
        g_key2 = two ? "d8b8" : NULL;
        kvpq_codebook *cb = make_codebook(1, &c);
        g_key2 = NULL;
        kvpq_cache *cache = make_cache(cb, 1, &c, W, 64, 256);
        float *k, *v;
        append_random(cache, 0, &c, len, &k, &v);
        const int nc = expected_coded(len, W);
        const size_t row = (size_t)nkv * d;
        float *kh = malloc((size_t)len * row * sizeof(float));
        cr_assert_eq(kvpq_cache_read(cache, 0, 0, len, kh, NULL), KVPQ_OK, "%s", kvpq_last_error());
        const kvpq_pq *k1 = kvpq_codebook_pq_const(cb, 0, 0), *k2 = kvpq_codebook_key_pq2_const(cb, 0);
        cr_assert_eq(kvpq_pq_get_params(k1).granularity, KVPQ_CODEBOOK_HEAD);
        cr_assert_eq(kvpq_pq_centroids_size(k1), (size_t)nkv * 256 * 8);
        const float *lam = kvpq_codebook_key_smooth_const(cb, 0), *mu = kvpq_codebook_key_mean_const(cb, 0);
        const size_t bk = 256 * 8; /* floats of one head's book (ksub 256, dsub 8) */
        for (int h = 1; h < nkv; h++)
            cr_assert_neq(memcmp(kvpq_pq_centroids(k1), kvpq_pq_centroids(k1) + h * bk, bk * sizeof(float)), 0,
                          "heads 0 and %d have the same book", h);
        double err_own = 0, err_other = 0, mse = 0;
        for (int h = 0; h < nkv; h++)
            for (int use = 0; use < 2; use++) { /* use 0: head h's books; 1: head (h + 1) % nkv's */
                const int hb = use ? (h + 1) % nkv : h;
                kvpq_pq *p1, *p2 = NULL;
                kvpq_pq_params pp = {.d = d, .M = 8, .nbits = 8, .granularity = KVPQ_CODEBOOK_SHARED};
                cr_assert_eq(kvpq_pq_new(&p1, &pp), KVPQ_OK);
                cr_assert_eq(kvpq_pq_set_centroids(p1, kvpq_pq_centroids(k1) + hb * bk, bk), KVPQ_OK);
                if (k2) {
                    cr_assert_eq(kvpq_pq_new(&p2, &pp), KVPQ_OK);
                    cr_assert_eq(kvpq_pq_set_centroids(p2, kvpq_pq_centroids(k2) + hb * bk, bk), KVPQ_OK);
                }
                for (int t = 0; t < nc; t++) {
                    float x[64], r[64], e[64], r2[64];
                    uint8_t code[8];
                    uint16_t hx[64];
                    const kvpq_vq_kernels *K = kvpq__vq_kernels(KVPQ_SIMD_SCALAR);
                    K->f32_to_f16(d, k + t * row + h * d, hx); /* the window's fp16 rounding */
                    K->f16_to_f32(d, hx, x);
                    for (int j = 0; j < d; j++) x[j] = (x[j] - mu[h * d + j]) / lam[h * d + j];
                    kvpq_hadamard(x, 1, d);
                    cr_assert_eq(kvpq_pq_encode(p1, 1, x, code), KVPQ_OK);
                    cr_assert_eq(kvpq_pq_decode(p1, 1, code, r), KVPQ_OK);
                    if (p2) {
                        for (int j = 0; j < d; j++) e[j] = x[j] - r[j];
                        cr_assert_eq(kvpq_pq_encode(p2, 1, e, code), KVPQ_OK);
                        cr_assert_eq(kvpq_pq_decode(p2, 1, code, r2), KVPQ_OK);
                        for (int j = 0; j < d; j++) r[j] += r2[j];
                    }
                    kvpq_hadamard(r, 1, d);
                    for (int j = 0; j < d; j++) {
                        const float want = r[j] * lam[h * d + j] + mu[h * d + j], got = kh[t * row + h * d + j];
                        const double de = fabs((double)got - want) / (1.0 + fabs(want));
                        if (use) err_other = fmax(err_other, de);
                        else {
                            err_own = fmax(err_own, de);
                            const double o = got - k[t * row + h * d + j];
                            mse += o * o;
                        }
                    }
                }
                kvpq_pq_free(p1);
                kvpq_pq_free(p2);
            }
        cr_assert(err_own < 1e-5, "stages %d: read() differs from head h's own reconstruction by %g", 1 + two, err_own);
        cr_assert(err_other > 1e-2, "stages %d: another head's books reproduce read() (%g)", 1 + two, err_other);
        static double mse_one;
        if (!two) mse_one = mse;
        else cr_assert(mse < 0.8 * mse_one, "two stages: key MSE %g not below one stage's %g", mse, mse_one);
        free(kh);
        free(k);
        free(v);
        kvpq_cache_free(cache);
        kvpq_codebook_free(cb);
    }
}

/* Per-layer value M (kvpq_codebook_set_layer_value_M) beside per-layer key M: every layer attends
 * within 2e-4 of fp64 attention over its decoded values (its own code size, W table or per-token
 * decode), with and without norm-explicit scales, both granularities; the page sizes follow each
 * layer's M (resident bytes from the real pages). */
Test(cache_vq, per_layer_value_M_matches_fp64) {
    const int key_M[3] = {16, 32, 8}, value_M[3] = {8, 16, 32};
    const int len = quick() ? 230 : 380;
    for (int gran = 0; gran < 2; gran++)
        for (int f = 0; f < 4; f += 3) {
            cfg c = {9, 3, 64, "d4b8", "d4b8", (kvpq_codebook_granularity)gran, gran};
            g_norm = f;
            g_value_M = value_M;
            run_config_layers(&c, len, 32, 40, 3, key_M);
            g_value_M = NULL;
        }
    g_norm = 0;
    /* The value M took effect: layer l's pages hold value codes of value_M[l] bytes. */
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    g_value_M = value_M;
    kvpq_codebook *cb = make_codebook(3, &c);
    g_value_M = NULL;
    for (int l = 0; l < 3; l++) cr_assert_eq(kvpq_codebook_layer_value_M(cb, l), value_M[l]);
    kvpq_codebook *cb0 = make_codebook(3, &c);
    kvpq_cache *a = make_cache(cb, 3, &c, 0, 64, 256), *b = make_cache(cb0, 3, &c, 0, 64, 256);
    for (int l = 0; l < 3; l++) {
        append_random(a, l, &c, 64, NULL, NULL);
        append_random(b, l, &c, 64, NULL, NULL);
    }
    /* one page of 64 tokens x 3 heads per layer; value code bytes 8+16+32 against 16*3 */
    size_t ra = kvpq_cache_resident_bytes(a), rb = kvpq_cache_resident_bytes(b);
    size_t cba = 0, cbb = 0;
    for (int l = 0; l < 3; l++) {
        cba += kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, l, 1)) * sizeof(float);
        cbb += kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb0, l, 1)) * sizeof(float);
    }
    cr_assert_eq((long long)(ra - cba) - (long long)(rb - cbb), (long long)64 * 3 * ((8 + 16 + 32) - 3 * 16),
                 "resident %zu vs %zu", ra, rb);
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    kvpq_codebook_free(cb);
    kvpq_codebook_free(cb0);
}

/* A token whose norm-explicit scale would not fit in float16 is refused when it is appended, naming
 * its position, and nothing is lost: the cache keeps working (it used to be refused only when the
 * token left the window, which then failed every later append). */
Test(cache_vq, norm_explicit_scale_beyond_fp16_is_refused_at_append) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    g_norm = 3;
    kvpq_codebook *cb = make_codebook(1, &c);
    g_norm = 0;
    kvpq_cache *a = make_cache(cb, 1, &c, 16, 32, 512);
    append_random(a, 0, &c, 40, NULL, NULL);
    const size_t row = 3 * 64;
    float *before = malloc(40 * row * 4), *after = malloc(40 * row * 4);
    cr_assert_eq(kvpq_cache_read(a, 0, 0, 40, before, NULL), KVPQ_OK);
    float *k = randn(5 * row, 1.0f), *v = randn(5 * row, 1.0f);
    for (int j = 0; j < 64; j++) v[3 * row + 64 + j] = 10000.0f; /* |v| = 80000: position 43, KV head 1 */
    cr_assert_eq(kvpq_cache_append(a, 0, 5, k, v), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "value scale of position 43, KV head 1"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(a, 0), 40);
    cr_assert_eq(kvpq_cache_read(a, 0, 0, 40, after, NULL), KVPQ_OK);
    cr_assert(!memcmp(before, after, 40 * row * 4));
    append_random(a, 0, &c, 100, NULL, NULL); /* the window overflows into codes as usual */
    cr_assert_eq(kvpq_cache_seq_len(a, 0), 140);
    check_attend(a, &c, 1, "after a refused append");
    /* A prefill block whose bad token is coded by the same call: refused by that encode, nothing stored. */
    kvpq_cache *b = make_cache(cb, 1, &c, 16, 32, 512);
    float *kb = randn(100 * row, 1.0f), *vb = randn(100 * row, 1.0f);
    for (int j = 0; j < 64; j++) vb[3 * row + j] = 10000.0f; /* position 3, KV head 0 */
    cr_assert_eq(kvpq_cache_append(b, 0, 100, kb, vb), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "value scale of position 3, KV head 0"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(b, 0), 0);
    append_random(b, 0, &c, 100, NULL, NULL);
    check_attend(b, &c, 1, "after a refused prefill");
    free(kb);
    free(vb);
    kvpq_cache_free(b);
    free(k);
    free(v);
    free(before);
    free(after);
    kvpq_cache_free(a);
    kvpq_codebook_free(cb);
}

// ---- 8-bit norm-explicit scales (k.norm_bits / v.norm_bits = "8") ------------------------------------

/* Attention from codes with 8-bit key and/or value scales equals exact attention over read() (which
 * applies the decoded scales): appends in uneven chunks, so a page's later batches use the reference
 * its first batch set; d1b8 keys (8 bits per element) keep float16 scales beside 8-bit value scales;
 * per-layer key M; a page size that is not a multiple of 4; every SIMD level for one shape. */
Test(cache_vq, norm8_matches_fp64) {
    const cfg cs[] = {
        {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0},
        {32, 8, 128, "d1b8", "d2b8", KVPQ_CODEBOOK_SHARED, 1},
        {4, 4, 256, "d8b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 0},
        {8, 2, 64, "d8b12", "d8b12", KVPQ_CODEBOOK_SHARED, 1},
    };
    const int len = quick() ? 260 : 420;
    g_norm_bits = 8;
    for (int f = 1; f < 4; f++) {
        g_norm = f;
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) run_config(&cs[i], len, 32, 64);
    }
    g_norm = 3;
    for_each_simd(&cs[0], len, 32, 48);
    const int key_M[3] = {16, 64, 8}; /* d4b8, d1b8 (float16 scales), d8b8 */
    run_config_layers(&cs[0], len, 32, 33, 3, key_M);
    run_config(&cs[3], len, 16, 33);
    /* 8-bit key scales beside float16 value scales (d1b8 values) with an odd n_head_kv * page_tokens:
     * the float16 scales must stay 2-byte aligned (UBSan in the ASan run of this test checks the loads) */
    const cfg odd = {4, 1, 64, "d4b8", "d1b8", KVPQ_CODEBOOK_SHARED, 0};
    run_config(&odd, len, 16, 33);
    g_norm = 0;
    g_norm_bits = 16;
}

/* Scales just under float16's limit (64.1k-65504 is accepted at append) stay finite: the 8-bit code
 * never takes a value that float16 rounds to infinity (2^16), in read() and in attention. */
Test(cache_vq, norm8_scales_near_fp16_max_stay_finite) {
    cfg c = {4, 2, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    kvpq_codebook *cb = make_norm_codebook(&c, 8);
    const int len = 64, d = 64, nkv = 2;
    const size_t row = (size_t)nkv * d, tot = (size_t)len * row;
    float *k = randn(tot, 1.0f), *v0 = randn(tot, 1.0f), *v = malloc(tot * sizeof(float));
    float *kh = malloc(tot * sizeof(float)), *vh = malloc(tot * sizeof(float));
    for (size_t i = 0; i < (size_t)len * nkv; i++) { /* unit value vectors */
        double n2 = 0;
        for (int j = 0; j < d; j++) n2 += (double)v0[i * d + j] * v0[i * d + j];
        for (int j = 0; j < d; j++) v0[i * d + j] /= (float)sqrt(n2);
    }
    /* the largest norm whose least-squares scales all fit float16 (the append refuses the others):
     * after a refusal, the accepted norm's largest scale is within 0.5% of 65504, above 2^15.97 */
    kvpq_cache *cache = NULL;
    int refused = 0;
    for (double norm = 64000.0; !cache && norm > 40000.0; norm *= 0.995) {
        for (size_t i = 0; i < tot; i++) v[i] = (float)(v0[i] * norm);
        cache = make_cache(cb, 1, &c, 0, 64, 256);
        if (kvpq_cache_append(cache, 0, len, k, v) != KVPQ_OK) {
            kvpq_cache_free(cache);
            cache = NULL;
            refused++;
        }
    }
    cr_assert_not_null(cache, "no norm in 40000..64000 was accepted");
    cr_assert(refused > 0, "64000 was accepted: the scales did not reach float16's edge");
    cr_assert_eq(kvpq_cache_read(cache, 0, 0, len, kh, vh), KVPQ_OK, "%s", kvpq_last_error());
    for (size_t i = 0; i < tot; i++)
        cr_assert(isfinite(vh[i]) && isfinite(kh[i]), "element %zu read back as %g / %g", i, (double)kh[i], (double)vh[i]);
    float *q = randn((size_t)c.n_head * d, 1.0f), *o = malloc((size_t)c.n_head * d * sizeof(float));
    cr_assert_eq(kvpq_cache_attend(cache, 0, 1, q, o), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < c.n_head * d; i++) cr_assert(isfinite(o[i]), "attention output %d is %g", i, (double)o[i]);
    free(q), free(o), free(kh), free(vh), free(k), free(v), free(v0);
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* read() of a norm-explicit cache equals s * decode(encode(u)) mapped back, recomputed here through
 * the public quantizer: u = x / |x| of the transformed fp16-rounded input, s = x . r / |r|^2 rounded
 * to float16 (each s is checked to be near |x|, so unscaled directions would fail); with norm8
 * (k.norm_bits = v.norm_bits = "8") s is then coded as the definition says: m = 2^round(log2 s) of
 * the first coded vector of each (page, KV head) (these random scales never leave its range, so no
 * re-basing), code = clamp(round(16 log2(s / m)) + 128, 1, 255),
 * c(s) = float16(m 2^((code - 128) / 16)) within 2.2% of s, except for d1b8 keys (more than 4 bits
 * per element: float16 kept). The resident bytes count two bytes per float16 scale, one per 8-bit
 * scale and one float reference per (page, KV head, kind) with 8-bit scales. */
static void check_norm_read_and_bytes(const char *kpreset, int norm8) {
    const int d1 = !strcmp(kpreset, "d1b8");
    cfg c = {9, 3, 64, kpreset, "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    kvpq_codebook *cb = make_norm_codebook(&c, norm8 ? 8 : 16);
    const int W = 16, PT = 48, len = 150, d = 64, nkv = 3;
    kvpq_cache *cache = make_cache(cb, 1, &c, W, PT, 256);
    float *k, *v;
    append_random(cache, 0, &c, len, &k, &v);
    const int nc = expected_coded(len, W);
    const size_t row = (size_t)nkv * d, tot = (size_t)len * row, nv = (size_t)nc * nkv;
    float *kh = malloc(tot * sizeof(float)), *vh = malloc(tot * sizeof(float));
    cr_assert_eq(kvpq_cache_read(cache, 0, 0, len, kh, vh), KVPQ_OK, "%s", kvpq_last_error());
    const float *lam = kvpq_codebook_key_smooth_const(cb, 0), *mu = kvpq_codebook_key_mean_const(cb, 0);
    const kvpq_vq_kernels *K = kvpq__vq_kernels(KVPQ_SIMD_SCALAR);
    float *x = malloc(tot * sizeof(float)), *r = malloc(tot * sizeof(float)), *sc = malloc(nv * sizeof(float));
    uint8_t *codes = malloc(nv * 64);
    uint16_t *h = malloc(tot * sizeof(uint16_t));
    for (int w = 0; w < 2; w++) {
        const int eight = norm8 && !(w == 0 && d1); /* d1b8 keys keep float16 scales */
        K->f32_to_f16(tot, w ? v : k, h);
        K->f16_to_f32(tot, h, x);
        if (!w)
            for (size_t i = 0; i < tot; i++) x[i] = (x[i] - mu[i % row]) / lam[i % row];
        kvpq_hadamard(x, (size_t)len * nkv, d);
        for (size_t i = 0; i < nv; i++) {
            double ss = 0;
            for (int j = 0; j < d; j++) ss += (double)x[i * d + j] * x[i * d + j];
            sc[i] = (float)sqrt(ss);
            for (int j = 0; j < d; j++) x[i * d + j] *= 1.0f / sc[i];
        }
        const kvpq_pq *pq = kvpq_codebook_pq_const(cb, 0, w);
        cr_assert_eq(kvpq_pq_encode(pq, nv, x, codes), KVPQ_OK);
        cr_assert_eq(kvpq_pq_decode(pq, nv, codes, r), KVPQ_OK);
        for (size_t i = 0; i < nv; i++) { /* float16 least-squares scales */
            double ur = 0, rr = 0;
            for (int j = 0; j < d; j++) {
                ur += (double)x[i * d + j] * r[i * d + j];
                rr += (double)r[i * d + j] * r[i * d + j];
            }
            cr_assert(rr > 0 && ur > 0);
            float s = (float)(sc[i] * ur / rr);
            uint16_t s16;
            K->f32_to_f16(1, &s, &s16);
            K->f16_to_f32(1, &s16, &s);
            cr_assert(s > 0.5f * sc[i] && s < 2.0f * sc[i], "scale %g vs norm %g", (double)s, (double)sc[i]);
            sc[i] = s;
        }
        for (int hh = 0; eight && hh < nkv; hh++)
            for (int p0 = 0; p0 < nc; p0 += PT) { /* the reference of (page, head), then the codes */
                const int p1 = p0 + PT < nc ? p0 + PT : nc;
                const double m = ldexp(1.0, (int)lrint(log2((double)sc[(size_t)p0 * nkv + hh])));
                for (int t = p0; t < p1; t++) {
                    float *s = &sc[(size_t)t * nkv + hh];
                    long code = lrint(16.0 * log2(*s / m)) + 128;
                    code = code < 1 ? 1 : code > 255 ? 255 : code;
                    float s8 = (float)(m * exp2((double)(code - 128) / 16.0));
                    uint16_t s16;
                    K->f32_to_f16(1, &s8, &s16);
                    K->f16_to_f32(1, &s16, &s8);
                    cr_assert(fabsf(s8 / *s - 1.0f) < 0.0225f, "8-bit scale %g vs %g", (double)s8, (double)*s);
                    *s = s8;
                }
            }
        for (size_t i = 0; i < nv; i++)
            for (int j = 0; j < d; j++) r[i * d + j] *= sc[i];
        kvpq_hadamard(r, nv, d);
        for (size_t i = 0; i < nv * d; i++) {
            float want = w ? r[i] : r[i] * lam[i % row] + mu[i % row];
            float got = (w ? vh : kh)[i];
            cr_assert_float_eq(got, want, 1e-4f * (1.0f + fabsf(want)), "%s coded element %zu: %g vs %g",
                               w ? "v" : "k", i, (double)got, (double)want);
        }
    }
    /* Pages: codes, two bytes per float16 scale, one per 8-bit scale, a float per 8-bit kind and head. */
    const size_t kcs = d1 ? 64 : 16, ksb = norm8 && !d1 ? 1 : 2, vsb = norm8 ? 1 : 2;
    const size_t n8 = (ksb == 1) + (vsb == 1);
    size_t books = (kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, 0, 0)) +
                    kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, 0, 1))) * 4 + 2 * row * 4;
    size_t ring = 2 * (size_t)(W + FLUSH) * row * 2, page = (size_t)nkv * PT * (kcs + 16 + ksb + vsb) + n8 * nkv * 4;
    size_t pages = (size_t)(nc + PT - 1) / PT;
    cr_assert_eq(kvpq_cache_resident_bytes(cache), books + ring + pages * page);
    free(x);
    free(r);
    free(sc);
    free(codes);
    free(h);
    free(k);
    free(v);
    free(kh);
    free(vh);
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

Test(cache_vq, norm_explicit_read_and_bytes) { check_norm_read_and_bytes("d4b8", 0); }

/* 8-bit scales: d4b8 keys and values take the byte; d1b8 keys keep float16 beside 8-bit values. */
Test(cache_vq, norm8_read_scales_and_bytes) {
    check_norm_read_and_bytes("d4b8", 1);
    check_norm_read_and_bytes("d1b8", 1);
}

/* k.norm_bits / v.norm_bits other than "8" or "16" are refused by set_meta, and a file holding one
 * is refused when it loads (FORMAT, naming the key); "8" round-trips through the file. */
Test(cache_vq, norm_bits_metadata_checked) {
    cfg c = {4, 2, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    g_norm = 3;
    kvpq_codebook *cb = make_codebook(1, &c);
    g_norm = 0;
    cr_assert_eq(kvpq_codebook_set_meta(cb, "k.norm_bits", "4"), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "k.norm_bits"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_set_meta(cb, "v.norm_bits", "8"), KVPQ_OK);
    char path[] = "/tmp/kvpq_norm_bits_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert_eq(kvpq_codebook_save(cb, path), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook *back = NULL;
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_str_eq(kvpq_codebook_get_meta(back, "v.norm_bits"), "8");
    kvpq_codebook_free(back);
    /* the same file with "8" patched to "9" (same length: the header stays valid JSON) */
    FILE *f = fopen(path, "r+b");
    cr_assert(f);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf, f);
    buf[n < sizeof buf ? n : sizeof buf - 1] = 0;
    char *at = NULL;
    for (size_t i = 0; i + 17 < n && !at; i++)
        if (!memcmp(buf + i, "\"v.norm_bits\":\"8\"", 17)) at = buf + i + 15;
    cr_assert(at, "v.norm_bits not found in the header");
    fseek(f, at - buf, SEEK_SET);
    fputc('9', f);
    fclose(f);
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_ERR_FORMAT);
    cr_assert(strstr(kvpq_last_error(), "v.norm_bits"), "%s", kvpq_last_error());
    unlink(path);
    kvpq_codebook_free(cb);
}

/* 8-bit scales: a page whose scales move far from its first one (vectors x fac[t]; values show the
 * factor, keys much less: their mean is subtracted first). Each coded vector's scale, read back, is
 * within 2.25% (the 1/16-octave step and float16) of the same cache's with float16 scales (same
 * codebook, same codes): the first vector an outlier 2^10 above or below the rest (before re-basing,
 * the rest were clamped at m 2^(+-7.9)), and a ramp over 15 octaves within one page. Where a page's
 * value scales span more than 15.9 octaves (an outlier 2^9 above, then one 2^-9 below), the earlier
 * ones keep their values and only the later extreme is clamped. Appends of one position at a time
 * give the same bits as one append (the re-basing follows the data in order, not the batches). */
static void check_norm8_page_range(const float *fac, int len, int clamped_at) {
    cfg c = {4, 1, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    kvpq_codebook *c8 = make_norm_codebook(&c, 8);
    const int d = 64, PT = 64;
    float *k = randn((size_t)len * d, 1.0f), *v = randn((size_t)len * d, 1.0f);
    for (int t = 0; t < len; t++)
        for (int j = 0; j < d; j++) k[(size_t)t * d + j] *= fac[t], v[(size_t)t * d + j] *= fac[t];
    kvpq_cache *a = make_cache(c8, 1, &c, 0, PT, 256), *one = make_cache(c8, 1, &c, 0, PT, 256);
    /* the same books with float16 scales (the caches keep the layout they were made with) */
    cr_assert_eq(kvpq_codebook_set_meta(c8, "k.norm_bits", "16"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_meta(c8, "v.norm_bits", "16"), KVPQ_OK);
    kvpq_cache *b = make_cache(c8, 1, &c, 0, PT, 256);
    cr_assert_eq(kvpq_cache_append(a, 0, len, k, v), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_append(b, 0, len, k, v), KVPQ_OK, "%s", kvpq_last_error());
    for (int t = 0; t < len; t++)
        cr_assert_eq(kvpq_cache_append(one, 0, 1, k + (size_t)t * d, v + (size_t)t * d), KVPQ_OK, "%s", kvpq_last_error());
    const size_t tot = (size_t)len * d;
    float *ka = malloc(tot * sizeof(float)), *va = malloc(tot * sizeof(float)), *kb = malloc(tot * sizeof(float)),
          *vb = malloc(tot * sizeof(float)), *k1 = malloc(tot * sizeof(float)), *v1 = malloc(tot * sizeof(float));
    cr_assert_eq(kvpq_cache_read(a, 0, 0, len, ka, va), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(b, 0, 0, len, kb, vb), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(one, 0, 0, len, k1, v1), KVPQ_OK);
    cr_assert(!memcmp(ka, k1, tot * sizeof(float)) && !memcmp(va, v1, tot * sizeof(float)),
              "one position per append reads back differently from one append");
    const float *mu = kvpq_codebook_key_mean_const(c8, 0);
    for (int t = 0; t < len; t++) {
        double na = 0, nb = 0, ma = 0, mb = 0; /* values: |s r|; keys: |x - mu| (smoothing: per channel) */
        for (int j = 0; j < d; j++) {
            const size_t i = (size_t)t * d + j;
            na += (double)va[i] * va[i], nb += (double)vb[i] * vb[i];
            ma += ((double)ka[i] - mu[j]) * ((double)ka[i] - mu[j]), mb += ((double)kb[i] - mu[j]) * ((double)kb[i] - mu[j]);
        }
        const double rv = sqrt(na / nb), rk = sqrt(ma / mb);
        cr_assert(fabs(rk - 1) < 0.0225, "position %d (x%g): 8-bit / float16 key scale %g", t, (double)fac[t], rk);
        if (t == clamped_at) /* at the bottom of the page's range: read back higher */
            cr_assert(rv > 2.0, "position %d (x%g): the value scale should be clamped: ratio %g", t, (double)fac[t], rv);
        else
            cr_assert(fabs(rv - 1) < 0.0225, "position %d (x%g): 8-bit / float16 value scale %g", t, (double)fac[t], rv);
    }
    free(k), free(v), free(ka), free(va), free(kb), free(vb), free(k1), free(v1);
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    kvpq_cache_free(one);
    kvpq_codebook_free(c8);
}

Test(cache_vq, norm8_page_rebases_by_octaves) {
    enum { N = 64 };
    float fac[N];
    for (int t = 0; t < N; t++) fac[t] = 1.0f;
    fac[0] = 1024.0f; /* the first, 10 octaves above */
    check_norm8_page_range(fac, N, -1);
    fac[0] = 1.0f / 1024.0f; /* the first, 10 octaves below */
    check_norm8_page_range(fac, N, -1);
    for (int t = 0; t < N; t++) fac[t] = exp2f(-7.5f + 15.0f * (float)t / (N - 1)); /* a ramp over 15 octaves */
    check_norm8_page_range(fac, N, -1);
    for (int t = 0; t < N; t++) fac[t] = 1.0f;
    fac[0] = 512.0f, fac[10] = 1.0f / 512.0f; /* 18 octaves within the page: the later extreme clamps */
    check_norm8_page_range(fac, N, 10);
}

// ---- truncation ----------------------------------------------------------------------------------

/* Truncate then append equals a fresh cache fed the kept prefix and the same new tokens — bit for
 * bit once the new tokens have pushed the cut past the coded edge (codes depend only on the data,
 * the coded/window split only on the length). Cuts inside the window and inside the codes. */
static void truncate_equals_fresh(void) {
    cfg c = {8, 2, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SUBSPACE, 1};
    kvpq_codebook *cb = make_codebook(2, &c);
    const int W = 48, PT = 40, L0 = 300, X = W + 2 * FLUSH + 5;
    const int cuts[] = {290, 260, 200, 100, 33, 0};
    size_t row = (size_t)c.n_head_kv * c.head_dim;
    float *k = randn((size_t)(L0 + X) * row, 1.0f), *v = randn((size_t)(L0 + X) * row, 1.0f);
    float *k2 = randn((size_t)X * row, 1.0f), *v2 = randn((size_t)X * row, 1.0f);
    for (size_t ci = 0; ci < sizeof cuts / sizeof cuts[0]; ci++) {
        int cut = cuts[ci];
        kvpq_cache *a = make_cache(cb, 2, &c, W, PT, 1024), *b = make_cache(cb, 2, &c, W, PT, 1024);
        for (int l = 0; l < 2; l++) {
            cr_assert_eq(kvpq_cache_append(a, l, 150, k, v), KVPQ_OK);
            cr_assert_eq(kvpq_cache_append(a, l, L0 - 150, k + 150 * row, v + 150 * row), KVPQ_OK);
        }
        cr_assert_eq(kvpq_cache_truncate(a, cut), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_seq_len(a, 1), cut);
        for (int l = 0; l < 2; l++) {
            if (cut) cr_assert_eq(kvpq_cache_append(b, l, cut, k, v), KVPQ_OK);
            cr_assert_eq(kvpq_cache_append(a, l, X, k2, v2), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_append(b, l, X, k2, v2), KVPQ_OK, "%s", kvpq_last_error());
        }
        int len = cut + X;
        size_t tot = (size_t)len * row * sizeof(float);
        float *ka = malloc(tot), *kb = malloc(tot), *va = malloc(tot), *vb = malloc(tot);
        for (int l = 0; l < 2; l++) {
            cr_assert_eq(kvpq_cache_read(a, l, 0, len, ka, va), KVPQ_OK);
            cr_assert_eq(kvpq_cache_read(b, l, 0, len, kb, vb), KVPQ_OK);
            cr_assert(!memcmp(ka, kb, tot) && !memcmp(va, vb, tot), "cut %d layer %d: read differs", cut, l);
        }
        kvpq_cache_stats sa, sb;
        kvpq_cache_get_stats(a, &sa);
        kvpq_cache_get_stats(b, &sb);
        cr_assert_eq(sa.tokens_coded, sb.tokens_coded, "cut %d", cut);
        cr_assert_eq(sa.resident_bytes, sb.resident_bytes, "cut %d", cut);
        float *q = randn((size_t)5 * c.n_head * c.head_dim, 2.0f);
        size_t osz = (size_t)5 * c.n_head * c.head_dim * sizeof(float);
        float *oa = malloc(osz), *ob = malloc(osz);
        cr_assert_eq(kvpq_cache_attend(a, 1, 5, q, oa), KVPQ_OK);
        cr_assert_eq(kvpq_cache_attend(b, 1, 5, q, ob), KVPQ_OK);
        cr_assert(!memcmp(oa, ob, osz), "cut %d: attention differs", cut);
        check_attend(a, &c, 3, "after truncate");
        free(q);
        free(oa);
        free(ob);
        free(ka);
        free(kb);
        free(va);
        free(vb);
        kvpq_cache_free(a);
        kvpq_cache_free(b);
    }
    free(k);
    free(v);
    free(k2);
    free(v2);
    kvpq_codebook_free(cb);
}

Test(cache_vq, truncate_then_append_equals_fresh) { truncate_equals_fresh(); }

/* The same with norm-explicit keys and values and 8-bit scales: a page's reference comes from its
 * first nonzero scale, so a cut that keeps it leaves the reference a fresh cache computes, and a cut
 * that keeps none resets it (vq_truncate). */
Test(cache_vq, truncate_then_append_equals_fresh_norm8) {
    g_norm = 3;
    g_norm_bits = 8;
    truncate_equals_fresh();
    g_norm = 0;
    g_norm_bits = 16;
}

/* 8-bit scales: zero values (scale 0, code 0) at the start of a page leave its value reference to
 * the first nonzero scale after them; a cut that keeps only the zeros must reset it, or the new
 * appends would be coded against the dropped tokens' reference instead of their own (a fresh cache's). */
Test(cache_vq, truncate_resets_the_8bit_reference) {
    cfg c = {4, 2, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    kvpq_codebook *cb = make_norm_codebook(&c, 8);
    const int PT = 64, n0 = 128, cut = 32, n1 = 96;
    const size_t row = (size_t)c.n_head_kv * c.head_dim;
    float *k = randn((size_t)n0 * row, 1.0f), *v = randn((size_t)n0 * row, 1.0f);
    float *k2 = randn((size_t)n1 * row, 1.0f), *v2 = randn((size_t)n1 * row, 400.0f); /* 8.6 octaves up: beyond the old reference's range */
    memset(v, 0, (size_t)cut * row * sizeof(float));
    kvpq_cache *a = make_cache(cb, 1, &c, 0, PT, 512), *b = make_cache(cb, 1, &c, 0, PT, 512);
    cr_assert_eq(kvpq_cache_append(a, 0, n0, k, v), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_truncate(a, cut), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_append(a, 0, n1, k2, v2), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_append(b, 0, cut, k, v), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_append(b, 0, n1, k2, v2), KVPQ_OK, "%s", kvpq_last_error());
    const int len = cut + n1;
    const size_t tot = (size_t)len * row * sizeof(float);
    float *ka = malloc(tot), *kb = malloc(tot), *va = malloc(tot), *vb = malloc(tot);
    cr_assert_eq(kvpq_cache_read(a, 0, 0, len, ka, va), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(b, 0, 0, len, kb, vb), KVPQ_OK);
    cr_assert(!memcmp(ka, kb, tot), "keys differ after the cut");
    cr_assert(!memcmp(va, vb, tot), "values differ after the cut (the page's reference was not reset)");
    free(k), free(v), free(k2), free(v2), free(ka), free(kb), free(va), free(vb);
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    kvpq_codebook_free(cb);
}

/* Right after a cut into the codes the kept positions read back unchanged (still codes). */
Test(cache_vq, truncate_keeps_prefix) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 0};
    kvpq_codebook *cb = make_codebook(1, &c);
    kvpq_cache *a = make_cache(cb, 1, &c, 32, 50, 1024);
    append_random(a, 0, &c, 400, NULL, NULL);
    size_t row = 3 * 64;
    float *before = malloc(150 * row * 4), *after = malloc(150 * row * 4);
    cr_assert_eq(kvpq_cache_read(a, 0, 0, 150, before, NULL), KVPQ_OK);
    cr_assert_eq(kvpq_cache_truncate(a, 150), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(a, 0, 0, 150, after, NULL), KVPQ_OK);
    cr_assert(!memcmp(before, after, 150 * row * 4));
    kvpq_cache_stats st;
    kvpq_cache_get_stats(a, &st);
    cr_assert_eq(st.tokens_coded, 150);
    cr_assert_eq(st.tokens_window, 0);
    check_attend(a, &c, 1, "after cut into codes");
    append_random(a, 0, &c, 10, NULL, NULL);
    check_attend(a, &c, 4, "after cut and append");
    free(before);
    free(after);
    kvpq_cache_free(a);
    kvpq_codebook_free(cb);
}

// ---- bad input -----------------------------------------------------------------------------------

static void expect_mismatch(const kvpq_codebook *cb, int n_layer, const cfg *c, const char *name) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = n_layer;
    p.n_head = c->n_head;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    p.max_seq = 256;
    p.codebook = cb;
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *cache = (kvpq_cache *)&p; /* must be reset to NULL on failure */
    kvpq_status s = kvpq_cache_new(&cache, &p);
    cr_assert_eq(s, KVPQ_ERR_MISMATCH, "%s: got %d (%s)", name, (int)s, kvpq_last_error());
    cr_assert_null(cache);
    cr_assert(strstr(kvpq_last_error(), name), "message '%s' should name %s", kvpq_last_error(), name);
}

Test(cache_vq, mismatched_codebook_is_refused) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    kvpq_codebook *cb = make_codebook(2, &c);
    expect_mismatch(cb, 3, &c, "n_layer");
    cfg c2 = {8, 4, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    expect_mismatch(cb, 2, &c2, "n_head_kv");
    cfg c3 = {9, 3, 128, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    expect_mismatch(cb, 2, &c3, "head_dim");
    /* A key mean that is not finite (set through the API, not a file) is refused, naming it. */
    float *mu = kvpq_codebook_key_mean(cb, 1);
    float keep = mu[5];
    mu[5] = NAN;
    kvpq_cache *bad = NULL;
    {
        kvpq_cache_params q = kvpq_cache_params_default();
        q.type = KVPQ_CACHE_VQ;
        q.n_layer = 2;
        q.n_head = 9;
        q.n_head_kv = 3;
        q.head_dim = 64;
        q.codebook = cb;
        q.backend = KVPQ_BACKEND_CPU;
        cr_assert_eq(kvpq_cache_new(&bad, &q), KVPQ_ERR_NONFINITE, "%s", kvpq_last_error());
        cr_assert_null(bad);
        cr_assert(strstr(kvpq_last_error(), "layer 1 key mean [head 0][channel 5]"), "%s", kvpq_last_error());
    }
    mu[5] = keep;
    /* No codebook at all. */
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *cache = NULL;
    cr_assert_neq(kvpq_cache_new(&cache, &p), KVPQ_OK);
    cr_assert(strstr(kvpq_last_error(), "codebook"), "%s", kvpq_last_error());
    kvpq_codebook_free(cb);
}

/* Beyond fp16's range the window cannot store a value: refused, and the cache is unchanged. */
Test(cache_vq, out_of_fp16_range_is_refused_and_nothing_lost) {
    cfg c = {9, 3, 64, "d4b8", "d4b8", KVPQ_CODEBOOK_SHARED, 1};
    kvpq_codebook *cb = make_codebook(1, &c);
    kvpq_cache *a = make_cache(cb, 1, &c, 16, 32, 512);
    append_random(a, 0, &c, 100, NULL, NULL);
    size_t row = 3 * 64;
    float *before = malloc(100 * row * 4), *after = malloc(100 * row * 4);
    kvpq_cache_read(a, 0, 0, 100, before, NULL);
    float *k = randn(60 * row, 1.0f), *v = randn(60 * row, 1.0f);
    v[59 * row + 7] = 1e6f;
    cr_assert_eq(kvpq_cache_append(a, 0, 60, k, v), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "fp16"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(a, 0), 100);
    kvpq_cache_read(a, 0, 0, 100, after, NULL);
    cr_assert(!memcmp(before, after, 100 * row * 4));
    check_attend(a, &c, 1, "after refused append");
    free(k);
    free(v);
    free(before);
    free(after);
    kvpq_cache_free(a);
    kvpq_codebook_free(cb);
}

// ---- SIMD kernels vs reference ---------------------------------------------------------------------

/* The Walsh-Hadamard rows kernel of every SIMD level does the reference's additions in its order:
 * equal bit for bit, for every power-of-two d (kvpq_hadamard and the codebooks depend on it). */
Test(cache_vq, fwht_rows_bit_identical_to_reference) {
    for (int lv = KVPQ_SIMD_AVX2; lv <= (int)kvpq_simd_get(); lv++) {
        const kvpq_vq_kernels *K = kvpq__vq_kernels((kvpq_simd_level)lv);
        for (int d = 1; d <= 512; d *= 2) {
            const size_t n = 5;
            float *a = randn(n * d, 3.0f), *b = malloc(n * d * sizeof(float));
            memcpy(b, a, n * d * sizeof(float));
            kvpq__vq_fwht_rows_ref(n, d, 0.125f, a);
            K->fwht_rows(n, d, 0.125f, b);
            cr_assert_eq(memcmp(a, b, n * d * sizeof(float)), 0, "level %d d %d", lv, d);
            free(a), free(b);
        }
    }
}

/* The row kernels of keys coded before RoPE (vq_rows.h) give the reference's bits at every level:
 * gather (dsub 1 / 2 / 4 / 8 / 16, shared and per-sub-space books, copy and add), affine rows, and
 * RoPE steps in both pair layouts with head-major strides. */
Test(cache_vq, row_kernels_bit_identical_to_reference) {
    for (int lv = KVPQ_SIMD_AVX2; lv <= (int)kvpq_simd_get(); lv++) {
        const kvpq_vq_kernels *K = kvpq__vq_kernels((kvpq_simd_level)lv);
        const size_t n = 7;
        for (int ds = 1; ds <= 16; ds *= 2)
            for (int nb = 0; nb < 2; nb++)
                for (int add = 0; add < 2; add++) {
                    const int M = 64 / ds, books = nb ? M : 1;
                    float *cent = randn((size_t)books * 256 * ds, 1.0f), *a = randn(n * 64, 1.0f);
                    float *b = malloc(n * 64 * sizeof(float));
                    uint8_t *codes = malloc(n * (M + 3));
                    for (size_t i = 0; i < n * (M + 3); i++) codes[i] = (uint8_t)(urand() * 256);
                    memcpy(b, a, n * 64 * sizeof(float));
                    kvpq__vq_gather_u8_ref(n, M, ds, books, 256, cent, codes, M + 3, add, a);
                    K->gather_u8(n, M, ds, books, 256, cent, codes, M + 3, add, b);
                    cr_assert_eq(memcmp(a, b, n * 64 * sizeof(float)), 0, "gather level %d dsub %d books %d add %d", lv,
                                 ds, books, add);
                    free(cent), free(a), free(b), free(codes);
                }
        float *x = randn(n * 128, 2.0f), *y = malloc(n * 128 * sizeof(float)), *ab = randn(256, 1.0f);
        memcpy(y, x, n * 128 * sizeof(float));
        kvpq__vq_affine_rows_ref(n, 128, ab, ab + 128, x);
        K->affine_rows(n, 128, ab, ab + 128, y);
        cr_assert_eq(memcmp(x, y, n * 128 * sizeof(float)), 0, "affine level %d", lv);
        for (int neox = 0; neox < 2; neox++) { /* 3 heads of 128, head-major (pos stride 128, head stride n * 128) */
            float *r = randn(3 * n * 128, 1.0f), *q = malloc(3 * n * 128 * sizeof(float)), cf[2 * 48];
            double cs[2][4 * 48];
            for (int i = 0; i < 48; i++) {
                const double w = pow(1e4, -2.0 * i / 96);
                cs[0][i] = cos(37 * w), cs[0][48 + i] = sin(37 * w), cs[0][96 + i] = cos(w), cs[0][144 + i] = sin(w);
            }
            memcpy(cs[1], cs[0], sizeof cs[0]);
            memcpy(q, r, 3 * n * 128 * sizeof(float));
            kvpq__vq_rope_steps_ref(n, 3, 48, neox, 128, n * 128, cs[0], cf, r);
            K->rope_steps(n, 3, 48, neox, 128, n * 128, cs[1], cf, q);
            cr_assert_eq(memcmp(r, q, 3 * n * 128 * sizeof(float)), 0, "rope level %d neox %d", lv, neox);
            cr_assert_eq(memcmp(cs[0], cs[1], sizeof cs[0]), 0, "rope state level %d", lv);
            free(r), free(q);
        }
        free(x), free(y), free(ab);
    }
}

Test(cache_vq, kernels_match_reference) {
    kvpq_simd_level best = kvpq_simd_get();
    const int gps[] = {1, 4, 8, 16, 32};
    const int n = 77;
    for (int lv = KVPQ_SIMD_AVX2; lv <= (int)best; lv++) {
        const kvpq_vq_kernels *K = kvpq__vq_kernels((kvpq_simd_level)lv);
        /* M = 16 and 32 take the precomputed-offsets path for gp 4 / 8, M = 12 the byte-peeling one. */
        for (int M = 12; M <= 32; M += M == 12 ? 4 : 16)
        for (size_t gi = 0; gi < 5; gi++)
            for (int nb = 8; nb <= 12; nb += 4) {
                int gp = gps[gi], ksub = 1 << nb;
                float *lut = randn((size_t)M * ksub * gp, 1.0f);
                uint8_t *c8 = malloc((size_t)n * M);
                uint16_t *c16 = malloc((size_t)n * M * 2);
                for (int i = 0; i < n * M; i++) {
                    c16[i] = (uint16_t)(urand() * ksub);
                    c8[i] = (uint8_t)c16[i];
                }
                float *s1 = malloc((size_t)n * gp * 4), *s2 = malloc((size_t)n * gp * 4);
                if (nb == 8) {
                    kvpq__vq_score_u8_ref(n, M, ksub, gp, c8, lut, s1);
                    K->score_u8(n, M, ksub, gp, c8, lut, s2);
                } else {
                    kvpq__vq_score_u16_ref(n, M, ksub, gp, c16, lut, s1);
                    K->score_u16(n, M, ksub, gp, c16, lut, s2);
                }
                for (int i = 0; i < n * gp; i++) cr_assert_float_eq(s1[i], s2[i], 1e-5f, "score gp %d nbits %d", gp, nb);
                /* softmax step on identical scores (lanes start empty or with a state), accumulation */
                memcpy(s2, s1, (size_t)n * gp * 4);
                float m1[32], d1[32], r1[32], m2[32], d2[32], r2[32];
                for (int g = 0; g < gp; g++) {
                    m1[g] = m2[g] = g % 2 ? -INFINITY : 0.5f;
                    d1[g] = d2[g] = g % 2 ? 0.0f : 3.0f;
                }
                int a1 = kvpq__vq_softmax_step_ref(n, gp, s1, m1, d1, r1);
                int a2 = K->softmax_step(n, gp, s2, m2, d2, r2);
                cr_assert_eq(a1, a2);
                for (int g = 0; g < gp; g++) {
                    cr_assert_float_eq(m1[g], m2[g], 1e-5f);
                    cr_assert_float_eq(d1[g], d2[g], 1e-5f * d1[g]);
                    cr_assert_float_eq(r1[g], r2[g], 1e-6f);
                }
                for (int i = 0; i < n * gp; i++)
                    cr_assert_float_eq(s1[i], s2[i], 1e-6f * (1 + s1[i]), "exp gp %d [%d]: %g vs %g", gp, i, (double)s1[i], (double)s2[i]);
                float *t1 = calloc((size_t)M * ksub * gp, 4), *t2 = calloc((size_t)M * ksub * gp, 4);
                if (nb == 8) {
                    kvpq__vq_accum_u8_ref(n, M, ksub, gp, c8, s1, t1);
                    K->accum_u8(n, M, ksub, gp, c8, s1, t2);
                } else {
                    kvpq__vq_accum_u16_ref(n, M, ksub, gp, c16, s1, t1);
                    K->accum_u16(n, M, ksub, gp, c16, s1, t2);
                }
                cr_assert(!memcmp(t1, t2, (size_t)M * ksub * gp * 4), "accum gp %d", gp);
                kvpq__vq_scale_rows_ref((size_t)M * ksub, gp, r1, t1);
                K->scale_rows((size_t)M * ksub, gp, r1, t2);
                cr_assert(!memcmp(t1, t2, (size_t)M * ksub * gp * 4), "scale gp %d", gp);
                free(t1);
                free(t2);
                free(s1);
                free(s2);
                free(c8);
                free(c16);
                free(lut);
            }
        /* exp half of the step against its reference: every lane pattern, lengths with and without
         * a tail, references above the lane max (weights < 1), one NaN score that must stay NaN. */
        const int gps_e[] = {1, 2, 3, 4, 8, 16, 32, 48, 64};
        const int ns_e[] = {1, 3, 5, 16, 77, 300};
        for (size_t gi = 0; gi < sizeof gps_e / sizeof gps_e[0]; gi++)
            for (size_t ni = 0; ni < sizeof ns_e / sizeof ns_e[0]; ni++) {
                const int gp = gps_e[gi], ne = ns_e[ni];
                float *e1 = randn((size_t)ne * gp, 3.0f), *e2 = malloc((size_t)ne * gp * 4), mref[64], sm1[64], sm2[64];
                float lmax[64];
                if (ne == 77) e1[(size_t)40 * gp + gp / 2] = NAN;
                for (int g = 0; g < gp; g++) {
                    lmax[g] = -INFINITY; /* fmaxf skips the NaN */
                    for (int t = 0; t < ne; t++) lmax[g] = fmaxf(lmax[g], e1[(size_t)t * gp + g]);
                    mref[g] = lmax[g] + (float)(g % 3); /* the block max of a later block may be higher */
                    sm1[g] = sm2[g] = (float)g;
                }
                memcpy(e2, e1, (size_t)ne * gp * 4);
                float lm1[64], lm2[64];
                kvpq__vq_lane_max_ref(ne, gp, e1, lm1);
                K->lane_max(ne, gp, e1, lm2);
                for (int g = 0; g < gp; g++) /* exact; the NaN entry is skipped */
                    cr_assert(lm1[g] == lm2[g] && lm1[g] == lmax[g], "lane_max gp %d n %d lane %d: %g vs %g",
                              gp, ne, g, (double)lm1[g], (double)lm2[g]);
                kvpq__vq_exp_sum_ref(ne, gp, e1, mref, sm1);
                K->exp_sum(ne, gp, e2, mref, sm2);
                for (int i = 0; i < ne * gp; i++) {
                    if (isnan(e1[i])) {
                        cr_assert(isnan(e2[i]), "exp_sum gp %d n %d [%d]: NaN lost", gp, ne, i);
                        continue;
                    }
                    cr_assert_float_eq(e1[i], e2[i], 1e-6f * e1[i] + 1e-30f, "exp_sum gp %d n %d [%d]: %g vs %g", gp, ne,
                                       i, (double)e1[i], (double)e2[i]);
                }
                for (int g = 0; g < gp; g++) {
                    if (isnan(sm1[g])) {
                        cr_assert(isnan(sm2[g]));
                        continue;
                    }
                    cr_assert_float_eq(sm1[g], sm2[g], 1e-5f * sm1[g], "exp_sum sum gp %d n %d lane %d", gp, ne, g);
                }
                /* Per-token scales (norm-explicit codes), with and without the bias: within 1 ulp of
                 * the reference (one FMA rounding instead of two), against an independent
                 * double-precision value. */
                uint16_t *h = malloc((size_t)ne * 2);
                float *hs = randn((size_t)ne, 2.0f), bias[64];
                K->f32_to_f16((size_t)ne, hs, h);
                K->f16_to_f32((size_t)ne, h, hs);
                for (int g = 0; g < gp; g++) bias[g] = 0.25f * (float)g - 1.0f;
                for (int wb = 0; wb < 2; wb++) {
                    float *x1 = randn((size_t)ne * gp, 1.0f), *x2 = malloc((size_t)ne * gp * 4);
                    memcpy(x2, x1, (size_t)ne * gp * 4);
                    float *x0 = malloc((size_t)ne * gp * 4);
                    memcpy(x0, x1, (size_t)ne * gp * 4);
                    kvpq__vq_scale_tokens_ref(ne, gp, x1, h, wb ? bias : NULL);
                    K->scale_tokens(ne, gp, x2, h, wb ? bias : NULL);
                    for (int i = 0; i < ne * gp; i++) {
                        double want = (double)x0[i] * hs[i / gp] + (wb ? bias[i % gp] : 0.0);
                        cr_assert(fabs(x1[i] - want) <= 1e-6 * (fabs(want) + 1.0) &&
                                      fabs(x2[i] - want) <= 1e-6 * (fabs(want) + 1.0),
                                  "scale_tokens gp %d n %d bias %d [%d]: %g / %g vs %g", gp, ne, wb, i, (double)x1[i],
                                  (double)x2[i], want);
                    }
                    free(x0);
                    free(x1);
                    free(x2);
                }
                free(h);
                free(hs);
                free(e1);
                free(e2);
            }
        /* LUT build and value output, dsub 1..16, shared and per-sub-space books */
        for (int dsub = 1; dsub <= 16; dsub *= 2)
            for (size_t gi = 0; gi < 5; gi++) {
                int gp = gps[gi], Mm = 64 / dsub, ksub = 256, nb = dsub % 4 ? 1 : Mm;
                float *cent = randn((size_t)nb * ksub * dsub, 1.0f), *qt = randn((size_t)Mm * dsub * gp, 1.0f);
                float *t = randn((size_t)Mm * ksub * gp, 1.0f);
                float *l1 = malloc((size_t)Mm * ksub * gp * 4), *l2 = malloc((size_t)Mm * ksub * gp * 4);
                kvpq__vq_lut_build_ref(Mm, ksub, dsub, nb, cent, gp, qt, l1);
                K->lut_build(Mm, ksub, dsub, nb, cent, gp, qt, l2);
                for (int i = 0; i < Mm * ksub * gp; i++) cr_assert_float_eq(l1[i], l2[i], 1e-4f, "lut dsub %d gp %d", dsub, gp);
                kvpq__vq_table_out_ref(Mm, ksub, dsub, nb, cent, gp, t, l1);
                K->table_out(Mm, ksub, dsub, nb, cent, gp, t, l2);
                for (int i = 0; i < 64 * gp; i++) cr_assert_float_eq(l1[i], l2[i], 2e-3f, "out dsub %d gp %d", dsub, gp);
                free(cent);
                free(qt);
                free(t);
                free(l1);
                free(l2);
            }
        /* fp16 conversion: bit-exact with the reference, including rounding ties and subnormals. */
        float x[1000];
        for (int i = 0; i < 1000; i++) x[i] = grand() * (float)pow(2.0, (int)(urand() * 40) - 24);
        x[0] = 1.0009765625f + 0.00048828125f; /* a tie */
        uint16_t h1[1000], h2[1000];
        float y1[1000], y2[1000];
        kvpq__vq_f32_to_f16_ref(1000, x, h1);
        K->f32_to_f16(1000, x, h2);
        cr_assert(!memcmp(h1, h2, sizeof h1));
        kvpq__vq_f16_to_f32_ref(1000, h1, y1);
        K->f16_to_f32(1000, h1, y2);
        cr_assert(!memcmp(y1, y2, sizeof y1));
        float *q = randn(128, 1.0f), *kk = randn(9 * 128, 1.0f), o1[9], o2[9];
        kvpq__vq_dot_rows_ref(9, 128, q, kk, o1);
        K->dot_rows(9, 128, q, kk, o2);
        for (int i = 0; i < 9; i++) cr_assert_float_eq(o1[i], o2[i], 1e-4f);
        float w1[128], w2[128];
        kvpq__vq_weighted_sum_ref(9, 128, o1, kk, w1);
        K->weighted_sum(9, 128, o1, kk, w2);
        for (int i = 0; i < 128; i++) cr_assert_float_eq(w1[i], w2[i], 1e-3f);
        free(q);
        free(kk);
    }
}

/* Fast-scan (8-bit LUT) scores: the quantization's error stays within its bound M * delta / 2 of the
 * exact float-LUT scores (and is not zero: the path really is the quantized one), and every SIMD
 * level's kernel equals the reference bit for bit (integer sums, one FMA for scale and bias).
 * n = 150 covers two 64-token blocks and a tail; M = 16, 32 (vector path) and 12 (reference). */
Test(cache_vq, fast_scan_scores) {
    kvpq_simd_level best = kvpq_simd_get();
    const int n = 150, ksub = 256;
    const int Ms[] = {12, 16, 32};
    const int gps[][2] = {{1, 1}, {3, 4}, {4, 4}, {6, 8}, {16, 16}};
    for (size_t mi = 0; mi < 3; mi++)
        for (size_t gi = 0; gi < 5; gi++) {
            const int M = Ms[mi], G = gps[gi][0], gp = gps[gi][1];
            float *lut = randn((size_t)M * ksub * gp, 1.0f);
            uint8_t *c8 = malloc((size_t)n * M), *lut8 = malloc((size_t)G * M * ksub);
            for (int i = 0; i < n * M; i++) c8[i] = (uint8_t)(urand() * ksub);
            float *ex = malloc((size_t)n * gp * 4), *s1 = malloc((size_t)n * gp * 4), *s2 = malloc((size_t)n * gp * 4);
            float scale[16], bias[16];
            kvpq__vq_lut_quantize(M, ksub, gp, G, lut, lut8, scale, bias);
            kvpq__vq_score_u8_ref(n, M, ksub, gp, c8, lut, ex);
            kvpq__vq_score_fs_u8_ref(n, M, G, gp, c8, lut8, scale, bias, s1);
            double max_err = 0.0;
            for (int t = 0; t < n; t++)
                for (int g = 0; g < gp; g++) {
                    float e = s1[t * gp + g], x = ex[t * gp + g];
                    if (g >= G) {
                        cr_assert_eq(e, 0.0f);
                        continue;
                    }
                    double err = fabs((double)e - x), bound = M * scale[g] / 2.0 * (1 + 1e-4) + 1e-5;
                    cr_assert(err <= bound, "fast-scan M %d g %d t %d: error %g > bound %g", M, g, t, err, bound);
                    if (err > max_err) max_err = err;
                }
            cr_assert(max_err > 0.0, "fast-scan scores equal the exact ones: not quantized?");
            for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
                const kvpq_vq_kernels *K = kvpq__vq_kernels((kvpq_simd_level)lv);
                memset(s2, 0x7f, (size_t)n * gp * 4);
                K->score_fs_u8(n, M, G, gp, c8, lut8, scale, bias, s2);
                cr_assert(!memcmp(s1, s2, (size_t)n * gp * 4), "fast-scan kernel level %d M %d G %d", lv, M, G);
            }
            free(lut);
            free(c8);
            free(lut8);
            free(ex);
            free(s1);
            free(s2);
        }
}

/* Per-token value decoding (the W-table alternative for small groups) against its reference, on
 * the shapes the SIMD level takes (and shared and per-sub-space books); a wrong code-to-centroid
 * mapping or head lane would differ by O(1). */
Test(cache_vq, accum_dec_matches_reference) {
    kvpq_simd_level best = kvpq_simd_get();
    const int n = 71; /* odd: the tail after token pairs */
    for (int dsub = 4; dsub <= 8; dsub += 4) /* 4: every level's shape; 8: where a level takes it */
    for (int M = 16 / (dsub / 4); M <= 32; M += 16 / (dsub / 4))
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        const int d = M * dsub;
        const kvpq_vq_kernels *K = kvpq__vq_kernels((kvpq_simd_level)lv);
        if (!K->accum_dec_u8 || (dsub == 8 && !K->accum_dec_ok(M, dsub, 1))) continue;
        for (int G = 1; G <= 4; G++)
            for (int nb = 1; nb <= M; nb += M - 1) {
                const int gp = G == 1 ? 1 : 4; /* nb: shared book, or one per sub-space */
                cr_assert(K->accum_dec_ok(M, dsub, G));
                float *cent = randn((size_t)nb * 256 * dsub, 1.0f), *p = randn((size_t)n * gp, 1.0f);
                float *o1 = randn((size_t)G * d, 1.0f), *o2 = malloc((size_t)G * d * 4);
                memcpy(o2, o1, (size_t)G * d * 4);
                uint8_t *c8 = malloc((size_t)n * M);
                for (int i = 0; i < n * M; i++) c8[i] = (uint8_t)(urand() * 256);
                kvpq__vq_accum_dec_u8_ref(n, M, dsub, nb, cent, gp, G, c8, p, o1);
                K->accum_dec_u8(n, M, dsub, nb, cent, gp, G, c8, p, o2);
                for (int i = 0; i < G * d; i++)
                    cr_assert_float_eq(o1[i], o2[i], 1e-4f * (1 + fabsf(o1[i])), "dec dsub %d M %d G %d books %d [%d]", dsub,
                                       M, G, nb, i);
                free(cent);
                free(p);
                free(o1);
                free(o2);
                free(c8);
            }
    }
}
