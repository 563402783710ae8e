/* encode.cu — fused PQ encode on the GPU: smoothing (x / lambda), normalized Hadamard rotation,
 * nearest-centroid search (argmin ||x - c||^2, ties to the lowest index) and bit packing in one
 * kernel. The search runs on tensor cores (mma.m16n8k16, float16 hi/lo splits, float32 accumulate)
 * for a shared codebook with nbits 3..8 and dsub 1/2/4/8, with its fragments staged in shared
 * memory; otherwise (and as the fallback of a tile out of the tensor-core path's range) exactly in
 * float32 on the CUDA cores, the codebook and its norms staged through shared memory in chunks. The
 * transformed rows live in shared memory only; the only device-memory write is the packed codes. */
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <math.h>
#include <stdlib.h>

#include "common.cuh"

/* Encode kernel variants (kvpq_cuda_kernels.encode_search, kept in kvpq_cuda_pq.search), all kept
 * so that gpu_check checks and the bench times each side by side (docs/BENCHMARKS.md):
 *   5 (default since session 11) variant 3 with each A-fragment register loaded straight from the
 *     sub-vector's record by a per-lane word index (rec_word_table) instead of selected per quad
 *     position: same keys, same codes, fewer instructions per mma;
 *   3 (the default before session 11) tensor cores, grouped argmin + exact re-rank (search_mma2), no
 *     accumulator input, bank-conflict-free re-rank, rows prefetched; 4 row tiles, 3 CTAs per SM;
 *   4 variant 3 with 2 row tiles, 4 CTAs per SM;
 *   2 search_mma2 with the accumulator input, plain re-rank; 2 row tiles, 4 CTAs per SM;
 *   1 tensor cores with a per-key argmin (search_mma, the previous kernel);
 *   0 float32 on the CUDA cores.
 * 2-5 apply to dsub 2 and 4 (dsub 1 and 8 take 1); quantizers without tensor-core fragments take
 * the float32 search whatever the value. kvpq_cuda_pq.dbg, the timing knob of the grouped search
 * (benchmarks only; 0 in use): bits 1 no search loop, 2 no re-rank, 4 no search at all (codes 0). */

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
    const uint2 *frag;        /* (ksub / 8, KS, 32) tensor-core B fragments of the codebook, or NULL */
    int frag_lt;              /* codebook scale t = 2^frag_lt */
    kvpq__code_dst dst;
    int *flag;                /* set to 1 on a non-finite input */
    int dbg;                  /* kvpq_cuda_pq.dbg */
};

/* Tensor-core search: k-steps of 16 for dsub (3 dsub + 2 terms: x_hi c_hi, x_lo c_hi, x_hi c_lo,
 * ||c||^2 hi and lo). */
template <int DSUB> __host__ __device__ constexpr int mma_ksteps() { return (3 * DSUB + 2 + 15) / 16; }

/* ---- phase 1: load, (subtract the mean,) smooth, rotate; a warp per row; xs = (T, D) ----
 * PREFETCH: each warp first issues the loads of all its T / 8 rows, then transforms them (one
 * device-memory round trip per warp instead of one per row; the grouped variants 6 and 7). */
template <int D>
__device__ __forceinline__ void load_row_regs(const EncodeParams &p, long long gr, int lane, float (&v)[D / 32]) {
    constexpr int EPL = D / 32;
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
    } else {
#pragma unroll
        for (int j = 0; j < EPL; j++) v[j] = 0.f;
    }
}

/* In registers: flag a non-finite row, subtract the mean, smooth, rotate (row gr < n_rows). */
template <int D>
__device__ __forceinline__ void transform_regs(const EncodeParams &p, long long gr, int lane, float (&v)[D / 32]) {
    constexpr int EPL = D / 32;
    bool bad = false;
#pragma unroll
    for (int j = 0; j < EPL; j++) bad |= !isfinite(v[j]);
    if (__any_sync(KVPQ_FULL_MASK, bad) && lane == 0) atomicOr(p.flag, 1);
    if (p.mean) {
        const float *mu = p.mean + (size_t)(gr % p.n_head_kv) * D + lane * EPL;
#pragma unroll
        for (int j = 0; j < EPL; j += 2) {
            const float2 m2 = *reinterpret_cast<const float2 *>(mu + j);
            v[j] -= m2.x;
            v[j + 1] -= m2.y;
        }
    }
    if (p.inv_lambda) {
        const float *il = p.inv_lambda + (size_t)(gr % p.n_head_kv) * D + lane * EPL;
#pragma unroll
        for (int j = 0; j < EPL; j += 2) {
            const float2 l2 = *reinterpret_cast<const float2 *>(il + j);
            v[j] *= l2.x;
            v[j + 1] *= l2.y;
        }
    }
    if (p.rotate) kvpq__warp_fwht<EPL>(v, lane);
}

template <int D>
__device__ __forceinline__ void transform_row(const EncodeParams &p, long long gr, int lane, float (&v)[D / 32],
                                              float *xrow) {
    constexpr int EPL = D / 32;
    if (gr < p.n_rows) transform_regs<D>(p, gr, lane, v);
#pragma unroll
    for (int j = 0; j < EPL; j++) xrow[lane * EPL + j] = v[j];
}

template <int D, bool PREFETCH = false>
__device__ __forceinline__ void load_rows(const EncodeParams &p, long long row0, float *xs) {
    constexpr int T = 4096 / D, EPL = D / 32, RPW = T / (kThreads / 32);
    static_assert(T % (kThreads / 32) == 0, "rows per warp");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if constexpr (PREFETCH) {
        float v[RPW][EPL];
#pragma unroll
        for (int i = 0; i < RPW; i++) load_row_regs<D>(p, row0 + warp + i * (kThreads / 32), lane, v[i]);
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const int r = warp + i * (kThreads / 32);
            transform_row<D>(p, row0 + r, lane, v[i], xs + r * D);
        }
    } else {
        for (int r = warp; r < T; r += kThreads / 32) {
            float v[EPL];
            load_row_regs<D>(p, row0 + r, lane, v);
            transform_row<D>(p, row0 + r, lane, v, xs + r * D);
        }
    }
}

/* ---- phase 2, exact: argmin ||c||^2 - 2 x.c in float32 on the CUDA cores, ties to the lowest
 * index. The codebook and its norms are staged through shared memory (cbs, nms) in chunks. A thread
 * takes R = 16 / DSUB sub-vectors, all of one sub-space index m = tid % M (kThreads % M == 0), so a
 * thread reads one codebook even when each sub-space has its own. ---- */
