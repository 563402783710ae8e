/* test_cache.c — the KV-cache API (cache.c) and every CPU kind: attention against an fp64
 * reference over what kvpq_cache_read returns, causal prefill, GQA, pages, truncate, errors, SIMD. */
#include <criterion/criterion.h>
#include <limits.h>
#include <string.h>

#include "cache_testutil.h"
#include "kvpq.h"

/* Attention vs the fp64 reference over the same (dequantized) K/V: float32 accumulation over a
 * few hundred tokens and the polynomial exp of the SIMD levels stay well inside this. */
#define ATTN_RTOL 2e-5
/* Two float32 evaluation orders of the same attention (split-KV merge vs one pass). */
#define ORDER_RTOL 2e-5

typedef struct {
    kvpq_cache_type type;
    double max_rel_rms; /* read-back error bound on N(0,1) data: relative RMS */
    int windowed;       /* KIVI: what a position holds depends on the positions after it */
} kind_info;

static const kind_info KINDS[] = {
    {KVPQ_CACHE_FP32, 0.0, 0},
    {KVPQ_CACHE_FP16, 5e-4, 0},  /* 11-bit significand: ~2^-12 relative per element */
    {KVPQ_CACHE_Q8_0, 0.01, 0},  /* brief: < 1% */
    {KVPQ_CACHE_Q4_0, 0.15, 0},  /* 16 levels over [-amax, amax]: ~10% on Gaussian blocks */
    {KVPQ_CACHE_KIVI2, 0.5, 1},  /* 4 levels over a group's [min, max] (~4 sigma): ~0.35 sigma RMS */
    {KVPQ_CACHE_KIVI4, 0.12, 1}, /* 16 levels: ~0.08 sigma RMS */
};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

static kvpq_cache *make(kvpq_cache_type t, int n_layer, int n_head, int n_head_kv, int hd, int max_seq, int page,
                        int window) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = n_layer;
    p.n_head = n_head;
    p.n_head_kv = n_head_kv;
    p.head_dim = hd;
    p.max_seq = max_seq;
    p.page_tokens = page;
    p.window = window;
    kvpq_cache *c = NULL;
    kvpq_status s = kvpq_cache_new(&c, &p);
    cr_assert_eq(s, KVPQ_OK, "cache_new %s: %s", kvpq_cache_type_name(t), kvpq_last_error());
    return c;
}

/* Append L positions in uneven pieces (crossing page boundaries), then attend the last n_q, and
 * compare with fp64 attention over the cache's own read-back K/V. */
