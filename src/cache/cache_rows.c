/* cache_rows.c — the engine of the per-token cache kinds (fp32, fp16, q8_0, q4_0): each head
 * vector is stored on its own as one "row" of a codec, in pages of page_tokens positions laid out
 * (n_head_kv, page_tokens, row_bytes), allocated as the sequence grows. */
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "internal.h"

typedef struct {
    kvpq_cache_params p;
    const kvpq__row_codec *codec;
    size_t row_bytes;
    kvpq__pages *k, *v; /* (n_layer) */
    int rot_k, rot_v;   /* rotated kinds: Walsh-Hadamard block sizes for K (and Q) and V; 0 = none */
} rows_state;

kvpq_status kvpq__rows_create(void **state, const kvpq_cache_params *p, const kvpq__row_codec *codec) {
    if (p->head_dim % codec->head_dim_multiple)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache %s: head_dim %d is not a multiple of %d (its block size)",
                         codec->name, p->head_dim, codec->head_dim_multiple);
    rows_state *s = calloc(1, sizeof *s);
    if (!s) return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory", codec->name);
    s->p = *p;
    s->codec = codec;
    s->row_bytes = codec->row_bytes(p->head_dim);
    s->k = calloc((size_t)p->n_layer, sizeof *s->k);
    s->v = calloc((size_t)p->n_layer, sizeof *s->v);
    if (!s->k || !s->v) {
        kvpq__rows_destroy(s);
        return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory for %d layers", codec->name, p->n_layer);
    }
    size_t page_bytes = (size_t)p->n_head_kv * p->page_tokens * s->row_bytes;
    for (int l = 0; l < p->n_layer; l++) {
        s->k[l].page_bytes = s->v[l].page_bytes = page_bytes;
        s->k[l].pool = s->v[l].pool = p->pool;
    }
    *state = s;
    return KVPQ_OK;
}

/* llama.cpp's rotation sizes (src/llama-kv-cache.cpp, llama_kv_cache's constructor, 2026): keys
 * n_rot_k = 64, doubled while head_dim % (2 n_rot_k) == 0 (the largest power of two dividing
 * head_dim); values n_rot_v = 64; both only when head_dim % 64 == 0. */
kvpq_status kvpq__rows_create_rotated(void **state, const kvpq_cache_params *p, const kvpq__row_codec *codec) {
    if (p->head_dim % 64)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                         "cache %s: head_dim %d is not a multiple of 64 (llama.cpp rotates K/V only then; use the "
                         "unrotated kind)",
                         codec->name, p->head_dim);
    KVPQ_TRY(kvpq__rows_create(state, p, codec));
    rows_state *s = *state;
    s->rot_k = 64;
    while (p->head_dim % (2 * s->rot_k) == 0) s->rot_k *= 2;
    s->rot_v = 64;
    return KVPQ_OK;
}

/* x (n_vec, head_dim) times the block-diagonal Walsh-Hadamard matrix of block size r (self-inverse). */
static void rotate(float *x, size_t n_vec, int head_dim, int r) {
    if (r) kvpq_hadamard(x, n_vec * (size_t)(head_dim / r), r); /* r is a power of two: cannot fail */
}

void kvpq__rows_destroy(void *state) {
    rows_state *s = state;
    if (!s) return;
    for (int l = 0; s->k && l < s->p.n_layer; l++) kvpq__pages_free(&s->k[l]);
    for (int l = 0; s->v && l < s->p.n_layer; l++) kvpq__pages_free(&s->v[l]);
    free(s->k);
    free(s->v);
    free(s);
}

static unsigned char *row_at(const rows_state *s, const kvpq__pages *pl, int kvh, int pos) {
    int pt = s->p.page_tokens;
    return kvpq__page(pl, pos / pt) + ((size_t)kvh * pt + pos % pt) * s->row_bytes;
}

static kvpq_status rows_append_plain(rows_state *s, int layer, int len, int n, const float *k, const float *v);

