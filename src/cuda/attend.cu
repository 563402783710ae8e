/* attend.cu — decode attention from PQ codes on the GPU (flash-decoding).
 *
 * Grid (n_splits + n_wsplits, n_head_kv * groups, B). CTA (s < n_splits, g, b) handles the code positions
 * [s*chunk, (s+1)*chunk) of sequence b for GS query heads of one KV head: it builds their LUTs
 * LUT[m][c][h] = scale*log2(e) * q'_h,m . C_k[m][c] (q' = Hadamard(q * lambda)) in shared memory,
 * then each warp walks tiles of 32 positions: the key and value codes of a tile are read once
 * (cp.async, double-buffered) for all GS heads; scores come from the LUTs (lane = position), the
 * online softmax {m, d, o} is updated per warp, and values are decoded from the value codebook
 * (lane = channels). CTAs s >= n_splits handle the float32 window, 32 positions each. Each CTA merges its warps and
 * writes a partial {m, d, o}; the combine kernel merges the splits (FlashAttention's rule;
 * Milakov & Gimelshein 2018), divides by d and undoes the value rotation. */
#include <cuda_pipeline.h>
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kWarps = 16, kThreads = kWarps * 32, kWindowChunk = 32;

struct Layout {  /* dynamic shared memory, in floats */
    int lut, vbook, qs, pbuf, stage, total;
    int k_stride, v_stride;  /* staged row strides in 32-bit words (odd: conflict-free lanes) */
    int nw;                  /* warps per CTA: kWarps, or 8 when that does not fit */
    int vbook_in_smem;
};

__host__ __device__ inline int odd_words(int bytes) {
    int w = (bytes + 3) / 4;
    return w | 1;
}

