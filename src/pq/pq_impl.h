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
 * codes have at most 4 bits per element (both key stages counted: nbits (M1 + M2) <= 4 head_dim;
 * finer quantizers keep float16, whose error the 8-bit code would exceed); else 2 (float16). KVPQ_ERR_FORMAT when that
 * metadata holds anything but "8" or "16". */
kvpq_status kvpq__codebook_scale_bytes(const kvpq_codebook *cb, int layer, int is_value, int *bytes);
/* A layer's RoPE frequencies when it codes keys before RoPE (key_rope_dims > 0 and some inv_freq
 * nonzero), else NULL: the one test of the cache, its CUDA kind and calibration. */
const float *kvpq__codebook_layer_rope(const kvpq_codebook *cb, int layer);
/* KVPQ_ERR_INVALID_ARG, "WHO: codebook layer L RoPE frequency I = X: must be finite and >= 0", when
 * one of a layer's frequencies is NaN, Inf or negative (set in memory: files are checked at load);
 * else KVPQ_OK. The check of the cache and calibration before they use them. */
kvpq_status kvpq__codebook_check_rope(const kvpq_codebook *cb, int layer, const char *who);
/* kvpq_rope_rotate's consecutive-position form (pos0, pos0 + 1, ... over n positions; half = n_rot / 2
 * >= 1) on rows anywhere: row h of position t at x + t pos_stride + h head_stride (the VQ cache's
 * decoded keys are head-major). Arguments as checked by kvpq_rope_rotate; KVPQ_ERR_NOMEM only. */
kvpq_status kvpq__rope_run(float *x, size_t n, int n_head, size_t pos_stride, size_t head_stride, int half, int neox,
                           const float *inv_freq, int pos0, int sign);

/* The VQ cache's page of one layer (cache_vq.c), shared with the byte model (kvpq_vq_cache_bytes)
 * so that the two agree to the byte: K codes then V codes (n_head_kv * page_tokens * (kcs + vcs)
 * bytes), then per norm-explicit kind its scales (n_head_kv * page_tokens * sb bytes; the first
 * kind with scales at a 4-byte aligned offset, a float16 kind at an even one), then, 4-byte aligned,
 * the 8-bit kinds' float references (n_head_kv each). Float16-only pages keep the layout they had
 * before 8-bit scales (saved caches). */
typedef struct {
    int sb[2];           /* bytes per scale of keys / values: 0, 1 or 2 (kvpq__codebook_scale_bytes) */
    size_t scale_off[2]; /* byte offset of the key / value scales (when sb > 0) */
    size_t ref_off;      /* byte offset of the references (when a kind has sb 1) */
    size_t page_bytes;
} kvpq__vq_page_layout;
kvpq_status kvpq__vq_page_layout_of(const kvpq_codebook *cb, int layer, int n_head_kv, int page_tokens, size_t kcs,
                                    size_t vcs, kvpq__vq_page_layout *out);

/* Validate params; message names the bad field. */
kvpq_status kvpq__pq_params_check(const kvpq_pq_params *p);
/* Recompute norms after centroids changed. */
void kvpq__pq_update_norms(kvpq_pq *pq);

#endif
