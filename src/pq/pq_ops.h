/* pq_ops.h — internal entry points of the product quantizer for other modules (cache/). */
#ifndef KVPQ_PQ_OPS_H
#define KVPQ_PQ_OPS_H

#include "kvpq.h"

/* kvpq_pq_encode / kvpq_pq_assign / kvpq_pq_decode with an explicit OpenMP thread count
 * (n_threads <= 0: OpenMP default). Small inputs run on the calling thread (no fork). Exactly one
 * of codes / idx is non-NULL for encode. Same errors as the public functions. */
kvpq_status kvpq__pq_encode_nt(const kvpq_pq *pq, size_t n, const float *x, uint8_t *codes, uint16_t *idx,
                               int n_threads);
kvpq_status kvpq__pq_decode_nt(const kvpq_pq *pq, size_t n, const uint8_t *codes, float *x, int n_threads);

#endif
