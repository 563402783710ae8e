/* calib_alloc.c — the per-layer bit allocation of a calibration (kvpq_calibration_allocate;
 * docs/allocation.md): a codebook per candidate preset (every layer, keys and values), what each
 * layer's keys / values cost at each candidate alone on held-out text
 * (kvpq_model_layer_sensitivity), a multiple-choice knapsack per fp16 window candidate under the
 * effective-bits budget at context ctx (kvpq_alloc_mckp over kvpq_vq_cache_bytes), the chosen
 * layers assembled into one codebook with the allocation in its metadata, and its joint check:
 * KL(fp16 || the codebook's cache) on a chunk never seen by k-means nor the sensitivities, scored as
 * `kvpq ppl --kl-base fp16` scores (kvpq_score_test). All in memory. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/internal.h"
#include "calib_impl.h"
#include "eval_hook.h"

enum { MAXU = 8, MAXC = 2 * MAXU };

/* The candidate presets: names[c] as given; a key candidate "P1+P2" is P1 (k1) with a residual
 * second stage P2 (k2, "" for single-stage candidates). With key_rope KVPQ_KEY_ROPE_CHOOSE the n_user
 * candidates of the list are followed by their twins coding keys before RoPE (rope[c] 1, named
 * "P@prerope"), key choices only: their values are the listed candidate's. */
typedef struct {
    char names[MAXC][48], k1[MAXC][16], k2[MAXC][16];
    unsigned char rope[MAXC];
    int n, n_user, vfix; /* vfix: the candidate equal to the recipe's values preset, or -1 */
    const char *stage2;  /* the one second-stage preset of the "+" candidates, or NULL */
} cand_set;

/* The joint check's state: the chunk and the fp16 cache's scores of it. */
typedef struct {
    int C, first, n_score, V;
    int32_t *tk;     /* (C); token 0 replaced by BOS when the model adds one (as ppl does) */
    float *base_lp;  /* (C - first, V) the fp16 cache's log-probabilities of the scored rows */
    float *lp, *row; /* scratch: (C - first, V), (V) */
    int *base_top;   /* (n_score) */
    double base_ppl;
} check_state;

typedef struct {
    kvpq_calibration *c;
    kvpq_codebook_recipe r;
    cand_set cs;
    kvpq_codebook *cc[MAXC];
    int L, NW, G, alloc_values, ref_cand;
    size_t nkl;          /* n_cand * 2 * L */
    double mse_k, mse_v; /* k-means MSE sums of the reference candidate (metadata) */
    double *kl;          /* (NW, n_cand, 2, L) predicted KL of each choice at each window */
    size_t *lb;          /* (NW, n_cand, L, 2) bytes of each choice at ctx */
    size_t fixed_w[16];
    int64_t elements;
    double *cost;        /* (G, n_cand) scratch of one knapsack */
    int64_t *weight;     /* (G, n_cand) */
    int *choice;         /* (NW, G) each window's knapsack choice */
    check_state ck;
    double t_kmeans, t_sens, t_check;
} alloc_state;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- candidates ---- */

static kvpq_status add_candidate(cand_set *cs, const char *name, size_t n, int head_dim, const char *values,
                                 int *nbits) {
    const int c = cs->n;
    snprintf(cs->names[c], sizeof cs->names[c], "%.*s", (int)n, name);
    const char *plus = strchr(cs->names[c], '+');
    const size_t n1 = plus ? (size_t)(plus - cs->names[c]) : n;
    if (n1 == 0 || n1 >= sizeof cs->k1[0] || (plus && (!plus[1] || strlen(plus + 1) >= sizeof cs->k2[0])))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates: '%s': expected PRESET or PRESET+PRESET",
                         cs->names[c]);
    memcpy(cs->k1[c], cs->names[c], n1);
    cs->k1[c][n1] = '\0';
    const size_t n2 = plus ? strlen(plus + 1) : 0;
    memcpy(cs->k2[c], plus ? plus + 1 : "", n2 + 1);
    kvpq_pq_params q, q2;
    if (kvpq_pq_params_preset(&q, cs->k1[c], head_dim) != KVPQ_OK)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates: %s", kvpq_last_error());
    if (*nbits >= 0 && q.nbits != *nbits)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates: %s has nbits %d, the others %d (a layer may "
                         "change only M)", cs->names[c], q.nbits, *nbits);
    *nbits = q.nbits;
    cs->n++;
    if (!plus) {
        if (!strcmp(cs->names[c], values)) cs->vfix = c;
        return KVPQ_OK;
    }
    if (kvpq_pq_params_preset(&q2, cs->k2[c], head_dim) != KVPQ_OK)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates (second stage): %s", kvpq_last_error());
    if (q2.nbits != q.nbits)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates: %s: the second stage has nbits %d, the first "
                         "%d (the two stages' tables are added as one)", cs->names[c], q2.nbits, q.nbits);
    if (cs->stage2 && strcmp(cs->stage2, cs->k2[c]))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates: second stages %s and %s: one second-stage "
                         "preset per file (k2.M); the first stage may differ", cs->stage2, cs->k2[c]);
    cs->stage2 = cs->k2[c];
    return KVPQ_OK;
}

