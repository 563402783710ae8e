/* vq_body.h — the width-generic kernels of attention from PQ codes (see vq_kernels.h; the *_ref in
 * vq_kernels.c are the specification), written once on simd.h and compiled per ISA by vq_avx2.c and
 * vq_avx512.c. Those files add what only their ISA has (4-lane rows at AVX2, fast-scan, decoded
 * values and 4-centroid permutes at AVX-512) and their dispatchers.
 *
 * A table row of a GQA group is gp floats (heads innermost). The kernels here take the groups whose
 * rows are whole vectors (gp a multiple of W), or whose lane pattern repeats with a period of
 * vw = max(gp, W) floats (gp dividing W or a multiple of it, up to GP_MAX); other shapes go to
 * VQ_NEXT(name), the next narrower level's kernel, which the including file defines
 * (AVX-512 -> AVX2 -> _ref). */
#include <math.h>
#include <string.h>

#include "cpu/simd.h"
#include "cpu/vq_kernels.h"
#include "cpu/vq_rows.h"

#ifndef VQ_NEXT
#error "define VQ_NEXT(name) (the next narrower level's kernel) before including vq_body.h"
#endif

#define W KVPQ_VW
#define GP_MAX 64 /* wider groups use the next level */

/* gp's lane pattern repeats with a period of whole vectors. */
static inline int period_ok(int gp) { return gp <= GP_MAX && (W % gp == 0 || gp % W == 0); }

// ---- scores and accumulation: rows of whole vectors ------------------------------------------

/* Two accumulators over the sub-spaces (even, odd) for latency. */
#define VQ_SCORE_LANES(NAME, T)                                                                     \
    static void NAME##_w(int n, int M, int ksub, int gp, const T *codes, const float *lut, float *s) {     \
        const size_t ms = (size_t)ksub * gp; /* stride between sub-spaces */                        \
        for (int t = 0; t < n; t++) {                                                               \
            const T *c = codes + (size_t)t * M;                                                     \
            for (int b = 0; b < gp; b += W) {                                                       \
                kvpq_vf a0 = vf_zero(), a1 = vf_zero();                                             \
                int m = 0;                                                                          \
                for (; m + 1 < M; m += 2) {                                                         \
                    a0 = vf_add(a0, vf_load(lut + m * ms + (size_t)c[m] * gp + b));                 \
                    a1 = vf_add(a1, vf_load(lut + (m + 1) * ms + (size_t)c[m + 1] * gp + b));       \
                }                                                                                   \
                if (m < M) a0 = vf_add(a0, vf_load(lut + m * ms + (size_t)c[m] * gp + b));          \
                vf_store(s + (size_t)t * gp + b, vf_add(a0, a1));                                   \
            }                                                                                       \
        }                                                                                           \
    }
VQ_SCORE_LANES(score_u8, uint8_t)
VQ_SCORE_LANES(score_u16, uint16_t)

