/* transform.c — outlier suppression for keys (VecInfer, arXiv 2510.06175, sec. 3): per-channel
 * smoothing by lambda = sqrt(max |K|) and the normalized Walsh-Hadamard rotation. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>

#include "internal.h"
#include "cpu/vq_kernels.h"
#include "pq/pq_impl.h"

// ---- Walsh-Hadamard ----------------------------------------------------------------------------

/* The first row of x (n, d) whose sum of squares ss (double) is not finite or has sqrt(ss * growth)
 * > FLT_MAX, with its ss in *ss; n when every row is within range. */
static size_t first_row_beyond(const float *x, size_t n, int d, double growth, double *ss) {
    for (size_t i = 0; i < n; i++) {
        const float *r = x + i * (size_t)d;
        *ss = 0;
        for (int j = 0; j < d; j++) *ss += (double)r[j] * r[j];
        if (!isfinite(*ss) || sqrt(*ss * growth) > FLT_MAX) return i;
    }
    return n;
}

/* KVPQ_ERR_NONFINITE naming row i's first NaN/Inf element, or KVPQ_OK when it has none. */
static kvpq_status check_row_finite(const char *fn, const float *x, size_t i, int d) {
    const float *r = x + i * (size_t)d;
    for (int j = 0; j < d; j++)
        if (!isfinite(r[j]))
            return kvpq__err(KVPQ_ERR_NONFINITE, "%s: row %zu element %d is %s", fn, i, j, isnan(r[j]) ? "NaN" : "Inf");
    return KVPQ_OK;
}

kvpq_status kvpq_hadamard(float *x, size_t n, int d) {
    if (d <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_hadamard: d=%d: expected a positive power of two", d);
    if (d & (d - 1))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_hadamard: d=%d is not a power of two (Sylvester Hadamard only)", d);
    if (n == 0) return KVPQ_OK;
    if (!x) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_hadamard: x is NULL");
    /* x is left unchanged on error. The butterflies sum before the 1/sqrt(d) scaling: an element
     * reaches at most sqrt(d) |x| on the way (Cauchy-Schwarz), so a row within FLT_MAX / sqrt(d)
     * cannot overflow; a larger one is refused by name instead of coming back inf. */
    double ss_bad;
    const size_t bad = first_row_beyond(x, n, d, (double)d, &ss_bad);
    if (bad < n) {
        KVPQ_TRY(check_row_finite("kvpq_hadamard", x, bad, d));
        return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_hadamard: row %zu has norm %g: its transform could overflow "
                         "float32 (rows up to FLT_MAX / sqrt(d) = %g are taken)", bad, sqrt(ss_bad), FLT_MAX / sqrt(d));
    }
    const float scale = (float)(1.0 / sqrt((double)d));
    /* H_2d = [[H_d, H_d], [H_d, -H_d]] by log2(d) butterfly stages; scaled by 1/sqrt(d) it is
     * orthonormal and, being symmetric, its own inverse. The SIMD level's rows kernel (the same sums
     * at every level), over blocks of rows on the threads. */
    void (*rows)(size_t, int, float, float *) = kvpq__vq_kernels(kvpq_simd_get())->fwht_rows;
    const size_t blk = 64;
#pragma omp parallel for if ((double)n * d >= 65536.0) schedule(static)
    for (size_t i = 0; i < n; i += blk) rows(n - i < blk ? n - i : blk, d, scale, x + i * (size_t)d);
    return KVPQ_OK;
}

