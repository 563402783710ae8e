/* vq_avx2.c — AVX2 kernels of attention from PQ codes (see vq_kernels.h; *_ref is the spec).
 *
 * A table row of a GQA group (gp = 4 or 8 heads' values for one (m, c)) is one 128- or 256-bit
 * load, so one code is read once for the whole group and each (token, m) costs one vector load
 * and one add. Lanes that are not 4 / 8 / a multiple of 8 fall back to the reference. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "cpu/vq_kernels.h"

// ---- exp ------------------------------------------------------------------------------------

/* exp(x) for x <= 0 (softmax arguments): x = k ln2 + r, |r| <= ln2/2, degree-6 Taylor of e^r
 * (relative error < 2e-7), then scaled by 2^k through the exponent bits. Below -87 the result
 * flushes to about 1e-38, far under what a softmax weight can contribute. NaN stays NaN (max / min
 * return their second operand when one is NaN). */
static inline __m256 exp256_ps(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ---- scores and accumulation ----------------------------------------------------------------

#define VQ_SCORE_AVX2(NAME, T, REF)                                                               \
    LINKAGE void NAME(int n, int M, int ksub, int gp, const T *codes, const float *lut, float *s) {       \
        const size_t ms = (size_t)ksub * gp; /* stride between sub-spaces */                      \
        if (gp == 4) {                                                                            \
            for (int t = 0; t < n; t++) {                                                         \
                const T *c = codes + (size_t)t * M;                                               \
                __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();                              \
                const float *L = lut;                                                             \
                int m = 0;                                                                        \
                for (; m + 1 < M; m += 2, L += 2 * ms) {                                          \
                    a0 = _mm_add_ps(a0, _mm_loadu_ps(L + (size_t)c[m] * 4));                      \
                    a1 = _mm_add_ps(a1, _mm_loadu_ps(L + ms + (size_t)c[m + 1] * 4));             \
                }                                                                                 \
                if (m < M) a0 = _mm_add_ps(a0, _mm_loadu_ps(L + (size_t)c[m] * 4));               \
                _mm_storeu_ps(s + (size_t)t * 4, _mm_add_ps(a0, a1));                             \
            }                                                                                     \
        } else if (gp == 8) {                                                                     \
            for (int t = 0; t < n; t++) {                                                         \
                const T *c = codes + (size_t)t * M;                                               \
                __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();                        \
                const float *L = lut;                                                             \
                int m = 0;                                                                        \
                for (; m + 1 < M; m += 2, L += 2 * ms) {                                          \
                    a0 = _mm256_add_ps(a0, _mm256_loadu_ps(L + (size_t)c[m] * 8));                \
                    a1 = _mm256_add_ps(a1, _mm256_loadu_ps(L + ms + (size_t)c[m + 1] * 8));       \
                }                                                                                 \
                if (m < M) a0 = _mm256_add_ps(a0, _mm256_loadu_ps(L + (size_t)c[m] * 8));         \
                _mm256_storeu_ps(s + (size_t)t * 8, _mm256_add_ps(a0, a1));                       \
            }                                                                                     \
        } else if (gp % 8 == 0) {                                                                 \
            for (int t = 0; t < n; t++) {                                                         \
                const T *c = codes + (size_t)t * M;                                               \
                for (int b = 0; b < gp; b += 8) {                                                 \
                    __m256 a0 = _mm256_setzero_ps();                                              \
                    for (int m = 0; m < M; m++)                                                   \
                        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(lut + m * ms + (size_t)c[m] * gp + b)); \
                    _mm256_storeu_ps(s + (size_t)t * gp + b, a0);                                 \
                }                                                                                 \
            }                                                                                     \
        } else {                                                                                  \
            REF(n, M, ksub, gp, codes, lut, s);                                                   \
        }                                                                                         \
    }
#define LINKAGE static
VQ_SCORE_AVX2(score_u8_generic, uint8_t, kvpq__vq_score_u8_ref)
#undef LINKAGE
#define LINKAGE
VQ_SCORE_AVX2(kvpq__vq_score_u16_avx2, uint16_t, kvpq__vq_score_u16_ref)