static kvpq_status parse_candidates(const char *list, const char *values, int head_dim, int alloc_values,
                                    cand_set *cs) {
    memset(cs, 0, sizeof *cs);
    cs->vfix = -1;
    int nbits = -1, n_plain = 0;
    for (const char *p = list; *p;) {
        const size_t n = strcspn(p, ",");
        if (n == 0 || n >= 32 || cs->n == MAXU)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates '%s': expected up to %d comma-separated "
                             "presets", list, MAXU);
        KVPQ_TRY(add_candidate(cs, p, n, head_dim, values, &nbits));
        n_plain += !cs->k2[cs->n - 1][0];
        p += n;
        if (*p) p++;
    }
    if (cs->n < 1) return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates is empty");
    if (n_plain < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --candidates '%s': needs a single-stage preset too (values "
                         "have one stage)", list);
    if (!alloc_values && cs->vfix < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "calibrate: --values %s must be one of --candidates %s (values are not "
                         "allocated)", values, list);
    cs->n_user = cs->n;
    return KVPQ_OK;
}

/* KVPQ_KEY_ROPE_CHOOSE: each listed candidate's twin coding keys before RoPE. */
static void add_rope_twins(cand_set *cs) {
    for (int k = 0; k < cs->n_user; k++) {
        const int t = cs->n_user + k;
        char base[sizeof cs->names[k]];
        memcpy(base, cs->names[k], sizeof base); /* a name is < 32 characters (parse_candidates) */
        snprintf(cs->names[t], sizeof cs->names[t], "%.39s@prerope", base);
        memcpy(cs->k1[t], cs->k1[k], sizeof cs->k1[k]);
        memcpy(cs->k2[t], cs->k2[k], sizeof cs->k2[k]);
        cs->rope[t] = 1;
    }
    cs->n = 2 * cs->n_user;
}

/* Candidate k is a key choice only: a second key stage or keys before RoPE (values have one stage
 * and no rotation). */
static int key_only(const cand_set *cs, int k) { return cs->k2[k][0] != '\0' || cs->rope[k]; }

kvpq_status kvpq__calib_check_candidates(const char *list, const char *values, int head_dim, int alloc_values) {
    cand_set cs;
    return parse_candidates(list, values, head_dim, alloc_values, &cs);
}

/* The single-stage candidate of candidate k's first stage and RoPE side, or -1. */
static int plain_twin(const cand_set *cs, int k) {
    for (int j = 0; j < cs->n; j++)
        if (!cs->k2[j][0] && cs->rope[j] == cs->rope[k] && !strcmp(cs->k1[j], cs->k1[k])) return j;
    return -1;
}

/* A codebook per candidate, every layer (the forward pass served them all): the single-stage ones
 * first, then the "P1+P2" ones, which copy P1's keys and values from P1's own candidate when the list
 * has it and train only their second stage. */
static kvpq_status train_candidates(alloc_state *st) {
    const cand_set *cs = &st->cs;
    double mk[MAXC] = {0}, mv[MAXC] = {0};
    for (int pass = 0; pass < 2; pass++)
        for (int k = 0; k < cs->n; k++) {
            if ((cs->k2[k][0] != '\0') != pass) continue;
            kvpq_codebook_recipe b = st->r;
            b.keys = b.values = cs->k1[k];
            b.keys2 = cs->k2[k][0] ? cs->k2[k] : NULL;
            b.keys_layers = b.values_layers = NULL;
            if (st->r.key_rope == KVPQ_KEY_ROPE_CHOOSE) b.key_rope = cs->rope[k];
            const int twin = pass ? plain_twin(cs, k) : -1;
            KVPQ_TRY(kvpq__calib_make_codebook(st->c, &b, &st->cc[k]));
            KVPQ_TRY(kvpq__calib_train_layers(st->c, &b, st->cc[k], twin >= 0 ? st->cc[twin] : NULL, &mk[k], &mv[k]));
            if (twin >= 0) mv[k] = mv[twin]; /* the values were copied */
        }
    const int ref = cs->vfix >= 0 ? cs->vfix : 0; /* the metadata's mean MSEs */
    st->mse_k = mk[ref], st->mse_v = mv[ref];
    return KVPQ_OK;
}

/* ---- measurements ---- */

typedef struct {
    const kvpq_calibration *c;
    double offset, total;
} sens_progress_ctx;

static int sens_progress(void *user, const char *stage, double done, double total) {
    (void)stage;
    (void)total;
    const sens_progress_ctx *p = user;
    return kvpq__calib_progress(p->c, "sensitivity", p->offset + done, p->total) != KVPQ_OK;
}

/* The sensitivities' chunks: the hold-out's, and with holdout_repeat one more. */
static int n_holdout(const kvpq_calibration *c) { return c->hchunks + (c->o.alloc.holdout_repeat != 0); }

/* Chunk ch's weight in the sensitivities' mean: 1, the repeated chunk's holdout_repeat. */
static double chunk_weight(const kvpq_calibration *c, int ch) {
    return ch < c->hchunks ? 1.0 : (double)c->o.alloc.holdout_repeat;
}

/* Hold-out chunk ch into tk (hctx tokens, token 0 the BOS when the model adds one, as kvpq ppl
 * scores a chunk); ch == hchunks (holdout_repeat): the first chunk's first half, twice. */
static void holdout_chunk(const kvpq_calibration *c, int ch, int32_t *tk) {
    const int32_t *src = c->toks + c->n_avail + (size_t)(ch < c->hchunks ? ch : 0) * c->hctx;
    const int half = c->hctx / 2;
    memcpy(tk, src, sizeof *tk * (size_t)c->hctx);
    if (ch == c->hchunks) memcpy(tk + half, src, sizeof *tk * (size_t)(c->hctx - half));
    if (c->mi.add_bos) tk[0] = c->mi.bos_id;
}

/* st->kl of candidates c0 .. c0 + n - 1: the sensitivities of kinds (1 keys, 3 keys and values)
 * averaged over the held-out chunks, ref (among them; -1: all measured) the reference of the scaled
 * ones; the smallest window is measured, the others scaled (kvpq_sensitivity_params.windows). */