kvpq_status kvpq_normalize_rows(float *x, size_t n, int d, float *norms) {
    if (d <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_normalize_rows: d=%d: expected > 0", d);
    if (n == 0) return KVPQ_OK;
    if (!x) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_normalize_rows: x is NULL");
    /* First every row's norm is checked (x is left unchanged on error): a NaN/Inf element, or finite
     * elements whose norm exceeds float's range, had given a zero row with an infinite norm. */
    double ss_bad;
    const size_t bad = first_row_beyond(x, n, d, 1.0, &ss_bad);
    if (bad < n) {
        KVPQ_TRY(check_row_finite("kvpq_normalize_rows", x, bad, d));
        return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_normalize_rows: row %zu has norm %g, beyond float's range", bad,
                         sqrt(ss_bad));
    }
    for (size_t i = 0; i < n; i++) {
        float *r = x + i * (size_t)d;
        double ss = 0;
        for (int j = 0; j < d; j++) ss += (double)r[j] * r[j];
        const float nrm = (float)sqrt(ss), inv = nrm > 0.0f ? 1.0f / nrm : 0.0f;
        if (isfinite(inv)) {
            for (int j = 0; j < d; j++) r[j] *= inv;
        } else { /* a subnormal norm: 1 / |x| overflows float, the quotient does not */
            const double dn = sqrt(ss);
            for (int j = 0; j < d; j++) r[j] = (float)(r[j] / dn);
        }
        if (norms) norms[i] = nrm;
    }
    return KVPQ_OK;
}

// ---- smoothing ---------------------------------------------------------------------------------

static kvpq_status check_heads(const char *fn, int n_head_kv, int head_dim) {
    if (n_head_kv <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: n_head_kv=%d: expected > 0", fn, n_head_kv);
    if (head_dim <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: head_dim=%d: expected > 0", fn, head_dim);
    return KVPQ_OK;
}

/* The checks of the smoothing functions (fn names the caller) and max_t |k_tc| per KV head and
 * channel into absmax (n_head_kv, head_dim). */
static kvpq_status key_absmax(const char *fn, size_t n_tokens, int n_head_kv, int head_dim, const float *k,
                              float floor, float *absmax) {
    KVPQ_TRY(check_heads(fn, n_head_kv, head_dim));
    if (!absmax || (n_tokens && !k)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: NULL array", fn);
    if (!(floor > 0.0f) || !isfinite(floor))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: floor=%g: expected a finite value > 0", fn, (double)floor);
    const size_t row = (size_t)n_head_kv * head_dim;
    if (!kvpq__all_finite(k, n_tokens * row)) {
        for (size_t t = 0; t < n_tokens; t++)
            if (!kvpq__all_finite(k + t * row, row))
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s: keys of token %zu contain NaN or Inf", fn, t);
    }
    for (size_t c = 0; c < row; c++) absmax[c] = 0.0f;
    for (size_t t = 0; t < n_tokens; t++) {
        const float *kt = k + t * row;
        for (size_t c = 0; c < row; c++) {
            float a = fabsf(kt[c]);
            absmax[c] = a > absmax[c] ? a : absmax[c];
        }
    }
    return KVPQ_OK;
}

kvpq_status kvpq_smooth_compute(size_t n_tokens, int n_head_kv, int head_dim, const float *k, float floor,
                                float *lambda) {
    KVPQ_TRY(key_absmax("kvpq_smooth_compute", n_tokens, n_head_kv, head_dim, k, floor, lambda));
    for (size_t c = 0; c < (size_t)n_head_kv * head_dim; c++) {
        float l = sqrtf(lambda[c]);
        lambda[c] = l > floor ? l : floor;
    }
    return KVPQ_OK;
}

kvpq_status kvpq_smooth_compute_qk(size_t n_tokens, int n_head_kv, int head_dim, const float *k,
                                   const float *q_absmax, float floor, float *lambda) {
    const char *fn = "kvpq_smooth_compute_qk";
    KVPQ_TRY(check_heads(fn, n_head_kv, head_dim));
    if (!q_absmax) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: q_absmax is NULL", fn);
    const size_t row = (size_t)n_head_kv * head_dim;
    for (size_t c = 0; c < row; c++)
        if (!(q_absmax[c] >= 0.0f) || !isfinite(q_absmax[c]))
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: q_absmax[%zu]=%g: expected a finite value >= 0", fn, c,
                             (double)q_absmax[c]);
    KVPQ_TRY(key_absmax(fn, n_tokens, n_head_kv, head_dim, k, floor, lambda)); /* max |k|, then lambda */
    for (int h = 0; h < n_head_kv; h++) {
        const float *qa = q_absmax + (size_t)h * head_dim;
        float *lh = lambda + (size_t)h * head_dim;
        double qmax = 0, qbar = 0;
        for (int c = 0; c < head_dim; c++) qmax = qa[c] > qmax ? qa[c] : qmax;
        const double qlo = 1e-3 * qmax;
        for (int c = 0; c < head_dim; c++) qbar += qa[c] > qlo ? qa[c] : qlo;
        qbar /= head_dim;
        for (int c = 0; c < head_dim; c++) {
            /* no query weight seen in the head (qmax 0): keys alone, as kvpq_smooth_compute */
            double qm = qa[c] > qlo ? qa[c] : qlo;
            double l = qmax > 0 ? sqrt((double)lh[c] * qbar / qm) : sqrt((double)lh[c]);
            lh[c] = l > floor ? (float)l : floor;
        }
    }
    return KVPQ_OK;
}

static kvpq_status check_lambda(const char *fn, size_t nl, const float *lambda) {
    for (size_t c = 0; c < nl; c++)
        if (!(lambda[c] > 0.0f) || !isfinite(lambda[c]))
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: lambda[%zu]=%g: expected a finite value > 0", fn, c,
                             (double)lambda[c]);
    return KVPQ_OK;
}

/* x (n, row) is finite and x / lambda (inverse 0) or x * lambda (inverse 1) stays within float. */
static kvpq_status check_scaled_finite(const char *fn, const float *x, size_t n, size_t row, const float *lambda,
                                       int inverse) {
    for (size_t t = 0; t < n; t++)
        for (size_t c = 0; c < row; c++) {
            const double v = x[t * row + c], y = inverse ? v * lambda[c] : v / lambda[c];
            if (!isfinite(v))
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s: row %zu element %zu is %s", fn, t, c, isnan(v) ? "NaN" : "Inf");
            if (fabs(y) > FLT_MAX)
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s: row %zu element %zu: %g %s lambda %g = %g overflows float32", fn,
                                 t, c, v, inverse ? "*" : "/", (double)lambda[c], y);
        }
    return KVPQ_OK;
}

