/* attn_ref.c — scalar reference kernels of the cache attention paths (the specification the SIMD
 * versions are tested against), and the dispatch on the SIMD level. */
#include <math.h>

#include "core/ggml_common.h"
#include "cpu/attn_kernels.h"
#include "cpu/dispatch.h"

/* Element i of float32 (f32_at) or half (f16_at) rows: the loops below are written once for both. */
static inline float f32_at(const void *x, size_t i) { return ((const float *)x)[i]; }
static inline float f16_at(const void *x, size_t i) { return kvpq__h2f(((const uint16_t *)x)[i]); }

static inline void qk_rows(const float *Q, int R, const void *K, float (*at)(const void *, size_t), int n, int hd,
                           float *S, int lds) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < n; t++) {
            float s = 0.0f;
            for (int c = 0; c < hd; c++) s += Q[(size_t)r * hd + c] * at(K, (size_t)t * hd + c);
            S[(size_t)r * lds + t] = s;
        }
}

static inline void pv_rows(const float *P, int R, int ldp, const void *V, float (*at)(const void *, size_t), int n,
                           int hd, float *O) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < n; t++) {
            float p = P[(size_t)r * ldp + t];
            if (p == 0.0f) continue;
            for (int c = 0; c < hd; c++) O[(size_t)r * hd + c] += p * at(V, (size_t)t * hd + c);
        }
}

static void qk_ref(const float *Q, int R, const float *K, int n, int hd, float *S, int lds) {
    qk_rows(Q, R, K, f32_at, n, hd, S, lds);
}

static void pv_ref(const float *P, int R, int ldp, const float *V, int n, int hd, float *O) {
    pv_rows(P, R, ldp, V, f32_at, n, hd, O);
}

static void qk_f16_ref(const float *Q, int R, const uint16_t *K, int n, int hd, float *S, int lds) {
    qk_rows(Q, R, K, f16_at, n, hd, S, lds);
}

static void pv_f16_ref(const float *P, int R, int ldp, const uint16_t *V, int n, int hd, float *O) {
    pv_rows(P, R, ldp, V, f16_at, n, hd, O);
}

static void qk_t_ref(const float *QT, int ldq, int R, const float *K, int n, int hd, float *ST, int lds) {
    for (int t = 0; t < n; t++)
        for (int r = 0; r < R; r++) {
            float s = 0.0f;
            for (int c = 0; c < hd; c++) s += K[(size_t)t * hd + c] * QT[(size_t)c * ldq + r];
            ST[(size_t)t * lds + r] = s;
        }
}

static void pv_t_ref(const float *PT, int ldp, int R, const float *V, int n, int hd, float *OT, int ldo) {
    for (int t = 0; t < n; t++)
        for (int c = 0; c < hd; c++)
            for (int r = 0; r < R; r++) OT[(size_t)c * ldo + r] += V[(size_t)t * hd + c] * PT[(size_t)t * ldp + r];
}

static void softmax_t_ref(float *ST, int lds, int n, int R, float *m, float *d, float *OT, int ldo, int hd) {
    for (int r = 0; r < R; r++) {
        float mx = m[r];
        for (int t = 0; t < n; t++) mx = ST[(size_t)t * lds + r] > mx ? ST[(size_t)t * lds + r] : mx;
        const float ms = mx == -INFINITY ? 0.0f : mx, e = m[r] == -INFINITY ? 0.0f : expf(m[r] - ms);
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            float *x = &ST[(size_t)t * lds + r];
            *x = *x == -INFINITY ? 0.0f : expf(*x - ms);
            sum += *x;
        }
        d[r] = d[r] * e + sum;
        for (int c = 0; c < hd; c++) OT[(size_t)c * ldo + r] *= e;
        m[r] = mx;
    }
}

static float max_ref(const float *x, int n) {
    float m = x[0];
    for (int i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static float exp_sum_ref(float *x, int n, float m) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        s += x[i];
    }
    return s;
}

static void scale_ref(float *x, int n, float s) {
    for (int i = 0; i < n; i++) x[i] *= s;
}

static void f16_to_f32_ref(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq__h2f(src[i]);
}

static void f32_to_f16_ref(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq__f2h(src[i]);
}

/* ggml blocks: the scalar block dequantization of core/ggml_common.h. */
static void dequant_q8_0_ref(const void *blocks, size_t n_blocks, float *x) {
    const uint8_t *y = blocks;
    for (size_t b = 0; b < n_blocks; b++, x += QK8_0, y += sizeof(block_q8_0)) kvpq__block_q8_0_ref(y, x);
}

static void dequant_q4_0_ref(const void *blocks, size_t n_blocks, float *x) {
    const uint8_t *y = blocks;
    for (size_t b = 0; b < n_blocks; b++, x += QK4_0, y += sizeof(block_q4_0)) kvpq__block_q4_0_ref(y, x);
}

static void dequant_bits_ref(const unsigned char *codes, int bits, int n, const float *scale, const float *min,
                             float *x) {
    const int mask = (1 << bits) - 1;
    for (int c = 0; c < n; c++) {
        int q = (codes[c * bits / 8] >> (c * bits % 8)) & mask;
        x[c] = fmaf((float)q, scale[c], min[c]);
    }
}

static void dequant_bits_g32_ref(const unsigned char *codes, int bits, int n, const float *scale32,
                                 const float *min32, float *x) {
    const int mask = (1 << bits) - 1;
    for (int c = 0; c < n; c++) {
        int q = (codes[c * bits / 8] >> (c * bits % 8)) & mask;
        x[c] = fmaf((float)q, scale32[c / 32], min32[c / 32]);
    }
}

const kvpq_attn_kernels kvpq__attn_ref = {
    .name = "scalar",
    .qk = qk_ref,
    .pv = pv_ref,
    .qk_f16 = qk_f16_ref,
    .pv_f16 = pv_f16_ref,
    .qk_t = qk_t_ref,
    .pv_t = pv_t_ref,
    .softmax_t = softmax_t_ref,
    .max = max_ref,
    .exp_sum = exp_sum_ref,
    .scale = scale_ref,
    .f16_to_f32 = f16_to_f32_ref,
    .f32_to_f16 = f32_to_f16_ref,
    .dequant_q8_0 = dequant_q8_0_ref,
    .dequant_q4_0 = dequant_q4_0_ref,
    .dequant_bits = dequant_bits_ref,
    .dequant_bits_g32 = dequant_bits_g32_ref,
};

/* The one CPU kernel table (dispatch.c) holds the attention kernels of each level. */
const kvpq_attn_kernels *kvpq__attn_kernels_for(kvpq_simd_level level) { return kvpq__cpu_kernels_for(level)->attn; }

const kvpq_attn_kernels *kvpq__attn_kernels(void) { return kvpq__cpu_kernels()->attn; }