#define VQ_ACCUM_AVX2(NAME, T, REF)                                                               \
    LINKAGE void NAME(int n, int M, int ksub, int gp, const T *codes, const float *p, float *table) {     \
        const size_t ms = (size_t)ksub * gp;                                                      \
        if (gp == 4) {                                                                            \
            for (int t = 0; t < n; t++) {                                                         \
                const T *c = codes + (size_t)t * M;                                               \
                const __m128 pv = _mm_loadu_ps(p + (size_t)t * 4);                                \
                float *L = table;                                                                 \
                for (int m = 0; m < M; m++, L += ms) {                                            \
                    float *row = L + (size_t)c[m] * 4;                                            \
                    _mm_storeu_ps(row, _mm_add_ps(_mm_loadu_ps(row), pv));                        \
                }                                                                                 \
            }                                                                                     \
        } else if (gp % 8 == 0) {                                                                 \
            for (int t = 0; t < n; t++) {                                                         \
                const T *c = codes + (size_t)t * M;                                               \
                for (int b = 0; b < gp; b += 8) {                                                 \
                    const __m256 pv = _mm256_loadu_ps(p + (size_t)t * gp + b);                    \
                    for (int m = 0; m < M; m++) {                                                 \
                        float *row = table + m * ms + (size_t)c[m] * gp + b;                      \
                        _mm256_storeu_ps(row, _mm256_add_ps(_mm256_loadu_ps(row), pv));           \
                    }                                                                             \
                }                                                                                 \
            }                                                                                     \
        } else {                                                                                  \
            REF(n, M, ksub, gp, codes, p, table);                                                 \
        }                                                                                         \
    }
#undef LINKAGE
#define LINKAGE static
VQ_ACCUM_AVX2(accum_u8_generic, uint8_t, kvpq__vq_accum_u8_ref)
#undef LINKAGE
#define LINKAGE
VQ_ACCUM_AVX2(kvpq__vq_accum_u16_avx2, uint16_t, kvpq__vq_accum_u16_ref)

// ---- nbits = 8, gp = 4 or 8: sub-spaces in groups that stay in L1 -----------------------------------

/* A whole LUT or W table is (M, ksub, gp) floats: 64 KiB for M = 16, gp = 4, more than L1. Walking
 * the tokens of a chunk once per group of 4 sub-spaces keeps the group's slices (16 KiB for gp 4,
 * 32 KiB for gp 8) and the chunk's scores in L1; the scores are reloaded once per group. The four
 * codes of a group come in one 32-bit load. */
#define VQ_MG 4

static void score_u8_g4(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    const size_t ms = (size_t)ksub * 4;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        const float *L0 = lut + m0 * ms, *L1 = L0 + ms, *L2 = L1 + ms, *L3 = L2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            __m128 a = _mm_add_ps(_mm_loadu_ps(L0 + (size_t)(w & 0xff) * 4), _mm_loadu_ps(L1 + (size_t)(w >> 8 & 0xff) * 4));
            __m128 b = _mm_add_ps(_mm_loadu_ps(L2 + (size_t)(w >> 16 & 0xff) * 4), _mm_loadu_ps(L3 + (size_t)(w >> 24) * 4));
            a = _mm_add_ps(a, b);
            if (m0) a = _mm_add_ps(a, _mm_loadu_ps(s + (size_t)t * 4));
            _mm_storeu_ps(s + (size_t)t * 4, a);
        }
    }
    for (; m0 < M; m0++) {
        const float *L0 = lut + m0 * ms;
        for (int t = 0; t < n; t++) {
            __m128 a = _mm_loadu_ps(L0 + (size_t)codes[(size_t)t * M + m0] * 4);
            if (m0) a = _mm_add_ps(a, _mm_loadu_ps(s + (size_t)t * 4));
            _mm_storeu_ps(s + (size_t)t * 4, a);
        }
    }
}

static void score_u8_g8(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    const size_t ms = (size_t)ksub * 8;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        const float *L0 = lut + m0 * ms, *L1 = L0 + ms, *L2 = L1 + ms, *L3 = L2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            __m256 a = _mm256_add_ps(_mm256_loadu_ps(L0 + (size_t)(w & 0xff) * 8),
                                     _mm256_loadu_ps(L1 + (size_t)(w >> 8 & 0xff) * 8));
            __m256 b = _mm256_add_ps(_mm256_loadu_ps(L2 + (size_t)(w >> 16 & 0xff) * 8),
                                     _mm256_loadu_ps(L3 + (size_t)(w >> 24) * 8));
            a = _mm256_add_ps(a, b);
            if (m0) a = _mm256_add_ps(a, _mm256_loadu_ps(s + (size_t)t * 8));
            _mm256_storeu_ps(s + (size_t)t * 8, a);
        }
    }
    for (; m0 < M; m0++) {
        const float *L0 = lut + m0 * ms;
        for (int t = 0; t < n; t++) {
            __m256 a = _mm256_loadu_ps(L0 + (size_t)codes[(size_t)t * M + m0] * 8);
            if (m0) a = _mm256_add_ps(a, _mm256_loadu_ps(s + (size_t)t * 8));
            _mm256_storeu_ps(s + (size_t)t * 8, a);
        }
    }
}

