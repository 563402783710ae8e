/* cache_kivi.c — KIVI KV caches, 2 and 4 bits (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit
 * Quantization for KV Cache", arXiv 2402.02750, sec. 3-4).
 *
 * Quantization (asymmetric, as KIVI eq. 1-2): a group of G = 32 numbers x is stored as
 * min = min(x), scale = (max(x) - min) / (2^b - 1), both fp16, and codes
 * q = clamp(round((x - min) / scale), 0, 2^b - 1) computed with the fp16-rounded min and scale, so
 * that x ~= q * scale + min exactly as dequantized. Keys are grouped per channel along the token
 * axis (32 consecutive tokens of one channel: KIVI's per-channel key quantization); values per
 * token along the channel axis (32 consecutive channels of one token). head_dim % 32 == 0.
 *
 * Residual window (KIVI's full-precision residual, fp16 as in KIVI): with L positions held and
 * window W, the positions [0, n_coded) are quantized, n_coded = floor(max(0, L - W) / 32) * 32, and
 * [n_coded, L) are kept in fp16. So the window always holds the newest min(L, W) positions plus the
 * 0..31 older ones that do not yet form a full group of 32: between min(L, W) and W + 31 positions.
 * A group of 32 positions is quantized (keys and values together) as soon as its newest position
 * is more than W positions old, i.e. when 32 positions have left the newest-W window. KIVI itself
 * quantizes the key residual all at once when it reaches R tokens and values token by token; the
 * single boundary here keeps K and V of a position in the same state, with the same memory.
 *
 * Storage: quantized groups in pages of ceil(page_tokens / 32) groups, a page laid out
 * (n_head_kv, groups, block); a key block is {scale (head_dim) fp16, min (head_dim) fp16,
 * codes (32 tokens, head_dim) packed LSB-first}; a value block is {scale (32, head_dim/32) fp16,
 * min (32, head_dim/32) fp16, codes (32 tokens, head_dim) packed LSB-first}: (b + 1) bits per
 * element. Codes are token-major in both, so a position decodes as one contiguous row. The window
 * is an fp16 ring of W + 32 positions per layer (allocated at the layer's first append), position t
 * in slot t mod (W + 32).
 *
 * Truncation to n_pos keeps every whole quantized group below n_pos as it is (n_coded becomes
 * min(n_coded, floor(n_pos / 32) * 32), which may exceed the rule above until appends catch up:
 * then the window holds fewer than W positions for a while). Only the positions of a group cut in
 * two, at most 31, go back to the window, holding their dequantized values rounded to fp16: so a
 * rollback (the model truncates after a failed eval) changes at most those by fp16 rounding, and
 * truncation that keeps n_coded, or to 0, is exact. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "internal.h"

#define G 32

typedef struct {
    kvpq_cache_params p;
    int bits, levels;    /* b, 2^b - 1 */
    int cap;             /* ring slots: W + 32 */
    int gp;              /* groups per page */
    size_t blk;          /* bytes of one key (or value) block of one KV head */
    kvpq__pages *k, *v;  /* (n_layer) quantized groups */
    uint16_t **wk, **wv; /* (n_layer) -> (cap, n_head_kv, head_dim) fp16 ring, NULL until first append */
    int *coded;          /* (n_layer) n_coded of the positions held */
} kivi_state;

static int n_coded_of(const kivi_state *s, int len) {
    int over = len - s->p.window;
    return over > 0 ? over / G * G : 0;
}

/* Bytes of one of a layer's two fp16 rings (K or V). */
static size_t ring_bytes(const kivi_state *s) {
    return (size_t)s->cap * s->p.n_head_kv * s->p.head_dim * sizeof(uint16_t);
}

/* The layer's K and V rings from the pool (zeroed); on failure neither. */
static kvpq_status ring_get(kivi_state *s, int l) {
    void *k = NULL, *v = NULL;
    kvpq_status st = kvpq__pool_get(s->p.pool, ring_bytes(s), &k);
    if (st == KVPQ_OK) st = kvpq__pool_get(s->p.pool, ring_bytes(s), &v);
    if (st != KVPQ_OK) {
        kvpq__pool_put(s->p.pool, k, ring_bytes(s));
        kvpq__err_prefix("cache kivi%d: the window of layer %d", s->bits, l);
        return st;
    }
    s->wk[l] = k, s->wv[l] = v;
    return KVPQ_OK;
}

