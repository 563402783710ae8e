/* test_model.c — the Llama forward pass on the real model (SmolLM2-135M-Instruct Q4_1): load errors,
 * golden greedy tokens and perplexity (recorded after checking the model against llama.cpp through
 * bench/llama_cpp_peer.py), decode == batched prefill, fp16 cache close to fp32. Skips, saying so,
 * when the model file is missing (scripts/fetch_model.sh fetches it). KVPQ_QUICK=1 shrinks sizes. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpq_model.h"

#define MODEL_PATH KVPQ_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"
#define TEXT_PATH KVPQ_SOURCE_DIR "/data/text/persuasion.txt"
#define MODEL_SIZE_MIN (1 << 20)

/* Greedy continuation of GOLDEN_PROMPT, 16 tokens (no BOS: the model's add_bos_token is false),
 * fp32 cache. Recorded from kvpq after bench/llama_cpp_peer.py showed kvpq's logits within 2e-3 of
 * llama.cpp's (llama-cpp-python) on the same model; llama.cpp's greedy tokens are the same. */
#define GOLDEN_PROMPT "The capital of France is"
static const int32_t golden_tokens[16] = {7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33};

/* Perplexity (llama.cpp scoring: second half of the chunk) of the first GOLDEN_CTX tokens of
 * persuasion.txt, fp32 cache; QUICK uses the first 128 tokens. Matches llama.cpp's value within
 * PPL_LLAMA_CPP_REL (see bench/llama_cpp_peer.py output in docs/model.md). */
#define GOLDEN_PPL_512 20.253636
#define GOLDEN_PPL_128 114.343239
/* 1e-3 relative: the value moves with summation order (SIMD level, threads) far less than this,
 * and a wrong RoPE, norm or attention changes it by percent or more. */
#define PPL_REL_TOL 1e-3

static int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && *q && strcmp(q, "0") != 0;
}

static int model_present(void) {
    FILE *f = fopen(MODEL_PATH, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fclose(f);
    return n > MODEL_SIZE_MIN;
}

#define REQUIRE_MODEL()                                                                          \
    do {                                                                                         \
        if (!model_present()) cr_skip_test("model %s missing (run scripts/fetch_model.sh)", MODEL_PATH); \
    } while (0)

static kvpq_model *g_model;
static kvpq_model_info g_info;

static kvpq_model *load_model(void) {
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, MODEL_PATH, &mp);
    cr_assert_eq(s, KVPQ_OK, "load: %s", kvpq_last_error());
    kvpq_model_get_info(m, &g_info);
    return m;
}

/* The golden values and the consistency checks are of the float32-activation forward pass (the
 * reference; KVPQ_ACT=f32); the 8-bit activations of the default path are checked against it in
 * model_q8 below. Criterion runs each test in its own process, so the variable stays local. */
static void setup_model(void) {
    setenv("KVPQ_ACT", "f32", 1);
    if (model_present()) g_model = load_model();
}
static void teardown_model(void) {
    kvpq_model_free(g_model);
    g_model = NULL;
}

static kvpq_cache *new_cache(kvpq_cache_type type, int max_seq) {
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = type;
    cp.n_layer = g_info.n_layer;
    cp.n_head = g_info.n_head;
    cp.n_head_kv = g_info.n_head_kv;
    cp.head_dim = g_info.head_dim;
    cp.max_seq = max_seq;
    cp.n_threads = 2;
    cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    kvpq_status s = kvpq_cache_new(&c, &cp);
    cr_assert_eq(s, KVPQ_OK, "cache_new %s: %s", kvpq_cache_type_name(type), kvpq_last_error());
    return c;
}