static void accum_u8_g4(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    const size_t ms = (size_t)ksub * 4;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        float *T0 = table + m0 * ms, *T1 = T0 + ms, *T2 = T1 + ms, *T3 = T2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            const __m128 pv = _mm_loadu_ps(p + (size_t)t * 4);
            float *r0 = T0 + (size_t)(w & 0xff) * 4, *r1 = T1 + (size_t)(w >> 8 & 0xff) * 4;
            float *r2 = T2 + (size_t)(w >> 16 & 0xff) * 4, *r3 = T3 + (size_t)(w >> 24) * 4;
            _mm_storeu_ps(r0, _mm_add_ps(_mm_loadu_ps(r0), pv));
            _mm_storeu_ps(r1, _mm_add_ps(_mm_loadu_ps(r1), pv));
            _mm_storeu_ps(r2, _mm_add_ps(_mm_loadu_ps(r2), pv));
            _mm_storeu_ps(r3, _mm_add_ps(_mm_loadu_ps(r3), pv));
        }
    }
    for (; m0 < M; m0++) {
        float *T0 = table + m0 * ms;
        for (int t = 0; t < n; t++) {
            float *r0 = T0 + (size_t)codes[(size_t)t * M + m0] * 4;
            _mm_storeu_ps(r0, _mm_add_ps(_mm_loadu_ps(r0), _mm_loadu_ps(p + (size_t)t * 4)));
        }
    }
}

static void accum_u8_g8(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    const size_t ms = (size_t)ksub * 8;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        float *T0 = table + m0 * ms, *T1 = T0 + ms, *T2 = T1 + ms, *T3 = T2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            const __m256 pv = _mm256_loadu_ps(p + (size_t)t * 8);
            float *r0 = T0 + (size_t)(w & 0xff) * 8, *r1 = T1 + (size_t)(w >> 8 & 0xff) * 8;
            float *r2 = T2 + (size_t)(w >> 16 & 0xff) * 8, *r3 = T3 + (size_t)(w >> 24) * 8;
            _mm256_storeu_ps(r0, _mm256_add_ps(_mm256_loadu_ps(r0), pv));
            _mm256_storeu_ps(r1, _mm256_add_ps(_mm256_loadu_ps(r1), pv));
            _mm256_storeu_ps(r2, _mm256_add_ps(_mm256_loadu_ps(r2), pv));
            _mm256_storeu_ps(r3, _mm256_add_ps(_mm256_loadu_ps(r3), pv));
        }
    }
    for (; m0 < M; m0++) {
        float *T0 = table + m0 * ms;
        for (int t = 0; t < n; t++) {
            float *r0 = T0 + (size_t)codes[(size_t)t * M + m0] * 8;
            _mm256_storeu_ps(r0, _mm256_add_ps(_mm256_loadu_ps(r0), _mm256_loadu_ps(p + (size_t)t * 8)));
        }
    }
}

// ---- nbits = 8 with precomputed row offsets ----------------------------------------------------------

/* Peeling code bytes with shifts costs 2-3 ALU ops per (token, m). Instead, per block of 64 tokens,
 * one SIMD pass turns 16 codes at a time into 16-bit row offsets (m * ksub + c) * gp, and the table
 * loops then need one offset load and one row load per (token, m). Valid when M % 16 == 0, M <= 64
 * and M * ksub * gp <= 65536 (offsets fit 16 bits): d4b8 / d8b8 for head_dim 64..256. */
#define VQ_OB 64

static int offsets_ok(int M, int ksub, int gp) {
    return M % 16 == 0 && M <= 64 && (size_t)M * ksub * gp <= 65536;
}