static void check_vs_ref(kvpq_cache_type t, int n_head, int n_head_kv, int hd, int L, int n_q, int page, int window,
                         uint64_t seed) {
    const size_t kvw = (size_t)n_head_kv * hd;
    kvpq_cache *c = make(t, 2, n_head, n_head_kv, hd, L + 8, page, window);
    float *k = rand_vec((size_t)L * kvw, seed, 1.0f), *v = rand_vec((size_t)L * kvw, seed + 1, 1.0f);
    float *q = rand_vec((size_t)n_q * n_head * hd, seed + 2, 1.0f);
    int pos = 0, piece = 1;
    while (pos < L - n_q) {
        int n = piece < L - n_q - pos ? piece : L - n_q - pos;
        cr_assert_eq(kvpq_cache_append(c, 1, n, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s", kvpq_last_error());
        pos += n;
        piece = piece * 3 + 1;
    }
    cr_assert_eq(kvpq_cache_append(c, 1, n_q, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(c, 1), L);
    cr_assert_eq(kvpq_cache_seq_len(c, 0), 0);
    float *out = malloc((size_t)n_q * n_head * hd * sizeof *out);
    cr_assert_eq(kvpq_cache_attend(c, 1, n_q, q, out), KVPQ_OK, "%s", kvpq_last_error());
    float *kr = malloc((size_t)L * kvw * sizeof *kr), *vr = malloc((size_t)L * kvw * sizeof *vr);
    cr_assert_eq(kvpq_cache_read(c, 1, 0, L, kr, vr), KVPQ_OK);
    double *ref = malloc((size_t)n_q * n_head * hd * sizeof *ref);
    ref_attend(L, n_q, n_head, n_head_kv, hd, kr, vr, q, ref);
    double e = rel_err_f64(out, ref, (size_t)n_q * n_head * hd);
    cr_assert(e < ATTN_RTOL, "%s n_head %d/%d hd %d L %d n_q %d page %d: rel err %.3g vs fp64 reference",
              kvpq_cache_type_name(t), n_head, n_head_kv, hd, L, n_q, page, e);
    free(k), free(v), free(q), free(out), free(kr), free(vr), free(ref);
    kvpq_cache_free(c);
}

Test(cache, attend_matches_fp64_reference_every_kind_gqa_and_head_dim) {
    static const int gqa[][2] = {{4, 4}, {9, 3}, {8, 2}, {8, 1}}; /* ratios 1, 3, 4, 8 */
    static const int hds[] = {64, 128, 256};
    const int L = quick() ? 150 : 300;
    for (int k = 0; k < N_KINDS; k++)
        for (int g = 0; g < 4; g++)
            for (int h = 0; h < 3; h++)
                check_vs_ref(KINDS[k].type, gqa[g][0], gqa[g][1], hds[h], L, 1 + (g + h) % 3 * 7, 64, 32,
                             100u + 10u * k + g + h);
}

Test(cache, attend_long_decode_uses_split_merge) {
    /* Long enough that the driver splits the token range across threads and merges {m, d, o}. */
    const int L = quick() ? 1200 : 3000;
    for (int k = 0; k < N_KINDS; k++) check_vs_ref(KINDS[k].type, 9, 3, 64, L, 1, 256, 128, 7u + k);
}

Test(cache, whole_prefill_from_empty_and_tiny_pages) {
    /* n_q == L: every position is a query (first prompt block); pages of 1 and 7 tokens. */
    for (int k = 0; k < N_KINDS; k++) {
        check_vs_ref(KINDS[k].type, 4, 2, 64, 100, 100, 1, 32, 200u + k);
        check_vs_ref(KINDS[k].type, 8, 2, 32, 180, 37, 7, 0, 210u + k);
    }
}

Test(cache, odd_head_dim_and_page_sizes_fp) {
    /* fp32/fp16 accept any head_dim: SIMD tails; pages of 1, 7 and 100 tokens. */
    static const int pages[] = {1, 7, 100};
    for (int i = 0; i < 3; i++) {
        check_vs_ref(KVPQ_CACHE_FP32, 6, 2, 37, 211, 5, pages[i], 16, 50u + i);
        check_vs_ref(KVPQ_CACHE_FP16, 6, 2, 20, 211, 5, pages[i], 16, 60u + i);
        check_vs_ref(KVPQ_CACHE_FP16, 6, 2, 24, 211, 5, pages[i], 16, 70u + i);
    }
}

Test(cache, prefill_block_equals_single_token_attends) {
    /* window 128: n_coded is 32 for every length in [162, 190], so KIVI holds the same values
     * whether the block comes at once or one position at a time. */
    const int n_head = 8, n_head_kv = 2, hd = 64, L0 = 162, n_q = 28;
    const size_t kvw = (size_t)n_head_kv * hd, qw = (size_t)n_head * hd;
    float *k = rand_vec((size_t)(L0 + n_q) * kvw, 11, 1.0f), *v = rand_vec((size_t)(L0 + n_q) * kvw, 12, 1.0f);
    float *q = rand_vec((size_t)n_q * qw, 13, 1.0f);
    float *ob = malloc(n_q * qw * sizeof(float)), *os = malloc(n_q * qw * sizeof(float));
    for (int kk = 0; kk < N_KINDS; kk++) {
        kvpq_cache *a = make(KINDS[kk].type, 1, n_head, n_head_kv, hd, 1024, 64, 128);
        kvpq_cache *b = make(KINDS[kk].type, 1, n_head, n_head_kv, hd, 1024, 64, 128);
        cr_assert_eq(kvpq_cache_append(a, 0, L0 + n_q, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_attend(a, 0, n_q, q, ob), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(b, 0, L0, k, v), KVPQ_OK);
        for (int i = 0; i < n_q; i++) {
            cr_assert_eq(kvpq_cache_append(b, 0, 1, k + (L0 + i) * kvw, v + (L0 + i) * kvw), KVPQ_OK);
            cr_assert_eq(kvpq_cache_attend(b, 0, 1, q + i * qw, os + i * qw), KVPQ_OK);
        }
        double num = 0, den = 1e-30;
        for (size_t i = 0; i < n_q * qw; i++) {
            num = fmax(num, fabs(ob[i] - os[i]));
            den = fmax(den, fabs(os[i]));
        }
        cr_assert(num / den < ORDER_RTOL, "%s: prefill vs single-token rel diff %.3g",
                  kvpq_cache_type_name(KINDS[kk].type), num / den);
        kvpq_cache_free(a);
        kvpq_cache_free(b);
    }
    free(k), free(v), free(q), free(ob), free(os);
}

Test(cache, read_back_error_per_kind) {
    const int L = 256, hkv = 2, hd = 128;
    const size_t n = (size_t)L * hkv * hd;
    float *k = rand_vec(n, 21, 1.0f), *v = rand_vec(n, 22, 1.0f);
    float *kr = malloc(n * sizeof *kr), *vr = malloc(n * sizeof *vr);
    for (int kk = 0; kk < N_KINDS; kk++) {
        kvpq_cache *c = make(KINDS[kk].type, 1, 4, hkv, hd, L, 256, 32);
        cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, kr, vr), KVPQ_OK);
        double ek = 0, ev = 0, nk = 0, nv = 0;
        for (size_t i = 0; i < n; i++) {
            ek += (kr[i] - k[i]) * (double)(kr[i] - k[i]);
            ev += (vr[i] - v[i]) * (double)(vr[i] - v[i]);
            nk += k[i] * (double)k[i];
            nv += v[i] * (double)v[i];
        }
        double rk = sqrt(ek / nk), rv = sqrt(ev / nv);
        cr_assert(rk <= KINDS[kk].max_rel_rms && rv <= KINDS[kk].max_rel_rms, "%s: rel RMS K %.3g V %.3g > %.3g",
                  kvpq_cache_type_name(KINDS[kk].type), rk, rv, KINDS[kk].max_rel_rms);
        if (KINDS[kk].type != KVPQ_CACHE_FP32) cr_assert(rk > 0, "a lossy kind that loses nothing is suspicious");
        kvpq_cache_free(c);
    }
    free(k), free(v), free(kr), free(vr);
}

Test(cache, bits_per_element_and_pages) {
    static const double bpe[] = {32.0, 16.0, 8.5, 4.5};
    for (int kk = 0; kk < N_KINDS; kk++) {
        if (KINDS[kk].windowed) continue; /* test_cache_kivi.c counts KIVI's bytes */
        kvpq_cache *c = make(KINDS[kk].type, 2, 4, 2, 64, 4096, 256, 128);
        cr_assert_eq(kvpq_cache_resident_bytes(c) < 4096, 1, "an empty cache holds no pages");
        const int L = 512; /* two full pages */
        float *k = rand_vec((size_t)L * 128, 31, 1.0f);
        for (int l = 0; l < 2; l++) cr_assert_eq(kvpq_cache_append(c, l, L, k, k), KVPQ_OK);
        kvpq_cache_stats st;
        cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
        cr_assert_eq(st.elements, 2 * 2 * L * 2 * 64);
        cr_assert(st.bits_per_element >= bpe[kk] && st.bits_per_element < bpe[kk] * 1.01, "%s: %.4f bits/elem",
                  kvpq_cache_type_name(KINDS[kk].type), st.bits_per_element);
        cr_assert_eq(st.resident_bytes, kvpq_cache_resident_bytes(c));
        cr_assert_eq(st.backend, KVPQ_BACKEND_CPU);
        /* One more position allocates a page of 256 on the layer that grows. */
        size_t before = kvpq_cache_resident_bytes(c);
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k, k), KVPQ_OK);
        size_t page = (size_t)(bpe[kk] / 8 * 2 * 64 * 256) * 2; /* K and V pages of 2 heads */
        cr_assert(kvpq_cache_resident_bytes(c) >= before + page, "%s: page not counted",
                  kvpq_cache_type_name(KINDS[kk].type));
        /* Truncating frees whole pages beyond the new length. */
        cr_assert_eq(kvpq_cache_truncate(c, 256), KVPQ_OK);
        cr_assert(kvpq_cache_resident_bytes(c) < before, "truncate frees pages");
        free(k);
        kvpq_cache_free(c);
    }
}

