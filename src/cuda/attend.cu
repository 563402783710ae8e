/* attend.cu — decode attention from PQ codes on the GPU (flash-decoding), one launch.
 *
 * Grid (n_splits + n_wsplits, n_head_kv * groups, B). CTA (s < n_splits, g, b) handles the code positions
 * [s*chunk, (s+1)*chunk) of sequence b for GS query heads of one KV head: it builds their LUTs
 * LUT[m][c][h] = scale*log2(e) * q'_h,m . C_k[m][c] (q' = Hadamard(q * lambda)) in shared memory
 * (float32, or float16 entries with float32 sums), then each warp walks tiles of 32 positions: a
 * lane reads its position's key code row straight from device memory (16-byte loads) when codes
 * are whole bytes, and the value code rows of the tile are staged in shared memory (cp.async,
 * double-buffered); scores come from the LUTs (lane = position), the online softmax {m, d, o} is
 * updated per warp, and values are decoded from the value codebook (lane = channels). CTAs
 * s >= n_splits handle the float32 window, 32 positions each. Each CTA merges its warps and writes
 * a partial {m, d, o}; the last CTA of a (sequence, head group) to finish (a counter in device
 * memory) merges the partials (FlashAttention's rule; Milakov & Gimelshein 2018), divides by d and
 * undoes the value rotation, so there is no second launch. */
#include <cuda_fp16.h>
#include <cuda_pipeline.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "common.cuh"

namespace {

constexpr int kWindowChunk = 32;

/* Entries per LUT row (m, c): GS floats, or the next power of two >= GS halves (aligned vector
 * loads). */
template <typename LT>
__host__ __device__ constexpr int lut_stride(int gs) {
    return sizeof(LT) == 4 ? gs : (gs <= 1 ? 1 : gs <= 2 ? 2 : gs <= 4 ? 4 : 8);
}

struct Layout {  /* dynamic shared memory, in floats */
    int lut, vbook, qs, pbuf, stage, total;
    int k_stride, v_stride;  /* staged row strides in 32-bit words; k_stride 0: key codes not staged */
    int nw;                  /* warps per CTA */
    int vbook_in_smem;       /* 1: value codebook in shared memory; 2: as 8 bank-private replicas */
    int lut16;               /* LUT entries are float16 */
    int pvec;                /* value loop with vector probability loads and hoisted addresses */
};

__host__ __device__ inline bool keys_direct(const kvpq__attend_params &p) {
    return p.k_nbits == 8 && (p.k_code_size & 15) == 0;
}

/* The value codebook as 8 replicas, float4 chunk k of replica r at float4 index 8k + r: lane l
 * reads replica l % 8, so the 8 lanes of a 16-byte-access phase hit 8 different bank groups
 * whatever their codes (conflict-free gathers). For a shared value codebook read as float4 chunks,
 * up to 64 KB. */
inline bool vrep_ok(const kvpq__attend_params &p) {
    return p.v_books == 1 && p.v_dsub >= 4 && (p.head_dim / 32) % 4 == 0 && 8 * p.v_ksub * p.v_dsub * 4 <= 65536;
}

inline Layout make_layout(const kvpq__attend_params &p, int gs, int with_vbook, int nw, int lut16) {
    Layout L;
    L.nw = nw;
    L.lut16 = lut16;
    L.pvec = p.pvec;
    int Mk = p.head_dim / p.k_dsub;
    L.k_stride = keys_direct(p) ? 0 : (((p.k_code_size + 3) / 4) | 1);  /* odd: lane = row, conflict-free */
    L.v_stride = (p.v_code_size + 3) / 4;  /* rows are read by all lanes at once: any stride */
    int o = 0;
    L.lut = o;
    o += lut16 ? (Mk * p.k_ksub * lut_stride<__half>(gs) + 1) / 2 : Mk * p.k_ksub * gs;
    int merge = nw * gs * (p.head_dim + 2);  /* reused for the warp merge */
    if (o < merge) o = merge;
    o = (o + 3) & ~3;
    L.vbook = o;
    L.vbook_in_smem = with_vbook;
    if (with_vbook == 2) o += 8 * p.v_ksub * p.v_dsub;
    else if (with_vbook) o += p.v_books * p.v_ksub * p.v_dsub;
    o = (o + 3) & ~3;
    L.qs = o;
    o += gs * p.head_dim;
    L.pbuf = o;
    o += nw * 32 * gs;
    o = (o + 3) & ~3;
    L.stage = o;
    o += nw * 2 * 32 * (L.k_stride + L.v_stride);
    o += 4;  /* the "last CTA" flag */
    L.total = o;
    return L;
}

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(KVPQ_FULL_MASK, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(KVPQ_FULL_MASK, v, o);
    return v;
}

/* s[h] += LUT entry e[h] for the GS heads (float32 entries). */
template <int GS>
__device__ __forceinline__ void add_entry(const float *e, float (&s)[GS]) {
    if constexpr (GS % 4 == 0) {
#pragma unroll
        for (int h = 0; h < GS; h += 4) {
            float4 t = *reinterpret_cast<const float4 *>(e + h);
            s[h] += t.x; s[h + 1] += t.y; s[h + 2] += t.z; s[h + 3] += t.w;
        }
    } else if constexpr (GS % 2 == 0) {
#pragma unroll
        for (int h = 0; h < GS; h += 2) {
            float2 t = *reinterpret_cast<const float2 *>(e + h);
            s[h] += t.x; s[h + 1] += t.y;
        }
    } else {
#pragma unroll
        for (int h = 0; h < GS; h++) s[h] += e[h];
    }
}
/* Same for float16 entries (padded to a power of two: one 2/4/8/16-byte load), summed in float32. */
template <int GS>
__device__ __forceinline__ void add_entry(const __half *e, float (&s)[GS]) {
    constexpr int P = lut_stride<__half>(GS);
    if constexpr (P == 1) {
        s[0] += __half2float(*e);
    } else if constexpr (P == 2) {
        float2 f = __half22float2(*reinterpret_cast<const __half2 *>(e));
        s[0] += f.x;
        if constexpr (GS > 1) s[1] += f.y;
    } else if constexpr (P == 4) {
        uint2 u = *reinterpret_cast<const uint2 *>(e);
        float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
        float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
        float f[4] = {a.x, a.y, b.x, b.y};
#pragma unroll
        for (int h = 0; h < GS; h++) s[h] += f[h];
    } else {
        uint4 u = *reinterpret_cast<const uint4 *>(e);
        float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
        float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
        float2 c = __half22float2(*reinterpret_cast<const __half2 *>(&u.z));
        float2 d = __half22float2(*reinterpret_cast<const __half2 *>(&u.w));
        float f[8] = {a.x, a.y, b.x, b.y, c.x, c.y, d.x, d.y};
#pragma unroll
        for (int h = 0; h < GS; h++) s[h] += f[h];
    }
}

/* pr[h] = src[h] for the GS heads, as 16/8-byte shared-memory loads where GS allows (src is aligned
 * to 4 * GS bytes: position t's probabilities start at t * GS floats of a 16-byte aligned buffer). */
template <int GS>
__device__ __forceinline__ void load_probs(const float *src, float (&pr)[GS]) {
    if constexpr (GS % 4 == 0) {
#pragma unroll
        for (int h = 0; h < GS; h += 4) {
            float4 t = *reinterpret_cast<const float4 *>(src + h);
            pr[h] = t.x; pr[h + 1] = t.y; pr[h + 2] = t.z; pr[h + 3] = t.w;
        }
    } else if constexpr (GS % 2 == 0) {
#pragma unroll
        for (int h = 0; h < GS; h += 2) {
            float2 t = *reinterpret_cast<const float2 *>(src + h);
            pr[h] = t.x; pr[h + 1] = t.y;
        }
    } else {
#pragma unroll
        for (int h = 0; h < GS; h++) pr[h] = src[h];
    }
}

/* Stage the value (and, when not read directly, key) code rows of positions [t0, t0 + n) (one
 * page) into a warp's buffers. */
__device__ __forceinline__ void stage_tile(const kvpq__attend_params &p, const Layout &L, uint32_t *kst,
                                           uint32_t *vst, int b, int kvh, int t0, int n, int lane) {
    int page = p.page_table[(size_t)b * p.max_pages + t0 / p.page_tokens];
    int r0 = t0 % p.page_tokens;
    if (L.k_stride) {
        const uint8_t *ks = p.k_pages + ((size_t)page * p.n_head_kv + kvh) * p.page_tokens * p.k_code_size +
                            (size_t)r0 * p.k_code_size;
        if ((p.k_code_size & 3) == 0) {
            int wpr = p.k_code_size >> 2;
            for (int w = lane; w < n * wpr; w += 32) {
                int t = w / wpr, i = w - t * wpr;
                __pipeline_memcpy_async(kst + t * L.k_stride + i, ks + (size_t)w * 4, 4);
            }
        } else {
            for (int w = lane; w < n * p.k_code_size; w += 32) {
                int t = w / p.k_code_size, i = w - t * p.k_code_size;
                reinterpret_cast<uint8_t *>(kst + t * L.k_stride)[i] = ks[w];
            }
        }
    }
    const uint8_t *vs = p.v_pages + ((size_t)page * p.n_head_kv + kvh) * p.page_tokens * p.v_code_size +
                        (size_t)r0 * p.v_code_size;
    if ((p.v_code_size & 15) == 0) {
        int wpr = p.v_code_size >> 4;
        for (int w = lane; w < n * wpr; w += 32) {
            int t = w / wpr, i = w - t * wpr;
            __pipeline_memcpy_async(vst + t * L.v_stride + 4 * i, vs + (size_t)w * 16, 16);
        }
    } else if ((p.v_code_size & 3) == 0) {
        int wpr = p.v_code_size >> 2;
        for (int w = lane; w < n * wpr; w += 32) {
            int t = w / wpr, i = w - t * wpr;
            __pipeline_memcpy_async(vst + t * L.v_stride + i, vs + (size_t)w * 4, 4);
        }
    } else {
        for (int w = lane; w < n * p.v_code_size; w += 32) {
            int t = w / p.v_code_size, i = w - t * p.v_code_size;
            reinterpret_cast<uint8_t *>(vst + t * L.v_stride)[i] = vs[w];
        }
    }
    __pipeline_commit();
}

/* A lane's EPL consecutive floats (EPL * 4-byte aligned: rows of head_dim floats, lane * EPL into
 * them): VEC as 16- or 8-byte loads, else one float at a time. */
template <int EPL, bool VEC>
__device__ __forceinline__ void load_lane(const float *src, float (&x)[EPL]) {
    if constexpr (!VEC) {
#pragma unroll
        for (int j = 0; j < EPL; j++) x[j] = src[j];
    } else if constexpr (EPL % 4 == 0) {
#pragma unroll
        for (int j = 0; j < EPL; j += 4) {
            const float4 v = *reinterpret_cast<const float4 *>(src + j);
            x[j] = v.x, x[j + 1] = v.y, x[j + 2] = v.z, x[j + 3] = v.w;
        }
    } else if constexpr (EPL == 2) {
        const float2 v = *reinterpret_cast<const float2 *>(src);
        x[0] = v.x, x[1] = v.y;
    } else {
#pragma unroll
        for (int j = 0; j < EPL; j++) x[j] = src[j];
    }
}

/* The float32 window positions t0, t0 + stride, ... < w1 of this warp, scores by warp dot products; state in
 * the lane = channels layout (lane holds channels [lane*EPL, (lane+1)*EPL) of o), values rotated
 * when the value codes are (so that every partial is in the codes' space). */
template <int D, int GS, bool VEC = false>
__device__ __forceinline__ void window_part(const kvpq__attend_params &p, int b, int kvh, int head0, int t0, int w1, int stride,
                                            float (&m_run)[GS], float (&d_lane)[GS], float (&o)[GS][D / 32]) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const float scale = 1.4426950408889634f * rsqrtf((float)D);
    float qv[GS][EPL];
    if (t0 < w1) {
#pragma unroll
        for (int h = 0; h < GS; h++) load_lane<EPL, VEC>(p.q + ((size_t)b * p.n_head + head0 + h) * D + lane * EPL, qv[h]);
    }
    for (int t = t0; t < w1; t += stride) {
        size_t row = (((size_t)b * p.window + t % p.window) * p.n_head_kv + kvh) * D + lane * EPL;
        float kv[EPL], vv[EPL];
        load_lane<EPL, VEC>(p.k_win + row, kv);
        load_lane<EPL, VEC>(p.v_win + row, vv);
#pragma unroll
        for (int h = 0; h < GS; h++) {
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < EPL; j++) s = fmaf(qv[h][j], kv[j], s);
            s = warp_sum(s) * scale;
            float mn = fmaxf(m_run[h], s), corr = exp2f(m_run[h] - mn), pr = exp2f(s - mn);
            m_run[h] = mn;
            d_lane[h] = d_lane[h] * corr + (lane == 0 ? pr : 0.f);
#pragma unroll
            for (int j = 0; j < EPL; j++) o[h][j] = fmaf(pr, vv[j], o[h][j] * corr);
        }
    }
    if (p.v_rotate) {
#pragma unroll
        for (int h = 0; h < GS; h++) kvpq__warp_fwht<EPL>(o[h], lane);
    }
}