static void make_offsets(int n, int M, int ksub, int lg, const uint8_t *codes, uint16_t *offs) {
    __m256i base[4];
    for (int b = 0; b < M / 16; b++) {
        __m256i m = _mm256_add_epi16(_mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                     _mm256_set1_epi16((short)(16 * b)));
        base[b] = _mm256_mullo_epi16(m, _mm256_set1_epi16((short)(ksub << lg)));
    }
    for (int t = 0; t < n; t++)
        for (int b = 0; b < M / 16; b++) {
            __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(codes + (size_t)t * M + 16 * b)));
            c = _mm256_add_epi16(_mm256_slli_epi16(c, lg), base[b]);
            _mm256_storeu_si256((__m256i *)(offs + (size_t)t * M + 16 * b), c);
        }
}

static void score_u8_off_g4(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, 2, codes + (size_t)t0 * M, offs);
        float *sb = s + (size_t)t0 * 4;
        /* 8 sub-spaces per pass: their LUT slices (32 KiB) still fit L1 with the scores. */
        for (int m0 = 0; m0 < M; m0 += 8)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                __m128 a = _mm_add_ps(_mm_loadu_ps(lut + o[0]), _mm_loadu_ps(lut + o[1]));
                __m128 b = _mm_add_ps(_mm_loadu_ps(lut + o[2]), _mm_loadu_ps(lut + o[3]));
                __m128 c = _mm_add_ps(_mm_loadu_ps(lut + o[4]), _mm_loadu_ps(lut + o[5]));
                __m128 e = _mm_add_ps(_mm_loadu_ps(lut + o[6]), _mm_loadu_ps(lut + o[7]));
                a = _mm_add_ps(_mm_add_ps(a, b), _mm_add_ps(c, e));
                if (m0) a = _mm_add_ps(a, _mm_loadu_ps(sb + (size_t)t * 4));
                _mm_storeu_ps(sb + (size_t)t * 4, a);
            }
    }
}

static void score_u8_off_g8(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, 3, codes + (size_t)t0 * M, offs);
        float *sb = s + (size_t)t0 * 8;
        for (int m0 = 0; m0 < M; m0 += 4)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                __m256 a = _mm256_add_ps(_mm256_loadu_ps(lut + o[0]), _mm256_loadu_ps(lut + o[1]));
                __m256 b = _mm256_add_ps(_mm256_loadu_ps(lut + o[2]), _mm256_loadu_ps(lut + o[3]));
                a = _mm256_add_ps(a, b);
                if (m0) a = _mm256_add_ps(a, _mm256_loadu_ps(sb + (size_t)t * 8));
                _mm256_storeu_ps(sb + (size_t)t * 8, a);
            }
    }
}

static void accum_u8_off_g4(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, 2, codes + (size_t)t0 * M, offs);
        const float *pb = p + (size_t)t0 * 4;
        for (int m0 = 0; m0 < M; m0 += 8)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                const __m128 pv = _mm_loadu_ps(pb + (size_t)t * 4);
                for (int u = 0; u < 8; u++) {
                    float *r = table + o[u];
                    _mm_storeu_ps(r, _mm_add_ps(_mm_loadu_ps(r), pv));
                }
            }
    }
}

static void accum_u8_off_g8(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, 3, codes + (size_t)t0 * M, offs);
        const float *pb = p + (size_t)t0 * 8;
        for (int m0 = 0; m0 < M; m0 += 4)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                const __m256 pv = _mm256_loadu_ps(pb + (size_t)t * 8);
                for (int u = 0; u < 4; u++) {
                    float *r = table + o[u];
                    _mm256_storeu_ps(r, _mm256_add_ps(_mm256_loadu_ps(r), pv));
                }
            }
    }
}

void kvpq__vq_score_u8_avx2(int n, int M, int ksub, int gp, const uint8_t *codes, const float *lut, float *s) {
    if (gp == 4 && offsets_ok(M, ksub, gp)) score_u8_off_g4(n, M, ksub, codes, lut, s);
    else if (gp == 8 && offsets_ok(M, ksub, gp)) score_u8_off_g8(n, M, ksub, codes, lut, s);
    else if (gp == 4) score_u8_g4(n, M, ksub, codes, lut, s);
    else if (gp == 8) score_u8_g8(n, M, ksub, codes, lut, s);
    else score_u8_generic(n, M, ksub, gp, codes, lut, s);
}