kvpq_status kvpq__rows_append(void *state, int layer, int len, int n, const float *k, const float *v) {
    rows_state *s = state;
    const int hkv = s->p.n_head_kv, hd = s->p.head_dim;
    float *rk = NULL;
    if (s->rot_k) { /* rotated kinds quantize H k and H v; the range check applies to those */
        const size_t ne = (size_t)n * hkv * hd;
        if (!(rk = malloc(2 * ne * sizeof *rk)))
            return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory rotating %d positions", s->codec->name, n);
        memcpy(rk, k, ne * sizeof *rk);
        memcpy(rk + ne, v, ne * sizeof *rk);
        rotate(rk, (size_t)n * hkv, hd, s->rot_k);
        rotate(rk + ne, (size_t)n * hkv, hd, s->rot_v);
        k = rk;
        v = rk + ne;
    }
    kvpq_status st = KVPQ_OK;
    if (s->codec->max_abs > 0) {
        st = kvpq__check_range(&s->p, s->codec->name, s->rot_k ? "K (rotated)" : "K", layer, len, n, k,
                               s->codec->max_abs);
        if (st == KVPQ_OK)
            st = kvpq__check_range(&s->p, s->codec->name, s->rot_k ? "V (rotated)" : "V", layer, len, n, v,
                                   s->codec->max_abs);
    }
    if (st == KVPQ_OK) st = rows_append_plain(s, layer, len, n, k, v);
    free(rk);
    return st;
}

static kvpq_status rows_append_plain(rows_state *s, int layer, int len, int n, const float *k, const float *v) {
    const int pt = s->p.page_tokens, hkv = s->p.n_head_kv, hd = s->p.head_dim;
    int need = (len + n + pt - 1) / pt;
    kvpq__pages *pk = &s->k[layer], *pv = &s->v[layer];
    int had_k = pk->n, had_v = pv->n;
    kvpq_status st = kvpq__pages_reserve(pk, need);
    if (st == KVPQ_OK) st = kvpq__pages_reserve(pv, need);
    if (st != KVPQ_OK) { /* leave the cache as it was */
        kvpq__pages_shrink(pk, had_k);
        kvpq__pages_shrink(pv, had_v);
        return st;
    }
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    for (int t = 0; t < n; t++)
        for (int h = 0; h < hkv; h++) {
            size_t src = ((size_t)t * hkv + h) * hd;
            s->codec->encode(k + src, 1, hd, row_at(s, pk, h, len + t), kr);
            s->codec->encode(v + src, 1, hd, row_at(s, pv, h, len + t), kr);
        }
    return KVPQ_OK;
}

static void rows_load(const void *state, int layer, int kvh, int t0, int n, float *kbuf, float *vbuf,
                      const float **k, const float **v) {
    const rows_state *s = state;
    const unsigned char *rk = row_at(s, &s->k[layer], kvh, t0), *rv = row_at(s, &s->v[layer], kvh, t0);
    if (!s->codec->decode) {
        *k = (const float *)rk;
        *v = (const float *)rv;
        return;
    }
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    s->codec->decode(rk, n, s->p.head_dim, kbuf, kr);
    s->codec->decode(rv, n, s->p.head_dim, vbuf, kr);
    *k = kbuf;
    *v = vbuf;
}

static void rows_load16(const void *state, int layer, int kvh, int t0, int n, const uint16_t **k,
                        const uint16_t **v) {
    const rows_state *s = state;
    (void)n;
    *k = (const uint16_t *)row_at(s, &s->k[layer], kvh, t0);
    *v = (const uint16_t *)row_at(s, &s->v[layer], kvh, t0);
}

kvpq_status kvpq__rows_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    rows_state *s = state;
    if (s->codec->f16_rows)
        return kvpq__attend_cpu_f16(&s->p, s, rows_load16, s->p.page_tokens, layer, len, n_q, q, out, lse);
    if (!s->rot_k) return kvpq__attend_cpu(&s->p, s, rows_load, s->p.page_tokens, layer, len, n_q, q, out, lse);
    /* Rotated kinds, as llama.cpp's graph (llm_graph_context::build_attn): scores from H_k q against
     * the stored H_k k (H_k orthonormal: q.k unchanged), values summed in the H_v space, then the
     * output rotated back by H_v (self-inverse). */
    const size_t nq = (size_t)n_q * s->p.n_head;
    float *qr = malloc(nq * s->p.head_dim * sizeof *qr);
    if (!qr) return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory rotating %d queries", s->codec->name, n_q);
    memcpy(qr, q, nq * s->p.head_dim * sizeof *qr);
    rotate(qr, nq, s->p.head_dim, s->rot_k);
    kvpq_status st = kvpq__attend_cpu(&s->p, s, rows_load, s->p.page_tokens, layer, len, n_q, qr, out, lse);
    free(qr);
    if (st == KVPQ_OK) rotate(out, nq, s->p.head_dim, s->rot_v);
    return st;
}