static kvpq_status measure_cands(alloc_state *st, int c0, int n, int kinds, int ref, sens_progress_ctx *pc) {
    const kvpq_calibration *c = st->c;
    const size_t per = (size_t)n * 2 * st->L; /* one window's (n, 2, L) table */
    double *klc = calloc(per * st->NW, sizeof *klc);
    int32_t *tk = malloc(sizeof *tk * (size_t)c->hctx);
    if (!klc || !tk) {
        free(klc), free(tk);
        return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    }
    kvpq_sensitivity_params sp = kvpq_sensitivity_params_default();
    sp.window = c->wins[0];
    sp.sinks = c->o.alloc.sinks;
    sp.windows = c->wins + 1;
    sp.n_windows = st->NW - 1;
    sp.kl_windows = klc + per;
    sp.n_threads = c->o.n_threads;
    sp.kinds = kinds;
    sp.ref_cand = ref;
    sp.progress = sens_progress;
    sp.progress_user = pc;
    kvpq_status s = KVPQ_OK;
    const int nch = n_holdout(c);
    double wsum = 0; /* the weights' sum, whole numbers: exact */
    for (int ch = 0; ch < nch; ch++) wsum += chunk_weight(c, ch);
    for (int ch = 0; ch < nch && s == KVPQ_OK; ch++, pc->offset += (double)n * st->L * (kinds == 3 ? 2 : 1)) {
        holdout_chunk(c, ch, tk);
        s = kvpq_model_layer_sensitivity(c->m, tk, c->hctx, (const kvpq_codebook *const *)st->cc + c0, n, &sp, klc);
        /* (klc * wt) / wsum, not klc * (wt / wsum): weights 0 and 1 keep the old klc / nch bit for bit */
        const double wt = chunk_weight(c, ch);
        for (int w = 0; s == KVPQ_OK && w < st->NW; w++)
            for (size_t i = 0; i < per; i++)
                st->kl[(size_t)w * st->nkl + (size_t)c0 * 2 * st->L + i] += klc[(size_t)w * per + i] * wt / wsum;
    }
    free(klc);
    free(tk);
    return s;
}

/* st->kl: the listed candidates' keys and values; with KVPQ_KEY_ROPE_CHOOSE their twins' keys too,
 * each side scaled from its own reference (the twins' value entries stay 0: key_only, never read). */
static kvpq_status measure(alloc_state *st) {
    const cand_set *cs = &st->cs;
    const int nu = cs->n_user, twins = cs->n > nu;
    sens_progress_ctx pc = {st->c, 0, (double)nu * st->L * (twins ? 3 : 2) * n_holdout(st->c)};
    KVPQ_TRY(measure_cands(st, 0, nu, 3, st->ref_cand, &pc));
    return twins ? measure_cands(st, nu, nu, 1, st->ref_cand, &pc) : KVPQ_OK;
}

/* st->lb, fixed_w, elements: each choice's bytes at context ctx, per window candidate. */
static kvpq_status cache_bytes(alloc_state *st) {
    const kvpq_calibration *c = st->c;
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = KVPQ_CACHE_VQ;
    kvpq_model_cache_params(c->m, &cp);
    cp.max_seq = c->o.ctx;
    cp.sinks = c->o.alloc.sinks;
    for (int w = 0; w < st->NW; w++) {
        cp.window = c->wins[w];
        for (int k = 0; k < st->cs.n; k++)
            KVPQ_TRY(kvpq_vq_cache_bytes(st->cc[k], &cp, c->o.ctx, 512, st->lb + ((size_t)w * st->cs.n + k) * 2 * st->L,
                                         &st->fixed_w[w], &st->elements));
    }
    return KVPQ_OK;
}

/* ---- the joint check ---- */

static void check_free(check_state *v) {
    free(v->tk);
    free(v->base_lp);
    free(v->lp);
    free(v->row);
    free(v->base_top);
    memset(v, 0, sizeof *v);
}

/* Evaluate chunk v->tk with a fresh cache of type t (codebook cb for vq; window and sinks as
 * kvpq_cache_params_resolve gives them: the codebook's alloc.window / alloc.sinks) into out. */
static kvpq_status check_eval(const kvpq_calibration *c, check_state *v, kvpq_cache_type t, const kvpq_codebook *cb,
                              float *out) {
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = t;
    cp.codebook = cb;
    KVPQ_TRY(kvpq_cache_params_resolve(&cp, -1, -1));
    kvpq_model_cache_params(c->m, &cp); /* shape and sliding window */
    cp.max_seq = v->C;
    cp.n_threads = c->o.n_threads;
    cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *cache = NULL;
    KVPQ_TRY(kvpq_cache_new(&cache, &cp));
    kvpq_status s = kvpq_eval_chunk(c->m, cache, v->tk, v->C, v->first, v->C, out, v->row);
    kvpq_cache_free(cache);
    return s;
}

