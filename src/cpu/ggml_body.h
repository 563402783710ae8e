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
 *   3. a `case GGML_TYPE_Q4_K:` in the two switches at the bottom (matvec and dequant);
 *   4. for 8-bit activations, its unpacking into unsigned bytes (`qb_<type>` + QMATMUL_BLOCKS for
 *      32-element blocks, `qk_<type>` + QMATMUL_K for K-quant super-blocks) and a case in
 *      kvpq__ggml_qmatmul's switch (section "integer activations" below).
 * Both ISAs pick it up from the one body; tests/test_ggml_types.c runs every level against the
 * _ref (KVPQ_SIMD=scalar|avx2|avx512 forces one). No new file, no CMake change. */
#if defined(__clang__)
/* Dequantization rounds the product and the sum separately (bit-exact with ggml / numpy). */
#pragma STDC FP_CONTRACT OFF
#endif
#include <float.h>
#include <string.h>

#include "core/ggml_common.h"
#include "cpu/ggml_kernels.h"
#include "cpu/simd.h"

#define W KVPQ_VW
/* A block's fp16 field, converted by the ISA (F16C where there is one). */
#define BLK_F16(p, T, F) vs_h2f_at(KVPQ_BLK_AT(p, T, F))
#define QV (32 / KVPQ_VW) /* vectors per 32-element block */

/* Software prefetch distance of the 32-element block kernels, in bytes. */
#define BPF_BYTES 1024
/* A Q5 block's fifth bits: qh, 4 bytes little-endian (may be unaligned). */
KVPQ_INLINE uint32_t q5_qh(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, sizeof h);
    return h; /* x86: little-endian, as the file */
}

#if !defined(KVPQ_GGML_Q8_ONLY) /* float32-activation kernels (not in the VNNI build: ggml_avx512vnni.c) */
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
            /* one line ahead per pair of blocks (>= 36 bytes): every line of the stream is asked for
             * BPF_BYTES early (decode reads each weight once from DRAM; see KPF_DIST below) */
            __builtin_prefetch(p + BPF_BYTES, 0, 3);
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

/* Q5_0: w = (q - 16)*d, so a block gives d * (q . x) - 16 * d * sum(x). */
KVPQ_INLINE void blk_q5_0(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off) {
    kvpq_vf f[QV];
    vf_load_q5_32(KVPQ_BLK_AT(p, block_q5_0, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_0, qh)), f);
    *dot = block_dot(f, x);
    *d = BLK_F16(p, block_q5_0, d);
    *off = *d * xs[0];
}

/* Q5_1: w = q*d + m, so a block gives d * (q . x) + m * sum(x). */
KVPQ_INLINE void blk_q5_1(const uint8_t *p, const float *x, const float *xs, kvpq_vf *dot, float *d, float *off) {
    kvpq_vf f[QV];
    vf_load_q5_32(KVPQ_BLK_AT(p, block_q5_1, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_1, qh)), f);
    *dot = block_dot(f, x);
    *d = BLK_F16(p, block_q5_1, d);
    *off = BLK_F16(p, block_q5_1, m) * xs[0];
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
MATVEC_BLOCKS(q5_0, block_q5_0, QK5_0, -16.0f)
MATVEC_BLOCKS(q5_1, block_q5_1, QK5_1, 1.0f)
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

#endif /* !KVPQ_GGML_Q8_ONLY */

// ---- K-quants (Q2_K .. Q6_K: super-blocks of QK_K = 256, layouts in core/ggml_common.h) -----------
/* A block's quants are unpacked to 256 bytes by plain loops (the compiler vectorizes them at this
 * file's ISA width), its sub-block scales d * sc (exact in float32) converted W at a time; then each
 * sub-block's W-byte runs are converted exactly to float and FMA'd with x in one chain, and the sum
 * scaled once by its dl into one of four accumulators (the FMA latency would otherwise bound the
 * loop). The mins (Q2_K, Q4_K, Q5_K) are applied once per sub-block through xs, the sums of x over
 * it. Activations stay float32 (no 8-bit quantization of x as llama.cpp's q8_K), so the result is
 * the _ref's up to the order of a float32 sum. */

#define KBLK_AT(p, T, F) KVPQ_BLK_AT(p, T, F)

/* The scales and mins of a Q4_K / Q5_K block as 8 bytes each (byte j = sub-block j), unpacked 4 at
 * a time in 32-bit words: the values of kvpq__k4_scale_min (the top 2 bits of bytes 0..7 are the
 * high bits of j >= 4). */
KVPQ_INLINE void k4_scales(const uint8_t *s, uint64_t *sc, uint64_t *m) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    *sc = (uint64_t)(a & 0x3f3f3f3fu) | (uint64_t)((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
    *m = (uint64_t)(b & 0x3f3f3f3fu) | (uint64_t)(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
}

#if !defined(KVPQ_GGML_Q8_ONLY) /* float32-activation kernels (not in the VNNI build: ggml_avx512vnni.c) */
/* out[j] = d * p[j] for j < n (n a multiple of 8; p and out hold max(n, W) entries). */
KVPQ_INLINE void scales_u8(float d, const uint8_t *p, int n, float *out) {
    for (int j = 0; j < n; j += W) vf_store(out + j, vf_mul(vf_set1(d), vf_load_u8(p + j)));
}
KVPQ_INLINE void scales_i8(float d, const int8_t *p, int n, float *out) {
    for (int j = 0; j < n; j += W) vf_store(out + j, vf_mul(vf_set1(d), vf_load_i8(p + j)));
}

/* Q2_K: u[e] = q in 0..3. */
KVPQ_INLINE void unpack_q2_K(const uint8_t *p, uint8_t u[QK_K]) {
    const uint8_t *qs = KBLK_AT(p, block_q2_K, qs);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) u[128 * h + 32 * s + l] = (qs[32 * h + l] >> (2 * s)) & 3;
}

/* Q3_K: q[e] in -4..3. */
KVPQ_INLINE void unpack_q3_K(const uint8_t *p, int8_t q[QK_K]) {
    const uint8_t *qs = KBLK_AT(p, block_q3_K, qs), *hm = KBLK_AT(p, block_q3_K, hmask);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                int j = 4 * h + s;
                q[32 * j + l] = (int8_t)((((qs[32 * h + l] >> (2 * s)) & 3) | (((hm[l] >> j) & 1) << 2)) - 4);
            }
}