/* Write a warp's {m, d, o} (lane = channels layout) into its merge slots mbuf (nw, GS, D + 2). */
template <int D, int GS>
__device__ __forceinline__ void write_slots(float *mbuf, const float (&m_run)[GS], const float (&d_lane)[GS],
                                            const float (&o)[GS][D / 32]) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < GS; h++) {
        float dsum = warp_sum(d_lane[h]);
        float *slot = mbuf + ((size_t)warp * GS + h) * (D + 2);
#pragma unroll
        for (int j = 0; j < EPL; j++) slot[2 + lane * EPL + j] = o[h][j];
        if (lane == 0) {
            slot[0] = m_run[h];
            slot[1] = dsum;
        }
    }
}

/* After every warp wrote its slots (and a barrier): merge the warps of this CTA and write its
 * partial {m, d, o} for split `split`; the last CTA of this (sequence, head group) to finish merges
 * the partials of all splits. `last` is a shared int. */
template <int D, int GS, int SO = 2>
__device__ void finish_cta(const kvpq__attend_params &p, const float *mbuf, int nw, int *last, int b, int head0,
                           int split) {
    constexpr int EPL = D / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthr = nw * 32;
    const int nsp = p.n_splits + p.n_wsplits;
    for (int i = tid; i < GS * D; i += nthr) {
        int h = i / D, e = i - h * D;
        float mx = -INFINITY;
        for (int w = 0; w < nw; w++) mx = fmaxf(mx, mbuf[((size_t)w * GS + h) * (D + SO)]);
        float dd = 0.f, oo = 0.f;
        if (mx != -INFINITY) {
            for (int w = 0; w < nw; w++) {
                const float *slot = mbuf + ((size_t)w * GS + h) * (D + SO);
                float sc = exp2f(slot[0] - mx);
                dd += sc * slot[1];
                oo += sc * slot[SO + e];
            }
        }
        size_t base = ((size_t)b * p.n_head + head0 + h) * nsp + split;
        p.part_o[base * D + e] = oo;
        if (e == 0) {
            p.part_md[base * 2] = mx;
            p.part_md[base * 2 + 1] = dd;
        }
    }

    /* ---- the last CTA of this (sequence, head group) merges the partials of all splits ---- */
    __threadfence();
    __syncthreads();
    if (tid == 0) {
        int *ctr = p.counters + (size_t)b * gridDim.y + blockIdx.y;
        int ticket = atomicAdd(ctr, 1);
        *last = ticket == nsp - 1;
        if (*last) *ctr = 0;  /* ready for the next launch (no other CTA of this group is left) */
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    if (warp < GS) {  /* a warp per query head */
        const int head = head0 + warp;
        const size_t base = ((size_t)b * p.n_head + head) * nsp;
        /* lanes over splits for {m, d}; then every lane walks the splits for its channels, loads
         * independent of each other (an empty split has m = -inf and o = 0: weight 0) */
        /* {m, d} of all splits in one pass (lanes over splits, merged online, then across the warp:
         * one round trip instead of one for m and one for d) */
        float mx = -INFINITY, dd = 0.f, acc[EPL];
        for (int s = lane; s < nsp; s += 32) {
            const float2 md = __ldcg(reinterpret_cast<const float2 *>(p.part_md + (base + s) * 2));
            if (md.x != -INFINITY) {
                const float mn = fmaxf(mx, md.x);
                dd = dd * (mx == -INFINITY ? 0.f : exp2f(mx - mn)) + md.y * exp2f(md.x - mn);
                mx = mn;
            }
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const float mo = __shfl_xor_sync(KVPQ_FULL_MASK, mx, o), d_o = __shfl_xor_sync(KVPQ_FULL_MASK, dd, o);
            const float mn = fmaxf(mx, mo);
            dd = (mx == -INFINITY ? 0.f : dd * exp2f(mx - mn)) + (mo == -INFINITY ? 0.f : d_o * exp2f(mo - mn));
            mx = mn;  /* finite at the end: every sequence holds >= 1 position */
        }
#pragma unroll
        for (int j = 0; j < EPL; j++) acc[j] = 0.f;
        /* the partials of up to 16 (head_dim <= 128) or 8 splits in flight at once */
        auto add_split = [&](int s) {
            const float m = __ldcg(p.part_md + (base + s) * 2);
            const float sc = m == -INFINITY ? 0.f : exp2f(m - mx);
            const float *po = p.part_o + (base + s) * D + lane * EPL;
#pragma unroll
            for (int j = 0; j < EPL; j++) acc[j] = fmaf(sc, __ldcg(po + j), acc[j]);
        };
        if constexpr (D <= 128) {
#pragma unroll 16
            for (int s = 0; s < nsp; s++) add_split(s);
        } else {
#pragma unroll 8
            for (int s = 0; s < nsp; s++) add_split(s);
        }
        float inv = 1.f / dd;
#pragma unroll
        for (int j = 0; j < EPL; j++) acc[j] *= inv;
        if (p.lse && lane == 0) p.lse[(size_t)b * p.n_head + head] = mx * 0.69314718f + logf(dd);
        if (p.v_rotate) kvpq__warp_fwht<EPL>(acc, lane);
        float *dst = p.out + ((size_t)b * p.n_head + head) * D + lane * EPL;
#pragma unroll
        for (int j = 0; j < EPL; j++) dst[j] = acc[j];
    }
}

/* SC: norm-explicit quantizers (p.k_scales and/or p.v_scales set); a separate instantiation, so that
 * plain codebooks run the code they ran before. */
template <int D, int GS, typename LT, bool SC>
__global__ void __launch_bounds__(512, 1) attend_split_kernel(kvpq__attend_params p, Layout L) {
    constexpr int EPL = D / 32, GSP = lut_stride<LT>(GS);
    extern __shared__ __align__(16) float smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = L.nw, nthr = nw * 32;
    const int split = blockIdx.x, b = blockIdx.z;
    const int groups = p.n_head / p.n_head_kv / GS;
    const int kvh = blockIdx.y / groups, head0 = kvh * (p.n_head / p.n_head_kv) + (blockIdx.y % groups) * GS;
    const int len = p.seq_len[b];
    const int win = min(p.window, len), coded = len - win;

    float m_run[GS], d_lane[GS], o[GS][EPL];
#pragma unroll
    for (int h = 0; h < GS; h++) {
        m_run[h] = -INFINITY;
        d_lane[h] = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) o[h][j] = 0.f;
    }

    if (split >= p.n_splits) {
        const int w0 = coded + (split - p.n_splits) * kWindowChunk;
        window_part<D, GS>(p, b, kvh, head0, w0 + warp, min(len, w0 + kWindowChunk), nw, m_run, d_lane, o);
    } else if (split * p.chunk < coded) {
        /* ---- code positions [c0, c1) ---- */
        const int c0 = split * p.chunk, c1 = min(c0 + p.chunk, coded);
        LT *lut = reinterpret_cast<LT *>(smem + L.lut);
        float *qs = smem + L.qs;
        uint32_t *stage = reinterpret_cast<uint32_t *>(smem + L.stage) + warp * 2 * 32 * (L.k_stride + L.v_stride);
        /* buffers: K[0], K[1], V[0], V[1]; selected by arithmetic (an indexed pointer array would
         * go to local memory) */
#define KST(i) (stage + (i) * 32 * L.k_stride)
#define VST(i) (stage + 2 * 32 * L.k_stride + (i) * 32 * L.v_stride)
        /* the first tile's code rows are requested before the LUT build, so that their latency
         * overlaps it: value (and staged key) rows by cp.async, directly read key rows into L2 */
        if (c0 + warp * 32 < c1) {
            const int t0 = c0 + warp * 32;
            stage_tile(p, L, KST(0), VST(0), b, kvh, t0, min(32, c1 - t0), lane);
            if (L.k_stride == 0 && lane < min(32, c1 - t0)) {
                const int t = t0 + lane;
                const int page = p.page_table[(size_t)b * p.max_pages + t / p.page_tokens];
                const uint8_t *kr = p.k_pages + (size_t)page * p.n_head_kv * p.page_tokens * p.k_code_size +
                                    ((size_t)kvh * p.page_tokens + t % p.page_tokens) * p.k_code_size;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(kr));
            }
        }
        if (L.vbook_in_smem == 2) {
            float4 *vb = reinterpret_cast<float4 *>(smem + L.vbook);
            const float4 *src = reinterpret_cast<const float4 *>(p.v_centroids);
            int nv = 8 * (p.v_ksub * p.v_dsub / 4);
            for (int i = tid; i < nv; i += nthr) vb[i] = src[i >> 3];
        } else if (L.vbook_in_smem) {
            float *vb = smem + L.vbook;
            int nv = p.v_books * p.v_ksub * p.v_dsub;
            for (int i = tid; i < nv; i += nthr) vb[i] = p.v_centroids[i];
        }
        if (warp < GS) {  /* q' = Hadamard(q * lambda) for head head0 + warp */
            float v[EPL];
#pragma unroll
            for (int j = 0; j < EPL; j++) {
                v[j] = p.q[((size_t)b * p.n_head + head0 + warp) * D + lane * EPL + j];
                if (p.k_lambda) v[j] *= p.k_lambda[(size_t)kvh * D + lane * EPL + j];
            }
            kvpq__warp_fwht<EPL>(v, lane);
#pragma unroll
            for (int j = 0; j < EPL; j++) qs[warp * D + lane * EPL + j] = v[j];
        }
        /* (one barrier below covers q', the value and the key codebooks) */
        const int Mk = D / p.k_dsub, ksub = p.k_ksub, kd = p.k_dsub;
        const float scale = 1.4426950408889634f * rsqrtf((float)D);
        /* A shared key codebook is staged (coalesced, all loads in flight) in the not yet used
         * probability buffers when it fits; sub-space codebooks are read from device memory. */
        const float *kbook = p.k_centroids;
        if (p.k_books == 1 && ksub * kd <= nw * 32 * GS) {
            float *kb = smem + L.pbuf;
            for (int i = tid; i < ksub * kd; i += nthr) kb[i] = p.k_centroids[i];
            kbook = kb;
        }
        __syncthreads();
        for (int i = tid; i < Mk * ksub; i += nthr) {
            int m = i / ksub, c = i - m * ksub;
            const float *cent = kbook + ((size_t)(p.k_books == 1 ? 0 : m) * ksub + c) * kd;
            const float *qm = qs + m * kd;
            float acc[GS];
#pragma unroll
            for (int h = 0; h < GS; h++) acc[h] = 0.f;
            if ((kd & 3) == 0) {
                for (int j = 0; j < kd; j += 4) {
                    float4 cv = *reinterpret_cast<const float4 *>(cent + j);
#pragma unroll
                    for (int h = 0; h < GS; h++) {
                        const float *qh = qm + h * D + j;
                        acc[h] = fmaf(qh[0], cv.x, fmaf(qh[1], cv.y, fmaf(qh[2], cv.z, fmaf(qh[3], cv.w, acc[h]))));
                    }
                }
            } else {
                for (int j = 0; j < kd; j++) {
                    float cv = cent[j];
#pragma unroll
                    for (int h = 0; h < GS; h++) acc[h] = fmaf(qm[h * D + j], cv, acc[h]);
                }
            }
            if constexpr (sizeof(LT) == 4) {
#pragma unroll
                for (int h = 0; h < GS; h++) lut[(size_t)i * GSP + h] = acc[h] * scale;
            } else {
#pragma unroll
                for (int h = 0; h < GSP; h++) lut[(size_t)i * GSP + h] = __float2half_rn(h < GS ? acc[h] * scale : 0.f);
            }
        }
        __syncthreads();

        float *pb = smem + L.pbuf + warp * 32 * GS;
        const int vshift = __ffs(p.v_dsub) - 1, vnb = p.v_nbits, vks = p.v_ksub;
        const int knb = p.k_nbits;
        const bool kdirect = L.k_stride == 0;
        const size_t kpage = (size_t)p.n_head_kv * p.page_tokens * p.k_code_size;

        int t0 = c0 + warp * 32, buf = 0;
        for (; t0 < c1; t0 += nw * 32, buf ^= 1) {
            const int n = min(32, c1 - t0), tn = t0 + nw * 32;
            /* norm-explicit quantizers: this lane's position's float16 scales (loads in flight while
             * the scores are summed) */
            float ksc = 1.f, vsc = 1.f;
            if constexpr (SC) {
                if (lane < n) {
                    const int t = t0 + lane;
                    const size_t si =
                        ((size_t)p.page_table[(size_t)b * p.max_pages + t / p.page_tokens] * p.n_head_kv + kvh) *
                            p.page_tokens + t % p.page_tokens;
                    if (p.k_scales) ksc = __half2float(__ushort_as_half(__ldg(p.k_scales + si)));
                    if (p.v_scales) vsc = __half2float(__ushort_as_half(__ldg(p.v_scales + si)));
                }
            }
            /* scores: lane = position */
            float s[GS];
#pragma unroll
            for (int h = 0; h < GS; h++) s[h] = 0.f;
            if (kdirect) {
                /* the key row of this lane's position, 16 codes per load, straight from device memory */
                if (lane < n) {
                    const int t = t0 + lane;
                    const int page = p.page_table[(size_t)b * p.max_pages + t / p.page_tokens];
                    const uint4 *kr = reinterpret_cast<const uint4 *>(
                        p.k_pages + page * kpage + ((size_t)kvh * p.page_tokens + t % p.page_tokens) * p.k_code_size);
                    const int nq = p.k_code_size >> 4;
                    for (int w4 = 0; w4 < nq; w4 += 2) {
                        uint4 a = __ldg(kr + w4), bq = make_uint4(0, 0, 0, 0);
                        if (w4 + 1 < nq) bq = __ldg(kr + w4 + 1);
                        const uint32_t wv[8] = {a.x, a.y, a.z, a.w, bq.x, bq.y, bq.z, bq.w};
#pragma unroll
                        for (int k = 0; k < 8; k++) {
                            if (k >= 4 && w4 + 1 >= nq) break;
#pragma unroll
                            for (int q4 = 0; q4 < 4; q4++) {
                                const int m = w4 * 16 + k * 4 + q4, c = (wv[k] >> (8 * q4)) & 0xff;
                                add_entry<GS>(lut + ((size_t)m * ksub + c) * GSP, s);
                            }
                        }
                    }
                }
            }
            if (tn < c1) {
                stage_tile(p, L, KST(buf ^ 1), VST(buf ^ 1), b, kvh, tn, min(32, c1 - tn), lane);
                __pipeline_wait_prior(1);
            } else {
                __pipeline_wait_prior(0);
            }
            __syncwarp();
            if (lane < n) {
                if (!kdirect) {
                    const uint32_t *row = KST(buf) + lane * L.k_stride;
                    if (knb == 8) {
                        for (int w = 0; w < (Mk >> 2); w++) {
                            uint32_t wv = row[w];
#pragma unroll
                            for (int q4 = 0; q4 < 4; q4++) {
                                int c = (wv >> (8 * q4)) & 0xff;
                                add_entry<GS>(lut + ((size_t)(w * 4 + q4) * ksub + c) * GSP, s);
                            }
                        }
                        for (int m = Mk & ~3; m < Mk; m++) {
                            int c = reinterpret_cast<const uint8_t *>(row)[m];
                            add_entry<GS>(lut + ((size_t)m * ksub + c) * GSP, s);
                        }
                    } else {
                        for (int m = 0; m < Mk; m++) {
                            int c = kvpq__get_code(reinterpret_cast<const uint8_t *>(row), m, knb);
                            add_entry<GS>(lut + ((size_t)m * ksub + c) * GSP, s);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int h = 0; h < GS; h++) s[h] = -INFINITY;
            }
            if constexpr (SC) {
                if (p.k_scales) { /* score = s_k * sum_m LUT (lanes past n keep -inf: their ksc is 1) */
#pragma unroll
                    for (int h = 0; h < GS; h++) s[h] *= ksc;
                }
            }
#pragma unroll
            for (int h = 0; h < GS; h++) {
                float mn = fmaxf(m_run[h], warp_max(s[h]));
                float corr = exp2f(m_run[h] - mn), pr = exp2f(s[h] - mn);
                m_run[h] = mn;
                d_lane[h] = d_lane[h] * corr + pr;
#pragma unroll
                for (int j = 0; j < EPL; j++) o[h][j] *= corr;
                if constexpr (SC) pb[lane * GS + h] = pr * vsc; /* the denominator keeps p, the values p s_v */
                else pb[lane * GS + h] = pr;
            }
            __syncwarp();
            /* values: lane = channels lane*EPL .. +EPL. The body is instantiated for a shared-memory
             * and a device-memory codebook so that the shared one is read with LDS. */
            /* rs, rl: replicated codebook (float4 chunk k of this lane at 8k + lane % 8), else 0, 0 */
            auto values = [&](const float *vb, int rs, int rl) {
                if ((EPL % 4 == 0) && p.v_dsub >= 4) {
                    /* a lane's sub-spaces and codebook offsets (float4 chunks) do not change with the position */
                    int mj[EPL / 4 > 0 ? EPL / 4 : 1], offj[EPL / 4 > 0 ? EPL / 4 : 1];
                    const int cshift = vshift - 2;
#pragma unroll
                    for (int jj = 0; jj < EPL / 4; jj++) {
                        int e = lane * EPL + 4 * jj;
                        mj[jj] = e >> vshift;
                        offj[jj] = ((((p.v_books == 1 ? 0 : mj[jj]) * vks) << vshift) + (e - (mj[jj] << vshift))) >> 2;
                    }
                    const float4 *vb4 = reinterpret_cast<const float4 *>(vb);
                    if (L.pvec && vnb == 8) {
                        /* whole-byte codes: per position one code load (a byte of the staged row), one
                         * float4 gather and the GS probabilities as vector loads; base addresses
                         * hoisted out of the position loop */
                        const uint8_t *crow = reinterpret_cast<const uint8_t *>(VST(buf));
                        const char *cbase[EPL / 4 > 0 ? EPL / 4 : 1];
#pragma unroll
                        for (int jj = 0; jj < EPL / 4; jj++)
                            cbase[jj] = reinterpret_cast<const char *>(vb4 + (offj[jj] << rs) + rl);
                        const int rowb = 4 * L.v_stride, csh = cshift + rs + 4;  /* byte offset of a code */
                        const float *pt = pb;
#pragma unroll 2
                        for (int t = 0; t < n; t++, pt += GS, crow += rowb) {
                            float pr[GS];
                            load_probs<GS>(pt, pr);
#pragma unroll
                            for (int jj = 0; jj < EPL / 4; jj++) {
                                const int j = 4 * jj;
                                const float4 cv =
                                    *reinterpret_cast<const float4 *>(cbase[jj] + ((int)crow[mj[jj]] << csh));
#pragma unroll
                                for (int h = 0; h < GS; h++) {
                                    o[h][j] = fmaf(pr[h], cv.x, o[h][j]);
                                    o[h][j + 1] = fmaf(pr[h], cv.y, o[h][j + 1]);
                                    o[h][j + 2] = fmaf(pr[h], cv.z, o[h][j + 2]);
                                    o[h][j + 3] = fmaf(pr[h], cv.w, o[h][j + 3]);
                                }
                            }
                        }
                        return;
                    }
                    for (int t = 0; t < n; t++) {
                        const uint8_t *row = reinterpret_cast<const uint8_t *>(VST(buf) + t * L.v_stride);
                        float pr[GS];
#pragma unroll
                        for (int h = 0; h < GS; h++) pr[h] = pb[t * GS + h];
#pragma unroll
                        for (int jj = 0; jj < EPL / 4; jj++) {
                            const int j = 4 * jj;
                            int code = kvpq__get_code(row, mj[jj], vnb);
                            float4 cv = vb4[((offj[jj] + (code << cshift)) << rs) + rl];
#pragma unroll
                            for (int h = 0; h < GS; h++) {
                                o[h][j] = fmaf(pr[h], cv.x, o[h][j]);
                                o[h][j + 1] = fmaf(pr[h], cv.y, o[h][j + 1]);
                                o[h][j + 2] = fmaf(pr[h], cv.z, o[h][j + 2]);
                                o[h][j + 3] = fmaf(pr[h], cv.w, o[h][j + 3]);
                            }
                        }
                    }
                } else {
                    int mj[EPL], offj[EPL];
#pragma unroll
                    for (int j = 0; j < EPL; j++) {
                        int e = lane * EPL + j;
                        mj[j] = e >> vshift;
                        offj[j] = (((p.v_books == 1 ? 0 : mj[j]) * vks) << vshift) + (e - (mj[j] << vshift));
                    }
                    for (int t = 0; t < n; t++) {
                        const uint8_t *row = reinterpret_cast<const uint8_t *>(VST(buf) + t * L.v_stride);
                        float pr[GS];
#pragma unroll
                        for (int h = 0; h < GS; h++) pr[h] = pb[t * GS + h];
#pragma unroll
                        for (int j = 0; j < EPL; j++) {
                            int code = kvpq__get_code(row, mj[j], vnb);
                            float val = vb[offj[j] + (code << vshift)];
#pragma unroll
                            for (int h = 0; h < GS; h++) o[h][j] = fmaf(pr[h], val, o[h][j]);
                        }
                    }
                }
            };
            if (L.vbook_in_smem == 2) values(smem + L.vbook, 3, lane & 7);
            else if (L.vbook_in_smem) values(smem + L.vbook, 0, 0);
            else values(p.v_centroids, 0, 0);
            __syncwarp();
        }
#undef KST
#undef VST
    }

    /* ---- merge the warps of this CTA and write the partial {m, d, o} ---- */
    __syncthreads();  /* the LUT region is reused */
    float *mbuf = smem + L.lut;  /* (nw, GS, D + 2) */
    write_slots<D, GS>(mbuf, m_run, d_lane, o);
    __syncthreads();
    finish_cta<D, GS>(p, mbuf, nw, reinterpret_cast<int *>(smem + L.total - 4), b, head0, split);
}

/* ==== tensor-core path: shared key and value codebooks with dsub 4 and nbits 8 ====================
 *
 * Keys and values are dequantized into registers as float16 tensor-core fragments and multiplied on
 * tensor cores (mma.m16n8k16, float32 accumulate), instead of LUT sums and float32 FMAs. A warp takes
 * tiles of 32 positions (16 at head_dim 256), in halves of 16:
 *   scores  S (16 positions x 8 columns) = K^ (16 x 16 dims) . B over D/16 k-steps, where lane
 *           (r = lane/4, a = lane%4) gathers, for positions r and r + 8, the centroid of sub-space
 *           a*D/16 + kt (4 float16 = 8 bytes: exactly its a0..a7 fragment elements, because the four
 *           dims a fragment lane holds per row are declared to be one sub-vector's dims; the product
 *           is the same under any dim order used for both operands). B holds q' = Hadamard(q*lambda)
 *           * log2(e)/sqrt(D) as float16 hi/lo splits: for <= 4 heads per CTA columns 0..3 are the hi
 *           parts and 4..7 the lo parts (added with one shuffle), otherwise two mma per k-step;
 *   values  O^T (16 dims x 8 heads) += V^T (16 dims x 16 positions) . P (16 positions x 8 heads):
 *           lane r gathers its sub-space's centroid at positions a, a+4, a+8, a+12 (the k order of
 *           this mma) and re-pairs the halves (PRMT) into the A fragments of two dim tiles; P comes
 *           from the score fragments by four shuffles.
 * Gathers read the codebooks from shared memory as 16 bank-private replicas (lane l reads replica
 * l % 16: every 8-byte gather of a half-warp is conflict-free whatever the codes), key and value
 * entries of one centroid interleaved in 256 bytes, so that one PRMT turns a code byte into its
 * address. The image is built once per cache (kvpq_cuda_cache.tc_image, 64 KiB, codebooks scaled by
 * 2^k_exp / 2^v_exp to the top of float16's range; the scales are undone in float32). Code rows come
 * through a per-warp cp.async ring of kTcStages tiles. The online softmax {m, d, o} is the one of
 * the LUT path (log2 domain); o is rescaled only when a running max moves. */
constexpr int kSub = 16, kTcStages = 2;
/* A merge slot of the tensor-core kernel: {m, d}, then o from float tc_so(CL): 2 (as the LUT
 * kernel's slots), or 4 in the cluster-merge kernel (CL): 16-byte aligned, so that a lane's channels
 * are one vector access */
__host__ __device__ constexpr int tc_so(bool cl) { return cl ? 4 : 2; }

/* Halves of 16 positions per warp iteration: two (one max reduction, one rescale check per 32
 * positions), one at head_dim 256 (registers). */
__host__ __device__ constexpr int tc_halves(int D) { return D >= 256 ? 1 : 2; }

struct TcLayout {  /* dynamic shared memory, bytes */
    int qs, qexp, stage, total;  /* codebook image (and later the merge slots) at 0 */
    int cmd;                     /* the cluster kernel's CTA partial {m, d} (its o goes over q', at qs) */
};

/* Bytes of a ring slot: the key then value code rows of a tile, then (sc, norm-explicit
 * quantizers) its key then value float16 scales. */
__host__ __device__ constexpr int tc_slot_bytes(int D, bool sc) {
    return kSub * tc_halves(D) * 2 * (D / 4) + (sc ? kSub * tc_halves(D) * 2 * 2 : 0);
}

inline TcLayout tc_layout(int D, int gs, int nw, bool sc, bool cl = false) {
    TcLayout L;
    int o = 256 * 256, merge = nw * gs * (D + tc_so(cl)) * 4;
    if (o < merge) o = merge;
    L.qs = o;
    o += gs * D * 4;
    L.qexp = o;
    o += 8 * 4;
    L.cmd = o;  /* cluster merge: the CTA partial's {m, d} per head (its o goes over q', at qs) */
    if (cl) o += 8 * 2 * 4;
    o = (o + 15) & ~15;
    L.stage = o;
    o += nw * kTcStages * tc_slot_bytes(D, sc);
    o += 16;  /* the "last CTA" flag at total - 4 */
    L.total = o;
    return L;
}

/* 2^x (MUFU.EX2, flush-to-zero; 2^-inf = 0). */
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

/* Programmatic dependent launch (PTX griddepcontrol, sm_90): wait until the grid this one depends on
 * has finished and its memory is visible (returns at once for a plain launch), and let the next grid
 * of the stream be scheduled. Nothing before pdl_wait() may read what an earlier kernel of the stream
 * can write (q, outputs, workspace, counters). */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Thread-block clusters (sm_90): barrier.cluster with release / acquire orders each CTA's shared
 * memory writes before the other CTAs' reads of it (distributed shared memory: mapa gives the
 * address of the same byte in CTA `rank` of the cluster, ld.shared::cluster reads it). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define KVPQ_TC_CLUSTER 1
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
__device__ __forceinline__ uint32_t cluster_map(const void *ptr, int rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(r)
                 : "r"((uint32_t)__cvta_generic_to_shared(ptr)), "r"(rank));
    return r;
}
__device__ __forceinline__ float2 ld_cluster2(uint32_t a) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(a));
    return v;
}
__device__ __forceinline__ float4 ld_cluster4(uint32_t a) {
    float4 v;
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a));
    return v;
}
#endif

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