Test(cache, truncate_then_append_equals_fresh) {
    const int hkv = 2, hd = 64, L = 700, T = 333, X = 150;
    const size_t kvw = (size_t)hkv * hd;
    float *k = rand_vec((size_t)L * kvw, 41, 1.0f), *v = rand_vec((size_t)L * kvw, 42, 1.0f);
    float *k2 = rand_vec((size_t)X * kvw, 43, 1.0f), *v2 = rand_vec((size_t)X * kvw, 44, 1.0f);
    float *q = rand_vec((size_t)4 * 8 * hd, 45, 1.0f);
    const size_t nr = (size_t)(T + X) * kvw;
    float *ka = malloc(nr * 4), *va = malloc(nr * 4), *kb = malloc(nr * 4), *vb = malloc(nr * 4);
    float *oa = malloc(4 * 8 * hd * 4), *ob = malloc(4 * 8 * hd * 4);
    for (int kk = 0; kk < N_KINDS; kk++) {
        if (KINDS[kk].windowed) continue; /* test_cache_kivi.c: exact only while n_coded is kept */
        kvpq_cache *a = make(KINDS[kk].type, 2, 8, hkv, hd, 1024, 128, 64);
        kvpq_cache *b = make(KINDS[kk].type, 2, 8, hkv, hd, 1024, 128, 64);
        cr_assert_eq(kvpq_cache_append(a, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(a, 1, 100, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_truncate(a, T), KVPQ_OK);
        cr_assert_eq(kvpq_cache_seq_len(a, 0), T);
        cr_assert_eq(kvpq_cache_seq_len(a, 1), 100, "a shorter layer keeps its positions");
        cr_assert_eq(kvpq_cache_append(a, 0, X, k2, v2), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(b, 0, T, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(b, 0, X, k2, v2), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(a, 0, 0, T + X, ka, va), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(b, 0, 0, T + X, kb, vb), KVPQ_OK);
        cr_assert(!memcmp(ka, kb, nr * 4) && !memcmp(va, vb, nr * 4), "%s: truncate+append differs from fresh",
                  kvpq_cache_type_name(KINDS[kk].type));
        cr_assert_eq(kvpq_cache_attend(a, 0, 4, q, oa), KVPQ_OK);
        cr_assert_eq(kvpq_cache_attend(b, 0, 4, q, ob), KVPQ_OK);
        cr_assert(!memcmp(oa, ob, 4 * 8 * hd * 4), "%s: attention differs", kvpq_cache_type_name(KINDS[kk].type));
        kvpq_cache_free(a);
        kvpq_cache_free(b);
    }
    free(k), free(v), free(k2), free(v2), free(q), free(ka), free(va), free(kb), free(vb), free(oa), free(ob);
}

Test(cache, nonfinite_rejected_and_cache_unchanged) {
    const int hkv = 3, hd = 64, L = 100;
    const size_t kvw = (size_t)hkv * hd;
    float *k = rand_vec((size_t)(L + 10) * kvw, 51, 1.0f), *v = rand_vec((size_t)(L + 10) * kvw, 52, 1.0f);
    float *r0 = malloc((size_t)L * kvw * 4), *r1 = malloc((size_t)L * kvw * 4);
    for (int kk = 0; kk < N_KINDS; kk++) {
        kvpq_cache *c = make(KINDS[kk].type, 1, 9, hkv, hd, 1024, 64, 32);
        cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, r0, NULL), KVPQ_OK);
        size_t bytes = kvpq_cache_resident_bytes(c);
        float *kb = k + L * kvw;
        kb[7 * kvw + 1 * hd + 5] = NAN; /* position L+7, head 1, dim 5 */
        kvpq_status s = kvpq_cache_append(c, 0, 10, kb, v + L * kvw);
        cr_assert_eq(s, KVPQ_ERR_NONFINITE);
        cr_assert(strstr(kvpq_last_error(), "NaN") && strstr(kvpq_last_error(), "position 107") &&
                      strstr(kvpq_last_error(), "head 1") && strstr(kvpq_last_error(), "dim 5"),
                  "message: %s", kvpq_last_error());
        kb[7 * kvw + 1 * hd + 5] = 0.0f;
        v[(L + 2) * kvw] = INFINITY;
        cr_assert_eq(kvpq_cache_append(c, 0, 10, kb, v + L * kvw), KVPQ_ERR_NONFINITE);
        cr_assert(strstr(kvpq_last_error(), "V is Inf"), "message: %s", kvpq_last_error());
        v[(L + 2) * kvw] = 0.0f;
        cr_assert_eq(kvpq_cache_seq_len(c, 0), L);
        cr_assert_eq(kvpq_cache_resident_bytes(c), bytes);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, r1, NULL), KVPQ_OK);
        cr_assert(!memcmp(r0, r1, (size_t)L * kvw * 4));
        float q[9 * 64] = {0};
        q[3] = NAN;
        float o[9 * 64];
        cr_assert_eq(kvpq_cache_attend(c, 0, 1, q, o), KVPQ_ERR_NONFINITE);
        kvpq_cache_free(c);
    }
    free(k), free(v), free(r0), free(r1);
}

