/* vq_avx2.c — attention from PQ codes at AVX2 + FMA + F16C: the width-generic kernels of vq_body.h
 * (8-lane rows: gp a multiple of 8, lane periods of 8), plus what only this level has: 4-lane rows
 * for GQA groups of 2..4 heads (gp = 4, one 128-bit load per row) and the nbits = 8 kernels that
 * walk sub-spaces in L1-sized groups or through precomputed row offsets (gp = 4 or 8). Shapes
 * neither covers go to the _ref. See vq_kernels.h for the shapes and the math. */
#define KVPQ_ISA_AVX2
#define VQ_NEXT(name) kvpq__vq_##name##_ref
#if defined(__x86_64__)
#include <unistd.h>

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

// ---- nbits = 8, gp = 4 or 8 (the kernels: vq_u8_avx2.h) ---------------------------------------------

/* A whole LUT or W table is (M, ksub, gp) floats: 64 KiB for M = 16, gp = 4, more than L1. Walking
 * the tokens of a chunk once per group of 4 sub-spaces keeps the group's slices (16 KiB for gp 4,
 * 32 KiB for gp 8) and the chunk's scores in L1; the scores are reloaded once per group. The four
 * codes of a group come in one 32-bit load. */
#define VQ_MG 4

/* Peeling code bytes with shifts costs 2-3 ALU ops per (token, m). Instead, per block of 64 tokens,
 * one SIMD pass turns 16 codes at a time into 16-bit row offsets (m * ksub + c) * gp, and the table
 * loops then need one offset load and one row load per (token, m). Valid when M % 16 == 0, M <= 64
 * and M * ksub * gp <= 65536 (offsets fit 16 bits): d4b8 / d8b8 for head_dim 64..256. */
#define VQ_OB 64

static int offsets_ok(int M, int ksub, int gp) {
    return M % 16 == 0 && M <= 64 && (size_t)M * ksub * gp <= 65536;
}

/* The offset kernels' passes read 32 KiB of table: on a 32 KiB L1D (Zen 3 and 4) they miss, and the
 * groups of VQ_MG sub-spaces (16 KiB) are faster there (Zen 3, d4b8 at gp 4: scores 8.1 -> 6.4 ns
 * per token, table sums 12.8 -> 8.9). Set once by kvpq__vq_kernels_avx2: 1 where the L1D is larger. */
static int l1_big;

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

/* The kernels of both widths: one body (vq_u8_avx2.h). */
#define VQ_GP 4
#include "cpu/vq_u8_avx2.h"
#define VQ_GP 8
#include "cpu/vq_u8_avx2.h"

/* The nbits = 8 kernel for gp 4 or 8 (score and accum share the type: codes, then what they read
 * and what they write), or NULL for the lanes kernels of vq_body.h. */
typedef void (*u8_fn)(int n, int M, int ksub, const uint8_t *codes, const float *in, float *out);
static u8_fn pick_u8(int M, int ksub, int gp, u8_fn off_g4, u8_fn off_g8, u8_fn g4, u8_fn g8) {
    if (gp != 4 && gp != 8) return NULL;
    if (l1_big && offsets_ok(M, ksub, gp)) return gp == 4 ? off_g4 : off_g8;
    return gp == 4 ? g4 : g8;
}

void kvpq__vq_score_u8_avx2(int n, int M, int ksub, int gp, const uint8_t *codes, const float *lut, float *s) {
    u8_fn f = pick_u8(M, ksub, gp, score_u8_off_g4, score_u8_off_g8, score_u8_g4, score_u8_g8);
    if (f) f(n, M, ksub, codes, lut, s);
    else score_u8_lanes(n, M, ksub, gp, codes, lut, s);
}

