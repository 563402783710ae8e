/* vq_avx512.c — attention from PQ codes at AVX-512 F/BW/VL/DQ: the width-generic kernels of
 * vq_body.h (16-lane rows: gp a multiple of 16, lane periods of 16), plus what only this level has:
 * 4-centroid permutes for gp = 4 with dsub = 4, values decoded per token, per-token scales for
 * gp = 4, and fast-scan scores with VBMI. Narrower groups go to the AVX2 kernels (a 4- or 8-float
 * row gains nothing from wider registers). See vq_kernels.h for the shapes and the math. */
#define KVPQ_ISA_AVX512
#define VQ_NEXT(name) kvpq__vq_##name##_avx2
#if defined(__x86_64__)
#include "cpu/vq_body.h"

// ---- LUT build and value output for gp = 4, dsub = 4 (d4b8 with GQA groups of 2..4) ---------------

/* Four centroids (16 floats) fill one zmm; the j-th coordinate of each is broadcast within its
 * 128-bit lane by an in-lane permute, so one FMA serves 4 centroids x 4 heads. */
static void lut_build_d4g4(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                           float *lut) {
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

static void table_out_d4g4(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                           float *out) {
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

/* The d4g4 kernels where they apply (gp 4, dsub 4, ksub a multiple of 4), else the lanes kernels. */
static int d4g4(int ksub, int dsub, int gp) { return gp == 4 && dsub == 4 && ksub % 4 == 0; }

static void lut_build_avx512(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                             float *lut) {
    (d4g4(ksub, dsub, gp) ? lut_build_d4g4 : lut_build_lanes)(M, ksub, dsub, n_books, cent, gp, qt, lut);
}

static void table_out_avx512(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                             float *out) {
    (d4g4(ksub, dsub, gp) ? table_out_d4g4 : table_out_lanes)(M, ksub, dsub, n_books, cent, gp, table, out);
}

// ---- fast-scan scores with AVX-512 VBMI (approximate, opt-in: kvpq_cache_params.vq_fast_scan) ----

#define VQ_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi")))

/* Codes of 64 tokens x 16 sub-spaces (m0..m0+15) -> cm[m] (64 bytes: code of token t at byte t).
 * Register i first holds tokens 4i..4i+3 (16 bytes each); a byte permute makes its dword j the
 * codes of sub-space j for those 4 tokens, then a 16 x 16 dword transpose (4 stages, each swapping
 * one bit of the row and column index) gives dword i of register m = sub-space m, tokens 4i..4i+3. */
VQ_VBMI static void fs_transpose16(int M, const uint8_t *codes, __m512i *cm) {
    static const uint8_t perm_b[64] = {
        0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
        6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
        12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};
    const __m512i perm = _mm512_loadu_si512(perm_b);
    __m512i r[16];
    for (int i = 0; i < 16; i++) {
        const uint8_t *c = codes + (size_t)4 * i * M;
        __m512i x;
        if (M == 16) {
            x = _mm512_loadu_si512(c);
        } else {
            x = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)c));
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(c + M)), 1);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(c + 2 * M)), 2);
            x = _mm512_inserti32x4(x, _mm_loadu_si128((const __m128i *)(c + 3 * M)), 3);
        }
        r[i] = _mm512_permutexvar_epi8(perm, x);
    }
    for (int b = 1; b < 16; b <<= 1) {
        int lo_i[16], hi_i[16];
        for (int j = 0; j < 16; j++) {
            lo_i[j] = (j & b) ? 16 + (j & ~b) : j;
            hi_i[j] = (j & b) ? 16 + j : (j | b);
        }
        const __m512i lo = _mm512_loadu_si512(lo_i), hi = _mm512_loadu_si512(hi_i);
        for (int i = 0; i < 16; i++) {
            if (i & b) continue;
            __m512i a = r[i], c = r[i | b];
            r[i] = _mm512_permutex2var_epi32(a, lo, c);
            r[i | b] = _mm512_permutex2var_epi32(a, hi, c);
        }
    }
    for (int m = 0; m < 16; m++) cm[m] = r[m];
}

/* 256-entry byte lookups in registers: two 128-entry vpermi2b (low 7 bits of the code) merged by
 * the code's top bit; 16-bit sums of even and odd tokens (M <= 257 keeps them below 65536). */