static void ring_put(kivi_state *s, int l) {
    kvpq__pool_put(s->p.pool, s->wk[l], ring_bytes(s));
    kvpq__pool_put(s->p.pool, s->wv[l], ring_bytes(s));
    s->wk[l] = s->wv[l] = NULL;
}

static void kivi_destroy(void *state) {
    kivi_state *s = state;
    if (!s) return;
    for (int l = 0; l < s->p.n_layer; l++) {
        if (s->k) kvpq__pages_free(&s->k[l]);
        if (s->v) kvpq__pages_free(&s->v[l]);
        if (s->wk && s->wv) ring_put(s, l);
    }
    free(s->k), free(s->v), free(s->wk), free(s->wv), free(s->coded);
    free(s);
}

static kvpq_status kivi_create(void **state, const kvpq_cache_params *p, int bits) {
    if (p->head_dim % G)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache kivi%d: head_dim %d is not a multiple of %d (its group size)",
                         bits, p->head_dim, G);
    if (p->window > (1 << 24))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache kivi%d: window %d: expected at most %d", bits, p->window,
                         1 << 24);
    kivi_state *s = calloc(1, sizeof *s);
    if (!s) return kvpq__err(KVPQ_ERR_NOMEM, "cache kivi%d: out of memory", bits);
    s->p = *p;
    s->bits = bits;
    s->levels = (1 << bits) - 1;
    s->cap = p->window + G;
    s->gp = (p->page_tokens + G - 1) / G;
    s->blk = (size_t)p->head_dim * 4 + (size_t)p->head_dim * G * bits / 8;
    size_t n = (size_t)p->n_layer;
    s->k = calloc(n, sizeof *s->k), s->v = calloc(n, sizeof *s->v);
    s->wk = calloc(n, sizeof *s->wk), s->wv = calloc(n, sizeof *s->wv);
    s->coded = calloc(n, sizeof *s->coded);
    if (!s->k || !s->v || !s->wk || !s->wv || !s->coded) {
        kivi_destroy(s);
        return kvpq__err(KVPQ_ERR_NOMEM, "cache kivi%d: out of memory for %d layers", bits, p->n_layer);
    }
    const size_t page_bytes = (size_t)s->gp * p->n_head_kv * s->blk;
    for (int l = 0; l < p->n_layer; l++) {
        s->k[l].page_bytes = s->v[l].page_bytes = page_bytes;
        s->k[l].pool = s->v[l].pool = p->pool;
    }
    *state = s;
    return KVPQ_OK;
}
static kvpq_status kivi2_create(void **state, const kvpq_cache_params *p) { return kivi_create(state, p, 2); }
static kvpq_status kivi4_create(void **state, const kvpq_cache_params *p) { return kivi_create(state, p, 4); }

/* ---- quantization of one group -------------------------------------------------------------- */

/* Quantize x[i * stride], i < 32; code i goes to bit (bit0 + i * bit_step) of `codes` (LSB-first,
 * zeroed beforehand); fp16 scale and min out. */
static void quant_group(const float *x, size_t stride, int bits, int levels, uint16_t *scale_h, uint16_t *min_h,
                        unsigned char *codes, size_t bit0, size_t bit_step) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < G; i++) {
        float xi = x[i * stride];
        mn = xi < mn ? xi : mn;
        mx = xi > mx ? xi : mx;
    }
    *min_h = kvpq__f2h(mn);
    *scale_h = kvpq__f2h((mx - mn) / (float)levels);
    const float m = kvpq__h2f(*min_h), sc = kvpq__h2f(*scale_h), inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    for (int i = 0; i < G; i++) {
        float qf = roundf((x[i * stride] - m) * inv);
        int q = qf < 0.0f ? 0 : qf > (float)levels ? levels : (int)qf;
        size_t bit = bit0 + (size_t)i * bit_step;
        codes[bit / 8] |= (unsigned char)(q << (bit % 8));
    }
}

static unsigned char *block_at(const kivi_state *s, const kvpq__pages *pl, int group, int kvh) {
    return kvpq__page(pl, group / s->gp) + ((size_t)kvh * s->gp + group % s->gp) * s->blk;
}

