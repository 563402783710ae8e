/* kmeans.c — k-means for PQ codebooks: k-means++ seeding (Arthur & Vassilvitskii 2007), Lloyd
 * iterations, empty clusters re-seeded by splitting the largest one (as faiss Clustering does), and
 * subsampling to at most k * max_points_per_centroid points (faiss's default policy).
 *
 * Determinism: every random draw comes from one splitmix64 stream seeded by kp->seed; the parallel
 * parts (assignment, distance updates) write per-point results, and every sum is taken in a fixed
 * order (per fixed-size block, then over blocks), so the codebook does not even depend on the
 * number of threads.
 *
 * Monotonicity: with assignment a_t from C_t, the mean update gives MSE(a_t, C_t+1) <= MSE(a_t, C_t)
 * and the next assignment MSE(a_t+1, C_t+1) <= MSE(a_t, C_t+1). Re-seeding only moves centroids that
 * own no point, so it cannot raise MSE(a_t, .). Floating-point rounding could still add a few ulps;
 * an iteration that would raise the MSE is rolled back and ends the run (a fixed point within
 * rounding), so the reported MSE never rises. */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "cpu/dispatch.h"
#include "pq/pq_impl.h"

#define KM_BLOCK 1024          /* points per parallel block and per partial sum */
#define KMPP_POINTS_PER_K 16   /* k-means++ seeds on at most 16 k points (uniform subsample) */
#define GEMM_MAX_FLOATS (1u << 20) /* distance block of the general-d path: at most 4 MiB */

// ---- random numbers ----------------------------------------------------------------------------

