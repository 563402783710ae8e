/* cache_q4_0.c — llama.cpp's Q4_0 KV cache: blocks of 32 along head_dim, a block being
 * {fp16 d; uint8 qs[16]} (18 bytes, ggml's block_q4_0): element j in the low nibble of qs[j],
 * element j+16 in the high nibble, x ~= d * (q - 8). Quantization rounds as ggml's
 * quantize_row_q4_0_ref: d = (the element of largest magnitude, signed) / -8,
 * q = min(15, (int8)(x / d + 8.5)). 4.5 bits per element. */
#include <math.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "core/ggml_common.h" /* QK4_0, block_q4_0 */

static void q4_0_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    (void)kr;
    unsigned char *y = rows;
    for (size_t b = 0; b < (size_t)n * head_dim / QK4_0; b++, x += QK4_0, y += sizeof(block_q4_0)) {
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

KVPQ__GGML_ROWS_KINDS(q4_0, QK4_0, 8.0f);