/* Quantize the group starting at position t0 (all 32 positions in the ring) into its blocks. */
static void quant_from_window(kivi_state *s, int layer, int t0, float *tmp /* (32, head_dim) */) {
    const int hd = s->p.head_dim, hkv = s->p.n_head_kv, gi = t0 / G;
    for (int h = 0; h < hkv; h++) {
        /* keys: per channel over the 32 tokens */
        for (int i = 0; i < G; i++)
            for (int c = 0; c < hd; c++)
                tmp[i * hd + c] = kvpq__h2f(s->wk[layer][((size_t)((t0 + i) % s->cap) * hkv + h) * hd + c]);
        unsigned char *bk = block_at(s, &s->k[layer], gi, h);
        uint16_t *ksc = (uint16_t *)bk, *kmn = ksc + hd;
        unsigned char *kcodes = (unsigned char *)(kmn + hd);
        memset(kcodes, 0, (size_t)G * hd * s->bits / 8);
        for (int c = 0; c < hd; c++) /* channel c, token i: code i*hd + c */
            quant_group(tmp + c, (size_t)hd, s->bits, s->levels, &ksc[c], &kmn[c], kcodes, (size_t)c * s->bits,
                        (size_t)hd * s->bits);
        /* values: per token over groups of 32 channels */
        for (int i = 0; i < G; i++)
            for (int c = 0; c < hd; c++)
                tmp[i * hd + c] = kvpq__h2f(s->wv[layer][((size_t)((t0 + i) % s->cap) * hkv + h) * hd + c]);
        unsigned char *bv = block_at(s, &s->v[layer], gi, h);
        const int ng = hd / G;
        uint16_t *vsc = (uint16_t *)bv, *vmn = vsc + G * ng;
        unsigned char *vcodes = (unsigned char *)(vmn + G * ng);
        memset(vcodes, 0, (size_t)G * hd * s->bits / 8);
        for (int i = 0; i < G; i++)
            for (int j = 0; j < ng; j++)
                quant_group(tmp + (size_t)i * hd + j * G, 1, s->bits, s->levels, &vsc[i * ng + j], &vmn[i * ng + j],
                            vcodes, ((size_t)i * hd + j * G) * s->bits, (size_t)s->bits);
    }
}

/* Dequantize positions [a, b) of group gi (a, b within it) of KV head h into k/v rows (b - a, hd).
 * Rows decode contiguously: codes of a block are laid out (32 tokens, head_dim) for K and V alike. */
static void dequant_group(const kivi_state *s, int layer, int gi, int h, int a, int b, float *k, float *v) {
    const int hd = s->p.head_dim, bits = s->bits, ng = hd / G;
    const int ia = a - gi * G, ib = b - gi * G;
    const size_t row_bytes = (size_t)hd * bits / 8;
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    float sc[1024], mn[1024]; /* head_dim <= 1024 (cache.c) */
    if (k) {
        const unsigned char *bk = block_at(s, &s->k[layer], gi, h);
        const uint16_t *ksc = (const uint16_t *)bk, *kmn = ksc + hd;
        const unsigned char *kcodes = (const unsigned char *)(kmn + hd);
        kr->f16_to_f32(ksc, sc, (size_t)hd);
        kr->f16_to_f32(kmn, mn, (size_t)hd);
        for (int i = ia; i < ib; i++)
            kr->dequant_bits(kcodes + (size_t)i * row_bytes, bits, hd, sc, mn, k + (size_t)(i - ia) * hd);
    }
    if (v) {
        const unsigned char *bv = block_at(s, &s->v[layer], gi, h);
        const uint16_t *vsc = (const uint16_t *)bv, *vmn = vsc + G * ng;
        const unsigned char *vcodes = (const unsigned char *)(vmn + G * ng);
        for (int i = ia; i < ib; i++) { /* this token's scale and min per 32 channels */
            kr->f16_to_f32(vsc + i * ng, sc, (size_t)ng);
            kr->f16_to_f32(vmn + i * ng, mn, (size_t)ng);
            kr->dequant_bits_g32(vcodes + (size_t)i * row_bytes, bits, hd, sc, mn, v + (size_t)(i - ia) * hd);
        }
    }
}

/* ---- ops ------------------------------------------------------------------------------------ */

