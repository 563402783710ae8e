/* decode.cu — PQ decode (gather) on the GPU, back to the original space: centroid lookup, inverse
 * Hadamard rotation (the normalized transform is its own inverse), times lambda. A warp per row.
 * Rows come either contiguous (kvpq_cuda_pq_decode) or from a paged cache's pages (one sequence's
 * page table; kvpq_cuda_cache_read), where a norm-explicit float16 scale and the key mean apply too. */
#include "common.cuh"

namespace {

struct DecodeParams {
    const uint8_t *codes;  /* (n_rows, code_size) */
    float *x;              /* (n_rows, D) */
    long long n_rows;
    int n_head_kv;
    const float *lambda;   /* (n_head_kv, D) or NULL */
    int rotate;
    const float *centroids;/* (n_books, ksub, dsub) */
    int ksub, n_books, nbits, code_size, dsub;
    /* paged rows (page_table not NULL): row r is position pos0 + r / n_head_kv, KV head r % n_head_kv,
     * at codes + (page * n_head_kv + head) * page_tokens + position % page_tokens code rows */
    const int *page_table; /* one sequence's (max_pages) page ids, or NULL: row r at codes + r * code_size */
    int page_tokens, pos0;
    const uint16_t *scales;/* paged: (n_pages, n_head_kv, page_tokens) float16 norm-explicit scales, or NULL */
    const float *mean;     /* (n_head_kv, D) added after decoding (the cache's key mean), or NULL */
};

/* Index of row gr's code row in p.codes, and its scale (1 without scales). */
__device__ __forceinline__ long long row_index(const DecodeParams &p, long long gr, float *scale) {
    *scale = 1.f;
    if (!p.page_table) return gr;
    const long long t = p.pos0 + gr / p.n_head_kv, h = gr % p.n_head_kv;
    const long long i = ((long long)p.page_table[t / p.page_tokens] * p.n_head_kv + h) * p.page_tokens + t % p.page_tokens;
    if (p.scales) *scale = __half2float(__ushort_as_half(p.scales[i]));
    return i;
}

template <int D>
__global__ void __launch_bounds__(256) decode_kernel(DecodeParams p) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const long long gr = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gr >= p.n_rows) return;  /* whole warps leave together: the shuffles below stay full */
    float scale;
    const uint8_t *row = p.codes + row_index(p, gr, &scale) * p.code_size;
    float v[EPL];
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        int e = lane * EPL + j, m = e / p.dsub;
        int code = kvpq__get_code(row, m, p.nbits);
        int book = p.n_books == 1 ? 0 : m;
        v[j] = p.centroids[((size_t)book * p.ksub + code) * p.dsub + (e - m * p.dsub)];
    }
    if (p.rotate) kvpq__warp_fwht<EPL>(v, lane);
    const size_t hoff = (size_t)(gr % p.n_head_kv) * D + lane * EPL;
#pragma unroll
    for (int j = 0; j < EPL; j++) v[j] *= (p.lambda ? p.lambda[hoff + j] : 1.f) * scale;
    if (p.mean) {
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] += p.mean[hoff + j];
    }
    float *dst = p.x + gr * D + lane * EPL;
#pragma unroll
    for (int j = 0; j < EPL; j++) dst[j] = v[j];
}

template <int D>
kvpq_status launch(const DecodeParams &p, cudaStream_t stream) {
    long long blocks = (p.n_rows + 7) / 8;
    if (blocks > 0x7fffffffLL) return kvpq__err(KVPQ_ERR_CAPACITY, "cuda decode: %lld rows is too many", p.n_rows);
    decode_kernel<D><<<(unsigned)blocks, 256, 0, stream>>>(p);
    return kvpq__cuda_err(cudaGetLastError(), "cuda decode kernel launch");
}

} // namespace

static kvpq_status decode_any(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes, float *x,
                              const kvpq__code_src *src, cudaStream_t stream) {
    if (n_tokens == 0) return KVPQ_OK;
    DecodeParams p;
    memset(&p, 0, sizeof p);
    if (src) {
        p.page_table = src->page_table;
        p.page_tokens = src->page_tokens;
        p.pos0 = src->pos0;
        p.scales = src->scales;
        p.mean = src->mean;
    }
    p.codes = codes;
    p.x = x;
    p.n_rows = (long long)n_tokens * q->n_head_kv;
    p.n_head_kv = q->n_head_kv;
    p.lambda = q->lambda;
    p.rotate = q->rotate;
    p.centroids = q->centroids;
    p.ksub = q->ksub;
    p.n_books = q->n_books;
    p.nbits = q->p.nbits;
    p.code_size = q->code_size;
    p.dsub = q->dsub;
    switch (q->p.d) {
    case 64: return launch<64>(p, stream);
    case 128: return launch<128>(p, stream);
    case 256: return launch<256>(p, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda decode: d=%d: expected 64, 128 or 256", q->p.d);
}

kvpq_status kvpq__cuda_decode_launch(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes, float *x,
                                     cudaStream_t stream) {
    return decode_any(q, n_tokens, codes, x, NULL, stream);
}

kvpq_status kvpq__cuda_decode_paged_launch(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *pages,
                                           const kvpq__code_src *src, float *x, cudaStream_t stream) {
    return decode_any(q, n_tokens, pages, x, src, stream);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_pq_decode(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes,
                                                    float *x) {
    if (!q || (n_tokens && (!x || !codes)))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_decode: NULL argument");
    if (n_tokens == 0) return KVPQ_OK;
    KVPQ_TRY(kvpq__cuda_decode_launch(q, n_tokens, codes, x, 0));
    return kvpq__cuda_err(cudaDeviceSynchronize(), "kvpq_cuda_pq_decode: kernel");
}
