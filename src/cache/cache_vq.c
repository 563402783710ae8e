/* cache_vq.c — the VQ kind of kvpq_cache: keys and values stored as product-quantization codes,
 * attention computed from the codes (VecInfer, arXiv 2510.06175).
 *
 * Encoding (per token, per KV head h, layer codebook from the borrowed kvpq_codebook):
 *   key   k (head_dim) -> k' = H ((k - mu_h) / lambda_h) -> PQ codes with the layer's key quantizer
 *   value v (head_dim) -> v' = H v (value_rotate) or v -> PQ codes with the value quantizer
 * H is the normalized Walsh-Hadamard transform (orthonormal, self-inverse); lambda_h are the
 * smoothing factors of KV head h (every query head uses those of the KV head it reads) and mu_h
 * its per-channel key mean (0 for a version 1 codebook file). Centering is exact: the coded score
 * approximates q . (k - mu), so q . mu / sqrt(d) is added back (folded into the LUT's row m = 0,
 * which every coded score reads once), and the window, stored uncentered, needs nothing.
 *
 * Attention from codes, per query head g of KV head h (VecInfer sec. 3.3):
 *   q' = H (q * lambda_h) / sqrt(head_dim); LUT[m][c] = q'_m . C_k[m][c] + [m = 0] q . mu_h / sqrt(d)
 *   score(t) = sum_m LUT[m][code_k(t, m)]                                  (= q . k_hat(t) / sqrt(d))
 *   online softmax over the coded tokens in chunks; weights p(t) summed per (m, c) into
 *   W[m][c] = sum_{t: code_v(t, m) = c} p(t), then o'_m = sum_c W[m][c] C_v[m][c] once, and
 *   o = H o' when values are rotated (H is linear, so it commutes with the weighted sum).
 * The window part (fp16 keys/values in the original space) is attended exactly and merged with
 * the coded part through the online-softmax state {m, d, o} (kvpq_softmax_merge).
 * All query heads of a GQA group are processed together: their LUTs and W tables are interleaved
 * on the innermost axis (vq_kernels.h), so each code byte is read once per group.
 *
 * Storage, per layer:
 *   - coded positions [0, n_coded): pages of page_tokens positions, allocated as the sequence
 *     grows; one page holds K codes (n_head_kv, page_tokens, k_code_size) then V codes
 *     (n_head_kv, page_tokens, v_code_size), so one head's codes are contiguous within a page.
 *     k_code_size and v_code_size are the layer's own: a codebook may give layers different key
 *     and value M (per-layer bit allocation, kvpq_codebook_set_layer_key_M / _value_M), so page
 *     sizes, LUT and W-table shapes and fast-scan use differ by layer; the per-thread scratch is
 *     sized for the largest.
 *   - window positions [n_coded, len): fp16 (IEEE half) keys and values in the original space, in
 *     a ring (n_head_kv, cap, head_dim), slot = position % cap, cap = window + VQ_FLUSH.
 *   n_coded = floor((len - window) / VQ_FLUSH) * VQ_FLUSH when len >= window + VQ_FLUSH, else 0:
 *   the newest `window` tokens (up to window + VQ_FLUSH - 1) stay in fp16, and the overflow is
 *   encoded in batches of VQ_FLUSH tokens (one encode call per batch instead of one per token).
 *   n_coded depends only on len (and on truncation), so the split never depends on how the data
 *   was chunked into appends. Encoding starts from the fp16-rounded token (as stored in the
 *   window), so a token's codes do not depend on when it left the window either.
 * Norm-explicit quantizers (kvpq_codebook_params.key_norm / value_norm; Dai et al., AAAI 2020):
 * the quantizer codes the direction u = x / |x| of the transformed vector x, and a float16 scale
 * s = x . r / |r|^2 per (token, KV head) (r = decoded direction) follows the V codes in the page,
 * (n_head_kv, page_tokens) for keys then for values, so x_hat = s r. A coded key's score is then
 * s * sum_m LUT[m][code_m] + q . mu / sqrt(d) (the mean term is added after the scaling, not
 * folded into the LUT), and a coded value's softmax weight p(t) enters the per-centroid sums as
 * p(t) s(t) while the softmax denominator keeps p(t). Fast-scan is not used with norm-explicit keys.
 * 8-bit scales (codebook metadata k.norm_bits / v.norm_bits = "8", layers whose quantizer has at
 * most 4 bits per element: kvpq__codebook_scale_bytes): a byte c per (token, KV head) instead of
 * the float16, s = m 2^((c - 128) / 16) (c = 0: s = 0), m a power of two per (page, KV head, kind)
 * set by the page's first nonzero scale (2^round(log2 s)), kept as a float after the scales. The code's step is 1/16 octave: relative error <= 2.2%, about 1.6e-4
 * of the direction's squared error against the 0.09 of d4b8's (docs/vq_cache.md "8-bit scales");
 * a later scale beyond m 2^(+-7.9) moves m (and the page's earlier codes) by whole octaves, exactly,
 * as far as the earlier codes allow, and is clamped only where the page's scales span more than
 * 15.9 octaves; a negative least-squares scale (u . r < 0) becomes 0. The code is decoded to float16 before the kernels read it, so attention, read and
 * the saved cache see the same value.
 * Truncation below n_coded keeps the remaining positions as codes (their full precision is gone);
 * the window refills from the next appends. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "cache/cache_cpu.h"
#include "cache/cache_impl.h"
#include "cpu/vq_kernels.h"
#include "pq/pq_impl.h"

#define VQ_FLUSH 32         /* window overflow is encoded in batches of this many tokens */
#define VQ_CHUNK 256        /* most coded tokens per kernel call (bounds the unpacked-index scratch) */
#define VQ_BLOCK_FLOATS 4096  /* scores of one two-pass block: (block tokens, gp) floats, 16 KiB (L1) */
#define VQ_MIN_SPLIT 512    /* fewest coded tokens per split of one head's context (decode) */
#define VQ_DENSE_MIN_Q 16   /* queries per attend call from which they attend densely to decoded rows */
#define VQ_FP16_MAX 65504.0f

// ---- state ----------------------------------------------------------------------------------

typedef struct {
    uint8_t **pages;  /* (max_pages) each page_bytes: K codes then V codes, see above */
    size_t kcs;       /* bytes of one K code vector: this layer's key M (kvpq_codebook_layer_key_M) */
    size_t vcs;       /* bytes of one V code vector: this layer's value M (kvpq_codebook_layer_value_M) */
    size_t page_bytes;/* n_head_kv * page_tokens * (kcs + vcs), then the scales (see vq_scales) */
    size_t scale_off[2]; /* byte offsets of the K and V scales in a page (kvpq__vq_page_layout) */
    int fast_scan;    /* st->fast_scan and this layer's key M <= 256 */
    int Mk;           /* key codes per vector: stage one's M, plus stage two's M with two key stages */
    int n_pages;      /* pages allocated: [first_page, n_pages) are non-NULL */
    int first_page;   /* pages before it were dropped (sliding-window layers) */
    int swa;          /* sliding window of this layer (positions a query sees), 0 = none */
    uint16_t *wk;     /* (n_head_kv, cap, head_dim) fp16 window keys; NULL until the first append */
    uint16_t *wv;     /* (n_head_kv, cap, head_dim) fp16 window values */
    int n_coded;      /* positions [0, n_coded) are codes */
    int sb[2];        /* bytes of a key / value scale: 0 (not norm-explicit), 1 (8-bit code) or 2 (float16) */
    size_t ref_off;   /* byte offset in a page of the 8-bit scales' references m: (kinds with sb 1, n_head_kv) floats */
} vq_layer;

typedef struct {          /* per-thread scratch, sized at creation: nothing allocated in attend */
    float *qr;            /* (gp, head_dim) smoothed, rotated, scaled queries of one group */
    float *lut;           /* (Mk, ksub_k, gp) */
    float *table;         /* (Mv, ksub_v, gp) */
    float *s;             /* (block tokens, gp) scores, then weights: a whole two-pass block */
    uint16_t *idx;        /* (VQ_CHUNK, max(Mk, Mv)) unpacked codes when nbits != 8 */
    float *rescale;       /* (gp) */
    uint8_t *lut8;        /* (group, Mk, 256) fast-scan LUT, when fast_scan */
    float *fs_scale, *fs_bias; /* (gp) fast-scan step and offset per head */
    float *wkf, *wvf;     /* (cap, head_dim) window keys / values as float */
    float *ws;            /* (cap) window scores */
    float *o;             /* (gp, head_dim) merged output of one group */
    float *ow;            /* (head_dim) window output of one head */
    float *s32;           /* (VQ_CHUNK) 8-bit scales decoded, as float */
    uint16_t *s16;        /* (VQ_CHUNK) the same as float16, as the kernels read them */
    uint8_t *dcodes;      /* (VQ_CHUNK * n_head_kv, largest code size) a chunk's codes to decode (vq_dec_fill) */
    float *dx;            /* (VQ_CHUNK * n_head_kv, head_dim) their decoded rows */
} vq_scratch;

typedef struct {
    kvpq_cache_params params; /* as created (the dense attention's driver reads its shapes and windows) */
    int n_layer, n_head, n_head_kv, head_dim;
    int group;            /* n_head / n_head_kv query heads per KV head */
    int gp;               /* group padded to 1, 4, 8 or a multiple of 16 lanes */
    int window, cap, page_tokens, max_pages, n_threads;
    int value_rotate;
    int k_norm, v_norm;   /* norm-explicit key / value quantizers: a scale per (token, KV head) (vq_layer.sb) */
    int fast_scan;        /* params.vq_fast_scan and 8-bit key codes (per layer: also M <= 256) */
    float scale;          /* 1 / sqrt(head_dim) */
    int k_ksub, v_ksub;   /* code sizes are per layer (vq_layer.kcs, .vcs) */
    const kvpq_pq **kpq;  /* (n_layer) borrowed from the codebook */
    const kvpq_pq **kpq2; /* (n_layer) stage-two key quantizers (residual VQ), NULL with one stage */
    const kvpq_pq **vpq;  /* (n_layer) */
    const float **smooth; /* (n_layer) -> (n_head_kv, head_dim) borrowed */
    const float **mean;   /* (n_layer) -> (n_head_kv, head_dim) borrowed key means mu */
    size_t codebook_bytes;/* centroids of every layer plus smoothing factors and key means */
    vq_layer *layers;     /* (n_layer) */
    vq_scratch *scr;      /* (n_threads) */
    float *xk, *xv;       /* (tokens to encode, n_head_kv, head_dim) append staging, transformed */
    size_t xk_cap, xv_cap;/* floats */
    uint8_t *ck, *cv;     /* (tokens to encode, n_head_kv, code size) the encoded batch */
    size_t ck_cap, cv_cap;/* bytes */
    float *xr;            /* (tokens to encode * n_head_kv, head_dim) decoded directions (norm-explicit) */
    size_t xr_cap;        /* floats */
    uint16_t *sk, *sv;    /* (tokens to encode, n_head_kv) float16 scales of the encoded batch */
    size_t sk_cap, sv_cap;/* elements */
    uint16_t *h16;        /* (n_head_kv, head_dim) fp16 staging of one token */
    float *part;          /* (part_cap) per attention job: m (gp), d (gp), o (gp, head_dim) */
    size_t part_cap;      /* floats */
    int *left;            /* (left_cap) per (query, KV head) of an attention call: splits not yet done */
    size_t left_cap;
    float s8tab[256];     /* 2^((c - 128) / 16), s8tab[0] = 0: the 8-bit scale code's factor */
    kvpq_page_pool *pool; /* params.pool: pages and window rings come from it (NULL: the system) */
    /* Keys coded before RoPE (kvpq_codebook_params.key_rope_dims): */
    int rope_dims, rope_neox;
    const float **rope;   /* (n_layer) inv_freq of a layer coding keys before RoPE, else NULL */
    int pos0;             /* sequence position of the kind's position 0: params.sinks (cache.c holds the sinks) */
    /* Coded keys (dec[0], RoPE applied for keys before RoPE) and values (dec[1]) of one layer decoded
     * into the original space (vq_read's values), (n_head_kv, dec_rows[w], head_dim), rows [0, dec_n[w])
     * for positions dec_t0.. of layer dec_layer (-1: none): the keys of a layer coding keys before
     * RoPE, and both for prefill attention (vq_dense_attend). Kept between attend calls, so the runs
     * of one prefill (kvpq_cache_append_attend) decode each position once; codes never change under
     * it (8-bit scale re-basing keeps values), and truncate frees it. Working memory like the other
     * scratch: not in resident_bytes (one layer's keys and values in float32). */
    float *dec[2];
    int dec_rows[2], dec_n[2], dec_layer, dec_t0;
    /* A fused append-attend (vq_stage_exact, vq_attend_staged): the exact keys (ex[0]) and values
     * (ex[1]) of positions [ex_t0, ex_t0 + ex_n) of layer ex_layer (-1: none staged) as the window
     * holds them, (n_head_kv, ex_n, head_dim) floats, 64-byte aligned; the layer held ex_len
     * positions, ex_nc coded, before the append; bound (ex_cap) the queries' first exact positions. */
    float *ex[2];
    int *bound;
    size_t ex_cap, bound_cap; /* floats of each ex[w]; ints of bound */
    int ex_layer, ex_t0, ex_n, ex_len, ex_nc;
} vq_state;

