/* ggml_kernels.h — per-ISA kernels behind ggml_matvec / ggml_matmul (model/ggml_types.c is the
 * dispatcher and holds the scalar _ref specification). One body, cpu/ggml_body.h, compiled per ISA
 * by ggml_avx2.c and ggml_avx512.c. Type numbers and block layouts: core/ggml_common.h. Internal. */
#ifndef KVPQ_GGML_KERNELS_H
#define KVPQ_GGML_KERNELS_H

#include <stddef.h>
#include <stdint.h>

/* Slots of the kernel table's per-type arrays: every ggml type number is below it. */
#define KVPQ_GGML_TYPE_SLOTS 64

/* y[r] = dot(row r of W, x) for r in [0, n_rows). W: n_rows rows of row_bytes bytes each, n
 * elements per row (a multiple of the type's block size); x: (n) float32; xs: (n/32) sums of x over
 * each 32-element block (used by the Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K kernels to apply the block offsets or
 * mins once per block; Q2_K: (n/16) sums over 16-element groups, its sub-blocks; may be NULL for
 * other types); y: (n_rows). */
typedef void (*kvpq__matvec_fn)(const uint8_t *W, size_t row_bytes, int64_t n_rows, int64_t n, const float *x,
                                const float *xs, float *y);
/* One row of n activations (n a multiple of 32) quantized to 8 bits in 32-element blocks b:
 * x[32 b + j] ~ d[b] * qs[32 b + j] with qs in [-127, 127] and d[b] = max_j |x[32 b + j]| / 127;
 * s16: (n/16) the integer sums of qs over 16-element groups; xs: (n/32) d[b] * (s16[2b] + s16[2b+1]),
 * the block sums of the quantized x (the offsets and mins of the weights go through them). Written
 * by ggml_quantize_act_row (model/ggml_types.h). */
typedef struct {
    const int8_t *qs;
    const float *d;
    const int16_t *s16;
    const float *xs;
} kvpq__q8row;

/* Y[t * ldy + r] = dot(row r of W, x_t) for r < n_rows, t < n_tok, x_t the quantized activation
 * row X[t] (n elements): integer dot products of each 32-element block of quants with qs, scaled by
 * the block's weight scale times d, plus the weights' offsets and mins times s16 / xs. W as for
 * kvpq__matvec_fn. The _ref (model/ggml_types.c ggml_matmul_q8_ref) is the same sum over the _ref's
 * dequantized weights in float. */
typedef void (*kvpq__qmatmul_fn)(const uint8_t *W, size_t row_bytes, int64_t n_rows, int64_t n,
                                 const kvpq__q8row *X, int64_t n_tok, float *Y, int64_t ldy);

/* Activation rows packed for the integer GEMM (kvpq__qgemm_fn): the rows of kvpq__q8row (same
 * quants, scales and sums) in tiles of KVPQ_QG_TILE token rows, so a kernel reads one element group
 * of a whole tile from one place. Tile i, element group k (elements 4k .. 4k+3, as one int32 of 4
 * int8): q[(i n/4 + k) KVPQ_QG_TILE + t]; 32-element block b: d[(i n/32 + b) KVPQ_QG_TILE + t] and
 * xs (d times the block's sum of quants) at the same index; 16-element group g: x16[(i n/16 + g)
 * KVPQ_QG_TILE + t] (d times the group's sum). Rows past n_tok in the last tile are 0. Written by
 * ggml_types.c (q8_tiles_fill). */
#define KVPQ_QG_TILE 12
typedef struct {
    const int32_t *q;        /* (tiles, n / 4, KVPQ_QG_TILE) 4 int8 quants as one int32 */
    const float *d, *xs, *x16; /* (tiles, n / 32, KVPQ_QG_TILE) twice, (tiles, n / 16, KVPQ_QG_TILE) */
} kvpq__q8tiles;
/* Weight rows of one kvpq__qgemm_fn call: a multiple of every level's panel (its vector width). */
#define KVPQ_QG_ROWS 16

/* Y[t * ldy + r] for r < n_rows (a multiple of KVPQ_QG_ROWS), t < n_tok: what
 * kvpq__qmatmul_fn gives for the same rows (the same integer dots, scaled per 32-element block; Q6_K
 * per 16), with weight rows unpacked once into `panel` (kvpq__qgemm_panel_bytes(n) bytes, 64-byte
 * aligned, the caller's) and each panel of rows run over every tile of X: a GEMM's weights are
 * unpacked once per call instead of once per 4 tokens. */
