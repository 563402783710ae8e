/* kquant_body.h — SIMD kernels for the K-quant weight types (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; block
 * layouts in model/kquants.h), written once on the width-generic vector layer and compiled per ISA
 * by kquant_avx2.c and kquant_avx512.c (each defines KVPQ_ISA_* and includes this file):
 *  - matvec rows, fused: each W bytes of quants are unpacked in integer registers (shifts, masks, the
 *    high bits OR-ed in, the offset subtracted as int8), converted to float exactly, and multiplied
 *    into x with FMA; per sub-block the sum is scaled once by d * sc (exact in float32), and the
 *    mins (Q2_K, Q4_K, Q5_K) are applied once per sub-block through xs, the sums of x over it.
 *    So the result differs from the _ref only by the order of a float32 sum.
 *  - dequantization of rows, bit-exact with the _ref (exact conversions and products, one rounded
 *    subtraction), for the prompt path (ggml_matmul dequantizes tiles for sgemm).
 * Activations stay float32: no 8-bit quantization of x (llama.cpp's q8_K), so the results are the
 * _ref's up to summation order. */
#include <string.h>

#include "cpu/ggml_kernels.h"
#include "model/ggml_types.h"
#include "model/kquants.h"

#define W KVPQ_VW

/* The scales and mins of a Q4_K / Q5_K block, unpacked 4 at a time in 32-bit words (the same
 * values as kvpq__k4_scale_min: the top 2 bits of bytes 0..7 are the high bits of j >= 4). */
KVPQ_INLINE void k4_scales(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    uint32_t w[4] = {a & 0x3f3f3f3fu, (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u), b & 0x3f3f3f3fu,
                     ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)};
    memcpy(sc, w, 8);
    memcpy(m, w + 2, 8);
}

// ---- 8 scales at a time (a block's sub-block scales and mins): out[j] = d * p[j] ---------------------
/* The compiler does not vectorize these byte -> float conversions by itself (it extracts and converts
 * one byte at a time: half of the kernel's time), so the x86 levels spell them out at 8 lanes. */
#if KVPQ_VW > 1
KVPQ_INLINE __m256 s8_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
KVPQ_INLINE __m256 s8_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
KVPQ_INLINE void mul8_u8(float d, const uint8_t *p, float *out) { _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), s8_u8(p))); }
KVPQ_INLINE void mul8_i8(float d, const int8_t *p, float *out) { _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_set1_ps(d), s8_i8(p))); }
/* acc[j] += (d * p[j]) * xs[j] */
KVPQ_INLINE void fma8_u8(float d, const uint8_t *p, const float *xs, float *acc) {
    __m256 ml = _mm256_mul_ps(_mm256_set1_ps(d), s8_u8(p));
    _mm256_storeu_ps(acc, _mm256_fmadd_ps(ml, _mm256_loadu_ps(xs), _mm256_loadu_ps(acc)));
}
#else
KVPQ_INLINE void mul8_u8(float d, const uint8_t *p, float *out) {
    for (int j = 0; j < 8; j++) out[j] = d * (float)p[j];
}
KVPQ_INLINE void mul8_i8(float d, const int8_t *p, float *out) {
    for (int j = 0; j < 8; j++) out[j] = d * (float)p[j];
}
KVPQ_INLINE void fma8_u8(float d, const uint8_t *p, const float *xs, float *acc) {
    for (int j = 0; j < 8; j++) acc[j] = fmaf(d * (float)p[j], xs[j], acc[j]);
}
#endif

// ---- unpacking a block's quants to 256 bytes (plain loops over bytes: the compiler vectorizes them
// at the width of the ISA the file is built for) ------------------------------------------------------

/* Q2_K: u[e] = q in 0..3. */
KVPQ_INLINE void unpack_q2_K(const kvpq_block_q2_K *b, uint8_t u[QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) u[128 * h + 32 * s + l] = (b->qs[32 * h + l] >> (2 * s)) & 3;
}

