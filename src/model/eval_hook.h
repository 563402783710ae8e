/* eval_hook.h — a forward pass with hooks, for measuring what one layer's KV-cache error costs
 * (sensitivity.c). Internal to libkvpq_model. */
#ifndef KVPQ_EVAL_HOOK_H
#define KVPQ_EVAL_HOOK_H

#include "kvpq_model.h"

typedef struct {
    /* Start at this layer (0: from the token embeddings). With layer0 > 0 the residual stream
     * entering layer0 comes from x0: (n, n_embd) for the n tokens evaluated; layers < layer0 are
     * neither run nor given anything in the cache. */
    int layer0;
    const float *x0;
    /* If not NULL: the input of every layer run is copied to save_x + (l * save_tokens + pos) * n_embd
     * (pos = the token's position), i.e. save_x is (n_layer, save_tokens, n_embd). */
    float *save_x;
    int save_tokens;
    /* If not NULL: every layer's keys (after RoPE) and values as appended to the cache, copied to
     * save_k / save_v + (l * save_tokens + pos) * n_head_kv * head_dim. */
    float *save_k, *save_v;
    /* If not NULL: every layer's queries as attention takes them (after RoPE and the query scale),
     * (n_layer, save_tokens, n_head * head_dim). */
    float *save_q;
    /* If not NULL: (n_layer, n_head_kv, head_dim), raised to max |q| over each KV head's query group
     * (q as save_q gets it) for every token run (kvpq_model_eval_query_absmax). */
    float *q_absmax;
    /* If attend is not NULL: layer attend_layer's attention is attend(user, layer, n, pos0, q, out)
     * instead of the cache's (the cache still receives the layer's keys and values); q: (n, n_head,
     * head_dim) after RoPE and the model's query scale, out: (n, n_head, head_dim), scale
     * 1/sqrt(head_dim) as kvpq_cache_attend. */
    int attend_layer;
    kvpq_status (*attend)(void *user, int layer, int n, int pos0, const float *q, float *out);
    void *user;
    int logits_from; /* set by kvpq__model_eval_hooked */
} kvpq__eval_hook;

/* Evaluate n tokens at positions pos0 .. pos0+n-1 (the cache must hold pos0 positions in every
 * layer >= hook->layer0) with the hooks; logits (may be NULL) gets the logits of tokens
 * logits_from .. n-1: (n - logits_from, n_vocab). No argument checks beyond the basic ones. */
kvpq_status kvpq__model_eval_hooked(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n, int pos0,
                                    int logits_from, float *logits, const kvpq__eval_hook *hook);

/* Measurements (calibration, layer sensitivities, their joint check) run the float32 activation
 * path, the reference `kvpq ppl` scores with: 8-bit activations (KVPQ_ACT=auto, the default of
 * generation) round every row after the layer a measurement perturbs differently from the
 * reference pass, a KL floor of their own that buried the small differences between candidates
 * (SmolLM2 `calibrate --bits 2.5` at ctx 4096: predicted KL 0.062 vs 0.026, held-out 0.048 vs
 * 0.032). Returns the mode to give back to kvpq__model_act_restore; one model serves one call at a
 * time (as kvpq_model_eval). */
int kvpq__model_act_reference(kvpq_model *m);
void kvpq__model_act_restore(kvpq_model *m, int act);

#endif
