/* calibrate.c — a model's key/value codebooks trained on its own activations (kvpq_model.h,
 * "calibration"): the options and their checks, the split of the text, the forward pass that
 * collects every layer's post-RoPE keys and values, and one codebook from a recipe. The per-layer
 * bit allocation is calib_alloc.c.
 *
 * Keys are centered per (KV head, channel) (mu, stored as layers.{i}.k.mean; exact at attention
 * time), divided by smoothing factors lambda and Hadamard-rotated (VecInfer, arXiv 2510.06175,
 * sec. 3); values are rotated when asked; each layer's key and value codebooks are trained by k-means
 * on the transformed vectors (kvpq_codebook_calibrate_layer). `kvpq calibrate` and Python's
 * kvpq.calibrate are clients of these calls, so the same options give the same file. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "calib_impl.h"
#include "eval_hook.h"

/* Tokens per forward step of the activation collection (each step read back at once). */
#define CALIB_STEP 512

static const int DEFAULT_WINDOWS[] = {0, 16, 32, 64, 128};

kvpq_codebook_recipe kvpq_codebook_recipe_default(void) {
    return (kvpq_codebook_recipe){.keys = "d4b8", .granularity = KVPQ_CODEBOOK_SHARED, .center = 1,
                                  .smooth_query = 1, .key_norm = 1, .value_norm = 1, .iters = 25,
                                  .kmeans_init = KVPQ_KMEANS_INIT_RANDOM, .seed = 1234};
}

kvpq_calibrate_opts kvpq_calibrate_opts_default(void) {
    return (kvpq_calibrate_opts){
        .tokens = 32768, .ctx = 2048, .recipe = kvpq_codebook_recipe_default(),
        .alloc = {.candidates = "d8b8,d4b8,d2b8,d8b8+d8b8,d4b8+d8b8", .sinks = 1, .holdout_chunks = 1,
                  .alloc_values = -1, .verify_ctx = -1, .window_select = KVPQ_WINDOW_SELECT_AUTO,
                  .window_trust = 0.3}};
}

void kvpq__calib_meta_fmt(kvpq_codebook *cb, const char *key, const char *fmt, ...) {
    char buf[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    kvpq_codebook_set_meta(cb, key, buf);
}

kvpq_status kvpq__calib_progress(const kvpq_calibration *c, const char *stage, double done, double total) {
    if (c->o.progress && c->o.progress(c->o.progress_user, stage, done, total))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: cancelled");
    return KVPQ_OK;
}

kvpq_codebook_recipe kvpq__calib_recipe(const kvpq_calibration *c, const kvpq_codebook_recipe *r) {
    kvpq_codebook_recipe x = r ? *r : c->o.recipe;
    if (!x.values) x.values = x.keys;
    if (!x.norm_bits) x.norm_bits = c->o.alloc.n_bits > 0 ? 8 : 16;
    return x;
}

/* ---- per-layer M items ("CFG:A-B[,CFG:A-B...]") ---- */

/* One item "CFG:A-B" (or "CFG:A") of length n at p: its preset's M into *M, its layers into *a, *b. */
static kvpq_status parse_layer_item(const char *what, const char *p, size_t n, int n_layer, int head_dim, int nbits,
                                    int *M, int *a, int *b) {
    const char *colon = memchr(p, ':', n);
    if (!colon || colon == p || colon - p > 31 || n - (size_t)(colon + 1 - p) == 0 || n - (size_t)(colon + 1 - p) > 31)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s item '%.*s': expected CFG:A-B (e.g. d2b8:10-19)", what, (int)n, p);
    char cfg[32], range[32];
    snprintf(cfg, sizeof cfg, "%.*s", (int)(colon - p), p);
    const int rn = (int)(n - (size_t)(colon + 1 - p));
    snprintf(range, sizeof range, "%.*s", rn, colon + 1);
    int used = 0, ok = sscanf(range, "%d-%d%n", a, b, &used) == 2 && used == rn;
    if (!ok) {
        used = 0;
        ok = sscanf(range, "%d%n", a, &used) == 1 && used == rn;
        *b = *a;
    }
    if (!ok) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s item '%.*s': layer range '%s' is not A-B", what, (int)n, p, range);
    if (*a < 0 || *b < *a || *b >= n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s item '%.*s': layers %d-%d out of the model's 0-%d", what, (int)n, p,
                         *a, *b, n_layer - 1);
    kvpq_pq_params q;
    if (kvpq_pq_params_preset(&q, cfg, head_dim) != KVPQ_OK)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s item '%.*s': %s", what, (int)n, p, kvpq_last_error());
    if (q.nbits != nbits)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s preset %s has nbits=%d, the layers' preset has nbits=%d (a layer "
                         "may change only M)", what, cfg, q.nbits, nbits);
    *M = q.M;
    return KVPQ_OK;
}

