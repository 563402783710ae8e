/* vq_kernels.h — CPU kernels of attention from PQ codes (the VQ cache, src/cache/cache_vq.c). Internal.
 *
 * The grouped layout: all query heads of one KV head (a GQA group of G heads) are processed
 * together, so each code is read once. Per-head quantities are interleaved on the innermost axis,
 * padded to `gp` lanes (gp = 1, 4, 8 or a multiple of 16; padded lanes carry zeros or don't-care):
 *   lut   (M, ksub, gp) float32: LUT[m][c][g] = q'_g,m . C_k[m][c]   (VecInfer eq. for q.k from codes)
 *   table (M, ksub, gp) float32: W[m][c][g]  = sum of softmax weights of tokens whose code m is c
 *   s/p   (n, gp) float32: scores, then unnormalized softmax weights exp(s - m)
 * Codes are (n, M) uint8 when nbits == 8 (the packed code is the index), else (n, M) uint16
 * indices unpacked from the bit stream.
 *
 * `*_ref` are the specification; the AVX2 / AVX-512 variants are tested against them. */
#ifndef KVPQ_VQ_KERNELS_H
#define KVPQ_VQ_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq.h"

typedef struct {
    /* scores (n, gp): s[t][g] = sum_m lut[m][code(t, m)][g]. */
    void (*score_u8)(int n, int M, int ksub, int gp, const uint8_t *codes, const float *lut, float *s);
    void (*score_u16)(int n, int M, int ksub, int gp, const uint16_t *idx, const float *lut, float *s);
    /* table[m][code(t, m)][g] += p[t][g] for every t < n, m < M. */
    void (*accum_u8)(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table);
    void (*accum_u16)(int n, int M, int ksub, int gp, const uint16_t *idx, const float *p, float *table);
    /* Fast-scan scores (approximate; 8-bit codes, ksub = 256, M <= 256): for g < G,
     * s[t][g] = scale[g] * sum_m lut8[g][m][code(t, m)] + bias[g] (the sum is exact in integers);
     * lanes G..gp-1 get 0. lut8 (G, M, 256) uint8 from kvpq__vq_lut_quantize. */
    void (*score_fs_u8)(int n, int M, int G, int gp, const uint8_t *codes, const uint8_t *lut8, const float *scale,
                        const float *bias, float *s);
    /* Values decoded per token (exact; instead of the W table when cheaper): for g < G,
     * o[g][m * dsub + j] += sum_t p[t][g] * C[m][code(t, m)][j], 8-bit codes (n, M), p (n, gp),
     * o (G, M * dsub), centroids (n_books, 256, dsub). NULL unless a SIMD level has it; use it
     * only where accum_dec_ok(M, dsub, G) says so. */
    void (*accum_dec_u8)(int n, int M, int dsub, int n_books, const float *cent, int gp, int G, const uint8_t *codes,
                         const float *p, float *o);
    int (*accum_dec_ok)(int M, int dsub, int G);
    /* One online-softmax step over a chunk of scores s (n, gp), n >= 1 (Milakov & Gimelshein 2018):
     * m_new = max(m, max_t s[t]); s[t] <- exp(s[t] - m_new); d <- d * exp(m - m_new) + sum_t s[t];
     * m <- m_new. rescale (gp) gets exp(m_old - m_new) (0 where m_old was -inf). Returns 1 if some
     * lane's factor is not exactly 1 (the caller must then rescale its accumulators), else 0. */
    int (*softmax_step)(int n, int gp, float *s, float *m, float *d, float *rescale);
    /* The exp half of that step when m (gp) is already each lane's reference (the block maximum,
     * so s[t][g] - m[g] <= 0): s[t][g] <- exp(s[t][g] - m[g]); sum[g] += sum_t of the new s[t][g].
     * NaN scores stay NaN. */
    void (*exp_sum)(int n, int gp, float *s, const float *m, float *sum);
    /* mx (gp) = per-lane maximum of s (n, gp) over t, n >= 1 (the block's softmax reference); NaN
     * entries are skipped (a lane of only NaN gives -inf). */
    void (*lane_max)(int n, int gp, const float *s, float *mx);
    /* table (rows, gp) *= rescale (gp) per lane. */
    void (*scale_rows)(size_t rows, int gp, const float *rescale, float *table);
    /* Per-token scales of norm-explicit codes: s[t][g] <- s[t][g] * f16(scale[t]) + bias[g] for t < n,
     * g < gp (bias NULL: + 0); scale (n) IEEE half. Keys: scores times the key scales plus the
     * q . mu term; values: softmax weights times the value scales. */
    void (*scale_tokens)(int n, int gp, float *s, const uint16_t *scale, const float *bias);
    /* lut (M, ksub, gp): lut[m][c][g] = sum_j C[m][c][j] * qt[m][j][g], with C the centroids
     * (n_books, ksub, dsub) (book 0 for every m when n_books == 1) and qt (M, dsub, gp). */
    void (*lut_build)(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt, float *lut);
    /* out (M, dsub, gp): out[m][j][g] = sum_c table[m][c][g] * C[m][c][j] (the value codebook
     * applied once to the accumulated weights). */
    void (*table_out)(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table, float *out);
    /* out (d) = sum_t p[t] * v[t] for v (n, d) (window values). */
    void (*weighted_sum)(int n, int d, const float *p, const float *v, float *out);
    /* out[t] = q . k[t] for k (n, d) (window scores). */
    void (*dot_rows)(int n, int d, const float *q, const float *k, float *out);
    /* IEEE half <-> float, round to nearest even (the window's storage). */
    void (*f16_to_f32)(size_t n, const uint16_t *src, float *dst);
    void (*f32_to_f16)(size_t n, const float *src, uint16_t *dst);
    /* In place, each row of x (n, d), d a power of two: the Walsh-Hadamard butterflies (a, b) ->
     * (a + b, a - b) with strides 1, 2, 4, ... < d (Sylvester order), then times scale (kvpq_hadamard).
     * Every level does the same additions in the same order: results are bit-identical. */
    void (*fwht_rows)(size_t n, int d, float scale, float *x);
    /* Rows of 8-bit codes (keys coded before RoPE): x (n, M * dsub) = the centroids of codes (n rows
     * of M bytes, `stride` bytes apart), cent (n_books, ksub, dsub) with n_books 1 (shared) or M;
     * add: x += them (a second stage). */
    void (*gather_u8)(size_t n, int M, int dsub, int n_books, int ksub, const float *cent, const uint8_t *codes,
                      size_t stride, int add, float *x);
    /* x[r][j] = x[r][j] * a[j] + b[j] for the rows of x (n, d): a multiplication, then an addition. */
    void (*affine_rows)(size_t n, int d, const float *a, const float *b, float *x);
    /* RoPE of n consecutive positions (kvpq_rope_rotate): pair i of each of the n_head rows of
     * position t (row h at x + t pos_stride + h head_stride) turned by ((float)c[i], (float)s[i]),
     * pairs (2i, 2i + 1) or, neox, (i, i + half); then (c, s) advance one step in double,
     * c' = c cw - s sw, s' = s cw + c sw. cs (4 half) doubles: c, s (updated), cw, sw; cf (2 half)
     * floats of scratch. */
    void (*rope_steps)(size_t n, int n_head, int half, int neox, size_t pos_stride, size_t head_stride, double *cs,
                       float *cf, float *x);
} kvpq_vq_kernels;