/* The check's chunk (the tokens right after the k-means tokens) and the fp16 cache's scores of it. */
static kvpq_status check_init(const kvpq_calibration *c, check_state *v) {
    const int C = c->vctx, V = c->mi.n_vocab;
    memset(v, 0, sizeof *v);
    v->C = C, v->first = C / 2, v->n_score = C - 1 - C / 2, v->V = V;
    const size_t rows = (size_t)(C - v->first) * (size_t)V;
    v->tk = malloc(sizeof *v->tk * (size_t)C);
    v->base_lp = malloc(sizeof *v->base_lp * rows);
    v->lp = malloc(sizeof *v->lp * rows);
    v->row = malloc(sizeof *v->row * (size_t)V);
    v->base_top = malloc(sizeof *v->base_top * (size_t)v->n_score);
    if (!v->tk || !v->base_lp || !v->lp || !v->row || !v->base_top)
        return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory for the joint check at --verify-ctx %d (%.0f MiB "
                         "of logits)", C, 2.0 * (double)rows * sizeof(float) / 1048576.0);
    memcpy(v->tk, c->toks + c->n_use, sizeof *v->tk * (size_t)C);
    if (c->mi.add_bos) v->tk[0] = c->mi.bos_id;
    KVPQ_TRY(check_eval(c, v, KVPQ_CACHE_FP16, NULL, v->base_lp));
    kvpq_score_sums sums = {0};
    kvpq_score_base(v->base_lp, v->n_score, V, v->tk + v->first + 1, v->base_top, &sums);
    v->base_ppl = exp(sums.nll / v->n_score);
    return KVPQ_OK;
}

/* KL(fp16 || cb's cache) mean, top-1 agreement and perplexity on the check's chunk. */
static kvpq_status check_codebook(const kvpq_calibration *c, check_state *v, const kvpq_codebook *cb, double *kl,
                                  double *top1, double *ppl) {
    KVPQ_TRY(check_eval(c, v, KVPQ_CACHE_VQ, cb, v->lp));
    kvpq_score_sums sums = {0};
    kvpq_score_test(v->lp, v->n_score, v->V, v->tk + v->first + 1, v->base_lp, v->base_top, NULL, &sums);
    *kl = sums.kl_sum / (double)v->n_score; /* as kvpq ppl: kl_sum / scored tokens */
    *top1 = (double)sums.agree / (double)v->n_score;
    *ppl = exp(sums.nll / v->n_score);
    return KVPQ_OK;
}

/* ---- one budget ---- */

/* Fill the knapsack of window w (st->cost, st->weight); *budget, *pf: the bytes left for the
 * allocated groups and the predicted KL of the fixed values (alloc_values 0). */
static void knapsack_inputs(alloc_state *st, int w, double bits, double *budget, double *pf) {
    const cand_set *cs = &st->cs;
    const int L = st->L, n = cs->n;
    const double *klw = st->kl + (size_t)w * st->nkl;
    const size_t *lbw = st->lb + (size_t)w * n * 2 * L;
    *budget = bits * (double)st->elements / 8.0 - (double)st->fixed_w[w];
    *pf = 0;
    for (int g = 0; g < st->G; g++) {
        const int l = g % L, kind = g / L;
        for (int k = 0; k < n; k++) {
            /* a key-only candidate is not a value choice (+inf: kvpq_alloc_mckp's "unavailable"; a
             * large finite cost was still picked when P1's values were lighter) */
            st->cost[(size_t)g * n + k] = kind && key_only(cs, k) ? INFINITY : klw[((size_t)k * 2 + kind) * L + l];
            st->weight[(size_t)g * n + k] = (int64_t)lbw[((size_t)k * L + l) * 2 + kind];
        }
    }
    if (st->alloc_values) return;
    for (int l = 0; l < L; l++) {
        *budget -= (double)lbw[((size_t)cs->vfix * L + l) * 2 + 1];
        *pf += klw[((size_t)cs->vfix * 2 + 1) * L + l];
    }
}

/* The lightest allocation's bytes at window w (after knapsack_inputs(w)): what the user is told
 * when nothing fits. */
static double lightest_bytes(const alloc_state *st, int w) {
    const cand_set *cs = &st->cs;
    const int L = st->L, n = cs->n;
    double light = (double)st->fixed_w[w];
    for (int g = 0; g < st->G; g++) {
        double m = INFINITY;
        for (int k = 0; k < n; k++) /* not a key-only candidate for values */
            if (!(g >= L && key_only(cs, k)) && (double)st->weight[(size_t)g * n + k] < m)
                m = (double)st->weight[(size_t)g * n + k];
        light += m;
    }
    if (!st->alloc_values)
        for (int l = 0; l < L; l++) light += (double)st->lb[((size_t)w * n * 2 * L) + ((size_t)cs->vfix * L + l) * 2 + 1];
    return light;
}

/* Every window's knapsack for budget bits: rep->predicted_kl_w (+Inf where none fits), st->choice;
 * the least predicted KL (ties: the fewer bytes, then the smaller window) into *best_w (-1: none
 * fits; rep->lightest_bits then says what would). */
static void plan_windows(alloc_state *st, double bits, kvpq_alloc_report *rep, int *best_w) {
    double best_pred = INFINITY, light_min = INFINITY;
    int64_t best_bytes = INT64_MAX;
    *best_w = -1;
    for (int w = 0; w < st->NW; w++) {
        double budget, pf, pr = 0;
        int64_t used = 0;
        knapsack_inputs(st, w, bits, &budget, &pf);
        rep->predicted_kl_w[w] = INFINITY;
        if (budget >= 0 && kvpq_alloc_mckp(st->G, st->cs.n, st->cost, st->weight, (int64_t)budget, 0,
                                           st->choice + (size_t)st->G * w, &pr, &used) == KVPQ_OK) {
            rep->predicted_kl_w[w] = pr + pf;
            const int64_t bytes_w = (int64_t)st->fixed_w[w] + used;
            if (pr + pf < best_pred || (pr + pf == best_pred && bytes_w < best_bytes))
                best_pred = pr + pf, best_bytes = bytes_w, *best_w = w;
        } else {
            const double light = lightest_bytes(st, w);
            if (light < light_min) light_min = light;
        }
    }
    if (*best_w < 0) rep->lightest_bits = 8.0 * light_min / (double)st->elements;
}