/* Exact: every table row gets its weights added in token order, as in the reference. */
#define VQ_ACCUM_LANES(NAME, T)                                                                     \
    static void NAME##_w(int n, int M, int ksub, int gp, const T *codes, const float *p, float *table) {   \
        const size_t ms = (size_t)ksub * gp;                                                        \
        for (int t = 0; t < n; t++) {                                                               \
            const T *c = codes + (size_t)t * M;                                                     \
            for (int b = 0; b < gp; b += W) {                                                       \
                const kvpq_vf pv = vf_load(p + (size_t)t * gp + b);                                 \
                for (int m = 0; m < M; m++) {                                                       \
                    float *row = table + m * ms + (size_t)c[m] * gp + b;                            \
                    vf_store(row, vf_add(vf_load(row), pv));                                        \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }
VQ_ACCUM_LANES(accum_u8, uint8_t)
VQ_ACCUM_LANES(accum_u16, uint16_t)

/* gp a multiple of W: the kernels above; other groups: the next level's. */
#define VQ_LANES(NAME, T)                                                                                \
    static void NAME##_lanes(int n, int M, int ksub, int gp, const T *codes, const float *in, float *out) { \
        (gp % W ? VQ_NEXT(NAME) : NAME##_w)(n, M, ksub, gp, codes, in, out);                            \
    }
VQ_LANES(score_u8, uint8_t)
VQ_LANES(score_u16, uint16_t)
VQ_LANES(accum_u8, uint8_t)
VQ_LANES(accum_u16, uint16_t)

// ---- online softmax: lane patterns of period vw ----------------------------------------------

/* s[i] <- exp(s[i] - pat[i % vw]) over total floats; lanes (vw) gets the per-lane sums (lanes of a
 * partial last period included, the others add nothing). Two periods per step when vw = W. */
static void exp_period(size_t total, int vw, const float *pat, float *s, float *lanes) {
    kvpq_vf acc[GP_MAX / W], acc2 = vf_zero();
    for (int b = 0; b < vw / W; b++) acc[b] = vf_zero();
    size_t i = 0;
    if (vw == W) {
        const kvpq_vf mv = vf_load(pat);
        for (; i + 2 * W <= total; i += 2 * W) {
            const kvpq_vf e0 = vf_exp(vf_sub(vf_load(s + i), mv)), e1 = vf_exp(vf_sub(vf_load(s + i + W), mv));
            vf_store(s + i, e0);
            vf_store(s + i + W, e1);
            acc[0] = vf_add(acc[0], e0);
            acc2 = vf_add(acc2, e1);
        }
    }
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / W; b++) {
            const kvpq_vf e = vf_exp(vf_sub(vf_load(s + i + b * W), vf_load(pat + b * W)));
            vf_store(s + i + b * W, e);
            acc[b] = vf_add(acc[b], e);
        }
    for (int b = 0; b < vw / W && i + b * W < total; b++) { /* partial period: masked */
        const int nl = total - i - b * W < (size_t)W ? (int)(total - i - b * W) : W;
        const kvpq_vf e = vf_exp(vf_sub(vf_load_n(s + i + b * W, nl), vf_load(pat + b * W)));
        vf_store_n(s + i + b * W, e, nl);
        acc[b] = vf_add(acc[b], vf_blend(vf_zero(), e, vm_first(nl)));
    }
    acc[0] = vf_add(acc[0], acc2);
    for (int b = 0; b < vw / W; b++) vf_store(lanes + b * W, acc[b]);
}

int KVPQ_ISA_FN(kvpq__vq_softmax_step)(int n, int gp, float *s, float *m, float *d, float *rescale) {
    if (!period_ok(gp)) return VQ_NEXT(softmax_step)(n, gp, s, m, d, rescale);
    const size_t total = (size_t)n * gp;
    const int vw = gp < W ? W : gp;
    float mx[GP_MAX], pat[GP_MAX], lanes[GP_MAX], sum[GP_MAX];
    /* Chunk maximum per lane: full periods of vw floats, folded to gp lanes, then the rest. */
    kvpq_vf vmax[GP_MAX / W];
    for (int b = 0; b < vw / W; b++) vmax[b] = vf_set1(-INFINITY);
    size_t i = 0;
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / W; b++) vmax[b] = vf_max(vmax[b], vf_load(s + i + b * W));
    for (int b = 0; b < vw / W; b++) vf_store(lanes + b * W, vmax[b]);
    for (int g = 0; g < gp; g++) mx[g] = -INFINITY;
    for (int l = 0; l < vw; l++) mx[l % gp] = fmaxf(mx[l % gp], lanes[l]);
    for (size_t j = i; j < total; j++) mx[j % gp] = fmaxf(mx[j % gp], s[j]);
    int any = 0;
    for (int g = 0; g < gp; g++) {
        float m_new = fmaxf(m[g], mx[g]);
        rescale[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
        if (rescale[g] != 1.0f) any = 1;
        m[g] = m_new;
    }
    for (int l = 0; l < vw; l++) pat[l] = m[l % gp];
    exp_period(total, vw, pat, s, lanes);
    for (int g = 0; g < gp; g++) sum[g] = 0.0f;
    for (int l = 0; l < vw; l++) sum[l % gp] += lanes[l];
    for (int g = 0; g < gp; g++) d[g] = d[g] * rescale[g] + sum[g];
    return any;
}

void KVPQ_ISA_FN(kvpq__vq_exp_sum)(int n, int gp, float *s, const float *m, float *sum) {
    if (!period_ok(gp)) {
        VQ_NEXT(exp_sum)(n, gp, s, m, sum);
        return;
    }
    const int vw = gp < W ? W : gp;
    float pat[GP_MAX], lanes[GP_MAX];
    for (int l = 0; l < vw; l++) pat[l] = m[l % gp];
    exp_period((size_t)n * gp, vw, pat, s, lanes);
    for (int l = 0; l < vw; l++) sum[l % gp] += lanes[l];
}

/* vf_max(s, acc) returns acc when s is NaN, so NaN entries are skipped as in the reference. Four
 * accumulators when the period is one vector. Exact (a maximum does not round). */
void KVPQ_ISA_FN(kvpq__vq_lane_max)(int n, int gp, const float *s, float *mx) {
    if (!period_ok(gp)) {
        VQ_NEXT(lane_max)(n, gp, s, mx);
        return;
    }
    const size_t total = (size_t)n * gp;
    const int vw = gp < W ? W : gp;
    float lanes[GP_MAX];
    kvpq_vf acc[GP_MAX / W > 4 ? GP_MAX / W : 4];
    for (int b = 0; b < 4 || b < vw / W; b++) acc[b] = vf_set1(-INFINITY);
    size_t i = 0;
    if (vw == W) {
        for (; i + 4 * W <= total; i += 4 * W)
            for (int b = 0; b < 4; b++) acc[b] = vf_max(vf_load(s + i + b * W), acc[b]);
        acc[0] = vf_max(vf_max(acc[0], acc[1]), vf_max(acc[2], acc[3]));
    }
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / W; b++) acc[b] = vf_max(vf_load(s + i + b * W), acc[b]);
    for (int b = 0; b < vw / W; b++) vf_store(lanes + b * W, acc[b]);
    for (int g = 0; g < gp; g++) mx[g] = -INFINITY;
    for (int l = 0; l < vw; l++) mx[l % gp] = lanes[l] > mx[l % gp] ? lanes[l] : mx[l % gp];
    for (; i < total; i++) mx[i % gp] = s[i] > mx[i % gp] ? s[i] : mx[i % gp];
}