/* The first n tokens of the held-out novel. */
static int32_t *text_tokens(int n) {
    FILE *f = fopen(TEXT_PATH, "rb");
    cr_assert_not_null(f, "%s missing", TEXT_PATH);
    size_t cap = 64 * 1024; /* far more than n tokens of English */
    char *buf = malloc(cap);
    size_t len = fread(buf, 1, cap, f);
    fclose(f);
    /* cut at a line end so no UTF-8 sequence is split */
    while (len > 0 && buf[len - 1] != '\n') len--;
    size_t nt = 0;
    cr_assert_eq(kvpq_tokenize(g_model, buf, len, g_info.add_bos, 0, NULL, 0, &nt), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_geq(nt, (size_t)n);
    int32_t *t = malloc(nt * sizeof *t);
    cr_assert_eq(kvpq_tokenize(g_model, buf, len, g_info.add_bos, 0, t, nt, &nt), KVPQ_OK);
    free(buf);
    return t;
}

/* ---- load errors ------------------------------------------------------------------------------ */

static char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc(*n);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

static void write_all(const char *path, const char *b, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

Test(model_load, missing_file_is_an_io_error) {
    kvpq_model *m = (kvpq_model *)1;
    kvpq_status s = kvpq_model_load(&m, "/nonexistent/model.gguf", NULL);
    cr_assert_eq(s, KVPQ_ERR_IO, "%s", kvpq_last_error());
    cr_assert_null(m);
    cr_assert(strstr(kvpq_last_error(), "/nonexistent/model.gguf"), "message names the file: %s", kvpq_last_error());
}

Test(model_load, truncated_copy_is_a_named_format_error) {
    REQUIRE_MODEL();
    size_t n;
    char *b = read_all(MODEL_PATH, &n);
    char path[] = "/tmp/kvpq_model_trunc.XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    /* cut inside the tensor data: the header is intact, the last tensors' bytes are missing */
    write_all(path, b, n - n / 3);
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, path, NULL);
    unlink(path);
    free(b);
    cr_assert_eq(s, KVPQ_ERR_FORMAT, "status %d: %s", s, kvpq_last_error());
    cr_assert_null(m);
    cr_assert_neq(kvpq_last_error()[0], 0);
}

Test(model_load, unknown_architecture_is_unsupported_and_named) {
    REQUIRE_MODEL();
    size_t n;
    char *b = read_all(MODEL_PATH, &n);
    /* general.architecture is a GGUF string: u64 length 5, then "llama". Patch its bytes in place to
     * "gptzz" (same length, so every offset in the file stays valid). */
    const char key[] = "general.architecture";
    char *p = memmem(b, n, key, sizeof key - 1);
    cr_assert_not_null(p);
    p += sizeof key - 1 + 4 + 8; /* key, value type (u32), string length (u64) */
    cr_assert_eq(memcmp(p, "llama", 5), 0);
    memcpy(p, "gptzz", 5);
    char path[] = "/tmp/kvpq_model_arch.XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    write_all(path, b, n);
    free(b);
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, path, NULL);
    unlink(path);
    cr_assert_eq(s, KVPQ_ERR_UNSUPPORTED, "status %d: %s", s, kvpq_last_error());
    cr_assert(strstr(kvpq_last_error(), "gptzz"), "message names the architecture: %s", kvpq_last_error());
}

Test(model_load, retyped_tensor_is_refused_by_its_layout) {
    REQUIRE_MODEL();
    size_t n;
    char *b = read_all(MODEL_PATH, &n);
    /* Tensor info: u64 name length, name, u32 n_dims, n_dims x u64 ne, u32 ggml type. Retype
     * blk.0.ffn_down.weight ([1536, 576] Q4_1) as IQ2_XXS (type 16), whose rows are smaller: the
     * next tensor no longer starts where this one ends. Until issue 31 the file loaded and the type
     * was named as unsupported; as ggml's loader does, the layout is refused first now, naming the
     * next tensor (test_gguf unknown_tensor_type_opens_but_is_unsupported and
     * describe_refuses_unknown_tensor_type name unsupported types in well-formed files). */
    const char name[] = "blk.0.ffn_down.weight";
    char *p = memmem(b, n, name, sizeof name - 1);
    cr_assert_not_null(p);
    p += sizeof name - 1;
    uint32_t n_dims;
    memcpy(&n_dims, p, 4);
    cr_assert_eq(n_dims, 2);
    p += 4 + 8 * n_dims;
    uint32_t type;
    memcpy(&type, p, 4);
    cr_assert_eq(type, 3, "expected Q4_1, found type %u", type);
    type = 16;
    memcpy(p, &type, 4);
    char path[] = "/tmp/kvpq_model_type.XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    write_all(path, b, n);
    free(b);
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, path, NULL);
    unlink(path);
    cr_assert_eq(s, KVPQ_ERR_FORMAT, "status %d: %s", s, kvpq_last_error());
    cr_assert(strstr(kvpq_last_error(), "'blk.0.ffn_gate.weight': data offset") &&
                  strstr(kvpq_last_error(), "overlapping data or a wrong type or shape"),
              "message names the misplaced tensor: %s", kvpq_last_error());
}

