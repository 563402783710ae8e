/* cache_testutil.h — helpers shared by the cache tests: random data, test codebooks, the fp64 reference
 * attention. */
#ifndef KVPQ_CACHE_TESTUTIL_H
#define KVPQ_CACHE_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "kvpq.h"

static inline int quick(void) {
    const char *e = getenv("KVPQ_QUICK");
    return e && *e && *e != '0';
}

/* splitmix64 -> uniform [0,1) and normal values: reproducible, no libc rand state. */
static inline uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static inline double rng_unif(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }
static inline float rng_normal(uint64_t *s) {
    double u = rng_unif(s) + 1e-300, v = rng_unif(s);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}
static inline float *rand_vec(size_t n, uint64_t seed, float scale) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = scale * rng_normal(&seed);
    return x;
}

/* A d4b8 (keys and values) codebook for cache tests, from a spec, so that the tests that need one
 * share the code and keep their own values:
 *   norm: -1 keeps kvpq_codebook_params_default's key_norm/value_norm, 0/1 sets both;
 *   train_points: 0 = random centroids: scale * N(0, 1) from seed + seed_step * (2 * layer + w)
 *     (w: 0 keys, 1 values); > 0 = k-means (niter 2, 1 thread) on that many N(0, 1) vectors drawn so;
 *     -1 = two points per centroid per sub-space, ceil(2 * ksub / M) vectors; the vectors are
 *     normalized first when norm is 1; max_points_per_centroid > 0 replaces the k-means default;
 *   smooth: after each layer's centroids, lambda in [0.5, 2) then mu in [-0.5, 0.5) per channel,
 *     drawn from the running seed (which the next layer's centroid seeds then start from).
 * Returns NULL with kvpq_last_error() set on failure. */
typedef struct {
    int n_layer, n_head_kv, head_dim;
    int norm;
    uint64_t seed, seed_step;
    float scale;
    int train_points, max_points_per_centroid;
    int smooth;
} test_codebook_spec;

static inline kvpq_codebook *test_codebook(const test_codebook_spec *s) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = s->n_layer;
    p.n_head_kv = s->n_head_kv;
    p.head_dim = s->head_dim;
    if (kvpq_pq_params_preset(&p.key, "d4b8", s->head_dim) != KVPQ_OK ||
        kvpq_pq_params_preset(&p.value, "d4b8", s->head_dim) != KVPQ_OK)
        return NULL;
    if (s->norm >= 0) p.key_norm = p.value_norm = s->norm;
    kvpq_codebook *cb = NULL;
    if (kvpq_codebook_new(&cb, &p) != KVPQ_OK) return NULL;
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 2;
    kp.n_threads = 1;
    if (s->max_points_per_centroid > 0) kp.max_points_per_centroid = s->max_points_per_centroid;
    uint64_t seed = s->seed;
    kvpq_status st = KVPQ_OK;
    for (int l = 0; l < s->n_layer && st == KVPQ_OK; l++) {
        for (int w = 0; w < 2 && st == KVPQ_OK; w++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb, l, w);
            const uint64_t sd = seed + s->seed_step * (uint64_t)(2 * l + w);
            if (s->train_points == 0) {
                const size_t n = kvpq_pq_centroids_size(pq);
                float *c = rand_vec(n, sd, s->scale);
                st = kvpq_pq_set_centroids(pq, c, n);
                free(c);
            } else {
                const kvpq_pq_params pp = kvpq_pq_get_params(pq);
                const size_t n = s->train_points > 0 ? (size_t)s->train_points
                                                     : (size_t)(2 * (1 << pp.nbits) + pp.M - 1) / (size_t)pp.M;
                float *x = rand_vec(n * (size_t)pp.d, sd, 1.0f);
                if (s->norm == 1) st = kvpq_normalize_rows(x, n, pp.d, NULL);
                if (st == KVPQ_OK) st = kvpq_pq_train(pq, &kp, n, x, NULL);
                free(x);
            }
        }
        if (s->smooth && st == KVPQ_OK) {
            float *lam = kvpq_codebook_key_smooth(cb, l), *mu = kvpq_codebook_key_mean(cb, l);
            for (int i = 0; i < s->n_head_kv * s->head_dim; i++) {
                lam[i] = (float)(0.5 + 1.5 * rng_unif(&seed));
                mu[i] = (float)(rng_unif(&seed) - 0.5);
            }
        }
    }
    if (st != KVPQ_OK) {
        kvpq_codebook_free(cb);
        return NULL;
    }
    return cb;
}

/* fp64 causal GQA attention over explicit K/V: k, v (L, n_head_kv, hd); queries q (n_q, n_head, hd)
 * at positions L - n_q + i; out (n_q, n_head, hd) float64. */
/* The same with a sliding window: the query at position t sees positions max(0, t - window + 1) .. t
 * (window 0: every earlier position). */
static inline void ref_attend_window(int L, int n_q, int n_head, int n_head_kv, int hd, int window, const float *k,
                                     const float *v, const float *q, double *out);
static inline void ref_attend(int L, int n_q, int n_head, int n_head_kv, int hd, const float *k, const float *v,
                              const float *q, double *out) {
    ref_attend_window(L, n_q, n_head, n_head_kv, hd, 0, k, v, q, out);
}
static inline void ref_attend_window(int L, int n_q, int n_head, int n_head_kv, int hd, int window, const float *k,
                                     const float *v, const float *q, double *out) {
    const int g = n_head / n_head_kv;
    double *w = malloc((size_t)L * sizeof *w);
    for (int i = 0; i < n_q; i++)
        for (int h = 0; h < n_head; h++) {
            const int kvh = h / g, lim = L - n_q + i + 1, t0 = window > 0 && lim - window > 0 ? lim - window : 0;
            const float *qi = q + ((size_t)i * n_head + h) * hd;
            double m = -INFINITY, d = 0.0;
            for (int t = t0; t < lim; t++) {
                double s = 0.0;
                const float *kt = k + ((size_t)t * n_head_kv + kvh) * hd;
                for (int c = 0; c < hd; c++) s += (double)qi[c] * kt[c];
                w[t] = s / sqrt((double)hd);
                if (w[t] > m) m = w[t];
            }
            for (int t = t0; t < lim; t++) d += (w[t] = exp(w[t] - m));
            double *o = out + ((size_t)i * n_head + h) * hd;
            for (int c = 0; c < hd; c++) o[c] = 0.0;
            for (int t = t0; t < lim; t++) {
                const float *vt = v + ((size_t)t * n_head_kv + kvh) * hd;
                for (int c = 0; c < hd; c++) o[c] += w[t] / d * vt[c];
            }
        }
    free(w);
}

/* max |a - b| / max(max |b|, floor) over n values */
static inline double rel_err_f64(const float *a, const double *b, size_t n) {
    double num = 0.0, den = 1e-30;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (e > num) num = e;
        if (fabs(b[i]) > den) den = fabs(b[i]);
    }
    return num / den;
}

#endif
