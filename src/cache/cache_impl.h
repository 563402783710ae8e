/* cache_impl.h — the KV-cache operations table behind kvpq_cache (kvpq.h). Internal.
 *
 * cache.c owns the public entry points: it checks arguments (NULL, layer range, NaN/Inf in K/V,
 * capacity) once, keeps the per-layer positions count, and calls the kind's ops. Each kind
 * (fp32, fp16, q8_0, q4_0, kivi, vq) lives in its own file and fills a kvpq_cache_ops. */
#ifndef KVPQ_CACHE_IMPL_H
#define KVPQ_CACHE_IMPL_H

#include "kvpq.h"

/* A saved cache's byte stream (cache_file.c): kvpq__stream_io writes n bytes of buf when saving and
 * reads n bytes into buf when loading (KVPQ_ERR_FORMAT when the file ends first, KVPQ_ERR_IO). */
typedef struct kvpq__stream kvpq__stream;
kvpq_status kvpq__stream_io(kvpq__stream *s, void *buf, size_t n);

/* ---- page pool (page_pool.c; kvpq_page_pool in kvpq.h) ----
 * Every page and window ring of a CPU cache comes from here: from its params' pool, or, with pool
 * NULL, from the system as before (aligned_alloc). Memory is zeroed, 64-byte aligned, of `bytes`
 * rounded up to 64. */
/* *out gets the memory; KVPQ_ERR_BUDGET (the pool's budget) or KVPQ_ERR_NOMEM with the message set. */
kvpq_status kvpq__pool_get(kvpq_page_pool *pool, size_t bytes, void **out);
/* Give back memory of kvpq__pool_get (same pool and bytes). NULL p is a no-op. */
void kvpq__pool_put(kvpq_page_pool *pool, void *p, size_t bytes);
/* A cache's reference (kvpq_cache_new / kvpq_cache_free). NULL is a no-op. */
void kvpq__pool_ref(kvpq_page_pool *pool);
void kvpq__pool_unref(kvpq_page_pool *pool);

typedef struct kvpq_cache_ops {
    const char *name;
    /* Create the kind's state from validated params. */
    kvpq_status (*create)(void **state, const kvpq_cache_params *p);
    void (*destroy)(void *state);
    /* Append n positions after the `len` already held by `layer`. k, v: (n, n_head_kv, head_dim). */
    kvpq_status (*append)(void *state, int layer, int len, int n, const float *k, const float *v);
    /* Causal attention of the newest n_q positions (see kvpq_cache_attend); `len` positions held.
     * lse: NULL, or (n_q, n_head) gets each row's log-sum-exp of its scaled scores, m + log(d) of the
     * final online-softmax state (cache.c merges attention-sink positions with it). */
    kvpq_status (*attend)(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse);
    /* Drop positions >= n_pos of every layer (lens[l] were held before). */
    kvpq_status (*truncate)(void *state, const int *lens, int n_pos);
    /* Dequantized K/V of positions [pos0, pos0+n); k or v may be NULL. */
    kvpq_status (*read)(const void *state, int layer, int len, int pos0, int n, float *k, float *v);
    size_t (*resident_bytes)(const void *state, const int *lens);
    /* Optional: fill tokens_coded / tokens_window. */
    void (*stats)(const void *state, const int *lens, kvpq_cache_stats *st);
    /* Sliding-window layers: free the storage of positions < keep_from that whole storage units
     * allow (never a position >= keep_from); `len` positions held. Returns the first position
     * still held afterwards (<= keep_from). Cannot fail. Positions are absolute throughout: a
     * kind only stops holding the ones before what it returns. */
    int (*drop)(void *state, int layer, int len, int keep_from);
    /* The kind's stored state as bytes (kvpq_cache_save / kvpq_cache_load): with load 0, write what
     * holding lens[l] positions needs through s; with load 1, read the same into a fresh state made
     * from the same params (allocating its pages). One function for both directions keeps the two
     * in step. A value read that the state cannot hold is KVPQ_ERR_FORMAT. NULL: not saveable. */
    /* lo[l]: the first position layer l holds (what `drop` returned; 0 without a sliding window):
     * storage units before it are neither written nor read, and a load leaves the state starting
     * there (a value lo that the kind's units cannot start at is KVPQ_ERR_FORMAT). */
    kvpq_status (*serial)(void *state, const int *lens, const int *lo, kvpq__stream *s, int load);
    /* Windowed kinds (a full-precision window, then codes): coded_of(len) is how many positions a
     * layer fed len positions by appends alone holds coded (the window rule), and n_coded(layer) how
     * many it holds coded now (a truncation may leave more or fewer than the rule). cache.c uses them
     * so that each query sees the window state of its own position (kvpq_cache_append_attend) and to
     * find exact prefixes (kvpq_cache_exact_prefix). NULL for kinds whose positions read the same
     * from their append on. */
    int (*coded_of)(const void *state, int len);
    int (*n_coded)(const void *state, int layer);
    /* kvpq_cache_reserve: make the storage exist that appends up to n_pos positions would allocate
     * in every layer holding lens[l] < n_pos (the kind's positions). On failure, every layer keeps
     * only the storage its positions need (spare pages and an empty layer's ring go back): nothing
     * held changes. NULL: nothing to reserve (the CUDA kind). */
    kvpq_status (*reserve)(void *state, const int *lens, int n_pos);
    /* Optional (windowed kinds): kvpq_cache_append_attend in one pass instead of runs of one window
     * state. stage_exact(len, n, k, v), before the append of n positions (k, v) to a layer holding
     * len, keeps what their queries will need that the append takes away (the window's rows of
     * positions it codes); it changes nothing held. attend_staged(len, n_q, ...) after that append
     * (len now includes it, n_q = n): query i sees the positions that appending up to its own would
     * have coded as codes and the rest exact, as a run of its own would; lse as attend's. Both or
     * neither; NULL: the runs. Used for batches of at least staged_min_n positions (smaller ones
     * are cheaper in runs: the kind's per-query path). */
    kvpq_status (*stage_exact)(void *state, int layer, int len, int n, const float *k, const float *v);
    kvpq_status (*attend_staged)(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse);
    int staged_min_n;
} kvpq_cache_ops;

