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

/* One task of attend_any: a block of nr query rows of KV head kvh over positions [ts, te) (its
 * split). Row rr sees positions [lo[rr], lim[rr]), those from bnd[rr] on through src->exact
 * (bounds rise with the rows). The softmax state (m, d) and output end in the task's partial. */
typedef struct {
    const void *state;
    const attn_src *src;
    const kvpq_attn_kernels *kr;
    int layer, kvh, hd, nr, ts, te;
    int lim[RB], lo[RB], bnd[RB];
    float *m, *d;
} attn_task;

/* Per-thread workspace: Q and O (RB, head_dim) in either layout, S (RB, CH), kbuf and vbuf (CH,
 * head_dim), m and d (RB); with an exact source S2, kbuf2, vbuf2 again. */
typedef struct {
    float *Q, *O, *S, *kbuf, *vbuf, *m, *d, *S2, *kbuf2, *vbuf2;
} attn_ws;

static size_t ws_floats(int hd, int exact) {
    const size_t one = (size_t)RB * CH + (size_t)2 * CH * hd;
    return (size_t)RB * hd * 2 + one * (exact ? 2 : 1) + 2 * RB;
}

static attn_ws ws_carve(float *ws, int hd, int exact) {
    attn_ws w;
    w.Q = ws, w.O = w.Q + (size_t)RB * hd, w.S = w.O + (size_t)RB * hd, w.kbuf = w.S + (size_t)RB * CH;
    w.vbuf = w.kbuf + (size_t)CH * hd, w.m = w.vbuf + (size_t)CH * hd, w.d = w.m + RB;
    w.S2 = w.kbuf2 = w.vbuf2 = NULL;
    if (exact) w.S2 = w.d + RB, w.kbuf2 = w.S2 + (size_t)RB * CH, w.vbuf2 = w.kbuf2 + (size_t)CH * hd;
    return w;
}

/* Length of the chunk at t0: at most CH, never crossing a multiple of align or te. */
static int chunk_len(const attn_task *a, int t0) {
    int n = a->te - t0 < CH ? a->te - t0 : CH;
    const int to_edge = a->src->align - t0 % a->src->align;
    return n > to_edge ? to_edge : n;
}

/* K and V of the chunk as float rows: the kind's, or its halves converted into kbuf / vbuf. */
static void chunk_load(const attn_task *a, int t0, int n, float *kbuf, float *vbuf, const float **K, const float **V) {
    if (!a->src->load16) {
        a->src->load(a->state, a->layer, a->kvh, t0, n, kbuf, vbuf, K, V);
        return;
    }
    const uint16_t *K16, *V16;
    a->src->load16(a->state, a->layer, a->kvh, t0, n, &K16, &V16);
    a->kr->f16_to_f32(K16, kbuf, (size_t)n * a->hd);
    a->kr->f16_to_f32(V16, vbuf, (size_t)n * a->hd);
    *K = kbuf, *V = vbuf;
}

/* Rows [0, nx) that read part of the chunk [t0, t0 + n) through the exact source. */
static int exact_rows(const attn_task *a, int t0, int n) {
    int nx = 0;
    while (nx < a->nr && a->bnd[nx] < t0 + n) nx++;
    return nx;
}

/* First position of the chunk that row rr reads through exact. */
static int exact_from(const attn_task *a, int rr, int t0) { return a->bnd[rr] > t0 ? a->bnd[rr] - t0 : 0; }

/* ---- rows in rows (few rows: decoding) ---- */

/* The chunk's online-softmax step of row-major S (rows, CH): window-masked positions weigh 0. */
static void rows_softmax(const attn_task *a, float *S, float *O, int t0, int n) {
    const kvpq_attn_kernels *kr = a->kr;
    for (int rr = 0; rr < a->nr; rr++) {
        float *srow = S + (size_t)rr * CH;
        int nv = a->lim[rr] - t0 < n ? a->lim[rr] - t0 : n;
        const int lo = a->lo[rr] > t0 ? a->lo[rr] - t0 : 0; /* positions before the row's window */
        if (nv <= lo) {
            memset(srow, 0, (size_t)n * sizeof *srow);
            continue;
        }
        const float mx = kr->max(srow + lo, nv - lo);
        if (mx > a->m[rr]) {
            const float sc = expf(a->m[rr] - mx);
            a->d[rr] *= sc;
            kr->scale(O + (size_t)rr * a->hd, a->hd, sc);
            a->m[rr] = mx;
        }
        a->d[rr] += kr->exp_sum(srow + lo, nv - lo, a->m[rr]);
        memset(srow, 0, (size_t)lo * sizeof *srow);
        if (nv < n) memset(srow + nv, 0, (size_t)(n - nv) * sizeof *srow);
    }
}