/* Each layer's key and value candidate of window w's choice. */
static void layer_choices(const alloc_state *st, int w, int *kc, int *vc) {
    const int *chw = st->choice + (size_t)st->G * w;
    for (int l = 0; l < st->L; l++) {
        kc[l] = chw[l];
        vc[l] = st->alloc_values ? chw[st->L + l] : st->cs.vfix;
    }
}

/* The candidate most layers chose (the codebook's base preset). */
static int most_chosen(const int *ch, int L, int n) {
    int count[MAXC] = {0}, best = 0;
    for (int l = 0; l < L; l++) count[ch[l]]++;
    for (int k = 1; k < n; k++)
        if (count[k] > count[best]) best = k;
    return best;
}

/* Layer l of fin takes candidate kc's keys (both stages) and vc's values, and the shared smoothing and mean. */
static kvpq_status copy_layer(alloc_state *st, kvpq_codebook *fin, int l, int kc, int vc, int any2) {
    const kvpq_pq *kq = kvpq_codebook_pq_const(st->cc[kc], l, 0), *vq = kvpq_codebook_pq_const(st->cc[vc], l, 1);
    KVPQ_TRY(kvpq_codebook_set_layer_key_M(fin, l, kvpq_pq_get_params(kq).M));
    KVPQ_TRY(kvpq_codebook_set_layer_value_M(fin, l, kvpq_pq_get_params(vq).M));
    KVPQ_TRY(kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 0), kvpq_pq_centroids(kq), kvpq_pq_centroids_size(kq)));
    KVPQ_TRY(kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 1), kvpq_pq_centroids(vq), kvpq_pq_centroids_size(vq)));
    if (any2) KVPQ_TRY(kvpq_codebook_set_layer_key_stages(fin, l, st->cs.k2[kc][0] ? 2 : 1));
    if (st->cs.k2[kc][0]) { /* the chosen candidate's stage-two centroids */
        const kvpq_pq *kq2 = kvpq_codebook_key_pq2_const(st->cc[kc], l);
        KVPQ_TRY(kvpq_pq_set_centroids(kvpq_codebook_key_pq2(fin, l), kvpq_pq_centroids(kq2), kvpq_pq_centroids_size(kq2)));
    }
    /* the smoothing and mean of the keys' side of RoPE (every candidate of a side has the same);
     * a layer coding keys after RoPE in a file that codes some before has no rotation */
    const kvpq_codebook *side = st->cc[st->cs.rope[kc] ? st->cs.n_user : 0];
    const size_t row = (size_t)st->c->mi.n_head_kv * st->c->mi.head_dim;
    memcpy(kvpq_codebook_key_smooth(fin, l), kvpq_codebook_key_smooth_const(side, l), sizeof(float) * row);
    memcpy(kvpq_codebook_key_mean(fin, l), kvpq_codebook_key_mean_const(side, l), sizeof(float) * row);
    float *freq = kvpq_codebook_key_rope_freq(fin, l);
    if (freq && !st->cs.rope[kc] && st->r.key_rope == KVPQ_KEY_ROPE_CHOOSE)
        memset(freq, 0, sizeof(float) * (size_t)(kvpq_codebook_get_params(fin).key_rope_dims / 2));
    return KVPQ_OK;
}

/* Window w's allocation as one codebook: each layer takes its chosen candidates' trained quantizers.
 * *eff: its effective bits at ctx. */
static kvpq_status assemble(alloc_state *st, int w, const int *kc, const int *vc, kvpq_codebook **out, double *eff) {
    const cand_set *cs = &st->cs;
    const int L = st->L;
    int any2 = 0, any_rope = 0;
    for (int l = 0; l < L; l++) any2 |= cs->k2[kc[l]][0] != '\0', any_rope |= cs->rope[kc[l]];
    kvpq_codebook_recipe b = st->r;
    if (b.key_rope == KVPQ_KEY_ROPE_CHOOSE) b.key_rope = any_rope;
    b.keys = cs->k1[most_chosen(kc, L, cs->n)];
    b.keys2 = any2 ? cs->stage2 : NULL;
    b.values = cs->k1[most_chosen(vc, L, cs->n)];
    b.keys_layers = b.values_layers = NULL;
    KVPQ_TRY(kvpq__calib_make_codebook(st->c, &b, out));
    const size_t *lbb = st->lb + (size_t)w * cs->n * 2 * L;
    int64_t total = (int64_t)st->fixed_w[w];
    for (int l = 0; l < L; l++) {
        kvpq_status s = copy_layer(st, *out, l, kc[l], vc[l], any2);
        if (s != KVPQ_OK) {
            kvpq_codebook_free(*out);
            *out = NULL;
            return kvpq__err(s, "calibrate: assembling the codebook: %s", kvpq_last_error());
        }
        total += (int64_t)lbb[((size_t)kc[l] * L + l) * 2] + (int64_t)lbb[((size_t)vc[l] * L + l) * 2 + 1];
    }
    *eff = 8.0 * (double)total / (double)st->elements;
    return KVPQ_OK;
}

/* ---- metadata ---- */

/* A comma-separated list of at most cap - 1 characters (as the CLI wrote them). */
typedef struct {
    char *buf;
    size_t cap;
} meta_list;

static void list_add(meta_list *m, const char *item) {
    const size_t n = strlen(m->buf);
    snprintf(m->buf + n, m->cap - n, "%s%s", n ? "," : "", item);
}

/* "W:KL" per window candidate ("none": +Inf or NaN). */
static void window_list(const alloc_state *st, meta_list *m, const double *kl_w) {
    char buf[64];
    m->buf[0] = '\0';
    for (int w = 0; w < st->NW; w++) {
        if (isfinite(kl_w[w])) snprintf(buf, sizeof buf, "%d:%.4g", st->c->wins[w], kl_w[w]);
        else snprintf(buf, sizeof buf, "%d:none", st->c->wins[w]);
        list_add(m, buf);
    }
}

