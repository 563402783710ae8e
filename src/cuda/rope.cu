/* rope.cu — keys coded before RoPE on the GPU (kvpq_cuda_cache_params.key_rope_dims; KVQuant, Hooper
 * et al., arXiv 2401.18079, sec. 3.2): the rotation of key rows by +-position (append: turned back
 * before coding; read: turned forward after decoding) and the attention of such a layer.
 *
 * The attention cannot score keys from per-query tables: a coded key's rotation depends on its
 * position. Each warp of a CTA takes positions of one (sequence, KV head, split) in turn, decodes the
 * key from its codes into registers as decode.cu does (centroids, inverse Hadamard rotation, times
 * lambda and the norm-explicit scale, plus the key mean), rotates it by its position, scores it
 * against the CTA's query heads, and adds the value decoded the same way (positions of the float32
 * window are read from it: k + mu, v), with an online softmax in the log2 domain (FlashAttention-2,
 * Dao 2023). The CTA's warps merge in shared memory; a second kernel merges the splits and writes the
 * output and the log-sum-exp. Angles: pos * inv_freq in double, reduced to [-pi, pi], then sincosf
 * (the CPU's kvpq_rope_rotate takes cos / sin in double: the two agree to float rounding). */
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kNW = 4; /* warps per CTA of the attention */

/* cos and sin of sign * pos * inv_freq. */
__device__ __forceinline__ void rope_cs(long long pos, float inv_freq, int sign, float *c, float *s) {
    double th = (double)pos * (double)inv_freq;
    th -= 6.283185307179586 * rint(th * 0.15915494309189535);
    sincosf((float)(sign * th), s, c);
}

/* Channels (a, b) of rotated pair i: (2i, 2i + 1) or, NeoX layout, (i, i + half). */
__device__ __forceinline__ void rope_pair(int i, int half, int neox, int *a, int *b) {
    *a = neox ? i : 2 * i;
    *b = neox ? i + half : 2 * i + 1;
}

/* out = x rotated by sign * (pos0 + t) for rows (t, h) of x (n_tokens, n_head_kv, D); a thread per
 * rotated pair, and per unrotated channel when out != x (in place is allowed). */
__global__ void rope_rows_kernel(const float *x, float *out, long long n_tokens, int n_head_kv, int D, int n_rot,
                                 int neox, const float *freq, int pos0, int sign) {
    const int half = n_rot / 2, per_row = D - half;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_tokens * n_head_kv * per_row) return;
    const long long row = i / per_row;
    const int j = (int)(i % per_row);
    const float *xr = x + row * D;
    float *orow = out + row * D;
    if (j >= half) { /* channel n_rot + (j - half): not rotated */
        if (out != x) orow[n_rot + j - half] = xr[n_rot + j - half];
        return;
    }
    int a, b;
    rope_pair(j, half, neox, &a, &b);
    float c, s;
    rope_cs(pos0 + row / n_head_kv, freq[j], sign, &c, &s);
    const float x0 = xr[a], x1 = xr[b];
    orow[a] = x0 * c - x1 * s;
    orow[b] = x0 * s + x1 * c;
}

/* Code row index of (sequence b, KV head h, position t) in the pages (scales share it). */
__device__ __forceinline__ long long page_row(const kvpq__attend_params &p, int b, int h, int t) {
    const long long page = p.page_table[(long long)b * p.max_pages + t / p.page_tokens];
    return (page * p.n_head_kv + h) * p.page_tokens + t % p.page_tokens;
}

/* One coded row into the warp's registers: lane l holds elements [l*EPL, (l+1)*EPL) of the
 * centroids of its codes, inverse-rotated when `rotate`, times `scale`. */
template <int EPL>
__device__ __forceinline__ void decode_row(const uint8_t *row, const float *cent, int books, int ksub, int dsub,
                                           int nbits, int rotate, float scale, int lane, float (&x)[EPL]) {
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane * EPL + j, m = e / dsub;
        const int code = kvpq__get_code(row, m, nbits);
        x[j] = cent[((size_t)(books == 1 ? 0 : m) * ksub + code) * dsub + (e - m * dsub)];
    }
    if (rotate) kvpq__warp_fwht<EPL>(x, lane);
#pragma unroll
    for (int j = 0; j < EPL; j++) x[j] *= scale;
}

/* Rotate the warp's key (registers, lane-major) by +pos, exchanging pair partners through `row`
 * (the warp's D floats of shared memory). */
template <int EPL>
__device__ __forceinline__ void rope_warp(const kvpq__attend_params &p, float *row, long long pos, int lane,
                                          float (&x)[EPL]) {
    const int half = p.rope_dims / 2;
#pragma unroll
    for (int j = 0; j < EPL; j++) row[lane * EPL + j] = x[j];
    __syncwarp();
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane * EPL + j;
        if (e >= p.rope_dims) continue;
        const int first = p.rope_neox ? e < half : !(e & 1);
        const int i = p.rope_neox ? (first ? e : e - half) : e >> 1;
        int a, b;
        rope_pair(i, half, p.rope_neox, &a, &b);
        float c, s;
        rope_cs(pos, p.rope_freq[i], 1, &c, &s);
        x[j] = first ? row[a] * c - row[b] * s : row[a] * s + row[b] * c;
    }
    __syncwarp();
}

