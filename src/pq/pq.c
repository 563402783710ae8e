/* pq.c — product quantizer object: params, presets, centroids (faiss ProductQuantizer naming). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pq/pq_impl.h"

kvpq_pq_params kvpq_pq_params_default(void) {
    kvpq_pq_params p = {.d = 64, .M = 16, .nbits = 8, .granularity = KVPQ_CODEBOOK_SHARED};
    return p;
}

kvpq_status kvpq_pq_params_preset(kvpq_pq_params *p, const char *preset, int d) {
    static const struct { const char *name; int dsub, nbits; } presets[] = {
        {"d8b8", 8, 8}, {"d8b12", 8, 12}, {"d4b8", 4, 8}, {"d4b12", 4, 12}, {"d2b8", 2, 8}, {"d1b8", 1, 8},
    };
    if (!p || !preset) return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq preset: NULL argument");
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        if (strcmp(preset, presets[i].name)) continue;
        if (d <= 0 || d % presets[i].dsub)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq preset %s: d=%d is not a positive multiple of dsub=%d",
                             preset, d, presets[i].dsub);
        p->d = d;
        p->M = d / presets[i].dsub;
        p->nbits = presets[i].nbits;
        return KVPQ_OK;
    }
    return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq preset '%s': expected d8b8, d8b12, d4b8, d4b12, d2b8 or d1b8", preset);
}

kvpq_status kvpq__pq_params_check(const kvpq_pq_params *p) {
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq params: NULL");
    if (p->d <= 0 || p->d > 65536) return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq d=%d: expected 1..65536", p->d);
    if (p->M <= 0 || p->d % p->M)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq M=%d: must divide d=%d", p->M, p->d);
    int dsub = p->d / p->M;
    if (dsub != 1 && dsub != 2 && dsub != 4 && dsub != 8 && dsub != 16)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "pq dsub=%d (d=%d / M=%d): expected 1, 2, 4, 8 or 16", dsub, p->d, p->M);
    if (p->nbits < 1 || p->nbits > 12)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "pq nbits=%d: expected 1..12", p->nbits);
    if (p->granularity != KVPQ_CODEBOOK_SHARED && p->granularity != KVPQ_CODEBOOK_SUBSPACE &&
        p->granularity != KVPQ_CODEBOOK_HEAD)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq granularity=%d: expected shared (0), subspace (1) or head (2)",
                         (int)p->granularity);
    if (p->granularity == KVPQ_CODEBOOK_HEAD && (p->n_head < 1 || p->n_head > 4096))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "pq n_head=%d: expected 1..4096 for head granularity", p->n_head);
    return KVPQ_OK;
}

size_t kvpq_codes_size(int M, int nbits) { return ((size_t)M * (size_t)nbits + 7) / 8; }

kvpq_status kvpq_pq_new(kvpq_pq **out, const kvpq_pq_params *p) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_new: out is NULL");
    *out = NULL;
    KVPQ_TRY(kvpq__pq_params_check(p));
    kvpq_pq *pq = calloc(1, sizeof *pq);
    if (!pq) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_pq_new: out of memory");
    pq->p = *p;
    pq->dsub = p->d / p->M;
    pq->ksub = 1 << p->nbits;
    pq->n_books = p->granularity == KVPQ_CODEBOOK_SHARED ? 1 : p->granularity == KVPQ_CODEBOOK_HEAD ? p->n_head : p->M;
    if (p->granularity != KVPQ_CODEBOOK_HEAD) pq->p.n_head = 0;
    pq->code_size = kvpq_codes_size(p->M, p->nbits);
    pq->centroids = calloc((size_t)pq->n_books * pq->ksub * pq->dsub, sizeof(float));
    pq->norms = calloc((size_t)pq->n_books * pq->ksub, sizeof(float));
    if (!pq->centroids || !pq->norms) {
        kvpq_pq_free(pq);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_pq_new: out of memory for %d codebook(s) of %d x %d",
                         pq->n_books, 1 << p->nbits, p->d / p->M);
    }
    *out = pq;
    return KVPQ_OK;
}

void kvpq_pq_free(kvpq_pq *pq) {
    if (!pq) return;
    free(pq->centroids);
    free(pq->norms);
    free(pq);
}

kvpq_pq_params kvpq_pq_get_params(const kvpq_pq *pq) { return pq->p; }
size_t kvpq_pq_centroids_size(const kvpq_pq *pq) { return (size_t)pq->n_books * pq->ksub * pq->dsub; }
const float *kvpq_pq_centroids(const kvpq_pq *pq) { return pq->centroids; }
size_t kvpq_pq_code_size(const kvpq_pq *pq) { return pq->code_size; }

void kvpq__pq_update_norms(kvpq_pq *pq) {
    size_t nc = (size_t)pq->n_books * pq->ksub;
    for (size_t c = 0; c < nc; c++) {
        const float *v = pq->centroids + c * pq->dsub;
        float s = 0;
        for (int j = 0; j < pq->dsub; j++) s += v[j] * v[j];
        pq->norms[c] = s;
    }
}

kvpq_status kvpq_pq_set_centroids(kvpq_pq *pq, const float *centroids, size_t n) {
    if (!pq || !centroids) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_set_centroids: NULL argument");
    if (n != kvpq_pq_centroids_size(pq))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_set_centroids: got %zu floats, expected %zu", n,
                         kvpq_pq_centroids_size(pq));
    if (!kvpq__all_finite(centroids, n))
        return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_pq_set_centroids: centroids contain NaN or Inf");
    memcpy(pq->centroids, centroids, n * sizeof(float));
    kvpq__pq_update_norms(pq);
    return KVPQ_OK;
}
