/* test_cache_sinks.c — attention sinks (kvpq_cache_params.sinks): positions < S read back exactly
 * (fp16), the kind holds the rest as its own sequence (its read-back equals a cache without sinks fed
 * the positions from S on), attention equals fp64 attention over the read-back K/V with the sink rows
 * exact (prefill across S, decode, fewer positions than S, truncate below S, sliding-window layers),
 * the sinks are counted in resident bytes, and save/load keep them (format version 3). */
#include <criterion/criterion.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "kvpq.h"

#define ATTN_RTOL 2e-5
#define VQ_RTOL 2e-4 /* attention from codes (LUT sums in float) vs fp64 over the decoded values */
#define NH 8
#define NKV 2
#define HD 64

static kvpq_codebook *make_codebook(int n_layer) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = n_layer, p.n_head_kv = NKV, p.head_dim = HD;
    cr_assert_eq(kvpq_pq_params_preset(&p.key, "d4b8", HD), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_pq_params_preset(&p.value, "d4b8", HD), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook *cb = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_kmeans_params kp = kvpq_kmeans_params_default();
    kp.niter = 2, kp.n_threads = 1;
    for (int l = 0; l < n_layer; l++)
        for (int w = 0; w < 2; w++) {
            float *x = rand_vec(1024 * HD, 700u + 2u * l + w, 1.0f);
            cr_assert_eq(kvpq_pq_train(kvpq_codebook_pq(cb, l, w), &kp, 1024, x, NULL), KVPQ_OK);
            free(x);
        }
    return cb;
}

static kvpq_cache *make(kvpq_cache_type t, const kvpq_codebook *cb, int sinks, int max_seq, int swa) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t, p.n_layer = 2, p.n_head = NH, p.n_head_kv = NKV, p.head_dim = HD, p.max_seq = max_seq;
    p.page_tokens = 32, p.window = 16, p.codebook = cb, p.n_threads = 2, p.sinks = sinks;
    static const uint8_t swa_layers[2] = {0, 1};
    if (swa) p.sliding_window = swa, p.swa_layers = swa_layers;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s sinks %d: %s", kvpq_cache_type_name(t), sinks,
                 kvpq_last_error());
    return c;
}

/* Values on a 1/64 grid in [-4, 4]: exact in fp16, so a sink reads back exactly what was appended. */
static float *grid_vec(size_t n, uint64_t seed) {
    float *x = rand_vec(n, seed, 1.0f);
    for (size_t i = 0; i < n; i++) x[i] = roundf(fmaxf(-4.0f, fminf(4.0f, x[i])) * 64.0f) / 64.0f;
    return x;
}

/* Attend the newest n_q of layer l's len positions and compare with fp64 attention over what the
 * cache reads back (window: the layer's sliding window, 0 for none). */
static void check_attend(kvpq_cache *c, int l, int len, int n_q, int window, const float *q, double tol,
                         const char *what) {
    const size_t kvw = (size_t)NKV * HD, qw = (size_t)NH * HD;
    int lo = window > 0 && len - n_q + 1 - window > 0 ? len - n_q + 1 - window : 0; /* first position still held */
    float *kr = calloc((size_t)len * kvw, sizeof *kr), *vr = calloc((size_t)len * kvw, sizeof *vr);
    cr_assert_eq(kvpq_cache_read(c, l, lo, len - lo, kr + lo * kvw, vr + lo * kvw), KVPQ_OK, "%s: %s", what,
                 kvpq_last_error());
    float *out = malloc(n_q * qw * sizeof *out);
    double *ref = malloc(n_q * qw * sizeof *ref);
    cr_assert_eq(kvpq_cache_attend(c, l, n_q, q, out), KVPQ_OK, "%s: %s", what, kvpq_last_error());
    ref_attend_window(len, n_q, NH, NKV, HD, window, kr, vr, q, ref);
    double e = rel_err_f64(out, ref, n_q * qw);
    cr_assert(e < tol, "%s: len %d n_q %d: rel err %.3g vs fp64 reference", what, len, n_q, e);
    free(kr), free(vr), free(out), free(ref);
}

