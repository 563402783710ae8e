/* score.c — chunk evaluation and the scores of one chunk (NLL, KL against a base, top-1 agreement):
 * one implementation for `kvpq ppl`, calibrate's joint check and the layer sensitivities, so that
 * calibrate's holdout_kl is what `kvpq ppl --kl-base` reports for the same tokens (kvpq_model.h). */
#include <math.h>

#include "../core/internal.h"
#include "kvpq_model.h"

kvpq_status kvpq_eval_chunk(kvpq_model *m, kvpq_cache *c, const int32_t *toks, int n, int first, int batch,
                            float *out, float *scratch_row) {
    if (!m || !c || !toks || !out || !scratch_row || batch < 1 || first < 0 || first >= n)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_eval_chunk: NULL argument, batch %d < 1 or first %d not in "
                         "0..n-1 = %d", batch, first, n - 1);
    kvpq_model_info mi;
    KVPQ_TRY(kvpq_model_get_info(m, &mi));
    const int V = mi.n_vocab;
    kvpq_status s = kvpq_cache_truncate(c, 0);
    if (s != KVPQ_OK) return s;
    for (int p = 0; p < first && s == KVPQ_OK; p += batch) {
        int nb = first - p < batch ? first - p : batch;
        s = kvpq_model_eval(m, c, toks + p, nb, 0, scratch_row);
    }
    for (int p = first; p < n && s == KVPQ_OK; p += batch) {
        int nb = n - p < batch ? n - p : batch;
        s = kvpq_model_eval(m, c, toks + p, nb, 1, out + (size_t)(p - first) * V);
    }
    return s;
}

/* In place: a row of logits -> log-probabilities (log-softmax, sums in double). Returns the argmax. */
static int log_softmax(float *row, int V) {
    int best = 0;
    for (int i = 1; i < V; i++)
        if (row[i] > row[best]) best = i;
    double mx = row[best], sum = 0;
    for (int i = 0; i < V; i++) sum += exp((double)row[i] - mx);
    double lse = mx + log(sum);
    for (int i = 0; i < V; i++) row[i] = (float)((double)row[i] - lse);
    return best;
}

/* The sums of the scores are taken in a fixed order (blocks of SCORE_BLK rows, each summed in row
 * order by one thread, the blocks added in order), so the totals have the same bits whatever the
 * number of threads: an OpenMP reduction adds the threads' partials in the order they finish, and
 * calibrate's window choice compares these sums. */
enum { SCORE_BLK = 32, SCORE_NB = 256 };

typedef struct {
    double nll, nll2, kl;
    int64_t agree;
} score_part;

/* One row: log-softmax in place, its negative log-likelihood of next, and with base_lp its KL and
 * agreement; the argmax into *top when top is not NULL. */
static void score_row(float *lp, int V, int32_t next, const float *lb, int base_top, float *kl_out, int *top,
                      score_part *p) {
    const int t = log_softmax(lp, V);
    if (top) *top = t;
    if (next >= 0) {
        const double v = -(double)lp[next];
        p->nll += v;
        p->nll2 += v * v;
    }
    if (lb) {
        double kl = 0;
        for (int i = 0; i < V; i++) kl += exp((double)lb[i]) * ((double)lb[i] - (double)lp[i]);
        if (kl < 0) kl = 0; /* rounding: KL >= 0 */
        if (kl_out) *kl_out = (float)kl;
        p->kl += kl;
        p->agree += base_top >= 0 && t == base_top;
    }
}

static void score_rows(float *lp_all, int n_score, int V, const int32_t *next, int *top, const float *base_lp,
                       const int *base_top, float *kl_out, kvpq_score_sums *s) {
    for (int j0 = 0; j0 < n_score; j0 += SCORE_BLK * SCORE_NB) {
        score_part part[SCORE_NB];
        const int nb = (n_score - j0 + SCORE_BLK - 1) / SCORE_BLK < SCORE_NB ? (n_score - j0 + SCORE_BLK - 1) / SCORE_BLK
                                                                               : SCORE_NB;
#pragma omp parallel for schedule(static)
        for (int b = 0; b < nb; b++) {
            score_part p = {0};
            for (int j = j0 + b * SCORE_BLK; j < j0 + (b + 1) * SCORE_BLK && j < n_score; j++)
                score_row(lp_all + (size_t)j * V, V, next ? next[j] : -1, base_lp ? base_lp + (size_t)j * V : NULL,
                          base_lp && base_top ? base_top[j] : -1, kl_out ? kl_out + j : NULL, top ? top + j : NULL, &p);
            part[b] = p;
        }
        for (int b = 0; b < nb; b++) {
            s->nll += part[b].nll;
            s->nll2 += part[b].nll2;
            s->kl_sum += part[b].kl;
            s->agree += part[b].agree;
        }
    }
}

void kvpq_score_base(float *lp_all, int n_score, int V, const int32_t *next, int *top, kvpq_score_sums *s) {
    score_rows(lp_all, n_score, V, next, top, NULL, NULL, NULL, s);
}

void kvpq_score_test(float *lp_all, int n_score, int V, const int32_t *next, const float *base_lp, const int *base_top,
                    float *kl_out, kvpq_score_sums *s) {
    score_rows(lp_all, n_score, V, next, NULL, base_lp, base_top, kl_out, s);
}
