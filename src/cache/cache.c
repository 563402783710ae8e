/* cache.c — the public KV-cache API: argument checks (NULL, layer range, NaN/Inf, capacity) done
 * once here, per-layer positions counts, and dispatch to the kind's ops (cache_impl.h). */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "cache/cache_impl.h"
#include "core/fp16.h"
#include "internal.h"

static const kvpq_cache_ops *ops_of(kvpq_cache_type t) {
    switch (t) {
    case KVPQ_CACHE_FP32: return &kvpq_cache_ops_fp32;
    case KVPQ_CACHE_FP16: return &kvpq_cache_ops_fp16;
    case KVPQ_CACHE_Q8_0: return &kvpq_cache_ops_q8_0;
    case KVPQ_CACHE_Q4_0: return &kvpq_cache_ops_q4_0;
    case KVPQ_CACHE_KIVI2: return &kvpq_cache_ops_kivi2;
    case KVPQ_CACHE_KIVI4: return &kvpq_cache_ops_kivi4;
    case KVPQ_CACHE_VQ: return &kvpq_cache_ops_vq;
    case KVPQ_CACHE_Q8_0R: return &kvpq_cache_ops_q8_0r;
    case KVPQ_CACHE_Q4_0R: return &kvpq_cache_ops_q4_0r;
    }
    return NULL;
}

static const char *const type_names[] = {"fp32", "fp16", "q8_0", "q4_0", "kivi2", "kivi4", "vq", "q8_0r", "q4_0r"};
#define N_TYPES ((int)(sizeof type_names / sizeof type_names[0]))

kvpq_cache_params kvpq_cache_params_default(void) {
    /* Shapes of SmolLM2-135M (the project's model); callers set their own. */
    kvpq_cache_params p = {
        .type = KVPQ_CACHE_FP32,
        .n_layer = 30,
        .n_head = 9,
        .n_head_kv = 3,
        .head_dim = 64,
        .max_seq = 8192,
        .window = 128,
        .page_tokens = 256,
        .codebook = NULL,
        .n_threads = 0,
        .backend = KVPQ_BACKEND_AUTO,
        .sliding_window = 0,
        .swa_layers = NULL,
        .sinks = 0,
        .pool = NULL,
    };
    return p;
}

kvpq_status kvpq_cache_type_parse(const char *spec, kvpq_cache_type *type, const char **vq_path) {
    if (vq_path) *vq_path = NULL;
    if (!spec || !type) return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache spec: NULL argument");
    for (int t = 0; t < N_TYPES; t++)
        if (t != KVPQ_CACHE_VQ && !strcmp(spec, type_names[t])) {
            *type = (kvpq_cache_type)t;
            return KVPQ_OK;
        }
    if (!strncmp(spec, "vq:", 3)) {
        if (!spec[3])
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache spec '%s': vq needs a codebook file (vq:FILE)", spec);
        *type = KVPQ_CACHE_VQ;
        if (vq_path) *vq_path = spec + 3;
        return KVPQ_OK;
    }
    if (!strcmp(spec, "vq"))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache spec 'vq': expected vq:FILE (the codebook file)");
    return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache spec '%s': expected fp32, fp16, q8_0, q4_0, q8_0r, q4_0r, kivi2, kivi4 or vq:FILE",
                     spec);
}

const char *kvpq_cache_type_name(kvpq_cache_type t) {
    return (int)t >= 0 && (int)t < N_TYPES ? type_names[t] : "unknown";
}

