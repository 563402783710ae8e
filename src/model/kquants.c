/* kquants.c — scalar dequantization of the K-quant types (the specification the SIMD kernels of
 * src/cpu/ggml_*.c are tested against). Block layouts and element order: model/kquants.h. */
#include "model/kquants.h"
#include "model/ggml_types.h"

static float half_at(const uint8_t p[2]) { return kvpq_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8))); }

/* Loops go sub-block by sub-block (scales computed once each); the element order is kquants.h's. */

void kvpq__dequant_q2_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q2_K *b = (const kvpq_block_q2_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        for (int h = 0; h < 2; h++)         /* 128 elements: 32 bytes of qs */
            for (int s = 0; s < 4; s++)     /* 32 elements: bits 2s, 2s+1 of those bytes */
                for (int k = 0; k < 2; k++) { /* sub-block of 16 */
                    int sb = b->scales[8 * h + 2 * s + k];
                    float dl = d * (float)(sb & 15), ml = dmin * (float)(sb >> 4);
                    const uint8_t *q = b->qs + 32 * h + 16 * k;
                    for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l] >> (2 * s)) & 3) - ml;
                }
    }
}

void kvpq__dequant_q3_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q3_K *b = (const kvpq_block_q3_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++) {
        float d = half_at(b->d);
        int8_t sc[16];
        kvpq__q3_K_scales(b->scales, sc);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) {
                int j = 4 * h + s; /* 32-element run: the bit of hmask */
                for (int k = 0; k < 2; k++) {
                    float dl = d * (float)sc[2 * j + k];
                    const uint8_t *q = b->qs + 32 * h + 16 * k, *hm = b->hmask + 16 * k;
                    for (int l = 0; l < 16; l++) {
                        int v = ((q[l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
            }
    }
}

void kvpq__dequant_q4_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q4_K *b = (const kvpq_block_q4_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        uint8_t sc[8], m[8];
        kvpq__k4_scale_min(b->scales, sc, m);
        for (int j = 0; j < 8; j++) { /* sub-block j: the low (even j) or high nibbles of 32 bytes */
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            const uint8_t *q = b->qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) *y++ = dl * (float)((q[l] >> (4 * (j % 2))) & 15) - ml;
        }
    }
}

void kvpq__dequant_q5_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q5_K *b = (const kvpq_block_q5_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        uint8_t sc[8], m[8];
        kvpq__k4_scale_min(b->scales, sc, m);
        for (int j = 0; j < 8; j++) {
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            const uint8_t *q = b->qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                int v = ((q[l] >> (4 * (j % 2))) & 15) | (((b->qh[l] >> j) & 1) << 4);
                *y++ = dl * (float)v - ml;
            }
        }
    }
}

void kvpq__dequant_q6_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q6_K *b = (const kvpq_block_q6_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++) {
        float d = half_at(b->d);
        for (int h = 0; h < 2; h++)
            for (int s = 0; s < 4; s++) /* 32-element run s of this half: nibble s/2 of ql, bits 2s of qh */
                for (int k = 0; k < 2; k++) {
                    float dl = d * (float)b->scales[8 * h + 2 * s + k];
                    const uint8_t *ql = b->ql + 64 * h + 32 * (s % 2) + 16 * k, *qh = b->qh + 32 * h + 16 * k;
                    for (int l = 0; l < 16; l++) {
                        int v = ((ql[l] >> (4 * (s / 2))) & 15) | (((qh[l] >> (2 * s)) & 3) << 4);
                        *y++ = dl * (float)(v - 32);
                    }
                }
    }
}
