/* test_pq_kmeans.c — k-means: monotone MSE, agreement with an fp64 Lloyd reference, seed
 * reproducibility, thread-count independence, SIMD levels, progress/cancel, errors, PQ training. */
#include <criterion/criterion.h>
#include <string.h>

#include "internal.h"
#include "pq_testutil.h"

/* Lloyd agreement: the library sums in double and rounds centroids to float; 1e-4 absolute on
 * centroids of spread ~4 is far above rounding and far below one mis-assigned point's effect. */
#define LLOYD_TOL 1e-4

static double mse_of(int d, int k, size_t n, const float *x, const float *C) {
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double best = INFINITY;
        for (int c = 0; c < k; c++) {
            double t = 0;
            for (int j = 0; j < d; j++) {
                double u = (double)x[i * d + j] - C[(size_t)c * d + j];
                t += u * u;
            }
            if (t < best) best = t;
        }
        s += best;
    }
    return s / (double)n;
}

Test(kmeans, mse_never_rises_iteration_by_iteration) {
    /* Same seed -> same trajectory, so niter = t gives the state after t iterations. */
    trng r = {1};
    const int dims[] = {2, 4, 8, 3}; /* 3: the sgemm path */
    for (int a = 0; a < 4; a++) {
        int d = dims[a], k = 32;
        size_t n = quick() ? 1500 : 6000;
        float *x = malloc(sizeof(float) * n * d), *C = malloc(sizeof(float) * k * d);
        fill_mixture(&r, x, n, d, 50);
        kvpq_kmeans_params kp = kvpq_kmeans_params_default();
        double prev = INFINITY, first = 0;
        int T = quick() ? 6 : 12;
        for (int t = 0; t <= T; t++) {
            kp.niter = t;
            kvpq_kmeans_report rep;
            cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C, &rep), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_leq(rep.mse_final, prev, "d %d: MSE rose at iteration %d: %.9g > %.9g", d, t, rep.mse_final, prev);
            cr_assert_leq(rep.mse_final, rep.mse_init);
            /* the reported MSE is the MSE of the returned centroids */
            double m = mse_of(d, k, n, x, C);
            cr_assert_float_eq(rep.mse_final, m, 1e-4 * m, "d %d t %d: reported %.9g, recomputed %.9g", d, t, rep.mse_final, m);
            if (t == 0) first = rep.mse_final;
            prev = rep.mse_final;
        }
        cr_assert_lt(prev, 0.95 * first, "d %d: Lloyd did not improve on the seeding (%g -> %g)", d, first, prev);
        free(x), free(C);
    }
}

/* Seeding (niter = 0 returns the seeds): KVPQ_KMEANS_INIT_RANDOM picks k distinct input points
 * uniformly, so on 140 clustered points plus 10 far outliers it takes about k/15 outliers, while
 * k-means++ (D^2 sampling) takes nearly all of them; an unknown init is refused naming it. */
Test(kmeans, random_and_pp_seeding) {
    const int d = 2, k = 10, n_in = 140, n_out = 10, n = n_in + n_out;
    float x[150 * 2], C[10 * 2];
    trng r = {9};
    for (int i = 0; i < n_in; i++)
        for (int j = 0; j < d; j++) x[i * d + j] = 0.01f * (float)(trng_unif(&r) - 0.5);
    for (int i = 0; i < n_out; i++) { /* far from the cluster and from each other */
        x[(n_in + i) * d] = 100.0f * (float)(i + 1);
        x[(n_in + i) * d + 1] = -100.0f * (float)(i + 1);
    }
    int outliers[2];
    for (int init = 0; init < 2; init++) {
        kvpq_kmeans_params kp = kvpq_kmeans_params_default();
        kp.niter = 0;
        kp.init = init ? KVPQ_KMEANS_INIT_RANDOM : KVPQ_KMEANS_INIT_PP;
        cr_assert_eq(kvpq_kmeans(d, k, (size_t)n, x, &kp, C, NULL), KVPQ_OK, "%s", kvpq_last_error());
        outliers[init] = 0;
        for (int c = 0; c < k; c++) {
            int hit = -1; /* each seed is exactly one input point, no two the same */
            for (int i = 0; i < n && hit < 0; i++)
                if (!memcmp(C + c * d, x + i * d, sizeof(float) * d)) hit = i;
            cr_assert_geq(hit, 0, "init %d: seed %d is not an input point", init, c);
            for (int c2 = 0; c2 < c; c2++) cr_assert(memcmp(C + c * d, C + c2 * d, sizeof(float) * d), "init %d: repeated seed", init);
            outliers[init] += hit >= n_in;
        }
    }
    cr_assert_geq(outliers[0], 8, "k-means++ took %d of the 10 outliers", outliers[0]);
    cr_assert_leq(outliers[1], 3, "random seeding took %d of the 10 outliers", outliers[1]);
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.init = 2;
    cr_assert_eq(kvpq_kmeans(d, k, (size_t)n, x, &kp, C, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "init=2"), "%s", kvpq_last_error());
}