/* Q4_K: u[e] = q in 0..15. */
KVPQ_INLINE void unpack_q4_K(const uint8_t *p, uint8_t u[QK_K]) {
    const uint8_t *qs = KBLK_AT(p, block_q4_K, qs);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            u[64 * c + l] = qs[32 * c + l] & 15;
            u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
}

/* Q5_K: u[e] = q in 0..31. */
KVPQ_INLINE void unpack_q5_K(const uint8_t *p, uint8_t u[QK_K]) {
    const uint8_t *qs = KBLK_AT(p, block_q5_K, qs), *qh = KBLK_AT(p, block_q5_K, qh);
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int h = qh[l] >> (2 * c);
            u[64 * c + l] = (uint8_t)((qs[32 * c + l] & 15) | (h & 1) << 4);
            u[64 * c + 32 + l] = (uint8_t)((qs[32 * c + l] >> 4) | (h & 2) << 3);
        }
}

/* Q6_K: q[e] in -32..31. */
KVPQ_INLINE void unpack_q6_K(const uint8_t *p, int8_t q[QK_K]) {
    const uint8_t *ql0 = KBLK_AT(p, block_q6_K, ql), *qh = KBLK_AT(p, block_q6_K, qh);
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = ql0 + 64 * h;
            int hb = qh[32 * h + l];
            q[128 * h + l] = (int8_t)(((ql[l] & 15) | (hb & 3) << 4) - 32);
            q[128 * h + 32 + l] = (int8_t)(((ql[l + 32] & 15) | ((hb >> 2) & 3) << 4) - 32);
            q[128 * h + 64 + l] = (int8_t)(((ql[l] >> 4) | ((hb >> 4) & 3) << 4) - 32);
            q[128 * h + 96 + l] = (int8_t)(((ql[l + 32] >> 4) | (hb >> 6) << 4) - 32);
        }
}

/* acc[g % 4] += dl[g] * (u[gL .. gL+L) . x[gL .. gL+L)) for the 256 / L sub-blocks g; u unsigned or
 * signed bytes. */
KVPQ_INLINE void kdot_block(const void *u, int is_signed, int L, const float *x, const float *dl, kvpq_vf acc[4]) {
    /* A compiler barrier: dl[g] is then broadcast from memory (a load) rather than permuted out of
     * the register that computed it (a shuffle, on the port the byte conversions need). */
    __asm__ __volatile__("" ::: "memory");
    for (int g = 0; g < QK_K / L; g++) {
        const uint8_t *p = (const uint8_t *)u + g * L;
        const float *xg = x + g * L;
        kvpq_vf t = vf_zero();
        for (int v = 0; v < L / W; v++) {
            kvpq_vf q = is_signed ? vf_load_i8((const int8_t *)p + v * W) : vf_load_u8(p + v * W);
            t = vf_fma(q, vf_load(xg + v * W), t);
        }
        acc[g & 3] = vf_fma(vf_set1(dl[g]), t, acc[g & 3]);
    }
}

KVPQ_INLINE float kacc_sum(const kvpq_vf acc[4]) {
    return vf_reduce_add(vf_add(vf_add(acc[0], acc[1]), vf_add(acc[2], acc[3])));
}

/* The mins: acc += ml[j] * xs[j] for j < n (ml holds max(n, W) entries, zero past n; xs is read
 * only below n). */
KVPQ_INLINE kvpq_vf kmins(const float *ml, const float *xs, int n, kvpq_vf acc) {
    for (int j = 0; j < n; j += W) acc = vf_fma(vf_load(ml + j), vf_load_n(xs + j, n - j < W ? n - j : W), acc);
    return acc;
}

#endif /* !KVPQ_GGML_Q8_ONLY */

#define MAXW(n) ((n) > W ? (n) : W) /* arrays that a W-lane store may fill */

/* Software prefetch of the block KPF_DIST blocks ahead, every cache line of it, into all cache
 * levels: a decoded token streams each weight once from DRAM, and the hardware prefetcher alone
 * leaves the kernel waiting. Measured on Qwen2.5-Coder-1.5B (every matvec of one token, 980 MB,
 * 1 thread, CPU time): no prefetch 189-192 ms; 8 blocks ahead 137 ms; 16: 137-139; 24: 139-143;
 * 16 ahead as non-temporal (locality 0): 167-168. */
#define KPF_DIST 8
#define KPREFETCH(p, bs)                                                         \
    do {                                                                         \
        for (int pf_ = 0; pf_ < (int)(bs); pf_ += 64)                            \
            __builtin_prefetch((const char *)(p) + KPF_DIST * (bs) + pf_, 0, 3); \
    } while (0)

#if !defined(KVPQ_GGML_Q8_ONLY) /* float32-activation kernels (not in the VNNI build: ggml_avx512vnni.c) */
/* xs: (n / 16) sums of x over 16-element groups, Q2_K's sub-blocks. */
static void matvec_q2_K(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()}, accm = vf_zero();
        for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q2_K)) {
            KPREFETCH(p, sizeof(block_q2_K));
            const uint8_t *sb = KBLK_AT(p, block_q2_K, scales);
            float dl[MAXW(16)], ml[MAXW(16)];
            uint8_t u[QK_K], sc[MAXW(16)], m[MAXW(16)];
            for (int g = 0; g < 16; g++) sc[g] = sb[g] & 15, m[g] = sb[g] >> 4;
            scales_u8(BLK_F16(p, block_q2_K, d), sc, 16, dl);
            scales_u8(BLK_F16(p, block_q2_K, dmin), m, 16, ml);
            accm = kmins(ml, xs + 16 * i, 16, accm);
            unpack_q2_K(p, u);
            kdot_block(u, 0, 16, x + i * QK_K, dl, acc);
        }
        y[r] = kacc_sum(acc) - vf_reduce_add(accm);
    }
}

static void matvec_q3_K(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q3_K)) {
            KPREFETCH(p, sizeof(block_q3_K));
            float dl[MAXW(16)];
            int8_t sc[MAXW(16)], q[QK_K];
            kvpq__q3_K_scales(KBLK_AT(p, block_q3_K, scales), sc);
            scales_i8(BLK_F16(p, block_q3_K, d), sc, 16, dl);
            unpack_q3_K(p, q);
            kdot_block(q, 1, 16, x + i * QK_K, dl, acc);
        }
        y[r] = kacc_sum(acc);
    }
}

