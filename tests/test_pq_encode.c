/* test_pq_encode.c — PQ encode/assign/decode against a brute-force fp64 reference, every SIMD level
 * against the scalar reference kernel, bit-packing, and rejection of bad input. */
#include <criterion/criterion.h>
#include <string.h>

#include "internal.h"
#include "pq_testutil.h"

/* Two codes may differ only when their exact distances are within the rounding of the fused float
 * formula ||c||^2 - 2 x.c: a few ulps of (||x||^2 + ||c||^2) per term; 1e-5 relative is generous. */
#define TIE_REL 1e-5
/* Reconstruction MSE of our codes vs the exact argmin: equal to 1e-6 relative (brief). */
#define MSE_REL 1e-6

static kvpq_pq *make_pq(int d, int M, int nbits, kvpq_codebook_granularity g, trng *r) {
    kvpq_pq_params p = {.d = d, .M = M, .nbits = nbits, .granularity = g};
    kvpq_pq *pq = NULL;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_OK, "%s", kvpq_last_error());
    size_t nc = kvpq_pq_centroids_size(pq);
    float *c = malloc(sizeof(float) * nc);
    fill_gauss(r, c, nc, 1.0f);
    cr_assert_eq(kvpq_pq_set_centroids(pq, c, nc), KVPQ_OK);
    free(c);
    return pq;
}

static double d2(const float *a, const float *b, int n) {
    double s = 0;
    for (int j = 0; j < n; j++) {
        double t = (double)a[j] - b[j];
        s += t * t;
    }
    return s;
}

/* Check idx (n, M) against the exact fp64 argmin; returns the number of (tolerated) tie differences. */
static size_t check_against_brute(const kvpq_pq *pq, size_t n, const float *x, const uint16_t *idx) {
    kvpq_pq_params p = kvpq_pq_get_params(pq);
    int dsub = p.d / p.M, ksub = 1 << p.nbits;
    const float *C = kvpq_pq_centroids(pq);
    size_t ties = 0;
    double mse_ours = 0, mse_ref = 0;
    for (size_t i = 0; i < n; i++)
        for (int m = 0; m < p.M; m++) {
            const float *xs = x + i * p.d + (size_t)m * dsub;
            const float *book = C + (p.granularity == KVPQ_CODEBOOK_SHARED ? 0 : (size_t)m * ksub * dsub);
            double best = INFINITY, cn = 0;
            int bi = 0;
            for (int c = 0; c < ksub; c++) {
                double t = d2(xs, book + (size_t)c * dsub, dsub);
                if (t < best) {
                    best = t;
                    bi = c;
                }
            }
            int ours = idx[i * p.M + m];
            cr_assert_lt(ours, ksub);
            double dours = d2(xs, book + (size_t)ours * dsub, dsub);
            if (ours != bi) {
                cn = d2(book + (size_t)ours * dsub, book + (size_t)ours * dsub, dsub) + d2(xs, xs, 0);
                double xn = 0;
                for (int j = 0; j < dsub; j++) xn += (double)xs[j] * xs[j];
                cr_assert_leq(dours - best, TIE_REL * (xn + cn + 1e-30),
                              "vector %zu sub-space %d: code %d (dist %.9g) vs exact %d (dist %.9g)", i, m, ours,
                              dours, bi, best);
                ties++;
            }
            mse_ours += dours;
            mse_ref += best;
        }
    /* 4096 centroids on a line (dsub 1, nbits 12) sit ~1e-3 apart, so near-ties within float rounding
     * move the MSE by ~1e-5 relative; there only the per-code tie bound above applies. */
    if (dsub == 1 && p.nbits == 12) return ties;
    cr_assert_leq(fabs(mse_ours - mse_ref), MSE_REL * mse_ref, "dsub %d nbits %d: MSE %.12g vs exact %.12g", dsub, p.nbits, mse_ours, mse_ref);
    return ties;
}

