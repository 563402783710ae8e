/* test_cache_property.c — every cache kind driven through random sequences of append / truncate /
 * read / attend (and calls that must fail) against a reference model of the cache (issue 14).
 *
 * The reference keeps, per layer and position, in float64: `ref`, the value appended, and `src`, the
 * value the cache holds in full precision (the fp16 rounding of ref for a windowed kind, or what a
 * truncation gave back to the window), plus `frozen`, the value a coded position reads as. After
 * every operation it checks:
 *   - lengths, and that failing calls (capacity, ranges) change nothing;
 *   - row kinds (fp32, fp16, q8_0, q4_0): every position reads exactly as a fresh cache of the kind
 *     fed ref in one append (rows are coded independently), and within the codec's error of ref;
 *   - windowed kinds (kivi2, kivi4, vq, vq norm-explicit): window positions read exactly src; a
 *     position newly coded reads exactly as a fresh window-0 cache fed the src rows of its group
 *     (codes never depend on when or how a position left the window) and never changes after;
 *     n_coded stays within the documented bounds; a truncation that cuts a KIVI group hands its
 *     positions back to the window as the fp16 rounding of their decoded values;
 *   - attention equals fp64 attention over the cache's own read-back keys and values.
 * Seeds are printed; KVPQ_PROP_SEED=S reruns one seed, KVPQ_PROP_OPS=N sets the operations per kind. */
#include <criterion/criterion.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "cache_testutil.h"
#include "kvpq.h"
#include "model/ggml_types.h"

#define N_LAYER 2
#define N_HEAD 4
#define N_HEAD_KV 2
#define HD 32
#define ROW (N_HEAD_KV * HD)
#define MAX_SEQ 300
#define WINDOW 16
#define PAGE 16
/* Attention vs fp64 over read-back K/V: float accumulation, online-softmax rescaling, LUT sums of
 * the VQ kind (test_cache_vq.c's ATTEND_TOL); a wrong position, length or merge is off by 1e-2. */
#define ATTN_ATOL 2e-4

typedef struct {
    const char *name;
    kvpq_cache_type type;
    int windowed; /* kivi / vq: a full-precision window, then codes */
    int norm;     /* vq: norm-explicit codebook */
} kind;

static const kind KINDS[] = {
    {"fp32", KVPQ_CACHE_FP32, 0, 0},  {"fp16", KVPQ_CACHE_FP16, 0, 0},   {"q8_0", KVPQ_CACHE_Q8_0, 0, 0},
    {"q4_0", KVPQ_CACHE_Q4_0, 0, 0},  {"kivi2", KVPQ_CACHE_KIVI2, 1, 0}, {"kivi4", KVPQ_CACHE_KIVI4, 1, 0},
    {"vq", KVPQ_CACHE_VQ, 1, 0},      {"vq-ne", KVPQ_CACHE_VQ, 1, 1},
};

static double f16r(double x) { return (double)kvpq_fp16_to_fp32(kvpq_fp32_to_fp16((float)x)); }

static kvpq_codebook *make_codebook(int norm, uint64_t seed) {
    /* random centroids (the cache's logic does not care how good) and random smoothing and means */
    kvpq_codebook *cb = test_codebook(&(test_codebook_spec){.n_layer = N_LAYER, .n_head_kv = N_HEAD_KV, .head_dim = HD,
                                                            .norm = norm, .seed = seed, .seed_step = 17,
                                                            .scale = norm ? 0.5f : 1.0f, .smooth = 1});
    cr_assert_not_null(cb, "%s", kvpq_last_error());
    return cb;
}

static kvpq_cache *make_cache(const kind *k, const kvpq_codebook *cb, int window, int max_seq) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = k->type;
    p.n_layer = N_LAYER;
    p.n_head = N_HEAD;
    p.n_head_kv = N_HEAD_KV;
    p.head_dim = HD;
    p.max_seq = max_seq;
    p.window = window;
    p.page_tokens = PAGE;
    p.codebook = cb;
    p.n_threads = 1;
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s: %s", k->name, kvpq_last_error());
    return c;
}