/* Q4_K and Q5_K: the same but for the unpacking. xs: (n / 32) sums of x over the sub-blocks. */
#define MATVEC_Q45_K(TYPE, BLOCK)                                                                              \
    static void matvec_##TYPE(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x,        \
                              const float *xs, float *y) {                                                    \
        for (int64_t r = 0; r < n_rows; r++) {                                                                \
            const uint8_t *p = W_ + (size_t)r * rb;                                                           \
            kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()}, accm = vf_zero();                  \
            for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(BLOCK)) {                                      \
                KPREFETCH(p, sizeof(BLOCK));                                                                  \
                float dl[MAXW(16)];                                                                           \
                uint8_t u[QK_K];                                                                              \
                uint64_t sc, m;                                                                               \
                k4_scales(KBLK_AT(p, BLOCK, scales), &sc, &m);                                                \
                vf_store(dl, vf_mul(vf_set1(BLK_F16(p, BLOCK, d)), vf_from_u8x8(sc)));                        \
                accm = vf_fma(vf_mul(vf_set1(BLK_F16(p, BLOCK, dmin)), vf_from_u8x8(m)),                      \
                              vf_load_n(xs + 8 * i, 8), accm);                                                \
                unpack_##TYPE(p, u);                                                                          \
                kdot_block(u, 0, 32, x + i * QK_K, dl, acc);                                                  \
            }                                                                                                 \
            y[r] = kacc_sum(acc) - vf_reduce_add(accm);                                                       \
        }                                                                                                     \
    }
MATVEC_Q45_K(q4_K, block_q4_K)
MATVEC_Q45_K(q5_K, block_q5_K)

static void matvec_q6_K(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q6_K)) {
            KPREFETCH(p, sizeof(block_q6_K));
            float dl[MAXW(16)];
            int8_t q[QK_K];
            scales_i8(BLK_F16(p, block_q6_K, d), (const int8_t *)KBLK_AT(p, block_q6_K, scales), 16, dl);
            unpack_q6_K(p, q);
            kdot_block(q, 1, 16, x + i * QK_K, dl, acc);
        }
        y[r] = kacc_sum(acc);
    }
}

/* Dequantization, bit-exact with the _ref: exact conversions, dl * q exact, one rounded - ml.
 * y[gL + l] = dl[g] * u[gL + l] - ml[g] (ml NULL: no min). */
KVPQ_INLINE void kdequant_block(const void *u, int is_signed, int L, const float *dl, const float *ml, float *y) {
    for (int g = 0; g < QK_K / L; g++)
        for (int v = 0; v < L / W; v++) {
            const uint8_t *p = (const uint8_t *)u + g * L + v * W;
            kvpq_vf q = is_signed ? vf_load_i8((const int8_t *)p) : vf_load_u8(p), w = vf_mul(vf_set1(dl[g]), q);
            vf_store(y + g * L + v * W, ml ? vf_sub(w, vf_set1(ml[g])) : w);
        }
}

static void dequant_q2_K(const uint8_t *p, float *y, int64_t n) {
    for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q2_K), y += QK_K) {
        const uint8_t *sb = KBLK_AT(p, block_q2_K, scales);
        float dl[MAXW(16)], ml[MAXW(16)];
        uint8_t u[QK_K], sc[MAXW(16)], m[MAXW(16)];
        for (int g = 0; g < 16; g++) sc[g] = sb[g] & 15, m[g] = sb[g] >> 4;
        scales_u8(BLK_F16(p, block_q2_K, d), sc, 16, dl);
        scales_u8(BLK_F16(p, block_q2_K, dmin), m, 16, ml);
        unpack_q2_K(p, u);
        kdequant_block(u, 0, 16, dl, ml, y);
    }
}

static void dequant_q3_K(const uint8_t *p, float *y, int64_t n) {
    for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q3_K), y += QK_K) {
        float dl[MAXW(16)];
        int8_t sc[MAXW(16)], q[QK_K];
        kvpq__q3_K_scales(KBLK_AT(p, block_q3_K, scales), sc);
        scales_i8(BLK_F16(p, block_q3_K, d), sc, 16, dl);
        unpack_q3_K(p, q);
        kdequant_block(q, 1, 16, dl, NULL, y);
    }
}

#define DEQUANT_Q45_K(TYPE, BLOCK)                                                   \
    static void dequant_##TYPE(const uint8_t *p, float *y, int64_t n) {               \
        for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(BLOCK), y += QK_K) {       \
            float dl[MAXW(16)], ml[MAXW(16)];                                         \
            uint8_t u[QK_K];                                                          \
            uint64_t sc, m;                                                           \
            k4_scales(KBLK_AT(p, BLOCK, scales), &sc, &m);                            \
            vf_store(dl, vf_mul(vf_set1(BLK_F16(p, BLOCK, d)), vf_from_u8x8(sc)));    \
            vf_store(ml, vf_mul(vf_set1(BLK_F16(p, BLOCK, dmin)), vf_from_u8x8(m)));  \
            unpack_##TYPE(p, u);                                                      \
            kdequant_block(u, 0, 32, dl, ml, y);                                      \
        }                                                                             \
    }
DEQUANT_Q45_K(q4_K, block_q4_K)
DEQUANT_Q45_K(q5_K, block_q5_K)

static void dequant_q6_K(const uint8_t *p, float *y, int64_t n) {
    for (int64_t i = 0; i < n / QK_K; i++, p += sizeof(block_q6_K), y += QK_K) {
        float dl[MAXW(16)];
        int8_t q[QK_K];
        scales_i8(BLK_F16(p, block_q6_K, d), (const int8_t *)KBLK_AT(p, block_q6_K, scales), 16, dl);
        unpack_q6_K(p, q);
        kdequant_block(q, 1, 16, dl, NULL, y);
    }
}

#endif /* !KVPQ_GGML_Q8_ONLY */