Test(pq_encode, equals_brute_force_every_dsub_nbits_granularity) {
    trng r = {42};
    const int dsubs[] = {1, 2, 4, 8, 16}, nbitss[] = {1, 3, 4, 8, 12};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 5; b++)
            for (int g = 0; g < 2; g++) {
                int dsub = dsubs[a], nbits = nbitss[b], d = 32, M = d / dsub;
                size_t n = nbits == 12 ? (quick() ? 8 : 24) : (quick() ? 40 : 200);
                kvpq_pq *pq = make_pq(d, M, nbits, (kvpq_codebook_granularity)g, &r);
                float *x = malloc(sizeof(float) * n * d);
                fill_gauss(&r, x, n * d, 1.0f);
                uint16_t *idx = malloc(sizeof(uint16_t) * n * M);
                cr_assert_eq(kvpq_pq_assign(pq, n, x, idx), KVPQ_OK, "%s", kvpq_last_error());
                size_t ties = check_against_brute(pq, n, x, idx);
                if (!(dsub == 1 && nbits == 12)) /* see check_against_brute */
                    cr_assert_leq(ties, n * M / 100 + 1, "dsub %d nbits %d: %zu tie differences", dsub, nbits, ties);
                free(x);
                free(idx);
                kvpq_pq_free(pq);
            }
}

Test(pq_encode, every_simd_level_equals_scalar_reference) {
    trng r = {7};
    kvpq_simd_level best = kvpq_simd_get();
    const int dsubs[] = {1, 2, 4, 8, 16}, nbitss[] = {2, 5, 8, 10};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 4; b++)
            for (int g = 0; g < 2; g++) {
                int dsub = dsubs[a], nbits = nbitss[b], d = 64, M = d / dsub;
                size_t n = quick() ? 37 : 301; /* odd: exercises the 4- and 2-vector pass tails */
                kvpq_pq *pq = make_pq(d, M, nbits, (kvpq_codebook_granularity)g, &r);
                float *x = malloc(sizeof(float) * n * d);
                fill_gauss(&r, x, n * d, 1.0f);
                uint16_t *ref = malloc(sizeof(uint16_t) * n * M), *got = malloc(sizeof(uint16_t) * n * M);
                cr_assert_eq(kvpq_simd_set(KVPQ_SIMD_SCALAR), KVPQ_OK);
                cr_assert_eq(kvpq_pq_assign(pq, n, x, ref), KVPQ_OK);
                for (int lv = KVPQ_SIMD_AVX2; lv <= (int)best; lv++) {
                    cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
                    cr_assert_eq(kvpq_pq_assign(pq, n, x, got), KVPQ_OK);
                    /* Every level accumulates the same fmaf sequence (dispatch.h), so codes are
                     * identical, not merely equal up to ties. */
                    for (size_t t = 0; t < n * M; t++)
                        cr_assert_eq(got[t], ref[t], "%s dsub %d nbits %d: sub-vector %zu: %u vs scalar %u",
                                     kvpq_simd_name((kvpq_simd_level)lv), dsub, nbits, t, got[t], ref[t]);
                }
                cr_assert_eq(kvpq_simd_set(best), KVPQ_OK);
                free(x);
                free(ref);
                free(got);
                kvpq_pq_free(pq);
            }
}

Test(pq_encode, exact_ties_go_to_the_lowest_index_at_every_level) {
    /* ksub 64, dsub 4: centroid c = (c, 0, 0, 0) except duplicates of centroid 37 at 5, 21 (other
     * SIMD lanes and blocks) ... so x = C[37] must get index 5, the lowest copy. */
    kvpq_pq_params p = {.d = 4, .M = 1, .nbits = 6, .granularity = KVPQ_CODEBOOK_SHARED};
    kvpq_pq *pq;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_OK);
    float C[64 * 4] = {0};
    for (int c = 0; c < 64; c++) C[c * 4] = (float)c + 100.0f;
    const int dup[] = {5, 21, 37, 53, 60};
    for (int t = 0; t < 5; t++) C[dup[t] * 4] = 7.5f, C[dup[t] * 4 + 1] = -2.0f;
    cr_assert_eq(kvpq_pq_set_centroids(pq, C, 64 * 4), KVPQ_OK);
    float x[9 * 4];
    for (int i = 0; i < 9; i++) x[i * 4] = 7.5f, x[i * 4 + 1] = -2.0f, x[i * 4 + 2] = 0, x[i * 4 + 3] = 0;
    kvpq_simd_level best = kvpq_simd_get();
    for (int lv = 0; lv <= (int)best; lv++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
        uint16_t idx[9];
        cr_assert_eq(kvpq_pq_assign(pq, 9, x, idx), KVPQ_OK);
        for (int i = 0; i < 9; i++) cr_assert_eq(idx[i], 5, "%s: vector %d got %u", kvpq_simd_name((kvpq_simd_level)lv), i, idx[i]);
    }
    cr_assert_eq(kvpq_simd_set(best), KVPQ_OK);
    kvpq_pq_free(pq);
}

