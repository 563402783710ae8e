/* test_cache_swa.c — sliding-window layers (kvpq_cache_params.sliding_window, swa_layers) in every
 * CPU cache kind: attention equals fp64 attention restricted to the window, over the same K/V a
 * cache without a window holds; a local layer holds a bounded number of positions; truncate, read
 * and attend refuse what is gone; a global layer of the same cache is untouched. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache_testutil.h"
#include "kvpq.h"

/* float32 attention vs fp64 over the same K/V (a few hundred positions; polynomial exp of the SIMD
 * levels): as test_cache.c's ATTN_RTOL. VQ attends from codes (LUT sums in float32, fp16 window):
 * test_cache_vq.c's ATTEND_TOL. */
#define ATTN_RTOL 2e-5
#define VQ_RTOL 2e-4

#define W 100     /* sliding window */
#define PAGE 32   /* page_tokens */
#define RESID 32  /* VQ / KIVI full-precision window */
#define L_TOTAL 700

static const kvpq_cache_type KINDS[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0, KVPQ_CACHE_Q4_0,
                                        KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4, KVPQ_CACHE_VQ,   KVPQ_CACHE_Q8_0R,
                                        KVPQ_CACHE_Q4_0R};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

static kvpq_codebook *make_codebook(int n_layer, int n_head_kv, int hd) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = n_layer;
    p.n_head_kv = n_head_kv;
    p.head_dim = hd;
    cr_assert_eq(kvpq_pq_params_preset(&p.key, "d4b8", hd), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_params_preset(&p.value, "d4b8", hd), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook *cb = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 2;
    kp.n_threads = 1;
    for (int l = 0; l < n_layer; l++)
        for (int w = 0; w < 2; w++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb, l, w);
            size_t n = 1024;
            float *x = rand_vec(n * hd, 900u + 2u * l + w, 1.0f);
            cr_assert_eq(kvpq_pq_train(pq, &kp, n, x, NULL), KVPQ_OK, "%s", kvpq_last_error());
            free(x);
        }
    return cb;
}

static kvpq_cache *make(kvpq_cache_type t, int n_head, int n_head_kv, int hd, int window, const uint8_t *swa,
                        const kvpq_codebook *cb) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = 2;
    p.n_head = n_head;
    p.n_head_kv = n_head_kv;
    p.head_dim = hd;
    p.max_seq = L_TOTAL + 8;
    p.page_tokens = PAGE;
    p.window = RESID;
    p.codebook = cb;
    p.n_threads = 2;
    p.backend = KVPQ_BACKEND_CPU;
    p.sliding_window = window;
    p.swa_layers = swa;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "cache_new %s: %s", kvpq_cache_type_name(t), kvpq_last_error());
    return c;
}

/* Feed the same positions, in uneven pieces as a model would (each piece appended, then its
 * queries attended), to a cache whose layer 1 is local (window W) and to one without a window.
 * After each piece: the local layer's output equals fp64 windowed attention over the K/V the
 * unwindowed cache reads back (the same stored values), the global layer 0 equals the
 * unwindowed cache's, and the local layer holds at most W - 1 + (PAGE-or-group unit) + piece. */