static kvpq_status kivi_append(void *state, int layer, int len, int n, const float *k, const float *v) {
    kivi_state *s = state;
    const int hd = s->p.head_dim, hkv = s->p.n_head_kv;
    const char *name = s->bits == 2 ? "kivi2" : "kivi4";
    KVPQ_TRY(kvpq__check_range(&s->p, name, "K", layer, len, n, k, 65504.0f));
    KVPQ_TRY(kvpq__check_range(&s->p, name, "V", layer, len, n, v, 65504.0f));
    const int new_ring = !s->wk[layer];
    if (new_ring) KVPQ_TRY(ring_get(s, layer));
    const int groups = n_coded_of(s, len + n) / G;
    const int pages = (groups + s->gp - 1) / s->gp;
    float *tmp = malloc((size_t)G * hd * sizeof *tmp);
    kvpq__pages *pk = &s->k[layer], *pv = &s->v[layer];
    const int had_k = pk->n, had_v = pv->n;
    kvpq_status st = tmp ? KVPQ_OK : kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory", name);
    if (st == KVPQ_OK) st = kvpq__pages_reserve(pk, pages);
    if (st == KVPQ_OK) st = kvpq__pages_reserve(pv, pages);
    if (st != KVPQ_OK) { /* leave the cache as it was */
        kvpq__pages_shrink(pk, had_k);
        kvpq__pages_shrink(pv, had_v);
        if (new_ring) ring_put(s, layer);
        free(tmp);
        return st;
    }
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    /* Start from the coded count the layer holds: after a truncation it may exceed the rule's
     * n_coded_of(len) (truncate keeps whole groups), and the window slots of those groups have been
     * reused since, so they must never be quantized again. */
    int coded = s->coded[layer];
    for (int t = 0; t < n; t++) {
        /* Window before this write holds at most W + 31 positions, so the slot is free. */
        size_t slot = (size_t)((len + t) % s->cap) * hkv * hd, src = (size_t)t * hkv * hd;
        kr->f32_to_f16(k + src, s->wk[layer] + slot, (size_t)hkv * hd);
        kr->f32_to_f16(v + src, s->wv[layer] + slot, (size_t)hkv * hd);
        int now = n_coded_of(s, len + t + 1);
        for (; coded < now; coded += G) quant_from_window(s, layer, coded, tmp);
    }
    s->coded[layer] = coded;
    free(tmp);
    return KVPQ_OK;
}

static void kivi_load(const void *state, int layer, int kvh, int t0, int n, float *kbuf, float *vbuf,
                      const float **k, const float **v) {
    const kivi_state *s = state;
    const int hd = s->p.head_dim, hkv = s->p.n_head_kv, coded = s->coded[layer];
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    for (int a = t0; a < t0 + n;) {
        if (a < coded) { /* up to the end of a's group, which is quantized as a whole */
            int gi = a / G, b = (gi + 1) * G < t0 + n ? (gi + 1) * G : t0 + n;
            dequant_group(s, layer, gi, kvh, a, b, kbuf + (size_t)(a - t0) * hd, vbuf + (size_t)(a - t0) * hd);
            a = b;
        } else { /* window: one row per position (the ring may wrap) */
            size_t slot = ((size_t)(a % s->cap) * hkv + kvh) * hd;
            kr->f16_to_f32(s->wk[layer] + slot, kbuf + (size_t)(a - t0) * hd, (size_t)hd);
            kr->f16_to_f32(s->wv[layer] + slot, vbuf + (size_t)(a - t0) * hd, (size_t)hd);
            a++;
        }
    }
    *k = kbuf;
    *v = vbuf;
}

static kvpq_status kivi_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse) {
    kivi_state *s = state;
    return kvpq__attend_cpu(&s->p, s, kivi_load, KVPQ_ATTN_CHUNK, layer, len, n_q, q, out, lse);
}

static kvpq_status kivi_read(const void *state, int layer, int len, int pos0, int n, float *k, float *v) {
    const kivi_state *s = state;
    return kvpq__read_cpu(&s->p, s, kivi_load, KVPQ_ATTN_CHUNK, layer, pos0, n, k, v);
}