/* c += A . B, m16n8k16, float16 inputs, float32 accumulate (PTX ISA fragment layouts). */
__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


/* 8-byte gather of the image at byte offset `off` (shared memory). */
__device__ __forceinline__ uint2 tc_gather(const char *cb, uint32_t off) {
    return *reinterpret_cast<const uint2 *>(cb + off);
}

/* Load `B` bytes (2, 4, 8 or 16) of staged code row bytes at p as 32-bit words. */
template <int B>
__device__ __forceinline__ void load_code_words(const uint8_t *p, uint32_t (&w)[(B + 3) / 4]) {
    if constexpr (B == 2) {
        w[0] = *reinterpret_cast<const uint16_t *>(p);
    } else if constexpr (B == 4) {
        w[0] = *reinterpret_cast<const uint32_t *>(p);
    } else if constexpr (B == 8) {
        uint2 t = *reinterpret_cast<const uint2 *>(p);
        w[0] = t.x; w[1] = t.y;
    } else {
        uint4 t = *reinterpret_cast<const uint4 *>(p);
        w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
    }
}

/* Load `B` bytes (2, 4, 8 or 16) of code row bytes at p in device memory (the code pages, read-only
 * during an attention call) as 32-bit words, through the non-coherent path (RR kernel). */
template <int B>
__device__ __forceinline__ void load_code_words_g(const uint8_t *p, uint32_t (&w)[(B + 3) / 4]) {
    if constexpr (B == 2) {
        w[0] = __ldg(reinterpret_cast<const unsigned short *>(p));
    } else if constexpr (B == 4) {
        w[0] = __ldg(reinterpret_cast<const unsigned int *>(p));
    } else if constexpr (B == 8) {
        const uint2 t = __ldg(reinterpret_cast<const uint2 *>(p));
        w[0] = t.x; w[1] = t.y;
    } else {
        const uint4 t = __ldg(reinterpret_cast<const uint4 *>(p));
        w[0] = t.x; w[1] = t.y; w[2] = t.z; w[3] = t.w;
    }
}

