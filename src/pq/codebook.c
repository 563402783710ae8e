/* codebook.c — a model's trained codebooks (per layer: key and value quantizers, key smoothing
 * factors) and their safetensors file.
 *
 * File layout (safetensors, https://github.com/huggingface/safetensors, format description):
 *   u64 little-endian N | N bytes of JSON header, padded with spaces | data section
 * The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative
 * to the data section) and "__metadata__" to a string -> string map. The JSON is written and parsed
 * with cJSON. Tensors are written contiguously in layer order; the header is padded so the data
 * section starts 8-byte aligned, as the reference writer does.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "internal.h"
#include "pq/codebook_impl.h"
#include "pq/pq_impl.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "codebook.c copies little-endian F32 tensors as host floats; big-endian hosts need byte swapping"
#endif

/* ---- object ----------------------------------------------------------------------------------- */

/* Limits on the configuration, far above any real model, so that sizes never overflow. */
#define CB_MAX_LAYER 4096
#define CB_MAX_HEAD_KV 4096
#define CB_MAX_HEAD_DIM 65536
/* Ranges of the stored floats (finite but absurd values load and then overflow or degrade the
 * cache silently). Smoothing factors lambda = sqrt(max |k - mu|): keys within float16's range give
 * lambda <= sqrt(2 * 65504) ~ 362, and calibration floors it at 1e-2; [2^-20, 2^20] leaves wide
 * margins on both sides. Centroids and key means: a vector in float16's range rotated by a
 * normalized Hadamard transform of up to 1024 dims has components up to 65504 * sqrt(1024) ~ 2^21. */
#define CB_SMOOTH_MIN 0x1p-20
#define CB_SMOOTH_MAX 0x1p20
#define CB_MAX_ABS 0x1p21

/* Metadata keys derived from the params (read-only through set_meta), in the order written. */
enum { CB_N_CONFIG_MAX = 17, CB_CONFIG_STAGES = 13, CB_CONFIG_ROPE = 15 };
static const char *const cb_config_keys[CB_N_CONFIG_MAX] = {
    "kvpq.format_version", "n_layer", "n_head_kv", "head_dim", "k.M", "k.nbits",
    "k.granularity",       "v.M",     "v.nbits",   "v.granularity", "v.rotate", "k.norm", "v.norm",
    /* version 4, written only with key_stages = 2: */
    "k.stages",            "k2.M",
    /* version 5, written only with key_rope_dims > 0: */
    "k.rope_dims",         "k.rope",
};

/* Tensor kinds of one layer, in file order. */
enum { CB_K_SMOOTH = 0, CB_K_BOOK = 1, CB_V_BOOK = 2, CB_K_MEAN = 3, CB_K_BOOK2 = 4, CB_K_ROPE = 5, CB_N_KIND = 6 };
static const char *const cb_kind_names[CB_N_KIND] = {"k.smooth", "k.codebook", "v.codebook", "k.mean",
                                                     "k.codebook2", "k.rope_freq"};
/* Format version 1 files hold the first three kinds (no key mean: mu = 0); versions 2-3 the first
 * four; version 4 adds k.codebook2 in a codebook with two key stages; version 5 k.rope_freq in a
 * codebook with key_rope_dims > 0. */
#define CB_N_KIND_V1 3

struct kvpq_codebook {
    kvpq_codebook_params p;
    kvpq_pq **pq;       /* (n_layer, 2): [2*i] key quantizer, [2*i + 1] value quantizer */
    kvpq_pq **pq2;      /* (n_layer) key stage-two quantizers (key_stages = 2), else NULL */
    int n_config;       /* config metadata entries: the cb_config_keys the params use (meta_put_config) */
    int *layer_M;       /* (n_layer, 3) each layer's key [3*i] and value [3*i + 1] M (p.key.M / p.value.M
                         * unless set_layer_key_M / set_layer_value_M changed it) and key stages
                         * [3*i + 2] (p.key_stages unless set_layer_key_stages changed it) */
    float *smooth;      /* (n_layer, n_head_kv, head_dim) key smoothing factors lambda */
    float *mean;        /* (n_layer, n_head_kv, head_dim) per-channel key mean mu */
    float *rope_freq;   /* (n_layer, key_rope_dims / 2) RoPE inv_freq of keys coded before RoPE; NULL without */
    size_t n_meta, cap_meta;
    char **meta_key;    /* (n_meta); the first CB_N_CONFIG entries are cb_config_keys, then the
                         * k.M.{i} of the layers whose key M differs from k.M, in layer order, then
                         * likewise v.M.{i} */
    char **meta_val;    /* (n_meta) */
};

kvpq_codebook_params kvpq_codebook_params_default(void) {
    /* SmolLM2-135M: 30 layers, 3 KV heads of 64 dims; d4b8 (2 bits per element) for K and V. */
    kvpq_codebook_params p = {.n_layer = 30, .n_head_kv = 3, .head_dim = 64, .value_rotate = 0};
    p.key = kvpq_pq_params_default();
    p.value = kvpq_pq_params_default();
    p.key.d = p.value.d = p.head_dim;
    return p;
}

static const char *granularity_name(kvpq_codebook_granularity g) {
    return g == KVPQ_CODEBOOK_SUBSPACE ? "subspace" : g == KVPQ_CODEBOOK_HEAD ? "head" : "shared";
}

/* The params as a codebook holds them: HEAD quantizers get n_head = n_head_kv (others 0), one key
 * stage is key_stages = 1 with key2 = key, stage two takes key's nbits and granularity fields. */
static kvpq_codebook_params params_normalize(const kvpq_codebook_params *in) {
    kvpq_codebook_params p = *in;
    kvpq_pq_params *q[2] = {&p.key, &p.value};
    for (int v = 0; v < 2; v++) q[v]->n_head = q[v]->granularity == KVPQ_CODEBOOK_HEAD ? p.n_head_kv : 0;
    if (p.key_stages <= 1) {
        p.key_stages = 1;
        p.key2 = p.key;
    } else {
        p.key2.n_head = p.key2.granularity == KVPQ_CODEBOOK_HEAD ? p.n_head_kv : 0;
    }
    return p;
}

/* The format version a codebook of these params is written as: the oldest that holds its features
 * (5: keys before RoPE; 4: head granularity or two key stages; else 3). */
static const char *params_version(const kvpq_codebook_params *p) {
    if (p->key_rope_dims > 0) return KVPQ_CODEBOOK_FORMAT_VERSION;
    if (p->key.granularity == KVPQ_CODEBOOK_HEAD || p->value.granularity == KVPQ_CODEBOOK_HEAD || p->key_stages == 2)
        return KVPQ_CODEBOOK_FORMAT_VERSION_V4;
    return KVPQ_CODEBOOK_FORMAT_VERSION_PLAIN;
}

/* Whether config key i (cb_config_keys) is written for these params. */
static int config_key_used(const kvpq_codebook_params *p, int i) {
    if (i >= CB_CONFIG_ROPE) return p->key_rope_dims > 0;
    if (i >= CB_CONFIG_STAGES) return p->key_stages == 2;
    return 1;
}

