/* ggml_common.h — GGML tensor type numbers and quantized block layouts, shared by every part of
 * libkvpq that reads them (the model's weights in cpu/ and model/, the q8_0 / q4_0 KV caches in
 * cache/), with the scalar dequantization of one block (the specification). Internal.
 *
 * Numbering and layouts as ggml's ggml.h (enum ggml_type) and ggml-common.h (block_q4_0 ...): a
 * block is QK elements, its scales IEEE halves (little-endian, like the rest of a GGUF file). Each
 * layout has a static_assert on its size, so a padding or a typo cannot go unnoticed. Blocks are
 * read through byte pointers with KVPQ_BLK_* (offsetof the struct's fields), never through a struct
 * pointer: a GGUF file may align its tensors to 1 byte, so a block can start at an odd address.
 *
 * To add a type: its number in the enum, its block struct with a static_assert, its scalar block
 * dequantization below; then its row in model/ggml_types.c's type table and its _ref, and its SIMD
 * kernels in cpu/ggml_body.h (see the comment at the top there). */
#ifndef KVPQ_GGML_COMMON_H
#define KVPQ_GGML_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "core/fp16.h"

enum {
    GGML_TYPE_F32 = 0, GGML_TYPE_F16 = 1, GGML_TYPE_Q4_0 = 2, GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6, GGML_TYPE_Q5_1 = 7, GGML_TYPE_Q8_0 = 8, GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10, GGML_TYPE_Q3_K = 11, GGML_TYPE_Q4_K = 12, GGML_TYPE_Q5_K = 13, GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15, GGML_TYPE_BF16 = 30,
};

// ---- block layouts -----------------------------------------------------------------------------

#define QK4_0 32
#define QK4_1 32
#define QK5_0 32
#define QK5_1 32
#define QK8_0 32

/* Q4_0: x = (q - 8) * d; element j is the low nibble of qs[j], element j + 16 its high nibble. */
typedef struct {
    uint16_t d;             /* fp16 scale */
    uint8_t qs[QK4_0 / 2];  /* nibbles */
} block_q4_0;
_Static_assert(sizeof(block_q4_0) == 2 + QK4_0 / 2, "block_q4_0: 18 bytes");

/* Q4_1: x = q * d + m, nibbles as Q4_0. */
typedef struct {
    uint16_t d, m;          /* fp16 scale and minimum */
    uint8_t qs[QK4_1 / 2];
} block_q4_1;
_Static_assert(sizeof(block_q4_1) == 4 + QK4_1 / 2, "block_q4_1: 20 bytes");

/* Q5_0: x = (q - 16) * d, q = nibble | (bit j of qh) << 4. */
typedef struct {
    uint16_t d;
    uint8_t qh[4];          /* little-endian u32: bit j is the 5th bit of element j */
    uint8_t qs[QK5_0 / 2];
} block_q5_0;
_Static_assert(sizeof(block_q5_0) == 6 + QK5_0 / 2, "block_q5_0: 22 bytes");

/* Q5_1: x = q * d + m, q as Q5_0. */
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK5_1 / 2];
} block_q5_1;
_Static_assert(sizeof(block_q5_1) == 8 + QK5_1 / 2, "block_q5_1: 24 bytes");

/* Q8_0: x = q * d. */
typedef struct {
    uint16_t d;
    int8_t qs[QK8_0];
} block_q8_0;
_Static_assert(sizeof(block_q8_0) == 2 + QK8_0, "block_q8_0: 34 bytes");

/* ---- K-quants ("k-quants": super-blocks of QK_K = 256 elements with 4-, 6- or 8-bit sub-block
 * scales). Element order as ggml's dequantize_row_q*_K and the PyPI gguf package's gguf/quants.py
 * (tests/python/test_kquant_peer.py holds kvpq to the latter on real model tensors). */
#define QK_K 256

