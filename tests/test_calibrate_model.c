/* test_calibrate_model.c — the library's calibration driver (kvpq_model.h: kvpq_model_calibrate,
 * kvpq_calibration_*) on the real model (SmolLM2-135M-Instruct Q4_1), small settings: option checks
 * before any work, budgets met with the window and sinks recorded where kvpq_cache_params_resolve
 * finds them, a budget no allocation fits, cancelling, and kvpq_calibrate_params.stage1_from giving
 * the same bytes as training every stage. Skips, saying so, when the model file is missing. The file
 * bytes against the CLI's (before and after the driver moved here): tests/python/test_calibrate_driver.py. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpq_model.h"

#define MODEL_PATH KVPQ_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define TEXT_PATH KVPQ_SOURCE_DIR "/data/text/emma.txt"
#define TEXT_BYTES 12000 /* about 2700 tokens */

static kvpq_model *g_model;
static int32_t *g_toks;
static size_t g_n;

static void setup(void) {
    FILE *f = fopen(MODEL_PATH, "rb");
    if (!f) return;
    fclose(f);
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    /* float32 activations (read at load): the calibration runs them whatever the model's mode
     * (eval_hook.h), and stage1_from_gives_the_same_centroids collects activations by hand */
    setenv("KVPQ_ACT", "f32", 1);
    cr_assert_eq(kvpq_model_load(&g_model, MODEL_PATH, &mp), KVPQ_OK, "%s", kvpq_last_error());
    char *text = calloc(TEXT_BYTES + 1, 1);
    f = fopen(TEXT_PATH, "rb");
    cr_assert(f && text);
    size_t len = fread(text, 1, TEXT_BYTES, f);
    fclose(f);
    while (len > 0 && (text[len - 1] & 0xC0) == 0x80) len--; /* whole UTF-8 sequences */
    if (len > 0 && (unsigned char)text[len - 1] >= 0xC0) len--;
    cr_assert_eq(kvpq_tokenize(g_model, text, len, 0, 0, NULL, 0, &g_n), KVPQ_OK);
    g_toks = malloc(sizeof *g_toks * g_n);
    cr_assert_eq(kvpq_tokenize(g_model, text, len, 0, 0, g_toks, g_n, &g_n), KVPQ_OK);
    free(text);
}

static void teardown(void) {
    kvpq_model_free(g_model);
    free(g_toks);
}

#define REQUIRE_MODEL() \
    if (!g_model) cr_skip_test("model %s missing (run scripts/fetch_model.sh)", MODEL_PATH)

static int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && *q && strcmp(q, "0") != 0;
}

/* Small settings: 512 k-means tokens, 3 k-means iterations, a 128-token hold-out and joint check;
 * KVPQ_QUICK (the sanitizer run): 1 iteration, 64-token hold-out and check, two candidates. */
static kvpq_calibrate_opts small_opts(const double *bits, int n_bits, const int *wins, int n_wins) {
    kvpq_calibrate_opts o = kvpq_calibrate_opts_default();
    o.tokens = 512, o.ctx = 1024, o.n_threads = 2;
    o.recipe.iters = quick() ? 1 : 3;
    o.alloc.bits = bits, o.alloc.n_bits = n_bits;
    o.alloc.candidates = quick() ? "d4b8,d4b8+d8b8" : "d8b8,d4b8,d4b8+d8b8";
    o.alloc.windows = wins, o.alloc.n_windows = n_wins;
    o.alloc.holdout_ctx = o.alloc.verify_ctx = quick() ? 64 : 128;
    return o;
}

/* 1000 s a test: under ASan on a 2-core AVX2 CPU the whole binary takes 435 s alone, and beside
 * another test and a busy process budgets_met_and_window_recorded passed 600 s (2026-12-06). */
TestSuite(calibrate_model, .init = setup, .fini = teardown, .timeout = 1000);