__host__ __device__ inline Layout make_layout(const kvpq__attend_params &p, int gs, bool with_vbook, int nw) {
    Layout L;
    L.nw = nw;
    int Mk = p.head_dim / p.k_dsub;
    L.k_stride = odd_words(p.k_code_size);
    L.v_stride = odd_words(p.v_code_size);
    int o = 0;
    L.lut = o;
    o += Mk * p.k_ksub * gs;
    int merge = nw * gs * (p.head_dim + 2);  /* reused for the warp merge */
    if (o < merge) o = merge;
    o = (o + 3) & ~3;
    L.vbook = o;
    L.vbook_in_smem = with_vbook;
    if (with_vbook) o += p.v_books * p.v_ksub * p.v_dsub;
    o = (o + 3) & ~3;
    L.qs = o;
    o += gs * p.head_dim;
    L.pbuf = o;
    o += nw * 32 * gs;
    o = (o + 3) & ~3;
    L.stage = o;
    o += nw * 2 * 32 * (L.k_stride + L.v_stride);
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

/* Stage the key and value code rows of positions [t0, t0 + n) (one page) into a warp's buffer. */
__device__ __forceinline__ void stage_tile(const kvpq__attend_params &p, const Layout &L, uint32_t *kst,
                                           uint32_t *vst, int b, int kvh, int t0, int n, int lane) {
    int page = p.page_table[(size_t)b * p.max_pages + t0 / p.page_tokens];
    int r0 = t0 % p.page_tokens;
    const uint8_t *ks = p.k_pages + ((size_t)page * p.n_head_kv + kvh) * p.page_tokens * p.k_code_size +
                        (size_t)r0 * p.k_code_size;
    const uint8_t *vs = p.v_pages + ((size_t)page * p.n_head_kv + kvh) * p.page_tokens * p.v_code_size +
                        (size_t)r0 * p.v_code_size;
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
    if ((p.v_code_size & 3) == 0) {
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

template <int D, int GS>
__global__ void __launch_bounds__(kThreads, 1) attend_split_kernel(kvpq__attend_params p, Layout L) {
    constexpr int EPL = D / 32;
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
        /* ---- the float32 window, kWindowChunk positions per CTA: a warp per position, scores by
         * warp dot products ---- */
        const int w0 = coded + (split - p.n_splits) * kWindowChunk, w1 = min(len, w0 + kWindowChunk);
        float qo[GS][EPL];
#pragma unroll
        for (int h = 0; h < GS; h++)
#pragma unroll
            for (int j = 0; j < EPL; j++) qo[h][j] = p.q[((size_t)b * p.n_head + head0 + h) * D + lane * EPL + j];
        const float scale = 1.4426950408889634f * rsqrtf((float)D);
        for (int t = w0 + warp; t < w1; t += nw) {
            size_t row = (((size_t)b * p.window + t % p.window) * p.n_head_kv + kvh) * D + lane * EPL;
            float kv[EPL], vv[EPL];
#pragma unroll
            for (int j = 0; j < EPL; j++) {
                kv[j] = p.k_win[row + j];
                vv[j] = p.v_win[row + j];
            }
#pragma unroll
            for (int h = 0; h < GS; h++) {
                float s = 0.f;
#pragma unroll
                for (int j = 0; j < EPL; j++) s = fmaf(qo[h][j], kv[j], s);
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
    } else if (split * p.chunk < coded) {
        /* ---- code positions [c0, c1) ---- */
        const int c0 = split * p.chunk, c1 = min(c0 + p.chunk, coded);
        float *lut = smem + L.lut, *qs = smem + L.qs;
        if (L.vbook_in_smem) {
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
        __syncthreads();
        const int Mk = D / p.k_dsub, ksub = p.k_ksub, kd = p.k_dsub;
        const float scale = 1.4426950408889634f * rsqrtf((float)D);
        /* A shared key codebook is staged (coalesced, all loads in flight) in the not yet used code
         * staging area; sub-space codebooks are read from device memory. */
        const float *kbook = p.k_centroids;
        const int stage_floats = nw * 2 * 32 * (L.k_stride + L.v_stride);
        if (p.k_books == 1 && ksub * kd <= stage_floats) {
            float *kb = smem + L.stage;
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
#pragma unroll
            for (int h = 0; h < GS; h++) lut[(size_t)i * GS + h] = acc[h] * scale;
        }
        __syncthreads();

        uint32_t *stage = reinterpret_cast<uint32_t *>(smem + L.stage) + warp * 2 * 32 * (L.k_stride + L.v_stride);
        /* buffers: K[0], K[1], V[0], V[1]; selected by arithmetic (an indexed pointer array would
         * go to local memory) */
#define KST(i) (stage + (i) * 32 * L.k_stride)
#define VST(i) (stage + 2 * 32 * L.k_stride + (i) * 32 * L.v_stride)
        float *pb = smem + L.pbuf + warp * 32 * GS;
        const int vshift = __ffs(p.v_dsub) - 1, vnb = p.v_nbits, vks = p.v_ksub, vd = p.v_dsub;
        (void)vd;
        const int knb = p.k_nbits;

        int t0 = c0 + warp * 32, buf = 0;
        if (t0 < c1) stage_tile(p, L, KST(0), VST(0), b, kvh, t0, min(32, c1 - t0), lane);
        for (; t0 < c1; t0 += nw * 32, buf ^= 1) {
            const int n = min(32, c1 - t0), tn = t0 + nw * 32;
            if (tn < c1) {
                stage_tile(p, L, KST(buf ^ 1), VST(buf ^ 1), b, kvh, tn, min(32, c1 - tn), lane);
                __pipeline_wait_prior(1);
            } else {
                __pipeline_wait_prior(0);
            }
            __syncwarp();
            /* scores: lane = position */
            float s[GS];
#pragma unroll
            for (int h = 0; h < GS; h++) s[h] = 0.f;
            if (lane < n) {
                const uint32_t *row = KST(buf) + lane * L.k_stride;
                if (knb == 8) {
                    for (int w = 0; w < (Mk >> 2); w++) {
                        uint32_t wv = row[w];
#pragma unroll
                        for (int q4 = 0; q4 < 4; q4++) {
                            int c = (wv >> (8 * q4)) & 0xff;
                            const float *e = lut + ((w * 4 + q4) * ksub + c) * GS;
                            if constexpr (GS % 4 == 0) {
#pragma unroll
                                for (int h = 0; h < GS; h += 4) {
                                    float4 t = *reinterpret_cast<const float4 *>(e + h);
                                    s[h] += t.x; s[h + 1] += t.y; s[h + 2] += t.z; s[h + 3] += t.w;
                                }
                            } else {
#pragma unroll
                                for (int h = 0; h < GS; h++) s[h] += e[h];
                            }
                        }
                    }
                    for (int m = Mk & ~3; m < Mk; m++) {
                        int c = reinterpret_cast<const uint8_t *>(row)[m];
#pragma unroll
                        for (int h = 0; h < GS; h++) s[h] += lut[(m * ksub + c) * GS + h];
                    }
                } else {
                    for (int m = 0; m < Mk; m++) {
                        int c = kvpq__get_code(reinterpret_cast<const uint8_t *>(row), m, knb);
#pragma unroll
                        for (int h = 0; h < GS; h++) s[h] += lut[(m * ksub + c) * GS + h];
                    }
                }
            } else {
#pragma unroll
                for (int h = 0; h < GS; h++) s[h] = -INFINITY;
            }
#pragma unroll
            for (int h = 0; h < GS; h++) {
                float mn = fmaxf(m_run[h], warp_max(s[h]));
                float corr = exp2f(m_run[h] - mn), pr = exp2f(s[h] - mn);
                m_run[h] = mn;
                d_lane[h] = d_lane[h] * corr + pr;
#pragma unroll
                for (int j = 0; j < EPL; j++) o[h][j] *= corr;
                pb[lane * GS + h] = pr;
            }
            __syncwarp();
            /* values: lane = channels lane*EPL .. +EPL. The body is instantiated for a shared-memory
             * and a device-memory codebook so that the shared one is read with LDS. */
            auto values = [&](const float *vb) {
                if ((EPL % 4 == 0) && vd >= 4) {
                    /* a lane's sub-spaces and codebook offsets do not change with the position */
                    int mj[EPL / 4 > 0 ? EPL / 4 : 1], offj[EPL / 4 > 0 ? EPL / 4 : 1];
#pragma unroll
                    for (int jj = 0; jj < EPL / 4; jj++) {
                        int e = lane * EPL + 4 * jj;
                        mj[jj] = e >> vshift;
                        offj[jj] = (((p.v_books == 1 ? 0 : mj[jj]) * vks) << vshift) + (e - (mj[jj] << vshift));
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
                            float4 cv = *reinterpret_cast<const float4 *>(vb + offj[jj] + (code << vshift));
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
            if (L.vbook_in_smem) values(smem + L.vbook);
            else values(p.v_centroids);
            __syncwarp();
        }
#undef KST
#undef VST
    }

    /* ---- merge the warps of this CTA and write the partial {m, d, o} ---- */
    __syncthreads();  /* the LUT region is reused */
    float *mbuf = smem + L.lut;  /* (nw, GS, D + 2) */
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
    __syncthreads();
    const int nsp = p.n_splits + p.n_wsplits;
    for (int i = tid; i < GS * D; i += nthr) {
        int h = i / D, e = i - h * D;
        float mx = -INFINITY;
        for (int w = 0; w < nw; w++) mx = fmaxf(mx, mbuf[((size_t)w * GS + h) * (D + 2)]);
        float dd = 0.f, oo = 0.f;
        if (mx != -INFINITY) {
            for (int w = 0; w < nw; w++) {
                const float *slot = mbuf + ((size_t)w * GS + h) * (D + 2);
                float sc = exp2f(slot[0] - mx);
                dd += sc * slot[1];
                oo += sc * slot[2 + e];
            }
        }
        size_t base = ((size_t)b * p.n_head + head0 + h) * nsp + split;
        p.part_o[base * D + e] = oo;
        if (e == 0) {
            p.part_md[base * 2] = mx;
            p.part_md[base * 2 + 1] = dd;
        }
    }
}

/* A warp per (sequence, query head): merge the n_splits + n_wsplits partials, divide by d, undo the value
 * rotation. */
template <int D>
__global__ void __launch_bounds__(128) attend_combine_kernel(kvpq__attend_params p) {
    constexpr int EPL = D / 32;
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * 4 + (threadIdx.x >> 5), b = blockIdx.y;
    if (head >= p.n_head) return;
    const int nsp = p.n_splits + p.n_wsplits;
    const size_t base = ((size_t)b * p.n_head + head) * nsp;
    float mx = -INFINITY;
    for (int s = 0; s < nsp; s++) mx = fmaxf(mx, p.part_md[(base + s) * 2]);
    float dd = 0.f, o[EPL];
#pragma unroll
    for (int j = 0; j < EPL; j++) o[j] = 0.f;
    for (int s = 0; s < nsp; s++) {
        float m = p.part_md[(base + s) * 2];
        if (m == -INFINITY) continue;
        float sc = exp2f(m - mx);
        dd += sc * p.part_md[(base + s) * 2 + 1];
        const float *po = p.part_o + (base + s) * D + lane * EPL;
#pragma unroll
        for (int j = 0; j < EPL; j++) o[j] = fmaf(sc, po[j], o[j]);
    }
    float inv = 1.f / dd;
#pragma unroll
    for (int j = 0; j < EPL; j++) o[j] *= inv;
    if (p.v_rotate) kvpq__warp_fwht<EPL>(o, lane);
    float *dst = p.out + ((size_t)b * p.n_head + head) * D + lane * EPL;
#pragma unroll
    for (int j = 0; j < EPL; j++) dst[j] = o[j];
}

/* Heads per CTA: the largest divisor of the group size (<= 8) whose LUTs fit in shared memory. */
kvpq_status plan(const kvpq__attend_params &p, int *gs_out, Layout *L_out) {
    size_t optin = 0;
    KVPQ_TRY(kvpq__cuda_props(NULL, &optin));
    int g = p.n_head / p.n_head_kv;
    /* prefer all heads in one CTA (codes read once), then 16 warps, then the value codebook in
     * shared memory */
    for (int gs = g < 8 ? g : 8; gs >= 1; gs--) {
        if (g % gs) continue;
        for (int nw = kWarps; nw >= 8; nw /= 2)
            for (int vb = 1; vb >= 0; vb--) {
                Layout L = make_layout(p, gs, vb != 0, nw);
                if ((size_t)L.total * 4 <= optin) {
                    *gs_out = gs;
                    *L_out = L;
                    return KVPQ_OK;
                }
            }
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                     "cuda attend: the key LUT of one query head (M=%d x ksub=%d floats) does not fit in %zu bytes of "
                     "shared memory",
                     p.head_dim / p.k_dsub, p.k_ksub, optin);
}

template <int D, int GS>
kvpq_status launch_split(const kvpq__attend_params &p, const Layout &L, int B, cudaStream_t stream) {
    size_t bytes = (size_t)L.total * 4;
    auto kern = attend_split_kernel<D, GS>;
    KVPQ_CUDA_TRY(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                  "cuda attend: shared memory attribute");
    dim3 grid(p.n_splits + p.n_wsplits, p.n_head_kv * (p.n_head / p.n_head_kv / GS), B);
    kern<<<grid, L.nw * 32, bytes, stream>>>(p, L);
    KVPQ_CUDA_TRY(cudaGetLastError(), "cuda attend split kernel launch");
    attend_combine_kernel<D><<<dim3((p.n_head + 3) / 4, B), 128, 0, stream>>>(p);
    return kvpq__cuda_err(cudaGetLastError(), "cuda attend combine kernel launch");
}

template <int D>
kvpq_status launch_d(const kvpq__attend_params &p, const Layout &L, int gs, int B, cudaStream_t stream) {
    switch (gs) {
    case 1: return launch_split<D, 1>(p, L, B, stream);
    case 2: return launch_split<D, 2>(p, L, B, stream);
    case 3: return launch_split<D, 3>(p, L, B, stream);
    case 4: return launch_split<D, 4>(p, L, B, stream);
    case 5: return launch_split<D, 5>(p, L, B, stream);
    case 6: return launch_split<D, 6>(p, L, B, stream);
    case 7: return launch_split<D, 7>(p, L, B, stream);
    case 8: return launch_split<D, 8>(p, L, B, stream);
    }
    return kvpq__err(KVPQ_ERR_INTERNAL, "cuda attend: heads per CTA %d", gs);
}

} // namespace

kvpq_status kvpq__cuda_attend_check(const kvpq__attend_params *p) {
    int gs;
    Layout L;
    if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: head_dim=%d: expected 64, 128 or 256", p->head_dim);
    return plan(*p, &gs, &L);
}

kvpq_status kvpq__cuda_attend_launch(kvpq__attend_params *p, int B, int max_coded, int max_splits,
                                     cudaStream_t stream) {
    int gs, n_sm = 0;
    Layout L;
    KVPQ_TRY(plan(*p, &gs, &L));
    KVPQ_TRY(kvpq__cuda_props(&n_sm, NULL));
    int ctas_per_sm = (int)(228 * 1024 / ((size_t)L.total * 4 + 1024));
    if (ctas_per_sm < 1) ctas_per_sm = 1;
    if (ctas_per_sm > 8) ctas_per_sm = 8;
    int pairs = B * p->n_head_kv * (p->n_head / p->n_head_kv / gs);
    int splits = n_sm * ctas_per_sm / pairs;
    int min_chunk = L.nw * 32;  /* a tile per warp at least: amortizes the LUT build */
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
    switch (p->head_dim) {
    case 64: return launch_d<64>(*p, L, gs, B, stream);
    case 128: return launch_d<128>(*p, L, gs, B, stream);
    case 256: return launch_d<256>(*p, L, gs, B, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend: head_dim=%d: expected 64, 128 or 256", p->head_dim);
}
