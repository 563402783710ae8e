/* cache_q4_0.c — llama.cpp's Q4_0 KV cache: blocks of 32 along head_dim, a block being
 * {fp16 d; uint8 qs[16]} (18 bytes, ggml's block_q4_0): element j in the low nibble of qs[j],
 * element j+16 in the high nibble, x ~= d * (q - 8). Quantization rounds as ggml's
 * quantize_row_q4_0_ref: d = (the element of largest magnitude, signed) / -8,
 * q = min(15, (int8)(x / d + 8.5)). 4.5 bits per element. */
#include <math.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "core/ggml_common.h" /* QK4_0, block_q4_0 */

#define Q4_0_BLOCK_BYTES sizeof(block_q4_0)

static size_t q4_0_row_bytes(int head_dim) { return (size_t)head_dim / QK4_0 * Q4_0_BLOCK_BYTES; }

static void q4_0_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    (void)kr;
    unsigned char *y = rows;
    for (size_t b = 0; b < (size_t)n * head_dim / QK4_0; b++, x += QK4_0, y += Q4_0_BLOCK_BYTES) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK4_0; j++)
            if (amax < fabsf(x[j])) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvpq__f2h(d);
        memcpy(y, &dh, 2);
        for (int j = 0; j < QK4_0 / 2; j++) {
            int8_t x0 = (int8_t)(x[j] * id + 8.5f), x1 = (int8_t)(x[j + QK4_0 / 2] * id + 8.5f);
            uint8_t q0 = x0 < 15 ? (uint8_t)x0 : 15, q1 = x1 < 15 ? (uint8_t)x1 : 15;
            y[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

static void q4_0_decode(const void *rows, int n, int head_dim, float *x, const kvpq_attn_kernels *kr) {
    kr->dequant_q4_0(rows, (size_t)n * head_dim / QK4_0, x);
}

/* The codec of the plain and the rotated kind (NAME). */
#define Q4_0_CODEC(NAME)                                                                         \
    {                                                                                            \
        .name = NAME, .row_bytes = q4_0_row_bytes, .encode = q4_0_encode, .decode = q4_0_decode, \
        .head_dim_multiple = QK4_0, .max_abs = 65504.0f * 8.0f,                                  \
    }
static const kvpq__row_codec q4_0_codec = Q4_0_CODEC("q4_0");
KVPQ__ROWS_KIND(q4_0, q4_0_codec, kvpq__rows_create);

/* q4_0r: the same blocks over Walsh-Hadamard-rotated head vectors, as llama.cpp stores a quantized
 * KV cache by default since April 2026 (ggml-org/llama.cpp PR 21038; src/llama-kv-cache.cpp and
 * src/llama-graph.cpp): see kvpq__rows_create_rotated. */
static const kvpq__row_codec q4_0r_codec = Q4_0_CODEC("q4_0r");
KVPQ__ROWS_KIND(q4_0r, q4_0r_codec, kvpq__rows_create_rotated);