Test(cache, capacity_exceeded) {
    float *k = rand_vec(200 * 64, 61, 1.0f);
    for (int kk = 0; kk < N_KINDS; kk++) {
        kvpq_cache *c = make(KINDS[kk].type, 1, 2, 1, 64, 100, 32, 16);
        cr_assert_eq(kvpq_cache_append(c, 0, 90, k, k), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(c, 0, 11, k, k), KVPQ_ERR_CAPACITY);
        cr_assert(strstr(kvpq_last_error(), "max_seq 100"), "message: %s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_seq_len(c, 0), 90);
        cr_assert_eq(kvpq_cache_append(c, 0, 10, k, k), KVPQ_OK);
        cr_assert_eq(kvpq_cache_seq_len(c, 0), 100);
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k, k), KVPQ_ERR_CAPACITY);
        kvpq_cache_free(c);
    }
    free(k);
}

static void expect_bad(kvpq_cache_params p, kvpq_status want, const char *needle) {
    kvpq_cache *c = (kvpq_cache *)&p; /* must be reset to NULL on failure */
    kvpq_status s = kvpq_cache_new(&c, &p);
    cr_assert_eq(s, want, "expected %s for '%s', got %s (%s)", kvpq_status_string(want), needle, kvpq_status_string(s),
                 kvpq_last_error());
    cr_assert_null(c);
    cr_assert(strstr(kvpq_last_error(), needle), "message '%s' lacks '%s'", kvpq_last_error(), needle);
}