/* Q3_K: i[e] = q in -4..3. */
KVPQ_INLINE void unpack_q3_K(const kvpq_block_q3_K *b, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                int j = 4 * h + s;
                q[32 * j + l] = (int8_t)((((b->qs[32 * h + l] >> (2 * s)) & 3) | (((b->hmask[l] >> j) & 1) << 2)) - 4);
            }
}

/* Q4_K: u[e] = q in 0..15. */
KVPQ_INLINE void unpack_q4_K(const kvpq_block_q4_K *b, uint8_t u[QK_K]) {
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            u[64 * c + l] = b->qs[32 * c + l] & 15;
            u[64 * c + 32 + l] = b->qs[32 * c + l] >> 4;
        }
}

/* Q5_K: u[e] = q in 0..31. */
KVPQ_INLINE void unpack_q5_K(const kvpq_block_q5_K *b, uint8_t u[QK_K]) {
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 32; l++) {
            int h = b->qh[l] >> (2 * c);
            u[64 * c + l] = (uint8_t)((b->qs[32 * c + l] & 15) | (h & 1) << 4);
            u[64 * c + 32 + l] = (uint8_t)((b->qs[32 * c + l] >> 4) | (h & 2) << 3);
        }
}

/* Q6_K: q[e] in -32..31. */
KVPQ_INLINE void unpack_q6_K(const kvpq_block_q6_K *b, int8_t q[QK_K]) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *ql = b->ql + 64 * h;
            int hb = b->qh[32 * h + l];
            q[128 * h + l] = (int8_t)(((ql[l] & 15) | (hb & 3) << 4) - 32);
            q[128 * h + 32 + l] = (int8_t)(((ql[l + 32] & 15) | ((hb >> 2) & 3) << 4) - 32);
            q[128 * h + 64 + l] = (int8_t)(((ql[l] >> 4) | ((hb >> 4) & 3) << 4) - 32);
            q[128 * h + 96 + l] = (int8_t)(((ql[l + 32] >> 4) | (hb >> 6) << 4) - 32);
        }
}

// ---- matvec ------------------------------------------------------------------------------------------

/* acc += sum over the sub-blocks g < 256 / L of dl[g] * (u[gL .. gL+L) . x[gL .. gL+L)), u unsigned
 * (U = 1) or signed bytes: per sub-block the L / W products in one FMA chain, then one FMA by its
 * scale into acc[g % 4] (four accumulators: the FMA latency would otherwise bound the loop). */
KVPQ_INLINE void dot_block(const void *u, int is_signed, int L, const float *x, const float *dl, kvpq_vf acc[4]) {
    for (int g = 0; g < QK_K / L; g++) {
        const uint8_t *p = (const uint8_t *)u + g * L;
        const float *xg = x + g * L;
        kvpq_vf t = vf_zero();
        for (int v = 0; v < L / W; v++) {
            kvpq_vf q = is_signed ? vf_from_i8(vb_load(p + v * W)) : vf_from_u8(vb_load(p + v * W));
            t = vf_fma(q, vf_load(xg + v * W), t);
        }
        acc[g & 3] = vf_fma(vf_set1(dl[g]), t, acc[g & 3]);
    }
}

KVPQ_INLINE float acc_sum(const kvpq_vf acc[4]) { return vf_reduce_add(vf_add(vf_add(acc[0], acc[1]), vf_add(acc[2], acc[3]))); }

/* The mins: accm[j] += ml[j] * xs[j] lane by lane (vectorized by the compiler), summed per row. */
KVPQ_INLINE float sum8(const float a[8]) { return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7])); }

