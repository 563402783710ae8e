/* attn_avx2.c — AVX2 + FMA + F16C kernels of the cache attention paths (see attn_kernels.h). */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>

#include "cpu/attn_kernels.h"

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float dot_avx2(const float *a, const float *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int c = 0;
    for (; c + 32 <= n; c += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 16), _mm256_loadu_ps(b + c + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 24), _mm256_loadu_ps(b + c + 24), s3);
    }
    for (; c + 8 <= n; c += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c), s0);
    float s = hsum8(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; c < n; c++) s += a[c] * b[c];
    return s;
}

/* Sums of four accumulators, as one vector {sum a0, sum a1, sum a2, sum a3}. */
static inline __m128 reduce4_avx2(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Four keys at a time: one reduction tree for four dot products instead of four. */
static void qk_avx2(const float *Q, int R, const float *K, int n, int hd, float *S, int lds) {
    int t = 0;
    if (hd % 8 == 0)
        for (; t + 4 <= n; t += 4) {
            const float *k0 = K + (size_t)t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
            for (int r = 0; r < R; r++) {
                const float *q = Q + (size_t)r * hd;
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                       a3 = _mm256_setzero_ps();
                for (int c = 0; c < hd; c += 8) {
                    __m256 qv = _mm256_loadu_ps(q + c);
                    a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
                    a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + c), a1);
                    a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + c), a2);
                    a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + c), a3);
                }
                _mm_storeu_ps(S + (size_t)r * lds + t, reduce4_avx2(a0, a1, a2, a3));
            }
        }
    for (; t < n; t++)
        for (int r = 0; r < R; r++) S[(size_t)r * lds + t] = dot_avx2(Q + (size_t)r * hd, K + (size_t)t * hd, hd);
}

static inline __m256 ld8h(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static void qk_f16_avx2(const float *Q, int R, const uint16_t *K, int n, int hd, float *S, int lds) {
    if (hd % 8) {
        kvpq__attn_ref.qk_f16(Q, R, K, n, hd, S, lds);
        return;
    }
    int t = 0;
    for (; t + 4 <= n; t += 4) {
        const uint16_t *k0 = K + (size_t)t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
        for (int r = 0; r < R; r++) {
            const float *q = Q + (size_t)r * hd;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int c = 0; c < hd; c += 8) {
                __m256 qv = _mm256_loadu_ps(q + c);
                a0 = _mm256_fmadd_ps(qv, ld8h(k0 + c), a0);
                a1 = _mm256_fmadd_ps(qv, ld8h(k1 + c), a1);
                a2 = _mm256_fmadd_ps(qv, ld8h(k2 + c), a2);
                a3 = _mm256_fmadd_ps(qv, ld8h(k3 + c), a3);
            }
            _mm_storeu_ps(S + (size_t)r * lds + t, reduce4_avx2(a0, a1, a2, a3));
        }
    }
    for (; t < n; t++)
        for (int r = 0; r < R; r++) {
            __m256 a = _mm256_setzero_ps();
            for (int c = 0; c < hd; c += 8)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(Q + (size_t)r * hd + c), ld8h(K + (size_t)t * hd + c), a);
            S[(size_t)r * lds + t] = hsum8(a);
        }
}

