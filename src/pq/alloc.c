/* alloc.c — bit allocation across layers (kvpq.h "bit allocation"): an exact multiple-choice
 * knapsack by dynamic programming, and the VQ cache's resident bytes per layer and kind, the weights
 * of that knapsack. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pq/pq_impl.h"

/* cache_vq.c's batch of encoding (VQ_FLUSH): the window overflows into codes in steps of this. */
#define ALLOC_FLUSH 32

kvpq_status kvpq_alloc_mckp(int n_groups, int n_choices, const double *cost, const int64_t *weight, int64_t budget,
                            int64_t max_units, int *choice, double *total_cost, int64_t *total_weight) {
    if (n_groups < 1 || n_choices < 1 || n_choices > 255 || !cost || !weight || !choice || budget < 0 || max_units < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_alloc_mckp: n_groups %d (>= 1), n_choices %d (1..255), budget %lld (>= 0), max_units "
                         "%lld (>= 0), or a NULL array", n_groups, n_choices, (long long)budget, (long long)max_units);
    /* Units are bounded: the tables take n_groups * (units + 1) bytes, and with budget and max_units
     * near INT64_MAX the sizes (U + 1) * sizeof(double) wrapped to a small allocation. */
    if (max_units > KVPQ_ALLOC_MAX_UNITS)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_alloc_mckp: max_units %lld: expected 0..%lld", (long long)max_units,
                         (long long)KVPQ_ALLOC_MAX_UNITS);
    if (max_units == 0) max_units = 1 << 16;
    /* ceil(budget / max_units) and ceil(w / q) below without forming budget + max_units - 1 (overflow) */
    const int64_t q = budget > max_units ? budget / max_units + (budget % max_units != 0) : 1; /* weight quantum */
    const int64_t U = budget / q;
    const size_t G = (size_t)n_groups, C = (size_t)n_choices;
    int any_ok = 1;
    for (size_t g = 0; g < G && any_ok; g++) {
        int ok = 0;
        for (size_t c = 0; c < C; c++) {
            double x = cost[g * C + c];
            if (isnan(x) || (isinf(x) && x < 0))
                return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_alloc_mckp: cost[%zu][%zu] = %g", g, c, x);
            ok |= weight[g * C + c] >= 0 && isfinite(x);
        }
        any_ok = ok;
    }
    if (!any_ok) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_alloc_mckp: a group has no usable choice");
    double *best = malloc(sizeof(double) * (size_t)(U + 1)), *next = malloc(sizeof(double) * (size_t)(U + 1));
    uint8_t *pick = malloc(G * (size_t)(U + 1));
    if (!best || !next || !pick) {
        free(best), free(next), free(pick);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_alloc_mckp: out of memory (%zu groups x %lld units)", G,
                         (long long)U + 1);
    }
    /* best[u]: least cost of the groups so far with total units <= u (INFINITY: none fits) */
    for (int64_t u = 0; u <= U; u++) best[u] = 0;
    for (size_t g = 0; g < G; g++) {
        for (int64_t u = 0; u <= U; u++) {
            double b = INFINITY;
            int bc = 255;
            for (size_t c = 0; c < C; c++) {
                int64_t w = weight[g * C + c];
                double x = cost[g * C + c];
                if (w < 0 || !isfinite(x)) continue;
                int64_t wu = w / q + (w % q != 0); /* rounded up: a pick within U units is within budget */
                if (wu > u) continue;
                double t = best[u - wu] + x;
                if (t < b) b = t, bc = (int)c;
            }
            next[u] = b;
            pick[g * (size_t)(U + 1) + (size_t)u] = (uint8_t)bc;
        }
        double *t = best;
        best = next;
        next = t;
    }
    kvpq_status s = KVPQ_OK;
    if (!isfinite(best[U])) {
        int64_t wmin = 0;
        for (size_t g = 0; g < G; g++) {
            int64_t m = INT64_MAX;
            for (size_t c = 0; c < C; c++)
                if (weight[g * C + c] >= 0 && isfinite(cost[g * C + c]) && weight[g * C + c] < m) m = weight[g * C + c];
            wmin = m > INT64_MAX - wmin ? INT64_MAX : wmin + m; /* saturated: only a message */
        }
        s = kvpq__err(KVPQ_ERR_CAPACITY, "kvpq_alloc_mckp: budget %lld is below the lightest allocation (%lld)",
                      (long long)budget, (long long)wmin);
    } else {
        int64_t u = U, tw = 0;
        double tc = 0;
        for (size_t g = G; g-- > 0;) {
            int c = pick[g * (size_t)(U + 1) + (size_t)u];
            choice[g] = c;
            u -= weight[g * C + (size_t)c] / q + (weight[g * C + (size_t)c] % q != 0);
            tw += weight[g * C + (size_t)c];
            tc += cost[g * C + (size_t)c];
        }
        if (total_cost) *total_cost = tc;
        if (total_weight) *total_weight = tw;
    }
    free(best);
    free(next);
    free(pick);
    return s;
}

