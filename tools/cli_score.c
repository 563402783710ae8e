/* cli_score.c — chunk evaluation and KL / top-1 scoring shared by ppl and calibrate (cli_score.h). */
#include <math.h>

#include "cli.h"
#include "cli_score.h"

kvpq_status cli_eval_chunk(kvpq_model *m, kvpq_cache *c, const int32_t *toks, int n, int first, int batch, int V,
                           float *out, float *scratch_row, double *seconds) {
    kvpq_status s = kvpq_cache_truncate(c, 0);
    if (s != KVPQ_OK) return s;
    double t0 = cli_now();
    for (int p = 0; p < first && s == KVPQ_OK; p += batch) {
        int nb = first - p < batch ? first - p : batch;
        s = kvpq_model_eval(m, c, toks + p, nb, 0, scratch_row);
    }
    for (int p = first; p < n && s == KVPQ_OK; p += batch) {
        int nb = n - p < batch ? n - p : batch;
        s = kvpq_model_eval(m, c, toks + p, nb, 1, out + (size_t)(p - first) * V);
    }
    *seconds += cli_now() - t0;
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

void cli_score_base(float *lp_all, int n_score, int V, const int32_t *next, int *top, cli_score_sums *s) {
    double nll = 0, nll2 = 0;
#pragma omp parallel for reduction(+ : nll, nll2) schedule(static)
    for (int j = 0; j < n_score; j++) {
        float *lp = lp_all + (size_t)j * V;
        top[j] = log_softmax(lp, V);
        double v = -(double)lp[next[j]];
        nll += v;
        nll2 += v * v;
    }
    s->nll += nll;
    s->nll2 += nll2;
}

void cli_score_test(float *lp_all, int n_score, int V, const int32_t *next, const float *base_lp, const int *base_top,
                    float *kl_out, cli_score_sums *s) {
    double nll = 0, nll2 = 0, kls = 0;
    int64_t agree = 0;
#pragma omp parallel for reduction(+ : nll, nll2, kls, agree) schedule(static)
    for (int j = 0; j < n_score; j++) {
        float *lp = lp_all + (size_t)j * V;
        int top = log_softmax(lp, V);
        double v = -(double)lp[next[j]];
        nll += v;
        nll2 += v * v;
        if (base_lp) {
            const float *lb = base_lp + (size_t)j * V;
            double kl = 0;
            for (int t = 0; t < V; t++) kl += exp((double)lb[t]) * ((double)lb[t] - (double)lp[t]);
            if (kl < 0) kl = 0; /* rounding: KL >= 0 */
            if (kl_out) kl_out[j] = (float)kl;
            kls += kl;
            agree += top == base_top[j];
        }
    }
    s->nll += nll;
    s->nll2 += nll2;
    s->kl_sum += kls;
    s->agree += agree;
}