static void check_kind(kvpq_cache_type t, int n_head, int n_head_kv, int hd, uint64_t seed) {
    const size_t kvw = (size_t)n_head_kv * hd, qw = (size_t)n_head * hd;
    kvpq_codebook *cb = t == KVPQ_CACHE_VQ ? make_codebook(2, n_head_kv, hd) : NULL;
    static const uint8_t swa[2] = {0, 1};
    kvpq_cache *cw = make(t, n_head, n_head_kv, hd, W, swa, cb), *cf = make(t, n_head, n_head_kv, hd, 0, NULL, cb);
    float *k = rand_vec((size_t)L_TOTAL * kvw, seed, 1.0f), *v = rand_vec((size_t)L_TOTAL * kvw, seed + 1, 1.0f);
    float *q = rand_vec((size_t)L_TOTAL * qw, seed + 2, 1.0f);
    float *ow = malloc((size_t)L_TOTAL * qw * sizeof *ow), *of = malloc((size_t)L_TOTAL * qw * sizeof *of);
    float *kr = malloc((size_t)L_TOTAL * kvw * sizeof *kr), *vr = malloc((size_t)L_TOTAL * kvw * sizeof *vr);
    double *ref = malloc((size_t)L_TOTAL * qw * sizeof *ref);
    const double tol = t == KVPQ_CACHE_VQ ? VQ_RTOL : ATTN_RTOL;
    const int unit = t == KVPQ_CACHE_KIVI2 || t == KVPQ_CACHE_KIVI4 ? (PAGE + 31) / 32 * 32 : PAGE;
    static const int pieces[] = {1, 7, 64, 1, 1, 150, 3, 1, 230, 1, 2, 90, 1};
    int pos = 0, checked_drop = 0;
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
        const int n = pieces[i];
        const char *kn = kvpq_cache_type_name(t);
        for (int l = 0; l < 2; l++) {
            cr_assert_eq(kvpq_cache_append(cw, l, n, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_append(cf, l, n, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s", kvpq_last_error());
        }
        pos += n;
        /* local layer vs fp64 windowed attention over the unwindowed cache's values */
        cr_assert_eq(kvpq_cache_attend(cw, 1, n, q + (pos - n) * qw, ow), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_read(cf, 1, 0, pos, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
        ref_attend_window(pos, n, n_head, n_head_kv, hd, W, kr, vr, q + (pos - n) * qw, ref);
        double e = rel_err_f64(ow, ref, (size_t)n * qw);
        cr_assert(e < tol, "%s hd %d %d/%d: %d positions, %d queries: rel err %.3g vs fp64 windowed attention", kn, hd,
                  n_head, n_head_kv, pos, n, e);
        /* ... and it is not full attention once the window is exceeded */
        if (pos > W + 50) {
            ref_attend(pos, n, n_head, n_head_kv, hd, kr, vr, q + (pos - n) * qw, ref);
            cr_assert(rel_err_f64(ow, ref, (size_t)n * qw) > 100 * tol, "%s: windowed output equals full attention",
                      kn);
        }
        /* global layer: identical to the unwindowed cache */
        cr_assert_eq(kvpq_cache_attend(cw, 0, n, q + (pos - n) * qw, ow), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_attend(cf, 0, n, q + (pos - n) * qw, of), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(memcmp(ow, of, (size_t)n * qw * sizeof *ow), 0, "%s: global layer differs", kn);
        /* what the local layer still holds reads back as the unwindowed cache's values */
        const int from = pos - W + 1 > 0 ? pos - W + 1 : 0;
        float *kw = malloc((size_t)(pos - from) * kvw * sizeof *kw), *vw = malloc((size_t)(pos - from) * kvw * sizeof *vw);
        cr_assert_eq(kvpq_cache_read(cw, 1, from, pos - from, kw, vw), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(memcmp(kw, kr + from * kvw, (size_t)(pos - from) * kvw * sizeof *kw), 0, "%s: K differs", kn);
        cr_assert_eq(memcmp(vw, vr + from * kvw, (size_t)(pos - from) * kvw * sizeof *vw), 0, "%s: V differs", kn);
        free(kw), free(vw);
        /* bounded: the append freed whole units before the first position its queries see */
        if (pos - n - W + 1 >= unit) {
            kvpq_status s = kvpq_cache_read(cw, 1, 0, 1, kr, NULL);
            cr_assert_eq(s, KVPQ_ERR_INVALID_ARG, "%s: position 0 still readable at %d", kn, pos);
            cr_assert(strstr(kvpq_last_error(), "no longer holds"), "%s", kvpq_last_error());
            checked_drop = 1;
        }
    }
    cr_assert(checked_drop, "the window was never exceeded");
    /* element count of the stats = positions held; the local layer's bound */
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(cw, &st), KVPQ_OK);
    const int64_t held1 = st.elements / (2 * (int64_t)kvw) - pos; /* layer 0 holds pos */
    cr_assert(held1 <= W - 1 + unit + pieces[sizeof pieces / sizeof pieces[0] - 1] && held1 >= W,
              "%s: local layer holds %lld positions (window %d, unit %d)", kvpq_cache_type_name(t), (long long)held1,
              W, unit);
    cr_assert(kvpq_cache_resident_bytes(cw) < kvpq_cache_resident_bytes(cf), "%s: no memory saved",
              kvpq_cache_type_name(t));
    /* truncation: within the window's reach fine, beyond refused, to 0 always */
    cr_assert_eq(kvpq_cache_truncate(cw, pos - 5), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_truncate(cw, 10), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "layer 1"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(cw, 0), pos - 5, "a refused truncate changed layer 0");
    cr_assert_eq(kvpq_cache_truncate(cw, 0), KVPQ_OK, "%s", kvpq_last_error());
    /* after a reset the layer works from position 0 again */
    for (int l = 0; l < 2; l++) cr_assert_eq(kvpq_cache_append(cw, l, 20, k, v), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_attend(cw, 1, 20, q, ow), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_read(cw, 1, 0, 20, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
    ref_attend_window(20, 20, n_head, n_head_kv, hd, W, kr, vr, q, ref);
    cr_assert(rel_err_f64(ow, ref, (size_t)20 * qw) < tol, "%s: after truncate to 0", kvpq_cache_type_name(t));
    free(k), free(v), free(q), free(ow), free(of), free(kr), free(vr), free(ref);
    kvpq_cache_free(cw);
    kvpq_cache_free(cf);
    kvpq_codebook_free(cb);
}

Test(cache_swa, every_kind_matches_fp64_window_gqa_mqa) {
    for (int i = 0; i < N_KINDS; i++) {
        check_kind(KINDS[i], 12, 2, 128, 31u + i); /* Qwen2.5-1.5B's shape: GQA 6:1, head_dim 128 */
        check_kind(KINDS[i], 4, 1, 256, 61u + i);  /* Gemma-3-270M's: MQA 4:1, head_dim 256 */
    }
}

Test(cache_swa, every_layer_when_swa_layers_is_null_and_bad_params) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.n_layer = 2, p.n_head = 4, p.n_head_kv = 1, p.head_dim = 64, p.max_seq = 400, p.page_tokens = 16;
    p.sliding_window = 40;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s", kvpq_last_error());
    const size_t kvw = 64, qw = 4 * 64;
    float *k = rand_vec(300 * kvw, 5, 1.0f), *v = rand_vec(300 * kvw, 6, 1.0f), *q = rand_vec(qw, 7, 1.0f);
    for (int l = 0; l < 2; l++)
        for (int t = 0; t < 300; t++) cr_assert_eq(kvpq_cache_append(c, l, 1, k + t * kvw, v + t * kvw), KVPQ_OK);
    for (int l = 0; l < 2; l++) {
        cr_assert_eq(kvpq_cache_read(c, l, 0, 1, k, NULL), KVPQ_ERR_INVALID_ARG, "layer %d kept position 0", l);
        float out[256];
        double ref[256];
        float *kr = malloc(300 * kvw * sizeof *kr), *vr = malloc(300 * kvw * sizeof *vr);
        /* positions 260..299 are all the last query sees; the ones before are not compared */
        memset(kr, 0, 300 * kvw * sizeof *kr), memset(vr, 0, 300 * kvw * sizeof *vr);
        cr_assert_eq(kvpq_cache_read(c, l, 260, 40, kr + 260 * kvw, vr + 260 * kvw), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_attend(c, l, 1, q, out), KVPQ_OK, "%s", kvpq_last_error());
        ref_attend_window(300, 1, 4, 1, 64, 40, kr, vr, q, ref);
        cr_assert(rel_err_f64(out, ref, qw) < ATTN_RTOL, "layer %d", l);
        free(kr), free(vr);
    }
    /* a query block reaching back before what is held is refused */
    float *q2 = rand_vec(100 * qw, 8, 1.0f), *o2 = malloc(100 * qw * sizeof *o2);
    cr_assert_eq(kvpq_cache_attend(c, 0, 100, q2, o2), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "no longer holds"), "%s", kvpq_last_error());
    free(q2), free(o2);
    kvpq_cache_free(c);
    p.sliding_window = -1;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "sliding_window"), "%s", kvpq_last_error());
    free(k), free(v), free(q);
}
