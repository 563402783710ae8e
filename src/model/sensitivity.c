/* sensitivity.c — what coding one layer's keys or values costs the model's next-token distribution
 * (kvpq_model_layer_sensitivity, kvpq_model.h): the measurements behind `kvpq calibrate --bits`. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "eval_hook.h"
#include "internal.h"

/* The VQ cache's batch of encoding (cache_vq.c VQ_FLUSH): the window overflows in steps of this. */
#define SENS_FLUSH 32

kvpq_sensitivity_params kvpq_sensitivity_params_default(void) {
    kvpq_sensitivity_params p = {.window = 128, .sinks = 0, .score_from = -1, .kinds = 3, .ref_cand = -1, .n_threads = 0};
    return p;
}

typedef struct {
    int n_head, n_head_kv, hd, window, sinks, swa;
    const float *k, *v;   /* (n, n_head_kv, hd) exact keys / values of the layer */
    const float *kr, *vr; /* reconstructions, or NULL where exact */
} mixed_attn;

/* End of the positions a VQ cache holding len positions keeps as codes (cache_vq.c vq_target_coded):
 * with S sinks its kind holds positions S.. as its own 0.., so the flush boundary counts from S. */
static int coded_upto(int window, int sinks, int len) {
    const int S = sinks < len ? sinks : len, in = len - S;
    if (in < window + SENS_FLUSH) return 0;
    return S + ((in - window) / SENS_FLUSH) * SENS_FLUSH;
}

static kvpq_status mixed_attend(void *user, int layer, int n, int pos0, const float *q, float *out) {
    (void)layer;
    const mixed_attn *a = user;
    const int H = a->n_head, hkv = a->n_head_kv, hd = a->hd, g = H / hkv, len = pos0 + n;
    const size_t row = (size_t)hkv * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    int bad = 0;
#pragma omp parallel reduction(| : bad)
    {
        float *sc = malloc(sizeof(float) * (size_t)len);
        double *acc = malloc(sizeof(double) * (size_t)hd);
        if (!sc || !acc) bad = 1;
#pragma omp for schedule(dynamic, 4)
        for (int ih = 0; ih < n * H; ih++) {
            if (!sc || !acc) continue;
            const int i = ih / H, h = ih % H, kvh = h / g, pos = pos0 + i;
            const int lo = a->swa > 0 && pos - a->swa + 1 > 0 ? pos - a->swa + 1 : 0;
            /* the cache as this query sees it: holding pos + 1 positions (kvpq_cache_append_attend) */
            const int nc = coded_upto(a->window, a->sinks, pos + 1);
            const float *qi = q + ((size_t)i * H + h) * hd;
            float mx = -INFINITY;
            for (int j = lo; j <= pos; j++) {
                const int coded = j >= a->sinks && j < nc;
                const float *kj = (coded && a->kr ? a->kr : a->k) + (size_t)j * row + (size_t)kvh * hd;
                float s = 0;
                for (int d = 0; d < hd; d++) s += qi[d] * kj[d];
                s *= scale;
                sc[j] = s;
                if (s > mx) mx = s;
            }
            double den = 0;
            for (int d = 0; d < hd; d++) acc[d] = 0;
            for (int j = lo; j <= pos; j++) {
                const int coded = j >= a->sinks && j < nc;
                const float *vj = (coded && a->vr ? a->vr : a->v) + (size_t)j * row + (size_t)kvh * hd;
                double w = exp((double)sc[j] - mx);
                den += w;
                for (int d = 0; d < hd; d++) acc[d] += w * vj[d];
            }
            float *o = out + ((size_t)i * H + h) * hd;
            for (int d = 0; d < hd; d++) o[d] = (float)(acc[d] / den);
        }
        free(sc);
        free(acc);
    }
    return bad ? kvpq__err(KVPQ_ERR_NOMEM, "sensitivity: out of memory") : KVPQ_OK;
}