typedef struct { uint64_t s; } rng_t;
static uint64_t rng_next(rng_t *r) { /* splitmix64 (Steele, Lea, Flood 2014) */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unif(rng_t *r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; } /* [0, 1) */

/* Selection sampling (Knuth TAOCP vol. 2, 3.4.2, algorithm S): m of n indices, increasing order. */
static void sample_sorted(rng_t *r, size_t n, size_t m, size_t *out) {
    size_t got = 0;
    for (size_t i = 0; i < n && got < m; i++)
        if ((double)(n - i) * rng_unif(r) < (double)(m - got)) out[got++] = i;
}

// ---- state -------------------------------------------------------------------------------------

typedef struct {
    int d, k, nt;
    size_t n;            /* points used */
    const float *x;      /* (n, d) contiguous copy of the used points */
    int fused;           /* d in {1,2,4,8,16}: dispatch nn kernel; else blocks of dot products */
    float *ct, *cnorm;   /* fused: prepared codebook (d, kpad) + (kpad); gemm: cnorm (k) */
    float *gemm;         /* gemm: (rows, k) block of -2 x.c */
    int32_t *assign;     /* (n) */
    float *dist;         /* (n) ||x - C[assign]||^2 */
    double *bsum;        /* (nblocks) */
} km_t;

static float sqdist(const float *a, const float *b, int d) {
    float s = 0;
    for (int j = 0; j < d; j++) {
        float t = a[j] - b[j];
        s += t * t;
    }
    return s;
}

/* Sum of v[0..n) in a fixed order: per KM_BLOCK block (in parallel), then blocks in order. */
static double fixed_sum(const float *v, size_t n, double *bsum, int nt) {
    size_t nb = (n + KM_BLOCK - 1) / KM_BLOCK;
#pragma omp parallel for num_threads(nt) if (n >= 8 * KM_BLOCK) schedule(static)
    for (size_t b = 0; b < nb; b++) {
        size_t e = (b + 1) * KM_BLOCK < n ? (b + 1) * KM_BLOCK : n;
        double s = 0;
        for (size_t i = b * KM_BLOCK; i < e; i++) s += v[i];
        bsum[b] = s;
    }
    double s = 0;
    for (size_t b = 0; b < nb; b++) s += bsum[b];
    return s;
}

/* Assign every point to its nearest centroid of C: (k, d); fills assign, dist; returns the MSE. */
static double km_assign(km_t *s, const float *C) {
    const int d = s->d, k = s->k;
    const size_t n = s->n;
    if (s->fused) {
        kvpq_nn_book book;
        kvpq__nn_book_init(&book, d, k, C, s->ct, s->cnorm);
        const kvpq_nn_fn nn = kvpq__cpu_kernels()->nn;
        size_t nb = (n + KM_BLOCK - 1) / KM_BLOCK;
#pragma omp parallel for num_threads(s->nt) schedule(dynamic, 1)
        for (size_t b = 0; b < nb; b++) {
            size_t i0 = b * KM_BLOCK, i1 = i0 + KM_BLOCK < n ? i0 + KM_BLOCK : n;
            nn(&book, i1 - i0, s->x + i0 * d, (size_t)d, s->assign + i0, 1);
            for (size_t i = i0; i < i1; i++) s->dist[i] = sqdist(s->x + i * d, C + (size_t)s->assign[i] * d, d);
        }
    } else {
        for (int c = 0; c < k; c++) {
            float t = 0;
            for (int j = 0; j < d; j++) t += C[(size_t)c * d + j] * C[(size_t)c * d + j];
            s->cnorm[c] = t;
        }
        size_t rows = GEMM_MAX_FLOATS / (size_t)k;
        if (rows < 1) rows = 1;
        for (size_t i0 = 0; i0 < n; i0 += rows) {
            size_t r = n - i0 < rows ? n - i0 : rows;
            /* G = -2 X C^T: (r, k), one dot product per (point, centroid) with the SIMD level's float
             * dot (libkvpq does not link a BLAS; this path serves only d outside {1, 2, 4, 8, 16}). */
            const kvpq__dot_fn dot = kvpq__cpu_kernels()->dot_f32;
#pragma omp parallel for num_threads(s->nt) schedule(static)
            for (size_t t = 0; t < r; t++)
                for (int c = 0; c < k; c++)
                    s->gemm[t * k + c] = -2.0f * dot(s->x + (i0 + t) * d, C + (size_t)c * d, d);
#pragma omp parallel for num_threads(s->nt) schedule(static)
            for (size_t t = 0; t < r; t++) {
                const float *g = s->gemm + t * k;
                float best = INFINITY;
                int32_t bi = 0;
                for (int c = 0; c < k; c++) {
                    float v = s->cnorm[c] + g[c];
                    if (v < best) {
                        best = v;
                        bi = c;
                    }
                }
                s->assign[i0 + t] = bi;
                s->dist[i0 + t] = sqdist(s->x + (i0 + t) * d, C + (size_t)bi * d, d);
            }
        }
    }
    return fixed_sum(s->dist, n, s->bsum, s->nt) / (double)n;
}

// ---- k-means++ ---------------------------------------------------------------------------------

static void km_seed_pp(km_t *s, rng_t *rng, float *C, size_t *pick, float *D) {
    const int d = s->d, k = s->k;
    size_t m = (size_t)k * KMPP_POINTS_PER_K;
    if (m > s->n) m = s->n;
    sample_sorted(rng, s->n, m, pick);
    size_t first = pick[(size_t)(rng_unif(rng) * (double)m)];
    memcpy(C, s->x + first * d, sizeof(float) * d);
    for (size_t i = 0; i < m; i++) D[i] = INFINITY;
    size_t nb = (m + KM_BLOCK - 1) / KM_BLOCK;
    for (int c = 1; c < k; c++) {
        const float *last = C + (size_t)(c - 1) * d;
        /* D[i] = min distance to the chosen centres; per-block sums in a fixed order */
#pragma omp parallel for num_threads(s->nt) if (m >= 4 * KM_BLOCK) schedule(static)
        for (size_t b = 0; b < nb; b++) {
            size_t e = (b + 1) * KM_BLOCK < m ? (b + 1) * KM_BLOCK : m;
            double bs = 0;
            for (size_t i = b * KM_BLOCK; i < e; i++) {
                float t = sqdist(s->x + pick[i] * d, last, d);
                if (t < D[i]) D[i] = t;
                bs += D[i];
            }
            s->bsum[b] = bs;
        }
        double total = 0;
        for (size_t b = 0; b < nb; b++) total += s->bsum[b];
        size_t chosen;
        if (!(total > 0)) { /* every point coincides with a centre: any point will do */
            chosen = pick[(size_t)(rng_unif(rng) * (double)m)];
        } else {
            double r = rng_unif(rng) * total, acc = 0;
            size_t b = 0;
            while (b + 1 < nb && acc + s->bsum[b] <= r) acc += s->bsum[b++];
            size_t i = b * KM_BLOCK, e = (b + 1) * KM_BLOCK < m ? (b + 1) * KM_BLOCK : m;
            size_t last_pos = i;
            for (; i < e; i++) {
                if (D[i] > 0) last_pos = i;
                acc += D[i];
                if (acc > r && D[i] > 0) break;
            }
            if (i >= e) i = last_pos; /* rounding ran off the block: take its last positive point */
            chosen = pick[i];
        }
        memcpy(C + (size_t)c * d, s->x + chosen * d, sizeof(float) * d);
    }
}

// ---- Lloyd -------------------------------------------------------------------------------------

/* C_new = cluster means of the current assignment; empty clusters are re-seeded by splitting the
 * largest cluster: the empty centroid moves a quarter of the way from the largest cluster's
 * centroid toward a random member of it (the largest keeps its centroid, so the MSE of the
 * current assignment does not change), and the two share its count for later choices. */
static int km_update(km_t *s, rng_t *rng, float *C, double *sums, size_t *counts) {
    const int d = s->d, k = s->k;
    memset(sums, 0, sizeof(double) * (size_t)k * d);
    memset(counts, 0, sizeof(size_t) * (size_t)k);
    for (size_t i = 0; i < s->n; i++) { /* serial: O(n d), fixed order */
        int32_t a = s->assign[i];
        double *sa = sums + (size_t)a * d;
        const float *xi = s->x + i * d;
        for (int j = 0; j < d; j++) sa[j] += xi[j];
        counts[a]++;
    }
    for (int c = 0; c < k; c++)
        if (counts[c])
            for (int j = 0; j < d; j++) C[(size_t)c * d + j] = (float)(sums[(size_t)c * d + j] / (double)counts[c]);
    int repaired = 0;
    for (int c = 0; c < k; c++) {
        if (counts[c]) continue;
        int big = 0;
        for (int b = 1; b < k; b++)
            if (counts[b] > counts[big]) big = b;
        if (counts[big] < 2) break; /* nothing to split */
        size_t r = (size_t)(rng_unif(rng) * (double)counts[big]), seen = 0, member = 0;
        for (size_t i = 0; i < s->n; i++)
            if (s->assign[i] == big && seen++ == r) {
                member = i;
                break;
            }
        const float *cb = C + (size_t)big * d, *p = s->x + member * d;
        for (int j = 0; j < d; j++) C[(size_t)c * d + j] = cb[j] + 0.25f * (p[j] - cb[j]);
        counts[c] = counts[big] / 2;
        counts[big] -= counts[c];
        repaired++;
    }
    return repaired;
}

static kvpq_status km_run(int d, int k, size_t n, const float *x, size_t x_stride, const kvpq_kmeans_params *kp,
                          uint64_t seed, const char *stage, float *centroids, kvpq_kmeans_report *rep) {
    const char *fn = "kvpq_kmeans";
    if (d <= 0 || k <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: d=%d, k=%d: expected > 0", fn, d, k);
    if (!x || !centroids) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: NULL array", fn);
    if (n < (size_t)k) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: n=%zu points < k=%d centroids", fn, n, k);
    if (kp->niter < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: niter=%d: expected >= 0", fn, kp->niter);
    if (kp->init != KVPQ_KMEANS_INIT_PP && kp->init != KVPQ_KMEANS_INIT_RANDOM)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: init=%d: expected KVPQ_KMEANS_INIT_PP (0) or _RANDOM (1)", fn,
                         kp->init);
    if (kp->max_points_per_centroid < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: max_points_per_centroid=%d: expected >= 1", fn,
                         kp->max_points_per_centroid);
    if (kp->n_threads < 0 || kp->n_threads > KVPQ_MAX_THREADS)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: n_threads=%d: expected 0..%d", fn, kp->n_threads, KVPQ_MAX_THREADS);
    const int nt = kp->n_threads > 0 ? kp->n_threads : omp_get_max_threads();

    /* Squared distances are summed in float: |a - b|^2 <= d (2 max|x|)^2 must stay below FLT_MAX, so
     * points beyond sqrt(FLT_MAX / (4 d)) (about 9e18 / sqrt(d)) are refused by name rather than
     * giving inf distances and NaN centroids. */
    const float lim = (float)sqrt(FLT_MAX / (4.0 * d));
    int bad = 0;
#pragma omp parallel for num_threads(nt) if (n * (size_t)d >= 65536) reduction(| : bad) schedule(static)
    for (size_t i = 0; i < n; i++)
        if (!kvpq__all_finite(x + i * x_stride, (size_t)d) || kvpq__max_abs(x + i * x_stride, (size_t)d) > lim) bad = 1;
    if (bad) {
        for (size_t i = 0; i < n; i++) {
            const float *xi = x + i * x_stride;
            if (!kvpq__all_finite(xi, (size_t)d))
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s: point %zu (of n=%zu) contains NaN or Inf", fn, i, n);
            if (kvpq__max_abs(xi, (size_t)d) > lim)
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s: point %zu (of n=%zu) holds %g: beyond %g, its squared "
                                 "distances overflow float32", fn, i, n, (double)kvpq__max_abs(xi, (size_t)d), (double)lim);
        }
    }

    rng_t rng = {seed ^ 0x6B6D65616E73ull}; /* "kmeans" */
    size_t n_used = (size_t)k * (size_t)kp->max_points_per_centroid;
    if (n_used > n) n_used = n;
    const int kpad = kvpq__nn_kpad(k);
    const int fused = (d == 1 || d == 2 || d == 4 || d == 8 || d == 16);
    size_t gemm_rows = GEMM_MAX_FLOATS / (size_t)k;
    if (gemm_rows < 1) gemm_rows = 1;
    size_t m_pp = (size_t)k * KMPP_POINTS_PER_K < n_used ? (size_t)k * KMPP_POINTS_PER_K : n_used;
    size_t nblocks = (n_used + KM_BLOCK - 1) / KM_BLOCK;

    km_t s = {.d = d, .k = k, .nt = nt, .n = n_used, .fused = fused};
    size_t *pick = malloc(sizeof(size_t) * (n_used > m_pp ? n_used : m_pp));
    float *xs = malloc(sizeof(float) * n_used * d);
    s.ct = fused ? malloc(sizeof(float) * (size_t)kpad * d) : NULL;
    s.cnorm = malloc(sizeof(float) * (size_t)kpad);
    s.gemm = fused ? NULL : malloc(sizeof(float) * gemm_rows * k);
    s.assign = malloc(sizeof(int32_t) * n_used);
    s.dist = malloc(sizeof(float) * (n_used > m_pp ? n_used : m_pp));
    s.bsum = malloc(sizeof(double) * (nblocks + 1));
    float *C = malloc(sizeof(float) * (size_t)k * d), *Cprev = malloc(sizeof(float) * (size_t)k * d);
    double *sums = malloc(sizeof(double) * (size_t)k * d);
    size_t *counts = malloc(sizeof(size_t) * (size_t)k);
    kvpq_status st = KVPQ_OK;
    if (!pick || !xs || (fused && !s.ct) || !s.cnorm || (!fused && !s.gemm) || !s.assign || !s.dist || !s.bsum || !C ||
        !Cprev || !sums || !counts) {
        st = kvpq__err(KVPQ_ERR_NOMEM, "%s: out of memory (n_used=%zu, k=%d, d=%d)", fn, n_used, k, d);
        goto done;
    }
    /* subsample (faiss: at most k * max_points_per_centroid points) into a contiguous copy */
    if (n_used < n) {
        sample_sorted(&rng, n, n_used, pick);
    } else {
        for (size_t i = 0; i < n; i++) pick[i] = i;
    }
    for (size_t i = 0; i < n_used; i++) memcpy(xs + i * d, x + pick[i] * x_stride, sizeof(float) * d);
    s.x = xs;

    if (kp->init == KVPQ_KMEANS_INIT_RANDOM) { /* k distinct points of the subsample (faiss's init) */
        sample_sorted(&rng, n_used, (size_t)k, pick);
        for (int c = 0; c < k; c++) memcpy(C + (size_t)c * d, xs + pick[c] * d, sizeof(float) * d);
    } else {
        km_seed_pp(&s, &rng, C, pick, s.dist);
    }
    double mse = km_assign(&s, C);
    kvpq_kmeans_report r = {.mse_init = mse, .mse_final = mse, .iterations = 0, .empty_repaired = 0, .n_used = n_used};
    if (kp->progress && kp->progress(kp->progress_user, stage, 0, kp->niter)) {
        st = kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: cancelled", fn);
        goto done;
    }
    for (int it = 1; it <= kp->niter; it++) {
        memcpy(Cprev, C, sizeof(float) * (size_t)k * d);
        int rep_it = km_update(&s, &rng, C, sums, counts);
        double mse_new = km_assign(&s, C);
        if (mse_new > mse) { /* rounding-level rise at a fixed point: keep the previous codebook */
            memcpy(C, Cprev, sizeof(float) * (size_t)k * d);
            break;
        }
        mse = mse_new;
        r.mse_final = mse;
        r.iterations = it;
        r.empty_repaired += rep_it;
        if (kp->progress && kp->progress(kp->progress_user, stage, it, kp->niter)) {
            st = kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: cancelled", fn);
            goto done;
        }
    }
    memcpy(centroids, C, sizeof(float) * (size_t)k * d);
    if (rep) *rep = r;
done:
    free(pick);
    free(xs);
    free(s.ct);
    free(s.cnorm);
    free(s.gemm);
    free(s.assign);
    free(s.dist);
    free(s.bsum);
    free(C);
    free(Cprev);
    free(sums);
    free(counts);
    return st;
}

kvpq_kmeans_params kvpq_kmeans_params_default(void) {
    kvpq_kmeans_params p = {.niter = 25, .max_points_per_centroid = 256, .seed = 1234, .n_threads = 0,
                            .progress = NULL, .progress_user = NULL, .init = KVPQ_KMEANS_INIT_PP};
    return p;
}

kvpq_status kvpq_kmeans(int d, int k, size_t n, const float *x, const kvpq_kmeans_params *kp, float *centroids,
                        kvpq_kmeans_report *report) {
    kvpq_kmeans_params def = kvpq_kmeans_params_default();
    if (!kp) kp = &def;
    return km_run(d, k, n, x, (size_t)d, kp, kp->seed, "kmeans", centroids, report);
}

/* SUBSPACE progress: sub-space m's iteration `done` is reported as m * niter + done of M * niter. */
typedef struct {
    const kvpq_kmeans_params *kp;
    int m, M;
} train_progress;
static int train_progress_fn(void *user, const char *stage, double done, double total) {
    const train_progress *tp = user;
    return tp->kp->progress(tp->kp->progress_user, stage, tp->m * total + done, tp->M * total);
}

/* Book i of n_books (a head's or a sub-space's centroids): k-means of the n sub-vectors of x (one
 * every stride floats) into cent, seeded by i, its progress reported as part i of n_books. */
static kvpq_status train_book(int dsub, int ksub, size_t n, const float *x, size_t stride, const kvpq_kmeans_params *kp,
                              int i, int n_books, float *cent, kvpq_kmeans_report *r) {
    uint64_t seed = kp->seed + 0x9E3779B97F4A7C15ull * (uint64_t)(i + 1);
    train_progress tp = {kp, i, n_books};
    kvpq_kmeans_params kpi = *kp;
    if (kp->progress) {
        kpi.progress = train_progress_fn;
        kpi.progress_user = &tp;
    }
    return km_run(dsub, ksub, n, x, stride, &kpi, seed, "pq_train", cent, r);
}

/* total += r, its errors times mul / div. */
static void report_add(kvpq_kmeans_report *total, const kvpq_kmeans_report *r, int mul, int div) {
    total->mse_init += r->mse_init * mul / div;
    total->mse_final += r->mse_final * mul / div;
    total->iterations += r->iterations;
    total->empty_repaired += r->empty_repaired;
    total->n_used += r->n_used;
}

kvpq_status kvpq_pq_train(kvpq_pq *pq, const kvpq_kmeans_params *kp, size_t n, const float *x,
                          kvpq_kmeans_report *report) {
    if (!pq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: pq is NULL");
    if (!x && n) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: x is NULL");
    kvpq_kmeans_params def = kvpq_kmeans_params_default();
    if (!kp) kp = &def;
    const int d = pq->p.d, M = pq->p.M, dsub = pq->dsub, ksub = pq->ksub;
    size_t nc = kvpq_pq_centroids_size(pq);
    float *cent = malloc(sizeof(float) * nc); /* trained here; pq keeps its codebook on failure */
    if (!cent) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_pq_train: out of memory");
    kvpq_kmeans_report total = {0};
    kvpq_status st = KVPQ_OK;
    if (pq->p.granularity == KVPQ_CODEBOOK_HEAD) {
        /* HEAD: per head, the (n / n_head) * M sub-vectors of its rows, gathered contiguous */
        const int nh = pq->p.n_head;
        const size_t nr = n / (size_t)nh;
        float *xh = NULL;
        if (n % (size_t)nh)
            st = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: n=%zu rows is not a multiple of n_head=%d (head "
                           "granularity)", n, nh);
        else if (nr * (size_t)M < (size_t)ksub)
            st = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: n=%zu vectors give %zu sub-vectors per head < ksub=%d",
                           n, nr * (size_t)M, ksub);
        else if (!(xh = malloc(sizeof(float) * nr * (size_t)d)))
            st = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_pq_train: out of memory");
        for (int h = 0; h < nh && st == KVPQ_OK; h++) {
            for (size_t r = 0; r < nr; r++)
                memcpy(xh + r * (size_t)d, x + (r * (size_t)nh + (size_t)h) * d, sizeof(float) * (size_t)d);
            kvpq_kmeans_report r;
            st = train_book(dsub, ksub, nr * (size_t)M, xh, (size_t)dsub, kp, h, nh, cent + (size_t)h * ksub * dsub, &r);
            if (st != KVPQ_OK) kvpq__err_prefix("kvpq_pq_train: head %d", h);
            report_add(&total, &r, M, nh); /* per d-dim vector, averaged over heads */
        }
        free(xh);
    } else if (pq->n_books == 1) {
        /* SHARED: the (n, d) array is (n * M, dsub) contiguous sub-vectors */
        if (n * (size_t)M < (size_t)ksub)
            st = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: n=%zu vectors give %zu sub-vectors < ksub=%d", n,
                           n * (size_t)M, ksub);
        else
            st = km_run(dsub, ksub, n * (size_t)M, x, (size_t)dsub, kp, kp->seed, "pq_train", cent, &total);
        /* per d-dim vector, like SUBSPACE's sum over sub-spaces */
        total.mse_init *= M;
        total.mse_final *= M;
    } else if (n < (size_t)ksub) {
        st = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_train: n=%zu vectors < ksub=%d (subspace codebooks)", n, ksub);
    } else {
        for (int m = 0; m < M && st == KVPQ_OK; m++) {
            kvpq_kmeans_report r;
            st = train_book(dsub, ksub, n, x + (size_t)m * dsub, (size_t)d, kp, m, M, cent + (size_t)m * ksub * dsub, &r);
            if (st != KVPQ_OK) kvpq__err_prefix("kvpq_pq_train: sub-space %d", m);
            report_add(&total, &r, 1, 1);
        }
    }
    if (st == KVPQ_OK) {
        memcpy(pq->centroids, cent, sizeof(float) * nc);
        kvpq__pq_update_norms(pq);
        if (report) *report = total;
    }
    free(cent);
    return st;
}