/* Bytes of one of a layer's two fp16 window rings (K or V): (n_head_kv, cap, head_dim). */
static size_t vq_ring_bytes(const vq_state *st) {
    return (size_t)st->cap * st->n_head_kv * st->head_dim * sizeof(uint16_t);
}

/* The fp16 ring row of position t, KV head h, of a layer's keys (w 0) or values (w 1). */
static uint16_t *vq_ring_row(const vq_state *st, const vq_layer *L, int w, int h, int t) {
    return (w ? L->wv : L->wk) + ((size_t)h * st->cap + (size_t)(t % st->cap)) * st->head_dim;
}

/* The exact keys and values of positions [t0, t1) of a layer holding len, as the window holds them
 * (fp16): from the ring for t < len, else from k, v (n, n_head_kv, head_dim) appended at len,
 * rounded to fp16. Position t, KV head h goes to xk / xv + (t - t0) ts + h hs. */
static void vq_exact_rows(vq_state *st, const vq_layer *L, int len, int t0, int t1, const float *k, const float *v,
                          float *xk, float *xv, size_t ts, size_t hs) {
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    const int nkv = st->n_head_kv, d = st->head_dim;
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < nkv; h++) {
            float *ok = xk + (size_t)(t - t0) * ts + (size_t)h * hs, *ov = xv + (size_t)(t - t0) * ts + (size_t)h * hs;
            if (t < len) {
                K->f16_to_f32(d, vq_ring_row(st, L, 0, h, t), ok);
                K->f16_to_f32(d, vq_ring_row(st, L, 1, h, t), ov);
                continue;
            }
            const size_t at = ((size_t)(t - len) * nkv + h) * d;
            K->f32_to_f16(d, k + at, st->h16);
            K->f16_to_f32(d, st->h16, ok);
            K->f32_to_f16(d, v + at, st->h16);
            K->f16_to_f32(d, st->h16, ov);
        }
}

/* The layer's K and V rings from the pool (zeroed); on failure neither. */
static kvpq_status vq_ring_get(vq_state *st, vq_layer *L, int layer) {
    void *k = NULL, *v = NULL;
    kvpq_status s = kvpq__pool_get(st->pool, vq_ring_bytes(st), &k);
    if (s == KVPQ_OK) s = kvpq__pool_get(st->pool, vq_ring_bytes(st), &v);
    if (s != KVPQ_OK) {
        kvpq__pool_put(st->pool, k, vq_ring_bytes(st));
        kvpq__err_prefix("VQ cache: the window of layer %d", layer);
        return s;
    }
    L->wk = k, L->wv = v;
    return KVPQ_OK;
}

static void vq_ring_put(vq_state *st, vq_layer *L) {
    kvpq__pool_put(st->pool, L->wk, vq_ring_bytes(st));
    kvpq__pool_put(st->pool, L->wv, vq_ring_bytes(st));
    L->wk = L->wv = NULL;
}

/* Pages [L->n_pages, n) from the pool; on failure the layer keeps the pages it had. */
static kvpq_status vq_pages_get(vq_state *st, vq_layer *L, int n) {
    const int old = L->n_pages;
    for (int pg = L->n_pages; pg < n; pg++) {
        void *p;
        kvpq_status s = kvpq__pool_get(st->pool, L->page_bytes, &p);
        if (s != KVPQ_OK) {
            for (int q = old; q < pg; q++) {
                kvpq__pool_put(st->pool, L->pages[q], L->page_bytes);
                L->pages[q] = NULL;
            }
            L->n_pages = old;
            return s;
        }
        L->pages[pg] = p;
        L->n_pages = pg + 1;
    }
    return KVPQ_OK;
}

/* Give back pages [n, L->n_pages). */
static void vq_pages_put(vq_state *st, vq_layer *L, int n) {
    for (int pg = n; pg < L->n_pages; pg++) {
        kvpq__pool_put(st->pool, L->pages[pg], L->page_bytes);
        L->pages[pg] = NULL;
    }
    if (L->n_pages > n) L->n_pages = n;
}

static int vq_target_coded(const vq_state *st, int len) {
    if (len < st->window + VQ_FLUSH) return 0;
    return ((len - st->window) / VQ_FLUSH) * VQ_FLUSH;
}

/* Coded tokens per two-pass block (scores of a whole block are kept, see vq_coded_part). */
static int vq_block_tokens(int gp) {
    int n = VQ_BLOCK_FLOATS / gp;
    return n < VQ_CHUNK ? VQ_CHUNK : n;
}

/* Tokens from t to the end of its page, at most VQ_CHUNK and at most t1 - t. */
static int vq_seg(const vq_state *st, int t, int t1) {
    int n = st->page_tokens - t % st->page_tokens;
    if (n > VQ_CHUNK) n = VQ_CHUNK;
    return n < t1 - t ? n : t1 - t;
}

static uint8_t *vq_kcodes(const vq_state *st, const vq_layer *L, int h, int pos) {
    return L->pages[pos / st->page_tokens] + ((size_t)h * st->page_tokens + pos % st->page_tokens) * L->kcs;
}

static uint8_t *vq_vcodes(const vq_state *st, const vq_layer *L, int h, int pos) {
    return L->pages[pos / st->page_tokens] + (size_t)st->n_head_kv * st->page_tokens * L->kcs +
           ((size_t)h * st->page_tokens + pos % st->page_tokens) * L->vcs;
}

/* The scales of KV head h from position pos to the end of its page (L->sb[is_value] bytes each:
 * float16 or 8-bit codes): is_value 0 for keys, 1 for values (norm-explicit quantizers only). */
static uint8_t *vq_scales(const vq_state *st, const vq_layer *L, int is_value, int h, int pos) {
    uint8_t *base = L->pages[pos / st->page_tokens] + L->scale_off[is_value];
    return base + ((size_t)h * st->page_tokens + pos % st->page_tokens) * L->sb[is_value];
}

/* The reference m of the 8-bit scales of KV head h in page pg (0 until the page's first batch). */
static float *vq_scale_ref(const vq_state *st, const vq_layer *L, int is_value, int h, int pg) {
    const int kind = is_value && L->sb[0] == 1; /* key references first when keys have them too */
    return (float *)(L->pages[pg] + L->ref_off) + (size_t)kind * st->n_head_kv + h;
}

/* The value of 8-bit scale code c against the reference m (before the float16 rounding). */
static float vq_s8_decode(const vq_state *st, uint8_t c, float m) { return m * st->s8tab[c]; }

/* n float16 scales of KV head h from position t (within one page), as the kernels read them: in
 * the page for float16 scales, else the 8-bit codes decoded (m s8tab[c] rounded to float16) into
 * s16 (n elements, through s32): the one decode of attention and read. */
static const uint16_t *vq_scales16(const vq_state *st, const vq_layer *L, int is_value, int h, int t, int n,
                                   float *s32, uint16_t *s16, const kvpq_vq_kernels *K) {
    const uint8_t *p = vq_scales(st, L, is_value, h, t);
    if (L->sb[is_value] == 2) return (const uint16_t *)p;
    const float m = *vq_scale_ref(st, L, is_value, h, t / st->page_tokens);
    for (int i = 0; i < n; i++) s32[i] = vq_s8_decode(st, p[i], m);
    K->f32_to_f16(n, s32, s16);
    return s16;
}

/* 8-bit code of a scale x against the reference m (see the header): 0 for x <= 0 (or m unset);
 * never one whose value exceeds float16's range (x <= 65504 may round up to 2^16 = inf in float16). */
static uint8_t vq_s8_code(const vq_state *st, float x, float m) {
    if (!(x > 0.0f) || !(m > 0.0f)) return 0;
    long c = lrintf(16.0f * log2f(x / m)) + 128;
    c = c < 1 ? 1 : c > 255 ? 255 : c;
    while (c > 1 && m * st->s8tab[c] > VQ_FP16_MAX) c--;
    return (uint8_t)c;
}

static void vq_scratch_free(vq_scratch *s) {
    free(s->qr);
    free(s->lut);
    free(s->table);
    free(s->s);
    free(s->idx);
    free(s->rescale);
    free(s->lut8);
    free(s->fs_scale);
    free(s->fs_bias);
    free(s->wkf);
    free(s->wvf);
    free(s->ws);
    free(s->o);
    free(s->ow);
    free(s->s32);
    free(s->s16);
    free(s->dcodes);
    free(s->dx);
}

static void vq_destroy(void *state) {
    vq_state *st = state;
    if (!st) return;
    if (st->layers)
        for (int l = 0; l < st->n_layer; l++) {
            vq_layer *L = &st->layers[l];
            if (L->pages) vq_pages_put(st, L, 0);
            free(L->pages);
            vq_ring_put(st, L);
        }
    if (st->scr)
        for (int t = 0; t < st->n_threads; t++) vq_scratch_free(&st->scr[t]);
    void *bufs[] = {st->scr, st->layers, st->kpq, st->kpq2, st->vpq, st->smooth, st->mean, st->xk,
                    st->xv,  st->ck,     st->cv,  st->xr,   st->sk,  st->sv,     st->h16,  st->part,
                    st->rope, st->dec[0], st->dec[1], st->ex[0], st->ex[1], st->bound, st->left};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) free(bufs[i]);
    free(st);
}

// ---- create ---------------------------------------------------------------------------------

static kvpq_status vq_check_codebook(const kvpq_cache_params *p, const kvpq_codebook *cb) {
    /* n_layer, n_head_kv and head_dim: checked against p by cache.c (cache_impl.h) */
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    if (cp.key.d != p->head_dim || cp.value.d != p->head_dim)
        return kvpq__err(KVPQ_ERR_MISMATCH, "VQ cache: codebook quantizers have d=%d (key) and %d (value), expected head_dim=%d",
                         cp.key.d, cp.value.d, p->head_dim);
    for (int l = 0; l < p->n_layer; l++) {
        const kvpq_pq *k = kvpq_codebook_pq_const(cb, l, 0), *v = kvpq_codebook_pq_const(cb, l, 1);
        const float *lam = kvpq_codebook_key_smooth_const(cb, l);
        if (!k || !v || !lam) return kvpq__err(KVPQ_ERR_MISMATCH, "VQ cache: codebook lacks layer %d", l);
        if (k->p.d != p->head_dim || v->p.d != p->head_dim)
            return kvpq__err(KVPQ_ERR_MISMATCH, "VQ cache: codebook layer %d quantizer d=%d/%d, expected head_dim=%d", l,
                             k->p.d, v->p.d, p->head_dim);
        const float *mu = kvpq_codebook_key_mean_const(cb, l);
        for (size_t i = 0; i < (size_t)p->n_head_kv * p->head_dim; i++)
            if (!isfinite(mu[i]))
                return kvpq__err(KVPQ_ERR_NONFINITE, "VQ cache: codebook layer %d key mean [head %zu][channel %zu] is %g",
                                 l, i / (size_t)p->head_dim, i % (size_t)p->head_dim, (double)mu[i]);
        KVPQ_TRY(kvpq__codebook_check_rope(cb, l, "VQ cache"));
        for (size_t i = 0; i < (size_t)p->n_head_kv * p->head_dim; i++)
            if (!(lam[i] > 0.0f) || !isfinite(lam[i]))
                return kvpq__err(KVPQ_ERR_INVALID_ARG,
                                 "VQ cache: codebook layer %d key smoothing factor [head %zu][channel %zu] = %g: must be finite and > 0",
                                 l, i / (size_t)p->head_dim, i % (size_t)p->head_dim, (double)lam[i]);
    }
    return KVPQ_OK;
}

