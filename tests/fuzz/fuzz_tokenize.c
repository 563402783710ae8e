/* fuzz_tokenize.c — libFuzzer target for the tokenizer. The first input byte picks add_bos (bit 0),
 * parse_special (bit 1) and the vocabulary (bits 2-3):
 *   0: the real model's byte-level BPE (env KVPQ_MODEL, else models/SmolLM2-135M-Instruct.Q4_1.gguf
 *      relative to the working directory);
 *   1: a synthetic byte-level BPE vocabulary with the qwen2 pre-tokenizer (built here in memory);
 *   2, 3: a synthetic SentencePiece vocabulary (scores, <0xNN> byte fallback, U+2581, CONTROL and
 *      USER_DEFINED tokens), without / with add_space_prefix.
 * The rest is the text. Byte-level BPE must tokenize it into ids whose pieces concatenate back to
 * exactly those bytes, or fail with INVALID_ARG (invalid UTF-8) / UNSUPPORTED (a byte without a
 * token) and a message. SentencePiece must always succeed (every byte has a fallback token), every
 * id in range; the pieces give the text back whenever no U+2581 marker was added or came from the
 * text (no prefix, no ' ' after invalid UTF-8, no literal U+2581). Never crash, leak or overread. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "kvpq_model.h"
#include "gguf_writer.h"
#include "model/gguf.h"
#include "model/tokenizer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvpq_vocab *model_vocab(void) {
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

// ---- synthetic vocabularies in an in-memory GGUF -------------------------------------------------

static kvpq_tokenizer *from_kv(gw_buf *kv) {
    gw_buf file = gw_file(kv, 0, NULL, NULL, 32); /* no tensors */
    gguf_file *f = NULL;
    kvpq_tokenizer *t = NULL;
    if (gguf_open_memory(&f, file.p, file.n) != KVPQ_OK || kvpq_tokenizer_from_gguf(&t, f) != KVPQ_OK) {
        fprintf(stderr, "fuzz_tokenize: synthetic vocabulary: %s\n", kvpq_last_error());
        abort();
    }
    gguf_close(f);
    gw_free(&file);
    gw_free(kv);
    return t;
}

/* GPT-2 byte -> code point as UTF-8 (the byte-level alphabet of tokenizer.ggml.tokens). */
static void byte_level(int byte, char out[3]) {
    int printable = (byte >= '!' && byte <= '~') || (byte >= 0xa1 && byte <= 0xac) || byte >= 0xae;
    int cp = byte;
    if (!printable) {
        cp = 256;
        for (int b = 0; b < byte; b++)
            if (!((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae)) cp++;
    }
    if (cp < 0x80) {
        out[0] = (char)cp, out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6)), out[1] = (char)(0x80 | (cp & 0x3f)), out[2] = 0;
    }
}

/* 256 byte tokens, a few merges, "<|im_end|>" CONTROL and "<tool>" USER_DEFINED; pre "qwen2". */
static kvpq_tokenizer *bpe_qwen2_vocab(void) {
    static const char *const merges[][3] = {/* left, right, merged (byte-level text) */
                                            {"Ġ", "t", "Ġt"}, {"h", "e", "he"}, {"Ġt", "he", "Ġthe"},
                                            {"1", "2", "12"}, {"Ġ", "Ġ", "ĠĠ"}, {"Ċ", "Ċ", "ĊĊ"},
                                            {"'", "s", "'s"}, {"Ã", "©", "Ã©"}};
    enum { N_MERGES = sizeof merges / sizeof merges[0], N = 256 + N_MERGES + 2 };
    char bytes[256][3];
    gw_buf kv = {0};
    gw_kv_str(&kv, "tokenizer.ggml.model", "gpt2");
    gw_kv_str(&kv, "tokenizer.ggml.pre", "qwen2");
    gw_kv_arr(&kv, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, N);
    for (int b = 0; b < 256; b++) {
        byte_level(b, bytes[b]);
        gw_str(&kv, bytes[b]);
    }
    for (int m = 0; m < N_MERGES; m++) gw_str(&kv, merges[m][2]);
    gw_str(&kv, "<|im_end|>");
    gw_str(&kv, "<tool>");
    gw_kv_arr(&kv, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, N);
    for (int i = 0; i < N; i++) gw_u32(&kv, i == N - 2 ? 3 : i == N - 1 ? 4 : 1);
    gw_kv_arr(&kv, "tokenizer.ggml.merges", GGUF_TYPE_STRING, N_MERGES);
    for (int m = 0; m < N_MERGES; m++) {
        char s[32];
        snprintf(s, sizeof s, "%s %s", merges[m][0], merges[m][1]);
        gw_str(&kv, s);
    }
    gw_key(&kv, "tokenizer.ggml.bos_token_id", GGUF_TYPE_UINT32);
    gw_u32(&kv, N - 2);
    return from_kv(&kv);
}

