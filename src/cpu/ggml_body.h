/* ggml_body.h — the SIMD kernels for GGML tensor types, written once on simd.h and compiled per ISA
 * by ggml_avx2.c and ggml_avx512.c (each defines KVPQ_ISA_* and includes this file): matvec rows
 * that dequantize blocks on the fly, and bit-exact row dequantization. The scalar _ref in
 * model/ggml_types.c (over the block functions of core/ggml_common.h) is the specification.
 *
 * Adding a kernel for a ggml type (say Q4_K):
 *   1. its block layout and scalar block dequantization go in core/ggml_common.h;
 *   2. here, its block function `blk_q4_k` (see blk_q8_0: unpack the block with the vf_* loads, a
 *      32-element run is QV vectors, return the vector dot, the scale and the scalar offset term)
 *      and `MATVEC_BLOCKS(q4_k, block_q4_k, QK_K, off_scale)`, which walks the rows (two
 *      accumulators, one vf_reduce_add per row); a type whose block does not fit that shape writes
 *      its own `static void matvec_q4_k(W, rb, n_rows, n, x, xs, y)`. If its dequantization can be
 *      bit-exact, also `static void dequant_q4_k(const uint8_t *src, float *y, int64_t n)`;
 *   3. a `case GGML_TYPE_Q4_K:` in the two switches at the bottom (matvec and dequant).
 * Both ISAs pick it up from the one body; tests/test_ggml_types.c runs every level against the
 * _ref (KVPQ_SIMD=scalar|avx2|avx512 forces one). No new file, no CMake change. */
#if defined(__clang__)
/* Dequantization rounds the product and the sum separately (bit-exact with ggml / numpy). */
#pragma STDC FP_CONTRACT OFF
#endif
#include <string.h>

#include "core/ggml_common.h"
#include "cpu/ggml_kernels.h"
#include "cpu/simd.h"

#define W KVPQ_VW
/* A block's fp16 field, converted by the ISA (F16C where there is one). */
#define BLK_F16(p, T, F) vs_h2f_at(KVPQ_BLK_AT(p, T, F))
#define QV (32 / KVPQ_VW) /* vectors per 32-element block */

// ---- block unpacking ------------------------------------------------------------------------------

/* 16 bytes of nibbles -> the 32 unsigned values of a Q4 block, as QV vectors. */
KVPQ_INLINE void q4_block(const uint8_t *qs, kvpq_vf f[QV]) { vf_load_nibbles32(qs, f); }

KVPQ_INLINE void q8_block(const uint8_t *qs, kvpq_vf f[QV]) {
    for (int k = 0; k < QV; k++) f[k] = vf_load_i8((const int8_t *)qs + k * W);
}

/* sum_j f_j * x_j over one 32-element block in two chains (even and odd vectors) for latency;
 * with only two vectors (W = 16) the second is fused into the first (one rounding fewer). */
KVPQ_INLINE kvpq_vf block_dot(const kvpq_vf f[QV], const float *x) {
    kvpq_vf s0 = vf_mul(f[0], vf_load(x));
    if (QV == 2) return vf_fma(f[1], vf_load(x + W), s0);
    kvpq_vf s1 = vf_mul(f[1], vf_load(x + W));
    for (int k = 2; k < QV; k += 2) {
        s0 = vf_fma(f[k], vf_load(x + k * W), s0);
        s1 = vf_fma(f[k + 1], vf_load(x + (k + 1) * W), s1);
    }
    return vf_add(s0, s1);
}

// ---- matvec kernels -------------------------------------------------------------------------------

/* One block of a quantized type, as the row walker below sees it: dot = the block's values before
 * its scale times x (QV vectors' worth), d = the scale, off = the scalar rest of the block's
 * contribution (offset terms times xs, the block sums of x), to be multiplied by the walker's
 * off_scale. So a block contributes d * dot + off_scale * off. */
typedef void (*blk_fn)(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off);

/* Rows of blocks of bs bytes and qk elements: two blocks at a time into two accumulators (latency),
 * then the leftover block; offsets summed in a float beside; one vf_reduce_add per row.
 * off_scale == 0: the type has no offset term (xs may be NULL). Inlined per type (blk constant). */
