/* cache_attend.c — page lists and the CPU attention driver shared by the cache kinds. */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_cpu.h"
#include "internal.h"

/* ---- pages ---------------------------------------------------------------------------------- */

kvpq_status kvpq__pages_reserve(kvpq__pages *pl, int n) {
    if (n <= pl->n) return KVPQ_OK;
    const int want = n - pl->base; /* slots of the page table */
    if (want > pl->cap) {
        int cap = pl->cap ? pl->cap : 4;
        while (cap < want) cap *= 2;
        unsigned char **pg = realloc(pl->page, (size_t)cap * sizeof *pg);
        if (!pg) return kvpq__err(KVPQ_ERR_NOMEM, "cache: out of memory for a page table of %d pages", cap);
        pl->page = pg;
        pl->cap = cap;
    }
    while (pl->n < n) {
        void *p; /* zeroed (kvpq__pool_get): same bytes for the same cache, nothing leaked */
        KVPQ_TRY(kvpq__pool_get(pl->pool, pl->page_bytes, &p));
        pl->page[pl->n - pl->base] = p;
        pl->n++;
    }
    return KVPQ_OK;
}

void kvpq__pages_shrink(kvpq__pages *pl, int n) {
    if (n < 0) n = 0;
    while (pl->n > n && pl->n > pl->base) {
        pl->n--;
        kvpq__pool_put(pl->pool, pl->page[pl->n - pl->base], pl->page_bytes);
    }
    if (n <= pl->base) { /* an empty list holds nothing, as when new */
        free(pl->page);
        pl->page = NULL;
        pl->cap = 0;
        pl->n = pl->base = n;
    }
}

void kvpq__pages_drop_front(kvpq__pages *pl, int k) {
    if (k <= pl->base) return;
    if (k >= pl->n) {
        kvpq__pages_shrink(pl, pl->base);
        pl->n = pl->base = k;
        return;
    }
    for (int i = pl->base; i < k; i++) kvpq__pool_put(pl->pool, pl->page[i - pl->base], pl->page_bytes);
    memmove(pl->page, pl->page + (k - pl->base), (size_t)(pl->n - k) * sizeof *pl->page);
    pl->base = k;
}

void kvpq__pages_free(kvpq__pages *pl) { kvpq__pages_shrink(pl, 0); }

size_t kvpq__pages_bytes(const kvpq__pages *pl) {
    return (size_t)(pl->n - pl->base) * ((pl->page_bytes + 63) / 64 * 64) + (size_t)pl->cap * sizeof *pl->page;
}

kvpq_status kvpq__check_range(const kvpq_cache_params *p, const char *kind, const char *what, int layer, int pos0,
                              int n, const float *x, float max_abs) {
    const size_t hd = (size_t)p->head_dim, heads = (size_t)p->n_head_kv, total = (size_t)n * heads * hd;
    float amax = 0.0f;
    for (size_t i = 0; i < total; i++) amax = fmaxf(amax, fabsf(x[i]));
    if (amax <= max_abs) return KVPQ_OK;
    for (size_t i = 0; i < total; i++)
        if (fabsf(x[i]) > max_abs)
            return kvpq__err(KVPQ_ERR_INVALID_ARG,
                             "cache %s layer %d: %s value %g at position %d (head %d, dim %d) is beyond the "
                             "format's range +-%g (fp16 storage)",
                             kind, layer, what, (double)x[i], pos0 + (int)(i / (heads * hd)), (int)(i / hd % heads),
                             (int)(i % hd), (double)max_abs);
    return KVPQ_OK;
}

/* ---- attention driver ----------------------------------------------------------------------- */

#define RB 64 /* query rows per block: S (RB, CHUNK) and o (RB, head_dim) stay in L1/L2 */
#define CH KVPQ_ATTN_CHUNK

/* Where attend_any reads K and V: float rows (load) or halves (load16), chunks never crossing a
 * multiple of align; with exact, query i reads positions >= bound[i] from exact instead (a fused
 * append-attend's window states, kvpq__attend_cpu_split). */
typedef struct {
    kvpq__load_fn load;
    kvpq__load16_fn load16;
    kvpq__load_fn exact;
    const int *bound;
    int align;
} attn_src;

/* Rows [0, nx) of a chunk [t0, t0 + n) whose bounds fall inside or before it: the scores S2 from the
 * exact rows replace S from each row's bound on. */
