/* test_pq_transform.c — normalized Walsh-Hadamard transform and key smoothing (VecInfer sec. 3). */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "internal.h"
#include "pq_testutil.h"

#define HAD_TOL 1e-6  /* brief: orthonormal and self-inverse to 1e-6 (float butterflies, log2 d stages) */
#define DOT_REL 1e-5  /* brief: q.k preserved to 1e-5, relative to sum |q_i k_i| (the dot's rounding scale) */

Test(hadamard, is_sylvester_orthonormal_matrix) {
    for (int d = 1; d <= 256; d *= 2) {
        float *h = calloc((size_t)d * d, sizeof(float));
        for (int i = 0; i < d; i++) h[i * d + i] = 1.0f;
        cr_assert_eq(kvpq_hadamard(h, (size_t)d, d), KVPQ_OK);
        double s = 1.0 / sqrt((double)d);
        for (int i = 0; i < d; i++)
            for (int j = 0; j < d; j++) {
                /* Sylvester order: H[i][j] = (-1)^popcount(i & j) / sqrt(d) */
                double want = (__builtin_popcount((unsigned)(i & j)) & 1) ? -s : s;
                cr_assert_float_eq(h[i * d + j], want, HAD_TOL, "d %d H[%d][%d]", d, i, j);
            }
        for (int i = 0; i < d; i++)
            for (int j = 0; j < d; j++) {
                double dot = 0;
                for (int t = 0; t < d; t++) dot += (double)h[i * d + t] * h[j * d + t];
                cr_assert_float_eq(dot, i == j ? 1.0 : 0.0, HAD_TOL, "d %d rows %d,%d", d, i, j);
            }
        free(h);
    }
}

Test(hadamard, is_self_inverse_and_keeps_norms) {
    trng r = {1};
    for (int d = 2; d <= 4096; d *= 2) {
        size_t n = 7;
        float *x = malloc(sizeof(float) * n * d), *y = malloc(sizeof(float) * n * d);
        fill_gauss(&r, x, n * d, 1.0f);
        memcpy(y, x, sizeof(float) * n * d);
        cr_assert_eq(kvpq_hadamard(y, n, d), KVPQ_OK);
        for (size_t i = 0; i < n; i++) {
            double nx = 0, ny = 0;
            for (int j = 0; j < d; j++) nx += (double)x[i * d + j] * x[i * d + j], ny += (double)y[i * d + j] * y[i * d + j];
            cr_assert_float_eq(ny / nx, 1.0, HAD_TOL * 4, "d %d: norm changed", d);
        }
        cr_assert_eq(kvpq_hadamard(y, n, d), KVPQ_OK);
        for (size_t t = 0; t < n * d; t++) cr_assert_float_eq(y[t], x[t], HAD_TOL * 4, "d %d element %zu", d, t);
        free(x), free(y);
    }
}

Test(hadamard, rejects_non_power_of_two_naming_d) {
    float x[48] = {0};
    cr_assert_eq(kvpq_hadamard(x, 1, 48), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "d=48"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_hadamard(x, 1, 0), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_hadamard(NULL, 1, 64), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_hadamard(NULL, 0, 64), KVPQ_OK);
}

/* Rows become unit vectors along the same direction (checked in double against the input), the
 * norms come back, a zero row stays zero (no NaN), and bad arguments are refused naming them. */
Test(normalize_rows, unit_rows_norms_and_zero_row) {
    const int n = 5, d = 64;
    float x[5 * 64], x0[5 * 64], nrm[5];
    for (int i = 0; i < n * d; i++) x[i] = (float)((i * 37 % 101) - 50) * (i / d + 1) * 0.25f;
    for (int j = 0; j < d; j++) x[2 * d + j] = 0.0f;
    memcpy(x0, x, sizeof x);
    cr_assert_eq(kvpq_normalize_rows(x, (size_t)n, d, nrm), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < n; i++) {
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)x0[i * d + j] * x0[i * d + j];
        cr_assert_float_eq(nrm[i], sqrt(ss), 1e-6 * sqrt(ss), "row %d norm", i);
        for (int j = 0; j < d; j++) {
            double want = ss > 0 ? x0[i * d + j] / sqrt(ss) : 0.0;
            cr_assert_float_eq(x[i * d + j], want, 1e-6, "row %d [%d]: %g vs %g", i, j, (double)x[i * d + j], want);
        }
    }
    cr_assert_eq(nrm[2], 0.0f);
    cr_assert_eq(kvpq_normalize_rows(x, 1, 0, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "d=0"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_normalize_rows(NULL, 1, 4, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_normalize_rows(NULL, 0, 4, NULL), KVPQ_OK);
}

/* Issue 14 item 10: a row whose norm is infinite (an Inf element, or finite elements whose norm
 * exceeds float's range) returned OK with a zero row and an Inf norm. Now NONFINITE naming the row,
 * x unchanged; a large but representable norm still normalizes. */
Test(normalize_rows, infinite_norm_refused) {
    const int d = 4;
    float x[3 * 4] = {1, 2, 3, 4, 3e38f, 3e38f, 3e38f, 3e38f, 0, 0, 0, 0}, x0[12], nrm[3];
    memcpy(x0, x, sizeof x);
    cr_assert_eq(kvpq_normalize_rows(x, 3, d, nrm), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "row 1 has norm 6e+38"), "%s", kvpq_last_error());
    cr_assert(!memcmp(x, x0, sizeof x), "x unchanged on error");
    x[5] = INFINITY;
    cr_assert_eq(kvpq_normalize_rows(x, 3, d, NULL), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "row 1 element 1 is Inf"), "%s", kvpq_last_error());
    x[5] = NAN;
    cr_assert_eq(kvpq_normalize_rows(x, 3, d, NULL), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "row 1 element 1 is NaN"), "%s", kvpq_last_error());
    float y[4] = {1e38f, 1e38f, 1e38f, 1e38f};
    cr_assert_eq(kvpq_normalize_rows(y, 1, d, nrm), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_float_eq(nrm[0], 2e38f, 1e32f);
    cr_assert_float_eq(y[0], 0.5f, 1e-6f);
}

