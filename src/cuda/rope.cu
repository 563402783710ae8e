/* rope.cu — keys coded before RoPE on the GPU (kvpq_cuda_cache_params.key_rope_dims; KVQuant, Hooper
 * et al., arXiv 2401.18079, sec. 3.2): the rotation of key rows by +-position (append: turned back
 * before coding; read: turned forward after decoding) and the attention of such a layer.
 *
 * The attention cannot score keys from per-query tables: a coded key's rotation depends on its
 * position. A CTA takes one (sequence, KV head, split) by tiles of kT positions: its warps decode the
 * tile's rows into shared memory (codes loaded a row ahead; centroids, inverse Hadamard rotation,
 * times lambda and the norm-explicit scale, plus the key mean, as decode.cu; then the key rotated by
 * its position; positions of the float32 window are read from it: k + mu, v rotated into the value
 * codebook's space), once for all the group's query heads; then each warp scores the tile for its
 * heads, a position per lane, and adds the values, with an online softmax in the log2 domain
 * (FlashAttention-2, Dao 2023); each head's sum is turned back by the value rotation once. A second
 * kernel merges the splits and writes the output and the log-sum-exp. (A warp-per-position form ran
 * until 2026-12-06: 1.6x slower at batch 8, bench/results/gpu_rope/tile_h100.) Angles: pos * inv_freq in double,
 * reduced to [-pi, pi], then the hardware sin / cos (the CPU's kvpq_rope_rotate takes cos / sin in
 * double: the two agree to about 1e-6). */
#include <math.h>

#include "common.cuh"