// ---- integer activations: 8-bit activation blocks, integer dot products ---------------------------
/* The kernels behind kvpq__qmatmul_fn (ggml_kernels.h). A weight block's quants are unpacked once
 * into unsigned bytes, one kvpq_vb per 32 elements (Q8_0: signed, folded by vb_sign_fold), and
 * dotted with the matching 32 bytes of each of up to QT activation rows (a prefill reads each block
 * once per QT tokens; decode has one). Each dot's 8 int32 lanes are converted and scaled by
 * (weight scale) * (activation block scale) into a float accumulator; the weights' offsets (Q4_0
 * -8, Q5_0 -16, Q6_K -32) and mins (Q4_1, Q5_1, Q4_K, Q5_K) are applied once per block through the
 * activation block sums (xs, or s16 where Q6_K's scales are per 16). Exact integer dots (maddubs
 * pair sums stay below 2^15: quants <= 128 unsigned, activations in [-127, 127]), so the result is
 * the _ref's (ggml_matmul_q8_ref) up to float rounding of the weight scales and the sum order. */

/* Activation rows per pass over a weight block. */
#define QT 4

/* A block of a 32-element type: unsigned quants u (Q8_0: signed), scale d, and m, the coefficient
 * of the activation block sum xs (the min; -8 d, -16 d for the offsets; 0 for Q8_0). */
typedef struct {
    kvpq_vb u;
    float d, m;
} qb32;

KVPQ_INLINE qb32 qb_q4_0(const uint8_t *p) {
    float d = BLK_F16(p, block_q4_0, d);
    return (qb32){vb_nibbles32(KVPQ_BLK_AT(p, block_q4_0, qs)), d, -8.0f * d};
}
KVPQ_INLINE qb32 qb_q4_1(const uint8_t *p) {
    return (qb32){vb_nibbles32(KVPQ_BLK_AT(p, block_q4_1, qs)), BLK_F16(p, block_q4_1, d), BLK_F16(p, block_q4_1, m)};
}
KVPQ_INLINE qb32 qb_q5_0(const uint8_t *p) {
    float d = BLK_F16(p, block_q5_0, d);
    return (qb32){vb_q5_32(KVPQ_BLK_AT(p, block_q5_0, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_0, qh))), d, -16.0f * d};
}
KVPQ_INLINE qb32 qb_q5_1(const uint8_t *p) {
    return (qb32){vb_q5_32(KVPQ_BLK_AT(p, block_q5_1, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_1, qh))),
                  BLK_F16(p, block_q5_1, d), BLK_F16(p, block_q5_1, m)};
}
KVPQ_INLINE qb32 qb_q8_0(const uint8_t *p) {
    return (qb32){vb_load(KVPQ_BLK_AT(p, block_q8_0, qs)), BLK_F16(p, block_q8_0, d), 0.0f};
}
typedef qb32 (*qb32_fn)(const uint8_t *p);

/* One block's contribution to token row x: acc += (u . qs_b) * d * d_b; accm += m * xs_b. */
KVPQ_INLINE void qb32_dot(qb32 q, int is_signed, const kvpq__q8row *x, int64_t b, kvpq_vf8 *acc, float *accm) {
    kvpq_vb u = q.u, s = vb_load(x->qs + 32 * b);
    if (is_signed) vb_sign_fold(&u, &s);
    *acc = v8_fma(v8_from_vi(vb_dot(u, s)), v8_set1(q.d * x->d[b]), *acc);
    *accm += q.m * x->xs[b];
}

/* Rows r < n_rows of T (a constant: QT or 1) activation rows X[0 .. T): blocks in pairs into two
 * accumulators per row (latency), the leftover block into the first. */
KVPQ_INLINE void qmm_blocks_T(qb32_fn unpack, size_t bs, int is_signed, int T, const uint8_t *W_, size_t rb,
                              int64_t n_rows, int64_t n, const kvpq__q8row *X, float *Y, int64_t ldy) {
    const int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf8 acc0[QT], acc1[QT];
        float accm0[QT], accm1[QT]; /* two chains for the scalar terms too (their latency bound the loop) */
        for (int t = 0; t < T; t++) acc0[t] = v8_zero(), acc1[t] = v8_zero(), accm0[t] = accm1[t] = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, p += 2 * bs) {
            __builtin_prefetch(p + BPF_BYTES, 0, 3);
            qb32 q0 = unpack(p), q1 = unpack(p + bs);
            for (int t = 0; t < T; t++) {
                qb32_dot(q0, is_signed, X + t, b, &acc0[t], &accm0[t]);
                qb32_dot(q1, is_signed, X + t, b + 1, &acc1[t], &accm1[t]);
            }
        }
        if (b < nb) {
            qb32 q0 = unpack(p);
            for (int t = 0; t < T; t++) qb32_dot(q0, is_signed, X + t, b, &acc0[t], &accm0[t]);
        }
        for (int t = 0; t < T; t++) Y[t * ldy + r] = v8_reduce_add(v8_add(acc0[t], acc1[t])) + (accm0[t] + accm1[t]);
    }
}

/* Token rows in tiles of QT, the rest (1 to QT - 1 rows) as one tile: each weight block is unpacked
 * once per tile, so a batched decode step of 2 or 3 sequences reads the weights once, not 2 or 3
 * times. A token row's sums do not depend on its tile (each row has its own accumulators, summed in
 * the same order), so a row's result is the same in any tile. */
_Static_assert(QT == 4, "QMM_TILES' rest covers 1 .. 3 rows");
#define QMM_TILES(FN, ...)                                                                              \
    do {                                                                                                \
        int64_t t0_ = 0;                                                                                \
        for (; t0_ + QT <= n_tok; t0_ += QT) FN(__VA_ARGS__, QT, W_, rb, n_rows, n, X + t0_, Y + t0_ * ldy, ldy); \
        switch (n_tok - t0_) {                                                                          \
        case 3: FN(__VA_ARGS__, 3, W_, rb, n_rows, n, X + t0_, Y + t0_ * ldy, ldy); break;              \
        case 2: FN(__VA_ARGS__, 2, W_, rb, n_rows, n, X + t0_, Y + t0_ * ldy, ldy); break;              \
        case 1: FN(__VA_ARGS__, 1, W_, rb, n_rows, n, X + t0_, Y + t0_ * ldy, ldy); break;              \
        default: break;                                                                                 \
        }                                                                                               \
    } while (0)