static void task_rows(const attn_task *a, const attn_ws *w) {
    const kvpq_attn_kernels *kr = a->kr;
    const int hd = a->hd, nr = a->nr;
    for (int t0 = a->ts; t0 < a->te;) {
        const int n = chunk_len(a, t0);
        const float *K = NULL, *V = NULL, *KE = NULL, *VE = NULL;
        const uint16_t *K16 = NULL, *V16 = NULL;
        if (a->src->load16 && nr <= KVPQ_ATTN_F16_ROWS) { /* few rows: halves converted in registers */
            a->src->load16(a->state, a->layer, a->kvh, t0, n, &K16, &V16);
            kr->qk_f16(w->Q, nr, K16, n, hd, w->S, CH);
        } else {
            chunk_load(a, t0, n, w->kbuf, w->vbuf, &K, &V);
            kr->qk(w->Q, nr, K, n, hd, w->S, CH);
        }
        const int nx = exact_rows(a, t0, n);
        if (nx) { /* those rows' scores from the exact rows, from each row's bound on */
            a->src->exact(a->state, a->layer, a->kvh, t0, n, w->kbuf2, w->vbuf2, &KE, &VE);
            kr->qk(w->Q, nx, KE, n, hd, w->S2, CH);
            for (int rr = 0; rr < nx; rr++) {
                const int e = exact_from(a, rr, t0);
                memcpy(w->S + (size_t)rr * CH + e, w->S2 + (size_t)rr * CH + e, (size_t)(n - e) * sizeof(float));
            }
        }
        rows_softmax(a, w->S, w->O, t0, n);
        if (nx) { /* their weights split by source: from the bound on into S2 */
            for (int rr = 0; rr < nx; rr++) {
                const int e = exact_from(a, rr, t0);
                float *p = w->S + (size_t)rr * CH, *p2 = w->S2 + (size_t)rr * CH;
                memset(p2, 0, (size_t)e * sizeof *p2);
                memcpy(p2 + e, p + e, (size_t)(n - e) * sizeof *p2);
                memset(p + e, 0, (size_t)(n - e) * sizeof *p);
            }
            kr->pv(w->S2, nx, CH, VE, n, hd, w->O);
        }
        if (V16)
            kr->pv_f16(w->S, nr, CH, V16, n, hd, w->O);
        else
            kr->pv(w->S, nr, CH, V, n, hd, w->O);
        t0 += n;
    }
}

/* ---- rows in lanes (many rows: prefill) ---- */

/* Rows padded to whole vectors of the widest level (their scores all masked). */
static int lanes_rows(int nr) { return (nr + 15) / 16 * 16; }

/* Scores ST (CH, RB) of positions a row does not see set to -inf (softmax_t weighs them 0). */
static void lanes_mask(const attn_task *a, float *ST, int t0, int n) {
    const int R = lanes_rows(a->nr);
    for (int rr = 0; rr < R; rr++) {
        const int lo = rr < a->nr ? a->lo[rr] - t0 : n, lim = rr < a->nr ? a->lim[rr] - t0 : 0;
        if (lo <= 0 && lim >= n) continue;
        for (int t = 0; t < n; t++)
            if (t < lo || t >= lim) ST[(size_t)t * RB + rr] = -INFINITY;
    }
}