static kvpq_status kivi_truncate(void *state, const int *lens, int n_pos) {
    kivi_state *s = state;
    const int hd = s->p.head_dim, hkv = s->p.n_head_kv;
    float *tmp = malloc((size_t)2 * G * hd * sizeof *tmp);
    if (!tmp) return kvpq__err(KVPQ_ERR_NOMEM, "cache kivi%d truncate: out of memory", s->bits);
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    for (int l = 0; l < s->p.n_layer; l++) {
        if (lens[l] <= n_pos) { /* nothing cut: storage kvpq_cache_reserve took beyond the positions goes */
            const int held = (s->coded[l] / G + s->gp - 1) / s->gp;
            if (s->k[l].n > held) kvpq__pages_shrink(&s->k[l], held);
            if (s->v[l].n > held) kvpq__pages_shrink(&s->v[l], held);
            if (lens[l] == 0) ring_put(s, l);
            continue;
        }
        const int old = s->coded[l], now = n_pos / G * G < old ? n_pos / G * G : old;
        /* Positions [now, min(n_pos, old)), of a group cut in two, go back to the window,
         * dequantized (none when old <= n_pos). At most 31, so their ring slots are free. */
        const int end = n_pos < old ? n_pos : old;
        for (int gi = now / G; gi * G < end; gi++) {
            int a = gi * G, b = a + G < end ? a + G : end;
            for (int h = 0; h < hkv; h++) {
                dequant_group(s, l, gi, h, a, b, tmp, tmp + (size_t)G * hd);
                for (int t = a; t < b; t++) {
                    size_t slot = ((size_t)(t % s->cap) * hkv + h) * hd;
                    kr->f32_to_f16(tmp + (size_t)(t - a) * hd, s->wk[l] + slot, (size_t)hd);
                    kr->f32_to_f16(tmp + (size_t)G * hd + (size_t)(t - a) * hd, s->wv[l] + slot, (size_t)hd);
                }
            }
        }
        s->coded[l] = now;
        int pages = (now / G + s->gp - 1) / s->gp;
        kvpq__pages_shrink(&s->k[l], pages);
        kvpq__pages_shrink(&s->v[l], pages);
        if (n_pos == 0) ring_put(s, l); /* an emptied layer holds nothing, as when new */
    }
    free(tmp);
    return KVPQ_OK;
}

/* Sliding-window layers: whole pages of quantized groups below keep_from go (the fp16 window is a
 * ring of fixed size and stays). */
static int kivi_drop(void *state, int layer, int len, int keep_from) {
    kivi_state *s = state;
    (void)len;
    const int per_page = s->gp * G, coded = s->coded[layer];
    const int upto = (keep_from < coded ? keep_from : coded) / per_page;
    kvpq__pages_drop_front(&s->k[layer], upto);
    kvpq__pages_drop_front(&s->v[layer], upto);
    return s->k[layer].base * per_page;
}

static size_t kivi_resident_bytes(const void *state, const int *lens) {
    const kivi_state *s = state;
    const size_t ring = (size_t)s->cap * s->p.n_head_kv * s->p.head_dim * sizeof(uint16_t);
    size_t b = 0;
    for (int l = 0; l < s->p.n_layer; l++) {
        b += kvpq__pages_bytes(&s->k[l]) + kvpq__pages_bytes(&s->v[l]);
        if (s->wk[l]) b += 2 * ring;
    }
    return b;
}

static void kivi_stats(const void *state, const int *lens, kvpq_cache_stats *st) {
    const kivi_state *s = state;
    for (int l = 0; l < s->p.n_layer; l++) {
        const size_t coded = (size_t)(s->coded[l] - s->k[l].base * s->gp * G), window = (size_t)(lens[l] - s->coded[l]);
        st->tokens_coded += (int64_t)coded;
        st->tokens_window += (int64_t)window;
        st->stored_bytes += coded * (s->k[l].page_bytes + s->v[l].page_bytes) / ((size_t)s->gp * G) +
                            window * 2 * (size_t)s->p.n_head_kv * s->p.head_dim * sizeof(uint16_t);
    }
}

/* Saved caches: per layer, n_coded, the pages of its groups (keys, then values), whether the
 * window ring exists, and the ring. */
