/* test_cache_rope.c — keys coded before RoPE (kvpq_codebook_params.key_rope_dims): kvpq_rope_rotate
 * against the closed form and its inverse; attention from codes against exact fp64 attention over
 * the cache's own reconstruction (kvpq_cache_read, which applies RoPE) for every head_dim the VQ
 * cache takes, both pair layouts, a partial rotation, sinks (position offset), a window, a sliding
 * window, norm-explicit and two-stage keys; with keys that the codebook holds exactly (lossless
 * codes), reading back gives the appended post-RoPE keys and attention equals exact attention over
 * them; save and load keep it. KVPQ_QUICK=1 shrinks sizes. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"

/* Attention from decoded keys vs fp64 over read(): float32 dot products and the online softmax. */
#define ATTEND_TOL 2e-4

typedef struct {
    int head_dim, n_rot, neox;
    int n_head, n_head_kv;
    int norm;        /* norm-explicit keys and values */
    int sinks, window, sliding;
    const char *key2; /* a second key stage's preset, or NULL */
    const char *keys; /* the key preset; NULL: d4b8 (8-bit codes: the decoder's direct path) */
} rope_cfg;

/* inv_freq[i] = base^(-2i / n_rot) (RoPE's frequencies, as llama.c computes them). */
static void set_freqs(kvpq_codebook *cb, int layer, int n_rot, double base) {
    float *f = kvpq_codebook_key_rope_freq(cb, layer);
    cr_assert_not_null(f);
    for (int i = 0; i < n_rot / 2; i++) f[i] = (float)pow(base, -2.0 * i / n_rot);
}

/* A d4b8 codebook (random centroids, lambda, mu) of n_layer layers coding keys before RoPE with the
 * config's layout; layer 1 (if any) keeps inv_freq 0 (keys as given). */
static kvpq_codebook *rope_codebook(const rope_cfg *c, int n_layer, uint64_t seed) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = n_layer;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    cr_assert_eq(kvpq_pq_params_preset(&p.key, c->keys ? c->keys : "d4b8", c->head_dim), KVPQ_OK);
    cr_assert_eq(kvpq_pq_params_preset(&p.value, "d4b8", c->head_dim), KVPQ_OK);
    p.key_norm = p.value_norm = c->norm;
    p.key_rope_dims = c->n_rot;
    p.key_rope_neox = c->neox;
    if (c->key2) {
        p.key_stages = 2;
        cr_assert_eq(kvpq_pq_params_preset(&p.key2, c->key2, c->head_dim), KVPQ_OK);
    }
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; l < n_layer; l++) {
        for (int w = 0; w < 3; w++) {
            kvpq_pq *pq = w == 2 ? kvpq_codebook_key_pq2(cb, l) : kvpq_codebook_pq(cb, l, w);
            if (!pq) continue;
            const size_t n = kvpq_pq_centroids_size(pq);
            float *x = rand_vec(n, seed++, w == 2 ? 0.2f : c->norm ? 0.25f : 1.0f);
            cr_assert_eq(kvpq_pq_set_centroids(pq, x, n), KVPQ_OK);
            free(x);
        }
        float *lam = kvpq_codebook_key_smooth(cb, l), *mu = kvpq_codebook_key_mean(cb, l);
        for (int i = 0; i < c->n_head_kv * c->head_dim; i++) {
            lam[i] = (float)(0.5 + 1.5 * rng_unif(&seed));
            mu[i] = (float)(2.0 * rng_unif(&seed) - 1.0);
        }
        if (l != 1) set_freqs(cb, l, c->n_rot, 10000.0);
    }
    return cb;
}

static kvpq_cache_params rope_params(const kvpq_codebook *cb, const rope_cfg *c, int n_layer, int max_seq) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = n_layer;
    p.n_head = c->n_head;
    p.n_head_kv = c->n_head_kv;
    p.head_dim = c->head_dim;
    p.max_seq = max_seq;
    p.window = c->window;
    p.sinks = c->sinks;
    p.sliding_window = c->sliding;
    p.page_tokens = 64;
    p.codebook = cb;
    p.n_threads = 2;
    p.backend = KVPQ_BACKEND_CPU;
    return p;
}