Test(pq_encode, encode_is_packed_assign_and_decode_gathers) {
    trng r = {99};
    const int nbitss[] = {1, 3, 4, 7, 8, 12};
    for (int b = 0; b < 6; b++)
        for (int g = 0; g < 2; g++) {
            int d = 64, M = 16, nbits = nbitss[b];
            size_t n = 50;
            kvpq_pq *pq = make_pq(d, M, nbits, (kvpq_codebook_granularity)g, &r);
            float *x = malloc(sizeof(float) * n * d), *y = malloc(sizeof(float) * n * d);
            fill_gauss(&r, x, n * d, 1.0f);
            size_t cs = kvpq_pq_code_size(pq);
            cr_assert_eq(cs, (size_t)(M * nbits + 7) / 8);
            uint8_t *codes = malloc(cs * n), *packed = malloc(cs * n);
            uint16_t *idx = malloc(sizeof(uint16_t) * n * M);
            cr_assert_eq(kvpq_pq_encode(pq, n, x, codes), KVPQ_OK);
            cr_assert_eq(kvpq_pq_assign(pq, n, x, idx), KVPQ_OK);
            cr_assert_eq(kvpq_codes_pack(M, nbits, n, idx, packed), KVPQ_OK);
            cr_assert_eq(memcmp(codes, packed, cs * n), 0, "nbits %d", nbits);
            cr_assert_eq(kvpq_pq_decode(pq, n, codes, y), KVPQ_OK);
            const float *C = kvpq_pq_centroids(pq);
            int dsub = d / M, ksub = 1 << nbits;
            for (size_t i = 0; i < n; i++)
                for (int m = 0; m < M; m++) {
                    const float *c = C + ((g ? (size_t)m * ksub : 0) + idx[i * M + m]) * dsub;
                    cr_assert_eq(memcmp(y + i * d + m * dsub, c, sizeof(float) * dsub), 0);
                }
            free(x), free(y), free(codes), free(packed), free(idx);
            kvpq_pq_free(pq);
        }
}

Test(pq_encode, larger_parallel_run_matches_serial_blocks) {
    /* Enough work to take the OpenMP path; compare with encoding one vector at a time (serial). */
    trng r = {5};
    int d = 128, M = 32, nbits = 8;
    size_t n = quick() ? 300 : 3000;
    kvpq_pq *pq = make_pq(d, M, nbits, KVPQ_CODEBOOK_SHARED, &r);
    float *x = malloc(sizeof(float) * n * d);
    fill_gauss(&r, x, n * d, 1.0f);
    size_t cs = kvpq_pq_code_size(pq);
    uint8_t *a = malloc(cs * n), *b = malloc(cs * n);
    cr_assert_eq(kvpq_pq_encode(pq, n, x, a), KVPQ_OK);
    for (size_t i = 0; i < n; i++) cr_assert_eq(kvpq_pq_encode(pq, 1, x + i * d, b + i * cs), KVPQ_OK);
    cr_assert_eq(memcmp(a, b, cs * n), 0);
    free(x), free(a), free(b);
    kvpq_pq_free(pq);
}

// ---- packing -----------------------------------------------------------------------------------

