/* simd.h — the width-generic SIMD layer of the CPU kernels. Internal.
 *
 * A kernel body is written once against `kvpq_vf` (a vector of KVPQ_VW float32 lanes), `kvpq_vi`
 * (KVPQ_VW int32 lanes), `kvpq_vm` (a lane mask) and the vf_* / vi_* operations below, and compiled
 * once per ISA. The translation unit picks the ISA by defining one macro before any include:
 *
 *     KVPQ_ISA_AVX512   W = 16: AVX-512 F, BW, VL, DQ (the file is built with those flags)
 *     KVPQ_ISA_AVX2     W = 8:  AVX2, FMA, F16C
 *     (neither)         W = 1:  plain C11, the same operations on one lane
 *
 * KVPQ_ISA_FN(name) appends the ISA's suffix (name_avx2, name_avx512, name_scalar), so the
 * instances of one body export distinct symbols. CMake gives `*_avx2.c` and `*_avx512.c` their flags;
 * a missing flag is a compile error here, never a silent scalar build.
 *
 * Rounding is the same at every width: vf_fma / vf_fnma are fused (one rounding; fmaf at W = 1),
 * conversions from integers and halves are exact, vf_reduce_add adds in a fixed halving tree (lane i
 * plus lane i + W/2, repeated), so a body's result depends on W only through its own loop structure.
 * vf_max(a, b) is `a > b ? a : b` (x86 maxps: the second operand when either is NaN).
 *
 * Like ggml's simd-mappings.h (GGML_F32_VEC ...), but functions instead of macros so that types are
 * checked. Only the operations that some kernel uses are here; add one for every ISA at once. */
#ifndef KVPQ_SIMD_H
#define KVPQ_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "core/fp16.h"

#define KVPQ_CAT_(a, b) a##_##b
#define KVPQ_CAT(a, b) KVPQ_CAT_(a, b)

#define KVPQ_INLINE static inline __attribute__((always_inline))

/* exp(x) for x <= 0 (Cephes expf): n = round(x / ln 2), r = x - n ln 2 in two parts (the first
 * exact in float), exp(r) ~ 1 + r + r^2 P(r) with P of degree 5, times 2^n built in the exponent
 * field. Inputs are clamped at -87 (giving ~1e-38 instead of 0, which a softmax cannot tell apart).
 * Relative error a few ulp (~2e-7); NaN stays NaN. The constants, shared by every width: */
#define KVPQ_EXP_LO (-87.0f)
#define KVPQ_EXP_LOG2E 1.44269504088896341f
#define KVPQ_EXP_LN2_HI 0.693359375f
#define KVPQ_EXP_LN2_LO (-2.12194440e-4f)
#define KVPQ_EXP_P0 1.9875691500e-4f
#define KVPQ_EXP_P1 1.3981999507e-3f
#define KVPQ_EXP_P2 8.3334519073e-3f
#define KVPQ_EXP_P3 4.1665795894e-2f
#define KVPQ_EXP_P4 1.6666665459e-1f
#define KVPQ_EXP_P5 5.0000001201e-1f

#if defined(KVPQ_ISA_AVX512)
// ---- AVX-512: 16 lanes ----------------------------------------------------------------------------
#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || \
    !defined(__FMA__) || !defined(__F16C__)
#error "KVPQ_ISA_AVX512: compile this file with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c"
#endif
#include <immintrin.h>
#define KVPQ_VW 16
#if defined(KVPQ_ISA_SUFFIX) /* a variant of this ISA with more extensions (ggml_avx512vnni.c) */
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, KVPQ_ISA_SUFFIX)
#else
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, avx512)
#endif
#define KVPQ_ISA_NAME "avx512"
typedef __m512 kvpq_vf;
typedef __m512i kvpq_vi;
typedef __mmask16 kvpq_vm;

