/* cache_cuda.cu — the device-resident VQ cache of one layer (kvpq_cuda_cache): pages of key and
 * value codes in device memory handed out from a pool, a page table per sequence, a float32 ring of
 * the newest `window` positions, and decode attention from the codes (attend.cu). Every position is
 * encoded when appended; attention reads codes for positions older than the window and the float32
 * ring for the window, which equals encoding positions as they leave the window. */
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "fp16.h"

struct kvpq_cuda_cache {
    kvpq_cuda_cache_params p;
    kvpq_cuda_pq *kq, *vq;
    int max_pages;       /* per sequence */
    int n_pages;         /* pool: pages allocated now (kvpq_cuda_cache_params.n_pages, or grown on demand) */
    int pool_max;        /* most pages the pool may hold: n_pages given, else n_seq * max_pages */
    uint8_t *k_pages;    /* device (n_pages, n_head_kv, page_tokens, k_code_size) */
    uint8_t *v_pages;    /* device (n_pages, n_head_kv, page_tokens, v_code_size) */
    int *page_table;     /* device (n_seq, max_pages) */
    int *h_page_table;   /* host mirror */
    int *free_pages;     /* host stack of free page ids, room for n_pages */
    int n_free;
    int *seq_len;        /* device (n_seq) */
    int *h_len;          /* host (n_seq) */
    float *k_win, *v_win;/* device (n_seq, window, n_head_kv, head_dim) */
    float *part_o, *part_md;
    int *counters;       /* device (n_seq, n_head) zeros, for the attention kernel's split merge */
    float *k_mean;       /* device (n_head_kv, head_dim) per-channel key mean mu, or NULL */
    void *tc_image;      /* device codebook image of the tensor-core attention, or NULL (attend.cu) */
    int tc_kexp, tc_vexp;
    int max_splits;
    /* norm-explicit quantizers (kq->p / vq->p from a codebook with key_norm / value_norm) */
    int k_norm, v_norm;
    uint16_t *k_scales;  /* device (n_pages, n_head_kv, page_tokens) float16 s_k, or NULL */
    uint16_t *v_scales;  /* device (n_pages, n_head_kv, page_tokens) float16 s_v, or NULL */
    float *ne_x;         /* device (ne_rows, head_dim) directions being encoded (workspace) */
    float *ne_n;         /* device (ne_rows) their norms (workspace) */
    size_t ne_rows;
    unsigned long long *ne_bad; /* device (2): key, value: first scale beyond float16 (row << 32 | bits) */
    unsigned *ne_smax;   /* device (2): key, value: max float bits of |s| of the append in progress */
    float v_smax;        /* max |s_v| stored so far (the tensor-core kernel's P scale) */
    /* host-pointer calls (kvpq_cache with backend CUDA, src/cache/cache_vq_cuda.c): device staging */
    float *stage;        /* device (stage_cap) floats: k, v of an append or q, out, lse of an attention */
    size_t stage_cap;
    int *stage_len;      /* device (len_cap) per-query lengths of a causal attention */
    int len_cap;
    /* keys coded before RoPE (p.key_rope_dims > 0; rope.cu) */
    float *rope_freq;    /* device (key_rope_dims / 2) inv_freq, or NULL: keys coded as given */
    float *rope_x;       /* device (rope_cap) floats: the keys of an append turned back by -position */
    size_t rope_cap;
};

namespace {

/* Copy positions [first, n) of this append into the ring slots (pos0 + t) % window. */
__global__ void window_copy_kernel(const float *k, const float *v, const float *k_mean, float *kw, float *vw,
                                   int first, int n, int pos0, int window, int row_floats) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)(n - first) * row_floats;
    if (i >= total) return;
    int t = first + (int)(i / row_floats), e = (int)(i % row_floats);
    size_t dst = (size_t)((pos0 + t) % window) * row_floats + e;
    kw[dst] = k[(size_t)t * row_floats + e] - (k_mean ? k_mean[e] : 0.f);
    vw[dst] = v[(size_t)t * row_floats + e];
}

/* Ring rows of positions [pos0, pos0 + n) (all in the ring) into k, v (n, row_floats), the key mean
 * added back (the ring holds k - mu); either output may be NULL. */
__global__ void window_read_kernel(const float *kw, const float *vw, const float *k_mean, float *k, float *v,
                                   int pos0, int n, int window, int row_floats) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * row_floats) return;
    int t = (int)(i / row_floats), e = (int)(i % row_floats);
    size_t src = (size_t)((pos0 + t) % window) * row_floats + e;
    if (k) k[i] = kw[src] + (k_mean ? k_mean[e] : 0.f);
    if (v) v[i] = vw[src];
}

} // namespace

/* kvpq_cuda_cache_params_default: src/core/cuda_stub.c (one definition for every build). */

/* Whether p asks for keys coded before RoPE (some frequency nonzero), after checking the fields. */
static kvpq_status rope_check(const kvpq_cuda_cache_params *p, int *on) {
    *on = 0;
    if (p->key_rope_dims == 0) return KVPQ_OK;
    if (p->key_rope_dims < 0 || p->key_rope_dims % 2 || p->key_rope_dims > p->head_dim)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: key_rope_dims=%d: expected even, 0..head_dim=%d",
                         p->key_rope_dims, p->head_dim);
    if (p->key_rope_pos0 < 0 || p->key_rope_pos0 > INT_MAX - p->max_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: key_rope_pos0=%d: expected 0..INT_MAX - max_seq",
                         p->key_rope_pos0);
    for (int i = 0; p->key_rope_freq && i < p->key_rope_dims / 2; i++) {
        if (!isfinite(p->key_rope_freq[i]))
            return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_cuda_cache_new: key_rope_freq[%d]=%g is not finite", i,
                             (double)p->key_rope_freq[i]);
        if (p->key_rope_freq[i] != 0.f) *on = 1;
    }
    return KVPQ_OK;
}

/* The RoPE frequencies on the device (rope_check said on), or key_rope_dims set to 0 (off). */
static kvpq_status rope_upload(kvpq_cuda_cache *c, const kvpq_cuda_cache_params *p, int on) {
    if (!on) {
        c->p.key_rope_dims = 0;
        return KVPQ_OK;
    }
    const size_t nb = (size_t)(p->key_rope_dims / 2) * sizeof(float);
    KVPQ_CUDA_TRY(cudaMalloc((void **)&c->rope_freq, nb), "kvpq_cuda_cache_new: cudaMalloc key_rope_freq");
    return kvpq__cuda_err(cudaMemcpy(c->rope_freq, p->key_rope_freq, nb, cudaMemcpyHostToDevice),
                          "kvpq_cuda_cache_new: copy key_rope_freq");
}

