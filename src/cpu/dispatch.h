/* dispatch.h — the one CPU kernel table. Internal.
 *
 * One table per SIMD level, built once (pthread_once) on first use: the scalar level holds the
 * `_ref` kernels (the specification), the AVX2 level starts as a copy of it and is overridden by
 * every kernel the AVX2 bodies have, the AVX-512 level starts as a copy of the AVX2 one and is
 * overridden in turn. So a kernel missing at one level is the next narrower level's. Callers take
 * kvpq__cpu_kernels() (the level of kvpq_simd_get(): detected once, KVPQ_SIMD or kvpq_simd_set()
 * force a lower one) and never test the ISA themselves. docs/cpu_kernels.md has the full picture. */
#ifndef KVPQ_DISPATCH_H
#define KVPQ_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "cpu/attn_kernels.h"
#include "cpu/ggml_kernels.h"
#include "cpu/vq_kernels.h"
#include "internal.h"
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
    kvpq_simd_level level;
    kvpq_nn_fn nn;                 /* nearest-centroid search (PQ encode, k-means) */
    const kvpq_attn_kernels *attn; /* attention paths of the per-token caches (attn_kernels.h) */
    kvpq_vq_kernels vq;            /* attention from PQ codes (vq_kernels.h) */
    kvpq__dot_fn dot_f32;          /* dot(a, b) over n float32 */
    kvpq__glu_fn glu[KVPQ_GLU_COUNT]; /* gated FFN activations by kvpq_glu_kind (ggml_kernels.h) */
    kvpq__q8act_fn q8_act;         /* activation rows to 8 bits (ggml_kernels.h); NULL: the _ref */
    /* GGML tensor types by type number: SIMD row kernels (ggml_kernels.h). NULL where the level
     * has none; model/ggml_types.c then uses its _ref (the GGUF type specs live there). */
    kvpq__matvec_fn ggml_matvec[KVPQ_GGML_TYPE_SLOTS];
    kvpq__dequant_fn ggml_dequant[KVPQ_GGML_TYPE_SLOTS];
    /* Integer-activation matvec / GEMM by type number (ggml_kernels.h); NULL where the level has
     * none (the scalar level: ggml_types.c's _ref). */
    kvpq__qmatmul_fn ggml_qmatmul[KVPQ_GGML_TYPE_SLOTS];
    /* Integer-activation GEMM for prefill steps (ggml_kernels.h kvpq__qgemm_fn); NULL likewise. */
    kvpq__qgemm_fn ggml_qgemm[KVPQ_GGML_TYPE_SLOTS];
} kvpq_cpu_kernels;

/* The table of kvpq_simd_get()'s level. Never NULL. */
KVPQ_INTERNAL_API const kvpq_cpu_kernels *kvpq__cpu_kernels(void);
/* The table of a level; a level above what the CPU supports gives the best it does. */
const kvpq_cpu_kernels *kvpq__cpu_kernels_for(kvpq_simd_level level);
/* The best level this CPU supports (detected once). */
kvpq_simd_level kvpq__simd_best(void);
/* 1 when the AVX-512 level takes the VNNI builds of the integer kernels: the CPU has AVX512_VNNI and
 * KVPQ_VNNI is not "0" (read once, with the tables; "0" tests the maddubs + madd forms on a VNNI CPU). */
int kvpq__vnni_on(void);

/* Build a padded, transposed codebook from C: (ksub, dsub), C row-major. ct: (dsub, kpad) and
 * norms: (kpad) are caller-provided (kpad = kvpq__nn_kpad(ksub)). */
static inline int kvpq__nn_kpad(int ksub) { return (ksub + KVPQ_NN_PAD - 1) / KVPQ_NN_PAD * KVPQ_NN_PAD; }
void kvpq__nn_book_init(kvpq_nn_book *b, int dsub, int ksub, const float *C, float *ct, float *norms);

/* Variants: nn_body.h compiled per ISA by nn_avx2.c and nn_avx512.c. */
void kvpq__nn_ref(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                  size_t idx_stride);
void kvpq__nn_avx2(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                   size_t idx_stride);
/* dot(a, b) over n float32 summed in order: the specification of kvpq_cpu_kernels.dot_f32. */
float kvpq__dot_f32_ref(const float *a, const float *b, int64_t n);
void kvpq__nn_avx512(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                     size_t idx_stride);

#endif
