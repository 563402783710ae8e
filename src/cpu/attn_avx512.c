/* attn_avx512.c — AVX-512 (F, BW, VL, DQ) kernels of the cache attention paths (see
 * attn_kernels.h). Tails use masked loads and stores. */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>

#include "cpu/attn_kernels.h"

static inline __mmask16 tail_mask(int k) { return (__mmask16)((1u << k) - 1u); }

static inline float dot_avx512(const float *a, const float *b, int n) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int c = 0;
    for (; c + 64 <= n; c += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 16), _mm512_loadu_ps(b + c + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 32), _mm512_loadu_ps(b + c + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c + 48), _mm512_loadu_ps(b + c + 48), s3);
    }
    for (; c + 16 <= n; c += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + c), _mm512_loadu_ps(b + c), s0);
    if (c < n) {
        __mmask16 k = tail_mask(n - c);
        s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, a + c), _mm512_maskz_loadu_ps(k, b + c), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

/* Sums of four accumulators, as one vector {sum a0, sum a1, sum a2, sum a3}. */
static inline __m128 reduce4_avx512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m256 b0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 b1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    __m256 b2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    __m256 b3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(b0, b1), _mm256_hadd_ps(b2, b3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Four keys at a time: one reduction tree for four dot products instead of four. */
static void qk_avx512(const float *Q, int R, const float *K, int n, int hd, float *S, int lds) {
    int t = 0;
    if (hd % 16 == 0)
        for (; t + 4 <= n; t += 4) {
            const float *k0 = K + (size_t)t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
            for (int r = 0; r < R; r++) {
                const float *q = Q + (size_t)r * hd;
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                       a3 = _mm512_setzero_ps();
                for (int c = 0; c < hd; c += 16) {
                    __m512 qv = _mm512_loadu_ps(q + c);
                    a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + c), a0);
                    a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + c), a1);
                    a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + c), a2);
                    a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + c), a3);
                }
                _mm_storeu_ps(S + (size_t)r * lds + t, reduce4_avx512(a0, a1, a2, a3));
            }
        }
    for (; t < n; t++)
        for (int r = 0; r < R; r++) S[(size_t)r * lds + t] = dot_avx512(Q + (size_t)r * hd, K + (size_t)t * hd, hd);
}

static inline __m512 ld16h(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }

static void qk_f16_avx512(const float *Q, int R, const uint16_t *K, int n, int hd, float *S, int lds) {
    if (hd % 16) {
        kvpq__attn_ref.qk_f16(Q, R, K, n, hd, S, lds);
        return;
    }
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const uint16_t *k0 = K + (size_t)t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        for (int r = 0; r < R; r++) {
            const float *q = Q + (size_t)r * hd;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(),
                   a3 = _mm512_setzero_ps();
            for (int c = 0; c < hd; c += 16) {
                __m512 qv = _mm512_loadu_ps(q + c);
                a0 = _mm512_fmadd_ps(qv, ld16h(k0 + c), a0);
                a1 = _mm512_fmadd_ps(qv, ld16h(k1 + c), a1);
                a2 = _mm512_fmadd_ps(qv, ld16h(k2 + c), a2);
                a3 = _mm512_fmadd_ps(qv, ld16h(k3 + c), a3);
            }
            _mm_storeu_ps(S + (size_t)r * lds + t, reduce4_avx512(a0, a1, a2, a3));
        }
    }
    for (; t < n; t++)
        for (int r = 0; r < R; r++) {
            __m512 a = _mm512_setzero_ps();
            for (int c = 0; c < hd; c += 16)
                a = _mm512_fmadd_ps(_mm512_loadu_ps(Q + (size_t)r * hd + c), ld16h(K + (size_t)t * hd + c), a);
            S[(size_t)r * lds + t] = _mm512_reduce_add_ps(a);
        }
}