void kvpq__vq_accum_u8_avx2(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table) {
    if (gp == 4 && offsets_ok(M, ksub, gp)) accum_u8_off_g4(n, M, ksub, codes, p, table);
    else if (gp == 8 && offsets_ok(M, ksub, gp)) accum_u8_off_g8(n, M, ksub, codes, p, table);
    else if (gp == 4) accum_u8_g4(n, M, ksub, codes, p, table);
    else if (gp == 8) accum_u8_g8(n, M, ksub, codes, p, table);
    else accum_u8_generic(n, M, ksub, gp, codes, p, table);
}

// ---- online softmax step --------------------------------------------------------------------

#define GP_MAX 64 /* wider groups use the reference */

int kvpq__vq_softmax_step_avx2(int n, int gp, float *s, float *m, float *d, float *rescale) {
    if (gp > GP_MAX || !(8 % gp == 0 || gp % 8 == 0))
        return kvpq__vq_softmax_step_ref(n, gp, s, m, d, rescale);
    const size_t total = (size_t)n * gp;
    const int vw = gp < 8 ? 8 : gp; /* lanes of one pattern period, a multiple of 8 */
    float mx[GP_MAX + 8], pat[GP_MAX + 8], sum[GP_MAX + 8];
    /* Chunk maximum per lane: accumulate full periods of vw floats, then fold to gp lanes. */
    __m256 vmax[GP_MAX / 8];
    for (int b = 0; b < vw / 8; b++) vmax[b] = _mm256_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / 8; b++) vmax[b] = _mm256_max_ps(vmax[b], _mm256_loadu_ps(s + i + 8 * b));
    for (int b = 0; b < vw / 8; b++) _mm256_storeu_ps(pat + 8 * b, vmax[b]);
    for (int g = 0; g < gp; g++) mx[g] = -INFINITY;
    for (int l = 0; l < vw; l++) mx[l % gp] = fmaxf(mx[l % gp], pat[l]);
    for (size_t j = i; j < total; j++) mx[j % gp] = fmaxf(mx[j % gp], s[j]);
    int any = 0;
    for (int g = 0; g < gp; g++) {
        float m_new = fmaxf(m[g], mx[g]);
        rescale[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
        if (rescale[g] != 1.0f) any = 1;
        m[g] = m_new;
    }
    for (int l = 0; l < vw; l++) pat[l] = m[l % gp];
    __m256 vsum[GP_MAX / 8];
    for (int b = 0; b < vw / 8; b++) vsum[b] = _mm256_setzero_ps();
    for (i = 0; i + vw <= total; i += vw)
        for (int b = 0; b < vw / 8; b++) {
            __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i + 8 * b), _mm256_loadu_ps(pat + 8 * b)));
            _mm256_storeu_ps(s + i + 8 * b, e);
            vsum[b] = _mm256_add_ps(vsum[b], e);
        }
    float lanes[GP_MAX + 8];
    for (int b = 0; b < vw / 8; b++) _mm256_storeu_ps(lanes + 8 * b, vsum[b]);
    for (int g = 0; g < gp; g++) sum[g] = 0.0f;
    for (int l = 0; l < vw; l++) sum[l % gp] += lanes[l];
    for (size_t j = i; j < total; j++) {
        float e = expf(s[j] - m[j % gp]);
        s[j] = e;
        sum[j % gp] += e;
    }
    for (int g = 0; g < gp; g++) d[g] = d[g] * rescale[g] + sum[g];
    return any;
}

void kvpq__vq_exp_sum_avx2(int n, int gp, float *s, const float *m, float *sum) {
    if (gp > GP_MAX || !(8 % gp == 0 || gp % 8 == 0)) {
        kvpq__vq_exp_sum_ref(n, gp, s, m, sum);
        return;
    }
    const size_t total = (size_t)n * gp;
    const int vw = gp < 8 ? 8 : gp;
    float pat[GP_MAX + 8], lanes[GP_MAX + 8];
    for (int l = 0; l < vw; l++) pat[l] = m[l % gp];
    __m256 vsum[GP_MAX / 8];
    for (int b = 0; b < vw / 8; b++) vsum[b] = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / 8; b++) {
            __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + i + 8 * b), _mm256_loadu_ps(pat + 8 * b)));
            _mm256_storeu_ps(s + i + 8 * b, e);
            vsum[b] = _mm256_add_ps(vsum[b], e);
        }
    for (int b = 0; b < vw / 8; b++) _mm256_storeu_ps(lanes + 8 * b, vsum[b]);
    for (int l = 0; l < vw; l++) sum[l % gp] += lanes[l];
    for (; i < total; i++) {
        float e = expf(s[i] - m[i % gp]);
        s[i] = e;
        sum[i % gp] += e;
    }
}