static kvpq_status check_params(const kvpq_cache_params *p) {
    if ((int)p->type < 0 || (int)p->type >= N_TYPES)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache type %d: expected 0..%d", (int)p->type, N_TYPES - 1);
    const char *tn = type_names[p->type];
    /* Bounded so that per-layer and per-head tables (n_layer x n_head x head_dim and such) stay small
     * and their sizes far from overflow: a huge count is an error, not a failed giant allocation. */
    if (p->n_layer <= 0 || p->n_layer > KVPQ_CACHE_MAX_LAYERS)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: n_layer %d: expected 1..%d", tn, p->n_layer,
                         KVPQ_CACHE_MAX_LAYERS);
    if (p->n_head <= 0 || p->n_head > KVPQ_CACHE_MAX_HEADS)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: n_head %d: expected 1..%d", tn, p->n_head,
                         KVPQ_CACHE_MAX_HEADS);
    if (p->n_head_kv <= 0 || p->n_head_kv > p->n_head)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: n_head_kv %d: expected 1..n_head (%d)", tn, p->n_head_kv,
                         p->n_head);
    if (p->n_head % p->n_head_kv)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: n_head %d is not a multiple of n_head_kv %d (GQA)", tn,
                         p->n_head, p->n_head_kv);
    if (p->head_dim <= 0 || p->head_dim > 1024)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: head_dim %d: expected 1..1024", tn, p->head_dim);
    /* At most 2^30 positions: with page_tokens <= 2^20, page counts (max_seq + page_tokens - 1) and
     * every position plus a count formed after the capacity check stay below INT_MAX. */
    if (p->max_seq <= 0 || p->max_seq > KVPQ_CACHE_MAX_SEQ)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: max_seq %d: expected 1..%d", tn, p->max_seq,
                         KVPQ_CACHE_MAX_SEQ);
    if (p->window < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: window %d must be >= 0", tn, p->window);
    if (p->page_tokens <= 0 || p->page_tokens > (1 << 20))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: page_tokens %d: expected 1..%d", tn, p->page_tokens, 1 << 20);
    if (p->n_threads < 0 || p->n_threads > KVPQ_MAX_THREADS)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: n_threads %d: expected 0..%d (0 = OpenMP default)", tn,
                         p->n_threads, KVPQ_MAX_THREADS);
    if (p->sliding_window < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: sliding_window %d must be >= 0 (0 = none)", tn,
                         p->sliding_window);
    if (p->sinks < 0 || p->sinks > 65536)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache %s: sinks %d: expected 0..65536", tn, p->sinks);
    if (p->sinks > 0 && (p->type == KVPQ_CACHE_FP32 || p->type == KVPQ_CACHE_FP16))
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "cache %s: sinks %d: attention sinks apply to the quantized kinds (this one loses nothing to "
                         "keep)", tn, p->sinks);
    if (p->type == KVPQ_CACHE_VQ) {
        if (!p->codebook) return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache vq: params.codebook is NULL (vq needs one)");
        kvpq_codebook_params cp = kvpq_codebook_get_params(p->codebook);
        if (cp.n_layer != p->n_layer)
            return kvpq__err(KVPQ_ERR_MISMATCH, "cache vq: codebook has n_layer %d, cache has n_layer %d", cp.n_layer,
                             p->n_layer);
        if (cp.n_head_kv != p->n_head_kv)
            return kvpq__err(KVPQ_ERR_MISMATCH, "cache vq: codebook has n_head_kv %d, cache has n_head_kv %d",
                             cp.n_head_kv, p->n_head_kv);
        if (cp.head_dim != p->head_dim)
            return kvpq__err(KVPQ_ERR_MISMATCH, "cache vq: codebook has head_dim %d, cache has head_dim %d",
                             cp.head_dim, p->head_dim);
    }
    return KVPQ_OK;
}

int kvpq_cache_default_sinks(kvpq_cache_type t) {
    return t == KVPQ_CACHE_VQ || t == KVPQ_CACHE_KIVI2 || t == KVPQ_CACHE_KIVI4 || t == KVPQ_CACHE_Q4_0R;
}

/* The codebook's alloc.<key> as an int in 0..max into *out (left as it is when the key is absent). */
static kvpq_status codebook_hint(const kvpq_codebook *cb, const char *key, long max, int *out) {
    const char *v = kvpq_codebook_get_meta(cb, key);
    if (!v) return KVPQ_OK;
    char *e = NULL;
    long x = strtol(v, &e, 10);
    if (e == v || *e || x < 0 || x > max || (v[0] < '0' || v[0] > '9'))
        return kvpq__err(KVPQ_ERR_FORMAT, "codebook metadata %s = '%.64s' is not a number in 0..%ld", key, v, max);
    *out = (int)x;
    return KVPQ_OK;
}