static kvpq_status params_check(const kvpq_codebook_params *p) {
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook params: NULL");
    if (p->n_layer < 1 || p->n_layer > CB_MAX_LAYER)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook n_layer=%d: expected 1..%d", p->n_layer, CB_MAX_LAYER);
    if (p->n_head_kv < 1 || p->n_head_kv > CB_MAX_HEAD_KV)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook n_head_kv=%d: expected 1..%d", p->n_head_kv,
                         CB_MAX_HEAD_KV);
    if (p->head_dim < 1 || p->head_dim > CB_MAX_HEAD_DIM || (p->head_dim & (p->head_dim - 1)))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                         "codebook head_dim=%d: expected a power of two up to %d (keys are rotated by a "
                         "Walsh-Hadamard transform)", p->head_dim, CB_MAX_HEAD_DIM);
    const kvpq_pq_params *pp[2] = {&p->key, &p->value};
    for (int v = 0; v < 2; v++) {
        const char *what = v ? "value" : "key";
        if (pp[v]->d != p->head_dim)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook %s.d=%d: expected head_dim=%d", what, pp[v]->d,
                             p->head_dim);
        kvpq_status s = kvpq__pq_params_check(pp[v]);
        if (s != KVPQ_OK) {
            kvpq__err_prefix("codebook %s quantizer", what);
            return s;
        }
    }
    if (p->value_rotate != 0 && p->value_rotate != 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook value_rotate=%d: expected 0 or 1", p->value_rotate);
    if (p->key_norm != 0 && p->key_norm != 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook key_norm=%d: expected 0 or 1", p->key_norm);
    if (p->value_norm != 0 && p->value_norm != 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook value_norm=%d: expected 0 or 1", p->value_norm);
    if (p->key_stages < 0 || p->key_stages > 2)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook key_stages=%d: expected 1 or 2", p->key_stages);
    if (p->key_rope_dims < 0 || p->key_rope_dims % 2 || p->key_rope_dims > p->head_dim)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook key_rope_dims=%d: expected an even number in [0, head_dim=%d]",
                         p->key_rope_dims, p->head_dim);
    if (p->key_rope_neox != 0 && p->key_rope_neox != 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook key_rope_neox=%d: expected 0 or 1", p->key_rope_neox);
    if (p->key_stages == 2) {
        if (p->key2.d != p->head_dim)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook key2.d=%d: expected head_dim=%d", p->key2.d, p->head_dim);
        if (p->key2.nbits != p->key.nbits || p->key2.granularity != p->key.granularity)
            return kvpq__err(KVPQ_ERR_INVALID_ARG,
                             "codebook key2 (stage two): nbits=%d granularity=%d, expected key's nbits=%d "
                             "granularity=%d (the cache adds the two stages' tables as one)",
                             p->key2.nbits, (int)p->key2.granularity, p->key.nbits, (int)p->key.granularity);
        kvpq_pq_params q = p->key2;
        if (q.granularity == KVPQ_CODEBOOK_HEAD) q.n_head = p->n_head_kv;
        kvpq_status s = kvpq__pq_params_check(&q);
        if (s != KVPQ_OK) {
            kvpq__err_prefix("codebook key2 (stage two) quantizer");
            return s;
        }
    }
    return KVPQ_OK;
}

/* 1 if s is valid UTF-8 (no overlong forms, no surrogates, at most U+10FFFF). JSON text must be. */
static int utf8_valid(const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s;
        int n;
        unsigned cp, min;
        if (c < 0x80) { s++; continue; }
        if ((c & 0xE0) == 0xC0) { n = 1; cp = c & 0x1F; min = 0x80; }
        else if ((c & 0xF0) == 0xE0) { n = 2; cp = c & 0x0F; min = 0x800; }
        else if ((c & 0xF8) == 0xF0) { n = 3; cp = c & 0x07; min = 0x10000; }
        else return 0;
        for (int i = 1; i <= n; i++) {
            if ((s[i] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        s += n + 1;
    }
    return 1;
}

static char *str_dup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

/* Append or replace an entry, without checks. */
static kvpq_status meta_put(kvpq_codebook *cb, const char *key, const char *value) {
    for (size_t i = 0; i < cb->n_meta; i++) {
        if (strcmp(cb->meta_key[i], key)) continue;
        char *v = str_dup(value);
        if (!v) return kvpq__err(KVPQ_ERR_NOMEM, "codebook metadata: out of memory");
        free(cb->meta_val[i]);
        cb->meta_val[i] = v;
        return KVPQ_OK;
    }
    if (cb->n_meta == cb->cap_meta) {
        size_t cap = cb->cap_meta ? 2 * cb->cap_meta : 16;
        char **k = realloc(cb->meta_key, cap * sizeof *k);
        if (!k) return kvpq__err(KVPQ_ERR_NOMEM, "codebook metadata: out of memory");
        cb->meta_key = k;
        char **v = realloc(cb->meta_val, cap * sizeof *v);
        if (!v) return kvpq__err(KVPQ_ERR_NOMEM, "codebook metadata: out of memory");
        cb->meta_val = v;
        cb->cap_meta = cap;
    }
    char *k = str_dup(key), *v = str_dup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return kvpq__err(KVPQ_ERR_NOMEM, "codebook metadata: out of memory");
    }
    cb->meta_key[cb->n_meta] = k;
    cb->meta_val[cb->n_meta] = v;
    cb->n_meta++;
    return KVPQ_OK;
}

/* Per-layer entries: key / value M "k.M.{i}" / "v.M.{i}", key stages "k.stages.{i}"; every key with
 * these prefixes is reserved. */
static const char *const cb_layer_m_prefix[3] = {"k.M.", "v.M.", "k.stages."};
static const int cb_layer_m_prefix_len[3] = {4, 4, 9};

/* 0 (key M), 1 (value M) or 2 (key stages) when key starts with that per-layer prefix, else -1. */
static int layer_m_kind(const char *key) {
    for (int v = 0; v < 3; v++)
        if (!strncmp(key, cb_layer_m_prefix[v], (size_t)cb_layer_m_prefix_len[v])) return v;
    return -1;
}
static int is_layer_m_key(const char *key) { return layer_m_kind(key) >= 0; }

/* The file-wide value of per-layer entry kind w (k.M, v.M, k.stages). */
static int default_M(const kvpq_codebook_params *p, int w) {
    return w == 2 ? p->key_stages : w ? p->value.M : p->key.M;
}

static int is_config_key(const char *key) {
    if (is_layer_m_key(key)) return 1;
    for (int i = 0; i < CB_N_CONFIG_MAX; i++)
        if (!strcmp(key, cb_config_keys[i])) return 1;
    return 0;
}

/* Rewrite the k.M.{i}, v.M.{i} and k.stages.{i} entries from cb->layer_M (the layers differing from
 * k.M / v.M / k.stages, in layer order, key M then value M then stages, right after the config
 * keys). All or nothing: on NOMEM the metadata is unchanged. */
static kvpq_status meta_sync_layer_m(kvpq_codebook *cb) {
    size_t n_keep = 0, n_new = 0;
    for (size_t i = 0; i < cb->n_meta; i++) n_keep += !is_layer_m_key(cb->meta_key[i]);
    for (int l = 0; l < 3 * cb->p.n_layer; l++) n_new += cb->layer_M[l] != default_M(&cb->p, l % 3);
    size_t n = n_keep + n_new, cap = n > 16 ? n : 16;
    char **k = calloc(cap, sizeof *k), **v = calloc(cap, sizeof *v);
    int ok = k && v;
    size_t o = 0;
    for (size_t i = 0; ok && i < cb->n_meta && i < (size_t)cb->n_config; i++, o++) {
        k[o] = cb->meta_key[i];
        v[o] = cb->meta_val[i];
    }
    size_t first_new = o;
    for (int w = 0; w < 3; w++)
    for (int l = 0; ok && l < cb->p.n_layer; l++) {
        const int M = cb->layer_M[3 * l + w];
        if (M == default_M(&cb->p, w)) continue;
        char kb[32], vb[16];
        snprintf(kb, sizeof kb, "%s%d", cb_layer_m_prefix[w], l);
        snprintf(vb, sizeof vb, "%d", M);
        k[o] = str_dup(kb);
        v[o] = str_dup(vb);
        ok = k[o] && v[o];
        o++;
    }
    if (!ok) {
        if (k && v)
            for (size_t i = first_new; i < o; i++) {
                free(k[i]);
                free(v[i]);
            }
        free(k);
        free(v);
        return kvpq__err(KVPQ_ERR_NOMEM, "codebook metadata: out of memory");
    }
    for (size_t i = (size_t)cb->n_config; i < cb->n_meta; i++) {
        if (is_layer_m_key(cb->meta_key[i])) {
            free(cb->meta_key[i]);
            free(cb->meta_val[i]);
            continue;
        }
        k[o] = cb->meta_key[i];
        v[o] = cb->meta_val[i];
        o++;
    }
    free(cb->meta_key);
    free(cb->meta_val);
    cb->meta_key = k;
    cb->meta_val = v;
    cb->n_meta = o;
    cb->cap_meta = cap;
    return KVPQ_OK;
}

static kvpq_status meta_put_config(kvpq_codebook *cb) {
    const kvpq_codebook_params *p = &cb->p;
    char v[CB_N_CONFIG_MAX][32];
    snprintf(v[0], sizeof v[0], "%s", params_version(p));
    snprintf(v[1], sizeof v[1], "%d", p->n_layer);
    snprintf(v[2], sizeof v[2], "%d", p->n_head_kv);
    snprintf(v[3], sizeof v[3], "%d", p->head_dim);
    snprintf(v[4], sizeof v[4], "%d", p->key.M);
    snprintf(v[5], sizeof v[5], "%d", p->key.nbits);
    snprintf(v[6], sizeof v[6], "%s", granularity_name(p->key.granularity));
    snprintf(v[7], sizeof v[7], "%d", p->value.M);
    snprintf(v[8], sizeof v[8], "%d", p->value.nbits);
    snprintf(v[9], sizeof v[9], "%s", granularity_name(p->value.granularity));
    snprintf(v[10], sizeof v[10], "%d", p->value_rotate);
    snprintf(v[11], sizeof v[11], "%d", p->key_norm);
    snprintf(v[12], sizeof v[12], "%d", p->value_norm);
    snprintf(v[13], sizeof v[13], "%d", p->key_stages);
    snprintf(v[14], sizeof v[14], "%d", p->key2.M);
    snprintf(v[15], sizeof v[15], "%d", p->key_rope_dims);
    snprintf(v[16], sizeof v[16], "%s", p->key_rope_neox ? "neox" : "norm");
    cb->n_config = 0;
    for (int i = 0; i < CB_N_CONFIG_MAX; i++)
        if (config_key_used(p, i)) {
            KVPQ_TRY(meta_put(cb, cb_config_keys[i], v[i]));
            cb->n_config++;
        }
    return KVPQ_OK;
}

kvpq_status kvpq_codebook_new(kvpq_codebook **out, const kvpq_codebook_params *p) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_new: out is NULL");
    *out = NULL;
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook params: NULL");
    const kvpq_codebook_params np = params_normalize(p);
    KVPQ_TRY(params_check(&np));
    p = &np;
    kvpq_codebook *cb = calloc(1, sizeof *cb);
    if (!cb) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_codebook_new: out of memory");
    cb->p = *p;
    size_t n_smooth = (size_t)p->n_layer * p->n_head_kv * p->head_dim;
    cb->pq = calloc((size_t)2 * p->n_layer, sizeof *cb->pq);
    cb->pq2 = calloc((size_t)p->n_layer, sizeof *cb->pq2);
    cb->layer_M = malloc((size_t)3 * p->n_layer * sizeof *cb->layer_M);
    cb->smooth = malloc(n_smooth * sizeof(float));
    cb->mean = calloc(n_smooth, sizeof(float)); /* mu = 0: no centering until trained */
    if (p->key_rope_dims > 0) /* inv_freq 0: no rotation until set */
        cb->rope_freq = calloc((size_t)p->n_layer * (p->key_rope_dims / 2), sizeof(float));
    if (!cb->pq || !cb->pq2 || !cb->layer_M || !cb->smooth || !cb->mean || (p->key_rope_dims > 0 && !cb->rope_freq)) {
        kvpq_codebook_free(cb);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_codebook_new: out of memory for %d layers", p->n_layer);
    }
    /* lambda = 1 is the identity smoothing until trained factors are stored. */
    for (size_t i = 0; i < n_smooth; i++) cb->smooth[i] = 1.0f;
    for (int l = 0; l < p->n_layer; l++) {
        cb->layer_M[3 * l] = p->key.M;
        cb->layer_M[3 * l + 1] = p->value.M;
        cb->layer_M[3 * l + 2] = p->key_stages;
    }
    kvpq_status s = KVPQ_OK;
    for (int i = 0; i < 2 * p->n_layer; i++) {
        if ((s = kvpq_pq_new(&cb->pq[i], (i & 1) ? &p->value : &p->key)) != KVPQ_OK) goto fail;
        cb->pq[i]->norm_explicit = (i & 1) ? p->value_norm : p->key_norm;
        cb->pq[i]->stage2 = !(i & 1) && p->key_stages == 2;
    }
    for (int l = 0; p->key_stages == 2 && l < p->n_layer; l++) {
        if ((s = kvpq_pq_new(&cb->pq2[l], &p->key2)) != KVPQ_OK) goto fail;
        cb->pq2[l]->norm_explicit = p->key_norm;
    }
    if ((s = meta_put_config(cb)) != KVPQ_OK) goto fail;
    *out = cb;
    return KVPQ_OK;
fail:
    kvpq_codebook_free(cb);
    return s;
}

void kvpq_codebook_free(kvpq_codebook *cb) {
    if (!cb) return;
    if (cb->pq)
        for (int i = 0; i < 2 * cb->p.n_layer; i++) kvpq_pq_free(cb->pq[i]);
    if (cb->pq2)
        for (int i = 0; i < cb->p.n_layer; i++) kvpq_pq_free(cb->pq2[i]);
    free(cb->pq);
    free(cb->pq2);
    free(cb->layer_M);
    free(cb->smooth);
    free(cb->mean);
    free(cb->rope_freq);
    for (size_t i = 0; i < cb->n_meta; i++) {
        free(cb->meta_key[i]);
        free(cb->meta_val[i]);
    }
    free(cb->meta_key);
    free(cb->meta_val);
    free(cb);
}

kvpq_codebook_params kvpq_codebook_get_params(const kvpq_codebook *cb) { return cb->p; }

kvpq_pq *kvpq_codebook_pq(kvpq_codebook *cb, int layer, int is_value) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->pq[2 * layer + (is_value ? 1 : 0)];
}

const kvpq_pq *kvpq_codebook_pq_const(const kvpq_codebook *cb, int layer, int is_value) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->pq[2 * layer + (is_value ? 1 : 0)];
}

