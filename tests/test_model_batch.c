/* test_model_batch.c — kvpq_model_eval_batch (several sequences in one forward pass) against each
 * sequence's own kvpq_model_eval on the real model (SmolLM2-135M-Instruct Q4_1): three prompts of
 * different lengths, the batched prompt step and 16 batched greedy decode steps; every cache kind of
 * a few; a batch larger than one internal step; bad input. Skips when the model file is missing. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpq_model.h"

#define MODEL_PATH KVPQ_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define GEMMA_PATH KVPQ_SOURCE_DIR "/models/gemma-3-270m-Q4_K_M.gguf" /* sliding window, Q4_K / Q6_K */
#define N_SEQ 3
#define N_DECODE 16
/* KVPQ_QUICK (the sanitizer run): 4 greedy steps, and the Gemma-3 and long-context cases left to the
 * Release run (scripts/test.sh runs both). */
static int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && *q && strcmp(q, "0") != 0;
}

/* Under the 8-bit activations (KVPQ_ACT=auto, the default, and q8) every row takes the path its own
 * eval takes: decode rows the tile-of-4 kernels and the prompts' rows (>= 32 tokens) the GEMM, whose
 * per-row quantization and per-(row, token) integer sums do not depend on the other rows. So the
 * logits are equal bit for bit (measured: max difference 0). Under KVPQ_ACT=f32, one decode row
 * alone takes the matvec kernels and a batch of rows the blocked matmul, which sum in another order:
 * rounding, relative 1e-6 .. 1e-5 after 30 layers, as test_model's decode-vs-prefill tolerance. */
#define F32_REL_TOL 2e-3

static const char *prompts[N_SEQ] = {
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning went "
    "out in his boat before the sun rose, and every evening came back with a story.",
    "def fibonacci(n):\n    ",
};

static kvpq_model *g_model;
static kvpq_model_info g_info;

static void load_path(const char *path, const char *act) {
    FILE *f = fopen(path, "rb");
    if (!f) cr_skip_test("model %s missing (run scripts/fetch_model.sh)", path);
    fclose(f);
    setenv("KVPQ_ACT", act, 1);
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    cr_assert_eq(kvpq_model_load(&g_model, path, &mp), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_model_get_info(g_model, &g_info);
}

static void load(const char *act) { load_path(MODEL_PATH, act); }

static void unload(void) {
    kvpq_model_free(g_model);
    g_model = NULL;
}

static kvpq_cache *new_cache_threads(kvpq_cache_type type, int max_seq, int n_threads) {
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = type;
    cr_assert_eq(kvpq_model_cache_params(g_model, &cp), KVPQ_OK);
    cp.max_seq = max_seq;
    cp.n_threads = n_threads;
    cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &cp), KVPQ_OK, "cache_new %s: %s", kvpq_cache_type_name(type), kvpq_last_error());
    return c;
}

static kvpq_cache *new_cache(kvpq_cache_type type, int max_seq) { return new_cache_threads(type, max_seq, 2); }

static int32_t *tokenize(const char *text, int *n) {
    size_t nt = 0;
    cr_assert_eq(kvpq_tokenize(g_model, text, strlen(text), g_info.add_bos, 0, NULL, 0, &nt), KVPQ_OK);
    int32_t *t = malloc(nt * sizeof *t);
    cr_assert_eq(kvpq_tokenize(g_model, text, strlen(text), g_info.add_bos, 0, t, nt, &nt), KVPQ_OK);
    *n = (int)nt;
    return t;
}