extern "C" KVPQ_API void kvpq_cuda_cache_free(kvpq_cuda_cache *c) {
    if (!c) return;
    kvpq_cuda_pq_free(c->kq);
    kvpq_cuda_pq_free(c->vq);
    cudaFree(c->k_pages);
    cudaFree(c->v_pages);
    cudaFree(c->page_table);
    cudaFree(c->seq_len);
    cudaFree(c->k_win);
    cudaFree(c->v_win);
    cudaFree(c->part_o);
    cudaFree(c->part_md);
    cudaFree(c->counters);
    cudaFree(c->k_mean);
    cudaFree(c->tc_image);
    cudaFree(c->k_scales);
    cudaFree(c->v_scales);
    cudaFree(c->ne_x);
    cudaFree(c->ne_n);
    cudaFree(c->ne_bad);
    cudaFree(c->ne_smax);
    cudaFree(c->stage);
    cudaFree(c->stage_len);
    cudaFree(c->rope_freq);
    cudaFree(c->rope_x);
    free(c->h_page_table);
    free(c->free_pages);
    free(c->h_len);
    free(c);
}

static void fill_attend_params(const kvpq_cuda_cache *c, kvpq__attend_params *a) {
    memset(a, 0, sizeof *a);
    a->seq_len = c->seq_len;
    a->page_table = c->page_table;
    a->max_pages = c->max_pages;
    a->page_tokens = c->p.page_tokens;
    a->page_shift = -1;
    for (int sh = 0; sh < 31; sh++)
        if (c->p.page_tokens == 1 << sh) a->page_shift = sh;
    a->window = c->p.window;
    a->k_pages = c->k_pages;
    a->v_pages = c->v_pages;
    a->k_code_size = c->kq->code_size;
    a->v_code_size = c->vq->code_size;
    a->k_win = c->k_win;
    a->v_win = c->v_win;
    a->k_centroids = c->kq->centroids;
    a->k_ksub = c->kq->ksub;
    a->k_books = c->kq->n_books;
    a->k_nbits = c->kq->p.nbits;
    a->k_dsub = c->kq->dsub;
    a->v_centroids = c->vq->centroids;
    a->v_ksub = c->vq->ksub;
    a->v_books = c->vq->n_books;
    a->v_nbits = c->vq->p.nbits;
    a->v_dsub = c->vq->dsub;
    a->k_lambda = c->kq->lambda;
    a->v_rotate = c->vq->rotate;
    a->head_dim = c->p.head_dim;
    a->n_head = c->p.n_head;
    a->n_head_kv = c->p.n_head_kv;
    a->counters = c->counters;
    a->tc_image = c->tc_image;
    a->tc = c->p.kernels.attend_tc;
    a->tc_warps = c->p.kernels.attend_tc_warps;
    a->lut16 = c->p.kernels.attend_lut16;
    a->vrep = c->p.kernels.attend_vrep;
    a->pvec = c->p.kernels.attend_pvec;
    a->pdl = c->p.kernels.attend_pdl;
    a->cluster = c->p.kernels.attend_cluster;
    a->tc_regs = c->p.kernels.attend_tc_regs;
    a->tc_heads = c->p.kernels.attend_tc_heads;
    a->rope_freq = c->rope_freq;
    a->rope_dims = c->p.key_rope_dims;
    a->rope_neox = c->p.key_rope_neox;
    a->rope_pos0 = c->p.key_rope_pos0;
    a->k_mean = c->k_mean;
    a->tc_kexp = c->tc_kexp;
    a->tc_vexp = c->tc_vexp;
    a->k_scales = c->k_scales;
    a->v_scales = c->v_scales;
    /* P * s_v must stay within float16 in the tensor-core value mma: p <= 1, |s_v| <= 2^sexp, so P
     * enters as p * s_v * 2^(14 - sexp) <= 2^14 (plain values: p * 2^14, sexp 0) */
    int sexp = 0;
    if (c->v_scales && c->v_smax > 0.f) {
        frexpf(c->v_smax, &sexp); /* v_smax < 2^sexp */
        sexp = sexp < -60 ? -60 : sexp > 16 ? 16 : sexp;
    }
    a->tc_sexp = sexp;
    a->tc_pscale = ldexpf(1.f, 14 - sexp);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_new(kvpq_cuda_cache **out, const kvpq_cuda_cache_params *p) {
    if (!out || !p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: NULL argument");
    *out = NULL;
    /* A window longer than max_seq holds the whole sequence: clamp it (as kvpq_cache_new does). So
     * does a page longer than max_seq: it is cut to the smallest power of two >= max_seq (at least
     * 32, so that pages stay multiples of 32 and a power of two stays one: the tensor-core attention
     * needs that), if that is shorter. */
    kvpq_cuda_cache_params clamped = *p;
    if (clamped.max_seq > 0 && clamped.window > clamped.max_seq) clamped.window = clamped.max_seq;
    if (clamped.max_seq > 0 && clamped.page_tokens > clamped.max_seq && clamped.page_tokens % 32 == 0) {
        int pt = 32;
        while (pt < clamped.max_seq) pt *= 2;
        if (pt < clamped.page_tokens) clamped.page_tokens = pt;
    }
    p = &clamped;
    if (p->head_dim != 64 && p->head_dim != 128 && p->head_dim != 256)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_cache_new: head_dim=%d: expected 64, 128 or 256", p->head_dim);
    if (p->n_head_kv <= 0 || p->n_head <= 0 || p->n_head % p->n_head_kv)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: n_head=%d must be a positive multiple of n_head_kv=%d",
                         p->n_head, p->n_head_kv);
    if (p->n_head / p->n_head_kv > 64)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cuda_cache_new: %d query heads per KV head (at most 64)",
                         p->n_head / p->n_head_kv);
    if (p->n_seq <= 0 || p->max_seq <= 0 || p->max_seq > KVPQ_CACHE_MAX_SEQ)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: n_seq=%d must be > 0 and max_seq=%d in 1..2^30", p->n_seq,
                         p->max_seq);
    if (p->window < 0 || p->window > p->max_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: window=%d: expected 0..max_seq=%d", p->window,
                         p->max_seq);
    if (p->page_tokens <= 0 || p->page_tokens % 32)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: page_tokens=%d must be a positive multiple of 32",
                         p->page_tokens);
    if (p->n_pages < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: n_pages=%d < 0", p->n_pages);
    if (!p->key || !p->value) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_new: key or value quantizer is NULL");
    KVPQ_TRY(kvpq__cuda_kernels_check(&p->kernels, "kvpq_cuda_cache_new"));
    if (p->key->p.d != p->head_dim || p->value->p.d != p->head_dim)
        return kvpq__err(KVPQ_ERR_MISMATCH, "kvpq_cuda_cache_new: quantizer d (key %d, value %d) != head_dim %d",
                         p->key->p.d, p->value->p.d, p->head_dim);
    int rope = 0;
    KVPQ_TRY(rope_check(p, &rope));
    KVPQ_TRY(kvpq__cuda_require("kvpq_cuda_cache_new"));

    kvpq_cuda_cache *c = (kvpq_cuda_cache *)calloc(1, sizeof *c);
    if (!c) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_cache_new: out of memory");
    c->p = *p;
    c->p.key = NULL;
    c->p.value = NULL;
    c->p.key_smooth = NULL;
    c->p.key_mean = NULL;
    c->p.key_rope_freq = NULL;
    c->k_norm = p->key->norm_explicit != 0;
    c->v_norm = p->value->norm_explicit != 0;
    if (p->key_mean) {
        for (size_t i = 0; i < (size_t)p->n_head_kv * p->head_dim; i++)
            if (!isfinite(p->key_mean[i])) {
                free(c);
                return kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_cuda_cache_new: key_mean[%zu]=%g is not finite", i,
                                 (double)p->key_mean[i]);
            }
    }
    kvpq_cuda_pq_params kp = kvpq_cuda_pq_params_default(), vp;
    kp.n_head_kv = p->n_head_kv;
    kp.kernels = p->kernels;
    vp = kp;
    kp.lambda = p->key_smooth;
    kp.rotate = 1;
    vp.rotate = p->value_rotate;
    kvpq_status s = kvpq__cuda_pq_upload(&c->kq, p->key, &kp);
    if (s == KVPQ_OK) s = kvpq__cuda_pq_upload(&c->vq, p->value, &vp);
    /* the image only where the tensor-core kernel may run (kernels.attend_tc) */
    if (s == KVPQ_OK && p->kernels.attend_tc && !rope &&
        kvpq__cuda_tc_image(p->key, p->value, &c->tc_image, &c->tc_kexp, &c->tc_vexp) != KVPQ_OK) {
        c->tc_image = NULL;      /* no image (out of memory): the LUT kernel serves every attention call */
        (void)cudaGetLastError();
    }
    if (s == KVPQ_OK && p->key_mean) {
        size_t nm = (size_t)p->n_head_kv * p->head_dim * sizeof(float);
        s = kvpq__cuda_err(cudaMalloc((void **)&c->k_mean, nm), "kvpq_cuda_cache_new: cudaMalloc key_mean");
        if (s == KVPQ_OK)
            s = kvpq__cuda_err(cudaMemcpy(c->k_mean, p->key_mean, nm, cudaMemcpyHostToDevice),
                               "kvpq_cuda_cache_new: copy key_mean");
        if (s == KVPQ_OK) c->kq->mean = c->k_mean;
    }
    if (s == KVPQ_OK) s = rope_upload(c, p, rope);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("kvpq_cuda_cache_new");
        kvpq_cuda_cache_free(c);
        return s;
    }
    kvpq__attend_params a;
    fill_attend_params(c, &a);
    s = rope ? KVPQ_OK : kvpq__cuda_attend_check(&a); /* keys before RoPE: no tables (rope.cu) */
    if (s != KVPQ_OK) {
        kvpq_cuda_cache_free(c);
        return s;
    }
    c->max_pages = (p->max_seq + p->page_tokens - 1) / p->page_tokens;
    long long np = p->n_pages ? p->n_pages : (long long)p->n_seq * c->max_pages;
    if (np > 0x7fffffffLL) {
        kvpq_cuda_cache_free(c);
        return kvpq__err(KVPQ_ERR_CAPACITY, "kvpq_cuda_cache_new: %lld pages", np);
    }
    /* an explicit pool is allocated whole; the default one starts with a page per sequence and
     * grows on demand (grow_pool), so that a large batch x max_seq costs only what is held */
    c->pool_max = (int)np;
    c->n_pages = p->n_pages ? (int)np : p->n_seq < np ? p->n_seq : (int)np;
    c->max_splits = 256;
    size_t kpb = (size_t)p->n_head_kv * p->page_tokens * c->kq->code_size;
    size_t vpb = (size_t)p->n_head_kv * p->page_tokens * c->vq->code_size;
    size_t nwin = (size_t)p->n_seq * p->window * p->n_head_kv * p->head_dim;
    size_t npart = (size_t)p->n_seq * p->n_head * (c->max_splits + p->window / 32 + 2);
    c->h_page_table = (int *)malloc((size_t)p->n_seq * c->max_pages * sizeof(int));
    c->free_pages = (int *)malloc((size_t)c->n_pages * sizeof(int));
    c->h_len = (int *)calloc((size_t)p->n_seq, sizeof(int));
    if (!c->h_page_table || !c->free_pages || !c->h_len) {
        kvpq_cuda_cache_free(c);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_cache_new: out of memory");
    }
    for (size_t i = 0; i < (size_t)p->n_seq * c->max_pages; i++) c->h_page_table[i] = -1;
    for (int i = 0; i < c->n_pages; i++) c->free_pages[i] = c->n_pages - 1 - i;
    c->n_free = c->n_pages;