/* Apply the items of spec to cb's key (is_value 0) or value (1) quantizers; seen (n_layer) names
 * an overlap with an earlier item. */
static kvpq_status apply_layer_items(kvpq_codebook *cb, const char *spec, int n_layer, int head_dim, int nbits,
                                     int is_value, unsigned char *seen) {
    const char *what = is_value ? "--values-layers" : "--keys-layers";
    if (!*spec) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s is empty", what);
    for (const char *p = spec; *p;) {
        const char *end = strchr(p, ',');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        int M = 0, a = 0, b = 0;
        KVPQ_TRY(parse_layer_item(what, p, n, n_layer, head_dim, nbits, &M, &a, &b));
        for (int l = a; l <= b; l++)
            if (seen[l])
                return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s item '%.*s': layer %d is already set by an earlier item",
                                 what, (int)n, p, l);
        for (int l = a; l <= b; l++) {
            seen[l] = 1;
            KVPQ_TRY(is_value ? kvpq_codebook_set_layer_value_M(cb, l, M) : kvpq_codebook_set_layer_key_M(cb, l, M));
        }
        p = end ? end + 1 : p + n;
        if (end && !*p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s ends with ','", what);
    }
    return KVPQ_OK;
}

static kvpq_status apply_layers(kvpq_codebook *cb, const char *spec, int n_layer, int head_dim, int nbits,
                                int is_value) {
    unsigned char *seen = calloc((size_t)n_layer, 1);
    if (!seen) return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    kvpq_status s = apply_layer_items(cb, spec, n_layer, head_dim, nbits, is_value, seen);
    free(seen);
    return s;
}

/* ---- one codebook from a recipe ---- */

static kvpq_status recipe_params(const kvpq_model *m, const kvpq_codebook_recipe *r, const kvpq_model_info *mi,
                                 kvpq_codebook_params *cp) {
    *cp = kvpq_codebook_params_default();
    cp->n_layer = mi->n_layer;
    cp->n_head_kv = mi->n_head_kv;
    cp->head_dim = mi->head_dim;
    cp->value_rotate = r->value_rotate;
    cp->key_norm = r->key_norm;
    cp->value_norm = r->value_norm;
    if (kvpq_pq_params_preset(&cp->key, r->keys, mi->head_dim) != KVPQ_OK ||
        kvpq_pq_params_preset(&cp->value, r->values, mi->head_dim) != KVPQ_OK)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: %s", kvpq_last_error());
    cp->key.granularity = cp->value.granularity = r->granularity;
    if (r->key_rope) KVPQ_TRY(kvpq_model_rope(m, 0, &cp->key_rope_dims, &cp->key_rope_neox, NULL));
    if (!r->keys2) return KVPQ_OK;
    if (kvpq_pq_params_preset(&cp->key2, r->keys2, mi->head_dim) != KVPQ_OK)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --keys2: %s", kvpq_last_error());
    cp->key_stages = 2;
    cp->key2.granularity = cp->key.granularity;
    if (cp->key2.nbits != cp->key.nbits)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --keys2 %s has nbits=%d, --keys has nbits=%d (the two "
                         "stages' tables are added as one)", r->keys2, cp->key2.nbits, cp->key.nbits);
    return KVPQ_OK;
}