static int32_t argmax(const float *x, int n) {
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* max |a - b| / max |b| over n */
static double rel_maxdiff(const float *a, const float *b, size_t n) {
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return d / s;
}

/* The prompts, then N_DECODE greedy steps: batched (one kvpq_model_eval_batch per step) and each
 * sequence alone; the logits of every step compared (exact: tol 0), the greedy tokens equal. */
static void batch_equals_single(kvpq_cache_type type, double tol) {
    const int V = g_info.n_vocab, max_seq = 128;
    int n[N_SEQ];
    int32_t *tok[N_SEQ];
    kvpq_cache *cb[N_SEQ], *cs[N_SEQ];
    for (int i = 0; i < N_SEQ; i++) {
        tok[i] = tokenize(prompts[i], &n[i]);
        cb[i] = new_cache(type, max_seq);
        cs[i] = new_cache(type, max_seq);
    }
    cr_assert(n[0] < 32 && n[1] >= 32, "prompt lengths %d, %d: one of each activation class wanted", n[0], n[1]);
    float *lb = malloc((size_t)N_SEQ * V * sizeof *lb), *ls = malloc((size_t)N_SEQ * V * sizeof *ls);
    const int32_t *tp[N_SEQ] = {tok[0], tok[1], tok[2]};
    for (int step = 0; step <= (quick() ? 4 : N_DECODE); step++) {
        cr_assert_eq(kvpq_model_eval_batch(g_model, N_SEQ, cb, tp, n, lb), KVPQ_OK, "step %d: %s", step,
                     kvpq_last_error());
        for (int i = 0; i < N_SEQ; i++)
            cr_assert_eq(kvpq_model_eval(g_model, cs[i], tp[i], n[i], 0, ls + (size_t)i * V), KVPQ_OK, "%s",
                         kvpq_last_error());
        for (int i = 0; i < N_SEQ; i++) {
            const float *b = lb + (size_t)i * V, *s = ls + (size_t)i * V;
            double d = rel_maxdiff(b, s, (size_t)V);
            cr_expect(d <= tol, "%s, step %d, sequence %d: relative max diff %g (tolerance %g)",
                      kvpq_cache_type_name(type), step, i, d, tol);
            cr_assert_eq(kvpq_cache_seq_len(cb[i], g_info.n_layer - 1), kvpq_cache_seq_len(cs[i], 0));
            tok[i][0] = argmax(b, V); /* the next step evaluates the batch's greedy token ... */
            cr_expect_eq(tok[i][0], argmax(s, V), "step %d, sequence %d: greedy tokens differ", step, i);
            tp[i] = tok[i];
            n[i] = 1; /* ... one token per sequence */
        }
    }
    for (int i = 0; i < N_SEQ; i++) {
        kvpq_cache_free(cb[i]);
        kvpq_cache_free(cs[i]);
        free(tok[i]);
    }
    free(lb);
    free(ls);
}

Test(model_batch, equals_each_sequence_alone_fp32) {
    load("auto");
    batch_equals_single(KVPQ_CACHE_FP32, 0);
    unload();
}

Test(model_batch, equals_each_sequence_alone_compressed_caches) {
    load("auto");
    batch_equals_single(KVPQ_CACHE_Q8_0, 0);
    batch_equals_single(KVPQ_CACHE_KIVI2, 0);
    unload();
}

Test(model_batch, equals_each_sequence_alone_q8) {
    load("q8");
    batch_equals_single(KVPQ_CACHE_FP32, 0);
    unload();
}

Test(model_batch, close_to_each_sequence_alone_f32_activations) {
    load("f32");
    batch_equals_single(KVPQ_CACHE_FP32, F32_REL_TOL);
    unload();
}

/* Gemma 3: sliding-window layers (their own rope base, a windowed cache), query/key norms, Q4_K
 * and Q6_K weights. */
Test(model_batch, equals_each_sequence_alone_gemma3) {
    if (quick()) cr_skip_test("KVPQ_QUICK: covered by the Release run");
    load_path(GEMMA_PATH, "auto");
    cr_assert_gt(g_info.n_swa_layers, 0);
    batch_equals_single(KVPQ_CACHE_FP32, 0);
    unload();
}

/* More rows than one internal step (512): two 300-token sequences and a one-token one run in several
 * steps, each sequence cut as its own eval cuts it. */
Test(model_batch, more_rows_than_one_step) {
    load("auto");
    const int V = g_info.n_vocab, n_long = 300;
    int32_t *a = malloc(n_long * sizeof *a), *b = malloc(n_long * sizeof *b);
    for (int t = 0; t < n_long; t++) {
        a[t] = (int32_t)((t * 7919 + 13) % V);
        b[t] = (int32_t)((t * 104729 + 5) % V);
    }
    int32_t one = 504;
    kvpq_cache *cb[3] = {new_cache(KVPQ_CACHE_FP32, 512), new_cache(KVPQ_CACHE_FP32, 512), new_cache(KVPQ_CACHE_FP32, 512)};
    const int32_t *tp[3] = {a, &one, b};
    int n[3] = {n_long, 1, n_long};
    float *lb = malloc((size_t)3 * V * sizeof *lb), *ls = malloc((size_t)V * sizeof *ls);
    cr_assert_eq(kvpq_model_eval_batch(g_model, 3, cb, tp, n, lb), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < 3; i++) {
        kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, 512);
        cr_assert_eq(kvpq_model_eval(g_model, c, tp[i], n[i], 0, ls), KVPQ_OK);
        cr_expect_eq(rel_maxdiff(lb + (size_t)i * V, ls, (size_t)V), 0, "sequence %d", i);
        cr_expect_eq(kvpq_cache_seq_len(cb[i], 0), n[i]);
        kvpq_cache_free(c);
        kvpq_cache_free(cb[i]);
    }
    free(a);
    free(b);
    free(lb);
    free(ls);
    unload();
}