static kvpq_cache *rope_cache(const kvpq_codebook *cb, const rope_cfg *c, int n_layer, int max_seq) {
    const kvpq_cache_params p = rope_params(cb, c, n_layer, max_seq);
    kvpq_cache *cache;
    cr_assert_eq(kvpq_cache_new(&cache, &p), KVPQ_OK, "%s", kvpq_last_error());
    return cache;
}

/* Attend the newest n_q positions of a layer and compare with fp64 over read() (the reconstruction,
 * RoPE applied); returns the error relative to max |ref|. */
static double attend_vs_read(kvpq_cache *cache, const rope_cfg *c, int layer, int n_q, uint64_t seed) {
    const int len = kvpq_cache_seq_len(cache, layer), d = c->head_dim;
    const size_t kvn = (size_t)len * c->n_head_kv * d, qn = (size_t)n_q * c->n_head * d;
    float *k = malloc(kvn * sizeof *k), *v = malloc(kvn * sizeof *v), *out = malloc(qn * sizeof *out);
    float *q = rand_vec(qn, seed, 1.5f);
    double *ref = malloc(qn * sizeof *ref);
    /* a sliding window's layer holds only what its queries still see: the rows before stay 0 */
    const int lo = c->sliding && len - n_q + 1 - c->sliding > 0 ? len - n_q + 1 - c->sliding : 0;
    memset(k, 0, kvn * sizeof *k), memset(v, 0, kvn * sizeof *v);
    const size_t off = (size_t)lo * c->n_head_kv * d;
    cr_assert_eq(kvpq_cache_read(cache, layer, lo, len - lo, k + off, v + off), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_attend(cache, layer, n_q, q, out), KVPQ_OK, "%s", kvpq_last_error());
    ref_attend_window(len, n_q, c->n_head, c->n_head_kv, d, c->sliding, k, v, q, ref);
    const double e = rel_err_f64(out, ref, qn);
    free(k), free(v), free(out), free(q), free(ref);
    return e;
}

/* Append n random positions to every layer and check each layer's attention of the newest ones. */
static void append_and_check(kvpq_cache *cache, const rope_cfg *c, int L, int n, uint64_t *seed) {
    const size_t sz = (size_t)n * c->n_head_kv * c->head_dim;
    for (int l = 0; l < L; l++) {
        float *k = rand_vec(sz, (*seed)++, 1.0f), *v = rand_vec(sz, (*seed)++, 1.0f);
        cr_assert_eq(kvpq_cache_append(cache, l, n, k, v), KVPQ_OK, "%s", kvpq_last_error());
        free(k), free(v);
    }
    for (int l = 0; l < L; l++) {
        const double e = attend_vs_read(cache, c, l, n < 6 ? n : 6, (*seed)++);
        cr_assert(e <= ATTEND_TOL, "layer %d len %d (d %d n_rot %d neox %d heads %d/%d norm %d sinks %d window %d "
                  "sliding %d key2 %s): error %g", l, kvpq_cache_seq_len(cache, l), c->head_dim, c->n_rot, c->neox,
                  c->n_head, c->n_head_kv, c->norm, c->sinks, c->window, c->sliding, c->key2 ? c->key2 : "-", e);
    }
}

/* Prefill in uneven chunks, then decode steps, attending every layer after each append; then cut
 * the cache to half and go on (the decoded keys a prefill keeps must not outlive the codes). */
static void run_rope(const rope_cfg *c, int len) {
    const int L = 2; /* layer 0 before RoPE, layer 1 as given */
    kvpq_codebook *cb = rope_codebook(c, L, 7);
    kvpq_cache *cache = rope_cache(cb, c, L, len + 128);
    uint64_t seed = 99;
    for (int done = 0, step = 0; done < len; step++) {
        int n = done < len - 4 ? 29 + 41 * (step % 3) : 1;
        if (n > len - done) n = len - done;
        append_and_check(cache, c, L, n, &seed);
        done += n;
    }
    if (!c->sliding) { /* a sliding window's layer cannot go back that far */
        cr_assert_eq(kvpq_cache_truncate(cache, len / 2), KVPQ_OK, "%s", kvpq_last_error());
        append_and_check(cache, c, L, len / 2 + 40, &seed); /* one run past the old end */
        append_and_check(cache, c, L, 1, &seed);
    }
    kvpq_cache_free(cache);
    kvpq_codebook_free(cb);
}