Test(model_load, info_matches_the_file, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    cr_assert_str_eq(g_info.arch, "llama");
    cr_assert_eq(g_info.n_layer, 30);
    cr_assert_eq(g_info.n_head, 9);
    cr_assert_eq(g_info.n_head_kv, 3);
    cr_assert_eq(g_info.head_dim, 64);
    cr_assert_eq(g_info.n_embd, 576);
    cr_assert_eq(g_info.n_ff, 1536);
    cr_assert_eq(g_info.n_vocab, 49152);
    cr_assert_eq(g_info.n_ctx_train, 8192);
    cr_assert_float_eq(g_info.rope_freq_base, 100000.0f, 1e-3);
    cr_assert_eq(g_info.bos_id, 1);
    cr_assert_eq(g_info.eos_id, 2);
    cr_assert_eq(g_info.add_bos, 0);
    const char *tmpl = kvpq_model_chat_template(g_model);
    cr_assert(tmpl && strstr(tmpl, "<|im_start|>"));
}

/* ---- eval errors ------------------------------------------------------------------------------ */

Test(model_eval, rejects_bad_input_and_leaves_the_cache_unchanged, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    float *logits = malloc((size_t)g_info.n_vocab * sizeof *logits);
    kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, 16);
    int32_t t[2] = {504, 2365};
    cr_assert_eq(kvpq_model_eval(g_model, c, t, 2, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    int32_t bad[2] = {504, 49152};
    cr_assert_eq(kvpq_model_eval(g_model, c, bad, 2, 0, logits), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "49152"), "%s", kvpq_last_error());
    int32_t many[15] = {0};
    cr_assert_eq(kvpq_model_eval(g_model, c, many, 15, 0, logits), KVPQ_ERR_CAPACITY, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(c, 0), 2);
    cr_assert_eq(kvpq_cache_seq_len(c, g_info.n_layer - 1), 2);
    kvpq_cache_free(c);

    /* beyond the training context: refused before any work */
    c = new_cache(KVPQ_CACHE_FP32, g_info.n_ctx_train + 8);
    int32_t *longer = calloc((size_t)g_info.n_ctx_train + 1, sizeof *longer);
    cr_assert_eq(kvpq_model_eval(g_model, c, longer, g_info.n_ctx_train + 1, 0, logits), KVPQ_ERR_CAPACITY);
    cr_assert(strstr(kvpq_last_error(), "n_ctx_train"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(c, 0), 0);
    kvpq_cache_free(c);
    free(longer);

    /* a cache shaped for another model */
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = KVPQ_CACHE_FP32;
    cp.n_layer = 2;
    cp.n_head = 9;
    cp.n_head_kv = 3;
    cp.head_dim = 64;
    cp.max_seq = 16;
    cr_assert_eq(kvpq_cache_new(&c, &cp), KVPQ_OK);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, 2, 0, logits), KVPQ_ERR_MISMATCH);
    kvpq_cache_free(c);
    free(logits);
}

/* ---- golden outputs --------------------------------------------------------------------------- */