Test(cache, bad_params_named) {
    kvpq_cache_params p = kvpq_cache_params_default(), b;
    b = p, b.n_head = 8, b.n_head_kv = 3;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "n_head_kv 3");
    b = p, b.head_dim = 0;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "head_dim 0");
    b = p, b.max_seq = 0;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "max_seq 0");
    b = p, b.n_layer = -1;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "n_layer -1");
    b = p, b.page_tokens = 0;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "page_tokens 0");
    b = p, b.window = -5;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "window -5");
    b = p, b.type = (kvpq_cache_type)99;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "cache type 99");
    b = p, b.type = KVPQ_CACHE_Q8_0, b.head_dim = 48;
    expect_bad(b, KVPQ_ERR_UNSUPPORTED, "head_dim 48");
    b = p, b.type = KVPQ_CACHE_Q4_0, b.head_dim = 40;
    expect_bad(b, KVPQ_ERR_UNSUPPORTED, "q4_0");
    b = p, b.type = KVPQ_CACHE_VQ, b.codebook = NULL;
    expect_bad(b, KVPQ_ERR_INVALID_ARG, "codebook");
    b = p, b.type = KVPQ_CACHE_FP32, b.backend = KVPQ_BACKEND_CUDA;
    kvpq_cache *c = NULL;
    kvpq_status s = kvpq_cache_new(&c, &b);
    cr_assert(s == KVPQ_ERR_NO_DEVICE || s == KVPQ_ERR_UNSUPPORTED, "cuda for a CPU kind: %s", kvpq_status_string(s));
    cr_assert_null(c);
    cr_assert_eq(kvpq_cache_new(NULL, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_new(&c, NULL), KVPQ_ERR_INVALID_ARG);
    kvpq_cache_free(NULL);
}

Test(cache, bad_calls_named) {
    kvpq_cache *c = make(KVPQ_CACHE_FP32, 2, 4, 2, 64, 100, 32, 16);
    float k[2 * 64 * 4] = {0}, o[4 * 64];
    cr_assert_eq(kvpq_cache_append(c, 2, 1, k, k), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "layer 2"));
    cr_assert_eq(kvpq_cache_append(c, 0, -1, k, k), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_append(c, 0, 1, NULL, k), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_append(NULL, 0, 1, k, k), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_append(c, 0, 0, NULL, NULL), KVPQ_OK);
    cr_assert_eq(kvpq_cache_attend(c, 0, 1, k, o), KVPQ_ERR_INVALID_ARG, "attend on an empty layer");
    cr_assert_eq(kvpq_cache_append(c, 0, 1, k, k), KVPQ_OK);
    cr_assert_eq(kvpq_cache_attend(c, 0, 2, k, o), KVPQ_ERR_INVALID_ARG, "n_q beyond the positions held");
    cr_assert_eq(kvpq_cache_read(c, 0, 0, 2, k, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "[0, 2)"));
    cr_assert_eq(kvpq_cache_read(c, 0, -1, 1, k, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_truncate(c, -1), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_seq_len(c, 7), 0);
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(c, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
    kvpq_cache_free(c);
}

Test(cache, type_parse_and_names) {
    static const char *specs[] = {"fp32", "fp16", "q8_0", "q4_0", "kivi2", "kivi4"};
    for (int i = 0; i < 6; i++) {
        kvpq_cache_type t;
        const char *path = "x";
        cr_assert_eq(kvpq_cache_type_parse(specs[i], &t, &path), KVPQ_OK);
        cr_assert_eq((int)t, i);
        cr_assert_null(path);
        cr_assert_str_eq(kvpq_cache_type_name(t), specs[i]);
    }
    kvpq_cache_type t;
    const char *path = NULL;
    cr_assert_eq(kvpq_cache_type_parse("vq:cb/a.safetensors", &t, &path), KVPQ_OK);
    cr_assert_eq(t, KVPQ_CACHE_VQ);
    cr_assert_str_eq(path, "cb/a.safetensors");
    cr_assert_eq(kvpq_cache_type_parse("vq:", &t, &path), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_type_parse("vq", &t, &path), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_cache_type_parse("q5_1", &t, &path), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "'q5_1'"));
    cr_assert_str_eq(kvpq_cache_type_name(KVPQ_CACHE_VQ), "vq");
    cr_assert_str_eq(kvpq_cache_type_name((kvpq_cache_type)42), "unknown");
    kvpq_cache_params p = kvpq_cache_params_default();
    cr_assert_eq(p.window, 128);
    cr_assert_eq(p.page_tokens, 256);
}

Test(cache, backend_resolve) {
    kvpq_backend got = KVPQ_BACKEND_CUDA;
    cr_assert_eq(kvpq_backend_resolve(KVPQ_BACKEND_CPU, &got), KVPQ_OK);
    cr_assert_eq(got, KVPQ_BACKEND_CPU);
    cr_assert_eq(kvpq_backend_resolve(KVPQ_BACKEND_AUTO, &got), KVPQ_OK);
    cr_assert(got == KVPQ_BACKEND_CPU || got == KVPQ_BACKEND_CUDA);
    kvpq_status s = kvpq_backend_resolve(KVPQ_BACKEND_CUDA, &got);
    if (s != KVPQ_OK) {
        cr_assert_eq(s, KVPQ_ERR_NO_DEVICE);
        cr_assert(strlen(kvpq_last_error()) > strlen("backend cuda: "), "says why: %s", kvpq_last_error());
    }
    cr_assert_eq(kvpq_backend_resolve((kvpq_backend)7, &got), KVPQ_ERR_INVALID_ARG);
    cr_assert_str_eq(kvpq_backend_name(KVPQ_BACKEND_CUDA), "cuda");
    cr_assert_str_eq(kvpq_backend_name(KVPQ_BACKEND_AUTO), "auto");
    cr_assert_str_eq(kvpq_backend_name(KVPQ_BACKEND_CPU), "cpu");
}