void KVPQ_ISA_FN(kvpq__vq_scale_rows)(size_t rows, int gp, const float *rescale, float *table) {
    if (!period_ok(gp)) {
        VQ_NEXT(scale_rows)(rows, gp, rescale, table);
        return;
    }
    const size_t total = rows * gp;
    const int vw = gp < W ? W : gp;
    float pat[GP_MAX];
    for (int l = 0; l < vw; l++) pat[l] = rescale[l % gp];
    size_t i = 0;
    for (; i + vw <= total; i += vw)
        for (int b = 0; b < vw / W; b++) vf_store(table + i + b * W, vf_mul(vf_load(table + i + b * W), vf_load(pat + b * W)));
    for (; i < total; i++) table[i] *= rescale[i % gp];
}

// ---- window: dot products, weighted sums, fp16 conversion --------------------------------------

void KVPQ_ISA_FN(kvpq__vq_dot_rows)(int n, int d, const float *q, const float *k, float *out) {
    if (d % (2 * W)) {
        VQ_NEXT(dot_rows)(n, d, q, k, out);
        return;
    }
    for (int t = 0; t < n; t++) {
        const float *kt = k + (size_t)t * d;
        kvpq_vf a0 = vf_zero(), a1 = vf_zero();
        for (int j = 0; j < d; j += 2 * W) {
            a0 = vf_fma(vf_load(q + j), vf_load(kt + j), a0);
            a1 = vf_fma(vf_load(q + j + W), vf_load(kt + j + W), a1);
        }
        out[t] = vf_reduce_add(vf_add(a0, a1));
    }
}

void KVPQ_ISA_FN(kvpq__vq_weighted_sum)(int n, int d, const float *p, const float *v, float *out) {
    if (d % W || d > 512) {
        VQ_NEXT(weighted_sum)(n, d, p, v, out);
        return;
    }
    kvpq_vf acc[512 / W];
    for (int j = 0; j < d / W; j++) acc[j] = vf_zero();
    for (int t = 0; t < n; t++) {
        const kvpq_vf pt = vf_set1(p[t]);
        const float *vt = v + (size_t)t * d;
        for (int j = 0; j < d / W; j++) acc[j] = vf_fma(pt, vf_load(vt + j * W), acc[j]);
    }
    for (int j = 0; j < d / W; j++) vf_store(out + j * W, acc[j]);
}