template <int D, int DSUB>
__device__ __forceinline__ void search_fp32(const EncodeParams &p, const float *xs, float *cbs, float *nms,
                                            uint16_t *idxs) {
    constexpr int M = D / DSUB, T = 4096 / D, R = 16 / DSUB;
    constexpr int CHUNK = DSUB == 1 ? 2048 : 4096;  /* codebook floats staged per chunk */
    static_assert(T * M == kThreads * R, "tile shape");
    static_assert(kThreads % M == 0, "one sub-space per thread");
    const int tid = threadIdx.x;
    float xr[R][DSUB], best[R];
    int bi[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int s = tid + r * kThreads;
#pragma unroll
        for (int j = 0; j < DSUB; j++) xr[r][j] = -2.f * xs[s * DSUB + j];  /* s = row * M + m; exact */
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
}

/* ---- phase 2, tensor cores (shared codebook, ksub <= 256, dsub <= 8) ----
 *
 * Key of (sub-vector x, centroid c) = s t ||x - c||^2 expanded as
 *     (t/s) ||u||^2 + 2^-kNormShift (s/t) 2^kNormShift ||w||^2 - 2 u.w,   u = s x, w = t c,
 * with s, t powers of two that bring max|u| into [1, 2) and max|w| into [2^14, 2^15): the top of
 * float16's range, so that float16's fixed absolute floor (2^-24) is negligible against the
 * codebook's scale. One mma.m16n8k16 (float16 in, float32 accumulate) per 16 sub-vectors x 8
 * centroids (per k-step) computes the last two terms: u.w ~ uh.wh + ul.wh + uh.wl from hi/lo
 * float16 splits (about 22 mantissa bits; the dropped ul.wl is below 2^-22 relative), and the
 * norm as two more k-columns, A = 2^kNormShift s/t against B = hi/lo of 2^-kNormShift ||w||^2; the
 * first term enters as the float32 accumulator. The argmin is an integer min over keys whose low
 * LB = nbits - 2 bits are replaced by the centroid's (tile, column) number within the thread: keys
 * are >= 0 up to rounding, so their float bits order as integers, and dropping LB <= 6 bits
 * changes a key by at most 2^-17 relative, inside the near-tie band of the float32 search (ties
 * go to the lowest index as there). A sub-vector whose 2^kNormShift s/t would leave float16's
 * normal range (x more than 2^18 times larger or 2^11 times smaller than the codebook) makes the
 * whole tile take the exact float32 search. */
constexpr int kNormShift = 18;
constexpr int kCodebookTop = 14; /* max|w| in [2^14, 2^15) */

template <int DSUB>
struct SubA {
    __half h[DSUB], l[DSUB]; /* hi / lo float16 parts of -2u */
    __half st;               /* 2^kNormShift s / t */
    float nu;                /* (t/s) ||u||^2 */
};

/* Exponent e of s = 2^e for a sub-vector with max|x| = mx; *oor set when 2^kNormShift s/t is out of
 * [2^-14, 2^15]. */
__device__ __forceinline__ int sub_exp(float mx, int lt, bool *oor) {
    constexpr int lo = -14 - kNormShift, hi = 15 - kNormShift;
    if (!(mx > 0.f)) return lt - kNormShift; /* zero: any scale */
    int e = 127 - ((__float_as_int(mx) >> 23) & 0xff);
    if (e - lt < lo || e - lt > hi) *oor = true;
    return min(max(e, lt + lo), lt + hi);
}

template <int DSUB>
__device__ __forceinline__ void load_sub(const float *xv, float (&v)[DSUB]) {
    if constexpr (DSUB % 4 == 0) {
#pragma unroll
        for (int j = 0; j < DSUB; j += 4) {
            float4 t = *reinterpret_cast<const float4 *>(xv + j);
            v[j] = t.x; v[j + 1] = t.y; v[j + 2] = t.z; v[j + 3] = t.w;
        }
    } else if constexpr (DSUB == 2) {
        float2 t = *reinterpret_cast<const float2 *>(xv);
        v[0] = t.x; v[1] = t.y;
    } else {
        v[0] = xv[0];
    }
}

/* e_lo: a further floor on e - lt (the no-C variants' nu bound), or below any */
template <int DSUB>
__device__ __forceinline__ bool sub_out_of_range(const float *xv, int lt, int e_lo) {
    float v[DSUB];
    load_sub<DSUB>(xv, v);
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j++) mx = fmaxf(mx, fabsf(v[j]));
    bool oor = false;
    const int e = sub_exp(mx, lt, &oor);
    return oor || (mx > 0.f && e - lt < e_lo);
}

template <int DSUB>
__device__ __forceinline__ void prep_sub(const float *xv, int lt, SubA<DSUB> &a) {
    float v[DSUB];
    load_sub<DSUB>(xv, v);
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j++) mx = fmaxf(mx, fabsf(v[j]));
    bool oor = false;
    const int e = sub_exp(mx, lt, &oor);
    const float s = __int_as_float((e + 127) << 23);
    float n = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j++) {
        float u = v[j] * s;
        n = fmaf(u, u, n);
        float m2u = -2.f * u;
        a.h[j] = __float2half_rn(m2u);
        a.l[j] = __float2half_rn(m2u - __half2float(a.h[j]));
    }
    a.st = __float2half_rn(__int_as_float((e - lt + kNormShift + 127) << 23));
    a.nu = n * __int_as_float((lt - e + 127) << 23);
}

/* Column k of the A row of a sub-vector (see the key above); k is a compile-time constant after
 * unrolling. */
template <int DSUB>
__device__ __forceinline__ __half aval(const SubA<DSUB> &a, int k) {
    if (k < DSUB) return a.h[k];
    if (k < 2 * DSUB) return a.l[k - DSUB];
    if (k < 3 * DSUB) return a.h[k - 2 * DSUB];
    if (k < 3 * DSUB + 2) return a.st;
    return __float2half_rn(0.f);
}

template <int DSUB>
__device__ __forceinline__ uint32_t apair(const SubA<DSUB> &a, int k) {
    return (uint32_t)__half_as_ushort(aval(a, k)) | ((uint32_t)__half_as_ushort(aval(a, k + 1)) << 16);
}

/* d = a b + c, m16n8k16, float16 inputs, float32 accumulate (c and d separate, so the constant
 * accumulator input stays in its registers). */
/* The A registers of one sub-vector (row of its 16-row tile) for this thread (q = lane % 4), dsub
 * even: every k this thread holds (16 ks + 2q + {0, 1}, + 8) has k % dsub = 2q % dsub, so only that
 * pair of elements is converted; the category of each column (hi, lo, norm factor, zero) is a
 * compile-time function of (ks, q). reg[ks][0]: columns 16 ks + 2q + {0, 1}; reg[ks][1]: + 8. */
template <int DSUB>
__host__ __device__ constexpr int a_cat(int k) { /* 0 hi, 1 lo, 2 norm factor, 3 zero */
    return k < DSUB ? 0 : k < 2 * DSUB ? 1 : k < 3 * DSUB ? 0 : k < 3 * DSUB + 2 ? 2 : 3;
}


/* The per-sub-vector scaling both A-fragment builders use: s = 2^e brings the largest |element| of
 * v into [1, 2) (a zero sub-vector takes e = lt - kNormShift); nu = ||v s||^2 2^(lt - e) (the norm
 * term, (t/s) ||u||^2); sf = 2^(e - lt + kNormShift) as float16 (the norm factor s/t). A tile with a
 * sub-vector out of range never gets here (sub_exp's clamp is not needed). */
struct SubScale {
    float s, nu;
    __half sf;
};

template <int DSUB>
__device__ __forceinline__ SubScale sub_scale(const float (&v)[DSUB], int lt) {
    float mx = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j++) mx = fmaxf(mx, fabsf(v[j]));
    const int e = mx > 0.f ? 127 - ((__float_as_int(mx) >> 23) & 0xff) : lt - kNormShift;
    SubScale r;
    r.s = __int_as_float((e + 127) << 23);
    float n = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j++) {
        const float u = v[j] * r.s;
        n = fmaf(u, u, n);
    }
    r.nu = n * __int_as_float((lt - e + 127) << 23);
    r.sf = __float2half_rn(__int_as_float((e - lt + kNormShift + 127) << 23));
    return r;
}

template <int DSUB, int KS>
__device__ __forceinline__ void build_a_row(const float *xv, int lt, int q, uint32_t (&reg)[KS][2], float &nu) {
    static_assert(DSUB % 2 == 0 && 8 % DSUB == 0, "pairs");
    float v[DSUB];
    load_sub<DSUB>(xv, v);
    const SubScale sc = sub_scale<DSUB>(v, lt);
    const float s = sc.s;
    const __half sf = sc.sf;
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int j = 0; j < DSUB; j += 2)
        if (j == 0 || (2 * q) % DSUB == j) {
            p0 = v[j];
            p1 = v[j + 1];
        }
    nu = sc.nu;
    p0 *= -2.f * s;
    p1 *= -2.f * s;
    const __half2 hi = __floats2half2_rn(p0, p1);
    const float2 hb = __half22float2(hi);
    const __half2 lo = __floats2half2_rn(p0 - hb.x, p1 - hb.y);
    const uint32_t H = kvpq__h2_bits(hi), L = kvpq__h2_bits(lo), ST = kvpq__h2_bits(__halves2half2(sf, sf));
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int off = 0; off < 2; off++) {
            uint32_t r = 0;
#pragma unroll
            for (int qq = 0; qq < 4; qq++) {
                const int cat = a_cat<DSUB>(16 * ks + 2 * qq + 8 * off);
                const uint32_t val = cat == 0 ? H : cat == 1 ? L : cat == 2 ? ST : 0u;
                if (q == qq) r = val;
            }
            reg[ks][off] = r;
        }
}