static kvpq_status vq_create(void **state, const kvpq_cache_params *p) {
    *state = NULL;
    const kvpq_codebook *cb = p->codebook;
    if (!cb) return kvpq__err(KVPQ_ERR_INVALID_ARG, "VQ cache: params.codebook is NULL (a trained codebook is required)");
    if (p->n_layer <= 0 || p->n_head <= 0 || p->n_head_kv <= 0 || p->n_head % p->n_head_kv || p->max_seq <= 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "VQ cache: bad shape n_layer=%d n_head=%d n_head_kv=%d max_seq=%d",
                         p->n_layer, p->n_head, p->n_head_kv, p->max_seq);
    if (p->head_dim <= 0 || (p->head_dim & (p->head_dim - 1)))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "VQ cache: head_dim=%d: the Hadamard rotation needs a power of two",
                         p->head_dim);
    if (p->window < 0 || p->window > p->max_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "VQ cache: window=%d: expected 0..max_seq (%d)", p->window, p->max_seq);
    if (p->page_tokens <= 0 || p->page_tokens > (1 << 20))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "VQ cache: page_tokens=%d: expected 1..%d", p->page_tokens, 1 << 20);
    KVPQ_TRY(vq_check_codebook(p, cb));
    int sb_check = 0;
    for (int kind = 0; kind < 2; kind++) KVPQ_TRY(kvpq__codebook_scale_bytes(cb, 0, kind, &sb_check)); /* metadata */

    vq_state *st = calloc(1, sizeof *st);
    if (!st) return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory");
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    st->pool = p->pool;
    st->n_layer = p->n_layer;
    st->n_head = p->n_head;
    st->n_head_kv = p->n_head_kv;
    st->head_dim = p->head_dim;
    st->group = p->n_head / p->n_head_kv;
    st->gp = st->group == 1 ? 1 : st->group <= 4 ? 4 : st->group <= 8 ? 8 : (st->group + 15) / 16 * 16;
    st->window = p->window;
    st->cap = p->window + VQ_FLUSH;
    st->page_tokens = p->page_tokens;
    st->max_pages = (p->max_seq + p->page_tokens - 1) / p->page_tokens;
    st->n_threads = p->n_threads > 0 ? p->n_threads : omp_get_max_threads();
    if (st->n_threads < 1) st->n_threads = 1;
    st->value_rotate = cp.value_rotate != 0;
    st->scale = 1.0f / sqrtf((float)p->head_dim);
    st->k_norm = cp.key_norm != 0;
    st->v_norm = cp.value_norm != 0;
    st->fast_scan = p->vq_fast_scan && cp.key.nbits == 8 && !st->k_norm;
    st->k_ksub = 1 << cp.key.nbits;
    st->s8tab[0] = 0.0f;
    for (int c = 1; c < 256; c++) st->s8tab[c] = exp2f((float)(c - 128) / 16.0f);
    st->v_ksub = 1 << cp.value.nbits;

    st->kpq = calloc(p->n_layer, sizeof *st->kpq);
    st->kpq2 = calloc(p->n_layer, sizeof *st->kpq2);
    st->vpq = calloc(p->n_layer, sizeof *st->vpq);
    st->smooth = calloc(p->n_layer, sizeof *st->smooth);
    st->mean = calloc(p->n_layer, sizeof *st->mean);
    st->layers = calloc(p->n_layer, sizeof *st->layers);
    st->scr = calloc(st->n_threads, sizeof *st->scr);
    st->h16 = calloc((size_t)p->n_head_kv * p->head_dim, sizeof(uint16_t));
    st->rope = calloc(p->n_layer, sizeof *st->rope);
    if (!st->kpq || !st->kpq2 || !st->vpq || !st->smooth || !st->mean || !st->layers || !st->scr || !st->h16 ||
        !st->rope)
        goto nomem;
    st->rope_dims = cp.key_rope_dims;
    st->rope_neox = cp.key_rope_neox;
    st->pos0 = p->sinks;
    st->params = *p;
    st->dec_layer = st->ex_layer = -1;
    size_t cs_max = 0; /* largest key or value code of any layer (the decode scratch) */
    int mk_max = 0, mk_fs = 0, mv_max = 0; /* largest key M of any layer, of any fast-scan layer, value M */
    for (int l = 0; l < p->n_layer; l++) {
        st->kpq[l] = kvpq_codebook_pq_const(cb, l, 0);
        st->kpq2[l] = kvpq_codebook_key_pq2_const(cb, l);
        if (st->kpq2[l]) st->codebook_bytes += kvpq_pq_centroids_size(st->kpq2[l]) * sizeof(float);
        st->vpq[l] = kvpq_codebook_pq_const(cb, l, 1);
        st->smooth[l] = kvpq_codebook_key_smooth_const(cb, l);
        st->mean[l] = kvpq_codebook_key_mean_const(cb, l);
        st->rope[l] = kvpq__codebook_layer_rope(cb, l);
        if (st->rope[l]) st->codebook_bytes += (size_t)(cp.key_rope_dims / 2) * sizeof(float);
        st->codebook_bytes += (kvpq_pq_centroids_size(st->kpq[l]) + kvpq_pq_centroids_size(st->vpq[l])) * sizeof(float);
        st->codebook_bytes += 2 * (size_t)p->n_head_kv * p->head_dim * sizeof(float);
        vq_layer *L = &st->layers[l];
        L->swa = kvpq__layer_window(p, l);
        /* this layer's key M (both stages' codes form one bit stream): the scratch is sized for the largest */
        const int Mk = st->kpq[l]->p.M + (st->kpq2[l] ? st->kpq2[l]->p.M : 0);
        L->Mk = Mk;
        L->kcs = kvpq_codes_size(Mk, st->kpq[l]->p.nbits);
        const int Mv = st->vpq[l]->p.M; /* this layer's value M */
        L->vcs = kvpq_codes_size(Mv, st->vpq[l]->p.nbits);
        if (Mv > mv_max) mv_max = Mv;
        /* after the codes: the key then the value scales (float16 or 8-bit), then the 8-bit scales'
         * references (one float per kind with 8-bit scales and KV head): kvpq__vq_page_layout */
        kvpq__vq_page_layout lay;
        (void)kvpq__vq_page_layout_of(cb, l, p->n_head_kv, p->page_tokens, L->kcs, L->vcs, &lay); /* metadata checked */
        L->sb[0] = lay.sb[0], L->sb[1] = lay.sb[1];
        L->scale_off[0] = lay.scale_off[0], L->scale_off[1] = lay.scale_off[1];
        L->ref_off = lay.ref_off;
        L->page_bytes = lay.page_bytes;
        L->fast_scan = st->fast_scan && Mk <= 256 && !st->rope[l]; /* keys before RoPE: decoded, not tables */
        if (L->kcs > cs_max) cs_max = L->kcs;
        if (L->vcs > cs_max) cs_max = L->vcs;
        if (Mk > mk_max) mk_max = Mk;
        if (L->fast_scan && Mk > mk_fs) mk_fs = Mk;
        L->pages = calloc(st->max_pages, sizeof(uint8_t *));
        if (!L->pages) goto nomem;
    }
    const int gp = st->gp, d = st->head_dim;
    const int mmax = mk_max > mv_max ? mk_max : mv_max;
    for (int t = 0; t < st->n_threads; t++) {
        vq_scratch *s = &st->scr[t];
        s->qr = calloc((size_t)gp * d, sizeof(float));
        s->lut = calloc((size_t)mk_max * st->k_ksub * gp, sizeof(float));
        s->table = calloc((size_t)mv_max * st->v_ksub * gp, sizeof(float));
        s->s = calloc((size_t)vq_block_tokens(gp) * gp, sizeof(float));
        s->idx = calloc((size_t)VQ_CHUNK * mmax, sizeof(uint16_t));
        s->rescale = calloc(gp, sizeof(float));
        s->fs_scale = calloc(gp, sizeof(float));
        s->fs_bias = calloc(gp, sizeof(float));
        s->lut8 = mk_fs ? malloc((size_t)st->group * mk_fs * 256) : malloc(1);
        if (!s->fs_scale || !s->fs_bias || !s->lut8) goto nomem;
        s->wkf = calloc((size_t)st->cap * d, sizeof(float));
        s->wvf = calloc((size_t)st->cap * d, sizeof(float));
        s->ws = calloc(st->cap, sizeof(float));
        s->o = calloc((size_t)gp * d, sizeof(float));
        s->ow = calloc(d, sizeof(float));
        s->s32 = calloc(VQ_CHUNK, sizeof(float));
        s->s16 = calloc(VQ_CHUNK, sizeof(uint16_t));
        s->dcodes = malloc((size_t)VQ_CHUNK * p->n_head_kv * cs_max);
        s->dx = malloc(sizeof(float) * VQ_CHUNK * p->n_head_kv * d);
        if (!s->dcodes || !s->dx) goto nomem;
        if (!s->qr || !s->lut || !s->table || !s->s || !s->idx || !s->rescale || !s->wkf || !s->wvf ||
            !s->ws || !s->o || !s->ow || !s->s32 || !s->s16)
            goto nomem;
    }
    *state = st;
    return KVPQ_OK;
nomem:
    vq_destroy(st);
    return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory for the workspace");
}

// ---- append ---------------------------------------------------------------------------------

static kvpq_status vq_grow(void **buf, size_t *cap, size_t want, size_t elem) {
    if (want <= *cap) return KVPQ_OK;
    void *nb = realloc(*buf, want * elem);
    if (!nb) return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory (%zu bytes)", want * elem);
    *buf = nb;
    *cap = want;
    return KVPQ_OK;
}

/* Residual VQ (Juang & Gray 1982): x (nv, d) -> stage-one indices c1 = argmin |x - C1[c]| and
 * stage-two indices c2 of the error e = x - r1; codes (nv, code size of M1 + M2 indices) get the
 * M1 + M2 indices as one bit stream (stage one first), r (nv, d) the reconstruction r1 + r2. */
static kvpq_status vq_encode_two(const kvpq_pq *pq1, const kvpq_pq *pq2, size_t nv, const float *x, uint8_t *codes,
                                 float *r) {
    const int M1 = pq1->p.M, M2 = pq2->p.M, nb = pq1->p.nbits, d = pq1->p.d;
    const size_t cs = pq1->code_size > pq2->code_size ? pq1->code_size : pq2->code_size;
    uint16_t *i1 = malloc(nv * M1 * sizeof(uint16_t)), *i2 = malloc(nv * M2 * sizeof(uint16_t));
    uint16_t *idx = malloc(nv * (M1 + M2) * sizeof(uint16_t));
    uint8_t *c = malloc(nv * cs);
    float *e = malloc(nv * d * sizeof(float));
    kvpq_status s = KVPQ_OK;
    if (!i1 || !i2 || !idx || !c || !e) s = kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory (two-stage encode)");
    if (s == KVPQ_OK) s = kvpq_pq_assign(pq1, nv, x, i1);
    if (s == KVPQ_OK) s = kvpq_codes_pack(M1, nb, nv, i1, c);
    if (s == KVPQ_OK) s = kvpq_pq_decode(pq1, nv, c, r);
    if (s == KVPQ_OK) {
        for (size_t i = 0; i < nv * d; i++) e[i] = x[i] - r[i];
        s = kvpq_pq_assign(pq2, nv, e, i2);
    }
    if (s == KVPQ_OK) s = kvpq_codes_pack(M2, nb, nv, i2, c);
    if (s == KVPQ_OK) s = kvpq_pq_decode(pq2, nv, c, e);
    if (s == KVPQ_OK) {
        for (size_t i = 0; i < nv * d; i++) r[i] += e[i];
        for (size_t i = 0; i < nv; i++) {
            memcpy(idx + i * (M1 + M2), i1 + i * M1, M1 * sizeof(uint16_t));
            memcpy(idx + i * (M1 + M2) + M1, i2 + i * M2, M2 * sizeof(uint16_t));
        }
        s = kvpq_codes_pack(M1 + M2, nb, nv, idx, codes);
    }
    free(i1);
    free(i2);
    free(idx);
    free(c);
    free(e);
    return s;
}