static void pv_f16_avx2(const float *P, int R, int ldp, const uint16_t *V, int n, int hd, float *O) {
    if (hd % 8) {
        kvpq__attn_ref.pv_f16(P, R, ldp, V, n, hd, O);
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *p = P + (size_t)r * ldp;
        float *o = O + (size_t)r * hd;
        int c = 0;
        for (; c + 32 <= hd; c += 32) {
            __m256 a0 = _mm256_loadu_ps(o + c), a1 = _mm256_loadu_ps(o + c + 8);
            __m256 a2 = _mm256_loadu_ps(o + c + 16), a3 = _mm256_loadu_ps(o + c + 24);
            for (int t = 0; t < n; t++) {
                const uint16_t *v = V + (size_t)t * hd + c;
                __m256 pt = _mm256_set1_ps(p[t]);
                a0 = _mm256_fmadd_ps(pt, ld8h(v), a0);
                a1 = _mm256_fmadd_ps(pt, ld8h(v + 8), a1);
                a2 = _mm256_fmadd_ps(pt, ld8h(v + 16), a2);
                a3 = _mm256_fmadd_ps(pt, ld8h(v + 24), a3);
            }
            _mm256_storeu_ps(o + c, a0);
            _mm256_storeu_ps(o + c + 8, a1);
            _mm256_storeu_ps(o + c + 16, a2);
            _mm256_storeu_ps(o + c + 24, a3);
        }
        for (; c < hd; c += 8) {
            __m256 a0 = _mm256_loadu_ps(o + c);
            for (int t = 0; t < n; t++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), ld8h(V + (size_t)t * hd + c), a0);
            _mm256_storeu_ps(o + c, a0);
        }
    }
}

static void pv_avx2(const float *P, int R, int ldp, const float *V, int n, int hd, float *O) {
    for (int r = 0; r < R; r++) {
        const float *p = P + (size_t)r * ldp;
        float *o = O + (size_t)r * hd;
        int c = 0;
        for (; c + 32 <= hd; c += 32) {
            __m256 a0 = _mm256_loadu_ps(o + c), a1 = _mm256_loadu_ps(o + c + 8);
            __m256 a2 = _mm256_loadu_ps(o + c + 16), a3 = _mm256_loadu_ps(o + c + 24);
            for (int t = 0; t < n; t++) {
                const float *v = V + (size_t)t * hd + c;
                __m256 pt = _mm256_set1_ps(p[t]);
                a0 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v), a0);
                a1 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(o + c, a0);
            _mm256_storeu_ps(o + c + 8, a1);
            _mm256_storeu_ps(o + c + 16, a2);
            _mm256_storeu_ps(o + c + 24, a3);
        }
        for (; c + 8 <= hd; c += 8) {
            __m256 a0 = _mm256_loadu_ps(o + c);
            for (int t = 0; t < n; t++)
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), _mm256_loadu_ps(V + (size_t)t * hd + c), a0);
            _mm256_storeu_ps(o + c, a0);
        }
        for (; c < hd; c++) {
            float a = o[c];
            for (int t = 0; t < n; t++) a += p[t] * V[(size_t)t * hd + c];
            o[c] = a;
        }
    }
}

static float max_avx2(const float *x, int n) {
    int i = 0;
    float m = x[0];
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(x + i));
        __m128 s = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        s = _mm_max_ps(s, _mm_movehl_ps(s, s));
        s = _mm_max_ss(s, _mm_movehdup_ps(s));
        m = _mm_cvtss_f32(s);
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2 in two parts, degree-5 polynomial,
 * 2^n by exponent arithmetic). Inputs below -87 give ~1e-38 instead of 0. */
static inline __m256 exp_avx2(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static float exp_sum_avx2(float *x, int n, float m) {
    __m256 vm = _mm256_set1_ps(m), s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    float sum = hsum8(s);
    for (; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    return sum;
}

static void scale_avx2(float *x, int n, float s) {
    __m256 vs = _mm256_set1_ps(s);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), vs));
    for (; i < n; i++) x[i] *= s;
}

static void f16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = kvpq__h2f(src[i]);
}

static void f32_to_f16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = kvpq__f2h(src[i]);
}

static void dequant_q8_0_avx2(const void *blocks, size_t n_blocks, float *x) {
    const unsigned char *y = blocks;
    for (size_t b = 0; b < n_blocks; b++, x += 32, y += 34) {
        const __m256 d = _mm256_set1_ps(kvpq__h2f((uint16_t)(y[0] | y[1] << 8)));
        for (int j = 0; j < 32; j += 8) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(y + 2 + j)));
            _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