VQ_VBMI static void score_fs_u8_vbmi(int n, int M, int G, int gp, const uint8_t *codes, const uint8_t *lut8,
                                     const float *scale, const float *bias, float *s) {
    if (M % 16 || M > 256) {
        kvpq__vq_score_fs_u8_ref(n, M, G, gp, codes, lut8, scale, bias, s);
        return;
    }
    __m512i cm[256];
    int t0 = 0;
    for (; t0 + 64 <= n; t0 += 64) {
        for (int m0 = 0; m0 < M; m0 += 16) fs_transpose16(M, codes + (size_t)t0 * M + m0, cm + m0);
        float *st = s + (size_t)t0 * gp;
        for (int g = 0; g < gp; g++) {
            if (g >= G) {
                for (int t = 0; t < 64; t++) st[(size_t)t * gp + g] = 0.0f;
                continue;
            }
            __m512i ae = _mm512_setzero_si512(), ao = _mm512_setzero_si512();
            const __m512i low = _mm512_set1_epi16(0xff);
            const uint8_t *L = lut8 + (size_t)g * M * 256;
            for (int m = 0; m < M; m++, L += 256) {
                const __m512i c = cm[m];
                __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(L), c, _mm512_loadu_si512(L + 64));
                __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(L + 128), c, _mm512_loadu_si512(L + 192));
                __m512i v = _mm512_mask_blend_epi8(_mm512_movepi8_mask(c), lo, hi);
                ae = _mm512_add_epi16(ae, _mm512_and_si512(v, low));
                ao = _mm512_add_epi16(ao, _mm512_srli_epi16(v, 8));
            }
            /* ae lane k = token 2k, ao lane k = token 2k + 1. */
            const __m512 sc = _mm512_set1_ps(scale[g]), bi = _mm512_set1_ps(bias[g]);
            float fe[32], fo[32];
            for (int h = 0; h < 2; h++) {
                __m256i e = h ? _mm512_extracti64x4_epi64(ae, 1) : _mm512_castsi512_si256(ae);
                __m256i o = h ? _mm512_extracti64x4_epi64(ao, 1) : _mm512_castsi512_si256(ao);
                _mm512_storeu_ps(fe + 16 * h, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(e)), bi));
                _mm512_storeu_ps(fo + 16 * h, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(o)), bi));
            }
            for (int k = 0; k < 32; k++) {
                st[(size_t)(2 * k) * gp + g] = fe[k];
                st[(size_t)(2 * k + 1) * gp + g] = fo[k];
            }
        }
    }
    if (t0 < n)
        kvpq__vq_score_fs_u8_ref(n - t0, M, G, gp, codes + (size_t)t0 * M, lut8, scale, bias, s + (size_t)t0 * gp);
}

// ---- values decoded per token: dsub = 4, M a multiple of 16, groups of up to 4 heads ---------------

/* One token's value slice (16 sub-spaces, 64 floats) is four zmm of four centroids each (one 128-bit load per
 * sub-space); each head adds p * vector with 4 FMAs. Per (token, sub-space) that is one load and
 * G / 4 FMAs, against a load, an add and a store per (token, sub-space) for the W table. */