Test(calibrate_model, options_checked_without_a_model) {
    const double bits[1] = {2.5};
    const int twice[3] = {0, 16, 16};
    kvpq_calibrate_opts o = small_opts(bits, 1, twice, 3);
    cr_assert_eq(kvpq_calibrate_opts_check(NULL, &o, 0), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "window 16 is listed twice"), "%s", kvpq_last_error());
    const int wins[2] = {0, 16};
    o = small_opts(bits, 1, wins, 2);
    o.recipe.keys2 = "d8b8";
    cr_assert_eq(kvpq_calibrate_opts_check(NULL, &o, 0), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "--keys2 is not used with it"), "%s", kvpq_last_error());
    o = small_opts(bits, 1, wins, 2);
    o.alloc.window_select = KVPQ_WINDOW_SELECT_MEASURED, o.alloc.verify_ctx = 0;
    cr_assert_eq(kvpq_calibrate_opts_check(NULL, &o, 0), KVPQ_ERR_INVALID_ARG);
    o = small_opts(bits, 1, wins, 2);
    cr_assert_eq(kvpq_calibrate_opts_check(NULL, &o, 0), KVPQ_OK, "%s", kvpq_last_error());
}

Test(calibrate_model, options_checked_against_the_model_and_text) {
    REQUIRE_MODEL();
    const double bits[1] = {2.5};
    const int wins[2] = {0, 16};
    kvpq_calibrate_opts o = small_opts(bits, 1, wins, 2);
    o.alloc.candidates = "d4b8,d4b12"; /* nbits 8 and 12 */
    cr_assert_eq(kvpq_calibrate_opts_check(g_model, &o, g_n), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "nbits"), "%s", kvpq_last_error());
    o = small_opts(bits, 1, wins, 2);
    cr_assert_eq(kvpq_calibrate_opts_check(g_model, &o, 300), KVPQ_ERR_INVALID_ARG); /* too short a text */
    o.recipe.keys = "d4b9";
    kvpq_calibration *c = (kvpq_calibration *)1;
    cr_assert_eq(kvpq_calibration_new(&c, g_model, g_toks, g_n, &o), KVPQ_ERR_INVALID_ARG);
    cr_assert_null(c);
}

Test(calibrate_model, budgets_met_and_window_recorded) {
    REQUIRE_MODEL();
    const double bits[2] = {3.3, 1.0}; /* 1.0: below the lightest allocation */
    const int wins[2] = {0, 16};
    kvpq_calibrate_opts o = small_opts(bits, 2, wins, 2);
    kvpq_codebook *out[2] = {0};
    kvpq_alloc_report rep[2];
    cr_assert_eq(kvpq_model_calibrate(g_model, g_toks, g_n, &o, out, rep), KVPQ_ERR_CAPACITY, "%s", kvpq_last_error());
    cr_assert_not_null(out[0]);
    cr_assert_null(out[1]);
    cr_assert(rep[0].effective_bits <= 3.3 && rep[0].effective_bits > 2.0, "%g", rep[0].effective_bits);
    cr_assert(rep[1].lightest_bits > 1.0 && isnan(rep[1].effective_bits), "%g", rep[1].lightest_bits);
    cr_assert(rep[0].holdout_kl > 0 && rep[0].holdout_kl < 1 && rep[0].holdout_top1 > 0.5);
    char w[16];
    snprintf(w, sizeof w, "%d", rep[0].window);
    cr_assert_str_eq(kvpq_codebook_get_meta(out[0], "alloc.window"), w);
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = KVPQ_CACHE_VQ, cp.codebook = out[0];
    cr_assert_eq(kvpq_cache_params_resolve(&cp, -1, -1), KVPQ_OK);
    cr_assert_eq(cp.window, rep[0].window);
    cr_assert_eq(cp.sinks, 1);
    kvpq_codebook_free(out[0]);
}

