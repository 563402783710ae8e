/* encode.cu — fused PQ encode on the GPU: smoothing (x / lambda), normalized Hadamard rotation,
 * nearest-centroid search (argmin ||c||^2 - 2 x.c, ties to the lowest index) and bit packing in one
 * kernel. The codebook and its norms are staged through shared memory in chunks; the transformed
 * rows live in shared memory only; the only device-memory write is the packed codes. */
#include <math.h>
#include <stdlib.h>

#include "common.cuh"

namespace {

constexpr int kThreads = 256;

struct EncodeParams {
    const float *x;           /* (n_rows, D), n_rows = n_tokens * n_head_kv */
    long long n_rows;
    int n_head_kv;
    const float *mean;        /* (n_head_kv, D) subtracted first, or NULL */
    const float *inv_lambda;  /* (n_head_kv, D) or NULL */
    int rotate;
    const float *centroids;   /* (n_books, ksub, dsub) */
    const float *norms;       /* (n_books, ksub) */
    int ksub, n_books, nbits, code_size;
    kvpq__code_dst dst;
    int *flag;                /* set to 1 on a non-finite input */
};

/* One CTA encodes a tile of T = 4096 / D rows: T * M = 4096 / DSUB sub-vectors, R = 16 / DSUB per
 * thread, all of one sub-space index m = tid % M (since kThreads % M == 0), so a thread reads one
 * codebook even when each sub-space has its own. */
template <int D, int DSUB>
__global__ void __launch_bounds__(kThreads) encode_kernel(EncodeParams p) {
    constexpr int M = D / DSUB, T = 4096 / D, R = 16 / DSUB, EPL = D / 32;
    constexpr int CHUNK = DSUB == 1 ? 2048 : 4096;  /* codebook floats staged per chunk */
    static_assert(T * M == kThreads * R, "tile shape");
    static_assert(kThreads % M == 0, "one sub-space per thread");
    __shared__ __align__(16) float xs[T * D];            /* transformed rows, times -2 */
    __shared__ __align__(16) float cbs[CHUNK + 4];        /* codebook chunk(s), padded per book */
    __shared__ float nms[CHUNK / DSUB];                   /* their norms */
    __shared__ uint16_t idxs[T * M];                      /* chosen codes */

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long row0 = (long long)blockIdx.x * T;

    /* ---- phase 1: load, smooth, rotate (a warp per row) ---- */
    for (int r = warp; r < T; r += kThreads / 32) {
        long long gr = row0 + r;
        float v[EPL];
        if (gr < p.n_rows) {
            const float *src = p.x + gr * D + lane * EPL;
            if constexpr (EPL % 4 == 0) {
#pragma unroll
                for (int j = 0; j < EPL; j += 4) {
                    float4 t = *reinterpret_cast<const float4 *>(src + j);
                    v[j] = t.x; v[j + 1] = t.y; v[j + 2] = t.z; v[j + 3] = t.w;
                }
            } else {
#pragma unroll
                for (int j = 0; j < EPL; j += 2) {
                    float2 t = *reinterpret_cast<const float2 *>(src + j);
                    v[j] = t.x; v[j + 1] = t.y;
                }
            }
            bool bad = false;
#pragma unroll
            for (int j = 0; j < EPL; j++) bad |= !isfinite(v[j]);
            if (__any_sync(KVPQ_FULL_MASK, bad) && lane == 0) atomicOr(p.flag, 1);
            if (p.mean) {
                const float *mu = p.mean + (size_t)(gr % p.n_head_kv) * D + lane * EPL;
#pragma unroll
                for (int j = 0; j < EPL; j++) v[j] -= mu[j];
            }
            if (p.inv_lambda) {
                const float *il = p.inv_lambda + (size_t)(gr % p.n_head_kv) * D + lane * EPL;
#pragma unroll
                for (int j = 0; j < EPL; j++) v[j] *= il[j];
            }
            if (p.rotate) kvpq__warp_fwht<EPL>(v, lane);
        } else {
#pragma unroll
            for (int j = 0; j < EPL; j++) v[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < EPL; j++) xs[r * D + lane * EPL + j] = -2.f * v[j];
    }
    __syncthreads();

    /* ---- phase 2: nearest centroid ---- */
    float xr[R][DSUB], best[R];
    int bi[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int s = tid + r * kThreads;
#pragma unroll
        for (int j = 0; j < DSUB; j++) xr[r][j] = xs[s * DSUB + j];  /* s = row * M + m */
        best[r] = INFINITY;
        bi[r] = 0;
    }
    const int nb = p.n_books;
    constexpr int PAD = DSUB >= 4 ? 4 : DSUB;                     /* keeps float4 alignment */
    const int ch = nb == 1 ? CHUNK / DSUB : (CHUNK / nb - PAD) / DSUB; /* centroids per chunk */
    const int stride = nb == 1 ? CHUNK : ch * DSUB + PAD;           /* floats per staged book */
    const int book = nb == 1 ? 0 : tid % M;
    for (int c0 = 0; c0 < p.ksub; c0 += ch) {
        const int chn = min(ch, p.ksub - c0);
        __syncthreads();
        for (int i = tid; i < nb * chn * DSUB; i += kThreads) {
            int b = i / (chn * DSUB), rem = i - b * chn * DSUB;
            cbs[b * stride + rem] = p.centroids[((size_t)b * p.ksub + c0) * DSUB + rem];
        }
        for (int i = tid; i < nb * chn; i += kThreads) {
            int b = i / chn, rem = i - b * chn;
            nms[b * ch + rem] = p.norms[(size_t)b * p.ksub + c0 + rem];
        }
        __syncthreads();
        const float *cb = cbs + book * stride;
        const float *nr = nms + book * ch;
#pragma unroll 4
        for (int c = 0; c < chn; c++) {
            float cv[DSUB];
            if constexpr (DSUB % 4 == 0) {
#pragma unroll
                for (int j = 0; j < DSUB; j += 4) {
                    float4 t = *reinterpret_cast<const float4 *>(cb + c * DSUB + j);
                    cv[j] = t.x; cv[j + 1] = t.y; cv[j + 2] = t.z; cv[j + 3] = t.w;
                }
            } else {
#pragma unroll
                for (int j = 0; j < DSUB; j++) cv[j] = cb[c * DSUB + j];
            }
            const float nrm = nr[c];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float d = nrm;
#pragma unroll
                for (int j = 0; j < DSUB; j++) d = fmaf(xr[r][j], cv[j], d);
                if (d < best[r]) {
                    best[r] = d;
                    bi[r] = c0 + c;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) idxs[tid + r * kThreads] = (uint16_t)bi[r];
    __syncthreads();

    /* ---- phase 3: pack, a byte per thread and step ---- */
    const int cs = p.code_size, nbits = p.nbits;
    for (int b = tid; b < T * cs; b += kThreads) {
        int r = b / cs, j = b - r * cs;
        long long gr = row0 + r;
        if (gr >= p.n_rows) continue;
        int m0 = (8 * j) / nbits, m1 = min((8 * j + 7) / nbits, M - 1);
        unsigned v = 0;
        for (int m = m0; m <= m1; m++) {
            unsigned code = idxs[r * M + m];
            int sh = m * nbits - 8 * j;
            v |= sh >= 0 ? code << sh : code >> -sh;
        }
        long long t = gr / p.n_head_kv;
        int h = (int)(gr - t * p.n_head_kv);
        uint8_t *dst;
        if (p.dst.page_table) {
            long long pos = p.dst.pos0 + t;
            int page = p.dst.page_table[pos / p.dst.page_tokens];
            dst = p.dst.out + page * p.dst.page_stride + h * p.dst.head_stride +
                  (pos % p.dst.page_tokens) * cs;
        } else {
            dst = p.dst.out + gr * cs;
        }
        dst[j] = (uint8_t)(v & 0xffu);
    }
}

template <int D, int DSUB>
kvpq_status launch(const EncodeParams &p, cudaStream_t stream) {
    constexpr int T = 4096 / D;
    long long blocks = (p.n_rows + T - 1) / T;
    if (blocks > 0x7fffffffLL) return kvpq__err(KVPQ_ERR_CAPACITY, "cuda encode: %lld rows is too many", p.n_rows);
    encode_kernel<D, DSUB><<<(unsigned)blocks, kThreads, 0, stream>>>(p);
    return kvpq__cuda_err(cudaGetLastError(), "cuda encode kernel launch");
}

template <int D>
kvpq_status launch_d(const EncodeParams &p, int dsub, cudaStream_t stream) {
    switch (dsub) {
    case 1: return launch<D, 1>(p, stream);
    case 2: return launch<D, 2>(p, stream);
    case 4: return launch<D, 4>(p, stream);
    case 8: return launch<D, 8>(p, stream);
    case 16: return launch<D, 16>(p, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda encode: dsub=%d: expected 1, 2, 4, 8 or 16", dsub);
}

} // namespace

kvpq_status kvpq__cuda_encode_launch(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, kvpq__code_dst dst,
                                     cudaStream_t stream) {
    if (n_tokens == 0) return KVPQ_OK;
    EncodeParams p;
    p.x = x;
    p.n_rows = (long long)n_tokens * q->n_head_kv;
    p.n_head_kv = q->n_head_kv;
    p.mean = q->mean;
    p.inv_lambda = q->inv_lambda;
    p.rotate = q->rotate;
    p.centroids = q->centroids;
    p.norms = q->norms;
    p.ksub = q->ksub;
    p.n_books = q->n_books;
    p.nbits = q->p.nbits;
    p.code_size = q->code_size;
    p.dst = dst;
    p.flag = q->flag;
    switch (q->p.d) {
    case 64: return launch_d<64>(p, q->dsub, stream);
    case 128: return launch_d<128>(p, q->dsub, stream);
    case 256: return launch_d<256>(p, q->dsub, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda encode: d=%d: expected 64, 128 or 256", q->p.d);
}

// ---- device quantizer object ----------------------------------------------------------------------

extern "C" KVPQ_API void kvpq_cuda_pq_free(kvpq_cuda_pq *q) {
    if (!q) return;
    cudaFree(q->centroids);
    cudaFree(q->norms);
    cudaFree(q->inv_lambda);
    cudaFree(q->lambda);
    cudaFree(q->flag);
    free(q);
}

kvpq_status kvpq__cuda_pq_upload(kvpq_cuda_pq **out, const kvpq_pq *pq, int n_head_kv, const float *lambda,
                                 int rotate) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: out is NULL");
    *out = NULL;
    if (!pq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: pq is NULL");
    if (n_head_kv <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: n_head_kv=%d must be > 0", n_head_kv);
    int d = pq->p.d;
    if (d != 64 && d != 128 && d != 256)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_pq_new: d=%d: the CUDA kernels handle 64, 128 or 256", d);
    size_t nl = (size_t)n_head_kv * d;
    if (lambda) {
        for (size_t i = 0; i < nl; i++)
            if (!(lambda[i] > 0.f) || !isfinite(lambda[i]))
                return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: lambda[%zu]=%g must be finite and > 0", i,
                                 (double)lambda[i]);
    }
    KVPQ_TRY(kvpq__cuda_require("kvpq_cuda_pq_new"));
    kvpq_cuda_pq *q = (kvpq_cuda_pq *)calloc(1, sizeof *q);
    if (!q) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_pq_new: out of memory");
    q->p = pq->p;
    q->dsub = pq->dsub;
    q->ksub = pq->ksub;
    q->n_books = pq->n_books;
    q->code_size = (int)pq->code_size;
    q->n_head_kv = n_head_kv;
    q->rotate = rotate != 0;
    size_t nc = (size_t)pq->n_books * pq->ksub * pq->dsub, nn = (size_t)pq->n_books * pq->ksub;
    kvpq_status s = KVPQ_OK;
    float *il = NULL;
#define KVPQ_STEP(call, what)                                 \
    do {                                                      \
        if (s == KVPQ_OK) s = kvpq__cuda_err((call), (what)); \
    } while (0)
    KVPQ_STEP(cudaMalloc((void **)&q->centroids, nc * sizeof(float)), "kvpq_cuda_pq_new: cudaMalloc centroids");
    KVPQ_STEP(cudaMalloc((void **)&q->norms, nn * sizeof(float)), "kvpq_cuda_pq_new: cudaMalloc norms");
    KVPQ_STEP(cudaMalloc((void **)&q->flag, sizeof(int)), "kvpq_cuda_pq_new: cudaMalloc flag");
    KVPQ_STEP(cudaMemcpy(q->centroids, pq->centroids, nc * sizeof(float), cudaMemcpyHostToDevice),
              "kvpq_cuda_pq_new: copy centroids");
    KVPQ_STEP(cudaMemcpy(q->norms, pq->norms, nn * sizeof(float), cudaMemcpyHostToDevice), "kvpq_cuda_pq_new: copy norms");
    KVPQ_STEP(cudaMemset(q->flag, 0, sizeof(int)), "kvpq_cuda_pq_new: clear flag");
    if (lambda && s == KVPQ_OK) {
        il = (float *)malloc(nl * sizeof(float));
        if (!il) s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_pq_new: out of memory");
        for (size_t i = 0; il && i < nl; i++) il[i] = 1.f / lambda[i];
        KVPQ_STEP(cudaMalloc((void **)&q->inv_lambda, nl * sizeof(float)), "kvpq_cuda_pq_new: cudaMalloc lambda");
        KVPQ_STEP(cudaMalloc((void **)&q->lambda, nl * sizeof(float)), "kvpq_cuda_pq_new: cudaMalloc lambda");
        KVPQ_STEP(cudaMemcpy(q->inv_lambda, il, nl * sizeof(float), cudaMemcpyHostToDevice), "kvpq_cuda_pq_new: copy lambda");
        KVPQ_STEP(cudaMemcpy(q->lambda, lambda, nl * sizeof(float), cudaMemcpyHostToDevice), "kvpq_cuda_pq_new: copy lambda");
    }
#undef KVPQ_STEP
    free(il);
    if (s != KVPQ_OK) {
        kvpq_cuda_pq_free(q);
        return s;
    }
    *out = q;
    return KVPQ_OK;
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_pq_new(kvpq_cuda_pq **out, const kvpq_pq *pq, int n_head_kv,
                                                 const float *lambda, int rotate) {
    return kvpq__cuda_pq_upload(out, pq, n_head_kv, lambda, rotate);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_pq_encode(const kvpq_cuda_pq *q, size_t n_tokens, const float *x,
                                                    uint8_t *codes) {
    if (!q || (n_tokens && (!x || !codes)))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_encode: NULL argument");
    if (n_tokens == 0) return KVPQ_OK;
    kvpq__code_dst dst = {codes, NULL, 0, 1, 0, 0};
    KVPQ_CUDA_TRY(cudaMemsetAsync(q->flag, 0, sizeof(int), 0), "kvpq_cuda_pq_encode: clear flag");
    KVPQ_TRY(kvpq__cuda_encode_launch(q, n_tokens, x, dst, 0));
    int flag = 0;
    KVPQ_CUDA_TRY(cudaMemcpy(&flag, q->flag, sizeof(int), cudaMemcpyDeviceToHost), "kvpq_cuda_pq_encode: kernel");
    if (flag) return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_cuda_pq_encode: x holds NaN or Inf");
    return KVPQ_OK;
}