static kvpq_status make_codebook(const kvpq_model *m, const kvpq_model_info *mi, const kvpq_codebook_recipe *r,
                                 kvpq_codebook **out) {
    kvpq_codebook_params cp;
    KVPQ_TRY(recipe_params(m, r, mi, &cp));
    kvpq_codebook *cb = NULL;
    kvpq_status s = kvpq_codebook_new(&cb, &cp);
    if (s == KVPQ_OK) s = kvpq_codebook_set_model(cb, mi);
    for (int l = 0; l < mi->n_layer && s == KVPQ_OK && cp.key_rope_dims > 0; l++) /* keys before RoPE: every layer */
        s = kvpq_model_rope(m, l, NULL, NULL, kvpq_codebook_key_rope_freq(cb, l));
    /* 8-bit norm-explicit scales (cache_vq.c): every candidate and the written file count and
     * measure them, since the VQ cache reads this metadata */
    if (s == KVPQ_OK && r->norm_bits == 8 && cp.key_norm) s = kvpq_codebook_set_meta(cb, "k.norm_bits", "8");
    if (s == KVPQ_OK && r->norm_bits == 8 && cp.value_norm) s = kvpq_codebook_set_meta(cb, "v.norm_bits", "8");
    if (s == KVPQ_OK && r->keys_layers)
        s = apply_layers(cb, r->keys_layers, mi->n_layer, mi->head_dim, cp.key.nbits, 0);
    if (s == KVPQ_OK && r->values_layers)
        s = apply_layers(cb, r->values_layers, mi->n_layer, mi->head_dim, cp.value.nbits, 1);
    if (s != KVPQ_OK) kvpq_codebook_free(cb), cb = NULL;
    *out = cb;
    return s;
}

kvpq_status kvpq__calib_make_codebook(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook **out) {
    return make_codebook(c->m, &c->mi, r, out);
}

typedef struct {
    const kvpq_calibration *c;
    int layer;
} kmeans_progress;

kvpq_status kvpq__calib_train_layers(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook *cb,
                                     const kvpq_codebook *stage1_from, double *mse_k, double *mse_v) {
    const int L = c->mi.n_layer;
    const size_t row = (size_t)c->mi.n_head_kv * c->mi.head_dim;
    kvpq_calibrate_params clp = kvpq_calibrate_params_default();
    clp.center = r->center;
    clp.kmeans.niter = r->iters;
    clp.kmeans.seed = r->seed;
    clp.kmeans.n_threads = c->o.n_threads;
    clp.kmeans.init = r->kmeans_init;
    clp.kmeans.max_points_per_centroid = r->max_points_per_centroid; /* 0: 256, or 32 for nbits > 8 */
    clp.stage1_from = stage1_from;
    *mse_k = *mse_v = 0;
    for (int l = 0; l < L; l++) {
        /* centering, smoothing, rotation, normalization, k-means: the library's recipe */
        kvpq_kmeans_report rk = {0}, rv = {0};
        clp.query_absmax = r->smooth_query ? c->qabs + (size_t)l * row : NULL;
        clp.positions = c->pos;
        KVPQ_TRY(kvpq_codebook_calibrate_layer(cb, l, c->n_use, c->k + (size_t)l * c->n_use * row,
                                               c->v + (size_t)l * c->n_use * row, &clp, &rk, &rv));
        *mse_k += rk.mse_final;
        *mse_v += rv.mse_final;
        KVPQ_TRY(kvpq__calib_progress(c, "k-means", l + 1, L));
    }
    return KVPQ_OK;
}

void kvpq__calib_common_meta(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook *cb,
                             double mse_k, double mse_v) {
    const int L = c->mi.n_layer;
    kvpq_codebook_set_meta(cb, "model", c->mi.name);
    if (c->o.model_file) kvpq_codebook_set_meta(cb, "model_file", c->o.model_file);
    if (c->o.text_name) kvpq_codebook_set_meta(cb, "text", c->o.text_name);
    kvpq__calib_meta_fmt(cb, "tokens", "%zu", c->n_use);
    kvpq__calib_meta_fmt(cb, "ctx", "%d", c->o.ctx);
    kvpq_codebook_set_meta(cb, "keys", r->keys);
    if (r->keys2) kvpq_codebook_set_meta(cb, "keys2", r->keys2);
    if (r->keys_layers) kvpq_codebook_set_meta(cb, "keys_layers", r->keys_layers);
    if (r->values_layers) kvpq_codebook_set_meta(cb, "values_layers", r->values_layers);
    kvpq_codebook_set_meta(cb, "values", r->values);
    kvpq__calib_meta_fmt(cb, "seed", "%llu", (unsigned long long)r->seed);
    kvpq__calib_meta_fmt(cb, "kmeans_iters", "%d", r->iters);
    kvpq_codebook_set_meta(cb, "kmeans_init", r->kmeans_init == KVPQ_KMEANS_INIT_PP ? "pp" : "random");
    kvpq_codebook_set_meta(cb, "key_center", r->center ? "1" : "0");
    kvpq_codebook_set_meta(cb, "key_smooth", r->smooth_query ? "query" : "keys");
    /* With norm-explicit quantizers these are errors of the unit directions. */
    kvpq__calib_meta_fmt(cb, "key_mse_mean", "%.6g", mse_k / L);
    kvpq__calib_meta_fmt(cb, "value_mse_mean", "%.6g", mse_v / L);
}

