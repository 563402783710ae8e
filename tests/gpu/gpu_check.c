/* gpu_check.c — checks of the CUDA backend against double-precision references (run on a GPU
 * machine by tests/gpu/run_gpu_tests.sh; registered in ctest, where it skips without a device).
 *
 *   encode: codes equal the reference argmin and the library's CPU path (kvpq_smooth_apply,
 *           kvpq_hadamard, kvpq_pq_encode) except near-ties (the two squared distances within
 *           TIE_REL of each other), and the reconstruction MSE differs by at most MSE_REL;
 *           every output byte written (two runs over outputs poisoned 0x00 and 0xFF agree).
 *   decode: equals the reference gather + inverse rotation + lambda to DECODE_REL.
 *   attend: equals softmax(q K^T / sqrt(d)) V in float64 over the dequantized codes (and the exact
 *           float32 window) to ATTEND_REL (relative L2 over the whole output); output poisoned
 *           with NaN before each run. Norm-explicit quantizers (g_ne): the reference dequantizes
 *           the stored direction codes times the stored float16 scales; the scales equal
 *           x'.r/|r|^2 in float64 to float16 rounding, the direction codes are the float64 argmin
 *           except near-ties; the codes and scales equal the CPU's own encode of the same
 *           (float16-exact) inputs except near-tie codes (counted and printed) and scales one
 *           float16 ulp apart; attention agrees with the CPU VQ cache's on sequences with no
 *           differing code (else the difference is printed); whole appends longer than one encode
 *           pass; a scale beyond float16 is refused at append naming the smallest such position
 *           (one or two bad rows, within a pass and across passes), and a good append at the same
 *           positions then succeeds.
 * Fresh random inputs every run (the seed is printed; KVPQ_SEED=... replays one). KVPQ_QUICK=1
 * shrinks the sizes (used under compute-sanitizer). Exit 0 pass, 1 fail, 77 skipped. */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpq.h"
#include "gpu_testutil.h"

/* Near-ties of the encode checks. A code c that differs from the reference's best b counts as a tie
 * when ||x-c||^2 - ||x-b||^2 <= TIE_REL (||x||^2 + ||x-b||^2) + 2 e ||c - b|| (x: the float64
 * transformed sub-vector), two terms:
 *  - the search's own float32 arithmetic: ||c||^2 - 2 x.c rounds relative to ||x||^2 + ||c||^2
 *    (<= ~12 (dsub + 1) 2^-24 (||x||^2 + ||x-b||^2) first-order worst case for two keys, 6.4e-6 at
 *    dsub 8, in practice far less); the tensor-core keys carry 2^-17 relative resolution: TIE_REL.
 *  - the input: the GPU and the CPU path search a float32 x' = x + e, not x. Smoothing rounds each
 *    element (x * fl(1/lambda): <= 2u relative, u = 2^-24); the float32 Walsh-Hadamard adds at most
 *    u |v| per butterfly stage (log2 d stages, each sqrt 2 times an orthogonal map of rounded sums,
 *    so each stage's error reaches the output scaled by exactly 1) and <= 3u for the 1/sqrt(d)
 *    scaling (rsqrtf's 2 ulp and the product): to first order ||e|| <= (log2 d + 5) u ||row|| over
 *    the whole transformed row, hence over any sub-vector. The error of an element is set by its
 *    row's norm, not by its own size, while ||x||^2 can be tiny at dsub 1 (an element near 0). A
 *    code optimal for x' is at most 2 ||e|| ||c - b|| worse than b at x, since the difference of
 *    two squared distances is linear in x: ||x-c||^2 - ||x-b||^2 = ||c||^2 - ||b||^2 - 2 x.(c - b).
 *    (Seed 4767417554760475544, d=256 dsub=1 nbits=12: x = 1.0128e-3 in a row of norm 18.2, the
 *    GPU's x' 1.66e-7 off, codes 2.5e-4 apart: gap 7.1e-11 against a TIE_REL term of 1.0e-11; the
 *    input term allows 2 * 1.4e-5 * 2.5e-4 = 6.9e-9. A wrong code passes only if it lies within
 *    2 ||e|| of the mirror image of b about x.) Without rotation e is per element:
 *    ||e|| <= 2u ||x||. */
#define TIE_REL 1e-5
#define F32_U (1.0 / 16777216.0)
/* brief: reconstruction MSE relative difference <= 1e-4 */
#define MSE_REL 1e-4
#define DECODE_REL 1e-5
/* brief: attention to 1e-3 relative against float64 */
#define ATTEND_REL 1e-3
/* Stored norm-explicit scale vs float64: float16 rounding (half an ulp, 2^-11 relative; 2^-25
 * absolute below float16's normal range) plus the float32 transform and normalization before it
 * (~(log2 d + 5) 2^-24 relative, 1e-5 is far above) */
#define SCALE_REL (1.0 / 2048 + 1e-5)
#define SCALE_ABS (1.0 / 33554432.0)
/* GPU vs CPU VQ cache attention on the same codebook and float16-exact inputs, applied only to the
 * sequences where no coded position's direction code differs between the two (ne_cpu_compare
 * measures the codes and scales directly first). The two encodes search float32 directions
 * rounded differently (the GPU's tensor-core search resolves distances to ~2^-17 relative, the
 * CPU's float32 search to ~2^-24), so near-tie codes can flip, and a flip moves one position's
 * score by about a centroid spacing times its scale: an attention difference set by the data, not
 * by either implementation, so a sequence with a flip is printed (difference and flip count) but
 * not held to a bound; the GPU's attention over its own codes is held to ATTEND_REL against float64
 * in every case. With equal codes, |GPU - CPU| <= |GPU - fp64(GPU codes)| (ATTEND_REL, checked)
 * + |CPU - fp64(CPU codes)| (float32 LUT, far smaller) + the effect of scales one float16 ulp apart
 * (counted and printed by ne_cpu_compare; each moves one score or one value by <= 2^-10 relative,
 * weighted by its probability). 5 ATTEND_REL leaves room for the first two; not for the third:
 * a key scale one ulp apart moves that key's score by up to 2^-10 of the score itself, and a
 * dominant key with a large score then moves the output by more than 5 ATTEND_REL (measured on an
 * H200: 7.1e-3, seed 4767462969500038701 under KVPQ_QUICK=1, one scale one ulp apart, no code
 * differing), so a sequence with a key scale one ulp apart is printed but not bounded, as one with
 * a flipped code. A value scale one ulp apart moves the output by at most 2^-10 of one value times
 * its probability: within the bound. A missing scale changes the output by about the norm of a vector (several times),
 * a scale of the wrong position by the spread of the norms (about 1/sqrt(2 head_dim) relative on
 * this data): far beyond this. */
#define CPU_GPU_REL (5 * ATTEND_REL)

static int g_fail = 0, g_quick = 0;
/* kernel variants (kvpq_cuda_kernels, kvpq.h) of every quantizer and cache the checks create;
 * main() walks them */
static kvpq_cuda_kernels g_kernels;
/* test hook (src/cuda/cache_cuda.cu): the codes and float16 scales a sequence holds */
extern kvpq_status kvpq__cuda_cache_read_codes(const kvpq_cuda_cache *c, int seq, uint8_t *kc, uint8_t *vc,
                                               uint16_t *ks, uint16_t *vs);
static uint64_t g_rng;

/* kvpq_cuda_pq_new with the kernel variants under check (g_kernels) */
static kvpq_cuda_pq *cuda_pq(const kvpq_pq *pq, int n_head_kv, const float *lambda, int rotate) {
    kvpq_cuda_pq_params p = kvpq_cuda_pq_params_default();
    p.n_head_kv = n_head_kv;
    p.lambda = lambda;
    p.rotate = rotate;
    p.kernels = g_kernels;
    kvpq_cuda_pq *q = NULL;
    KV_OK(kvpq_cuda_pq_new_params(&q, pq, &p));
    return q;
}

