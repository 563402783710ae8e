/* vq_avx2.c — attention from PQ codes at AVX2 + FMA + F16C: the width-generic kernels of vq_body.h
 * (8-lane rows: gp a multiple of 8, lane periods of 8), plus what only this level has: 4-lane rows
 * for GQA groups of 2..4 heads (gp = 4, one 128-bit load per row) and the nbits = 8 kernels that
 * walk sub-spaces in L1-sized groups or through precomputed row offsets (gp = 4 or 8). Shapes
 * neither covers go to the _ref. See vq_kernels.h for the shapes and the math. */
#define KVPQ_ISA_AVX2
#define VQ_NEXT(name) kvpq__vq_##name##_ref
#if defined(__x86_64__)
#include "cpu/vq_body.h"

// ---- gp = 4: one 128-bit row per (m, code) ------------------------------------------------------

#define VQ_SCORE_G4(NAME, T)                                                                        \
    static void NAME##_g4(int n, int M, int ksub, const T *codes, const float *lut, float *s) {     \
        const size_t ms = (size_t)ksub * 4;                                                         \
        for (int t = 0; t < n; t++) {                                                               \
            const T *c = codes + (size_t)t * M;                                                     \
            __m128 a0 = _mm_setzero_ps(), a1 = _mm_setzero_ps();                                    \
            const float *L = lut;                                                                   \
            int m = 0;                                                                              \
            for (; m + 1 < M; m += 2, L += 2 * ms) {                                                \
                a0 = _mm_add_ps(a0, _mm_loadu_ps(L + (size_t)c[m] * 4));                            \
                a1 = _mm_add_ps(a1, _mm_loadu_ps(L + ms + (size_t)c[m + 1] * 4));                   \
            }                                                                                       \
            if (m < M) a0 = _mm_add_ps(a0, _mm_loadu_ps(L + (size_t)c[m] * 4));                     \
            _mm_storeu_ps(s + (size_t)t * 4, _mm_add_ps(a0, a1));                                   \
        }                                                                                           \
    }
VQ_SCORE_G4(score_u16, uint16_t)

#define VQ_ACCUM_G4(NAME, T)                                                                        \
    static void NAME##_g4(int n, int M, int ksub, const T *codes, const float *p, float *table) {   \
        const size_t ms = (size_t)ksub * 4;                                                         \
        for (int t = 0; t < n; t++) {                                                               \
            const T *c = codes + (size_t)t * M;                                                     \
            const __m128 pv = _mm_loadu_ps(p + (size_t)t * 4);                                      \
            float *L = table;                                                                       \
            for (int m = 0; m < M; m++, L += ms) {                                                  \
                float *row = L + (size_t)c[m] * 4;                                                  \
                _mm_storeu_ps(row, _mm_add_ps(_mm_loadu_ps(row), pv));                              \
            }                                                                                       \
        }                                                                                           \
    }
VQ_ACCUM_G4(accum_u16, uint16_t)

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
    else score_u8_lanes(n, M, ksub, gp, codes, lut, s);
}

void kvpq__vq_accum_u8_avx2(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table) {
    if (gp == 4 && offsets_ok(M, ksub, gp)) accum_u8_off_g4(n, M, ksub, codes, p, table);
    else if (gp == 8 && offsets_ok(M, ksub, gp)) accum_u8_off_g8(n, M, ksub, codes, p, table);
    else if (gp == 4) accum_u8_g4(n, M, ksub, codes, p, table);
    else if (gp == 8) accum_u8_g8(n, M, ksub, codes, p, table);
    else accum_u8_lanes(n, M, ksub, gp, codes, p, table);
}

void kvpq__vq_score_u16_avx2(int n, int M, int ksub, int gp, const uint16_t *idx, const float *lut, float *s) {
    if (gp == 4) score_u16_g4(n, M, ksub, idx, lut, s);
    else score_u16_lanes(n, M, ksub, gp, idx, lut, s);
}

void kvpq__vq_accum_u16_avx2(int n, int M, int ksub, int gp, const uint16_t *idx, const float *p, float *table) {
    if (gp == 4) accum_u16_g4(n, M, ksub, idx, p, table);
    else accum_u16_lanes(n, M, ksub, gp, idx, p, table);
}

// ---- LUT build and value output for gp = 4 (wider rows: vq_body.h) ---------------------------------

void kvpq__vq_lut_build_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                             float *lut) {
    if (gp != 4) {
        lut_build_lanes(M, ksub, dsub, n_books, cent, gp, qt, lut);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub, *q = qt + (size_t)m * dsub * gp;
        float *out = lut + (size_t)m * ksub * gp;
        __m128 qj[16];
        for (int j = 0; j < dsub; j++) qj[j] = _mm_loadu_ps(q + j * 4);
        for (int c = 0; c < ksub; c++) {
            const float *cv = book + (size_t)c * dsub;
            __m128 a = _mm_mul_ps(_mm_broadcast_ss(cv), qj[0]);
            for (int j = 1; j < dsub; j++) a = _mm_fmadd_ps(_mm_broadcast_ss(cv + j), qj[j], a);
            _mm_storeu_ps(out + (size_t)c * 4, a);
        }
    }
}

void kvpq__vq_table_out_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                             float *out) {
    if (gp != 4) {
        table_out_lanes(M, ksub, dsub, n_books, cent, gp, table, out);
        return;
    }
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub;
        const float *tm = table + (size_t)m * ksub * gp;
        float *o = out + (size_t)m * dsub * gp;
        /* Two centroid phases per accumulator (one 256-bit FMA covers c and c+1) halve the FMA
         * latency chain; the halves are summed at the end. */
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
    }
}

void kvpq__vq_kernels_avx2(kvpq_vq_kernels *k) {
    vq_body_fill(k);
    k->lut_build = kvpq__vq_lut_build_avx2;
    k->table_out = kvpq__vq_table_out_avx2;
    k->score_u8 = kvpq__vq_score_u8_avx2;
    k->score_u16 = kvpq__vq_score_u16_avx2;
    k->accum_u8 = kvpq__vq_accum_u8_avx2;
    k->accum_u16 = kvpq__vq_accum_u16_avx2;
}
#endif