void KVPQ_ISA_FN(kvpq__vq_f16_to_f32)(size_t n, const uint16_t *src, float *dst) {
    size_t i = 0;
    for (; i + W <= n; i += W) vf_store(dst + i, vf_load_f16(src + i));
    for (; i < n; i++) dst[i] = vs_h2f(src[i]);
}

void KVPQ_ISA_FN(kvpq__vq_f32_to_f16)(size_t n, const float *src, uint16_t *dst) {
    size_t i = 0;
    for (; i + W <= n; i += W) vf_store_f16(dst + i, vf_load(src + i));
    for (; i < n; i++) dst[i] = vs_f2h(src[i]);
}

// ---- LUT build and value output: one W-lane FMA per (m, c, j) ----------------------------------

static void lut_build_w(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                        float *lut) {
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub, *q = qt + (size_t)m * dsub * gp;
        float *out = lut + (size_t)m * ksub * gp;
        for (int b = 0; b < gp; b += W)
            for (int c = 0; c < ksub; c++) {
                const float *cv = book + (size_t)c * dsub;
                kvpq_vf a = vf_mul(vf_set1(cv[0]), vf_load(q + b));
                for (int j = 1; j < dsub; j++) a = vf_fma(vf_set1(cv[j]), vf_load(q + j * gp + b), a);
                vf_store(out + (size_t)c * gp + b, a);
            }
    }
}

static void table_out_w(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                        float *out) {
    for (int m = 0; m < M; m++) {
        const float *book = cent + (size_t)(n_books == 1 ? 0 : m) * ksub * dsub;
        const float *tm = table + (size_t)m * ksub * gp;
        float *o = out + (size_t)m * dsub * gp;
        for (int b = 0; b < gp; b += W) {
            kvpq_vf acc[16];
            for (int j = 0; j < dsub; j++) acc[j] = vf_zero();
            for (int c = 0; c < ksub; c++) {
                const kvpq_vf w = vf_load(tm + (size_t)c * gp + b);
                const float *cv = book + (size_t)c * dsub;
                for (int j = 0; j < dsub; j++) acc[j] = vf_fma(vf_set1(cv[j]), w, acc[j]);
            }
            for (int j = 0; j < dsub; j++) vf_store(o + j * gp + b, acc[j]);
        }
    }
}

/* gp a multiple of W: the kernels above; other groups: the next level's. */
static void lut_build_lanes(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *qt,
                            float *lut) {
    (gp % W ? VQ_NEXT(lut_build) : lut_build_w)(M, ksub, dsub, n_books, cent, gp, qt, lut);
}

static void table_out_lanes(int M, int ksub, int dsub, int n_books, const float *cent, int gp, const float *table,
                            float *out) {
    (gp % W ? VQ_NEXT(table_out) : table_out_w)(M, ksub, dsub, n_books, cent, gp, table, out);
}

/* The kernels of this body into a table; the including file sets the rest after it. */
static void vq_body_fill(kvpq_vq_kernels *k) {
    k->score_u8 = score_u8_lanes;
    k->score_u16 = score_u16_lanes;
    k->accum_u8 = accum_u8_lanes;
    k->accum_u16 = accum_u16_lanes;
    k->softmax_step = KVPQ_ISA_FN(kvpq__vq_softmax_step);
    k->exp_sum = KVPQ_ISA_FN(kvpq__vq_exp_sum);
    k->lane_max = KVPQ_ISA_FN(kvpq__vq_lane_max);
    k->scale_rows = KVPQ_ISA_FN(kvpq__vq_scale_rows);
    k->dot_rows = KVPQ_ISA_FN(kvpq__vq_dot_rows);
    k->gather_u8 = vq_rows_gather_u8; /* vq_rows.h, vectorized for this ISA */
    k->affine_rows = vq_rows_affine;
    k->rope_steps = vq_rows_rope_steps;
    k->weighted_sum = KVPQ_ISA_FN(kvpq__vq_weighted_sum);
    k->f16_to_f32 = KVPQ_ISA_FN(kvpq__vq_f16_to_f32);
    k->f32_to_f16 = KVPQ_ISA_FN(kvpq__vq_f32_to_f16);
    k->lut_build = lut_build_lanes;
    k->table_out = table_out_lanes;
}

#undef W
