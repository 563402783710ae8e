/* nn_avx512.c — nearest-centroid search, AVX-512: 16 centroids per register, 4 sub-vectors per pass
 * (each centroid block is loaded once for 4 sub-vectors); distances never leave registers. */
#include <immintrin.h>
#include <math.h>

#include "cpu/dispatch.h"

#define NB 4 /* sub-vectors per pass */

static inline __attribute__((always_inline)) void nn_pass(const kvpq_nn_book *b, int dsub, int nb,
                                                          const float *x, size_t xs, int32_t *idx,
                                                          size_t is) {
    float m2x[NB][16];
    for (int v = 0; v < nb; v++)
        for (int j = 0; j < dsub; j++) m2x[v][j] = -2.0f * x[v * xs + j];
    __m512 best[NB];
    __m512i bidx[NB];
    for (int v = 0; v < nb; v++) {
        best[v] = _mm512_set1_ps(INFINITY);
        bidx[v] = _mm512_setzero_si512();
    }
    __m512i cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    const int kpad = b->kpad;
    for (int c = 0; c < kpad; c += 16) {
        __m512 nrm = _mm512_loadu_ps(b->norms + c);
        __m512 acc[NB];
        for (int v = 0; v < nb; v++) acc[v] = nrm;
        for (int j = 0; j < dsub; j++) {
            __m512 cj = _mm512_loadu_ps(b->ct + (size_t)j * kpad + c);
            for (int v = 0; v < nb; v++) acc[v] = _mm512_fmadd_ps(_mm512_set1_ps(m2x[v][j]), cj, acc[v]);
        }
        for (int v = 0; v < nb; v++) {
            __mmask16 lt = _mm512_cmp_ps_mask(acc[v], best[v], _CMP_LT_OQ);
            best[v] = _mm512_mask_mov_ps(best[v], lt, acc[v]);
            bidx[v] = _mm512_mask_mov_epi32(bidx[v], lt, cur);
        }
        cur = _mm512_add_epi32(cur, step);
    }
    for (int v = 0; v < nb; v++) {
        /* Lane l holds the best of centroids l, l+16, ... (lowest index on ties); the answer is the
         * lowest index among lanes holding the overall minimum. */
        float m = _mm512_reduce_min_ps(best[v]);
        __mmask16 eq = _mm512_cmp_ps_mask(best[v], _mm512_set1_ps(m), _CMP_EQ_OQ);
        idx[v * is] = _mm512_mask_reduce_min_epi32(eq, bidx[v]);
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

void kvpq__nn_avx512(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
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
