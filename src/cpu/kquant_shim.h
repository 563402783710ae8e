/* kquant_shim.h — TEMPORARY: the few simd.h operations (names as on branch `kernels`) that
 * kquant_body.h uses, until that layer is merged; then this file goes and simd.h is included. */
#ifndef KVPQ_KQUANT_SHIM_H
#define KVPQ_KQUANT_SHIM_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define KVPQ_CAT_(a, b) a##_##b
#define KVPQ_CAT(a, b) KVPQ_CAT_(a, b)
#define KVPQ_INLINE static inline __attribute__((always_inline))

#if defined(KVPQ_ISA_AVX512)
#define KVPQ_VW 16
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, avx512)
typedef __m512 kvpq_vf;
KVPQ_INLINE kvpq_vf vf_zero(void) { return _mm512_setzero_ps(); }
KVPQ_INLINE kvpq_vf vf_set1(float x) { return _mm512_set1_ps(x); }
KVPQ_INLINE kvpq_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
KVPQ_INLINE void vf_store(float *p, kvpq_vf v) { _mm512_storeu_ps(p, v); }
KVPQ_INLINE kvpq_vf vf_add(kvpq_vf a, kvpq_vf b) { return _mm512_add_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_sub(kvpq_vf a, kvpq_vf b) { return _mm512_sub_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_mul(kvpq_vf a, kvpq_vf b) { return _mm512_mul_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_fma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm512_fmadd_ps(a, b, c); }
KVPQ_INLINE __m256 vf__half_add(kvpq_vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
typedef __m128i kvpq_vb;
KVPQ_INLINE kvpq_vb vb_load(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
KVPQ_INLINE kvpq_vf vf_from_u8(kvpq_vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
KVPQ_INLINE kvpq_vf vf_from_i8(kvpq_vb b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
#elif defined(KVPQ_ISA_AVX2)
#define KVPQ_VW 8
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, avx2)
typedef __m256 kvpq_vf;
KVPQ_INLINE kvpq_vf vf_zero(void) { return _mm256_setzero_ps(); }
KVPQ_INLINE kvpq_vf vf_set1(float x) { return _mm256_set1_ps(x); }
KVPQ_INLINE kvpq_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
KVPQ_INLINE void vf_store(float *p, kvpq_vf v) { _mm256_storeu_ps(p, v); }
KVPQ_INLINE kvpq_vf vf_add(kvpq_vf a, kvpq_vf b) { return _mm256_add_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_sub(kvpq_vf a, kvpq_vf b) { return _mm256_sub_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_mul(kvpq_vf a, kvpq_vf b) { return _mm256_mul_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_fma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm256_fmadd_ps(a, b, c); }
KVPQ_INLINE __m256 vf__half_add(kvpq_vf v) { return v; }
typedef __m128i kvpq_vb;
KVPQ_INLINE kvpq_vb vb_load(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
KVPQ_INLINE kvpq_vf vf_from_u8(kvpq_vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
KVPQ_INLINE kvpq_vf vf_from_i8(kvpq_vb b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
#endif
KVPQ_INLINE float vf_reduce_add(kvpq_vf v) {
    __m256 h = vf__half_add(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
KVPQ_INLINE float vs_h2f_at(const void *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
/* bytes: (b >> s) & m in every byte; b | c; b << s (values small enough not to cross bytes); b - c */
KVPQ_INLINE kvpq_vb vb_bits(kvpq_vb b, int s, int m) {
    return _mm_and_si128(_mm_srli_epi16(b, s), _mm_set1_epi8((char)m));
}
KVPQ_INLINE kvpq_vb vb_or(kvpq_vb a, kvpq_vb b) { return _mm_or_si128(a, b); }
KVPQ_INLINE kvpq_vb vb_shl(kvpq_vb b, int s) { return _mm_slli_epi16(b, s); }
KVPQ_INLINE kvpq_vb vb_sub(kvpq_vb a, int c) { return _mm_sub_epi8(a, _mm_set1_epi8((char)c)); }
#endif