/* Decode two-stage codes (nv, code size of M1 + M2) into x (nv, d) = r1 + r2. */
static kvpq_status vq_decode_two(const kvpq_pq *pq1, const kvpq_pq *pq2, size_t nv, const uint8_t *codes, float *x) {
    const int M1 = pq1->p.M, M2 = pq2->p.M, nb = pq1->p.nbits, d = pq1->p.d;
    const size_t cs = pq1->code_size > pq2->code_size ? pq1->code_size : pq2->code_size;
    uint16_t *idx = malloc(nv * (M1 + M2) * sizeof(uint16_t)), *ix = malloc(nv * (M1 > M2 ? M1 : M2) * sizeof(uint16_t));
    uint8_t *c = malloc(nv * cs);
    float *e = malloc(nv * d * sizeof(float));
    kvpq_status s = KVPQ_OK;
    if (!idx || !ix || !c || !e) s = kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory (two-stage decode)");
    if (s == KVPQ_OK) s = kvpq_codes_unpack(M1 + M2, nb, nv, codes, idx);
    for (int st = 0; st < 2 && s == KVPQ_OK; st++) {
        const int M = st ? M2 : M1, off = st ? M1 : 0;
        for (size_t i = 0; i < nv; i++) memcpy(ix + i * M, idx + i * (M1 + M2) + off, M * sizeof(uint16_t));
        s = kvpq_codes_pack(M, nb, nv, ix, c);
        if (s == KVPQ_OK) s = kvpq_pq_decode(st ? pq2 : pq1, nv, c, st ? e : x);
    }
    if (s == KVPQ_OK)
        for (size_t i = 0; i < nv * d; i++) x[i] += e[i];
    free(idx);
    free(ix);
    free(c);
    free(e);
    return s;
}

/* Encode nv transformed vectors x (nv, head_dim) with pq (and pq2, the residual second stage, when
 * not NULL: vq_encode_two) into codes (nv, code size). With a norm-explicit quantizer (norm = 1) x
 * is replaced by its directions u = x / |x| (0 stays 0), u is encoded, and scales (nv) get
 * s = x . r / |r|^2 in float16 (r = decoded u, both stages summed: the least-squares scale of the
 * two-stage reconstruction; s = 0 when x or r is 0). Row i is position t0 + i / n_head_kv, KV head
 * i % n_head_kv. Fails with KVPQ_ERR_INVALID_ARG when a scale exceeds float16. */
static kvpq_status vq_encode(vq_state *st, const kvpq_pq *pq, const kvpq_pq *pq2, int norm, int layer,
                             const char *what, int t0, size_t nv, float *x, uint8_t *codes, uint16_t *scales) {
    if (!norm && !pq2) return kvpq_pq_encode(pq, nv, x, codes);
    const int d = st->head_dim;
    KVPQ_TRY(vq_grow((void **)&st->xr, &st->xr_cap, nv * d + nv, sizeof(float)));
    float *r = st->xr, *nrm = st->xr + nv * d; /* (nv, d) decoded directions, (nv) norms then scales */
    if (norm) KVPQ_TRY(kvpq_normalize_rows(x, nv, d, nrm));
    if (pq2) {
        KVPQ_TRY(vq_encode_two(pq, pq2, nv, x, codes, r));
        if (!norm) return KVPQ_OK;
    } else {
        KVPQ_TRY(kvpq_pq_encode(pq, nv, x, codes));
        KVPQ_TRY(kvpq_pq_decode(pq, nv, codes, r));
    }
    for (size_t i = 0; i < nv; i++) {
        double ur = 0, rr = 0;
        for (int j = 0; j < d; j++) {
            ur += (double)x[i * d + j] * r[i * d + j];
            rr += (double)r[i * d + j] * r[i * d + j];
        }
        const double sc = rr > 0 ? nrm[i] * ur / rr : 0.0;
        if (!(fabs(sc) <= VQ_FP16_MAX))
            return kvpq__err(KVPQ_ERR_INVALID_ARG,
                             "VQ cache layer %d: the norm-explicit %s scale of position %zu, KV head %zu is %g, beyond "
                             "float16's range (65504)",
                             layer, what, (size_t)t0 + i / (size_t)st->n_head_kv, i % (size_t)st->n_head_kv, sc);
        nrm[i] = (float)sc;
    }
    kvpq__vq_kernels(kvpq_simd_get())->f32_to_f16(nv, nrm, scales);
    return KVPQ_OK;
}

/* Stage positions [t0, t1) of a layer holding len positions, as they are encoded, into st->xk and
 * st->xv ((t1 - t0) * n_head_kv rows): each token rounded to fp16 as the window stores it (from the
 * ring for t < len, else from the appended k, v (n, n_head_kv, head_dim)), keys turned back by
 * -position when the layer codes them before RoPE, centered, smoothed and rotated, values rotated
 * when value_rotate; then encoded into st->ck / st->cv and the scales
 * st->sk / st->sv. Codes therefore depend only on the data, never on how appends were chunked. */
static kvpq_status vq_stage_encode(vq_state *st, int layer, int len, int t0, int t1, const float *k, const float *v) {
    const vq_layer *L = &st->layers[layer];
    const int nkv = st->n_head_kv, d = st->head_dim;
    const size_t row = (size_t)nkv * d, nv = (size_t)(t1 - t0) * nkv;
    KVPQ_TRY(vq_grow((void **)&st->xk, &st->xk_cap, nv * d, sizeof(float)));
    KVPQ_TRY(vq_grow((void **)&st->xv, &st->xv_cap, nv * d, sizeof(float)));
    KVPQ_TRY(vq_grow((void **)&st->ck, &st->ck_cap, nv * L->kcs, 1));
    KVPQ_TRY(vq_grow((void **)&st->cv, &st->cv_cap, nv * L->vcs, 1));
    if (st->k_norm) KVPQ_TRY(vq_grow((void **)&st->sk, &st->sk_cap, nv, sizeof(uint16_t)));
    if (st->v_norm) KVPQ_TRY(vq_grow((void **)&st->sv, &st->sv_cap, nv, sizeof(uint16_t)));
    vq_exact_rows(st, L, len, t0, t1, k, v, st->xk, st->xv, row, (size_t)d);
    if (st->rope[layer]) /* keys before RoPE: turned back by -position */
        KVPQ_TRY(kvpq_rope_rotate(st->xk, (size_t)(t1 - t0), nkv, d, st->rope_dims, st->rope_neox, st->rope[layer], NULL,
                                  st->pos0 + t0, -1));
    for (size_t r = 0; r < nv; r++) {
        const float *lam = st->smooth[layer] + (r % nkv) * d, *mu = st->mean[layer] + (r % nkv) * d;
        for (int j = 0; j < d; j++) st->xk[r * d + j] = (st->xk[r * d + j] - mu[j]) / lam[j];
    }
    KVPQ_TRY(kvpq_hadamard(st->xk, nv, d));
    if (st->value_rotate) KVPQ_TRY(kvpq_hadamard(st->xv, nv, d));
    KVPQ_TRY(vq_encode(st, st->kpq[layer], st->kpq2[layer], st->k_norm, layer, "key", t0, nv, st->xk, st->ck, st->sk));
    return vq_encode(st, st->vpq[layer], NULL, st->v_norm, layer, "value", t0, nv, st->xv, st->cv, st->sv);
}

/* Store the float16 scales sc (row (t - first) * n_head_kv + h) of positions [first, target) of one
 * kind into the pages: as they are, or as 8-bit codes against each (page, KV head) reference m, set
 * by the page's first nonzero scale s (m = 2^round(log2 s)) and moved by whole octaves when a later
 * scale falls outside m 2^(+-7.9) (vq_s8_rebase: the earlier codes keep their values). A function
 * of the data in order, so a truncated cache decodes its kept positions as a fresh cache does
 * (vq_truncate resets m where it keeps no nonzero scale). */
/* Re-base the 8-bit codes c[0..n) of a page (an earlier part of it) by whole octaves so that a new
 * scale x fits: m becomes m 2^k and every nonzero code c - 16 k, which is the same value (exact: a
 * power-of-two factor), with k the least shift that brings x's code into 1..255 without pushing an
 * earlier code out of it. Where no shift does both (the page's scales span more than 15.9 octaves),
 * the earlier codes keep their values and vq_s8_code clamps x. */
static void vq_s8_rebase(uint8_t *c, int n, float *m, float x) {
    const long cx = lrintf(16.0f * log2f(x / *m)) + 128;
    if (cx >= 1 && cx <= 255) return;
    int lo = 255, hi = 1; /* the earlier nonzero codes' range */
    for (int i = 0; i < n; i++)
        if (c[i]) lo = c[i] < lo ? c[i] : lo, hi = c[i] > hi ? c[i] : hi;
    long k;
    if (cx > 255) {
        const long kmax = (lo - 1) / 16;
        k = (cx - 255 + 15) / 16;
        k = k < kmax ? k : kmax;
    } else {
        const long kmin = -((255 - hi) / 16);
        k = -((1 - cx + 15) / 16);
        k = k > kmin ? k : kmin;
    }
    if (k == 0) return;
    for (int i = 0; i < n; i++)
        if (c[i]) c[i] = (uint8_t)(c[i] - 16 * k);
    *m = ldexpf(*m, (int)k);
}

static void vq_store_scales(vq_state *st, vq_layer *L, int is_value, int first, int target, const uint16_t *sc) {
    const int nkv = st->n_head_kv, pt = st->page_tokens;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    for (int h = 0; h < nkv; h++)
        for (int t = first; t < target;) {
            const int pg = t / pt, e = (pg + 1) * pt < target ? (pg + 1) * pt : target;
            if (L->sb[is_value] == 2) {
                for (int u = t; u < e; u++) memcpy(vq_scales(st, L, is_value, h, u), sc + (size_t)(u - first) * nkv + h, 2);
            } else {
                float *m = vq_scale_ref(st, L, is_value, h, pg), x;
                uint8_t *page = vq_scales(st, L, is_value, h, pg * pt);
                for (int u = t; u < e; u++) {
                    K->f16_to_f32(1, sc + (size_t)(u - first) * nkv + h, &x);
                    if (!(*m > 0.0f) && x > 0.0f) *m = ldexpf(1.0f, (int)lrint(log2((double)x))); /* the first nonzero */
                    else if (x > 0.0f) vq_s8_rebase(page, u - pg * pt, m, x);
                    page[u - pg * pt] = vq_s8_code(st, x, *m);
                }
            }
            t = e;
        }
}

