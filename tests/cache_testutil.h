/* cache_testutil.h — helpers shared by the cache tests: random data, the fp64 reference attention. */
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
