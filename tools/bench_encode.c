/* bench_encode.c — `kvpq bench encode`: PQ encode throughput and peak memory, ours (fused
 * nearest-centroid kernels, kvpq_pq_encode) beside the materializing baseline, in one process.
 *
 * Baseline ("materializing"): the pure-tensor path of the Python post, written here in C: for each
 * chunk of sub-vectors it allocates the difference tensor diff = x[:, None, :] - C[None, :, :] of
 * shape (chunk, ksub, dsub), reduces it to dist (chunk, ksub), takes the argmin and packs. OpenMP
 * threads take chunks, each with its own tensors (as torch's intra-op threads would share the
 * work). Unchunked, that tensor is n * M * ksub * dsub floats (the post's out-of-memory).
 *
 * Memory: "peak extra" is the rise of the process's peak resident set (VmHWM in /proc/self/status,
 * reset before each run by writing 5 to /proc/self/clear_refs) over the resident set before the
 * run; inputs and outputs are allocated and touched beforehand, so it counts only what the encode
 * itself allocates and touches. Where the reset is not permitted the column says n/a. glibc's
 * dynamic mmap threshold would keep a freed 16 MiB tensor in the heap (resident, so invisible to
 * the next run's delta); the threshold is pinned at 1 MiB so every large block is mapped and
 * unmapped per use, as a fresh process would see it. */
#include <math.h>
#include <omp.h>
#if defined(__GLIBC__) || defined(__linux__)
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_json.h"

typedef struct {
    int S, H, D, dsub, nbits;
} shape_t;

typedef struct {
    double ms;          /* median wall time */
    double subvec_per_s;
    double peak_mib;    /* < 0: not measurable */
    double hwm_mib;     /* the process's peak resident set during the runs (absolute) */
} result_t;

// ---- helpers -----------------------------------------------------------------------------------

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static float rng_gauss(uint64_t *s) {
    double u = ((rng_next(s) >> 11) + 0.5) * 0x1.0p-53, v = (rng_next(s) >> 11) * 0x1.0p-53;
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

/* "VmRSS:" or "VmHWM:" in KiB; -1 when unreadable. */
static long status_kib(const char *key) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t kl = strlen(key);
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, kl)) {
            v = strtol(line + kl, NULL, 10);
            break;
        }
    fclose(f);
    return v;
}
static int reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return 0;
    int ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

// ---- the materializing baseline ----------------------------------------------------------------

typedef struct {
    int d, M, dsub, ksub, nbits, shared;
    const float *C;    /* (n_books, ksub, dsub) */
    size_t chunk;      /* sub-vectors per difference tensor */
} base_t;

/* Returns 0 on success, -1 if an allocation failed. Each thread allocates its tensors once per call
 * and reuses them for every chunk it takes (the kindest version of the path: no per-chunk page
 * faults), so the time measures the materializing arithmetic and memory traffic. */
static int baseline_encode(const base_t *b, size_t n, const float *x, uint8_t *codes) {
    const size_t nsub = n * (size_t)b->M;
    const size_t nchunks = (nsub + b->chunk - 1) / b->chunk;
    uint16_t *idx = malloc(sizeof(uint16_t) * nsub);
    if (!idx) return -1;
    int fail = 0;
#pragma omp parallel reduction(| : fail)
    {
        float *diff = malloc(sizeof(float) * b->chunk * b->ksub * b->dsub); /* (chunk, ksub, dsub) */
        float *dist = malloc(sizeof(float) * b->chunk * b->ksub);           /* (chunk, ksub) */
        if (!diff || !dist) fail = 1;
#pragma omp for schedule(dynamic, 1)
        for (size_t ch = 0; ch < nchunks; ch++) {
            if (!diff || !dist) continue;
            size_t t0 = ch * b->chunk, t1 = t0 + b->chunk < nsub ? t0 + b->chunk : nsub, cn = t1 - t0;
            for (size_t t = 0; t < cn; t++) { /* diff = x[:, None, :] - C[None, :, :] */
                size_t sv = t0 + t, m = sv % (size_t)b->M;
                const float *xs = x + sv * b->dsub; /* (n, d) is (n * M, dsub) */
                const float *book = b->C + (b->shared ? 0 : m * b->ksub * b->dsub);
                for (int c = 0; c < b->ksub; c++)
                    for (int j = 0; j < b->dsub; j++)
                        diff[(t * b->ksub + c) * b->dsub + j] = xs[j] - book[(size_t)c * b->dsub + j];
            }
            for (size_t r = 0; r < cn * b->ksub; r++) { /* dist = (diff ** 2).sum(-1) */
                float s = 0;
                for (int j = 0; j < b->dsub; j++) s += diff[r * b->dsub + j] * diff[r * b->dsub + j];
                dist[r] = s;
            }
            for (size_t t = 0; t < cn; t++) { /* idx = dist.argmin(-1) */
                const float *dr = dist + t * b->ksub;
                int bi = 0;
                for (int c = 1; c < b->ksub; c++)
                    if (dr[c] < dr[bi]) bi = c;
                idx[t0 + t] = (uint16_t)bi;
            }
        }
        free(diff), free(dist);
    }
    if (!fail) kvpq_codes_pack(b->M, b->nbits, n, idx, codes);
    free(idx);
    return fail ? -1 : 0;
}

