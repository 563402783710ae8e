/* test_attn_kernels.c — every SIMD level's attention kernels against the scalar *_ref table on
 * fresh random inputs, at sizes with and without SIMD tails. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache_testutil.h"
#include "cpu/attn_kernels.h"

/* float32 dot products of up to 256 terms summed in a different order: a few ulp of the sum of
 * |terms|, bounded here relative to that sum. */
#define DOT_RTOL 1e-5
/* Polynomial exp of the SIMD levels (Cephes expf): ~2 ulp. */
#define EXP_RTOL 1e-6

static double max_rel(const float *a, const float *b, size_t n) {
    double num = 0, den = 1e-30;
    for (size_t i = 0; i < n; i++) num = fmax(num, fabs((double)a[i] - b[i])), den = fmax(den, fabs((double)b[i]));
    return num / den;
}

/* attn_body.h at W = 1 (tests/body_scalar_attn.c; the library's scalar level is the _ref). */
extern const kvpq_attn_kernels kvpq__attn_scalar;

/* The tables under test into t: the width-1 body, then every SIMD level this CPU has. */
static int tables(const kvpq_attn_kernels **t) {
    int n = 0;
    t[n++] = &kvpq__attn_scalar;
    for (int lv = KVPQ_SIMD_AVX2; lv <= KVPQ_SIMD_AVX512; lv++)
        if (kvpq_simd_set((kvpq_simd_level)lv) == KVPQ_OK) t[n++] = kvpq__attn_kernels(); /* else: the CPU lacks it */
    return n;
}

Test(attn_kernels, qk_pv_scale_max_vs_ref) {
    const kvpq_attn_kernels *ref = &kvpq__attn_ref;
    static const int hds[] = {1, 7, 8, 16, 20, 37, 64, 100, 128, 256};
    static const int ns[] = {1, 3, 4, 5, 17, 64};
    uint64_t seed = 1;
    const kvpq_attn_kernels *tab[3];
    const int n_tab = tables(tab);
    for (int ti = 0; ti < n_tab; ti++) {
        const kvpq_attn_kernels *kr = tab[ti];
        for (int a = 0; a < 10; a++)
            for (int b = 0; b < 6; b++) {
                const int hd = hds[a], n = ns[b], R = 1 + (a + b) % 5, ld = 70;
                float *Q = rand_vec((size_t)R * hd, seed++, 1.0f), *K = rand_vec((size_t)n * hd, seed++, 1.0f);
                float *S0 = calloc((size_t)R * ld, 4), *S1 = calloc((size_t)R * ld, 4);
                ref->qk(Q, R, K, n, hd, S0, ld);
                kr->qk(Q, R, K, n, hd, S1, ld);
                for (int r = 0; r < R; r++)
                    for (int t = 0; t < n; t++) {
                        double mag = 0;
                        for (int c = 0; c < hd; c++) mag += fabs((double)Q[r * hd + c] * K[t * hd + c]);
                        cr_assert(fabs(S0[r * ld + t] - S1[r * ld + t]) <= DOT_RTOL * mag + 1e-30,
                                  "%s qk hd %d n %d", kr->name, hd, n);
                    }
                float *P = rand_vec((size_t)R * ld, seed++, 1.0f), *V = rand_vec((size_t)n * hd, seed++, 1.0f);
                float *O0 = rand_vec((size_t)R * hd, seed, 1.0f), *O1 = rand_vec((size_t)R * hd, seed++, 1.0f);
                ref->pv(P, R, ld, V, n, hd, O0);
                kr->pv(P, R, ld, V, n, hd, O1);
                cr_assert(max_rel(O1, O0, (size_t)R * hd) < DOT_RTOL * 8, "%s pv hd %d n %d", kr->name, hd, n);
                /* the fp16 forms on the same values rounded to fp16 */
                uint16_t *K16 = malloc((size_t)n * hd * 2), *V16 = malloc((size_t)n * hd * 2);
                kvpq__attn_ref.f32_to_f16(K, K16, (size_t)n * hd);
                kvpq__attn_ref.f32_to_f16(V, V16, (size_t)n * hd);
                ref->qk_f16(Q, R, K16, n, hd, S0, ld);
                kr->qk_f16(Q, R, K16, n, hd, S1, ld);
                for (int r = 0; r < R; r++)
                    for (int t = 0; t < n; t++) {
                        double mag = 0;
                        for (int c = 0; c < hd; c++) mag += fabs((double)Q[r * hd + c] * K[t * hd + c]);
                        cr_assert(fabs(S0[r * ld + t] - S1[r * ld + t]) <= DOT_RTOL * mag * 1.01 + 1e-30,
                                  "%s qk_f16 hd %d n %d", kr->name, hd, n);
                    }
                float *W0 = calloc((size_t)R * hd, 4), *W1 = calloc((size_t)R * hd, 4);
                ref->pv_f16(P, R, ld, V16, n, hd, W0);
                kr->pv_f16(P, R, ld, V16, n, hd, W1);
                cr_assert(max_rel(W1, W0, (size_t)R * hd) < DOT_RTOL * 8, "%s pv_f16 hd %d n %d", kr->name, hd, n);
                free(K16), free(V16), free(W0), free(W1);
                kr->scale(O1, R * hd, 0.37f);
                ref->scale(O0, R * hd, 0.37f);
                cr_assert(max_rel(O1, O0, (size_t)R * hd) < DOT_RTOL * 8);
                cr_assert_eq(kr->max(V, n * hd), ref->max(V, n * hd), "%s max", kr->name);
                free(Q), free(K), free(S0), free(S1), free(P), free(V), free(O0), free(O1);
            }
    }
}

