/* test_models_golden.c — golden outputs of the forward pass on the real Qwen2.5-Coder-1.5B (qwen2:
 * Q/K/V biases, NEOX RoPE, GQA 6:1, head_dim 128, Q4_K/Q6_K weights) and Gemma-3-270M (gemma3:
 * QK-norm, post-norms, GELU, sliding-window layers, MQA 4:1, head_dim 256, Q5_0/Q8_0/Q4_K/Q6_K):
 * the prompt's token ids, greedy tokens and the perplexity of the novel's first tokens, fp32 cache,
 * recorded from kvpq after bench/models_peer.py put its perplexity beside llama.cpp's on the same
 * token ids (docs/model.md). Small sizes: the Qwen forward pass on 2 cores is the slow part. Skips,
 * saying so, when a model file is missing (scripts/fetch_model.sh NAME fetches it). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpq_model.h"

#define TEXT_PATH KVPQ_SOURCE_DIR "/data/text/persuasion.txt"
#define PROMPT "The capital of France is"
/* 1e-3 relative: summation order (SIMD level, threads) moves the value far less; a wrong norm,
 * bias, RoPE or window moves it by percent or more. */
#define PPL_REL_TOL 1e-3

typedef struct {
    const char *file;
    int32_t prompt_ids[8]; /* llama-tokenize's ids of PROMPT for this file (BOS where the model adds it) */
    int n_prompt;
    int32_t greedy[8];     /* greedy continuation, fp32 cache */
    int n_greedy;
    int ppl_ctx;           /* one chunk of this many tokens of the novel, llama.cpp scoring */
    double ppl;
} golden;

static const golden QWEN = {
    .file = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
    .prompt_ids = {785, 6722, 315, 9625, 374}, .n_prompt = 5, /* no BOS: add_bos_token false */
    .greedy = {12095, 13, 12095}, .n_greedy = 3,             /* " Paris. Paris" */
    .ppl_ctx = 64, .ppl = 21.252792,
};

static const golden GEMMA = {
    .file = "gemma-3-270m-Q4_K_M.gguf",
    .prompt_ids = {2, 818, 5279, 529, 7001, 563}, .n_prompt = 6, /* <bos> The capital of France is */
    .greedy = {506, 5279, 529, 506, 2891, 529, 7001, 236761}, .n_greedy = 8, /* " the capital of the country of France." */
    .ppl_ctx = 128, .ppl = 91.277170,
};

static char *model_path(const golden *g) {
    static char p[512];
    snprintf(p, sizeof p, "%s/models/%s", KVPQ_SOURCE_DIR, g->file);
    return p;
}

static kvpq_model *load_or_skip(const golden *g, kvpq_model_info *mi) {
    FILE *f = fopen(model_path(g), "rb");
    if (!f) cr_skip_test("model %s missing (run scripts/fetch_model.sh)", model_path(g));
    fclose(f);
    setenv("KVPQ_ACT", "f32", 1); /* the goldens are the float32 path's (beside llama.cpp's in docs/model.md) */
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    kvpq_model *m = NULL;
    cr_assert_eq(kvpq_model_load(&m, model_path(g), &mp), KVPQ_OK, "load: %s", kvpq_last_error());
    kvpq_model_get_info(m, mi);
    return m;
}

static kvpq_cache *cache_for(const kvpq_model *m, int max_seq) {
    kvpq_cache_params cp = kvpq_cache_params_default();
    kvpq_model_cache_params(m, &cp);
    cp.type = KVPQ_CACHE_FP32;
    cp.max_seq = max_seq;
    cp.n_threads = 2;
    cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &cp), KVPQ_OK, "%s", kvpq_last_error());
    return c;
}

static int argmax(const float *x, int n) {
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static void check_greedy(const golden *g) {
    kvpq_model_info mi;
    kvpq_model *m = load_or_skip(g, &mi);
    int32_t ids[16];
    size_t n = 0;
    cr_assert_eq(kvpq_tokenize(m, PROMPT, strlen(PROMPT), mi.add_bos, 0, ids, 16, &n), KVPQ_OK, "%s",
                 kvpq_last_error());
    cr_assert_eq((int)n, g->n_prompt, "%s: prompt has %zu tokens, expected %d", g->file, n, g->n_prompt);
    for (int i = 0; i < g->n_prompt; i++) cr_assert_eq(ids[i], g->prompt_ids[i], "%s: prompt token %d", g->file, i);
    kvpq_cache *c = cache_for(m, g->n_prompt + g->n_greedy);
    float *logits = malloc((size_t)mi.n_vocab * sizeof *logits);
    cr_assert_eq(kvpq_model_eval(m, c, ids, g->n_prompt, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < g->n_greedy; i++) {
        int32_t t = argmax(logits, mi.n_vocab);
        cr_assert_eq(t, g->greedy[i], "%s: greedy token %d is %d, expected %d", g->file, i, t, g->greedy[i]);
        if (i + 1 < g->n_greedy)
            cr_assert_eq(kvpq_model_eval(m, c, &t, 1, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    }
    free(logits);
    kvpq_cache_free(c);
    kvpq_model_free(m);
}

/* llama.cpp's scoring of one chunk: first token BOS when the model adds one, NLL of tokens
 * ctx/2+1 .. ctx-1 given the logits before them. */
static void check_ppl(const golden *g) {
    kvpq_model_info mi;
    kvpq_model *m = load_or_skip(g, &mi);
    FILE *f = fopen(TEXT_PATH, "rb");
    cr_assert_not_null(f, "%s missing", TEXT_PATH);
    char buf[16384];
    size_t len = fread(buf, 1, sizeof buf, f);
    fclose(f);
    while (len > 0 && buf[len - 1] != '\n') len--; /* no UTF-8 sequence cut */
    int32_t *ids = malloc(8192 * sizeof *ids);
    size_t n = 0;
    cr_assert_eq(kvpq_tokenize(m, buf, len, mi.add_bos, 0, ids, 8192, &n), KVPQ_OK, "%s", kvpq_last_error());
    const int C = g->ppl_ctx;
    cr_assert_geq((int)n, C);
    if (mi.add_bos) ids[0] = mi.bos_id;
    kvpq_cache *c = cache_for(m, C);
    float *logits = malloc((size_t)C * mi.n_vocab * sizeof *logits);
    cr_assert_eq(kvpq_model_eval(m, c, ids, C, 1, logits), KVPQ_OK, "%s", kvpq_last_error());
    double nll = 0;
    int cnt = 0;
    for (int j = C / 2; j < C - 1; j++, cnt++) {
        const float *row = logits + (size_t)j * mi.n_vocab;
        double mx = row[argmax(row, mi.n_vocab)], s = 0;
        for (int v = 0; v < mi.n_vocab; v++) s += exp((double)row[v] - mx);
        nll += mx + log(s) - row[ids[j + 1]];
    }
    double ppl = exp(nll / cnt);
    cr_assert(fabs(ppl / g->ppl - 1) < PPL_REL_TOL, "%s: perplexity of the first %d tokens %.6f, recorded %.6f",
              g->file, C, ppl, g->ppl);
    free(logits), free(ids);
    kvpq_cache_free(c);
    kvpq_model_free(m);
}

Test(models_golden, qwen2_greedy_tokens) { check_greedy(&QWEN); }
Test(models_golden, qwen2_perplexity) { check_ppl(&QWEN); }
Test(models_golden, gemma3_greedy_tokens) { check_greedy(&GEMMA); }
Test(models_golden, gemma3_perplexity) { check_ppl(&GEMMA); }
