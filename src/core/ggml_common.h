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
    GGML_TYPE_BF16 = 30,
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

#endif