kvpq_status kvpq_cache_params_resolve(kvpq_cache_params *p, int window, int sinks) {
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_params_resolve: params is NULL");
    if (window < -1 || sinks < -1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_params_resolve: window %d, sinks %d: expected >= -1 (-1: "
                         "not given)", window, sinks);
    int w = p->window, s = kvpq_cache_default_sinks(p->type);
    if (p->type == KVPQ_CACHE_VQ && p->codebook) {
        KVPQ_TRY(codebook_hint(p->codebook, "alloc.window", 1L << 20, &w));
        KVPQ_TRY(codebook_hint(p->codebook, "alloc.sinks", 65536, &s));
    }
    p->window = window >= 0 ? window : w;
    p->sinks = sinks >= 0 ? sinks : s;
    return KVPQ_OK;
}

kvpq_status kvpq_cache_new(kvpq_cache **out, const kvpq_cache_params *p) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_new: out is NULL");
    *out = NULL;
    if (!p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_new: params is NULL");
    KVPQ_TRY(check_params(p));
    const kvpq_cache_ops *ops = ops_of(p->type);
    if (!ops) return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache %s: this kind is not built into this library",
                               kvpq_cache_type_name(p->type));
    kvpq_cache_params q = *p;
    kvpq_backend got;
    kvpq_status s = kvpq_backend_resolve(p->backend, &got);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("cache %s", kvpq_cache_type_name(p->type));
        return s;
    }
    if (p->type != KVPQ_CACHE_VQ) { /* the baseline kinds run on the CPU */
        if (p->backend == KVPQ_BACKEND_CUDA)
            return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache %s: runs on the CPU only (backend cuda requested)",
                             kvpq_cache_type_name(p->type));
        got = KVPQ_BACKEND_CPU;
    }
    /* VQ runs on the GPU when asked for (backend CUDA: cache_vq_cuda.c, host arrays copied each
     * call); AUTO stays on the CPU, so that a program's results do not depend on the machine. */
    if (got == KVPQ_BACKEND_CUDA && p->backend != KVPQ_BACKEND_CUDA) got = KVPQ_BACKEND_CPU;
    if (got == KVPQ_BACKEND_CUDA) ops = &kvpq_cache_ops_vq_cuda;
    q.backend = got;
    if (got == KVPQ_BACKEND_CUDA) q.pool = NULL; /* device storage: the host pool has nothing to give */
    /* A window or page longer than the cache can ever hold means "the whole sequence": clamp them to
     * max_seq, so a short prompt with the default window (128) or pages (256) just works, and a
     * short cache does not allocate rings and pages for positions it can never hold. */
    if (q.window > q.max_seq) q.window = q.max_seq;
    if (q.page_tokens > q.max_seq) q.page_tokens = q.max_seq;
    if (q.sinks > q.max_seq) q.sinks = q.max_seq;
    if (q.sliding_window > 0 && !ops->drop)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "cache %s: sliding-window layers are not supported by this kind",
                         ops->name);
    kvpq_cache *c = calloc(1, sizeof *c);
    if (!c || !(c->len = calloc((size_t)p->n_layer, sizeof *c->len)) ||
        !(c->lo = calloc((size_t)p->n_layer, sizeof *c->lo)) ||
        (q.sliding_window > 0 && q.swa_layers && !(c->swa = malloc((size_t)p->n_layer)))) {
        if (c) free(c->len), free(c->lo);
        free(c);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_new: out of memory");
    }
    if (q.sliding_window == 0) q.swa_layers = NULL;
    if (c->swa) {
        for (int l = 0; l < p->n_layer; l++) c->swa[l] = q.swa_layers[l] != 0;
        q.swa_layers = c->swa;
    }
    c->p = q;
    c->ops = ops;
    if (q.sinks > 0) {
        size_t ns = (size_t)q.n_layer * q.sinks * q.n_head_kv * q.head_dim;
        c->sk = calloc(ns, sizeof *c->sk);
        c->sv = calloc(ns, sizeof *c->sv);
        c->ilen = calloc((size_t)q.n_layer, sizeof *c->ilen);
        if (!c->sk || !c->sv || !c->ilen) {
            free(c->sk), free(c->sv), free(c->ilen), free(c->len), free(c->lo), free(c->swa);
            free(c);
            return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_new: out of memory for %d attention sinks", q.sinks);
        }
    }
    s = ops->create(&c->state, &c->p);
    if (s == KVPQ_OK && q.type == KVPQ_CACHE_VQ) c->cb_fp = kvpq_codebook_fingerprint(q.codebook);
    if (s != KVPQ_OK) {
        free(c->sk), free(c->sv), free(c->ilen);
        free(c->len), free(c->lo), free(c->swa);
        free(c);
        return s;
    }
    kvpq__pool_ref(c->p.pool);
    *out = c;
    return KVPQ_OK;
}