Test(pq_pack, round_trip_and_bit_layout_every_nbits) {
    trng r = {3};
    const int Ms[] = {1, 3, 7, 16, 33};
    for (int nbits = 1; nbits <= 12; nbits++)
        for (int a = 0; a < 5; a++) {
            int M = Ms[a];
            size_t n = 20, cs = kvpq_codes_size(M, nbits);
            cr_assert_eq(cs, (size_t)(M * nbits + 7) / 8);
            uint16_t *idx = malloc(sizeof(uint16_t) * n * M), *back = malloc(sizeof(uint16_t) * n * M);
            uint8_t *p = malloc(cs * n);
            for (size_t t = 0; t < n * M; t++) idx[t] = (uint16_t)(trng_next(&r) % (1u << nbits));
            idx[0] = (uint16_t)((1u << nbits) - 1); /* all ones */
            memset(p, 0xAB, cs * n);
            cr_assert_eq(kvpq_codes_pack(M, nbits, n, idx, p), KVPQ_OK);
            /* layout: stream bit b of a vector is bit b%8 of byte b/8; code m in [m*nbits, (m+1)*nbits) */
            for (size_t i = 0; i < n; i++)
                for (int bit = 0; bit < (int)cs * 8; bit++) {
                    int got = (p[i * cs + bit / 8] >> (bit % 8)) & 1;
                    int want = bit < M * nbits ? (idx[i * M + bit / nbits] >> (bit % nbits)) & 1 : 0;
                    cr_assert_eq(got, want, "nbits %d M %d vector %zu bit %d", nbits, M, i, bit);
                }
            cr_assert_eq(kvpq_codes_unpack(M, nbits, n, p, back), KVPQ_OK);
            cr_assert_eq(memcmp(idx, back, sizeof(uint16_t) * n * M), 0, "nbits %d M %d", nbits, M);
            free(idx), free(back), free(p);
        }
}

Test(pq_pack, rejects_codes_too_wide_and_bad_shapes) {
    uint16_t idx[4] = {1, 2, 16, 3};
    uint8_t p[4];
    cr_assert_eq(kvpq_codes_pack(4, 4, 1, idx, p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "idx[0][2] = 16"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codes_pack(0, 4, 1, idx, p), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_codes_pack(4, 0, 1, idx, p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "nbits=0"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codes_unpack(4, 17, 1, p, idx), KVPQ_ERR_INVALID_ARG);
}

// ---- bad input ---------------------------------------------------------------------------------

Test(pq_encode, rejects_nan_and_inf_naming_the_vector) {
    trng r = {11};
    kvpq_pq *pq = make_pq(16, 4, 8, KVPQ_CODEBOOK_SHARED, &r);
    float x[10 * 16];
    fill_gauss(&r, x, 10 * 16, 1.0f);
    uint8_t codes[10 * 4];
    memset(codes, 0x5A, sizeof codes);
    x[3 * 16 + 7] = NAN;
    cr_assert_eq(kvpq_pq_encode(pq, 10, x, codes), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "x[3]"), "%s", kvpq_last_error());
    for (size_t t = 0; t < sizeof codes; t++) cr_assert_eq(codes[t], 0x5A, "output written before the check");
    x[3 * 16 + 7] = 0;
    x[9 * 16] = -INFINITY;
    uint16_t idx[10 * 4];
    cr_assert_eq(kvpq_pq_assign(pq, 10, x, idx), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "x[9]"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_encode(pq, 0, NULL, NULL), KVPQ_OK); /* nothing to do */
    cr_assert_eq(kvpq_pq_encode(pq, 1, NULL, codes), KVPQ_ERR_INVALID_ARG);
    kvpq_pq_free(pq);
}

Test(pq_encode, bad_params_are_named) {
    kvpq_pq *pq = NULL;
    kvpq_pq_params p = {.d = 24, .M = 8, .nbits = 8, .granularity = KVPQ_CODEBOOK_SHARED};
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "dsub=3"), "%s", kvpq_last_error());
    p.M = 5;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "M=5"), "%s", kvpq_last_error());
    p.M = 6, p.nbits = 13;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "nbits=13"), "%s", kvpq_last_error());
    cr_assert_null(pq);
    p.nbits = 4;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_OK);
    float c[16 * 4] = {0};
    c[17] = NAN;
    cr_assert_eq(kvpq_pq_set_centroids(pq, c, 64), KVPQ_ERR_NONFINITE);
    cr_assert_eq(kvpq_pq_set_centroids(pq, c, 63), KVPQ_ERR_INVALID_ARG);
    kvpq_pq_free(pq);
}