#define QMATMUL_BLOCKS(TYPE, BLOCK, SIGNED)                                                                      \
    static void qmatmul_##TYPE(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const kvpq__q8row *X,   \
                               int64_t n_tok, float *Y, int64_t ldy) {                                          \
        QMM_TILES(qmm_blocks_T, qb_##TYPE, sizeof(BLOCK), SIGNED);                                               \
    }
QMATMUL_BLOCKS(q4_0, block_q4_0, 0)
QMATMUL_BLOCKS(q4_1, block_q4_1, 0)
QMATMUL_BLOCKS(q5_0, block_q5_0, 0)
QMATMUL_BLOCKS(q5_1, block_q5_1, 0)
QMATMUL_BLOCKS(q8_0, block_q8_0, 1)

/* A K-quant super-block (256 elements, 8 sub-blocks of 32): u[k] the unsigned quants of sub-block
 * k; dw lane k its float scale; Q4_K / Q5_K: mn lane k the coefficient of xs (-dmin * min); Q6_K:
 * w16[k] its two per-16 integer scales (vw_pair), sc16 all 16, and c = -32 d, the coefficient of
 * sum_g sc_g s16_g (its quants are q + 32). */
typedef struct {
    kvpq_vb u[8];
    kvpq_vf8 dw, mn;
    __m256i w16[8], sc16;
    float c;
} qbk;

KVPQ_INLINE void qk_q4_K(const uint8_t *p, qbk *q) {
    uint64_t sc, m;
    k4_scales(KVPQ_BLK_AT(p, block_q4_K, scales), &sc, &m);
    q->dw = v8_mul(v8_set1(BLK_F16(p, block_q4_K, d)), v8_from_u8x8(sc));
    q->mn = v8_mul(v8_set1(-BLK_F16(p, block_q4_K, dmin)), v8_from_u8x8(m));
    const uint8_t *qs = KVPQ_BLK_AT(p, block_q4_K, qs);
    for (int c = 0; c < 4; c++) {
        kvpq_vb v = vb_load(qs + 32 * c);
        q->u[2 * c] = vb_bits(v, 0, 4);
        q->u[2 * c + 1] = vb_bits(v, 4, 4);
    }
}

/* Q5_K: Q4_K's nibbles plus bit k of qh[l] as bit 4 of sub-block k's element l. */
KVPQ_INLINE void qk_q5_K(const uint8_t *p, qbk *q) {
    uint64_t sc, m;
    k4_scales(KVPQ_BLK_AT(p, block_q5_K, scales), &sc, &m);
    q->dw = v8_mul(v8_set1(BLK_F16(p, block_q5_K, d)), v8_from_u8x8(sc));
    q->mn = v8_mul(v8_set1(-BLK_F16(p, block_q5_K, dmin)), v8_from_u8x8(m));
    const uint8_t *qs = KVPQ_BLK_AT(p, block_q5_K, qs);
    kvpq_vb qh = vb_load(KVPQ_BLK_AT(p, block_q5_K, qh));
    for (int c = 0; c < 4; c++) {
        kvpq_vb v = vb_load(qs + 32 * c);
        q->u[2 * c] = vb_or(vb_bits(v, 0, 4), vb_shl(vb_bits(qh, 2 * c, 1), 4));
        q->u[2 * c + 1] = vb_or(vb_bits(v, 4, 4), vb_shl(vb_bits(qh, 2 * c + 1, 1), 4));
    }
}

/* Q6_K: q + 32 in 0..63 from 4 bits of ql and 2 of qh (unpack_q6_K's order). */
KVPQ_INLINE void qk_q6_K(const uint8_t *p, qbk *q) {
    const uint8_t *ql = KVPQ_BLK_AT(p, block_q6_K, ql), *qhp = KVPQ_BLK_AT(p, block_q6_K, qh);
    float d = BLK_F16(p, block_q6_K, d);
    q->dw = v8_set1(d);
    q->c = -32.0f * d;
    q->sc16 = vw_from_i8x16((const int8_t *)KVPQ_BLK_AT(p, block_q6_K, scales));
    for (int h = 0; h < 2; h++) {
        kvpq_vb l0 = vb_load(ql + 64 * h), l1 = vb_load(ql + 64 * h + 32), qh = vb_load(qhp + 32 * h);
        q->u[4 * h + 0] = vb_or(vb_bits(l0, 0, 4), vb_shl(vb_bits(qh, 0, 2), 4));
        q->u[4 * h + 1] = vb_or(vb_bits(l1, 0, 4), vb_shl(vb_bits(qh, 2, 2), 4));
        q->u[4 * h + 2] = vb_or(vb_bits(l0, 4, 4), vb_shl(vb_bits(qh, 4, 2), 4));
        q->u[4 * h + 3] = vb_or(vb_bits(l1, 4, 4), vb_shl(vb_bits(qh, 6, 2), 4));
    }
    for (int k = 0; k < 8; k++) q->w16[k] = vw_pair(q->sc16, k);
}
typedef void (*qk_fn)(const uint8_t *p, qbk *q);

/* Super-block i's contribution to token row x: acc[k % 2] += (u_k . qs) * dw_k * d_{8i+k} for each
 * sub-block k (Q6_K: the dot weighted per 16 by its integer scales); accm += the offsets / mins. */
KVPQ_INLINE void qk_dot(const qbk *q, int is_q6, const kvpq__q8row *x, int64_t i, kvpq_vf8 acc[2],
                        kvpq_vf8 *accm) {
    const int8_t *qs = x->qs + 256 * i;
    kvpq_vf8 dx = v8_load(x->d + 8 * i);
    float s[8];
    v8_store(s, v8_mul(q->dw, dx));
    for (int k = 0; k < 8; k++) {
        kvpq_vb a = vb_load(qs + 32 * k);
        kvpq_vi8 iv = is_q6 ? vb_dot_w16(q->u[k], a, q->w16[k]) : vb_dot(q->u[k], a);
        acc[k & 1] = v8_fma(v8_from_vi(iv), v8_set1(s[k]), acc[k & 1]);
    }
    if (is_q6)
        *accm = v8_fma(v8_from_vi(vw_madd(q->sc16, vw_load(x->s16 + 16 * i))), v8_mul(v8_set1(q->c), dx), *accm);
    else
        *accm = v8_fma(q->mn, v8_load(x->xs + 8 * i), *accm);
}

KVPQ_INLINE void qmm_k_T(qk_fn unpack, size_t bs, int is_q6, int T, const uint8_t *W_, size_t rb, int64_t n_rows,
                         int64_t n, const kvpq__q8row *X, float *Y, int64_t ldy) {
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        kvpq_vf8 acc[QT][2], accm[QT];
        for (int t = 0; t < T; t++) acc[t][0] = acc[t][1] = accm[t] = v8_zero();
        for (int64_t i = 0; i < n / QK_K; i++, p += bs) {
            KPREFETCH(p, bs);
            qbk q;
            unpack(p, &q);
            for (int t = 0; t < T; t++) qk_dot(&q, is_q6, X + t, i, acc[t], &accm[t]);
        }
        for (int t = 0; t < T; t++) Y[t * ldy + r] = v8_reduce_add(v8_add(v8_add(acc[t][0], acc[t][1]), accm[t]));
    }
}