kvpq_status kvpq__rows_truncate(void *state, const int *lens, int n_pos) {
    rows_state *s = state;
    const int pt = s->p.page_tokens;
    for (int l = 0; l < s->p.n_layer; l++) {
        int keep = lens[l] < n_pos ? lens[l] : n_pos;
        kvpq__pages_shrink(&s->k[l], (keep + pt - 1) / pt);
        kvpq__pages_shrink(&s->v[l], (keep + pt - 1) / pt);
    }
    return KVPQ_OK;
}

kvpq_status kvpq__rows_read(const void *state, int layer, int len, int pos0, int n, float *k, float *v) {
    const rows_state *s = state;
    (void)len;
    KVPQ_TRY(kvpq__read_cpu(&s->p, s, rows_load, s->p.page_tokens, layer, pos0, n, k, v));
    /* Rotated kinds: back to the model's space (each rotation is its own inverse). */
    if (k) rotate(k, (size_t)n * s->p.n_head_kv, s->p.head_dim, s->rot_k);
    if (v) rotate(v, (size_t)n * s->p.n_head_kv, s->p.head_dim, s->rot_v);
    return KVPQ_OK;
}

kvpq_status kvpq__rows_reserve(void *state, const int *lens, int n_pos) {
    rows_state *s = state;
    const int pt = s->p.page_tokens, need = (n_pos + pt - 1) / pt;
    kvpq_status st = KVPQ_OK;
    for (int l = 0; l < s->p.n_layer && st == KVPQ_OK; l++) {
        if (lens[l] >= n_pos) continue;
        st = kvpq__pages_reserve(&s->k[l], need);
        if (st == KVPQ_OK) st = kvpq__pages_reserve(&s->v[l], need);
    }
    for (int l = 0; l < s->p.n_layer && st != KVPQ_OK; l++) { /* back to the pages the positions need */
        const int held = (lens[l] + pt - 1) / pt;
        if (s->k[l].n > held) kvpq__pages_shrink(&s->k[l], held);
        if (s->v[l].n > held) kvpq__pages_shrink(&s->v[l], held);
    }
    return st;
}

int kvpq__rows_drop(void *state, int layer, int len, int keep_from) {
    rows_state *s = state;
    (void)len;
    const int pt = s->p.page_tokens;
    kvpq__pages_drop_front(&s->k[layer], keep_from / pt);
    kvpq__pages_drop_front(&s->v[layer], keep_from / pt);
    return s->k[layer].base * pt;
}

size_t kvpq__rows_resident_bytes(const void *state, const int *lens) {
    const rows_state *s = state;
    size_t b = 0;
    for (int l = 0; l < s->p.n_layer; l++) b += kvpq__pages_bytes(&s->k[l]) + kvpq__pages_bytes(&s->v[l]);
    return b;
}

void kvpq__rows_stats(const void *state, const int *lens, kvpq_cache_stats *st) {
    const rows_state *s = state;
    const int pt = s->p.page_tokens;
    for (int l = 0; l < s->p.n_layer; l++) {
        const size_t held = (size_t)(lens[l] - s->k[l].base * pt); /* positions in the pages kept */
        st->stored_bytes += held * (s->k[l].page_bytes + s->v[l].page_bytes) / (size_t)pt;
    }
}

/* Saved caches: per layer, K then V, the pages holding lens[l] positions, whole. */
kvpq_status kvpq__rows_serial(void *state, const int *lens, const int *lo, kvpq__stream *st, int load) {
    rows_state *s = state;
    const int pt = s->p.page_tokens;
    for (int l = 0; l < s->p.n_layer; l++) {
        const int need = (lens[l] + pt - 1) / pt, first = lo[l] / pt;
        if (load && lo[l] % pt)
            return kvpq__err(KVPQ_ERR_FORMAT, "saved cache layer %d: first position %d is not at a page (%d)", l,
                             lo[l], pt);
        kvpq__pages *pl[2] = {&s->k[l], &s->v[l]};
        for (int w = 0; w < 2; w++) {
            if (load) {
                kvpq__pages_drop_front(pl[w], first); /* the pages a sliding window had freed stay absent */
                KVPQ_TRY(kvpq__pages_reserve(pl[w], need));
            }
            for (int pg = first; pg < need; pg++)
                KVPQ_TRY(kvpq__stream_io(st, kvpq__page(pl[w], pg), pl[w]->page_bytes));
        }
    }
    return KVPQ_OK;
}