static uint64_t rng_next(void) {
    g_rng ^= g_rng << 13;
    g_rng ^= g_rng >> 7;
    g_rng ^= g_rng << 17;
    return g_rng;
}
static double urand(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }
static float nrand(void) {
    double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* ---- references (float64) ---------------------------------------------------------------------- */

static void ref_fwht(double *x, int d) {
    for (int s = 1; s < d; s <<= 1)
        for (int i = 0; i < d; i += 2 * s)
            for (int j = i; j < i + s; j++) {
                double a = x[j], b = x[j + s];
                x[j] = a + b;
                x[j + s] = a - b;
            }
    double sc = 1.0 / sqrt((double)d);
    for (int i = 0; i < d; i++) x[i] *= sc;
}

typedef struct {
    kvpq_pq_params p;
    int dsub, ksub, n_books;
    const float *C; /* (n_books, ksub, dsub) */
} ref_pq;

static const float *ref_cent(const ref_pq *q, int m, int c) {
    return q->C + ((size_t)(q->n_books == 1 ? 0 : m) * q->ksub + c) * q->dsub;
}
static double ref_dist(const ref_pq *q, const double *xs, int m, int c) {
    const float *cc = ref_cent(q, m, c);
    double d = 0;
    for (int j = 0; j < q->dsub; j++) d += (xs[j] - cc[j]) * (xs[j] - cc[j]);
    return d;
}
/* transformed row: x / lambda, then rotated */
static void ref_transform(const float *x, const float *lambda, int rotate, int d, double *out) {
    for (int i = 0; i < d; i++) out[i] = x[i] / (lambda ? (double)lambda[i] : 1.0);
    if (rotate) ref_fwht(out, d);
}
static int get_code(const uint8_t *row, int m, int nbits) {
    int v = 0;
    for (int b = 0; b < nbits; b++) {
        int bit = m * nbits + b;
        v |= ((row[bit >> 3] >> (bit & 7)) & 1) << b;
    }
    return v;
}
static void ref_decode_row(const ref_pq *q, const uint8_t *row, const float *lambda, int rotate, double *out) {
    int d = q->p.d;
    for (int m = 0; m < q->p.M; m++) {
        const float *cc = ref_cent(q, m, get_code(row, m, q->p.nbits));
        for (int j = 0; j < q->dsub; j++) out[m * q->dsub + j] = cc[j];
    }
    if (rotate) ref_fwht(out, d);
    for (int i = 0; i < d; i++) out[i] *= lambda ? (double)lambda[i] : 1.0;
}

static double row_norm(const double *x, int d) {
    double s = 0;
    for (int i = 0; i < d; i++) s += x[i] * x[i];
    return sqrt(s);
}

/* Whether code c, `gap` = ||x-c||^2 - ||x-b||^2 worse than code b at the float64 sub-vector x, is a
 * near-tie (see TIE_REL): 0 no, 1 within the TIE_REL term, 2 only with the input term. e_row bounds
 * the float32 input's error over the row (rotated), else the per-element smoothing error 2u ||x||. */
static int near_tie(const ref_pq *q, const double *x, int m, int c, int b, double gap, double e_row, int smooth) {
    const float *cc = ref_cent(q, m, c), *cb = ref_cent(q, m, b);
    double xn = 0, bd = 0, cbn = 0;
    for (int j = 0; j < q->dsub; j++) {
        xn += x[j] * x[j];
        bd += (x[j] - cb[j]) * (x[j] - cb[j]);
        cbn += ((double)cc[j] - cb[j]) * ((double)cc[j] - cb[j]);
    }
    const double e = e_row > 0 ? e_row : smooth ? 2 * F32_U * sqrt(xn) : 0;
    const double t = TIE_REL * (xn + bd + 1e-30);
    return gap <= t ? 1 : gap <= t + 2 * e * sqrt(cbn) ? 2 : 0;
}

/* Random centroids sc * N(0, 1) into pq (params pp); r describes it. */
static void fill_pq(kvpq_pq *pq, const kvpq_pq_params *pp, float sc, ref_pq *r) {
    size_t n = kvpq_pq_centroids_size(pq);
    float *c = malloc(n * sizeof *c);
    for (size_t i = 0; i < n; i++) c[i] = sc * nrand();
    KV_OK(kvpq_pq_set_centroids(pq, c, n));
    free(c);
    r->p = *pp;
    r->dsub = pp->d / pp->M;
    r->ksub = 1 << pp->nbits;
    r->n_books = pp->granularity == KVPQ_CODEBOOK_SHARED ? 1 : pp->M;
    r->C = kvpq_pq_centroids(pq);
}

static kvpq_pq *make_pq(int d, int dsub, int nbits, kvpq_codebook_granularity g, ref_pq *r, float *scale_out) {
    kvpq_pq_params pp = {.d = d, .M = d / dsub, .nbits = nbits, .granularity = g};
    kvpq_pq *pq;
    KV_OK(kvpq_pq_new(&pq, &pp));
    float sc = 0.5f + (float)urand();
    fill_pq(pq, &pp, sc, r);
    if (scale_out) *scale_out = sc;
    return pq;
}

/* x rounded to the nearest float16 value (ties to even), as a float; beyond float16's range: x. */
static float f16_round(float x) {
    if (!(fabsf(x) < 65520.f) || x == 0.f) return x;
    int e;
    frexpf(x, &e);             /* |x| in [2^(e-1), 2^e): float16 ulp 2^(e-11), at least 2^-24 */
    int ue = e - 11 < -24 ? -24 : e - 11;
    return ldexpf(nearbyintf(ldexpf(x, -ue)), ue);
}
static double f16_value(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}

/* ---- encode / decode ----------------------------------------------------------------------------- */

static void check_encode(int d, int dsub, int nbits, kvpq_codebook_granularity g, int H, int n_tok, int smooth,
                         int rotate, float xscale) {
    ref_pq r;
    float sc;
    kvpq_pq *pq = make_pq(d, dsub, nbits, g, &r, &sc);
    size_t cs = kvpq_pq_code_size(pq), nrow = (size_t)n_tok * H, nx = nrow * d;
    float *x = malloc(nx * sizeof *x), *lambda = NULL;
    for (size_t i = 0; i < nx; i++) x[i] = xscale * sc * nrand();
    if (smooth) {
        lambda = malloc((size_t)H * d * sizeof *lambda);
        for (int i = 0; i < H * d; i++) lambda[i] = 0.5f + 1.5f * (float)urand();
        for (size_t i = 0; i < nx; i++) x[i] *= lambda[i % ((size_t)H * d)];
    }
    kvpq_cuda_pq *q = cuda_pq(pq, H, lambda, rotate);
    float *dx;
    uint8_t *dc;
    CUDA_OK(cudaMalloc((void **)&dx, nx * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dc, nrow * cs));
    CUDA_OK(cudaMemcpy(dx, x, nx * sizeof(float), cudaMemcpyHostToDevice));
    uint8_t *c0 = malloc(nrow * cs), *c1 = malloc(nrow * cs);
    CUDA_OK(cudaMemset(dc, 0x00, nrow * cs));
    KV_OK(kvpq_cuda_pq_encode(q, (size_t)n_tok, dx, dc));
    CUDA_OK(cudaMemcpy(c0, dc, nrow * cs, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemset(dc, 0xFF, nrow * cs));
    KV_OK(kvpq_cuda_pq_encode(q, (size_t)n_tok, dx, dc));
    CUDA_OK(cudaMemcpy(c1, dc, nrow * cs, cudaMemcpyDeviceToHost));
    CHECK(!memcmp(c0, c1, nrow * cs), "encode d=%d dsub=%d nbits=%d: output bytes not all written", d, dsub, nbits);
    /* padding bits past M*nbits must be zero (as the CPU packer writes them) */
    int M = d / dsub, ties = 0, ties_input = 0, bad = 0, log2d = 0;
    while ((1 << log2d) < d) log2d++;
    double mse_gpu = 0, mse_ref = 0;
    double *xt = malloc(d * sizeof *xt);
    for (size_t rw = 0; rw < nrow; rw++) {
        const float *lam = lambda ? lambda + (rw % H) * d : NULL;
        ref_transform(x + rw * d, lam, rotate, d, xt);
        const double e_row = rotate ? (log2d + 5) * F32_U * row_norm(xt, d) : 0;
        for (int m = 0; m < M; m++) {
            int best = 0;
            double bd = INFINITY;
            for (int c = 0; c < r.ksub; c++) {
                double dd = ref_dist(&r, xt + m * dsub, m, c);
                if (dd < bd) {
                    bd = dd;
                    best = c;
                }
            }
            int gc = get_code(c0 + rw * cs, m, nbits);
            double gd = gc < r.ksub ? ref_dist(&r, xt + m * dsub, m, gc) : INFINITY;
            mse_gpu += gd;
            mse_ref += bd;
            if (gc != best) {
                const int nt = gc < r.ksub ? near_tie(&r, xt + m * dsub, m, gc, best, gd - bd, e_row, smooth) : 0;
                if (nt) ties++;
                else bad++;
                ties_input += nt == 2;
            }
        }
        int used_bits = M * nbits;
        if (used_bits % 8) {
            uint8_t last = c0[rw * cs + cs - 1] >> (used_bits % 8);
            if (last) bad++;
        }
    }
    /* the CPU path of the library (smoothing, Hadamard, kvpq_pq_encode): same codes except near-ties */
    float *xc = malloc(nx * sizeof *xc);
    uint8_t *cc = malloc(nrow * cs);
    memcpy(xc, x, nx * sizeof *xc);
    if (smooth) KV_OK(kvpq_smooth_apply(xc, (size_t)n_tok, H, d, lambda, 0));
    if (rotate) KV_OK(kvpq_hadamard(xc, nrow, d));
    KV_OK(kvpq_pq_encode(pq, nrow, xc, cc));
    int cpu_diff = 0, cpu_bad = 0;
    double mse_cpu = 0;
    for (size_t rw = 0; rw < nrow; rw++) {
        ref_transform(x + rw * d, lambda ? lambda + (rw % H) * d : NULL, rotate, d, xt);
        const double e_row = rotate ? (log2d + 5) * F32_U * row_norm(xt, d) : 0;
        for (int m = 0; m < M; m++) {
            int gc = get_code(c0 + rw * cs, m, nbits), ccode = get_code(cc + rw * cs, m, nbits);
            double gd = gc < r.ksub ? ref_dist(&r, xt + m * dsub, m, gc) : INFINITY;
            double cd = ref_dist(&r, xt + m * dsub, m, ccode);
            mse_cpu += cd;
            if (gc != ccode) {
                /* both are near-optimal for their own float32 x': the same band, either way round */
                const int lo = gd < cd ? gc : ccode, hi = gd < cd ? ccode : gc;
                cpu_diff++;
                if (gc >= r.ksub || !near_tie(&r, xt + m * dsub, m, hi, lo, fabs(gd - cd), e_row, smooth)) cpu_bad++;
            }
        }
    }
    double rel_cpu = fabs(mse_gpu - mse_cpu) / (mse_cpu > 0 ? mse_cpu : 1);
    CHECK(cpu_bad == 0 && rel_cpu <= MSE_REL,
          "encode vs CPU kvpq_pq_encode d=%d dsub=%d nbits=%d: %d codes differ beyond ties, MSE rel diff %.3g", d, dsub,
          nbits, cpu_bad, rel_cpu);
    free(xc);
    free(cc);
    double rel = fabs(mse_gpu - mse_ref) / (mse_ref > 0 ? mse_ref : 1);
    CHECK(bad == 0 && rel <= MSE_REL,
          "encode d=%d dsub=%d nbits=%d %s smooth=%d rotate=%d: %d codes differ beyond ties, MSE rel diff %.3g", d,
          dsub, nbits, g ? "subspace" : "shared", smooth, rotate, bad, rel);
    /* decode */
    float *dy, *y = malloc(nx * sizeof *y);
    CUDA_OK(cudaMalloc((void **)&dy, nx * sizeof(float)));
    CUDA_OK(cudaMemset(dy, 0xFF, nx * sizeof(float)));
    KV_OK(kvpq_cuda_pq_decode(q, (size_t)n_tok, dc, dy));
    CUDA_OK(cudaMemcpy(y, dy, nx * sizeof(float), cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t rw = 0; rw < nrow; rw++) {
        ref_decode_row(&r, c0 + rw * cs, lambda ? lambda + (rw % H) * d : NULL, rotate, xt);
        for (int i = 0; i < d; i++) {
            double e = (double)y[rw * d + i] - xt[i];
            num += isfinite(y[rw * d + i]) ? e * e : INFINITY;
            den += xt[i] * xt[i];
        }
    }
    double drel = sqrt(num / (den > 0 ? den : 1));
    CHECK(drel <= DECODE_REL, "decode d=%d dsub=%d nbits=%d: relative error %.3g", d, dsub, nbits, drel);
    printf("  encode d=%3d dsub=%2d nbits=%2d %-8s smooth=%d rotate=%d rows=%zu: vs fp64 near-ties %d (%d by the input "
           "term), MSE rel diff %.2e; vs CPU %d differ (ties), MSE rel diff %.2e; decode rel err %.2e\n",
           d, dsub, nbits, g ? "subspace" : "shared", smooth, rotate, nrow, ties, ties_input, rel, cpu_diff, rel_cpu,
           drel);
    /* NaN input */
    float nan = NAN;
    CUDA_OK(cudaMemcpy(dx + (nx / 2), &nan, sizeof nan, cudaMemcpyHostToDevice));
    kvpq_status s = kvpq_cuda_pq_encode(q, (size_t)n_tok, dx, dc);
    CHECK(s == KVPQ_ERR_NONFINITE, "encode with NaN returned %d (%s)", (int)s, kvpq_last_error());
    cudaFree(dx);
    cudaFree(dc);
    cudaFree(dy);
    kvpq_cuda_pq_free(q);
    kvpq_pq_free(pq);
    free(x);
    free(lambda);
    free(c0);
    free(c1);
    free(y);
    free(xt);
}

/* ---- attention ----------------------------------------------------------------------------------- */

/* Positions per page of the next check_attend caches (the tensor-core kernel takes powers of two
 * >= 32; other sizes take the LUT kernel). */
static int g_page_tokens = 64;
/* Norm-explicit quantizers of the next check_attend caches: bit 0 keys, bit 1 values (0: plain). */
static int g_ne = 0;
/* 1: check_attend appends each sequence in one kvpq_cuda_cache_append call (else in random pieces);
 * a norm-explicit append longer than one pass of the encode workspace (4 MiB / (n_head_kv *
 * head_dim * 4) tokens) then runs the passes after the first (t0 > 0 in kvpq__cuda_encode_ne_launch) */
static int g_whole = 0;
/* 1: the cache's max_seq is exactly the longest sequence, so that a window longer than it is clamped
 * (kvpq_cuda_cache_new holds the whole sequence then, as kvpq_cache_new does) */
static int g_tight = 0;

/* The float64 transformed vector x' of a stored row: keys H((k - mu) / lambda), values H v or v. */
static void ref_transformed(const float *x, const float *mu, const float *lambda, int rotate, int d, double *out) {
    for (int i = 0; i < d; i++) out[i] = ((double)x[i] - (mu ? mu[i] : 0.0)) / (lambda ? (double)lambda[i] : 1.0);
    if (rotate) ref_fwht(out, d);
}

/* Norm-explicit checks of one stored row (codes `row`, float16 scale `sh`) of transformed x (d):
 * the scale against x'.r/|r|^2 in float64 (r = the centroids of the stored codes; returns the error
 * relative to SCALE_REL |s| + SCALE_ABS, <= 1 passes) and, when codes_too, each direction code
 * against the float64 argmin for u = x/|x| (near-ties allowed: u is float32 after a float32
 * transform, ||e|| <= (log2 d + 7) u; adds the codes that are not to *bad_codes). */
static double ne_check_row(const ref_pq *q, const uint8_t *row, uint16_t sh, const double *x, int codes_too,
                           int *bad_codes) {
    const int d = q->p.d;
    double xr = 0, rr = 0, xx = 0;
    for (int m = 0; m < q->p.M; m++) {
        const float *c = ref_cent(q, m, get_code(row, m, q->p.nbits));
        for (int j = 0; j < q->dsub; j++) {
            xr += x[m * q->dsub + j] * c[j];
            rr += (double)c[j] * c[j];
        }
    }
    for (int i = 0; i < d; i++) xx += x[i] * x[i];
    const double s64 = rr > 0 ? xr / rr : 0.0, err = fabs(f16_value(sh) - s64);
    if (codes_too && xx > 0) {
        int log2d = 0;
        while ((1 << log2d) < d) log2d++;
        double *u = malloc(d * sizeof *u);
        for (int i = 0; i < d; i++) u[i] = x[i] / sqrt(xx);
        for (int m = 0; m < q->p.M; m++) {
            int best = 0, gc = get_code(row, m, q->p.nbits);
            double bd = INFINITY;
            for (int c = 0; c < q->ksub; c++) {
                double dd = ref_dist(q, u + m * q->dsub, m, c);
                if (dd < bd) {
                    bd = dd;
                    best = c;
                }
            }
            if (gc != best &&
                (gc >= q->ksub || !near_tie(q, u + m * q->dsub, m, gc, best, ref_dist(q, u + m * q->dsub, m, gc) - bd,
                                             (log2d + 7) * F32_U, 0)))
                (*bad_codes)++;
        }
        free(u);
    }
    return err / (SCALE_REL * fabs(s64) + SCALE_ABS);
}

/* Counts of ne_cpu_compare over a check_attend run. */
typedef struct {
    long rows;        /* (position, KV head) rows compared */
    long flips;       /* direction codes (sub-vectors) that differ from the CPU's, all near-ties */
    long bad_codes;   /* ... of those, beyond the near-tie rule (fails) */
    long scale_ulp;   /* rows whose codes all agree and whose scales differ by one float16 ulp */
    long scale_bad;   /* ... by more than one float16 ulp (fails) */
} ne_cpu_counts;

/* The spacing of float16 values around |a| and |b| (the larger of the two): 2^-24 below 2^-14. */
static double f16_ulp(double a, double b) {
    const double v = fabs(a) > fabs(b) ? fabs(a) : fabs(b);
    if (v < 1.0 / 16384) return 1.0 / 16777216.0;
    int e;
    frexp(v, &e); /* v in [2^(e-1), 2^e) */
    return ldexp(1.0, e - 11);
}

/* The CPU VQ cache's own encode of the L positions x (L, H, d) of one kind (src/cache/cache_vq.c:
 * vq_stage_encode then vq_encode, on float16-exact inputs so its float16 window rounding changes
 * nothing): keys (k - mu) / lambda in float (mu NULL: 0), rotated by kvpq_hadamard when rotate,
 * kvpq_normalize_rows, kvpq_pq_encode of the directions, scale s = |x'| (u.r) / |r|^2 in double
 * (r = kvpq_pq_decode of the codes), rounded to float then float16; compared with the codes gc and
 * scales gs the GPU cache stored. A code may differ only at a near-tie of the float64 direction
 * (both searches see a float32 u within (log2 d + 7) 2^-24 of it, the rule of ne_check_row and of
 * check_encode's comparison with the CPU); where all codes of a row agree the two scales come from
 * the same r and an x' equal to float32 rounding, so they may differ by at most one float16 ulp.
 * flips_at[t] (L) counts the differing codes of position t, and (is_key) its key scales one float16
 * ulp apart. gs NULL: a plain quantizer of a cache whose other kind is norm-explicit (the keys of
 * g_ne == 2, the values of g_ne == 1): the codes of x' itself, no normalization, no scales; its
 * near-tie flips count too (the CPU VQ cache codes them with its own float32 search: a flipped key
 * code of a large score moved the attention by 1.2e-2 on an H200, seed 4767639356757468334 under
 * racecheck, when only the norm-explicit kind's flips were counted). */
static void ne_cpu_compare(const kvpq_pq *pq, const ref_pq *q, const float *x, int L, int H, const float *mu,
                           const float *lambda, int rotate, const uint8_t *gc, const uint16_t *gs, int is_key,
                           int *flips_at, ne_cpu_counts *cnt) {
    const int d = q->p.d, M = q->p.M, ne = gs != NULL;
    const size_t n = (size_t)L * H, cs = kvpq_pq_code_size(pq);
    float *xc = malloc(n * d * sizeof *xc), *r = malloc(n * d * sizeof *r), *nrm = malloc(n * sizeof *nrm);
    uint8_t *cc = malloc(n * cs);
    double *x64 = malloc(d * sizeof *x64);
    for (size_t i = 0; i < n; i++) {
        const size_t h = i % (size_t)H;
        for (int j = 0; j < d; j++) {
            float v = x[i * d + j];
            if (lambda) v = (v - (mu ? mu[h * d + j] : 0.f)) / lambda[h * d + j];
            xc[i * d + j] = v;
        }
    }
    if (rotate) KV_OK(kvpq_hadamard(xc, n, d));
    if (ne) KV_OK(kvpq_normalize_rows(xc, n, d, nrm));
    KV_OK(kvpq_pq_encode(pq, n, xc, cc));
    KV_OK(kvpq_pq_decode(pq, n, cc, r));
    int log2d = 0;
    while ((1 << log2d) < d) log2d++;
    for (size_t i = 0; i < n; i++) {
        const uint8_t *grow = gc + i * cs, *crow = cc + i * cs;
        int diff = 0, have_u = 0;
        for (int m = 0; m < M; m++) {
            const int a = get_code(grow, m, q->p.nbits), b = get_code(crow, m, q->p.nbits);
            if (a == b) continue;
            diff++;
            if (!have_u) { /* the float64 direction of this row */
                const size_t h = i % (size_t)H;
                ref_transformed(x + i * d, mu && lambda ? mu + h * d : NULL, lambda ? lambda + h * d : NULL, rotate, d,
                                x64);
                const double nx = ne ? row_norm(x64, d) : 1.0;
                for (int j = 0; j < d; j++) x64[j] = nx > 0 ? x64[j] / nx : 0.0;
                have_u = 1;
            }
            const double *um = x64 + m * q->dsub;
            const double da = a < q->ksub ? ref_dist(q, um, m, a) : INFINITY, db = ref_dist(q, um, m, b);
            const int lo = da < db ? a : b, hi = da < db ? b : a;
            if (a >= q->ksub || !near_tie(q, um, m, hi, lo, fabs(da - db), (log2d + 7) * F32_U, 0)) cnt->bad_codes++;
        }
        cnt->flips += diff;
        flips_at[i / (size_t)H] += diff;
        cnt->rows++;
        if (diff || !ne) continue;
        double ur = 0, rr = 0;
        for (int j = 0; j < d; j++) {
            ur += (double)xc[i * d + j] * r[i * d + j];
            rr += (double)r[i * d + j] * r[i * d + j];
        }
        const double cpu = f16_round((float)(rr > 0 ? nrm[i] * ur / rr : 0.0)), gpu = f16_value(gs[i]);
        if (gpu != cpu) {
            if (fabs(gpu - cpu) <= f16_ulp(gpu, cpu)) cnt->scale_ulp++;
            else cnt->scale_bad++;
            if (is_key) flips_at[i / (size_t)H]++; /* the sequence is then not bounded (CPU_GPU_REL) */
        }
    }
    free(xc);
    free(r);
    free(nrm);
    free(cc);
    free(x64);
}

/* A page longer than max_seq is cut to the smallest power of two >= max_seq (kvpq_cuda_cache_new):
 * a cache with pages of 65536 positions and max_seq 100 holds what one with pages of 128 holds (the
 * same resident bytes; before the cut its one page per sequence took 512 times the code bytes) and
 * attends with the same bits; page_tokens 96 (not a power of two, shorter than max_seq 100) stays. */
static void check_page_clamp(void) {
    const int D = 128, H = 8, NH = 32, MS = 100, lens[2] = {100, 37};
    ref_pq rk, rv;
    float sck, scv;
    kvpq_pq *kpq = make_pq(D, 4, 8, KVPQ_CODEBOOK_SHARED, &rk, &sck), *vpq = make_pq(D, 4, 8, KVPQ_CODEBOOK_SHARED, &rv, &scv);
    const size_t row = (size_t)H * D, nq = (size_t)2 * NH * D;
    float *k = malloc(MS * row * sizeof *k), *v = malloc(MS * row * sizeof *v), *q = malloc(nq * sizeof *q);
    float *o[2] = {malloc(nq * sizeof(float)), malloc(nq * sizeof(float))}, *dk, *dv, *dq, *dout;
    for (size_t i = 0; i < MS * row; i++) {
        k[i] = sck * nrand();
        v[i] = scv * nrand();
    }
    for (size_t i = 0; i < nq; i++) q[i] = nrand() / sck;
    CUDA_OK(cudaMalloc((void **)&dk, MS * row * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dv, MS * row * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dq, nq * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dout, nq * sizeof(float)));
    CUDA_OK(cudaMemcpy(dk, k, MS * row * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dv, v, MS * row * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice));
    size_t res[2] = {0, 0};
    const int pts[2] = {65536, 128};
    for (int i = 0; i < 2; i++) {
        kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
        cp.n_head = NH;
        cp.n_head_kv = H;
        cp.head_dim = D;
        cp.n_seq = 2;
        cp.max_seq = MS;
        cp.window = 16;
        cp.page_tokens = pts[i];
        cp.key = kpq;
        cp.value = vpq;
        cp.value_rotate = 1;
        cp.kernels = g_kernels;
        kvpq_cuda_cache *c;
        KV_OK(kvpq_cuda_cache_new(&c, &cp));
        for (int b = 0; b < 2; b++) KV_OK(kvpq_cuda_cache_append(c, b, lens[b], dk, dv));
        res[i] = kvpq_cuda_cache_resident_bytes(c);
        CUDA_OK(cudaMemset(dout, 0xFF, nq * sizeof(float)));
        KV_OK(kvpq_cuda_cache_attend(c, 2, dq, dout));
        CUDA_OK(cudaMemcpy(o[i], dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
        kvpq_cuda_cache_free(c);
    }
    CHECK(res[0] == res[1], "pages of 65536 with max_seq %d: resident bytes %zu, pages of 128: %zu", MS, res[0], res[1]);
    CHECK(memcmp(o[0], o[1], nq * sizeof(float)) == 0, "pages of 65536 with max_seq %d attend differently from pages of 128", MS);
    { /* a page shorter than max_seq is kept whatever its length (96: the LUT kernel's pages) */
        kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
        cp.n_head = NH;
        cp.n_head_kv = H;
        cp.head_dim = D;
        cp.n_seq = 1;
        cp.max_seq = MS;
        cp.page_tokens = 96;
        cp.key = kpq;
        cp.value = vpq;
        kvpq_cuda_cache *c;
        KV_OK(kvpq_cuda_cache_new(&c, &cp));
        KV_OK(kvpq_cuda_cache_append(c, 0, 97, dk, dv)); /* two pages */
        const size_t two = kvpq_cuda_cache_resident_bytes(c);
        KV_OK(kvpq_cuda_cache_clear(c, 0));
        KV_OK(kvpq_cuda_cache_append(c, 0, 96, dk, dv)); /* one page */
        const size_t one = kvpq_cuda_cache_resident_bytes(c);
        CHECK(two - one == (size_t)96 * H * (kvpq_pq_code_size(kpq) + kvpq_pq_code_size(vpq)),
              "pages of 96, max_seq 100: one page is %zu bytes, expected %zu", two - one,
              (size_t)96 * H * (kvpq_pq_code_size(kpq) + kvpq_pq_code_size(vpq)));
        kvpq_cuda_cache_free(c);
    }
    printf("page clamp: pages of 65536 with max_seq %d hold %zu resident bytes, as pages of 128; same attention bits\n", MS,
           res[0]);
    CUDA_OK(cudaFree(dk));
    CUDA_OK(cudaFree(dv));
    CUDA_OK(cudaFree(dq));
    CUDA_OK(cudaFree(dout));
    free(k);
    free(v);
    free(q);
    free(o[0]);
    free(o[1]);
    kvpq_pq_free(kpq);
    kvpq_pq_free(vpq);
}

/* with_mean: the cache centers keys by a per-(KV head, channel) mean mu (key_mean); keys are drawn
 * around a large mu, the reference attends over dequantized codes of k - mu, plus mu. The error is
 * checked over the whole batch and per sequence (a short sequence, mostly window, must not hide a
 * long one's error). */
static void check_attend(int D, int n_head, int n_head_kv, int kdsub, int knbits, int vdsub, int vnbits,
                         kvpq_codebook_granularity g, int window, int value_rotate, int B, const int *lens,
                         int with_mean) {
    ref_pq rk, rv;
    float sck, scv;
    kvpq_pq *kpq, *vpq;
    kvpq_codebook *cb = NULL; /* norm-explicit runs: the quantizers of a codebook with k.norm / v.norm */
    const int kne = g_ne & 1, vne = (g_ne >> 1) & 1;
    if (g_ne) {
        kvpq_codebook_params bp = kvpq_codebook_params_default();
        bp.n_layer = 1;
        bp.n_head_kv = n_head_kv;
        bp.head_dim = D;
        bp.key = (kvpq_pq_params){.d = D, .M = D / kdsub, .nbits = knbits, .granularity = g};
        bp.value = (kvpq_pq_params){.d = D, .M = D / vdsub, .nbits = vnbits, .granularity = g};
        bp.value_rotate = value_rotate;
        bp.key_norm = kne;
        bp.value_norm = vne;
        KV_OK(kvpq_codebook_new(&cb, &bp));
        kpq = kvpq_codebook_pq(cb, 0, 0);
        vpq = kvpq_codebook_pq(cb, 0, 1);
        sck = 0.5f + (float)urand(); /* data scales */
        scv = 0.5f + (float)urand();
        /* a direction codebook's elements are ~ 1/sqrt(D) (unit vectors) */
        fill_pq(kpq, &bp.key, kne ? (0.5f + (float)urand()) / sqrtf((float)D) : sck, &rk);
        fill_pq(vpq, &bp.value, vne ? (0.5f + (float)urand()) / sqrtf((float)D) : scv, &rv);
    } else {
        kpq = make_pq(D, kdsub, knbits, g, &rk, &sck);
        vpq = make_pq(D, vdsub, vnbits, g, &rv, &scv);
    }
    int H = n_head_kv, maxL = 0;
    for (int b = 0; b < B; b++) maxL = lens[b] > maxL ? lens[b] : maxL;
    float *lambda = malloc((size_t)H * D * sizeof *lambda);
    for (int i = 0; i < H * D; i++) lambda[i] = 0.5f + 1.5f * (float)urand();
    float *mu = NULL;
    if (with_mean) {
        mu = malloc((size_t)H * D * sizeof *mu);
        for (int i = 0; i < H * D; i++) mu[i] = 4.f * sck * nrand();
    }
    kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
    cp.n_head = n_head;
    cp.n_head_kv = n_head_kv;
    cp.head_dim = D;
    cp.n_seq = B;
    cp.max_seq = g_tight ? maxL : maxL + 64 > window ? maxL + 64 : window;
    cp.window = window;
    cp.page_tokens = g_page_tokens;
    cp.n_pages = 0;
    cp.key = kpq;
    cp.value = vpq;
    cp.key_smooth = lambda;
    cp.value_rotate = value_rotate;
    cp.key_mean = mu;
    cp.kernels = g_kernels;
    kvpq_cuda_cache *c;
    if (mu) { /* a non-finite mean is refused at creation, naming it */
        float keep = mu[3];
        mu[3] = NAN;
        c = (kvpq_cuda_cache *)1;
        kvpq_status sm = kvpq_cuda_cache_new(&c, &cp);
        CHECK(sm == KVPQ_ERR_NONFINITE && strstr(kvpq_last_error(), "key_mean[3]"),
              "cache with a NaN key_mean returned %d (%s)", (int)sm, kvpq_last_error());
        mu[3] = keep;
    }
    KV_OK(kvpq_cuda_cache_new(&c, &cp));
    if (g_tight) { /* the window ring holds min(window, max_seq) positions: resident bytes before any append */
        const int wc = window < cp.max_seq ? window : cp.max_seq, max_pages = (cp.max_seq + g_page_tokens - 1) / g_page_tokens;
        const int tc_img = g_kernels.attend_tc && g == KVPQ_CODEBOOK_SHARED && kdsub == 4 && vdsub == 4 && knbits == 8 &&
                           vnbits == 8;
        const size_t want = 2 * (size_t)B * wc * n_head_kv * D * sizeof(float) +
                            ((size_t)rk.n_books * rk.ksub * (kdsub + 1) + (size_t)rv.n_books * rv.ksub * (vdsub + 1)) * 4 +
                            (size_t)B * (max_pages + 1) * sizeof(int) + (tc_img ? 65536 : 0);
        CHECK(kvpq_cuda_cache_resident_bytes(c) == want, "window %d > max_seq %d: resident bytes %zu, expected %zu (window %d)",
              window, cp.max_seq, kvpq_cuda_cache_resident_bytes(c), want, wc);
        printf("  window %d > max_seq %d: created, ring of %d positions (%zu resident bytes)\n", window, cp.max_seq, wc,
               kvpq_cuda_cache_resident_bytes(c));
    }
    /* same quantizers, to read back the codes the cache stored */
    kvpq_cuda_pq *kq = cuda_pq(kpq, H, lambda, 1), *vq = cuda_pq(vpq, H, NULL, value_rotate);
    size_t row = (size_t)H * D, kcs = kvpq_pq_code_size(kpq), vcs = kvpq_pq_code_size(vpq);
    float **K = malloc(B * sizeof *K), **V = malloc(B * sizeof *V);
    double **Kh = malloc(B * sizeof *Kh), **Vh = malloc(B * sizeof *Vh);
    float *dk, *dv;
    uint8_t *dkc, *dvc;
    CUDA_OK(cudaMalloc((void **)&dk, (size_t)maxL * row * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dv, (size_t)maxL * row * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dkc, (size_t)maxL * H * kcs));
    CUDA_OK(cudaMalloc((void **)&dvc, (size_t)maxL * H * vcs));
    uint8_t *kc = malloc((size_t)maxL * H * kcs), *vc = malloc((size_t)maxL * H * vcs);
    uint16_t *ksc = malloc((size_t)maxL * H * sizeof *ksc), *vsc = malloc((size_t)maxL * H * sizeof *vsc);
    double *xt64 = malloc((size_t)D * sizeof *xt64), ne_scale_worst = 0;
    int ne_bad_codes = 0;
    long ne_rows = 0;
    ne_cpu_counts nec = {0, 0, 0, 0, 0}, plc = {0, 0, 0, 0, 0}; /* norm-explicit kinds, the plain kind */
    int *flips_at = calloc((size_t)maxL + 1, sizeof *flips_at); /* (maxL) differing codes of a position */
    int *flips_seq = calloc((size_t)B, sizeof *flips_seq);      /* (B) ... over the positions coded there */
    for (int b = 0; b < B; b++) {
        int L = lens[b];
        K[b] = malloc((size_t)L * row * sizeof(float));
        V[b] = malloc((size_t)L * row * sizeof(float));
        Kh[b] = malloc((size_t)L * row * sizeof(double));
        Vh[b] = malloc((size_t)L * row * sizeof(double));
        for (size_t i = 0; i < (size_t)L * row; i++) {
            K[b][i] = sck * nrand() * lambda[i % row] + (mu ? mu[i % row] : 0.f);
            V[b][i] = scv * nrand();
            if (g_ne) { /* float16-exact, so that the CPU VQ cache (float16 window) codes the same inputs */
                K[b][i] = f16_round(K[b][i]);
                V[b][i] = f16_round(V[b][i]);
            }
        }
        /* whole norm-explicit appends of several encode passes: first the sequence with a scale beyond
         * float16 in the second pass (KV head 1) and one in the last (KV head 0), refused naming the
         * second pass's (the smallest position, across passes); then the good append below at the same
         * positions */
        const int pass = (int)(((size_t)4 << 20) / ((size_t)H * D * sizeof(float))); /* tokens per pass */
        for (int w = 0; w < 2 && g_whole && b == 0 && L > pass + 6; w++) {
            if (!(w ? vne : kne)) continue;
            const int hb = H > 1 ? 1 : 0, pos[2] = {pass + 5, L - 1}, hs[2] = {hb, 0};
            float *bx = malloc((size_t)L * row * sizeof *bx);
            memcpy(bx, w ? V[b] : K[b], (size_t)L * row * sizeof *bx);
            for (int r = 0; r < 2; r++)
                for (int j = 0; j < D; j++) {
                    const size_t o = (size_t)pos[r] * row + (size_t)hs[r] * D + j;
                    bx[o] = w ? 1e6f * nrand()
                              : 1e6f * nrand() * lambda[(size_t)hs[r] * D + j] + (mu ? mu[(size_t)hs[r] * D + j] : 0.f);
                }
            CUDA_OK(cudaMemcpy(dk, w ? K[b] : bx, (size_t)L * row * sizeof(float), cudaMemcpyHostToDevice));
            CUDA_OK(cudaMemcpy(dv, w ? bx : V[b], (size_t)L * row * sizeof(float), cudaMemcpyHostToDevice));
            kvpq_status s = kvpq_cuda_cache_append(c, b, L, dk, dv);
            char want[96];
            snprintf(want, sizeof want, "%s scale of position %d, KV head %d", w ? "value" : "key", pos[0], hb);
            CHECK(s == KVPQ_ERR_INVALID_ARG && strstr(kvpq_last_error(), want) && kvpq_cuda_cache_seq_len(c, b) == 0,
                  "whole append of %d positions (passes of %d) with two %s scales beyond float16: status %d (%s), len %d",
                  L, pass, w ? "value" : "key", (int)s, kvpq_last_error(), kvpq_cuda_cache_seq_len(c, b));
            free(bx);
        }
        CUDA_OK(cudaMemcpy(dk, K[b], (size_t)L * row * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv, V[b], (size_t)L * row * sizeof(float), cudaMemcpyHostToDevice));
        /* append in random pieces (prefill then steps), or whole (g_whole) */
        for (int t = 0; t < L;) {
            int n = g_whole ? L : 1 + (int)(urand() * (urand() < 0.5 ? 8 : 700));
            if (n > L - t) n = L - t;
            KV_OK(kvpq_cuda_cache_append(c, b, n, dk + (size_t)t * row, dv + (size_t)t * row));
            t += n;
        }
        CHECK(kvpq_cuda_cache_seq_len(c, b) == L, "seq_len %d != %d", kvpq_cuda_cache_seq_len(c, b), L);
        if (g_ne) {
            /* norm-explicit: the codes of the directions and the scales, as the cache stored them */
            KV_OK(kvpq__cuda_cache_read_codes(c, b, kc, vc, ksc, vsc));
            for (int t = 0; t < L; t++) /* every position was encoded at append (window ones too) */
                for (int h = 0; h < H; h++) {
                    const size_t o = (size_t)t * row + (size_t)h * D, rh = (size_t)t * H + h;
                    for (int w = 0; w < 2; w++) {
                        if (!(w ? vne : kne)) continue;
                        if (w) ref_transformed(V[b] + o, NULL, NULL, value_rotate, D, xt64);
                        else ref_transformed(K[b] + o, mu ? mu + (size_t)h * D : NULL, lambda + (size_t)h * D, 1, D, xt64);
                        double e = ne_check_row(w ? &rv : &rk, (w ? vc + rh * vcs : kc + rh * kcs), (w ? vsc : ksc)[rh],
                                                xt64, t < 48, &ne_bad_codes);
                        ne_scale_worst = e > ne_scale_worst || !(e == e) ? e : ne_scale_worst;
                        ne_rows++;
                    }
                }
            /* the CPU's own codes and scales of the same inputs (every position), and the differing
             * codes of the positions the caches code (not the window's) */
            memset(flips_at, 0, (size_t)L * sizeof *flips_at);
            ne_cpu_compare(kpq, &rk, K[b], L, H, mu, lambda, 1, kc, kne ? ksc : NULL, 1, flips_at, kne ? &nec : &plc);
            ne_cpu_compare(vpq, &rv, V[b], L, H, NULL, NULL, value_rotate, vc, vne ? vsc : NULL, 0, flips_at,
                           vne ? &nec : &plc);
            for (int t = 0; t < L - (window < L ? window : L); t++) flips_seq[b] += flips_at[t];
        } else {
            /* the cache's codes are those of kvpq_cuda_pq_encode (same kernel, same inputs: k - mu) */
            if (mu) {
                float *kc0 = malloc((size_t)L * row * sizeof *kc0);
                for (size_t i = 0; i < (size_t)L * row; i++) kc0[i] = K[b][i] - mu[i % row];
                CUDA_OK(cudaMemcpy(dk, kc0, (size_t)L * row * sizeof(float), cudaMemcpyHostToDevice));
                free(kc0);
            }
            KV_OK(kvpq_cuda_pq_encode(kq, (size_t)L, dk, dkc));
            KV_OK(kvpq_cuda_pq_encode(vq, (size_t)L, dv, dvc));
            CUDA_OK(cudaMemcpy(kc, dkc, (size_t)L * H * kcs, cudaMemcpyDeviceToHost));
            CUDA_OK(cudaMemcpy(vc, dvc, (size_t)L * H * vcs, cudaMemcpyDeviceToHost));
        }
        int win = window < L ? window : L;
        for (int t = 0; t < L; t++)
            for (int h = 0; h < H; h++) {
                size_t o = (size_t)t * row + (size_t)h * D;
                if (t >= L - win) {
                    for (int i = 0; i < D; i++) {
                        Kh[b][o + i] = K[b][o + i];
                        Vh[b][o + i] = V[b][o + i];
                    }
                } else {
                    ref_decode_row(&rk, kc + ((size_t)t * H + h) * kcs, lambda + (size_t)h * D, 1, Kh[b] + o);
                    /* norm-explicit: x_hat = s r, mapped back linearly, so s times the decoded row */
                    const double sk = kne ? f16_value(ksc[(size_t)t * H + h]) : 1.0;
                    for (int i = 0; i < D; i++) Kh[b][o + i] = sk * Kh[b][o + i] + (mu ? mu[(size_t)h * D + i] : 0.0);
                    ref_decode_row(&rv, vc + ((size_t)t * H + h) * vcs, NULL, value_rotate, Vh[b] + o);
                    if (vne)
                        for (int i = 0; i < D; i++) Vh[b][o + i] *= f16_value(vsc[(size_t)t * H + h]);
                }
            }
    }
    /* error paths: NaN append and capacity leave the sequence unchanged */
    {
        float nan = NAN;
        CUDA_OK(cudaMemcpy(dk + 3, &nan, sizeof nan, cudaMemcpyHostToDevice));
        kvpq_status s = kvpq_cuda_cache_append(c, 0, 2, dk, dv);
        CHECK(s == KVPQ_ERR_NONFINITE && kvpq_cuda_cache_seq_len(c, 0) == lens[0],
              "append with NaN: status %d, len %d", (int)s, kvpq_cuda_cache_seq_len(c, 0));
        s = kvpq_cuda_cache_append(c, 0, cp.max_seq, dk, dv);
        CHECK(s == KVPQ_ERR_CAPACITY && kvpq_cuda_cache_seq_len(c, 0) == lens[0], "append past max_seq: status %d",
              (int)s);
        /* norm-explicit: a scale beyond float16 (a row of norm ~1e6 sqrt(D)) is refused naming its
         * position, as the CPU cache does; the sequence is unchanged (the attention check below runs
         * after this). Two appends per kind: one bad row (second position, KV head 1), and two bad
         * rows (that one and the third position's KV head 0), where the smallest position must be
         * named (the kernel keeps the smallest row by a 64-bit atomicMin; a last-writer-wins flag
         * would name either). A good append at the same positions follows the checks below. */
        for (int w = 0; w < 2; w++) {
            if (!(w ? vne : kne)) continue;
            const int hb = H > 1 ? 1 : 0;
            for (int nbad = 1; nbad <= 2; nbad++) {
                const int np = nbad + 1;
                float *bk = malloc(np * row * sizeof *bk), *bv = malloc(np * row * sizeof *bv);
                for (size_t i = 0; i < np * row; i++) {
                    bk[i] = sck * nrand() * lambda[i % row] + (mu ? mu[i % row] : 0.f);
                    bv[i] = scv * nrand();
                }
                for (int r = 0; r < nbad; r++) {
                    const int hr = r ? 0 : hb; /* position 1 + r, KV head hr */
                    for (int j = 0; j < D; j++) {
                        const size_t o = (size_t)(1 + r) * row + (size_t)hr * D + j;
                        if (w) bv[o] = 1e6f * nrand();
                        else bk[o] = 1e6f * nrand() * lambda[(size_t)hr * D + j] + (mu ? mu[(size_t)hr * D + j] : 0.f);
                    }
                }
                CUDA_OK(cudaMemcpy(dk, bk, np * row * sizeof(float), cudaMemcpyHostToDevice));
                CUDA_OK(cudaMemcpy(dv, bv, np * row * sizeof(float), cudaMemcpyHostToDevice));
                s = kvpq_cuda_cache_append(c, 0, np, dk, dv);
                char want[96];
                snprintf(want, sizeof want, "%s scale of position %d, KV head %d", w ? "value" : "key", lens[0] + 1, hb);
                CHECK(s == KVPQ_ERR_INVALID_ARG && strstr(kvpq_last_error(), want) &&
                          kvpq_cuda_cache_seq_len(c, 0) == lens[0],
                      "append of %d %s scale(s) beyond float16: status %d (%s), len %d", nbad, w ? "value" : "key",
                      (int)s, kvpq_last_error(), kvpq_cuda_cache_seq_len(c, 0));
                free(bk);
                free(bv);
            }
        }
    }
    size_t nq = (size_t)B * n_head * D;
    float *q = malloc(nq * sizeof *q), *out = malloc(nq * sizeof *out), *dq, *dout;
    double *ref = malloc(nq * sizeof *ref);
    for (size_t i = 0; i < nq; i++) q[i] = nrand() / sck;
    CUDA_OK(cudaMalloc((void **)&dq, nq * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dout, nq * sizeof(float)));
    CUDA_OK(cudaMemcpy(dq, q, nq * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(dout, 0xFF, nq * sizeof(float))); /* NaN poison */
    KV_OK(kvpq_cuda_cache_attend(c, B, dq, dout));
    CUDA_OK(cudaMemcpy(out, dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
    { /* a second launch (the split-merge counters were reset by the first) gives the same bits */
        float *out2 = malloc(nq * sizeof *out2);
        CUDA_OK(cudaMemset(dout, 0xFF, nq * sizeof(float)));
        KV_OK(kvpq_cuda_cache_attend(c, B, dq, dout));
        CUDA_OK(cudaMemcpy(out2, dout, nq * sizeof(float), cudaMemcpyDeviceToHost));
        CHECK(memcmp(out, out2, nq * sizeof(float)) == 0, "attend: a second launch gives different output");
        /* kvpq_cuda_cache_attend_async on a stream of its own (a programmatic dependent launch with
         * kernels.attend_pdl = 1 on the tensor-core kernel): A = attend(q), then B = attend(A), whose
         * query is the previous kernel's output (so B must wait for A before reading it), then A again
         * over the poisoned A; each must give the bits of the synchronous call on the same query */
        float *refB = malloc(nq * sizeof *refB), *dA, *dB;
        CUDA_OK(cudaMalloc((void **)&dA, nq * sizeof(float)));
        CUDA_OK(cudaMalloc((void **)&dB, nq * sizeof(float)));
        KV_OK(kvpq_cuda_cache_attend(c, B, dout, dB)); /* dout holds attend(q) */
        CUDA_OK(cudaMemcpy(refB, dB, nq * sizeof(float), cudaMemcpyDeviceToHost));
        cudaStream_t st;
        CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
        for (int rep = 0; rep < 2; rep++) {
            CUDA_OK(cudaMemsetAsync(dA, 0xFF, nq * sizeof(float), st));
            CUDA_OK(cudaMemsetAsync(dB, 0xFF, nq * sizeof(float), st));
            KV_OK(kvpq_cuda_cache_attend_async(c, B, dq, dA, st));
            KV_OK(kvpq_cuda_cache_attend_async(c, B, dA, dB, st));
            KV_OK(kvpq_cuda_cache_attend_async(c, B, dq, dA, st));
            CUDA_OK(cudaStreamSynchronize(st));
            CUDA_OK(cudaMemcpy(out2, dA, nq * sizeof(float), cudaMemcpyDeviceToHost));
            CHECK(memcmp(out, out2, nq * sizeof(float)) == 0, "attend_async (pdl %d) on a stream: A differs from the synchronous call",
                  g_kernels.attend_pdl);
            CUDA_OK(cudaMemcpy(out2, dB, nq * sizeof(float), cudaMemcpyDeviceToHost));
            CHECK(memcmp(refB, out2, nq * sizeof(float)) == 0,
                  "attend_async (pdl %d) on a stream: B = attend(A) differs from the synchronous call", g_kernels.attend_pdl);
        }
        CUDA_OK(cudaStreamDestroy(st));
        CUDA_OK(cudaFree(dA));
        CUDA_OK(cudaFree(dB));
        free(refB);
        free(out2);
    }
    int g_sz = n_head / n_head_kv;
    double *sc = malloc((size_t)maxL * sizeof *sc);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < n_head; h++) {
            const float *qq = q + ((size_t)b * n_head + h) * D;
            int kvh = h / g_sz, L = lens[b];
            double mx = -INFINITY, den = 0;
            for (int t = 0; t < L; t++) {
                const double *kk = Kh[b] + (size_t)t * row + (size_t)kvh * D;
                double s = 0;
                for (int i = 0; i < D; i++) s += qq[i] * kk[i];
                sc[t] = s / sqrt((double)D);
                mx = sc[t] > mx ? sc[t] : mx;
            }
            double *o = ref + ((size_t)b * n_head + h) * D;
            for (int i = 0; i < D; i++) o[i] = 0;
            for (int t = 0; t < L; t++) {
                double p = exp(sc[t] - mx);
                den += p;
                const double *vv = Vh[b] + (size_t)t * row + (size_t)kvh * D;
                for (int i = 0; i < D; i++) o[i] += p * vv[i];
            }
            for (int i = 0; i < D; i++) o[i] /= den;
        }
    double num = 0, den = 0;
    int nonfinite = 0;
    for (size_t i = 0; i < nq; i++) {
        if (!isfinite(out[i])) nonfinite++;
        num += (out[i] - ref[i]) * (out[i] - ref[i]);
        den += ref[i] * ref[i];
    }
    double rel = sqrt(num / den), rel_seq = 0;
    for (int b = 0; b < B; b++) {
        double nb = 0, db = 0;
        for (size_t i = (size_t)b * n_head * D; i < (size_t)(b + 1) * n_head * D; i++) {
            nb += (out[i] - ref[i]) * (out[i] - ref[i]);
            db += ref[i] * ref[i];
        }
        double r = sqrt(nb / db);
        rel_seq = r > rel_seq || !(r == r) ? r : rel_seq;
    }
    CHECK(nonfinite == 0 && rel <= ATTEND_REL && rel_seq <= ATTEND_REL,
          "attend D=%d heads %d/%d k(dsub %d, %d bits) v(dsub %d, %d bits) window %d pages of %d: rel err %.3g (worst "
          "sequence %.3g), %d non-finite",
          D, n_head, n_head_kv, kdsub, knbits, vdsub, vnbits, window, g_page_tokens, rel, rel_seq, nonfinite);
    printf("  attend D=%3d heads %2d/%d B=%d maxL=%5d k(dsub %2d, %2d bits) v(dsub %2d, %2d bits) %-8s window %3d "
           "pages %3d vrot %d%s%s: rel err vs fp64 %.2e, worst sequence %.2e\n",
           D, n_head, n_head_kv, B, maxL, kdsub, knbits, vdsub, vnbits, g ? "subspace" : "shared", window,
           g_page_tokens, value_rotate, mu ? " key_mean" : "",
           g_ne == 3 ? " norm-explicit K+V" : g_ne == 1 ? " norm-explicit K" : g_ne == 2 ? " norm-explicit V" : "", rel,
           rel_seq);
    if (g_ne) {
        CHECK(ne_scale_worst <= 1.0 && ne_bad_codes == 0,
              "norm-explicit D=%d: stored scales off by %.3g of the allowed float16 rounding (<= 1 passes), %d direction "
              "codes beyond near-ties",
              D, ne_scale_worst, ne_bad_codes);
        /* resident bytes count a float16 scale per (position, KV head) of the pages in use, per kind */
        const int PT = g_page_tokens, max_pages = (cp.max_seq + PT - 1) / PT;
        size_t pages = 0;
        for (int b = 0; b < B; b++) pages += (size_t)(lens[b] + PT - 1) / PT;
        /* the tensor-core kernel's codebook image, built only where that kernel may run */
        const int tc_img = g_kernels.attend_tc && g == KVPQ_CODEBOOK_SHARED && kdsub == 4 && vdsub == 4 && knbits == 8 &&
                           vnbits == 8;
        const size_t want = pages * H * PT * (kcs + vcs) + 2 * (size_t)B * window * H * D * sizeof(float) +
                            ((size_t)rk.n_books * rk.ksub * (kdsub + 1) + (size_t)rv.n_books * rv.ksub * (vdsub + 1)) * 4 +
                            (size_t)B * (max_pages + 1) * sizeof(int) + (tc_img ? 65536 : 0) +
                            pages * H * PT * 2 * (size_t)(kne + vne);
        CHECK(kvpq_cuda_cache_resident_bytes(c) == want, "norm-explicit resident bytes %zu, expected %zu",
              kvpq_cuda_cache_resident_bytes(c), want);
        /* the CPU's own encode of the same inputs, measured directly (ne_cpu_compare) */
        CHECK(plc.bad_codes == 0, "norm-explicit D=%d: %ld plain codes differ from the CPU's beyond near-ties", D,
              plc.bad_codes);
        CHECK(nec.bad_codes == 0 && nec.scale_bad == 0,
              "norm-explicit D=%d vs CPU encode: %ld direction codes differ beyond near-ties, %ld scales (codes equal) "
              "differ by more than one float16 ulp",
              D, nec.bad_codes, nec.scale_bad);
        /* the CPU VQ cache on the same codebook and inputs, for the sequences whose coded / window split
         * is the same there (it codes whole batches of 32 leaving the window); held to CPU_GPU_REL only
         * where no coded position's code differs (see CPU_GPU_REL) */
        memcpy(kvpq_codebook_key_smooth(cb, 0), lambda, (size_t)H * D * sizeof(float));
        if (mu) memcpy(kvpq_codebook_key_mean(cb, 0), mu, (size_t)H * D * sizeof(float));
        double cpu_worst = 0, flip_worst = 0;
        int n_cpu = 0, n_flip = 0, flip_codes = 0;
        float *cout = malloc((size_t)n_head * D * sizeof *cout);
        for (int b = 0; b < B; b++) {
            const int L = lens[b];
            if (!(L <= window || (L - window) % 32 == 0)) continue;
            kvpq_cache_params pc = kvpq_cache_params_default();
            pc.type = KVPQ_CACHE_VQ;
            pc.n_layer = 1;
            pc.n_head = n_head;
            pc.n_head_kv = H;
            pc.head_dim = D;
            pc.max_seq = L + window + 64;
            pc.window = window;
            pc.codebook = cb;
            kvpq_cache *cc;
            KV_OK(kvpq_cache_new(&cc, &pc));
            KV_OK(kvpq_cache_append(cc, 0, L, K[b], V[b]));
            KV_OK(kvpq_cache_attend(cc, 0, 1, q + (size_t)b * n_head * D, cout));
            double nb = 0, db = 0;
            for (size_t i = 0; i < (size_t)n_head * D; i++) {
                const double gv = out[(size_t)b * n_head * D + i];
                nb += (gv - cout[i]) * (gv - cout[i]);
                db += (double)cout[i] * cout[i];
            }
            const double r = sqrt(nb / db);
            if (flips_seq[b] == 0) {
                cpu_worst = r > cpu_worst || !(r == r) ? r : cpu_worst;
                n_cpu++;
            } else { /* printed, not held to a bound (only to being finite) */
                CHECK(isfinite(r), "norm-explicit D=%d: GPU vs CPU VQ cache attention of sequence %d: %g", D, b, r);
                flip_worst = r > flip_worst ? r : flip_worst;
                flip_codes += flips_seq[b];
                n_flip++;
            }
            kvpq_cache_free(cc);
        }
        free(cout);
        CHECK(cpu_worst <= CPU_GPU_REL, "norm-explicit D=%d: GPU vs CPU VQ cache attention rel diff %.3g (sequences with "
              "no differing code or key scale)", D, cpu_worst);
        printf("    norm-explicit: %ld scales within %.2f of float16 rounding vs fp64, direction codes ok; vs CPU encode "
               "(%ld rows): %ld codes differ (near-ties), %ld scales one float16 ulp apart; vs CPU VQ cache: %d sequences "
               "with equal codes and key scales rel diff %.2e, %d with %d differing codes or key scales rel diff %.2e (not bounded); "
               "plain kind vs CPU encode: %ld codes differ (near-ties)\n",
               ne_rows, ne_scale_worst, nec.rows, nec.flips, nec.scale_ulp, n_cpu, cpu_worst, n_flip, flip_codes,
               flip_worst, plc.flips);
        /* after the refused appends above: a good append at the same positions (lens[0], lens[0] + 1)
         * succeeds (no state of the refusals is left), storing its rows right (scales to float16
         * rounding, direction codes the float64 argmin except near-ties) */
        const int L0 = lens[0], np = 2;
        float *gk = malloc(np * row * sizeof *gk), *gv = malloc(np * row * sizeof *gv);
        for (size_t i = 0; i < np * row; i++) {
            gk[i] = f16_round(sck * nrand() * lambda[i % row] + (mu ? mu[i % row] : 0.f));
            gv[i] = f16_round(scv * nrand());
        }
        CUDA_OK(cudaMemcpy(dk, gk, np * row * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemcpy(dv, gv, np * row * sizeof(float), cudaMemcpyHostToDevice));
        kvpq_status sg = kvpq_cuda_cache_append(c, 0, np, dk, dv);
        CHECK(sg == KVPQ_OK && kvpq_cuda_cache_seq_len(c, 0) == L0 + np,
              "norm-explicit D=%d: good append after the refused ones: status %d (%s), len %d", D, (int)sg,
              kvpq_last_error(), kvpq_cuda_cache_seq_len(c, 0));
        if (sg == KVPQ_OK) {
            uint8_t *gkc = malloc((size_t)(L0 + np) * H * kcs), *gvc = malloc((size_t)(L0 + np) * H * vcs);
            uint16_t *gks = malloc((size_t)(L0 + np) * H * sizeof *gks), *gvs = malloc((size_t)(L0 + np) * H * sizeof *gvs);
            KV_OK(kvpq__cuda_cache_read_codes(c, 0, gkc, gvc, gks, gvs));
            double worst = 0;
            int badc = 0;
            for (int t = L0; t < L0 + np; t++)
                for (int h = 0; h < H; h++) {
                    const size_t o = (size_t)(t - L0) * row + (size_t)h * D, rh = (size_t)t * H + h;
                    for (int w = 0; w < 2; w++) {
                        if (!(w ? vne : kne)) continue;
                        if (w) ref_transformed(gv + o, NULL, NULL, value_rotate, D, xt64);
                        else ref_transformed(gk + o, mu ? mu + (size_t)h * D : NULL, lambda + (size_t)h * D, 1, D, xt64);
                        const double e = ne_check_row(w ? &rv : &rk, w ? gvc + rh * vcs : gkc + rh * kcs,
                                                      (w ? gvs : gks)[rh], xt64, 1, &badc);
                        worst = e > worst || !(e == e) ? e : worst;
                    }
                }
            CHECK(worst <= 1.0 && badc == 0,
                  "norm-explicit D=%d: good append after the refused ones: scales off by %.3g of float16 rounding, %d "
                  "direction codes beyond near-ties",
                  D, worst, badc);
            free(gkc);
            free(gvc);
            free(gks);
            free(gvs);
        }
        free(gk);
        free(gv);
    }
    free(flips_at);
    free(flips_seq);
    for (int b = 0; b < B; b++) {
        free(K[b]);
        free(V[b]);
        free(Kh[b]);
        free(Vh[b]);
    }
    free(K);
    free(V);
    free(Kh);
    free(Vh);
    free(kc);
    free(vc);
    free(q);
    free(out);
    free(ref);
    free(sc);
    free(lambda);
    free(mu);
    cudaFree(dk);
    cudaFree(dv);
    cudaFree(dkc);
    cudaFree(dvc);
    cudaFree(dq);
    cudaFree(dout);
    kvpq_cuda_pq_free(kq);
    kvpq_cuda_pq_free(vq);
    kvpq_cuda_cache_free(c);
    free(ksc);
    free(vsc);
    free(xt64);
    if (cb) {
        kvpq_codebook_free(cb); /* owns kpq, vpq */
    } else {
        kvpq_pq_free(kpq);
        kvpq_pq_free(vpq);
    }
}

int main(void) {
    char why[256];
    if (!kvpq_cuda_available(why, sizeof why)) {
        printf("SKIP: GPU tests need a CUDA device: %s\n", why);
        return 77;
    }
    printf("%s\n", why);
    const char *qe = getenv("KVPQ_QUICK");
    g_quick = qe && *qe && strcmp(qe, "0");
    const char *se = getenv("KVPQ_SEED");
    g_rng = se ? strtoull(se, NULL, 10) : (uint64_t)time(NULL) * 2654435761u ^ (uint64_t)clock();
    if (!g_rng) g_rng = 88172645463325252ull;
    printf("seed %llu (KVPQ_SEED=... replays)\n", (unsigned long long)g_rng);
    int nt = g_quick ? 40 : 700;

    const kvpq_cuda_kernels k0 = kvpq_cuda_kernels_default();
    g_kernels = k0;
    { /* a kernel variant outside the listed values is refused at creation, naming the field */
        ref_pq r;
        kvpq_pq *kp = make_pq(128, 4, 8, KVPQ_CODEBOOK_SHARED, &r, NULL);
        kvpq_cuda_pq_params qp = kvpq_cuda_pq_params_default();
        qp.kernels.encode_search = 6;
        kvpq_cuda_pq *q = (kvpq_cuda_pq *)1;
        kvpq_status s = kvpq_cuda_pq_new_params(&q, kp, &qp);
        CHECK(s == KVPQ_ERR_INVALID_ARG && q == NULL && strstr(kvpq_last_error(), "kernels.encode_search=6"),
              "encode_search 6: status %d (%s)", (int)s, kvpq_last_error());
        kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
        cp.key = kp;
        cp.value = kp;
        cp.kernels.attend_tc_warps = 12;
        kvpq_cuda_cache *c = (kvpq_cuda_cache *)1;
        s = kvpq_cuda_cache_new(&c, &cp);
        CHECK(s == KVPQ_ERR_INVALID_ARG && c == NULL && strstr(kvpq_last_error(), "kernels.attend_tc_warps=12"),
              "attend_tc_warps 12: status %d (%s)", (int)s, kvpq_last_error());
        printf("kernel variant out of range refused: %s\n", kvpq_last_error());
        kvpq_pq_free(kp);
    }
    check_page_clamp();
    /* every encode kernel variant (kvpq_cuda_kernels.encode_search, src/cuda/encode.cu): 2-6 tensor cores,
     * grouped argmin + exact re-rank (2: accumulator input; 3, 4: none, other row tiles / CTAs per
     * SM; 5 (default): as 3 with the A registers loaded by index); 1 tensor cores, per-key argmin
     * (previous); 0 float32. KVPQ_ENCODE_VARIANTS="2 0" checks a subset (digits 0-5). */
    int variants[8] = {5, 2, 3, 4, 1, 0}, n_variants = 6;
    const char *ve = getenv("KVPQ_ENCODE_VARIANTS");
    if (ve) {
        n_variants = 0;
        for (const char *c = ve; *c && n_variants < 8; c++)
            if (*c >= '0' && *c <= '5') variants[n_variants++] = *c - '0';
    }
    /* KVPQ_ENCODE_SHAPES=few: a few shapes for compute-sanitizer racecheck, which runs the full set
     * for minutes: the 2-bit preset, the OOM shape, dsub 8, dsub 1, 12 bits with dsub 16, the
     * float32 fallback inside the tensor-core kernel (x at 1e-6 of the codebook's scale), sub-space
     * codebooks, 5-bit codes (packing across bytes) */
    const char *es = getenv("KVPQ_ENCODE_SHAPES");
    const int few = es && !strcmp(es, "few");
    for (int vi = 0; vi < n_variants && few; vi++) {
        g_kernels.encode_search = variants[vi];
        printf("encode/decode (variant %d, few shapes):\n", variants[vi]);
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
        check_encode(256, 4, 8, KVPQ_CODEBOOK_SHARED, 4, nt, 1, 1, 1.f);
        check_encode(128, 8, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
        check_encode(64, 1, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
        check_encode(256, 16, 12, KVPQ_CODEBOOK_SHARED, 1, nt / 4, 1, 1, 1.f);
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1e-6f);
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SUBSPACE, 2, nt, 1, 1, 1.f);
        check_encode(64, 2, 5, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
    }
    for (int vi = 0; vi < n_variants && !few; vi++) {
        const int variant = variants[vi];
        g_kernels.encode_search = variant;
        printf("encode/decode (%s search, variant %d):\n", variant ? "tensor-core" : "float32", variant);
        const int ds[] = {64, 128, 256}, dsubs[] = {1, 2, 4, 8, 16};
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 5; j++) {
                int nbits = (i + j) % 3 == 0 ? 8 : ((i + j) % 3 == 1 ? 5 : 12);
                if (g_quick && nbits == 12 && dsubs[j] < 4) nbits = 10;
                check_encode(ds[i], dsubs[j], nbits, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
            }
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SHARED, 8, nt, 0, 0, 1.f);
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SUBSPACE, 2, nt, 1, 1, 1.f);
        check_encode(64, 2, 6, KVPQ_CODEBOOK_SUBSPACE, 2, nt, 0, 1, 1.f);
        check_encode(256, 16, 12, KVPQ_CODEBOOK_SHARED, 1, nt / 4, 1, 1, 1.f);
        check_encode(64, 8, 3, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
        check_encode(128, 8, 4, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1.f);
        /* x far from the codebook's scale: 1e-3 and 1e5 stay on the tensor cores (1e5 near the top of
         * their range), 1e-6 takes the float32 fallback of the tensor-core kernel */
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1e-3f);
        check_encode(128, 4, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 1, 1e-6f);
        check_encode(256, 4, 8, KVPQ_CODEBOOK_SHARED, 3, nt, 0, 1, 1e5f);
        check_encode(64, 2, 7, KVPQ_CODEBOOK_SHARED, 3, nt, 1, 0, 30.f);
    }
    g_kernels = k0;

    { /* a key LUT that cannot fit in shared memory is refused at creation, naming the shape */
        ref_pq r;
        kvpq_pq *kp = make_pq(256, 8, 12, KVPQ_CODEBOOK_SHARED, &r, NULL);
        kvpq_cuda_cache_params cp = kvpq_cuda_cache_params_default();
        cp.head_dim = 256;
        cp.key = kp;
        cp.value = kp;
        kvpq_cuda_cache *c = NULL;
        kvpq_status s = kvpq_cuda_cache_new(&c, &cp);
        CHECK(s == KVPQ_ERR_UNSUPPORTED && c == NULL, "oversized LUT: status %d", (int)s);
        printf("  oversized key LUT refused: %s\n", kvpq_last_error());
        kvpq_pq_free(kp);
    }
    printf("attention:\n");
    int L1[] = {1, 37, 700, g_quick ? 300 : 3000};
    int L2[] = {g_quick ? 500 : 5000};
    int L3[] = {130, 64, 257};
    int L4[] = {g_quick ? 2000 : 32768};
    /* norm-explicit runs: lengths window + 32k or within the window, so that the CPU VQ cache (which
     * codes whole batches of 32 leaving the window) splits them into codes and window alike */
    int Lne128[] = {128 + 32 * 20, 37, g_quick ? 128 + 32 * 6 : 128 + 32 * 90, 1};
    int Lne64[] = {64 + 32 * 12, 64 + 32 * 3, 33};
    /* whole appends (g_whole) longer than one encode pass: 1024 tokens at head_dim 256 with 4 KV heads,
     * 2048 with 2 (the quick size exceeds the first only) */
    int Lne64b[] = {g_quick ? 64 + 32 * 34 : 64 + 32 * 155};
    int Lne32[] = {32 + 32 * 8, 32 + 32 * 2, 20};
    /* KVPQ_ATTEND_VARIANTS="5 6 7" checks a subset (digits 0-9 and a for 10, below; "" none), e.g. to
     * run only the tensor-core kernel under compute-sanitizer racecheck */
    int att_variants[11] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, n_att = 11;
    const char *va = getenv("KVPQ_ATTEND_VARIANTS");
    if (va) {
        n_att = 0;
        for (const char *c = va; *c && n_att < 11; c++) {
            if (*c >= '0' && *c <= '9') att_variants[n_att++] = *c - '0';
            else if (*c == 'a') att_variants[n_att++] = 10;
        }
    }
    for (int vi = 0; vi < n_att; vi++) { /* every kernel variant the switches select */
        const int variant = att_variants[vi];
        /* 0-3: LUT kernel, entries float32/float16 x value codebook plain/replicated, with the vector
         * value loop; 4: float16 + replicas with the previous value loop (kernels.attend_pvec = 0);
         * 5: the defaults: shared K and V codebooks with dsub 4, nbits 8 take the tensor-core kernel;
         * 6, 7: the tensor-core kernel with 8-warp and 16-warp CTAs; 8: the defaults with the split
         * merge through the device-memory workspace and a counter (kernels.attend_cluster = 0); 9: the
         * defaults with the other way of bringing the tensor-core kernel's code rows in
         * (kernels.attend_tc_regs toggled: registers one tile ahead / cp.async ring); 10: the defaults
         * with 2 query heads per CTA (kernels.attend_tc_heads = 2, or 0 where 2 is the default) */
        g_kernels = k0;
        g_kernels.attend_lut16 = variant >= 4 ? 1 : variant & 1;
        g_kernels.attend_vrep = variant >= 4 ? 1 : variant >> 1;
        g_kernels.attend_pvec = variant != 4;
        g_kernels.attend_tc = variant >= 5;
        g_kernels.attend_tc_warps = variant == 6 ? 8 : variant == 7 ? 16 : k0.attend_tc_warps;
        g_kernels.attend_cluster = variant == 8 ? 0 : k0.attend_cluster;
        g_kernels.attend_tc_regs = variant == 9 ? !k0.attend_tc_regs : k0.attend_tc_regs;
        g_kernels.attend_tc_heads = variant == 10 ? (k0.attend_tc_heads == 2 ? 0 : 2) : k0.attend_tc_heads;
        if (variant >= 5)
            printf(" defaults (tensor-core kernel, CTA warps %d (0: chosen per launch), split merge %s, code rows %s, "
                   "query heads per CTA up to %d (0: 8), for shared dsub-4 / 8-bit K and V codebooks, else LUT "
                   "float16):\n", g_kernels.attend_tc_warps,
                   g_kernels.attend_cluster ? "through a cluster where it fits" : "through device memory",
                   g_kernels.attend_tc_regs ? "into registers" : "through the cp.async ring", g_kernels.attend_tc_heads);
        else
            printf(" LUT entries %s, %s, %s value loop:\n", g_kernels.attend_lut16 ? "float16" : "float32",
                   g_kernels.attend_vrep ? "replicated value codebook" : "plain value codebook",
                   g_kernels.attend_pvec ? "vector" : "previous");
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 0, 4, L1, 0);  /* 2-bit K and V */
        check_attend(64, 9, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 4, L1, 0);    /* SmolLM2 shape */
        check_attend(64, 9, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 4, L1, 1);    /* key centering */
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 0, 3, L3, 1);
        check_attend(256, 8, 2, 8, 10, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 1, 1, L2, 0);
        check_attend(128, 8, 8, 2, 8, 8, 8, KVPQ_CODEBOOK_SHARED, 0, 0, 3, L3, 0);     /* no window, MHA */
        check_attend(64, 16, 2, 8, 6, 2, 5, KVPQ_CODEBOOK_SUBSPACE, 16, 1, 3, L3, 0);  /* subspace books, odd bits */
        check_attend(128, 24, 2, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 500, 0, 3, L3, 0);  /* window > length; 12 heads/KV */
        g_tight = 1; /* window 500 > max_seq 257: clamped at creation */
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 500, 1, 3, L3, 0);
        g_tight = 0;
        check_attend(256, 16, 2, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 1, 1, L2, 0);   /* D 256, 8 heads/KV */
        check_attend(64, 4, 4, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 32, 0, 3, L3, 1);     /* MHA, 1 head/KV */
        /* tensor-core paths the shapes above miss: 8 heads per KV head with codes (two mma per k-step),
         * head_dim 256 with 2 heads per KV head, pages of 32 and 256 positions, pages of 96 (not a
         * power of two: the LUT kernel), and one long sequence (B=1) */
        check_attend(128, 24, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 1, 3, L3, 0);   /* 8 heads/KV */
        check_attend(256, 8, 4, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 0, 1, L2, 1);    /* D 256, 2 heads/KV */
        g_page_tokens = 32;
        check_attend(64, 9, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 4, L1, 0);
        g_page_tokens = 96;
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 0, 3, L3, 0);
        g_page_tokens = 256;
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 1, L4, 0);  /* one long sequence */
        g_page_tokens = 64;
        /* norm-explicit codebooks (k.norm / v.norm = 1, calibrate's default): scales per (position,
         * KV head) in both kernels; keys and values, keys only, values only */
        g_ne = 3;
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 0, 4, Lne128, 0); /* 4 heads/KV */
        check_attend(64, 9, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 4, Lne128, 1);   /* SmolLM2, key mean */
        check_attend(128, 24, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 1, 3, Lne64, 0);   /* 8 heads/KV */
        g_whole = 1;
        check_attend(256, 8, 4, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 0, 1, Lne64b, 1);   /* D 256, several passes */
        g_whole = 0;
        check_attend(64, 16, 2, 8, 6, 2, 5, KVPQ_CODEBOOK_SUBSPACE, 32, 1, 3, Lne32, 0);  /* LUT only: odd bits */
        g_page_tokens = 32;
        check_attend(64, 4, 4, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 32, 0, 3, Lne32, 1);     /* MHA, pages of 32 */
        g_page_tokens = 64;
        g_ne = 1;
        check_attend(64, 9, 3, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 1, 4, Lne128, 0);
        check_attend(128, 16, 8, 8, 10, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 0, 3, Lne64, 0);  /* LUT only: 10-bit keys */
        g_ne = 2;
        check_attend(128, 32, 8, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 128, 0, 4, Lne128, 1);
        g_whole = 1;
        check_attend(256, 16, 2, 4, 8, 4, 8, KVPQ_CODEBOOK_SHARED, 64, 1, 1, Lne64b, 0);  /* D 256, 8 heads/KV */
        g_whole = 0;
        g_ne = 0;
    }
    g_kernels = k0;

    if (g_fail) {
        printf("FAILED: %d check(s)\n", g_fail);
        return 1;
    }
    printf("all GPU checks passed\n");
    return 0;
}