#define QMATMUL_K(TYPE, BLOCK, IS_Q6)                                                                            \
    static void qmatmul_##TYPE(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const kvpq__q8row *X,   \
                               int64_t n_tok, float *Y, int64_t ldy) {                                          \
        QMM_TILES(qmm_k_T, qk_##TYPE, sizeof(BLOCK), IS_Q6);                                                     \
    }
QMATMUL_K(q4_K, block_q4_K, 0)
QMATMUL_K(q5_K, block_q5_K, 0)
QMATMUL_K(q6_K, block_q6_K, 1)

// ---- integer GEMM: weight rows unpacked once per call, one row per vector lane --------------------
/* The kernels behind kvpq__qgemm_fn (ggml_kernels.h), for prefill steps: a panel of NR = W weight
 * rows is unpacked once into unsigned bytes laid out so that lane r of a kvpq_vi holds 4 bytes of
 * row r (element group k of row r at u[k NR + r]), with each sub-block's float scale and the
 * coefficient of its activation sum (the min or offset) per lane; then every pass of QG_T token rows
 * runs over it: per element group one vector load and QG_T vi_dot4_add with the token's 4 quants
 * broadcast, per sub-block (32 elements; Q6_K 16) one conversion and two FMAs per token. No
 * horizontal sums: a lane is a weight row. Integer dots exact (u <= 128 where vi_dot4_add is
 * maddubs + madd; Q8_0, whose u = q + 128 is larger, only where it is vpdpbusd). */
#define NR W
#define QG_T (W == 16 ? 12 : 4) /* token rows per pass: 2 QG_T accumulators + 5 in 32 / 16 registers */
_Static_assert(KVPQ_QG_TILE % QG_T == 0, "a pass covers a part of one tile");
_Static_assert(KVPQ_QG_ROWS % NR == 0, "a call's rows are whole panels");

typedef struct {
    uint32_t *u;      /* (n / 4, NR): element group k of row r at u[k * NR + r] */
    float *dw, *mn;   /* (n / G, NR): sub-block g's scale and activation-sum coefficient of row r */
} qpanel;

KVPQ_INLINE qpanel qpanel_at(void *buf, int64_t n, int G) {
    uint32_t *u = buf;
    float *dw = (float *)(void *)(u + n / 4 * NR);
    return (qpanel){u, dw, dw + n / G * NR};
}

/* Element groups k0 .. k0+7 of row r from a 32-byte block, each XORed with flip. */
KVPQ_INLINE void qpanel_put(uint32_t *u, int64_t k0, int r, kvpq_vb v, uint32_t flip) {
    uint32_t g[8];
    vb_store(g, v);
    for (int j = 0; j < 8; j++) u[(k0 + j) * NR + r] = g[j] ^ flip;
}

/* 32-element block types: w = d u + m per block. Q8_0 (signed q): u = q + 128 (q XOR 0x80), m = -128 d. */
KVPQ_INLINE void qpanel_blocks(qb32_fn unpack, size_t bs, int is_signed, const uint8_t *W_, size_t rb, int64_t n,
                               qpanel P) {
    for (int r = 0; r < NR; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        for (int64_t b = 0; b < n / 32; b++, p += bs) {
            qb32 q = unpack(p);
            qpanel_put(P.u, 8 * b, r, q.u, is_signed ? 0x80808080u : 0u);
            P.dw[b * NR + r] = q.d;
            P.mn[b * NR + r] = is_signed ? -128.0f * q.d : q.m;
        }
    }
}

/* K-quant super-blocks: Q4_K / Q5_K per 32 (dw_k, mn_k); Q6_K per 16: w = d sc_g (u - 32). */
KVPQ_INLINE void qpanel_k(qk_fn unpack, size_t bs, int is_q6, const uint8_t *W_, size_t rb, int64_t n, qpanel P) {
    for (int r = 0; r < NR; r++) {
        const uint8_t *p = W_ + (size_t)r * rb;
        for (int64_t i = 0; i < n / QK_K; i++, p += bs) {
            qbk q;
            unpack(p, &q);
            for (int k = 0; k < 8; k++) qpanel_put(P.u, 64 * i + 8 * k, r, q.u[k], 0u);
            float dw[8], mn[8];
            v8_store(dw, q.dw);
            if (is_q6) {
                int16_t sc[16];
                vb_store(sc, q.sc16);
                for (int g = 0; g < 16; g++) {
                    P.dw[(16 * i + g) * NR + r] = dw[0] * (float)sc[g];
                    P.mn[(16 * i + g) * NR + r] = q.c * (float)sc[g];
                }
            } else {
                v8_store(mn, q.mn);
                for (int k = 0; k < 8; k++) P.dw[(8 * i + k) * NR + r] = dw[k], P.mn[(8 * i + k) * NR + r] = mn[k];
            }
        }
    }
}

/* Y[t * ldy + lane] for the panel's rows and token rows t0 .. t0 + nt - 1 (nt <= QG_T) of tile `tile`:
 * per sub-block g of G elements, acc += (integer dot) * (dw_g d_t) + mn_g xs_t. */
KVPQ_INLINE void qgemm_pass(qpanel P, int G, int64_t n, const kvpq__q8tiles *X, int64_t tile, int t0, int nt,
                            float *Y, int64_t ldy) {
    const int64_t T = KVPQ_QG_TILE;
    const int32_t *xq = X->q + tile * (n / 4) * T + t0;
    const float *xd = X->d + tile * (n / 32) * T + t0;
    const float *xs = (G == 32 ? X->xs + tile * (n / 32) * T : X->x16 + tile * (n / 16) * T) + t0;
    kvpq_vf acc[QG_T];
    for (int t = 0; t < QG_T; t++) acc[t] = vf_zero();
    for (int64_t g = 0; g < n / G; g++) {
        kvpq_vi s[QG_T];
        for (int t = 0; t < QG_T; t++) s[t] = vi_zero();
        for (int64_t k = g * (G / 4); k < (g + 1) * (G / 4); k++) {
            kvpq_vi u = vi_load(P.u + k * NR);
            for (int t = 0; t < QG_T; t++) s[t] = vi_dot4_add(s[t], u, xq[k * T + t]);
        }
        kvpq_vf dw = vf_load(P.dw + g * NR), mn = vf_load(P.mn + g * NR);
        const float *d = xd + g * G / 32 * T, *c = xs + g * T;
        for (int t = 0; t < QG_T; t++)
            acc[t] = vf_fma(vf_from_vi(s[t]), vf_mul(dw, vf_set1(d[t])), vf_fma(mn, vf_set1(c[t]), acc[t]));
    }
    for (int t = 0; t < QG_T; t++)
        if (t < nt) vf_store(Y + t * ldy, acc[t]);
}

/* qgemm_<type>: each panel of NR rows unpacked by FILL(W, rb, n, P) and run over every token row. */
#define QGEMM(TYPE, G, FILL)                                                                                     \
    static void qgemm_##TYPE(const uint8_t *W_, size_t rb, int64_t n_rows, int64_t n, const kvpq__q8tiles *X,   \
                             int64_t n_tok, float *Y, int64_t ldy, void *buf) {                                 \
        qpanel P = qpanel_at(buf, n, G);                                                                         \
        for (int64_t r0 = 0; r0 < n_rows; r0 += NR) {                                                            \
            FILL(W_ + (size_t)r0 * rb, rb, n, P);                                                                \
            for (int64_t t0 = 0; t0 < n_tok; t0 += QG_T)                                                         \
                qgemm_pass(P, G, n, X, t0 / KVPQ_QG_TILE, (int)(t0 % KVPQ_QG_TILE),                              \
                           (int)(n_tok - t0 < QG_T ? n_tok - t0 : QG_T), Y + t0 * ldy + r0, ldy);               \
        }                                                                                                        \
    }