static kvpq_status vq_append(void *state, int layer, int len, int n, const float *k, const float *v) {
    vq_state *st = state;
    vq_layer *L = &st->layers[layer];
    const int nkv = st->n_head_kv, d = st->head_dim;
    const size_t row = (size_t)nkv * d;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    /* The window keeps fp16: refuse what fp16 cannot hold before touching anything. */
    for (size_t i = 0; i < (size_t)n * row; i++)
        if (fabsf(k[i]) > VQ_FP16_MAX || fabsf(v[i]) > VQ_FP16_MAX)
            return kvpq__err(KVPQ_ERR_INVALID_ARG,
                             "VQ cache layer %d: %s[token %zu][head %zu][channel %zu] = %g exceeds the fp16 window's range (65504)",
                             layer, fabsf(k[i]) > VQ_FP16_MAX ? "k" : "v", i / row, i % row / d, i % d,
                             (double)(fabsf(k[i]) > VQ_FP16_MAX ? k[i] : v[i]));
    const int new_len = len + n;
    int target = vq_target_coded(st, new_len);
    if (target < L->n_coded) target = L->n_coded;
    const int first = L->n_coded, ne = target - first;
    /* Norm-explicit quantizers: the scales of the new tokens that stay in the window are computed
     * now (their flush recomputes the same values), so that one beyond float16 is refused before
     * anything is stored, instead of failing every later append once the token leaves the window.
     * New tokens coded by this call are checked by its own encode below, before anything is stored. */
    const int w0 = target > len ? target : len;
    if ((st->k_norm || st->v_norm) && new_len > w0) KVPQ_TRY(vq_stage_encode(st, layer, len, w0, new_len, k, v));

    const int new_ring = !L->wk;
    if (new_ring) KVPQ_TRY(vq_ring_get(st, L, layer));
    if (ne > 0) {
        const int pages_needed = (target + st->page_tokens - 1) / st->page_tokens;
        kvpq_status s = pages_needed <= st->max_pages
                            ? vq_pages_get(st, L, pages_needed)
                            : kvpq__err(KVPQ_ERR_CAPACITY, "VQ cache layer %d: %d positions exceed max_seq", layer, target);
        if (s != KVPQ_OK) { /* leave the cache as it was */
            if (new_ring) vq_ring_put(st, L);
            return s;
        }
        /* The tokens leaving the window (or passing through it). */
        KVPQ_TRY(vq_stage_encode(st, layer, len, first, target, k, v));
        for (int t = first; t < target; t++)
            for (int h = 0; h < nkv; h++) {
                size_t r = (size_t)(t - first) * nkv + h;
                memcpy(vq_kcodes(st, L, h, t), st->ck + r * L->kcs, L->kcs);
                memcpy(vq_vcodes(st, L, h, t), st->cv + r * L->vcs, L->vcs);
            }
        for (int kind = 0; kind < 2; kind++)
            if (L->sb[kind]) vq_store_scales(st, L, kind, first, target, kind ? st->sv : st->sk);
    }
    /* New tokens that stay in the window go to their ring slots (after the encode read the ring). */
    for (int t = target > len ? target : len; t < new_len; t++) {
        const float *kt = k + (size_t)(t - len) * row, *vt = v + (size_t)(t - len) * row;
        for (int h = 0; h < nkv; h++) {
            K->f32_to_f16(d, kt + (size_t)h * d, vq_ring_row(st, L, 0, h, t));
            K->f32_to_f16(d, vt + (size_t)h * d, vq_ring_row(st, L, 1, h, t));
        }
    }
    L->n_coded = target;
    return KVPQ_OK;
}

// ---- decoding ---------------------------------------------------------------------------------

/* Decode coded positions [t0, t1) of a layer's keys (which 0) or values (1) into dst (t1 - t0,
 * n_head_kv, head_dim) in the original space: centroids (both key stages summed), times the
 * norm-explicit scale, the inverse Hadamard (keys; values when value_rotate), times lambda plus mu
 * (keys), then RoPE at each position for a layer coding keys before RoPE. codes ((t1 - t0) n_head_kv
 * rows of the kind's code size) and x ((t1 - t0) n_head_kv rows of head_dim) are scratch; dst may be x. */
static kvpq_status vq_decode_rows(const vq_state *st, const vq_layer *L, int layer, int which, int t0, int t1,
                                  uint8_t *codes, float *x, float *dst) {
    const int nkv = st->n_head_kv, d = st->head_dim;
    const size_t nv = (size_t)(t1 - t0) * nkv, sz = which ? L->vcs : L->kcs;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    for (int t = t0; t < t1; t++)
        for (int h = 0; h < nkv; h++)
            memcpy(codes + ((size_t)(t - t0) * nkv + h) * sz, which ? vq_vcodes(st, L, h, t) : vq_kcodes(st, L, h, t),
                   sz);
    if (!which && st->kpq2[layer]) KVPQ_TRY(vq_decode_two(st->kpq[layer], st->kpq2[layer], nv, codes, x));
    else KVPQ_TRY(kvpq_pq_decode(which ? st->vpq[layer] : st->kpq[layer], nv, codes, x));
    if (which ? st->v_norm : st->k_norm)
        for (int t = t0; t < t1; t++)
            for (int h = 0; h < nkv; h++) {
                float sc, s32;
                uint16_t s16;
                K->f16_to_f32(1, vq_scales16(st, L, which, h, t, 1, &s32, &s16, K), &sc);
                float *xr = x + ((size_t)(t - t0) * nkv + h) * d;
                for (int j = 0; j < d; j++) xr[j] *= sc;
            }
    if (!which || st->value_rotate) KVPQ_TRY(kvpq_hadamard(x, nv, d));
    for (size_t r = 0; r < nv; r++) {
        const float *lam = st->smooth[layer] + (r % nkv) * d, *mu = st->mean[layer] + (r % nkv) * d;
        for (int j = 0; j < d; j++) dst[r * d + j] = which ? x[r * d + j] : x[r * d + j] * lam[j] + mu[j];
    }
    if (!which && st->rope[layer])
        KVPQ_TRY(kvpq_rope_rotate(dst, (size_t)(t1 - t0), nkv, d, st->rope_dims, st->rope_neox, st->rope[layer], NULL,
                                  st->pos0 + t0, 1));
    return KVPQ_OK;
}

/* vq_decode_keys_u8's rows of KV head h before RoPE, into out (b - a, head_dim). */
static void vq_decode_key_head_u8(const vq_state *st, const vq_layer *L, int layer, int h, int a, int b, vq_scratch *s,
                                  const kvpq_vq_kernels *K, float *out) {
    const int d = st->head_dim;
    const kvpq_pq *pq[2] = {st->kpq[layer], st->kpq2[layer]};
    for (int t = a; t < b;) { /* a page's run of code rows at a time, kcs bytes apart */
        const int n = vq_seg(st, t, b);
        const uint8_t *c = vq_kcodes(st, L, h, t);
        for (int stage = 0, off = 0; stage < 2 && pq[stage]; off += pq[stage]->p.M, stage++)
            K->gather_u8((size_t)n, pq[stage]->p.M, pq[stage]->dsub, kvpq__pq_view_books(pq[stage]), 256,
                         kvpq__pq_head_book(pq[stage], h), c + off, L->kcs, stage, out + (size_t)(t - a) * d);
        t += n;
    }
    for (int t = a; st->k_norm && t < b;) { /* the scales, a page at a time */
        const int n = vq_seg(st, t, b);
        K->f16_to_f32(n, vq_scales16(st, L, 0, h, t, n, s->s32, s->s16, K), s->s32);
        for (int i = 0; i < n; i++)
            for (int j = 0; j < d; j++) out[(size_t)(t - a + i) * d + j] *= s->s32[i];
        t += n;
    }
    K->fwht_rows((size_t)(b - a), d, (float)(1.0 / sqrt((double)d)), out);
    K->affine_rows((size_t)(b - a), d, st->smooth[layer] + (size_t)h * d, st->mean[layer] + (size_t)h * d, out);
}

/* Keys before RoPE with 8-bit codes: positions [a, b) of every KV head decoded straight from the
 * pages into out (head h's rows at out + h * rows * head_dim): vq_decode_rows' arithmetic in its order
 * (the same bits), without its copies and bit-stream repacking; one RoPE pass over all heads (the
 * angles' recurrence once per position). */
static kvpq_status vq_decode_keys_u8(const vq_state *st, const vq_layer *L, int layer, int a, int b, vq_scratch *s,
                                     const kvpq_vq_kernels *K, float *out, int rows) {
    const int d = st->head_dim;
    for (int h = 0; h < st->n_head_kv; h++)
        vq_decode_key_head_u8(st, L, layer, h, a, b, s, K, out + (size_t)h * rows * d);
    if (!st->rope[layer]) return KVPQ_OK;
    return kvpq__rope_run(out, (size_t)(b - a), st->n_head_kv, (size_t)d, (size_t)rows * d, st->rope_dims / 2,
                          st->rope_neox, st->rope[layer], st->pos0 + a, 1);
}

/* st->dec[w] with room for `rows` rows per KV head, its dec_n[w] rows kept. */
static kvpq_status vq_dec_reserve(vq_state *st, int w, int rows) {
    if (rows <= st->dec_rows[w]) return KVPQ_OK;
    const int nkv = st->n_head_kv, d = st->head_dim, old = st->dec_rows[w], cap = rows > 2 * old ? rows : 2 * old;
    /* 64-byte aligned: rows of whole cache lines for the attention kernels' vector loads */
    float *nb = aligned_alloc(64, (sizeof(float) * nkv * (size_t)cap * d + 63) / 64 * 64);
    if (!nb) return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache: out of memory for %d decoded %s", cap, w ? "values" : "keys");
    for (int h = 0; h < nkv && st->dec[w]; h++)
        memcpy(nb + (size_t)h * cap * d, st->dec[w] + (size_t)h * old * d, sizeof(float) * st->dec_n[w] * d);
    free(st->dec[w]);
    st->dec[w] = nb;
    st->dec_rows[w] = cap;
    return KVPQ_OK;
}

/* What st->dec keeps for positions [lo, hi) of a layer: its rows of the same layer when they start
 * at or before lo and end within [lo, hi) (a prefill's next run), less the rows before a sliding
 * window's start once they outnumber the live ones; else nothing. */
static void vq_dec_keep(vq_state *st, int layer, int lo, int hi) {
    const int nkv = st->n_head_kv, d = st->head_dim;
    if (st->dec_layer != layer || st->dec_t0 > lo) st->dec_t0 = lo, st->dec_n[0] = st->dec_n[1] = 0;
    for (int w = 0; w < 2; w++) {
        const int end = st->dec_t0 + st->dec_n[w];
        if (end < lo || end > hi) st->dec_n[w] = 0;
    }
    const int cut = lo - st->dec_t0;
    if (cut <= hi - lo) return;
    for (int w = 0; w < 2; w++) {
        const int keep = st->dec_n[w] > cut ? st->dec_n[w] - cut : 0;
        for (int h = 0; h < nkv && keep; h++)
            memmove(st->dec[w] + (size_t)h * st->dec_rows[w] * d, st->dec[w] + ((size_t)h * st->dec_rows[w] + cut) * d,
                    sizeof(float) * keep * d);
        st->dec_n[w] = keep;
    }
    st->dec_t0 = lo;
}

/* Decode positions [from, hi) of a layer's keys (w 0) or values (w 1) into st->dec[w] (rows from
 * dec_t0), a chunk per job over the threads: 8-bit key codes straight from the pages, others through
 * vq_decode_rows. Returns 0, or 1 when a job failed (out of memory). */
static int vq_dec_fill(vq_state *st, const vq_layer *L, int layer, int w, int from, int hi) {
    const int nkv = st->n_head_kv, d = st->head_dim, nt = st->n_threads, t0 = st->dec_t0, rows = st->dec_rows[w];
    const int n_jobs = (hi - from + VQ_CHUNK - 1) / VQ_CHUNK, u8 = !w && st->kpq[layer]->p.nbits == 8;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    float *out = st->dec[w];
    int failed = 0;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1 && n_jobs > 1) reduction(| : failed)
    for (int j = 0; j < n_jobs; j++) {
        vq_scratch *s = &st->scr[omp_get_thread_num()];
        const int a = from + j * VQ_CHUNK, b = hi - a < VQ_CHUNK ? hi : a + VQ_CHUNK;
        if (u8) {
            failed |= vq_decode_keys_u8(st, L, layer, a, b, s, K, out + (size_t)(a - t0) * d, rows) != KVPQ_OK;
            continue;
        }
        if (vq_decode_rows(st, L, layer, w, a, b, s->dcodes, s->dx, s->dx) != KVPQ_OK) {
            failed = 1;
            continue;
        }
        for (int t = a; t < b; t++)
            for (int h = 0; h < nkv; h++)
                memcpy(out + ((size_t)h * rows + (t - t0)) * d, s->dx + ((size_t)(t - a) * nkv + h) * d,
                       sizeof(float) * d);
    }
    return failed;
}