/* <unk> <s> </s>, the 256 <0xNN> tokens, then pieces with scores; add_space_prefix as given. */
static kvpq_tokenizer *spm_vocab(int add_space_prefix) {
    static const struct { const char *text; float score; int type; } pieces[] = {
        {"\xe2\x96\x81", -1, 1}, {"a", -2, 1}, {"b", -2, 1}, {"ab", -3, 1}, {"\xe2\x96\x81" "a", -1.5f, 1},
        {"\xe2\x96\x81\xe2\x96\x81", -1, 1}, {"\xc3\xa9", -2, 1}, {"<start_of_turn>", 0, 3},
        {"<end_of_turn>", 0, 3}, {"\n", 0, 4}, {"\n\n", 0, 4}, {"  ", 0, 4}, {"<td>", 0, 4}};
    enum { NP = sizeof pieces / sizeof pieces[0], N = 3 + 256 + NP };
    gw_buf kv = {0};
    gw_kv_str(&kv, "tokenizer.ggml.model", "llama");
    gw_kv_arr(&kv, "tokenizer.ggml.tokens", GGUF_TYPE_STRING, N);
    gw_str(&kv, "<unk>");
    gw_str(&kv, "<s>");
    gw_str(&kv, "</s>");
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        gw_str(&kv, s);
    }
    for (int i = 0; i < NP; i++) gw_str(&kv, pieces[i].text);
    gw_kv_arr(&kv, "tokenizer.ggml.scores", GGUF_TYPE_FLOAT32, N);
    for (int i = 0; i < N; i++) {
        float s = i < 3 + 256 ? 0.0f : pieces[i - 3 - 256].score;
        gw_put(&kv, &s, 4);
    }
    gw_kv_arr(&kv, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, N);
    for (int i = 0; i < N; i++) gw_u32(&kv, i == 0 ? 2 : i < 3 ? 3 : i < 3 + 256 ? 6 : (uint32_t)pieces[i - 3 - 256].type);
    gw_key(&kv, "tokenizer.ggml.add_space_prefix", GGUF_TYPE_BOOL);
    uint8_t flag = (uint8_t)add_space_prefix;
    gw_put(&kv, &flag, 1);
    return from_kv(&kv);
}

// ---- the checks ----------------------------------------------------------------------------------

/* Strict UTF-8 (no overlongs, surrogates or code points above U+10FFFF). */
static int valid_utf8(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t b = s[i];
        size_t l = b < 0x80 ? 1 : (b >= 0xc2 && b < 0xe0) ? 2 : (b >= 0xe0 && b < 0xf0) ? 3 : (b >= 0xf0 && b < 0xf5) ? 4 : 0;
        if (l == 0 || i + l > n) return 0;
        uint32_t cp = l == 1 ? b : (uint32_t)(b & (0x7f >> l));
        for (size_t k = 1; k < l; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3f);
        }
        if ((l == 3 && (cp < 0x800 || (cp >= 0xd800 && cp < 0xe000))) || (l == 4 && (cp < 0x10000 || cp > 0x10ffff)))
            return 0;
        i += l;
    }
    return 1;
}

typedef kvpq_status (*tok_fn)(const void *v, const char *text, size_t len, int add_bos, int parse_special,
                              int32_t *ids, size_t cap, size_t *n);