static void check_kind(kvpq_cache_type t, const kvpq_codebook *cb, int S, uint64_t seed) {
    const int L = 300;
    const size_t kvw = (size_t)NKV * HD, qw = (size_t)NH * HD;
    const double tol = t == KVPQ_CACHE_VQ ? VQ_RTOL : ATTN_RTOL;
    float *k = grid_vec(L * kvw, seed), *v = grid_vec(L * kvw, seed + 1), *q = rand_vec(L * qw, seed + 2, 0.3f);
    char what[96];
    snprintf(what, sizeof what, "%s sinks %d", kvpq_cache_type_name(t), S);
    kvpq_cache *c = make(t, cb, S, L, 0), *ref = make(t, cb, 0, L, 0);
    /* Prefill across S in one block: queries below S see only sinks, the rest both parts. */
    cr_assert_eq(kvpq_cache_append(c, 0, 120, k, v), KVPQ_OK, "%s", kvpq_last_error());
    check_attend(c, 0, 120, 120, 0, q, tol, what);
    /* Sinks read back exactly; the rest equals a sink-less cache fed positions S.. */
    float *kr = malloc(L * kvw * sizeof *kr), *vr = malloc(L * kvw * sizeof *vr);
    float *k2 = malloc(L * kvw * sizeof *k2), *v2 = malloc(L * kvw * sizeof *v2);
    cr_assert_eq(kvpq_cache_read(c, 0, 0, 120, kr, vr), KVPQ_OK);
    cr_assert(!memcmp(kr, k, S * kvw * sizeof *k) && !memcmp(vr, v, S * kvw * sizeof *v),
              "%s: sink positions do not read back exactly", what);
    cr_assert_eq(kvpq_cache_append(ref, 0, 120 - S, k + S * kvw, v + S * kvw), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(ref, 0, 0, 120 - S, k2, v2), KVPQ_OK);
    cr_assert(!memcmp(kr + S * kvw, k2, (120 - S) * kvw * sizeof *k2) &&
                  !memcmp(vr + S * kvw, v2, (120 - S) * kvw * sizeof *v2),
              "%s: positions >= S differ from the kind without sinks fed the same positions", what);
    /* Decode one position at a time; then a block. */
    for (int p = 120; p < 140; p++) {
        cr_assert_eq(kvpq_cache_append(c, 0, 1, k + p * kvw, v + p * kvw), KVPQ_OK);
        check_attend(c, 0, p + 1, 1, 0, q + p * qw, tol, what);
    }
    cr_assert_eq(kvpq_cache_append(c, 0, L - 140, k + 140 * kvw, v + 140 * kvw), KVPQ_OK);
    check_attend(c, 0, L, 37, 0, q + (L - 37) * qw, tol, what);
    /* Truncate below S, refill: the sinks hold the new values, attention still matches. */
    const int cut = S > 1 ? S / 2 : 0;
    cr_assert_eq(kvpq_cache_truncate(c, cut), KVPQ_OK);
    cr_assert_eq(kvpq_cache_seq_len(c, 0), cut);
    cr_assert_eq(kvpq_cache_append(c, 0, 90 - cut, v + cut * kvw, k + cut * kvw), KVPQ_OK); /* K, V swapped */
    cr_assert_eq(kvpq_cache_read(c, 0, 0, 90, kr, vr), KVPQ_OK);
    cr_assert(!memcmp(kr, k, cut * kvw * sizeof *k), "%s: positions kept by the truncate changed", what);
    cr_assert(!memcmp(kr + cut * kvw, v + cut * kvw, (S - cut) * kvw * sizeof *k), "%s: refilled sinks", what);
    check_attend(c, 0, 90, 90, 0, q, tol, what);
    /* Fewer positions than S: layer 1 with S - 1 positions (sinks only). */
    if (S > 1) {
        cr_assert_eq(kvpq_cache_append(c, 1, S - 1, k, v), KVPQ_OK);
        check_attend(c, 1, S - 1, S - 1, 0, q, tol, what);
        cr_assert_eq(kvpq_cache_read(c, 1, 0, S - 1, kr, NULL), KVPQ_OK);
        cr_assert(!memcmp(kr, k, (S - 1) * kvw * sizeof *k), "%s: sinks below S", what);
    }
    kvpq_cache_free(c), kvpq_cache_free(ref);
    free(k), free(v), free(q), free(kr), free(vr), free(k2), free(v2);
}