/* Make st->dec hold the coded keys (and values when `values`) of positions [lo, hi) of a layer,
 * decoded into the original space (keys before RoPE rotated to their positions: dequantize-then-
 * rotate, since the score q . R_t k_t needs each position's own rotation, which one lookup table per
 * query cannot give). What it holds of the same layer is kept (vq_dec_keep): a prefill's runs decode
 * each position once. */
static kvpq_status vq_decode_range(vq_state *st, const vq_layer *L, int layer, int lo, int hi, int values) {
    vq_dec_keep(st, layer, lo, hi);
    st->dec_layer = -1; /* until complete */
    for (int w = 0; w <= values; w++) {
        KVPQ_TRY(vq_dec_reserve(st, w, hi - st->dec_t0 > 1 ? hi - st->dec_t0 : 1));
        if (vq_dec_fill(st, L, layer, w, st->dec_t0 + st->dec_n[w], hi))
            return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache layer %d: out of memory decoding %s", layer, w ? "values" : "keys");
        st->dec_n[w] = hi - st->dec_t0;
    }
    st->dec_layer = layer;
    return KVPQ_OK;
}

/* Scores of the group's G query heads q (G, head_dim) against the decoded keys of positions [t, t + n)
 * of KV head h (st->dec[0]): sc (n, gp) = q . k / sqrt(head_dim), padded lanes 0. n <= VQ_CHUNK. */
static void vq_score_decoded(const vq_state *st, int h, const float *q, int t, int n, vq_scratch *s,
                             const kvpq_vq_kernels *K, float *sc) {
    const int gp = st->gp, G = st->group, d = st->head_dim;
    const float *kh = st->dec[0] + ((size_t)h * st->dec_rows[0] + (t - st->dec_t0)) * d;
    for (int g = 0; g < gp; g++) {
        if (g < G) K->dot_rows(n, d, q + (size_t)g * d, kh, s->s32);
        for (int i = 0; i < n; i++) sc[(size_t)i * gp + g] = g < G ? s->s32[i] * st->scale : 0.0f;
    }
}

// ---- attention --------------------------------------------------------------------------------

/* The key lookup tables of one group's queries q (G, head_dim) against KV head h's codes: s->lut
 * (and s->lut8 for fast-scan), and kb (gp) the mean term q . mu / sqrt(d) of norm-explicit keys
 * (folded into the LUT otherwise). */
static void vq_key_tables(const vq_state *st, const vq_layer *L, int layer, int h, const float *q, vq_scratch *s,
                          const kvpq_vq_kernels *K, float *kb) {
    const int gp = st->gp, G = st->group, d = st->head_dim;
    const kvpq_pq *kpq = st->kpq[layer];
    /* q' = H (q * lambda_h) / sqrt(d), for the G heads of the group (padded rows stay zero). */
    const float *lam = st->smooth[layer] + (size_t)h * d;
    for (int g = 0; g < G; g++)
        for (int j = 0; j < d; j++) s->qr[(size_t)g * d + j] = q[(size_t)g * d + j] * lam[j] * st->scale;
    kvpq_hadamard(s->qr, G, d);
    /* qt (M, dsub, gp) = q' regrouped by sub-space with the heads innermost (padded lanes zero). */
    float *qt = s->o; /* (gp, head_dim) floats, free until the merge */
    memset(qt, 0, (size_t)gp * d * sizeof(float));
    for (int g = 0; g < G; g++)
        for (int i = 0; i < d; i++) qt[(size_t)i * gp + g] = s->qr[(size_t)g * d + i];
    /* Head granularity: KV head h's own books (kvpq__pq_head_book). Residual keys: stage two's table
     * follows stage one's, LUT2[m][c] = q'_m . C2[m][c], and the codes of both stages form one
     * vector of M1 + M2 indices, so a score is sum_m LUT1[m][c1_m] + sum_m LUT2[m][c2_m]. */
    K->lut_build(kpq->p.M, kpq->ksub, kpq->dsub, kvpq__pq_view_books(kpq), kvpq__pq_head_book(kpq, h), gp, qt, s->lut);
    const kvpq_pq *kpq2 = st->kpq2[layer];
    if (kpq2) {
        /* qt for stage two's sub-spaces: the same q' regrouped (M2, dsub2, gp) = (head_dim, gp) */
        K->lut_build(kpq2->p.M, kpq2->ksub, kpq2->dsub, kvpq__pq_view_books(kpq2), kvpq__pq_head_book(kpq2, h), gp, qt,
                     s->lut + (size_t)kpq->p.M * kpq->ksub * gp);
    }
    /* Coded keys are centered: add q . mu_h / sqrt(d) once per score, through LUT row m = 0 (after
     * the per-token scaling instead, for norm-explicit keys). */
    const float *mu = st->mean[layer] + (size_t)h * d;
    for (int g = 0; g < G; g++) {
        float b = 0.0f;
        for (int j = 0; j < d; j++) b += q[(size_t)g * d + j] * mu[j];
        b *= st->scale;
        if (st->k_norm) kb[g] = b;
        else if (b != 0.0f)
            for (int c = 0; c < kpq->ksub; c++) s->lut[(size_t)c * gp + g] += b;
    }
    if (L->fast_scan) kvpq__vq_lut_quantize(L->Mk, kpq->ksub, gp, G, s->lut, s->lut8, s->fs_scale, s->fs_bias);
}

/* Softmax state of one group's queries over coded positions [t0, t1) of KV head h. part gets
 * m (gp), d (gp), o (gp, head_dim) with o in the value codebook's space (rotated if value_rotate). */
static void vq_coded_part(const vq_state *st, const vq_layer *L, int layer, int h, const float *q, int t0, int t1,
                          vq_scratch *s, const kvpq_vq_kernels *K, float *part) {
    const int gp = st->gp, G = st->group, d = st->head_dim;
    float *pm = part, *pd = part + gp, *po = part + 2 * gp;
    for (int g = 0; g < gp; g++) {
        pm[g] = -INFINITY;
        pd[g] = 0.0f;
    }
    memset(po, 0, (size_t)gp * d * sizeof(float));
    if (t1 <= t0) return;
    const kvpq_pq *kpq = st->kpq[layer], *vpq = st->vpq[layer];
    float kb[64] = {0}; /* (gp) the mean term of norm-explicit keys */
    if (!st->rope[layer]) vq_key_tables(st, L, layer, h, q, s, K, kb);
    const size_t table_rows = (size_t)vpq->p.M * vpq->ksub;
    /* Values: decoded per token straight into po where the SIMD level has that kernel for this
     * shape (small groups, see accum_dec_u8), else summed per (m, c) in the W table. */
    const int dec = vpq->p.nbits == 8 && K->accum_dec_ok && K->accum_dec_ok(vpq->p.M, vpq->dsub, G);
    if (!dec) memset(s->table, 0, table_rows * gp * sizeof(float));
    const int kbits8 = kpq->p.nbits == 8, vbits8 = vpq->p.nbits == 8;
    const int Mk = L->Mk, Mv = vpq->p.M;
    const float *vcent = kvpq__pq_head_book(vpq, h);
    const int vbooks = kvpq__pq_view_books(vpq);
    /* Two passes per block of up to vq_block_tokens(gp) tokens: all scores of the block first (they
     * stay in L2), then its per-lane maximum becomes the softmax reference m before any weight is
     * taken, so the W table is rescaled at most once per block (not each time a chunk's maximum
     * rises); the weights exp(s - m) of the whole block are then taken in one exp_sum call and
     * accumulated with factor 1. Same math as the online step. */
    const int blk = vq_block_tokens(gp);
    for (int b0 = t0; b0 < t1;) {
        const int b1 = t1 - b0 < blk ? t1 : b0 + blk;
        for (int t = b0; t < b1;) {
            int n = vq_seg(st, t, b1);
            const uint8_t *kc = vq_kcodes(st, L, h, t);
            float *sc = s->s + (size_t)(t - b0) * gp;
            if (st->rope[layer]) {
                vq_score_decoded(st, h, q, t, n, s, K, sc);
                t += n;
                continue;
            }
            if (L->fast_scan) {
                K->score_fs_u8(n, Mk, G, gp, kc, s->lut8, s->fs_scale, s->fs_bias, sc);
            } else if (kbits8) {
                K->score_u8(n, Mk, kpq->ksub, gp, kc, s->lut, sc);
            } else {
                kvpq_codes_unpack(Mk, kpq->p.nbits, n, kc, s->idx);
                K->score_u16(n, Mk, kpq->ksub, gp, s->idx, s->lut, sc);
            }
            if (st->k_norm) /* score = s(t) * sum_m LUT + q . mu / sqrt(d) */
                K->scale_tokens(n, gp, sc, vq_scales16(st, L, 0, h, t, n, s->s32, s->s16, K), kb);
            t += n;
        }
        float mx[64];
        K->lane_max(b1 - b0, gp, s->s, mx);
        int any = 0;
        for (int g = 0; g < gp; g++) {
            float m_new = pm[g] > mx[g] ? pm[g] : mx[g];
            s->rescale[g] = pm[g] == -INFINITY ? 0.0f : expf(pm[g] - m_new);
            if (s->rescale[g] != 1.0f) any = 1;
            pd[g] *= s->rescale[g];
            pm[g] = m_new;
        }
        if (any && b0 > t0) {
            if (dec) {
                for (int g = 0; g < G; g++)
                    for (int i = 0; i < d; i++) po[(size_t)g * d + i] *= s->rescale[g];
            } else {
                K->scale_rows(table_rows, gp, s->rescale, s->table);
            }
        }
        K->exp_sum(b1 - b0, gp, s->s, pm, pd); /* pm is the block max: weights exp(s - pm), summed into pd */
        for (int t = b0; t < b1;) {
            int n = vq_seg(st, t, b1);
            const uint8_t *vc = vq_vcodes(st, L, h, t);
            float *sc = s->s + (size_t)(t - b0) * gp;
            if (st->v_norm) /* exp_sum put p(t) into the denominator; the value sums take p(t) s(t) */
                K->scale_tokens(n, gp, sc, vq_scales16(st, L, 1, h, t, n, s->s32, s->s16, K), NULL);
            if (dec) {
                K->accum_dec_u8(n, Mv, vpq->dsub, vbooks, vcent, gp, G, vc, sc, po);
            } else if (vbits8) {
                K->accum_u8(n, Mv, vpq->ksub, gp, vc, sc, s->table);
            } else {
                kvpq_codes_unpack(Mv, vpq->p.nbits, n, vc, s->idx);
                K->accum_u16(n, Mv, vpq->ksub, gp, s->idx, sc, s->table);
            }
            t += n;
        }
        b0 = b1;
    }
    /* (M, dsub, gp) = (head_dim, gp) in s->o, then heads outermost into the part. */
    if (dec) return; /* po already holds the weighted values */
    K->table_out(vpq->p.M, vpq->ksub, vpq->dsub, vbooks, vcent, gp, s->table, s->o);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < d; i++) po[(size_t)g * d + i] = s->o[(size_t)i * gp + g];
}

/* The first position a query at position pos sees: its sliding window's start, else 0. */
static int vq_view_start(const vq_layer *L, int pos) {
    return L->swa > 0 && pos + 1 - L->swa > 0 ? pos + 1 - L->swa : 0;
}

/* Merge b into a, treating d == 0 as the empty state (m = -inf). */
static void vq_merge(kvpq_softmax_state *a, float *oa, const kvpq_softmax_state *b, const float *ob, int d) {
    if (b->d == 0.0f) return;
    if (a->d == 0.0f) {
        *a = *b;
        memcpy(oa, ob, (size_t)d * sizeof(float));
        return;
    }
    kvpq_softmax_merge(a, oa, b, ob, d);
}

