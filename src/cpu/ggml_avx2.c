/* ggml_avx2.c — AVX2/FMA/F16C kernels for GGML tensor types: matvec rows that dequantize blocks on
 * the fly, and bit-exact row dequantization. The scalar _ref in model/ggml_types.c is the spec. */
#if defined(__clang__)
/* Dequantization rounds the product and the sum separately (bit-exact with ggml / numpy). */
#pragma STDC FP_CONTRACT OFF
#endif
#include <string.h>

#include "cpu/ggml_kernels.h"
#include "model/ggml_types.h"

#if defined(__x86_64__)
#include <immintrin.h>

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 bytes of nibbles -> the 32 unsigned values of a Q4 block, as 4 x 8 floats (element order:
 * low nibbles are elements 0..15, high nibbles 16..31). */
static inline void nibbles(const uint8_t *qs, __m256 f[4]) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

/* sum_j f_j * x_j over one 32-element block, two chains for latency. */
static inline __m256 block_dot(const __m256 f[4], const float *x) {
    __m256 s0 = _mm256_mul_ps(f[0], _mm256_loadu_ps(x));
    __m256 s1 = _mm256_mul_ps(f[1], _mm256_loadu_ps(x + 8));
    s0 = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(x + 16), s0);
    s1 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(x + 24), s1);
    return _mm256_add_ps(s0, s1);
}

/* ---- matvec kernels ---- */

/* Q4_1: w = q*d + m, so dot = sum_b d_b * (q_b . x_b) + m_b * sum(x_b). */
static void matvec_q4_1(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float accm = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 40) {
            __m256 f[4], g[4];
            nibbles(blk + 4, f);
            nibbles(blk + 24, g);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk + 20)), block_dot(g, x + b * 32 + 32), acc1);
            accm += half(blk + 2) * xs[b] + half(blk + 22) * xs[b + 1];
        }
        for (; b < nb; b++, blk += 20) {
            __m256 f[4];
            nibbles(blk + 4, f);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            accm += half(blk + 2) * xs[b];
        }
        y[r] = hsum(_mm256_add_ps(acc0, acc1)) + accm;
    }
}

/* Q4_0: w = (q - 8)*d, so dot = sum_b d_b * (q_b . x_b - 8 sum(x_b)). */
static void matvec_q4_0(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        float accm = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 36) {
            __m256 f[4], g[4];
            float d0 = half(blk), d1 = half(blk + 18);
            nibbles(blk + 2, f);
            nibbles(blk + 20, g);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), block_dot(f, x + b * 32), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), block_dot(g, x + b * 32 + 32), acc1);
            accm += d0 * xs[b] + d1 * xs[b + 1];
        }
        for (; b < nb; b++, blk += 18) {
            __m256 f[4];
            float d0 = half(blk);
            nibbles(blk + 2, f);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), block_dot(f, x + b * 32), acc0);
            accm += d0 * xs[b];
        }
        y[r] = hsum(_mm256_add_ps(acc0, acc1)) - 8.0f * accm;
    }
}

static inline void q8_block(const uint8_t *qs, __m256 f[4]) {
    for (int k = 0; k < 4; k++)
        f[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * k))));
}

static void matvec_q8_0(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 68) {
            __m256 f[4], g[4];
            q8_block(blk + 2, f);
            q8_block(blk + 36, g);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk + 34)), block_dot(g, x + b * 32 + 32), acc1);
        }
        for (; b < nb; b++, blk += 34) {
            __m256 f[4];
            q8_block(blk + 2, f);
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
        }
        y[r] = hsum(_mm256_add_ps(acc0, acc1));
    }
}

