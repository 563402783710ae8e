/* fuzz_model.c — libFuzzer target for the model loader and the tokenizer's vocabulary reader: any
 * bytes as a GGUF file must either be refused by kvpq_model_load / kvpq_vocab_load with an error, or
 * load into a model (hyperparameters, every tensor's shape and type checked against them, the
 * vocabulary, merges, token types, chat template) that tokenizes, turns tokens into pieces and runs
 * a forward pass without reading out of bounds (ASan/UBSan check it). fuzz_gguf covers the GGUF
 * container itself; this target covers what is read out of it.
 * The input goes through a memfd (a regular file), as the loaders take a path and mmap it.
 * Seeds: tests/fuzz/corpus/model/ (tests/fuzz/make_model_seeds.py: tiny complete models). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvpq_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile uint64_t sink;

static void use_tokens(kvpq_status (*tok)(const void *, const char *, size_t, int, int, int32_t *, size_t, size_t *),
                       const void *obj, int32_t n_vocab,
                       kvpq_status (*piece)(const void *, int32_t, char *, size_t, size_t *)) {
    static const char *const texts[] = {"ab a b", "<|im_start|>user\nab<|im_end|>", "", "\xc3\xa9"};
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++)
        for (int special = 0; special < 2; special++) {
            int32_t ids[64];
            size_t n = 0;
            if (tok(obj, texts[i], strlen(texts[i]), special, special, ids, 64, &n) != KVPQ_OK) continue;
            for (size_t j = 0; j < n && j < 64; j++) {
                if (ids[j] < 0 || ids[j] >= n_vocab) abort(); /* ids always in range */
                char buf[16];
                size_t len;
                if (piece(obj, ids[j], buf, sizeof buf, &len) == KVPQ_OK) sink += len;
            }
        }
    char buf[8];
    size_t len;
    if (piece(obj, n_vocab, buf, sizeof buf, &len) == KVPQ_OK) abort(); /* one past the end */
}

static kvpq_status model_tok(const void *m, const char *t, size_t l, int b, int s, int32_t *ids, size_t cap,
                             size_t *n) {
    return kvpq_tokenize(m, t, l, b, s, ids, cap, n);
}
static kvpq_status model_piece(const void *m, int32_t id, char *buf, size_t cap, size_t *len) {
    return kvpq_token_to_piece(m, id, buf, cap, len);
}
static kvpq_status vocab_tok(const void *v, const char *t, size_t l, int b, int s, int32_t *ids, size_t cap,
                             size_t *n) {
    return kvpq_vocab_tokenize(v, t, l, b, s, ids, cap, n);
}
static kvpq_status vocab_piece(const void *v, int32_t id, char *buf, size_t cap, size_t *len) {
    return kvpq_vocab_piece(v, id, buf, cap, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int fd = memfd_create("fuzz_model", MFD_CLOEXEC);
    if (fd < 0) return 0;
    if (size && write(fd, data, size) != (ssize_t)size) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);

    kvpq_vocab *v = NULL;
    if (kvpq_vocab_load(&v, path) == KVPQ_OK) {
        use_tokens(vocab_tok, v, kvpq_vocab_n_tokens(v), vocab_piece);
        kvpq_vocab_free(v);
    }

    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 1;
    kvpq_model *m = NULL;
    if (kvpq_model_load(&m, path, &mp) == KVPQ_OK) {
        kvpq_model_info mi;
        if (kvpq_model_get_info(m, &mi) != KVPQ_OK) abort();
        const char *tmpl = kvpq_model_chat_template(m);
        if (tmpl) sink += strlen(tmpl);
        use_tokens(model_tok, m, mi.n_vocab, model_piece);
        /* A forward pass over two tokens when the model is small (the loader checked every shape). */
        if ((int64_t)mi.n_embd * mi.n_vocab <= (1 << 16) && (int64_t)mi.n_embd * mi.n_ff <= (1 << 16) &&
            mi.n_layer <= 8 && mi.n_ctx_train >= 2) {
            kvpq_cache_params cp = kvpq_cache_params_default();
            if (kvpq_model_cache_params(m, &cp) != KVPQ_OK) abort(); /* shapes and sliding window */
            cp.max_seq = 4;
            cp.n_threads = 1;
            kvpq_cache *c = NULL;
            float *logits = malloc((size_t)mi.n_vocab * 2 * sizeof(float));
            if (logits && kvpq_cache_new(&c, &cp) == KVPQ_OK) {
                int32_t toks[2] = {0, mi.n_vocab - 1};
                if (kvpq_model_eval(m, c, toks, 2, 1, logits) == KVPQ_OK) sink += (uint64_t)(logits[0] == logits[0]);
                int32_t bad = mi.n_vocab;
                if (kvpq_model_eval(m, c, &bad, 1, 0, logits) == KVPQ_OK) abort(); /* id out of range */
            }
            kvpq_cache_free(c);
            free(logits);
        }
        kvpq_model_free(m);
    }
    close(fd);
    return 0;
}
