/* tokenizer_vs_llama.c — tokens/s of kvpq's tokenizer beside llama.cpp's (llama_tokenize), the same
 * GGUF vocabulary and text, one process, single thread, the best of R runs each; and whether the ids
 * are equal. Not built by CMake (it links llama.cpp); scripts/tokenizer_golden.py speed builds and
 * runs it:
 *   cc -O2 bench/tokenizer_vs_llama.c -Iinclude -I$LLAMA/include -I$LLAMA/ggml/include \
 *      build/libkvpq_model.so build/libkvpq.so $LLAMA/build/bin/libllama.so -Wl,-rpath,... -o build/tokenizer_vs_llama
 *   build/tokenizer_vs_llama MODEL.gguf TEXT [R]
 *   build/tokenizer_vs_llama MODEL.gguf --random N   (ids of N random edge-case strings, see below)
 * Both add BOS as the file says and parse special tokens (llama-tokenize's defaults). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpq_model.h"
#include "llama.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
    (void)level, (void)text, (void)user;
}

/* Differential check: n random strings over pieces where tokenizers tend to disagree (digits, runs
 * of spaces / newlines / tabs, CRLF, apostrophes, emoji, CJK, combining marks, special-token text
 * whole and cut, U+2581, and for SentencePiece invalid UTF-8), both special-parsing modes, with and
 * without BOS. Returns the number of strings whose ids differ (the first few are printed). */
static int random_check(const kvpq_vocab *kv, const struct llama_vocab *lv, int n_strings, int spm) {
    static const char *const pieces[] = {
        "a", "b", "The", " the", "I", "'s", "'LL", "don't", "0", "7", "12", "2024", "3.14", "1234567",
        " ", "  ", "    ", "\n", "\n\n", "\n\n\n", "\t", "\t\t", "\r\n", " \n", "\u00a0", "\u3000",
        "\xf0\x9f\x98\x80", "\xf0\x9f\x91\x8d\xf0\x9f\x8f\xbd", "\xe2\x9d\xa4\xef\xb8\x8f", "\xe4\xbd\xa0\xe5\xa5\xbd",
        "\xe6\x97\xa5\xe6\x9c\xac", "e\xcc\x81", "\xc3\xa9", "\xd9\xa1\xd9\xa2", "!", "...", "?!", "--", "(", ")", "<", ">",
        "/", "#", "*", "_", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<start_of_turn>", "<end_of_turn>",
        "<bos>", "<eos>", "</s>", "<s>", "<unk>", "<pad>", "<mask>", "<td>", "</td>", "<b>", "<tool_call>",
        "<unused0>", "<0x41>", "<|im_", "<start_of", "\xe2\x96\x81", "\xe2\x96\x81\xe2\x96\x81",
        "\xff", "\xc3", "\x80", "\xe2\x82", "\xed\xa0\x80"};
    int n_pieces = sizeof pieces / sizeof pieces[0];
    int n_valid = n_pieces - 5; /* the last five are invalid UTF-8: SentencePiece only */
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    char text[4096];
    int32_t ids_k[4096];
    llama_token ids_l[4096];
    int bad = 0;
    for (int s = 0; s < n_strings; s++) {
        size_t len = 0;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int n_p = 1 + (int)(x % 40);
        for (int i = 0; i < n_p; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const char *p = pieces[x % (uint64_t)(spm ? n_pieces : n_valid)];
            memcpy(text + len, p, strlen(p));
            len += strlen(p);
        }
        /* llama_tokenize's add_special adds BOS only where the vocabulary says so */
        int add_bos = (int)((x >> 20) & 1), special = (int)((x >> 21) & 1);
        size_t n_k;
        if (kvpq_vocab_tokenize(kv, text, len, add_bos && kvpq_vocab_add_bos(kv), special, ids_k, 4096, &n_k) != KVPQ_OK) {
            if (bad++ < 5) printf("string %d: kvpq: %s\n", s, kvpq_last_error());
            continue;
        }
        int32_t n_l = llama_tokenize(lv, text, (int32_t)len, ids_l, 4096, add_bos, special);
        if (n_l < 0 || (size_t)n_l != n_k || memcmp(ids_k, ids_l, n_k * sizeof *ids_k) != 0) {
            if (bad++ < 5) {
                printf("string %d (add_bos %d, special %d) differs: '%.*s'\n  kvpq     ", s, add_bos, special, (int)len, text);
                for (size_t i = 0; i < n_k && i < 40; i++) printf(" %d", ids_k[i]);
                printf("\n  llama.cpp");
                for (int32_t i = 0; i < n_l && i < 40; i++) printf(" %d", ids_l[i]);
                printf("\n");
            }
        }
    }
    return bad;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL.gguf TEXT [REPEATS]\n       %s MODEL.gguf --random N\n", argv[0], argv[0]);
        return 2;
    }
    if (strcmp(argv[2], "--random") == 0) {
        kvpq_vocab *kv;
        if (kvpq_vocab_load(&kv, argv[1]) != KVPQ_OK) { fprintf(stderr, "kvpq: %s\n", kvpq_last_error()); return 1; }
        llama_log_set(quiet, NULL);
        llama_backend_init();
        struct llama_model_params mp = llama_model_default_params();
        mp.vocab_only = 1;
        struct llama_model *lm = llama_model_load_from_file(argv[1], mp);
        if (!lm) { fprintf(stderr, "llama.cpp: cannot load %s\n", argv[1]); return 1; }
        int n = argc > 3 ? atoi(argv[3]) : 10000;
        int spm = llama_vocab_type(llama_model_get_vocab(lm)) == LLAMA_VOCAB_TYPE_SPM;
        int bad = random_check(kv, llama_model_get_vocab(lm), n, spm);
        printf("%-40s %d random strings (%s): %d differ\n", strrchr(argv[1], '/') ? strrchr(argv[1], '/') + 1 : argv[1], n,
               spm ? "incl. invalid UTF-8" : "valid UTF-8", bad);
        llama_model_free(lm);
        llama_backend_free();
        kvpq_vocab_free(kv);
        return bad != 0;
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