// ---- one shape ---------------------------------------------------------------------------------

typedef struct {
    int repeats, threads, json, granularity;
    size_t chunk;
} opts_t;

/* A shape's data: random vectors, a codebook drawn from them (set into pq), each method's codes. */
typedef struct {
    kvpq_pq *pq;
    float *x;             /* (n, d) */
    float *C;             /* (ncent) the centroids */
    uint8_t *ours, *base; /* (n, cs) codes of kvpq and of the baseline */
    size_t n, nsub, cs, ncent;
    int d, M, ksub, nbooks;
} shape_data;

static void shape_free(shape_data *s) {
    free(s->x), free(s->ours), free(s->base), free(s->C);
    kvpq_pq_free(s->pq);
}

/* The quantizer, the inputs (random, not zeros) and a random-from-data codebook: ksub sub-vectors
 * drawn from the data for each book. 0, or the exit code (message printed). */
static int shape_setup(const shape_t *sh, const opts_t *o, shape_data *s) {
    memset(s, 0, sizeof *s);
    s->n = (size_t)sh->S * sh->H;
    s->d = sh->D;
    kvpq_pq_params pp = {.d = s->d, .M = s->d / sh->dsub, .nbits = sh->nbits,
                         .granularity = (kvpq_codebook_granularity)o->granularity};
    if (s->d % sh->dsub) return cli_usage_error("--dsub %d does not divide D=%d", sh->dsub, s->d);
    kvpq_status st = kvpq_pq_new(&s->pq, &pp);
    if (st) return cli_fail("bench encode", st);
    s->M = pp.M;
    s->ksub = 1 << pp.nbits;
    s->nsub = s->n * s->M;
    s->cs = kvpq_pq_code_size(s->pq);
    s->ncent = kvpq_pq_centroids_size(s->pq);
    s->x = malloc(sizeof(float) * s->n * s->d);
    s->ours = malloc(s->cs * s->n);
    s->base = malloc(s->cs * s->n);
    s->C = malloc(sizeof(float) * s->ncent);
    if (!s->x || !s->ours || !s->base || !s->C) {
        fprintf(stderr, "kvpq bench encode: out of memory for the inputs\n");
        return 1;
    }
    uint64_t seed = 0x5EED0000ull + (uint64_t)s->n * 31 + (uint64_t)s->d;
    for (size_t i = 0; i < s->n * (size_t)s->d; i++) s->x[i] = rng_gauss(&seed);
    s->nbooks = o->granularity == KVPQ_CODEBOOK_SHARED ? 1 : s->M;
    for (int bk = 0; bk < s->nbooks; bk++)
        for (int c = 0; c < s->ksub; c++) {
            size_t i = rng_next(&seed) % s->n;
            int m = s->nbooks == 1 ? (int)(rng_next(&seed) % (uint64_t)s->M) : bk;
            memcpy(s->C + ((size_t)bk * s->ksub + c) * sh->dsub, s->x + i * s->d + (size_t)m * sh->dsub,
                   sizeof(float) * sh->dsub);
        }
    st = kvpq_pq_set_centroids(s->pq, s->C, s->ncent);
    if (st) return cli_fail("bench encode", st);
    memset(s->ours, 0, s->cs * s->n), memset(s->base, 0, s->cs * s->n); /* outputs resident before measuring */
    return 0;
}

/* Method `which` (0: kvpq, 1: the materializing baseline b): one warm-up (thread pool, page faults)
 * and o->repeats timed runs, with the memory they add; *mem_ok drops to 0 when memory cannot be
 * measured (shared by both methods). 0, or the exit code (message printed). */
