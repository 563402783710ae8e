/* cache_q8_0.c — llama.cpp's Q8_0 KV cache: each head vector in blocks of 32 along head_dim, a
 * block being {fp16 d; int8 qs[32]} (34 bytes, ggml's block_q8_0), x ~= d * qs. Quantization
 * rounds as ggml's quantize_row_q8_0_ref: d = max|x| / 127, qs = roundf(x / d) computed with
 * the float32 d (the stored d is its fp16 rounding). 8.5 bits per element. */
#include <math.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "core/ggml_common.h" /* QK8_0, block_q8_0 */

#define Q8_0_BLOCK_BYTES sizeof(block_q8_0)

static size_t q8_0_row_bytes(int head_dim) { return (size_t)head_dim / QK8_0 * Q8_0_BLOCK_BYTES; }

static void q8_0_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    (void)kr;
    unsigned char *y = rows;
    for (size_t b = 0; b < (size_t)n * head_dim / QK8_0; b++, x += QK8_0, y += Q8_0_BLOCK_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvpq__f2h(d);
        memcpy(y, &dh, 2);
        for (int j = 0; j < QK8_0; j++) y[2 + j] = (unsigned char)(int8_t)roundf(x[j] * id);
    }
}

static void q8_0_decode(const void *rows, int n, int head_dim, float *x, const kvpq_attn_kernels *kr) {
    kr->dequant_q8_0(rows, (size_t)n * head_dim / QK8_0, x);
}

/* The codec of the plain and the rotated kind (NAME). */
#define Q8_0_CODEC(NAME)                                                                         \
    {                                                                                            \
        .name = NAME, .row_bytes = q8_0_row_bytes, .encode = q8_0_encode, .decode = q8_0_decode, \
        .head_dim_multiple = QK8_0, .max_abs = 65504.0f * 127.0f,                                \
    }
static const kvpq__row_codec q8_0_codec = Q8_0_CODEC("q8_0");
KVPQ__ROWS_KIND(q8_0, q8_0_codec, kvpq__rows_create);

/* q8_0r: the same blocks over Walsh-Hadamard-rotated head vectors, as llama.cpp stores a quantized
 * KV cache by default since April 2026 (ggml-org/llama.cpp PR 21038; src/llama-kv-cache.cpp and
 * src/llama-graph.cpp): see kvpq__rows_create_rotated. */
static const kvpq__row_codec q8_0r_codec = Q8_0_CODEC("q8_0r");
KVPQ__ROWS_KIND(q8_0r, q8_0r_codec, kvpq__rows_create_rotated);