/* Finish query position i of KV head h: merge the coded splits, rotate back, attend the window
 * exactly, merge, normalize into out (G, d). */
static void vq_finish(const vq_state *st, const vq_layer *L, int h, int pos, const float *q, const float *parts,
                      int n_split, vq_scratch *s, const kvpq_vq_kernels *K, float *out, float *lse) {
    const int gp = st->gp, G = st->group, d = st->head_dim;
    const size_t psz = (size_t)gp * (2 + d);
    kvpq_softmax_state a[64]; /* G <= 64, checked by vq_attend */
    /* Coded splits (all in the value codebook's space). */
    for (int g = 0; g < G; g++) {
        kvpq_softmax_state acc = {-INFINITY, 0.0f};
        float *o = s->o + (size_t)g * d;
        memset(o, 0, (size_t)d * sizeof(float));
        for (int sp = 0; sp < n_split; sp++) {
            const float *pt = parts + sp * psz;
            kvpq_softmax_state b = {pt[g], pt[gp + g]};
            vq_merge(&acc, o, &b, pt + 2 * gp + (size_t)g * d, d);
        }
        a[g] = acc;
    }
    if (st->value_rotate) kvpq_hadamard(s->o, G, d);
    /* Window: positions [n_coded, pos] in fp16, original space (from the sliding window's start
     * when that lies later). */
    const int lo = vq_view_start(L, pos);
    const int w0 = L->n_coded > lo ? L->n_coded : lo, w1 = pos + 1;
    const int nw = w1 > w0 ? w1 - w0 : 0;
    for (int t = 0; t < nw; t++) {
        K->f16_to_f32(d, vq_ring_row(st, L, 0, h, w0 + t), s->wkf + (size_t)t * d);
        K->f16_to_f32(d, vq_ring_row(st, L, 1, h, w0 + t), s->wvf + (size_t)t * d);
    }
    for (int g = 0; g < G; g++) {
        kvpq_softmax_state acc = a[g];
        float *o = s->o + (size_t)g * d;
        if (nw > 0) {
            K->dot_rows(nw, d, q + (size_t)g * d, s->wkf, s->ws);
            for (int t = 0; t < nw; t++) s->ws[t] *= st->scale;
            float mx = -INFINITY, sum = 0.0f, r;
            K->softmax_step(nw, 1, s->ws, &mx, &sum, &r); /* ws <- exp(ws - max) */
            K->weighted_sum(nw, d, s->ws, s->wvf, s->ow);
            kvpq_softmax_state b = {mx, sum};
            vq_merge(&acc, o, &b, s->ow, d);
        }
        float inv = acc.d > 0.0f ? 1.0f / acc.d : 0.0f;
        for (int j = 0; j < d; j++) out[(size_t)g * d + j] = o[j] * inv;
        if (lse) lse[g] = acc.d > 0.0f ? acc.m + logf(acc.d) : -INFINITY;
    }
}

/* kvpq__load_fn of vq_dense_attend: coded positions from st->dec (pointers when the whole range is
 * coded), window positions from the fp16 ring converted into kbuf / vbuf. */
static void vq_dense_load(const void *state, int layer, int kvh, int t0, int n, float *kbuf, float *vbuf,
                          const float **k, const float **v) {
    const vq_state *st = state;
    const vq_layer *L = &st->layers[layer];
    const int d = st->head_dim, nc = L->n_coded;
#define DEC_ROW(w, t) (st->dec[w] + ((size_t)kvh * st->dec_rows[w] + (size_t)((t) - st->dec_t0)) * d)
    if (t0 + n <= nc) {
        *k = DEC_ROW(0, t0), *v = DEC_ROW(1, t0);
        return;
    }
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    for (int t = t0; t < t0 + n; t++) {
        float *kr = kbuf + (size_t)(t - t0) * d, *vr = vbuf + (size_t)(t - t0) * d;
        if (t < nc) {
            memcpy(kr, DEC_ROW(0, t), sizeof(float) * d);
            memcpy(vr, DEC_ROW(1, t), sizeof(float) * d);
            continue;
        }
        K->f16_to_f32(d, vq_ring_row(st, L, 0, kvh, t), kr);
        K->f16_to_f32(d, vq_ring_row(st, L, 1, kvh, t), vr);
    }
    *k = kbuf, *v = vbuf;
#undef DEC_ROW
}

/* Prefill attention (n_q >= VQ_DENSE_MIN_Q queries): the coded positions any query of the call sees
 * decoded once into float rows (vq_decode_range: kept across the runs of one prefill, so each
 * position is decoded once per layer and prefill step), then the shared dense driver
 * (kvpq__attend_cpu: Q K^T and P V over chunks, online softmax), the window from the fp16 ring. The
 * same attention as the per-query lookup tables (the tables' float16 / 8-bit rounding aside): those
 * cost each query a pass over every code, these a pass of dense products that the queries of a
 * block share. */
static kvpq_status vq_dense_attend(vq_state *st, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    const vq_layer *L = &st->layers[layer];
    const int P = len - n_q, hi = L->n_coded < len ? L->n_coded : len;
    const int lo = vq_view_start(L, P);
    if (lo < hi) KVPQ_TRY(vq_decode_range(st, L, layer, lo, hi, 1));
    return kvpq__attend_cpu(&st->params, st, vq_dense_load, 1 << 30, layer, len, n_q, q, out, lse);
}

static kvpq_status vq_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse);

/* First position query i of a fused append-attend reads exact: what the layer holds coded once
 * positions up to the query's own are appended (vq_append's rule: never fewer than before). */
static int vq_query_bound(const vq_state *st, int i) {
    const int t = vq_target_coded(st, st->ex_len + i + 1);
    return t > st->ex_nc ? t : st->ex_nc;
}

/* Room for `floats` in each of st->ex[0..1] (64-byte aligned; what they held is not kept). */
static kvpq_status vq_ex_reserve(vq_state *st, int layer, size_t floats) {
    if (floats <= st->ex_cap) return KVPQ_OK;
    for (int w = 0; w < 2; w++) {
        free(st->ex[w]);
        st->ex[w] = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    }
    st->ex_cap = st->ex[0] && st->ex[1] ? floats : 0;
    if (st->ex_cap) return KVPQ_OK;
    for (int w = 0; w < 2; w++) free(st->ex[w]), st->ex[w] = NULL;
    return kvpq__err(KVPQ_ERR_NOMEM, "VQ cache layer %d: out of memory for %zu staged exact floats", layer, floats);
}

/* cache_impl.h stage_exact: before n positions (k, v) are appended to a layer holding len, keep the
 * exact rows their queries will read and the append may code or overwrite in the ring: positions
 * [first query's bound, len + n), from the ring (t < len) or k, v rounded to fp16 as the ring
 * stores them. Changes nothing held. */
static kvpq_status vq_stage_exact(void *state, int layer, int len, int n, const float *k, const float *v) {
    vq_state *st = state;
    const vq_layer *L = &st->layers[layer];
    const int nkv = st->n_head_kv, d = st->head_dim;
    st->ex_layer = -1;
    st->ex_len = len, st->ex_nc = L->n_coded;
    const int t0 = vq_query_bound(st, 0), rows = len + n - t0;
    KVPQ_TRY(vq_ex_reserve(st, layer, (size_t)nkv * rows * d));
    KVPQ_TRY(vq_grow((void **)&st->bound, &st->bound_cap, (size_t)n, sizeof(int)));
    vq_exact_rows(st, L, len, t0, len + n, k, v, st->ex[0], st->ex[1], (size_t)d, (size_t)rows * d);
    for (int i = 0; i < n; i++) st->bound[i] = vq_query_bound(st, i);
    st->ex_layer = layer, st->ex_t0 = t0, st->ex_n = rows;
    return KVPQ_OK;
}

/* kvpq__load_fn of the staged exact rows; positions before ex_t0 (which no query reads exact) as 0. */
static void vq_exact_load(const void *state, int layer, int kvh, int t0, int n, float *kbuf, float *vbuf,
                          const float **k, const float **v) {
    const vq_state *st = state;
    (void)layer;
    const int d = st->head_dim, skip = st->ex_t0 > t0 ? st->ex_t0 - t0 : 0;
    const float *xk = st->ex[0] + ((size_t)kvh * st->ex_n + (size_t)(t0 + skip - st->ex_t0)) * d;
    const float *xv = st->ex[1] + ((size_t)kvh * st->ex_n + (size_t)(t0 + skip - st->ex_t0)) * d;
    if (!skip) {
        *k = xk, *v = xv;
        return;
    }
    memset(kbuf, 0, sizeof(float) * skip * d);
    memset(vbuf, 0, sizeof(float) * skip * d);
    memcpy(kbuf + (size_t)skip * d, xk, sizeof(float) * (n - skip) * d);
    memcpy(vbuf + (size_t)skip * d, xv, sizeof(float) * (n - skip) * d);
    *k = kbuf, *v = vbuf;
}

/* cache_impl.h attend_staged: the n_q queries of the positions just appended after vq_stage_exact,
 * each with its own window state. One state for all: vq_attend. Else dense over decoded rows up to
 * the last query's bound, each query reading from its own bound on the staged exact rows
 * (kvpq__attend_cpu_split): the attention runs of one window state each would give, in one pass. */
static kvpq_status vq_attend_staged(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    vq_state *st = state;
    const vq_layer *L = &st->layers[layer];
    if (st->ex_layer != layer || st->ex_len + n_q != len)
        return kvpq__err(KVPQ_ERR_INTERNAL, "VQ cache layer %d: attention of %d appended queries without their staging",
                         layer, n_q);
    st->ex_layer = -1;
    if (st->bound[0] == st->bound[n_q - 1]) return vq_attend(st, layer, len, n_q, q, out, lse);
    const int lo = vq_view_start(L, len - n_q), hi = L->n_coded;
    if (lo < hi) KVPQ_TRY(vq_decode_range(st, L, layer, lo, hi, 1));
    return kvpq__attend_cpu_split(&st->params, st, vq_dense_load, vq_exact_load, st->bound, layer, len, n_q, q, out,
                                  lse);
}

static kvpq_status vq_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    vq_state *st = state;
    const vq_layer *L = &st->layers[layer];
    const int nkv = st->n_head_kv, d = st->head_dim, G = st->group, gp = st->gp, nt = st->n_threads;
    if (G > 64) return kvpq__err(KVPQ_ERR_UNSUPPORTED, "VQ cache: %d query heads per KV head (at most 64)", G);
    if (n_q >= VQ_DENSE_MIN_Q) return vq_dense_attend(st, layer, len, n_q, q, out, lse);
    const int P = len - n_q, nc = L->n_coded;
    /* Split one head's coded context when there are too few (query, head) jobs for the threads:
     * pick the split count minimizing rounds x (work per job + a fixed per-job cost of about 1/32
     * of a whole context: LUT build, table clear, value output), splits of >= VQ_MIN_SPLIT tokens. */
    const int base_jobs = n_q * nkv;
    int n_split = 1;
    if (nt > 1 && base_jobs < 2 * nt) {
        int smax = nc / VQ_MIN_SPLIT;
        if (smax > 4 * nt) smax = 4 * nt;
        double best = 1e30;
        for (int sp = 1; sp <= smax; sp++) {
            int rounds = (base_jobs * sp + nt - 1) / nt;
            double cost = rounds * (1.0 / sp + 1.0 / 32);
            if (cost < best - 1e-9) {
                best = cost;
                n_split = sp;
            }
        }
    }
    const int n_jobs = base_jobs * n_split;
    const size_t psz = (size_t)gp * (2 + d);
    if (st->rope[layer]) { /* every coded position a query of this call sees, decoded once */
        const int hi = P + n_q < nc ? P + n_q : nc, lo = vq_view_start(L, P);
        KVPQ_TRY(vq_decode_range(st, L, layer, lo < hi ? lo : hi, hi, 0));
    }
    KVPQ_TRY(vq_grow((void **)&st->part, &st->part_cap, (size_t)n_jobs * psz, sizeof(float)));
    KVPQ_TRY(vq_grow((void **)&st->left, &st->left_cap, (size_t)base_jobs, sizeof(int)));
    for (int j = 0; j < base_jobs; j++) st->left[j] = n_split;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    float *parts = st->part;
    int *left = st->left;
    /* The thread that completes a (query, head)'s last split merges its splits: no barrier between
     * the parts and the finish (a barrier is a sleep and a wake-up per call under passive waiting). */
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (nt > 1 && n_jobs > 1)
    for (int j = 0; j < n_jobs; j++) {
        vq_scratch *s = &st->scr[omp_get_thread_num()];
        const int bj = j / n_split, i = bj / nkv, h = bj % nkv, sp = j % n_split;
        int limit = P + i + 1 < nc ? P + i + 1 : nc;
        int lo = vq_view_start(L, P + i);
        if (lo > limit) lo = limit;
        int t0 = lo + (int)((int64_t)(limit - lo) * sp / n_split);
        int t1 = lo + (int)((int64_t)(limit - lo) * (sp + 1) / n_split);
        const size_t off = ((size_t)i * st->n_head + (size_t)h * G) * d;
        vq_coded_part(st, L, layer, h, q + off, t0, t1, s, K, parts + (size_t)j * psz);
        if (__atomic_sub_fetch(&left[bj], 1, __ATOMIC_ACQ_REL) == 0)
            vq_finish(st, L, h, P + i, q + off, parts + (size_t)bj * n_split * psz, n_split, s, K, out + off,
                      lse ? lse + (size_t)i * st->n_head + (size_t)h * G : NULL);
    }
    return KVPQ_OK;
}