kvpq_status kvpq_smooth_apply(float *x, size_t n, int n_head_kv, int head_dim, const float *lambda, int inverse) {
    const char *fn = "kvpq_smooth_apply";
    KVPQ_TRY(check_heads(fn, n_head_kv, head_dim));
    if (!lambda || (n && !x)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: NULL array", fn);
    const size_t row = (size_t)n_head_kv * head_dim;
    KVPQ_TRY(check_lambda(fn, row, lambda));
    KVPQ_TRY(check_scaled_finite(fn, x, n, row, lambda, inverse)); /* x unchanged on error */
    for (size_t t = 0; t < n; t++) {
        float *xt = x + t * row;
        if (inverse)
            for (size_t c = 0; c < row; c++) xt[c] *= lambda[c];
        else
            for (size_t c = 0; c < row; c++) xt[c] /= lambda[c];
    }
    return KVPQ_OK;
}

kvpq_status kvpq_smooth_apply_query(float *q, size_t n, int n_head, int n_head_kv, int head_dim,
                                    const float *lambda) {
    const char *fn = "kvpq_smooth_apply_query";
    KVPQ_TRY(check_heads(fn, n_head_kv, head_dim));
    if (n_head <= 0 || n_head % n_head_kv)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: n_head=%d: expected a positive multiple of n_head_kv=%d", fn,
                         n_head, n_head_kv);
    if (!lambda || (n && !q)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: NULL array", fn);
    KVPQ_TRY(check_lambda(fn, (size_t)n_head_kv * head_dim, lambda));
    const int group = n_head / n_head_kv;
    for (size_t t = 0; t < n; t++) /* x unchanged on error: each query head against its KV head's factors */
        for (int h = 0; h < n_head; h++)
            KVPQ_TRY(check_scaled_finite(fn, q + (t * (size_t)n_head + h) * head_dim, 1, (size_t)head_dim,
                                         lambda + (size_t)(h / group) * head_dim, 1));
    for (size_t t = 0; t < n; t++)
        for (int h = 0; h < n_head; h++) {
            float *qh = q + (t * (size_t)n_head + h) * head_dim;
            const float *l = lambda + (size_t)(h / group) * head_dim;
            for (int c = 0; c < head_dim; c++) qh[c] *= l[c];
        }
    return KVPQ_OK;
}

// ---- RoPE ----------------------------------------------------------------------------------------

/* Rotate pair i of each head of vector x (n_head, head_dim) by (c, s). */
static void rope_pair(float *x, int n_head, int head_dim, int i, int other, int stride, float c, float s) {
    for (int h = 0; h < n_head; h++) {
        float *p = x + (size_t)h * head_dim + (size_t)i * stride;
        const float x0 = p[0], x1 = p[other];
        p[0] = x0 * c - x1 * s;
        p[other] = x0 * s + x1 * c;
    }
}

/* Positions given one by one: the angle of each (t, i) from cos / sin in double, as llama.c's rope. */
static void rope_at(float *x, size_t n, int n_head, int head_dim, int half, int neox, const float *inv_freq,
                    const int32_t *pos, int sign) {
    const int stride = neox ? 1 : 2, other = neox ? half : 1;
    for (size_t t = 0; t < n; t++)
        for (int i = 0; i < half; i++) {
            const double th = sign * (double)pos[t] * inv_freq[i];
            rope_pair(x + t * (size_t)n_head * head_dim, n_head, head_dim, i, other, stride, (float)cos(th),
                      (float)sin(th));
        }
}

/* Consecutive positions pos0, pos0 + 1, ...: cos / sin of every pair at pos0, then one complex
 * multiplication by e^(i sign inv_freq) per step, in double (n steps drift by ~n 1e-16), instead of
 * n cos / sin calls: the form the VQ cache's attention uses on every coded key (the kernel
 * rope_steps of the CPU level in use, vq_kernels.h; bit-identical at every level). */
kvpq_status kvpq__rope_run(float *x, size_t n, int n_head, size_t pos_stride, size_t head_stride, int half, int neox,
                           const float *inv_freq, int pos0, int sign) {
    double cbuf[4 * 128];
    float fbuf[2 * 128]; /* head_dim up to 256 on the stack; larger ones on the heap */
    double *c = half <= 128 ? cbuf : malloc(sizeof(double) * 4 * (size_t)half);
    float *cf = half <= 128 ? fbuf : malloc(sizeof(float) * 2 * (size_t)half);
    if (!c || !cf) {
        if (half > 128) free(c), free(cf);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_rope_rotate: out of memory");
    }
    for (int i = 0; i < half; i++) {
        const double w = sign * (double)inv_freq[i];
        c[2 * half + i] = cos(w), c[3 * half + i] = sin(w), c[i] = cos(pos0 * w), c[half + i] = sin(pos0 * w);
    }
    kvpq__vq_kernels(kvpq_simd_get())->rope_steps(n, n_head, half, neox, pos_stride, head_stride, c, cf, x);
    if (half > 128) free(c), free(cf);
    return KVPQ_OK;
}

kvpq_status kvpq_rope_rotate(float *x, size_t n, int n_head, int head_dim, int n_rot, int neox, const float *inv_freq,
                             const int32_t *pos, int pos0, int sign) {
    if (n_head < 1 || head_dim < 1 || n_rot < 0 || n_rot % 2 || n_rot > head_dim || (sign != 1 && sign != -1))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_rope_rotate: n_head %d, head_dim %d, n_rot %d, sign %d (expected "
                         "n_head, head_dim >= 1, n_rot even in [0, head_dim], sign +-1)", n_head, head_dim, n_rot, sign);
    if (n == 0) return KVPQ_OK;
    if (!x || (n_rot > 0 && !inv_freq))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_rope_rotate: %s is NULL", x ? "inv_freq" : "x");
    if (pos) rope_at(x, n, n_head, head_dim, n_rot / 2, neox, inv_freq, pos, sign);
    else if (n_rot > 0)
        return kvpq__rope_run(x, n, n_head, (size_t)n_head * head_dim, (size_t)head_dim, n_rot / 2, neox, inv_freq, pos0,
                              sign);
    return KVPQ_OK;
}
