/* pq_impl.h — the product quantizer's layout, shared by the pq/ and cache/ modules. Internal. */
#ifndef KVPQ_PQ_IMPL_H
#define KVPQ_PQ_IMPL_H

#include "kvpq.h"

struct kvpq_pq {
    kvpq_pq_params p;
    int dsub;          /* d / M */
    int ksub;          /* 2^nbits */
    int n_books;       /* 1 (SHARED) or M (SUBSPACE) */
    size_t code_size;  /* ceil(M * nbits / 8) */
    float *centroids;  /* (n_books, ksub, dsub) */
    float *norms;      /* (n_books, ksub) squared L2 norms of the centroids, kept in sync */
    int norm_explicit; /* 1: a norm-explicit codebook's quantizer (codes directions; the VQ cache
                        * keeps a scale per vector, kvpq_codebook_params.key_norm); 0 otherwise */
};

/* Centroids of sub-space m: (ksub, dsub). */
static inline const float *kvpq__pq_book(const kvpq_pq *pq, int m) {
    return pq->centroids + (size_t)(pq->n_books == 1 ? 0 : m) * pq->ksub * pq->dsub;
}
static inline const float *kvpq__pq_norms(const kvpq_pq *pq, int m) {
    return pq->norms + (size_t)(pq->n_books == 1 ? 0 : m) * pq->ksub;
}

/* Validate params; message names the bad field. */
kvpq_status kvpq__pq_params_check(const kvpq_pq_params *p);
/* Recompute norms after centroids changed. */
void kvpq__pq_update_norms(kvpq_pq *pq);

#endif