static void split_scores(float *S, const float *S2, int nx, const int *bnd, int t0, int n) {
    for (int rr = 0; rr < nx; rr++) {
        const int a = bnd[rr] > t0 ? bnd[rr] - t0 : 0;
        memcpy(S + (size_t)rr * CH + a, S2 + (size_t)rr * CH + a, (size_t)(n - a) * sizeof *S);
    }
}

/* The weights of those rows split by source: before the bound stay in P (the rows of load), from
 * it on move to P2 (the rows of exact), zeros elsewhere. */
static void split_weights(float *P, float *P2, int nx, const int *bnd, int t0, int n) {
    for (int rr = 0; rr < nx; rr++) {
        const int a = bnd[rr] > t0 ? bnd[rr] - t0 : 0;
        float *p = P + (size_t)rr * CH, *p2 = P2 + (size_t)rr * CH;
        memset(p2, 0, (size_t)a * sizeof *p2);
        memcpy(p2 + a, p + a, (size_t)(n - a) * sizeof *p2);
        memset(p + a, 0, (size_t)(n - a) * sizeof *p);
    }
}

static kvpq_status attend_any(const kvpq_cache_params *p, const void *state, const attn_src *src, int layer, int len,
                              int n_q, const float *q, float *out, float *lse) {
    const kvpq__load_fn load = src->load;
    const kvpq__load16_fn load16 = src->load16;
    const int align = src->align;
    const int hd = p->head_dim, hkv = p->n_head_kv, g = p->n_head / p->n_head_kv;
    const int rows = n_q * g; /* query rows of one KV head: row r = (query r / g, head kvh*g + r % g) */
    const int nb = (rows + RB - 1) / RB;
    const kvpq_attn_kernels *kr = kvpq__attn_kernels();
    const float qscale = 1.0f / sqrtf((float)hd);
    const int W = kvpq__layer_window(p, layer); /* 0: every earlier position */
    int T = p->n_threads > 0 ? p->n_threads : omp_get_max_threads();
    if (T < 1) T = 1;

    /* Split the token range when (KV head, row block) pairs alone leave threads idle (decoding),
     * but keep each split at least a few chunks long so the merge stays negligible. */
    int n_split = 1, base = hkv * nb;
    if (base < 2 * T) {
        /* Smallest count giving at least 2 tasks per thread and a whole number of tasks per thread
         * (equal splits then finish together). */
        int a = base, b = T;
        while (b) {
            int r = a % b;
            a = b, b = r;
        }
        const int step = T / a; /* base * step is a multiple of T */
        n_split = step;
        while (base * n_split < 2 * T) n_split += step;
        int most = len / (4 * CH);
        if (most < 1) most = 1;
        if (n_split > most) n_split = most;
    }
    const size_t n_rows_all = (size_t)hkv * rows;
    const size_t n_part = (size_t)n_split * n_rows_all;
    float *part = malloc(n_part * (2 + (size_t)hd) * sizeof(float));
    if (!part) return kvpq__err(KVPQ_ERR_NOMEM, "cache attend: out of memory for %zu partial states", n_part);
    float *part_m = part, *part_d = part + n_part, *part_o = part + 2 * n_part; /* (n_split, hkv, rows[, hd]) */

    const size_t ws_one = (size_t)RB * CH + (size_t)2 * CH * hd; /* S, kbuf, vbuf; twice with exact */
    const size_t ws_floats = (size_t)RB * hd * 2 + ws_one * (src->exact ? 2 : 1) + 2 * RB;
    const int n_tasks = hkv * nb * n_split;
    int nomem = 0;
    if (T > n_tasks) T = n_tasks;

#pragma omp parallel num_threads(T)
    {
        float *ws = aligned_alloc(64, (ws_floats * sizeof(float) + 63) / 64 * 64);
        if (!ws) {
#pragma omp atomic write
            nomem = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < n_tasks; task++) {
            if (!ws) continue;
            const int s = task % n_split, b = (task / n_split) % nb, kvh = task / n_split / nb;
            float *Q = ws, *O = Q + (size_t)RB * hd, *S = O + (size_t)RB * hd, *kbuf = S + (size_t)RB * CH;
            float *vbuf = kbuf + (size_t)CH * hd, *m = vbuf + (size_t)CH * hd, *d = m + RB;
            float *S2 = d + RB, *kbuf2 = S2 + (size_t)RB * CH, *vbuf2 = kbuf2 + (size_t)CH * hd; /* with exact */
            int lim[RB], lo[RB], bnd[RB]; /* row rr sees positions [lo, lim), from bnd on through exact */
            const int r0 = b * RB, nr = rows - r0 < RB ? rows - r0 : RB;
            for (int rr = 0; rr < nr; rr++) {
                int i = (r0 + rr) / g, head = kvh * g + (r0 + rr) % g;
                const float *qi = q + ((size_t)i * p->n_head + head) * hd;
                for (int c = 0; c < hd; c++) Q[(size_t)rr * hd + c] = qi[c] * qscale;
                lim[rr] = len - n_q + i + 1;
                lo[rr] = W > 0 && lim[rr] - W > 0 ? lim[rr] - W : 0;
                bnd[rr] = src->exact ? src->bound[i] : len;
                m[rr] = -INFINITY;
                d[rr] = 0.0f;
            }
            memset(O, 0, (size_t)nr * hd * sizeof *O);
            /* This split's token range of [lo[0], lim[nr-1]), in whole chunks. */
            const int tbeg = lo[0], tend = lim[nr - 1];
            int per = (tend - tbeg + n_split - 1) / n_split;
            per = (per + CH - 1) / CH * CH;
            int ts = tbeg + s * per, te = ts + per < tend ? ts + per : tend;
            for (int t0 = ts; t0 < te;) {
                int n = te - t0 < CH ? te - t0 : CH;
                int to_edge = align - t0 % align;
                if (n > to_edge) n = to_edge;
                const float *K = NULL, *V = NULL;
                const uint16_t *K16 = NULL, *V16 = NULL;
                if (load16) {
                    load16(state, layer, kvh, t0, n, &K16, &V16);
                    if (nr <= KVPQ_ATTN_F16_ROWS) {
                        kr->qk_f16(Q, nr, K16, n, hd, S, CH);
                    } else { /* many rows: convert once, then the fp32 kernels */
                        kr->f16_to_f32(K16, kbuf, (size_t)n * hd);
                        kr->f16_to_f32(V16, vbuf, (size_t)n * hd);
                        K = kbuf, V = vbuf, K16 = V16 = NULL;
                        kr->qk(Q, nr, K, n, hd, S, CH);
                    }
                } else {
                    load(state, layer, kvh, t0, n, kbuf, vbuf, &K, &V);
                    kr->qk(Q, nr, K, n, hd, S, CH);
                }
                int nx = 0; /* rows [0, nx) read part of this chunk through exact (bounds rise with rows) */
                while (nx < nr && bnd[nx] < t0 + n) nx++;
                const float *KE = NULL, *VE = NULL;
                if (nx) {
                    src->exact(state, layer, kvh, t0, n, kbuf2, vbuf2, &KE, &VE);
                    kr->qk(Q, nx, KE, n, hd, S2, CH);
                    split_scores(S, S2, nx, bnd, t0, n);
                }
                for (int rr = 0; rr < nr; rr++) {
                    float *srow = S + (size_t)rr * CH;
                    int nv = lim[rr] - t0 < n ? lim[rr] - t0 : n;
                    int a = lo[rr] > t0 ? lo[rr] - t0 : 0; /* positions before the row's window */
                    if (nv <= a) {
                        memset(srow, 0, (size_t)n * sizeof *srow);
                        continue;
                    }
                    if (a > 0) { /* scores of the window only... */
                        srow += a;
                        nv -= a;
                    }
                    float mx = kr->max(srow, nv);
                    if (mx > m[rr]) {
                        float sc = expf(m[rr] - mx);
                        d[rr] *= sc;
                        kr->scale(O + (size_t)rr * hd, hd, sc);
                        m[rr] = mx;
                    }
                    d[rr] += kr->exp_sum(srow, nv, m[rr]);
                    if (a > 0) { /* ...and the positions before it weigh nothing */
                        srow -= a;
                        nv += a;
                        memset(srow, 0, (size_t)a * sizeof *srow);
                    }
                    if (nv < n) memset(srow + nv, 0, (size_t)(n - nv) * sizeof *srow);
                }
                if (nx) {
                    split_weights(S, S2, nx, bnd, t0, n);
                    kr->pv(S2, nx, CH, VE, n, hd, O);
                }
                if (V16)
                    kr->pv_f16(S, nr, CH, V16, n, hd, O);
                else
                    kr->pv(S, nr, CH, V, n, hd, O);
                t0 += n;
            }
            for (int rr = 0; rr < nr; rr++) {
                size_t idx = ((size_t)s * hkv + kvh) * rows + r0 + rr;
                part_m[idx] = m[rr];
                part_d[idx] = d[rr];
                memcpy(part_o + idx * hd, O + (size_t)rr * hd, (size_t)hd * sizeof(float));
            }
        }
        free(ws);
    }
    if (nomem) {
        free(part);
        return kvpq__err(KVPQ_ERR_NOMEM, "cache attend: out of memory for thread workspaces");
    }
    for (int kvh = 0; kvh < hkv; kvh++)
        for (int r = 0; r < rows; r++) {
            size_t i0 = (size_t)kvh * rows + r;
            kvpq_softmax_state st = {part_m[i0], part_d[i0]};
            float *o = part_o + i0 * hd;
            for (int s = 1; s < n_split; s++) {
                size_t is = ((size_t)s * hkv + kvh) * rows + r;
                kvpq_softmax_state sb = {part_m[is], part_d[is]};
                kvpq_softmax_merge(&st, o, &sb, part_o + is * hd, hd);
            }
            int i = r / g, head = kvh * g + r % g;
            float *dst = out + ((size_t)i * p->n_head + head) * hd;
            float inv = 1.0f / st.d; /* d >= 1: the row's max score contributes exp(0) */
            for (int c = 0; c < hd; c++) dst[c] = o[c] * inv;
            if (lse) lse[(size_t)i * p->n_head + head] = st.m + logf(st.d);
        }
    free(part);
    return KVPQ_OK;
}