/* kvpq_rope_rotate of 40 positions from 1000 against the closed form per channel, then its inverse at
 * explicit positions back to the input. */
static void check_rotation(int d, int n_rot, int neox, const float *f) {
    const int n = 40, H = 2;
    float *x = rand_vec((size_t)n * H * d, 5, 1.0f), *y = malloc(sizeof(float) * n * H * d);
    int32_t pos[40];
    for (int t = 0; t < n; t++) pos[t] = 1000 + t;
    memcpy(y, x, sizeof(float) * n * H * d);
    cr_assert_eq(kvpq_rope_rotate(y, n, H, d, n_rot, neox, f, NULL, 1000, 1), KVPQ_OK);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++)
            for (int j = 0; j < d; j++) {
                const float *xr = x + ((size_t)t * H + h) * d;
                const int i = neox ? j % (n_rot / 2) : j / 2, first = neox ? j < n_rot / 2 : j % 2 == 0;
                const int a = neox ? i : 2 * i, b = neox ? i + n_rot / 2 : 2 * i + 1;
                const double th = j < n_rot ? (1000.0 + t) * f[i] : 0.0, c = cos(th), s = sin(th);
                const double want = j >= n_rot ? xr[j] : first ? xr[a] * c - xr[b] * s : xr[a] * s + xr[b] * c;
                cr_assert(fabs(y[((size_t)t * H + h) * d + j] - want) < 1e-5, "d %d neox %d t %d h %d j %d: %g vs %g",
                          d, neox, t, h, j, (double)y[((size_t)t * H + h) * d + j], want);
            }
    cr_assert_eq(kvpq_rope_rotate(y, n, H, d, n_rot, neox, f, pos, 0, -1), KVPQ_OK); /* explicit positions */
    for (size_t i = 0; i < (size_t)n * H * d; i++) cr_assert(fabsf(y[i] - x[i]) < 1e-5f, "inverse at %zu", i);
    free(x), free(y);
}

Test(cache_rope, rotate_matches_closed_form_and_inverts) {
    const int dims[2][2] = {{16, 12}, {512, 512}}; /* (head_dim, n_rot); 512: the rotation's buffers on the heap */
    float f[256];
    for (int cfg = 0; cfg < 4; cfg++) {
        const int d = dims[cfg / 2][0], n_rot = dims[cfg / 2][1];
        for (int i = 0; i < n_rot / 2; i++) f[i] = powf(500.0f, -2.0f * i / n_rot);
        check_rotation(d, n_rot, cfg % 2, f);
    }
    float x1[4] = {0};
    cr_assert_eq(kvpq_rope_rotate(x1, 1, 1, 4, 3, 0, f, NULL, 0, 1), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_rope_rotate(x1, 1, 1, 4, 6, 0, f, NULL, 0, 1), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_rope_rotate(x1, 1, 1, 4, 4, 0, f, NULL, 0, 2), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_rope_rotate(x1, 1, 1, 4, 4, 0, NULL, NULL, 0, 1), KVPQ_ERR_INVALID_ARG);
}

Test(cache_rope, every_head_dim_and_layout_matches_fp64) {
    const int len = quick() ? 200 : 330;
    const int dims[] = {16, 64, 128, 256};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        for (int neox = 0; neox < 2; neox++) {
            rope_cfg c = {.head_dim = dims[i], .n_rot = dims[i], .neox = neox, .n_head = 6, .n_head_kv = 2,
                          .window = 32};
            run_rope(&c, len);
        }
}

