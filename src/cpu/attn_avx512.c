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

static void qk_avx512(const float *Q, int R, const float *K, int n, int hd, float *S, int lds) {
    for (int t = 0; t < n; t++)
        for (int r = 0; r < R; r++) S[(size_t)r * lds + t] = dot_avx512(Q + (size_t)r * hd, K + (size_t)t * hd, hd);
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

const kvpq_attn_kernels kvpq__attn_avx512 = {
    .name = "avx512",
    .qk = qk_avx512,
    .pv = pv_avx512,
    .max = max_avx512,
    .exp_sum = exp_sum_avx512,
    .scale = scale_avx512,
    .f16_to_f32 = f16_to_f32_avx512,
    .f32_to_f16 = f32_to_f16_avx512,
};
#endif