void kvpq__vq_lane_max_avx2(int n, int gp, const float *s, float *mx) {
    if (gp > GP_MAX || !(8 % gp == 0 || gp % 8 == 0)) {
        kvpq__vq_lane_max_ref(n, gp, s, mx);
        return;
    }
    const size_t total = (size_t)n * gp;
    const int vw = gp < 8 ? 8 : gp;
    float lanes[GP_MAX + 8];
    __m256 acc[GP_MAX / 8];
    for (int b = 0; b < vw / 8; b++) acc[b] = _mm256_set1_ps(-INFINITY);
    size_t i = 0;
    for (; i + vw <= total; i += vw) /* max(s, acc) returns acc when s is NaN: skipped */
        for (int b = 0; b < vw / 8; b++) acc[b] = _mm256_max_ps(_mm256_loadu_ps(s + i + 8 * b), acc[b]);
    for (int b = 0; b < vw / 8; b++) _mm256_storeu_ps(lanes + 8 * b, acc[b]);
    for (int g = 0; g < gp; g++) mx[g] = -INFINITY;
    for (int l = 0; l < vw; l++) mx[l % gp] = lanes[l] > mx[l % gp] ? lanes[l] : mx[l % gp];
    for (; i < total; i++) mx[i % gp] = s[i] > mx[i % gp] ? s[i] : mx[i % gp];
}

void kvpq__vq_scale_rows_avx2(size_t rows, int gp, const float *rescale, float *table) {
    if (gp > GP_MAX || !(8 % gp == 0 || gp % 8 == 0)) {
        kvpq__vq_scale_rows_ref(rows, gp, rescale, table);
        return;
    }
    const size_t total = rows * gp;
    const int vw = gp < 8 ? 8 : gp;
    float pat[GP_MAX + 8];
    for (int l = 0; l < vw; l++) pat[l] = rescale[l % gp];
    size_t i = 0;
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / 8; b++)
            _mm256_storeu_ps(table + i + 8 * b,
                             _mm256_mul_ps(_mm256_loadu_ps(table + i + 8 * b), _mm256_loadu_ps(pat + 8 * b)));
    for (; i < total; i++) table[i] *= rescale[i % gp];
}

// ---- window: dot products and fp16 conversion -------------------------------------------------

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static void dot_rows_avx2(int n, int d, const float *q, const float *k, float *out) {
    if (d % 16) {
        kvpq__vq_dot_rows_ref(n, d, q, k, out);
        return;
    }
    for (int t = 0; t < n; t++) {
        const float *kt = k + (size_t)t * d;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        for (int j = 0; j < d; j += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kt + j), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + j + 8), _mm256_loadu_ps(kt + j + 8), a1);
        }
        out[t] = hsum256(_mm256_add_ps(a0, a1));
    }
}

static void weighted_sum_avx2(int n, int d, const float *p, const float *v, float *out) {
    if (d % 8 || d > 512) {
        kvpq__vq_weighted_sum_ref(n, d, p, v, out);
        return;
    }
    __m256 acc[64];
    for (int j = 0; j < d / 8; j++) acc[j] = _mm256_setzero_ps();
    for (int t = 0; t < n; t++) {
        const __m256 pt = _mm256_set1_ps(p[t]);
        const float *vt = v + (size_t)t * d;
        for (int j = 0; j < d / 8; j++) acc[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * j), acc[j]);
    }
    for (int j = 0; j < d / 8; j++) _mm256_storeu_ps(out + 8 * j, acc[j]);
}

static void f16_to_f32_avx2(size_t n, const uint16_t *src, float *dst) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    kvpq__vq_f16_to_f32_ref(n - i, src + i, dst + i);
}

static void f32_to_f16_avx2(size_t n, const float *src, uint16_t *dst) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    kvpq__vq_f32_to_f16_ref(n - i, src + i, dst + i);
}

// ---- LUT build and value output: one gp-lane FMA per (m, c, j) ---------------------------------