/* Head granularity at the quantizer level: rows interleave n_head heads, row i is coded with head
 * i % n_head's book (the same codes as a plain SHARED quantizer holding that book); training fits
 * each head's book on that head's rows only; n not a multiple of n_head is refused. */
Test(pq_encode, head_granularity_uses_each_rows_head_book) {
    kvpq_pq_params p = {.d = 8, .M = 2, .nbits = 2, .granularity = KVPQ_CODEBOOK_HEAD, .n_head = 2};
    kvpq_pq *pq;
    cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_centroids_size(pq), (size_t)2 * 4 * 4);
    /* train: head 0's rows near +5, head 1's near -5 */
    const size_t n = 400;
    float *x = malloc(n * 8 * sizeof(float));
    for (size_t i = 0; i < n; i++)
        for (int j = 0; j < 8; j++) x[i * 8 + j] = (i % 2 ? -5.0f : 5.0f) + 0.5f * (float)((i * 7 + (size_t)j * 3) % 5);
    cr_assert_eq(kvpq_pq_train(pq, NULL, n, x, NULL), KVPQ_OK, "%s", kvpq_last_error());
    const float *c = kvpq_pq_centroids(pq);
    for (int i = 0; i < 16; i++) cr_assert(c[i] > 4.9f, "head 0 centroid %d = %g", i, (double)c[i]);
    for (int i = 16; i < 32; i++) cr_assert(c[i] < -2.9f, "head 1 centroid %d = %g", i, (double)c[i]);
    /* encode / decode against a SHARED quantizer per head */
    uint8_t *codes = malloc(n), *ch = malloc(n);
    float *y = malloc(n * 8 * sizeof(float)), *yh = malloc(8 * sizeof(float));
    cr_assert_eq(kvpq_pq_encode(pq, n, x, codes), KVPQ_OK);
    cr_assert_eq(kvpq_pq_decode(pq, n, codes, y), KVPQ_OK);
    for (int h = 0; h < 2; h++) {
        kvpq_pq *s;
        kvpq_pq_params sp = {.d = 8, .M = 2, .nbits = 2, .granularity = KVPQ_CODEBOOK_SHARED};
        cr_assert_eq(kvpq_pq_new(&s, &sp), KVPQ_OK);
        cr_assert_eq(kvpq_pq_set_centroids(s, c + h * 16, 16), KVPQ_OK);
        for (size_t i = (size_t)h; i < n; i += 2) {
            cr_assert_eq(kvpq_pq_encode(s, 1, x + i * 8, ch), KVPQ_OK);
            cr_assert_eq(ch[0], codes[i], "row %zu", i);
            cr_assert_eq(kvpq_pq_decode(s, 1, ch, yh), KVPQ_OK);
            cr_assert_eq(memcmp(yh, y + i * 8, 8 * sizeof(float)), 0, "row %zu decode", i);
        }
        kvpq_pq_free(s);
    }
    cr_assert_eq(kvpq_pq_encode(pq, 3, x, codes), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "not a multiple of n_head=2"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_decode(pq, 3, codes, y), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_pq_train(pq, NULL, 3, x, NULL), KVPQ_ERR_INVALID_ARG);
    p.n_head = 0;
    kvpq_pq *bad;
    cr_assert_eq(kvpq_pq_new(&bad, &p), KVPQ_ERR_INVALID_ARG);
    free(x);
    free(codes);
    free(ch);
    free(y);
    free(yh);
    kvpq_pq_free(pq);
}
