/* encode.c — PQ encode (fused nearest-centroid search) and decode (gather).
 *
 * Each sub-vector's code is argmin_c ||x - C[c]||^2 = argmin_c (||C[c]||^2 - 2 x.C[c]) (the ||x||^2
 * term is common), computed by the dispatch table's nn kernel: the centroid norms are precomputed,
 * distances stay in registers, and no (n, ksub, dsub) difference tensor is ever formed. Memory:
 * the output plus one prepared codebook per sub-space (ksub floats x (dsub + 1)) and a per-thread
 * block of unpacked indices. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "cpu/dispatch.h"
#include "pq/pack.h"
#include "pq/pq_impl.h"
#include "pq/pq_ops.h"

#define ENC_BLOCK_SUBVECS 16384      /* unpacked indices per thread block (64 KiB of int32) */
#define PAR_MIN_WORK (1u << 18)      /* sub-vector x centroid pairs below which we stay serial */

static int resolve_threads(int n_threads) { return n_threads > 0 ? n_threads : omp_get_max_threads(); }

/* Index of the first row holding NaN/Inf, or n. Rows are checked in parallel. */
static size_t first_nonfinite_row(size_t n, int d, const float *x, int nt, int par) {
    int bad = 0;
#pragma omp parallel for num_threads(nt) if (par) reduction(| : bad) schedule(static)
    for (size_t i = 0; i < n; i++)
        if (!kvpq__all_finite(x + i * (size_t)d, (size_t)d)) bad = 1;
    if (!bad) return n;
    for (size_t i = 0; i < n; i++)
        if (!kvpq__all_finite(x + i * (size_t)d, (size_t)d)) return i;
    return n;
}

