/* fuzz_tokenize.c — libFuzzer target for the tokenizer: any bytes must either tokenize into ids
 * whose pieces concatenate back to exactly those bytes, or fail with INVALID_ARG (invalid UTF-8) /
 * UNSUPPORTED (a byte without a token) and a message; never crash, leak or read out of bounds.
 * The vocabulary is the real model's: env KVPQ_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf
 * relative to the working directory. The first input byte picks add_bos / parse_special. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kvpq_model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvpq_vocab *vocab(void) {
    static kvpq_vocab *v;
    if (!v) {
        const char *path = getenv("KVPQ_MODEL");
        if (!path) path = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
        if (kvpq_vocab_load(&v, path) != KVPQ_OK) {
            fprintf(stderr, "fuzz_tokenize: %s (set KVPQ_MODEL)\n", kvpq_last_error());
            abort();
        }
    }
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const kvpq_vocab *v = vocab();
    int add_bos = data[0] & 1, parse_special = (data[0] >> 1) & 1;
    size_t len = size - 1;
    char *text = malloc(len ? len : 1); /* exactly len bytes, so ASan sees any overread */
    if (!text) return 0;
    memcpy(text, data + 1, len);
    size_t n = 0;
    kvpq_status s = kvpq_vocab_tokenize(v, text, len, add_bos, parse_special, NULL, 0, &n);
    if (s == KVPQ_OK) {
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        size_t n2 = 0;
        if (kvpq_vocab_tokenize(v, text, len, add_bos, parse_special, ids, n, &n2) != KVPQ_OK || n2 != n) abort();
        if (add_bos && (n == 0 || ids[0] != kvpq_vocab_bos(v))) abort();
        size_t off = 0;
        for (size_t i = add_bos ? 1 : 0; i < n; i++) {
            char piece[256];
            size_t pl;
            if (kvpq_vocab_piece(v, ids[i], piece, sizeof piece, &pl) != KVPQ_OK || pl > sizeof piece) abort();
            if (off + pl > len || memcmp(text + off, piece, pl) != 0) abort(); /* round trip */
            off += pl;
        }
        if (off != len) abort();
        free(ids);
    } else if ((s != KVPQ_ERR_INVALID_ARG && s != KVPQ_ERR_UNSUPPORTED) || n != 0 || kvpq_last_error()[0] == '\0') {
        abort();
    }
    free(text);
    return 0;
}