static void matvec_q2_K(const uint8_t *Wq, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    /* xs: (n / 16) sums of x over 16-element groups (Q2_K's sub-blocks) */
    for (int64_t r = 0; r < n_rows; r++) {
        const kvpq_block_q2_K *b = (const kvpq_block_q2_K *)(const void *)(Wq + (size_t)r * rb);
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        float accm[16] = {0};
        for (int64_t i = 0; i < n / QK_K; i++, b++) {
            float d = vs_h2f_at(b->d), dmin = vs_h2f_at(b->dmin), dl[16];
            uint8_t u[QK_K], sc[16], m[16];
            for (int g = 0; g < 16; g++) sc[g] = b->scales[g] & 15, m[g] = b->scales[g] >> 4;
            mul8_u8(d, sc, dl);
            mul8_u8(d, sc + 8, dl + 8);
            fma8_u8(dmin, m, xs + 16 * i, accm);
            fma8_u8(dmin, m + 8, xs + 16 * i + 8, accm + 8);
            unpack_q2_K(b, u);
            dot_block(u, 0, 16, x + i * QK_K, dl, acc);
        }
        y[r] = acc_sum(acc) - (sum8(accm) + sum8(accm + 8));
    }
}

static void matvec_q3_K(const uint8_t *Wq, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    (void)xs;
    for (int64_t r = 0; r < n_rows; r++) {
        const kvpq_block_q3_K *b = (const kvpq_block_q3_K *)(const void *)(Wq + (size_t)r * rb);
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int64_t i = 0; i < n / QK_K; i++, b++) {
            float d = vs_h2f_at(b->d), dl[16];
            int8_t sc[16], q[QK_K];
            kvpq__q3_K_scales(b->scales, sc);
            mul8_i8(d, sc, dl);
            mul8_i8(d, sc + 8, dl + 8);
            unpack_q3_K(b, q);
            dot_block(q, 1, 16, x + i * QK_K, dl, acc);
        }
        y[r] = acc_sum(acc);
    }
}

/* Q4_K and Q5_K: the same but for the unpacking. xs: (n / 32) sums of x over the sub-blocks. */
#define MATVEC_Q45_K(NAME, BLOCK, UNPACK)                                                                     \
    static void NAME(const uint8_t *Wq, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs, \
                     float *y) {                                                                               \
        for (int64_t r = 0; r < n_rows; r++) {                                                                 \
            const BLOCK *b = (const BLOCK *)(const void *)(Wq + (size_t)r * rb);                               \
            kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};                                     \
            float accm[8] = {0};                                                                               \
            for (int64_t i = 0; i < n / QK_K; i++, b++) {                                                      \
                float d = vs_h2f_at(b->d), dmin = vs_h2f_at(b->dmin), dl[8];                                   \
                uint8_t sc[8], m[8], u[QK_K];                                                                  \
                k4_scales(b->scales, sc, m);                                                                   \
                mul8_u8(d, sc, dl);                                                                            \
                fma8_u8(dmin, m, xs + 8 * i, accm);                                                            \
                UNPACK(b, u);                                                                                  \
                dot_block(u, 0, 32, x + i * QK_K, dl, acc);                                                    \
            }                                                                                                  \
            y[r] = acc_sum(acc) - sum8(accm);                                                                  \
        }                                                                                                      \
    }
MATVEC_Q45_K(matvec_q4_K, kvpq_block_q4_K, unpack_q4_K)
MATVEC_Q45_K(matvec_q5_K, kvpq_block_q5_K, unpack_q5_K)

static void matvec_q6_K(const uint8_t *Wq, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    (void)xs;
    for (int64_t r = 0; r < n_rows; r++) {
        const kvpq_block_q6_K *b = (const kvpq_block_q6_K *)(const void *)(Wq + (size_t)r * rb);
        kvpq_vf acc[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int64_t i = 0; i < n / QK_K; i++, b++) {
            float d = vs_h2f_at(b->d), dl[16];
            int8_t q[QK_K];
            mul8_i8(d, b->scales, dl);
            mul8_i8(d, b->scales + 8, dl + 8);
            unpack_q6_K(b, q);
            dot_block(q, 1, 16, x + i * QK_K, dl, acc);
        }
        y[r] = acc_sum(acc);
    }
}