/* Q2_K (84 bytes, 2.625 bits/weight): 16 sub-blocks of 16. scales[g]: low nibble the scale, high
 * nibble the min of sub-block g. Element e = 128 h + 32 s + l (h < 2, s < 4, l < 32) is the 2 bits
 * (qs[32 h + l] >> 2 s) & 3; x = d * sc * q - dmin * m for its sub-block e / 16. */
typedef struct {
    uint8_t scales[QK_K / 16];
    uint8_t qs[QK_K / 4];
    uint16_t d, dmin;
} block_q2_K;
_Static_assert(sizeof(block_q2_K) == 84, "block_q2_K: 84 bytes");

/* Q3_K (110 bytes, 3.4375 bits/weight): 16 sub-blocks of 16 with 6-bit signed scales (stored + 32,
 * packed in 12 bytes: kvpq__q3_K_scales). Element e = 128 h + 32 s + l: low 2 bits
 * (qs[32 h + l] >> 2 s) & 3, high bit (hmask[l] >> (e / 32)) & 1; q = low - (high ? 0 : 4);
 * x = d * scale * q for its sub-block e / 16. */
typedef struct {
    uint8_t hmask[QK_K / 8];
    uint8_t qs[QK_K / 4];
    uint8_t scales[12];
    uint16_t d;
} block_q3_K;
_Static_assert(sizeof(block_q3_K) == 110, "block_q3_K: 110 bytes");

/* Q4_K (144 bytes, 4.5 bits/weight): 8 sub-blocks of 32 with 6-bit scales and mins packed in 12
 * bytes (kvpq__k4_scale_min). Element e = 64 c + 32 h + l (c < 4, h < 2, l < 32) is the nibble
 * (qs[32 c + l] >> 4 h) & 15; x = d * sc * q - dmin * m for its sub-block e / 32. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} block_q4_K;
_Static_assert(sizeof(block_q4_K) == 144, "block_q4_K: 144 bytes");

/* Q5_K (176 bytes, 5.5 bits/weight): Q4_K plus a fifth bit (qh[l] >> (e / 32)) & 1 for element
 * e = 32 j + l, worth 16. */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} block_q5_K;
_Static_assert(sizeof(block_q5_K) == 176, "block_q5_K: 176 bytes");

/* Q6_K (210 bytes, 6.5625 bits/weight): 16 sub-blocks of 16 with int8 scales. Element
 * e = 128 h + r (h < 2, r < 128): low nibble (ql[64 h + r % 64] >> 4 (r / 64)) & 15, high 2 bits
 * (qh[32 h + r % 32] >> 2 (r / 32)) & 3; q = (low | high << 4) - 32; x = d * scales[e / 16] * q. */
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;
_Static_assert(sizeof(block_q6_K) == 210, "block_q6_K: 210 bytes");

/* The 8 scales sc[j] and mins m[j] (6 bits each) of a Q4_K / Q5_K block from its 12 bytes s:
 * j < 4: sc = s[j] & 63, m = s[j + 4] & 63; j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4,
 * m = (s[j + 4] >> 4) | (s[j] >> 6) << 4. */
static inline void kvpq__k4_scale_min(const uint8_t s[12], uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | ((s[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4));
    }
}

/* The 16 signed scales of a Q3_K block (6 bits stored + 32) from its 12 bytes s: sub-block g takes
 * its low 4 bits from s[g % 8] (low nibble for g < 8, high nibble after) and its high 2 bits from
 * (s[8 + g % 4] >> 2 (g / 4)) & 3. */