/* For each window W in wins (n_w of them), the sum over the queries at positions first .. pos0+n-1
 * of this step (n queries from pos0) and over the query heads of |attn_W - attn_exact|^2, attn_W of
 * the query at pos having the positions [sinks, coded_upto(W, sinks, pos + 1)) (the cache as that
 * query sees it, kvpq_cache_append_attend) read from the reconstruction (a->kr / a->vr where not NULL). The coded sets of the windows are nested
 * prefixes, so one pass serves them all: with every score exact (a_j) and coded (b_j), and m their
 * maximum, attn_W = (X + D(nc_W)) / (x + d(nc_W)), X, x the exact softmax numerator and
 * denominator and D(t), d(t) the running sums over coded positions j < t of
 * e^(b_j - m) vb_j - e^(a_j - m) v_j and e^(b_j - m) - e^(a_j - m). Sums in double; err (n_w) is
 * added to. */
static kvpq_status window_errors(const mixed_attn *a, int n, int pos0, int first, const float *q, int n_w,
                                 const int *wins, double *err) {
    const int H = a->n_head, hkv = a->n_head_kv, hd = a->hd, g = H / hkv, len = pos0 + n;
    const size_t row = (size_t)hkv * hd;
    const double scale = 1.0 / sqrt((double)hd);
    const float *kb_ = a->kr ? a->kr : a->k, *vb_ = a->vr ? a->vr : a->v;
    int bad = 0;
    const int i0 = first > pos0 ? first - pos0 : 0;
    /* each query head's error in its own slot, summed below in query order: the same bits whatever
     * the threads and the schedule (per-thread partials added in arrival order were not) */
    double *eq = n > i0 ? calloc((size_t)(n - i0) * H * n_w, sizeof(double)) : NULL;
    if (n > i0 && !eq) return kvpq__err(KVPQ_ERR_NOMEM, "sensitivity: out of memory");
#pragma omp parallel reduction(| : bad)
    {
        double *sa = malloc(sizeof(double) * (size_t)len), *sb = malloc(sizeof(double) * (size_t)len);
        double *X = malloc(sizeof(double) * (size_t)hd * (2 + (size_t)n_w)), *Dv = X + hd, *Dw = X + 2 * (size_t)hd;
        double dw[16];
        if (!sa || !sb || !X) bad = 1;
#pragma omp for schedule(dynamic, 4)
        for (int ih = i0 * H; ih < n * H; ih++) {
            if (bad) continue;
            const int i = ih / H, h = ih % H, kvh = h / g, pos = pos0 + i;
            const int lo = a->swa > 0 && pos - a->swa + 1 > 0 ? pos - a->swa + 1 : 0;
            const int cs = lo > a->sinks ? lo : a->sinks; /* first position that can be coded */
            int nc[16]; /* per window, the coded end of the cache as this query sees it (pos + 1 held) */
            for (int w = 0; w < n_w; w++) nc[w] = coded_upto(wins[w], a->sinks, pos + 1);
            const float *qi = q + ((size_t)i * H + h) * hd;
            double mx = -INFINITY;
            int ce = cs; /* coded positions this query sees: [cs, ce) */
            for (int w = 0; w < n_w; w++) {
                int e = nc[w] < pos + 1 ? nc[w] : pos + 1;
                if (e > ce) ce = e;
            }
            for (int j = lo; j <= pos; j++) {
                const float *kj = a->k + (size_t)j * row + (size_t)kvh * hd;
                double s = 0;
                for (int d = 0; d < hd; d++) s += (double)qi[d] * kj[d];
                sa[j] = s * scale;
                if (sa[j] > mx) mx = sa[j];
                if (j >= cs && j < ce && !a->kr) {
                    sb[j] = sa[j]; /* exact keys (the values' measurement): the same sum */
                } else if (j >= cs && j < ce) {
                    const float *kr = kb_ + (size_t)j * row + (size_t)kvh * hd;
                    double t = 0;
                    for (int d = 0; d < hd; d++) t += (double)qi[d] * kr[d];
                    sb[j] = t * scale;
                    if (sb[j] > mx) mx = sb[j];
                }
            }
            double x = 0, dd = 0;
            for (int d = 0; d < hd; d++) X[d] = Dv[d] = 0;
            for (int j = lo; j <= pos; j++) {
                const float *vj = a->v + (size_t)j * row + (size_t)kvh * hd;
                const double wa = exp(sa[j] - mx);
                x += wa;
                for (int d = 0; d < hd; d++) X[d] += wa * vj[d];
            }
            for (int w = 0; w < n_w; w++) dw[w] = 0;
            for (int w = 0; w < n_w; w++)
                for (int d = 0; d < hd; d++) Dw[(size_t)w * hd + d] = 0;
            for (int j = cs; j < ce; j++) {
                const float *vj = a->v + (size_t)j * row + (size_t)kvh * hd;
                const float *vr = vb_ + (size_t)j * row + (size_t)kvh * hd;
                const double wa = exp(sa[j] - mx), wb = exp(sb[j] - mx);
                dd += wb - wa;
                for (int d = 0; d < hd; d++) Dv[d] += wb * vr[d] - wa * vj[d];
                for (int w = 0; w < n_w; w++)
                    if ((nc[w] < pos + 1 ? nc[w] : pos + 1) == j + 1) {
                        dw[w] = dd;
                        memcpy(Dw + (size_t)w * hd, Dv, sizeof(double) * (size_t)hd);
                    }
            }
            for (int w = 0; w < n_w; w++) {
                if ((nc[w] < pos + 1 ? nc[w] : pos + 1) <= cs) continue; /* nothing coded: exact */
                double e = 0;
                for (int d = 0; d < hd; d++) {
                    const double diff = (X[d] + Dw[(size_t)w * hd + d]) / (x + dw[w]) - X[d] / x;
                    e += diff * diff;
                }
                eq[(size_t)(ih - i0 * H) * n_w + w] = e;
            }
        }
        free(sa);
        free(sb);
        free(X);
    }
    if (!bad)
        for (size_t r = 0; r < (size_t)(n - i0) * H; r++)
            for (int w = 0; w < n_w; w++) err[w] += eq[r * n_w + w];
    free(eq);
    return bad ? kvpq__err(KVPQ_ERR_NOMEM, "sensitivity: out of memory") : KVPQ_OK;
}