/* Per kind: the chosen presets, their KL, and the whole measured table at window w. */
static void choice_meta(const alloc_state *st, kvpq_codebook *fin, int w, const int *kc, const int *vc, meta_list *m) {
    const int L = st->L;
    const double *klb = st->kl + (size_t)w * st->nkl;
    char buf[64], key[64];
    for (int kind = 0; kind < 2; kind++) {
        const int *ch = kind ? vc : kc;
        m->buf[0] = '\0';
        for (int l = 0; l < L; l++) list_add(m, st->cs.names[ch[l]]);
        kvpq_codebook_set_meta(fin, kind ? "alloc.v" : "alloc.k", m->buf);
        m->buf[0] = '\0';
        for (int l = 0; l < L; l++) {
            snprintf(buf, sizeof buf, "%.4g", klb[((size_t)ch[l] * 2 + kind) * L + l]);
            list_add(m, buf);
        }
        kvpq_codebook_set_meta(fin, kind ? "alloc.kl.v" : "alloc.kl.k", m->buf);
        for (int k = 0; k < st->cs.n; k++) {
            if (kind && st->cs.rope[k]) continue; /* a RoPE twin's values are its listed candidate's */
            m->buf[0] = '\0';
            for (int l = 0; l < L; l++) {
                snprintf(buf, sizeof buf, "%.4g", klb[((size_t)k * 2 + kind) * L + l]);
                list_add(m, buf);
            }
            snprintf(key, sizeof key, "alloc.sens.%s.%s", kind ? "v" : "k", st->cs.names[k]);
            kvpq_codebook_set_meta(fin, key, m->buf);
        }
    }
}

static int measured_select(const kvpq_calibration *c) {
    return c->vctx > 0 && c->o.alloc.window_select == KVPQ_WINDOW_SELECT_MEASURED;
}

static int auto_select(const kvpq_calibration *c) {
    return c->vctx > 0 && c->o.alloc.window_select == KVPQ_WINDOW_SELECT_AUTO;
}

/* The allocation's metadata (docs/allocation.md), in the order the files have always had them. */
static kvpq_status alloc_meta(const alloc_state *st, kvpq_codebook *fin, const kvpq_alloc_report *rep, int w,
                              const int *kc, const int *vc, double pred, double eff) {
    const kvpq_calibration *c = st->c;
    meta_list m = {malloc((size_t)st->L * 48 + 64), (size_t)st->L * 48 + 64};
    if (!m.buf) return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    kvpq__calib_common_meta(c, &st->r, fin, st->mse_k, st->mse_v);
    kvpq__calib_meta_fmt(fin, "alloc.bits", "%g", rep->bits);
    kvpq__calib_meta_fmt(fin, "alloc.ctx", "%d", c->o.ctx);
    kvpq__calib_meta_fmt(fin, "alloc.window", "%d", c->wins[w]);
    char buf[64];
    m.buf[0] = '\0';
    for (int i = 0; i < st->NW; i++) snprintf(buf, sizeof buf, "%d", c->wins[i]), list_add(&m, buf);
    kvpq_codebook_set_meta(fin, "alloc.window_candidates", m.buf);
    window_list(st, &m, rep->predicted_kl_w); /* the predicted KL at each window ("none": nothing fits) */
    kvpq_codebook_set_meta(fin, "alloc.window_predicted_kl", m.buf);
    kvpq__calib_meta_fmt(fin, "alloc.sinks", "%d", c->o.alloc.sinks);
    kvpq_codebook_set_meta(fin, "alloc.candidates", c->o.alloc.candidates);
    kvpq_codebook_set_meta(fin, "alloc.method", "mckp-dp");
    kvpq_codebook_set_meta(fin, "alloc.sensitivity", st->ref_cand < 0 ? "full" : st->cs.names[st->ref_cand]);
    kvpq_codebook_set_meta(fin, "alloc.values", st->alloc_values ? "allocated" : "fixed");
    if (st->r.key_rope == KVPQ_KEY_ROPE_CHOOSE) kvpq_codebook_set_meta(fin, "alloc.key_rope", "per-layer");
    kvpq__calib_meta_fmt(fin, "alloc.holdout_tokens", "%d", c->hchunks * c->hctx);
    if (c->o.alloc.holdout_repeat) kvpq__calib_meta_fmt(fin, "alloc.holdout_repeat", "%d", c->o.alloc.holdout_repeat);
    kvpq__calib_meta_fmt(fin, "alloc.holdout_ctx", "%d", c->hctx);
    kvpq__calib_meta_fmt(fin, "alloc.predicted_kl", "%.6g", pred);
    kvpq__calib_meta_fmt(fin, "alloc.effective_bits", "%.6g", eff);
    choice_meta(st, fin, w, kc, vc, &m);
    if (c->vctx > 0)
        kvpq_codebook_set_meta(fin, "alloc.window_select",
                               measured_select(c) ? "measured" : auto_select(c) ? "auto" : "predicted");
    if (auto_select(c)) kvpq__calib_meta_fmt(fin, "alloc.window_trust", "%g", c->o.alloc.window_trust);
    free(m.buf);
    return KVPQ_OK;
}

