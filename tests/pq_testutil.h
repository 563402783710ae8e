/* pq_testutil.h — deterministic random data for the PQ tests. */
#ifndef KVPQ_PQ_TESTUTIL_H
#define KVPQ_PQ_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct { uint64_t s; } trng;
static inline uint64_t trng_next(trng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static inline double trng_unif(trng *r) { return (double)(trng_next(r) >> 11) * 0x1.0p-53; }
static inline float trng_gauss(trng *r) {
    double u = trng_unif(r), v = trng_unif(r);
    return (float)(sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v));
}
static inline void fill_gauss(trng *r, float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = scale * trng_gauss(r);
}
/* n points in d dims around `nc` random centres (spread 4) with unit noise. */
static inline void fill_mixture(trng *r, float *x, size_t n, int d, int nc) {
    float *cen = malloc(sizeof(float) * (size_t)nc * d);
    fill_gauss(r, cen, (size_t)nc * d, 4.0f);
    for (size_t i = 0; i < n; i++) {
        int c = (int)(trng_next(r) % (uint64_t)nc);
        for (int j = 0; j < d; j++) x[i * d + j] = cen[(size_t)c * d + j] + trng_gauss(r);
    }
    free(cen);
}
static inline int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && *q && *q != '0';
}

#endif