static kvpq_status kivi_serial(void *state, const int *lens, const int *lo, kvpq__stream *st, int load) {
    kivi_state *s = state;
    const size_t ring = (size_t)s->cap * s->p.n_head_kv * s->p.head_dim;
    for (int l = 0; l < s->p.n_layer; l++) {
        int32_t coded = s->coded[l], has_ring = s->wk[l] != NULL;
        KVPQ_TRY(kvpq__stream_io(st, &coded, sizeof coded));
        KVPQ_TRY(kvpq__stream_io(st, &has_ring, sizeof has_ring));
        if (load) {
            /* n_coded is a multiple of the group size, at most the positions held, and at least
             * what the window leaves over (a truncate can make it smaller than n_coded_of) */
            if (coded < 0 || coded % G || coded > lens[l] || lens[l] - coded > s->cap || (lens[l] > 0 && !has_ring))
                return kvpq__err(KVPQ_ERR_FORMAT, "saved cache kivi layer %d: n_coded %d for %d positions", l,
                                 (int)coded, lens[l]);
            /* a sliding window frees whole pages of coded groups only */
            if (lo[l] % (s->gp * G) || lo[l] > coded)
                return kvpq__err(KVPQ_ERR_FORMAT, "saved cache kivi layer %d: first position %d for %d coded", l,
                                 lo[l], (int)coded);
            s->coded[l] = coded;
        }
        const int pages = (coded / G + s->gp - 1) / s->gp, first = lo[l] / (s->gp * G);
        kvpq__pages *pl[2] = {&s->k[l], &s->v[l]};
        for (int w = 0; w < 2; w++) {
            if (load) {
                kvpq__pages_drop_front(pl[w], first);
                KVPQ_TRY(kvpq__pages_reserve(pl[w], pages));
            }
            for (int pg = first; pg < pages; pg++)
                KVPQ_TRY(kvpq__stream_io(st, kvpq__page(pl[w], pg), pl[w]->page_bytes));
        }
        if (!has_ring) continue;
        if (load) KVPQ_TRY(ring_get(s, l));
        KVPQ_TRY(kvpq__stream_io(st, s->wk[l], ring * sizeof(uint16_t)));
        KVPQ_TRY(kvpq__stream_io(st, s->wv[l], ring * sizeof(uint16_t)));
    }
    return KVPQ_OK;
}

/* Pages for the groups appends up to n_pos would code, and the ring of a layer that has none. */
static kvpq_status kivi_reserve(void *state, const int *lens, int n_pos) {
    kivi_state *s = state;
    kvpq_status st = KVPQ_OK;
    for (int l = 0; l < s->p.n_layer && st == KVPQ_OK; l++) {
        if (lens[l] >= n_pos) continue;
        int coded = n_coded_of(s, n_pos);
        if (coded < s->coded[l]) coded = s->coded[l];
        const int pages = (coded / G + s->gp - 1) / s->gp;
        if (!s->wk[l]) st = ring_get(s, l);
        if (st == KVPQ_OK) st = kvpq__pages_reserve(&s->k[l], pages);
        if (st == KVPQ_OK) st = kvpq__pages_reserve(&s->v[l], pages);
    }
    for (int l = 0; l < s->p.n_layer && st != KVPQ_OK; l++) { /* back to what the positions need */
        const int held = (s->coded[l] / G + s->gp - 1) / s->gp;
        if (s->k[l].n > held) kvpq__pages_shrink(&s->k[l], held);
        if (s->v[l].n > held) kvpq__pages_shrink(&s->v[l], held);
        if (lens[l] == 0 && s->wk[l]) ring_put(s, l);
    }
    return st;
}

static int kivi_coded_of(const void *state, int len) { return n_coded_of(state, len); }
static int kivi_n_coded(const void *state, int layer) { return ((const kivi_state *)state)->coded[layer]; }

/* The two kinds differ only in their create (the bits per code). */
#define KIVI_OPS(BITS)                         \
    {                                          \
        .name = "kivi" #BITS,                  \
        .create = kivi##BITS##_create,         \
        .destroy = kivi_destroy,               \
        .append = kivi_append,                 \
        .attend = kivi_attend,                 \
        .truncate = kivi_truncate,             \
        .read = kivi_read,                     \
        .resident_bytes = kivi_resident_bytes, \
        .stats = kivi_stats,                   \
        .drop = kivi_drop,                     \
        .serial = kivi_serial,                 \
        .coded_of = kivi_coded_of,             \
        .n_coded = kivi_n_coded,               \
        .reserve = kivi_reserve,               \
    }
const kvpq_cache_ops kvpq_cache_ops_kivi2 = KIVI_OPS(2);
const kvpq_cache_ops kvpq_cache_ops_kivi4 = KIVI_OPS(4);
