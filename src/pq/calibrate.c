/* calibrate.c — one layer of a codebook from collected keys and values: the recipe of
 * `kvpq calibrate` (centering, smoothing, Hadamard rotation, normalization, k-means), shared by the
 * CLI and the Python binding so both train the same codebook from the same activations. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pq/pq_impl.h"

kvpq_calibrate_params kvpq_calibrate_params_default(void) {
    kvpq_calibrate_params p = {.center = 1, .smooth_floor = 1e-2f, .kmeans = kvpq_kmeans_params_default()};
    p.kmeans.init = KVPQ_KMEANS_INIT_RANDOM;
    p.kmeans.max_points_per_centroid = 0;
    return p;
}

/* kvpq_calibrate_params.stage1_from: layer's stage-one key and value centroids copied from `from`
 * (same presets; cb has a second key stage there). */
static kvpq_status copy_stage1(kvpq_codebook *cb, const kvpq_codebook *from, int layer) {
    if (!kvpq_codebook_key_pq2(cb, layer))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "stage1_from: the codebook has no second key stage at layer %d", layer);
    for (int is_value = 0; is_value < 2; is_value++) {
        const kvpq_pq *src = kvpq_codebook_pq_const(from, layer, is_value);
        kvpq_pq *dst = kvpq_codebook_pq(cb, layer, is_value);
        if (!src || kvpq_pq_centroids_size(src) != kvpq_pq_centroids_size(dst))
            return kvpq__err(KVPQ_ERR_MISMATCH, "stage1_from: its layer %d %s quantizer has another shape", layer,
                             is_value ? "value" : "key");
        KVPQ_TRY(kvpq_pq_set_centroids(dst, kvpq_pq_centroids(src), kvpq_pq_centroids_size(src)));
    }
    return KVPQ_OK;
}

