/* cache_q8_0.c — llama.cpp's Q8_0 KV cache: each head vector in blocks of 32 along head_dim, a
 * block being {fp16 d; int8 qs[32]} (34 bytes, ggml's block_q8_0), x ~= d * qs. Quantization
 * rounds as ggml's quantize_row_q8_0_ref: d = max|x| / 127, qs = roundf(x / d) computed with
 * the float32 d (the stored d is its fp16 rounding). 8.5 bits per element. */
#include <math.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "core/ggml_common.h" /* QK8_0, block_q8_0 */

static void q8_0_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    (void)kr;
    unsigned char *y = rows;
    for (size_t b = 0; b < (size_t)n * head_dim / QK8_0; b++, x += QK8_0, y += sizeof(block_q8_0)) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint16_t dh = kvpq__f2h(d);
        memcpy(y, &dh, 2);
        for (int j = 0; j < QK8_0; j++) y[2 + j] = (unsigned char)(int8_t)roundf(x[j] * id);
    }
}

KVPQ__GGML_ROWS_KINDS(q8_0, QK8_0, 127.0f);