kvpq_status kvpq_calibration_train(kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook **out) {
    if (!c || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_train: NULL argument");
    *out = NULL;
    const kvpq_codebook_recipe x = kvpq__calib_recipe(c, r);
    if (x.key_rope == KVPQ_KEY_ROPE_CHOOSE)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_train: key_rope KVPQ_KEY_ROPE_CHOOSE (--key-rope "
                         "auto) is a choice of the allocation (kvpq_calibration_allocate); one codebook takes 0 or 1");
    kvpq_codebook *cb = NULL;
    double mse_k = 0, mse_v = 0;
    kvpq_status s = make_codebook(c->m, &c->mi, &x, &cb);
    if (s == KVPQ_OK) s = kvpq__calib_train_layers(c, &x, cb, NULL, &mse_k, &mse_v);
    if (s != KVPQ_OK) {
        kvpq_codebook_free(cb);
        return s;
    }
    kvpq__calib_common_meta(c, &x, cb, mse_k, mse_v);
    *out = cb;
    return KVPQ_OK;
}

/* ---- the options' checks and the split of the text ---- */

/* The recipe's fields that need no model. */
static kvpq_status check_recipe_fields(const kvpq_codebook_recipe *r, int n_bits) {
    if (!r->keys) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: recipe.keys is NULL (a preset, e.g. d4b8)");
    if (r->granularity < KVPQ_CODEBOOK_SHARED || r->granularity > KVPQ_CODEBOOK_HEAD)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: granularity %d: expected shared, subspace or head",
                         (int)r->granularity);
    if (r->norm_bits != 0 && r->norm_bits != 8 && r->norm_bits != 16)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --norm-bits %d: expected 8 or 16", r->norm_bits);
    if (r->kmeans_init != KVPQ_KMEANS_INIT_PP && r->kmeans_init != KVPQ_KMEANS_INIT_RANDOM)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: kmeans_init %d: expected pp or random", r->kmeans_init);
    if (r->key_rope < 0 || r->key_rope > KVPQ_KEY_ROPE_CHOOSE)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: key_rope %d: expected 0 (after RoPE), 1 (before) or %d "
                         "(chosen per layer by the allocation)", r->key_rope, KVPQ_KEY_ROPE_CHOOSE);
    if (r->key_rope == KVPQ_KEY_ROPE_CHOOSE && n_bits < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --key-rope auto lets the allocation choose each layer's "
                         "keys before or after RoPE: it needs budgets (--bits)");
    if (r->iters < 1 || r->max_points_per_centroid < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: iters %d (expected >= 1), max_points_per_centroid %d", r->iters,
                         r->max_points_per_centroid);
    /* budgets take every layer's presets from the candidates (a second key stage: a P1+P2 candidate);
     * these were silently dropped, yet written to the file's metadata */
    if (n_bits > 0 && (r->keys2 || r->keys_layers || r->values_layers))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --bits chooses every layer's presets from --candidates: %s "
                         "is not used with it (a residual second key stage: a candidate P1+P2, e.g. d4b8+d8b8)",
                         r->keys2 ? "--keys2" : r->keys_layers ? "--keys-layers" : "--values-layers");
    return KVPQ_OK;
}

/* The recipe against the model: its presets, second stage and per-layer items make a codebook. */
static kvpq_status check_recipe(const kvpq_model *m, const kvpq_model_info *mi, const kvpq_codebook_recipe *r0) {
    kvpq_codebook_recipe r = *r0;
    if (!r.values) r.values = r.keys;
    kvpq_codebook *cb = NULL;
    kvpq_status s = make_codebook(m, mi, &r, &cb);
    kvpq_codebook_free(cb);
    return s;
}