static int time_method(shape_data *s, const base_t *b, const opts_t *o, int which, int *mem_ok, result_t *res) {
    double *t = malloc(sizeof(double) * (o->repeats + 1));
    double peak = -1, hwm_max = 0;
    for (int r = -1; r < o->repeats; r++) {
        int reset = reset_peak();
        long rss0 = status_kib("VmRSS:");
        double t0 = cli_now();
        if (which == 0) {
            kvpq_status st = kvpq_pq_encode(s->pq, s->n, s->x, s->ours);
            if (st) return cli_fail("bench encode", st);
        } else if (baseline_encode(b, s->n, s->x, s->base)) {
            fprintf(stderr, "kvpq bench encode: baseline ran out of memory\n");
            return 1;
        }
        double t1 = cli_now();
        long hwm = status_kib("VmHWM:");
        if (r >= 0) t[r] = t1 - t0;
        if (!reset || rss0 < 0 || hwm < 0) *mem_ok = 0;
        else if (r >= 0) {
            if ((hwm - rss0) / 1024.0 > peak) peak = (hwm - rss0) / 1024.0;
            if (hwm / 1024.0 > hwm_max) hwm_max = hwm / 1024.0;
        }
    }
    qsort(t, o->repeats, sizeof(double), cmp_double);
    double med = o->repeats % 2 ? t[o->repeats / 2] : 0.5 * (t[o->repeats / 2 - 1] + t[o->repeats / 2]);
    res->ms = med * 1e3;
    res->subvec_per_s = s->nsub / med;
    res->peak_mib = *mem_ok ? (peak < 0 ? 0 : peak) : -1;
    res->hwm_mib = *mem_ok ? hwm_max : -1;
    free(t);
    return 0;
}

/* Percent of sub-vectors whose codes agree: the baseline's exact (x - c)^2 sums and our
 * ||c||^2 - 2 x.c may differ on near-ties. */
static double codes_agree(const shape_data *s, int nbits) {
    uint16_t *ia = malloc(sizeof(uint16_t) * s->nsub), *ib = malloc(sizeof(uint16_t) * s->nsub);
    size_t same = 0;
    if (ia && ib && !kvpq_codes_unpack(s->M, nbits, s->n, s->ours, ia) && !kvpq_codes_unpack(s->M, nbits, s->n, s->base, ib))
        for (size_t i = 0; i < s->nsub; i++) same += ia[i] == ib[i];
    free(ia), free(ib);
    return 100.0 * same / s->nsub;
}

/* What a shape's rows report beside the times. */
typedef struct {
    double agree, in_mib, out_mib;
    int threads;
} shape_report;

static void json_rows(const shape_t *sh, const opts_t *o, const shape_data *s, const result_t *res,
                      const shape_report *rp, cJSON *rows) {
    for (int w = 0; w < 2; w++) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddNumberToObject(r, "S", sh->S);
        cJSON_AddNumberToObject(r, "H", sh->H);
        cJSON_AddNumberToObject(r, "D", s->d);
        cJSON_AddNumberToObject(r, "dsub", sh->dsub);
        cJSON_AddNumberToObject(r, "nbits", sh->nbits);
        cJSON_AddNumberToObject(r, "M", s->M);
        cJSON_AddStringToObject(r, "granularity", s->nbooks == 1 ? "shared" : "subspace");
        cJSON_AddStringToObject(r, "method", w ? "materializing" : "kvpq");
        cJSON_AddNumberToObject(r, "threads", rp->threads);
        cli_json_num(r, "median_ms", res[w].ms);
        cli_json_num(r, "subvec_per_s", res[w].subvec_per_s);
        /* negative: not measurable here (no /proc/self/clear_refs) */
        if (res[w].peak_mib < 0) cJSON_AddNullToObject(r, "peak_extra_mib"), cJSON_AddNullToObject(r, "peak_rss_mib");
        else cli_json_num(r, "peak_extra_mib", res[w].peak_mib), cli_json_num(r, "peak_rss_mib", res[w].hwm_mib);
        cli_json_num(r, "input_mib", rp->in_mib);
        cli_json_num(r, "output_mib", rp->out_mib);
        cli_json_num(r, "codes_agree_pct", rp->agree);
        cJSON_AddNumberToObject(r, "chunk", w ? (double)o->chunk : 0.0);
        cJSON_AddItemToArray(rows, r);
    }
}

