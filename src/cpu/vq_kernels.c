/* vq_kernels.c — scalar reference kernels of attention from PQ codes, and their dispatch table.
 * The shapes and the math are documented in vq_kernels.h. */
#include <math.h>

#include "cpu/vq_kernels.h"
#include "model/ggml_types.h"

// ---- reference kernels ----------------------------------------------------------------------

#define VQ_SCORE_REF(NAME, T)                                                                     \
    void NAME(int n, int M, int ksub, int gp, const T *codes, const float *lut, float *s) {       \
        for (int t = 0; t < n; t++) {                                                             \
            const T *c = codes + (size_t)t * M;                                                   \
            float *st = s + (size_t)t * gp;                                                       \
            for (int g = 0; g < gp; g++) st[g] = 0.0f;                                            \
            for (int m = 0; m < M; m++) {                                                         \
                const float *row = lut + ((size_t)m * ksub + c[m]) * gp;                          \
                for (int g = 0; g < gp; g++) st[g] += row[g];                                     \
            }                                                                                     \
        }                                                                                         \
    }
VQ_SCORE_REF(kvpq__vq_score_u8_ref, uint8_t)
VQ_SCORE_REF(kvpq__vq_score_u16_ref, uint16_t)

#define VQ_ACCUM_REF(NAME, T)                                                                     \
    void NAME(int n, int M, int ksub, int gp, const T *codes, const float *p, float *table) {     \
        for (int t = 0; t < n; t++) {                                                             \
            const T *c = codes + (size_t)t * M;                                                   \
            const float *pt = p + (size_t)t * gp;                                                 \
            for (int m = 0; m < M; m++) {                                                         \
                float *row = table + ((size_t)m * ksub + c[m]) * gp;                              \
                for (int g = 0; g < gp; g++) row[g] += pt[g];                                     \
            }                                                                                     \
        }                                                                                         \
    }
VQ_ACCUM_REF(kvpq__vq_accum_u8_ref, uint8_t)
VQ_ACCUM_REF(kvpq__vq_accum_u16_ref, uint16_t)

int kvpq__vq_softmax_step_ref(int n, int gp, float *s, float *m, float *d, float *rescale) {
    int any = 0;
    for (int g = 0; g < gp; g++) {
        float mx = s[g];
        for (int t = 1; t < n; t++) mx = fmaxf(mx, s[(size_t)t * gp + g]);
        float m_new = fmaxf(m[g], mx);
        rescale[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
        if (rescale[g] != 1.0f) any = 1;
        float sum = 0.0f;
        for (int t = 0; t < n; t++) {
            float e = expf(s[(size_t)t * gp + g] - m_new);
            s[(size_t)t * gp + g] = e;
            sum += e;
        }
        d[g] = d[g] * rescale[g] + sum;
        m[g] = m_new;
    }
    return any;
}

void kvpq__vq_scale_rows_ref(size_t rows, int gp, const float *rescale, float *table) {
    for (size_t r = 0; r < rows; r++)
        for (int g = 0; g < gp; g++) table[r * gp + g] *= rescale[g];
}

void kvpq__vq_lut_build_ref(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                            float *lut) {
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub, *q = qt + (size_t)m * dsub * gp;
        for (int c = 0; c < ksub; c++) {
            float *r = lut + ((size_t)m * ksub + c) * gp;
            for (int g = 0; g < gp; g++) {
                float a = 0.0f;
                for (int j = 0; j < dsub; j++) a += book[(size_t)c * dsub + j] * q[j * gp + g];
                r[g] = a;
            }
        }
    }
}

void kvpq__vq_table_out_ref(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                            float *out) {
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub;
        float *o = out + (size_t)m * dsub * gp;
        for (int i = 0; i < dsub * gp; i++) o[i] = 0.0f;
        for (int c = 0; c < ksub; c++) {
            const float *w = table + ((size_t)m * ksub + c) * gp;
            for (int j = 0; j < dsub; j++)
                for (int g = 0; g < gp; g++) o[j * gp + g] += book[(size_t)c * dsub + j] * w[g];
        }
    }
}

void kvpq__vq_weighted_sum_ref(int n, int d, const float *p, const float *v, float *out) {
    for (int j = 0; j < d; j++) out[j] = 0.0f;
    for (int t = 0; t < n; t++)
        for (int j = 0; j < d; j++) out[j] += p[t] * v[(size_t)t * d + j];
}

void kvpq__vq_dot_rows_ref(int n, int d, const float *q, const float *k, float *out) {
    for (int t = 0; t < n; t++) {
        float acc = 0.0f;
        for (int j = 0; j < d; j++) acc += q[j] * k[(size_t)t * d + j];
        out[t] = acc;
    }
}

void kvpq__vq_f16_to_f32_ref(size_t n, const uint16_t *src, float *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq_fp16_to_fp32(src[i]);
}

void kvpq__vq_f32_to_f16_ref(size_t n, const float *src, uint16_t *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq_fp32_to_fp16(src[i]);
}

// ---- dispatch -------------------------------------------------------------------------------

static kvpq_vq_kernels tables[3];
static int tables_ready;

static void init_tables(void) {
    kvpq_vq_kernels ref = {
        .score_u8 = kvpq__vq_score_u8_ref,
        .score_u16 = kvpq__vq_score_u16_ref,
        .accum_u8 = kvpq__vq_accum_u8_ref,
        .accum_u16 = kvpq__vq_accum_u16_ref,
        .softmax_step = kvpq__vq_softmax_step_ref,
        .scale_rows = kvpq__vq_scale_rows_ref,
        .lut_build = kvpq__vq_lut_build_ref,
        .table_out = kvpq__vq_table_out_ref,
        .weighted_sum = kvpq__vq_weighted_sum_ref,
        .dot_rows = kvpq__vq_dot_rows_ref,
        .f16_to_f32 = kvpq__vq_f16_to_f32_ref,
        .f32_to_f16 = kvpq__vq_f32_to_f16_ref,
    };
    tables[0] = tables[1] = tables[2] = ref;
#if defined(__x86_64__)
    kvpq__vq_kernels_avx2(&tables[1]);
    tables[2] = tables[1];
    kvpq__vq_kernels_avx512(&tables[2]);
#endif
}

const kvpq_vq_kernels *kvpq__vq_kernels(kvpq_simd_level level) {
    /* Filling the same constant tables twice from two threads is harmless; do it once up front. */
    if (!tables_ready) {
#pragma omp critical(kvpq_vq_kernels_init)
        {
            if (!tables_ready) {
                init_tables();
                tables_ready = 1;
            }
        }
    }
    int i = (int)level;
    if (i < 0) i = 0;
    if (i > 2) i = 2;
    return &tables[i];
}