typedef struct {
    int len;
    double ref[2][MAX_SEQ * ROW];    /* [K, V] values appended */
    double src[2][MAX_SEQ * ROW];    /* [K, V] the full-precision value the cache holds */
    double frozen[2][MAX_SEQ * ROW]; /* [K, V] value of a coded position, NaN while not coded */
} layer_ref;

typedef struct {
    const kind *k;
    const kvpq_codebook *cb;
    kvpq_cache *c;
    layer_ref L[N_LAYER];
    int n_coded; /* per layer, as last seen */
    uint64_t seed;
    int op;
    float *kb, *vb; /* (MAX_SEQ, ROW) read buffers */
} prop;

#define PASSERT(cond, ...)                                                                                  \
    cr_assert(cond, "kind %s seed %llu op %d: %s", p->k->name, (unsigned long long)p->seed, p->op,        \
              (snprintf(g_msg, sizeof g_msg, __VA_ARGS__), g_msg))
static char g_msg[512];

/* Error bound of a row codec over a block of 32 channels (ggml's q8_0 / q4_0: d = amax / 127 or
 * amax / 8, stored in fp16; the value is within one step of d, plus d's own rounding). */
static double row_bound(const kind *k, const double *blk, int j) {
    double amax = 0;
    for (int i = 0; i < 32; i++) amax = fmax(amax, fabs(blk[i]));
    switch (k->type) {
    case KVPQ_CACHE_FP32: return 0;
    case KVPQ_CACHE_FP16: return fabs(blk[j]) * 0x1p-11 + 0x1p-24;
    case KVPQ_CACHE_Q8_0: return amax / 127.0 * (0.5 + 0x1p-10) + amax * 0x1p-10;
    default: return amax / 8.0 * (1.0 + 0x1p-10) + amax * 0x1p-10;
    }
}

