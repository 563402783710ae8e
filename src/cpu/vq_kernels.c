/* vq_kernels.c — scalar reference kernels of attention from PQ codes, and their dispatch table.
 * The shapes and the math are documented in vq_kernels.h. */
#include <math.h>

#include "cpu/dispatch.h"
#include "cpu/vq_kernels.h"
#include "cpu/vq_rows.h"
#include "core/fp16.h"

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

void kvpq__vq_score_fs_u8_ref(int n, int M, int G, int gp, const uint8_t *codes, const uint8_t *lut8,
                              const float *scale, const float *bias, float *s) {
    for (int t = 0; t < n; t++) {
        const uint8_t *c = codes + (size_t)t * M;
        for (int g = 0; g < gp; g++) {
            if (g >= G) {
                s[(size_t)t * gp + g] = 0.0f;
                continue;
            }
            uint32_t a = 0;
            for (int m = 0; m < M; m++) a += lut8[((size_t)g * M + m) * 256 + c[m]];
            s[(size_t)t * gp + g] = fmaf(scale[g], (float)a, bias[g]);
        }
    }
}

/* min and max over c of lut[m][c][g0 + g] for g < ng; chk[g] turns NaN once an entry is NaN or
 * infinite. Heads are innermost in lut, so the inner loops run over contiguous lanes. */
static void lut_minmax(int ksub, int gp, int ng, const float *lm, float *lo, float *hi, float *chk) {
    for (int g = 0; g < ng; g++) lo[g] = INFINITY, hi[g] = -INFINITY;
    for (int c = 0; c < ksub; c++) {
        const float *r = lm + (size_t)c * gp;
        for (int g = 0; g < ng; g++) {
            lo[g] = r[g] < lo[g] ? r[g] : lo[g];
            hi[g] = r[g] > hi[g] ? r[g] : hi[g];
            chk[g] += r[g] * 0.0f;
        }
    }
}

void kvpq__vq_lut_quantize(int M, int ksub, int gp, int G, const float *lut, uint8_t *lut8, float *scale, float *bias) {
    for (int g0 = 0; g0 < G; g0 += 64) { /* lanes in slices of 64 */
        const int ng = G - g0 < 64 ? G - g0 : 64;
        float rng[64], chk[64], lo[64], hi[64], inv[64];
        double b[64];
        for (int g = 0; g < ng; g++) rng[g] = chk[g] = 0.0f, b[g] = 0.0;
        for (int m = 0; m < M; m++) {
            lut_minmax(ksub, gp, ng, lut + (size_t)m * ksub * gp + g0, lo, hi, chk);
            for (int g = 0; g < ng; g++) {
                rng[g] = hi[g] - lo[g] > rng[g] ? hi[g] - lo[g] : rng[g];
                b[g] += lo[g];
            }
        }
        for (int g = 0; g < ng; g++) {
            const int finite = chk[g] == 0.0f;
            const float delta = finite && rng[g] > 0.0f ? rng[g] / 255.0f : 1.0f;
            inv[g] = 1.0f / delta;
            scale[g0 + g] = finite ? delta : NAN;
            bias[g0 + g] = finite ? (float)b[g] : NAN;
            if (!finite) inv[g] = 0.0f; /* codes 0; the NaN scale makes the scores NaN */
        }
        for (int m = 0; m < M; m++) {
            const float *lm = lut + (size_t)m * ksub * gp + g0;
            float dummy[64] = {0};
            lut_minmax(ksub, gp, ng, lm, lo, hi, dummy);
            for (int c = 0; c < ksub; c++)
                for (int g = 0; g < ng; g++) {
                    float q = inv[g] > 0.0f ? (lm[(size_t)c * gp + g] - lo[g]) * inv[g] + 0.5f : 0.0f;
                    /* q >= 0.5 for finite input: truncation rounds to nearest */
                    lut8[((size_t)(g0 + g) * M + m) * ksub + c] = (uint8_t)(q < 255.0f ? q : 255.0f);
                }
        }
    }
}

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

void kvpq__vq_accum_dec_u8_ref(int n, int M, int dsub, int n_books, const float *cent, int gp, int G,
                               const uint8_t *codes, const float *p, float *o) {
    const int d = M * dsub;
    for (int t = 0; t < n; t++)
        for (int m = 0; m < M; m++) {
            const float *cv = cent + ((size_t)(n_books == 1 ? 0 : m) * 256 + codes[(size_t)t * M + m]) * dsub;
            for (int g = 0; g < G; g++)
                for (int j = 0; j < dsub; j++) o[(size_t)g * d + m * dsub + j] += p[(size_t)t * gp + g] * cv[j];
        }
}

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