/* Window candidates of a (the defaults when NULL) into wins, ascending and distinct. */
static kvpq_status sorted_windows(const kvpq_alloc_params *a, int wins[16], int *n_wins) {
    const int *w = a->windows ? a->windows : DEFAULT_WINDOWS;
    const int n = a->windows ? a->n_windows : (int)(sizeof DEFAULT_WINDOWS / sizeof DEFAULT_WINDOWS[0]);
    if (n < 1 || n > 16) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: %d window candidates: expected 1..16", n);
    *n_wins = 0;
    for (int i = 0; i < n; i++) {
        if (w[i] < 0 || w[i] > (1 << 20))
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: window %d: expected 0..%d", w[i], 1 << 20);
        for (int j = 0; j < *n_wins; j++)
            if (wins[j] == w[i])
                return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --window-candidates: window %d is listed twice",
                                 w[i]);
        int at = (*n_wins)++; /* insertion: ascending */
        while (at > 0 && wins[at - 1] > w[i]) wins[at] = wins[at - 1], at--;
        wins[at] = w[i];
    }
    return KVPQ_OK;
}

/* The allocation's fields that need no model. */
static kvpq_status check_alloc_fields(const kvpq_alloc_params *a) {
    if (a->n_bits < 0 || a->n_bits > 9 || (a->n_bits > 0 && !a->bits))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: %d budgets: expected 0..9 (with bits)", a->n_bits);
    for (int i = 0; i < a->n_bits; i++)
        if (!(a->bits[i] > 0 && a->bits[i] <= 32))
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: budget %g bits: expected (0, 32]", a->bits[i]);
    if (a->n_bits == 0) return KVPQ_OK;
    int wins[16], nw;
    KVPQ_TRY(sorted_windows(a, wins, &nw));
    if (!a->candidates || !*a->candidates) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates is empty");
    if (a->sinks < 0 || a->holdout_chunks < 1 || (a->holdout_ctx != 0 && a->holdout_ctx < 64) ||
        a->holdout_repeat < 0 || a->holdout_repeat > KVPQ_HOLDOUT_REPEAT_MAX)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: sinks %d (>= 0), holdout_chunks %d (>= 1), holdout_ctx %d "
                         "(0 or >= 64), holdout_repeat %d (0 .. %d)", a->sinks, a->holdout_chunks, a->holdout_ctx,
                         a->holdout_repeat, KVPQ_HOLDOUT_REPEAT_MAX);
    if (a->verify_ctx < -1 || (a->verify_ctx > 0 && a->verify_ctx < 16))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --verify-ctx %d: expected 0 (off) or at least 16 tokens",
                         a->verify_ctx);
    if ((unsigned)a->window_select > KVPQ_WINDOW_SELECT_MEASURED)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: window_select %d: expected auto, predicted or measured",
                         (int)a->window_select);
    if (a->window_select == KVPQ_WINDOW_SELECT_MEASURED && a->verify_ctx == 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --window-select measured needs the joint check: not with "
                         "--verify-ctx 0");
    if (!(a->window_trust >= 0 && a->window_trust <= 100))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --window-trust %g: expected 0..100", a->window_trust);
    return KVPQ_OK;
}

/* The allocation against the model: the joint check's context, the candidates' presets. */
static kvpq_status check_alloc(const kvpq_model_info *mi, const kvpq_alloc_params *a, const char *values) {
    if (a->n_bits == 0) return KVPQ_OK;
    if (a->verify_ctx > mi->n_ctx_train)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --verify-ctx %d exceeds the model's context length %d",
                         a->verify_ctx, mi->n_ctx_train);
    return kvpq__calib_check_candidates(a->candidates, values, mi->head_dim, a->alloc_values != 0);
}