static void check_state(prop *p) {
    const kind *k = p->k;
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(p->c, &st), KVPQ_OK);
    const int len = p->L[0].len;
    for (int l = 0; l < N_LAYER; l++) PASSERT(kvpq_cache_seq_len(p->c, l) == len, "layer %d length", l);
    if (!k->windowed) {
        /* Rows are coded independently: a fresh cache fed ref reads identically; and within the codec's error. */
        if (len == 0) return;
        kvpq_cache *fresh = make_cache(k, p->cb, WINDOW, MAX_SEQ);
        float *kf = malloc((size_t)len * ROW * 4), *vf = malloc((size_t)len * ROW * 4);
        float *kf2 = malloc((size_t)len * ROW * 4), *vf2 = malloc((size_t)len * ROW * 4);
        for (int l = 0; l < N_LAYER; l++) {
            for (size_t i = 0; i < (size_t)len * ROW; i++) kf[i] = (float)p->L[l].ref[0][i], vf[i] = (float)p->L[l].ref[1][i];
            cr_assert_eq(kvpq_cache_append(fresh, l, len, kf, vf), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_read(fresh, l, 0, len, kf2, vf2), KVPQ_OK);
            cr_assert_eq(kvpq_cache_read(p->c, l, 0, len, p->kb, p->vb), KVPQ_OK, "%s", kvpq_last_error());
            for (size_t i = 0; i < (size_t)len * ROW; i++) {
                PASSERT(p->kb[i] == kf2[i] && p->vb[i] == vf2[i], "layer %d position %zu: K %g V %g, fresh cache %g %g", l,
                        i / ROW, p->kb[i], p->vb[i], kf2[i], vf2[i]);
                size_t b0 = i / 32 * 32;
                for (int w = 0; w < 2; w++) {
                    double got = w ? p->vb[i] : p->kb[i], want = p->L[l].ref[w][i];
                    PASSERT(fabs(got - want) <= row_bound(k, &p->L[l].ref[w][b0], (int)(i - b0)),
                            "layer %d position %zu %s: %g vs appended %g", l, i / ROW, w ? "V" : "K", got, want);
                }
            }
        }
        free(kf), free(vf), free(kf2), free(vf2);
        kvpq_cache_free(fresh);
        return;
    }
    /* Windowed kinds. */
    PASSERT(st.tokens_coded % N_LAYER == 0, "tokens_coded %lld", (long long)st.tokens_coded);
    const int nc = (int)(st.tokens_coded / N_LAYER);
    const int is_kivi = k->type != KVPQ_CACHE_VQ;
    PASSERT(nc >= 0 && nc <= len, "n_coded %d of %d", nc, len);
    PASSERT(len - nc <= WINDOW + 31, "window holds %d positions (at most W + 31 = %d)", len - nc, WINDOW + 31);
    if (is_kivi) PASSERT(nc % 32 == 0, "KIVI n_coded %d not whole groups", nc);
    for (int l = 0; l < N_LAYER; l++) {
        layer_ref *R = &p->L[l];
        if (len) cr_assert_eq(kvpq_cache_read(p->c, l, 0, len, p->kb, p->vb), KVPQ_OK, "%s", kvpq_last_error());
        /* Newly coded positions [a, nc): exactly as a fresh window-0 cache coding their src rows. */
        int a = nc;
        while (a > 0 && isnan(R->frozen[0][(size_t)(a - 1) * ROW])) a--;
        for (int g0 = a; g0 < nc;) {
            int g1 = is_kivi ? (g0 / 32 + 1) * 32 : nc; /* a KIVI group; VQ codes rows independently */
            if (g1 > nc) g1 = nc;
            int n = g1 - g0, pad = (n + 31) / 32 * 32; /* window 0: coded in whole groups of 32 */
            int off = is_kivi ? g0 % 32 : 0;          /* KIVI: the group's position in its 32 */
            int ntot = is_kivi ? 32 : pad;
            PASSERT(!is_kivi || off == 0, "KIVI coded from mid-group %d", g0);
            kvpq_cache *o = make_cache(k, p->cb, 0, 64 + ntot);
            float *ko = calloc((size_t)ntot * ROW, 4), *vo = calloc((size_t)ntot * ROW, 4);
            for (int t = 0; t < n; t++)
                for (int j = 0; j < ROW; j++) {
                    ko[(size_t)t * ROW + j] = (float)R->src[0][(size_t)(g0 + t) * ROW + j];
                    vo[(size_t)t * ROW + j] = (float)R->src[1][(size_t)(g0 + t) * ROW + j];
                }
            if (is_kivi && n < 32) { /* the rest of the group: src of its other (coded) positions */
                PASSERT(0, "KIVI group [%d, %d) coded in part", g0, g1);
            }
            cr_assert_eq(kvpq_cache_append(o, l, ntot, ko, vo), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_read(o, l, 0, n, ko, vo), KVPQ_OK, "%s", kvpq_last_error());
            for (size_t i = 0; i < (size_t)n * ROW; i++) {
                size_t at = (size_t)g0 * ROW + i;
                PASSERT(p->kb[at] == ko[i] && p->vb[at] == vo[i],
                        "layer %d position %zu newly coded: K %g V %g, a fresh cache coding its src gives %g %g "
                        "(src %g %g)", l, at / ROW, p->kb[at], p->vb[at], ko[i], vo[i], R->src[0][at], R->src[1][at]);
                R->frozen[0][at] = p->kb[at];
                R->frozen[1][at] = p->vb[at];
            }
            free(ko), free(vo);
            kvpq_cache_free(o);
            g0 = g1;
        }
        for (size_t i = 0; i < (size_t)len * ROW; i++) {
            if ((int)(i / ROW) < nc)
                PASSERT(p->kb[i] == R->frozen[0][i] && p->vb[i] == R->frozen[1][i],
                        "layer %d coded position %zu changed: K %g V %g, was %g %g", l, i / ROW, p->kb[i], p->vb[i],
                        R->frozen[0][i], R->frozen[1][i]);
            else
                PASSERT(p->kb[i] == R->src[0][i] && p->vb[i] == R->src[1][i],
                        "layer %d window position %zu: K %g V %g, holds %g %g", l, i / ROW, p->kb[i], p->vb[i],
                        R->src[0][i], R->src[1][i]);
        }
    }
    p->n_coded = nc;
}