__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint2 b, const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

/* d = a b (m16n8k16, float16 inputs, float32 accumulate, zero accumulator input) */
__device__ __forceinline__ void mma16816z(float (&d)[4], const uint32_t (&a)[4], uint2 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%10,%10,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b.x), "r"(b.y), "f"(0.f));
}

#ifndef KVPQ_ENCODE_MMA_ROW_TILES /* row tiles of 16 sub-vectors a warp holds per pass over the codebook */
#define KVPQ_ENCODE_MMA_ROW_TILES 4
#endif
#ifndef KVPQ_ENCODE_MMA_UNROLL /* unrolling of the loop over column tiles */
#define KVPQ_ENCODE_MMA_UNROLL 2
#endif
constexpr int kMmaUnroll = KVPQ_ENCODE_MMA_UNROLL;
template <int D, int DSUB>
__device__ __forceinline__ void search_mma(const EncodeParams &p, const float *xs, const uint2 *sB,
                                           uint16_t *idxs) {
    constexpr int KS = mma_ksteps<DSUB>(), NSUB = 4096 / DSUB, R = NSUB / 16 / (kThreads / 32);
    constexpr int RG = R < KVPQ_ENCODE_MMA_ROW_TILES / KS ? R : KVPQ_ENCODE_MMA_ROW_TILES / KS; /* row tiles per pass */
    static_assert(R % RG == 0, "row groups");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nct = p.ksub >> 3, lt = p.frag_lt;
    const int lowmask = (1 << (p.nbits - 2)) - 1, mask = ~lowmask;
    for (int grp = 0; grp < R / RG; grp++) {
        uint32_t a[RG][KS][4];
        float ci[RG][4]; /* accumulator input: (t/s) ||u||^2 of rows g, g, g + 8, g + 8 */
        int key[RG][2];
#pragma unroll
        for (int r = 0; r < RG; r++) {
            const int base = (warp * R + grp * RG + r) * 16;
            float nu0, nu1;
            if constexpr (DSUB % 2 == 0) {
                uint32_t r0[KS][2], r1[KS][2];
                build_a_row<DSUB, KS>(xs + (base + g) * DSUB, lt, t, r0, nu0);
                build_a_row<DSUB, KS>(xs + (base + g + 8) * DSUB, lt, t, r1, nu1);
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    a[r][ks][0] = r0[ks][0];
                    a[r][ks][1] = r1[ks][0];
                    a[r][ks][2] = r0[ks][1];
                    a[r][ks][3] = r1[ks][1];
                }
            } else {
                SubA<DSUB> s0, s1;
                prep_sub<DSUB>(xs + (base + g) * DSUB, lt, s0);
                prep_sub<DSUB>(xs + (base + g + 8) * DSUB, lt, s1);
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
#pragma unroll
                    for (int tt = 0; tt < 4; tt++) {
                        if (t == tt) {
                            a[r][ks][0] = apair(s0, 16 * ks + 2 * tt);
                            a[r][ks][1] = apair(s1, 16 * ks + 2 * tt);
                            a[r][ks][2] = apair(s0, 16 * ks + 2 * tt + 8);
                            a[r][ks][3] = apair(s1, 16 * ks + 2 * tt + 8);
                        }
                    }
                }
                nu0 = s0.nu;
                nu1 = s1.nu;
            }
            /* + 0.f: a distinct value per accumulator slot (nu >= 0, so the same number), so that the
             * compiler keeps the 4-register accumulator input in place instead of copying it into
             * place before every mma */
            ci[r][0] = nu0;
            ci[r][1] = nu0 + 0.f;
            ci[r][2] = nu1;
            ci[r][3] = nu1 + 0.f;
            key[r][0] = key[r][1] = 0x7fffffff;
        }
#pragma unroll kMmaUnroll
        for (int ct = 0; ct < nct; ct++) {
            uint2 b[KS];
#pragma unroll
            for (int ks = 0; ks < KS; ks++) b[ks] = sB[(ct * KS + ks) * 32 + lane];
            const int kb = ct * 2;
#pragma unroll
            for (int r = 0; r < RG; r++) {
                float c[4];
                mma16816(c, a[r][0], b[0], ci[r]);
#pragma unroll
                for (int ks = 1; ks < KS; ks++) mma16816(c, a[r][ks], b[ks], c);
                const int k0 = (__float_as_int(c[0]) & mask) | kb, k1 = (__float_as_int(c[1]) & mask) | (kb + 1);
                const int k2 = (__float_as_int(c[2]) & mask) | kb, k3 = (__float_as_int(c[3]) & mask) | (kb + 1);
                key[r][0] = min(key[r][0], min(k0, k1));
                key[r][1] = min(key[r][1], min(k2, k3));
            }
        }
        /* the quad's 4 threads hold the candidates of columns 2t, 2t+1 of every tile: reduce */
#pragma unroll
        for (int r = 0; r < RG; r++) {
            const int base = (warp * R + grp * RG + r) * 16;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int k = key[r][h];
                int v = k & mask, code = ((k & lowmask) >> 1) * 8 + 2 * t + (k & 1);
#pragma unroll
                for (int off = 1; off < 4; off <<= 1) {
                    const int ov = __shfl_xor_sync(KVPQ_FULL_MASK, v, off);
                    const int oc = __shfl_xor_sync(KVPQ_FULL_MASK, code, off);
                    if (ov < v || (ov == v && oc < code)) {
                        v = ov;
                        code = oc;
                    }
                }
                if (t == 0) idxs[base + g + 8 * h] = (uint16_t)code;
            }
        }
    }
}

/* ---- phase 2, tensor cores, grouped argmin (kvpq_cuda_pq.search 2-5; 5 is the default) ----
 *
 * Same keys as search_mma (one mma.m16n8k16 per 16 sub-vectors x 8 centroids and k-step), with two
 * changes that cut the search loop's instructions per mma from ~8.6 to ~5.4-6.6 (SASS) and the
 * integer ones from 6 to 3:
 *  - A fragments: each sub-vector's float16 hi/lo pairs, norm factor and (t/s)||u||^2 are computed
 *    once, by one lane, into a per-warp record in shared memory (REC = dsub + 2 words); each thread
 *    then reads the 3 words its quad position needs. search_mma had all 4 threads of a quad repeat
 *    the whole per-sub-vector computation.
 *  - argmin: the keys of U consecutive column tiles (a group of 8U centroids) are reduced by raw
 *    integer min over their float bits (3-input VIMNMX3, 2 keys per instruction, no per-key index);
 *    only each group's minimum gets the (group, quad position) number in its low log2(4 n_groups)
 *    bits (one LOP3 + one VIMNMX per row and group instead of a LOP3 per key): 2 + 4/U integer
 *    instructions per mma and thread instead of 6. The quad's minimum names the winning group and
 *    quad position; the 2U centroids of that pair are re-ranked exactly, argmin ||x - c||^2 in
 *    float32 on the CUDA cores (ties to the lowest index), from the float32 sub-vector and codebook.
 *    The keys lose log2(4 n_groups) <= 5 low bits (2^-18 relative at nbits 8, inside the near-tie
 *    band like search_mma's nbits - 2 bits); a centroid beaten only within that resolution by one of
 *    another group or quad position is a near-tie. */
#ifndef KVPQ_ENCODE_MMA_GROUP /* column tiles per argmin group (U) */
#define KVPQ_ENCODE_MMA_GROUP 4
#endif
constexpr int kMmaGroup = KVPQ_ENCODE_MMA_GROUP;
/* The grouped variants (kvpq_cuda_pq.search >= 2): row tiles of 16 sub-vectors a warp holds per
 * pass over the codebook (times k-steps), and CTAs per SM the registers are capped for. */