Test(cache_sinks, exact_sinks_and_attention_vs_fp64_every_quantized_kind) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_Q8_0, KVPQ_CACHE_Q4_0, KVPQ_CACHE_Q4_0R, KVPQ_CACHE_KIVI2,
                                            KVPQ_CACHE_KIVI4, KVPQ_CACHE_VQ};
    static const int sinks[] = {1, 4, 16, 64};
    kvpq_codebook *cb = make_codebook(2);
    for (int k = 0; k < 6; k++)
        for (int s = 0; s < 4; s++) check_kind(kinds[k], cb, sinks[s], 100u * k + s);
    kvpq_codebook_free(cb);
}

Test(cache_sinks, sliding_window_layer_sees_sinks_only_inside_its_window) {
    const int L = 200, W = 50, S = 4;
    const size_t kvw = (size_t)NKV * HD, qw = (size_t)NH * HD;
    float *k = grid_vec(L * kvw, 3), *v = grid_vec(L * kvw, 4), *q = rand_vec(L * qw, 5, 0.3f);
    kvpq_codebook *cb = make_codebook(2);
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_VQ};
    for (int i = 0; i < 3; i++) {
        kvpq_cache *c = make(kinds[i], cb, S, L, W);
        const double tol = kinds[i] == KVPQ_CACHE_VQ ? VQ_RTOL : ATTN_RTOL;
        for (int pos = 0, n = 3; pos < L; pos += n, n = n * 2 % 37 + 1) {
            if (n > L - pos) n = L - pos;
            for (int l = 0; l < 2; l++) {
                cr_assert_eq(kvpq_cache_append(c, l, n, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s",
                             kvpq_last_error());
                check_attend(c, l, pos + n, n, l == 1 ? W : 0, q + pos * qw, tol, kvpq_cache_type_name(kinds[i]));
            }
        }
        kvpq_cache_free(c);
    }
    kvpq_codebook_free(cb);
    free(k), free(v), free(q);
}