static int cancel_in_kmeans(void *user, const char *stage, double done, double total) {
    (void)done, (void)total;
    ++*(int *)user;
    return !strcmp(stage, "k-means");
}

Test(calibrate_model, progress_cancels) {
    REQUIRE_MODEL();
    kvpq_calibrate_opts o = small_opts(NULL, 0, NULL, 0);
    int calls = 0;
    o.progress = cancel_in_kmeans, o.progress_user = &calls;
    kvpq_codebook *cb = (kvpq_codebook *)1;
    cr_assert_eq(kvpq_model_calibrate(g_model, g_toks, g_n, &o, &cb, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "cancelled"), "%s", kvpq_last_error());
    cr_assert_null(cb);
    cr_assert_gt(calls, 1); /* the forward pass reported before k-means */
}

/* Two trainings of the same "d4b8 + second stage d8b8" codebook: all stages, and stage two alone
 * with stage one and the values copied from a one-stage d4b8 training. */
Test(calibrate_model, stage1_from_gives_the_same_centroids) {
    REQUIRE_MODEL();
    kvpq_calibrate_opts o = small_opts(NULL, 0, NULL, 0);
    kvpq_calibration *c = NULL;
    cr_assert_eq(kvpq_calibration_new(&c, g_model, g_toks, g_n, &o), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_recipe one = o.recipe, two = o.recipe;
    two.keys2 = "d8b8";
    kvpq_codebook *cb1 = NULL, *cb2 = NULL;
    cr_assert_eq(kvpq_calibration_train(c, &one, &cb1), KVPQ_OK);
    cr_assert_eq(kvpq_calibration_train(c, &two, &cb2), KVPQ_OK);
    kvpq_calibration_free(c);
    /* stage two alone on layer 3's activations, collected as calibrate does */
    kvpq_model_info mi;
    kvpq_model_get_info(g_model, &mi);
    const size_t row = (size_t)mi.n_head_kv * mi.head_dim;
    kvpq_cache_params kp = kvpq_cache_params_default();
    kp.type = KVPQ_CACHE_FP32;
    kvpq_model_cache_params(g_model, &kp);
    kp.max_seq = 512;
    kvpq_cache *cache = NULL;
    cr_assert_eq(kvpq_cache_new(&cache, &kp), KVPQ_OK);
    float *logits = malloc(sizeof(float) * mi.n_vocab), *qabs = calloc((size_t)mi.n_layer * row, sizeof(float));
    float *k = malloc(sizeof(float) * 512 * row), *v = malloc(sizeof(float) * 512 * row);
    cr_assert_eq(kvpq_model_eval_query_absmax(g_model, cache, g_toks, 512, 0, logits, qabs), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(cache, 3, 0, 512, k, v), KVPQ_OK);
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb2);
    kvpq_codebook *cb3 = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb3, &cp), KVPQ_OK);
    kvpq_calibrate_params clp = kvpq_calibrate_params_default();
    clp.kmeans.niter = o.recipe.iters, clp.kmeans.n_threads = 2, clp.query_absmax = qabs + 3 * row;
    clp.stage1_from = cb1;
    cr_assert_eq(kvpq_codebook_calibrate_layer(cb3, 3, 512, k, v, &clp, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
    const kvpq_pq *a[3] = {kvpq_codebook_pq_const(cb2, 3, 0), kvpq_codebook_pq_const(cb2, 3, 1),
                           kvpq_codebook_key_pq2_const(cb2, 3)};
    const kvpq_pq *b[3] = {kvpq_codebook_pq_const(cb3, 3, 0), kvpq_codebook_pq_const(cb3, 3, 1),
                           kvpq_codebook_key_pq2_const(cb3, 3)};
    for (int i = 0; i < 3; i++)
        cr_assert_eq(memcmp(kvpq_pq_centroids(a[i]), kvpq_pq_centroids(b[i]), sizeof(float) * kvpq_pq_centroids_size(a[i])),
                     0, "quantizer %d differs", i);
    clp.stage1_from = cb2; /* cb1 has no second stage to train: refused */
    cr_assert_eq(kvpq_codebook_calibrate_layer(cb1, 3, 512, k, v, &clp, NULL, NULL), KVPQ_ERR_INVALID_ARG);
    kvpq_cache_free(cache);
    free(logits), free(qabs), free(k), free(v);
    kvpq_codebook_free(cb1), kvpq_codebook_free(cb2), kvpq_codebook_free(cb3);
}

/* One budget at one window with keys after RoPE (0), before (1), and chosen per layer
 * (KVPQ_KEY_ROPE_CHOOSE): the choice has both sides' candidates, measured as each side alone measures
 * them, so its predicted KL is at most either's; a layer rotates its keys exactly when the allocation
 * chose a "@prerope" candidate for it, and takes that side's key mean. KVPQ_QUICK (the sanitizer
 * run, where each calibration takes minutes): the per-layer choice alone, one candidate and its twin. */
Test(calibrate_model, key_rope_chosen_per_layer) {
    REQUIRE_MODEL();
    const double bits[1] = {3.3};
    const int wins[1] = {16};
    kvpq_codebook *cb[3] = {0};
    kvpq_alloc_report rep[3];
    const int sides = !quick(); /* also calibrate each side alone */
    for (int mode = sides ? 0 : 2; mode < 3; mode++) {
        kvpq_calibrate_opts o = small_opts(bits, 1, wins, 1);
        o.recipe.key_rope = mode;
        if (!sides) o.alloc.candidates = "d4b8";
        cr_assert_eq(kvpq_model_calibrate(g_model, g_toks, g_n, &o, &cb[mode], &rep[mode]), KVPQ_OK, "%s",
                     kvpq_last_error());
    }
    if (sides)
        cr_assert_leq(rep[2].predicted_kl, fmin(rep[0].predicted_kl, rep[1].predicted_kl), "%g vs %g, %g",
                      rep[2].predicted_kl, rep[0].predicted_kl, rep[1].predicted_kl);
    cr_assert(rep[2].holdout_kl > 0 && rep[2].holdout_kl < 1, "%g", rep[2].holdout_kl);
    cr_assert_str_eq(kvpq_codebook_get_meta(cb[2], "alloc.key_rope"), "per-layer");
    const kvpq_codebook_params p = kvpq_codebook_get_params(cb[2]);
    const char *names = kvpq_codebook_get_meta(cb[2], "alloc.k");
    cr_assert_not_null(names);
    const size_t row = (size_t)p.n_head_kv * p.head_dim;
    int n_pre = 0;
    for (int l = 0; l < p.n_layer; l++, names = strchr(names, ',') + 1) {
        const size_t len = strcspn(names, ",");
        const int pre = len > 8 && !strncmp(names + len - 8, "@prerope", 8);
        const float *f = kvpq_codebook_key_rope_freq_const(cb[2], l);
        int rotated = 0;
        for (int i = 0; f && i < p.key_rope_dims / 2; i++) rotated |= f[i] != 0.0f;
        cr_assert_eq(rotated, pre, "layer %d: chosen %.*s, rotation %s", l, (int)len, names, rotated ? "on" : "off");
        if (sides)
            cr_assert_eq(memcmp(kvpq_codebook_key_mean_const(cb[2], l), kvpq_codebook_key_mean_const(cb[pre], l),
                                sizeof(float) * row), 0, "layer %d: the key mean is not its side's", l);
        n_pre += pre;
        if (l + 1 < p.n_layer) cr_assert_not_null(strchr(names, ','));
    }
    cr_assert(n_pre > 0 && n_pre < p.n_layer, "%d of %d layers before RoPE: no choice was made", n_pre, p.n_layer);
    for (int mode = 0; mode < 3; mode++) kvpq_codebook_free(cb[mode]);
}

/* Per-layer values of a codebook's comma-separated metadata list (at most 64). */
static int meta_list(const kvpq_codebook *cb, const char *key, double *v) {
    const char *p = kvpq_codebook_get_meta(cb, key);
    cr_assert_not_null(p, "no %s", key);
    int n = 0;
    for (char *end; n < 64 && *p; p = *end == ',' ? end + 1 : end, n++) {
        v[n] = strtod(p, &end);
        cr_assert(end != p, "%s: not a number at '%s'", key, p);
    }
    return n;
}

/* holdout_repeat W: one more sensitivity chunk, the first one's first half twice, weighing W in the
 * sensitivities' mean; it is measured (the tables move), recorded in the metadata, and a weight
 * outside 0 .. KVPQ_HOLDOUT_REPEAT_MAX is refused before any work. The weight is a weight: with
 * s_W = (s_0 + W r) / (1 + W) (r the repeated chunk's KL), s_3 = 1.5 s_1 - 0.5 s_0 per layer.
 * KVPQ_QUICK (the sanitizer run): the repeated chunk's calibration alone, one candidate. */
Test(calibrate_model, holdout_repeat_measures_a_copied_chunk) {
    REQUIRE_MODEL();
    const double bits[1] = {3.3};
    const int wins[1] = {16};
    kvpq_calibrate_opts o = small_opts(bits, 1, wins, 1);
    o.alloc.holdout_repeat = KVPQ_HOLDOUT_REPEAT_MAX + 1;
    cr_assert_eq(kvpq_calibrate_opts_check(g_model, &o, g_n), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "holdout_repeat 17"), "%s", kvpq_last_error());
    o.alloc.holdout_repeat = -1;
    cr_assert_eq(kvpq_calibrate_opts_check(g_model, &o, g_n), KVPQ_ERR_INVALID_ARG);
    const int reps[3] = {1, 0, 3}; /* one plain chunk (small_opts), so s_W = (s_0 + W r) / (1 + W) */
    kvpq_codebook *cb[3] = {0};
    for (int i = 0; i < (quick() ? 1 : 3); i++) {
        o = small_opts(bits, 1, wins, 1);
        o.alloc.holdout_repeat = reps[i];
        cr_assert_eq(o.alloc.holdout_chunks, 1);
        if (quick()) o.alloc.candidates = "d4b8";
        cr_assert_eq(kvpq_model_calibrate(g_model, g_toks, g_n, &o, &cb[i], NULL), KVPQ_OK, "%s", kvpq_last_error());
    }
    cr_assert_str_eq(kvpq_codebook_get_meta(cb[0], "alloc.holdout_repeat"), "1");
    if (!quick()) {
        cr_assert_null(kvpq_codebook_get_meta(cb[1], "alloc.holdout_repeat"));
        cr_assert_str_eq(kvpq_codebook_get_meta(cb[2], "alloc.holdout_repeat"), "3");
        const char *key = "alloc.sens.k.d4b8";
        cr_assert_str_neq(kvpq_codebook_get_meta(cb[0], key), kvpq_codebook_get_meta(cb[1], key));
        double s1[64], s0[64], s3[64];
        const int L = meta_list(cb[0], key, s1);
        cr_assert(L > 0 && meta_list(cb[1], key, s0) == L && meta_list(cb[2], key, s3) == L);
        for (int l = 0; l < L; l++) {
            const double want = 1.5 * s1[l] - 0.5 * s0[l]; /* the metadata keep 4 digits */
            cr_assert(fabs(s3[l] - want) <= 2e-3 * fmax(fabs(s0[l]), fabs(s1[l])) + 1e-7,
                      "layer %d: s_3 %g, expected 1.5 s_1 - 0.5 s_0 = %g (s_0 %g, s_1 %g)", l, s3[l], want, s0[l], s1[l]);
        }
    }
    for (int i = 0; i < 3; i++) kvpq_codebook_free(cb[i]);
}
