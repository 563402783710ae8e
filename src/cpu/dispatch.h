/* dispatch.h — the CPU kernel table: filled with the scalar `_ref` kernels (the specification),
 * then overridden by the AVX2 / AVX-512 variants that kvpq_simd_get() allows. Internal. */
#ifndef KVPQ_DISPATCH_H
#define KVPQ_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq.h"

/* Centroids are padded to a multiple of KVPQ_NN_PAD so that SIMD kernels never need a tail loop:
 * padded centroids have coordinates 0 and norm +INF, so they never win a (strict <) comparison. */
#define KVPQ_NN_PAD 16

/* A codebook prepared for nearest-centroid search (see kvpq__nn_book_init). */
typedef struct {
    int dsub;           /* 1, 2, 4, 8 or 16 */
    int ksub;           /* real centroids */
    int kpad;           /* ksub rounded up to KVPQ_NN_PAD */
    const float *ct;    /* (dsub, kpad) centroids transposed: ct[j * kpad + c] = C[c][j] */
    const float *norms; /* (kpad) ||C[c]||^2; +INF for padding */
} kvpq_nn_book;

/* Nearest centroid of n sub-vectors: sub-vector i is x[i * x_stride + 0 .. dsub).
 * idx[i * idx_stride] = argmin_c (norms[c] - 2 x.C[c]), ties to the lowest c.
 * The distance of every centroid is accumulated in exactly this order, in every variant:
 *     acc = norms[c];  for j in 0..dsub: acc = fmaf(-2 * x[j], C[c][j], acc)
 * (-2 x[j] is exact), so all SIMD levels produce bit-identical distances and identical codes. */
typedef void (*kvpq_nn_fn)(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride,
                           int32_t *idx, size_t idx_stride);

typedef struct {
    kvpq_nn_fn nn; /* nearest-centroid search */
} kvpq_cpu_kernels;

/* The table for the current SIMD level (kvpq_simd_get()); re-resolved when the level changes. */
const kvpq_cpu_kernels *kvpq__cpu_kernels(void);

/* Build a padded, transposed codebook from C: (ksub, dsub), C row-major. ct: (dsub, kpad) and
 * norms: (kpad) are caller-provided (kpad = kvpq__nn_kpad(ksub)). */
static inline int kvpq__nn_kpad(int ksub) { return (ksub + KVPQ_NN_PAD - 1) / KVPQ_NN_PAD * KVPQ_NN_PAD; }
void kvpq__nn_book_init(kvpq_nn_book *b, int dsub, int ksub, const float *C, float *ct, float *norms);

/* Variants (each file compiled with its ISA flags). */
void kvpq__nn_ref(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                  size_t idx_stride);
void kvpq__nn_avx2(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                   size_t idx_stride);
void kvpq__nn_avx512(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                     size_t idx_stride);

#endif
