/* tokenizer_vs_llama.c — tokens/s of kvpq's tokenizer beside llama.cpp's (llama_tokenize), the same
 * GGUF vocabulary and text, one process, single thread, the best of R runs each; and whether the ids
 * are equal. Not built by CMake (it links llama.cpp); scripts/tokenizer_golden.py speed builds and
 * runs it:
 *   cc -O2 bench/tokenizer_vs_llama.c -Iinclude -I$LLAMA/include -I$LLAMA/ggml/include \
 *      build/libkvpq.so $LLAMA/build/bin/libllama.so -Wl,-rpath,... -o build/tokenizer_vs_llama
 *   build/tokenizer_vs_llama MODEL.gguf TEXT [R]
 * Both add BOS as the file says and parse special tokens (llama-tokenize's defaults). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpq.h"
#include "llama.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)level, (void)text, (void)user;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf TEXT [REPEATS]\n", argv[0]);
        return 2;
    }
    int reps = argc > 3 ? atoi(argv[3]) : 3;
    FILE *f = fopen(argv[2], "rb");
    if (!f) { perror(argv[2]); return 1; }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (fread(text, 1, (size_t)len, f) != (size_t)len) { perror(argv[2]); return 1; }
    fclose(f);

    kvpq_vocab *kv;
    double t0 = now();
    if (kvpq_vocab_load(&kv, argv[1]) != KVPQ_OK) { fprintf(stderr, "kvpq: %s\n", kvpq_last_error()); return 1; }
    double kvpq_load = now() - t0;
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.vocab_only = 1;
    t0 = now();
    struct llama_model *lm = llama_model_load_from_file(argv[1], mp);
    if (!lm) { fprintf(stderr, "llama.cpp: cannot load %s\n", argv[1]); return 1; }
    double llama_load = now() - t0;
    const struct llama_vocab *lv = llama_model_get_vocab(lm);
    int add_bos = kvpq_vocab_add_bos(kv);

    size_t cap = (size_t)len + 2, n_k = 0;
    int32_t *ids_k = malloc(cap * sizeof *ids_k);
    llama_token *ids_l = malloc(cap * sizeof *ids_l);
    double best_k = 1e30, best_l = 1e30;
    int32_t n_l = 0;
    for (int r = 0; r < reps; r++) {
        t0 = now();
        if (kvpq_vocab_tokenize(kv, text, (size_t)len, add_bos, 1, ids_k, cap, &n_k) != KVPQ_OK) {
            fprintf(stderr, "kvpq: %s\n", kvpq_last_error());
            return 1;
        }
        double tk = now() - t0;
        t0 = now();
        n_l = llama_tokenize(lv, text, (int32_t)len, ids_l, (int32_t)cap, add_bos, 1);
        double tl = now() - t0;
        if (tk < best_k) best_k = tk;
        if (tl < best_l) best_l = tl;
    }
    int same = n_l >= 0 && (size_t)n_l == n_k && memcmp(ids_k, ids_l, n_k * sizeof *ids_k) == 0;
    printf("%-40s %9ld bytes %8zu tokens | kvpq %7.3f s %9.0f tok/s (load %.2f s) | llama.cpp %7.3f s %9.0f tok/s "
           "(load %.2f s) | kvpq/llama.cpp %.2fx | ids %s\n",
           strrchr(argv[1], '/') ? strrchr(argv[1], '/') + 1 : argv[1], len, n_k, best_k, (double)n_k / best_k, kvpq_load,
           best_l, (double)n_l / best_l, llama_load, best_l / best_k, same ? "equal" : "DIFFER");
    llama_model_free(lm);
    llama_backend_free();
    kvpq_vocab_free(kv);
    free(text);
    free(ids_k);
    free(ids_l);
    return same ? 0 : 1;
}