Test(smooth, compute_is_sqrt_of_max_abs_with_floor) {
    /* 3 tokens, 2 KV heads, head_dim 3 */
    const float k[3 * 2 * 3] = {1, -4, 0, 9, 0.5f, 0,   -16, 2, 0, -1, 0.25f, 0,   3, 1, 0, 2, -0.5f, 0};
    float lambda[6];
    cr_assert_eq(kvpq_smooth_compute(3, 2, 3, k, 1e-2f, lambda), KVPQ_OK);
    const float want[6] = {4, 2, 1e-2f, 3, sqrtf(0.5f), 1e-2f};
    for (int c = 0; c < 6; c++) cr_assert_float_eq(lambda[c], want[c], 1e-6, "channel %d", c);
    cr_assert_eq(kvpq_smooth_compute(3, 2, 3, k, 0.9f, lambda), KVPQ_OK);
    cr_assert_float_eq(lambda[4], 0.9f, 1e-7);
    cr_assert_float_eq(lambda[0], 4.0f, 1e-7);
}

Test(smooth, compute_qk_balances_key_and_query_magnitudes) {
    /* the keys of compute_is_sqrt_of_max_abs_with_floor: max|k| = {16, 4, 0 | 9, 0.5, 0} */
    const float k[3 * 2 * 3] = {1, -4, 0, 9, 0.5f, 0,   -16, 2, 0, -1, 0.25f, 0,   3, 1, 0, 2, -0.5f, 0};
    float plain[6], lambda[6];
    cr_assert_eq(kvpq_smooth_compute(3, 2, 3, k, 1e-2f, plain), KVPQ_OK);
    /* equal |q| in every channel of a head, or no query seen: exactly the keys-only factors */
    const float qeq[6] = {2.5f, 2.5f, 2.5f, 0, 0, 0};
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, k, qeq, 1e-2f, lambda), KVPQ_OK, "%s", kvpq_last_error());
    for (int c = 0; c < 6; c++) cr_assert_eq(lambda[c], plain[c], "channel %d: %g vs %g", c, lambda[c], plain[c]);
    /* head 0: the queries weigh channel 0 four times channel 1; channel 2 unused (0: clamped to
     * 1e-3 of the head's largest) */
    const float qa[6] = {4, 1, 0, 1, 1, 1};
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, k, qa, 1e-2f, lambda), KVPQ_OK, "%s", kvpq_last_error());
    const double qbar = (4.0 + 1.0 + 4e-3) / 3.0;
    cr_assert_float_eq(lambda[0], sqrt(16.0 * qbar / 4.0), 1e-6);
    cr_assert_float_eq(lambda[1], sqrt(4.0 * qbar / 1.0), 1e-6);
    cr_assert_eq(lambda[2], 1e-2f); /* max|k| = 0: the floor */
    for (int c = 3; c < 6; c++) cr_assert_eq(lambda[c], plain[c]);
    /* the balance: lambda^2 max|q| / max|k| is the same for every used channel of a head */
    cr_assert_float_eq(lambda[0] * lambda[0] * 4 / 16, lambda[1] * lambda[1] * 1 / 4, 1e-6);
    /* bad q_absmax: named, nothing written */
    float bad[6] = {1, 1, 1, 1, -1, 1};
    lambda[0] = 123;
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, k, bad, 1e-2f, lambda), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "q_absmax[4]=-1"), "%s", kvpq_last_error());
    cr_assert_eq(lambda[0], 123);
    bad[4] = NAN;
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, k, bad, 1e-2f, lambda), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "q_absmax[4]"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, k, NULL, 1e-2f, lambda), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "q_absmax is NULL"), "%s", kvpq_last_error());
    float kn[6 * 3];
    memcpy(kn, k, sizeof kn);
    kn[7] = INFINITY;
    cr_assert_eq(kvpq_smooth_compute_qk(3, 2, 3, kn, qa, 1e-2f, lambda), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "kvpq_smooth_compute_qk") && strstr(kvpq_last_error(), "token 1"), "%s",
              kvpq_last_error());
}