void kvpq__vq_exp_sum_ref(int n, int gp, float *s, const float *m, float *sum) {
    for (int g = 0; g < gp; g++) {
        float a = 0.0f;
        for (int t = 0; t < n; t++) {
            float e = expf(s[(size_t)t * gp + g] - m[g]);
            s[(size_t)t * gp + g] = e;
            a += e;
        }
        sum[g] += a;
    }
}

void kvpq__vq_lane_max_ref(int n, int gp, const float *s, float *mx) {
    for (int g = 0; g < gp; g++) {
        float a = -INFINITY;
        for (int t = 0; t < n; t++) a = s[(size_t)t * gp + g] > a ? s[(size_t)t * gp + g] : a;
        mx[g] = a;
    }
}

void kvpq__vq_scale_tokens_ref(int n, int gp, float *s, const uint16_t *scale, const float *bias) {
    for (int t = 0; t < n; t++) {
        float f;
        kvpq__vq_f16_to_f32_ref(1, scale + t, &f);
        for (int g = 0; g < gp; g++) s[(size_t)t * gp + g] = s[(size_t)t * gp + g] * f + (bias ? bias[g] : 0.0f);
    }
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

void kvpq__vq_fwht_rows_ref(size_t n, int d, float scale, float *x) {
    for (size_t i = 0; i < n; i++) {
        float *r = x + i * (size_t)d;
        for (int h = 1; h < d; h <<= 1)
            for (int b = 0; b < d; b += h << 1)
                for (int j = b; j < b + h; j++) {
                    const float u = r[j], v = r[j + h];
                    r[j] = u + v;
                    r[j + h] = u - v;
                }
        for (int j = 0; j < d; j++) r[j] *= scale;
    }
}

void kvpq__vq_gather_u8_ref(size_t n, int M, int dsub, int n_books, int ksub, const float *cent, const uint8_t *codes,
                            size_t stride, int add, float *x) {
    vq_rows_gather_u8(n, M, dsub, n_books, ksub, cent, codes, stride, add, x);
}

void kvpq__vq_affine_rows_ref(size_t n, int d, const float *a, const float *b, float *x) { vq_rows_affine(n, d, a, b, x); }

void kvpq__vq_rope_steps_ref(size_t n, int n_head, int half, int neox, size_t pos_stride, size_t head_stride,
                             double *cs, float *cf, float *x) {
    vq_rows_rope_steps(n, n_head, half, neox, pos_stride, head_stride, cs, cf, x);
}

void kvpq__vq_f16_to_f32_ref(size_t n, const uint16_t *src, float *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq__h2f(src[i]);
}

void kvpq__vq_f32_to_f16_ref(size_t n, const float *src, uint16_t *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = kvpq__f2h(src[i]);
}

// ---- dispatch -------------------------------------------------------------------------------

void kvpq__vq_kernels_ref(kvpq_vq_kernels *k) {
    const kvpq_vq_kernels ref = {
        .score_u8 = kvpq__vq_score_u8_ref,
        .score_u16 = kvpq__vq_score_u16_ref,
        .score_fs_u8 = kvpq__vq_score_fs_u8_ref,
        .accum_u8 = kvpq__vq_accum_u8_ref,
        .accum_u16 = kvpq__vq_accum_u16_ref,
        .softmax_step = kvpq__vq_softmax_step_ref,
        .exp_sum = kvpq__vq_exp_sum_ref,
        .lane_max = kvpq__vq_lane_max_ref,
        .scale_rows = kvpq__vq_scale_rows_ref,
        .scale_tokens = kvpq__vq_scale_tokens_ref,
        .lut_build = kvpq__vq_lut_build_ref,
        .table_out = kvpq__vq_table_out_ref,
        .weighted_sum = kvpq__vq_weighted_sum_ref,
        .dot_rows = kvpq__vq_dot_rows_ref,
        .f16_to_f32 = kvpq__vq_f16_to_f32_ref,
        .f32_to_f16 = kvpq__vq_f32_to_f16_ref,
        .fwht_rows = kvpq__vq_fwht_rows_ref,
        .gather_u8 = kvpq__vq_gather_u8_ref,
        .affine_rows = kvpq__vq_affine_rows_ref,
        .rope_steps = kvpq__vq_rope_steps_ref,
    };
    *k = ref;
}

/* The one CPU kernel table (dispatch.c) holds the VQ kernels of each level. */
const kvpq_vq_kernels *kvpq__vq_kernels(kvpq_simd_level level) { return &kvpq__cpu_kernels_for(level)->vq; }