static void pv_f16_avx512(const float *P, int R, int ldp, const uint16_t *V, int n, int hd, float *O) {
    if (hd % 16) {
        kvpq__attn_ref.pv_f16(P, R, ldp, V, n, hd, O);
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *p = P + (size_t)r * ldp;
        float *o = O + (size_t)r * hd;
        int c = 0;
        for (; c + 64 <= hd; c += 64) {
            __m512 a0 = _mm512_loadu_ps(o + c), a1 = _mm512_loadu_ps(o + c + 16);
            __m512 a2 = _mm512_loadu_ps(o + c + 32), a3 = _mm512_loadu_ps(o + c + 48);
            for (int t = 0; t < n; t++) {
                const uint16_t *v = V + (size_t)t * hd + c;
                __m512 pt = _mm512_set1_ps(p[t]);
                a0 = _mm512_fmadd_ps(pt, ld16h(v), a0);
                a1 = _mm512_fmadd_ps(pt, ld16h(v + 16), a1);
                a2 = _mm512_fmadd_ps(pt, ld16h(v + 32), a2);
                a3 = _mm512_fmadd_ps(pt, ld16h(v + 48), a3);
            }
            _mm512_storeu_ps(o + c, a0);
            _mm512_storeu_ps(o + c + 16, a1);
            _mm512_storeu_ps(o + c + 32, a2);
            _mm512_storeu_ps(o + c + 48, a3);
        }
        for (; c < hd; c += 16) {
            __m512 a0 = _mm512_loadu_ps(o + c);
            for (int t = 0; t < n; t++) a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), ld16h(V + (size_t)t * hd + c), a0);
            _mm512_storeu_ps(o + c, a0);
        }
    }
}

static void pv_avx512(const float *P, int R, int ldp, const float *V, int n, int hd, float *O) {
    for (int r = 0; r < R; r++) {
        const float *p = P + (size_t)r * ldp;
        float *o = O + (size_t)r * hd;
        int c = 0;
        for (; c + 64 <= hd; c += 64) {
            __m512 a0 = _mm512_loadu_ps(o + c), a1 = _mm512_loadu_ps(o + c + 16);
            __m512 a2 = _mm512_loadu_ps(o + c + 32), a3 = _mm512_loadu_ps(o + c + 48);
            for (int t = 0; t < n; t++) {
                const float *v = V + (size_t)t * hd + c;
                __m512 pt = _mm512_set1_ps(p[t]);
                a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v), a0);
                a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16), a1);
                a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 32), a2);
                a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 48), a3);
            }
            _mm512_storeu_ps(o + c, a0);
            _mm512_storeu_ps(o + c + 16, a1);
            _mm512_storeu_ps(o + c + 32, a2);
            _mm512_storeu_ps(o + c + 48, a3);
        }
        for (; c < hd; c += 16) {
            __mmask16 k = hd - c >= 16 ? (__mmask16)0xffff : tail_mask(hd - c);
            __m512 a0 = _mm512_maskz_loadu_ps(k, o + c);
            for (int t = 0; t < n; t++)
                a0 = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_maskz_loadu_ps(k, V + (size_t)t * hd + c), a0);
            _mm512_mask_storeu_ps(o + c, k, a0);
        }
    }
}

static float max_avx512(const float *x, int n) {
    __m512 vm = _mm512_set1_ps(x[0]);
    int i = 0;
    for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
    if (i < n) vm = _mm512_mask_max_ps(vm, tail_mask(n - i), vm, _mm512_maskz_loadu_ps(tail_mask(n - i), x + i));
    return _mm512_reduce_max_ps(vm);
}

/* exp(x) for x <= 0: the polynomial of attn_avx2.c's exp_avx2 (Cephes expf). */
static inline __m512 exp_avx512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

static float exp_sum_avx512(float *x, int n, float m) {
    __m512 vm = _mm512_set1_ps(m), s = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
        _mm512_storeu_ps(x + i, e);
        s = _mm512_add_ps(s, e);
    }
    if (i < n) {
        __mmask16 k = tail_mask(n - i);
        __m512 e = exp_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
        _mm512_mask_storeu_ps(x + i, k, e);
        s = _mm512_mask_add_ps(s, k, s, e);
    }
    return _mm512_reduce_add_ps(s);
}

static void scale_avx512(float *x, int n, float s) {
    __m512 vs = _mm512_set1_ps(s);
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    if (i < n) {
        __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs));
    }
}

