/* kquants.c — scalar dequantization of the K-quant types (the specification the SIMD kernels of
 * src/cpu/ggml_*.c are tested against). Block layouts and element order: model/kquants.h. */
#include "model/kquants.h"
#include "model/ggml_types.h"

static float half_at(const uint8_t p[2]) { return kvpq_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8))); }

void kvpq__dequant_q2_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q2_K *b = (const kvpq_block_q2_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, s = (e / 32) % 4, l = e % 32, sb = b->scales[e / 16];
            float dl = d * (float)(sb & 15), ml = dmin * (float)(sb >> 4);
            y[e] = dl * (float)((b->qs[32 * h + l] >> (2 * s)) & 3) - ml;
        }
    }
}

void kvpq__dequant_q3_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q3_K *b = (const kvpq_block_q3_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = half_at(b->d);
        int8_t sc[16];
        kvpq__q3_K_scales(b->scales, sc);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, s = (e / 32) % 4, l = e % 32;
            int q = ((b->qs[32 * h + l] >> (2 * s)) & 3) - (((b->hmask[l] >> (e / 32)) & 1) ? 0 : 4);
            y[e] = (d * (float)sc[e / 16]) * (float)q;
        }
    }
}

void kvpq__dequant_q4_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q4_K *b = (const kvpq_block_q4_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        uint8_t sc[8], m[8];
        kvpq__k4_scale_min(b->scales, sc, m);
        for (int e = 0; e < QK_K; e++) {
            int c = e / 64, h = (e / 32) % 2, l = e % 32, j = e / 32;
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            y[e] = dl * (float)((b->qs[32 * c + l] >> (4 * h)) & 15) - ml;
        }
    }
}

void kvpq__dequant_q5_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q5_K *b = (const kvpq_block_q5_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = half_at(b->d), dmin = half_at(b->dmin);
        uint8_t sc[8], m[8];
        kvpq__k4_scale_min(b->scales, sc, m);
        for (int e = 0; e < QK_K; e++) {
            int c = e / 64, h = (e / 32) % 2, l = e % 32, j = e / 32;
            int q = ((b->qs[32 * c + l] >> (4 * h)) & 15) | (((b->qh[l] >> j) & 1) << 4);
            float dl = d * (float)sc[j], ml = dmin * (float)m[j];
            y[e] = dl * (float)q - ml;
        }
    }
}

void kvpq__dequant_q6_K_ref(const uint8_t *src, float *y, int64_t n) {
    const kvpq_block_q6_K *b = (const kvpq_block_q6_K *)(const void *)src;
    for (int64_t i = 0; i < n / QK_K; i++, b++, y += QK_K) {
        float d = half_at(b->d);
        for (int e = 0; e < QK_K; e++) {
            int h = e / 128, r = e % 128;
            int lo = (b->ql[64 * h + r % 64] >> (4 * (r / 64))) & 15, hi = (b->qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
            y[e] = (d * (float)b->scales[e / 16]) * (float)((lo | hi << 4) - 32);
        }
    }
}
