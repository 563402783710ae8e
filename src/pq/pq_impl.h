/* pq_impl.h — the product quantizer's layout, shared by the pq/ and cache/ modules. Internal. */
#ifndef KVPQ_PQ_IMPL_H
#define KVPQ_PQ_IMPL_H

#include "kvpq.h"

struct kvpq_pq {
    kvpq_pq_params p;
    int dsub;          /* d / M */
    int ksub;          /* 2^nbits */
    int n_books;       /* 1 (SHARED), M (SUBSPACE) or n_head (HEAD) */
    size_t code_size;  /* ceil(M * nbits / 8) */
    float *centroids;  /* (n_books, ksub, dsub) */
    float *norms;      /* (n_books, ksub) squared L2 norms of the centroids, kept in sync */
    int stage2;        /* 1: the stage-one key quantizer of a codebook layer with a residual second
                        * stage (kvpq_codebook_params.key_stages); the CUDA cache refuses it */
    int norm_explicit; /* 1: a norm-explicit codebook's quantizer (codes directions; the VQ cache
                        * keeps a scale per vector, kvpq_codebook_params.key_norm); 0 otherwise */
};

/* Centroids of sub-space m: (ksub, dsub). Not for HEAD quantizers (see kvpq__pq_head_book). */
static inline const float *kvpq__pq_book(const kvpq_pq *pq, int m) {
    return pq->centroids + (size_t)(pq->n_books == 1 ? 0 : m) * pq->ksub * pq->dsub;
}
/* The book of vectors of head h (row h % n_head of an interleaved batch): (ksub, dsub), shared by
 * its sub-spaces for HEAD; book 0 (SHARED) or the first sub-space's (SUBSPACE) otherwise, which
 * callers then index by sub-space as kvpq__pq_book does (n_books of the view: kvpq__pq_view_books). */
static inline const float *kvpq__pq_head_book(const kvpq_pq *pq, int h) {
    return pq->p.granularity == KVPQ_CODEBOOK_HEAD ? pq->centroids + (size_t)h * pq->ksub * pq->dsub : pq->centroids;
}
/* n_books as seen by one head's vectors: 1 for HEAD (its own book), else pq->n_books. */
static inline int kvpq__pq_view_books(const kvpq_pq *pq) {
    return pq->p.granularity == KVPQ_CODEBOOK_HEAD ? 1 : pq->n_books;
}
static inline const float *kvpq__pq_norms(const kvpq_pq *pq, int m) {
    return pq->norms + (size_t)(pq->n_books == 1 ? 0 : m) * pq->ksub;
}

/* Bytes of the norm-explicit scale of one coded vector of `layer`'s keys (is_value 0) or values:
 * 0 without a norm-explicit quantizer for that kind; 1 (an 8-bit log-coded scale, docs/vq_cache.md
 * "8-bit scales") when the codebook's metadata k.norm_bits / v.norm_bits is "8" and the layer's
 * (stage-one) quantizer has at most 4 bits per element (nbits <= 4 dsub: finer quantizers keep
 * float16, whose error the 8-bit code would exceed); else 2 (float16). KVPQ_ERR_FORMAT when that
 * metadata holds anything but "8" or "16". */
kvpq_status kvpq__codebook_scale_bytes(const kvpq_codebook *cb, int layer, int is_value, int *bytes);

/* Validate params; message names the bad field. */
kvpq_status kvpq__pq_params_check(const kvpq_pq_params *p);
/* Recompute norms after centroids changed. */
void kvpq__pq_update_norms(kvpq_pq *pq);

#endif