/* The joint check's result in the codebook's metadata. */
static void check_meta(const alloc_state *st, kvpq_codebook *cb, double kl, double top1, double ppl) {
    kvpq__calib_meta_fmt(cb, "alloc.holdout_kl", "%.17g", kl);
    kvpq__calib_meta_fmt(cb, "alloc.holdout_top1", "%.17g", top1);
    kvpq__calib_meta_fmt(cb, "alloc.holdout_ppl", "%.6f", ppl);
    kvpq__calib_meta_fmt(cb, "alloc.holdout_ppl_base", "%.6f", st->ck.base_ppl);
    kvpq__calib_meta_fmt(cb, "alloc.verify_ctx", "%d", st->ck.C);
    kvpq__calib_meta_fmt(cb, "alloc.verify_start", "%zu", st->c->n_use);
    kvpq__calib_meta_fmt(cb, "alloc.verify_scored", "%d", st->ck.n_score);
    kvpq_codebook_set_meta(cb, "alloc.verify_base", "fp16");
}

/* ---- one budget: the windows tried, the one kept ---- */

typedef struct {
    kvpq_codebook *cb;
    double kl, top1, ppl, eff, pred; /* kl, top1, ppl: the joint check's (0 without one) */
    int w;
} tried;

/* Window w's allocation for the budget of rep: assembled, with its metadata, checked when the
 * calibration has a joint check. */
static kvpq_status try_window(alloc_state *st, kvpq_alloc_report *rep, int w, tried *x) {
    const int L = st->L;
    int *kc = malloc(sizeof *kc * 2 * (size_t)L);
    if (!kc) return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    int *vc = kc + L;
    layer_choices(st, w, kc, vc);
    *x = (tried){.pred = rep->predicted_kl_w[w], .w = w};
    kvpq_status s = assemble(st, w, kc, vc, &x->cb, &x->eff);
    if (s == KVPQ_OK) s = alloc_meta(st, x->cb, rep, w, kc, vc, x->pred, x->eff);
    free(kc);
    if (s == KVPQ_OK && st->c->vctx > 0) {
        const double t0 = now();
        s = check_codebook(st->c, &st->ck, x->cb, &x->kl, &x->top1, &x->ppl);
        st->t_check += now() - t0;
        if (s == KVPQ_OK) check_meta(st, x->cb, x->kl, x->top1, x->ppl);
        rep->measured_kl_w[w] = x->kl;
        rep->measured_top1_w[w] = x->top1;
        if (s == KVPQ_OK) s = kvpq__calib_progress(st->c, "check", 1, 1);
    }
    if (s != KVPQ_OK) kvpq_codebook_free(x->cb), x->cb = NULL;
    return s;
}

/* AUTO: after the first check, when the prediction of the chosen window is off its held-out KL by
 * more than window_trust, the AUTO_RECHECK windows of next-least predicted KL (where an allocation
 * fits) are checked too. Three in all picked the measured best of five in all six budgets of the
 * 2026-12-06 main job (docs/allocation.md) at 3/5 of the checks' cost. */
enum { AUTO_RECHECK = 2 };

static int listed(const int *a, int n, int v) {
    for (int i = 0; i < n; i++)
        if (a[i] == v) return 1;
    return 0;
}

/* tries[0] is x's window, the one checked first. */
static void auto_recheck(const alloc_state *st, kvpq_alloc_report *rep, const tried *x, int *tries, int *n_tries) {
    if (!(fabs(x->pred / x->kl - 1) > st->c->o.alloc.window_trust)) return;
    for (int k = 0; k < AUTO_RECHECK; k++) {
        int next = -1;
        for (int w = 0; w < st->NW; w++)
            if (!listed(tries, *n_tries, w) && isfinite(rep->predicted_kl_w[w]) &&
                (next < 0 || rep->predicted_kl_w[w] < rep->predicted_kl_w[next]))
                next = w;
        if (next < 0) break;
        tries[(*n_tries)++] = next;
        rep->rechecked = 1;
    }
}

static void report_init(const alloc_state *st, double bits, kvpq_alloc_report *rep) {
    *rep = (kvpq_alloc_report){.bits = bits, .effective_bits = NAN, .lightest_bits = NAN, .predicted_kl = NAN,
                               .window = -1, .predicted_window = -1, .holdout_kl = NAN, .holdout_top1 = NAN, .holdout_ppl = NAN,
                               .base_ppl = st->c->vctx > 0 ? st->ck.base_ppl : NAN, .n_windows = st->NW};
    for (int w = 0; w < st->NW; w++) {
        rep->windows[w] = st->c->wins[w];
        rep->measured_kl_w[w] = rep->measured_top1_w[w] = NAN;
    }
}

/* The codebook of one budget into *out (NULL when no allocation fits). */
static kvpq_status allocate_budget(alloc_state *st, double bits, kvpq_codebook **out, kvpq_alloc_report *rep) {
    const kvpq_calibration *c = st->c;
    const int measured = measured_select(c), auto_sel = auto_select(c);
    int best_w, tries[16], n_tries = 0;
    *out = NULL;
    report_init(st, bits, rep);
    plan_windows(st, bits, rep, &best_w);
    if (best_w < 0) return KVPQ_OK;
    rep->predicted_window = c->wins[best_w];
    for (int w = 0; measured && w < st->NW; w++)
        if (isfinite(rep->predicted_kl_w[w])) tries[n_tries++] = w;
    if (!measured) tries[n_tries++] = best_w;
    tried kept = {0}, x;
    for (int t = 0; t < n_tries; t++) {
        kvpq_status s = try_window(st, rep, tries[t], &x);
        if (s != KVPQ_OK) {
            kvpq_codebook_free(kept.cb);
            return s;
        }
        if (auto_sel && t == 0 && n_tries == 1) auto_recheck(st, rep, &x, tries, &n_tries);
        /* ties: the fewer effective bits, then the first checked (measured: the smaller window;
         * auto: the predicted choice) */
        if (!kept.cb || ((measured || auto_sel) && (x.kl < kept.kl || (x.kl == kept.kl && x.eff < kept.eff)))) {
            kvpq_codebook_free(kept.cb);
            kept = x;
        } else {
            kvpq_codebook_free(x.cb);
        }
    }
    if (n_tries > 1) { /* the kept window's file, with every window's measured KL */
        meta_list m = {malloc((size_t)st->L * 48 + 64), (size_t)st->L * 48 + 64};
        if (!m.buf) {
            kvpq_codebook_free(kept.cb);
            return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
        }
        window_list(st, &m, rep->measured_kl_w);
        kvpq_codebook_set_meta(kept.cb, "alloc.window_measured_kl", m.buf);
        free(m.buf);
    }
    rep->effective_bits = kept.eff, rep->predicted_kl = kept.pred, rep->window = c->wins[kept.w];
    if (c->vctx > 0) rep->holdout_kl = kept.kl, rep->holdout_top1 = kept.top1, rep->holdout_ppl = kept.ppl;
    *out = kept.cb;
    return KVPQ_OK;
}