#define KVPQ_STEP(call, what)                                 \
    do {                                                      \
        if (s == KVPQ_OK) s = kvpq__cuda_err((call), (what)); \
    } while (0)
    KVPQ_STEP(cudaMalloc((void **)&c->k_pages, kpb * c->n_pages), "kvpq_cuda_cache_new: cudaMalloc key pages");
    KVPQ_STEP(cudaMalloc((void **)&c->v_pages, vpb * c->n_pages), "kvpq_cuda_cache_new: cudaMalloc value pages");
    KVPQ_STEP(cudaMalloc((void **)&c->page_table, (size_t)p->n_seq * c->max_pages * sizeof(int)),
              "kvpq_cuda_cache_new: cudaMalloc page table");
    KVPQ_STEP(cudaMalloc((void **)&c->seq_len, (size_t)p->n_seq * sizeof(int)), "kvpq_cuda_cache_new: cudaMalloc lengths");
    KVPQ_STEP(cudaMalloc((void **)&c->k_win, (nwin ? nwin : 1) * sizeof(float)), "kvpq_cuda_cache_new: cudaMalloc window");
    KVPQ_STEP(cudaMalloc((void **)&c->v_win, (nwin ? nwin : 1) * sizeof(float)), "kvpq_cuda_cache_new: cudaMalloc window");
    KVPQ_STEP(cudaMalloc((void **)&c->part_o, npart * p->head_dim * sizeof(float)), "kvpq_cuda_cache_new: cudaMalloc workspace");
    KVPQ_STEP(cudaMalloc((void **)&c->part_md, npart * 2 * sizeof(float)), "kvpq_cuda_cache_new: cudaMalloc workspace");
    KVPQ_STEP(cudaMalloc((void **)&c->counters, (size_t)p->n_seq * p->n_head * sizeof(int)),
              "kvpq_cuda_cache_new: cudaMalloc counters");
    KVPQ_STEP(cudaMemset(c->counters, 0, (size_t)p->n_seq * p->n_head * sizeof(int)), "kvpq_cuda_cache_new: counters");
    KVPQ_STEP(cudaMemcpy(c->page_table, c->h_page_table, (size_t)p->n_seq * c->max_pages * sizeof(int),
                         cudaMemcpyHostToDevice), "kvpq_cuda_cache_new: page table");
    KVPQ_STEP(cudaMemset(c->seq_len, 0, (size_t)p->n_seq * sizeof(int)), "kvpq_cuda_cache_new: lengths");
    if (c->k_norm || c->v_norm) {
        /* scales beside the code pages (same page ids), and the encode workspace: at most 4 MiB of
         * directions per pass, whole tokens */
        const size_t spb = (size_t)p->n_head_kv * p->page_tokens * sizeof(uint16_t) * c->n_pages;
        if (c->k_norm) KVPQ_STEP(cudaMalloc((void **)&c->k_scales, spb ? spb : 2), "kvpq_cuda_cache_new: cudaMalloc key scales");
        if (c->v_norm) KVPQ_STEP(cudaMalloc((void **)&c->v_scales, spb ? spb : 2), "kvpq_cuda_cache_new: cudaMalloc value scales");
        /* finite from the start: the tensor-core kernel multiplies the scales of a tile's positions
         * past the sequence's end by probability 0 */
        if (c->k_norm) KVPQ_STEP(cudaMemset(c->k_scales, 0, spb ? spb : 2), "kvpq_cuda_cache_new: key scales");
        if (c->v_norm) KVPQ_STEP(cudaMemset(c->v_scales, 0, spb ? spb : 2), "kvpq_cuda_cache_new: value scales");
        size_t tok = ((size_t)4 << 20) / ((size_t)p->n_head_kv * p->head_dim * sizeof(float));
        if (tok < 1) tok = 1;
        if (tok > (size_t)p->max_seq) tok = (size_t)p->max_seq;
        c->ne_rows = tok * p->n_head_kv;
        KVPQ_STEP(cudaMalloc((void **)&c->ne_x, c->ne_rows * p->head_dim * sizeof(float)),
                  "kvpq_cuda_cache_new: cudaMalloc norm-explicit workspace");
        KVPQ_STEP(cudaMalloc((void **)&c->ne_n, c->ne_rows * sizeof(float)), "kvpq_cuda_cache_new: cudaMalloc norm-explicit workspace");
        KVPQ_STEP(cudaMalloc((void **)&c->ne_bad, 2 * sizeof(unsigned long long)), "kvpq_cuda_cache_new: cudaMalloc flags");
        KVPQ_STEP(cudaMalloc((void **)&c->ne_smax, 2 * sizeof(unsigned)), "kvpq_cuda_cache_new: cudaMalloc flags");
    }