/* A layer's key (is_value 0) or value (1) quantizer params with M replaced: checked (M divides
 * head_dim, dsub allowed). */
static kvpq_status layer_params(const kvpq_codebook_params *p, int layer, int is_value, int M, kvpq_pq_params *q) {
    const char *what = is_value ? "value" : "key";
    *q = is_value ? p->value : p->key;
    q->M = M;
    if (M < 1 || M > p->head_dim || p->head_dim % M)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook layer %d %s M=%d: expected a divisor of head_dim=%d",
                         layer, what, M, p->head_dim);
    kvpq_status s = kvpq__pq_params_check(q);
    if (s != KVPQ_OK) kvpq__err_prefix("codebook layer %d %s M=%d", layer, what, M);
    return s;
}

/* cb is not NULL and layer is one of its layers, else KVPQ_ERR_INVALID_ARG (fn: the caller). */
static kvpq_status check_layer(const kvpq_codebook *cb, int layer, const char *fn) {
    if (!cb) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: cb is NULL", fn);
    if (layer < 0 || layer >= cb->p.n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: layer %d out of range [0, %d)", fn, layer, cb->p.n_layer);
    return KVPQ_OK;
}

/* layer_M[im] = v (a layer's key M, value M or key stages) and the metadata that lists them; on
 * failure both are left as they were. */
static kvpq_status set_layer_entry(kvpq_codebook *cb, int im, int v) {
    const int old = cb->layer_M[im];
    cb->layer_M[im] = v;
    kvpq_status s = meta_sync_layer_m(cb);
    if (s != KVPQ_OK) cb->layer_M[im] = old;
    return s;
}

static kvpq_status set_layer_M(kvpq_codebook *cb, int layer, int is_value, int M, const char *fn) {
    KVPQ_TRY(check_layer(cb, layer, fn));
    kvpq_pq_params q;
    KVPQ_TRY(layer_params(&cb->p, layer, is_value, M, &q));
    kvpq_pq *pq;
    KVPQ_TRY(kvpq_pq_new(&pq, &q));
    const int i = 2 * layer + is_value;
    kvpq_status s = set_layer_entry(cb, 3 * layer + is_value, M);
    if (s != KVPQ_OK) {
        kvpq_pq_free(pq);
        return s;
    }
    pq->norm_explicit = is_value ? cb->p.value_norm : cb->p.key_norm;
    pq->stage2 = !is_value && cb->pq2[layer] != NULL;
    kvpq_pq_free(cb->pq[i]);
    cb->pq[i] = pq;
    return KVPQ_OK;
}

kvpq_status kvpq_codebook_set_layer_key_M(kvpq_codebook *cb, int layer, int M) {
    return set_layer_M(cb, layer, 0, M, "kvpq_codebook_set_layer_key_M");
}

kvpq_status kvpq_codebook_set_layer_value_M(kvpq_codebook *cb, int layer, int M) {
    return set_layer_M(cb, layer, 1, M, "kvpq_codebook_set_layer_value_M");
}

kvpq_pq *kvpq_codebook_key_pq2(kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->pq2[layer];
}

const kvpq_pq *kvpq_codebook_key_pq2_const(const kvpq_codebook *cb, int layer) {
    return kvpq_codebook_key_pq2((kvpq_codebook *)cb, layer);
}

int kvpq_codebook_layer_key_M(const kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return 0;
    return cb->layer_M[3 * layer];
}

int kvpq_codebook_layer_value_M(const kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return 0;
    return cb->layer_M[3 * layer + 1];
}

kvpq_status kvpq_codebook_set_layer_key_stages(kvpq_codebook *cb, int layer, int stages) {
    const char *fn = "kvpq_codebook_set_layer_key_stages";
    KVPQ_TRY(check_layer(cb, layer, fn));
    if (stages != 1 && stages != 2) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: stages=%d: expected 1 or 2", fn, stages);
    if (stages == 2 && cb->p.key_stages != 2)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: layer %d: stages=2 needs a codebook made with key_stages=2 (its "
                         "key2 params)", fn, layer);
    const int im = 3 * layer + 2;
    if (cb->layer_M[im] == stages) return KVPQ_OK;
    kvpq_pq *pq2 = NULL;
    if (stages == 2) {
        KVPQ_TRY(kvpq_pq_new(&pq2, &cb->p.key2));
        pq2->norm_explicit = cb->p.key_norm;
    }
    kvpq_status s = set_layer_entry(cb, im, stages);
    if (s != KVPQ_OK) {
        kvpq_pq_free(pq2);
        return s;
    }
    kvpq_pq_free(cb->pq2[layer]);
    cb->pq2[layer] = pq2;
    cb->pq[2 * layer]->stage2 = stages == 2;
    return KVPQ_OK;
}

int kvpq_codebook_layer_key_stages(const kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return 0;
    return cb->layer_M[3 * layer + 2];
}

int kvpq_codebook_layer_scale_bits(const kvpq_codebook *cb, int layer, int is_value) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return -1;
    int bytes = 0;
    return kvpq__codebook_scale_bytes(cb, layer, is_value != 0, &bytes) == KVPQ_OK ? 8 * bytes : -1;
}

float *kvpq_codebook_key_smooth(kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->smooth + (size_t)layer * cb->p.n_head_kv * cb->p.head_dim;
}

const float *kvpq_codebook_key_smooth_const(const kvpq_codebook *cb, int layer) {
    return kvpq_codebook_key_smooth((kvpq_codebook *)cb, layer);
}

float *kvpq_codebook_key_mean(kvpq_codebook *cb, int layer) {
    if (!cb || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->mean + (size_t)layer * cb->p.n_head_kv * cb->p.head_dim;
}

const float *kvpq_codebook_key_mean_const(const kvpq_codebook *cb, int layer) {
    return kvpq_codebook_key_mean((kvpq_codebook *)cb, layer);
}

float *kvpq_codebook_key_rope_freq(kvpq_codebook *cb, int layer) {
    if (!cb || !cb->rope_freq || layer < 0 || layer >= cb->p.n_layer) return NULL;
    return cb->rope_freq + (size_t)layer * (cb->p.key_rope_dims / 2);
}

const float *kvpq_codebook_key_rope_freq_const(const kvpq_codebook *cb, int layer) {
    return kvpq_codebook_key_rope_freq((kvpq_codebook *)cb, layer);
}

kvpq_status kvpq__codebook_check_rope(const kvpq_codebook *cb, int layer, const char *who) {
    const float *f = kvpq_codebook_key_rope_freq_const(cb, layer);
    for (int i = 0; f && i < cb->p.key_rope_dims / 2; i++)
        if (!(f[i] >= 0.0f) || !isfinite(f[i]))
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: codebook layer %d RoPE frequency %d = %g: must be finite and >= 0",
                             who, layer, i, (double)f[i]);
    return KVPQ_OK;
}