// ---- truncate, read, sizes --------------------------------------------------------------------

static kvpq_status vq_truncate(void *state, const int *lens, int n_pos) {
    vq_state *st = state;
    st->dec_layer = st->ex_layer = -1; /* decoded rows of positions that may go: the buffers too (working memory) */
    for (int w = 0; w < 2; w++) {
        free(st->dec[w]);
        free(st->ex[w]);
        st->dec[w] = st->ex[w] = NULL;
        st->dec_rows[w] = st->dec_n[w] = 0;
    }
    st->ex_cap = 0;
    for (int l = 0; l < st->n_layer; l++) {
        vq_layer *L = &st->layers[l];
        if (n_pos >= lens[l]) { /* nothing cut: storage kvpq_cache_reserve took beyond the positions goes */
            const int held = (L->n_coded + st->page_tokens - 1) / st->page_tokens;
            if (L->n_pages > held) vq_pages_put(st, L, held > L->first_page ? held : L->first_page);
            if (lens[l] == 0) vq_ring_put(st, L);
            continue;
        }
        if (L->n_coded > n_pos) L->n_coded = n_pos;
        int need = (L->n_coded + st->page_tokens - 1) / st->page_tokens;
        vq_pages_put(st, L, need);
        /* 8-bit scales: the last kept page's reference came from its first nonzero scale; where no
         * kept position has one, a fresh cache would take it from the next appends: reset it */
        const int pg = need - 1, p0 = pg * st->page_tokens;
        for (int kind = 0; kind < 2 && pg >= 0 && L->pages[pg]; kind++)
            for (int h = 0; L->sb[kind] == 1 && h < st->n_head_kv; h++) {
                const uint8_t *c = vq_scales(st, L, kind, h, p0);
                int any = 0;
                for (int t = p0; t < L->n_coded && !any; t++) any = c[t - p0] != 0;
                if (!any) *vq_scale_ref(st, L, kind, h, pg) = 0.0f;
            }
        if (L->first_page > L->n_pages) L->first_page = L->n_pages;
        if (n_pos == 0) { /* emptied: its rings go back too, as kivi's (taken again at the next append) */
            L->first_page = 0;
            vq_ring_put(st, L);
        }
    }
    return KVPQ_OK;
}

static kvpq_status vq_read(const void *state, int layer, int len, int pos0, int n, float *k, float *v) {
    const vq_state *st = state;
    const vq_layer *L = &st->layers[layer];
    const int nkv = st->n_head_kv, d = st->head_dim;
    const size_t row = (size_t)nkv * d;
    const kvpq_vq_kernels *K = kvpq__vq_kernels(kvpq_simd_get());
    int c1 = pos0 + n < L->n_coded ? pos0 + n : L->n_coded; /* coded part [pos0, c1) */
    if (c1 > pos0) {
        size_t nv = (size_t)(c1 - pos0) * nkv;
        size_t cs = L->kcs > L->vcs ? L->kcs : L->vcs;
        uint8_t *codes = malloc(nv * cs);
        float *x = malloc(nv * d * sizeof(float));
        kvpq_status rc = codes && x ? KVPQ_OK : kvpq__err(KVPQ_ERR_NOMEM, "VQ cache read: out of memory");
        for (int which = 0; which < 2 && rc == KVPQ_OK; which++)
            if (which ? v : k) rc = vq_decode_rows(st, L, layer, which, pos0, c1, codes, x, which ? v : k);
        free(codes);
        free(x);
        KVPQ_TRY(rc);
    }
    for (int t = c1 > pos0 ? c1 : pos0; t < pos0 + n; t++) {
        for (int h = 0; h < nkv; h++) {
            size_t o = (size_t)(t - pos0) * row + (size_t)h * d;
            if (k) K->f16_to_f32(d, vq_ring_row(st, L, 0, h, t), k + o);
            if (v) K->f16_to_f32(d, vq_ring_row(st, L, 1, h, t), v + o);
        }
    }
    return KVPQ_OK;
}

/* Sliding-window layers: whole pages of codes below keep_from go (the fp16 window ring stays). */
static int vq_drop(void *state, int layer, int len, int keep_from) {
    vq_state *st = state;
    vq_layer *L = &st->layers[layer];
    (void)len;
    int upto = (keep_from < L->n_coded ? keep_from : L->n_coded) / st->page_tokens;
    if (upto > L->n_pages) upto = L->n_pages;
    for (int pg = L->first_page; pg < upto; pg++) {
        kvpq__pool_put(st->pool, L->pages[pg], L->page_bytes);
        L->pages[pg] = NULL;
    }
    if (upto > L->first_page) L->first_page = upto;
    return L->first_page * st->page_tokens;
}

static size_t vq_resident_bytes(const void *state, const int *lens) {
    const vq_state *st = state;
    size_t b = st->codebook_bytes;
    for (int l = 0; l < st->n_layer; l++) {
        const vq_layer *L = &st->layers[l];
        b += (size_t)(L->n_pages - L->first_page) * L->page_bytes;
        if (L->wk) b += 2 * (size_t)st->cap * st->n_head_kv * st->head_dim * sizeof(uint16_t);
    }
    return b;
}

static void vq_stats(const void *state, const int *lens, kvpq_cache_stats *s) {
    const vq_state *st = state;
    s->tokens_coded = 0;
    s->tokens_window = 0;
    for (int l = 0; l < st->n_layer; l++) {
        const vq_layer *L = &st->layers[l];
        const size_t coded = (size_t)(L->n_coded - L->first_page * st->page_tokens),
                     window = (size_t)(lens[l] - L->n_coded);
        s->tokens_coded += (int64_t)coded;
        s->tokens_window += (int64_t)window;
        s->stored_bytes += coded * L->page_bytes / (size_t)st->page_tokens +
                           window * 2 * (size_t)st->n_head_kv * st->head_dim * sizeof(uint16_t);
    }
}

/* Saved caches: per layer, n_coded, the pages of its codes (and scales), whole, whether the
 * window ring exists, and the ring (fp16). */
static kvpq_status vq_serial(void *state, const int *lens, const int *lo, kvpq__stream *s, int load) {
    vq_state *st = state;
    const size_t ring = (size_t)st->cap * st->n_head_kv * st->head_dim;
    for (int l = 0; l < st->n_layer; l++) {
        vq_layer *L = &st->layers[l];
        int32_t coded = L->n_coded, has_ring = L->wk != NULL;
        KVPQ_TRY(kvpq__stream_io(s, &coded, sizeof coded));
        KVPQ_TRY(kvpq__stream_io(s, &has_ring, sizeof has_ring));
        /* in 64 bits: on load, coded comes from the file and is checked only below (INT32_MAX overflowed) */
        const int64_t pages = ((int64_t)coded + st->page_tokens - 1) / st->page_tokens;
        const int first = lo[l] / st->page_tokens;
        if (load) {
            if (lo[l] % st->page_tokens || lo[l] > coded)
                return kvpq__err(KVPQ_ERR_FORMAT, "saved cache vq layer %d: first position %d for %d coded", l, lo[l],
                                 (int)coded);
            if (coded < 0 || coded > lens[l] || lens[l] - coded > st->cap || pages > st->max_pages ||
                (lens[l] > 0 && !has_ring))
                return kvpq__err(KVPQ_ERR_FORMAT, "saved cache vq layer %d: n_coded %d for %d positions", l,
                                 (int)coded, lens[l]);
            L->n_coded = coded;
            L->first_page = first; /* pages a sliding window had freed stay NULL */
            if (L->n_pages < first) L->n_pages = first; /* pages before it stay NULL */
            KVPQ_TRY(vq_pages_get(st, L, (int)pages));
        }
        for (int pg = first; pg < pages; pg++) KVPQ_TRY(kvpq__stream_io(s, L->pages[pg], L->page_bytes));
        if (!has_ring) continue;
        if (load) KVPQ_TRY(vq_ring_get(st, L, l));
        KVPQ_TRY(kvpq__stream_io(s, L->wk, ring * sizeof(uint16_t)));
        KVPQ_TRY(kvpq__stream_io(s, L->wv, ring * sizeof(uint16_t)));
    }
    return KVPQ_OK;
}

/* Pages for the positions appends up to n_pos would code, and the ring of a layer that has none. */
static kvpq_status vq_reserve(void *state, const int *lens, int n_pos) {
    vq_state *st = state;
    kvpq_status s = KVPQ_OK;
    for (int l = 0; l < st->n_layer && s == KVPQ_OK; l++) {
        vq_layer *L = &st->layers[l];
        if (lens[l] >= n_pos) continue;
        int target = vq_target_coded(st, n_pos);
        if (target < L->n_coded) target = L->n_coded;
        const int pages = (target + st->page_tokens - 1) / st->page_tokens;
        if (!L->wk) s = vq_ring_get(st, L, l);
        if (s == KVPQ_OK && pages > st->max_pages)
            s = kvpq__err(KVPQ_ERR_CAPACITY, "VQ cache layer %d: %d positions exceed max_seq", l, target);
        if (s == KVPQ_OK) s = vq_pages_get(st, L, pages);
    }
    for (int l = 0; l < st->n_layer && s != KVPQ_OK; l++) { /* back to what the positions need */
        vq_layer *L = &st->layers[l];
        const int held = (L->n_coded + st->page_tokens - 1) / st->page_tokens;
        if (L->n_pages > held) vq_pages_put(st, L, held > L->first_page ? held : L->first_page);
        if (lens[l] == 0 && L->wk) vq_ring_put(st, L);
    }
    return s;
}

static int vq_coded_of(const void *state, int len) { return vq_target_coded(state, len); }
static int vq_n_coded(const void *state, int layer) { return ((const vq_state *)state)->layers[layer].n_coded; }

const kvpq_cache_ops kvpq_cache_ops_vq = {
    .name = "vq",
    .create = vq_create,
    .serial = vq_serial,
    .destroy = vq_destroy,
    .append = vq_append,
    .attend = vq_attend,
    .truncate = vq_truncate,
    .read = vq_read,
    .resident_bytes = vq_resident_bytes,
    .stats = vq_stats,
    .drop = vq_drop,
    .coded_of = vq_coded_of,
    .n_coded = vq_n_coded,
    .reserve = vq_reserve,
    .stage_exact = vq_stage_exact,
    .attend_staged = vq_attend_staged,
    .staged_min_n = VQ_DENSE_MIN_Q,
};