static void do_append(prop *p, uint64_t *rs) {
    const int len = p->L[0].len;
    int n = rng_unif(rs) < 0.8 ? 1 + (int)(rng_unif(rs) * 8) : 1 + (int)(rng_unif(rs) * 70);
    float *k = malloc((size_t)n * ROW * 4), *v = malloc((size_t)n * ROW * 4);
    if (len + n > MAX_SEQ) { /* must fail and change nothing */
        for (int l = 0; l < N_LAYER; l++)
            PASSERT(kvpq_cache_append(p->c, l, n, k, v) == KVPQ_ERR_CAPACITY, "append %d beyond max_seq", n);
        free(k), free(v);
        return;
    }
    for (int l = 0; l < N_LAYER; l++) {
        for (size_t i = 0; i < (size_t)n * ROW; i++) {
            k[i] = rng_normal(rs) * (i % 7 == 0 ? 3.0f : 1.0f); /* some larger channels */
            v[i] = rng_normal(rs);
        }
        PASSERT(kvpq_cache_append(p->c, l, n, k, v) == KVPQ_OK, "append %d: %s", n, kvpq_last_error());
        layer_ref *R = &p->L[l];
        for (size_t i = 0; i < (size_t)n * ROW; i++) {
            size_t at = (size_t)len * ROW + i;
            R->ref[0][at] = k[i];
            R->ref[1][at] = v[i];
            R->src[0][at] = p->k->windowed ? f16r(k[i]) : k[i];
            R->src[1][at] = p->k->windowed ? f16r(v[i]) : v[i];
            R->frozen[0][at] = R->frozen[1][at] = NAN;
        }
        R->len = len + n;
    }
    free(k), free(v);
}

static void do_truncate(prop *p, uint64_t *rs) {
    const int len = p->L[0].len;
    int n_pos = rng_unif(rs) < 0.1 ? len + (int)(rng_unif(rs) * 10) : (int)(rng_unif(rs) * (len + 1));
    if (rng_unif(rs) < 0.05) n_pos = 0;
    PASSERT(kvpq_cache_truncate(p->c, n_pos) == KVPQ_OK, "truncate %d: %s", n_pos, kvpq_last_error());
    if (n_pos >= len) return;
    kvpq_cache_stats st;
    kvpq_cache_get_stats(p->c, &st);
    const int nc = (int)(st.tokens_coded / N_LAYER);
    for (int l = 0; l < N_LAYER; l++) {
        layer_ref *R = &p->L[l];
        R->len = n_pos;
        /* Coded positions handed back to the window hold the fp16 rounding of their decoded values. */
        for (size_t i = (size_t)nc * ROW; i < (size_t)n_pos * ROW; i++)
            if (!isnan(R->frozen[0][i])) {
                R->src[0][i] = f16r(R->frozen[0][i]);
                R->src[1][i] = f16r(R->frozen[1][i]);
                R->frozen[0][i] = R->frozen[1][i] = NAN;
            }
    }
}

static void do_read(prop *p, uint64_t *rs) {
    const int len = p->L[0].len, l = (int)(rng_unif(rs) * N_LAYER);
    if (rng_unif(rs) < 0.2) { /* out of range, overflowing forms included: refused */
        int bad[][2] = {{-1, 1}, {0, len + 1}, {len, 1}, {1, INT_MAX}, {INT_MAX, INT_MAX}, {len + 1, 0}};
        int *b = bad[(int)(rng_unif(rs) * 6)];
        if (b[0] == len && b[1] == 1 && len == 0) b = bad[1];
        PASSERT(kvpq_cache_read(p->c, l, b[0], b[1], p->kb, p->vb) == KVPQ_ERR_INVALID_ARG, "read [%d, +%d) of %d",
                b[0], b[1], len);
        return;
    }
    int pos0 = (int)(rng_unif(rs) * (len + 1)), n = (int)(rng_unif(rs) * (len - pos0 + 1));
    float *k = malloc((size_t)(n + 1) * ROW * 4), *v = malloc((size_t)(n + 1) * ROW * 4);
    int which = (int)(rng_unif(rs) * 3); /* K and V, K only, V only */
    PASSERT(kvpq_cache_read(p->c, l, pos0, n, which == 2 ? NULL : k, which == 1 ? NULL : v) == KVPQ_OK,
            "read [%d, +%d): %s", pos0, n, kvpq_last_error());
    if (n) cr_assert_eq(kvpq_cache_read(p->c, l, 0, len, p->kb, p->vb), KVPQ_OK);
    for (size_t i = 0; i < (size_t)n * ROW; i++) {
        size_t at = (size_t)pos0 * ROW + i;
        if (which != 2) PASSERT(k[i] == p->kb[at], "partial read of K at position %zu", at / ROW);
        if (which != 1) PASSERT(v[i] == p->vb[at], "partial read of V at position %zu", at / ROW);
    }
    free(k), free(v);
}