#define FILL_B(TYPE, BLOCK, SIGNED) \
    static void fill_##TYPE(const uint8_t *W_, size_t rb, int64_t n, qpanel P) { qpanel_blocks(qb_##TYPE, sizeof(BLOCK), SIGNED, W_, rb, n, P); }
#define FILL_K(TYPE, BLOCK, IS_Q6) \
    static void fill_##TYPE(const uint8_t *W_, size_t rb, int64_t n, qpanel P) { qpanel_k(qk_##TYPE, sizeof(BLOCK), IS_Q6, W_, rb, n, P); }
FILL_B(q4_0, block_q4_0, 0)
FILL_B(q4_1, block_q4_1, 0)
FILL_B(q5_0, block_q5_0, 0)
FILL_B(q5_1, block_q5_1, 0)
FILL_B(q8_0, block_q8_0, 1)
FILL_K(q4_K, block_q4_K, 0)
FILL_K(q5_K, block_q5_K, 0)
FILL_K(q6_K, block_q6_K, 1)
QGEMM(q4_0, 32, fill_q4_0)
QGEMM(q4_1, 32, fill_q4_1)
QGEMM(q5_0, 32, fill_q5_0)
QGEMM(q5_1, 32, fill_q5_1)
QGEMM(q8_0, 32, fill_q8_0)
QGEMM(q4_K, 32, fill_q4_K)
QGEMM(q5_K, 32, fill_q5_K)
QGEMM(q6_K, 16, fill_q6_K)
#undef FILL_B
#undef FILL_K
#undef QGEMM

kvpq__qgemm_fn KVPQ_ISA_FN(kvpq__ggml_qgemm)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return qgemm_q4_0;
    case GGML_TYPE_Q4_1: return qgemm_q4_1;
    case GGML_TYPE_Q5_0: return qgemm_q5_0;
    case GGML_TYPE_Q5_1: return qgemm_q5_1;
    case GGML_TYPE_Q8_0: return KVPQ_VI_DPBUSD ? qgemm_q8_0 : NULL; /* u = q + 128: maddubs would saturate */
    case GGML_TYPE_Q4_K: return qgemm_q4_K;
    case GGML_TYPE_Q5_K: return qgemm_q5_K;
    case GGML_TYPE_Q6_K: return qgemm_q6_K;
    }
    return NULL;
}
#undef QG_T
#undef NR
#undef QMM_TILES
#undef QT

kvpq__qmatmul_fn KVPQ_ISA_FN(kvpq__ggml_qmatmul)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return qmatmul_q4_0;
    case GGML_TYPE_Q4_1: return qmatmul_q4_1;
    case GGML_TYPE_Q5_0: return qmatmul_q5_0;
    case GGML_TYPE_Q5_1: return qmatmul_q5_1;
    case GGML_TYPE_Q8_0: return qmatmul_q8_0;
    case GGML_TYPE_Q4_K: return qmatmul_q4_K;
    case GGML_TYPE_Q5_K: return qmatmul_q5_K;
    case GGML_TYPE_Q6_K: return qmatmul_q6_K;
    }
    return NULL;
}

#undef MAXW
#undef KBLK_AT

#if !defined(KVPQ_GGML_Q8_ONLY) /* float32-activation kernels (not in the VNNI build: ggml_avx512vnni.c) */
kvpq__matvec_fn KVPQ_ISA_FN(kvpq__ggml_matvec)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return matvec_f32;
    case GGML_TYPE_F16: return matvec_f16;
    case GGML_TYPE_BF16: return matvec_bf16;
    case GGML_TYPE_Q4_0: return matvec_q4_0;
    case GGML_TYPE_Q4_1: return matvec_q4_1;
    case GGML_TYPE_Q5_0: return matvec_q5_0;
    case GGML_TYPE_Q5_1: return matvec_q5_1;
    case GGML_TYPE_Q8_0: return matvec_q8_0;
    case GGML_TYPE_Q2_K: return matvec_q2_K;
    case GGML_TYPE_Q3_K: return matvec_q3_K;
    case GGML_TYPE_Q4_K: return matvec_q4_K;
    case GGML_TYPE_Q5_K: return matvec_q5_K;
    case GGML_TYPE_Q6_K: return matvec_q6_K;
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