__host__ __device__ constexpr int mma2_row_tiles(int var) { return var == 3 || var == 5 ? 4 : 2; }
__host__ __device__ constexpr int mma2_blocks(int var) { return var == 3 || var == 5 ? 3 : 4; }
/* Variants 3 and 4: no accumulator input (the mma's C is zero; nu enters as one more k-column, A = a
 * float16 upper bound of nu / 2^15 against B = 2^15, so no registers hold C and none are copied
 * before each mma), the re-rank reads the codebook in a permuted, bank-conflict-free order, and the
 * rows are loaded with PREFETCH (load_rows). */
__host__ __device__ constexpr bool mma2_noc(int var) { return var >= 3; }
/* Variants 5 and 6: each lane loads its A registers straight from the record by a per-lane word
 * index (computed once), instead of loading the record's words and selecting among them by quad
 * position (SEL): the four words of an A fragment are then fresh values that the register allocator
 * places as the mma's register quad, where the selected ones were copied into place (IMAD.MOV) before
 * every mma (variant 3's SASS: 7 instructions per mma in the loop, 4.4 without the copies). The
 * record gets one more word, 0, for the all-zero k-columns. (The same with 2 row tiles and 4 CTAs per
 * SM, as 4 is to 3, was slower on an H200: 49.2-49.8 us against 48.1-48.7 at the OOM shape; a
 * persistent double-buffered kernel around variant 5's search was slower still, 58.7 us;
 * docs/BENCHMARKS.md, session 11.) */
__host__ __device__ constexpr bool mma2_idx(int var) { return var == 5; }
/* exponent floor of the no-C variants: nu < 2^(lt - e) 4 dsub must stay below 2^31 (A <= 65504) */
__host__ __device__ constexpr int noc_lo(int dsub) { return (dsub >= 8 ? 3 : dsub >= 4 ? 2 : dsub >= 2 ? 1 : 0) - 28; }

/* Record of one sub-vector (dsub even): H pairs (dsub / 2 words: float16x2 hi parts of -2u),
 * L pairs (lo parts), ST (float16x2 of 2^kNormShift s/t twice), nu ((t/s)||u||^2, float32 bits; the
 * no-C variants: float16x2 (nu / 2^15 rounded up, 0), the A entries of the k-columns 3 dsub + 2, + 3). */
template <int DSUB> __host__ __device__ constexpr int rec_words() { return DSUB + 2; }
template <int DSUB, int VAR> __host__ __device__ constexpr int rec_words_v() { return DSUB + 2 + (mma2_idx(VAR) ? 1 : 0); }
/* Word of the record that holds A columns (k, k + 1) of a sub-vector (k even; the a_cat categories;
 * the no-C nu pair; the zero word of variants 5 and 6 otherwise). */
template <int DSUB, bool NOC>
__host__ __device__ constexpr int rec_word(int k) {
    return a_cat<DSUB>(k) == 0   ? (k % DSUB) / 2
           : a_cat<DSUB>(k) == 1 ? DSUB / 2 + (k % DSUB) / 2
           : a_cat<DSUB>(k) == 2 ? DSUB
           : NOC && k == 3 * DSUB + 2 ? DSUB + 1
                                      : DSUB + 2;
}
/* The words of columns 16 ks + 8 off + 2q (+1) for the quad positions q = 0..3, a byte each. */
template <int DSUB, bool NOC>
__host__ __device__ constexpr uint32_t rec_word_table(int ks, int off) {
    return (uint32_t)rec_word<DSUB, NOC>(16 * ks + 8 * off) | (uint32_t)rec_word<DSUB, NOC>(16 * ks + 8 * off + 2) << 8 |
           (uint32_t)rec_word<DSUB, NOC>(16 * ks + 8 * off + 4) << 16 |
           (uint32_t)rec_word<DSUB, NOC>(16 * ks + 8 * off + 6) << 24;
}

template <int DSUB, bool NOC, bool ZW = false>
__device__ __forceinline__ void build_rec(const float *xv, int lt, uint32_t *rec) {
    float v[DSUB];
    load_sub<DSUB>(xv, v);
    const SubScale sc = sub_scale<DSUB>(v, lt);
    const float s = sc.s, nu = sc.nu;
#pragma unroll
    for (int j = 0; j < DSUB; j += 2) {
        const float p0 = v[j] * (-2.f * s), p1 = v[j + 1] * (-2.f * s);
        const __half2 hi = __floats2half2_rn(p0, p1);
        const float2 hb = __half22float2(hi);
        const __half2 lo = __floats2half2_rn(p0 - hb.x, p1 - hb.y);
        rec[j / 2] = kvpq__h2_bits(hi);
        rec[DSUB / 2 + j / 2] = kvpq__h2_bits(lo);
    }
    rec[DSUB] = kvpq__h2_bits(__halves2half2(sc.sf, sc.sf));
    if constexpr (NOC)
        rec[DSUB + 1] = kvpq__h2_bits(__halves2half2(__float2half_ru(nu * (1.f / 32768.f)), __float2half_rn(0.f)));
    else
        rec[DSUB + 1] = __float_as_uint(nu);
    if constexpr (ZW) rec[DSUB + 2] = 0u;
}

/* The A registers of one row for quad position q from its record (see build_a_row); the no-C
 * variants also take the pair of k-columns 3 dsub + 2, + 3 (nu bound, 0) from it. */
template <int DSUB, int KS, bool NOC>
__device__ __forceinline__ void load_a_row(const uint32_t *rec, int q, uint32_t (&reg)[KS][2], float &nu) {
    const int jp = ((2 * q) % DSUB) / 2;
    const uint32_t H = rec[jp], L = rec[DSUB / 2 + jp], ST = rec[DSUB], KZ = rec[DSUB + 1];
    nu = NOC ? 0.f : __uint_as_float(KZ);
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int off = 0; off < 2; off++) {
            uint32_t r = 0;
#pragma unroll
            for (int qq = 0; qq < 4; qq++) {
                const int k = 16 * ks + 2 * qq + 8 * off, cat = a_cat<DSUB>(k);
                const uint32_t val = cat == 0 ? H : cat == 1 ? L : cat == 2 ? ST : NOC && k == 3 * DSUB + 2 ? KZ : 0u;
                if (q == qq) r = val;
            }
            reg[ks][off] = r;
        }
}

/* Position of centroid c in the no-C variants' shared float32 codebook: the 2U centroids of each
 * (group, quad position) pair (columns 2t, 2t + 1 of the group's U tiles) are contiguous. */
__host__ __device__ constexpr int rerank_pos(int c, int U) {
    return c / (8 * U) * (8 * U) + (c % 8 >> 1) * (2 * U) + (c % (8 * U) >> 3) * 2 + (c & 1);
}

template <int D, int DSUB, int VAR>
struct Mma2Shape {
    static constexpr int KS = mma_ksteps<DSUB>(), NSUB = 4096 / DSUB, R = NSUB / 16 / (kThreads / 32);
    static constexpr int RG = R < mma2_row_tiles(VAR) / KS ? R : mma2_row_tiles(VAR) / KS;
    static constexpr int STAGE_WORDS = (kThreads / 32) * RG * 16 * rec_words_v<DSUB, VAR>(); /* all warps */
};