static void dequant_q4_0_avx2(const void *blocks, size_t n_blocks, float *x) {
    const unsigned char *y = blocks;
    const __m128i lo = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    for (size_t b = 0; b < n_blocks; b++, x += 32, y += 18) {
        const __m256 d = _mm256_set1_ps(kvpq__h2f((uint16_t)(y[0] | y[1] << 8)));
        __m128i qs = _mm_loadu_si128((const __m128i *)(y + 2));
        __m128i q0 = _mm_sub_epi8(_mm_and_si128(qs, lo), eight);                    /* elements 0..15 */
        __m128i q1 = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), lo), eight); /* 16..31 */
        _mm256_storeu_ps(x, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)), d));
        _mm256_storeu_ps(x + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q0, 8))), d));
        _mm256_storeu_ps(x + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)), d));
        _mm256_storeu_ps(x + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q1, 8))), d));
    }
}

/* 32 codes of `bits` bits (2 or 4) from `codes` as 32 bytes, in order, in two 128-bit halves. */
static inline void unpack32(const unsigned char *codes, int bits, __m128i *lo16, __m128i *hi16) {
    if (bits == 4) {
        const __m128i m = _mm_set1_epi8(0x0f);
        __m128i b = _mm_loadu_si128((const __m128i *)codes);
        __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        *lo16 = _mm_unpacklo_epi8(l, h);
        *hi16 = _mm_unpackhi_epi8(l, h);
    } else {
        const __m128i m = _mm_set1_epi8(0x03);
        __m128i b = _mm_loadl_epi64((const __m128i *)codes);
        __m128i p0 = _mm_and_si128(b, m), p1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
        __m128i p2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), p3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
        __m128i u01 = _mm_unpacklo_epi8(p0, p1), u23 = _mm_unpacklo_epi8(p2, p3);
        *lo16 = _mm_unpacklo_epi16(u01, u23);
        *hi16 = _mm_unpackhi_epi16(u01, u23);
    }
}

static void dequant_bits_avx2(const unsigned char *codes, int bits, int n, const float *scale, const float *min,
                              float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        __m128i q[2];
        unpack32(codes, bits, &q[0], &q[1]);
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 16; e += 8) {
                __m128i qq = e ? _mm_srli_si128(q[h], 8) : q[h];
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qq));
                int o = c + 16 * h + e;
                _mm256_storeu_ps(x + o, _mm256_fmadd_ps(f, _mm256_loadu_ps(scale + o), _mm256_loadu_ps(min + o)));
            }
    }
}

static void dequant_bits_g32_avx2(const unsigned char *codes, int bits, int n, const float *scale32,
                                  const float *min32, float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        __m128i q[2];
        unpack32(codes, bits, &q[0], &q[1]);
        const __m256 sc = _mm256_set1_ps(scale32[c / 32]), mn = _mm256_set1_ps(min32[c / 32]);
        for (int h = 0; h < 2; h++)
            for (int e = 0; e < 16; e += 8) {
                __m128i qq = e ? _mm_srli_si128(q[h], 8) : q[h];
                __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(qq));
                _mm256_storeu_ps(x + c + 16 * h + e, _mm256_fmadd_ps(f, sc, mn));
            }
    }
}

const kvpq_attn_kernels kvpq__attn_avx2 = {
    .name = "avx2",
    .qk = qk_avx2,
    .pv = pv_avx2,
    .qk_f16 = qk_f16_avx2,
    .pv_f16 = pv_f16_avx2,
    .max = max_avx2,
    .exp_sum = exp_sum_avx2,
    .scale = scale_avx2,
    .f16_to_f32 = f16_to_f32_avx2,
    .f32_to_f16 = f32_to_f16_avx2,
    .dequant_q8_0 = dequant_q8_0_avx2,
    .dequant_q4_0 = dequant_q4_0_avx2,
    .dequant_bits = dequant_bits_avx2,
    .dequant_bits_g32 = dequant_bits_g32_avx2,
};
#endif