Test(model_golden, greedy_tokens_match_the_recording, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    int32_t prompt[64];
    size_t np = 0;
    cr_assert_eq(kvpq_tokenize(g_model, GOLDEN_PROMPT, strlen(GOLDEN_PROMPT), g_info.add_bos, 0, prompt, 64, &np),
                 KVPQ_OK);
    kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, 64);
    float *logits = malloc((size_t)g_info.n_vocab * sizeof *logits);
    cr_assert_eq(kvpq_model_eval(g_model, c, prompt, (int)np, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    int32_t got[16];
    for (int i = 0; i < 16; i++) {
        int32_t best = 0;
        for (int v = 1; v < g_info.n_vocab; v++)
            if (logits[v] > logits[best]) best = v;
        got[i] = best;
        if (i < 15) cr_assert_eq(kvpq_model_eval(g_model, c, &best, 1, 0, logits), KVPQ_OK);
    }
    for (int i = 0; i < 16; i++)
        cr_expect_eq(got[i], golden_tokens[i], "token %d: got %d, recorded %d", i, got[i], golden_tokens[i]);
    free(logits);
    kvpq_cache_free(c);
}

/* llama.cpp perplexity scoring of one chunk: NLL of tokens first+1 .. n-1, first = n/2. */
static double chunk_ppl(kvpq_cache_type type, int n) {
    int32_t *t = text_tokens(n);
    int V = g_info.n_vocab, first = n / 2;
    float *logits = malloc((size_t)n * V * sizeof *logits);
    kvpq_cache *c = new_cache(type, n);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, n, 1, logits), KVPQ_OK, "%s", kvpq_last_error());
    double nll = 0;
    for (int j = first; j < n - 1; j++) {
        const float *row = logits + (size_t)j * V;
        double mx = row[0], sum = 0;
        for (int v = 1; v < V; v++) mx = fmax(mx, row[v]);
        for (int v = 0; v < V; v++) sum += exp(row[v] - mx);
        nll += mx + log(sum) - row[t[j + 1]];
    }
    kvpq_cache_free(c);
    free(logits);
    free(t);
    return exp(nll / (n - 1 - first));
}

Test(model_golden, perplexity_matches_the_recording, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    int n = quick() ? 128 : 512;
    double want = quick() ? GOLDEN_PPL_128 : GOLDEN_PPL_512;
    double ppl = chunk_ppl(KVPQ_CACHE_FP32, n);
    cr_assert(fabs(ppl / want - 1) < PPL_REL_TOL, "ppl over %d tokens: %.6f, recorded %.6f", n, ppl, want);
}

/* ---- 8-bit activations (KVPQ_ACT=q8: every matrix through the integer kernels) --------------- */

/* Perplexity of the golden chunk within 1% of the float32 path's (2.5% for QUICK's 63 scored tokens;
 * measured +0.3% on 16 chunks of 1024: docs/cpu_kernels.md), and the greedy tokens' first 5 unchanged (" Paris.\n\nThe"; the
 * recording continues past a near tie that the activation rounding may flip). */
Test(model_q8, activations_in_8_bits_stay_close_to_float32) {
    REQUIRE_MODEL();
    setenv("KVPQ_ACT", "q8", 1);
    g_model = load_model();
    int n = quick() ? 128 : 512;
    double want = quick() ? GOLDEN_PPL_128 : GOLDEN_PPL_512, ppl = chunk_ppl(KVPQ_CACHE_FP32, n);
    cr_expect(fabs(ppl / want - 1) < (quick() ? 2.5e-2 : 1e-2), "q8 ppl over %d tokens: %.6f, float32 %.6f", n, ppl, want);
    cr_expect(fabs(ppl / want - 1) > 1e-7, "q8 ppl %.6f equals float32's: the integer path did not run", ppl);
    int32_t prompt[64];
    size_t np = 0;
    cr_assert_eq(kvpq_tokenize(g_model, GOLDEN_PROMPT, strlen(GOLDEN_PROMPT), g_info.add_bos, 0, prompt, 64, &np),
                 KVPQ_OK);
    kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, 64);
    float *logits = malloc((size_t)g_info.n_vocab * sizeof *logits);
    cr_assert_eq(kvpq_model_eval(g_model, c, prompt, (int)np, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < 5; i++) {
        int32_t best = 0;
        for (int v = 1; v < g_info.n_vocab; v++)
            if (logits[v] > logits[best]) best = v;
        cr_expect_eq(best, golden_tokens[i], "q8 token %d: got %d, recorded %d", i, best, golden_tokens[i]);
        if (i < 4) cr_assert_eq(kvpq_model_eval(g_model, c, &best, 1, 0, logits), KVPQ_OK);
    }
    free(logits);
    kvpq_cache_free(c);
    teardown_model();
}