const float *kvpq__codebook_layer_rope(const kvpq_codebook *cb, int layer) {
    const float *f = kvpq_codebook_key_rope_freq_const(cb, layer);
    for (int i = 0; f && i < cb->p.key_rope_dims / 2; i++)
        if (f[i] != 0.0f) return f;
    return NULL;
}

/* A value k.norm_bits / v.norm_bits may hold (kvpq__codebook_scale_bytes): "8" or "16". */
static int norm_bits_ok(const char *v) { return !strcmp(v, "8") || !strcmp(v, "16"); }

kvpq_status kvpq_codebook_set_meta(kvpq_codebook *cb, const char *key, const char *value) {
    if (!cb || !key || !value) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_set_meta: NULL argument");
    if (!key[0]) return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook metadata: empty key");
    if (is_config_key(key))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook metadata '%s' is derived from the codebook params "
                         "and cannot be set", key);
    if (!utf8_valid(key)) return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook metadata key is not valid UTF-8");
    if ((!strcmp(key, "k.norm_bits") || !strcmp(key, "v.norm_bits")) && !norm_bits_ok(value))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook metadata %s = '%s': expected \"8\" or \"16\"", key, value);
    if (!utf8_valid(value))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "codebook metadata '%s': value is not valid UTF-8", key);
    return meta_put(cb, key, value);
}

const char *kvpq_codebook_get_meta(const kvpq_codebook *cb, const char *key) {
    if (!cb || !key) return NULL;
    for (size_t i = 0; i < cb->n_meta; i++)
        if (!strcmp(cb->meta_key[i], key)) return cb->meta_val[i];
    return NULL;
}

kvpq_status kvpq__codebook_scale_bytes(const kvpq_codebook *cb, int layer, int is_value, int *bytes) {
    const kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    const char *key = is_value ? "v.norm_bits" : "k.norm_bits", *v = kvpq_codebook_get_meta(cb, key);
    *bytes = 0;
    if (v && !norm_bits_ok(v))
        return kvpq__err(KVPQ_ERR_FORMAT, "codebook metadata %s = '%s': expected \"8\" or \"16\"", key, v);
    if (!(is_value ? cp.value_norm : cp.key_norm)) return KVPQ_OK;
    const kvpq_pq *pq = kvpq_codebook_pq_const(cb, layer, is_value);
    const kvpq_pq *pq2 = is_value ? NULL : kvpq_codebook_key_pq2_const(cb, layer);
    /* bits per element of both stages' codes: nbits (M1 + M2) / d <= 4 */
    const long bits = pq ? (long)pq->p.nbits * (pq->p.M + (pq2 ? pq2->p.M : 0)) : 0;
    *bytes = v && !strcmp(v, "8") && pq && bits <= 4L * pq->p.d ? 1 : 2;
    return KVPQ_OK;
}

kvpq_status kvpq__vq_page_layout_of(const kvpq_codebook *cb, int layer, int n_head_kv, int page_tokens, size_t kcs,
                                    size_t vcs, kvpq__vq_page_layout *out) {
    memset(out, 0, sizeof *out);
    for (int kind = 0; kind < 2; kind++) KVPQ_TRY(kvpq__codebook_scale_bytes(cb, layer, kind, &out->sb[kind]));
    const size_t pv = (size_t)n_head_kv * page_tokens;
    size_t o = pv * (kcs + vcs);
    if (out->sb[0] || out->sb[1]) o = (o + 3) / 4 * 4;
    for (int kind = 0; kind < 2; kind++) {
        if (!out->sb[kind]) continue;
        if (out->sb[kind] == 2) o = (o + 1) / 2 * 2; /* float16 scales are read as uint16_t */
        out->scale_off[kind] = o;
        o += pv * (size_t)out->sb[kind];
    }
    const int n8 = (out->sb[0] == 1) + (out->sb[1] == 1);
    if (n8) {
        o = (o + 3) / 4 * 4;
        out->ref_off = o;
        o += (size_t)n8 * n_head_kv * sizeof(float);
    }
    out->page_bytes = o;
    return KVPQ_OK;
}

size_t kvpq_codebook_meta_count(const kvpq_codebook *cb) { return cb ? cb->n_meta : 0; }

const char *kvpq_codebook_meta_key(const kvpq_codebook *cb, size_t i) {
    return cb && i < cb->n_meta ? cb->meta_key[i] : NULL;
}

/* ---- shapes ----------------------------------------------------------------------------------- */

#define CB_MAX_DIMS 8

typedef struct {
    int ndim;
    uint64_t dim[CB_MAX_DIMS];
} cb_shape;

/* Shape of a tensor of `kind`; lm: the layer's key and value M (k.M or its k.M.{i}, v.M or its
 * v.M.{i}). */
static cb_shape tensor_shape(const kvpq_codebook_params *p, int kind, const int *lm) {
    cb_shape s = {0};
    if (kind == CB_K_ROPE) {
        s.ndim = 1;
        s.dim[0] = (uint64_t)(p->key_rope_dims / 2);
        return s;
    }
    if (kind == CB_K_SMOOTH || kind == CB_K_MEAN) {
        s.ndim = 2;
        s.dim[0] = (uint64_t)p->n_head_kv;
        s.dim[1] = (uint64_t)p->head_dim;
        return s;
    }
    const kvpq_pq_params *q = kind == CB_K_BOOK ? &p->key : kind == CB_K_BOOK2 ? &p->key2 : &p->value;
    const int M = kind == CB_K_BOOK ? lm[0] : kind == CB_K_BOOK2 ? p->key2.M : lm[1];
    if (q->granularity == KVPQ_CODEBOOK_SUBSPACE) s.dim[s.ndim++] = (uint64_t)M;
    if (q->granularity == KVPQ_CODEBOOK_HEAD) s.dim[s.ndim++] = (uint64_t)p->n_head_kv;
    s.dim[s.ndim++] = (uint64_t)1 << q->nbits;
    s.dim[s.ndim++] = (uint64_t)(q->d / M);
    return s;
}

static size_t shape_numel(const cb_shape *s) {
    size_t n = 1;
    for (int i = 0; i < s->ndim; i++) n *= (size_t)s->dim[i];
    return n;
}

static void shape_str(const cb_shape *s, char *buf, size_t cap) {
    size_t o = 0;
    o += (size_t)snprintf(buf + o, cap - o, "[");
    for (int i = 0; i < s->ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, "%s%llu", i ? "," : "", (unsigned long long)s->dim[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
}

/* Tensor data of (layer, kind): the borrowed floats and their count. */
static float *tensor_data(const kvpq_codebook *cb, int layer, int kind, size_t *n) {
    if (kind == CB_K_ROPE) {
        *n = (size_t)cb->p.key_rope_dims / 2;
        return cb->rope_freq + (size_t)layer * *n;
    }
    if (kind == CB_K_SMOOTH || kind == CB_K_MEAN) {
        *n = (size_t)cb->p.n_head_kv * cb->p.head_dim;
        return (kind == CB_K_SMOOTH ? cb->smooth : cb->mean) + (size_t)layer * *n;
    }
    kvpq_pq *pq = kind == CB_K_BOOK2 ? cb->pq2[layer] : cb->pq[2 * layer + (kind == CB_V_BOOK)];
    *n = kvpq_pq_centroids_size(pq);
    return pq->centroids;
}

/* Check one tensor's floats: finite everywhere, and positive for smoothing factors (they divide
 * the keys). `name` names it in the message. */
static kvpq_status check_values(const float *x, size_t n, int kind, const char *name) {
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]))
            return kvpq__err(KVPQ_ERR_NONFINITE, "tensor %s element %zu is %s", name, i,
                             isnan(x[i]) ? "NaN" : "Inf");
        if (kind == CB_K_SMOOTH && !(x[i] > 0))
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s element %zu is %g: smoothing factors must be positive",
                             name, i, (double)x[i]);
        if (kind == CB_K_SMOOTH && !(x[i] >= CB_SMOOTH_MIN && x[i] <= CB_SMOOTH_MAX))
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s element %zu is %g: smoothing factors must lie in [%g, %g]",
                             name, i, (double)x[i], CB_SMOOTH_MIN, CB_SMOOTH_MAX);
        if (kind == CB_K_ROPE && !(x[i] >= 0))
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s element %zu is %g: RoPE frequencies must be >= 0", name, i,
                             (double)x[i]);
        if (kind != CB_K_SMOOTH && !(fabsf(x[i]) <= CB_MAX_ABS))
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s element %zu is %g: expected |x| <= %g", name, i, (double)x[i],
                             CB_MAX_ABS);
    }
    return KVPQ_OK;
}

/* Whether layer l holds a tensor of `kind` in the file: stage two only where the layer has it, the
 * RoPE frequencies only with key_rope_dims > 0. */
static int tensor_present(const kvpq_codebook *cb, int l, int kind) {
    if (kind == CB_K_BOOK2) return cb->pq2[l] != NULL;
    if (kind == CB_K_ROPE) return cb->p.key_rope_dims > 0;
    return 1;
}

/* ---- save ------------------------------------------------------------------------------------- */

