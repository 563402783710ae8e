/* nn_body.h — nearest-centroid search (kvpq__nn_ref's contract, see dispatch.h), written once on
 * simd.h and compiled per ISA by nn_avx2.c and nn_avx512.c. Codes are bit-identical to the _ref at
 * every width: each distance is accumulated in the _ref's order (norm, then one FMA per coordinate)
 * and the argmin keeps the lowest index on ties.
 *
 * Per pass, NB sub-vectors share each load of 16 centroids (16 / W vectors per coordinate); their
 * distances never leave registers (AVX2: 2 sub-vectors x 2 blocks, AVX-512: 4 x 1). */
#include <math.h>

#include "cpu/dispatch.h"
#include "cpu/simd.h"

#define W KVPQ_VW
#define NBLK (KVPQ_NN_PAD / W)     /* centroid vectors per step of KVPQ_NN_PAD centroids */
#define NB (W >= 8 ? W / 4 : 1)    /* sub-vectors per pass */

static inline __attribute__((always_inline)) void nn_pass(const kvpq_nn_book *b, int dsub, int nb, const float *x,
                                                          size_t xs, int32_t *idx, size_t is) {
    float m2x[NB][16];
    for (int v = 0; v < nb; v++)
        for (int j = 0; j < dsub; j++) m2x[v][j] = -2.0f * x[v * xs + j];
    kvpq_vf best[NB];
    kvpq_vi bidx[NB];
    for (int v = 0; v < nb; v++) {
        best[v] = vf_set1(INFINITY);
        bidx[v] = vi_set1(0);
    }
    const kvpq_vi step = vi_set1(W);
    kvpq_vi cur = vi_iota();
    const int kpad = b->kpad;
    for (int c = 0; c < kpad; c += KVPQ_NN_PAD) {
        kvpq_vf acc[NB][NBLK];
        for (int k = 0; k < NBLK; k++) {
            const kvpq_vf nrm = vf_load(b->norms + c + k * W);
            for (int v = 0; v < nb; v++) acc[v][k] = nrm;
        }
        for (int j = 0; j < dsub; j++)
            for (int k = 0; k < NBLK; k++) {
                const kvpq_vf cj = vf_load(b->ct + (size_t)j * kpad + c + k * W);
                for (int v = 0; v < nb; v++) acc[v][k] = vf_fma(vf_set1(m2x[v][j]), cj, acc[v][k]);
            }
        /* The blocks' lane-wise minimum (an earlier block wins ties: a later one must be strictly
         * smaller; vf_min(a, b) is exactly a < b ? a : b), merged into the running best once. */
        for (int v = 0; v < nb; v++) {
            kvpq_vf m = acc[v][0];
            kvpq_vi mi = cur, ck = cur;
            for (int k = 1; k < NBLK; k++) {
                ck = vi_add(ck, step);
                mi = vi_blend(mi, ck, vf_lt(acc[v][k], m));
                m = vf_min(acc[v][k], m);
            }
            const kvpq_vm lt = vf_lt(m, best[v]);
            best[v] = vf_min(m, best[v]);
            bidx[v] = vi_blend(bidx[v], mi, lt);
        }
        for (int k = 0; k < NBLK; k++) cur = vi_add(cur, step);
    }
    /* Lane l holds the best of its centroids (lowest index on ties); the answer is the lowest
     * index among the lanes holding the overall minimum. */
    for (int v = 0; v < nb; v++) idx[v * is] = vf_argmin_lowest(best[v], bidx[v]);
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

void KVPQ_ISA_FN(kvpq__nn)(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
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

#undef W
#undef NBLK
#undef NB