kvpq_status kvpq__attend_cpu(const kvpq_cache_params *p, const void *state, kvpq__load_fn load, int align,
                             int layer, int len, int n_q, const float *q, float *out, float *lse) {
    const attn_src src = {.load = load, .align = align};
    return attend_any(p, state, &src, layer, len, n_q, q, out, lse);
}

kvpq_status kvpq__attend_cpu_split(const kvpq_cache_params *p, const void *state, kvpq__load_fn load,
                                   kvpq__load_fn exact, const int *bound, int layer, int len, int n_q, const float *q,
                                   float *out, float *lse) {
    const attn_src src = {.load = load, .exact = exact, .bound = bound, .align = 1 << 30};
    return attend_any(p, state, &src, layer, len, n_q, q, out, lse);
}

kvpq_status kvpq__attend_cpu_f16(const kvpq_cache_params *p, const void *state, kvpq__load16_fn load16, int align,
                                 int layer, int len, int n_q, const float *q, float *out, float *lse) {
    const attn_src src = {.load16 = load16, .align = align};
    return attend_any(p, state, &src, layer, len, n_q, q, out, lse);
}

kvpq_status kvpq__read_cpu(const kvpq_cache_params *p, const void *state, kvpq__load_fn load, int align,
                           int layer, int pos0, int n, float *k, float *v) {
    const int hd = p->head_dim, hkv = p->n_head_kv;
    float *buf = malloc((size_t)2 * CH * hd * sizeof(float));
    if (!buf) return kvpq__err(KVPQ_ERR_NOMEM, "cache read: out of memory");
    for (int kvh = 0; kvh < hkv; kvh++)
        for (int t0 = pos0; t0 < pos0 + n;) {
            int m = pos0 + n - t0 < CH ? pos0 + n - t0 : CH;
            int to_edge = align - t0 % align;
            if (m > to_edge) m = to_edge;
            const float *K, *V;
            load(state, layer, kvh, t0, m, buf, buf + (size_t)CH * hd, &K, &V);
            for (int t = 0; t < m; t++) {
                size_t dst = ((size_t)(t0 - pos0 + t) * hkv + kvh) * hd;
                if (k) memcpy(k + dst, K + (size_t)t * hd, (size_t)hd * sizeof(float));
                if (v) memcpy(v + dst, V + (size_t)t * hd, (size_t)hd * sizeof(float));
            }
            t0 += m;
        }
    free(buf);
    return KVPQ_OK;
}