/* Merge a warp's window state {m_run, d_lane, o} (window_part) into its merge slots (FlashAttention's
 * rule; a warp reads and writes only its own slots). */
template <int D, int GS, int SO>
__device__ __forceinline__ void tc_window_merge(float *mbuf, const float (&m_run)[GS], const float (&d_lane)[GS],
                                                const float (&o)[GS][D / 32]) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int h = 0; h < GS; h++) {
        float *slot = mbuf + ((size_t)warp * GS + h) * (D + SO);
        const float dw = warp_sum(d_lane[h]), ms = slot[0], mn = fmaxf(ms, m_run[h]);  /* m_run: finite */
        const float fs = ms == -INFINITY ? 0.f : exp2f(ms - mn), fw = exp2f(m_run[h] - mn);
        float *so = slot + SO + lane * EPL;
        if constexpr (SO % 4 == 0 && EPL % 4 == 0) {
#pragma unroll
            for (int j = 0; j < EPL; j += 4) {
                float4 v = *reinterpret_cast<float4 *>(so + j);
                v.x = fs * v.x + fw * o[h][j];
                v.y = fs * v.y + fw * o[h][j + 1];
                v.z = fs * v.z + fw * o[h][j + 2];
                v.w = fs * v.w + fw * o[h][j + 3];
                *reinterpret_cast<float4 *>(so + j) = v;
            }
        } else if constexpr (SO == 4 && EPL == 2) {
            float2 v = *reinterpret_cast<float2 *>(so);
            v.x = fs * v.x + fw * o[h][0];
            v.y = fs * v.y + fw * o[h][1];
            *reinterpret_cast<float2 *>(so) = v;
        } else {
#pragma unroll
            for (int j = 0; j < EPL; j++) slot[SO + lane * EPL + j] = fs * slot[SO + lane * EPL + j] + fw * o[h][j];
        }
        __syncwarp();
        if (lane == 0) {
            slot[0] = mn;
            slot[1] = fs * slot[1] + fw * dw;
        }
    }
    __syncwarp();
}

/* This warp's positions t0, t0 + stride, ... < w1 of the CTA's share of the float32 window, merged
 * into its slots. */
template <int D, int GS, int SO, bool VEC>
__device__ __forceinline__ void tc_window(const kvpq__attend_params &p, float *mbuf, int b, int kvh, int head0, int t0,
                                          int w1, int stride) {
    constexpr int EPL = D / 32;
    if (t0 >= w1) return;
    float m_run[GS], d_lane[GS], o[GS][EPL];
#pragma unroll
    for (int h = 0; h < GS; h++) {
        m_run[h] = -INFINITY;
        d_lane[h] = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) o[h][j] = 0.f;
    }
    window_part<D, GS, VEC>(p, b, kvh, head0, t0, w1, stride, m_run, d_lane, o);
    tc_window_merge<D, GS, SO>(mbuf, m_run, d_lane, o);
}

/* The code positions [c0, c1) of a CTA on the tensor-core path; leaves this warp's {m, d, o} in its
 * merge slots at smem (after a barrier: the slots overwrite the codebook image). Warps with no code
 * tile (when the CTA has fewer tiles than warps) take the CTA's window share [w0, w1) while the others
 * walk their tiles, and merge it into their slots; returns whether they did (uniform in the CTA: the
 * caller then has no window left). */