/* stage: (warps, RG * 16, REC) records; cbr: the float32 codebook (ksub, dsub), shared or device. */
template <int D, int DSUB, int VAR>
__device__ __forceinline__ void search_mma2(const EncodeParams &p, const float *xs, const uint2 *sB, uint32_t *stage,
                                            const float *cbr, uint16_t *idxs) {
    using S = Mma2Shape<D, DSUB, VAR>;
    constexpr int KS = S::KS, R = S::R, RG = S::RG, REC = rec_words_v<DSUB, VAR>(), U = kMmaGroup;
    constexpr bool NOC = mma2_noc(VAR), IDX = mma2_idx(VAR);
    static_assert(R % RG == 0 && RG % 2 == 0, "row groups");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int ngrp = (p.ksub >> 3) / U, lt = p.frag_lt;
    const int lowmask = 4 * ngrp - 1, mask = ~lowmask; /* low bits: (group, quad position) */
    uint32_t *st = stage + warp * (RG * 16 * REC);
    int wi[KS][2]; /* IDX: this lane's record words of its A registers */
#pragma unroll
    for (int ks = 0; ks < KS; ks++)
#pragma unroll
        for (int off = 0; off < 2; off++) wi[ks][off] = (int)(rec_word_table<DSUB, NOC>(ks, off) >> (8 * t)) & 0xff;
    for (int grp = 0; grp < R / RG; grp++) {
        const int base = (warp * R + grp * RG) * 16; /* first sub-vector of this pass */
        __syncwarp();
        for (int i = lane; i < RG * 16; i += 32) build_rec<DSUB, NOC, IDX>(xs + (base + i) * DSUB, lt, st + i * REC);
        __syncwarp();
        uint32_t a[RG][KS][4];
        float ci[RG][4]; /* accumulator input: (t/s) ||u||^2 of rows g, g, g + 8, g + 8 */
        int key[RG][2];
#pragma unroll
        for (int r = 0; r < RG; r++) {
            key[r][0] = key[r][1] = 0x7fffffff;
            if constexpr (IDX) {
                const uint32_t *q0 = st + (r * 16 + g) * REC, *q1 = st + (r * 16 + g + 8) * REC;
#pragma unroll
                for (int ks = 0; ks < KS; ks++) {
                    a[r][ks][0] = q0[wi[ks][0]];
                    a[r][ks][1] = q1[wi[ks][0]];
                    a[r][ks][2] = q0[wi[ks][1]];
                    a[r][ks][3] = q1[wi[ks][1]];
                }
                continue;
            }
            uint32_t r0[KS][2], r1[KS][2];
            float nu0, nu1;
            load_a_row<DSUB, KS, NOC>(st + (r * 16 + g) * REC, t, r0, nu0);
            load_a_row<DSUB, KS, NOC>(st + (r * 16 + g + 8) * REC, t, r1, nu1);
#pragma unroll
            for (int ks = 0; ks < KS; ks++) {
                a[r][ks][0] = r0[ks][0];
                a[r][ks][1] = r1[ks][0];
                a[r][ks][2] = r0[ks][1];
                a[r][ks][3] = r1[ks][1];
            }
            ci[r][0] = nu0; /* + 0.f: see search_mma */
            ci[r][1] = nu0 + 0.f;
            ci[r][2] = nu1;
            ci[r][3] = nu1 + 0.f;
        }
        for (int gi = 0; gi < (p.dbg & 1 ? 0 : ngrp); gi++) {
            int gm[RG][2];
#pragma unroll
            for (int i = 0; i < U; i++) {
                const int ct = gi * U + i;
                uint2 b[KS];
#pragma unroll
                for (int ks = 0; ks < KS; ks++) b[ks] = sB[(ct * KS + ks) * 32 + lane];
                /* all RG mma of this column tile first, then their minima: RG results in flight */
                float c[RG][4];
#pragma unroll
                for (int r = 0; r < RG; r++) {
                    if constexpr (NOC)
                        mma16816z(c[r], a[r][0], b[0]);
                    else
                        mma16816(c[r], a[r][0], b[0], ci[r]);
#pragma unroll
                    for (int ks = 1; ks < KS; ks++) mma16816(c[r], a[r][ks], b[ks], c[r]);
                }
#pragma unroll
                for (int r = 0; r < RG; r++) {
                    const int k0 = __float_as_int(c[r][0]), k1 = __float_as_int(c[r][1]);
                    const int k2 = __float_as_int(c[r][2]), k3 = __float_as_int(c[r][3]);
                    gm[r][0] = i == 0 ? min(k0, k1) : min(gm[r][0], min(k0, k1));
                    gm[r][1] = i == 0 ? min(k2, k3) : min(gm[r][1], min(k2, k3));
                }
            }
            const int tag = (gi << 2) | t;
#pragma unroll
            for (int r = 0; r < RG; r++) {
                key[r][0] = min(key[r][0], (gm[r][0] & mask) | tag);
                key[r][1] = min(key[r][1], (gm[r][1] & mask) | tag);
            }
        }
        /* the quad's minimum: the winning (group, quad position) of each row, in every lane */
        int win[RG][2];
#pragma unroll
        for (int r = 0; r < RG; r++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int v = key[r][h];
                v = min(v, __shfl_xor_sync(KVPQ_FULL_MASK, v, 1));
                v = min(v, __shfl_xor_sync(KVPQ_FULL_MASK, v, 2));
                win[r][h] = v & lowmask;
            }
        /* exact re-rank of the winner's 2U centroids; the quad's 2 RG rows are shared out over its 4
         * lanes: lane t takes rows 4j + t of the quad (row r = (4j + t) / 2, half h = t % 2) */
#pragma unroll
        for (int j = 0; j < RG / 2; j++) {
            const int w = t == 0 ? win[2 * j][0] : t == 1 ? win[2 * j][1] : t == 2 ? win[2 * j + 1][0] : win[2 * j + 1][1];
            const int s = base + (2 * j + (t >> 1)) * 16 + g + 8 * (t & 1);
            float xv[DSUB];
            load_sub<DSUB>(xs + s * DSUB, xv);
            const int c0 = (w >> 2) * (8 * U) + 2 * (w & 3);
            if (p.dbg & 2) {
                idxs[s] = (uint16_t)c0;
                continue;
            }
            float bd = INFINITY;
            int bc = c0;
            if constexpr (NOC) {
                /* the 2U candidates are contiguous (rerank_pos); lane l starts at candidate l % 2U,
                 * so the 8 lanes of each quarter-warp read 8 different bank groups (dsub 4) */
                const float *cb = cbr + ((w >> 2) * (8 * U) + (w & 3) * (2 * U)) * DSUB;
#pragma unroll
                for (int kk = 0; kk < 2 * U; kk++) {
                    const int k = (kk + lane) & (2 * U - 1), c = c0 + 8 * (k >> 1) + (k & 1);
                    float cv[DSUB];
                    load_sub<DSUB>(cb + k * DSUB, cv);
                    float d = 0.f;
#pragma unroll
                    for (int kd = 0; kd < DSUB; kd++) {
                        const float df = xv[kd] - cv[kd];
                        d = fmaf(df, df, d);
                    }
                    if (d < bd || (d == bd && c < bc)) {
                        bd = d;
                        bc = c;
                    }
                }
            } else {
#pragma unroll
                for (int i = 0; i < U; i++)
#pragma unroll
                    for (int jj = 0; jj < 2; jj++) {
                        const int c = c0 + 8 * i + jj;
                        float cv[DSUB];
                        load_sub<DSUB>(cbr + c * DSUB, cv);
                        float d = 0.f;
#pragma unroll
                        for (int k = 0; k < DSUB; k++) {
                            const float df = xv[k] - cv[k];
                            d = fmaf(df, df, d);
                        }
                        if (d < bd) {
                            bd = d;
                            bc = c;
                        }
                    }
            }
            idxs[s] = (uint16_t)bc;
        }
    }
}

