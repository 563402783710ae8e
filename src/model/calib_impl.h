/* calib_impl.h — the calibration session shared by calibrate.c (text split, forward pass, one
 * codebook from a recipe) and calib_alloc.c (the per-layer bit allocation). */
#ifndef KVPQ_CALIB_IMPL_H
#define KVPQ_CALIB_IMPL_H

#include "kvpq_model.h"

struct kvpq_calibration {
    kvpq_model *m;
    kvpq_model_info mi;
    kvpq_calibrate_opts o;  /* as given, strings borrowed; recipe.values and norm_bits resolved */
    int wins[16], n_wins;   /* window candidates, ascending */
    int32_t *toks;          /* (n_tok) the text, a copy */
    size_t n_tok;
    size_t n_use;           /* k-means tokens: toks[0 .. n_use) */
    size_t n_avail;         /* tokens before the sensitivities' hold-out: toks[n_avail ..) is held out */
    int hctx, hchunks;      /* the hold-out: hchunks chunks of hctx tokens (0 without budgets) */
    int vctx;               /* the joint check's chunk toks[n_use .. n_use + vctx); 0: none */
    int verify_skipped;
    float *k, *v;           /* (n_layer, n_use, n_head_kv, head_dim) post-RoPE keys and values */
    int32_t *pos;           /* (n_use) each k-means token's position in its forward chunk */
    float *qabs;            /* (n_layer, n_head_kv, head_dim) max |q| per KV head's group and channel */
    double t_forward;
};

/* The recipe r (NULL: the calibration's) with values and norm_bits resolved. */
kvpq_codebook_recipe kvpq__calib_recipe(const kvpq_calibration *c, const kvpq_codebook_recipe *r);
/* An untrained codebook of recipe r (resolved) for the calibration's model: presets, granularity,
 * second stage, per-layer M items, norm metadata. */
kvpq_status kvpq__calib_make_codebook(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook **out);
/* Train every layer of cb on the collected activations; summed k-means MSEs to *mse_k, *mse_v.
 * stage1_from: NULL, or a codebook trained here with cb's presets but one key stage, whose stage one
 * and values are copied (kvpq_calibrate_params.stage1_from). */
kvpq_status kvpq__calib_train_layers(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook *cb,
                                     const kvpq_codebook *stage1_from, double *mse_k, double *mse_v);
/* The metadata every codebook of calibrate records (model, text, tokens, ctx, recipe, mean MSEs). */
void kvpq__calib_common_meta(const kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook *cb,
                             double mse_k, double mse_v);
/* kvpq_codebook_set_meta with a printf-formatted value (at most 63 characters). */
void kvpq__calib_meta_fmt(kvpq_codebook *cb, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Check a candidate list (kvpq_alloc_params.candidates) against the values preset and head_dim. */
kvpq_status kvpq__calib_check_candidates(const char *list, const char *values, int head_dim, int alloc_values);
/* o->progress, if any; a nonzero return is KVPQ_ERR_INVALID_ARG "cancelled". */
kvpq_status kvpq__calib_progress(const kvpq_calibration *c, const char *stage, double done, double total);

#endif