template <int D, int GS, int NW, bool SC, bool CL, bool RR>
__device__ __forceinline__ bool tc_codes(const kvpq__attend_params &p, const TcLayout &L, char *smem, int b, int kvh,
                                         int head0, int c0, int c1, int w0, int w1) {
    constexpr bool PACKED = GS <= 4;     /* hi and lo q parts in one mma (columns 0..3 and 4..7) */
    constexpr int KT = D / 16;           /* key k-steps = key code bytes per lane per position */
    constexpr int VT = D / 32;           /* value dim-tile pairs = value code bytes per lane per position */
    constexpr int CS = D / 4;            /* code bytes per position (M, nbits 8) */
    constexpr int HT = tc_halves(D), TILE = kSub * HT;  /* positions per warp iteration */
    constexpr int NST = kTcStages, SB = tc_slot_bytes(D, SC);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = NW;
    const int r = lane >> 2, a = lane & 3;
    /* replica of a gather: lane % 16 for keys; for values (lane % 16) ^ 4ti at position a + 4ti of a
     * half, so that a value sub-space's 16 positions of a half read 16 different replicas (the
     * image's dithered value rounding averages over them, see tc_dither); each gather of a
     * half-warp still reads 16 different replicas (conflict-free) */
    const uint32_t offk = (uint32_t)(lane & 15) * 8;
    uint32_t offv[4];
#pragma unroll
    for (int ti = 0; ti < 4; ti++) offv[ti] = 128 + (((uint32_t)lane & 15) ^ (4u * ti)) * 8;
    float *qs = reinterpret_cast<float *>(smem + L.qs);
    int *qexp = reinterpret_cast<int *>(smem + L.qexp);
    uint8_t *st = reinterpret_cast<uint8_t *>(smem + L.stage) + warp * NST * SB;

    /* state: running max and sum for heads hA, hA + 1 (score columns); o fragments (value tile pair
     * vt, dims 2j and 2j+1 of sub-space r*VT + vt, heads 2a and 2a + 1) */
    const int hA = PACKED ? 2 * (a & 1) : 2 * a;
    float mA = -INFINITY, mB = -INFINITY, dA = 0.f, dB = 0.f;
    float o[VT][2][4];
#pragma unroll
    for (int v = 0; v < VT; v++)
#pragma unroll
        for (int j = 0; j < 2; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[v][j][e] = 0.f;

    const int ntile = (c1 - c0 + TILE - 1) / TILE;
    const int my_n = warp < ntile ? (ntile - 1 - warp) / nw + 1 : 0;
    const size_t pstride = (size_t)p.n_head_kv * p.page_tokens * CS, hoff = (size_t)kvh * p.page_tokens * CS;
    /* code rows of this warp's k-th tile (positions c0 + (warp + k*nw)*TILE ...; TILE-aligned, so in
     * one page) into ring slot k % NST: key rows then value rows */
    auto issue = [&](int k) {
        const int t0 = c0 + (warp + k * nw) * TILE;
        const int page = p.page_table[(size_t)b * p.max_pages + (t0 >> p.page_shift)];
        const size_t roff = (size_t)page * pstride + hoff + (size_t)(t0 & (p.page_tokens - 1)) * CS;
        uint8_t *dst = st + (k % NST) * SB;
        constexpr int NCH = TILE * CS / 16;
#pragma unroll
        for (int i = lane; i < 2 * NCH; i += 32) {
            const uint8_t *src = i < NCH ? p.k_pages + roff + i * 16 : p.v_pages + roff + (i - NCH) * 16;
            __pipeline_memcpy_async(dst + i * 16, src, 16);
        }
        if constexpr (SC) {
            /* the tile's float16 scales (TILE-aligned: whole 16-byte chunks), key then value; a
             * plain kind's stay unread */
            constexpr int NSC = TILE * 2 / 16;
            const size_t soff = ((size_t)page * p.n_head_kv + kvh) * p.page_tokens + (t0 & (p.page_tokens - 1));
            if (lane < 2 * NSC) {
                const uint16_t *sbase = lane < NSC ? p.k_scales : p.v_scales;
                if (sbase)
                    __pipeline_memcpy_async(dst + 2 * TILE * CS + lane * 16,
                                            reinterpret_cast<const uint8_t *>(sbase + soff) + (lane % NSC) * 16, 16);
            }
        }
    };
    /* RR: the code rows straight from device memory into registers, no shared-memory staging. Lane
     * (r, a) holds, for each half h of the tile, the key words of rows 16h + r and 16h + r + 8 at byte
     * a*KT (the bytes its A-fragment gathers need) and the value words of rows 16h + a + 4ti at byte
     * r*VT (and, norm-explicit, the float16 scales of positions 16h + r, 16h + r + 8). Software-
     * pipelined one tile ahead: the next tile's key words are loaded as soon as this tile's scores
     * are taken, its value words of half h as soon as this tile's half h is summed. */
    constexpr int KW = (KT + 3) / 4, VW = (VT + 3) / 4;
    uint32_t rk[HT][2][KW], rv[HT][4][VW];
    __half rks[HT][2], rvs[HT][2];
    size_t rroff = 0, rsoff = 0; /* the tile whose rows are being loaded: code row and scale offsets */
    auto rr_locate = [&](int k) {
        const int t0 = c0 + (warp + k * nw) * TILE;
        const int page = p.page_table[(size_t)b * p.max_pages + (t0 >> p.page_shift)];
        rroff = (size_t)page * pstride + hoff + (size_t)(t0 & (p.page_tokens - 1)) * CS;
        rsoff = ((size_t)page * p.n_head_kv + kvh) * p.page_tokens + (t0 & (p.page_tokens - 1));
    };
    auto rr_keys = [&]() {
#pragma unroll
        for (int h = 0; h < HT; h++) {
            load_code_words_g<KT>(p.k_pages + rroff + (size_t)(16 * h + r) * CS + a * KT, rk[h][0]);
            load_code_words_g<KT>(p.k_pages + rroff + (size_t)(16 * h + r + 8) * CS + a * KT, rk[h][1]);
            if constexpr (SC) {
                rks[h][0] = rks[h][1] = __ushort_as_half((unsigned short)0);
                if (p.k_scales) {
                    rks[h][0] = __ushort_as_half(__ldg(p.k_scales + rsoff + 16 * h + r));
                    rks[h][1] = __ushort_as_half(__ldg(p.k_scales + rsoff + 16 * h + r + 8));
                }
            }
        }
    };
    auto rr_vals = [&](int h) {
#pragma unroll
        for (int ti = 0; ti < 4; ti++)
            load_code_words_g<VT>(p.v_pages + rroff + (size_t)(16 * h + a + 4 * ti) * CS + r * VT, rv[h][ti]);
        if constexpr (SC) {
            rvs[h][0] = rvs[h][1] = __ushort_as_half((unsigned short)0);
            if (p.v_scales) {
                rvs[h][0] = __ushort_as_half(__ldg(p.v_scales + rsoff + 16 * h + r));
                rvs[h][1] = __ushort_as_half(__ldg(p.v_scales + rsoff + 16 * h + r + 8));
            }
        }
    };
    if (c0 < c1) {
        /* the codebook image, then the first sub-tiles, in flight while q' is computed */
        for (int i = tid; i < 256 * 256 / 16; i += nw * 32)
            __pipeline_memcpy_async(smem + i * 16, reinterpret_cast<const uint4 *>(p.tc_image) + i, 16);
        __pipeline_commit();
        for (int k = 0; k < NST - 1; k++) {
            if constexpr (!RR) {
                if (k < my_n) issue(k);
            }
            __pipeline_commit();
        }
        if constexpr (RR) {
            if (my_n > 0) {
                rr_locate(0);
                rr_keys();
#pragma unroll
                for (int h = 0; h < HT; h++) rr_vals(h);
            }
        }
    }
    /* everything above reads only the image, the page table, the lengths and the code pages (written
     * by appends, which synchronize): with a programmatic dependent launch it overlaps the previous
     * kernel of the stream; q, the window's use of it and every write come after the wait */
    pdl_wait();
    pdl_trigger();
    if (c0 < c1) {
        if (warp < GS) {  /* q' = Hadamard(q * lambda) * log2(e)/sqrt(D), scaled by 2^qexp to float16's top */
            constexpr int EPL = D / 32;
            float v[EPL], mx = 0.f;
#pragma unroll
            for (int j = 0; j < EPL; j++) {
                v[j] = p.q[((size_t)b * p.n_head + head0 + warp) * D + lane * EPL + j];
                if (p.k_lambda) v[j] *= p.k_lambda[(size_t)kvh * D + lane * EPL + j];
            }
            kvpq__warp_fwht<EPL>(v, lane);
            const float scale = 1.4426950408889634f * rsqrtf((float)D);
#pragma unroll
            for (int j = 0; j < EPL; j++) {
                v[j] *= scale;
                mx = fmaxf(mx, fabsf(v[j]));
            }
            mx = warp_max(mx);
            int ex = 0;
            if (mx > 0.f) frexpf(mx, &ex);
            const int e = mx > 0.f ? 15 - ex : 0;
#pragma unroll
            for (int j = 0; j < EPL; j++) qs[warp * D + lane * EPL + j] = ldexpf(v[j], e);
            if (lane == 0) qexp[warp] = e;
        }
        __pipeline_wait_prior(NST - 1);  /* this thread's part of the image */
    }
    __syncthreads();
    if (c0 < c1) {
        /* B fragments of q': lane (r, a), k-step kt: sub-space a*KT + kt of column r */
        constexpr int NB = PACKED ? 1 : 2;
        uint32_t qb[NB][KT][2];
#pragma unroll
        for (int part = 0; part < NB; part++) {
            const int h = PACKED ? (r & 3) : r, lo = PACKED ? (r >> 2) : part;
#pragma unroll
            for (int kt = 0; kt < KT; kt++) {
                float x[4] = {0.f, 0.f, 0.f, 0.f};
                if (h < GS) {
                    const float4 t = *reinterpret_cast<const float4 *>(qs + h * D + 4 * (a * KT + kt));
                    x[0] = t.x; x[1] = t.y; x[2] = t.z; x[3] = t.w;
                }
                __half hh[4];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    hh[e] = __float2half_rn(x[e]);
                    if (lo) hh[e] = __float2half_rn(x[e] - __half2float(hh[e]));
                }
                qb[part][kt][0] = kvpq__h2_bits(__halves2half2(hh[0], hh[1]));
                qb[part][kt][1] = kvpq__h2_bits(__halves2half2(hh[2], hh[3]));
            }
        }
        /* scores times fA / fB undo the codebook and q' scales */
        const float fA = hA < GS ? ldexpf(1.f, -(p.tc_kexp + qexp[hA])) : 0.f;
        const float fB = hA + 1 < GS ? ldexpf(1.f, -(p.tc_kexp + qexp[hA + 1])) : 0.f;
        const char *cb = smem;

        for (int k = 0; k < my_n; k++) {
            if constexpr (!RR) {
                if (k + NST - 1 < my_n) issue(k + NST - 1);
                __pipeline_commit();
                __pipeline_wait_prior(NST - 1);
                __syncwarp();
            }
            const uint8_t *kb = st + (k % NST) * SB, *vb = kb + TILE * CS;
            const int n = min(TILE, c1 - (c0 + (warp + k * nw) * TILE));

            /* ---- scores of the HT halves (16 positions each): s[h] = [pos r, hA], [r, hA+1], [r+8, hA],
             * [r+8, hA+1] ---- */
            float s[HT][4];
#pragma unroll
            for (int h = 0; h < HT; h++) {
                uint32_t kw0[KW], kw1[KW];
                if constexpr (RR) {
#pragma unroll
                    for (int i = 0; i < KW; i++) {
                        kw0[i] = rk[h][0][i];
                        kw1[i] = rk[h][1][i];
                    }
                } else {
                    load_code_words<KT>(kb + (16 * h + r) * CS + a * KT, kw0);
                    load_code_words<KT>(kb + (16 * h + r + 8) * CS + a * KT, kw1);
                }
                /* packed: even and odd k-steps in two accumulators (two independent mma chains);
                 * otherwise the hi and lo parts */
                float c[2][4];
#pragma unroll
                for (int e = 0; e < 8; e++) c[e >> 2][e & 3] = 0.f;
#pragma unroll
                for (int kt = 0; kt < KT; kt++) {
                    const uint32_t sel = 0x5504u | ((uint32_t)(kt & 3) << 4);
                    const uint2 g0 = tc_gather(cb, prmt(kw0[kt >> 2], offk, sel));
                    const uint2 g1 = tc_gather(cb, prmt(kw1[kt >> 2], offk, sel));
                    if constexpr (PACKED) {
                        mma_16816(c[kt & 1], g0.x, g1.x, g0.y, g1.y, qb[0][kt][0], qb[0][kt][1]);
                    } else {
                        mma_16816(c[0], g0.x, g1.x, g0.y, g1.y, qb[0][kt][0], qb[0][kt][1]);
                        mma_16816(c[1], g0.x, g1.x, g0.y, g1.y, qb[NB - 1][kt][0], qb[NB - 1][kt][1]);
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = c[0][e] + c[1][e];
                    if constexpr (PACKED) v += __shfl_xor_sync(KVPQ_FULL_MASK, v, 2);
                    s[h][e] = v * ((e & 1) ? fB : fA);
                }
                if constexpr (SC) {
                    if (p.k_scales) { /* norm-explicit keys: score = s_k * (q' . r); rows r, r + 8 */
                        const __half *ksc = reinterpret_cast<const __half *>(kb + 2 * TILE * CS) + 16 * h + r;
                        const float k0 = __half2float(RR ? rks[h][0] : ksc[0]), k8 = __half2float(RR ? rks[h][1] : ksc[8]);
                        s[h][0] *= k0;
                        s[h][1] *= k0;
                        s[h][2] *= k8;
                        s[h][3] *= k8;
                    }
                }
                if (16 * h + r >= n) s[h][0] = s[h][1] = -INFINITY;
                if (16 * h + r + 8 >= n) s[h][2] = s[h][3] = -INFINITY;
            }
            if constexpr (RR) { /* the next tile's key words (and key scales), in flight from here */
                if (k + 1 < my_n) {
                    rr_locate(k + 1);
                    rr_keys();
                }
            }

            /* ---- online softmax over the tile ---- */
            float xA = fmaxf(s[0][0], s[0][2]), xB = fmaxf(s[0][1], s[0][3]);
#pragma unroll
            for (int h = 1; h < HT; h++) {
                xA = fmaxf(xA, fmaxf(s[h][0], s[h][2]));
                xB = fmaxf(xB, fmaxf(s[h][1], s[h][3]));
            }
#pragma unroll
            for (int sh = 4; sh < 32; sh <<= 1) {
                xA = fmaxf(xA, __shfl_xor_sync(KVPQ_FULL_MASK, xA, sh));
                xB = fmaxf(xB, __shfl_xor_sync(KVPQ_FULL_MASK, xB, sh));
            }
            const float nA = fmaxf(mA, xA), nB = fmaxf(mB, xB);
            if (__any_sync(KVPQ_FULL_MASK, nA > mA || nB > mB)) {
                const float kA = ex2(mA - nA), kB = ex2(mB - nB);
                dA *= kA;
                dB *= kB;
#pragma unroll
                for (int v = 0; v < VT; v++)
#pragma unroll
                    for (int j = 0; j < 2; j++) {
                        o[v][j][0] *= kA; o[v][j][2] *= kA;
                        o[v][j][1] *= kB; o[v][j][3] *= kB;
                    }
                mA = nA;
                mB = nB;
            }
            const int srcA = 4 * a + (r >> 1), srcB = srcA + 16;
#pragma unroll
            for (int h = 0; h < HT; h++) {
                const float p0 = ex2(s[h][0] - mA), p1 = ex2(s[h][1] - mB), p2 = ex2(s[h][2] - mA), p3 = ex2(s[h][3] - mB);
                dA += p0 + p2;
                dB += p1 + p3;
                /* P as the B fragment of the value mma. Its k index i stands for position pi(i) of the
                 * half, pi(2a) = a, pi(2a+1) = a+4, pi(2a+8) = a+8, pi(2a+9) = a+12 (any order serves
                 * when A uses the same; this one puts the value code rows a lane reads, a + 4*ti, in
                 * different banks). Lane (r, a) takes column (head) r of positions a, a+8 from lane
                 * 4a + r/2 and of a+4, a+12 from lane 4a + 16 + r/2. */
                /* float16 P scaled by 2^14 (undone with the value scale): probabilities down to 2^-38
                 * of the running max stay normal float16 numbers */
                float ps0 = 16384.f, ps8 = 16384.f;
                if constexpr (SC) {
                    if (p.v_scales) { /* norm-explicit values: P = p s_v 2^(14 - sexp) (d keeps p) */
                        const __half *vsc = reinterpret_cast<const __half *>(kb + 2 * TILE * CS) + TILE + 16 * h + r;
                        ps0 = __half2float(RR ? rvs[h][0] : vsc[0]) * p.tc_pscale;
                        ps8 = __half2float(RR ? rvs[h][1] : vsc[8]) * p.tc_pscale;
                    }
                }
                const uint32_t X0 = kvpq__h2_bits(__floats2half2_rn(p0 * ps0, p2 * ps8)),
                               X1 = kvpq__h2_bits(__floats2half2_rn(p1 * ps0, p3 * ps8));
                const uint32_t yA0 = __shfl_sync(KVPQ_FULL_MASK, X0, srcA), yA1 = __shfl_sync(KVPQ_FULL_MASK, X1, srcA);
                const uint32_t yB0 = __shfl_sync(KVPQ_FULL_MASK, X0, srcB), yB1 = __shfl_sync(KVPQ_FULL_MASK, X1, srcB);
                const uint32_t ya = (r & 1) ? yA1 : yA0, yb = (r & 1) ? yB1 : yB0;
                const uint32_t pb0 = prmt(ya, yb, 0x5410), pb1 = prmt(ya, yb, 0x7632);

                /* ---- values of the half ---- */
                uint32_t vw[4][VW];
#pragma unroll
                for (int ti = 0; ti < 4; ti++) {
                    if constexpr (RR) {
#pragma unroll
                        for (int i = 0; i < VW; i++) vw[ti][i] = rv[h][ti][i];
                    } else {
                        load_code_words<VT>(vb + (16 * h + a + 4 * ti) * CS + r * VT, vw[ti]);
                    }
                }
#pragma unroll
                for (int vt = 0; vt < VT; vt++) {
                    const uint32_t sel = 0x5504u | ((uint32_t)(vt & 3) << 4);
                    uint2 g[4];
#pragma unroll
                    for (int ti = 0; ti < 4; ti++) g[ti] = tc_gather(cb, prmt(vw[ti][vt >> 2], offv[ti], sel));
                    mma_16816(o[vt][0], prmt(g[0].x, g[1].x, 0x5410), prmt(g[0].x, g[1].x, 0x7632),
                              prmt(g[2].x, g[3].x, 0x5410), prmt(g[2].x, g[3].x, 0x7632), pb0, pb1);
                    mma_16816(o[vt][1], prmt(g[0].y, g[1].y, 0x5410), prmt(g[0].y, g[1].y, 0x7632),
                              prmt(g[2].y, g[3].y, 0x5410), prmt(g[2].y, g[3].y, 0x7632), pb0, pb1);
                }
                if constexpr (RR) { /* the next tile's value words of this half */
                    if (k + 1 < my_n) rr_vals(h);
                }
            }
            __syncwarp();
        }
    }
    /* warps without a tile take the window now, while the others walk their tiles (its state stays
     * in registers over the barrier: the slots overwrite the image only after it) */
    const int busy = c0 < c1 ? min(ntile, nw) : 0, n_free = nw - busy;
    constexpr int WEPL = D / 32;
    float wm[GS], wd[GS], wo[GS][WEPL];
    const bool early = CL && n_free > 0 && warp >= busy && w0 + (warp - busy) < w1;
    if (early) {
#pragma unroll
        for (int h = 0; h < GS; h++) {
            wm[h] = -INFINITY;
            wd[h] = 0.f;
#pragma unroll
            for (int j = 0; j < WEPL; j++) wo[h][j] = 0.f;
        }
        window_part<D, GS, CL>(p, b, kvh, head0, w0 + (warp - busy), w1, n_free, wm, wd, wo);
    }
    __pipeline_wait_prior(0);
    __syncthreads();  /* the slots below overwrite the codebook image */

    /* ---- this warp's merge slots (nw, GS, D + tc_so(CL)): heads 2a, 2a + 1 (packed: lanes a < 2) ---- */
#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
        dA += __shfl_xor_sync(KVPQ_FULL_MASK, dA, sh);
        dB += __shfl_xor_sync(KVPQ_FULL_MASK, dB, sh);
    }
    float *mbuf = reinterpret_cast<float *>(smem);
    /* the value image's scale and P's 2^14 (2^(14 - sexp) with value scales) */
    const float vinv = ldexpf(1.f, -(p.tc_vexp + 14 - (SC && p.v_scales ? p.tc_sexp : 0)));
    if (!PACKED || a < 2) {
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
            const int h = 2 * a + hh;
            if (h >= GS) continue;
            float *slot = mbuf + ((size_t)warp * GS + h) * (D + tc_so(CL));
            if (r == 0) {
                slot[0] = hh ? mB : mA;
                slot[1] = hh ? dB : dA;
            }
#pragma unroll
            for (int vt = 0; vt < VT; vt++) {
                const int e0 = 4 * (r * VT + vt);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    if constexpr (CL) { /* 16-byte-aligned slots: the pair as one 8-byte store */
                        *reinterpret_cast<float2 *>(slot + tc_so(CL) + e0 + 2 * j) =
                            make_float2(o[vt][j][hh] * vinv, o[vt][j][2 + hh] * vinv);
                    } else {
                        slot[tc_so(CL) + e0 + 2 * j] = o[vt][j][hh] * vinv;
                        slot[tc_so(CL) + e0 + 2 * j + 1] = o[vt][j][2 + hh] * vinv;
                    }
                }
            }
        }
    }
    __syncwarp();
    if (early) tc_window_merge<D, GS, tc_so(CL)>(mbuf, wm, wd, wo);
    return CL && n_free > 0;
}

