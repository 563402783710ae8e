/* kquants.h — the K-quant block layouts (ggml's "k-quants": super-blocks of QK_K = 256 elements with
 * 6-, 8- or 4-bit sub-block scales), shared by the scalar specification (model/kquants.c) and the
 * per-ISA kernels (cpu/ggml_*.c). Layouts and element order as ggml's ggml-common.h and the PyPI gguf
 * package's gguf/quants.py, which the CI test tests/python/test_dequant_peer.py holds kvpq to.
 * Every field is bytes (fp16 values as 2 little-endian bytes), so a block pointer needs no alignment.
 * Internal. */
#ifndef KVPQ_KQUANTS_H
#define KVPQ_KQUANTS_H

#include <stdint.h>
#include <string.h>

#define QK_K 256

/* Q2_K (84 bytes, 2.625 bits/weight): 16 sub-blocks of 16. scales[i]: low nibble the scale, high
 * nibble the min of sub-block i. Element e = 128 h + 32 s + l (h < 2, s < 4, l < 32) is the 2 bits
 * (qs[32 h + l] >> 2 s) & 3; value d * sc * q - dmin * m for its sub-block e / 16. */
typedef struct {
    uint8_t scales[QK_K / 16];
    uint8_t qs[QK_K / 4];
    uint8_t d[2];    /* fp16 */
    uint8_t dmin[2]; /* fp16 */
} kvpq_block_q2_K;

/* Q3_K (110 bytes, 3.4375 bits/weight): 16 sub-blocks of 16 with 6-bit signed scales (stored +32,
 * packed in 12 bytes: see kvpq__q3_K_scales). Element e = 128 h + 32 s + l: low 2 bits
 * (qs[32 h + l] >> 2 s) & 3, high bit (hmask[l] >> (e / 32)) & 1; q = low - (high ? 0 : 4);
 * value d * (scale - 32) * q for its sub-block e / 16. */
typedef struct {
    uint8_t hmask[QK_K / 8];
    uint8_t qs[QK_K / 4];
    uint8_t scales[12];
    uint8_t d[2]; /* fp16 */
} kvpq_block_q3_K;

/* Q4_K (144 bytes, 4.5 bits/weight): 8 sub-blocks of 32 with 6-bit scales and mins packed in 12
 * bytes (kvpq__k4_scale_min). Element e = 64 c + 32 h + l (c < 4, h < 2, l < 32) is the nibble
 * (qs[32 c + l] >> 4 h) & 15; value d * sc * q - dmin * m for its sub-block e / 32. */
typedef struct {
    uint8_t d[2];    /* fp16 */
    uint8_t dmin[2]; /* fp16 */
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} kvpq_block_q4_K;

/* Q5_K (176 bytes, 5.5 bits/weight): Q4_K plus a fifth bit (qh[l] >> (e / 32)) & 1 for element
 * e = 32 k + l, added as 16. */
typedef struct {
    uint8_t d[2];    /* fp16 */
    uint8_t dmin[2]; /* fp16 */
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} kvpq_block_q5_K;

/* Q6_K (210 bytes, 6.5625 bits/weight): 16 sub-blocks of 16 with int8 scales. Element
 * e = 128 h + r (h < 2, r < 128): low nibble (ql[64 h + r % 64] >> 4 (r / 64)) & 15, high 2 bits
 * (qh[32 h + r % 32] >> 2 (r / 32)) & 3; q = (low | high << 4) - 32; value d * scales[e / 16] * q. */
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint8_t d[2]; /* fp16 */
} kvpq_block_q6_K;

_Static_assert(sizeof(kvpq_block_q2_K) == 84, "Q2_K block");
_Static_assert(sizeof(kvpq_block_q3_K) == 110, "Q3_K block");
_Static_assert(sizeof(kvpq_block_q4_K) == 144, "Q4_K block");
_Static_assert(sizeof(kvpq_block_q5_K) == 176, "Q5_K block");
_Static_assert(sizeof(kvpq_block_q6_K) == 210, "Q6_K block");

/* The 8 scales sc[j] and mins m[j] (6 bits each) of a Q4_K / Q5_K block from its 12 bytes:
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

/* The 16 signed scales of a Q3_K block (6 bits stored + 32) from its 12 bytes: sub-block i takes
 * its low 4 bits from s[i % 8] (low nibble for i < 8, high nibble after) and its high 2 bits from
 * (s[8 + i % 4] >> 2 (i / 4)) & 3. */
static inline void kvpq__q3_K_scales(const uint8_t s[12], int8_t out[16]) {
    for (int i = 0; i < 16; i++) {
        int lo = (i < 8 ? s[i] : s[i - 8] >> 4) & 15, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (int8_t)((lo | hi << 4) - 32);
    }
}

/* Dequantize n elements (a multiple of QK_K) of a row to float32: the scalar specification, bit-exact
 * with ggml's dequantize_row_q*_K and gguf.quants.dequantize. (Every product of a scale and a quant
 * is exact in float32, so the only rounding is the subtraction of the min, as theirs.) */
void kvpq__dequant_q2_K_ref(const uint8_t *src, float *y, int64_t n);
void kvpq__dequant_q3_K_ref(const uint8_t *src, float *y, int64_t n);
void kvpq__dequant_q4_K_ref(const uint8_t *src, float *y, int64_t n);
void kvpq__dequant_q5_K_ref(const uint8_t *src, float *y, int64_t n);
void kvpq__dequant_q6_K_ref(const uint8_t *src, float *y, int64_t n);

#endif