/* Rows in lanes: qk_t and pv_t against the reference within the dot-product bound, softmax_t's
 * weights, sums and rescaled outputs within the exp's, with masked scores (-inf), rows masked so far
 * (m = -inf) and rows masked in the whole chunk; R at every multiple of 16 up to 64 and not. */
Test(attn_kernels, rows_in_lanes_vs_ref) {
    const kvpq_attn_kernels *ref = &kvpq__attn_ref;
    static const int hds[] = {1, 5, 16, 64, 128};
    static const int ns[] = {1, 3, 4, 17, 64};
    static const int Rs[] = {16, 32, 48, 64, 8, 5};
    uint64_t seed = 900;
    const kvpq_attn_kernels *tab[3];
    const int n_tab = tables(tab);
    for (int ti = 0; ti < n_tab; ti++)
        for (int a = 0; a < 5; a++)
            for (int b = 0; b < 5; b++)
                for (int c6 = 0; c6 < 6; c6++) {
                    const kvpq_attn_kernels *kr = tab[ti];
                    const int hd = hds[a], n = ns[b], R = Rs[c6], ld = 80;
                    float *QT = rand_vec((size_t)hd * ld, seed++, 1.0f), *K = rand_vec((size_t)n * hd, seed++, 1.0f);
                    float *S0 = calloc((size_t)n * ld, 4), *S1 = calloc((size_t)n * ld, 4);
                    ref->qk_t(QT, ld, R, K, n, hd, S0, ld);
                    kr->qk_t(QT, ld, R, K, n, hd, S1, ld);
                    for (int t = 0; t < n; t++)
                        for (int r = 0; r < R; r++) {
                            double mag = 0;
                            for (int c = 0; c < hd; c++) mag += fabs((double)QT[c * ld + r] * K[t * hd + c]);
                            cr_assert(fabs(S0[t * ld + r] - S1[t * ld + r]) <= DOT_RTOL * mag + 1e-30,
                                      "%s qk_t hd %d n %d R %d", kr->name, hd, n, R);
                        }
                    memcpy(S1, S0, (size_t)n * ld * sizeof *S1); /* the same scores into both softmaxes */
                    /* masks: row 1 masked so far and in the whole chunk, row 2 from t = 1 on; row 0 masked so far */
                    for (int t = 0; t < n; t++) {
                        S0[t * ld + 1] = S1[t * ld + 1] = -INFINITY;
                        if (t >= 1) S0[t * ld + 2] = S1[t * ld + 2] = -INFINITY;
                    }
                    float m0[80], m1[80], d0[80], d1[80];
                    for (int r = 0; r < R; r++) {
                        m0[r] = m1[r] = r <= 1 ? -INFINITY : 0.5f * (float)(r % 7) - 1.0f;
                        d0[r] = d1[r] = r <= 1 ? 0.0f : 1.0f + 0.1f * (float)r;
                    }
                    float *O0 = rand_vec((size_t)hd * ld, seed, 1.0f), *O1 = rand_vec((size_t)hd * ld, seed++, 1.0f);
                    for (int c = 0; c < hd; c++) /* rows masked so far hold 0 */
                        O0[c * ld] = O1[c * ld] = O0[c * ld + 1] = O1[c * ld + 1] = 0.0f;
                    ref->softmax_t(S0, ld, n, R, m0, d0, O0, ld, hd);
                    kr->softmax_t(S1, ld, n, R, m1, d1, O1, ld, hd);
                    for (int r = 0; r < R; r++) {
                        cr_assert(m0[r] == m1[r] || (isinf(m0[r]) && isinf(m1[r])), "%s softmax_t m", kr->name);
                        cr_assert(fabs(d0[r] - d1[r]) <= EXP_RTOL * 4 * (n + d0[r]), "%s softmax_t d row %d: %g vs %g",
                                  kr->name, r, (double)d1[r], (double)d0[r]);
                        for (int t = 0; t < n; t++)
                            cr_assert(fabs(S0[t * ld + r] - S1[t * ld + r]) <= EXP_RTOL * 4, "%s softmax_t weight", kr->name);
                    }
                    cr_assert(m1[1] == -INFINITY && d1[1] == 0.0f, "%s: a row masked everywhere stays empty", kr->name);
                    cr_assert(max_rel(O1, O0, (size_t)hd * ld) < EXP_RTOL * 8, "%s softmax_t rescale", kr->name);
                    /* pv_t on the weights */
                    float *V = rand_vec((size_t)n * hd, seed++, 1.0f);
                    ref->pv_t(S0, ld, R, V, n, hd, O0, ld);
                    kr->pv_t(S0, ld, R, V, n, hd, O1, ld);
                    cr_assert(max_rel(O1, O0, (size_t)hd * ld) < DOT_RTOL * 8, "%s pv_t hd %d n %d R %d", kr->name, hd,
                              n, R);
                    free(QT), free(K), free(S0), free(S1), free(O0), free(O1), free(V);
                }
}

