/* vocab.c — the public kvpq_vocab: a GGUF file's tokenizer without its weights (kvpq.h). */
#include <stdlib.h>

#include "gguf.h"
#include "internal.h"
#include "tokenizer.h"

struct kvpq_vocab {
    kvpq_tokenizer *tok;
};

kvpq_status kvpq_vocab_load(kvpq_vocab **out, const char *gguf_path) {
    if (!out || !gguf_path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_vocab_load: NULL %s", !out ? "out" : "path");
    *out = NULL;
    gguf_file *f;
    kvpq_status st = gguf_open(&f, gguf_path);
    if (st != KVPQ_OK) return st;
    kvpq_vocab *v = calloc(1, sizeof *v);
    if (!v) st = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_vocab_load");
    /* The tokenizer copies what it needs, so the file is closed right away. */
    if (st == KVPQ_OK) st = kvpq_tokenizer_from_gguf(&v->tok, f);
    gguf_close(f);
    if (st == KVPQ_OK) {
        *out = v;
        return KVPQ_OK;
    }
    kvpq__err_prefix("'%s'", gguf_path);
    free(v);
    return st;
}

void kvpq_vocab_free(kvpq_vocab *v) {
    if (!v) return;
    kvpq_tokenizer_free(v->tok);
    free(v);
}

int32_t kvpq_vocab_n_tokens(const kvpq_vocab *v) { return v ? kvpq_tokenizer_n_vocab(v->tok) : 0; }
int32_t kvpq_vocab_bos(const kvpq_vocab *v) { return v ? kvpq_tokenizer_bos(v->tok) : -1; }
int32_t kvpq_vocab_eos(const kvpq_vocab *v) { return v ? kvpq_tokenizer_eos(v->tok) : -1; }
int kvpq_vocab_add_bos(const kvpq_vocab *v) { return v ? kvpq_tokenizer_add_bos_default(v->tok) : 0; }
unsigned kvpq_vocab_token_attr(const kvpq_vocab *v, int32_t token) { return v ? kvpq_tokenizer_token_attr(v->tok, token) : 0; }

kvpq_status kvpq_vocab_tokenize(const kvpq_vocab *v, const char *text, size_t len, int add_bos, int parse_special,
                                int32_t *tokens, size_t cap, size_t *n_tokens) {
    if (!v) {
        if (n_tokens) *n_tokens = 0;
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_vocab_tokenize: NULL vocab");
    }
    return kvpq_tokenizer_encode(v->tok, text, len, add_bos, parse_special, tokens, cap, n_tokens);
}

kvpq_status kvpq_vocab_piece(const kvpq_vocab *v, int32_t token, char *buf, size_t cap, size_t *len) {
    if (!v) {
        if (len) *len = 0;
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_vocab_piece: NULL vocab");
    }
    return kvpq_tokenizer_piece(v->tok, token, buf, cap, len);
}