static void f16_to_f32_avx512(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    for (; i < n; i++) dst[i] = kvpq__h2f(src[i]);
}

static void f32_to_f16_avx512(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = kvpq__f2h(src[i]);
}

static void dequant_q8_0_avx512(const void *blocks, size_t n_blocks, float *x) {
    const unsigned char *y = blocks;
    for (size_t b = 0; b < n_blocks; b++, x += 32, y += 34) {
        const __m512 d = _mm512_set1_ps(kvpq__h2f((uint16_t)(y[0] | y[1] << 8)));
        for (int j = 0; j < 32; j += 16) {
            __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(y + 2 + j)));
            _mm512_storeu_ps(x + j, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
        }
    }
}

static void dequant_q4_0_avx512(const void *blocks, size_t n_blocks, float *x) {
    const unsigned char *y = blocks;
    const __m128i lo = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    for (size_t b = 0; b < n_blocks; b++, x += 32, y += 18) {
        const __m512 d = _mm512_set1_ps(kvpq__h2f((uint16_t)(y[0] | y[1] << 8)));
        __m128i qs = _mm_loadu_si128((const __m128i *)(y + 2));
        __m128i q0 = _mm_sub_epi8(_mm_and_si128(qs, lo), eight);                    /* elements 0..15 */
        __m128i q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), lo), eight); /* 16..31 */
        _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
        _mm512_storeu_ps(x + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
    }
}

/* 32 codes of `bits` bits (2 or 4) as 32 bytes, in order, in two 128-bit halves. */
static inline void unpack32_512(const unsigned char *codes, int bits, __m128i *q) {
    if (bits == 4) {
        const __m128i m = _mm_set1_epi8(0x0f);
        __m128i b = _mm_loadu_si128((const __m128i *)codes);
        __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        q[0] = _mm_unpacklo_epi8(l, h);
        q[1] = _mm_unpackhi_epi8(l, h);
    } else {
        const __m128i m = _mm_set1_epi8(0x03);
        __m128i b = _mm_loadl_epi64((const __m128i *)codes);
        __m128i p0 = _mm_and_si128(b, m), p1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
        __m128i p2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), p3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
        __m128i u01 = _mm_unpacklo_epi8(p0, p1), u23 = _mm_unpacklo_epi8(p2, p3);
        q[0] = _mm_unpacklo_epi16(u01, u23);
        q[1] = _mm_unpackhi_epi16(u01, u23);
    }
}

static void dequant_bits_avx512(const unsigned char *codes, int bits, int n, const float *scale, const float *min,
                                float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        __m128i q[2];
        unpack32_512(codes, bits, q);
        for (int h = 0; h < 2; h++) {
            __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[h]));
            int o = c + 16 * h;
            _mm512_storeu_ps(x + o, _mm512_fmadd_ps(f, _mm512_loadu_ps(scale + o), _mm512_loadu_ps(min + o)));
        }
    }
}

static void dequant_bits_g32_avx512(const unsigned char *codes, int bits, int n, const float *scale32,
                                    const float *min32, float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        __m128i q[2];
        unpack32_512(codes, bits, q);
        const __m512 sc = _mm512_set1_ps(scale32[c / 32]), mn = _mm512_set1_ps(min32[c / 32]);
        _mm512_storeu_ps(x + c, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[0])), sc, mn));
        _mm512_storeu_ps(x + c + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q[1])), sc, mn));
    }
}

const kvpq_attn_kernels kvpq__attn_avx512 = {
    .name = "avx512",
    .qk = qk_avx512,
    .pv = pv_avx512,
    .qk_f16 = qk_f16_avx512,
    .pv_f16 = pv_f16_avx512,
    .max = max_avx512,
    .exp_sum = exp_sum_avx512,
    .scale = scale_avx512,
    .f16_to_f32 = f16_to_f32_avx512,
    .f32_to_f16 = f32_to_f16_avx512,
    .dequant_q8_0 = dequant_q8_0_avx512,
    .dequant_q4_0 = dequant_q4_0_avx512,
    .dequant_bits = dequant_bits_avx512,
    .dequant_bits_g32 = dequant_bits_g32_avx512,
};
#endif