static void print_table(const shape_t *sh, const opts_t *o, const shape_data *s, const result_t *res,
                        const shape_report *rp) {
    const char *names[2] = {"kvpq fused", "materializing"};
    double full_gib = (double)s->nsub * s->ksub * sh->dsub * 4 / (1u << 30);
    printf("S=%d H=%d D=%d dsub=%d nbits=%d (M=%d, ksub=%d, %s codebook, random-from-data), %zu sub-vectors,"
           " inputs %.1f MiB, codes %.2f MiB; unchunked diff tensor would be %.2f GiB\n",
           sh->S, sh->H, s->d, sh->dsub, sh->nbits, s->M, s->ksub, s->nbooks == 1 ? "shared" : "subspace", s->nsub,
           rp->in_mib, rp->out_mib, full_gib);
    printf("  method          threads     simd   median ms      Msubvec/s   peak extra MiB  peak RSS MiB\n");
    for (int w = 0; w < 2; w++) {
        char mem[32], hwm[32];
        if (res[w].peak_mib < 0) snprintf(mem, sizeof mem, "n/a"), snprintf(hwm, sizeof hwm, "n/a");
        else snprintf(mem, sizeof mem, "%.2f", res[w].peak_mib), snprintf(hwm, sizeof hwm, "%.1f", res[w].hwm_mib);
        printf("  %-14s %7d %8s %11.2f %14.1f %16s %13s", names[w], rp->threads, kvpq_simd_name(kvpq_simd_get()),
               res[w].ms, res[w].subvec_per_s / 1e6, mem, hwm);
        if (w) printf("   (chunk %zu sub-vectors)", o->chunk);
        printf("\n");
    }
    printf("  fused is %.1fx faster; codes agree on %.3f%% of sub-vectors (rest: near-ties)\n", res[1].ms / res[0].ms,
           rp->agree);
    if (res[0].hwm_mib >= 0)
        printf("  target peak RSS < inputs + outputs + 64 MiB = %.1f MiB: fused peak extra %.2f MiB %s"
               " (whole-process peak RSS %.1f MiB: binary, libraries, inputs, both outputs)\n",
               rp->in_mib + rp->out_mib + 64, res[0].peak_mib, res[0].peak_mib < 64 ? "(met)" : "(MISSED)",
               res[0].hwm_mib);
    printf("\n");
}

static int run_shape(const shape_t *sh, const opts_t *o, cJSON *rows) {
    shape_data s;
    int rc = shape_setup(sh, o, &s);
    base_t b = {.d = s.d, .M = s.M, .dsub = sh->dsub, .ksub = s.ksub, .nbits = sh->nbits,
                .shared = s.nbooks == 1, .C = s.C, .chunk = o->chunk};
    result_t res[2];
    int mem_ok = 1;
    for (int which = 0; which < 2 && !rc; which++) rc = time_method(&s, &b, o, which, &mem_ok, &res[which]);
    if (!rc) {
        shape_report rp = {.agree = codes_agree(&s, sh->nbits), .in_mib = s.n * (double)s.d * 4 / (1 << 20),
                           .out_mib = s.cs * (double)s.n / (1 << 20), .threads = omp_get_max_threads()};
        if (o->json) json_rows(sh, o, &s, res, &rp, rows);
        else print_table(sh, o, &s, res, &rp);
    }
    shape_free(&s);
    return rc;
}

static void usage(void) {
    fprintf(stdout,
            "usage: kvpq bench encode [--shape S,H,D] [--dsub N] [--nbits N] [--granularity shared|subspace]\n"
            "                         [--backend cpu] [--threads N] [--repeats N] [--chunk N] [--json] [--quiet]\n"
            "  Encodes S*H random vectors of D dims (codebook: ksub sub-vectors drawn from the data) with\n"
            "  kvpq's fused kernels and with the materializing baseline (a (chunk, ksub, dsub) difference\n"
            "  tensor per chunk); prints median time, sub-vectors/s and peak extra resident memory.\n"
            "  Default: S=4096,H=4,D=256 dsub 4 nbits 8 and S=8192,H=8,D=128 dsub 8 nbits 8.\n"
            "  --json: the rows as JSON (schema kvpq.bench.encode/1, docs/json.md); --quiet: no progress lines.\n");
}

static const char *const OPTS[] = {"--help", "-h", "--json", "--quiet", "-q", "--shape", "--dsub", "--nbits", "--threads",
                                   "--repeats", "--chunk", "--granularity", "--backend", NULL};