kvpq_status kvpq_model_layer_sensitivity(kvpq_model *m, const int32_t *tokens, int n,
                                         const kvpq_codebook *const *cands, int n_cand,
                                         const kvpq_sensitivity_params *p, double *kl) {
    kvpq_sensitivity_params def = kvpq_sensitivity_params_default();
    if (!p) p = &def;
    if (!m || !tokens || !cands || !kl || n_cand < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: NULL argument or n_cand %d < 1", n_cand);
    kvpq_model_info mi;
    KVPQ_TRY(kvpq_model_get_info(m, &mi));
    if (n < 64 || n > mi.n_ctx_train)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: n = %d tokens: expected 64..%d", n,
                         mi.n_ctx_train);
    const int first = p->score_from < 0 ? n / 2 : p->score_from;
    if (p->ref_cand >= n_cand)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: ref_cand %d: expected < n_cand %d",
                         p->ref_cand, n_cand);
    if (first >= n - 1 || p->window < 0 || p->sinks < 0 || p->kinds < 1 || p->kinds > 3 || p->n_threads < 0)
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_model_layer_sensitivity: score_from %d, window %d, sinks %d, kinds %d, n_threads %d "
                         "(expected score_from < n - 1 = %d, window, sinks >= 0, kinds 1..3)",
                         p->score_from, p->window, p->sinks, p->kinds, p->n_threads, n - 1);
    if (p->n_windows < 0 || p->n_windows > 15 || (p->n_windows > 0 && (!p->windows || !p->kl_windows)))
        return kvpq__err(KVPQ_ERR_INVALID_ARG,
                         "kvpq_model_layer_sensitivity: n_windows %d (expected 0..15, with windows and kl_windows)",
                         p->n_windows);
    for (int w = 0; w < p->n_windows; w++)
        if (p->windows[w] < 0)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: windows[%d] = %d: expected >= 0", w,
                             p->windows[w]);
    for (int c = 0; c < n_cand; c++) {
        if (!cands[c]) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: cands[%d] is NULL", c);
        kvpq_codebook_params cp = kvpq_codebook_get_params(cands[c]);
        if (cp.n_layer != mi.n_layer || cp.n_head_kv != mi.n_head_kv || cp.head_dim != mi.head_dim)
            return kvpq__err(KVPQ_ERR_MISMATCH,
                             "kvpq_model_layer_sensitivity: cands[%d] has n_layer %d, n_head_kv %d, head_dim %d; the "
                             "model %d, %d, %d", c, cp.n_layer, cp.n_head_kv, cp.head_dim, mi.n_layer, mi.n_head_kv,
                             mi.head_dim);
    }
    const int L = mi.n_layer, E = mi.n_embd, V = mi.n_vocab, n_sc = n - 1 - first;
    const size_t row = (size_t)mi.n_head_kv * mi.head_dim;
    const int n_pad = (n + SENS_FLUSH - 1) / SENS_FLUSH * SENS_FLUSH;
    kvpq_status s = KVPQ_OK;
    kvpq_cache *fc = NULL, *vc = NULL;
    const int act = kvpq__model_act_reference(m); /* eval_hook.h: float32 activations */
    float *xs = malloc(sizeof(float) * (size_t)L * n * E);
    float *ks = malloc(sizeof(float) * (size_t)L * n * row), *vs = malloc(sizeof(float) * (size_t)L * n * row);
    float *kr = malloc(sizeof(float) * (size_t)n_pad * row), *vr = malloc(sizeof(float) * (size_t)n_pad * row);
    float *pad = malloc(sizeof(float) * (size_t)n_pad * row);
    const int ref = p->ref_cand, nw = p->n_windows, use_err = ref >= 0 || nw > 0;
    int wall[16]; /* the measured window first, then the others */
    wall[0] = p->window;
    for (int w = 0; w < nw; w++) wall[1 + w] = p->windows[w];
    const size_t qrow = (size_t)mi.n_head * mi.head_dim;
    float *qs = use_err ? malloc(sizeof(float) * (size_t)L * n * qrow) : NULL;
    double *err = use_err ? calloc((size_t)(1 + nw) * n_cand * 2 * L, sizeof(double)) : NULL;
    float *base = malloc(sizeof(float) * (size_t)(n - first) * V), *lp = malloc(sizeof(float) * (size_t)(n - first) * V);
    if (!xs || !ks || !vs || !kr || !vr || !pad || !base || !lp || (use_err && (!qs || !err))) {
        s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_model_layer_sensitivity: out of memory (%d layers x %d tokens)", L, n);
        goto done;
    }
    int saved_threads = omp_get_max_threads();
    if (p->n_threads > 0) omp_set_num_threads(p->n_threads);
    kvpq_cache_params cpar = kvpq_cache_params_default();
    cpar.type = KVPQ_CACHE_FP32;
    kvpq_model_cache_params(m, &cpar);
    cpar.max_seq = n;
    cpar.n_threads = p->n_threads;
    if ((s = kvpq_cache_new(&fc, &cpar)) != KVPQ_OK) goto restore;
    /* the full-precision pass: every layer's input, keys and values; the reference distributions */
    kvpq__eval_hook h0 = {.layer0 = 0, .save_x = xs, .save_k = ks, .save_v = vs, .save_q = qs, .save_tokens = n,
                          .attend_layer = -1};
    if ((s = kvpq__model_eval_hooked(m, fc, tokens, n, 0, first, base, &h0)) != KVPQ_OK) goto restore;
    kvpq_score_sums base_sums = {0};
    kvpq_score_base(base, n_sc, V, NULL, NULL, &base_sums); /* logits -> log-probabilities */
    const int kinds[2] = {p->kinds & 1, (p->kinds >> 1) & 1};
    const double total = (double)n_cand * L * (kinds[0] + kinds[1]);
    double done = 0;
    for (int c = 0; c < n_cand && s == KVPQ_OK; c++) {
        /* the candidate's reconstructions of every position: a VQ cache without a window (and
         * without a sliding window, so nothing is dropped), filled to a multiple of its batch */
        kvpq_cache_params vp = cpar;
        vp.type = KVPQ_CACHE_VQ;
        vp.codebook = cands[c];
        vp.window = 0;
        vp.sliding_window = 0;
        vp.swa_layers = NULL;
        vp.max_seq = n_pad;
        if ((s = kvpq_cache_new(&vc, &vp)) != KVPQ_OK) break;
        for (int l = 0; l < L && s == KVPQ_OK; l++) {
            const float *kl_ = ks + (size_t)l * n * row, *vl_ = vs + (size_t)l * n * row;
            s = kvpq_cache_append(vc, l, n, kl_, vl_);
            if (s == KVPQ_OK && n_pad > n) {
                for (int t = 0; t < n_pad - n; t++) memcpy(pad + (size_t)t * row, kl_ + (size_t)(n - 1) * row, sizeof(float) * row);
                s = kvpq_cache_append(vc, l, n_pad - n, pad, pad);
            }
        }
        for (int l = 0; l < L && s == KVPQ_OK; l++) {
            if ((s = kvpq_cache_read(vc, l, 0, n, kr, vr)) != KVPQ_OK) break;
            for (int kind = 0; kind < 2 && s == KVPQ_OK; kind++) {
                if (!kinds[kind]) continue;
                mixed_attn a = {.n_head = mi.n_head, .n_head_kv = mi.n_head_kv, .hd = mi.head_dim,
                                .window = p->window, .sinks = p->sinks,
                                .swa = cpar.sliding_window > 0 && (!cpar.swa_layers || cpar.swa_layers[l])
                                           ? cpar.sliding_window : 0,
                                .k = ks + (size_t)l * n * row, .v = vs + (size_t)l * n * row,
                                .kr = kind == 0 ? kr : NULL, .vr = kind == 1 ? vr : NULL};
                if (use_err) {
                    /* the layer's attention-output error over the scored queries, at every window
                     * (each query with the cache as it held pos + 1 positions), in steps of 512 */
                    double e[16] = {0};
                    for (int t0 = 0; t0 < n && s == KVPQ_OK; t0 += 512) {
                        int nb = n - t0 < 512 ? n - t0 : 512;
                        if (t0 + nb <= first) continue;
                        s = window_errors(&a, nb, t0, first, qs + ((size_t)l * n + t0) * qrow, 1 + nw, wall, e);
                    }
                    if (s != KVPQ_OK) break;
                    for (int w = 0; w <= nw; w++) err[(((size_t)w * n_cand + c) * 2 + kind) * L + l] = e[w];
                    if (ref >= 0 && c != ref) {
                        done += 1;
                        continue; /* scaled from the reference below */
                    }
                }
                kvpq__eval_hook h = {.layer0 = l, .x0 = xs + (size_t)l * n * E, .attend_layer = l,
                                     .attend = mixed_attend, .user = &a};
                if ((s = kvpq_cache_truncate(fc, 0)) != KVPQ_OK) break;
                if ((s = kvpq__model_eval_hooked(m, fc, tokens, n, 0, first, lp, &h)) != KVPQ_OK) break;
                kvpq_score_sums sums = {0}; /* as kvpq ppl --kl-base scores (fixed order: any threads) */
                kvpq_score_test(lp, n_sc, V, NULL, base, NULL, NULL, &sums);
                kl[((size_t)c * 2 + kind) * L + l] = sums.kl_sum / n_sc;
                done += 1;
                if (p->progress && p->progress(p->progress_user, "sensitivity", done, total)) {
                    s = kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_layer_sensitivity: cancelled");
                    break;
                }
            }
        }
        kvpq_cache_free(vc);
        vc = NULL;
    }
    if (s == KVPQ_OK && p->progress) p->progress(p->progress_user, "sensitivity", total, total); /* scaled ones too */
    if (s == KVPQ_OK && ref >= 0)
        for (int c = 0; c < n_cand; c++)
            for (int kind = 0; kind < 2; kind++)
                for (int l = 0; l < L && c != ref && kinds[kind]; l++) {
                    const double er = err[((size_t)ref * 2 + kind) * L + l], kr0 = kl[((size_t)ref * 2 + kind) * L + l];
                    kl[((size_t)c * 2 + kind) * L + l] = er > 0 ? kr0 * err[((size_t)c * 2 + kind) * L + l] / er : 0;
                }
    /* the other windows: scaled from the measured window by the same candidate's error ratio */
    for (int w = 0; s == KVPQ_OK && w < nw; w++)
        for (size_t i = 0; i < (size_t)n_cand * 2 * L; i++) {
            const double e0 = err[i], ew = err[(size_t)(1 + w) * n_cand * 2 * L + i];
            p->kl_windows[(size_t)w * n_cand * 2 * L + i] = e0 > 0 ? kl[i] * ew / e0 : (ew > 0 ? INFINITY : kl[i]);
        }
restore:
    if (p->n_threads > 0) omp_set_num_threads(saved_threads);
done:
    kvpq__model_act_restore(m, act);
    kvpq_cache_free(fc);
    kvpq_cache_free(vc);
    free(xs);
    free(ks);
    free(vs);
    free(kr);
    free(vr);
    free(pad);
    free(base);
    free(lp);
    free(qs);
    free(err);
    return s;
}