void kvpq_cache_free(kvpq_cache *c) {
    if (!c) return;
    if (c->state) c->ops->destroy(c->state); /* gives its pages back to the pool */
    kvpq__pool_unref(c->p.pool);
    free(c->sk), free(c->sv), free(c->ilen);
    free(c->len), free(c->lo), free(c->swa);
    free(c);
}

static kvpq_status check_layer(const kvpq_cache *c, int layer, const char *fn) {
    if (!c) return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: cache is NULL", fn);
    if (layer < 0 || layer >= c->p.n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: layer %d out of range [0, %d)", fn, layer, c->p.n_layer);
    return KVPQ_OK;
}

/* First non-finite element of x (n, n_head_kv, head_dim), named; KVPQ_OK if none. */
static kvpq_status check_finite(const kvpq_cache *c, const float *x, int n, int heads, const char *what, int layer,
                                int pos0) {
    const size_t hd = (size_t)c->p.head_dim, total = (size_t)n * heads * hd;
    if (kvpq__all_finite(x, total)) return KVPQ_OK;
    for (size_t i = 0; i < total; i++)
        if (!isfinite(x[i]))
            return kvpq__err(KVPQ_ERR_NONFINITE, "cache %s layer %d: %s is %s at position %d (head %d, dim %d)",
                             c->ops->name, layer, what, isnan(x[i]) ? "NaN" : "Inf", pos0 + (int)(i / (heads * hd)),
                             (int)(i / hd % heads), (int)(i % hd));
    return KVPQ_OK;
}

/* Room for n more positions in layer, and k, v (n, n_head_kv, head_dim) finite. */
static kvpq_status check_append(const kvpq_cache *c, int layer, int n, const float *k, const float *v) {
    const int len = c->len[layer];
    if (n > c->p.max_seq - len)
        return kvpq__err(KVPQ_ERR_CAPACITY, "cache %s layer %d: holds %d positions, appending %d exceeds max_seq %d",
                         c->ops->name, layer, len, n, c->p.max_seq);
    KVPQ_TRY(check_finite(c, k, n, c->p.n_head_kv, "K", layer, len));
    return check_finite(c, v, n, c->p.n_head_kv, "V", layer, len);
}

kvpq_status kvpq_cache_append(kvpq_cache *c, int layer, int n, const float *k, const float *v) {
    KVPQ_TRY(check_layer(c, layer, "kvpq_cache_append"));
    if (n < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_append: n %d must be >= 0", n);
    if (n == 0) return KVPQ_OK;
    if (!k || !v) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_append: k or v is NULL");
    KVPQ_TRY(check_append(c, layer, n, k, v));
    const int len = c->len[layer];
    const int S = c->p.sinks, ns = len < S ? (n < S - len ? n : S - len) : 0; /* positions going to sinks */
    const size_t kvw = (size_t)c->p.n_head_kv * c->p.head_dim;
    if (ns > 0) {
        KVPQ_TRY(kvpq__check_range(&c->p, "sinks", "K", layer, len, ns, k, 65504.0f));
        KVPQ_TRY(kvpq__check_range(&c->p, "sinks", "V", layer, len, ns, v, 65504.0f));
    }
    /* Sliding window: the first query to come (position len) sees positions from
     * kvpq__window_start(len); what lies before can go (the kind's part; sinks stay allocated). */
    const int keep = kvpq__window_start(&c->p, layer, len);
    if (keep > c->lo[layer] && keep > S) {
        /* the kind's first held position: 0 while it has freed no page, and then every position is
         * still held (lo stays 0: S + 0 refused truncations and sink reads that need nothing freed) */
        const int kind_lo = c->ops->drop(c->state, layer, len - S, keep - S);
        if (kind_lo > 0) c->lo[layer] = S + kind_lo;
    }
    if (n > ns) KVPQ_TRY(c->ops->append(c->state, layer, len + ns - S, n - ns, k + ns * kvw, v + ns * kvw));
    for (size_t i = 0; i < (size_t)ns * kvw; i++) { /* cannot fail: after the kind's append */
        size_t dst = ((size_t)layer * S + len) * kvw + i;
        c->sk[dst] = kvpq__f2h(k[i]);
        c->sv[dst] = kvpq__f2h(v[i]);
    }
    c->len[layer] = len + n;
    return KVPQ_OK;
}

/* The kind's positions per layer: every position but the sinks. */
static const int *inner_lens(const kvpq_cache *c) {
    if (!c->p.sinks) return c->len;
    for (int l = 0; l < c->p.n_layer; l++) c->ilen[l] = c->len[l] > c->p.sinks ? c->len[l] - c->p.sinks : 0;
    return c->ilen;
}

/* Queries of the last n_q (of len positions) that the kind attends: those past the sinks. */
static int kind_queries(const kvpq_cache *c, int len, int n_q) {
    const int n_in = len - c->p.sinks < n_q ? len - c->p.sinks : n_q;
    return n_in > 0 ? n_in : 0;
}

/* The sinks' part of attention merged into out: the kind's rows (the last min(n_q, len - S)
 * queries) with their lse, the others (queries among the sinks) the sinks' attention alone. */
static void merge_sinks(const kvpq_cache *c, int layer, int len, int n_q, const float *q, float *out,
                        const float *lse) {
    const int S = c->p.sinks, hd = c->p.head_dim, nh = c->p.n_head, g = nh / c->p.n_head_kv;
    const size_t qw = (size_t)nh * hd, kvw = (size_t)c->p.n_head_kv * hd;
    const int n_in = kind_queries(c, len, n_q);
    const int nt = c->p.n_threads > 0 ? c->p.n_threads : omp_get_max_threads();
    const double scale = 1.0 / sqrt((double)hd);
    const uint16_t *sk = c->sk + (size_t)layer * S * kvw, *sv = c->sv + (size_t)layer * S * kvw;
#pragma omp parallel for num_threads(nt) if ((double)n_q * nh * S * hd > 1e5) schedule(static)
    for (int r = 0; r < n_q * nh; r++) {
        const int i = r / nh, h = r % nh, pos = len - n_q + i, kvh = h / g;
        int t0 = kvpq__window_start(&c->p, layer, pos), t1 = pos + 1 < S ? pos + 1 : S;
        float *dst = out + (size_t)i * qw + (size_t)h * hd;
        if (t0 >= t1) continue; /* no sink in this query's window: the kind's part alone */
        const float *qi = q + (size_t)i * qw + (size_t)h * hd;
        double m = -INFINITY, d = 0.0, o[1024];
        for (int t = t0; t < t1; t++) {
            const uint16_t *kt = sk + (size_t)t * kvw + (size_t)kvh * hd;
            double sc = 0.0;
            for (int j = 0; j < hd; j++) sc += (double)qi[j] * kvpq__h2f(kt[j]);
            if (sc * scale > m) m = sc * scale;
        }
        for (int j = 0; j < hd; j++) o[j] = 0.0;
        for (int t = t0; t < t1; t++) {
            const uint16_t *kt = sk + (size_t)t * kvw + (size_t)kvh * hd, *vt = sv + (size_t)t * kvw + (size_t)kvh * hd;
            double sc = 0.0;
            for (int j = 0; j < hd; j++) sc += (double)qi[j] * kvpq__h2f(kt[j]);
            double w = exp(sc * scale - m);
            d += w;
            for (int j = 0; j < hd; j++) o[j] += w * kvpq__h2f(vt[j]);
        }
        const int ii = i - (n_q - n_in); /* the kind's query row, when it has one */
        if (ii < 0) {
            for (int j = 0; j < hd; j++) dst[j] = (float)(o[j] / d);
            continue;
        }
        const double l = lse[(size_t)ii * nh + h], M = m > l ? m : l, a = exp(m - M), b = exp(l - M);
        const double inv = 1.0 / (a * d + b);
        for (int j = 0; j < hd; j++) dst[j] = (float)((a * o[j] + b * dst[j]) * inv);
    }
}

/* Attention with sinks: the kind attends its positions (S..) for the queries at positions >= S and
 * returns each row's log-sum-exp; the sinks a query sees (positions [max(0, window start), min(S,
 * pos + 1))) are scored here in double, and the two parts are merged as two online-softmax states:
 * with (m_s, d_s, o_s) over the sinks and (lse, out) from the kind, M = max(m_s, lse),
 * out = (e^(m_s - M) o_s + e^(lse - M) out) / (e^(m_s - M) d_s + e^(lse - M)). */
static kvpq_status attend_sinks(kvpq_cache *c, int layer, int len, int n_q, const float *q, float *out) {
    const int S = c->p.sinks, nh = c->p.n_head, n_in = kind_queries(c, len, n_q);
    const size_t qw = (size_t)nh * c->p.head_dim;
    float *lse = NULL;
    if (n_in > 0) {
        if (!(lse = malloc((size_t)n_in * nh * sizeof *lse)))
            return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory for %d queries", c->ops->name, n_q);
        kvpq_status s = c->ops->attend(c->state, layer, len - S, n_in, q + (size_t)(n_q - n_in) * qw,
                                       out + (size_t)(n_q - n_in) * qw, lse);
        if (s != KVPQ_OK) {
            free(lse);
            return s;
        }
    }
    merge_sinks(c, layer, len, n_q, q, out, lse);
    free(lse);
    return KVPQ_OK;
}

/* Finite q, K and V can still overflow float in q . k (|q| |k| beyond 3.4e38): named, not NaN. */
static kvpq_status check_out(const kvpq_cache *c, int layer, int len, int n_q, const float *q, const float *out) {
    const size_t qw = (size_t)c->p.n_head * c->p.head_dim;
    if (!kvpq__all_finite(out, (size_t)n_q * qw))
        for (int i = 0; i < n_q; i++)
            if (!kvpq__all_finite(out + (size_t)i * qw, qw))
                return kvpq__err(KVPQ_ERR_NONFINITE, "cache %s layer %d: attention of the query at position %d is not "
                                 "finite: q . k or the weighted sum of V overflows float32 (|q| up to %g)",
                                 c->ops->name, layer, len - n_q + i, (double)kvpq__max_abs(q + (size_t)i * qw, qw));
    return KVPQ_OK;
}

kvpq_status kvpq_cache_attend(kvpq_cache *c, int layer, int n_q, const float *q, float *out) {
    KVPQ_TRY(check_layer(c, layer, "kvpq_cache_attend"));
    const int len = c->len[layer];
    if (n_q <= 0 || n_q > len)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_attend: n_q %d: expected 1..%d (positions held by layer %d)",
                         n_q, len, layer);
    if (!q || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_attend: q or out is NULL");
    KVPQ_TRY(check_finite(c, q, n_q, c->p.n_head, "Q", layer, len - n_q));
    if (kvpq__window_start(&c->p, layer, len - n_q) < c->lo[layer])
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_cache_attend: layer %d (sliding window %d) no longer holds positions before %d, which "
                         "the query at position %d would see",
                         layer, c->p.sliding_window, c->lo[layer], len - n_q);
    KVPQ_TRY(c->p.sinks > 0 ? attend_sinks(c, layer, len, n_q, q, out)
                            : c->ops->attend(c->state, layer, len, n_q, q, out, NULL));
    return check_out(c, layer, len, n_q, q, out);
}

/* Positions a windowed kind holds coded once the layer holds len positions by appends (sinks are
 * not the kind's); 0 for the other kinds. */
static int coded_at(const kvpq_cache *c, int len) {
    const int inner = len > c->p.sinks ? len - c->p.sinks : 0;
    return c->ops->coded_of ? c->ops->coded_of(c->state, inner) : 0;
}

/* The longest run of the next n positions (at least 1) whose queries all see the same window
 * state: appending them together shows each query what it would see appended alone. */
static int same_window_run(const kvpq_cache *c, int layer, int n) {
    const int len = c->len[layer], first = coded_at(c, len + 1);
    int run = 1;
    while (run < n && coded_at(c, len + run + 1) == first) run++;
    return run;
}

/* kvpq_cache_append_attend in one pass, for a kind with stage_exact / attend_staged: n positions
 * past the sinks staged, appended, and their queries attended together, each query still seeing
 * its own position's window state. */
static kvpq_status fused_append_attend(kvpq_cache *c, int layer, int n, const float *k, const float *v,
                                       const float *q, float *out) {
    const int S = c->p.sinks, len = c->len[layer] + n;
    float *lse = NULL; /* before the append: running out of memory then leaves the layer as it was */
    if (S > 0 && !(lse = malloc((size_t)n * c->p.n_head * sizeof *lse)))
        return kvpq__err(KVPQ_ERR_NOMEM, "cache %s: out of memory for %d queries", c->ops->name, n);
    kvpq_status s = c->ops->stage_exact(c->state, layer, len - n - S, n, k, v);
    if (s == KVPQ_OK) s = kvpq_cache_append(c, layer, n, k, v);
    if (s == KVPQ_OK) s = c->ops->attend_staged(c->state, layer, len - S, n, q, out, lse);
    if (s == KVPQ_OK) {
        if (S > 0) merge_sinks(c, layer, len, n, q, out, lse);
        s = check_out(c, layer, len, n, q, out);
    }
    free(lse);
    return s;
}

kvpq_status kvpq_cache_append_attend(kvpq_cache *c, int layer, int n, const float *k, const float *v, const float *q,
                                     float *out) {
    KVPQ_TRY(check_layer(c, layer, "kvpq_cache_append_attend"));
    if (n <= 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_append_attend: n %d must be >= 1", n);
    if (!k || !v || !q || !out)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_append_attend: k, v, q or out is NULL");
    /* every input first, so that NaN/Inf fail before any position is appended (the kind's range
     * checks, fp16 parts within 65504, run per append: kvpq.h says so) */
    KVPQ_TRY(check_append(c, layer, n, k, v));
    KVPQ_TRY(check_finite(c, q, n, c->p.n_head, "Q", layer, c->len[layer]));
    const size_t kvw = (size_t)c->p.n_head_kv * c->p.head_dim, qw = (size_t)c->p.n_head * c->p.head_dim;
    for (int done = 0; done < n;) {
        const int run = same_window_run(c, layer, n - done);
        if (run < n - done && c->ops->stage_exact && c->ops->attend_staged && n - done >= c->ops->staged_min_n &&
            c->len[layer] >= c->p.sinks)
            return fused_append_attend(c, layer, n - done, k + done * kvw, v + done * kvw, q + done * qw,
                                       out + done * qw);
        KVPQ_TRY(kvpq_cache_append(c, layer, run, k + done * kvw, v + done * kvw));
        KVPQ_TRY(kvpq_cache_attend(c, layer, run, q + done * qw, out + done * qw));
        done += run;
    }
    return KVPQ_OK;
}

int kvpq_cache_exact_prefix(const kvpq_cache *c, int n_pos) {
    if (!c || n_pos <= 0) return 0;
    int p = n_pos;
    for (int l = 0; l < c->p.n_layer; l++)
        if (c->len[l] < p) p = c->len[l];
    if (!c->ops->n_coded) return p;
    /* Truncating to p leaves min(n_coded, p) positions coded (a KIVI group cut in two goes back to
     * the window decoded, so fewer): exact when that is what appends alone give, coded_of(p). */
    for (; p > c->p.sinks; p--) {
        const int inner = p - c->p.sinks;
        int l = 0;
        for (; l < c->p.n_layer; l++) {
            const int now = c->ops->n_coded(c->state, l);
            if ((now < inner ? now : inner) != c->ops->coded_of(c->state, inner)) break;
        }
        if (l == c->p.n_layer) return p;
    }
    return p;
}

kvpq_status kvpq_cache_truncate(kvpq_cache *c, int n_pos) {
    if (!c) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_truncate: cache is NULL");
    if (n_pos < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_truncate: n_pos %d must be >= 0", n_pos);
    /* A sliding-window layer can go back only as far as the next query (position n_pos) still
     * finds its window held; to 0 it always can (nothing is left to see). */
    for (int l = 0; l < c->p.n_layer; l++)
        if (n_pos > 0 && c->len[l] > n_pos && kvpq__window_start(&c->p, l, n_pos) < c->lo[l])
            return kvpq__err(KVPQ_ERR_INVALID_ARG,
                             "kvpq_cache_truncate: layer %d (sliding window %d) no longer holds positions before %d; "
                             "truncating to %d needs them",
                             l, c->p.sliding_window, c->lo[l], n_pos);
    const int S = c->p.sinks;
    KVPQ_TRY(c->ops->truncate(c->state, inner_lens(c), n_pos > S ? n_pos - S : 0));
    for (int l = 0; l < c->p.n_layer; l++) {
        if (c->len[l] > n_pos) c->len[l] = n_pos;
        if (n_pos == 0) c->lo[l] = 0;
    }
    return KVPQ_OK;
}

kvpq_status kvpq_cache_reserve(kvpq_cache *c, int n_pos) {
    if (!c) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_reserve: cache is NULL");
    if (n_pos < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_reserve: n_pos %d must be >= 0", n_pos);
    if (n_pos > c->p.max_seq)
        return kvpq__err(KVPQ_ERR_CAPACITY, "cache %s: reserving %d positions exceeds max_seq %d", c->ops->name, n_pos,
                         c->p.max_seq);
    const int S = c->p.sinks;
    if (!c->ops->reserve || n_pos <= S) return KVPQ_OK; /* sinks are allocated with the cache */
    kvpq_status s = c->ops->reserve(c->state, inner_lens(c), n_pos - S);
    if (s != KVPQ_OK) kvpq__err_prefix("reserving %d positions", n_pos);
    return s;
}

int kvpq_cache_seq_len(const kvpq_cache *c, int layer) {
    if (!c || layer < 0 || layer >= c->p.n_layer) return 0;
    return c->len[layer];
}

kvpq_status kvpq_cache_read(const kvpq_cache *c, int layer, int pos0, int n, float *k, float *v) {
    KVPQ_TRY(check_layer(c, layer, "kvpq_cache_read"));
    const int len = c->len[layer];
    if (pos0 < 0 || n < 0 || pos0 > len || n > len - pos0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_read: positions [%d, %lld) out of range: layer %d holds %d",
                         pos0, (long long)pos0 + n, layer, len);
    if (n == 0 || (!k && !v)) return KVPQ_OK;
    if (pos0 < c->lo[layer])
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_cache_read: layer %d (sliding window %d) no longer holds positions before %d (asked from %d)",
                         layer, c->p.sliding_window, c->lo[layer], pos0);
    const int S = c->p.sinks;
    if (!S) return c->ops->read(c->state, layer, len, pos0, n, k, v);
    const size_t kvw = (size_t)c->p.n_head_kv * c->p.head_dim;
    const int n_s = pos0 < S ? (n < S - pos0 ? n : S - pos0) : 0; /* positions read from the sinks */
    for (size_t i = 0; i < (size_t)n_s * kvw; i++) {
        size_t src = ((size_t)layer * S + pos0) * kvw + i;
        if (k) k[i] = kvpq__h2f(c->sk[src]);
        if (v) v[i] = kvpq__h2f(c->sv[src]);
    }
    if (n == n_s) return KVPQ_OK;
    return c->ops->read(c->state, layer, len - S, pos0 + n_s - S, n - n_s, k ? k + n_s * kvw : NULL,
                        v ? v + n_s * kvw : NULL);
}

size_t kvpq_cache_resident_bytes(const kvpq_cache *c) {
    if (!c) return 0;
    const size_t sink_bytes = (size_t)2 * c->p.n_layer * c->p.sinks * c->p.n_head_kv * c->p.head_dim * sizeof(uint16_t);
    return c->ops->resident_bytes(c->state, inner_lens(c)) + sink_bytes;
}

kvpq_status kvpq_cache_get_stats(const kvpq_cache *c, kvpq_cache_stats *st) {
    if (!c || !st) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_get_stats: NULL argument");
    memset(st, 0, sizeof *st);
    st->resident_bytes = kvpq_cache_resident_bytes(c);
    int64_t tokens = 0;
    for (int l = 0; l < c->p.n_layer; l++) tokens += c->len[l] - c->lo[l];
    st->elements = 2 * tokens * c->p.n_head_kv * c->p.head_dim;
    st->bits_per_element = st->elements ? (double)st->resident_bytes * 8.0 / (double)st->elements : 0.0;
    st->backend = c->p.backend;
    if (c->ops->stats) c->ops->stats(c->state, inner_lens(c), st);
    for (int l = 0; l < c->p.n_layer && c->p.sinks; l++) { /* sinks: full precision (fp16 K and V) */
        const int ns = c->len[l] < c->p.sinks ? c->len[l] : c->p.sinks;
        st->tokens_window += ns;
        st->stored_bytes += (size_t)2 * ns * c->p.n_head_kv * c->p.head_dim * sizeof(uint16_t);
    }
    st->stored_bits_per_element = st->elements ? (double)st->stored_bytes * 8.0 / (double)st->elements : 0.0;
    return KVPQ_OK;
}

kvpq_status kvpq_cache_get_params(const kvpq_cache *c, kvpq_cache_params *p) {
    if (!c || !p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_get_params: NULL argument");
    *p = c->p;
    return KVPQ_OK;
}
