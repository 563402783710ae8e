/* test_cache_short.c — every cache kind with sequences shorter than, equal to and just longer than
 * its window (W = 128, the default) and its pages (256): prompt lengths 1, W-1, W, W+1 with max_seq
 * sized as `kvpq generate` sizes it (prompt + a few generated tokens) and exactly the prompt, the
 * default window and pages left as they are (issue 15: a window or page longer than the sequence
 * means the whole sequence). Each case prefills the prompt in one append, attends every position,
 * then decodes; attention is checked against fp64 attention over the cache's own read-back K/V, and
 * positions still inside the window read back as their fp16 rounding. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache_testutil.h"
#include "kvpq.h"

/* Attention vs fp64 over read(): float32 sums over at most a few hundred positions and the SIMD exp;
 * the VQ cache's LUT sums as in test_cache_vq.c (ATTEND_TOL there). */
#define ATTN_RTOL 2e-4
/* fp16 rounding of N(0,1) values: half an ulp of 2^-10 relative, max over values up to ~5 sigma. */
#define FP16_ABS 4e-3

#define W 128
#define N_HEAD 9
#define N_HEAD_KV 3
#define HD 64

/* A VQ codebook (d4b8 keys and values) trained on Gaussian data through the public API. */
static kvpq_codebook *make_codebook(int n_layer, int norm) {
    kvpq_codebook *cb = test_codebook(&(test_codebook_spec){.n_layer = n_layer, .n_head_kv = N_HEAD_KV, .head_dim = HD,
                                                            .norm = norm, .seed = 900, .seed_step = 1,
                                                            .train_points = -1, .max_points_per_centroid = 2});
    cr_assert_not_null(cb, "%s", kvpq_last_error());
    return cb;
}

/* One prompt of n positions into a cache of max_seq positions (default window and pages), attend
 * all n, then decode n_dec positions one by one. */