float kvpq__dot_f32_avx2(const float *a, const float *b, int64_t n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

static void matvec_f32(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                       float *y) {
    for (int64_t r = 0; r < n_rows; r++) y[r] = kvpq__dot_f32_avx2((const float *)(const void *)(W + (size_t)r * rb), x, n);
}

static inline __m256 load_f16(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 load_bf16(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

#define MATVEC_16BIT(NAME, LOAD, SCALAR)                                                                       \
    static void NAME(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs, \
                     float *y) {                                                                               \
        for (int64_t r = 0; r < n_rows; r++) {                                                                 \
            const uint8_t *w = W + (size_t)r * rb;                                                             \
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();                                         \
            int64_t i = 0;                                                                                     \
            for (; i + 16 <= n; i += 16) {                                                                     \
                s0 = _mm256_fmadd_ps(LOAD(w + 2 * i), _mm256_loadu_ps(x + i), s0);                            \
                s1 = _mm256_fmadd_ps(LOAD(w + 2 * i + 16), _mm256_loadu_ps(x + i + 8), s1);                   \
            }                                                                                                  \
            float s = hsum(_mm256_add_ps(s0, s1));                                                             \
            for (; i < n; i++) {                                                                               \
                uint16_t h;                                                                                    \
                memcpy(&h, w + 2 * i, 2);                                                                      \
                s += SCALAR(h) * x[i];                                                                         \
            }                                                                                                  \
            y[r] = s;                                                                                          \
        }                                                                                                      \
    }
MATVEC_16BIT(matvec_f16, load_f16, _cvtsh_ss)
MATVEC_16BIT(matvec_bf16, load_bf16, kvpq_bf16_to_fp32)

kvpq__matvec_fn kvpq__ggml_matvec_avx2(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return matvec_f32;
    case GGML_TYPE_F16: return matvec_f16;
    case GGML_TYPE_BF16: return matvec_bf16;
    case GGML_TYPE_Q4_0: return matvec_q4_0;
    case GGML_TYPE_Q4_1: return matvec_q4_1;
    case GGML_TYPE_Q8_0: return matvec_q8_0;
    }
    return kvpq__kquant_matvec_avx2(type);
}

/* ---- dequantization (bit-exact: exact int->float conversions, one rounded mul, one rounded add) ---- */

static void dequant_q4_1(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, src += 20, y += 32) {
        __m256 d = _mm256_set1_ps(half(src)), m = _mm256_set1_ps(half(src + 2)), f[4];
        nibbles(src + 4, f);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, _mm256_add_ps(_mm256_mul_ps(f[k], d), m));
    }
}

static void dequant_q4_0(const uint8_t *src, float *y, int64_t n) {
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int64_t b = 0; b < n / 32; b++, src += 18, y += 32) {
        __m256 d = _mm256_set1_ps(half(src)), f[4];
        nibbles(src + 2, f);
        /* q - 8 is exact in float, so this equals ggml's (float)(q - 8) * d. */
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(_mm256_sub_ps(f[k], eight), d));
    }
}

static void dequant_q8_0(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, src += 34, y += 32) {
        __m256 d = _mm256_set1_ps(half(src)), f[4];
        q8_block(src + 2, f);
        for (int k = 0; k < 4; k++) _mm256_storeu_ps(y + 8 * k, _mm256_mul_ps(f[k], d));
    }
}

static void dequant_f16(const uint8_t *src, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, load_f16(src + 2 * i));
    for (; i < n; i++) y[i] = half(src + 2 * i);
}

kvpq__dequant_fn kvpq__ggml_dequant_avx2(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return dequant_q4_0;
    case GGML_TYPE_Q4_1: return dequant_q4_1;
    case GGML_TYPE_Q8_0: return dequant_q8_0;
    case GGML_TYPE_F16: return dequant_f16;
    }
    return kvpq__kquant_dequant_avx2(type);
}

#else /* not x86-64: no kernels; the dispatcher never asks for them */
kvpq__matvec_fn kvpq__ggml_matvec_avx2(uint32_t type) { return NULL; }
kvpq__dequant_fn kvpq__ggml_dequant_avx2(uint32_t type) { return NULL; }
float kvpq__dot_f32_avx2(const float *a, const float *b, int64_t n) { return 0; }
#endif
