/* nn_avx2.c — nearest-centroid search, AVX2+FMA: 8 centroids per register, 2 sub-vectors per pass
 * (16 ymm registers: 2 x {acc A, acc B, best, index} plus the centroid loads). */
#include <immintrin.h>
#include <math.h>

#include "cpu/dispatch.h"

#define NB 2 /* sub-vectors per pass */

static inline __attribute__((always_inline)) void nn_pass(const kvpq_nn_book *b, int dsub, int nb,
                                                          const float *x, size_t xs, int32_t *idx,
                                                          size_t is) {
    float m2x[NB][16];
    for (int v = 0; v < nb; v++)
        for (int j = 0; j < dsub; j++) m2x[v][j] = -2.0f * x[v * xs + j];
    __m256 best[NB];
    __m256i bidx[NB];
    for (int v = 0; v < nb; v++) {
        best[v] = _mm256_set1_ps(INFINITY);
        bidx[v] = _mm256_setzero_si256();
    }
    __m256i cur = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    const int kpad = b->kpad;
    /* kpad is a multiple of 16: two 8-centroid blocks A, B per step. Their pairwise minimum (A on
     * ties: B must be strictly smaller) is merged into the running best once, which costs fewer
     * compare/blend uops than merging each block, and picks the same index as a sequential scan.
     * (min_ps(a, b) is exactly a < b ? a : b, so it equals the blend on the strict comparison.) */
    const __m256i step2 = _mm256_add_epi32(step, step);
    for (int c = 0; c < kpad; c += 16) {
        __m256 nrmA = _mm256_loadu_ps(b->norms + c), nrmB = _mm256_loadu_ps(b->norms + c + 8);
        __m256 accA[NB], accB[NB];
        for (int v = 0; v < nb; v++) accA[v] = nrmA, accB[v] = nrmB;
        for (int j = 0; j < dsub; j++) {
            __m256 cA = _mm256_loadu_ps(b->ct + (size_t)j * kpad + c);
            __m256 cB = _mm256_loadu_ps(b->ct + (size_t)j * kpad + c + 8);
            for (int v = 0; v < nb; v++) {
                __m256 xv = _mm256_set1_ps(m2x[v][j]);
                accA[v] = _mm256_fmadd_ps(xv, cA, accA[v]);
                accB[v] = _mm256_fmadd_ps(xv, cB, accB[v]);
            }
        }
        const __m256i curB = _mm256_add_epi32(cur, step);
        for (int v = 0; v < nb; v++) {
            __m256 bLt = _mm256_cmp_ps(accB[v], accA[v], _CMP_LT_OQ);
            __m256 m = _mm256_min_ps(accB[v], accA[v]); /* accB < accA ? accB : accA, = blend on bLt */
            __m256 mi = _mm256_blendv_ps(_mm256_castsi256_ps(cur), _mm256_castsi256_ps(curB), bLt);
            __m256 lt = _mm256_cmp_ps(m, best[v], _CMP_LT_OQ);
            best[v] = _mm256_min_ps(m, best[v]); /* m < best ? m : best, = blend on lt */
            bidx[v] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(bidx[v]), mi, lt));
        }
        cur = _mm256_add_epi32(cur, step2);
    }
    for (int v = 0; v < nb; v++) {
        float bv[8];
        int32_t bi[8];
        _mm256_storeu_ps(bv, best[v]);
        _mm256_storeu_si256((__m256i *)bi, bidx[v]);
        /* lowest index among lanes holding the overall minimum */
        float m = bv[0];
        int32_t r = bi[0];
        for (int l = 1; l < 8; l++) {
            if (bv[l] < m || (bv[l] == m && bi[l] < r)) {
                m = bv[l];
                r = bi[l];
            }
        }
        idx[v * is] = r;
    }
}

#define DEF_NN(DSUB)                                                                                  \
    static void nn_##DSUB(const kvpq_nn_book *b, size_t n, const float *x, size_t xs, int32_t *idx, \
                          size_t is) {                                                               \
        size_t i = 0;                                                                                \
        for (; i + NB <= n; i += NB) nn_pass(b, DSUB, NB, x + i * xs, xs, idx + i * is, is);         \
        for (; i < n; i++) nn_pass(b, DSUB, 1, x + i * xs, xs, idx + i * is, is);                    \
    }
DEF_NN(1)
DEF_NN(2)
DEF_NN(4)
DEF_NN(8)
DEF_NN(16)

void kvpq__nn_avx2(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                   size_t idx_stride) {
    switch (book->dsub) {
    case 1: nn_1(book, n, x, x_stride, idx, idx_stride); return;
    case 2: nn_2(book, n, x, x_stride, idx, idx_stride); return;
    case 4: nn_4(book, n, x, x_stride, idx, idx_stride); return;
    case 8: nn_8(book, n, x, x_stride, idx, idx_stride); return;
    case 16: nn_16(book, n, x, x_stride, idx, idx_stride); return;
    default: kvpq__nn_ref(book, n, x, x_stride, idx, idx_stride); return;
    }
}