/* The kernels of a SIMD level (the best this build and CPU have at or below `level`): the vq part of
 * the one CPU kernel table (dispatch.h). */
const kvpq_vq_kernels *kvpq__vq_kernels(kvpq_simd_level level);
/* The _ref kernels into k (the scalar level of the table). */
void kvpq__vq_kernels_ref(kvpq_vq_kernels *k);

void kvpq__vq_score_u8_ref(int n, int M, int ksub, int gp, const uint8_t *codes, const float *lut, float *s);
void kvpq__vq_score_u16_ref(int n, int M, int ksub, int gp, const uint16_t *idx, const float *lut, float *s);
void kvpq__vq_score_fs_u8_ref(int n, int M, int G, int gp, const uint8_t *codes, const uint8_t *lut8,
                              const float *scale, const float *bias, float *s);
/* Quantize the float LUT (M, ksub, gp) of heads g < G to lut8 (G, M, ksub) uint8 for fast-scan
 * (André et al., "Cache locality is not enough", VLDB 2015; faiss fast-scan): per head g and
 * sub-space m, lut8 = round((LUT[m][c][g] - min_c LUT[m][c][g]) / delta_g) with one step per head
 * delta_g = max_m (max_c - min_c) / 255, so a score is scale[g] = delta_g times the integer sum plus
 * bias[g] = sum_m min_c. Each score's added error is at most M * delta_g / 2 (rounding). Non-finite
 * LUT entries make that head's scale and bias NaN (its scores are then NaN, as on the exact path). */