/* ---- the whole allocation ---- */

static void state_free(alloc_state *st) {
    for (int k = 0; k < MAXC; k++) kvpq_codebook_free(st->cc[k]);
    free(st->kl);
    free(st->lb);
    free(st->cost);
    free(st->weight);
    free(st->choice);
    check_free(&st->ck);
}

/* Candidates parsed, the reference candidate of the scaled sensitivities, the tables allocated. */
static kvpq_status state_init(alloc_state *st, kvpq_calibration *c) {
    memset(st, 0, sizeof *st);
    st->c = c;
    st->r = kvpq__calib_recipe(c, NULL);
    st->L = c->mi.n_layer;
    st->NW = c->n_wins;
    st->alloc_values = c->o.alloc.alloc_values != 0;
    KVPQ_TRY(parse_candidates(c->o.alloc.candidates, st->r.values, c->mi.head_dim, st->alloc_values, &st->cs));
    const cand_set *cs = &st->cs;
    int ref = c->o.alloc.full_sensitivity ? -1 : (cs->vfix >= 0 ? cs->vfix : cs->n / 2);
    while (ref > 0 && cs->k2[ref][0]) ref--; /* a single-stage reference */
    while (ref >= 0 && cs->k2[ref][0]) ref++;
    st->ref_cand = ref; /* of the listed candidates; the RoPE twins' is its twin */
    if (st->r.key_rope == KVPQ_KEY_ROPE_CHOOSE) add_rope_twins(&st->cs);
    st->G = st->alloc_values ? 2 * st->L : st->L;
    st->nkl = (size_t)cs->n * 2 * st->L;
    st->kl = calloc(st->nkl * st->NW, sizeof *st->kl);
    st->lb = malloc(sizeof *st->lb * st->nkl * st->NW);
    st->cost = malloc(sizeof *st->cost * (size_t)st->G * cs->n);
    st->weight = malloc(sizeof *st->weight * (size_t)st->G * cs->n);
    st->choice = malloc(sizeof *st->choice * (size_t)st->G * st->NW);
    if (!st->kl || !st->lb || !st->cost || !st->weight || !st->choice)
        return kvpq__err(KVPQ_ERR_NOMEM, "calibrate: out of memory");
    return KVPQ_OK;
}

/* Candidates trained, sensitivities measured, bytes counted, the check's base scored. */
static kvpq_status state_measure(alloc_state *st) {
    double t0 = now();
    KVPQ_TRY(train_candidates(st));
    st->t_kmeans = now() - t0;
    t0 = now();
    KVPQ_TRY(measure(st));
    st->t_sens = now() - t0;
    KVPQ_TRY(cache_bytes(st));
    if (st->c->vctx > 0) {
        t0 = now();
        KVPQ_TRY(check_init(st->c, &st->ck));
        st->t_check += now() - t0;
    }
    return KVPQ_OK;
}

kvpq_status kvpq_calibration_allocate(kvpq_calibration *c, kvpq_codebook **out, kvpq_alloc_report *report) {
    if (!c || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_allocate: NULL argument");
    const kvpq_alloc_params *a = &c->o.alloc;
    if (a->n_bits < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_calibration_allocate: no budgets (the options' alloc.n_bits is 0)");
    for (int i = 0; i < a->n_bits; i++) out[i] = NULL;
    alloc_state st;
    const int act = kvpq__model_act_reference(c->m); /* eval_hook.h: float32 activations */
    kvpq_status s = state_init(&st, c);
    if (s == KVPQ_OK) s = state_measure(&st);
    int n_failed = 0;
    for (int i = 0; i < a->n_bits && s == KVPQ_OK; i++) {
        kvpq_alloc_report rep;
        s = allocate_budget(&st, a->bits[i], &out[i], &rep);
        rep.kmeans_seconds = st.t_kmeans, rep.sensitivity_seconds = st.t_sens, rep.check_seconds = st.t_check;
        if (report) report[i] = rep;
        n_failed += s == KVPQ_OK && !out[i];
    }
    state_free(&st);
    kvpq__model_act_restore(c->m, act);
    if (s != KVPQ_OK) {
        for (int i = 0; i < a->n_bits; i++) kvpq_codebook_free(out[i]), out[i] = NULL;
        return s;
    }
    if (n_failed)
        return kvpq__err(KVPQ_ERR_CAPACITY, "calibrate: %d of %d budgets fit no allocation at any window (their "
                         "reports give the lightest allocation's effective bits)", n_failed, a->n_bits);
    return KVPQ_OK;
}