static void dequant_q5_0(const uint8_t *p, float *y, int64_t n) {
    const kvpq_vf sixteen = vf_set1(16.0f);
    for (int64_t b = 0; b < n / QK5_0; b++, p += sizeof(block_q5_0), y += QK5_0) {
        kvpq_vf d = vf_set1(BLK_F16(p, block_q5_0, d)), f[QV];
        vf_load_q5_32(KVPQ_BLK_AT(p, block_q5_0, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_0, qh)), f);
        /* q - 16 is exact in float, so this equals ggml's (float)(q - 16) * d. */
        for (int k = 0; k < QV; k++) vf_store(y + k * W, vf_mul(vf_sub(f[k], sixteen), d));
    }
}

static void dequant_q5_1(const uint8_t *p, float *y, int64_t n) {
    for (int64_t b = 0; b < n / QK5_1; b++, p += sizeof(block_q5_1), y += QK5_1) {
        kvpq_vf d = vf_set1(BLK_F16(p, block_q5_1, d)), m = vf_set1(BLK_F16(p, block_q5_1, m)), f[QV];
        vf_load_q5_32(KVPQ_BLK_AT(p, block_q5_1, qs), q5_qh(KVPQ_BLK_AT(p, block_q5_1, qh)), f);
        for (int k = 0; k < QV; k++) vf_store(y + k * W, vf_add(vf_mul(f[k], d), m));
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
    case GGML_TYPE_Q5_0: return dequant_q5_0;
    case GGML_TYPE_Q5_1: return dequant_q5_1;
    case GGML_TYPE_Q8_0: return dequant_q8_0;
    case GGML_TYPE_F16: return dequant_f16;
    case GGML_TYPE_Q2_K: return dequant_q2_K;
    case GGML_TYPE_Q3_K: return dequant_q3_K;
    case GGML_TYPE_Q4_K: return dequant_q4_K;
    case GGML_TYPE_Q5_K: return dequant_q5_K;
    case GGML_TYPE_Q6_K: return dequant_q6_K;
    }
    return NULL;
}

// ---- gated activations (ggml_kernels.h: kvpq__glu_*) ---------------------------------------------

/* sqrt(2 / pi) doubled: 0.5 (1 + tanh(y)) = sigmoid(2 y) */
#define GELU_2C 1.5957691216f

static void glu_gelu_tanh(float *g, const float *u, int64_t n) {
    int64_t i = 0;
    for (; i < n; i += W) {
        int m = n - i < W ? (int)(n - i) : W;
        kvpq_vf x = vf_load_n(g + i, m), x2 = vf_mul(x, x);
        kvpq_vf y = vf_mul(vf_mul(vf_set1(GELU_2C), x), vf_fma(vf_set1(0.044715f), x2, vf_set1(1.0f)));
        vf_store_n(g + i, vf_mul(vf_mul(x, vf_sigmoid(y)), vf_load_n(u + i, m)), m);
    }
}

static void glu_silu(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i += W) {
        int m = n - i < W ? (int)(n - i) : W;
        kvpq_vf x = vf_load_n(g + i, m);
        vf_store_n(g + i, vf_mul(vf_mul(x, vf_sigmoid(x)), vf_load_n(u + i, m)), m);
    }
}

kvpq__glu_fn KVPQ_ISA_FN(kvpq__glu)(kvpq_glu_kind kind) {
    switch (kind) {
    case KVPQ_GLU_SILU: return glu_silu;
    case KVPQ_GLU_GELU_TANH: return glu_gelu_tanh;
    default: return NULL;
    }
}

// ---- activation rows to 8 bits (ggml_kernels.h: kvpq__q8act_fn) ----------------------------------

/* The _ref's arithmetic lane by lane: per 32-element block the largest |x|, d = max / 127, q = x
 * times 1 / d (x / d where 1 / d overflows) rounded to nearest even (the _ref's 1.5 * 2^23 trick does the same) and clamped to
 * +-127; sums of 16 integers are exact in float. A block holding a NaN or an infinity (x * 0 is then
 * NaN) gets d = NaN and q = 0, as in the _ref. */
static void q8_act_row(const float *x, int64_t n, int8_t *qs, float *d, int16_t *s16, float *xs) {
    const kvpq_vf lim = vf_set1(127.0f), nlim = vf_set1(-127.0f);
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        kvpq_vf mx = vf_zero(), nf = vf_zero();
        for (int j = 0; j < 32; j += W) {
            const kvpq_vf v = vf_load(xb + j);
            mx = vf_max(mx, vf_max(v, vf_sub(vf_zero(), v)));
            nf = vf_add(nf, vf_mul(v, vf_zero()));
        }
        const float amax = vf_reduce_max(mx) + 0.0f, nfs = vf_reduce_add(nf); /* + 0: never -0 */
        float s[2] = {0.0f, 0.0f};
        if (nfs != nfs) {
            memset(qs + 32 * b, 0, 32);
            d[b] = NAN;
        } else {
            const float db = amax / 127.0f, idf = db > 0 ? 1.0f / db : 0.0f;
            const int div = idf > FLT_MAX; /* d below 2^-128: x / d, as the _ref */
            const kvpq_vf id = vf_set1(idf), dv = vf_set1(db);
            for (int j = 0; j < 32; j += W) {
                const kvpq_vf xq = div ? vf_div(vf_load(xb + j), dv) : vf_mul(vf_load(xb + j), id);
                const kvpq_vf q = vf_min(vf_max(vf_round(xq), nlim), lim);
                vi_store_i8(qs + 32 * b + j, vi_from_vf(q));
                s[j / 16] += vf_reduce_add(q);
            }
            d[b] = db;
        }
        s16[2 * b] = (int16_t)s[0];
        s16[2 * b + 1] = (int16_t)s[1];
        xs[b] = d[b] * (s[0] + s[1]);
    }
}

kvpq__q8act_fn KVPQ_ISA_FN(kvpq__q8act)(void) { return q8_act_row; }

#endif /* !KVPQ_GGML_Q8_ONLY */
#undef GELU_2C
#undef W
#undef BLK_F16
#undef QV