#undef KVPQ_STEP
    if (s != KVPQ_OK) {
        kvpq_cuda_cache_free(c);
        return s;
    }
    *out = c;
    return KVPQ_OK;
}

/* Move device array *p of `old` bytes to a new allocation of `grown` bytes (contents kept, the rest
 * zeroed: scales past a sequence's end must be finite). */
static kvpq_status regrow(void **p, size_t old, size_t grown, const char *what) {
    void *q = NULL;
    KVPQ_CUDA_TRY(cudaMalloc(&q, grown), what);
    kvpq_status s = kvpq__cuda_err(cudaMemcpy(q, *p, old, cudaMemcpyDeviceToDevice), what);
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemset((char *)q + old, 0, grown - old), what);
    if (s != KVPQ_OK) {
        cudaFree(q);
        return s;
    }
    cudaFree(*p);
    *p = q;
    return KVPQ_OK;
}

/* At least `need` free pages: the default pool grows (at least doubling, up to pool_max) by new
 * device arrays for the code pages and scales, the old contents copied; page ids stay valid. A
 * captured attention graph holds the old arrays' addresses: capture again after appends (kvpq.h). */
static kvpq_status grow_pool(kvpq_cuda_cache *c, int need) {
    if (need <= c->n_free) return KVPQ_OK;
    long long want = (long long)c->n_pages + (need - c->n_free), two = 2LL * c->n_pages;
    if (want > c->pool_max)
        return kvpq__err(KVPQ_ERR_CAPACITY, "kvpq_cuda_cache_append: %d pages needed, %d free in the pool of %d", need,
                         c->n_free, c->pool_max);
    const int n = (int)(two > want ? (two < c->pool_max ? two : c->pool_max) : want);
    int *fp = (int *)realloc(c->free_pages, (size_t)n * sizeof(int));
    if (!fp) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cuda_cache_append: out of memory growing the page pool");
    c->free_pages = fp;
    const size_t rows = (size_t)c->p.n_head_kv * c->p.page_tokens;
    const size_t kpb = rows * c->kq->code_size, vpb = rows * c->vq->code_size, spb = rows * sizeof(uint16_t);
    const char *what = "kvpq_cuda_cache_append: growing the page pool";
    KVPQ_TRY(regrow((void **)&c->k_pages, kpb * c->n_pages, kpb * n, what));
    KVPQ_TRY(regrow((void **)&c->v_pages, vpb * c->n_pages, vpb * n, what));
    if (c->k_scales) KVPQ_TRY(regrow((void **)&c->k_scales, spb * c->n_pages, spb * n, what));
    if (c->v_scales) KVPQ_TRY(regrow((void **)&c->v_scales, spb * c->n_pages, spb * n, what));
    for (int i = n - 1; i >= c->n_pages; i--) c->free_pages[c->n_free++] = i; /* lowest id on top */
    c->n_pages = n;
    return KVPQ_OK;
}

extern "C" KVPQ_API int kvpq_cuda_cache_seq_len(const kvpq_cuda_cache *c, int seq) {
    if (!c || seq < 0 || seq >= c->p.n_seq) return -1;
    return c->h_len[seq];
}