/* The split merge through a thread-block cluster (the CL kernel: the launcher made the n_splits
 * CTAs of a (sequence, head group) one cluster). Each CTA merges its warps as finish_cta does, but
 * into its own shared memory (o at cpo (GS, D), {m, d} at cmd (GS, 2)); after a cluster barrier a
 * warp per query head (head h: CTA h % n_splits, warp h / n_splits) reads every split's partial from
 * distributed shared memory (all loads in flight at once) and merges them with finish_cta's last-CTA
 * arithmetic, in the same order, so the output has the same bits. No workspace in device memory,
 * no fence, no ticket; a second cluster barrier keeps every CTA's shared memory until it was read. */
#ifdef KVPQ_TC_CLUSTER
template <int D, int GS>
__device__ void finish_cluster(const kvpq__attend_params &p, const float *mbuf, int nw, float *cpo, float *cmd, int b,
                               int head0, int split) {
    constexpr int EPL = D / 32, U = D <= 128 ? 16 : 8;  /* partials in flight per lane (registers) */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nthr = nw * 32;
    const int nsp = gridDim.x;  /* the cluster: every split of this (sequence, head group), <= 16 */
    for (int i = tid; i < GS * D; i += nthr) {
        int h = i / D, e = i - h * D;
        float mx = -INFINITY;
        for (int w = 0; w < nw; w++) mx = fmaxf(mx, mbuf[((size_t)w * GS + h) * (D + tc_so(true))]);
        float dd = 0.f, oo = 0.f;
        if (mx != -INFINITY) {
            for (int w = 0; w < nw; w++) {
                const float *slot = mbuf + ((size_t)w * GS + h) * (D + tc_so(true));
                float sc = exp2f(slot[0] - mx);
                dd += sc * slot[1];
                oo += sc * slot[tc_so(true) + e];
            }
        }
        cpo[h * D + e] = oo;
        if (e == 0) {
            cmd[2 * h] = mx;
            cmd[2 * h + 1] = dd;
        }
    }
    cluster_arrive();
    cluster_wait();
    const int head = warp * nsp + split; /* this warp's query head within the group, if < GS */
    float acc[EPL];
    float mx = -INFINITY, dd = 0.f;
    if (head < GS) {
        /* lane s < nsp: split s's {m, d}; the first U splits' o requested at the same time */
        const uint32_t md_a = cluster_map(cmd + 2 * head, lane < nsp ? lane : 0);
        const float2 md = lane < nsp ? ld_cluster2(md_a) : make_float2(-INFINITY, 0.f);
        float po[U][EPL];
        auto load_o = [&](int s0) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (s0 + u < nsp) {
                    const uint32_t a = cluster_map(cpo + head * D + lane * EPL, s0 + u);
#pragma unroll
                    for (int j = 0; j < EPL; j += 4) {
                        if constexpr (EPL >= 4) {
                            const float4 v = ld_cluster4(a + j * 4);
                            po[u][j] = v.x, po[u][j + 1] = v.y, po[u][j + 2] = v.z, po[u][j + 3] = v.w;
                        } else {
                            const float2 v = ld_cluster2(a);
                            po[u][0] = v.x, po[u][1] = v.y;
                        }
                    }
                }
            }
        };
        load_o(0);
        if (md.x != -INFINITY) { /* finish_cta's lane merge, with one split per lane */
            const float mn = fmaxf(mx, md.x);
            dd = dd * (mx == -INFINITY ? 0.f : exp2f(mx - mn)) + md.y * exp2f(md.x - mn);
            mx = mn;
        }
#pragma unroll
        for (int o = 16; o; o >>= 1) {
            const float mo = __shfl_xor_sync(KVPQ_FULL_MASK, mx, o), d_o = __shfl_xor_sync(KVPQ_FULL_MASK, dd, o);
            const float mn = fmaxf(mx, mo);
            dd = (mx == -INFINITY ? 0.f : dd * exp2f(mx - mn)) + (mo == -INFINITY ? 0.f : d_o * exp2f(mo - mn));
            mx = mn;
        }
#pragma unroll
        for (int j = 0; j < EPL; j++) acc[j] = 0.f;
        for (int s0 = 0; s0 < nsp; s0 += U) {
            if (s0) load_o(s0);
#pragma unroll
            for (int u = 0; u < U; u++) {
                const float m = __shfl_sync(KVPQ_FULL_MASK, md.x, (s0 + u) & 31);
                if (s0 + u < nsp) {
                    const float sc = m == -INFINITY ? 0.f : exp2f(m - mx);
#pragma unroll
                    for (int j = 0; j < EPL; j++) acc[j] = fmaf(sc, po[u][j], acc[j]);
                }
            }
        }
    }
    cluster_arrive(); /* this CTA's reads are done: the others may exit */
    if (head < GS) {
        float inv = 1.f / dd;
#pragma unroll
        for (int j = 0; j < EPL; j++) acc[j] *= inv;
        if (p.lse && lane == 0) p.lse[(size_t)b * p.n_head + head0 + head] = mx * 0.69314718f + logf(dd);
        if (p.v_rotate) kvpq__warp_fwht<EPL>(acc, lane);
        float *dst = p.out + ((size_t)b * p.n_head + head0 + head) * D + lane * EPL;
#pragma unroll
        for (int j = 0; j < EPL; j++) dst[j] = acc[j];
    }
    cluster_wait();
}
#endif

/* CL: the cluster-merge kernel (launched as clusters of the n_splits CTAs of a (sequence, head
 * group); finish_cluster), which also has the 16-byte-aligned slots, the window's 16-byte loads and
 * its warps without a code tile taking the window while the others walk theirs (tc_codes); the
 * other instantiation is the kernel of sessions 7-11, merging through device memory (finish_cta). */
template <int D, int GS, int NW, bool SC, bool CL, bool RR>
__global__ void __launch_bounds__(NW * 32, 16 / NW) attend_tc_kernel(kvpq__attend_params p, TcLayout L) {
    extern __shared__ __align__(16) char smem_tc[];
    const int split = blockIdx.x, b = blockIdx.z;
    const int groups = p.n_head / p.n_head_kv / GS;
    const int kvh = blockIdx.y / groups, head0 = kvh * (p.n_head / p.n_head_kv) + (blockIdx.y % groups) * GS;
    float *mbuf = reinterpret_cast<float *>(smem_tc);
    const int len = p.seq_len[b], win = min(p.window, len), coded = len - win;
    const int c0 = split * p.chunk, c1 = min(c0 + p.chunk, coded);
    /* every CTA also takes 1/n_splits of the window (no window CTAs: no second wave of CTAs); its rows
     * are requested into L2 now (the window ring is written by appends only, so this may run before
     * the programmatic-launch wait in tc_codes), so that tc_window finds them there */
    const int w0 = coded + (int)((long long)win * split / p.n_splits), w1 = coded + (int)((long long)win * (split + 1) / p.n_splits);
    {
        const int lane = threadIdx.x & 31;
        for (int t = w0 + (int)(threadIdx.x >> 5); t < w1; t += NW) {
            const size_t row = (((size_t)b * p.window + t % p.window) * p.n_head_kv + kvh) * D + lane * (D / 32);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p.k_win + row));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(p.v_win + row));
        }
    }
    if (!tc_codes<D, GS, NW, SC, CL, RR>(p, L, smem_tc, b, kvh, head0, c0, c1, w0, w1))
        tc_window<D, GS, tc_so(CL), CL>(p, mbuf, b, kvh, head0, w0 + (int)(threadIdx.x >> 5), w1, NW);
    __syncthreads();