/* Long contexts (> 512 positions: the cache's attention splits a decode row's positions among the
 * threads) and caches with n_threads 0 (OpenMP's count): the segments' attention runs side by side,
 * each on one thread, and its split must still be the one the sequence gets alone. */
Test(model_batch, long_contexts_split_attention_as_alone) {
    if (quick()) cr_skip_test("KVPQ_QUICK: covered by the Release run");
    load("auto");
    const int V = g_info.n_vocab, n_long = 600, n_seq = 3;
    kvpq_cache *cb[3], *cs[3];
    int32_t *tok[3], last[3];
    const int32_t *tp[3];
    int n[3];
    float *lb = malloc((size_t)n_seq * V * sizeof *lb), *ls = malloc((size_t)V * sizeof *ls);
    for (int i = 0; i < n_seq; i++) {
        tok[i] = malloc(n_long * sizeof *tok[i]);
        for (int t = 0; t < n_long; t++) tok[i][t] = (int32_t)((t * 7919 + 131 * i + 13) % V);
        cb[i] = new_cache_threads(KVPQ_CACHE_FP32, 1024, 0);
        cs[i] = new_cache_threads(KVPQ_CACHE_FP32, 1024, 0);
        cr_assert_eq(kvpq_model_eval(g_model, cb[i], tok[i], n_long - 8 * i, 0, ls), KVPQ_OK);
        cr_assert_eq(kvpq_model_eval(g_model, cs[i], tok[i], n_long - 8 * i, 0, ls), KVPQ_OK);
        last[i] = tok[i][0];
        tp[i] = &last[i];
        n[i] = 1;
    }
    for (int step = 0; step < 4; step++) {
        cr_assert_eq(kvpq_model_eval_batch(g_model, n_seq, cb, tp, n, lb), KVPQ_OK, "%s", kvpq_last_error());
        for (int i = 0; i < n_seq; i++) {
            cr_assert_eq(kvpq_model_eval(g_model, cs[i], tp[i], 1, 0, ls), KVPQ_OK);
            cr_expect_eq(rel_maxdiff(lb + (size_t)i * V, ls, (size_t)V), 0, "step %d, sequence %d", step, i);
            last[i] = argmax(ls, V);
        }
    }
    for (int i = 0; i < n_seq; i++) {
        kvpq_cache_free(cb[i]);
        kvpq_cache_free(cs[i]);
        free(tok[i]);
    }
    free(lb);
    free(ls);
    unload();
}