/* ---- phase 3: pack, a byte per thread and step ---- */
template <int D, int DSUB>
__device__ __forceinline__ void pack_codes(const EncodeParams &p, long long row0, const uint16_t *idxs) {
    constexpr int M = D / DSUB, T = 4096 / D;
    const int cs = p.code_size, nbits = p.nbits;
    if constexpr (M % 4 == 0) {
        /* whole-byte codes (nbits 8, cs = M): 4 codes per 32-bit store where the rows are aligned */
        const bool aligned = ((uintptr_t)p.dst.out & 3) == 0;
        if (nbits == 8 && aligned) {
            for (int w = threadIdx.x; w < T * (M / 4); w += kThreads) {
                const int r = w / (M / 4), j = (w - r * (M / 4)) * 4;
                const long long gr = row0 + r;
                if (gr >= p.n_rows) continue;
                const uint2 c = *reinterpret_cast<const uint2 *>(idxs + r * M + j);
                const uint32_t v = (c.x & 0xffu) | ((c.x >> 8) & 0xff00u) | ((c.y & 0xffu) << 16) | ((c.y << 8) & 0xff000000u);
                long long t = gr / p.n_head_kv;
                int h = (int)(gr - t * p.n_head_kv);
                uint8_t *dst;
                if (p.dst.page_table) {
                    long long pos = p.dst.pos0 + t;
                    int page = p.dst.page_table[pos / p.dst.page_tokens];
                    dst = p.dst.out + page * p.dst.page_stride + h * p.dst.head_stride + (pos % p.dst.page_tokens) * cs;
                } else {
                    dst = p.dst.out + gr * cs;
                }
                *reinterpret_cast<uint32_t *>(dst + j) = v;
            }
            return;
        }
    }
    for (int b = threadIdx.x; b < T * cs; b += kThreads) {
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

/* One CTA encodes a tile of T = 4096 / D rows (4096 / DSUB sub-vectors). VAR 0: the float32 search;
 * 1: the tensor-core search of search_mma; 2-4: search_mma2 (grouped argmin, exact re-rank; dsub
 * even and at least kMmaGroup column tiles, else search_mma; see kvpq_cuda_pq.search). All
 * tensor-core variants (shared codebook,
 * fragments in p.frag) fall back to the float32 search for a tile with a sub-vector out of their
 * range. */
#ifndef KVPQ_ENCODE_MMA_MIN_BLOCKS /* CTAs per SM the tensor-core kernel's registers are capped for */
#define KVPQ_ENCODE_MMA_MIN_BLOCKS 3
#endif
template <int D, int DSUB, int VAR>
__global__ void __launch_bounds__(kThreads, VAR >= 2   ? mma2_blocks(VAR)
                                           : VAR == 1 ? KVPQ_ENCODE_MMA_MIN_BLOCKS
                                                      : 1)
    encode_kernel(EncodeParams p) {
    constexpr int T = 4096 / D, NSUB = 4096 / DSUB;
    constexpr int CHUNK = DSUB == 1 ? 2048 : 4096;
    constexpr int FP32_BYTES = (CHUNK + 4) * 4 + CHUNK / DSUB * 4;
    constexpr int FRAG_BYTES = VAR ? 32 * mma_ksteps<DSUB>() * 32 * 8 : 0; /* ksub <= 256 */
    /* search_mma2: the records after the fragments, then the float32 codebook where it fits in the
     * 48 KB of static shared memory (else it is read from device memory) */
    constexpr bool M2 = VAR >= 2;
    constexpr int STAGE_BYTES = M2 ? Mma2Shape<D, DSUB, VAR>::STAGE_WORDS * 4 : 0;
    constexpr int CB_BYTES = M2 ? 256 * DSUB * 4 : 0;
    constexpr bool CB_SHARED = M2 && T * D * 4 + FRAG_BYTES + STAGE_BYTES + CB_BYTES + NSUB * 2 <= 48 * 1024;
    constexpr int MMA_BYTES = FRAG_BYTES + STAGE_BYTES + (CB_SHARED ? CB_BYTES : 0);
    __shared__ __align__(16) float xs[T * D];  /* transformed rows */
    __shared__ __align__(16) unsigned char scratch[FP32_BYTES > MMA_BYTES ? FP32_BYTES : MMA_BYTES];
    __shared__ __align__(16) uint16_t idxs[NSUB]; /* chosen codes */
    float *cbs = reinterpret_cast<float *>(scratch), *nms = cbs + CHUNK + 4;
    const long long row0 = (long long)blockIdx.x * T;

    if constexpr (VAR != 0) {
        /* the fragments (and the codebook) are copied asynchronously (cp.async), overlapping the
         * loads of the rows */
        uint2 *sB = reinterpret_cast<uint2 *>(scratch);
        const int nf = (p.ksub >> 3) * mma_ksteps<DSUB>() * 32; /* even: 16-byte copies */
        for (int i = threadIdx.x; i < nf / 2; i += kThreads) __pipeline_memcpy_async(sB + 2 * i, p.frag + 2 * i, 16);
        float *cb2 = reinterpret_cast<float *>(scratch + FRAG_BYTES + STAGE_BYTES);
        static_assert(!mma2_noc(VAR) || CB_SHARED, "the no-C variants re-rank from shared memory");
        if constexpr (CB_SHARED)
            for (int i = threadIdx.x; i < p.ksub * DSUB / 4; i += kThreads) {
                /* a 16-byte chunk holds whole centroids (dsub 2, 4), adjacent in rerank_pos order too */
                const int dst = mma2_noc(VAR) ? rerank_pos(4 * i / DSUB, kMmaGroup) * DSUB : 4 * i;
                __pipeline_memcpy_async(cb2 + dst, p.centroids + 4 * i, 16);
            }
        __pipeline_commit();
        load_rows<D, mma2_noc(VAR)>(p, row0, xs);
        __pipeline_wait_prior(0);
        __syncthreads();
        bool oor = false;
        for (int s = threadIdx.x; s < NSUB; s += kThreads)
            oor |= sub_out_of_range<DSUB>(xs + s * DSUB, p.frag_lt, mma2_noc(VAR) ? noc_lo(DSUB) : -1000);
        if (p.dbg & 4) {
            for (int s = threadIdx.x; s < NSUB; s += kThreads) idxs[s] = 0;
        } else if (__syncthreads_or(oor)) {
            search_fp32<D, DSUB>(p, xs, cbs, nms, idxs);
        } else {
            if constexpr (M2 && DSUB % 2 == 0) {
                if (p.ksub >= 8 * kMmaGroup) {
                    search_mma2<D, DSUB, VAR>(p, xs, sB, reinterpret_cast<uint32_t *>(scratch + FRAG_BYTES),
                                         CB_SHARED ? cb2 : p.centroids, idxs);
                } else {
                    search_mma<D, DSUB>(p, xs, sB, idxs);
                }
            } else {
                search_mma<D, DSUB>(p, xs, sB, idxs);
            }
        }
    } else {
        load_rows<D>(p, row0, xs);
        __syncthreads();
        search_fp32<D, DSUB>(p, xs, cbs, nms, idxs);
    }
    __syncthreads();
    pack_codes<D, DSUB>(p, row0, idxs);
}

template <int D, int DSUB, int VAR>
kvpq_status launch_var(const EncodeParams &p, long long blocks, cudaStream_t stream) {
    encode_kernel<D, DSUB, VAR><<<(unsigned)blocks, kThreads, 0, stream>>>(p);
    return kvpq__cuda_err(cudaGetLastError(), "cuda encode kernel launch");
}

template <int D, int DSUB>
kvpq_status launch(const EncodeParams &p, int variant, cudaStream_t stream) {
    constexpr int T = 4096 / D;
    long long blocks = (p.n_rows + T - 1) / T;
    if (blocks > 0x7fffffffLL) return kvpq__err(KVPQ_ERR_CAPACITY, "cuda encode: %lld rows is too many", p.n_rows);
    if constexpr (DSUB <= 8) {
        if (p.frag) {
            /* the grouped search for dsub 2 and 4 (dsub 8: its float32 codebook would not fit beside
             * the fragments in shared memory; search_mma) */
            if constexpr (DSUB == 2 || DSUB == 4) {
                switch (variant) {
                case 2: return launch_var<D, DSUB, 2>(p, blocks, stream);
                case 3: return launch_var<D, DSUB, 3>(p, blocks, stream);
                case 4: return launch_var<D, DSUB, 4>(p, blocks, stream);
                case 5: return launch_var<D, DSUB, 5>(p, blocks, stream);
                }
            }
            return launch_var<D, DSUB, 1>(p, blocks, stream);
        }
    }
    return launch_var<D, DSUB, 0>(p, blocks, stream);
}

template <int D>
kvpq_status launch_d(const EncodeParams &p, int dsub, int variant, cudaStream_t stream) {
    switch (dsub) {
    case 1: return launch<D, 1>(p, variant, stream);
    case 2: return launch<D, 2>(p, variant, stream);
    case 4: return launch<D, 4>(p, variant, stream);
    case 8: return launch<D, 8>(p, variant, stream);
    case 16: return launch<D, 16>(p, variant, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda encode: dsub=%d: expected 1, 2, 4, 8 or 16", dsub);
}

/* Tensor-core B fragments of a shared codebook (host): for column tile ct (centroids 8ct..8ct+7),
 * k-step ks and lane (g = lane / 4, q = lane % 4), the two float16 pairs of B[k][n] at k = 16 ks +
 * 2q + {0, 1} and 16 ks + 2q + 8 + {0, 1}, n = 8 ct + g, B column n = (wh, wh, wl, hi and lo of
 * 2^-kNormShift ||w||^2, 0...) of w = t c, t = 2^lt. Returns k-steps, 0 when the tensor-core search
 * does not apply, -1 when out of memory. */
int build_frag(const kvpq_pq *pq, uint2 **frag_host, int *lt_out) {
    const int dsub = pq->dsub, ksub = pq->ksub, nbits = pq->p.nbits;
    *frag_host = NULL;
    if (pq->n_books != 1 || nbits < 3 || nbits > 8 || (dsub != 1 && dsub != 2 && dsub != 4 && dsub != 8)) return 0;
    double mx = 0;
    for (size_t i = 0; i < (size_t)ksub * dsub; i++) mx = fmax(mx, fabs((double)pq->centroids[i]));
    int lt = 0;
    if (mx > 0) {
        int e;
        frexp(mx, &e); /* mx = f 2^e, f in [0.5, 1): t mx in [2^14, 2^15) */
        lt = kCodebookTop + 1 - e;
    }
    if (lt < -90 || lt > 100) return 0; /* s = 2^e stays a normal float (e >= lt - 32) */
    const int KS = (3 * dsub + 2 + 15) / 16, nct = ksub / 8;
    uint2 *f = (uint2 *)malloc((size_t)nct * KS * 32 * sizeof *f);
    if (!f) return -1;
    for (int ct = 0; ct < nct; ct++)
        for (int ks = 0; ks < KS; ks++)
            for (int lane = 0; lane < 32; lane++) {
                const int n = ct * 8 + lane / 4, q = lane % 4;
                const float *c = pq->centroids + (size_t)n * dsub;
                unsigned short hv[4];
                const int kk[4] = {16 * ks + 2 * q, 16 * ks + 2 * q + 1, 16 * ks + 2 * q + 8, 16 * ks + 2 * q + 9};
                double nw = 0;
                for (int j = 0; j < dsub; j++) nw += ldexp((double)c[j], lt) * ldexp((double)c[j], lt);
                nw = ldexp(nw, -kNormShift);
                for (int i = 0; i < 4; i++) {
                    const int k = kk[i];
                    float v = 0.f;
                    int lo = 0;
                    if (k < 3 * dsub) {
                        int j = k % dsub;
                        float w = ldexpf(c[j], lt);
                        lo = k >= 2 * dsub;
                        float wh = __half2float(__float2half_rn(w));
                        v = lo ? w - wh : w;
                    } else if (k < 3 * dsub + 2) {
                        float nf = (float)nw, nh = __half2float(__float2half_rn(nf));
                        v = k == 3 * dsub ? nf : nf - nh;
                    } else if (k == 3 * dsub + 2) {
                        v = 32768.f; /* against the no-C variants' nu / 2^15 (search_mma's A is 0 there) */
                    }
                    __half_raw r = __float2half_rn(v);
                    hv[i] = r.x;
                }
                f[((size_t)ct * KS + ks) * 32 + lane] =
                    make_uint2((unsigned)hv[0] | ((unsigned)hv[1] << 16), (unsigned)hv[2] | ((unsigned)hv[3] << 16));
            }
    *frag_host = f;
    *lt_out = lt;
    return KS;
}

/* ---- norm-explicit encode (kvpq__cuda_encode_ne_launch) ----
 * Three launches per chunk of rows: the directions (a warp per row), the fused encode of the
 * directions (plain: their transforms are done), the scales (a warp per row). The fused kernel is
 * the one plain quantizers use, unchanged. */

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(KVPQ_FULL_MASK, v, o);
    return v;
}

/* Row gr: x' = the fused kernel's transforms of x, then u = x' / |x'| into u (n_rows, D) and |x'|
 * into nrm (n_rows), with kvpq_normalize_rows' arithmetic (double sum of squares, float norm, float
 * reciprocal; a zero row stays zero). */
template <int D>
__global__ void __launch_bounds__(256) ne_direction_kernel(EncodeParams p, float *u, float *nrm) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const long long gr = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gr >= p.n_rows) return; /* whole warps leave together */
    float v[EPL];
    load_row_regs<D>(p, gr, lane, v);
    transform_regs<D>(p, gr, lane, v);
    double ss = 0;
#pragma unroll
    for (int j = 0; j < EPL; j++) ss += (double)v[j] * v[j];
    ss = warp_sum_d(ss);
    const float n = (float)sqrt(ss), inv = n > 0.f ? 1.f / n : 0.f;
#pragma unroll
    for (int j = 0; j < EPL; j++) u[gr * D + lane * EPL + j] = v[j] * inv;
    if (lane == 0) nrm[gr] = n;
}

struct NeScaleParams {
    const float *u;          /* (n_rows, D) directions */
    const float *nrm;        /* (n_rows) |x'| */
    long long n_rows, row0;  /* rows of this chunk; its first row in the call (for the error) */
    int n_head_kv;
    const float *centroids;  /* (n_books, ksub, dsub) */
    int ksub, n_books, nbits, dsub, code_size;
    kvpq__code_dst dst;      /* where the fused kernel wrote the codes of this chunk */
    uint16_t *scales;        /* (pages, n_head_kv, page_tokens) float16 */
    unsigned long long *bad; /* min (row << 32 | scale bits) of a scale beyond float16 */
    unsigned *smax;          /* max float bits of |s| */
};

/* Row gr: r = the centroids of its codes (as stored), s = |x'| (u . r) / |r|^2 in double (as the
 * CPU cache's vq_encode), rounded to float then float16. */
template <int D>
__global__ void __launch_bounds__(256) ne_scale_kernel(NeScaleParams p) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const long long gr = (long long)blockIdx.x * 8 + (threadIdx.x >> 5);
    if (gr >= p.n_rows) return;
    const long long t = gr / p.n_head_kv;
    const int h = (int)(gr - t * p.n_head_kv);
    const uint8_t *row;
    size_t sidx = 0;
    if (p.dst.page_table) {
        const long long pos = p.dst.pos0 + t;
        const int page = p.dst.page_table[pos / p.dst.page_tokens];
        const int slot = (int)(pos % p.dst.page_tokens);
        row = p.dst.out + page * p.dst.page_stride + h * p.dst.head_stride + (long long)slot * p.code_size;
        sidx = ((size_t)page * p.n_head_kv + h) * p.dst.page_tokens + slot;
    } else {
        row = p.dst.out + gr * p.code_size;
        sidx = (size_t)gr;
    }
    double ur = 0, rr = 0;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane * EPL + j, m = e / p.dsub;
        const int code = kvpq__get_code(row, m, p.nbits);
        const float r = p.centroids[((size_t)(p.n_books == 1 ? 0 : m) * p.ksub + code) * p.dsub + (e - m * p.dsub)];
        ur += (double)p.u[gr * D + e] * r;
        rr += (double)r * r;
    }
    ur = warp_sum_d(ur);
    rr = warp_sum_d(rr);
    if (lane) return;
    const double sc = rr > 0 ? (double)p.nrm[gr] * ur / rr : 0.0;
    const float sf = (float)sc;
    if (!(fabs(sc) <= 65504.0)) {
        atomicMin(p.bad, ((unsigned long long)(p.row0 + gr) << 32) | __float_as_uint(sf));
        return;
    }
    const __half hs = __float2half_rn(sf);
    p.scales[sidx] = __half_as_ushort(hs);
    atomicMax(p.smax, __float_as_uint(fabsf(__half2float(hs))));
}

