/* turboquant.c — TurboQuant's MSE quantizer as a kvpq codebook (Zandieh, Daliri, Hadian & Mirrokni,
 * "TurboQuant: Online Vector Quantization with Near-optimal Distortion Rate", arXiv 2504.19874,
 * Algorithm 1): rotate a vector, code each coordinate of its direction by one scalar Lloyd-Max
 * quantizer for the distribution of one coordinate of a uniformly random unit vector in R^d, keep its
 * norm. In kvpq's terms: a product quantizer with dsub = 1 (M = head_dim) whose one shared codebook
 * of 2^nbits centroids is that Lloyd-Max quantizer (not trained), on norm-explicit directions, after
 * kvpq's normalized Walsh-Hadamard rotation (keys with mu = 0 and lambda = 1; values rotated).
 * Attention then runs from the codes as for any VQ cache. Differences from the paper, stated: the
 * rotation is the deterministic Hadamard transform, not a random orthogonal matrix, and the kept
 * scale is the least-squares fit x . r / |r|^2 rather than |x| (kvpq's norm-explicit scale, never a
 * larger error). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* Cumulative moments of the coordinate density f(x) ~ (1 - x^2)^((d - 3) / 2) on [-1, 1], on a grid
 * of TQ_GRID intervals: m0[i] = int_{-1}^{x_i} f, m1[i] = int_{-1}^{x_i} x f (trapezoids, x_i = -1 +
 * 2 i / TQ_GRID); a cell's moments come from them by linear interpolation at its ends, so the cells'
 * boundaries fall anywhere, not on grid points (a boundary rounded to the grid moved the outer
 * centroids by 1e-4 of their value at d = 256). */
enum { TQ_GRID = 1 << 16, TQ_ITERS = 4000 };

static void density_moments(int d, double *m0, double *m1) {
    const double a = 0.5 * (d - 3), h = 2.0 / TQ_GRID;
    double f_prev = 0, xf_prev = 0; /* f(-1) = 0 for d > 3 */
    m0[0] = m1[0] = 0;
    for (int i = 1; i <= TQ_GRID; i++) {
        const double x = -1.0 + h * i, f = i == TQ_GRID ? 0 : exp(a * log1p(-x * x));
        m0[i] = m0[i - 1] + 0.5 * h * (f + f_prev);
        m1[i] = m1[i - 1] + 0.5 * h * (x * f + xf_prev);
        f_prev = f, xf_prev = x * f;
    }
}

/* A cumulative moment at x in [-1, 1], interpolated. */
static double moment_at(const double *m, double x) {
    const double t = (x + 1.0) * 0.5 * TQ_GRID;
    if (t <= 0) return m[0];
    if (t >= TQ_GRID) return m[TQ_GRID];
    const int i = (int)t;
    return m[i] + (t - i) * (m[i + 1] - m[i]);
}

/* One Lloyd step: cells between midpoints of c (sorted), each centroid to its cell's mean. Returns
 * the largest move. */
static double lloyd_step(const double *m0, const double *m1, double *c, int k) {
    double moved = 0, lo = -1.0;
    for (int j = 0; j < k; j++) {
        const double hi = j + 1 < k ? 0.5 * (c[j] + c[j + 1]) : 1.0;
        const double w = moment_at(m0, hi) - moment_at(m0, lo), wx = moment_at(m1, hi) - moment_at(m1, lo);
        if (w > 0) {
            moved = fmax(moved, fabs(wx / w - c[j]));
            c[j] = wx / w;
        }
        lo = hi;
    }
    return moved;
}

kvpq_status kvpq_turboquant_centroids(int d, int nbits, float *out) {
    if (d < 4 || nbits < 1 || nbits > 8 || !out)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_turboquant_centroids: d %d (>= 4), nbits %d (1..8), out %s", d,
                         nbits, out ? "given" : "NULL");
    const int k = 1 << nbits;
    double *m0 = malloc(sizeof *m0 * (TQ_GRID + 1)), *m1 = malloc(sizeof *m1 * (TQ_GRID + 1)), c[256];
    if (!m0 || !m1) {
        free(m0), free(m1);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_turboquant_centroids: out of memory");
    }
    density_moments(d, m0, m1);
    const double sigma = 1.0 / sqrt((double)d); /* the coordinate's standard deviation */
    for (int j = 0; j < k; j++) c[j] = sigma * 3.0 * (2.0 * j + 1.0 - k) / k; /* uniform over +-3 sigma */
    for (int it = 0; it < TQ_ITERS && lloyd_step(m0, m1, c, k) > 1e-13; it++) {
    }
    for (int j = 0; j < k; j++) out[j] = (float)c[j];
    free(m0), free(m1);
    return KVPQ_OK;
}

kvpq_status kvpq_codebook_turboquant(kvpq_codebook **out, int n_layer, int n_head_kv, int head_dim, int nbits,
                                     int norm_bits) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_turboquant: out is NULL");
    *out = NULL;
    if (nbits < 1 || nbits > 8 || (norm_bits != 8 && norm_bits != 16) || (norm_bits == 8 && nbits > 4))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_turboquant: nbits %d (1..8), norm_bits %d (8 or 16; "
                         "8 only up to 4 bits per element)", nbits, norm_bits);
    kvpq_codebook_params cp = kvpq_codebook_params_default();
    cp.n_layer = n_layer, cp.n_head_kv = n_head_kv, cp.head_dim = head_dim;
    cp.key.d = cp.value.d = head_dim;
    cp.key.M = cp.value.M = head_dim; /* dsub 1: one scalar code per coordinate */
    cp.key.nbits = cp.value.nbits = nbits;
    cp.key.granularity = cp.value.granularity = KVPQ_CODEBOOK_SHARED;
    cp.value_rotate = 1, cp.key_norm = 1, cp.value_norm = 1;
    float c[256];
    KVPQ_TRY(kvpq_turboquant_centroids(head_dim, nbits, c));
    kvpq_codebook *cb = NULL;
    KVPQ_TRY(kvpq_codebook_new(&cb, &cp));
    kvpq_status s = KVPQ_OK;
    for (int l = 0; l < n_layer && s == KVPQ_OK; l++)
        for (int kind = 0; kind < 2 && s == KVPQ_OK; kind++)
            s = kvpq_pq_set_centroids(kvpq_codebook_pq(cb, l, kind), c, (size_t)1 << nbits);
    char bits[8];
    snprintf(bits, sizeof bits, "%d", nbits);
    if (s == KVPQ_OK) s = kvpq_codebook_set_meta(cb, "method", "turboquant-mse");
    if (s == KVPQ_OK) s = kvpq_codebook_set_meta(cb, "tq.bits", bits);
    /* TurboQuant keeps no fp16 window nor sinks: what kvpq_cache_params_resolve applies by default */
    if (s == KVPQ_OK) s = kvpq_codebook_set_meta(cb, "alloc.window", "0");
    if (s == KVPQ_OK) s = kvpq_codebook_set_meta(cb, "alloc.sinks", "0");
    if (s == KVPQ_OK && norm_bits == 8) s = kvpq_codebook_set_meta(cb, "k.norm_bits", "8");
    if (s == KVPQ_OK && norm_bits == 8) s = kvpq_codebook_set_meta(cb, "v.norm_bits", "8");
    if (s != KVPQ_OK) {
        kvpq_codebook_free(cb);
        return s;
    }
    *out = cb;
    return KVPQ_OK;
}