#ifdef KVPQ_TC_CLUSTER
    if constexpr (CL) {
        finish_cluster<D, GS>(p, mbuf, NW, reinterpret_cast<float *>(smem_tc + L.qs),
                              reinterpret_cast<float *>(smem_tc + L.cmd), b, head0, split);
        return;
    }
#endif
    /* (below sm_90 the CL kernel, never launched as a cluster there, merges this way too) */
    finish_cta<D, GS, tc_so(CL)>(p, mbuf, NW, reinterpret_cast<int *>(smem_tc + L.total - 4), b, head0, split);
}

/* Heads per CTA: the largest divisor of the group size (<= 8) whose LUTs fit in shared memory. */
kvpq_status plan(const kvpq__attend_params &p, int lut16, int vrep, int max_nw, int *gs_out, Layout *L_out) {
    size_t optin = 0;
    KVPQ_TRY(kvpq__cuda_props(NULL, &optin));
    int g = p.n_head / p.n_head_kv;
    /* prefer all heads in one CTA (codes read once), then more warps, then the value codebook in
     * shared memory (replicated where possible) */
    for (int gs = g < 8 ? g : 8; gs >= 1; gs--) {
        if (g % gs) continue;
        for (int nw = max_nw; nw >= 8; nw /= 2) {
            for (int vb = vrep && vrep_ok(p) ? 2 : 1; vb >= 0; vb--) {
                Layout L = make_layout(p, gs, vb, nw, lut16);
                if ((size_t)L.total * 4 <= optin) {
                    *gs_out = gs;
                    *L_out = L;
                    return KVPQ_OK;
                }
            }
        }
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                     "cuda attend: the key LUT of one query head (M=%d x ksub=%d floats) does not fit in %zu bytes of "
                     "shared memory",
                     p.head_dim / p.k_dsub, p.k_ksub, optin);
}

/* Splits over the sequence so that the grid fills the GPU once (ctas_per_sm resident CTAs per SM),
 * each CTA at least min_chunk positions. */
void plan_splits(kvpq__attend_params *p, int min_chunk, int gs, int B, int max_coded, int max_splits, int n_sm,
                 int ctas_per_sm) {
    if (ctas_per_sm < 1) ctas_per_sm = 1;
    int pairs = B * p->n_head_kv * (p->n_head / p->n_head_kv / gs);
    int splits = n_sm * ctas_per_sm / pairs;
    int max_by_len = (max_coded + min_chunk - 1) / min_chunk;
    if (splits > max_by_len) splits = max_by_len;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    int chunk = (max_coded + splits - 1) / splits;
    chunk = (chunk + 31) & ~31;
    if (chunk < 32) chunk = 32;
    p->chunk = chunk;
    p->n_splits = (max_coded + chunk - 1) / chunk;
    if (p->n_splits < 1) p->n_splits = 1;
    p->n_wsplits = p->window > 0 ? (p->window + kWindowChunk - 1) / kWindowChunk : 1;
}

template <int D, int GS, typename LT, bool SC>
kvpq_status launch_split(kvpq__attend_params &p, const Layout &L, int B, int max_coded, int max_splits,
                         cudaStream_t stream) {
    size_t bytes = (size_t)L.total * 4;
    auto kern = attend_split_kernel<D, GS, LT, SC>;
    KVPQ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                  "cuda attend: shared memory attribute");
    int n_sm = 0, per_sm = 1;
    KVPQ_TRY(kvpq__cuda_props(&n_sm, NULL));
    KVPQ_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, L.nw * 32, bytes),
                  "cuda attend: occupancy");
    plan_splits(&p, L.nw * 32, GS, B, max_coded, max_splits, n_sm, per_sm);
    dim3 grid(p.n_splits + p.n_wsplits, p.n_head_kv * (p.n_head / p.n_head_kv / GS), B);
    kern<<<grid, L.nw * 32, bytes, stream>>>(p, L);
    return kvpq__cuda_err(cudaGetLastError(), "cuda attend kernel launch");
}

template <int D, int GS>
kvpq_status launch_lut(kvpq__attend_params &p, const Layout &L, int B, int max_coded, int max_splits,
                       cudaStream_t stream) {
    if (p.k_scales || p.v_scales) { /* norm-explicit quantizers */
        if (L.lut16) return launch_split<D, GS, __half, true>(p, L, B, max_coded, max_splits, stream);
        return launch_split<D, GS, float, true>(p, L, B, max_coded, max_splits, stream);
    }
    if (L.lut16) return launch_split<D, GS, __half, false>(p, L, B, max_coded, max_splits, stream);
    return launch_split<D, GS, float, false>(p, L, B, max_coded, max_splits, stream);
}

template <int D>
kvpq_status launch_d(kvpq__attend_params &p, const Layout &L, int gs, int B, int max_coded, int max_splits,
                     cudaStream_t stream) {
#ifdef KVPQ_ATTEND_DEV_SHAPES
    if (gs == 4) return launch_lut<D, 4>(p, L, B, max_coded, max_splits, stream);
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: built with KVPQ_ATTEND_DEV_SHAPES (4 heads per CTA only)");
#else
    switch (gs) {
    case 1: return launch_lut<D, 1>(p, L, B, max_coded, max_splits, stream);
    case 2: return launch_lut<D, 2>(p, L, B, max_coded, max_splits, stream);
    case 3: return launch_lut<D, 3>(p, L, B, max_coded, max_splits, stream);
    case 4: return launch_lut<D, 4>(p, L, B, max_coded, max_splits, stream);
    case 5: return launch_lut<D, 5>(p, L, B, max_coded, max_splits, stream);
    case 6: return launch_lut<D, 6>(p, L, B, max_coded, max_splits, stream);
    case 7: return launch_lut<D, 7>(p, L, B, max_coded, max_splits, stream);
    case 8: return launch_lut<D, 8>(p, L, B, max_coded, max_splits, stream);
    }
    return kvpq__err(KVPQ_ERR_INTERNAL, "cuda attend: heads per CTA %d", gs);
#endif
}

/* Query heads per CTA of the tensor-core kernel: the largest divisor of the group size up to 8, or
 * up to kernels.attend_tc_heads where that is set (> 0). */
int tc_gs(const kvpq__attend_params &p) {
    int g = p.n_head / p.n_head_kv, cap = p.tc_heads > 0 && p.tc_heads < 8 ? p.tc_heads : 8, gs = g < cap ? g : cap;
    while (g % gs) gs--;
    return gs;
}

/* Whether the tensor-core path takes this configuration (see attend_tc_kernel): the codebooks, pages
 * of 2^page_shift >= 32 positions (tiles never straddle pages), and an 8-warp CTA's shared memory
 * within the device's opt-in limit (e.g. 99 KiB on consumer GPUs: head_dim 128 fits with up to 4
 * heads per CTA); otherwise the LUT kernel runs. */
bool tc_ok(const kvpq__attend_params &p) {
    if (!(p.tc_image && p.k_books == 1 && p.v_books == 1 && p.k_dsub == 4 && p.v_dsub == 4 && p.k_nbits == 8 &&
          p.v_nbits == 8 && p.k_code_size == p.head_dim / 4 && p.v_code_size == p.head_dim / 4 && p.page_shift >= 5))
        return false;
    size_t optin = 0;
    if (kvpq__cuda_props(NULL, &optin) != KVPQ_OK) return false;
    return (size_t)tc_layout(p.head_dim, tc_gs(p), 8, p.k_scales || p.v_scales).total <= optin;
}

/* Clusters: at most 16 CTAs (Hopper; more than 8 non-portable); the merge through one is used for
 * at most kTcClusterWide splits (launch_tc_nw says why). */
constexpr int kTcMaxCluster = 16, kTcClusterWide = 8;

/* How many clusters of n CTAs (threads, smem bytes) of kernel `kern` can be resident at once
 * (cudaOccupancyMaxActiveClusters; 0 below compute capability 9.0 or on any error, which is
 * cleared), asked once per kernel and n (the answer kept in `known` as count + 1; one device per
 * process, as kvpq__cuda_props assumes). */
template <typename K>
int tc_cluster_max(K kern, int n, int threads, int smem, int (&known)[kTcMaxCluster + 1]) {
    if (n < 1 || n > kTcMaxCluster) return 0;
    if (known[n]) return known[n] - 1;
    int nc = 0, dev = 0, major = 0;
    if (cudaGetDevice(&dev) == cudaSuccess && cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
        major >= 9) {
        cudaError_t e = cudaSuccess;
        if (n > 8) e = cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = (unsigned)n;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = 1;
        cfg.gridDim = dim3((unsigned)n, 1, 1);
        cfg.blockDim = dim3((unsigned)threads);
        cfg.dynamicSmemBytes = (size_t)smem;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        if (e == cudaSuccess) e = cudaOccupancyMaxActiveClusters(&nc, kern, &cfg);
        if (e != cudaSuccess) {
            (void)cudaGetLastError();
            nc = 0;
        }
    }
    known[n] = nc + 1;
    return nc;
}

/* One launch of kernel `kern` (layout L) on grid `grid`: a programmatic dependent launch when asked
 * and given a stream, a cluster of `cluster` CTAs along x when cluster > 0. */
template <typename K>
kvpq_status launch_tc_kernel(K kern, const kvpq__attend_params &p, const TcLayout &L, dim3 grid, int threads, int cluster,
                             cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    int na = 0;
    if (p.pdl && stream) {
        /* programmatic dependent launch: the kernel's prologue may run while the previous kernel of
         * the stream finishes; it waits for it (griddepcontrol.wait) before reading q */
        attr[na].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[na].val.programmaticStreamSerializationAllowed = 1;
        na++;
    }
    if (cluster > 0) {
        attr[na].id = cudaLaunchAttributeClusterDimension;
        attr[na].val.clusterDim.x = (unsigned)cluster;
        attr[na].val.clusterDim.y = 1;
        attr[na].val.clusterDim.z = 1;
        na++;
    }
    if (!na) {
        kern<<<grid, threads, L.total, stream>>>(p, L);
        return kvpq__cuda_err(cudaGetLastError(), "cuda attend kernel launch (tensor cores)");
    }
    cfg.gridDim = grid;
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = (size_t)L.total;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = na;
    return kvpq__cuda_err(cudaLaunchKernelEx(&cfg, kern, p, L),
                          cluster > 0 ? "cuda attend kernel launch (tensor cores, cluster)" : "cuda attend kernel launch (tensor cores, PDL)");
}

template <int D, int GS, int NW, bool SC, bool RR>
kvpq_status launch_tc_nw(kvpq__attend_params &p, int B, int max_coded, int max_splits, cudaStream_t stream) {
    const TcLayout L = tc_layout(D, GS, NW, SC);
    auto kern = attend_tc_kernel<D, GS, NW, SC, false, RR>;
    KVPQ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, L.total),
                  "cuda attend: shared memory attribute");
    int n_sm = 0, per_sm = 1;
    KVPQ_TRY(kvpq__cuda_props(&n_sm, NULL));
    KVPQ_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, NW * 32, L.total),
                  "cuda attend: occupancy");
    plan_splits(&p, NW * kSub * tc_halves(D), GS, B, max_coded, max_splits, n_sm, per_sm);
    p.n_wsplits = 0;  /* the code CTAs share the window: at least one CTA per 64 window positions */
    const int wmin = (p.window + 63) / 64;
    if (p.n_splits < wmin) p.n_splits = wmin < max_splits ? wmin : max_splits;
    dim3 grid(p.n_splits, p.n_head_kv * (p.n_head / p.n_head_kv / GS), B);
    /* The split merge through a cluster of the n_splits CTAs of a (sequence, head group)
     * (kernels.attend_cluster; the CL kernel, finish_cluster): for one split (a cluster of one CTA),
     * or up to 8 splits of CTAs that take a whole SM each, when the device holds all the grid's
     * clusters at once (asked once per kernel and cluster size: a second wave of clusters would
     * double the time). Measured on an H200 (docs/BENCHMARKS.md, session 12): clusters of CTAs that
     * fit two per SM (b1@4k: 16 splits of 8-warp CTAs, +1.2 us; b8 with 8-warp CTAs: 4 splits, 62
     * clusters resident for 64, +40%) and clusters of 16 whole-SM CTAs (b1@32k: 7 resident for 8,
     * 1.8x) were slower than the merge through device memory; 2 splits of 16-warp CTAs (b8) faster */
    if (p.cluster && (p.n_splits == 1 || (per_sm == 1 && p.n_splits <= kTcClusterWide))) {
        const TcLayout Lc = tc_layout(D, GS, NW, SC, true);
        auto kernc = attend_tc_kernel<D, GS, NW, SC, true, RR>;
        static int cluster_known[kTcMaxCluster + 1]; /* per kernel and size: 0 not asked, else max clusters + 1 */
        size_t optin = 0;
        KVPQ_TRY(kvpq__cuda_props(NULL, &optin));
        if ((size_t)Lc.total <= optin &&
            cudaFuncSetAttribute(kernc, cudaFuncAttributeMaxDynamicSharedMemorySize, Lc.total) == cudaSuccess) {
            /* (also for one split: 0 below compute capability 9.0, where no cluster launches) */
            const int need = p.n_splits == 1 ? 1 : (int)(grid.y * grid.z);
            if (tc_cluster_max(kernc, p.n_splits, NW * 32, Lc.total, cluster_known) >= need)
                return launch_tc_kernel(kernc, p, Lc, grid, NW * 32, p.n_splits, stream);
        } else {
            (void)cudaGetLastError();
        }
    }
