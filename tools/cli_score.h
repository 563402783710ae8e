/* cli_score.h — the scoring of `kvpq ppl`, shared with `kvpq calibrate --bits` (its joint check of an
 * allocation, docs/allocation.md): one chunk run from an empty cache, its second half scored by
 * negative log-likelihood and, against a base cache's log-probabilities, KL(base || test) and top-1
 * agreement. One implementation, so calibrate's holdout_kl is what `kvpq ppl --kl-base` reports for
 * the same tokens. Uses kvpq_model.h only. */
#ifndef KVPQ_CLI_SCORE_H
#define KVPQ_CLI_SCORE_H

#include <stdint.h>

#include "kvpq_model.h"

/* Evaluate one chunk toks (n tokens) from an empty cache c (truncated to 0) in calls of at most
 * batch tokens: positions 0 .. first-1 without logits (scratch_row: (V) floats of scratch), then
 * the logits of positions first .. n-1 into out: (n - first, V) floats. Adds the seconds spent in
 * kvpq_model_eval to *seconds. Returns kvpq_model_eval's status. */
kvpq_status cli_eval_chunk(kvpq_model *m, kvpq_cache *c, const int32_t *toks, int n, int first, int batch, int V,
                           float *out, float *scratch_row, double *seconds);

/* Sums over scored positions (the caller divides by their count). */
typedef struct {
    double nll, nll2; /* sum of -log p(next token), and of its square (nats) */
    double kl_sum;    /* sum of KL(base || test) (nats); cli_score_test with a base only */
    int64_t agree;    /* positions whose argmax equals the base's; cli_score_test with a base only */
} cli_score_sums;

/* The base cache's rows: lp (n_score, V) logits -> log-probabilities in place (log-softmax, sums in
 * double), top[j] = argmax of row j, and the NLL of next[j] (the token row j predicts) added to *s. */
void cli_score_base(float *lp, int n_score, int V, const int32_t *next, int *top, cli_score_sums *s);

/* A test cache's rows: lp (n_score, V) logits -> log-probabilities in place, the NLL of next[j] added
 * to *s; with base_lp (n_score, V) log-probabilities and base_top (n_score) from cli_score_base
 * (NULL: no comparison), also KL(base || test) = sum_t p_base(t) (log p_base(t) - log p_test(t)) per
 * row (negative rounding results clamped to 0; written to kl_out[j] when kl_out is not NULL) and the
 * top-1 agreement. Both functions sum the rows in a fixed order (blocks of 32 rows, each in row
 * order, the blocks in order): the same bits whatever the number of threads or their timing. */
void cli_score_test(float *lp, int n_score, int V, const int32_t *next, const float *base_lp, const int *base_top,
                    float *kl_out, cli_score_sums *s);

#endif