static void do_attend(prop *p, uint64_t *rs) {
    const int len = p->L[0].len, l = (int)(rng_unif(rs) * N_LAYER);
    float q[4 * N_HEAD * HD] = {0}, out[4 * N_HEAD * HD];
    if (len == 0) {
        PASSERT(kvpq_cache_attend(p->c, l, 1, q, out) == KVPQ_ERR_INVALID_ARG, "attend on an empty cache");
        return;
    }
    int n_q = 1 + (int)(rng_unif(rs) * (len < 4 ? len : 4));
    for (int i = 0; i < n_q * N_HEAD * HD; i++) q[i] = 1.5f * rng_normal(rs);
    PASSERT(kvpq_cache_attend(p->c, l, n_q, q, out) == KVPQ_OK, "attend %d: %s", n_q, kvpq_last_error());
    cr_assert_eq(kvpq_cache_read(p->c, l, 0, len, p->kb, p->vb), KVPQ_OK);
    double ref[4 * N_HEAD * HD];
    ref_attend(len, n_q, N_HEAD, N_HEAD_KV, HD, p->kb, p->vb, q, ref);
    double err = 0;
    for (int i = 0; i < n_q * N_HEAD * HD; i++) err = fmax(err, fabs(out[i] - ref[i]));
    PASSERT(err <= ATTN_ATOL, "attend layer %d, %d queries over %d positions: max error %g vs fp64 over read-back", l,
            n_q, len, err);
}

static void run_kind(const kind *k, uint64_t seed, int n_ops) {
    prop *p = calloc(1, sizeof *p);
    p->k = k;
    p->seed = seed;
    kvpq_codebook *cb = k->type == KVPQ_CACHE_VQ ? make_codebook(k->norm, seed) : NULL;
    p->cb = cb;
    p->c = make_cache(k, cb, WINDOW, MAX_SEQ);
    p->kb = malloc((size_t)MAX_SEQ * ROW * 4);
    p->vb = malloc((size_t)MAX_SEQ * ROW * 4);
    uint64_t rs = seed;
    int counts[4] = {0};
    for (p->op = 0; p->op < n_ops; p->op++) {
        double u = rng_unif(&rs);
        int which = u < 0.45 ? 0 : u < 0.6 ? 1 : u < 0.8 ? 2 : 3;
        counts[which]++;
        if (which == 0) do_append(p, &rs);
        else if (which == 1) do_truncate(p, &rs);
        else if (which == 2) do_read(p, &rs);
        else do_attend(p, &rs);
        check_state(p);
    }
    fprintf(stderr, "cache property: %-6s seed %llu: %d ops (%d append, %d truncate, %d read, %d attend), ends at %d "
                    "positions\n", k->name, (unsigned long long)seed, n_ops, counts[0], counts[1], counts[2], counts[3],
            p->L[0].len);
    kvpq_cache_free(p->c);
    kvpq_codebook_free(cb);
    free(p->kb), free(p->vb), free(p);
}

Test(cache_property, every_kind_against_reference_model, .timeout = 600) {
    const char *se = getenv("KVPQ_PROP_SEED"), *so = getenv("KVPQ_PROP_OPS");
    int n_ops = so ? atoi(so) : quick() ? 500 : 2000;
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++) {
        uint64_t seed = se ? strtoull(se, NULL, 10) : 1000 + 7919 * (uint64_t)i;
        run_kind(&KINDS[i], seed, n_ops);
    }
}