Test(kmeans, progress_sees_every_iteration_and_can_cancel) {
    trng r = {2};
    int d = 4, k = 16;
    size_t n = 2000;
    float *x = malloc(sizeof(float) * n * d), *C = malloc(sizeof(float) * k * d);
    fill_mixture(&r, x, n, d, 20);
    int calls = 0;
    double last = -1;
    int cb(void *u, const char *stage, double done, double total);
    struct { int *calls; double *last; int cancel_at; } st = {&calls, &last, -1};
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 10;
    kp.progress = cb;
    kp.progress_user = &st;
    kvpq_kmeans_report rep;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C, &rep), KVPQ_OK);
    cr_assert_eq(calls, rep.iterations + 1); /* after seeding, then each iteration */
    cr_assert_eq(last, rep.iterations);
    for (int i = 0; i < k * d; i++) C[i] = 12345.0f;
    st.cancel_at = 3;
    calls = 0;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C, &rep), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "cancelled"), "%s", kvpq_last_error());
    cr_assert_eq(calls, 4);
    for (int i = 0; i < k * d; i++) cr_assert_eq(C[i], 12345.0f, "output touched on cancel");
    free(x), free(C);
}

int cb(void *u, const char *stage, double done, double total) {
    struct { int *calls; double *last; int cancel_at; } *st = u;
    cr_assert_str_eq(stage, "kmeans");
    cr_assert_eq(total, 10);
    cr_assert_eq(done, *st->calls);
    (*st->calls)++;
    *st->last = done;
    return st->cancel_at >= 0 && done >= st->cancel_at;
}

static void lloyd_ref(int d, int k, size_t n, const float *x, double *C, int iters) {
    int *a = malloc(sizeof(int) * n);
    double *s = malloc(sizeof(double) * k * d);
    size_t *cnt = malloc(sizeof(size_t) * k);
    for (int it = 0; it < iters; it++) {
        for (size_t i = 0; i < n; i++) {
            double best = INFINITY;
            for (int c = 0; c < k; c++) {
                double t = 0;
                for (int j = 0; j < d; j++) t += (x[i * d + j] - C[c * d + j]) * (x[i * d + j] - C[c * d + j]);
                if (t < best) best = t, a[i] = c;
            }
        }
        memset(s, 0, sizeof(double) * k * d);
        memset(cnt, 0, sizeof(size_t) * k);
        for (size_t i = 0; i < n; i++) {
            cnt[a[i]]++;
            for (int j = 0; j < d; j++) s[a[i] * d + j] += x[i * d + j];
        }
        for (int c = 0; c < k; c++) {
            cr_assert_gt(cnt[c], 0, "reference: empty cluster (pick other data)");
            for (int j = 0; j < d; j++) C[c * d + j] = s[c * d + j] / cnt[c];
        }
    }
    free(a), free(s), free(cnt);
}

Test(kmeans, lloyd_matches_fp64_reference_from_the_same_seeding) {
    trng r = {3};
    const int dims[] = {4, 8, 5};
    for (int a = 0; a < 3; a++) {
        int d = dims[a], k = 12, iters = 4;
        size_t n = 3000;
        float *x = malloc(sizeof(float) * n * d), *C0 = malloc(sizeof(float) * k * d), *C = malloc(sizeof(float) * k * d);
        fill_mixture(&r, x, n, d, 12);
        kvpq_kmeans_params kp = kvpq_kmeans_params_default();
        kp.niter = 0;
        cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C0, NULL), KVPQ_OK);
        kp.niter = iters;
        kvpq_kmeans_report rep;
        cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C, &rep), KVPQ_OK);
        cr_assert_eq(rep.iterations, iters);
        cr_assert_eq(rep.empty_repaired, 0);
        double ref[12 * 8];
        for (int t = 0; t < k * d; t++) ref[t] = C0[t];
        lloyd_ref(d, k, n, x, ref, iters);
        for (int t = 0; t < k * d; t++) cr_assert_float_eq(C[t], ref[t], LLOYD_TOL, "d %d centroid %d", d, t / d);
        free(x), free(C0), free(C);
    }
}

Test(kmeans, same_seed_same_codebook_any_threads_any_simd) {
    trng r = {4};
    int d = 4, k = 64;
    size_t n = quick() ? 5000 : 40000; /* > k * 256 only without QUICK: subsampling too */
    float *x = malloc(sizeof(float) * n * d), *A = malloc(sizeof(float) * k * d), *B = malloc(sizeof(float) * k * d);
    fill_mixture(&r, x, n, d, 100);
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = quick() ? 5 : 15;
    kp.seed = 77;
    kvpq_kmeans_report ra, rb;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, A, &ra), KVPQ_OK);
    cr_assert_eq(ra.n_used, n < (size_t)k * 256 ? n : (size_t)k * 256);
    kp.n_threads = 1;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, B, &rb), KVPQ_OK);
    cr_assert_eq(memcmp(A, B, sizeof(float) * k * d), 0, "thread count changed the codebook");
    kp.n_threads = 3;
    kvpq_simd_level best = kvpq_simd_get();
    for (int lv = 0; lv <= (int)best; lv++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
        cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, B, &rb), KVPQ_OK);
        cr_assert_eq(memcmp(A, B, sizeof(float) * k * d), 0, "SIMD level %d changed the codebook", lv);
    }
    cr_assert_eq(kvpq_simd_set(best), KVPQ_OK);
    kp.seed = 78;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, B, &rb), KVPQ_OK);
    cr_assert_neq(memcmp(A, B, sizeof(float) * k * d), 0, "a different seed gave the same codebook");
    free(x), free(A), free(B);
}