/* Layer l's VQ page layout (kvpq__vq_page_layout: codes, norm-explicit scales in float16 or 8 bits,
 * the 8-bit scales' references, alignment), with page_tokens pt; a residual second key stage
 * (kvpq_codebook_key_pq2) adds its M codes to the key bit stream, as the cache packs them. */
static kvpq_status layer_layout(const kvpq_codebook *cb, int l, int H, int pt, kvpq__vq_page_layout *lay) {
    const kvpq_pq *kq = kvpq_codebook_pq_const(cb, l, 0), *kq2 = kvpq_codebook_key_pq2_const(cb, l);
    const kvpq_pq_params kp1 = kvpq_pq_get_params(kq);
    const size_t kcs = kq2 ? kvpq_codes_size(kp1.M + kvpq_pq_get_params(kq2).M, kp1.nbits) : kvpq_pq_code_size(kq);
    return kvpq__vq_page_layout_of(cb, l, H, pt, kcs, kvpq_pq_code_size(kvpq_codebook_pq_const(cb, l, 1)), lay);
}

kvpq_status kvpq_vq_cache_bytes(const kvpq_codebook *cb, const kvpq_cache_params *p, int len, int step,
                                size_t *layer_bytes, size_t *fixed_bytes, int64_t *elements) {
    if (!cb || !p || len < 0 || step < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_vq_cache_bytes: NULL argument, len %d or step %d", len, step);
    /* The ranges kvpq_cache_new takes: page_tokens 0 divided by zero below, and a window or max_seq
     * near INT_MAX overflowed window + ALLOC_FLUSH. */
    if (p->max_seq < 1 || p->max_seq > KVPQ_CACHE_MAX_SEQ || p->page_tokens < 1 || p->page_tokens > (1 << 20) ||
        p->window < 0 || p->sliding_window < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_vq_cache_bytes: max_seq %d (expected 1..%d), page_tokens %d (1..%d), window %d, "
                         "sliding_window %d (>= 0): out of range", p->max_seq, KVPQ_CACHE_MAX_SEQ, p->page_tokens,
                         1 << 20, p->window, p->sliding_window);
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    if (cp.n_layer != p->n_layer || cp.n_head_kv != p->n_head_kv || cp.head_dim != p->head_dim || p->max_seq < 1 ||
        len > p->max_seq)
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_vq_cache_bytes: codebook (n_layer %d, n_head_kv %d, head_dim %d) vs cache params (%d, "
                         "%d, %d), len %d, max_seq %d", cp.n_layer, cp.n_head_kv, cp.head_dim, p->n_layer,
                         p->n_head_kv, p->head_dim, len, p->max_seq);
    const int H = cp.n_head_kv, D = cp.head_dim;
    const int window = p->window < p->max_seq ? p->window : p->max_seq;
    const int pt = p->page_tokens < p->max_seq ? p->page_tokens : p->max_seq;
    /* attention sinks (clamped to max_seq as kvpq_cache_new does): positions [0, S) in fp16, allocated
     * with the cache; the VQ kind holds positions S.. as its own 0.. (cache.c) */
    const int S = p->sinks > 0 ? (p->sinks < p->max_seq ? p->sinks : p->max_seq) : 0;
    const int cap = window + ALLOC_FLUSH;
    /* every layer's page layout first (it checks the scale metadata), so that an error leaves
     * layer_bytes untouched */
    for (int l = 0; l < cp.n_layer; l++) {
        kvpq__vq_page_layout lay;
        KVPQ_TRY(layer_layout(cb, l, H, pt, &lay));
    }
    size_t fixed = 0;
    int64_t el = 0;
    for (int l = 0; l < cp.n_layer; l++) {
        const kvpq_pq *kq = kvpq_codebook_pq_const(cb, l, 0), *vq = kvpq_codebook_pq_const(cb, l, 1);
        const int sw = p->sliding_window > 0 && (!p->swa_layers || p->swa_layers[l]) ? p->sliding_window : 0;
        /* replay the appends of kvpq_model_eval in steps: pages allocated and dropped (cache.c: a
         * layer drops what the next query no longer sees, keep, counted past the sinks) */
        int n_coded = 0, n_pages = 0, first_page = 0;
        for (int cur = 0; cur < len;) {
            int nb = len - cur < step ? len - cur : step;
            if (sw > 0) {
                int keep = cur - sw + 1 > 0 ? cur - sw + 1 : 0;
                if (keep > S) {
                    keep -= S;
                    int upto = (keep < n_coded ? keep : n_coded) / pt;
                    if (upto > n_pages) upto = n_pages;
                    if (upto > first_page) first_page = upto;
                }
            }
            cur += nb;
            const int in = cur > S ? cur - S : 0; /* the kind's positions */
            n_coded = in < window + ALLOC_FLUSH ? 0 : ((in - window) / ALLOC_FLUSH) * ALLOC_FLUSH;
            int need = (n_coded + pt - 1) / pt;
            if (need > n_pages) n_pages = need;
        }
        const size_t held = (size_t)(n_pages - first_page) * pt * H; /* coded head vectors held */
        /* the pages as the cache lays them out (layer_layout): the value part is its codes, scales
         * and references, the key part the rest of the pages (alignment padding included) */
        const kvpq_pq *kq2 = kvpq_codebook_key_pq2_const(cb, l);
        kvpq__vq_page_layout lay;
        const size_t vcs = kvpq_pq_code_size(vq);
        KVPQ_TRY(layer_layout(cb, l, H, pt, &lay));
        const size_t pages = (size_t)(n_pages - first_page);
        const size_t vpart = held * (vcs + (size_t)lay.sb[1]) + (lay.sb[1] == 1 ? pages * H * sizeof(float) : 0);
        size_t kb = pages * lay.page_bytes - vpart + kvpq_pq_centroids_size(kq) * sizeof(float) +
                    (kq2 ? kvpq_pq_centroids_size(kq2) * sizeof(float) : 0);
        size_t vb = vpart + kvpq_pq_centroids_size(vq) * sizeof(float);
        if (layer_bytes) layer_bytes[2 * l] = kb, layer_bytes[2 * l + 1] = vb;
        fixed += 2 * (size_t)H * D * sizeof(float);                       /* smoothing factors, key mean */
        if (len > S) fixed += 2 * (size_t)cap * H * D * sizeof(uint16_t); /* the fp16 window ring */
        fixed += 2 * (size_t)S * H * D * sizeof(uint16_t);                 /* the sinks, K and V */
        el += 2 * (int64_t)(len - (first_page > 0 ? (int64_t)S + (int64_t)first_page * pt : 0)) * H * D;
    }
    if (fixed_bytes) *fixed_bytes = fixed;
    if (elements) *elements = el;
    return KVPQ_OK;
}