#ifdef KVPQ_ATTEND_DEV_SHAPES
    if (getenv("KVPQ_DEV_CLUSTER_REPORT")) { /* tuning: co-resident clusters of each size */
        static int reported;
        if (!reported++) {
            KVPQ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), "report");
            printf("{\"cluster_report\": {\"D\": %d, \"GS\": %d, \"NW\": %d, \"SC\": %d, \"smem\": %d, \"per_sm\": %d, \"max_active\": [",
                   D, GS, NW, (int)SC, L.total, per_sm);
            for (int n = 1; n <= kTcMaxCluster; n++) {
                cudaLaunchConfig_t c = {};
                cudaLaunchAttribute a[1];
                a[0].id = cudaLaunchAttributeClusterDimension;
                a[0].val.clusterDim.x = (unsigned)n;
                a[0].val.clusterDim.y = a[0].val.clusterDim.z = 1;
                c.gridDim = dim3((unsigned)n);
                c.blockDim = dim3(NW * 32);
                c.dynamicSmemBytes = (size_t)L.total;
                c.attrs = a;
                c.numAttrs = 1;
                int nc = -1;
                if (cudaOccupancyMaxActiveClusters(&nc, kern, &c) != cudaSuccess) (void)cudaGetLastError();
                printf("%d%s", nc, n < kTcMaxCluster ? ", " : "]}}\n");
            }
        }
    }
#endif
    return launch_tc_kernel(kern, p, L, grid, NW * 32, 0, stream);
}

template <int D, int GS>
kvpq_status launch_tc(kvpq__attend_params &p, int B, int max_coded, int max_splits, cudaStream_t stream) {
    int n_sm = 0;
    size_t optin = 0;
    KVPQ_TRY(kvpq__cuda_props(&n_sm, &optin));
    int nw = p.tc_warps;
    if (nw != 8 && nw != 16) {
        /* auto: 8-warp CTAs (two per SM) when the tiles of 32 positions are fewer than 32 per SM (a
         * short batch: more, smaller splits), else 16-warp CTAs (one codebook image per SM) */
        long long tiles = (long long)B * p.n_head_kv * (p.n_head / p.n_head_kv / GS) * ((max_coded + 31) / 32);
        nw = tiles < 32LL * n_sm ? 8 : 16;
    }
    const bool sc = p.k_scales || p.v_scales;  /* norm-explicit: the kernel that reads scales */
    if ((size_t)tc_layout(D, GS, 16, sc).total > optin) nw = 8;  /* tc_ok checked that 8 warps fit */
    if (p.tc_regs) { /* code rows straight into registers (kernels.attend_tc_regs) */
        if (sc) {
            if (nw == 8) return launch_tc_nw<D, GS, 8, true, true>(p, B, max_coded, max_splits, stream);
            return launch_tc_nw<D, GS, 16, true, true>(p, B, max_coded, max_splits, stream);
        }
        if (nw == 8) return launch_tc_nw<D, GS, 8, false, true>(p, B, max_coded, max_splits, stream);
        return launch_tc_nw<D, GS, 16, false, true>(p, B, max_coded, max_splits, stream);
    }
    if (sc) {
        if (nw == 8) return launch_tc_nw<D, GS, 8, true, false>(p, B, max_coded, max_splits, stream);
        return launch_tc_nw<D, GS, 16, true, false>(p, B, max_coded, max_splits, stream);
    }
    if (nw == 8) return launch_tc_nw<D, GS, 8, false, false>(p, B, max_coded, max_splits, stream);
    return launch_tc_nw<D, GS, 16, false, false>(p, B, max_coded, max_splits, stream);
}

template <int D>
kvpq_status launch_tc_d(kvpq__attend_params &p, int B, int max_coded, int max_splits, cudaStream_t stream) {
    const int gs = tc_gs(p);
#ifdef KVPQ_ATTEND_DEV_SHAPES
    if (gs == 4) return launch_tc<D, 4>(p, B, max_coded, max_splits, stream);
    if (gs == 2) return launch_tc<D, 2>(p, B, max_coded, max_splits, stream);
    if (gs == 1) return launch_tc<D, 1>(p, B, max_coded, max_splits, stream);
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: built with KVPQ_ATTEND_DEV_SHAPES (1, 2 or 4 heads per CTA only)");
#else
    switch (gs) {
    case 1: return launch_tc<D, 1>(p, B, max_coded, max_splits, stream);
    case 2: return launch_tc<D, 2>(p, B, max_coded, max_splits, stream);
    case 3: return launch_tc<D, 3>(p, B, max_coded, max_splits, stream);
    case 4: return launch_tc<D, 4>(p, B, max_coded, max_splits, stream);
    case 5: return launch_tc<D, 5>(p, B, max_coded, max_splits, stream);
    case 6: return launch_tc<D, 6>(p, B, max_coded, max_splits, stream);
    case 7: return launch_tc<D, 7>(p, B, max_coded, max_splits, stream);
    case 8: return launch_tc<D, 8>(p, B, max_coded, max_splits, stream);
    }
    return kvpq__err(KVPQ_ERR_INTERNAL, "cuda attend: heads per CTA %d", gs);
#endif
}

} // namespace

/* Power of two e with max|x| * 2^e in [2^14, 2^15) (0 for all zeros). */
static int f16_top_exp(const float *x, size_t n) {
    float mx = 0.f;
    for (size_t i = 0; i < n; i++) mx = fmaxf(mx, fabsf(x[i]));
    int ex = 0;
    if (mx > 0.f) frexpf(mx, &ex);
    return mx > 0.f ? 15 - ex : 0;
}

/* The 16 float16 replicas of one scaled value-centroid element f, rounded down or up (dithered
 * rounding) so that their mean is f to within 1/32 of a float16 ulp instead of 1/2: one rounding
 * per centroid biased every position coded with that centroid the same way, an error that does not
 * average out over a long context (measured 0.7-1.4e-3 relative at 32768 positions of random data,
 * against 2e-4 at 257). The kernel reads replica (lane % 16) ^ 4ti at position a + 4ti of a half,
 * so a sub-space's 16 positions of a half read all 16. Replicas round up in bit-reversed order of
 * their index, so that neighbouring positions alternate. The price: each copy's own error is up
 * to 31/32 ulp (variance 1/6 ulp^2 against 1/12), which a softmax peaked on a few positions sees
 * (numpy model: 2.0e-4 -> 2.8e-4 there, 1.5e-4 -> 3.3e-5 for a flat one at 32768 positions). Keys
 * keep round-to-nearest: their rounding bias moves scores, which does not accumulate over positions
 * when keys and values are independent (the same model: dithered keys were worse at every score
 * scale tried). */
static void tc_dither(float f, __half out[16]) {
    const __half lo = __float2half_rd(f), hi = __float2half_ru(f);
    const float flo = __half2float(lo), fhi = __half2float(hi);
    const int up = fhi > flo ? (int)lrintf((f - flo) / (fhi - flo) * 16.f) : 0;
    for (int rep = 0; rep < 16; rep++) {
        const int rank = (rep & 1) << 3 | (rep & 2) << 1 | (rep & 4) >> 1 | (rep & 8) >> 3; /* bit-reversed */
        out[rep] = rank < up ? hi : lo;
    }
}

kvpq_status kvpq__cuda_tc_image(const kvpq_pq *key, const kvpq_pq *value, void **image, int *kexp, int *vexp) {
    *image = NULL;
    *kexp = *vexp = 0;
    const kvpq_pq *pq[2] = {key, value};
    for (int i = 0; i < 2; i++)
        if (pq[i]->n_books != 1 || pq[i]->dsub != 4 || pq[i]->p.nbits != 8) return KVPQ_OK;  /* LUT path */
    int ex[2];
    for (int i = 0; i < 2; i++) ex[i] = f16_top_exp(pq[i]->centroids, (size_t)256 * 4);
    __half *h = (__half *)malloc(256 * 256);
    if (!h) return kvpq__err(KVPQ_ERR_NOMEM, "cuda attend: out of memory (codebook image)");
    /* centroid c: bytes [256c, 256c + 128) = 16 key replicas, [256c + 128, 256c + 256) = 16 value
     * replicas, 4 float16 each */
    for (int c = 0; c < 256; c++)
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) {
                const float f = ldexpf(pq[i]->centroids[c * 4 + j], ex[i]);
                __half rep16[16];
                if (i) tc_dither(f, rep16); /* values */
                else for (int rep = 0; rep < 16; rep++) rep16[rep] = __float2half_rn(f);
                for (int rep = 0; rep < 16; rep++) h[c * 128 + i * 64 + rep * 4 + j] = rep16[rep];
            }
    void *d = NULL;
    kvpq_status s = kvpq__cuda_err(cudaMalloc(&d, 256 * 256), "cuda attend: cudaMalloc codebook image");
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemcpy(d, h, 256 * 256, cudaMemcpyHostToDevice), "cuda attend: copy codebook image");
    free(h);
    if (s != KVPQ_OK) {
        cudaFree(d);
        return s;
    }
    *image = d;
    *kexp = ex[0];
    *vexp = ex[1];
    return KVPQ_OK;
}

kvpq_status kvpq__cuda_attend_check(const kvpq__attend_params *p) {
    int gs;
    Layout L;
    if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: head_dim=%d: expected 64, 128 or 256", p->head_dim);
    /* the float32 LUT is the larger: a shape that fits with it fits with float16 entries too */
    return plan(*p, 0, 0, 16, &gs, &L);
}

kvpq_status kvpq__cuda_attend_launch(kvpq__attend_params *p, int B, int max_coded, int max_splits,
                                     cudaStream_t stream) {
#ifdef KVPQ_ATTEND_DEV_SHAPES
    /* development builds (-DKVPQ_ATTEND_DEV_SHAPES, compile time): head_dim 128 with 4 query heads
     * per CTA only (8 attention kernels instead of 192: about 45 s to compile instead of 15 min), for
     * timing the kernels being tuned; never for checks or releases */
    if (p->head_dim != 128)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: built with KVPQ_ATTEND_DEV_SHAPES (head_dim 128 only)");
#endif
    if (p->tc && tc_ok(*p)) {
        switch (p->head_dim) {
#ifndef KVPQ_ATTEND_DEV_SHAPES
        case 64: return launch_tc_d<64>(*p, B, max_coded, max_splits, stream);
#endif
        case 128: return launch_tc_d<128>(*p, B, max_coded, max_splits, stream);
#ifndef KVPQ_ATTEND_DEV_SHAPES
        case 256: return launch_tc_d<256>(*p, B, max_coded, max_splits, stream);
#endif
        }
    }
    int gs;
    Layout L;
    /* 16-warp CTAs also when the grid leaves SMs idle: 8-warp CTAs with twice the splits measured
     * slower at B=1, 4k (the per-CTA LUT build dominates there) */
    KVPQ_TRY(plan(*p, p->lut16, p->vrep, 16, &gs, &L));
    switch (p->head_dim) {
#ifndef KVPQ_ATTEND_DEV_SHAPES
    case 64: return launch_d<64>(*p, L, gs, B, max_coded, max_splits, stream);
#endif
    case 128: return launch_d<128>(*p, L, gs, B, max_coded, max_splits, stream);
#ifndef KVPQ_ATTEND_DEV_SHAPES
    case 256: return launch_d<256>(*p, L, gs, B, max_coded, max_splits, stream);
#endif
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: head_dim=%d: expected 64, 128 or 256", p->head_dim);
}