Test(model_q8, bad_kvpq_act_is_a_named_error) {
    REQUIRE_MODEL();
    setenv("KVPQ_ACT", "int4", 1);
    kvpq_model *m = NULL;
    cr_assert_eq(kvpq_model_load(&m, MODEL_PATH, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert(m == NULL);
    cr_assert(strstr(kvpq_last_error(), "KVPQ_ACT=int4"), "%s", kvpq_last_error());
}

/* ---- consistency ------------------------------------------------------------------------------ */

/* Max |a - b| over n floats, relative to max |b|. */
static double rel_maxdiff(const float *a, const float *b, size_t n) {
    double d = 0, s = 0;
    for (size_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        s = fmax(s, fabs((double)b[i]));
    }
    return d / s;
}

/* Decode and prefill sum the same products in another order (matvec vs blocked matmul): relative
 * differences of 1e-5 .. 1e-4 after 30 layers are rounding; an off-by-one position or a wrong mask
 * gives O(1). */
#define DECODE_VS_PREFILL_TOL 2e-3

Test(model_consistency, decode_one_at_a_time_equals_batched_prefill, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    int n = quick() ? 8 : 24, V = g_info.n_vocab;
    int32_t *t = text_tokens(n);
    float *batched = malloc((size_t)n * V * sizeof(float)), *single = malloc((size_t)n * V * sizeof(float));
    kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, n);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, n, 1, batched), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_free(c);
    c = new_cache(KVPQ_CACHE_FP32, n);
    for (int i = 0; i < n; i++)
        cr_assert_eq(kvpq_model_eval(g_model, c, t + i, 1, 0, single + (size_t)i * V), KVPQ_OK);
    kvpq_cache_free(c);
    for (int i = 0; i < n; i++) {
        double d = rel_maxdiff(single + (size_t)i * V, batched + (size_t)i * V, (size_t)V);
        cr_expect_lt(d, DECODE_VS_PREFILL_TOL, "position %d: relative max diff %g", i, d);
    }
    /* and a split prefill (3 + rest) gives the same as one call */
    c = new_cache(KVPQ_CACHE_FP32, n);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, 3, 1, single), KVPQ_OK);
    cr_assert_eq(kvpq_model_eval(g_model, c, t + 3, n - 3, 1, single + (size_t)3 * V), KVPQ_OK);
    cr_expect_lt(rel_maxdiff(single, batched, (size_t)n * V), DECODE_VS_PREFILL_TOL);
    /* logits_all = 0 gives the last row */
    kvpq_cache_truncate(c, 0);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, n, 0, single), KVPQ_OK);
    cr_expect_lt(rel_maxdiff(single, batched + (size_t)(n - 1) * V, (size_t)V), 1e-6);
    kvpq_cache_free(c);
    free(batched);
    free(single);
    free(t);
}

/* fp16 keys/values carry ~2^-11 relative error; through 30 layers that moves logits by about 1e-3
 * of their range (measured ~2e-4) and never the argmax of a confident position. */
#define FP16_VS_FP32_TOL 1e-2

Test(model_consistency, fp16_cache_logits_close_to_fp32, .init = setup_model, .fini = teardown_model) {
    REQUIRE_MODEL();
    int n = quick() ? 16 : 64, V = g_info.n_vocab;
    int32_t *t = text_tokens(n);
    float *a = malloc((size_t)n * V * sizeof(float)), *b = malloc((size_t)n * V * sizeof(float));
    kvpq_cache *c = new_cache(KVPQ_CACHE_FP32, n);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, n, 1, a), KVPQ_OK);
    kvpq_cache_free(c);
    c = new_cache(KVPQ_CACHE_FP16, n);
    cr_assert_eq(kvpq_model_eval(g_model, c, t, n, 1, b), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_free(c);
    double d = rel_maxdiff(b, a, (size_t)n * V);
    cr_expect_lt(d, FP16_VS_FP32_TOL, "fp16 vs fp32 logits: relative max diff %g", d);
    cr_expect_gt(d, 0, "fp16 gave bit-identical logits: is the cache kind really fp16?");
    free(a);
    free(b);
    free(t);
}