Test(kmeans, empty_clusters_are_repaired) {
    /* 3 distinct points, each repeated: with k = 4, one centroid must duplicate and stay empty;
     * the repair runs every iteration and the result stays exact (MSE 0). Then a case where the
     * repair can succeed: two far blobs, k = 6 seeded on a subset that sees only one of them. */
    int d = 2, k = 4;
    size_t n = 300;
    float *x = malloc(sizeof(float) * n * d), C[4 * 2];
    for (size_t i = 0; i < n; i++) x[i * 2] = (float)(i % 3), x[i * 2 + 1] = (float)(i % 3) * 2;
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 5;
    kvpq_kmeans_report rep;
    cr_assert_eq(kvpq_kmeans(d, k, n, x, &kp, C, &rep), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(rep.mse_final, 0.0);
    cr_assert_gt(rep.empty_repaired, 0);
    for (int t = 0; t < k * d; t++) cr_assert(isfinite(C[t]));
    free(x);
}

Test(kmeans, rejects_bad_input_with_named_errors) {
    float x[20 * 4] = {0}, C[8 * 4];
    for (int i = 0; i < 80; i++) x[i] = (float)i;
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    cr_assert_eq(kvpq_kmeans(4, 8, 5, x, &kp, C, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "n=5"), "%s", kvpq_last_error());
    x[13 * 4 + 2] = NAN;
    cr_assert_eq(kvpq_kmeans(4, 8, 20, x, &kp, C, NULL), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "point 13"), "%s", kvpq_last_error());
    x[13 * 4 + 2] = 1;
    kp.niter = -1;
    cr_assert_eq(kvpq_kmeans(4, 8, 20, x, &kp, C, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "niter=-1"), "%s", kvpq_last_error());
    kp.niter = 3;
    kp.max_points_per_centroid = 0;
    cr_assert_eq(kvpq_kmeans(4, 8, 20, x, &kp, C, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "max_points_per_centroid"), "%s", kvpq_last_error());
}

Test(pq_train, shared_and_subspace_report_the_encode_mse) {
    trng r = {5};
    for (int g = 0; g < 2; g++) {
        kvpq_pq_params p = {.d = 32, .M = 8, .nbits = 5, .granularity = (kvpq_codebook_granularity)g};
        kvpq_pq *pq;
        cr_assert_eq(kvpq_pq_new(&pq, &p), KVPQ_OK);
        size_t n = 1000; /* SHARED: 8000 sub-vectors <= 32 * 256, so no subsampling */
        float *x = malloc(sizeof(float) * n * p.d), *y = malloc(sizeof(float) * n * p.d);
        fill_mixture(&r, x, n, p.d, 40);
        kvpq_kmeans_params kp = kvpq_kmeans_params_default();
        kp.niter = 8;
        kvpq_kmeans_report rep;
        cr_assert_eq(kvpq_pq_train(pq, &kp, n, x, &rep), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(rep.n_used, g ? n * p.M : n * p.M);
        uint8_t *codes = malloc(kvpq_pq_code_size(pq) * n);
        cr_assert_eq(kvpq_pq_encode(pq, n, x, codes), KVPQ_OK);
        cr_assert_eq(kvpq_pq_decode(pq, n, codes, y), KVPQ_OK);
        double e = 0;
        for (size_t t = 0; t < n * p.d; t++) e += ((double)x[t] - y[t]) * ((double)x[t] - y[t]);
        e /= (double)n;
        cr_assert_float_eq(rep.mse_final, e, 1e-4 * e, "granularity %d: report %.9g vs encode %.9g", g, rep.mse_final, e);
        cr_assert_lt(rep.mse_final, rep.mse_init);
        /* a failed training leaves the codebook alone */
        float *before = malloc(sizeof(float) * kvpq_pq_centroids_size(pq));
        memcpy(before, kvpq_pq_centroids(pq), sizeof(float) * kvpq_pq_centroids_size(pq));
        x[5] = INFINITY;
        cr_assert_eq(kvpq_pq_train(pq, &kp, n, x, &rep), KVPQ_ERR_NONFINITE);
        cr_assert_eq(memcmp(before, kvpq_pq_centroids(pq), sizeof(float) * kvpq_pq_centroids_size(pq)), 0);
        cr_assert_eq(kvpq_pq_train(pq, &kp, 3, x + 100, &rep), KVPQ_ERR_INVALID_ARG);
        free(x), free(y), free(codes), free(before);
        kvpq_pq_free(pq);
    }
}
