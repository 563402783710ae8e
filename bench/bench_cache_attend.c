/* bench_cache_attend.c — decode attention (n_q = 1, all query heads of one layer) of every baseline
 * cache kind (fp32, fp16, q8_0, q4_0, q8_0r, q4_0r, kivi2, kivi4) beside, in the same process on the same data:
 *   - a plain parallel read (sum) of the fp32 K and V arrays: a reference rate for streaming the
 *     bytes an fp32 attention must read (plain C; not a hard ceiling: a tuned kernel can beat it), and
 *   - an OpenBLAS baseline: S = Q K^T (sgemm), softmax, O = P V (sgemm) over contiguous fp32 K/V.
 * Median of repeats. GB/s counts the bytes the cache holds (kvpq_cache_get_stats).
 * usage: bench_cache_attend [ctx=8192] [reps=50]; threads from OMP_NUM_THREADS (OpenBLAS's from
 * OPENBLAS_NUM_THREADS). */
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "kvpq.h"

/* Parallel sum of n floats with 8 independent accumulators (the compiler vectorizes it). */
static float read_all(const float *x, size_t n) {
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
        float acc[8] = {0};
#pragma omp for schedule(static)
        for (size_t i = 0; i < n / 8; i++)
            for (int j = 0; j < 8; j++) acc[j] += x[i * 8 + j];
        for (int j = 0; j < 8; j++) total += acc[j];
    }
    return total;
}

/* fp32 attention through OpenBLAS: per KV head, its query heads as one sgemm each way. */
static void blas_attend(int L, int n_head, int n_head_kv, int hd, const float *k, const float *v, const float *q,
                        float *out, float *S) {
    const int g = n_head / n_head_kv;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int h = 0; h < n_head_kv; h++) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g, L, hd, scale, q + (size_t)h * g * hd, hd, k + h * hd,
                    n_head_kv * hd, 0.0f, S, L);
        for (int r = 0; r < g; r++) {
            float *s = S + (size_t)r * L, m = -INFINITY, d = 0.0f;
            for (int t = 0; t < L; t++) m = s[t] > m ? s[t] : m;
            for (int t = 0; t < L; t++) d += (s[t] = expf(s[t] - m));
            for (int t = 0; t < L; t++) s[t] /= d;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g, hd, L, 1.0f, S, L, v + h * hd, n_head_kv * hd, 0.0f,
                    out + (size_t)h * g * hd, hd);
    }
}

int main(int argc, char **argv) {
    const int L = argc > 1 ? atoi(argv[1]) : 8192, reps0 = argc > 2 ? atoi(argv[2]) : 50;
    const int n_head = 9, n_head_kv = 3, hd = 64; /* SmolLM2-135M */
    if (L < 1 || reps0 < 1) {
        fprintf(stderr, "usage: bench_cache_attend [ctx >= 1] [reps >= 1]\n");
        return 2;
    }
    const int reps = reps0 > 1000 ? 1000 : reps0;
    const size_t n = (size_t)L * n_head_kv * hd, nq = (size_t)n_head * hd;
    float *k = malloc(n * 4), *v = malloc(n * 4), *q = malloc(nq * 4), *o = malloc(nq * 4), *ob = malloc(nq * 4);
    float *S = malloc((size_t)L * n_head * 4);
    double *t = malloc((size_t)reps * sizeof *t);
    if (!k || !v || !q || !o || !ob || !S || !t) return 1;
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        k[i] = (float)(x >> 40) / 16777216.0f - 0.5f;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        v[i] = (float)(x >> 40) / 16777216.0f - 0.5f;
    }
    for (size_t i = 0; i < nq; i++) q[i] = (float)((i * 7919) % 1000) / 1000.0f - 0.5f;

    printf("decode attention: ctx %d, n_head %d, n_head_kv %d, head_dim %d; %d threads, simd %s; median of %d\n", L,
           n_head, n_head_kv, hd, omp_get_max_threads(), kvpq_simd_name(kvpq_simd_get()), reps);
    printf("%-28s %10s %10s %8s %10s %12s\n", "what", "us", "GB/s", "x BLAS", "bits/elem", "max rel diff");
    volatile float sink = 0.0f;
    for (int r = 0; r < reps; r++) {
        double a = now();
        sink += read_all(k, n) + read_all(v, n);
        t[r] = now() - a;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    printf("%-28s %10.1f %10.1f %8s %10s %12s\n", "plain read of fp32 K+V", t[reps / 2] * 1e6,
           2.0 * n * 4 / t[reps / 2] / 1e9, "", "32.00", "");
    for (int r = 0; r < reps; r++) {
        double a = now();
        blas_attend(L, n_head, n_head_kv, hd, k, v, q, ob, S);
        t[r] = now() - a;
    }
    qsort(t, (size_t)reps, sizeof *t, cmp_double);
    const double tb = t[reps / 2];
    printf("%-28s %10.1f %10.1f %8.2f %10s %12s\n", "OpenBLAS sgemm+softmax fp32", tb * 1e6, 2.0 * n * 4 / tb / 1e9,
           1.0, "32.00", "");
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,  KVPQ_CACHE_Q4_0,
                                            KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q4_0R, KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = kinds[i], p.n_layer = 1, p.n_head = n_head, p.n_head_kv = n_head_kv, p.head_dim = hd, p.max_seq = L;
        kvpq_cache *c;
        kvpq_status s = kvpq_cache_new(&c, &p);
        if (s == KVPQ_OK) s = kvpq_cache_append(c, 0, L, k, v);
        for (int r = 0; s == KVPQ_OK && r < 3; r++) s = kvpq_cache_attend(c, 0, 1, q, o);
        if (s != KVPQ_OK) {
            fprintf(stderr, "bench_cache_attend: %s: %s\n", kvpq_cache_type_name(kinds[i]), kvpq_last_error());
            return 1;
        }
        for (int r = 0; r < reps; r++) {
            double a = now();
            kvpq_cache_attend(c, 0, 1, q, o);
            t[r] = now() - a;
        }
        qsort(t, (size_t)reps, sizeof *t, cmp_double);
        kvpq_cache_stats st;
        kvpq_cache_get_stats(c, &st);
        double num = 0, den = 1e-30;
        for (size_t j = 0; j < nq; j++) num = fmax(num, fabs(o[j] - ob[j])), den = fmax(den, fabs(ob[j]));
        char name[64];
        snprintf(name, sizeof name, "kvpq cache %s", kvpq_cache_type_name(kinds[i]));
        printf("%-28s %10.1f %10.1f %8.2f %10.2f %12.1e\n", name, t[reps / 2] * 1e6,
               (double)st.resident_bytes / t[reps / 2] / 1e9, tb / t[reps / 2], st.bits_per_element, num / den);
        kvpq_cache_free(c);
    }
    free(k), free(v), free(q), free(o), free(ob), free(S), free(t);
    return sink == 12345.0f ? 3 : 0;
}
