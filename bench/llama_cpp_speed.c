/* llama_cpp_speed.c — a small client of llama.cpp's libllama (the peer, built elsewhere; not part of
 * kvpq's build) that measures what llama-bench's pp<N> and tg<N> tests measure, for when only
 * libllama is built (llama-bench needs llama.cpp's `common` library too, a further ~40 C++ files):
 *   pp N: one N-token batch from an empty context (n_batch 2048, n_ubatch 512, the default f16 KV
 *         cache and flash-attention setting, as llama-bench), after one warmup batch of the same size;
 *   tg N: N one-token decodes from an empty context, after a one-token warmup.
 * Tokens are random ids (BOS first where the model adds one), as llama-bench's. The context is
 * n_ctx = N, cleared before the timed run. Time: wall clock around llama_decode + llama_synchronize.
 * Also `ctx IDS N STEPS TYPE_K TYPE_V` (bench/longctx_peer.py): the first N token ids of the file IDS
 *         (space-separated, as `tok` prints them) as the prompt, in batches of 2048 (n_ubatch 512), then
 *         STEPS one-token decodes fed from the file's next ids (teacher forcing, as `kvpq bench decode`);
 *         n_ctx = N + STEPS, flash attention on, the KV cache's types TYPE_K / TYPE_V (f16, q8_0, q4_0;
 *         llama.cpp's quantized V cache needs flash attention). No warmup: the prompt is the first work,
 *         as in kvpq bench decode. Output: one JSON line with the prompt's seconds and tok/s, the
 *         decode step's median and mean ms, decode tok/s = 1 / median (kvpq bench decode's statistic)
 *         and the KV cache's bytes as llama_state_seq_get_size reports them for the sequence.
 * Also `tok FILE`: prints FILE's token ids (llama_tokenize, special tokens parsed as llama-tokenize
 * does by default, BOS where the model adds one), space-separated, for kvpq to get the same ids.
 * Build (bench/models_peer.py does it when llama-bench is missing):
 *   cc -O2 -I LLAMA/include -I LLAMA/ggml/include bench/llama_cpp_speed.c -L LLAMA/build/bin -lllama
 *      -Wl,-rpath,LLAMA/build/bin -o llama_cpp_speed
 * Usage: llama_cpp_speed MODEL THREADS pp N | tg N | tok FILE | ctx IDS N STEPS TYPE_K TYPE_V
 * Output (pp, tg): one JSON line {"test": "pp512", "n_threads": 2, "tokens": 512, "seconds": s, "ts": tok/s}.
 * Errors: exit 1 with the failing call named on stderr; 2 for bad arguments. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "llama.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int print_ids(const struct llama_vocab *vocab, const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "llama_cpp_speed: cannot open %s\n", path);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, f) != (size_t)len) {
        fprintf(stderr, "llama_cpp_speed: cannot read %s\n", path);
        fclose(f);
        return 1;
    }
    fclose(f);
    text[len] = 0;
    int32_t cap = (int32_t)len + 16;
    llama_token *ids = malloc((size_t)cap * sizeof *ids);
    int32_t n = ids ? llama_tokenize(vocab, text, (int32_t)len, ids, cap, llama_vocab_get_add_bos(vocab), true) : -1;
    if (n < 0) {
        fprintf(stderr, "llama_cpp_speed: llama_tokenize of %s failed (%d)\n", path, n);
        return 1;
    }
    for (int32_t i = 0; i < n; i++) printf(i ? " %d" : "%d", ids[i]);
    printf("\n");
    free(ids);
    free(text);
    return 0;
}

/* Decode n tokens (random ids, BOS first where the model adds one) as one batch (one_by_one = 0) or
 * n single-token decodes; returns the seconds, or -1 when llama_decode fails. */