typedef kvpq_status (*piece_fn)(const void *v, int32_t id, char *buf, size_t cap, size_t *len);

static kvpq_status vocab_tok(const void *v, const char *text, size_t len, int add_bos, int parse_special, int32_t *ids,
                             size_t cap, size_t *n) {
    return kvpq_vocab_tokenize(v, text, len, add_bos, parse_special, ids, cap, n);
}
static kvpq_status vocab_piece(const void *v, int32_t id, char *buf, size_t cap, size_t *len) {
    return kvpq_vocab_piece(v, id, buf, cap, len);
}
static kvpq_status tok_tok(const void *v, const char *text, size_t len, int add_bos, int parse_special, int32_t *ids,
                           size_t cap, size_t *n) {
    return kvpq_tokenizer_encode(v, text, len, add_bos, parse_special, ids, cap, n);
}
static kvpq_status tok_piece(const void *v, int32_t id, char *buf, size_t cap, size_t *len) {
    return kvpq_tokenizer_piece(v, id, buf, cap, len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static kvpq_tokenizer *qwen2, *spm[2];
    if (size == 0) return 0;
    int add_bos = data[0] & 1, parse_special = (data[0] >> 1) & 1, which = (data[0] >> 2) & 3;
    const void *v;
    tok_fn tok = tok_tok;
    piece_fn piece = tok_piece;
    int32_t n_vocab, bos;
    if (which == 0) {
        const kvpq_vocab *mv = model_vocab();
        v = mv, tok = vocab_tok, piece = vocab_piece;
        n_vocab = kvpq_vocab_n_tokens(mv), bos = kvpq_vocab_bos(mv);
    } else if (which == 1) {
        if (!qwen2) qwen2 = bpe_qwen2_vocab();
        v = qwen2, n_vocab = kvpq_tokenizer_n_vocab(qwen2), bos = kvpq_tokenizer_bos(qwen2);
    } else {
        if (!spm[which - 2]) spm[which - 2] = spm_vocab(which - 2);
        v = spm[which - 2], n_vocab = kvpq_tokenizer_n_vocab(v), bos = kvpq_tokenizer_bos(v);
    }
    int is_spm = which >= 2;
    size_t len = size - 1;
    char *text = malloc(len ? len : 1); /* exactly len bytes, so ASan sees any overread */
    if (!text) return 0;
    memcpy(text, data + 1, len);
    size_t n = 0;
    kvpq_status s = tok(v, text, len, add_bos, parse_special, NULL, 0, &n);
    if (is_spm && s != KVPQ_OK) abort(); /* every byte has a fallback token */
    if (s == KVPQ_OK) {
        int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
        size_t n2 = 0;
        if (tok(v, text, len, add_bos, parse_special, ids, n, &n2) != KVPQ_OK || n2 != n) abort();
        if (add_bos && (n == 0 || ids[0] != bos)) abort();
        if (len > 0 && n == (size_t)add_bos) abort(); /* text never vanishes */
        for (size_t i = 0; i < n; i++)
            if (ids[i] < 0 || ids[i] >= n_vocab) abort();
        /* SentencePiece writes ' ' as U+2581: the pieces give the text back when no marker was
         * added (prefix), none came from the text and no stray byte took one along. */
        int exact = !is_spm || (which == 2 && valid_utf8((const uint8_t *)text, len) &&
                                !memmem(text, len, "\xe2\x96\x81", 3));
        if (exact) {
            size_t off = 0;
            for (size_t i = add_bos ? 1 : 0; i < n; i++) {
                char p[256];
                size_t pl;
                if (piece(v, ids[i], p, sizeof p, &pl) != KVPQ_OK || pl > sizeof p) abort();
                if (off + pl > len || memcmp(text + off, p, pl) != 0) abort(); /* round trip */
                off += pl;
            }
            if (off != len) abort();
        }
        free(ids);
    } else if ((s != KVPQ_ERR_INVALID_ARG && s != KVPQ_ERR_UNSUPPORTED) || n != 0 || kvpq_last_error()[0] == '\0') {
        abort();
    }
    free(text);
    return 0;
}