static int write_all(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The JSON header (unpadded), or NULL (error set). Caller frees with cJSON_free. */
static char *build_header(const kvpq_codebook *cb) {
    cJSON *root = cJSON_CreateObject(), *meta = cJSON_CreateObject();
    if (!root || !meta) goto nomem;
    cJSON_AddItemToObject(root, "__metadata__", meta);
    for (size_t i = 0; i < cb->n_meta; i++)
        if (!cJSON_AddStringToObject(meta, cb->meta_key[i], cb->meta_val[i])) goto nomem_root;
    uint64_t off = 0;
    for (int l = 0; l < cb->p.n_layer; l++) {
        for (int k = 0; k < CB_N_KIND; k++) {
            if (!tensor_present(cb, l, k)) continue;
            char name[64];
            snprintf(name, sizeof name, "layers.%d.%s", l, cb_kind_names[k]);
            cb_shape sh = tensor_shape(&cb->p, k, cb->layer_M + 3 * l);
            uint64_t bytes = (uint64_t)shape_numel(&sh) * sizeof(float);
            cJSON *t = cJSON_AddObjectToObject(root, name);
            cJSON *shape = t ? cJSON_AddArrayToObject(t, "shape") : NULL;
            cJSON *offs = shape ? cJSON_AddArrayToObject(t, "data_offsets") : NULL;
            if (!offs || !cJSON_AddStringToObject(t, "dtype", "F32")) goto nomem_root;
            for (int d = 0; d < sh.ndim; d++) {
                cJSON *n = cJSON_CreateNumber((double)sh.dim[d]);
                if (!n) goto nomem_root;
                cJSON_AddItemToArray(shape, n);
            }
            cJSON *b = cJSON_CreateNumber((double)off), *e = cJSON_CreateNumber((double)(off + bytes));
            if (!b || !e) {
                cJSON_Delete(b);
                cJSON_Delete(e);
                goto nomem_root;
            }
            cJSON_AddItemToArray(offs, b);
            cJSON_AddItemToArray(offs, e);
            off += bytes;
        }
    }
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    if (!json) kvpq__err(KVPQ_ERR_NOMEM, "codebook save: out of memory for the header");
    return json;
nomem:
    cJSON_Delete(meta);
nomem_root:
    cJSON_Delete(root);
    kvpq__err(KVPQ_ERR_NOMEM, "codebook save: out of memory for the header");
    return NULL;
}

kvpq_status kvpq_codebook_save(const kvpq_codebook *cb, const char *path) {
    if (!cb || !path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_save: NULL argument");
    /* Never write a file that load would reject. */
    for (int l = 0; l < cb->p.n_layer; l++)
        for (int k = 0; k < CB_N_KIND; k++) {
            if (!tensor_present(cb, l, k)) continue;
            char name[64];
            size_t n;
            snprintf(name, sizeof name, "layers.%d.%s", l, cb_kind_names[k]);
            const float *x = tensor_data(cb, l, k, &n);
            kvpq_status s = check_values(x, n, k, name);
            if (s != KVPQ_OK) {
                kvpq__err_prefix("codebook save '%s'", path);
                return s == KVPQ_ERR_FORMAT ? KVPQ_ERR_INVALID_ARG : s;
            }
        }
    char *json = build_header(cb);
    if (!json) return KVPQ_ERR_NOMEM;
    size_t hl = strlen(json);
    size_t pad = (8 - (8 + hl) % 8) % 8; /* data section starts 8-byte aligned */
    uint64_t n_header = hl + pad;
    uint8_t len_le[8];
    for (int i = 0; i < 8; i++) len_le[i] = (uint8_t)(n_header >> (8 * i));

    /* Saving to a symbolic link replaces the file it names (rename would replace the link), and
     * the temp file goes beside that file, on its file system. */
    char *target = kvpq__resolve_target(path);
    char *tmp = target ? kvpq__temp_name(target) : NULL;
    if (!tmp) {
        free(target);
        cJSON_free(json);
        return kvpq__err(KVPQ_ERR_NOMEM, "codebook save: out of memory");
    }
    struct stat st;
    if (lstat(target, &st) == 0 && !S_ISREG(st.st_mode)) { /* never rename over a directory or /dev/null */
        free(tmp);
        free(target);
        cJSON_free(json);
        return kvpq__err(KVPQ_ERR_IO, "codebook save '%s': not a regular file (any existing file is unchanged)",
                         path);
    }
    int fd = kvpq__temp_create(tmp);
    if (fd < 0) {
        kvpq_status s = kvpq__err(KVPQ_ERR_IO, "codebook save '%s': cannot create a temporary file beside it: %s",
                                  path, strerror(errno));
        free(tmp);
        free(target);
        cJSON_free(json);
        return s;
    }
    int ok = fchmod(fd, 0644) == 0 && write_all(fd, len_le, 8) == 0 && write_all(fd, json, hl) == 0 &&
             write_all(fd, "        ", pad) == 0;
    cJSON_free(json);
    for (int l = 0; ok && l < cb->p.n_layer; l++)
        for (int k = 0; ok && k < CB_N_KIND; k++) {
            if (!tensor_present(cb, l, k)) continue;
            size_t n;
            const float *x = tensor_data(cb, l, k, &n);
            ok = write_all(fd, x, n * sizeof(float)) == 0;
        }
    int err = ok ? 0 : errno;
    if (ok && fsync(fd) != 0) ok = 0, err = errno;
    if (close(fd) != 0 && ok) ok = 0, err = errno;
    if (ok && rename(tmp, target) != 0) ok = 0, err = errno;
    kvpq__temp_done(tmp, ok);
    free(tmp);
    free(target);
    if (!ok)
        return kvpq__err(KVPQ_ERR_IO, "codebook save '%s': %s (any existing file is unchanged)", path,
                         strerror(err ? err : EIO));
    return KVPQ_OK;
}

/* ---- load ------------------------------------------------------------------------------------- */

/* A JSON number that is an exact non-negative integer below 2^53 (exactly representable). */
static int json_u64(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j)) return 0;
    double d = j->valuedouble;
    if (!(d >= 0 && d <= 9007199254740992.0) || d != (double)(uint64_t)d) return 0;
    *out = (uint64_t)d;
    return 1;
}

/* Strict decimal: digits only, no sign, no leading zero (so it prints back identically). */
static int parse_dec(const char *s, long lo, long hi, int *out) {
    if (!s[0] || strlen(s) > 9 || (s[0] == '0' && s[1])) return 0;
    long v = 0;
    for (const char *c = s; *c; c++) {
        if (*c < '0' || *c > '9') return 0;
        v = v * 10 + (*c - '0');
    }
    if (v < lo || v > hi) return 0;
    *out = (int)v;
    return 1;
}

static kvpq_status meta_int(const cJSON *meta, const char *key, long lo, long hi, int *out) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(meta, key);
    if (!j) return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s is missing", key);
    if (!parse_dec(j->valuestring, lo, hi, out))
        return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s='%.64s': expected an integer in [%ld, %ld]", key,
                         j->valuestring, lo, hi);
    return KVPQ_OK;
}

static kvpq_status meta_granularity(const cJSON *meta, const char *key, kvpq_codebook_granularity *g) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(meta, key);
    if (!j) return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s is missing", key);
    if (!strcmp(j->valuestring, "shared")) *g = KVPQ_CODEBOOK_SHARED;
    else if (!strcmp(j->valuestring, "subspace")) *g = KVPQ_CODEBOOK_SUBSPACE;
    else if (!strcmp(j->valuestring, "head")) *g = KVPQ_CODEBOOK_HEAD;
    else return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s='%.64s': expected shared, subspace or head", key, j->valuestring);
    return KVPQ_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Version 5's k.rope_dims and k.rope (keys coded before RoPE) into p; absent: 0 (keys as given). */
static kvpq_status read_rope_config(const cJSON *meta, int version, kvpq_codebook_params *p) {
    const cJSON *dims = cJSON_GetObjectItemCaseSensitive(meta, "k.rope_dims");
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(meta, "k.rope");
    if (!dims && !mode) return KVPQ_OK;
    if (version < 5)
        return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.rope_dims / k.rope appear in a version %d file (added in version 5)",
                         version);
    if (!dims || !mode) return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.rope_dims and k.rope appear only together");
    KVPQ_TRY(meta_int(meta, "k.rope_dims", 2, CB_MAX_HEAD_DIM, &p->key_rope_dims));
    if (!strcmp(mode->valuestring, "norm") || !strcmp(mode->valuestring, "neox"))
        p->key_rope_neox = !strcmp(mode->valuestring, "neox");
    else
        return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.rope='%.64s': expected norm or neox", mode->valuestring);
    return KVPQ_OK;
}