Test(cache, every_simd_level_equals_scalar) {
    const int n_head = 9, n_head_kv = 3, hd = 64, L = 700, n_q = 3;
    const size_t kvw = (size_t)n_head_kv * hd, qw = (size_t)n_head * hd;
    float *k = rand_vec((size_t)L * kvw, 71, 1.0f), *v = rand_vec((size_t)L * kvw, 72, 1.0f);
    float *q = rand_vec(n_q * qw, 73, 1.0f);
    float *o0 = malloc(n_q * qw * 4), *o1 = malloc(n_q * qw * 4);
    float *r0 = malloc((size_t)L * kvw * 4), *r1 = malloc((size_t)L * kvw * 4);
    kvpq_simd_level best = kvpq_simd_get();
    for (int kk = 0; kk < N_KINDS; kk++) {
        cr_assert_eq(kvpq_simd_set(KVPQ_SIMD_SCALAR), KVPQ_OK);
        kvpq_cache *c0 = make(KINDS[kk].type, 1, n_head, n_head_kv, hd, L, 256, 128);
        cr_assert_eq(kvpq_cache_append(c0, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_attend(c0, 0, n_q, q, o0), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c0, 0, 0, L, r0, NULL), KVPQ_OK);
        for (int lv = KVPQ_SIMD_AVX2; lv <= (int)best; lv++) {
            cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
            kvpq_cache *c1 = make(KINDS[kk].type, 1, n_head, n_head_kv, hd, L, 256, 128);
            cr_assert_eq(kvpq_cache_append(c1, 0, L, k, v), KVPQ_OK);
            cr_assert_eq(kvpq_cache_read(c1, 0, 0, L, r1, NULL), KVPQ_OK);
            cr_assert(!memcmp(r0, r1, (size_t)L * kvw * 4), "%s at %s: stored values differ from scalar",
                      kvpq_cache_type_name(KINDS[kk].type), kvpq_simd_name((kvpq_simd_level)lv));
            cr_assert_eq(kvpq_cache_attend(c1, 0, n_q, q, o1), KVPQ_OK);
            double num = 0, den = 1e-30;
            for (size_t i = 0; i < n_q * qw; i++) {
                num = fmax(num, fabs(o0[i] - o1[i]));
                den = fmax(den, fabs(o0[i]));
            }
            cr_assert(num / den < ORDER_RTOL, "%s at %s: rel diff %.3g from scalar",
                      kvpq_cache_type_name(KINDS[kk].type), kvpq_simd_name((kvpq_simd_level)lv), num / den);
            kvpq_cache_free(c1);
        }
        kvpq_cache_free(c0);
    }
    free(k), free(v), free(q), free(o0), free(o1), free(r0), free(r1);
}

Test(cache, values_beyond_fp16_range_rejected) {
    /* Kinds with fp16 parts cannot hold |x| beyond their range: a named error, not an Inf. */
    float *k = rand_vec(4 * 64, 81, 1.0f);
    for (int kk = 1; kk < N_KINDS; kk++) {
        kvpq_cache *c = make(KINDS[kk].type, 1, 2, 1, 64, 100, 32, 16);
        float keep = k[64 * 2 + 9];
        k[64 * 2 + 9] = 1e9f;
        cr_assert_eq(kvpq_cache_append(c, 0, 4, k, k + 0), KVPQ_ERR_INVALID_ARG, "%s",
                     kvpq_cache_type_name(KINDS[kk].type));
        cr_assert(strstr(kvpq_last_error(), "position 2") && strstr(kvpq_last_error(), "dim 9"), "message: %s",
                  kvpq_last_error());
        cr_assert_eq(kvpq_cache_seq_len(c, 0), 0);
        k[64 * 2 + 9] = keep;
        cr_assert_eq(kvpq_cache_append(c, 0, 4, k, k), KVPQ_OK);
        kvpq_cache_free(c);
    }
    free(k);
}

Test(cache, vq_codebook_shape_mismatch_named) {
    kvpq_codebook_params cp = kvpq_codebook_params_default();
    cp.n_layer = 2, cp.n_head_kv = 1, cp.head_dim = 64;
    cp.key = kvpq_pq_params_default(), cp.value = kvpq_pq_params_default();
    kvpq_codebook *cb = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb, &cp), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ, p.codebook = cb, p.n_layer = 2, p.n_head = 2, p.n_head_kv = 1, p.head_dim = 64;
    kvpq_cache_params b = p;
    b.n_layer = 3;
    expect_bad(b, KVPQ_ERR_MISMATCH, "codebook has n_layer 2, cache has n_layer 3");
    b = p, b.n_head = 4, b.n_head_kv = 2;
    expect_bad(b, KVPQ_ERR_MISMATCH, "n_head_kv");
    b = p, b.head_dim = 128;
    expect_bad(b, KVPQ_ERR_MISMATCH, "head_dim");
    kvpq_codebook_free(cb);
}