Test(cache_rope, partial_rotation_sinks_windows_norm_and_stages_match_fp64) {
    const int len = quick() ? 200 : 330;
    const rope_cfg cs[] = {
        {.head_dim = 64, .n_rot = 32, .neox = 1, .n_head = 4, .n_head_kv = 4, .window = 16},
        {.head_dim = 64, .n_rot = 64, .neox = 0, .n_head = 9, .n_head_kv = 3, .window = 0, .sinks = 3},
        {.head_dim = 128, .n_rot = 128, .neox = 1, .n_head = 8, .n_head_kv = 2, .window = 16, .sliding = 100},
        {.head_dim = 64, .n_rot = 64, .neox = 1, .n_head = 6, .n_head_kv = 2, .window = 16, .norm = 1, .sinks = 2},
        {.head_dim = 64, .n_rot = 64, .neox = 0, .n_head = 6, .n_head_kv = 2, .window = 16, .key2 = "d8b8"},
        {.head_dim = 64, .n_rot = 64, .neox = 1, .n_head = 6, .n_head_kv = 2, .window = 16, .keys = "d8b12"},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) run_rope(&cs[i], len);
}

/* Keys the codebook holds exactly: k_pre = lambda H x + mu with x made of centroids, appended after
 * RoPE at their sequence positions (sinks included). The cache turns them back, finds the same
 * centroids, and turns the reconstruction forward: read() returns the appended keys to fp16
 * precision, and attention equals exact fp64 attention over them; save and load give the same. */