/* Positions a query of `layer` may see (its sliding window), or 0 for every earlier position. */
static inline int kvpq__layer_window(const kvpq_cache_params *p, int layer) {
    return p->sliding_window > 0 && (!p->swa_layers || p->swa_layers[layer]) ? p->sliding_window : 0;
}

/* First position the query at position `pos` attends to in `layer`. */
static inline int kvpq__window_start(const kvpq_cache_params *p, int layer, int pos) {
    int w = kvpq__layer_window(p, layer);
    return w > 0 && pos - w + 1 > 0 ? pos - w + 1 : 0;
}

struct kvpq_cache {
    kvpq_cache_params p;
    const kvpq_cache_ops *ops;
    void *state;
    int *len; /* (n_layer) positions held per layer */
    int *lo;  /* (n_layer) first position still held (> 0 only in sliding-window layers) */
    uint8_t *swa; /* (n_layer) copy of params.swa_layers (p.swa_layers points here), or NULL */
    /* Attention sinks (params.sinks = S > 0): positions [0, S) of every layer in fp16, (n_layer, S,
     * n_head_kv, head_dim) each; the kind holds positions S.. as its positions 0.. (its len is
     * max(0, len - S), kept in ilen). NULL when S == 0. */
    uint16_t *sk, *sv;
    int *ilen;
    /* VQ kinds: kvpq_codebook_fingerprint of the codebook when the cache was made (its page layout:
     * a later change of the codebook's metadata, e.g. k.norm_bits, does not change this cache's
     * pages, so kvpq_cache_save writes and kvpq_cache_load checks this one); 0 otherwise */
    uint64_t cb_fp;
};

/* The kinds (cache_fp32.c, cache_fp16.c, cache_q8_0.c, cache_q4_0.c, cache_kivi.c). */
extern const kvpq_cache_ops kvpq_cache_ops_fp32;
extern const kvpq_cache_ops kvpq_cache_ops_fp16;
extern const kvpq_cache_ops kvpq_cache_ops_q8_0;
extern const kvpq_cache_ops kvpq_cache_ops_q4_0;
extern const kvpq_cache_ops kvpq_cache_ops_q8_0r;
extern const kvpq_cache_ops kvpq_cache_ops_q4_0r;
extern const kvpq_cache_ops kvpq_cache_ops_kivi2;
extern const kvpq_cache_ops kvpq_cache_ops_kivi4;
/* The VQ kind: src/cache/cache_vq.c.
 * create() receives params with backend already resolved (CPU or CUDA; AUTO never reaches it) and
 * a codebook whose n_layer, n_head_kv and head_dim cache.c has checked against the params. */
extern const kvpq_cache_ops kvpq_cache_ops_vq;
/* The VQ kind on the GPU (backend CUDA): src/cache/cache_vq_cuda.c, in every build (without CUDA
 * kvpq_backend_resolve refuses the backend before it is reached). */
extern const kvpq_cache_ops kvpq_cache_ops_vq_cuda;

/* Online-softmax state {m, d, o} (FlashAttention; Milakov & Gimelshein 2018): m running max of
 * scores, d sum of exp(score - m), o (head_dim) sum of exp(score - m) * v. Merging two partial
 * states over disjoint key sets gives the state over their union. Shared by every CPU path. */
typedef struct {
    float m;
    float d;
} kvpq_softmax_state;

/* Merge (mb, db, ob) into (ma, da, oa) in place; o vectors have head_dim floats. */
void kvpq_softmax_merge(kvpq_softmax_state *a, float *oa, const kvpq_softmax_state *b, const float *ob,
                        int head_dim);

#endif
