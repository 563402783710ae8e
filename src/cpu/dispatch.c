/* dispatch.c — the CPU kernel table and the scalar reference kernels (the specification). */
#include <math.h>
#include <pthread.h>

#include "internal.h"
#include "cpu/dispatch.h"

// ---- codebook preparation ----------------------------------------------------------------------

void kvpq__nn_book_init(kvpq_nn_book *b, int dsub, int ksub, const float *C, float *ct, float *norms) {
    int kpad = kvpq__nn_kpad(ksub);
    for (int c = 0; c < kpad; c++) {
        float s = 0;
        for (int j = 0; j < dsub; j++) {
            float v = c < ksub ? C[(size_t)c * dsub + j] : 0.0f;
            ct[(size_t)j * kpad + c] = v;
            s += v * v;
        }
        norms[c] = c < ksub ? s : INFINITY;
    }
    b->dsub = dsub;
    b->ksub = ksub;
    b->kpad = kpad;
    b->ct = ct;
    b->norms = norms;
}

// ---- reference kernels -------------------------------------------------------------------------

void kvpq__nn_ref(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                  size_t idx_stride) {
    const int dsub = book->dsub, ksub = book->ksub, kpad = book->kpad;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * x_stride;
        float m2x[16]; /* -2 x_j: exact, so fmaf(m2x, c, acc) = one rounding of acc - 2 x c */
        for (int j = 0; j < dsub; j++) m2x[j] = -2.0f * xi[j];
        float best = INFINITY;
        int32_t bi = 0;
        for (int c = 0; c < ksub; c++) {
            float acc = book->norms[c];
            for (int j = 0; j < dsub; j++) acc = fmaf(m2x[j], book->ct[(size_t)j * kpad + c], acc);
            if (acc < best) { /* strict: ties keep the lowest index; NaN never wins */
                best = acc;
                bi = c;
            }
        }
        idx[i * idx_stride] = bi;
    }
}

// ---- table -------------------------------------------------------------------------------------

static kvpq_cpu_kernels tables[3];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void tables_init(void) {
    tables[KVPQ_SIMD_SCALAR].nn = kvpq__nn_ref;
    tables[KVPQ_SIMD_AVX2] = tables[KVPQ_SIMD_SCALAR];
    tables[KVPQ_SIMD_AVX2].nn = kvpq__nn_avx2;
    tables[KVPQ_SIMD_AVX512] = tables[KVPQ_SIMD_AVX2];
    tables[KVPQ_SIMD_AVX512].nn = kvpq__nn_avx512;
}

const kvpq_cpu_kernels *kvpq__cpu_kernels(void) {
    pthread_once(&tables_once, tables_init);
    /* kvpq_simd_get() never returns a level the CPU lacks, so the override is safe to call. */
    return &tables[kvpq_simd_get()];
}
