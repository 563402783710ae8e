/* vq_avx512.c — AVX-512 kernels of attention from PQ codes (see vq_kernels.h; *_ref is the spec).
 * Groups of 16 query heads per KV head (gp a multiple of 16) load a table row as one zmm; narrower
 * groups are served by the AVX2 kernels (a 4- or 8-float row gains nothing from wider registers). */
#if defined(__x86_64__)
#include <immintrin.h>

#include "cpu/vq_kernels.h"

#define VQ_SCORE_AVX512(NAME, T, FALLBACK)                                                        \
    static void NAME(int n, int M, int ksub, int gp, const T *codes, const float *lut, float *s) { \
        if (gp % 16) {                                                                            \
            FALLBACK(n, M, ksub, gp, codes, lut, s);                                              \
            return;                                                                               \
        }                                                                                         \
        const size_t ms = (size_t)ksub * gp;                                                      \
        for (int t = 0; t < n; t++) {                                                             \
            const T *c = codes + (size_t)t * M;                                                   \
            for (int b = 0; b < gp; b += 16) {                                                    \
                __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                        \
                int m = 0;                                                                        \
                for (; m + 1 < M; m += 2) {                                                       \
                    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(lut + m * ms + (size_t)c[m] * gp + b)); \
                    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(lut + (m + 1) * ms + (size_t)c[m + 1] * gp + b)); \
                }                                                                                 \
                if (m < M) a0 = _mm512_add_ps(a0, _mm512_loadu_ps(lut + m * ms + (size_t)c[m] * gp + b)); \
                _mm512_storeu_ps(s + (size_t)t * gp + b, _mm512_add_ps(a0, a1));                  \
            }                                                                                     \
        }                                                                                         \
    }
VQ_SCORE_AVX512(score_u8_avx512, uint8_t, kvpq__vq_score_u8_avx2)
VQ_SCORE_AVX512(score_u16_avx512, uint16_t, kvpq__vq_score_u16_avx2)

#define VQ_ACCUM_AVX512(NAME, T, FALLBACK)                                                        \
    static void NAME(int n, int M, int ksub, int gp, const T *codes, const float *p, float *table) { \
        if (gp % 16) {                                                                            \
            FALLBACK(n, M, ksub, gp, codes, p, table);                                            \
            return;                                                                               \
        }                                                                                         \
        const size_t ms = (size_t)ksub * gp;                                                      \
        for (int t = 0; t < n; t++) {                                                             \
            const T *c = codes + (size_t)t * M;                                                   \
            for (int b = 0; b < gp; b += 16) {                                                    \
                const __m512 pv = _mm512_loadu_ps(p + (size_t)t * gp + b);                        \
                for (int m = 0; m < M; m++) {                                                     \
                    float *row = table + m * ms + (size_t)c[m] * gp + b;                          \
                    _mm512_storeu_ps(row, _mm512_add_ps(_mm512_loadu_ps(row), pv));               \
                }                                                                                 \
            }                                                                                     \
        }                                                                                         \
    }
VQ_ACCUM_AVX512(accum_u8_avx512, uint8_t, kvpq__vq_accum_u8_avx2)
VQ_ACCUM_AVX512(accum_u16_avx512, uint16_t, kvpq__vq_accum_u16_avx2)

void kvpq__vq_kernels_avx512(kvpq_vq_kernels *k) {
    k->score_u8 = score_u8_avx512;
    k->score_u16 = score_u16_avx512;
    k->accum_u8 = accum_u8_avx512;
    k->accum_u16 = accum_u16_avx512;
}
#endif