kvpq_status kvpq_codebook_calibrate_layer(kvpq_codebook *cb, int layer, size_t n_tokens, const float *k,
                                          const float *v, const kvpq_calibrate_params *p,
                                          kvpq_kmeans_report *key_report, kvpq_kmeans_report *value_report) {
    kvpq_calibrate_params def = kvpq_calibrate_params_default();
    if (!p) p = &def;
    if (!cb) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: codebook is NULL");
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    if (layer < 0 || layer >= cp.n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: layer %d out of range 0..%d", layer,
                         cp.n_layer - 1);
    if (n_tokens == 0 || !k || !v)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: layer %d: %s", layer,
                         n_tokens == 0 ? "n_tokens is 0" : "k or v is NULL");
    if (!(p->smooth_floor > 0))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: smooth_floor %g: expected > 0",
                         (double)p->smooth_floor);
    const int H = cp.n_head_kv, D = cp.head_dim;
    const size_t row = (size_t)H * D;
    if (n_tokens > SIZE_MAX / sizeof(float) / row)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: n_tokens %zu too large", n_tokens);
    if (!kvpq__all_finite(k, n_tokens * row))
        return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_codebook_calibrate_layer: layer %d: k holds NaN or Inf", layer);
    KVPQ_TRY(kvpq__codebook_check_rope(cb, layer, "kvpq_codebook_calibrate_layer"));
    if (!kvpq__all_finite(v, n_tokens * row))
        return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_codebook_calibrate_layer: layer %d: v holds NaN or Inf", layer);
    float *kd = malloc(sizeof(float) * n_tokens * row), *vd = malloc(sizeof(float) * n_tokens * row);
    float *lam = malloc(sizeof(float) * row);
    kvpq_status s = KVPQ_OK;
    if (!kd || !vd || !lam) {
        s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_codebook_calibrate_layer: out of memory (%zu tokens)", n_tokens);
        goto done;
    }
    memcpy(kd, k, sizeof(float) * n_tokens * row);
    memcpy(vd, v, sizeof(float) * n_tokens * row);
    const float *rope = kvpq__codebook_layer_rope(cb, layer);
    if (rope && !p->positions) {
        s = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_calibrate_layer: layer %d codes keys before RoPE: "
                      "params.positions (each token's position) is NULL", layer);
        goto done;
    }
    if (rope && (s = kvpq_rope_rotate(kd, n_tokens, H, D, cp.key_rope_dims, cp.key_rope_neox, rope, p->positions, 0,
                                      -1)) != KVPQ_OK) /* keys before RoPE: turned back by -position */
        goto fail;
    if (p->center) {
        /* mu in double over tokens (the order `kvpq calibrate` always used: its files stay identical) */
        float *mu = kvpq_codebook_key_mean(cb, layer); /* (H, D) */
        for (size_t c = 0; c < row; c++) {
            double acc = 0;
            for (size_t t = 0; t < n_tokens; t++) acc += kd[t * row + c];
            mu[c] = (float)(acc / (double)n_tokens);
        }
        for (size_t t = 0; t < n_tokens; t++)
            for (size_t c = 0; c < row; c++) kd[t * row + c] -= mu[c];
    }
    if ((s = p->query_absmax ? kvpq_smooth_compute_qk(n_tokens, H, D, kd, p->query_absmax, p->smooth_floor, lam)
                             : kvpq_smooth_compute(n_tokens, H, D, kd, p->smooth_floor, lam)) != KVPQ_OK)
        goto fail;
    memcpy(kvpq_codebook_key_smooth(cb, layer), lam, sizeof(float) * row);
    if ((s = kvpq_smooth_apply(kd, n_tokens, H, D, lam, 0)) != KVPQ_OK ||
        (s = kvpq_hadamard(kd, n_tokens * H, D)) != KVPQ_OK ||
        (cp.value_rotate && (s = kvpq_hadamard(vd, n_tokens * H, D)) != KVPQ_OK))
        goto fail;
    if ((cp.key_norm && (s = kvpq_normalize_rows(kd, n_tokens * H, D, NULL)) != KVPQ_OK) ||
        (cp.value_norm && (s = kvpq_normalize_rows(vd, n_tokens * H, D, NULL)) != KVPQ_OK))
        goto fail;
    kvpq_kmeans_params km = p->kmeans;
    int ppc = p->kmeans.max_points_per_centroid;
    km.max_points_per_centroid = ppc > 0 ? ppc : (cp.key.nbits > 8 ? 32 : 256);
    if (p->stage1_from) s = copy_stage1(cb, p->stage1_from, layer);
    else s = kvpq_pq_train(kvpq_codebook_pq(cb, layer, 0), &km, n_tokens * H, kd, key_report);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("kvpq_codebook_calibrate_layer: layer %d: key codebook", layer);
        goto done;
    }
    if (kvpq_codebook_key_pq2(cb, layer)) { /* this layer has a second key stage */
        /* Residual VQ (Juang & Gray 1982): stage two is k-means on the stage-one errors x - r1 of the
         * same transformed keys (directions with key_norm). */
        const kvpq_pq *k1 = kvpq_codebook_pq(cb, layer, 0);
        const size_t nv = n_tokens * H;
        uint8_t *codes = malloc(nv * kvpq_pq_code_size(k1));
        float *r1 = malloc(sizeof(float) * nv * D);
        if (!codes || !r1) s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_codebook_calibrate_layer: out of memory (stage two)");
        if (s == KVPQ_OK) s = kvpq_pq_encode(k1, nv, kd, codes);
        if (s == KVPQ_OK) s = kvpq_pq_decode(k1, nv, codes, r1);
        if (s == KVPQ_OK) {
            for (size_t i = 0; i < nv * D; i++) kd[i] -= r1[i];
            kvpq_kmeans_report r2;
            s = kvpq_pq_train(kvpq_codebook_key_pq2(cb, layer), &km, nv, kd, &r2);
            if (s == KVPQ_OK && key_report) key_report->mse_final = r2.mse_final; /* after both stages */
        }
        free(codes);
        free(r1);
        if (s != KVPQ_OK) {
            kvpq__err_prefix("kvpq_codebook_calibrate_layer: layer %d: key stage-two codebook", layer);
            goto done;
        }
    }
    km.max_points_per_centroid = ppc > 0 ? ppc : (cp.value.nbits > 8 ? 32 : 256);
    if (p->stage1_from) goto done; /* the values were copied with stage one */
    if ((s = kvpq_pq_train(kvpq_codebook_pq(cb, layer, 1), &km, n_tokens * H, vd, value_report)) != KVPQ_OK) {
        kvpq__err_prefix("kvpq_codebook_calibrate_layer: layer %d: value codebook", layer);
        goto done;
    }
    goto done;
fail:
    kvpq__err_prefix("kvpq_codebook_calibrate_layer: layer %d", layer);
done:
    free(kd);
    free(vd);
    free(lam);
    return s;
}