/* Validate __metadata__ (an object of strings, no duplicate keys) and read the params from it. */
static kvpq_status read_config(const cJSON *meta, kvpq_codebook_params *p, int *version) {
    if (!cJSON_IsObject(meta))
        return kvpq__err(KVPQ_ERR_FORMAT, "header has no __metadata__ object (not a kvpq codebook file)");
    size_t n = 0;
    for (const cJSON *j = meta->child; j; j = j->next) {
        if (!cJSON_IsString(j) || !j->valuestring)
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata '%.64s' is not a string", j->string);
        n++;
    }
    if (n > 1) {
        const char **keys = malloc(n * sizeof *keys);
        if (!keys) return kvpq__err(KVPQ_ERR_NOMEM, "out of memory for %zu metadata keys", n);
        size_t i = 0;
        for (const cJSON *j = meta->child; j; j = j->next) keys[i++] = j->string;
        qsort(keys, n, sizeof *keys, cmp_str_ptr);
        for (i = 1; i < n; i++)
            if (!strcmp(keys[i - 1], keys[i])) {
                kvpq_status s = kvpq__err(KVPQ_ERR_FORMAT, "metadata key '%.64s' appears twice", keys[i]);
                free(keys);
                return s;
            }
        free(keys);
    }
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(meta, "kvpq.format_version");
    if (!ver) return kvpq__err(KVPQ_ERR_FORMAT, "metadata kvpq.format_version is missing (not a kvpq codebook file)");
    if (!strcmp(ver->valuestring, "1")) *version = 1;
    else if (!strcmp(ver->valuestring, "2")) *version = 2;
    else if (!strcmp(ver->valuestring, "3")) *version = 3;
    else if (!strcmp(ver->valuestring, KVPQ_CODEBOOK_FORMAT_VERSION_V4)) *version = 4;
    else if (!strcmp(ver->valuestring, KVPQ_CODEBOOK_FORMAT_VERSION)) *version = 5;
    else
        return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                         "format version '%.32s' is not supported: this build reads versions 1 to %s",
                         ver->valuestring, KVPQ_CODEBOOK_FORMAT_VERSION);
    memset(p, 0, sizeof *p);
    KVPQ_TRY(meta_int(meta, "n_layer", 1, CB_MAX_LAYER, &p->n_layer));
    KVPQ_TRY(meta_int(meta, "n_head_kv", 1, CB_MAX_HEAD_KV, &p->n_head_kv));
    KVPQ_TRY(meta_int(meta, "head_dim", 1, CB_MAX_HEAD_DIM, &p->head_dim));
    KVPQ_TRY(meta_int(meta, "k.M", 1, CB_MAX_HEAD_DIM, &p->key.M));
    KVPQ_TRY(meta_int(meta, "k.nbits", 1, 64, &p->key.nbits));
    KVPQ_TRY(meta_granularity(meta, "k.granularity", &p->key.granularity));
    KVPQ_TRY(meta_int(meta, "v.M", 1, CB_MAX_HEAD_DIM, &p->value.M));
    KVPQ_TRY(meta_int(meta, "v.nbits", 1, 64, &p->value.nbits));
    KVPQ_TRY(meta_granularity(meta, "v.granularity", &p->value.granularity));
    KVPQ_TRY(meta_int(meta, "v.rotate", 0, 1, &p->value_rotate));
    if (*version >= 3) {
        KVPQ_TRY(meta_int(meta, "k.norm", 0, 1, &p->key_norm));
        KVPQ_TRY(meta_int(meta, "v.norm", 0, 1, &p->value_norm));
    } else if (cJSON_GetObjectItemCaseSensitive(meta, "k.norm") || cJSON_GetObjectItemCaseSensitive(meta, "v.norm")) {
        return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.norm / v.norm appear in a version %d file (added in version 3)",
                         *version);
    }
    for (int kind = 0; kind < 2; kind++) { /* 8-bit norm-explicit scales (kvpq__codebook_scale_bytes) */
        const cJSON *j = cJSON_GetObjectItemCaseSensitive(meta, kind ? "v.norm_bits" : "k.norm_bits");
        if (j && !norm_bits_ok(j->valuestring))
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s='%.64s': expected 8 or 16", j->string, j->valuestring);
    }
    p->key_stages = 1;
    if (*version >= 4) {
        if (cJSON_GetObjectItemCaseSensitive(meta, "k.stages"))
            KVPQ_TRY(meta_int(meta, "k.stages", 1, 2, &p->key_stages));
        if (p->key_stages == 2) {
            KVPQ_TRY(meta_int(meta, "k2.M", 1, CB_MAX_HEAD_DIM, &p->key2.M));
            p->key2.nbits = p->key.nbits;
            p->key2.granularity = p->key.granularity;
            p->key2.d = p->head_dim;
        } else if (cJSON_GetObjectItemCaseSensitive(meta, "k2.M")) {
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata k2.M appears without k.stages=2");
        }
    } else {
        if (cJSON_GetObjectItemCaseSensitive(meta, "k.stages") || cJSON_GetObjectItemCaseSensitive(meta, "k2.M"))
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.stages / k2.M appear in a version %d file (added in "
                             "version 4)", *version);
        if (p->key.granularity == KVPQ_CODEBOOK_HEAD || p->value.granularity == KVPQ_CODEBOOK_HEAD)
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata k.granularity / v.granularity 'head' in a version %d file "
                             "(added in version 4)", *version);
    }
    KVPQ_TRY(read_rope_config(meta, *version, p));
    p->key.d = p->value.d = p->head_dim;
    *p = params_normalize(p);
    if (params_check(p) != KVPQ_OK) {
        kvpq__err_prefix("inconsistent metadata");
        return KVPQ_ERR_FORMAT;
    }
    return KVPQ_OK;
}

/* The per-layer M entries k.M.{i} and v.M.{i} of __metadata__ (validated by read_config) into
 * layer_M (n_layer, 2), which starts as k.M / v.M everywhere. Each must name a layer below n_layer
 * in canonical decimal and hold an M that divides head_dim with an allowed dsub (same nbits and
 * granularity). */
static kvpq_status read_layer_m(const cJSON *meta, const kvpq_codebook_params *p, int *layer_M) {
    for (int l = 0; l < p->n_layer; l++) {
        layer_M[3 * l] = p->key.M;
        layer_M[3 * l + 1] = p->value.M;
        layer_M[3 * l + 2] = p->key_stages;
    }
    for (const cJSON *j = meta->child; j; j = j->next) {
        const int w = layer_m_kind(j->string);
        if (w < 0) continue;
        int layer, M;
        if (!parse_dec(j->string + cb_layer_m_prefix_len[w], 0, p->n_layer - 1, &layer))
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata '%.64s': expected %s{layer} with layer in [0, %d]",
                             j->string, cb_layer_m_prefix[w], p->n_layer - 1);
        if (w == 2) { /* k.stages.{i}: "1" drops stage two from a layer of a k.stages=2 file */
            if (p->key_stages != 2 || !parse_dec(j->valuestring, 1, 2, &M))
                return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s='%.64s': expected 1 or 2 in a file with k.stages=2",
                                 j->string, j->valuestring);
            layer_M[3 * layer + 2] = M;
            continue;
        }
        if (!parse_dec(j->valuestring, 1, p->head_dim, &M))
            return kvpq__err(KVPQ_ERR_FORMAT, "metadata %s='%.64s': expected an integer in [1, %d]", j->string,
                             j->valuestring, p->head_dim);
        kvpq_pq_params q;
        if (layer_params(p, layer, w, M, &q) != KVPQ_OK) {
            kvpq__err_prefix("metadata %s", j->string);
            return KVPQ_ERR_FORMAT;
        }
        layer_M[3 * layer + w] = M;
    }
    return KVPQ_OK;
}

/* "layers.{i}.{kind}" with i a canonical decimal: sets layer and kind, or returns 0. */
static int parse_tensor_name(const char *name, int *layer, int *kind) {
    if (strncmp(name, "layers.", 7)) return 0;
    const char *s = name + 7, *dot = strchr(s, '.');
    if (!dot || dot - s > 9) return 0;
    char num[10];
    memcpy(num, s, (size_t)(dot - s));
    num[dot - s] = '\0';
    if (!parse_dec(num, 0, CB_MAX_LAYER, layer)) return 0;
    for (int k = 0; k < CB_N_KIND; k++)
        if (!strcmp(dot + 1, cb_kind_names[k])) {
            *kind = k;
            return 1;
        }
    return 0;
}

typedef struct {
    uint64_t begin, end;
    const cJSON *t;
} cb_range;

static int cmp_range(const void *a, const void *b) {
    const cb_range *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin;
}

/* Check one tensor entry against its expected dtype, shape and the data section; fills r. */
static kvpq_status check_entry(const cJSON *t, const kvpq_codebook_params *p, int layer, int kind, const int *lm,
                               uint64_t data_len, cb_range *r) {
    const char *name = t->string;
    if (!cJSON_IsObject(t)) return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: entry is not a JSON object", name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(t, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(t, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
    if (!cJSON_IsString(dtype) || !dtype->valuestring)
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: dtype is missing or not a string", name);
    if (strcmp(dtype->valuestring, "F32"))
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s has dtype %.16s, expected F32", name, dtype->valuestring);
    cb_shape want = tensor_shape(p, kind, lm), got = {0};
    if (!cJSON_IsArray(shape)) return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: shape is missing or not an array", name);
    int too_many = 0;
    for (const cJSON *d = shape->child; d; d = d->next) {
        uint64_t v;
        if (!json_u64(d, &v))
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: shape holds something other than non-negative integers",
                             name);
        if (got.ndim == CB_MAX_DIMS) too_many = 1;
        else got.dim[got.ndim++] = v;
    }
    int same = !too_many && got.ndim == want.ndim;
    for (int i = 0; same && i < want.ndim; i++) same = got.dim[i] == want.dim[i];
    if (!same) {
        char gs[192], ws[96];
        shape_str(&got, gs, sizeof gs);
        if (too_many) snprintf(gs, sizeof gs, "of more than %d dims", CB_MAX_DIMS);
        shape_str(&want, ws, sizeof ws);
        if (kind == CB_K_BOOK && lm[0] != p->key.M)
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s has shape %s, expected %s (metadata k.M.%d=%d)", name, gs,
                             ws, layer, lm[0]);
        if (kind == CB_V_BOOK && lm[1] != p->value.M)
            return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s has shape %s, expected %s (metadata v.M.%d=%d)", name, gs,
                             ws, layer, lm[1]);
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s has shape %s, expected %s", name, gs, ws);
    }
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || !json_u64(offs->child, &r->begin) ||
        !json_u64(offs->child->next, &r->end))
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: data_offsets is not a pair of non-negative integers", name);
    if (r->begin > r->end || r->end > data_len)
        return kvpq__err(KVPQ_ERR_FORMAT,
                         "tensor %s: data_offsets [%llu,%llu] out of bounds of the %llu-byte data section", name,
                         (unsigned long long)r->begin, (unsigned long long)r->end, (unsigned long long)data_len);
    uint64_t bytes = (uint64_t)shape_numel(&want) * sizeof(float);
    if (r->end - r->begin != bytes)
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: data_offsets [%llu,%llu] span %llu bytes, shape needs %llu",
                         name, (unsigned long long)r->begin, (unsigned long long)r->end,
                         (unsigned long long)(r->end - r->begin), (unsigned long long)bytes);
    r->t = t;
    return KVPQ_OK;
}

