/* tokenizer.h — the tokenizer of a GGUF file: byte-level BPE (GPT-2 style, tokenizer.ggml.model
 * "gpt2") with the pre-tokenizer regex chosen by tokenizer.ggml.pre and matched by PCRE2, or
 * SentencePiece-style BPE over scores with byte fallback ("llama"). Internal. */
#ifndef KVPQ_TOKENIZER_H
#define KVPQ_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq_model.h"
#include "gguf.h"

typedef struct kvpq_tokenizer kvpq_tokenizer;

/* Build from the tokenizer.ggml.* keys of a GGUF file (model "gpt2" or "llama"; pre-tokenizers
 * supported are named in the error when another is asked for). Copies what it needs. */
kvpq_status kvpq_tokenizer_from_gguf(kvpq_tokenizer **out, const gguf_file *f);
void kvpq_tokenizer_free(kvpq_tokenizer *t);

int32_t kvpq_tokenizer_n_vocab(const kvpq_tokenizer *t);
int32_t kvpq_tokenizer_bos(const kvpq_tokenizer *t);
int32_t kvpq_tokenizer_eos(const kvpq_tokenizer *t);
/* Value of tokenizer.ggml.add_bos_token (absent: 0 for "gpt2", 1 for "llama", as llama.cpp). */
int kvpq_tokenizer_add_bos_default(const kvpq_tokenizer *t);
/* KVPQ_TOKEN_ATTR_* bits of a token (kvpq.h), 0 when out of range. */
unsigned kvpq_tokenizer_token_attr(const kvpq_tokenizer *t, int32_t token);

/* Same contract as kvpq_tokenize() in kvpq.h. */
kvpq_status kvpq_tokenizer_encode(const kvpq_tokenizer *t, const char *text, size_t len, int add_bos,
                                  int parse_special, int32_t *tokens, size_t cap, size_t *n_tokens);
/* Same contract as kvpq_token_to_piece() in kvpq.h (special tokens give their text). */
kvpq_status kvpq_tokenizer_piece(const kvpq_tokenizer *t, int32_t token, char *buf, size_t cap, size_t *len);

#endif