static void run_case(kvpq_cache_type t, const kvpq_codebook *cb, int n, int max_seq, int n_dec, uint64_t seed) {
    const char *tn = kvpq_cache_type_name(t);
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = 1;
    p.n_head = N_HEAD;
    p.n_head_kv = N_HEAD_KV;
    p.head_dim = HD;
    p.max_seq = max_seq;
    p.codebook = cb;
    p.n_threads = 2;
    cr_assert_eq(p.window, W, "the default window this test is about");
    kvpq_cache *c = NULL;
    kvpq_status s = kvpq_cache_new(&c, &p);
    cr_assert_eq(s, KVPQ_OK, "%s prompt %d max_seq %d: %s: %s", tn, n, max_seq, kvpq_status_string(s),
                 kvpq_last_error());
    const size_t kvw = (size_t)N_HEAD_KV * HD, qw = (size_t)N_HEAD * HD;
    const int L = n + n_dec;
    float *k = rand_vec((size_t)L * kvw, seed, 1.0f), *v = rand_vec((size_t)L * kvw, seed + 1, 1.0f);
    float *q = rand_vec((size_t)L * qw, seed + 2, 1.0f);
    float *out = malloc((size_t)L * qw * sizeof *out);
    float *kr = malloc((size_t)L * kvw * sizeof *kr), *vr = malloc((size_t)L * kvw * sizeof *vr);
    double *ref = malloc((size_t)L * qw * sizeof *ref);

    cr_assert_eq(kvpq_cache_append(c, 0, n, k, v), KVPQ_OK, "%s prompt %d: %s", tn, n, kvpq_last_error());
    cr_assert_eq(kvpq_cache_attend(c, 0, n, q, out), KVPQ_OK, "%s prompt %d: %s", tn, n, kvpq_last_error());
    cr_assert_eq(kvpq_cache_read(c, 0, 0, n, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
    ref_attend(n, n, N_HEAD, N_HEAD_KV, HD, kr, vr, q, ref);
    double e = rel_err_f64(out, ref, (size_t)n * qw);
    cr_assert(e < ATTN_RTOL, "%s prompt %d max_seq %d: prefill rel err %.3g", tn, n, max_seq, e);

    for (int i = 0; i < n_dec; i++) {
        const int pos = n + i;
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s decode %d: %s", tn, pos,
                     kvpq_last_error());
        cr_assert_eq(kvpq_cache_attend(c, 0, 1, q + pos * qw, out), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_read(c, 0, 0, pos + 1, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
        ref_attend(pos + 1, 1, N_HEAD, N_HEAD_KV, HD, kr, vr, q + pos * qw, ref);
        e = rel_err_f64(out, ref, qw);
        cr_assert(e < ATTN_RTOL, "%s prompt %d decode position %d: rel err %.3g", tn, n, pos, e);
    }
    cr_assert_eq(kvpq_cache_seq_len(c, 0), L);

    /* The windowed kinds keep the newest min(L, W) positions, at least, in fp16: those read back
     * as their fp16 rounding, not coded. */
    if (t == KVPQ_CACHE_VQ || t == KVPQ_CACHE_KIVI2 || t == KVPQ_CACHE_KIVI4) {
        kvpq_cache_stats st;
        cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
        const int held = L < W ? L : W;
        cr_assert(st.tokens_window >= held, "%s L %d: %lld positions in the window, expected >= %d", tn, L,
                  (long long)st.tokens_window, held);
        cr_assert_eq(st.tokens_coded + st.tokens_window, L);
        cr_assert_eq(kvpq_cache_read(c, 0, L - held, held, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
        double worst = 0;
        for (size_t i = 0; i < (size_t)held * kvw; i++) {
            double dk = fabs(kr[i] - k[(size_t)(L - held) * kvw + i]), dv = fabs(vr[i] - v[(size_t)(L - held) * kvw + i]);
            if (dk > worst) worst = dk;
            if (dv > worst) worst = dv;
        }
        cr_assert(worst < FP16_ABS, "%s L %d: window read-back differs by %g from the input", tn, L, worst);
    }
    free(k), free(v), free(q), free(out), free(kr), free(vr), free(ref);
    kvpq_cache_free(c);
}

static void every_length(kvpq_cache_type t, const kvpq_codebook *cb, uint64_t seed) {
    static const int lens[] = {1, W - 1, W, W + 1};
    for (int i = 0; i < 4; i++) {
        const int n = lens[i];
        run_case(t, cb, n, n, 0, seed + 10u * i);          /* max_seq exactly the prompt */
        run_case(t, cb, n, n + 4, 3, seed + 10u * i + 3u); /* generate's sizing: prompt + n + 1 */
    }
    /* A prompt that crosses the window by a whole flush (VQ/KIVI encode in batches of 32). */
    run_case(t, cb, W + 40, W + 48, 5, seed + 99u);
}

Test(cache_short, every_baseline_kind_prompt_1_Wm1_W_Wp1) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,
                                            KVPQ_CACHE_Q4_0,  KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4};
    for (int i = 0; i < 6; i++) every_length(kinds[i], NULL, 1000u + 100u * i);
}

Test(cache_short, vq_prompt_1_Wm1_W_Wp1) {
    for (int norm = 0; norm < 2; norm++) {
        kvpq_codebook *cb = make_codebook(1, norm);
        every_length(KVPQ_CACHE_VQ, cb, 2000u + 100u * norm);
        kvpq_codebook_free(cb);
    }
}

Test(cache_short, window_and_pages_clamped_not_refused) {
    /* Windows and pages far beyond max_seq (ppl --ctx 100 with the default window of 128). */
    kvpq_codebook *cb = make_codebook(1, 1);
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP16, KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_VQ};
    for (int i = 0; i < 4; i++) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = kinds[i];
        p.n_layer = 1, p.n_head = N_HEAD, p.n_head_kv = N_HEAD_KV, p.head_dim = HD;
        p.max_seq = 100;
        p.window = 1 << 20;
        p.page_tokens = 1 << 20;
        p.codebook = cb;
        kvpq_cache *c = NULL;
        cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s: %s", kvpq_cache_type_name(p.type), kvpq_last_error());
        float *k = rand_vec(100 * N_HEAD_KV * HD, 7u + i, 1.0f);
        cr_assert_eq(kvpq_cache_append(c, 0, 100, k, k), KVPQ_OK, "%s", kvpq_last_error());
        /* Pages clamped to the sequence: no page of 2^20 positions is resident. */
        size_t bytes = kvpq_cache_resident_bytes(c);
        cr_assert(bytes < (size_t)64 << 20, "%s: %zu bytes resident for 100 positions", kvpq_cache_type_name(p.type),
                  bytes);
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k, k), KVPQ_ERR_CAPACITY, "max_seq still holds");
        free(k);
        kvpq_cache_free(c);
    }
    kvpq_codebook_free(cb);
}