KVPQ_INLINE void matvec_blocks(blk_fn blk, size_t bs, int qk, float off_scale, const uint8_t *W_, size_t rb,
                               int64_t n_rows, int64_t n, const float *x, const float *xs, float *y) {
    const int64_t nb = n / qk;
    const int xq = qk / 32; /* xs entries per block */
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf acc0 = vf_zero(), acc1 = vf_zero(), v0, v1;
        float accm = 0, d0, d1, o0 = 0, o1 = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, p += 2 * bs) {
            blk(p, x + b * qk, off_scale != 0 ? xs + b * xq : NULL, &v0, &d0, &o0);
            blk(p + bs, x + (b + 1) * qk, off_scale != 0 ? xs + (b + 1) * xq : NULL, &v1, &d1, &o1);
            acc0 = vf_fma(vf_set1(d0), v0, acc0);
            acc1 = vf_fma(vf_set1(d1), v1, acc1);
            if (off_scale != 0) accm += o0 + o1;
        }
        for (; b < nb; b++, p += bs) {
            blk(p, x + b * qk, off_scale != 0 ? xs + b * xq : NULL, &v0, &d0, &o0);
            acc0 = vf_fma(vf_set1(d0), v0, acc0);
            if (off_scale != 0) accm += o0;
        }
        float s = vf_reduce_add(vf_add(acc0, acc1));
        y[r] = off_scale != 0 ? s + off_scale * accm : s;
    }
}

/* Q4_1: w = q*d + m, so a block gives d * (q . x) + m * sum(x). */
KVPQ_INLINE void blk_q4_1(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off) {
    kvpq_vf f[QV];
    q4_block(KVPQ_BLK_AT(p, block_q4_1, qs), f);
    *dot = block_dot(f, x);
    *d = BLK_F16(p, block_q4_1, d);
    *off = BLK_F16(p, block_q4_1, m) * xs[0];
}

/* Q4_0: w = (q - 8)*d, so a block gives d * (q . x) - 8 * d * sum(x). */
KVPQ_INLINE void blk_q4_0(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off) {
    kvpq_vf f[QV];
    q4_block(KVPQ_BLK_AT(p, block_q4_0, qs), f);
    *dot = block_dot(f, x);
    *d = BLK_F16(p, block_q4_0, d);
    *off = *d * xs[0];
}

KVPQ_INLINE void blk_q8_0(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off) {
    kvpq_vf f[QV];
    q8_block(KVPQ_BLK_AT(p, block_q8_0, qs), f);
    *dot = block_dot(f, x);
    *d = BLK_F16(p, block_q8_0, d);
}

/* matvec_<type> from blk_<type>: the walker with the type's block size and offset scale. */
#define MATVEC_BLOCKS(TYPE, BLOCK, QK, OFF_SCALE)                                                               \
    static void matvec_##TYPE(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x,         \
                              const float *xs, float *y) {                                                     \
        matvec_blocks(blk_##TYPE, sizeof(BLOCK), QK, OFF_SCALE, W_, rb, n_rows, n, x, xs, y);                  \
    }
MATVEC_BLOCKS(q4_1, block_q4_1, QK4_1, 1.0f)
MATVEC_BLOCKS(q4_0, block_q4_0, QK4_0, -8.0f)
MATVEC_BLOCKS(q8_0, block_q8_0, QK8_0, 0.0f)

float KVPQ_ISA_FN(kvpq__dot_f32)(const float *a, const float *b, int64_t n) { return vf_dot(a, b, n); }

static void matvec_f32(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                       float *y) {
    for (int64_t r = 0; r < n_rows; r++) y[r] = vf_dot((const float *)(const void *)(W_ + (size_t)r * rb), x, n);
}

/* 16-bit float rows (F16, BF16): two accumulators over 2W elements, a scalar tail. */
#define MATVEC_16BIT(NAME, LOAD, SCALAR)                                                                        \
    static void NAME(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs, \
                     float *y) {                                                                                \
        for (int64_t r = 0; r < n_rows; r++) {                                                                  \
            const uint16_t *w = (const uint16_t *)(const void *)(W_ + (size_t)r * rb);                          \
            kvpq_vf s0 = vf_zero(), s1 = vf_zero();                                                             \
            int64_t i = 0;                                                                                      \
            for (; i + 2 * W <= n; i += 2 * W) {                                                                \
                s0 = vf_fma(LOAD(w + i), vf_load(x + i), s0);                                                   \
                s1 = vf_fma(LOAD(w + i + W), vf_load(x + i + W), s1);                                           \
            }                                                                                                   \
            float s = vf_reduce_add(vf_add(s0, s1));                                                            \
            for (; i < n; i++) {                                                                                \
                uint16_t h;                                                                                     \
                memcpy(&h, w + i, sizeof h);                                                                    \
                s += SCALAR(h) * x[i];                                                                          \
            }                                                                                                   \
            y[r] = s;                                                                                           \
        }                                                                                                       \
    }
MATVEC_16BIT(matvec_f16, vf_load_f16, kvpq__h2f)
MATVEC_16BIT(matvec_bf16, vf_load_bf16, kvpq__bf2f)

kvpq__matvec_fn KVPQ_ISA_FN(kvpq__ggml_matvec)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return matvec_f32;
    case GGML_TYPE_F16: return matvec_f16;
    case GGML_TYPE_BF16: return matvec_bf16;
    case GGML_TYPE_Q4_0: return matvec_q4_0;
    case GGML_TYPE_Q4_1: return matvec_q4_1;
    case GGML_TYPE_Q8_0: return matvec_q8_0;
    }
    return NULL;
}