/* The straightforward float32 attention (scores, softmax, weighted sum), the yardstick of the
 * FlashAttention papers: a blocked online-softmax implementation may be at most 2x less accurate. */
static void naive_f32(int L, int n_q, int n_head, int n_head_kv, int hd, const float *k, const float *v,
                      const float *q, float *out) {
    const int g = n_head / n_head_kv;
    float *w = malloc((size_t)L * sizeof *w);
    for (int i = 0; i < n_q; i++)
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / g, lim = L - n_q + i + 1;
            const float *qi = q + ((size_t)i * n_head + h) * hd;
            float m = -INFINITY, d = 0.0f;
            for (int t = 0; t < lim; t++) {
                float s = 0.0f;
                for (int c = 0; c < hd; c++) s += qi[c] * k[((size_t)t * n_head_kv + kvh) * hd + c];
                w[t] = s / sqrtf((float)hd);
                m = w[t] > m ? w[t] : m;
            }
            for (int t = 0; t < lim; t++) d += (w[t] = expf(w[t] - m));
            float *o = out + ((size_t)i * n_head + h) * hd;
            for (int c = 0; c < hd; c++) o[c] = 0.0f;
            for (int t = 0; t < lim; t++)
                for (int c = 0; c < hd; c++) o[c] += w[t] / d * v[((size_t)t * n_head_kv + kvh) * hd + c];
        }
    free(w);
}

Test(cache, fp32_error_at_most_twice_naive_float32) {
    const int n_head = 9, n_head_kv = 3, hd = 64, n_q = 4;
    const int lens[] = {64, 1000, 4096};
    const int n_lens = quick() ? 2 : 3;
    kvpq_simd_level best = kvpq_simd_get();
    for (int li = 0; li < n_lens; li++) {
        const int L = lens[li];
        const size_t kvw = (size_t)n_head_kv * hd, qn = (size_t)n_q * n_head * hd;
        float *k = rand_vec((size_t)L * kvw, 91 + li, 1.0f), *v = rand_vec((size_t)L * kvw, 92 + li, 1.0f);
        float *q = rand_vec(qn, 93 + li, 2.0f), *o = malloc(qn * 4), *on = malloc(qn * 4);
        double *ref = malloc(qn * sizeof *ref);
        ref_attend(L, n_q, n_head, n_head_kv, hd, k, v, q, ref);
        naive_f32(L, n_q, n_head, n_head_kv, hd, k, v, q, on);
        const double e_naive = rel_err_f64(on, ref, qn);
        for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
            cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
            kvpq_cache *c = make(KVPQ_CACHE_FP32, 1, n_head, n_head_kv, hd, L, 256, 128);
            cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
            cr_assert_eq(kvpq_cache_attend(c, 0, n_q, q, o), KVPQ_OK);
            double e = rel_err_f64(o, ref, qn);
            cr_assert(e <= 2.0 * e_naive, "L %d at %s: error %.3g vs naive float32 %.3g", L,
                      kvpq_simd_name((kvpq_simd_level)lv), e, e_naive);
            kvpq_cache_free(c);
        }
        free(k), free(v), free(q), free(o), free(on), free(ref);
    }
}

/* Issue 14 item 8: a position plus a count past INT_MAX must be refused without overflow (UBSan
 * aborted on pos0 + n, Release printed a negative bound), and a cache cannot be made so large that
 * its page arithmetic (max_seq + page_tokens - 1) overflows. */
Test(cache, ranges_checked_without_overflow) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32, KVPQ_CACHE_FP16, KVPQ_CACHE_Q8_0, KVPQ_CACHE_Q4_0,
                                            KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4};
    for (size_t t = 0; t < sizeof kinds / sizeof kinds[0]; t++) {
        kvpq_cache *c = make(kinds[t], 1, 2, 1, 64, 100, 32, 16);
        float k[64] = {0}, buf[64];
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k, k), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 1, INT_MAX, buf, NULL), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "[1, 2147483648)"), "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_read(c, 0, INT_MAX, INT_MAX, buf, NULL), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "[2147483647, 4294967294)"), "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_append(c, 0, INT_MAX, k, k), KVPQ_ERR_CAPACITY);
        cr_assert_eq(kvpq_cache_seq_len(c, 0), 1);
        kvpq_cache_free(c);
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = kinds[t];
        p.max_seq = INT_MAX;
        p.page_tokens = 1 << 20;
        c = NULL;
        cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "max_seq 2147483647"), "%s", kvpq_last_error());
        cr_assert_null(c);
    }
}