Test(cache_rope, lossless_codes_give_the_appended_keys_and_exact_attention) {
    const int n = quick() ? 300 : 600;
    for (int neox = 0; neox < 2; neox++) {
        rope_cfg c = {.head_dim = 64, .n_rot = 64, .neox = neox, .n_head = 6, .n_head_kv = 2, .window = 16, .sinks = 4};
        kvpq_codebook *cb = rope_codebook(&c, 1, 11);
        const int d = c.head_dim, H = c.n_head_kv, M = 16;
        const float *C = kvpq_pq_centroids(kvpq_codebook_pq_const(cb, 0, 0)); /* shared (256, 4) */
        const float *lam = kvpq_codebook_key_smooth_const(cb, 0), *mu = kvpq_codebook_key_mean_const(cb, 0);
        float *k = malloc(sizeof(float) * n * H * d), *v = rand_vec((size_t)n * H * d, 3, 1.0f);
        uint64_t seed = 21;
        for (int r = 0; r < n * H; r++) {
            float *x = k + (size_t)r * d;
            for (int m = 0; m < M; m++) memcpy(x + 4 * m, C + 4 * (rng_next(&seed) % 256), 4 * sizeof(float));
            cr_assert_eq(kvpq_hadamard(x, 1, d), KVPQ_OK);
            for (int j = 0; j < d; j++) x[j] = x[j] * lam[(r % H) * d + j] + mu[(r % H) * d + j];
        }
        cr_assert_eq(kvpq_rope_rotate(k, n, H, d, c.n_rot, neox, kvpq_codebook_key_rope_freq_const(cb, 0), NULL, 0, 1),
                     KVPQ_OK);
        kvpq_cache *cache = rope_cache(cb, &c, 1, n);
        for (int t = 0; t < n; t += 97) {
            const int m = n - t < 97 ? n - t : 97;
            cr_assert_eq(kvpq_cache_append(cache, 0, m, k + (size_t)t * H * d, v + (size_t)t * H * d), KVPQ_OK);
        }
        kvpq_cache_stats st;
        cr_assert_eq(kvpq_cache_get_stats(cache, &st), KVPQ_OK);
        cr_assert_gt(st.tokens_coded, n / 2, "most positions coded");
        for (int round = 0; round < 2; round++) {
            float *kr = malloc(sizeof(float) * n * H * d), *vr = malloc(sizeof(float) * n * H * d);
            cr_assert_eq(kvpq_cache_read(cache, 0, 0, n, kr, vr), KVPQ_OK);
            double kmax = 0, kerr = 0;
            for (size_t i = 0; i < (size_t)n * H * d; i++) {
                kmax = fmax(kmax, fabs(k[i]));
                kerr = fmax(kerr, fabs(kr[i] - k[i]));
            }
            cr_assert(kerr <= 2e-3 * kmax, "neox %d round %d: keys read back off by %g (max |k| %g)", neox, round, kerr,
                      kmax);
            const int nq = 5;
            float *q = rand_vec((size_t)nq * c.n_head * d, 8, 1.0f), *out = malloc(sizeof(float) * nq * c.n_head * d);
            double *ref = malloc(sizeof(double) * nq * c.n_head * d);
            cr_assert_eq(kvpq_cache_attend(cache, 0, nq, q, out), KVPQ_OK);
            ref_attend(n, nq, c.n_head, H, d, k, vr, q, ref); /* exact keys; the values as coded */
            const double e = rel_err_f64(out, ref, (size_t)nq * c.n_head * d);
            cr_assert(e <= 2e-3, "neox %d round %d: attention vs exact over the appended keys: %g", neox, round, e);
            free(kr), free(vr), free(q), free(out), free(ref);
            if (round) break;
            /* save, load into a fresh cache, and check again */
            char path[64];
            snprintf(path, sizeof path, "/tmp/kvpq_rope_%d.kvpq", (int)getpid());
            cr_assert_eq(kvpq_cache_save(cache, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
            kvpq_cache_free(cache);
            const kvpq_cache_params lp = rope_params(cb, &c, 1, n);
            cr_assert_eq(kvpq_cache_load(&cache, &lp, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
            unlink(path);
        }
        kvpq_cache_free(cache);
        kvpq_codebook_free(cb);
        free(k), free(v);
    }
}

/* Without a usable device (a build without CUDA, or no GPU) the CUDA kind is refused for such a
 * codebook as for any; with one it serves it (tests/gpu/cache_backend_check.c, the rope configs). */
Test(cache_rope, cuda_backend_needs_a_device) {
    if (kvpq_cuda_available(NULL, 0)) cr_skip_test("a device is present: tests/gpu/cache_backend_check.c covers it");
    rope_cfg c = {.head_dim = 64, .n_rot = 64, .n_head = 2, .n_head_kv = 2, .window = 8};
    kvpq_codebook *cb = rope_codebook(&c, 1, 3);
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = 1, p.n_head = 2, p.n_head_kv = 2, p.head_dim = 64, p.max_seq = 64;
    p.codebook = cb;
    p.backend = KVPQ_BACKEND_CUDA;
    kvpq_cache *cache = NULL;
    const kvpq_status s = kvpq_cache_new(&cache, &p);
    cr_assert_neq(s, KVPQ_OK);
    cr_assert_null(cache);
    kvpq_codebook_free(cb);
}

/* A frequency set in memory that is NaN, Inf or negative is refused by the cache and by calibration
 * by name, before anything is stored (the key mean stays as it was); n = 0 rotates nothing. */
Test(cache_rope, bad_frequencies_are_refused_by_name) {
    rope_cfg c = {.head_dim = 64, .n_rot = 64, .n_head = 2, .n_head_kv = 2, .window = 8};
    const float bad[] = {NAN, INFINITY, -1.0f};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvpq_codebook *cb = rope_codebook(&c, 1, 3);
        kvpq_codebook_key_rope_freq(cb, 0)[5] = bad[i];
        const kvpq_cache_params p = rope_params(cb, &c, 1, 64);
        kvpq_cache *cache = NULL;
        cr_assert_eq(kvpq_cache_new(&cache, &p), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "RoPE frequency 5"), "%s", kvpq_last_error());
        float *k = rand_vec(64 * 2 * 64, 4, 1.0f), mu0 = kvpq_codebook_key_mean_const(cb, 0)[0];
        kvpq_calibrate_params cp = kvpq_calibrate_params_default();
        int32_t pos[64];
        for (int t = 0; t < 64; t++) pos[t] = t;
        cp.positions = pos;
        cr_assert_eq(kvpq_codebook_calibrate_layer(cb, 0, 64, k, k, &cp, NULL, NULL), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "RoPE frequency 5"), "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_key_mean_const(cb, 0)[0], mu0, "nothing stored");
        free(k);
        kvpq_codebook_free(cb);
    }
    cr_assert_eq(kvpq_rope_rotate(NULL, 0, 1, 8, 8, 0, NULL, NULL, 0, 1), KVPQ_OK);
}