// ---- dequantization (bit-exact: exact int->float conversions, one rounded mul, one rounded add) ----

static void dequant_q4_1(const uint8_t *p, float *y, int64_t n) {
    for (int64_t b = 0; b < n / QK4_1; b++, p += sizeof(block_q4_1), y += QK4_1) {
        kvpq_vf d = vf_set1(BLK_F16(p, block_q4_1, d)), m = vf_set1(BLK_F16(p, block_q4_1, m)), f[QV];
        q4_block(KVPQ_BLK_AT(p, block_q4_1, qs), f);
        for (int k = 0; k < QV; k++) vf_store(y + k * W, vf_add(vf_mul(f[k], d), m));
    }
}

static void dequant_q4_0(const uint8_t *p, float *y, int64_t n) {
    const kvpq_vf eight = vf_set1(8.0f);
    for (int64_t b = 0; b < n / QK4_0; b++, p += sizeof(block_q4_0), y += QK4_0) {
        kvpq_vf d = vf_set1(BLK_F16(p, block_q4_0, d)), f[QV];
        q4_block(KVPQ_BLK_AT(p, block_q4_0, qs), f);
        /* q - 8 is exact in float, so this equals ggml's (float)(q - 8) * d. */
        for (int k = 0; k < QV; k++) vf_store(y + k * W, vf_mul(vf_sub(f[k], eight), d));
    }
}

static void dequant_q8_0(const uint8_t *p, float *y, int64_t n) {
    for (int64_t b = 0; b < n / QK8_0; b++, p += sizeof(block_q8_0), y += QK8_0) {
        kvpq_vf d = vf_set1(BLK_F16(p, block_q8_0, d)), f[QV];
        q8_block(KVPQ_BLK_AT(p, block_q8_0, qs), f);
        for (int k = 0; k < QV; k++) vf_store(y + k * W, vf_mul(f[k], d));
    }
}

static void dequant_f16(const uint8_t *src, float *y, int64_t n) {
    const uint16_t *h = (const uint16_t *)(const void *)src;
    int64_t i = 0;
    for (; i + W <= n; i += W) vf_store(y + i, vf_load_f16(h + i));
    for (; i < n; i++) y[i] = kvpq__h2f_at(h + i);
}

kvpq__dequant_fn KVPQ_ISA_FN(kvpq__ggml_dequant)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return dequant_q4_0;
    case GGML_TYPE_Q4_1: return dequant_q4_1;
    case GGML_TYPE_Q8_0: return dequant_q8_0;
    case GGML_TYPE_F16: return dequant_f16;
    }
    return NULL;
}

#undef W
#undef BLK_F16
#undef QV