/* n_layer and n_head were bounded below only: n_layer INT_MAX reached calloc (a 16 GiB request per
 * table, or a failed allocation reported as NOMEM rather than as the bad field). Both are now
 * 1..4096 with a named error, for every kind, and n_head_kv may not exceed n_head. */
Test(cache, layer_and_head_counts_bounded_by_name) {
    for (int t = KVPQ_CACHE_FP32; t <= KVPQ_CACHE_Q4_0R; t++) {
        if (t == KVPQ_CACHE_VQ) continue; /* needs a codebook; its shapes are checked against it */
        const struct { int n_layer, n_head, n_head_kv; const char *needle; } bad[] = {
            {KVPQ_CACHE_MAX_LAYERS + 1, 2, 1, "n_layer 4097: expected 1..4096"},
            {INT_MAX, 2, 1, "n_layer 2147483647: expected 1..4096"},
            {0, 2, 1, "n_layer 0: expected 1..4096"},
            {2, KVPQ_CACHE_MAX_HEADS + 1, 1, "n_head 4097: expected 1..4096"},
            {2, INT_MAX, INT_MAX, "n_head 2147483647: expected 1..4096"},
            {2, -1, 1, "n_head -1: expected 1..4096"},
            {2, 2, 4, "n_head_kv 4: expected 1..n_head (2)"},
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            kvpq_cache_params p = kvpq_cache_params_default();
            p.type = (kvpq_cache_type)t, p.n_layer = bad[i].n_layer, p.n_head = bad[i].n_head;
            p.n_head_kv = bad[i].n_head_kv, p.head_dim = 64, p.max_seq = 16;
            kvpq_cache *c = (kvpq_cache *)1;
            cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_INVALID_ARG, "%s case %zu", kvpq_cache_type_name(p.type), i);
            cr_assert(strstr(kvpq_last_error(), bad[i].needle), "%s", kvpq_last_error());
            cr_assert_null(c);
        }
        /* the bounds themselves are accepted */
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = (kvpq_cache_type)t, p.n_layer = KVPQ_CACHE_MAX_LAYERS, p.n_head = KVPQ_CACHE_MAX_HEADS;
        p.n_head_kv = 1, p.head_dim = 64, p.max_seq = 4, p.page_tokens = 4;
        kvpq_cache *c = NULL;
        cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s: %s", kvpq_cache_type_name(p.type), kvpq_last_error());
        kvpq_cache_free(c);
    }
}

/* kvpq_vq_cache_bytes took the cache params unchecked: page_tokens 0 divided by zero (SIGFPE),
 * a window near INT_MAX overflowed window + 32 (UBSan), a negative window gave a huge byte count.
 * Now the ranges of kvpq_cache_new, refused by name. */
Test(cache, vq_cache_bytes_refuses_params_out_of_range) {
    kvpq_codebook *cb = test_codebook(&(test_codebook_spec){.n_layer = 1, .n_head_kv = 1, .head_dim = 16, .norm = -1,
                                                            .seed = 1, .seed_step = 1, .scale = 1.0f});
    cr_assert_not_null(cb, "%s", kvpq_last_error());
    const struct { int max_seq, window, page_tokens, sliding_window; const char *needle; } bad[] = {
        {100, 16, 0, 0, "page_tokens 0"},
        {100, 16, -4, 0, "page_tokens -4"},
        {100, 16, (1 << 20) + 1, 0, "page_tokens 1048577"},
        {100, -1000, 16, 0, "window -1000"},
        {INT_MAX, INT_MAX - 1, 256, 0, "max_seq 2147483647"},
        {0, 16, 16, 0, "max_seq 0"},
        {100, 16, 16, -5, "sliding_window -5"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = KVPQ_CACHE_VQ, p.n_layer = 1, p.n_head = 1, p.n_head_kv = 1, p.head_dim = 16, p.codebook = cb;
        p.max_seq = bad[i].max_seq, p.window = bad[i].window, p.page_tokens = bad[i].page_tokens;
        p.sliding_window = bad[i].sliding_window;
        size_t fixed = 0;
        int64_t el = 0;
        const int len = bad[i].max_seq < 50 ? bad[i].max_seq : 50;
        cr_assert_eq(kvpq_vq_cache_bytes(cb, &p, len, 7, NULL, &fixed, &el), KVPQ_ERR_INVALID_ARG, "case %zu", i);
        cr_assert(strstr(kvpq_last_error(), bad[i].needle), "%s", kvpq_last_error());
    }
    kvpq_cache_params p = kvpq_cache_params_default(); /* and a good one still works */
    p.type = KVPQ_CACHE_VQ, p.n_layer = 1, p.n_head = 1, p.n_head_kv = 1, p.head_dim = 16, p.codebook = cb;
    p.max_seq = 100, p.window = 16, p.page_tokens = 16;
    size_t fixed = 0;
    int64_t el = 0;
    cr_assert_eq(kvpq_vq_cache_bytes(cb, &p, 50, 7, NULL, &fixed, &el), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(el, 2 * 50 * 16);
    kvpq_codebook_free(cb);
}