typedef void (*kvpq__qgemm_fn)(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const kvpq__q8tiles *X,
                               int64_t n_tok, float *Y, int64_t ldy, void *panel);
/* Bytes of a GEMM panel for rows of n elements (KVPQ_QG_ROWS rows: the widest level's panel). */
static inline size_t kvpq__qgemm_panel_bytes(int64_t n) {
    return (size_t)n * KVPQ_QG_ROWS + (size_t)(n / 16) * KVPQ_QG_ROWS * 2 * sizeof(float);
}

/* One activation row to 8 bits (the kvpq__q8row above): x (n), n a multiple of 32, into qs (n),
 * d (n/32), s16 (n/16), xs (n/32). The specification is model/ggml_types.c's _ref (ggml_quantize_act_row
 * uses it where the level has no kernel); a kernel gives its bits exactly. */
typedef void (*kvpq__q8act_fn)(const float *x, int64_t n, int8_t *qs, float *d, int16_t *s16, float *xs);
kvpq__q8act_fn kvpq__q8act_avx2(void);
kvpq__q8act_fn kvpq__q8act_avx512(void);

/* dot(a, b) over n float32. */
typedef float (*kvpq__dot_fn)(const float *a, const float *b, int64_t n);
/* Dequantize n elements (a multiple of the block size) of a row; bit-exact with the _ref. */
typedef void (*kvpq__dequant_fn)(const uint8_t *src, float *dst, int64_t n);

/* The gated activations of the FFN (the model's elementwise hot spot after the matrices): in place,
 * g[i] = act(g[i]) * u[i] for i < n. KVPQ_GLU_GELU_TANH: act(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x +
 * 0.044715 x^3))) (Hendrycks & Gimpel 2016, arXiv 1606.08415; Gemma's GeGLU); KVPQ_GLU_SILU:
 * act(x) = x / (1 + exp(-x)) (SwiGLU, Shazeer 2020, arXiv 2002.05202). The _ref (kvpq__glu_ref) is
 * libm's tanhf / expf; the SIMD versions write 0.5 (1 + tanh(y)) as sigmoid(2 y) and take the
 * sigmoid from simd.h's vf_exp, a few ulp from the _ref. */
typedef enum { KVPQ_GLU_SILU = 0, KVPQ_GLU_GELU_TANH = 1, KVPQ_GLU_COUNT } kvpq_glu_kind;
typedef void (*kvpq__glu_fn)(float *g, const float *u, int64_t n);
void kvpq__glu_ref(kvpq_glu_kind kind, float *g, const float *u, int64_t n);
kvpq__glu_fn kvpq__glu_avx2(kvpq_glu_kind kind);
kvpq__glu_fn kvpq__glu_avx512(kvpq_glu_kind kind);

/* Kernel for a ggml type at that ISA, or NULL when there is none (the dispatcher then dequantizes
 * chunks with the _ref and uses the ISA's dot). x86-64 builds only. */
kvpq__matvec_fn kvpq__ggml_matvec_avx2(uint32_t type);
kvpq__matvec_fn kvpq__ggml_matvec_avx512(uint32_t type);
kvpq__dequant_fn kvpq__ggml_dequant_avx2(uint32_t type);
kvpq__qmatmul_fn kvpq__ggml_qmatmul_avx2(uint32_t type);
kvpq__qmatmul_fn kvpq__ggml_qmatmul_avx512(uint32_t type);
/* The same compiled with AVX512_VNNI (ggml_avx512vnni.c): for CPUs that have it. */
kvpq__qmatmul_fn kvpq__ggml_qmatmul_avx512vnni(uint32_t type);
kvpq__qgemm_fn kvpq__ggml_qgemm_avx2(uint32_t type);
kvpq__qgemm_fn kvpq__ggml_qgemm_avx512(uint32_t type);
kvpq__qgemm_fn kvpq__ggml_qgemm_avx512vnni(uint32_t type);
kvpq__dequant_fn kvpq__ggml_dequant_avx512(uint32_t type);
float kvpq__dot_f32_avx2(const float *a, const float *b, int64_t n);
float kvpq__dot_f32_avx512(const float *a, const float *b, int64_t n);

#endif