kvpq__matvec_fn KVPQ_ISA_FN(kvpq__kquant_matvec)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q2_K: return matvec_q2_K;
    case GGML_TYPE_Q3_K: return matvec_q3_K;
    case GGML_TYPE_Q4_K: return matvec_q4_K;
    case GGML_TYPE_Q5_K: return matvec_q5_K;
    case GGML_TYPE_Q6_K: return matvec_q6_K;
    }
    return NULL;
}

// ---- dequantization (bit-exact with the _ref: exact conversions, exact dl * q, one rounded - ml) ----

/* y[gL + l] = dl[g] * u[gL + l] - ml[g] (ml NULL: no min) */
KVPQ_INLINE void dequant_block(const void *u, int is_signed, int L, const float *dl, const float *ml, float *y) {
    for (int g = 0; g < QK_K / L; g++)
        for (int v = 0; v < L / W; v++) {
            const uint8_t *p = (const uint8_t *)u + g * L + v * W;
            kvpq_vf q = is_signed ? vf_from_i8(vb_load(p)) : vf_from_u8(vb_load(p)), w = vf_mul(vf_set1(dl[g]), q);
            vf_store(y + g * L + v * W, ml ? vf_sub(w, vf_set1(ml[g])) : w);
        }
}

static void dequant_q2_K(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q2_K *b = (const kvpq_block_q2_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = vs_h2f_at(b->d), dmin = vs_h2f_at(b->dmin), dl[16], ml[16];
        uint8_t u[QK_K];
        for (int g = 0; g < 16; g++) dl[g] = d * (float)(b->scales[g] & 15), ml[g] = dmin * (float)(b->scales[g] >> 4);
        unpack_q2_K(b, u);
        dequant_block(u, 0, 16, dl, ml, y);
    }
}

static void dequant_q3_K(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q3_K *b = (const kvpq_block_q3_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = vs_h2f_at(b->d), dl[16];
        int8_t sc[16], q[QK_K];
        kvpq__q3_K_scales(b->scales, sc);
        for (int g = 0; g < 16; g++) dl[g] = d * (float)sc[g];
        unpack_q3_K(b, q);
        dequant_block(q, 1, 16, dl, NULL, y);
    }
}

#define DEQUANT_Q45_K(NAME, BLOCK, UNPACK)                                                         \
    static void NAME(const uint8_t *src, float *y, int64_t n) {                                     \
        const BLOCK *b = (const BLOCK *)(const void *)src;                                          \
        for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {                                    \
            float d = vs_h2f_at(b->d), dmin = vs_h2f_at(b->dmin), dl[8], ml[8];                     \
            uint8_t sc[8], m[8], u[QK_K];                                                           \
            k4_scales(b->scales, sc, m);                                                            \
            for (int j = 0; j < 8; j++) dl[j] = d * (float)sc[j], ml[j] = dmin * (float)m[j];       \
            UNPACK(b, u);                                                                           \
            dequant_block(u, 0, 32, dl, ml, y);                                                     \
        }                                                                                           \
    }
DEQUANT_Q45_K(dequant_q4_K, kvpq_block_q4_K, unpack_q4_K)
DEQUANT_Q45_K(dequant_q5_K, kvpq_block_q5_K, unpack_q5_K)

static void dequant_q6_K(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q6_K *b = (const kvpq_block_q6_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = vs_h2f_at(b->d), dl[16];
        int8_t q[QK_K];
        for (int g = 0; g < 16; g++) dl[g] = d * (float)b->scales[g];
        unpack_q6_K(b, q);
        dequant_block(q, 1, 16, dl, NULL, y);
    }
}

kvpq__dequant_fn KVPQ_ISA_FN(kvpq__kquant_dequant)(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q2_K: return dequant_q2_K;
    case GGML_TYPE_Q3_K: return dequant_q3_K;
    case GGML_TYPE_Q4_K: return dequant_q4_K;
    case GGML_TYPE_Q5_K: return dequant_q5_K;
    case GGML_TYPE_Q6_K: return dequant_q6_K;
    }
    return NULL;
}

#undef W