kvpq_status kvpq__pq_encode_nt(const kvpq_pq *pq, size_t n, const float *x, uint8_t *codes, uint16_t *idx16,
                               int n_threads) {
    const char *fn = codes ? "kvpq_pq_encode" : "kvpq_pq_assign";
    if (!pq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: pq is NULL", fn);
    if (n == 0) return KVPQ_OK;
    if (!x || (!codes && !idx16)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: NULL array (n=%zu)", fn, n);
    const int d = pq->p.d, M = pq->p.M, dsub = pq->dsub, ksub = pq->ksub, nbooks = pq->n_books;
    const int nt = resolve_threads(n_threads);
    const int par = nt > 1 && (double)n * M * ksub >= PAR_MIN_WORK;
    size_t bad = first_nonfinite_row(n, d, x, nt, par);
    if (bad < n) return kvpq__err(KVPQ_ERR_NONFINITE, "%s: x[%zu] (of n=%zu vectors) contains NaN or Inf", fn, bad, n);
    const int head = pq->p.granularity == KVPQ_CODEBOOK_HEAD, nh = head ? pq->p.n_head : 1;
    if (head && n % (size_t)nh)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: n=%zu rows is not a multiple of n_head=%d (head granularity)", fn,
                         n, nh);

    const int kpad = kvpq__nn_kpad(ksub);
    float *ws = malloc(sizeof(float) * (size_t)nbooks * kpad * (dsub + 1));
    kvpq_nn_book *books = malloc(sizeof *books * (size_t)nbooks);
    if (!ws || !books) {
        free(ws);
        free(books);
        return kvpq__err(KVPQ_ERR_NOMEM, "%s: out of memory for the prepared codebook", fn);
    }
    for (int b = 0; b < nbooks; b++) {
        float *ct = ws + (size_t)b * kpad * (dsub + 1);
        kvpq__nn_book_init(&books[b], dsub, ksub, kvpq__pq_book(pq, b), ct, ct + (size_t)kpad * dsub);
    }
    const kvpq_nn_fn nn = kvpq__cpu_kernels()->nn;
    const size_t rows_per_block = M >= ENC_BLOCK_SUBVECS ? 1 : ENC_BLOCK_SUBVECS / (size_t)M;
    const size_t nblocks = (n + rows_per_block - 1) / rows_per_block;
    const size_t cs = pq->code_size;
    int nomem = 0;

#pragma omp parallel num_threads(nt) if (par) reduction(| : nomem)
    {
        int32_t *buf = malloc(sizeof(int32_t) * rows_per_block * (size_t)M);
        if (!buf) nomem = 1;
#pragma omp for schedule(dynamic, 1)
        for (size_t blk = 0; blk < nblocks; blk++) {
            if (!buf) continue;
            size_t r0 = blk * rows_per_block, r1 = r0 + rows_per_block < n ? r0 + rows_per_block : n;
            const float *xb = x + r0 * (size_t)d;
            if (head) {
                /* HEAD: row r is head r % n_head; its M sub-vectors use that head's book */
                for (size_t r = r0; r < r1; r++)
                    nn(&books[r % (size_t)nh], (size_t)M, x + r * (size_t)d, (size_t)dsub, buf + (r - r0) * M, 1);
            } else if (nbooks == 1) {
                /* SHARED: the block is (rows * M, dsub) contiguous sub-vectors, one codebook */
                nn(&books[0], (r1 - r0) * (size_t)M, xb, (size_t)dsub, buf, 1);
            } else {
                for (int m = 0; m < M; m++) nn(&books[m], r1 - r0, xb + (size_t)m * dsub, (size_t)d, buf + m, (size_t)M);
            }
            if (codes) {
                for (size_t r = r0; r < r1; r++) kvpq__pack_row(M, pq->p.nbits, buf + (r - r0) * M, codes + r * cs);
            } else {
                uint16_t *o = idx16 + r0 * (size_t)M;
                for (size_t t = 0; t < (r1 - r0) * (size_t)M; t++) o[t] = (uint16_t)buf[t];
            }
        }
        free(buf);
    }
    free(ws);
    free(books);
    if (nomem) return kvpq__err(KVPQ_ERR_NOMEM, "%s: out of memory for a thread's index block", fn);
    return KVPQ_OK;
}

kvpq_status kvpq_pq_encode(const kvpq_pq *pq, size_t n, const float *x, uint8_t *codes) {
    if (n && !codes) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_encode: codes is NULL");
    return kvpq__pq_encode_nt(pq, n, x, codes, NULL, 0);
}

kvpq_status kvpq_pq_assign(const kvpq_pq *pq, size_t n, const float *x, uint16_t *idx) {
    if (n && !idx) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_assign: idx is NULL");
    return kvpq__pq_encode_nt(pq, n, x, NULL, idx, 0);
}

kvpq_status kvpq__pq_decode_nt(const kvpq_pq *pq, size_t n, const uint8_t *codes, float *x, int n_threads) {
    if (!pq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_decode: pq is NULL");
    if (n == 0) return KVPQ_OK;
    if (!codes || !x) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_decode: NULL array (n=%zu)", n);
    const int d = pq->p.d, M = pq->p.M, dsub = pq->dsub, nbits = pq->p.nbits;
    const size_t cs = pq->code_size;
    const int head = pq->p.granularity == KVPQ_CODEBOOK_HEAD;
    if (head && n % (size_t)pq->p.n_head)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_pq_decode: n=%zu rows is not a multiple of n_head=%d (head "
                         "granularity)", n, pq->p.n_head);
    const int nt = resolve_threads(n_threads);
    const int par = nt > 1 && (double)n * d >= PAR_MIN_WORK;
#pragma omp parallel for num_threads(nt) if (par) schedule(static)
    for (size_t i = 0; i < n; i++) {
        const uint8_t *row = codes + i * cs;
        float *xi = x + i * (size_t)d;
        const float *hb = head ? kvpq__pq_head_book(pq, (int)(i % (size_t)pq->p.n_head)) : NULL;
        for (int m = 0; m < M; m++) {
            uint32_t c = nbits == 8 ? row[m] : kvpq__code_get(row, cs, m, nbits);
            memcpy(xi + (size_t)m * dsub, (head ? hb : kvpq__pq_book(pq, m)) + (size_t)c * dsub,
                   sizeof(float) * (size_t)dsub);
        }
    }
    return KVPQ_OK;
}

kvpq_status kvpq_pq_decode(const kvpq_pq *pq, size_t n, const uint8_t *codes, float *x) {
    return kvpq__pq_decode_nt(pq, n, codes, x, 0);
}