namespace {

constexpr int kNW = 4; /* warps per CTA of the attention */

/* cos and sin of sign * pos * inv_freq: the angle in double, reduced to [-pi, pi], then the
 * hardware's sin / cos (absolute error about 5e-7 there, below float rounding of the products). */
__device__ __forceinline__ void rope_cs(long long pos, float inv_freq, int sign, float *c, float *s) {
    double th = (double)pos * (double)inv_freq;
    th -= 6.283185307179586 * rint(th * 0.15915494309189535);
    __sincosf((float)(sign * th), s, c);
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

/* What a lane needs of one coded position, loaded an iteration ahead (the page table, code and scale
 * loads depend on each other: their latency, not arithmetic, bounded the loop): the codes of its
 * elements [l*EPL, (l+1)*EPL) in the key and value rows, and the norm-explicit scales (1 without). */
template <int EPL>
struct Pre {
    int kc[EPL], vc[EPL];
    float sk, sv;
};

template <int EPL>
__device__ __forceinline__ void fetch(const kvpq__attend_params &p, int b, int h, int t, int lane, Pre<EPL> &f) {
    const long long page = p.page_table[(long long)b * p.max_pages + t / p.page_tokens];
    const long long r = (page * p.n_head_kv + h) * p.page_tokens + t % p.page_tokens;
    const uint8_t *kr = p.k_pages + r * p.k_code_size, *vr = p.v_pages + r * p.v_code_size;
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        f.kc[j] = kvpq__get_code(kr, (lane * EPL + j) / p.k_dsub, p.k_nbits);
        f.vc[j] = kvpq__get_code(vr, (lane * EPL + j) / p.v_dsub, p.v_nbits);
    }
    f.sk = p.k_scales ? __half2float(__ushort_as_half(p.k_scales[r])) : 1.f;
    f.sv = p.v_scales ? __half2float(__ushort_as_half(p.v_scales[r])) : 1.f;
}

/* The centroids of a lane's codes times scale: lane l's elements of the row in the codebook's
 * (rotated) space. */
template <int EPL>
__device__ __forceinline__ void gather(const int (&code)[EPL], const float *cent, int books, int ksub, int dsub,
                                       float scale, int lane, float (&x)[EPL]) {
#pragma unroll
    for (int j = 0; j < EPL; j++) {
        const int e = lane * EPL + j, m = e / dsub;
        x[j] = cent[((size_t)(books == 1 ? 0 : m) * ksub + code[j]) * dsub + (e - m * dsub)] * scale;
    }
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

/* Key of (b, h, t) in the original space after RoPE, and its value in the value codebook's space
 * (rotated when v_rotate: the sum over positions is turned back once, at the end). f: the codes of
 * a coded position t < coded. */
template <int EPL>
__device__ __forceinline__ void load_kv(const kvpq__attend_params &p, float *row, int b, int h, int t, int coded,
                                        const Pre<EPL> &f, int lane, float (&k)[EPL], float (&v)[EPL]) {
    const size_t hoff = (size_t)h * (32 * EPL) + lane * EPL;
    if (t >= coded) { /* the float32 ring: k - mu, v */
        const size_t off = (((size_t)b * p.window + t % p.window) * p.n_head_kv) * (32 * EPL) + hoff;
#pragma unroll
        for (int j = 0; j < EPL; j++) {
            k[j] = p.k_win[off + j] + (p.k_mean ? p.k_mean[hoff + j] : 0.f);
            v[j] = p.v_win[off + j];
        }
        if (p.v_rotate) kvpq__warp_fwht<EPL>(v, lane); /* H is its own inverse */
        return;
    }
    gather<EPL>(f.kc, p.k_centroids, p.k_books, p.k_ksub, p.k_dsub, f.sk, lane, k);
    kvpq__warp_fwht<EPL>(k, lane);
#pragma unroll
    for (int j = 0; j < EPL; j++)
        k[j] = k[j] * (p.k_lambda ? p.k_lambda[hoff + j] : 1.f) + (p.k_mean ? p.k_mean[hoff + j] : 0.f);
    rope_warp<EPL>(p, row, (long long)p.rope_pos0 + t, lane, k);
    gather<EPL>(f.vc, p.v_centroids, p.v_books, p.v_ksub, p.v_dsub, f.sv, lane, v);
}

constexpr int kT = 32; /* positions per tile of the tile kernel */

/* Shared memory of the tile kernel, in floats: keys (kT, D + 4: float4 rows on distinct banks),
 * values (kT, D), queries (GS, D), probabilities (GS, kT). */
template <int D, int GS>
constexpr int tile_floats() { return kT * (D + 4) + kT * D + GS * D + GS * kT; }

/* Positions [tb, tb + kT) of (b, h) into the tile: keys after RoPE, values in the value codebook's
 * space; positions at or past t1 as zeros. Warp w takes rows w, w + kNW, ... (codes one row ahead). */
template <int D>
__device__ __forceinline__ void decode_tile(const kvpq__attend_params &p, float *sK, float *sV, int b, int h, int tb,
                                            int t1, int coded, int warp, int lane) {
    constexpr int EPL = D / 32, KS = D + 4;
    const int cend = t1 < coded ? t1 : coded;
    Pre<EPL> cur{}, nxt{};
    if (tb + warp < cend) fetch<EPL>(p, b, h, tb + warp, lane, cur);
    for (int i = warp; i < kT; i += kNW) {
        const int t = tb + i;
        if (i + kNW < kT && t + kNW < cend) fetch<EPL>(p, b, h, t + kNW, lane, nxt);
        float *kr = sK + i * KS, *vr = sV + i * D, k[EPL], v[EPL];
        if (t < t1) {
            load_kv<EPL>(p, kr, b, h, t, coded, cur, lane, k, v);
        } else {
#pragma unroll
            for (int j = 0; j < EPL; j++) k[j] = v[j] = 0.f;
        }
#pragma unroll
        for (int j = 0; j < EPL; j++) kr[lane * EPL + j] = k[j], vr[lane * EPL + j] = v[j];
        cur = nxt;
    }
}

/* One query head (q: D floats in shared memory, pre-scaled) over the tile: lane = position for the
 * scores (float4 rows, no shuffles), an online-softmax step (m, l), then lane = element for the
 * value sum: o[j] holds element j * 32 + lane. pr: the head's kT probabilities (shared). */
template <int D>
__device__ __forceinline__ void score_pv(const float *sK, const float *sV, const float *q, float *pr, bool valid,
                                         int lane, float (&o)[D / 32], float &m, float &l) {
    constexpr int EPL = D / 32, KS = D + 4;
    const float4 *k4 = reinterpret_cast<const float4 *>(sK + lane * KS), *q4 = reinterpret_cast<const float4 *>(q);
    float s = 0.f;
#pragma unroll 8
    for (int d = 0; d < D / 4; d++) {
        const float4 a = q4[d], c = k4[d];
        s += a.x * c.x + a.y * c.y + a.z * c.z + a.w * c.w;
    }
    s = valid ? s : -INFINITY;
    float mx = s;
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(KVPQ_FULL_MASK, mx, x));
    const float mn = fmaxf(m, mx), corr = exp2f(m - mn), pp = valid ? exp2f(s - mn) : 0.f;
    float sum = pp;
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) sum += __shfl_xor_sync(KVPQ_FULL_MASK, sum, x);
    l = l * corr + sum;
    m = mn;
    pr[lane] = pp;
    __syncwarp();
#pragma unroll
    for (int j = 0; j < EPL; j++) o[j] *= corr;
    for (int t = 0; t < kT; t++) {
        const float w = pr[t];
#pragma unroll
        for (int j = 0; j < EPL; j++) o[j] += w * sV[t * D + j * 32 + lane];
    }
    __syncwarp();
}

