/* llama_cpp_speed.c — a small client of llama.cpp's libllama (the peer, built elsewhere; not part of
 * kvpq's build) that measures what llama-bench's pp<N> and tg<N> tests measure, for when only
 * libllama is built (llama-bench needs llama.cpp's `common` library too, a further ~40 C++ files):
 *   pp N: one N-token batch from an empty context (n_batch 2048, n_ubatch 512, the default f16 KV
 *         cache and flash-attention setting, as llama-bench), after one warmup batch of the same size;
 *   tg N: N one-token decodes from an empty context, after a one-token warmup.
 * Tokens are random ids (BOS first where the model adds one), as llama-bench's. The context is
 * n_ctx = N, cleared before the timed run. Time: wall clock around llama_decode + llama_synchronize.
 * Also `tok FILE`: prints FILE's token ids (llama_tokenize, special tokens parsed as llama-tokenize
 * does by default, BOS where the model adds one), space-separated, for kvpq to get the same ids.
 * Build (bench/models_peer.py does it when llama-bench is missing):
 *   cc -O2 -I LLAMA/include -I LLAMA/ggml/include bench/llama_cpp_speed.c -L LLAMA/build/bin -lllama
 *      -Wl,-rpath,LLAMA/build/bin -o llama_cpp_speed
 * Usage: llama_cpp_speed MODEL THREADS pp N | tg N | tok FILE
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

int main(int argc, char **argv) {
    if (argc != 5 || (strcmp(argv[3], "pp") && strcmp(argv[3], "tg") && strcmp(argv[3], "tok"))) {
        fprintf(stderr, "usage: %s MODEL THREADS pp N | tg N | tok FILE\n", argv[0]);
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