static kvpq_status load_header(kvpq_codebook **out, const cJSON *root, const uint8_t *data, uint64_t data_len) {
    if (!cJSON_IsObject(root)) return kvpq__err(KVPQ_ERR_FORMAT, "header is not a JSON object");
    kvpq_codebook_params p;
    int version = 0;
    KVPQ_TRY(read_config(cJSON_GetObjectItemCaseSensitive(root, "__metadata__"), &p, &version));
    /* kinds the file must hold per layer: the first n_kind, plus k.codebook2 with two key stages */
    const int n_kind = version == 1 ? CB_N_KIND_V1 : CB_K_MEAN + 1;
#define CB_KIND_EXPECTED(k, l) \
    ((k) < n_kind || ((k) == CB_K_BOOK2 && key_M[3 * (l) + 2] == 2) || ((k) == CB_K_ROPE && p.key_rope_dims > 0))
    int *key_M = malloc((size_t)3 * p.n_layer * sizeof *key_M); /* (n_layer, 3) key M, value M, key stages */
    if (!key_M) return kvpq__err(KVPQ_ERR_NOMEM, "out of memory");
    kvpq_status s = read_layer_m(cJSON_GetObjectItemCaseSensitive(root, "__metadata__"), &p, key_M);
    if (s != KVPQ_OK) {
        free(key_M);
        return s;
    }

    /* Every entry is one expected tensor, seen once; shapes and offsets checked before allocating. */
    size_t n_tensor = (size_t)CB_N_KIND * p.n_layer;
    cb_range *seen = calloc(n_tensor, sizeof *seen); /* (n_layer, CB_N_KIND) */
    if (!seen) {
        free(key_M);
        return kvpq__err(KVPQ_ERR_NOMEM, "out of memory");
    }
    for (const cJSON *t = root->child; t && s == KVPQ_OK; t = t->next) {
        if (!strcmp(t->string, "__metadata__")) {
            if (t != cJSON_GetObjectItemCaseSensitive(root, "__metadata__"))
                s = kvpq__err(KVPQ_ERR_FORMAT, "__metadata__ appears twice");
            continue;
        }
        int layer, kind;
        if (!parse_tensor_name(t->string, &layer, &kind) || layer >= p.n_layer || !CB_KIND_EXPECTED(kind, layer)) {
            s = kvpq__err(KVPQ_ERR_FORMAT, "unexpected tensor '%.64s' (a version %d file holds layers.{0..%d}.{%s%s})",
                          t->string, version, p.n_layer - 1,
                          version == 1 ? "k.smooth, k.codebook, v.codebook"
                                       : p.key_stages == 2 ? "k.smooth, k.mean, k.codebook, k.codebook2, v.codebook"
                                                           : "k.smooth, k.mean, k.codebook, v.codebook",
                          p.key_rope_dims > 0 ? ", k.rope_freq" : "");
            break;
        }
        cb_range *r = &seen[(size_t)layer * CB_N_KIND + kind];
        if (r->t) s = kvpq__err(KVPQ_ERR_FORMAT, "tensor %s appears twice", t->string);
        else s = check_entry(t, &p, layer, kind, key_M + 3 * layer, data_len, r);
    }
    for (size_t i = 0; i < n_tensor && s == KVPQ_OK; i++)
        if (!seen[i].t && CB_KIND_EXPECTED((int)(i % CB_N_KIND), (int)(i / CB_N_KIND)))
            s = kvpq__err(KVPQ_ERR_FORMAT, "tensor layers.%zu.%s is missing", i / CB_N_KIND,
                          cb_kind_names[i % CB_N_KIND]);
    if (s == KVPQ_OK) {
        cb_range *sorted = malloc(n_tensor * sizeof *sorted);
        if (!sorted) s = kvpq__err(KVPQ_ERR_NOMEM, "out of memory");
        else {
            size_t n_seen = 0;
            for (size_t i = 0; i < n_tensor; i++)
                if (seen[i].t) sorted[n_seen++] = seen[i];
            qsort(sorted, n_seen, sizeof *sorted, cmp_range);
            /* Exact coverage, as the safetensors format requires (its reference reader rejects the
             * rest): the tensors tile the data section from byte 0 to its end, no overlap, no gap,
             * no trailing bytes. A gap or a tail is where hidden data would ride along. */
            for (size_t i = 1; i < n_seen && s == KVPQ_OK; i++)
                if (sorted[i].begin < sorted[i - 1].end)
                    s = kvpq__err(KVPQ_ERR_FORMAT, "tensors %s [%llu,%llu] and %s [%llu,%llu] overlap",
                                  sorted[i - 1].t->string, (unsigned long long)sorted[i - 1].begin,
                                  (unsigned long long)sorted[i - 1].end, sorted[i].t->string,
                                  (unsigned long long)sorted[i].begin, (unsigned long long)sorted[i].end);
            if (s == KVPQ_OK && n_seen && sorted[0].begin != 0)
                s = kvpq__err(KVPQ_ERR_FORMAT, "the data section starts with %llu bytes no tensor covers (before %s)",
                              (unsigned long long)sorted[0].begin, sorted[0].t->string);
            for (size_t i = 1; i < n_seen && s == KVPQ_OK; i++)
                if (sorted[i].begin > sorted[i - 1].end)
                    s = kvpq__err(KVPQ_ERR_FORMAT, "gap of %llu bytes between tensors %s [%llu,%llu] and %s [%llu,%llu]",
                                  (unsigned long long)(sorted[i].begin - sorted[i - 1].end), sorted[i - 1].t->string,
                                  (unsigned long long)sorted[i - 1].begin, (unsigned long long)sorted[i - 1].end,
                                  sorted[i].t->string, (unsigned long long)sorted[i].begin,
                                  (unsigned long long)sorted[i].end);
            if (s == KVPQ_OK && n_seen && sorted[n_seen - 1].end != data_len)
                s = kvpq__err(KVPQ_ERR_FORMAT, "%llu trailing bytes after the last tensor %s (data section of %llu bytes)",
                              (unsigned long long)(data_len - sorted[n_seen - 1].end), sorted[n_seen - 1].t->string,
                              (unsigned long long)data_len);
            free(sorted);
        }
    }

    kvpq_codebook *cb = NULL;
    if (s == KVPQ_OK) s = kvpq_codebook_new(&cb, &p);
    for (int l = 0; l < p.n_layer && s == KVPQ_OK; l++) {
        for (int w = 0; w < 2 && s == KVPQ_OK; w++)
            if (key_M[3 * l + w] != default_M(&p, w)) s = set_layer_M(cb, l, w, key_M[3 * l + w], "load");
        if (s == KVPQ_OK && key_M[3 * l + 2] != p.key_stages) s = kvpq_codebook_set_layer_key_stages(cb, l, 1);
    }
    free(key_M);
    for (const cJSON *j = cJSON_GetObjectItemCaseSensitive(root, "__metadata__")->child; j && s == KVPQ_OK;
         j = j->next) {
        if (is_config_key(j->string)) continue;
        s = kvpq_codebook_set_meta(cb, j->string, j->valuestring);
        if (s == KVPQ_ERR_INVALID_ARG) s = KVPQ_ERR_FORMAT; /* empty key or invalid UTF-8 in the file */
    }
    for (size_t i = 0; i < n_tensor && s == KVPQ_OK; i++) {
        int layer = (int)(i / CB_N_KIND), kind = (int)(i % CB_N_KIND);
        if (!seen[i].t) continue; /* k.mean of a version 1 file: mu stays 0 */
        size_t n;
        float *dst = tensor_data(cb, layer, kind, &n);
        memcpy(dst, data + seen[i].begin, n * sizeof(float)); /* the data may be unaligned: copy, then read */
        s = check_values(dst, n, kind, seen[i].t->string);
        if (s == KVPQ_OK && (kind == CB_K_BOOK || kind == CB_V_BOOK)) kvpq__pq_update_norms(cb->pq[2 * layer + (kind == CB_V_BOOK)]);
        if (s == KVPQ_OK && kind == CB_K_BOOK2) kvpq__pq_update_norms(cb->pq2[layer]);
    }
    free(seen);
    if (s != KVPQ_OK) {
        kvpq_codebook_free(cb);
        return s;
    }
    *out = cb;
    return KVPQ_OK;
}

/* Every number of a safetensors header (shape, data_offsets) is an integer: refuse any JSON number
 * written with a fraction or an exponent ("16.0", "1.6e1"), which cJSON would read as 16. Scans the
 * NUL-terminated header text outside strings. */