void kvpq__vq_accum_u8_avx2(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table) {
    u8_fn f = pick_u8(M, ksub, gp, accum_u8_off_g4, accum_u8_off_g8, accum_u8_g4, accum_u8_g8);
    if (f) f(n, M, ksub, codes, p, table);
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

static void lut_build_g4(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                         float *lut) {
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

static void table_out_g4(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                         float *out) {
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

void kvpq__vq_lut_build_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                             float *lut) {
    (gp == 4 ? lut_build_g4 : lut_build_lanes)(M, ksub, dsub, n_books, cent, gp, qt, lut);
}

void kvpq__vq_table_out_avx2(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                             float *out) {
    (gp == 4 ? table_out_g4 : table_out_lanes)(M, ksub, dsub, n_books, cent, gp, table, out);
}

// ---- norm-explicit scales and values decoded per token ---------------------------------------------

/* scale_tokens for gp = 4 (GQA groups of 2..4): 8 tokens' half scales -> one ymm, then per 2 tokens
 * (one ymm of scores) each scale spread over its token's 4 lanes by a permute, one FMA. The FMA
 * rounds once where the reference multiplies then adds (results within 1 ulp). */
static void scale_tokens_avx2(int n, int gp, float *s, const uint16_t *scale, const float *bias) {
    if (gp != 4) {
        kvpq__vq_scale_tokens_ref(n, gp, s, scale, bias);
        return;
    }
    const __m256 b = bias ? _mm256_broadcast_ps((const __m128 *)bias) : _mm256_setzero_ps();
    __m256i idx[4];
    for (int j = 0; j < 4; j++)
        idx[j] = _mm256_setr_epi32(2 * j, 2 * j, 2 * j, 2 * j, 2 * j + 1, 2 * j + 1, 2 * j + 1, 2 * j + 1);
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + t)));
        for (int j = 0; j < 4; j++) {
            float *p = s + (size_t)(t + 2 * j) * 4;
            _mm256_storeu_ps(p, _mm256_fmadd_ps(_mm256_loadu_ps(p), _mm256_permutevar8x32_ps(f, idx[j]), b));
        }
    }
    if (t < n) kvpq__vq_scale_tokens_ref(n - t, gp, s + (size_t)t * 4, scale + t, bias);
}

/* Values decoded per token, dsub 4 or 8, one pass over the tokens per 16 output floats per head (4
 * or 2 sub-spaces): a token's slice is two ymm (two centroids each, a 128-bit load and an insert
 * per pair, or one centroid each) and each head adds p * them with 2 FMAs, the accumulators in
 * registers. Per (token, 16 floats) 2-4 centroid loads and 2 G FMAs, where the W table takes a load,
 * an add and a store per sub-space and then needs clearing, rescaling and applying to the codebook.
 * Groups of up to 3 heads keep two accumulator sets (even and odd tokens) against FMA latency. */
static inline __attribute__((always_inline)) __m256 dec_pair(const float *b0, size_t bs, const uint8_t *c) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(b0 + (size_t)c[0] * 4)),
                                _mm_loadu_ps(b0 + bs + (size_t)c[1] * 4), 1);
}

/* One token's 16 floats from sub-space books b0, b0 + bs, ... and its codes c. */
static inline __attribute__((always_inline)) void dec_slice(const float *b0, size_t bs, const int dsub,
                                                             const uint8_t *c, __m256 *v) {
    if (dsub == 8) {
        v[0] = _mm256_loadu_ps(b0 + (size_t)c[0] * 8);
        v[1] = _mm256_loadu_ps(b0 + bs + (size_t)c[1] * 8);
    } else {
        v[0] = dec_pair(b0, bs, c);
        v[1] = dec_pair(b0 + 2 * bs, bs, c + 2);
    }
}

static inline __attribute__((always_inline)) void dec_fma(const __m256 *v, const float *pt, const int G,
                                                           __m256 (*acc)[2]) {
    for (int g = 0; g < G; g++) {
        const __m256 pg = _mm256_broadcast_ss(pt + g);
        acc[g][0] = _mm256_fmadd_ps(pg, v[0], acc[g][0]);
        acc[g][1] = _mm256_fmadd_ps(pg, v[1], acc[g][1]);
    }
}

static inline __attribute__((always_inline)) void dec16_g(int n, int M, const int dsub, const float *b0, size_t bs,
                                                           int gp, const int G, const uint8_t *codes,
                                                           const float *p, float *o) {
    const int d = M * dsub, ph = G <= 3 ? 2 : 1;
    __m256 acc[2][4][2], v[2];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 2; r++) {
            acc[0][g][r] = _mm256_loadu_ps(o + g * d + 8 * r);
            acc[1][g][r] = _mm256_setzero_ps();
        }
    int t = 0;
    for (; t + ph <= n; t += ph)
        for (int u = 0; u < ph; u++) {
            dec_slice(b0, bs, dsub, codes + (size_t)(t + u) * M, v);
            dec_fma(v, p + (size_t)(t + u) * gp, G, acc[u]);
        }
    for (; t < n; t++) {
        dec_slice(b0, bs, dsub, codes + (size_t)t * M, v);
        dec_fma(v, p + (size_t)t * gp, G, acc[0]);
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 2; r++) _mm256_storeu_ps(o + g * d + 8 * r, _mm256_add_ps(acc[0][g][r], acc[1][g][r]));
}