KVPQ_INLINE kvpq_vf vf_zero(void) { return _mm512_setzero_ps(); }
KVPQ_INLINE kvpq_vf vf_set1(float x) { return _mm512_set1_ps(x); }
KVPQ_INLINE kvpq_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
KVPQ_INLINE void vf_store(float *p, kvpq_vf v) { _mm512_storeu_ps(p, v); }
KVPQ_INLINE kvpq_vm vm_first(int n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }
/* Lanes i < n (0 <= n <= W) from p, the others 0; reads nothing past p + n. */
KVPQ_INLINE kvpq_vf vf_load_n(const float *p, int n) { return _mm512_maskz_loadu_ps(vm_first(n), p); }
KVPQ_INLINE void vf_store_n(float *p, kvpq_vf v, int n) { _mm512_mask_storeu_ps(p, vm_first(n), v); }
KVPQ_INLINE kvpq_vf vf_add(kvpq_vf a, kvpq_vf b) { return _mm512_add_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_sub(kvpq_vf a, kvpq_vf b) { return _mm512_sub_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_mul(kvpq_vf a, kvpq_vf b) { return _mm512_mul_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_div(kvpq_vf a, kvpq_vf b) { return _mm512_div_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_fma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm512_fmadd_ps(a, b, c); }
KVPQ_INLINE kvpq_vf vf_fnma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm512_fnmadd_ps(a, b, c); }
KVPQ_INLINE kvpq_vf vf_max(kvpq_vf a, kvpq_vf b) { return _mm512_max_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_min(kvpq_vf a, kvpq_vf b) { return _mm512_min_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_round(kvpq_vf a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
KVPQ_INLINE float vf_first(kvpq_vf v) { return _mm512_cvtss_f32(v); }
/* lane i + lane i + 8, as an AVX2-width vector: the first step of the halving tree */
KVPQ_INLINE __m256 vf__half_add(kvpq_vf v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
KVPQ_INLINE __m256 vf__half_max(kvpq_vf v) {
    return _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}
/* fp16 / bf16 / integer loads of W elements, converted exactly */
KVPQ_INLINE kvpq_vf vf_load_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
KVPQ_INLINE void vf_store_f16(uint16_t *p, kvpq_vf v) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
KVPQ_INLINE kvpq_vf vf_load_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
KVPQ_INLINE __m128i vf__bytes(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
KVPQ_INLINE kvpq_vf vf__from_u8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
KVPQ_INLINE kvpq_vf vf__from_i8(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
/* integer lanes and masks */
KVPQ_INLINE kvpq_vi vi_set1(int32_t x) { return _mm512_set1_epi32(x); }
KVPQ_INLINE kvpq_vi vi_iota(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
KVPQ_INLINE kvpq_vi vi_add(kvpq_vi a, kvpq_vi b) { return _mm512_add_epi32(a, b); }
KVPQ_INLINE void vi_store(int32_t *p, kvpq_vi v) { _mm512_storeu_si512((void *)p, v); }
/* Lanes in [-128, 127] to W bytes (saturating). */
KVPQ_INLINE void vi_store_i8(int8_t *p, kvpq_vi v) { _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(v)); }
KVPQ_INLINE kvpq_vf vf_from_vi(kvpq_vi v) { return _mm512_cvtepi32_ps(v); }
KVPQ_INLINE kvpq_vi vi_from_vf(kvpq_vf v) { return _mm512_cvtps_epi32(v); }
KVPQ_INLINE kvpq_vi vi_shl(kvpq_vi v, int s) { return _mm512_slli_epi32(v, (unsigned)s); }
KVPQ_INLINE kvpq_vf vf_from_bits(kvpq_vi v) { return _mm512_castsi512_ps(v); }
KVPQ_INLINE kvpq_vm vf_lt(kvpq_vf a, kvpq_vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
/* m ? b : a, lane by lane */
KVPQ_INLINE kvpq_vf vf_blend(kvpq_vf a, kvpq_vf b, kvpq_vm m) { return _mm512_mask_mov_ps(a, m, b); }
KVPQ_INLINE kvpq_vi vi_blend(kvpq_vi a, kvpq_vi b, kvpq_vm m) { return _mm512_mask_mov_epi32(a, m, b); }
/* The lowest of idx's lanes among the lanes where v holds its minimum (an argmin's tie-break). */
KVPQ_INLINE int32_t vf_argmin_lowest(kvpq_vf v, kvpq_vi idx) {
    float m = _mm512_reduce_min_ps(v);
    return _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ), idx);
}

#elif defined(KVPQ_ISA_AVX2)
// ---- AVX2 + FMA + F16C: 8 lanes ---------------------------------------------------------------------
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "KVPQ_ISA_AVX2: compile this file with -mavx2 -mfma -mf16c"
#endif
#include <immintrin.h>
#define KVPQ_VW 8
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, avx2)
#define KVPQ_ISA_NAME "avx2"
typedef __m256 kvpq_vf;
typedef __m256i kvpq_vi;
typedef __m256 kvpq_vm; /* all-ones lanes where true */

KVPQ_INLINE kvpq_vf vf_zero(void) { return _mm256_setzero_ps(); }
KVPQ_INLINE kvpq_vf vf_set1(float x) { return _mm256_set1_ps(x); }
KVPQ_INLINE kvpq_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
KVPQ_INLINE void vf_store(float *p, kvpq_vf v) { _mm256_storeu_ps(p, v); }
KVPQ_INLINE __m256i vm__first(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
KVPQ_INLINE kvpq_vm vm_first(int n) { return _mm256_castsi256_ps(vm__first(n)); }
KVPQ_INLINE kvpq_vf vf_load_n(const float *p, int n) { return _mm256_maskload_ps(p, vm__first(n)); }
KVPQ_INLINE void vf_store_n(float *p, kvpq_vf v, int n) { _mm256_maskstore_ps(p, vm__first(n), v); }
KVPQ_INLINE kvpq_vf vf_add(kvpq_vf a, kvpq_vf b) { return _mm256_add_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_sub(kvpq_vf a, kvpq_vf b) { return _mm256_sub_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_mul(kvpq_vf a, kvpq_vf b) { return _mm256_mul_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_div(kvpq_vf a, kvpq_vf b) { return _mm256_div_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_fma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm256_fmadd_ps(a, b, c); }
KVPQ_INLINE kvpq_vf vf_fnma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return _mm256_fnmadd_ps(a, b, c); }
KVPQ_INLINE kvpq_vf vf_max(kvpq_vf a, kvpq_vf b) { return _mm256_max_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_min(kvpq_vf a, kvpq_vf b) { return _mm256_min_ps(a, b); }
KVPQ_INLINE kvpq_vf vf_round(kvpq_vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
KVPQ_INLINE float vf_first(kvpq_vf v) { return _mm256_cvtss_f32(v); }
KVPQ_INLINE __m256 vf__half_add(kvpq_vf v) { return v; }
KVPQ_INLINE __m256 vf__half_max(kvpq_vf v) { return v; }
KVPQ_INLINE kvpq_vf vf_load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
KVPQ_INLINE void vf_store_f16(uint16_t *p, kvpq_vf v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
KVPQ_INLINE kvpq_vf vf_load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
KVPQ_INLINE __m128i vf__bytes(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
KVPQ_INLINE kvpq_vf vf__from_u8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); }
KVPQ_INLINE kvpq_vf vf__from_i8(__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)); }
KVPQ_INLINE kvpq_vi vi_set1(int32_t x) { return _mm256_set1_epi32(x); }
KVPQ_INLINE kvpq_vi vi_iota(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
KVPQ_INLINE kvpq_vi vi_add(kvpq_vi a, kvpq_vi b) { return _mm256_add_epi32(a, b); }
KVPQ_INLINE void vi_store(int32_t *p, kvpq_vi v) { _mm256_storeu_si256((__m256i *)p, v); }
KVPQ_INLINE void vi_store_i8(int8_t *p, kvpq_vi v) {
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm_storel_epi64((__m128i *)p, _mm_packs_epi16(w, w));
}
KVPQ_INLINE kvpq_vf vf_from_vi(kvpq_vi v) { return _mm256_cvtepi32_ps(v); }
KVPQ_INLINE kvpq_vi vi_from_vf(kvpq_vf v) { return _mm256_cvtps_epi32(v); }
KVPQ_INLINE kvpq_vi vi_shl(kvpq_vi v, int s) { return _mm256_slli_epi32(v, s); }
KVPQ_INLINE kvpq_vf vf_from_bits(kvpq_vi v) { return _mm256_castsi256_ps(v); }
KVPQ_INLINE kvpq_vm vf_lt(kvpq_vf a, kvpq_vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
KVPQ_INLINE kvpq_vf vf_blend(kvpq_vf a, kvpq_vf b, kvpq_vm m) { return _mm256_blendv_ps(a, b, m); }
KVPQ_INLINE kvpq_vi vi_blend(kvpq_vi a, kvpq_vi b, kvpq_vm m) {
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), m));
}
KVPQ_INLINE int32_t vf_argmin_lowest(kvpq_vf v, kvpq_vi idx) {
    float bv[8];
    int32_t bi[8];
    _mm256_storeu_ps(bv, v);
    _mm256_storeu_si256((__m256i *)bi, idx);
    float m = bv[0];
    int32_t r = bi[0];
    for (int l = 1; l < 8; l++)
        if (bv[l] < m || (bv[l] == m && bi[l] < r)) m = bv[l], r = bi[l];
    return r;
}

#else
// ---- scalar: 1 lane ---------------------------------------------------------------------------------
#define KVPQ_VW 1
#define KVPQ_ISA_FN(name) KVPQ_CAT(name, scalar)
#define KVPQ_ISA_NAME "scalar"
typedef float kvpq_vf;
typedef int32_t kvpq_vi;
typedef int kvpq_vm;

KVPQ_INLINE kvpq_vf vf_zero(void) { return 0.0f; }
KVPQ_INLINE kvpq_vf vf_set1(float x) { return x; }
KVPQ_INLINE kvpq_vf vf_load(const float *p) { return *p; }
KVPQ_INLINE void vf_store(float *p, kvpq_vf v) { *p = v; }
KVPQ_INLINE kvpq_vm vm_first(int n) { return n > 0; }
KVPQ_INLINE kvpq_vf vf_load_n(const float *p, int n) { return n > 0 ? *p : 0.0f; }
KVPQ_INLINE void vf_store_n(float *p, kvpq_vf v, int n) {
    if (n > 0) *p = v;
}
KVPQ_INLINE kvpq_vf vf_add(kvpq_vf a, kvpq_vf b) { return a + b; }
KVPQ_INLINE kvpq_vf vf_sub(kvpq_vf a, kvpq_vf b) { return a - b; }
KVPQ_INLINE kvpq_vf vf_mul(kvpq_vf a, kvpq_vf b) { return a * b; }
KVPQ_INLINE kvpq_vf vf_div(kvpq_vf a, kvpq_vf b) { return a / b; }
KVPQ_INLINE kvpq_vf vf_fma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return fmaf(a, b, c); }
KVPQ_INLINE kvpq_vf vf_fnma(kvpq_vf a, kvpq_vf b, kvpq_vf c) { return fmaf(-a, b, c); }
KVPQ_INLINE kvpq_vf vf_max(kvpq_vf a, kvpq_vf b) { return a > b ? a : b; }
KVPQ_INLINE kvpq_vf vf_min(kvpq_vf a, kvpq_vf b) { return a < b ? a : b; }
KVPQ_INLINE kvpq_vf vf_round(kvpq_vf a) { return nearbyintf(a); }
KVPQ_INLINE float vf_first(kvpq_vf v) { return v; }
/* (memcpy: ggml rows of halves may start at an odd address) */
KVPQ_INLINE kvpq_vf vf_load_f16(const uint16_t *p) { return kvpq__h2f_at(p); }
KVPQ_INLINE void vf_store_f16(uint16_t *p, kvpq_vf v) { *p = kvpq__f2h(v); }
KVPQ_INLINE kvpq_vf vf_load_bf16(const uint16_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return kvpq__bf2f(h);
}
KVPQ_INLINE kvpq_vi vi_set1(int32_t x) { return x; }
KVPQ_INLINE kvpq_vi vi_iota(void) { return 0; }
KVPQ_INLINE kvpq_vi vi_add(kvpq_vi a, kvpq_vi b) { return (int32_t)((uint32_t)a + (uint32_t)b); }
KVPQ_INLINE void vi_store(int32_t *p, kvpq_vi v) { *p = v; }
KVPQ_INLINE void vi_store_i8(int8_t *p, kvpq_vi v) { *p = (int8_t)(v < -128 ? -128 : v > 127 ? 127 : v); }
KVPQ_INLINE kvpq_vf vf_from_vi(kvpq_vi v) { return (float)v; }
KVPQ_INLINE kvpq_vi vi_from_vf(kvpq_vf v) { return (int32_t)nearbyintf(v); }
KVPQ_INLINE kvpq_vi vi_shl(kvpq_vi v, int s) { return (int32_t)((uint32_t)v << s); }
KVPQ_INLINE kvpq_vf vf_from_bits(kvpq_vi v) {
    float f;
    memcpy(&f, &v, sizeof f);
    return f;
}
KVPQ_INLINE kvpq_vm vf_lt(kvpq_vf a, kvpq_vf b) { return a < b; }
KVPQ_INLINE kvpq_vf vf_blend(kvpq_vf a, kvpq_vf b, kvpq_vm m) { return m ? b : a; }
KVPQ_INLINE kvpq_vi vi_blend(kvpq_vi a, kvpq_vi b, kvpq_vm m) { return m ? b : a; }
KVPQ_INLINE int32_t vf_argmin_lowest(kvpq_vf v, kvpq_vi idx) { return idx; }
#endif

// ---- derived operations, written once for every width -----------------------------------------------

#if KVPQ_VW > 1
/* Horizontal sum in the halving tree: (l0+l4)+(l2+l6) + (l1+l5)+(l3+l7) at W = 8, the 16 lanes first
 * folded to 8 at W = 16 (the same tree as _mm512_reduce_add_ps). */
KVPQ_INLINE float vf_reduce_add(kvpq_vf v) {
    __m256 h = vf__half_add(v);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
KVPQ_INLINE float vf_reduce_max(kvpq_vf v) {
    __m256 h = vf__half_max(v);
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* W unsigned / signed bytes, the low or high nibbles of W bytes, as floats (exact). */
KVPQ_INLINE kvpq_vf vf_load_u8(const uint8_t *p) { return vf__from_u8(vf__bytes(p)); }
KVPQ_INLINE kvpq_vf vf_load_i8(const int8_t *p) { return vf__from_i8(vf__bytes((const uint8_t *)p)); }
/* The 8 bytes of v (little-endian, byte j in lane j) as floats, lanes from 8 on zero: built in
 * registers, for bytes just computed (a vector load of bytes stored one word at a time would stall
 * on store forwarding). */
KVPQ_INLINE kvpq_vf vf_from_u8x8(uint64_t v) { return vf__from_u8(_mm_cvtsi64_si128((long long)v)); }
KVPQ_INLINE kvpq_vf vf_load_u4lo(const uint8_t *p) {
    return vf__from_u8(_mm_and_si128(vf__bytes(p), _mm_set1_epi8(0x0f)));
}
KVPQ_INLINE kvpq_vf vf_load_u4hi(const uint8_t *p) {
    return vf__from_u8(_mm_and_si128(_mm_srli_epi16(vf__bytes(p), 4), _mm_set1_epi8(0x0f)));
}
/* {sum a0, sum a1, sum a2, sum a3} into out[0..4): one horizontal-add tree for four dot products
 * (at W = 16 each vector is first folded to 8 lanes, lane i + lane i + 8). */
KVPQ_INLINE void vf_reduce4(kvpq_vf a0, kvpq_vf a1, kvpq_vf a2, kvpq_vf a3, float *out) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(vf__half_add(a0), vf__half_add(a1)),
                              _mm256_hadd_ps(vf__half_add(a2), vf__half_add(a3)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
/* 32 codes of `bits` bits (2 or 4), packed LSB-first from p (4 * bits bytes), as 32 / W vectors of
 * their unsigned values in order. */
KVPQ_INLINE void vf_load_codes32(const uint8_t *p, int bits, kvpq_vf f[32 / KVPQ_VW]) {
    __m128i q0, q1; /* codes 0..15, 16..31 as bytes */
    if (bits == 4) {
        const __m128i m = _mm_set1_epi8(0x0f);
        __m128i b = _mm_loadu_si128((const __m128i *)p);
        __m128i l = _mm_and_si128(b, m), h = _mm_and_si128(_mm_srli_epi16(b, 4), m);
        q0 = _mm_unpacklo_epi8(l, h);
        q1 = _mm_unpackhi_epi8(l, h);
    } else {
        const __m128i m = _mm_set1_epi8(0x03);
        __m128i b = _mm_loadl_epi64((const __m128i *)p);
        __m128i p0 = _mm_and_si128(b, m), p1 = _mm_and_si128(_mm_srli_epi16(b, 2), m);
        __m128i p2 = _mm_and_si128(_mm_srli_epi16(b, 4), m), p3 = _mm_and_si128(_mm_srli_epi16(b, 6), m);
        __m128i u01 = _mm_unpacklo_epi8(p0, p1), u23 = _mm_unpacklo_epi8(p2, p3);
        q0 = _mm_unpacklo_epi16(u01, u23);
        q1 = _mm_unpackhi_epi16(u01, u23);
    }
#if KVPQ_VW == 16
    f[0] = vf__from_u8(q0);
    f[1] = vf__from_u8(q1);
#else
    f[0] = vf__from_u8(q0);
    f[1] = vf__from_u8(_mm_srli_si128(q0, 8));
    f[2] = vf__from_u8(q1);
    f[3] = vf__from_u8(_mm_srli_si128(q1, 8));
#endif
}
/* One half <-> float by F16C (exact; RNE like vcvtps2ph): the scalar tails of vector loops. */
KVPQ_INLINE float vs_h2f(uint16_t h) { return _cvtsh_ss(h); }
KVPQ_INLINE uint16_t vs_f2h(float x) { return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* One half at an unaligned address, converted by F16C (the scales of quantized blocks). */
KVPQ_INLINE float vs_h2f_at(const void *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return _cvtsh_ss(h);
}
/* 32 bytes (lo: elements 0..15, hi: 16..31) as 32 / W vectors of their unsigned values. */
KVPQ_INLINE void vf__u8x32(__m128i lo, __m128i hi, kvpq_vf f[32 / KVPQ_VW]) {
#if KVPQ_VW == 16
    f[0] = vf__from_u8(lo);
    f[1] = vf__from_u8(hi);
#else
    f[0] = vf__from_u8(lo);
    f[1] = vf__from_u8(_mm_srli_si128(lo, 8));
    f[2] = vf__from_u8(hi);
    f[3] = vf__from_u8(_mm_srli_si128(hi, 8));
#endif
}
/* 16 bytes of nibbles -> 32 values (elements 0..15 the low nibbles of bytes 0..15, 16..31 the high
 * ones; ggml's Q4 order) as 32 / W vectors. One 16-byte load, unpacked in registers. */
KVPQ_INLINE void vf_load_nibbles32(const uint8_t *p, kvpq_vf f[32 / KVPQ_VW]) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    vf__u8x32(_mm_and_si128(q, m4), _mm_and_si128(_mm_srli_epi16(q, 4), m4), f);
}
/* A Q5 block's 32 unsigned values 0..31 (ggml's Q5_0 / Q5_1 order): element j < 16 is the low nibble
 * of qs[j] plus 16 * bit j of qh, element j + 16 the high nibble of qs[j] plus 16 * bit j + 16. The
 * fifth bits become bytes 0x10 / 0 in registers: a mask register at AVX-512 (BW, VL); at AVX2 byte j
 * takes byte j / 8 of qh (pshufb), keeps bit j % 8 and compares it with that bit. As bytes, elements
 * 0..15 in *lo and 16..31 in *hi: */
KVPQ_INLINE void vq5__bytes(const uint8_t *qs, uint32_t qh, __m128i *lo, __m128i *hi) {
    const __m128i m4 = _mm_set1_epi8(0x0f), x10 = _mm_set1_epi8(0x10);
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
#if KVPQ_VW == 16
    __m128i h0 = _mm_maskz_mov_epi8((__mmask16)qh, x10), h1 = _mm_maskz_mov_epi8((__mmask16)(qh >> 16), x10);
#else
    const __m128i bit = _mm_set1_epi64x((long long)0x8040201008040201ull);
    __m128i b = _mm_cvtsi32_si128((int)qh);
    __m128i b0 = _mm_shuffle_epi8(b, _mm_set_epi64x(0x0101010101010101ll, 0)),
            b1 = _mm_shuffle_epi8(b, _mm_set_epi64x(0x0303030303030303ll, 0x0202020202020202ll));
    __m128i h0 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b0, bit), bit), x10),
            h1 = _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b1, bit), bit), x10);
#endif
    *lo = _mm_or_si128(_mm_and_si128(q, m4), h0);
    *hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(q, 4), m4), h1);
}
/* ... and as 32 / W float vectors. */
KVPQ_INLINE void vf_load_q5_32(const uint8_t *qs, uint32_t qh, kvpq_vf f[32 / KVPQ_VW]) {
    __m128i lo, hi;
    vq5__bytes(qs, qh, &lo, &hi);
    vf__u8x32(lo, hi, f);
}

/* ---- 8-bit integer dot products (the integer-activation kernels of ggml_body.h) ----------------------
 * kvpq_vb: one 32-element block of 8-bit values, 32 bytes, at both x86 widths (the AVX-512 build
 * gets the same 256-bit forms, EVEX-encoded with 32 registers: a 64-byte vector would hold two
 * blocks whose activation scales differ). Their dot products come out as kvpq_vi8 (8 int32 lanes,
 * lane i the sum over bytes 4i .. 4i+3), converted exactly to kvpq_vf8 (8 float lanes). No scalar
 * (W = 1) form: the scalar specification of these kernels is model/ggml_types.c's _ref. */
typedef __m256i kvpq_vb;
typedef __m256i kvpq_vi8;
typedef __m256 kvpq_vf8;
KVPQ_INLINE kvpq_vb vb_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
KVPQ_INLINE kvpq_vb vb_set1(int8_t x) { return _mm256_set1_epi8(x); }
KVPQ_INLINE kvpq_vb vb_and(kvpq_vb a, kvpq_vb b) { return _mm256_and_si256(a, b); }
KVPQ_INLINE kvpq_vb vb_or(kvpq_vb a, kvpq_vb b) { return _mm256_or_si256(a, b); }
/* Shifts of 16-bit lanes: bits cross from one byte into the next, so callers mask the result. */
KVPQ_INLINE kvpq_vb vb_shr(kvpq_vb v, int s) { return _mm256_srli_epi16(v, s); }
KVPQ_INLINE kvpq_vb vb_shl(kvpq_vb v, int s) { return _mm256_slli_epi16(v, s); }
/* Bits [s, s + bits) of every byte, as its value (0 .. 2^bits - 1). */
KVPQ_INLINE kvpq_vb vb_bits(kvpq_vb v, int s, int bits) { return vb_and(vb_shr(v, s), vb_set1((int8_t)((1 << bits) - 1))); }
/* 16 bytes of nibbles -> 32 values (low nibbles: elements 0..15, high: 16..31; ggml's Q4 order). */
KVPQ_INLINE kvpq_vb vb_nibbles32(const uint8_t *p) {
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}
/* A Q5 block's 32 values (vq5__bytes). */
KVPQ_INLINE kvpq_vb vb_q5_32(const uint8_t *qs, uint32_t qh) {
    __m128i lo, hi;
    vq5__bytes(qs, qh, &lo, &hi);
    return _mm256_set_m128i(hi, lo);
}
/* sum over each 4 bytes of u_j * s_j: u unsigned <= 128, s signed in [-127, 127], so the pair sums of
 * maddubs (<= 2 * 128 * 127 = 32512) never saturate and the result is exact (as VNNI's vpdpbusd,
 * used where the build has it). */
KVPQ_INLINE kvpq_vi8 vb_dot(kvpq_vb u, kvpq_vb s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
/* The same with each pair sum (bytes 2i, 2i + 1) weighted by int16 lane i of w (exact in int32 for
 * |w| <= 2^14). */
KVPQ_INLINE kvpq_vi8 vb_dot_w16(kvpq_vb u, kvpq_vb s, __m256i w) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), w);
}
/* A signed w's dot as an unsigned one: *w = |w| (-128 -> 128), *s = s * sign(w). */
KVPQ_INLINE void vb_sign_fold(kvpq_vb *w, kvpq_vb *s) {
    *s = _mm256_sign_epi8(*s, *w);
    *w = _mm256_abs_epi8(*w);
}
/* 16 signed bytes as 16 int16 lanes; lanes 2k, 2k + 1 summed in pairs after a product (madd). */
KVPQ_INLINE __m256i vw_from_i8x16(const int8_t *p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p)); }
KVPQ_INLINE __m256i vw_load(const int16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
KVPQ_INLINE kvpq_vi8 vw_madd(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
/* From 16 int16 lanes w: lanes 0..7 = w[2k], lanes 8..15 = w[2k + 1] (the weights of a 32-byte
 * block's two 16-byte halves in vb_dot_w16). */
KVPQ_INLINE __m256i vw_pair(__m256i w, int k) {
    __m256i p = _mm256_permutevar8x32_epi32(w, _mm256_set1_epi32(k));
    return _mm256_shuffle_epi8(p, _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2,
                                                   3, 2, 3, 2, 3, 2, 3, 2, 3));
}
KVPQ_INLINE void vb_store(void *p, kvpq_vb v) { _mm256_storeu_si256((__m256i *)p, v); }
/* The integer GEMM's W-lane forms (ggml_body.h "integer GEMM"): lane r of a kvpq_vi holds 4 bytes
 * of weight row r. vi_dot4_add: s + (sum over each lane's 4 bytes of u (unsigned) times the 4 bytes
 * of x (signed), the same x in every lane): vpdpbusd where the build has it at this width
 * (KVPQ_VI_DPBUSD 1, exact for any u); else maddubs + madd, exact for u <= 128 (the pair sums stay
 * below 2^15). */
KVPQ_INLINE kvpq_vi vi_zero(void) { return vi_set1(0); }
#if KVPQ_VW == 16
KVPQ_INLINE kvpq_vi vi_load(const void *p) { return _mm512_loadu_si512(p); }
#if defined(__AVX512VNNI__)
#define KVPQ_VI_DPBUSD 1
KVPQ_INLINE kvpq_vi vi_dot4_add(kvpq_vi s, kvpq_vi u, int32_t x) { return _mm512_dpbusd_epi32(s, u, _mm512_set1_epi32(x)); }
#else
#define KVPQ_VI_DPBUSD 0
KVPQ_INLINE kvpq_vi vi_dot4_add(kvpq_vi s, kvpq_vi u, int32_t x) {
    return _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(u, _mm512_set1_epi32(x)), _mm512_set1_epi16(1)));
}
#endif
#else /* the AVX2 level (built without VNNI) */
KVPQ_INLINE kvpq_vi vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
#define KVPQ_VI_DPBUSD 0
KVPQ_INLINE kvpq_vi vi_dot4_add(kvpq_vi s, kvpq_vi u, int32_t x) {
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(x)), _mm256_set1_epi16(1)));
}
#endif
KVPQ_INLINE kvpq_vf8 v8_zero(void) { return _mm256_setzero_ps(); }
KVPQ_INLINE kvpq_vf8 v8_set1(float x) { return _mm256_set1_ps(x); }
KVPQ_INLINE kvpq_vf8 v8_load(const float *p) { return _mm256_loadu_ps(p); }
KVPQ_INLINE void v8_store(float *p, kvpq_vf8 v) { _mm256_storeu_ps(p, v); }
KVPQ_INLINE kvpq_vf8 v8_add(kvpq_vf8 a, kvpq_vf8 b) { return _mm256_add_ps(a, b); }
KVPQ_INLINE kvpq_vf8 v8_mul(kvpq_vf8 a, kvpq_vf8 b) { return _mm256_mul_ps(a, b); }
KVPQ_INLINE kvpq_vf8 v8_fma(kvpq_vf8 a, kvpq_vf8 b, kvpq_vf8 c) { return _mm256_fmadd_ps(a, b, c); }
KVPQ_INLINE kvpq_vf8 v8_from_vi(kvpq_vi8 v) { return _mm256_cvtepi32_ps(v); }
/* The 8 bytes of v (byte j in lane j) as floats. */
KVPQ_INLINE kvpq_vf8 v8_from_u8x8(uint64_t v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v))); }
/* The halving tree of vf_reduce_add. */
KVPQ_INLINE float v8_reduce_add(kvpq_vf8 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#else
KVPQ_INLINE void vf_reduce4(kvpq_vf a0, kvpq_vf a1, kvpq_vf a2, kvpq_vf a3, float *out) {
    out[0] = a0, out[1] = a1, out[2] = a2, out[3] = a3;
}
KVPQ_INLINE void vf_load_codes32(const uint8_t *p, int bits, kvpq_vf f[32]) {
    for (int c = 0; c < 32; c++) f[c] = (float)((p[c * bits / 8] >> (c * bits % 8)) & ((1 << bits) - 1));
}
KVPQ_INLINE float vs_h2f(uint16_t h) { return kvpq__h2f(h); }
KVPQ_INLINE uint16_t vs_f2h(float x) { return kvpq__f2h(x); }
KVPQ_INLINE float vs_h2f_at(const void *p) { return kvpq__h2f_at(p); }
KVPQ_INLINE void vf_load_nibbles32(const uint8_t *p, kvpq_vf f[32]) {
    for (int j = 0; j < 16; j++) {
        f[j] = (float)(p[j] & 0x0f);
        f[j + 16] = (float)(p[j] >> 4);
    }
}
KVPQ_INLINE void vf_load_q5_32(const uint8_t *qs, uint32_t qh, kvpq_vf f[32]) {
    for (int j = 0; j < 16; j++) {
        f[j] = (float)((qs[j] & 0x0f) | ((qh >> j) & 1) << 4);
        f[j + 16] = (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
    }
}
KVPQ_INLINE float vf_reduce_add(kvpq_vf v) { return v; }
KVPQ_INLINE float vf_reduce_max(kvpq_vf v) { return v; }
KVPQ_INLINE kvpq_vf vf_load_u8(const uint8_t *p) { return (float)*p; }
KVPQ_INLINE kvpq_vf vf_load_i8(const int8_t *p) { return (float)*p; }
KVPQ_INLINE kvpq_vf vf_from_u8x8(uint64_t v) { return (float)(v & 0xff); }
KVPQ_INLINE kvpq_vf vf_load_u4lo(const uint8_t *p) { return (float)(*p & 0x0f); }
KVPQ_INLINE kvpq_vf vf_load_u4hi(const uint8_t *p) { return (float)(*p >> 4); }
#endif

/* exp(x) for x <= 0, the polynomial above (the one vector exp of the CPU kernels). */
KVPQ_INLINE kvpq_vf vf_exp(kvpq_vf x) {
    x = vf_max(vf_set1(KVPQ_EXP_LO), x); /* this operand order keeps NaN (maxps returns the second) */
    kvpq_vf n = vf_round(vf_mul(x, vf_set1(KVPQ_EXP_LOG2E)));
    kvpq_vf r = vf_fnma(n, vf_set1(KVPQ_EXP_LN2_HI), x);
    r = vf_fnma(n, vf_set1(KVPQ_EXP_LN2_LO), r);
    kvpq_vf y = vf_set1(KVPQ_EXP_P0);
    y = vf_fma(y, r, vf_set1(KVPQ_EXP_P1));
    y = vf_fma(y, r, vf_set1(KVPQ_EXP_P2));
    y = vf_fma(y, r, vf_set1(KVPQ_EXP_P3));
    y = vf_fma(y, r, vf_set1(KVPQ_EXP_P4));
    y = vf_fma(y, r, vf_set1(KVPQ_EXP_P5));
    y = vf_fma(y, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    kvpq_vi e = vi_shl(vi_add(vi_from_vf(n), vi_set1(127)), 23);
    return vf_mul(y, vf_from_bits(e));
}

/* The logistic function 1 / (1 + exp(-z)) through vf_exp of -|z| <= 0 (no overflow either way):
 * t = exp(-|z|), r = 1 / (1 + t); z >= 0 gives r, z < 0 gives t * r. Relative error a few ulp. */
KVPQ_INLINE kvpq_vf vf_sigmoid(kvpq_vf z) {
    kvpq_vf t = vf_exp(vf_min(z, vf_sub(vf_zero(), z)));
    kvpq_vf r = vf_div(vf_set1(1.0f), vf_add(vf_set1(1.0f), t));
    return vf_blend(r, vf_mul(t, r), vf_lt(z, vf_zero()));
}

/* dot(a, b) over n float32: four accumulators over 4W-element steps, then W-element steps into
 * the first, then a masked tail into the second; the sum (s0 + s1) + (s2 + s3) reduced by the tree. */
KVPQ_INLINE float vf_dot(const float *a, const float *b, int64_t n) {
    kvpq_vf s0 = vf_zero(), s1 = vf_zero(), s2 = vf_zero(), s3 = vf_zero();
    int64_t i = 0;
    for (; i + 4 * KVPQ_VW <= n; i += 4 * KVPQ_VW) {
        s0 = vf_fma(vf_load(a + i), vf_load(b + i), s0);
        s1 = vf_fma(vf_load(a + i + KVPQ_VW), vf_load(b + i + KVPQ_VW), s1);
        s2 = vf_fma(vf_load(a + i + 2 * KVPQ_VW), vf_load(b + i + 2 * KVPQ_VW), s2);
        s3 = vf_fma(vf_load(a + i + 3 * KVPQ_VW), vf_load(b + i + 3 * KVPQ_VW), s3);
    }
    for (; i + KVPQ_VW <= n; i += KVPQ_VW) s0 = vf_fma(vf_load(a + i), vf_load(b + i), s0);
    if (i < n) s1 = vf_fma(vf_load_n(a + i, (int)(n - i)), vf_load_n(b + i, (int)(n - i)), s1);
    return vf_reduce_add(vf_add(vf_add(s0, s1), vf_add(s2, s3)));
}

#endif