static inline void kvpq__q3_K_scales(const uint8_t s[12], int8_t out[16]) {
    for (int g = 0; g < 16; g++) {
        int lo = (g < 8 ? s[g] : s[g - 8] >> 4) & 15, hi = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
        out[g] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* The fp16 field F and the address of the array field F of the block of type T at byte pointer p. */
#define KVPQ_BLK_F16(p, T, F) kvpq__h2f_at((const uint8_t *)(p) + offsetof(T, F))
#define KVPQ_BLK_AT(p, T, F) ((const uint8_t *)(p) + offsetof(T, F))

// ---- scalar dequantization of one block (bit-exact with ggml's dequantize_row_*) ------------------
/* Each product and each sum is rounded on its own (no FMA contraction: C11 mode, and the pragma for
 * clang), as ggml and numpy compute them. */

static inline void kvpq__block_q4_0_ref(const void *b, float *y) {
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
    const float d = KVPQ_BLK_F16(b, block_q4_0, d);
    const uint8_t *qs = KVPQ_BLK_AT(b, block_q4_0, qs);
    for (int j = 0; j < QK4_0 / 2; j++) {
        y[j] = (float)((qs[j] & 0x0f) - 8) * d;
        y[j + QK4_0 / 2] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static inline void kvpq__block_q4_1_ref(const void *b, float *y) {
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
    const float d = KVPQ_BLK_F16(b, block_q4_1, d), m = KVPQ_BLK_F16(b, block_q4_1, m);
    const uint8_t *qs = KVPQ_BLK_AT(b, block_q4_1, qs);
    for (int j = 0; j < QK4_1 / 2; j++) {
        float p0 = (float)(qs[j] & 0x0f) * d, p1 = (float)(qs[j] >> 4) * d;
        y[j] = p0 + m;
        y[j + QK4_1 / 2] = p1 + m;
    }
}

static inline uint32_t kvpq__block_qh(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
}

static inline void kvpq__block_q5_0_ref(const void *b, float *y) {
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
    const float d = KVPQ_BLK_F16(b, block_q5_0, d);
    const uint32_t qh = kvpq__block_qh(KVPQ_BLK_AT(b, block_q5_0, qh));
    const uint8_t *qs = KVPQ_BLK_AT(b, block_q5_0, qs);
    for (int j = 0; j < QK5_0 / 2; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        y[j] = (float)(((qs[j] & 0x0f) | (h0 << 4)) - 16) * d;
        y[j + QK5_0 / 2] = (float)(((qs[j] >> 4) | (h1 << 4)) - 16) * d;
    }
}

static inline void kvpq__block_q5_1_ref(const void *b, float *y) {
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
    const float d = KVPQ_BLK_F16(b, block_q5_1, d), m = KVPQ_BLK_F16(b, block_q5_1, m);
    const uint32_t qh = kvpq__block_qh(KVPQ_BLK_AT(b, block_q5_1, qh));
    const uint8_t *qs = KVPQ_BLK_AT(b, block_q5_1, qs);
    for (int j = 0; j < QK5_1 / 2; j++) {
        int h0 = (qh >> j) & 1, h1 = (qh >> (j + 16)) & 1;
        float p0 = (float)((qs[j] & 0x0f) | (h0 << 4)) * d, p1 = (float)((qs[j] >> 4) | (h1 << 4)) * d;
        y[j] = p0 + m;
        y[j + QK5_1 / 2] = p1 + m;
    }
}

static inline void kvpq__block_q8_0_ref(const void *b, float *y) {
    const float d = KVPQ_BLK_F16(b, block_q8_0, d);
    const int8_t *qs = (const int8_t *)KVPQ_BLK_AT(b, block_q8_0, qs);
    for (int j = 0; j < QK8_0; j++) y[j] = (float)qs[j] * d;
}

/* K-quants, sub-block by sub-block. Every product of a scale and a quant is exact in float32 (at most
 * 11 + 8 + 6 significant bits), so FMA contraction cannot change a result and the only rounding is
 * the subtraction of the min, as in ggml and numpy. */

static inline void kvpq__block_q2_K_ref(const void *b, float *y) {
    const float d = KVPQ_BLK_F16(b, block_q2_K, d), dmin = KVPQ_BLK_F16(b, block_q2_K, dmin);
    const uint8_t *scales = KVPQ_BLK_AT(b, block_q2_K, scales), *qs = KVPQ_BLK_AT(b, block_q2_K, qs);
    for (int h = 0; h < 2; h++)           /* 128 elements: 32 bytes of qs */
        for (int s = 0; s < 4; s++)       /* 32 elements: bits 2s, 2s+1 of those bytes */
            for (int k = 0; k < 2; k++) { /* sub-block of 16 */
                int sb = scales[8 * h + 2 * s + k];
                float dl = d * (float)(sb & 15), ml = dmin * (float)(sb >> 4);
                const uint8_t *q = qs + 32 * h + 16 * k;
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
            }
}

static inline void kvpq__block_q3_K_ref(const void *b, float *y) {
    const float d = KVPQ_BLK_F16(b, block_q3_K, d);
    const uint8_t *hmask = KVPQ_BLK_AT(b, block_q3_K, hmask), *qs = KVPQ_BLK_AT(b, block_q3_K, qs);
    int8_t sc[16];
    kvpq__q3_K_scales(KVPQ_BLK_AT(b, block_q3_K, scales), sc);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) {
            int j = 4 * h + s; /* 32-element run: the bit of hmask */
            for (int k = 0; k < 2; k++) {
                float dl = d * (float)sc[2 * j + k];
                const uint8_t *q = qs + 32 * h + 16 * k, *hm = hmask + 16 * k;
                for (int l = 0; l < 16; l++) {
                    int v = ((q[l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
                    *y++ = dl * (float)v;
                }
            }
        }
}

/* Q4_K and Q5_K (qh NULL for Q4_K): sub-block j is the low (even j) or high nibbles of 32 bytes. */
static inline void kvpq__block_q45_K_ref(float d, float dmin, const uint8_t *scales, const uint8_t *qh,
                                         const uint8_t *qs, float *y) {
    uint8_t sc[8], m[8];
    kvpq__k4_scale_min(scales, sc, m);
    for (int j = 0; j < 8; j++) {
        float dl = d * (float)sc[j], ml = dmin * (float)m[j];
        const uint8_t *q = qs + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = ((q[l] >> (4 * (j % 2))) & 15) | (qh ? ((qh[l] >> j) & 1) << 4 : 0);
            *y++ = dl * (float)v - ml;
        }
    }
}

static inline void kvpq__block_q4_K_ref(const void *b, float *y) {
    kvpq__block_q45_K_ref(KVPQ_BLK_F16(b, block_q4_K, d), KVPQ_BLK_F16(b, block_q4_K, dmin),
                          KVPQ_BLK_AT(b, block_q4_K, scales), NULL, KVPQ_BLK_AT(b, block_q4_K, qs), y);
}

static inline void kvpq__block_q5_K_ref(const void *b, float *y) {
    kvpq__block_q45_K_ref(KVPQ_BLK_F16(b, block_q5_K, d), KVPQ_BLK_F16(b, block_q5_K, dmin),
                          KVPQ_BLK_AT(b, block_q5_K, scales), KVPQ_BLK_AT(b, block_q5_K, qh),
                          KVPQ_BLK_AT(b, block_q5_K, qs), y);
}

static inline void kvpq__block_q6_K_ref(const void *b, float *y) {
    const float d = KVPQ_BLK_F16(b, block_q6_K, d);
    const uint8_t *ql0 = KVPQ_BLK_AT(b, block_q6_K, ql), *qh0 = KVPQ_BLK_AT(b, block_q6_K, qh);
    const int8_t *scales = (const int8_t *)KVPQ_BLK_AT(b, block_q6_K, scales);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++) /* 32-element run s of this half: nibble s/2 of ql, bits 2s of qh */
            for (int k = 0; k < 2; k++) {
                float dl = d * (float)scales[8 * h + 2 * s + k];
                const uint8_t *ql = ql0 + 64 * h + 32 * (s % 2) + 16 * k, *qh = qh0 + 32 * h + 16 * k;
                for (int l = 0; l < 16; l++) {
                    int v = ((ql[l] >> (4 * (s / 2))) & 15) | (((qh[l] >> (2 * s)) & 3) << 4);
                    *y++ = dl * (float)(v - 32);
                }
            }
}

#endif