static void task_lanes(const attn_task *a, const attn_ws *w) {
    const kvpq_attn_kernels *kr = a->kr;
    const int hd = a->hd, R = lanes_rows(a->nr);
    for (int t0 = a->ts; t0 < a->te;) {
        const int n = chunk_len(a, t0);
        const float *K, *V, *KE = NULL, *VE = NULL;
        chunk_load(a, t0, n, w->kbuf, w->vbuf, &K, &V);
        kr->qk_t(w->Q, RB, R, K, n, hd, w->S, RB);
        const int nx = exact_rows(a, t0, n), RX = lanes_rows(nx);
        if (nx) { /* those rows' scores from the exact rows, from each row's bound on */
            a->src->exact(a->state, a->layer, a->kvh, t0, n, w->kbuf2, w->vbuf2, &KE, &VE);
            kr->qk_t(w->Q, RB, RX, KE, n, hd, w->S2, RB);
            for (int rr = 0; rr < nx; rr++)
                for (int t = exact_from(a, rr, t0); t < n; t++) w->S[(size_t)t * RB + rr] = w->S2[(size_t)t * RB + rr];
        }
        lanes_mask(a, w->S, t0, n);
        kr->softmax_t(w->S, RB, n, R, w->m, w->d, w->O, RB, hd);
        if (nx) { /* their weights split by source: from the bound on into S2, the rest of S2 zero */
            for (int t = 0; t < n; t++)
                for (int rr = 0; rr < RX; rr++) {
                    float *p = w->S + (size_t)t * RB + rr, *p2 = w->S2 + (size_t)t * RB + rr;
                    const int from_exact = rr < nx && t >= exact_from(a, rr, t0);
                    *p2 = from_exact ? *p : 0.0f;
                    if (from_exact) *p = 0.0f;
                }
            kr->pv_t(w->S2, RB, RX, VE, n, hd, w->O, RB);
        }
        kr->pv_t(w->S, RB, R, V, n, hd, w->O, RB);
        t0 += n;
    }
}

/* Blocks of at least this many rows run with the rows in lanes (prefill), fewer row by row. */
#define LANES_MIN_ROWS 16

static kvpq_status attend_any(const kvpq_cache_params *p, const void *state, const attn_src *src, int layer, int len,
                              int n_q, const float *q, float *out, float *lse) {
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

    const size_t wsf = ws_floats(hd, src->exact != NULL);
    const int n_tasks = hkv * nb * n_split;
    int nomem = 0;
    if (T > n_tasks) T = n_tasks;

#pragma omp parallel num_threads(T)
    {
        float *ws = aligned_alloc(64, (wsf * sizeof(float) + 63) / 64 * 64);
        if (!ws) {
#pragma omp atomic write
            nomem = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < n_tasks; task++) {
            if (!ws) continue;
            const int s = task % n_split, b = (task / n_split) % nb, kvh = task / n_split / nb;
            const attn_ws w = ws_carve(ws, hd, src->exact != NULL);
            const int r0 = b * RB, nr = rows - r0 < RB ? rows - r0 : RB, lanes = nr >= LANES_MIN_ROWS;
            attn_task a = {.state = state, .src = src, .kr = kr, .layer = layer, .kvh = kvh, .hd = hd, .nr = nr,
                           .m = w.m, .d = w.d};
            if (lanes) memset(w.Q, 0, (size_t)RB * hd * sizeof(float)); /* padded rows score 0, then masked */
            for (int rr = 0; rr < RB; rr++) a.m[rr] = -INFINITY, a.d[rr] = 0.0f;
            for (int rr = 0; rr < nr; rr++) {
                int i = (r0 + rr) / g, head = kvh * g + (r0 + rr) % g;
                const float *qi = q + ((size_t)i * p->n_head + head) * hd;
                for (int c = 0; c < hd; c++) w.Q[lanes ? (size_t)c * RB + rr : (size_t)rr * hd + c] = qi[c] * qscale;
                a.lim[rr] = len - n_q + i + 1;
                a.lo[rr] = W > 0 && a.lim[rr] - W > 0 ? a.lim[rr] - W : 0;
                a.bnd[rr] = src->exact ? src->bound[i] : len;
            }
            memset(w.O, 0, (size_t)RB * hd * sizeof(float));
            /* This split's token range of [lo[0], lim[nr-1]), in whole chunks. */
            const int tbeg = a.lo[0], tend = a.lim[nr - 1];
            int per = (tend - tbeg + n_split - 1) / n_split;
            per = (per + CH - 1) / CH * CH;
            a.ts = tbeg + s * per, a.te = a.ts + per < tend ? a.ts + per : tend;
            if (lanes) task_lanes(&a, &w);
            else task_rows(&a, &w);
            for (int rr = 0; rr < nr; rr++) {
                size_t idx = ((size_t)s * hkv + kvh) * rows + r0 + rr;
                part_m[idx] = a.m[rr];
                part_d[idx] = a.d[rr];
                for (int c = 0; c < hd; c++) part_o[idx * hd + c] = w.O[lanes ? (size_t)c * RB + rr : (size_t)rr * hd + c];
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
