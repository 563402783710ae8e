/* ggml_types.h — GGML tensor types: block layouts, dequantization, and dot products that
 * dequantize blocks on the fly. Numbering and block layouts as in ggml (ggml.h, ggml-common.h). */
#ifndef KVPQ_GGML_TYPES_H
#define KVPQ_GGML_TYPES_H

#include <stddef.h>
#include <stdint.h>

#include "core/ggml_common.h" /* GGML_TYPE_* numbers, block layouts */
#include "cpu/ggml_kernels.h" /* kvpq__q8row */
#include "kvpq.h"

/* "F32", "Q4_1", ...; "type <n>" style name for unknown types is written into a static buffer. */
const char *ggml_type_name(uint32_t type);
/* 1 if kvpq can dequantize this type. */
int ggml_type_supported(uint32_t type);
/* Elements per block (1 for F32/F16/BF16, 32 for Q4_0/Q4_1/Q8_0) and bytes per block; 0 if unknown. */
int64_t ggml_blck_size(uint32_t type);
size_t ggml_type_size(uint32_t type);
/* Bytes of a row of n elements (n a multiple of the block size). */
size_t ggml_row_size(uint32_t type, int64_t n);

/* Dequantize n elements (a multiple of the block size) to float32, bit-exact with ggml's
 * dequantize_row_* (checked against the PyPI gguf package). Errors: unsupported type. */
kvpq_status ggml_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);
/* The scalar specification of the same (the SIMD level in use picks the version above). */
kvpq_status ggml_dequantize_row_ref(uint32_t type, const void *src, float *dst, int64_t n);

/* y[r] = dot(row r of W, x) for r in [0, n_rows): W is (n_rows, n) of `type`, rows contiguous
 * (row stride ggml_row_size(type, n)); x: (n) float32. Dequantizes blocks on the fly (SIMD). */
void ggml_matvec(uint32_t type, const void *W, int64_t n_rows, int64_t n, const float *x, float *y);
/* ggml_matvec of several matrices on the same x (n, a multiple of 32), e.g. a layer's Q, K and V:
 * one OpenMP region over the row blocks of all of them (one wake-up of the threads instead of one
 * per matrix), the same kernels and results as one ggml_matvec each. Returns 1 when done, 0
 * (nothing written) where a type has no SIMD kernel of that form (the scalar level, Q2_K, types
 * without a kernel) or memory fails: the caller then calls ggml_matvec per matrix. */
typedef struct {
    uint32_t type;
    const void *W;
    int64_t n_rows;
    float *Y;
} ggml_mat;
int ggml_matvec_multi(const ggml_mat *mats, int n_mat, int64_t n, const float *x);
/* The specification: every element dequantized by the _ref, products summed in order in float32.
 * SIMD versions differ only by summation order. An unsupported type gives y = NaN (never silently
 * wrong; the model loader rejects such types by name first). */
void ggml_matvec_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, const float *x, float *y);

/* From this many tokens on, ggml_matmul dequantizes tiles of W to float32 for OpenBLAS sgemm;
 * below it, each weight row is dequantized once and dotted with every token. */
#define GGML_MATMUL_BLAS_MIN_TOK 32

/* Y (n_tok, n_rows) = X (n_tok, n) @ W^T, W as above. Batched: each weight row is dequantized once
 * and used for every token (or whole tiles dequantized and handed to OpenBLAS sgemm). OpenMP inside. */
void ggml_matmul(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X,
                 float *Y);
void ggml_matmul_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X,
                     float *Y);

/* ---- integer activations ----
 * Activations quantized once per row to 8-bit blocks of 32 (cpu/ggml_kernels.h kvpq__q8row: per
 * block d = max |x| / 127, x ~ d * q with q = round-to-nearest-even(x / d) in [-127, 127]), then
 * integer dot products with the weights' quants (llama.cpp's approach with its Q8_0 / Q8_K; here one
 * format for every type, a float scale per 32 elements). Each product then differs from the float32
 * path by at most sum_b (d_b / 2) sum_{j in b} |w_j| (the activation rounding) plus float rounding. */

/* 1 if ggml_matmul_q8 has kernels for the type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K). */
int ggml_q8_supported(uint32_t type);
/* Bytes of one quantized row of n activations (n a multiple of 32). */
size_t ggml_q8_row_bytes(int64_t n);
/* Quantize x (n, a multiple of 32) into buf (ggml_q8_row_bytes(n) bytes, 4-byte aligned). A block
 * holding NaN or Inf gets d = NaN (its products are NaN). */
void ggml_quantize_act_row(const float *x, int64_t n, void *buf);
/* The same through the scalar specification whatever the SIMD level (tests compare the two). */
void ggml_quantize_act_row_ref(const float *x, int64_t n, void *buf);
/* The row view of a buffer written by ggml_quantize_act_row. */
kvpq__q8row ggml_q8_row_at(void *buf, int64_t n);
/* Y (n_tok, n_rows) = X (n_tok, n) @ W^T with X quantized row by row as above, OpenMP over rows.
 * Returns 1 when done, 0 when the type has no integer kernel (or n % 32, or no memory for the
 * quantized rows): the caller then uses ggml_matmul. At the scalar SIMD level, the _ref. */
int ggml_matmul_q8(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X, float *Y);
/* One matrix of ggml_matmul_q8_multi / ggml_matvec_multi: W (n_rows, n) of type; Y (n_tok, n_rows). */
/* Several matrices on the same input X (n_tok, n), e.g. a layer's Q, K and V: X quantized once,
 * and one OpenMP region over the row blocks of all of them (one wake-up of the threads instead of
 * one per matrix). Returns 1 when done, 0 (nothing written) when a type has no integer kernel or
 * n % 32 or memory fails. */
int ggml_matmul_q8_multi(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const float *X);
/* ggml_matmul_q8_multi through the GEMM kernels (cpu/ggml_kernels.h kvpq__qgemm_fn: each panel of
 * weight rows unpacked once per call and run over every token row), for prefill steps: the same
 * integer dots, each 32-element block's (Q6_K: 16) summed exactly in int32 before its scales, so a
 * token's result differs from ggml_matmul_q8's in float rounding only, and does not depend on the
 * other rows of the call. Returns 0 (nothing written) where the level has no GEMM kernel for a
 * matrix's type (the scalar level; Q8_0 without VNNI), a matrix's rows are not a multiple of 16,
 * n % 32, or memory fails: the caller then uses ggml_matmul_q8_multi or float32. */
int ggml_qgemm_multi(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const float *X);
/* The specification: each x row quantized as above, the weights dequantized by the _ref, and
 * Y[t, r] = sum_b d_b * (sum_{j in b} w_j q_j), summed in order in float. Unsupported: NaN. */
void ggml_matmul_q8_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X,
                        float *Y);

/* fp16 <-> fp32 (IEEE half), round-to-nearest-even (core/fp16.h, the library's one converter). */
float kvpq_fp16_to_fp32(uint16_t h);
uint16_t kvpq_fp32_to_fp16(float f);
float kvpq_bf16_to_fp32(uint16_t h);

#endif