Test(smooth, rejects_bad_input) {
    float k[2 * 1 * 4] = {1, 2, 3, 4, 5, 6, NAN, 8}, lambda[4];
    cr_assert_eq(kvpq_smooth_compute(2, 1, 4, k, 1e-2f, lambda), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "token 1"), "%s", kvpq_last_error());
    k[6] = 7;
    cr_assert_eq(kvpq_smooth_compute(2, 1, 4, k, 0.0f, lambda), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "floor"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_smooth_compute(2, 0, 4, k, 1e-2f, lambda), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "n_head_kv=0"), "%s", kvpq_last_error());
    float bad[4] = {1, 0, 1, 1};
    cr_assert_eq(kvpq_smooth_apply(k, 2, 1, 4, bad, 0), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "lambda[1]"), "%s", kvpq_last_error());
    float q[4 * 3];
    const float one[4] = {1, 1, 1, 1};
    cr_assert_eq(kvpq_smooth_apply_query(q, 1, 3, 2, 2, one), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "n_head=3"), "%s", kvpq_last_error());
}

Test(smooth, smoothing_and_rotation_keep_q_dot_k) {
    /* GQA as in SmolLM2: 9 query heads over 3 KV heads, head_dim 64; keys with outlier channels. */
    trng r = {21};
    const int n_head = 9, n_head_kv = 3, hd = 64, group = n_head / n_head_kv;
    const size_t nt = quick() ? 16 : 64;
    float *k = malloc(sizeof(float) * nt * n_head_kv * hd), *q = malloc(sizeof(float) * nt * n_head * hd);
    fill_gauss(&r, k, nt * n_head_kv * hd, 1.0f);
    fill_gauss(&r, q, nt * n_head * hd, 1.0f);
    for (size_t t = 0; t < nt; t++) /* massive channels, as in real keys */
        for (int h = 0; h < n_head_kv; h++) k[(t * n_head_kv + h) * hd + 5 + 7 * h] *= 40.0f;
    float *ks = malloc(sizeof(float) * nt * n_head_kv * hd), *qs = malloc(sizeof(float) * nt * n_head * hd);
    memcpy(ks, k, sizeof(float) * nt * n_head_kv * hd);
    memcpy(qs, q, sizeof(float) * nt * n_head * hd);
    float lambda[3 * 64];
    cr_assert_eq(kvpq_smooth_compute(nt, n_head_kv, hd, k, 1e-2f, lambda), KVPQ_OK);
    cr_assert_eq(kvpq_smooth_apply(ks, nt, n_head_kv, hd, lambda, 0), KVPQ_OK);
    cr_assert_eq(kvpq_smooth_apply_query(qs, nt, n_head, n_head_kv, hd, lambda), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(ks, nt * n_head_kv, hd), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(qs, nt * n_head, hd), KVPQ_OK);
    double maxabs_before = 0, maxabs_after = 0;
    for (size_t t = 0; t < nt * n_head_kv * hd; t++) {
        maxabs_before = fmax(maxabs_before, fabs(k[t]));
        maxabs_after = fmax(maxabs_after, fabs(ks[t]));
    }
    cr_assert_lt(maxabs_after * 4, maxabs_before, "smoothing+rotation should flatten the outliers");
    for (size_t i = 0; i < nt; i++)
        for (int h = 0; h < n_head; h++)
            for (size_t j = 0; j < nt; j++) {
                const float *qv = q + (i * n_head + h) * hd, *kv = k + (j * n_head_kv + h / group) * hd;
                const float *qv2 = qs + (i * n_head + h) * hd, *kv2 = ks + (j * n_head_kv + h / group) * hd;
                double dot = 0, dot2 = 0, scale = 0;
                for (int c = 0; c < hd; c++) {
                    dot += (double)qv[c] * kv[c];
                    dot2 += (double)qv2[c] * kv2[c];
                    scale += fabs((double)qv[c] * kv[c]);
                }
                cr_assert_leq(fabs(dot2 - dot), DOT_REL * scale, "q%zu h%d k%zu: %g vs %g", i, h, j, dot2, dot);
            }
    /* inverse smoothing restores the keys */
    cr_assert_eq(kvpq_hadamard(ks, nt * n_head_kv, hd), KVPQ_OK);
    cr_assert_eq(kvpq_smooth_apply(ks, nt, n_head_kv, hd, lambda, 1), KVPQ_OK);
    for (size_t t = 0; t < nt * n_head_kv * hd; t++)
        cr_assert_float_eq(ks[t], k[t], 1e-5 * (1 + fabs(k[t])), "element %zu", t);
    free(k), free(q), free(ks), free(qs);
}