/* Key and value of (b, h, t) in the original space, the key after RoPE. */
template <int EPL>
__device__ __forceinline__ void load_kv(const kvpq__attend_params &p, float *row, int b, int h, int t, int coded,
                                        int lane, float (&k)[EPL], float (&v)[EPL]) {
    const size_t hoff = (size_t)h * (32 * EPL) + lane * EPL;
    if (t >= coded) { /* the float32 ring: k - mu, v */
        const size_t off = (((size_t)b * p.window + t % p.window) * p.n_head_kv) * (32 * EPL) + hoff;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            k[j] = p.k_win[off + j] + (p.k_mean ? p.k_mean[hoff + j] : 0.f);
            v[j] = p.v_win[off + j];
        }
        return;
    }
    const long long r = page_row(p, b, h, t);
    const float sk = p.k_scales ? __half2float(__ushort_as_half(p.k_scales[r])) : 1.f;
    const float sv = p.v_scales ? __half2float(__ushort_as_half(p.v_scales[r])) : 1.f;
    decode_row<EPL>(p.k_pages + r * p.k_code_size, p.k_centroids, p.k_books, p.k_ksub, p.k_dsub, p.k_nbits, 1, sk,
                    lane, k);
#pragma unroll
    for (int j = 0; j < EPL; j++)
        k[j] = k[j] * (p.k_lambda ? p.k_lambda[hoff + j] : 1.f) + (p.k_mean ? p.k_mean[hoff + j] : 0.f);
    rope_warp<EPL>(p, row, (long long)p.rope_pos0 + t, lane, k);
    decode_row<EPL>(p.v_pages + r * p.v_code_size, p.v_centroids, p.v_books, p.v_ksub, p.v_dsub, p.v_nbits,
                    p.v_rotate, sv, lane, v);
}

/* Split blockIdx.x of (sequence blockIdx.z, head group blockIdx.y): GS query heads of one KV head,
 * positions [split * chunk, min(L, (split + 1) * chunk)). Partials: part_o (B, n_head, n_splits, D)
 * unnormalized, part_md {m (log2 domain, -inf when empty), d}. */
template <int D, int GS>
__global__ void __launch_bounds__(kNW * 32) attend_rope_kernel(const kvpq__attend_params p) {
    constexpr int EPL = D / 32;
    __shared__ float s_row[kNW][D];
    __shared__ float s_o[kNW][GS][D];
    __shared__ float s_md[kNW][GS][2];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.z, split = blockIdx.x;
    const int G = p.n_head / p.n_head_kv, groups = G / GS;
    const int kvh = blockIdx.y / groups, head0 = kvh * G + (int)(blockIdx.y % groups) * GS;
    const int L = p.seq_len[b], coded = L - (p.window < L ? p.window : L);
    const int t0 = split * p.chunk, t1 = L < t0 + p.chunk ? L : t0 + p.chunk;
    const float qs = 1.4426950408889634f * rsqrtf((float)D);
    float q[GS][EPL], o[GS][EPL], m[GS], l[GS];
#pragma unroll
    for (int h = 0; h < GS; h++) {
        m[h] = -INFINITY, l[h] = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            q[h][j] = p.q[((size_t)b * p.n_head + head0 + h) * D + lane * EPL + j] * qs;
            o[h][j] = 0.f;
        }
    }
    for (int t = t0 + warp; t < t1; t += kNW) {
        float k[EPL], v[EPL];
        load_kv<EPL>(p, s_row[warp], b, kvh, t, coded, lane, k, v);
#pragma unroll
        for (int h = 0; h < GS; h++) {
            float sc = 0.f;
#pragma unroll
            for (int j = 0; j < EPL; j++) sc += q[h][j] * k[j];
#pragma unroll
            for (int x = 16; x > 0; x >>= 1) sc += __shfl_xor_sync(KVPQ_FULL_MASK, sc, x);
            const float mn = fmaxf(m[h], sc), corr = exp2f(m[h] - mn), pr = exp2f(sc - mn);
            l[h] = l[h] * corr + pr;
#pragma unroll
            for (int j = 0; j < EPL; j++) o[h][j] = o[h][j] * corr + pr * v[j];
            m[h] = mn;
        }
    }
#pragma unroll
    for (int h = 0; h < GS; h++) {
#pragma unroll
        for (int j = 0; j < EPL; j++) s_o[warp][h][lane * EPL + j] = o[h][j];
        if (lane == 0) s_md[warp][h][0] = m[h], s_md[warp][h][1] = l[h];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GS * D; i += kNW * 32) {
        const int h = i / D, e = i % D;
        float M = -INFINITY;
        for (int w = 0; w < kNW; w++) M = fmaxf(M, s_md[w][h][0]);
        float acc = 0.f, den = 0.f;
        for (int w = 0; w < kNW; w++) {
            const float f = s_md[w][h][0] == -INFINITY ? 0.f : exp2f(s_md[w][h][0] - M);
            acc += s_o[w][h][e] * f;
            den += s_md[w][h][1] * f;
        }
        const size_t part = ((size_t)b * p.n_head + head0 + h) * p.n_splits + split;
        p.part_o[part * D + e] = acc;
        if (e == 0) p.part_md[2 * part] = M, p.part_md[2 * part + 1] = den;
    }
}