/* c->rope_x = the n key rows k of positions [L, L + n) turned back by -(key_rope_pos0 + position). */
static kvpq_status rope_back(kvpq_cuda_cache *c, int n, const float *k, int L) {
    const size_t need = (size_t)n * c->p.n_head_kv * c->p.head_dim;
    if (need > c->rope_cap) {
        cudaFree(c->rope_x);
        c->rope_x = NULL;
        c->rope_cap = 0;
        KVPQ_CUDA_TRY(cudaMalloc((void **)&c->rope_x, need * sizeof(float)), "kvpq_cuda_cache_append: cudaMalloc RoPE workspace");
        c->rope_cap = need;
    }
    return kvpq__cuda_rope_launch(k, c->rope_x, n, c->p.n_head_kv, c->p.head_dim, c->p.key_rope_dims, c->p.key_rope_neox,
                                  c->rope_freq, c->p.key_rope_pos0 + L, -1, 0);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_append(kvpq_cuda_cache *c, int seq, int n, const float *k,
                                                       const float *v) {
    if (!c) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_append: cache is NULL");
    if (seq < 0 || seq >= c->p.n_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_append: seq=%d: expected 0..%d", seq, c->p.n_seq - 1);
    if (n < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_append: n=%d < 0", n);
    if (n == 0) return KVPQ_OK;
    if (!k || !v) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_append: k or v is NULL");
    const int L = c->h_len[seq], PT = c->p.page_tokens;
    if ((long long)L + n > c->p.max_seq)
        return kvpq__err(KVPQ_ERR_CAPACITY, "kvpq_cuda_cache_append: sequence %d holds %d positions; %d more exceed max_seq=%d",
                         seq, L, n, c->p.max_seq);
    int *pt = c->h_page_table + (size_t)seq * c->max_pages;
    int first_new = (L + PT - 1) / PT, last = (L + n + PT - 1) / PT, need = last - first_new;
    KVPQ_TRY(grow_pool(c, need));
    for (int i = first_new; i < last; i++) pt[i] = c->free_pages[--c->n_free];
    kvpq_status s = KVPQ_OK;
    if (need)
        s = kvpq__cuda_err(cudaMemcpy(c->page_table + (size_t)seq * c->max_pages + first_new, pt + first_new,
                                      need * sizeof(int), cudaMemcpyHostToDevice),
                           "kvpq_cuda_cache_append: page table");
    const int H = c->p.n_head_kv;
    kvpq__code_dst kd = {c->k_pages, c->page_table + (size_t)seq * c->max_pages, L, PT,
                         (long long)H * PT * c->kq->code_size, (long long)PT * c->kq->code_size};
    kvpq__code_dst vd = {c->v_pages, c->page_table + (size_t)seq * c->max_pages, L, PT,
                         (long long)H * PT * c->vq->code_size, (long long)PT * c->vq->code_size};
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemsetAsync(c->kq->flag, 0, sizeof(int), 0), "kvpq_cuda_cache_append: flag");
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemsetAsync(c->vq->flag, 0, sizeof(int), 0), "kvpq_cuda_cache_append: flag");
    const int ne = c->k_norm || c->v_norm;
    if (s == KVPQ_OK && ne) {
        s = kvpq__cuda_err(cudaMemsetAsync(c->ne_bad, 0xff, 2 * sizeof(unsigned long long), 0), "kvpq_cuda_cache_append: flag");
        if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemsetAsync(c->ne_smax, 0, 2 * sizeof(unsigned), 0), "kvpq_cuda_cache_append: flag");
    }
    /* keys before RoPE: the coded keys are turned back by -position (the window keeps them as given) */
    const float *kx = k;
    if (s == KVPQ_OK && c->rope_freq) {
        s = rope_back(c, n, k, L);
        kx = c->rope_x;
    }
    /* norm-explicit quantizers code directions and store a float16 scale per (position, KV head) */
    if (s == KVPQ_OK)
        s = c->k_norm ? kvpq__cuda_encode_ne_launch(c->kq, (size_t)n, kx, kd, c->k_scales, c->ne_x, c->ne_n, c->ne_rows,
                                                    c->ne_bad, c->ne_smax, 0)
                      : kvpq__cuda_encode_launch(c->kq, (size_t)n, kx, kd, 0);
    if (s == KVPQ_OK)
        s = c->v_norm ? kvpq__cuda_encode_ne_launch(c->vq, (size_t)n, v, vd, c->v_scales, c->ne_x, c->ne_n, c->ne_rows,
                                                    c->ne_bad + 1, c->ne_smax + 1, 0)
                      : kvpq__cuda_encode_launch(c->vq, (size_t)n, v, vd, 0);
    int fk = 0, fv = 0;
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemcpy(&fk, c->kq->flag, sizeof(int), cudaMemcpyDeviceToHost), "kvpq_cuda_cache_append: encode");
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemcpy(&fv, c->vq->flag, sizeof(int), cudaMemcpyDeviceToHost), "kvpq_cuda_cache_append: encode");
    if (s == KVPQ_OK && (fk || fv))
        s = kvpq__err(KVPQ_ERR_NONFINITE, "kvpq_cuda_cache_append: %s hold NaN or Inf", fk ? (fv ? "k and v" : "k") : "v");
    unsigned smax[2] = {0, 0};
    if (s == KVPQ_OK && ne) {
        unsigned long long bad[2];
        s = kvpq__cuda_err(cudaMemcpy(bad, c->ne_bad, sizeof bad, cudaMemcpyDeviceToHost), "kvpq_cuda_cache_append: encode");
        if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemcpy(smax, c->ne_smax, sizeof smax, cudaMemcpyDeviceToHost), "kvpq_cuda_cache_append: encode");
        for (int w = 0; w < 2 && s == KVPQ_OK; w++)
            if (bad[w] != ~0ull) { /* as the CPU cache (vq_encode): refused, naming the position */
                const long long row = (long long)(bad[w] >> 32);
                const unsigned bits = (unsigned)(bad[w] & 0xffffffffu);
                float sv;
                memcpy(&sv, &bits, sizeof sv);
                s = kvpq__err(KVPQ_ERR_INVALID_ARG,
                              "kvpq_cuda_cache_append: the norm-explicit %s scale of position %lld, KV head %lld is %g, "
                              "beyond float16's range (65504)",
                              w ? "value" : "key", (long long)L + row / H, row % H, (double)sv);
            }
    }
    if (s == KVPQ_OK && c->p.window > 0) {
        int first = n > c->p.window ? n - c->p.window : 0, rf = H * c->p.head_dim;
        long long total = (long long)(n - first) * rf;
        size_t off = (size_t)seq * c->p.window * rf;
        window_copy_kernel<<<(unsigned)((total + 255) / 256), 256>>>(k, v, c->k_mean, c->k_win + off, c->v_win + off, first, n, L,
                                                                     c->p.window, rf);
        s = kvpq__cuda_err(cudaGetLastError(), "kvpq_cuda_cache_append: window copy launch");
    }
    int nl = L + n;
    if (s == KVPQ_OK)
        s = kvpq__cuda_err(cudaMemcpy(c->seq_len + seq, &nl, sizeof(int), cudaMemcpyHostToDevice),
                           "kvpq_cuda_cache_append: lengths");
    if (s != KVPQ_OK) {  /* give the pages back: the sequence is unchanged */
        for (int i = last - 1; i >= first_new; i--) {
            c->free_pages[c->n_free++] = pt[i];
            pt[i] = -1;
        }
        return s;
    }
    c->h_len[seq] = nl;
    if (c->v_norm) {
        float vm;
        memcpy(&vm, &smax[1], sizeof vm);
        if (vm > c->v_smax) c->v_smax = vm;
    }
    return KVPQ_OK;
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_clear(kvpq_cuda_cache *c, int seq) {
    if (!c || seq < 0 || seq >= c->p.n_seq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_clear: bad cache or seq");
    int *pt = c->h_page_table + (size_t)seq * c->max_pages;
    int used = (c->h_len[seq] + c->p.page_tokens - 1) / c->p.page_tokens;
    int zero = 0;
    KVPQ_CUDA_TRY(cudaMemcpy(c->seq_len + seq, &zero, sizeof(int), cudaMemcpyHostToDevice), "kvpq_cuda_cache_clear");
    for (int i = used - 1; i >= 0; i--) {
        c->free_pages[c->n_free++] = pt[i];
        pt[i] = -1;
    }
    c->h_len[seq] = 0;
    return KVPQ_OK;
}

/* Decode [pos0, pos0 + n) of sequence seq from its pages into x (keys: kind 0, values: 1). */
static kvpq_status read_codes_dev(const kvpq_cuda_cache *c, int seq, int kind, int pos0, int n, float *x,
                                  cudaStream_t stream) {
    kvpq__code_src src = {c->page_table + (size_t)seq * c->max_pages, c->p.page_tokens, pos0,
                          kind ? c->v_scales : c->k_scales, kind ? NULL : c->k_mean};
    return kvpq__cuda_decode_paged_launch(kind ? c->vq : c->kq, (size_t)n, kind ? c->v_pages : c->k_pages, &src, x,
                                          stream);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_read(const kvpq_cuda_cache *c, int seq, int pos0, int n,
                                                     int from_codes, float *k, float *v, void *stream) {
    if (!c) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_read: cache is NULL");
    if (seq < 0 || seq >= c->p.n_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_read: seq=%d: expected 0..%d", seq, c->p.n_seq - 1);
    const int len = c->h_len[seq], W = c->p.window;
    if (n < 0 || pos0 < 0 || (long long)pos0 + n > len)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_read: positions [%d, %lld) outside the %d held by sequence %d",
                         pos0, (long long)pos0 + n, len, seq);
    if (n == 0) return KVPQ_OK;
    if (!k && !v) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_read: k and v are both NULL");
    cudaStream_t st = (cudaStream_t)stream;
    const int w0 = from_codes || W == 0 ? len : (len > W ? len - W : 0); /* the ring serves [w0, len) */
    const int c1 = pos0 + n < w0 ? pos0 + n : w0;
    const size_t rf = (size_t)c->p.n_head_kv * c->p.head_dim;
    if (c1 > pos0) {
        if (k) KVPQ_TRY(read_codes_dev(c, seq, 0, pos0, c1 - pos0, k, st));
        if (k && c->rope_freq) /* decoded before RoPE: turned forward */
            KVPQ_TRY(kvpq__cuda_rope_launch(k, k, c1 - pos0, c->p.n_head_kv, c->p.head_dim, c->p.key_rope_dims,
                                            c->p.key_rope_neox, c->rope_freq, c->p.key_rope_pos0 + pos0, 1, st));
        if (v) KVPQ_TRY(read_codes_dev(c, seq, 1, pos0, c1 - pos0, v, st));
    }
    const int r0 = c1 > pos0 ? c1 : pos0, nr = pos0 + n - r0;
    if (nr > 0) {
        const size_t off = (size_t)seq * W * rf, skip = (size_t)(r0 - pos0) * rf;
        const long long total = (long long)nr * rf;
        window_read_kernel<<<(unsigned)((total + 255) / 256), 256, 0, st>>>(
            c->k_win + off, c->v_win + off, c->k_mean, k ? k + skip : NULL, v ? v + skip : NULL, r0, nr, W, (int)rf);
        KVPQ_CUDA_TRY(cudaGetLastError(), "kvpq_cuda_cache_read: window read launch");
    }
    return KVPQ_OK;
}

/* The attention kernel of this cache over B sequences, the longest max_len positions long. */
static kvpq_status attend_launch(const kvpq_cuda_cache *c, kvpq__attend_params *a, int B, int max_len,
                                 cudaStream_t stream) {
    if (c->rope_freq) return kvpq__cuda_attend_rope_launch(a, B, max_len, c->max_splits, stream);
    const int max_coded = max_len - (max_len < c->p.window ? max_len : c->p.window);
    return kvpq__cuda_attend_launch(a, B, max_coded, c->max_splits, stream);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_attend_async(kvpq_cuda_cache *c, int n_seq, const float *q,
                                                             float *out, void *stream) {
    if (!c || !q || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_attend: NULL argument");
    if (n_seq < 1 || n_seq > c->p.n_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_attend: n_seq=%d: expected 1..%d", n_seq, c->p.n_seq);
    int max_len = 0;
    for (int b = 0; b < n_seq; b++) {
        int L = c->h_len[b];
        if (L < 1) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cuda_cache_attend: sequence %d is empty", b);
        if (L > max_len) max_len = L;
    }
    kvpq__attend_params a;
    fill_attend_params(c, &a);
    a.q = q;
    a.out = out;
    a.part_o = c->part_o;
    a.part_md = c->part_md;
    return attend_launch(c, &a, n_seq, max_len, (cudaStream_t)stream);
}

extern "C" KVPQ_API kvpq_status kvpq_cuda_cache_attend(kvpq_cuda_cache *c, int n_seq, const float *q, float *out) {
    KVPQ_TRY(kvpq_cuda_cache_attend_async(c, n_seq, q, out, NULL));
    return kvpq__cuda_err(cudaDeviceSynchronize(), "kvpq_cuda_cache_attend: kernel");
}

extern "C" KVPQ_API size_t kvpq_cuda_cache_resident_bytes(const kvpq_cuda_cache *c) {
    if (!c) return 0;
    size_t kpb = (size_t)c->p.n_head_kv * c->p.page_tokens * c->kq->code_size;
    size_t vpb = (size_t)c->p.n_head_kv * c->p.page_tokens * c->vq->code_size;
    size_t used = (size_t)(c->n_pages - c->n_free) * (kpb + vpb);
    size_t win = 2 * (size_t)c->p.n_seq * c->p.window * c->p.n_head_kv * c->p.head_dim * sizeof(float);
    size_t books = ((size_t)c->kq->n_books * c->kq->ksub * (c->kq->dsub + 1) +
                    (size_t)c->vq->n_books * c->vq->ksub * (c->vq->dsub + 1)) * sizeof(float);
    size_t tables = (size_t)c->p.n_seq * (c->max_pages + 1) * sizeof(int);
    size_t image = c->tc_image ? 256 * 256 : 0; /* the tensor-core attention's codebook image */
    if (c->rope_freq) books += (size_t)(c->p.key_rope_dims / 2) * sizeof(float);
    /* norm-explicit: a float16 scale per (position, KV head) of the pages in use, per kind (the
     * encode workspace, like the attention workspace, is not counted) */
    size_t scales = (size_t)(c->n_pages - c->n_free) * c->p.n_head_kv * c->p.page_tokens * sizeof(uint16_t) *
                    (size_t)(c->k_norm + c->v_norm);
    return used + win + books + tables + image + scales;
}

/* Test hook (gpu_check): the codes and float16 scales sequence `seq` holds, positions [0, len):
 * kc (len, n_head_kv, k_code_size), vc (len, n_head_kv, v_code_size), ks / vs (len, n_head_kv)
 * (each may be NULL; ks / vs are left alone for a plain quantizer). Host outputs. */
extern "C" kvpq_status kvpq__cuda_cache_read_codes(const kvpq_cuda_cache *c, int seq, uint8_t *kc, uint8_t *vc,
                                                   uint16_t *ks, uint16_t *vs) {
    if (!c || seq < 0 || seq >= c->p.n_seq) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_read_codes: bad seq");
    const int L = c->h_len[seq], PT = c->p.page_tokens, H = c->p.n_head_kv;
    const int *pt = c->h_page_table + (size_t)seq * c->max_pages;
    const size_t kcs = c->kq->code_size, vcs = c->vq->code_size, cmax = kcs > vcs ? kcs : vcs;
    uint8_t *buf = (uint8_t *)malloc((size_t)H * PT * cmax);
    if (!buf) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq__cuda_cache_read_codes: out of memory");
    kvpq_status s = KVPQ_OK;
    /* a page at a time: (n_head_kv, page_tokens, bytes per position) */
    for (int t0 = 0; t0 < L && s == KVPQ_OK; t0 += PT) {
        const int n = L - t0 < PT ? L - t0 : PT, page = pt[t0 / PT];
        for (int w = 0; w < 4 && s == KVPQ_OK; w++) {
            uint8_t *out = w == 0 ? kc : w == 1 ? vc : w == 2 ? (uint8_t *)ks : (uint8_t *)vs;
            const uint8_t *src = w == 0 ? c->k_pages : w == 1 ? c->v_pages : w == 2 ? (const uint8_t *)c->k_scales
                                                                                 : (const uint8_t *)c->v_scales;
            const size_t bs = w == 0 ? kcs : w == 1 ? vcs : 2;
            if (!out || !src) continue;
            s = kvpq__cuda_err(cudaMemcpy(buf, src + (size_t)page * H * PT * bs, (size_t)H * PT * bs, cudaMemcpyDeviceToHost),
                               "kvpq__cuda_cache_read_codes");
            for (int h = 0; h < H && s == KVPQ_OK; h++)
                for (int t = 0; t < n; t++)
                    memcpy(out + ((size_t)(t0 + t) * H + h) * bs, buf + ((size_t)h * PT + t) * bs, bs);
        }
    }
    free(buf);
    return s;
}

/* ---- host-pointer calls of one sequence (seq 0): kvpq_cache with backend CUDA --------------------
 * src/cache/cache_vq_cuda.c (the VQ kind of kvpq_cache on the GPU) calls these; declared in
 * src/core/internal.h, stubbed in src/core/cuda_stub.c for builds without CUDA. */

/* Device staging of at least n floats (grown, never shrunk; its old contents are dropped). */
static kvpq_status stage_floats(kvpq_cuda_cache *c, size_t n) {
    if (n <= c->stage_cap) return KVPQ_OK;
    cudaFree(c->stage);
    c->stage = NULL;
    c->stage_cap = 0;
    KVPQ_CUDA_TRY(cudaMalloc((void **)&c->stage, n * sizeof(float)), "kvpq cache (cuda): staging buffer");
    c->stage_cap = n;
    return KVPQ_OK;
}

extern "C" kvpq_status kvpq__cuda_cache_append_host(kvpq_cuda_cache *c, int n, const float *k, const float *v) {
    if (!c || n < 0 || !k || !v) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_append_host: bad argument");
    if (n == 0) return KVPQ_OK;
    const size_t rows = (size_t)n * c->p.n_head_kv * c->p.head_dim;
    KVPQ_TRY(stage_floats(c, 2 * rows));
    KVPQ_CUDA_TRY(cudaMemcpy(c->stage, k, rows * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): copy K");
    KVPQ_CUDA_TRY(cudaMemcpy(c->stage + rows, v, rows * sizeof(float), cudaMemcpyHostToDevice),
                  "kvpq cache (cuda): copy V");
    return kvpq_cuda_cache_append(c, 0, n, c->stage, c->stage + rows);
}

extern "C" kvpq_status kvpq__cuda_cache_attend_host(kvpq_cuda_cache *c, int n_q, const float *q, float *out,
                                                    float *lse) {
    if (!c || n_q < 1 || !q || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_attend_host: bad argument");
    const int len = c->h_len[0], W = c->p.window;
    if (n_q > len)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq cache (cuda): %d queries, %d positions held", n_q, len);
    if (n_q > 1 && W > 0 && len > W)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                         "kvpq cache (cuda): %d queries at once over %d positions: the float32 window (%d) holds only "
                         "the newest positions, so the earlier queries' windows are gone; attend one query per "
                         "append (kvpq_cache_append_attend does)", n_q, len, W);
    if (n_q > c->len_cap) {
        cudaFree(c->stage_len);
        c->stage_len = NULL;
        c->len_cap = 0;
        KVPQ_CUDA_TRY(cudaMalloc((void **)&c->stage_len, (size_t)n_q * sizeof(int)), "kvpq cache (cuda): lengths");
        c->len_cap = n_q;
    }
    int *lens = (int *)malloc((size_t)n_q * sizeof(int));
    if (!lens) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq cache (cuda): out of memory");
    for (int i = 0; i < n_q; i++) lens[i] = len - n_q + 1 + i; /* query i sees positions [0, lens[i]) */
    const size_t qw = (size_t)c->p.n_head * c->p.head_dim;
    kvpq_status s = stage_floats(c, 2 * n_q * qw + (size_t)n_q * c->p.n_head);
    float *dq = c->stage, *dout = dq + n_q * qw, *dlse = dout + n_q * qw;
    if (s == KVPQ_OK)
        s = kvpq__cuda_err(cudaMemcpy(c->stage_len, lens, (size_t)n_q * sizeof(int), cudaMemcpyHostToDevice),
                           "kvpq cache (cuda): lengths");
    if (s == KVPQ_OK)
        s = kvpq__cuda_err(cudaMemcpy(dq, q, n_q * qw * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): copy Q");
    /* one launch per query on the default stream (ordered), each reading its own length; a query's
     * window [lens[i] - W, lens[i]) is still in the ring (checked above) */
    for (int i = 0; i < n_q && s == KVPQ_OK; i++) {
        kvpq__attend_params a;
        fill_attend_params(c, &a);
        a.seq_len = c->stage_len + i;
        a.q = dq + i * qw;
        a.out = dout + i * qw;
        a.lse = lse ? dlse + (size_t)i * c->p.n_head : NULL;
        a.part_o = c->part_o;
        a.part_md = c->part_md;
        s = attend_launch(c, &a, 1, lens[i], 0);
    }
    free(lens);
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaDeviceSynchronize(), "kvpq cache (cuda): attention kernel");
    if (s == KVPQ_OK)
        s = kvpq__cuda_err(cudaMemcpy(out, dout, n_q * qw * sizeof(float), cudaMemcpyDeviceToHost), "kvpq cache (cuda): copy out");
    if (s == KVPQ_OK && lse)
        s = kvpq__cuda_err(cudaMemcpy(lse, dlse, (size_t)n_q * c->p.n_head * sizeof(float), cudaMemcpyDeviceToHost),
                           "kvpq cache (cuda): copy lse");
    return s;
}

extern "C" kvpq_status kvpq__cuda_cache_read_host(kvpq_cuda_cache *c, int pos0, int n, int from_codes, float *k,
                                                  float *v) {
    if (!c || n < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_read_host: bad argument");
    if (n == 0 || (!k && !v)) return KVPQ_OK;
    const size_t rows = (size_t)n * c->p.n_head_kv * c->p.head_dim;
    KVPQ_TRY(stage_floats(c, 2 * rows));
    KVPQ_TRY(kvpq_cuda_cache_read(c, 0, pos0, n, from_codes, k ? c->stage : NULL, v ? c->stage + rows : NULL, NULL));
    /* on the legacy default stream, after the read */
    if (k) KVPQ_CUDA_TRY(cudaMemcpy(k, c->stage, rows * sizeof(float), cudaMemcpyDeviceToHost), "kvpq cache (cuda): read K");
    if (v) KVPQ_CUDA_TRY(cudaMemcpy(v, c->stage + rows, rows * sizeof(float), cudaMemcpyDeviceToHost), "kvpq cache (cuda): read V");
    return KVPQ_OK;
}

extern "C" kvpq_status kvpq__cuda_cache_truncate(kvpq_cuda_cache *c, int n) {
    if (!c || n < 0 || n > c->h_len[0]) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_truncate: bad argument");
    const int PT = c->p.page_tokens, used = (c->h_len[0] + PT - 1) / PT, keep = (n + PT - 1) / PT;
    KVPQ_CUDA_TRY(cudaMemcpy(c->seq_len, &n, sizeof(int), cudaMemcpyHostToDevice), "kvpq cache (cuda): truncate");
    int *pt = c->h_page_table;
    for (int i = used - 1; i >= keep; i--) {
        c->free_pages[c->n_free++] = pt[i];
        pt[i] = -1;
    }
    c->h_len[0] = n;
    if (!c->v_norm) return KVPQ_OK;
    /* the tensor-core kernel's P scale follows the largest |s_v| held: as a cache fed [0, n) has it */
    uint16_t *vs = (uint16_t *)malloc(((size_t)n * c->p.n_head_kv + 1) * sizeof *vs);
    if (!vs) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq cache (cuda): out of memory truncating");
    kvpq_status s = kvpq__cuda_cache_read_codes(c, 0, NULL, NULL, NULL, vs);
    c->v_smax = 0.f;
    for (size_t i = 0; s == KVPQ_OK && i < (size_t)n * c->p.n_head_kv; i++) {
        const float a = fabsf(kvpq__h2f(vs[i]));
        if (a > c->v_smax) c->v_smax = a;
    }
    free(vs);
    return s;
}

/* The float32 ring rows of positions [pos0, pos0 + n) (all within the newest `window`): k (keys
 * minus the key mean, as stored) and v host (n, n_head_kv, head_dim), either may be NULL. */
extern "C" kvpq_status kvpq__cuda_cache_read_window(const kvpq_cuda_cache *c, int pos0, int n, float *k, float *v) {
    const int len = c ? c->h_len[0] : 0, W = c ? c->p.window : 0;
    if (!c || n < 0 || pos0 < len - W || pos0 < 0 || pos0 + n > len)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_read_window: positions outside the window");
    const size_t rf = (size_t)c->p.n_head_kv * c->p.head_dim;
    for (int t = pos0; t < pos0 + n; t++) {
        const size_t src = (size_t)(t % W) * rf, dst = (size_t)(t - pos0) * rf;
        if (k) KVPQ_CUDA_TRY(cudaMemcpy(k + dst, c->k_win + src, rf * sizeof(float), cudaMemcpyDeviceToHost), "kvpq cache (cuda): read window");
        if (v) KVPQ_CUDA_TRY(cudaMemcpy(v + dst, c->v_win + src, rf * sizeof(float), cudaMemcpyDeviceToHost), "kvpq cache (cuda): read window");
    }
    return KVPQ_OK;
}

extern "C" kvpq_status kvpq__cuda_cache_write_window(kvpq_cuda_cache *c, int pos0, int n, const float *k,
                                                     const float *v) {
    const int len = c ? c->h_len[0] : 0, W = c ? c->p.window : 0;
    if (!c || !k || !v || n < 0 || pos0 < 0 || pos0 < len - W || pos0 + n > len)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_write_window: positions outside the window");
    const size_t rf = (size_t)c->p.n_head_kv * c->p.head_dim;
    for (int t = pos0; t < pos0 + n; t++) {
        const size_t dst = (size_t)(t % W) * rf, src = (size_t)(t - pos0) * rf;
        KVPQ_CUDA_TRY(cudaMemcpy(c->k_win + dst, k + src, rf * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): write window");
        KVPQ_CUDA_TRY(cudaMemcpy(c->v_win + dst, v + src, rf * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): write window");
    }
    return KVPQ_OK;
}

/* A loaded state: sequence 0 (empty) gets len positions: codes kc (len, n_head_kv, k_code_size),
 * vc likewise, float16 scales ks / vs (len, n_head_kv) of norm-explicit quantizers (else ignored),
 * and the ring rows of positions [len - min(len, window), len), kw (keys minus the mean) and vw
 * (min(len, window), n_head_kv, head_dim). Host inputs. */
extern "C" kvpq_status kvpq__cuda_cache_write(kvpq_cuda_cache *c, int len, const uint8_t *kc, const uint8_t *vc,
                                              const uint16_t *ks, const uint16_t *vs, const float *kw, const float *vw) {
    if (!c || c->h_len[0] != 0 || len < 0 || len > c->p.max_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__cuda_cache_write: bad argument");
    const int PT = c->p.page_tokens, H = c->p.n_head_kv, need = (len + PT - 1) / PT, W = c->p.window;
    KVPQ_TRY(grow_pool(c, need));
    for (int i = 0; i < need; i++) c->h_page_table[i] = c->free_pages[--c->n_free];
    KVPQ_CUDA_TRY(cudaMemcpy(c->page_table, c->h_page_table, (size_t)c->max_pages * sizeof(int), cudaMemcpyHostToDevice),
                  "kvpq cache (cuda): page table");
    const size_t kcs = c->kq->code_size, vcs = c->vq->code_size, cmax = kcs > vcs ? kcs : vcs;
    uint8_t *buf = (uint8_t *)calloc((size_t)H * PT, cmax);
    if (!buf) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq cache (cuda): out of memory");
    kvpq_status s = KVPQ_OK;
    for (int t0 = 0; t0 < len && s == KVPQ_OK; t0 += PT) { /* a page at a time, (n_head_kv, page_tokens, bytes) */
        const int n = len - t0 < PT ? len - t0 : PT, page = c->h_page_table[t0 / PT];
        for (int w = 0; w < 4 && s == KVPQ_OK; w++) {
            const uint8_t *in = w == 0 ? kc : w == 1 ? vc : w == 2 ? (const uint8_t *)ks : (const uint8_t *)vs;
            uint8_t *dst = w == 0 ? c->k_pages : w == 1 ? c->v_pages : w == 2 ? (uint8_t *)c->k_scales : (uint8_t *)c->v_scales;
            const size_t bs = w == 0 ? kcs : w == 1 ? vcs : 2;
            if (!in || !dst) continue;
            for (int h = 0; h < H; h++)
                for (int t = 0; t < n; t++) memcpy(buf + ((size_t)h * PT + t) * bs, in + ((size_t)(t0 + t) * H + h) * bs, bs);
            s = kvpq__cuda_err(cudaMemcpy(dst + (size_t)page * H * PT * bs, buf, (size_t)H * PT * bs, cudaMemcpyHostToDevice),
                               "kvpq cache (cuda): write codes");
        }
    }
    free(buf);
    const size_t rf = (size_t)H * c->p.head_dim;
    for (int t = len - (len < W ? len : W); t < len && s == KVPQ_OK; t++) {
        const size_t src = (size_t)(t - (len - (len < W ? len : W))) * rf, dst = (size_t)(t % W) * rf;
        s = kvpq__cuda_err(cudaMemcpy(c->k_win + dst, kw + src, rf * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): write window");
        if (s == KVPQ_OK)
            s = kvpq__cuda_err(cudaMemcpy(c->v_win + dst, vw + src, rf * sizeof(float), cudaMemcpyHostToDevice), "kvpq cache (cuda): write window");
    }
    if (s == KVPQ_OK) s = kvpq__cuda_err(cudaMemcpy(c->seq_len, &len, sizeof(int), cudaMemcpyHostToDevice), "kvpq cache (cuda): length");
    if (s != KVPQ_OK) {
        for (int i = need - 1; i >= 0; i--) {
            c->free_pages[c->n_free++] = c->h_page_table[i];
            c->h_page_table[i] = -1;
        }
        return s;
    }
    c->h_len[0] = len;
    if (c->v_norm && vs) /* the tensor-core kernel's P scale: the largest |s_v| held */
        for (size_t i = 0; i < (size_t)len * H; i++) {
            const float a = fabsf(kvpq__h2f(vs[i]));
            if (a > c->v_smax) c->v_smax = a;
        }
    return KVPQ_OK;
}
