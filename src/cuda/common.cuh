/* common.cuh — shared pieces of the CUDA backend: error translation, the device quantizer layout,
 * warp-level Hadamard transform and code (un)packing. Internal; only src/cuda/*.cu include it. */
#ifndef KVPQ_CUDA_COMMON_CUH
#define KVPQ_CUDA_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "internal.h"
#include "pq/pq_impl.h"
}

#define KVPQ_FULL_MASK 0xffffffffu

/* CUDA error -> KVPQ_ERR_DEVICE with CUDA's string; never aborts. `what` names the call site. */
static inline kvpq_status kvpq__cuda_err(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return KVPQ_OK;
    if (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver)
        return kvpq__err(KVPQ_ERR_NO_DEVICE, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
    return kvpq__err(KVPQ_ERR_DEVICE, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}
#define KVPQ_CUDA_TRY(call, what) KVPQ_TRY(kvpq__cuda_err((call), (what)))

extern "C" int kvpq__cuda_available(char *why, size_t n);
/* Device properties of the current device, cached (multiprocessors, opt-in shared memory). */
kvpq_status kvpq__cuda_props(int *n_sm, size_t *smem_optin);
/* KVPQ_OK if a device is usable, else KVPQ_ERR_NO_DEVICE naming why (for `what`). */
kvpq_status kvpq__cuda_require(const char *what);

/* The device quantizer (kvpq_cuda_pq). */
struct kvpq_cuda_pq {
    kvpq_pq_params p;
    int dsub, ksub, n_books, code_size;
    int n_head_kv, rotate;
    float *centroids;  /* device (n_books, ksub, dsub) */
    float *norms;      /* device (n_books, ksub) */
    float *inv_lambda; /* device (n_head_kv, d) 1/lambda, or NULL */
    float *lambda;     /* device (n_head_kv, d), or NULL */
    const float *mean; /* device (n_head_kv, d) subtracted before smoothing, or NULL (not owned: the
                          cache sets it to its key mean) */
    int *flag;         /* device (1): set to 1 by the encode kernel on a non-finite input */
    uint2 *frag;       /* device (ksub / 8, k-steps, 32): the codebook as tensor-core B fragments for the
                          encode search (shared codebook, nbits 3..8, dsub 1/2/4/8), or NULL */
    int frag_lt;       /* the fragments hold t * c, t = 2^frag_lt */
    int search;        /* encode search variant (kvpq_cuda_kernels.encode_search; encode.cu) */
    int dbg;           /* timing knob of the grouped search, benchmarks only (0 in use; encode.cu) */
};

/* Where encode writes the codes of row (token t, head h): either contiguous
 * (page_table NULL: out + (t*n_head_kv + h)*code_size) or paged (page p = page_table[(pos0+t) /
 * page_tokens], out + p*page_stride + h*head_stride + ((pos0+t) % page_tokens)*code_size). */
typedef struct {
    uint8_t *out;
    const int *page_table;
    int pos0, page_tokens;
    long long page_stride, head_stride;
} kvpq__code_dst;

/* Launch the fused encode kernel on `stream` (no synchronization, no flag check). */
kvpq_status kvpq__cuda_encode_launch(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, kvpq__code_dst dst,
                                     cudaStream_t stream);
/* Launch the decode kernel (contiguous codes). */
kvpq_status kvpq__cuda_decode_launch(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes, float *x,
                                     cudaStream_t stream);
/* Where decode reads paged codes: one sequence's page table (device), positions from pos0, pages of
 * (n_head_kv, page_tokens) code rows; float16 scales laid out like the code rows (or NULL); a
 * (n_head_kv, d) vector added to every decoded row (or NULL). */
typedef struct {
    const int *page_table;
    int page_tokens, pos0;
    const uint16_t *scales;
    const float *mean;
} kvpq__code_src;
/* Launch the decode kernel on n_tokens positions of a paged cache: x (n_tokens, n_head_kv, d). */
kvpq_status kvpq__cuda_decode_paged_launch(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *pages,
                                           const kvpq__code_src *src, float *x, cudaStream_t stream);
/* Norm-explicit encode of n_tokens rows of x (n_tokens, n_head_kv, d) float32 (Dai et al., AAAI
 * 2020, as the CPU VQ cache, src/cache/cache_vq.c vq_encode): each row is transformed as the fused
 * encode does (x' = H((x - mu) / lambda), the quantizer's transforms), divided by its norm
 * (kvpq_normalize_rows' arithmetic), the direction u is coded into dst by the fused kernel, and the
 * float16 scale s = |x'| (u . r) / |r|^2 (r = the centroids of u's codes; 0 when x' or r is 0) of
 * row (token t, head h) is written to scales[page][h][pos % page_tokens] (dst's page table; page
 * stride n_head_kv * page_tokens). work_x: device (work_rows, d) floats, work_n: device (work_rows)
 * floats; the rows go through in chunks of work_rows (>= n_head_kv). A scale beyond float16's range
 * is not written: bad (device, 1) gets the minimum of (row << 32 | float bits of the scale) over such
 * rows (initialize it to ~0); smax (device, 1) gets the maximum of the float bits of |s| (>= 0, so
 * they order as integers). Non-finite input sets q->flag. No synchronization. */
kvpq_status kvpq__cuda_encode_ne_launch(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, kvpq__code_dst dst,
                                        uint16_t *scales, float *work_x, float *work_n, size_t work_rows,
                                        unsigned long long *bad, unsigned *smax, cudaStream_t stream);
/* Copy a host quantizer to the device (p->kernels checked by the caller). */
kvpq_status kvpq__cuda_pq_upload(kvpq_cuda_pq **out, const kvpq_pq *pq, const kvpq_cuda_pq_params *p);


/* Decode attention from codes over paged caches (attend.cu). Pages: key codes
 * (n_pages, n_head_kv, page_tokens, k_code_size) bytes, value codes likewise; window rings:
 * (n_seq, window, n_head_kv, head_dim) float32 in the original space, position t at slot t % window. */
typedef struct {
    const float *q;            /* (B, n_head, D) */
    float *out;                /* (B, n_head, D) */
    float *lse;                /* (B, n_head) or NULL: each row's natural log-sum-exp of its scaled
                                  scores, m ln 2 + ln d of the merged state (the scores omit q . mu
                                  with key centering: the caller adds it; not so for keys before
                                  RoPE, rope.cu, whose scores are whole) */
    float *part_o;             /* (B, n_head, n_splits + n_wsplits, D) workspace */
    float *part_md;            /* (B, n_head, n_splits + n_wsplits, 2) workspace: {m (log2 domain), d} */
    const int *seq_len;        /* device (B) positions held */
    const int *page_table;     /* device (B, max_pages) */
    int max_pages, page_tokens, window;
    int page_shift;            /* log2(page_tokens) when a power of two, else -1 */
    const uint8_t *k_pages, *v_pages;
    int k_code_size, v_code_size;
    const float *k_win, *v_win;
    const float *k_centroids;  /* (k_books, k_ksub, k_dsub) */
    int k_ksub, k_books, k_nbits, k_dsub;
    const float *v_centroids;
    int v_ksub, v_books, v_nbits, v_dsub;
    const float *k_lambda;     /* (n_head_kv, D) or NULL */
    int v_rotate;
    int head_dim, n_head, n_head_kv;
    int n_splits, chunk;       /* filled by the launcher: code splits and their positions */
    int n_wsplits;             /* filled by the launcher: window splits (32 positions each) */
    const void *tc_image;      /* tensor-core path: codebook image (256 x 256 bytes; attend.cu), or NULL */
    int tc_kexp, tc_vexp;      /* the image holds key centroids * 2^tc_kexp, value centroids * 2^tc_vexp */
    /* Norm-explicit quantizers (kvpq_codebook_params.key_norm / value_norm): float16 scale s of each
     * (page, KV head, position), (n_pages, n_head_kv, page_tokens) like the code pages, or NULL for a
     * plain quantizer. A coded key's score is s_k * sum_m LUT; a coded value's softmax weight p enters
     * the value sum as p * s_v (the denominator keeps p). */
    const uint16_t *k_scales, *v_scales;
    int tc_sexp;               /* tensor-core path, value scales: max |s_v| <= 2^tc_sexp (0 without) */
    float tc_pscale;           /* tensor-core path: P enters the value mma as p * s_v * tc_pscale,
                                  tc_pscale = 2^(14 - tc_sexp) (2^14 without value scales) */
    int *counters;             /* device (B, n_head) zeros: CTAs done per (sequence, head group); the last
                                  one merges the splits and sets it back to 0 */
    /* Kernel variant (kvpq_cuda_kernels, kvpq.h): tc 1 = the tensor-core kernel where tc_image is
     * set; tc_warps 8 / 16 / 0 (chosen per launch, launch_tc); LUT kernel: lut16 = float16 entries
     * summed in float32, vrep = the value codebook as 8 bank-private replicas in shared memory
     * (conflict-free gathers) where it fits, pvec = for whole-byte value codes the value loop loads
     * a position's GS probabilities as 16/8-byte vectors and hoists its address arithmetic. */
    int tc, tc_warps, lut16, vrep, pvec;
    int pdl;                   /* tensor-core kernel: programmatic dependent launch (kernels.attend_pdl)
                                  when the launcher is given a stream other than NULL */
    int cluster;               /* tensor-core kernel: split merge through a thread-block cluster where
                                  it pays (kernels.attend_cluster; launch_tc_nw) */
    int tc_regs;               /* tensor-core kernel: code rows straight into registers, one tile ahead
                                  (kernels.attend_tc_regs) instead of the cp.async ring */
    int tc_heads;              /* tensor-core kernel: at most this many query heads per CTA (0: up to 8;
                                  kernels.attend_tc_heads; tc_gs) */
    /* Keys coded before RoPE (rope.cu; kvpq_cuda_cache_params.key_rope_*): rope_freq device
     * (rope_dims / 2) inv_freq, or NULL for the other kernels; position t of the cache turns by
     * rope_pos0 + t. That kernel scores whole keys: k_mean device (n_head_kv, D) or NULL is added to
     * each decoded key and window row, so its lse needs no q . mu. */
    const float *rope_freq;
    int rope_dims, rope_neox, rope_pos0;
    const float *k_mean;
} kvpq__attend_params;

/* The tensor-core attention's codebook image of a key and a value quantizer, or *image = NULL when
 * the pair does not qualify (attend.cu): 256 centroids x (16 key replicas, 16 value replicas) of 4
 * float16, each codebook scaled by a power of two to float16's top (the exponents come back). */
kvpq_status kvpq__cuda_tc_image(const kvpq_pq *key, const kvpq_pq *value, void **image, int *kexp, int *vexp);

/* Plan splits for the longest code region `max_coded` over B sequences and launch the attention
 * kernel (splits merged in the same launch) on `stream`. max_splits bounds n_splits (workspace size). */
kvpq_status kvpq__cuda_attend_launch(kvpq__attend_params *p, int B, int max_coded, int max_splits,
                                     cudaStream_t stream);
/* The attention of a layer coding keys before RoPE (rope.cu): every position [0, seq_len) scored
 * from its decoded, rotated key (or the float32 window), splits merged by a second kernel; max_len
 * the longest sequence, max_splits bounds the splits (workspace). */
kvpq_status kvpq__cuda_attend_rope_launch(kvpq__attend_params *p, int B, int max_len, int max_splits,
                                          cudaStream_t stream);
/* out = x (n_tokens, n_head_kv, head_dim) with the first n_rot channels of row (t, h) rotated by
 * sign * (pos0 + t) * freq (device, n_rot / 2), pairs as kvpq_rope_rotate's; in place allowed. */
kvpq_status kvpq__cuda_rope_launch(const float *x, float *out, long long n_tokens, int n_head_kv, int head_dim,
                                   int n_rot, int neox, const float *freq, int pos0, int sign, cudaStream_t stream);
/* Whether the configuration fits the device (shared memory); message names the shape if not. */
kvpq_status kvpq__cuda_attend_check(const kvpq__attend_params *p);

/* ---- device helpers ---------------------------------------------------------------------------- */

/* The 32 bits of a float16 pair (for mma fragments and PRMT). */
__device__ __forceinline__ uint32_t kvpq__h2_bits(__half2 h) { return *reinterpret_cast<uint32_t *>(&h); }

/* In-register normalized Walsh-Hadamard transform (Sylvester order, scale 1/sqrt(32*EPL)) of one
 * vector held by a warp: lane l holds elements [l*EPL, (l+1)*EPL). Butterflies of stride < EPL stay
 * in a lane; larger strides exchange with lane l ^ (stride / EPL). */
template <int EPL>
__device__ __forceinline__ void kvpq__warp_fwht(float (&x)[EPL], int lane) {
#pragma unroll
    for (int s = 1; s < EPL; s <<= 1) {
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            if (!(j & s)) {
                float a = x[j], b = x[j + s];
                x[j] = a + b;
                x[j + s] = a - b;
            }
        }
    }
#pragma unroll
    for (int ls = 1; ls < 32; ls <<= 1) {
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            float o = __shfl_xor_sync(KVPQ_FULL_MASK, x[j], ls);
            x[j] = (lane & ls) ? (o - x[j]) : (x[j] + o);
        }
    }
    const float sc = rsqrtf((float)(32 * EPL));
#pragma unroll
    for (int j = 0; j < EPL; j++) x[j] *= sc;
}

/* Code m of a packed little-endian bit stream `row` (code m in bits [m*nbits, (m+1)*nbits)). Reads
 * only bytes that hold bits of code m. */
__device__ __forceinline__ int kvpq__get_code(const uint8_t *row, int m, int nbits) {
    if (nbits == 8) return row[m];
    int bit = m * nbits, byte = bit >> 3, sh = bit & 7;
    unsigned v = row[byte];
    if (sh + nbits > 8) v |= (unsigned)row[byte + 1] << 8;
    if (sh + nbits > 16) v |= (unsigned)row[byte + 2] << 16;
    return (int)((v >> sh) & ((1u << nbits) - 1u));
}

#endif