/* Split blockIdx.x of (sequence blockIdx.z, head group blockIdx.y): GS query heads of one KV head,
 * positions [split * chunk, min(L, (split + 1) * chunk)), by tiles of kT: the CTA's warps decode a
 * tile into shared memory (each position once for all GS heads), then each warp scores and sums it
 * for its heads (warp w: heads w, w + kNW, ...), so the only shuffles per position are the key's
 * Hadamard rotation. Partials: part_o (B, n_head, n_splits, D) unnormalized, part_md {m (log2
 * domain, -inf when empty), d} (a head's whole split in one warp). */
template <int D, int GS>
__global__ void __launch_bounds__(kNW * 32) attend_rope_tile_kernel(const kvpq__attend_params p) {
    constexpr int EPL = D / 32, KS = D + 4, HW = (GS + kNW - 1) / kNW;
    extern __shared__ float4 smem_rope[];
    float *sK = reinterpret_cast<float *>(smem_rope), *sV = sK + kT * KS, *sQ = sV + kT * D, *sP = sQ + GS * D;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, b = blockIdx.z, split = blockIdx.x;
    const int G = p.n_head / p.n_head_kv, groups = G / GS;
    const int kvh = blockIdx.y / groups, head0 = kvh * G + (int)(blockIdx.y % groups) * GS;
    const int L = p.seq_len[b], coded = L - (p.window < L ? p.window : L);
    const int t0 = split * p.chunk, t1 = L < t0 + p.chunk ? L : t0 + p.chunk;
    const float qs = 1.4426950408889634f * rsqrtf((float)D);
    for (int i = threadIdx.x; i < GS * D; i += kNW * 32) sQ[i] = p.q[((size_t)b * p.n_head + head0) * D + i] * qs;
    float o[HW][EPL], m[HW], l[HW];
#pragma unroll
    for (int r = 0; r < HW; r++) {
        m[r] = -INFINITY, l[r] = 0.f;
#pragma unroll
        for (int j = 0; j < EPL; j++) o[r][j] = 0.f;
    }
    for (int tb = t0; tb < t1; tb += kT) {
        decode_tile<D>(p, sK, sV, b, kvh, tb, t1, coded, warp, lane);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < HW; r++)
            if (warp + kNW * r < GS)
                score_pv<D>(sK, sV, sQ + (warp + kNW * r) * D, sP + (warp + kNW * r) * kT, tb + lane < t1, lane, o[r],
                            m[r], l[r]);
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < HW; r++) {
        const int h = warp + kNW * r;
        if (h >= GS) continue;
        float *row = sK + warp * KS, x[EPL]; /* the tile is free after the last __syncthreads */
#pragma unroll
        for (int j = 0; j < EPL; j++) row[j * 32 + lane] = o[r][j];
        __syncwarp();
#pragma unroll
        for (int j = 0; j < EPL; j++) x[j] = row[lane * EPL + j];
        __syncwarp();
        if (p.v_rotate) kvpq__warp_fwht<EPL>(x, lane); /* back from the value codebook's space */
        const size_t part = ((size_t)b * p.n_head + head0 + h) * p.n_splits + split;
#pragma unroll
        for (int j = 0; j < EPL; j++) p.part_o[part * D + lane * EPL + j] = x[j];
        if (lane == 0) p.part_md[2 * part] = m[r], p.part_md[2 * part + 1] = l[r];
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
    int splits = (8 * n_sm + pairs - 1) / pairs;       /* about 8 CTAs per multiprocessor (2 waves) */
    const int by_len = (max_len + 8 * kNW - 1) / (8 * kNW); /* at least 8 positions per warp */
    if (splits > by_len) splits = by_len;
    if (splits > max_splits) splits = max_splits;
    if (splits < 1) splits = 1;
    p.chunk = ((max_len + splits - 1) / splits + kT - 1) / kT * kT; /* whole tiles */
    p.n_splits = (max_len + p.chunk - 1) / p.chunk;
    p.n_wsplits = 0;
    const dim3 grid(p.n_splits, p.n_head / GS, B);
    const int bytes = tile_floats<D, GS>() * (int)sizeof(float);
    KVPQ_CUDA_TRY(cudaFuncSetAttribute(attend_rope_tile_kernel<D, GS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       bytes), "cuda attend (keys before RoPE): shared memory attribute");
    attend_rope_tile_kernel<D, GS><<<grid, kNW * 32, bytes, stream>>>(p);
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