/* The split of n tokens (struct kvpq_calibration's fields n_use .. verify_skipped). */
static kvpq_status split_text(kvpq_calibration *c, const kvpq_model_info *mi, const kvpq_calibrate_opts *o, size_t n) {
    const kvpq_alloc_params *a = &o->alloc;
    c->n_tok = n, c->n_avail = n, c->hctx = c->hchunks = c->vctx = c->verify_skipped = 0;
    if (a->n_bits > 0) {
        c->hctx = a->holdout_ctx ? a->holdout_ctx : (o->ctx < 1024 ? o->ctx : 1024);
        c->hchunks = a->holdout_chunks;
        if (c->hctx > mi->n_ctx_train) c->hctx = mi->n_ctx_train;
        if ((size_t)c->hctx * c->hchunks + 16 > n)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --bits: the text has %zu tokens, too few to hold back "
                             "%d x %d", n, c->hchunks, c->hctx);
        c->n_avail = n - (size_t)c->hctx * c->hchunks;
    }
    c->n_use = c->n_avail < o->tokens ? c->n_avail : o->tokens;
    if (c->n_use < 16)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: the text has only %zu tokens (need at least 16)", n);
    if (a->n_bits == 0 || a->verify_ctx == 0) return KVPQ_OK;
    /* the joint check's chunk: the tokens right after the k-means tokens (never seen by k-means,
     * before the sensitivities' hold-out). Asked for and missing: an error; by default: no check. */
    const int vctx = a->verify_ctx > 0 ? a->verify_ctx : o->ctx;
    if (c->n_use + (size_t)vctx <= c->n_avail) {
        c->vctx = vctx;
        return KVPQ_OK;
    }
    if (a->verify_ctx > 0 || a->window_select == KVPQ_WINDOW_SELECT_MEASURED)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: %s %d: the text has %zu tokens: %zu for k-means and %d x "
                         "%d held out for the sensitivities leave %zu, fewer than the %d of the joint check (lower "
                         "--tokens or --verify-ctx, or --verify-ctx 0)",
                         a->verify_ctx > 0 ? "--verify-ctx" : "--window-select measured, --verify-ctx", vctx, n,
                         c->n_use, c->hchunks, c->hctx, c->n_avail - c->n_use, vctx);
    c->verify_skipped = 1;
    return KVPQ_OK;
}

kvpq_status kvpq_calibrate_opts_check(const kvpq_model *m, const kvpq_calibrate_opts *o, size_t n_tokens) {
    if (!o) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibrate_opts_check: o is NULL");
    if (o->ctx < 16) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --ctx %d: expected >= 16", o->ctx);
    if (o->tokens < 16) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --tokens %zu: expected >= 16", o->tokens);
    if (o->n_threads < 0 || o->n_threads > 1024)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: n_threads %d: expected 0..1024", o->n_threads);
    KVPQ_TRY(check_recipe_fields(&o->recipe, o->alloc.n_bits));
    KVPQ_TRY(check_alloc_fields(&o->alloc));
    if (!m) return KVPQ_OK;
    kvpq_model_info mi;
    KVPQ_TRY(kvpq_model_get_info(m, &mi));
    if (o->ctx > mi.n_ctx_train)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --ctx %d exceeds the model's context length %d", o->ctx,
                         mi.n_ctx_train);
    KVPQ_TRY(check_recipe(m, &mi, &o->recipe));
    KVPQ_TRY(check_alloc(&mi, &o->alloc, o->recipe.values ? o->recipe.values : o->recipe.keys));
    kvpq_calibration probe;
    return split_text(&probe, &mi, o, n_tokens);
}

/* ---- the forward pass ---- */

/* Run the k-means tokens in chunks of ctx (each from an empty fp32 cache) and steps of CALIB_STEP,
 * reading every layer's keys and values back after each step: a sliding-window layer frees
 * positions its later queries no longer see, but never those of the step just appended. */
static kvpq_status collect(kvpq_calibration *c) {
    const int L = c->mi.n_layer, ctx = c->o.ctx;
    const size_t row = (size_t)c->mi.n_head_kv * c->mi.head_dim;
    kvpq_cache_params kp = kvpq_cache_params_default();
    kp.type = KVPQ_CACHE_FP32;
    kvpq_model_cache_params(c->m, &kp); /* shape and sliding window */
    kp.max_seq = ctx;
    kp.n_threads = c->o.n_threads;
    kvpq_cache *cache = NULL;
    float *logits = malloc(sizeof(float) * (size_t)c->mi.n_vocab);
    kvpq_status s = logits ? kvpq_cache_new(&cache, &kp) : kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    for (size_t p0 = 0; s == KVPQ_OK && p0 < c->n_use; p0 += (size_t)ctx) {
        const int n = (int)(c->n_use - p0 < (size_t)ctx ? c->n_use - p0 : (size_t)ctx);
        s = kvpq_cache_truncate(cache, 0);
        for (int q0 = 0; s == KVPQ_OK && q0 < n; q0 += CALIB_STEP) {
            const int nq = n - q0 < CALIB_STEP ? n - q0 : CALIB_STEP;
            s = kvpq_model_eval_query_absmax(c->m, cache, c->toks + p0 + q0, nq, 0, logits, c->qabs);
            for (int l = 0; l < L && s == KVPQ_OK; l++) {
                const size_t at = ((size_t)l * c->n_use + p0 + (size_t)q0) * row;
                s = kvpq_cache_read(cache, l, q0, nq, c->k + at, c->v + at);
            }
            if (s == KVPQ_OK) s = kvpq__calib_progress(c, "forward", (double)(p0 + (size_t)(q0 + nq)), (double)c->n_use);
        }
    }
    kvpq_cache_free(cache);
    free(logits);
    return s;
}