void kvpq__vq_lut_quantize(int M, int ksub, int gp, int G, const float *lut, uint8_t *lut8, float *scale, float *bias);
void kvpq__vq_accum_dec_u8_ref(int n, int M, int dsub, int n_books, const float *cent, int gp, int G,
                               const uint8_t *codes, const float *p, float *o);
void kvpq__vq_accum_u8_ref(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table);
void kvpq__vq_accum_u16_ref(int n, int M, int ksub, int gp, const uint16_t *idx, const float *p, float *table);
int kvpq__vq_softmax_step_ref(int n, int gp, float *s, float *m, float *d, float *rescale);
void kvpq__vq_exp_sum_ref(int n, int gp, float *s, const float *m, float *sum);
void kvpq__vq_lane_max_ref(int n, int gp, const float *s, float *mx);
void kvpq__vq_scale_tokens_ref(int n, int gp, float *s, const uint16_t *scale, const float *bias);
void kvpq__vq_scale_rows_ref(size_t rows, int gp, const float *rescale, float *table);
void kvpq__vq_lut_build_ref(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                            float *lut);
void kvpq__vq_table_out_ref(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                            float *out);
void kvpq__vq_weighted_sum_ref(int n, int d, const float *p, const float *v, float *out);
void kvpq__vq_dot_rows_ref(int n, int d, const float *q, const float *k, float *out);
void kvpq__vq_f16_to_f32_ref(size_t n, const uint16_t *src, float *dst);
void kvpq__vq_f32_to_f16_ref(size_t n, const float *src, uint16_t *dst);
void kvpq__vq_fwht_rows_ref(size_t n, int d, float scale, float *x);
void kvpq__vq_gather_u8_ref(size_t n, int M, int dsub, int n_books, int ksub, const float *cent, const uint8_t *codes,
                            size_t stride, int add, float *x);
void kvpq__vq_affine_rows_ref(size_t n, int d, const float *a, const float *b, float *x);
void kvpq__vq_rope_steps_ref(size_t n, int n_head, int half, int neox, size_t pos_stride, size_t head_stride,
                             double *cs, float *cf, float *x);

#if defined(__x86_64__)
/* Variants (vq_body.h compiled per ISA by vq_avx2.c and vq_avx512.c, plus their own kernels) fill
 * only the (kernel, gp) pairs they accelerate and fall back to the next level. */
void kvpq__vq_kernels_avx2(kvpq_vq_kernels *k);
void kvpq__vq_kernels_avx512(kvpq_vq_kernels *k);
#define KVPQ_VQ_DECLARE(ISA)                                                                              \
    void kvpq__vq_score_u8_##ISA(int n, int M, int ksub, int gp, const uint8_t *codes, const float *lut, float *s); \
    void kvpq__vq_score_u16_##ISA(int n, int M, int ksub, int gp, const uint16_t *idx, const float *lut, float *s); \
    void kvpq__vq_accum_u8_##ISA(int n, int M, int ksub, int gp, const uint8_t *codes, const float *p, float *table); \
    void kvpq__vq_accum_u16_##ISA(int n, int M, int ksub, int gp, const uint16_t *idx, const float *p, float *table); \
    int kvpq__vq_softmax_step_##ISA(int n, int gp, float *s, float *m, float *d, float *rescale);                  \
    void kvpq__vq_exp_sum_##ISA(int n, int gp, float *s, const float *m, float *sum);                             \
    void kvpq__vq_lane_max_##ISA(int n, int gp, const float *s, float *mx);                                       \
    void kvpq__vq_scale_rows_##ISA(size_t rows, int gp, const float *rescale, float *table);                      \
    void kvpq__vq_lut_build_##ISA(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt, \
                                  float *lut);                                                                    \
    void kvpq__vq_table_out_##ISA(int M, int ksub, int dsub, int n_books, const float *cent, int gp,             \
                                  const float *table, float *out);                                                \
    void kvpq__vq_weighted_sum_##ISA(int n, int d, const float *p, const float *v, float *out);                   \
    void kvpq__vq_dot_rows_##ISA(int n, int d, const float *q, const float *k, float *out);                       \
    void kvpq__vq_f16_to_f32_##ISA(size_t n, const uint16_t *src, float *dst);                                    \
    void kvpq__vq_f32_to_f16_##ISA(size_t n, const float *src, uint16_t *dst);
KVPQ_VQ_DECLARE(avx2)
KVPQ_VQ_DECLARE(avx512)
#endif

#endif