Test(cache_sinks, counted_in_bytes_refused_by_fp_kinds_and_saved) {
    const int S = 16;
    kvpq_cache *a = make(KVPQ_CACHE_Q4_0, NULL, 0, 512, 0), *b = make(KVPQ_CACHE_Q4_0, NULL, S, 512, 0);
    float *k = rand_vec(512 * NKV * HD, 1, 1.0f), *v = rand_vec(512 * NKV * HD, 2, 1.0f);
    for (int l = 0; l < 2; l++) {
        cr_assert_eq(kvpq_cache_append(a, l, 256 + S, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(b, l, 256 + S, k, v), KVPQ_OK);
    }
    /* b = a cache without sinks holding b's other 256 positions + the fp16 sinks (K and V, 2 layers). */
    kvpq_cache *e = make(KVPQ_CACHE_Q4_0, NULL, 0, 512, 0);
    for (int l = 0; l < 2; l++) cr_assert_eq(kvpq_cache_append(e, l, 256, k, v), KVPQ_OK);
    const size_t sink_bytes = (size_t)2 * 2 * S * NKV * HD * 2;
    cr_assert_eq(kvpq_cache_resident_bytes(b), kvpq_cache_resident_bytes(e) + sink_bytes,
                 "with sinks %zu, without %zu", kvpq_cache_resident_bytes(b), kvpq_cache_resident_bytes(e));
    cr_assert(kvpq_cache_resident_bytes(a) != kvpq_cache_resident_bytes(b));
    kvpq_cache_free(e);
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(b, &st), KVPQ_OK);
    cr_assert_eq(st.tokens_window, 2 * S);
    cr_assert_eq(st.elements, 2LL * 2 * (256 + S) * NKV * HD);
    char path[] = "/tmp/kvpq_sinks_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    /* saved with its sinks (format version 3; tests/test_cache_file.c covers every kind) */
    cr_assert_eq(kvpq_cache_save(b, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_params p;
    cr_assert_eq(kvpq_cache_get_params(b, &p), KVPQ_OK);
    cr_assert_eq(p.sinks, S);
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_load(&c, &p, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_resident_bytes(c), kvpq_cache_resident_bytes(b));
    kvpq_cache_free(c);
    c = NULL;
    cr_assert_eq(kvpq_cache_save(a, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_load(&c, &p, path, NULL, NULL), KVPQ_ERR_MISMATCH); /* a file without sinks */
    cr_assert(strstr(kvpq_last_error(), "sinks"), "%s", kvpq_last_error());
    cr_assert_null(c);
    unlink(path);
    p.type = KVPQ_CACHE_FP16;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_INVALID_ARG);
    p.type = KVPQ_CACHE_Q4_0, p.sinks = -1;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_INVALID_ARG);
    /* A sink beyond fp16's range is refused, naming the sinks; nothing changes. */
    kvpq_cache *d = make(KVPQ_CACHE_Q4_0, NULL, S, 512, 0);
    k[5] = 70000.0f;
    cr_assert_eq(kvpq_cache_append(d, 0, 8, k, v), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "sinks"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(d, 0), 0);
    kvpq_cache_free(a), kvpq_cache_free(b), kvpq_cache_free(d);
    free(k), free(v);
}

/* A sliding-window layer whose kind has dropped nothing yet (its window start is past the sinks but
 * inside its first page) still holds every position: truncating back, reading the sinks and the
 * element count must be as in a cache that never dropped. The layer's first position held was set
 * to S on every append past the window whether or not the kind freed a page, so kvpq_cache_truncate
 * refused ("no longer holds positions before 4"), reads of the sinks were refused and
 * kvpq_cache_get_stats counted S positions fewer (kvpq generate --prompt-cache then recomputed a
 * shorter prompt on Gemma-3 with the CLI's default sink). */
Test(cache_sinks, sliding_window_layer_that_dropped_nothing_keeps_every_position) {
    const int W = 50, S = 4;
    const size_t kvw = (size_t)NKV * HD;
    float *k = grid_vec(200 * kvw, 11), *v = grid_vec(200 * kvw, 12);
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_FP16};
    for (int i = 0; i < 3; i++) {
        const int sinks = kinds[i] == KVPQ_CACHE_FP16 ? 0 : S;
        kvpq_cache *c = make(kinds[i], NULL, sinks, 200, W);
        for (int l = 0; l < 2; l++) { /* 56 then 4: the second append's window starts at 7, page 0 (32) */
            cr_assert_eq(kvpq_cache_append(c, l, 56, k, v), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_append(c, l, 4, k + 56 * kvw, v + 56 * kvw), KVPQ_OK, "%s", kvpq_last_error());
        }
        kvpq_cache_stats st;
        cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
        cr_assert_eq(st.elements, (int64_t)2 * 2 * 60 * kvw, "%s: %lld elements, every position is held",
                     kvpq_cache_type_name(kinds[i]), (long long)st.elements);
        float kr[4 * NKV * HD], vr[4 * NKV * HD];
        cr_assert_eq(kvpq_cache_read(c, 1, 0, 4, kr, vr), KVPQ_OK, "%s: %s", kvpq_cache_type_name(kinds[i]),
                     kvpq_last_error());
        if (sinks) cr_assert(!memcmp(kr, k, sizeof kr) && !memcmp(vr, v, sizeof vr), "sinks read back other values");
        cr_assert_eq(kvpq_cache_truncate(c, 20), KVPQ_OK, "%s: %s", kvpq_cache_type_name(kinds[i]), kvpq_last_error());
        cr_assert_eq(kvpq_cache_seq_len(c, 1), 20);
        kvpq_cache_free(c);
    }
    free(k), free(v);
}