void kvpq__vq_lut_build_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                             float *lut) {
    if (gp != 4 && gp % 8) {
        kvpq__vq_lut_build_ref(M, ksub, dsub, n_books, cent, gp, qt, lut);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub, *q = qt + (size_t)m * dsub * gp;
        float *out = lut + (size_t)m * ksub * gp;
        if (gp == 4) {
            __m128 qj[16];
            for (int j = 0; j < dsub; j++) qj[j] = _mm_loadu_ps(q + j * 4);
            for (int c = 0; c < ksub; c++) {
                const float *cv = book + (size_t)c * dsub;
                __m128 a = _mm_mul_ps(_mm_broadcast_ss(cv), qj[0]);
                for (int j = 1; j < dsub; j++) a = _mm_fmadd_ps(_mm_broadcast_ss(cv + j), qj[j], a);
                _mm_storeu_ps(out + (size_t)c * 4, a);
            }
        } else {
            for (int b = 0; b < gp; b += 8)
                for (int c = 0; c < ksub; c++) {
                    const float *cv = book + (size_t)c * dsub;
                    __m256 a = _mm256_mul_ps(_mm256_broadcast_ss(cv), _mm256_loadu_ps(q + b));
                    for (int j = 1; j < dsub; j++)
                        a = _mm256_fmadd_ps(_mm256_broadcast_ss(cv + j), _mm256_loadu_ps(q + j * gp + b), a);
                    _mm256_storeu_ps(out + (size_t)c * gp + b, a);
                }
        }
    }
}

void kvpq__vq_table_out_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                           float *out) {
    if (gp != 4 && gp % 8) {
        kvpq__vq_table_out_ref(M, ksub, dsub, n_books, cent, gp, table, out);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub;
        const float *tm = table + (size_t)m * ksub * gp;
        float *o = out + (size_t)m * dsub * gp;
        if (gp == 4) {
            /* Two centroid phases per accumulator (one 256-bit FMA covers c and c+1) halve the
             * FMA latency chain; the halves are summed at the end. */
            __m256 acc[16];
            for (int j = 0; j < dsub; j++) acc[j] = _mm256_setzero_ps();
            int c = 0;
            for (; c + 2 <= ksub; c += 2) {
                const __m256 w = _mm256_loadu_ps(tm + (size_t)c * 4);
                const float *cv = book + (size_t)c * dsub;
                for (int j = 0; j < dsub; j++) {
                    __m256 cc = _mm256_set_m128(_mm_broadcast_ss(cv + dsub + j), _mm_broadcast_ss(cv + j));
                    acc[j] = _mm256_fmadd_ps(cc, w, acc[j]);
                }
            }
            for (int j = 0; j < dsub; j++) {
                __m128 r = _mm_add_ps(_mm256_castps256_ps128(acc[j]), _mm256_extractf128_ps(acc[j], 1));
                if (c < ksub) r = _mm_fmadd_ps(_mm_broadcast_ss(book + (size_t)c * dsub + j), _mm_loadu_ps(tm + (size_t)c * 4), r);
                _mm_storeu_ps(o + j * 4, r);
            }
        } else {
            for (int b = 0; b < gp; b += 8) {
                __m256 acc[16];
                for (int j = 0; j < dsub; j++) acc[j] = _mm256_setzero_ps();
                for (int c = 0; c < ksub; c++) {
                    const __m256 w = _mm256_loadu_ps(tm + (size_t)c * gp + b);
                    const float *cv = book + (size_t)c * dsub;
                    for (int j = 0; j < dsub; j++) acc[j] = _mm256_fmadd_ps(_mm256_broadcast_ss(cv + j), w, acc[j]);
                }
                for (int j = 0; j < dsub; j++) _mm256_storeu_ps(o + j * gp + b, acc[j]);
            }
        }
    }
}

void kvpq__vq_kernels_avx2(kvpq_vq_kernels *k) {
    k->lut_build = kvpq__vq_lut_build_avx2;
    k->table_out = kvpq__vq_table_out_avx2;
    k->dot_rows = dot_rows_avx2;
    k->weighted_sum = weighted_sum_avx2;
    k->f16_to_f32 = f16_to_f32_avx2;
    k->f32_to_f16 = f32_to_f16_avx2;
    k->score_u8 = kvpq__vq_score_u8_avx2;
    k->score_u16 = kvpq__vq_score_u16_avx2;
    k->accum_u8 = kvpq__vq_accum_u8_avx2;
    k->accum_u16 = kvpq__vq_accum_u16_avx2;
    k->softmax_step = kvpq__vq_softmax_step_avx2;
    k->exp_sum = kvpq__vq_exp_sum_avx2;
    k->lane_max = kvpq__vq_lane_max_avx2;
    k->scale_rows = kvpq__vq_scale_rows_avx2;
}
#endif