static double run(struct llama_context *ctx, const struct llama_vocab *vocab, int n, int one_by_one) {
    int n_vocab = llama_vocab_n_tokens(vocab);
    llama_token *t = malloc((size_t)n * sizeof *t);
    if (!t) return -1;
    for (int i = 0; i < n; i++) t[i] = rand() % n_vocab;
    if (llama_vocab_get_add_bos(vocab)) t[0] = llama_vocab_bos(vocab);
    llama_memory_clear(llama_get_memory(ctx), false);
    double t0 = now_s();
    int bad = 0;
    if (one_by_one)
        for (int i = 0; i < n && !bad; i++) bad = llama_decode(ctx, llama_batch_get_one(&t[i], 1)) != 0;
    else
        bad = llama_decode(ctx, llama_batch_get_one(t, n)) != 0;
    llama_synchronize(ctx);
    double s = now_s() - t0;
    free(t);
    return bad ? -1 : s;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int kv_type(const char *name, enum ggml_type *t) {
    if (!strcmp(name, "f16")) *t = GGML_TYPE_F16;
    else if (!strcmp(name, "q8_0")) *t = GGML_TYPE_Q8_0;
    else if (!strcmp(name, "q4_0")) *t = GGML_TYPE_Q4_0;
    else if (!strcmp(name, "f32")) *t = GGML_TYPE_F32;
    else return 0;
    return 1;
}

/* ctx mode (see the header): 0, 1 on a failed call, 2 on bad arguments. */
static int long_ctx(const char *model_path, int threads, char **argv) {
    long n = atol(argv[1]), steps = atol(argv[2]);
    enum ggml_type tk, tv;
    if (n < 1 || steps < 1 || !kv_type(argv[3], &tk) || !kv_type(argv[4], &tv)) {
        fprintf(stderr, "llama_cpp_speed: ctx IDS N STEPS TYPE_K TYPE_V: N, STEPS >= 1; types f32 f16 q8_0 q4_0\n");
        return 2;
    }
    FILE *f = fopen(argv[0], "r");
    if (!f) {
        fprintf(stderr, "llama_cpp_speed: cannot open %s\n", argv[0]);
        return 1;
    }
    llama_token *ids = malloc((size_t)(n + steps) * sizeof *ids);
    long got = 0;
    while (ids && got < n + steps && fscanf(f, "%d", &ids[got]) == 1) got++;
    fclose(f);
    if (got < n + steps) {
        fprintf(stderr, "llama_cpp_speed: %s has %ld ids; N + STEPS need %ld\n", argv[0], got, n + steps);
        return 1;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(model_path, mp);
    if (!model) {
        fprintf(stderr, "llama_cpp_speed: llama_model_load_from_file(%s) failed\n", model_path);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n + steps);
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
    cp.type_k = tk;
    cp.type_v = tv;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_cpp_speed: llama_init_from_model failed\n");
        return 1;
    }
    double t0 = now_s();
    for (long b = 0; b < n; b += 2048) {
        int nb = (int)(n - b < 2048 ? n - b : 2048);
        if (llama_decode(ctx, llama_batch_get_one(ids + b, nb))) {
            fprintf(stderr, "llama_cpp_speed: llama_decode of the prompt failed at %ld\n", b);
            return 1;
        }
    }
    llama_synchronize(ctx);
    double t_prompt = now_s() - t0, *dt = malloc((size_t)steps * sizeof *dt), sum = 0.0;
    for (long i = 0; dt && i < steps; i++) {
        t0 = now_s();
        if (llama_decode(ctx, llama_batch_get_one(ids + n + i, 1))) {
            fprintf(stderr, "llama_cpp_speed: llama_decode of step %ld failed\n", i);
            return 1;
        }
        llama_synchronize(ctx);
        dt[i] = now_s() - t0;
        sum += dt[i];
    }
    qsort(dt, (size_t)steps, sizeof *dt, cmp_double);
    double med = steps % 2 ? dt[steps / 2] : 0.5 * (dt[steps / 2 - 1] + dt[steps / 2]);
    size_t kv = llama_state_seq_get_size(ctx, 0);
    printf("{\"test\": \"ctx%ld+%ld\", \"n_threads\": %d, \"type_k\": \"%s\", \"type_v\": \"%s\", \"flash_attn\": true, "
           "\"prompt_tokens\": %ld, \"prompt_s\": %.6f, \"prompt_tok_per_s\": %.4f, \"decode_ms_median\": %.4f, "
           "\"decode_ms_mean\": %.4f, \"decode_tok_per_s\": %.4f, \"state_seq_bytes\": %zu}\n",
           n, steps, threads, argv[3], argv[4], n, t_prompt, n / t_prompt, med * 1e3, sum / steps * 1e3, 1.0 / med, kv);
    free(dt);
    free(ids);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 9 && !strcmp(argv[3], "ctx")) {
        int threads = atoi(argv[2]);
        if (threads < 1) {
            fprintf(stderr, "llama_cpp_speed: THREADS must be >= 1\n");
            return 2;
        }
        return long_ctx(argv[1], threads, argv + 4);
    }
    if (argc != 5 || (strcmp(argv[3], "pp") && strcmp(argv[3], "tg") && strcmp(argv[3], "tok"))) {
        fprintf(stderr, "usage: %s MODEL THREADS pp N | tg N | tok FILE | ctx IDS N STEPS TYPE_K TYPE_V\n", argv[0]);
        return 2;
    }
    int threads = atoi(argv[2]), n = atoi(argv[4]), pp = !strcmp(argv[3], "pp");
    if (threads < 1 || (strcmp(argv[3], "tok") && (n < 1 || n > 2048))) {
        fprintf(stderr, "llama_cpp_speed: THREADS must be >= 1 and N in 1..2048\n");
        return 2;
    }
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) {
        fprintf(stderr, "llama_cpp_speed: llama_model_load_from_file(%s) failed\n", argv[1]);
        return 1;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    if (!strcmp(argv[3], "tok")) return print_ids(vocab, argv[4]);
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)n;
    cp.n_batch = 2048;
    cp.n_ubatch = 512;
    cp.n_threads = cp.n_threads_batch = threads;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_cpp_speed: llama_init_from_model failed\n");
        return 1;
    }
    srand(1);
    double s = run(ctx, vocab, pp ? n : 1, !pp); /* warmup, as llama-bench's */
    if (s >= 0) s = run(ctx, vocab, n, !pp);
    if (s < 0) {
        fprintf(stderr, "llama_cpp_speed: llama_decode failed\n");
        return 1;
    }
    printf("{\"test\": \"%s%d\", \"n_threads\": %d, \"tokens\": %d, \"seconds\": %.6f, \"ts\": %.4f}\n", argv[3], n,
           threads, n, s, n / s);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
