/* ggml_avx512.c — AVX-512 (F, BW, VL, DQ) kernels for GGML tensor types: 16-wide versions of
 * ggml_avx2.c. The scalar _ref in model/ggml_types.c is the spec. */
#if defined(__clang__)
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

/* A Q4 block's 32 unsigned nibble values as 2 x 16 floats (elements 0..15, 16..31). */
static inline void nibbles(const uint8_t *qs, __m512 f[2]) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, m4)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), m4)));
}

static inline void q8_block(const uint8_t *qs, __m512 f[2]) {
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16))));
}

static inline __m512 block_dot(const __m512 f[2], const float *x) {
    return _mm512_fmadd_ps(f[1], _mm512_loadu_ps(x + 16), _mm512_mul_ps(f[0], _mm512_loadu_ps(x)));
}

/* ---- matvec kernels (same algebra as ggml_avx2.c) ---- */

static void matvec_q4_1(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        float accm = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 40) {
            __m512 f[2], g[2];
            nibbles(blk + 4, f);
            nibbles(blk + 24, g);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk + 20)), block_dot(g, x + b * 32 + 32), acc1);
            accm += half(blk + 2) * xs[b] + half(blk + 22) * xs[b + 1];
        }
        for (; b < nb; b++, blk += 20) {
            __m512 f[2];
            nibbles(blk + 4, f);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            accm += half(blk + 2) * xs[b];
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + accm;
    }
}

static void matvec_q4_0(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        float accm = 0;
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 36) {
            __m512 f[2], g[2];
            float d0 = half(blk), d1 = half(blk + 18);
            nibbles(blk + 2, f);
            nibbles(blk + 20, g);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d0), block_dot(f, x + b * 32), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(d1), block_dot(g, x + b * 32 + 32), acc1);
            accm += d0 * xs[b] + d1 * xs[b + 1];
        }
        for (; b < nb; b++, blk += 18) {
            __m512 f[2];
            float d0 = half(blk);
            nibbles(blk + 2, f);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(d0), block_dot(f, x + b * 32), acc0);
            accm += d0 * xs[b];
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) - 8.0f * accm;
    }
}

static void matvec_q8_0(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                        float *y) {
    int64_t nb = n / 32;
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *blk = W + (size_t)r * rb;
        __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
        int64_t b = 0;
        for (; b + 1 < nb; b += 2, blk += 68) {
            __m512 f[2], g[2];
            q8_block(blk + 2, f);
            q8_block(blk + 36, g);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk + 34)), block_dot(g, x + b * 32 + 32), acc1);
        }
        for (; b < nb; b++, blk += 34) {
            __m512 f[2];
            q8_block(blk + 2, f);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(half(blk)), block_dot(f, x + b * 32), acc0);
        }
        y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    }
}

float kvpq__dot_f32_avx512(const float *a, const float *b, int64_t n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
    }
    if (i < n) { /* masked tail */
        int64_t left = n - i;
        __mmask16 k0 = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        s0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k0, a + i), _mm512_maskz_loadu_ps(k0, b + i), s0);
        if (left > 16) {
            __mmask16 k1 = (__mmask16)((1u << (left - 16)) - 1);
            s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k1, a + i + 16), _mm512_maskz_loadu_ps(k1, b + i + 16), s1);
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

static void matvec_f32(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs,
                       float *y) {
    for (int64_t r = 0; r < n_rows; r++)
        y[r] = kvpq__dot_f32_avx512((const float *)(const void *)(W + (size_t)r * rb), x, n);
}

static inline __m512 load_f16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512 load_bf16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#define MATVEC_16BIT(NAME, LOAD, SCALAR)                                                                       \
    static void NAME(const uint8_t *W, size_t rb, int64_t n_rows, int64_t n, const float *x, const float *xs, \
                     float *y) {                                                                               \
        for (int64_t r = 0; r < n_rows; r++) {                                                                 \
            const uint8_t *w = W + (size_t)r * rb;                                                             \
            __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();                                         \
            int64_t i = 0;                                                                                     \
            for (; i + 32 <= n; i += 32) {                                                                     \
                s0 = _mm512_fmadd_ps(LOAD(w + 2 * i), _mm512_loadu_ps(x + i), s0);                            \
                s1 = _mm512_fmadd_ps(LOAD(w + 2 * i + 32), _mm512_loadu_ps(x + i + 16), s1);                  \
            }                                                                                                  \
            float s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));                                             \
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

kvpq__matvec_fn kvpq__ggml_matvec_avx512(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return matvec_f32;
    case GGML_TYPE_F16: return matvec_f16;
    case GGML_TYPE_BF16: return matvec_bf16;
    case GGML_TYPE_Q4_0: return matvec_q4_0;
    case GGML_TYPE_Q4_1: return matvec_q4_1;
    case GGML_TYPE_Q8_0: return matvec_q8_0;
    }
    return kvpq__kquant_matvec_avx512(type);
}

/* ---- dequantization (bit-exact, as ggml_avx2.c) ---- */

static void dequant_q4_1(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, src += 20, y += 32) {
        __m512 d = _mm512_set1_ps(half(src)), m = _mm512_set1_ps(half(src + 2)), f[2];
        nibbles(src + 4, f);
        _mm512_storeu_ps(y, _mm512_add_ps(_mm512_mul_ps(f[0], d), m));
        _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_mul_ps(f[1], d), m));
    }
}

static void dequant_q4_0(const uint8_t *src, float *y, int64_t n) {
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int64_t b = 0; b < n / 32; b++, src += 18, y += 32) {
        __m512 d = _mm512_set1_ps(half(src)), f[2];
        nibbles(src + 2, f);
        _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_sub_ps(f[0], eight), d));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(_mm512_sub_ps(f[1], eight), d));
    }
}

static void dequant_q8_0(const uint8_t *src, float *y, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, src += 34, y += 32) {
        __m512 d = _mm512_set1_ps(half(src)), f[2];
        q8_block(src + 2, f);
        _mm512_storeu_ps(y, _mm512_mul_ps(f[0], d));
        _mm512_storeu_ps(y + 16, _mm512_mul_ps(f[1], d));
    }
}

static void dequant_f16(const uint8_t *src, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, load_f16(src + 2 * i));
    for (; i < n; i++) y[i] = half(src + 2 * i);
}

kvpq__dequant_fn kvpq__ggml_dequant_avx512(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0: return dequant_q4_0;
    case GGML_TYPE_Q4_1: return dequant_q4_1;
    case GGML_TYPE_Q8_0: return dequant_q8_0;
    case GGML_TYPE_F16: return dequant_f16;
    }
    return kvpq__kquant_dequant_avx512(type);
}

#else
kvpq__matvec_fn kvpq__ggml_matvec_avx512(uint32_t type) { return NULL; }
kvpq__dequant_fn kvpq__ggml_dequant_avx512(uint32_t type) { return NULL; }
float kvpq__dot_f32_avx512(const float *a, const float *b, int64_t n) { return 0; }
#endif