/* Bad input: a named error, and no cache changed. */
Test(model_batch, rejects_bad_input_and_leaves_the_caches_unchanged) {
    load("auto");
    const int V = g_info.n_vocab;
    float *lg = malloc((size_t)2 * V * sizeof *lg);
    kvpq_cache *c[2] = {new_cache(KVPQ_CACHE_FP32, 8), new_cache(KVPQ_CACHE_FP32, 8)};
    int32_t t2[2] = {504, 2365}, t1[1] = {504};
    const int32_t *tp[2] = {t2, t1};
    int n[2] = {2, 1};
    cr_assert_eq(kvpq_model_eval_batch(g_model, 2, c, tp, n, lg), KVPQ_OK, "%s", kvpq_last_error());

    cr_expect_eq(kvpq_model_eval_batch(g_model, 0, c, tp, n, lg), KVPQ_ERR_INVALID_ARG);
    cr_expect(strstr(kvpq_last_error(), "n_seq"), "%s", kvpq_last_error());
    cr_expect_eq(kvpq_model_eval_batch(NULL, 2, c, tp, n, lg), KVPQ_ERR_INVALID_ARG);
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, c, tp, n, NULL), KVPQ_ERR_INVALID_ARG);
    kvpq_cache *with_null[2] = {c[0], NULL};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, with_null, tp, n, lg), KVPQ_ERR_INVALID_ARG);
    cr_expect(strstr(kvpq_last_error(), "sequence 1: NULL cache"), "%s", kvpq_last_error());
    const int32_t *null_tok[2] = {t2, NULL};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, c, null_tok, n, lg), KVPQ_ERR_INVALID_ARG);
    int zero[2] = {2, 0};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, c, tp, zero, lg), KVPQ_ERR_INVALID_ARG);
    kvpq_cache *shared[2] = {c[0], c[0]};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, shared, tp, n, lg), KVPQ_ERR_INVALID_ARG);
    cr_expect(strstr(kvpq_last_error(), "share one cache"), "%s", kvpq_last_error());
    int32_t bad[1] = {V};
    const int32_t *bad_tok[2] = {t2, bad};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, c, bad_tok, n, lg), KVPQ_ERR_INVALID_ARG);
    cr_expect(strstr(kvpq_last_error(), "sequence 1"), "%s", kvpq_last_error());
    /* sequence 1 holds 1 of 8 positions: 8 more do not fit its max_seq */
    int32_t many[8] = {0};
    const int32_t *many_tok[2] = {t2, many};
    int n_many[2] = {2, 8};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, c, many_tok, n_many, lg), KVPQ_ERR_CAPACITY);
    cr_expect(strstr(kvpq_last_error(), "sequence 1") && strstr(kvpq_last_error(), "max_seq"), "%s",
              kvpq_last_error());
    /* a cache shaped for another model */
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = KVPQ_CACHE_FP32;
    cp.n_layer = 2;
    cp.n_head = 9;
    cp.n_head_kv = 3;
    cp.head_dim = 64;
    cp.max_seq = 16;
    kvpq_cache *other = NULL;
    cr_assert_eq(kvpq_cache_new(&other, &cp), KVPQ_OK);
    kvpq_cache *mixed[2] = {c[0], other};
    cr_expect_eq(kvpq_model_eval_batch(g_model, 2, mixed, tp, n, lg), KVPQ_ERR_MISMATCH);
    cr_expect(strstr(kvpq_last_error(), "sequence 1"), "%s", kvpq_last_error());
    kvpq_cache_free(other);

    for (int i = 0; i < 2; i++)
        for (int l = 0; l < g_info.n_layer; l++) cr_expect_eq(kvpq_cache_seq_len(c[i], l), n[i]);
    kvpq_cache_free(c[0]);
    kvpq_cache_free(c[1]);
    free(lg);
    unload();
}
