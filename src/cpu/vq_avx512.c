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

// ---- LUT build and value output for gp = 4, dsub = 4 (d4b8 with GQA groups of 2..4) ---------------

/* Four centroids (16 floats) fill one zmm; the j-th coordinate of each is broadcast within its
 * 128-bit lane by an in-lane permute, so one FMA serves 4 centroids x 4 heads. */
static void lut_build_avx512(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                             float *lut) {
    if (gp != 4 || dsub != 4 || ksub % 4) {
        kvpq__vq_lut_build_avx2(M, ksub, dsub, n_books, cent, gp, qt, lut);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * 4, *q = qt + (size_t)m * 16;
        const __m512 q0 = _mm512_broadcast_f32x4(_mm_loadu_ps(q)), q1 = _mm512_broadcast_f32x4(_mm_loadu_ps(q + 4));
        const __m512 q2 = _mm512_broadcast_f32x4(_mm_loadu_ps(q + 8)), q3 = _mm512_broadcast_f32x4(_mm_loadu_ps(q + 12));
        float *out = lut + (size_t)m * ksub * 4;
        for (int c = 0; c < ksub; c += 4) {
            const __m512 cb = _mm512_loadu_ps(book + (size_t)c * 4);
            __m512 a = _mm512_mul_ps(_mm512_permute_ps(cb, 0x00), q0);
            a = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0x55), q1, a);
            a = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0xAA), q2, a);
            a = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0xFF), q3, a);
            _mm512_storeu_ps(out + (size_t)c * 4, a);
        }
    }
}

static void table_out_avx512(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                             float *out) {
    if (gp != 4 || dsub != 4 || ksub % 4) {
        kvpq__vq_table_out_avx2(M, ksub, dsub, n_books, cent, gp, table, out);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * 4;
        const float *tm = table + (size_t)m * ksub * 4;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int c = 0; c < ksub; c += 4) {
            const __m512 cb = _mm512_loadu_ps(book + (size_t)c * 4), w = _mm512_loadu_ps(tm + (size_t)c * 4);
            a0 = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0x00), w, a0);
            a1 = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0x55), w, a1);
            a2 = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0xAA), w, a2);
            a3 = _mm512_fmadd_ps(_mm512_permute_ps(cb, 0xFF), w, a3);
        }
        /* Sum the four 128-bit lanes (4 centroid phases) of each accumulator: out[m][j][g]. */
        const __m512 acc[4] = {a0, a1, a2, a3};
        for (int j = 0; j < 4; j++) {
            __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc[j]),
                                     _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j]), 1)));
            __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(out + (size_t)m * 16 + j * 4, r);
        }
    }
}

void kvpq__vq_kernels_avx512(kvpq_vq_kernels *k) {
    k->lut_build = lut_build_avx512;
    k->table_out = table_out_avx512;
    k->score_u8 = score_u8_avx512;
    k->score_u16 = score_u16_avx512;
    k->accum_u8 = accum_u8_avx512;
    k->accum_u16 = accum_u16_avx512;
}
#endif