static int accum_dec_ok_avx2(int M, int dsub, int G) {
    return (dsub == 4 || dsub == 8) && M * dsub % 16 == 0 && G >= 1 && G <= 4;
}

#define DEC16(DSUB, G) dec16_g(n, M, DSUB, b0, bs, gp, G, codes + m0, p, o + m0 * (DSUB))

static void accum_dec_u8_avx2(int n, int M, int dsub, int n_books, const float *cent, int gp, int G,
                              const uint8_t *codes, const float *p, float *o) {
    if (!accum_dec_ok_avx2(M, dsub, G)) {
        kvpq__vq_accum_dec_u8_ref(n, M, dsub, n_books, cent, gp, G, codes, p, o);
        return;
    }
    const size_t bs = n_books == 1 ? 0 : (size_t)256 * dsub; /* stride between sub-spaces' books */
    for (int m0 = 0; m0 < M; m0 += 16 / dsub) {
        const float *b0 = cent + m0 * bs;
        if (dsub == 4) {
            switch (G) {
            case 1: DEC16(4, 1); break;
            case 2: DEC16(4, 2); break;
            case 3: DEC16(4, 3); break;
            default: DEC16(4, 4); break;
            }
        } else {
            switch (G) {
            case 1: DEC16(8, 1); break;
            case 2: DEC16(8, 2); break;
            case 3: DEC16(8, 3); break;
            default: DEC16(8, 4); break;
            }
        }
    }
}
#undef DEC16

// ---- Walsh-Hadamard rows (d a multiple of 8) --------------------------------------------------------

/* Strides 1, 2, 4 within each 8-float block (lane j meets lane j ^ h: sum where bit h is clear, the
 * butterfly's a - b where it is set), then whole registers: the scalar's operations, bit for bit. */
static void fwht_rows_avx2(size_t n, int d, float scale, float *x) {
    if (d % 8) {
        kvpq__vq_fwht_rows_ref(n, d, scale, x);
        return;
    }
    __m256i perm[3];
    __m256 hi[3]; /* all-ones where bit h is set */
    for (int s = 0; s < 3; s++) {
        int32_t idx[8], m[8];
        for (int j = 0; j < 8; j++) idx[j] = j ^ (1 << s), m[j] = (j >> s) & 1 ? -1 : 0;
        perm[s] = _mm256_loadu_si256((const __m256i *)idx);
        hi[s] = _mm256_castsi256_ps(_mm256_loadu_si256((const __m256i *)m));
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (size_t i = 0; i < n; i++) {
        float *r = x + i * (size_t)d;
        for (int b = 0; b < d; b += 8) {
            __m256 v = _mm256_loadu_ps(r + b);
            for (int s = 0; s < 3; s++) {
                const __m256 u = _mm256_permutevar8x32_ps(v, perm[s]);
                v = _mm256_blendv_ps(_mm256_add_ps(v, u), _mm256_sub_ps(u, v), hi[s]);
            }
            _mm256_storeu_ps(r + b, v);
        }
        for (int h = 8; h < d; h <<= 1)
            for (int b = 0; b < d; b += h << 1)
                for (int j = b; j < b + h; j += 8) {
                    const __m256 u = _mm256_loadu_ps(r + j), v = _mm256_loadu_ps(r + j + h);
                    _mm256_storeu_ps(r + j, _mm256_add_ps(u, v));
                    _mm256_storeu_ps(r + j + h, _mm256_sub_ps(u, v));
                }
        for (int j = 0; j < d; j += 8) _mm256_storeu_ps(r + j, _mm256_mul_ps(_mm256_loadu_ps(r + j), sc));
    }
}

void kvpq__vq_kernels_avx2(kvpq_vq_kernels *k) {
    l1_big = sysconf(_SC_LEVEL1_DCACHE_SIZE) > 32768; /* 0 or -1 where unknown: the 16 KiB groups */
    vq_body_fill(k);
    k->lut_build = kvpq__vq_lut_build_avx2;
    k->table_out = kvpq__vq_table_out_avx2;
    k->score_u8 = kvpq__vq_score_u8_avx2;
    k->score_u16 = kvpq__vq_score_u16_avx2;
    k->accum_u8 = kvpq__vq_accum_u8_avx2;
    k->accum_u16 = kvpq__vq_accum_u16_avx2;
    k->fwht_rows = fwht_rows_avx2;
    k->scale_tokens = scale_tokens_avx2;
    k->accum_dec_u8 = accum_dec_u8_avx2;
    k->accum_dec_ok = accum_dec_ok_avx2;
}
#endif