static double wall_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

kvpq_status kvpq_calibration_new(kvpq_calibration **out, kvpq_model *m, const int32_t *tokens, size_t n,
                                 const kvpq_calibrate_opts *o) {
    if (!out || !m || !tokens || !o) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_new: NULL argument");
    *out = NULL;
    KVPQ_TRY(kvpq_calibrate_opts_check(m, o, n));
    kvpq_calibration *c = calloc(1, sizeof *c);
    if (!c) return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    c->m = m;
    c->o = *o;
    kvpq_model_get_info(m, &c->mi);
    if (o->alloc.n_bits > 0) sorted_windows(&o->alloc, c->wins, &c->n_wins);
    split_text(c, &c->mi, o, n);
    const size_t row = (size_t)c->mi.n_head_kv * c->mi.head_dim, L = (size_t)c->mi.n_layer;
    c->toks = malloc(sizeof *c->toks * n);
    c->k = malloc(sizeof(float) * L * c->n_use * row);
    c->v = malloc(sizeof(float) * L * c->n_use * row);
    c->qabs = calloc(L * row, sizeof(float));
    c->pos = malloc(sizeof *c->pos * (c->n_use ? c->n_use : 1));
    kvpq_status s = KVPQ_OK;
    if (!c->toks || !c->k || !c->v || !c->qabs || !c->pos)
        s = kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory for %zu tokens' keys and values (%.0f MiB)", c->n_use,
                      2.0 * (double)(L * c->n_use * row) * sizeof(float) / 1048576.0);
    if (s == KVPQ_OK) {
        memcpy(c->toks, tokens, sizeof *c->toks * n);
        for (size_t i = 0; i < c->n_use; i++) c->pos[i] = (int32_t)(i % (size_t)o->ctx); /* collect's chunks */
        const double t0 = wall_seconds();
        const int act = kvpq__model_act_reference(m); /* eval_hook.h: float32 activations */
        s = collect(c);
        kvpq__model_act_restore(m, act);
        c->t_forward = wall_seconds() - t0;
    }
    if (s != KVPQ_OK) {
        kvpq_calibration_free(c);
        return s;
    }
    *out = c;
    return KVPQ_OK;
}

void kvpq_calibration_free(kvpq_calibration *c) {
    if (!c) return;
    free(c->toks);
    free(c->pos);
    free(c->k);
    free(c->v);
    free(c->qabs);
    free(c);
}

kvpq_status kvpq_calibration_info_get(const kvpq_calibration *c, kvpq_calibration_info *info) {
    if (!c || !info) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_info_get: NULL argument");
    *info = (kvpq_calibration_info){.n_text = c->n_tok, .n_kmeans = c->n_use, .verify_ctx = c->vctx,
                                    .verify_skipped = c->verify_skipped, .holdout_ctx = c->hctx,
                                    .holdout_chunks = c->hchunks, .forward_seconds = c->t_forward};
    return KVPQ_OK;
}

kvpq_status kvpq_model_calibrate(kvpq_model *m, const int32_t *tokens, size_t n, const kvpq_calibrate_opts *o,
                                 kvpq_codebook **out, kvpq_alloc_report *report) {
    if (!out || !o) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_calibrate: NULL argument");
    kvpq_calibration *c = NULL;
    KVPQ_TRY(kvpq_calibration_new(&c, m, tokens, n, o));
    kvpq_status s = o->alloc.n_bits > 0 ? kvpq_calibration_allocate(c, out, report) : kvpq_calibration_train(c, NULL, out);
    kvpq_calibration_free(c);
    return s;
}