static kvpq_status check_integer_numbers(const char *text) {
    int in_str = 0;
    for (const char *c = text; *c; c++) {
        if (in_str) {
            if (*c == '\\' && c[1]) c++;
            else if (*c == '"') in_str = 0;
            continue;
        }
        if (*c == '"') {
            in_str = 1;
            continue;
        }
        if (*c != '-' && !(*c >= '0' && *c <= '9')) continue;
        const char *b = c;
        int frac = 0;
        while (*c == '-' || *c == '+' || *c == '.' || *c == 'e' || *c == 'E' || (*c >= '0' && *c <= '9')) {
            frac |= *c == '.' || *c == 'e' || *c == 'E';
            c++;
        }
        if (frac)
            return kvpq__err(KVPQ_ERR_FORMAT, "header holds the number '%.*s' at byte %td: shape and data_offsets "
                             "must be integers", (int)(c - b > 32 ? 32 : c - b), b, b - text);
        c--;
    }
    return KVPQ_OK;
}

static kvpq_status load_mem(kvpq_codebook **out, const uint8_t *buf, size_t len) {
    if (len < 8) return kvpq__err(KVPQ_ERR_FORMAT, "file is %zu bytes, shorter than the 8-byte header length", len);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)buf[i] << (8 * i);
    if (n > len - 8)
        return kvpq__err(KVPQ_ERR_FORMAT, "header length %llu exceeds the %zu bytes that follow it (truncated "
                         "file or corrupt length)", (unsigned long long)n, len - 8);
    if (n > KVPQ_CODEBOOK_MAX_HEADER)
        return kvpq__err(KVPQ_ERR_FORMAT, "header length %llu exceeds the %llu-byte limit", (unsigned long long)n,
                         (unsigned long long)KVPQ_CODEBOOK_MAX_HEADER);
    /* A NUL-terminated copy: cJSON then never reads past the header, and an embedded NUL ends the
     * JSON early, which the trailing-bytes check below rejects. */
    char *text = malloc((size_t)n + 1);
    if (!text) return kvpq__err(KVPQ_ERR_NOMEM, "out of memory for a %llu-byte header", (unsigned long long)n);
    memcpy(text, buf + 8, (size_t)n);
    text[n] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithOpts(text, &end, 0);
    kvpq_status s = KVPQ_OK;
    if (!root) {
        s = kvpq__err(KVPQ_ERR_FORMAT, "header is not valid JSON (error at byte %td of %llu)",
                      end ? end - text : (ptrdiff_t)0, (unsigned long long)n);
    } else {
        for (const char *c = end; c < text + n && s == KVPQ_OK; c++)
            if (*c != ' ' && *c != '\t' && *c != '\n' && *c != '\r')
                s = kvpq__err(KVPQ_ERR_FORMAT, "header has bytes after its JSON object (at byte %td of %llu)",
                              c - text, (unsigned long long)n);
        if (s == KVPQ_OK) s = load_header(out, root, buf + 8 + n, (uint64_t)(len - 8 - n));
        /* After load_header, which names the tensor of a number that is not integral ("8.5");
         * left to catch here: integral values spelled as floats ("16.0"). */
        if (s == KVPQ_OK && (s = check_integer_numbers(text)) != KVPQ_OK) {
            kvpq_codebook_free(*out);
            *out = NULL;
        }
    }
    cJSON_Delete(root);
    free(text);
    return s;
}

kvpq_status kvpq__codebook_load_mem(kvpq_codebook **out, const uint8_t *buf, size_t len, const char *name) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_load: out is NULL");
    *out = NULL;
    if (!buf && len) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_load: NULL buffer");
    static const uint8_t empty[1];
    kvpq_status s = load_mem(out, buf ? buf : empty, len);
    if (s != KVPQ_OK) kvpq__err_prefix("codebook file '%s'", name ? name : "(memory)");
    return s;
}

kvpq_status kvpq_codebook_load(kvpq_codebook **out, const char *path) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_load: out is NULL");
    *out = NULL;
    if (!path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_load: path is NULL");
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK); /* a FIFO must not block the open */
    if (fd < 0) return kvpq__err(KVPQ_ERR_IO, "codebook file '%s': cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return kvpq__err(KVPQ_ERR_IO, "codebook file '%s': not a regular file", path);
    }
    /* read() rather than mmap: a file shrunk by someone else while we read gives a short read (an
     * error below), never SIGBUS. */
    size_t cap = (size_t)st.st_size, len = 0;
    uint8_t *buf = malloc(cap ? cap : 1);
    if (!buf) {
        close(fd);
        return kvpq__err(KVPQ_ERR_NOMEM, "codebook file '%s': out of memory for %zu bytes", path, cap);
    }
    while (len < cap) {
        ssize_t r = read(fd, buf + len, cap - len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            kvpq_status s = kvpq__err(KVPQ_ERR_IO, "codebook file '%s': read failed: %s", path, strerror(errno));
            free(buf);
            close(fd);
            return s;
        }
        if (r == 0) break;
        len += (size_t)r;
    }
    close(fd);
    kvpq_status s = kvpq__codebook_load_mem(out, buf, len, path);
    free(buf);
    return s;
}

/* ---- a codebook for some of the KV heads (tensor parallelism) ------------------------------------ */

/* dst's quantizers of layer l take src's centroids (same params: the layer's M and stages match). */
static kvpq_status copy_layer_books(kvpq_codebook *dst, const kvpq_codebook *src, int l) {
    KVPQ_TRY(kvpq_codebook_set_layer_key_M(dst, l, src->layer_M[3 * l]));
    KVPQ_TRY(kvpq_codebook_set_layer_value_M(dst, l, src->layer_M[3 * l + 1]));
    KVPQ_TRY(kvpq_codebook_set_layer_key_stages(dst, l, src->layer_M[3 * l + 2]));
    for (int w = 0; w < 3; w++) {
        const kvpq_pq *from = w == 2 ? src->pq2[l] : src->pq[2 * l + w];
        kvpq_pq *to = w == 2 ? dst->pq2[l] : dst->pq[2 * l + w];
        if (from) KVPQ_TRY(kvpq_pq_set_centroids(to, kvpq_pq_centroids(from), kvpq_pq_centroids_size(from)));
    }
    if (src->rope_freq) /* the same params: the same key_rope_dims */
        memcpy(kvpq_codebook_key_rope_freq(dst, l), kvpq_codebook_key_rope_freq_const(src, l),
               sizeof(float) * (size_t)(src->p.key_rope_dims / 2));
    return KVPQ_OK;
}

/* dst's smoothing factors and key means: KV heads [h0, h0 + dst's n_head_kv) of src's. */
static void copy_head_rows(kvpq_codebook *dst, const kvpq_codebook *src, int h0) {
    const size_t d = (size_t)src->p.head_dim, n = (size_t)dst->p.n_head_kv;
    for (int l = 0; l < src->p.n_layer; l++) {
        const size_t from = ((size_t)l * src->p.n_head_kv + h0) * d, to = (size_t)l * n * d;
        memcpy(dst->smooth + to, src->smooth + from, n * d * sizeof(float));
        memcpy(dst->mean + to, src->mean + from, n * d * sizeof(float));
    }
}

/* Every metadata entry of src that is not derived from the params (those dst has of its own). */
static kvpq_status copy_free_meta(kvpq_codebook *dst, const kvpq_codebook *src) {
    for (size_t i = 0; i < src->n_meta; i++)
        if (!is_config_key(src->meta_key[i])) KVPQ_TRY(meta_put(dst, src->meta_key[i], src->meta_val[i]));
    return KVPQ_OK;
}

kvpq_status kvpq_codebook_slice_heads(kvpq_codebook **out, const kvpq_codebook *cb, int h0, int n_head_kv) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_slice_heads: out is NULL");
    *out = NULL;
    if (!cb) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_slice_heads: cb is NULL");
    if (h0 < 0 || n_head_kv < 1 || h0 > cb->p.n_head_kv - n_head_kv)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_codebook_slice_heads: KV heads [%d, %d) outside the codebook's %d",
                         h0, h0 + n_head_kv, cb->p.n_head_kv);
    const kvpq_pq_params *q[3] = {&cb->p.key, &cb->p.value, &cb->p.key2};
    for (int w = 0; w < 3; w++)
        if (q[w]->granularity == KVPQ_CODEBOOK_HEAD)
            return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_codebook_slice_heads: the %s quantizer has a codebook per KV "
                             "head (granularity head); only shared and sub-space codebooks are sliced",
                             w == 1 ? "value" : w ? "stage-two key" : "key");
    kvpq_codebook_params p = cb->p;
    p.n_head_kv = n_head_kv;
    kvpq_codebook *c;
    KVPQ_TRY(kvpq_codebook_new(&c, &p));
    kvpq_status s = KVPQ_OK;
    for (int l = 0; l < p.n_layer && s == KVPQ_OK; l++) s = copy_layer_books(c, cb, l);
    if (s == KVPQ_OK) {
        copy_head_rows(c, cb, h0);
        s = copy_free_meta(c, cb);
    }
    char heads[64];
    snprintf(heads, sizeof heads, "%d:%d/%d", h0, h0 + n_head_kv, cb->p.n_head_kv);
    if (s == KVPQ_OK) s = meta_put(c, "heads", heads);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("kvpq_codebook_slice_heads");
        kvpq_codebook_free(c);
        return s;
    }
    *out = c;
    return KVPQ_OK;
}
