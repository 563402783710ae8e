/* attn_kernels.h — CPU kernels of the attention paths of the KV caches, one table per SIMD level.
 *
 * attn_ref.c holds the scalar *_ref kernels, the specification; attn_body.h, compiled per ISA
 * by attn_avx2.c and attn_avx512.c, overrides them. kvpq__attn_kernels() picks the table for kvpq_simd_get(). Every kernel handles any
 * size (SIMD kernels finish tails in scalar code). Internal. */
#ifndef KVPQ_ATTN_KERNELS_H
#define KVPQ_ATTN_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "core/fp16.h" /* kvpq__h2f, kvpq__f2h: the scalar converters */
#include "kvpq.h"

typedef struct {
    const char *name;
    /* S[r*lds + t] = Q[r] . K[t] for r < R, t < n.  Q: (R, hd), K: (n, hd). */
    void (*qk)(const float *Q, int R, const float *K, int n, int hd, float *S, int lds);
    /* O[r] += sum_t P[r*ldp + t] * V[t] for r < R.  P: (R, ldp), V: (n, hd), O: (R, hd). */
    void (*pv)(const float *P, int R, int ldp, const float *V, int n, int hd, float *O);
    /* qk and pv with K, V as IEEE halves (n, hd), converted in registers. */
    void (*qk_f16)(const float *Q, int R, const uint16_t *K, int n, int hd, float *S, int lds);
    void (*pv_f16)(const float *P, int R, int ldp, const uint16_t *V, int n, int hd, float *O);
    /* Rows in lanes (blocks of many query rows, prefill): the same products with the rows as the
     * fast index, so that a vector holds one score of W rows and no sum runs across lanes.
     * ST[t*lds + r] = sum_c K[t*hd + c] QT[c*ldq + r] for r < R, t < n.  QT: (hd, ldq), K: (n, hd). */
    void (*qk_t)(const float *QT, int ldq, int R, const float *K, int n, int hd, float *ST, int lds);
    /* OT[c*ldo + r] += sum_t V[t*hd + c] PT[t*ldp + r] for r < R, c < hd.  PT: (n, ldp), V: (n, hd). */
    void (*pv_t)(const float *PT, int ldp, int R, const float *V, int n, int hd, float *OT, int ldo);
    /* One chunk's online-softmax step of rows in lanes, over ST[t*lds + r] for t < n, r < R (-inf:
     * masked): m' = max(m[r], max_t ST), ST = exp(ST - m') (0 where masked), d[r] = d[r] e + sum_t ST
     * and OT[c*ldo + r] *= e for c < hd with e = exp(m[r] - m'), then m[r] = m'. A row masked so far
     * everywhere keeps m = -inf, d = 0 (FlashAttention-2's update, Dao 2023, alg. 1). */
    void (*softmax_t)(float *ST, int lds, int n, int R, float *m, float *d, float *OT, int ldo, int hd);
    /* max of x[0..n), n >= 1. */
    float (*max)(const float *x, int n);
    /* x[i] = exp(x[i] - m) in place; returns the sum. SIMD levels use a polynomial exp accurate to
     * a few ulp (KVPQ_EXP_RTOL in the tests). */
    float (*exp_sum)(float *x, int n, float m);
    /* x[i] *= s */
    void (*scale)(float *x, int n, float s);
    /* IEEE half <-> float32, round to nearest even: bit-exact at every level. */
    void (*f16_to_f32)(const uint16_t *src, float *dst, size_t n);
    void (*f32_to_f16)(const float *src, uint16_t *dst, size_t n);
    /* ggml block_q8_0 {fp16 d; int8 qs[32]} (34 bytes) x n_blocks -> x (32 n_blocks): d * qs.
     * Bit-exact at every level (one product per element). */
    void (*dequant_q8_0)(const void *blocks, size_t n_blocks, float *x);
    /* ggml block_q4_0 {fp16 d; uint8 qs[16]} (18 bytes) -> x: element j from the low nibble of
     * qs[j], element j+16 from the high nibble; d * (q - 8). Bit-exact at every level. */
    void (*dequant_q4_0)(const void *blocks, size_t n_blocks, float *x);
    /* KIVI rows: x[c] = code_c * scale[c] + min[c] for c < n (n % 32 == 0), codes of `bits` (2 or
     * 4) bits packed LSB-first. Bit-exact at every level (one fused or two rounded ops: the SIMD
     * levels use FMA, the reference fmaf). */
    void (*dequant_bits)(const unsigned char *codes, int bits, int n, const float *scale, const float *min, float *x);
    /* The same with one scale and min per 32 consecutive codes: scale32, min32 (n / 32). */
    void (*dequant_bits_g32)(const unsigned char *codes, int bits, int n, const float *scale32, const float *min32,
                             float *x);
} kvpq_attn_kernels;

extern const kvpq_attn_kernels kvpq__attn_ref;
#if defined(__x86_64__) /* one body, attn_body.h, compiled per ISA */
extern const kvpq_attn_kernels kvpq__attn_avx2;
extern const kvpq_attn_kernels kvpq__attn_avx512;
#endif

/* The table of a level (a level the build lacks falls back to a lower one). */
const kvpq_attn_kernels *kvpq__attn_kernels_for(kvpq_simd_level level);
/* The table of kvpq_simd_get(). */
const kvpq_attn_kernels *kvpq__attn_kernels(void);

#endif