Test(attn_kernels, exp_sum_vs_ref) {
    const kvpq_attn_kernels *tab[3];
    const int n_tab = tables(tab);
    for (int ti = 0; ti < n_tab; ti++) {
        const kvpq_attn_kernels *kr = tab[ti];
        for (int n = 1; n <= 70; n += 3) {
            float *x0 = rand_vec((size_t)n, 100 + n, 8.0f), *x1 = malloc((size_t)n * 4);
            x0[0] = -200.0f; /* far below the max: ~0 */
            memcpy(x1, x0, (size_t)n * 4);
            float m = kvpq__attn_ref.max(x0, n);
            float s0 = kvpq__attn_ref.exp_sum(x0, n, m), s1 = kr->exp_sum(x1, n, m);
            cr_assert(fabs(s0 - s1) <= EXP_RTOL * s0, "%s exp_sum n %d: %g vs %g", kr->name, n, s1, s0);
            for (int i = 0; i < n; i++)
                cr_assert(fabs(x0[i] - x1[i]) <= EXP_RTOL * x0[i] + 1e-37, "%s exp n %d i %d: %g vs %g", kr->name, n, i,
                          x1[i], x0[i]);
            free(x0), free(x1);
        }
    }
}

Test(attn_kernels, conversions_and_dequant_bit_exact) {
    const size_t n = 1000 + 13;
    float *x = rand_vec(n, 7, 3.0f);
    x[0] = 65504.0f, x[1] = 6e-8f, x[2] = -3e-5f, x[3] = 1.0f + 1.0f / 2048, x[4] = 0.0f, x[5] = -0.0f;
    x[6] = 1e-9f, x[7] = 65519.0f;
    uint16_t *h0 = malloc(n * 2), *h1 = malloc(n * 2);
    float *y0 = malloc(n * 4), *y1 = malloc(n * 4);
    kvpq__attn_ref.f32_to_f16(x, h0, n);
    cr_assert_eq(h0[0], 0x7bff);
    cr_assert_eq(h0[3], 0x3c00, "1 + 2^-11 ties to even");
    cr_assert_eq(h0[5], 0x8000);
    cr_assert_eq(h0[7], 0x7bff, "65519 rounds down to 65504");
    unsigned char *blk = malloc(34 * 32);
    for (int i = 0; i < 34 * 32; i++) blk[i] = (unsigned char)(i * 37 + 11);
    for (int b = 0; b < 32; b++) blk[b * 34 + 1] = 0x3c, blk[b * 34] = (unsigned char)b; /* finite fp16 scales */
    float *d0 = malloc(32 * 32 * 4), *d1 = malloc(32 * 32 * 4);
    float sc[64], mn[64];
    for (int i = 0; i < 64; i++) sc[i] = 0.1f * (float)i - 2.0f, mn[i] = (float)i * 0.01f;
    const kvpq_attn_kernels *tab[3];
    const int n_tab = tables(tab);
    for (int ti = 0; ti < n_tab; ti++) {
        const kvpq_attn_kernels *kr = tab[ti];
        kr->f32_to_f16(x, h1, n);
        cr_assert(!memcmp(h0, h1, n * 2), "%s f32_to_f16", kr->name);
        kvpq__attn_ref.f16_to_f32(h0, y0, n);
        kr->f16_to_f32(h0, y1, n);
        cr_assert(!memcmp(y0, y1, n * 4), "%s f16_to_f32", kr->name);
        kvpq__attn_ref.dequant_q8_0(blk, 32, d0);
        kr->dequant_q8_0(blk, 32, d1);
        cr_assert(!memcmp(d0, d1, 32 * 32 * 4), "%s q8_0", kr->name);
        kvpq__attn_ref.dequant_q4_0(blk, 32, d0);
        kr->dequant_q4_0(blk, 32, d1);
        cr_assert(!memcmp(d0, d1, 32 * 32 * 4), "%s q4_0", kr->name);
        for (int bits = 2; bits <= 4; bits += 2) {
            kvpq__attn_ref.dequant_bits(blk, bits, 64, sc, mn, d0);
            kr->dequant_bits(blk, bits, 64, sc, mn, d1);
            cr_assert(!memcmp(d0, d1, 64 * 4), "%s dequant_bits %d", kr->name, bits);
            kvpq__attn_ref.dequant_bits_g32(blk, bits, 64, sc + 3, mn + 5, d0);
            kr->dequant_bits_g32(blk, bits, 64, sc + 3, mn + 5, d1);
            cr_assert(!memcmp(d0, d1, 64 * 4), "%s dequant_bits_g32 %d", kr->name, bits);
        }
    }
    /* the reference unpacking itself: code c of `bits` bits, LSB-first */
    kvpq__attn_ref.dequant_bits(blk, 2, 32, sc, mn, d0);
    for (int c = 0; c < 32; c++) cr_assert_eq(d0[c], fmaf((float)((blk[c / 4] >> (2 * (c % 4))) & 3), sc[c], mn[c]));
    free(x), free(h0), free(h1), free(y0), free(y1), free(blk), free(d0), free(d1);
}