static inline __attribute__((always_inline)) void dec_g(int n, int M, int n_books, const float *cent, int gp,
                                                         const int G, const uint8_t *codes, const float *p, float *o) {
    const int d = M * 4;
    __m512 acc[4][4];
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 4; r++) acc[g][r] = _mm512_loadu_ps(o + g * d + 16 * r);
    const size_t bs = n_books == 1 ? 0 : 256 * 4; /* stride between sub-spaces' books */
    for (int t = 0; t < n; t++) {
        const uint8_t *c = codes + (size_t)t * M;
        __m512 v[4];
        for (int r = 0; r < 4; r++) {
            const float *b0 = cent + 4 * r * bs;
            __m512 x = _mm512_castps128_ps512(_mm_loadu_ps(b0 + (size_t)c[4 * r] * 4));
            x = _mm512_insertf32x4(x, _mm_loadu_ps(b0 + bs + (size_t)c[4 * r + 1] * 4), 1);
            x = _mm512_insertf32x4(x, _mm_loadu_ps(b0 + 2 * bs + (size_t)c[4 * r + 2] * 4), 2);
            v[r] = _mm512_insertf32x4(x, _mm_loadu_ps(b0 + 3 * bs + (size_t)c[4 * r + 3] * 4), 3);
        }
        for (int g = 0; g < G; g++) {
            const __m512 pg = _mm512_set1_ps(p[(size_t)t * gp + g]);
            for (int r = 0; r < 4; r++) acc[g][r] = _mm512_fmadd_ps(pg, v[r], acc[g][r]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int r = 0; r < 4; r++) _mm512_storeu_ps(o + g * d + 16 * r, acc[g][r]);
}

static int accum_dec_ok_avx512(int M, int dsub, int G) {
    return M % 16 == 0 && dsub == 4 && G >= 1 && G <= 4;
}

static void accum_dec_u8_avx512(int n, int M, int dsub, int n_books, const float *cent, int gp, int G,
                                const uint8_t *codes, const float *p, float *o) {
    if (!accum_dec_ok_avx512(M, dsub, G)) {
        kvpq__vq_accum_dec_u8_ref(n, M, dsub, n_books, cent, gp, G, codes, p, o);
        return;
    }
    /* One pass over the tokens per slice of 16 sub-spaces (64 output floats per head), so the
     * G x 4 accumulators stay in registers for any head_dim. */
    const size_t bs = n_books == 1 ? 0 : 256 * 4;
    for (int m0 = 0; m0 < M; m0 += 16) {
        const float *cm = cent + m0 * bs;
        const uint8_t *cd = codes + m0;
        float *om = o + m0 * 4;
        switch (G) {
        case 1: dec_g(n, M, n_books, cm, gp, 1, cd, p, om); break;
        case 2: dec_g(n, M, n_books, cm, gp, 2, cd, p, om); break;
        case 3: dec_g(n, M, n_books, cm, gp, 3, cd, p, om); break;
        default: dec_g(n, M, n_books, cm, gp, 4, cd, p, om); break;
        }
    }
}

/* scale_tokens for gp = 4 (GQA groups of 2..4): 16 tokens' half scales -> one zmm, then per 4 tokens
 * (one zmm of scores) each scale spread over its token's 4 lanes by a permute, one FMA. The FMA
 * rounds once where the reference multiplies then adds (results within 1 ulp). */
static void scale_tokens_avx512(int n, int gp, float *s, const uint16_t *scale, const float *bias) {
    if (gp != 4) {
        kvpq__vq_scale_tokens_ref(n, gp, s, scale, bias);
        return;
    }
    const __m512 b = bias ? _mm512_broadcast_f32x4(_mm_loadu_ps(bias)) : _mm512_setzero_ps();
    __m512i idx[4];
    for (int j = 0; j < 4; j++)
        idx[j] = _mm512_set_epi32(4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 3, 4 * j + 2, 4 * j + 2, 4 * j + 2,
                                  4 * j + 2, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j + 1, 4 * j, 4 * j, 4 * j, 4 * j);
    int t = 0;
    for (; t + 16 <= n; t += 16) {
        const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + t)));
        for (int j = 0; j < 4; j++) {
            float *p = s + (size_t)(t + 4 * j) * 4;
            _mm512_storeu_ps(p, _mm512_fmadd_ps(_mm512_loadu_ps(p), _mm512_permutexvar_ps(idx[j], f), b));
        }
    }
    if (t < n) kvpq__vq_scale_tokens_ref(n - t, gp, s + (size_t)t * 4, scale + t, bias);
}

// ---- Walsh-Hadamard rows (d a multiple of 16) ------------------------------------------------------

/* Strides 1, 2, 4, 8 within each 16-float block: lane j meets lane j ^ h; lanes with bit h clear
 * take x_j + x_(j^h), the others x_(j^h) - x_j (the butterfly's a - b): the scalar's operations. */
static void fwht_rows_avx512(size_t n, int d, float scale, float *x) {
    if (d % 16) {
        kvpq__vq_fwht_rows_ref(n, d, scale, x);
        return;
    }
    static const __mmask16 mask[4] = {0xAAAA, 0xCCCC, 0xF0F0, 0xFF00};
    __m512i perm[4];
    for (int s = 0; s < 4; s++) {
        int32_t idx[16];
        for (int j = 0; j < 16; j++) idx[j] = j ^ (1 << s);
        perm[s] = _mm512_loadu_si512(idx);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    for (size_t i = 0; i < n; i++) {
        float *r = x + i * (size_t)d;
        for (int b = 0; b < d; b += 16) {
            __m512 v = _mm512_loadu_ps(r + b);
            for (int s = 0; s < 4; s++) {
                const __m512 u = _mm512_permutexvar_ps(perm[s], v);
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, u), mask[s], u, v);
            }
            _mm512_storeu_ps(r + b, v);
        }
        for (int h = 16; h < d; h <<= 1)
            for (int b = 0; b < d; b += h << 1)
                for (int j = b; j < b + h; j += 16) {
                    const __m512 u = _mm512_loadu_ps(r + j), v = _mm512_loadu_ps(r + j + h);
                    _mm512_storeu_ps(r + j, _mm512_add_ps(u, v));
                    _mm512_storeu_ps(r + j + h, _mm512_sub_ps(u, v));
                }
        for (int j = 0; j < d; j += 16) _mm512_storeu_ps(r + j, _mm512_mul_ps(_mm512_loadu_ps(r + j), sc));
    }
}

void kvpq__vq_kernels_avx512(kvpq_vq_kernels *k) {
    vq_body_fill(k);
    k->scale_tokens = scale_tokens_avx512;
    k->accum_dec_u8 = accum_dec_u8_avx512;
    k->accum_dec_ok = accum_dec_ok_avx512;
    if (__builtin_cpu_supports("avx512vbmi")) k->score_fs_u8 = score_fs_u8_vbmi;
    k->lut_build = lut_build_avx512;
    k->table_out = table_out_avx512;
    k->fwht_rows = fwht_rows_avx512;
}
#endif