/* Merge the splits of row (sequence blockIdx.y, head blockIdx.x): out = sum o 2^(m - M) / sum d
 * 2^(m - M); lse = M ln 2 + ln(sum d 2^(m - M)). A thread per element. */
__global__ void merge_kernel(const kvpq__attend_params p) {
    const int e = threadIdx.x, D = p.head_dim;
    const size_t row = (size_t)blockIdx.y * p.n_head + blockIdx.x, base = row * p.n_splits;
    float M = -INFINITY;
    for (int s = 0; s < p.n_splits; s++) M = fmaxf(M, p.part_md[2 * (base + s)]);
    float acc = 0.f, den = 0.f;
    for (int s = 0; s < p.n_splits; s++) {
        const float m = p.part_md[2 * (base + s)];
        if (m == -INFINITY) continue;
        const float f = exp2f(m - M);
        acc += p.part_o[(base + s) * D + e] * f;
        den += p.part_md[2 * (base + s) + 1] * f;
    }
    p.out[row * D + e] = acc / den;
    if (e == 0 && p.lse) p.lse[row] = M * 0.6931471805599453f + logf(den);
}

template <int D, int GS>
kvpq_status launch_gs(kvpq__attend_params &p, int B, int max_len, int max_splits, cudaStream_t stream) {
    int n_sm = 0;
    KVPQ_TRY(kvpq__cuda_props(&n_sm, NULL));
    const int pairs = B * p.n_head / GS;
    int splits = (4 * n_sm + pairs - 1) / pairs;       /* about 4 CTAs per multiprocessor */
    const int by_len = (max_len + 8 * kNW - 1) / (8 * kNW); /* at least 8 positions per warp */
    if (splits > by_len) splits = by_len;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    p.chunk = (max_len + splits - 1) / splits;
    p.n_splits = (max_len + p.chunk - 1) / p.chunk;
    p.n_wsplits = 0;
    attend_rope_kernel<D, GS><<<dim3(p.n_splits, p.n_head / GS, B), kNW * 32, 0, stream>>>(p);
    KVPQ_CUDA_TRY(cudaGetLastError(), "cuda attend (keys before RoPE): kernel launch");
    merge_kernel<<<dim3(p.n_head, B), D, 0, stream>>>(p);
    return kvpq__cuda_err(cudaGetLastError(), "cuda attend (keys before RoPE): merge launch");
}

template <int D>
kvpq_status launch_d(kvpq__attend_params &p, int B, int max_len, int max_splits, cudaStream_t stream) {
    const int g = p.n_head / p.n_head_kv;
    int gs = g < 8 ? g : 8;
    while (g % gs) gs--; /* the largest divisor of the group size up to 8 */
    switch (gs) {
    case 1: return launch_gs<D, 1>(p, B, max_len, max_splits, stream);
    case 2: return launch_gs<D, 2>(p, B, max_len, max_splits, stream);
    case 3: return launch_gs<D, 3>(p, B, max_len, max_splits, stream);
    case 4: return launch_gs<D, 4>(p, B, max_len, max_splits, stream);
    case 5: return launch_gs<D, 5>(p, B, max_len, max_splits, stream);
    case 6: return launch_gs<D, 6>(p, B, max_len, max_splits, stream);
    case 7: return launch_gs<D, 7>(p, B, max_len, max_splits, stream);
    default: return launch_gs<D, 8>(p, B, max_len, max_splits, stream);
    }
}

} // namespace

kvpq_status kvpq__cuda_rope_launch(const float *x, float *out, long long n_tokens, int n_head_kv, int head_dim,
                                   int n_rot, int neox, const float *freq, int pos0, int sign, cudaStream_t stream) {
    const long long n = n_tokens * n_head_kv * (head_dim - n_rot / 2);
    if (n <= 0) return KVPQ_OK;
    if ((n + 255) / 256 > 0x7fffffffLL) return kvpq__err(KVPQ_ERR_CAPACITY, "cuda rope: %lld rows", n_tokens);
    rope_rows_kernel<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, out, n_tokens, n_head_kv, head_dim, n_rot, neox,
                                                                      freq, pos0, sign);
    return kvpq__cuda_err(cudaGetLastError(), "cuda rope: kernel launch");
}

kvpq_status kvpq__cuda_attend_rope_launch(kvpq__attend_params *p, int B, int max_len, int max_splits,
                                          cudaStream_t stream) {
    switch (p->head_dim) {
    case 64: return launch_d<64>(*p, B, max_len, max_splits, stream);
    case 128: return launch_d<128>(*p, B, max_len, max_splits, stream);
    case 256: return launch_d<256>(*p, B, max_len, max_splits, stream);
    }
    return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cuda attend (keys before RoPE): head_dim=%d: expected 64, 128 or 256",
                     p->head_dim);
}