template <int D>
kvpq_status ne_launch_d(const EncodeParams &p, float *u, float *nrm, const NeScaleParams &sp, const kvpq_cuda_pq *plain,
                        size_t n_tokens, kvpq__code_dst cd, cudaStream_t stream) {
    const long long blocks = (p.n_rows + 7) / 8;
    if (blocks > 0x7fffffffLL) return kvpq__err(KVPQ_ERR_CAPACITY, "cuda encode: %lld rows is too many", p.n_rows);
    ne_direction_kernel<D><<<(unsigned)blocks, 256, 0, stream>>>(p, u, nrm);
    KVPQ_CUDA_TRY(cudaGetLastError(), "cuda norm-explicit encode: direction kernel launch");
    KVPQ_TRY(kvpq__cuda_encode_launch(plain, n_tokens, u, cd, stream));
    ne_scale_kernel<D><<<(unsigned)blocks, 256, 0, stream>>>(sp);
    return kvpq__cuda_err(cudaGetLastError(), "cuda norm-explicit encode: scale kernel launch");
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
    p.frag = q->search ? q->frag : NULL;
    p.frag_lt = q->frag_lt;
    p.dbg = q->dbg;
    p.dst = dst;
    p.flag = q->flag;
    switch (q->p.d) {
    case 64: return launch_d<64>(p, q->dsub, q->search, stream);
    case 128: return launch_d<128>(p, q->dsub, q->search, stream);
    case 256: return launch_d<256>(p, q->dsub, q->search, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda encode: d=%d: expected 64, 128 or 256", q->p.d);
}

kvpq_status kvpq__cuda_encode_ne_launch(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, kvpq__code_dst dst,
                                        uint16_t *scales, float *work_x, float *work_n, size_t work_rows,
                                        unsigned long long *bad, unsigned *smax, cudaStream_t stream) {
    const int H = q->n_head_kv, d = q->p.d;
    const size_t chunk = work_rows / (size_t)H; /* tokens per pass */
    if (chunk == 0) return kvpq__err(KVPQ_ERR_INTERNAL, "cuda norm-explicit encode: workspace of %zu rows", work_rows);
    kvpq_cuda_pq plain = *q; /* codes the directions as they are: their transforms are done */
    plain.mean = NULL;
    plain.inv_lambda = NULL;
    plain.rotate = 0;
    for (size_t t0 = 0; t0 < n_tokens; t0 += chunk) {
        const size_t nt = n_tokens - t0 < chunk ? n_tokens - t0 : chunk;
        EncodeParams p = {};
        p.x = x + t0 * H * d;
        p.n_rows = (long long)nt * H;
        p.n_head_kv = H;
        p.mean = q->mean;
        p.inv_lambda = q->inv_lambda;
        p.rotate = q->rotate;
        p.flag = q->flag;
        kvpq__code_dst cd = dst;
        if (cd.page_table) cd.pos0 += (int)t0;
        else cd.out += t0 * H * q->code_size;
        NeScaleParams sp;
        sp.u = work_x;
        sp.nrm = work_n;
        sp.n_rows = p.n_rows;
        sp.row0 = (long long)t0 * H;
        sp.n_head_kv = H;
        sp.centroids = q->centroids;
        sp.ksub = q->ksub;
        sp.n_books = q->n_books;
        sp.nbits = q->p.nbits;
        sp.dsub = q->dsub;
        sp.code_size = q->code_size;
        sp.dst = cd;
        sp.scales = cd.page_table ? scales : scales + t0 * H;
        sp.bad = bad;
        sp.smax = smax;
        kvpq_status s = KVPQ_OK;
        switch (d) {
        case 64: s = ne_launch_d<64>(p, work_x, work_n, sp, &plain, nt, cd, stream); break;
        case 128: s = ne_launch_d<128>(p, work_x, work_n, sp, &plain, nt, cd, stream); break;
        case 256: s = ne_launch_d<256>(p, work_x, work_n, sp, &plain, nt, cd, stream); break;
        default: return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda encode: d=%d: expected 64, 128 or 256", d);
        }
        KVPQ_TRY(s);
    }
    return KVPQ_OK;
}

// ---- device quantizer object ----------------------------------------------------------------------

extern "C" KVPQ_API void kvpq_cuda_pq_free(kvpq_cuda_pq *q) {
    if (!q) return;
    cudaFree(q->centroids);
    cudaFree(q->norms);
    cudaFree(q->inv_lambda);
    cudaFree(q->lambda);
    cudaFree(q->flag);
    cudaFree(q->frag);
    free(q);
}

kvpq_status kvpq__cuda_pq_upload(kvpq_cuda_pq **out, const kvpq_pq *pq, const kvpq_cuda_pq_params *pp) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: out is NULL");
    *out = NULL;
    if (!pq || !pp) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: pq or params is NULL");
    const int n_head_kv = pp->n_head_kv, rotate = pp->rotate;
    const float *lambda = pp->lambda;
    if (n_head_kv <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new: n_head_kv=%d must be > 0", n_head_kv);
    int d = pq->p.d;
    if (d != 64 && d != 128 && d != 256)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_pq_new: d=%d: the CUDA kernels handle 64, 128 or 256", d);
    if (pq->p.granularity == KVPQ_CODEBOOK_HEAD)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_pq_new: head granularity (one codebook per KV head) is "
                         "not supported by the CUDA kernels; use the CPU VQ cache");
    if (pq->stage2)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_pq_new: a key quantizer with a residual second stage "
                         "(key_stages = 2) is not supported by the CUDA kernels; use the CPU VQ cache");
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
    q->search = pp->kernels.encode_search;
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
    if (s == KVPQ_OK) { /* tensor-core fragments of a shared codebook (encode's fast search) */
        uint2 *fh = NULL;
        int ks = build_frag(pq, &fh, &q->frag_lt);
        if (ks < 0) s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_pq_new: out of memory");
        size_t nf = (size_t)(pq->ksub / 8) * (ks > 0 ? ks : 0) * 32;
        if (ks > 0) {
            KVPQ_STEP(cudaMalloc((void **)&q->frag, nf * sizeof(uint2)), "kvpq_cuda_pq_new: cudaMalloc fragments");
            KVPQ_STEP(cudaMemcpy(q->frag, fh, nf * sizeof(uint2), cudaMemcpyHostToDevice),
                      "kvpq_cuda_pq_new: copy fragments");
        }
        free(fh);
    }
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

extern "C" KVPQ_API kvpq_status kvpq_cuda_pq_new_params(kvpq_cuda_pq **out, const kvpq_pq *pq,
                                                        const kvpq_cuda_pq_params *p) {
    if (out) *out = NULL;
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_pq_new_params: params is NULL");
    KVPQ_TRY(kvpq__cuda_kernels_check(&p->kernels, "kvpq_cuda_pq_new_params"));
    return kvpq__cuda_pq_upload(out, pq, p);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_pq_new(kvpq_cuda_pq **out, const kvpq_pq *pq, int n_head_kv,
                                                 const float *lambda, int rotate) {
    kvpq_cuda_pq_params p = kvpq_cuda_pq_params_default();
    p.n_head_kv = n_head_kv;
    p.lambda = lambda;
    p.rotate = rotate;
    return kvpq__cuda_pq_upload(out, pq, &p);
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