int cmd_bench_encode(int argc, char **argv) {
    opts_t o = {.repeats = 5, .threads = 0, .json = 0, .granularity = KVPQ_CODEBOOK_SHARED, .chunk = 4096};
    shape_t one = {0, 0, 0, 4, 8};
    int have_shape = 0;
    long v;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        } else if (!strcmp(a, "--json")) {
            o.json = 1;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
        } else if (!strcmp(a, "--shape")) {
            if (!val || sscanf(val, "%d,%d,%d", &one.S, &one.H, &one.D) != 3 || one.S <= 0 || one.H <= 0 || one.D <= 0)
                return cli_usage_error("--shape: expected S,H,D (positive integers), got '%s'", val ? val : "(missing)");
            have_shape = 1;
            i++;
        } else if (!strcmp(a, "--dsub")) {
            if (!cli_parse_int(a, val, 1, 16, &v)) return 2;
            one.dsub = (int)v, i++;
        } else if (!strcmp(a, "--nbits")) {
            if (!cli_parse_int(a, val, 1, 12, &v)) return 2;
            one.nbits = (int)v, i++;
        } else if (!strcmp(a, "--threads")) {
            if (!cli_parse_int(a, val, 1, 1024, &v)) return 2;
            o.threads = (int)v, i++;
        } else if (!strcmp(a, "--repeats")) {
            if (!cli_parse_int(a, val, 1, 1000, &v)) return 2;
            o.repeats = (int)v, i++;
        } else if (!strcmp(a, "--chunk")) {
            if (!cli_parse_int(a, val, 1, 1L << 30, &v)) return 2;
            o.chunk = (size_t)v, i++;
        } else if (!strcmp(a, "--granularity")) {
            if (val && !strcmp(val, "shared")) o.granularity = KVPQ_CODEBOOK_SHARED;
            else if (val && !strcmp(val, "subspace")) o.granularity = KVPQ_CODEBOOK_SUBSPACE;
            else return cli_usage_error("--granularity: expected shared or subspace, got '%s'", val ? val : "(missing)");
            i++;
        } else if (!strcmp(a, "--backend")) {
            if (!val) return cli_usage_error("--backend: expected cpu");
            if (strcmp(val, "cpu"))
                return cli_usage_error("--backend %s: bench encode measures the CPU encoder only (expected cpu)", val);
            i++;
        } else {
            return cli_unknown_option("bench encode", a, OPTS);
        }
    }
    if (o.threads > 0) omp_set_num_threads(o.threads);
#ifdef M_MMAP_THRESHOLD
    mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
    shape_t defaults[2] = {{4096, 4, 256, 4, 8}, {8192, 8, 128, 8, 8}};
    const shape_t *shapes = have_shape ? &one : defaults;
    int nshapes = have_shape ? 1 : 2;
    if (!have_shape && (one.dsub != 4 || one.nbits != 8)) {
        /* --dsub/--nbits without --shape apply to both default shapes */
        for (int s = 0; s < 2; s++) defaults[s].dsub = one.dsub, defaults[s].nbits = one.nbits;
    }
    cJSON *settings = NULL, *rows = NULL, *root = cli_json_new("bench.encode", &settings, &rows);
    if (!root) return cli_usage_error("bench encode: out of memory");
    cJSON_AddNumberToObject(settings, "repeats", o.repeats);
    cJSON_AddNumberToObject(settings, "threads", o.threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    cJSON_AddNumberToObject(settings, "chunk", (double)o.chunk);
    cJSON_AddStringToObject(settings, "codebook", "random-from-data");
    cJSON_AddStringToObject(settings, "backend", "cpu");
    if (!o.json)
        printf("kvpq bench encode: median of %d runs after one warm-up; peak extra = rise of VmHWM (reset via\n"
               "/proc/self/clear_refs) over VmRSS before the run, inputs and outputs already resident\n\n",
               o.repeats);
    cli_progress pr;
    cli_progress_begin(&pr, "bench encode", "shapes", nshapes);
    for (int s = 0; s < nshapes; s++) {
        int rc = run_shape(&shapes[s], &o, rows);
        if (rc) {
            cJSON_Delete(root);
            return rc;
        }
        cli_progress_update(&pr, s + 1, NULL);
    }
    cli_progress_end(&pr, nshapes, NULL);
    if (o.json) return cli_json_print(root);
    cJSON_Delete(root);
    return 0;
}
