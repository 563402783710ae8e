/* tokenizer.c — the two tokenizers of llama.cpp-converted GGUF files, over their tokenizer.ggml.* keys:
 *   - byte-level BPE (GPT-2 style, tokenizer.ggml.model "gpt2": SmolLM2, Qwen2.5, Llama 3);
 *   - SentencePiece-style BPE over scores (tokenizer.ggml.model "llama": Gemma, Llama 2, Mistral).
 *
 * Pipeline of kvpq_tokenizer_encode:
 *   1. (byte-level BPE) validate UTF-8 (PCRE2's UTF check, which reports the offset of the bad byte);
 *   2. cut the text at special tokens as llama.cpp's tokenizer_st_partition does: every token text
 *      of type USER_DEFINED always, and of type CONTROL / UNKNOWN only with parse_special; longer
 *      token texts are cut first, each at its leftmost occurrences not inside an earlier cut;
 *   3a. byte-level BPE: pre-tokenize each fragment by the chain of regexes named by
 *      tokenizer.ggml.pre (PCRE2, UTF + Unicode properties, JIT when available). As in llama.cpp's
 *      unicode_regex_split, each regex splits the pieces left by the previous one and the text
 *      between matches is kept as a piece; then byte-pair-encode each piece: start from one symbol
 *      per byte and repeatedly merge the adjacent pair of lowest merge rank (leftmost on ties), with
 *      a binary heap of candidate pairs and lazy invalidation: O(n log n) per piece;
 *   3b. SentencePiece BPE: each fragment, with ' ' written as U+2581 '▁' (and one '▁' in front when
 *      tokenizer.ggml.add_space_prefix and the fragment starts the text or follows a special token),
 *      starts as one symbol per UTF-8 character; the adjacent pair whose concatenation is the token
 *      of highest score merges first (leftmost on ties), until no pair is a token (Kudo & Richardson
 *      2018, SentencePiece's BPE model; the same loop as llama.cpp's llm_tokenizer_spm). A final
 *      symbol that is not a token is written as its bytes' <0xNN> tokens (byte fallback).
 *
 * Byte-level token texts in GGUF are in the GPT-2 "bytes to unicode" form (each byte mapped to a
 * printable code point, e.g. ' ' -> U+0120 'Ġ'); they are decoded to raw bytes once at load, so
 * merging, lookup and detokenization all work on raw bytes. SentencePiece token texts stay as the
 * file has them (lookup works on the '▁' form) and their pieces are decoded once at load ('▁' -> ' ',
 * <0xNN> -> that byte). Special tokens (CONTROL / USER_DEFINED / UNKNOWN) keep their text as is.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "tokenizer.h"

/* llama.cpp token types (tokenizer.ggml.token_type). */
enum { TOKEN_NORMAL = 1, TOKEN_UNKNOWN = 2, TOKEN_CONTROL = 3, TOKEN_USER_DEFINED = 4, TOKEN_UNUSED = 5,
       TOKEN_BYTE = 6 };

enum { KIND_BPE, KIND_SPM }; /* tokenizer.ggml.model "gpt2", "llama" */

/* How a token's text is cut out of input text (special_attr): */
#define SPECIAL_CTRL 1 /* CONTROL / UNKNOWN: only with parse_special */
#define SPECIAL_USER 2 /* USER_DEFINED: always, as llama.cpp and HF tokenizers' non-special added tokens */

#define MAX_PRE_REGEX 4

// ---- pre-tokenizers ------------------------------------------------------------------------------

/* GPT-2's split pattern as HF tokenizers' ByteLevel pre-tokenizer has it (the trailing \s+ alternative
 * makes every character part of some match; llama.cpp omits it but keeps unmatched text as pieces,
 * which splits identically). */
#define RE_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"

/* Regex chains per tokenizer.ggml.pre name, as llama.cpp's llm_tokenizer_bpe selects them. */
typedef struct {
    const char *name;
    int n_regex;
    const char *regex[MAX_PRE_REGEX];
} pre_spec;

static const pre_spec k_pre[] = {
    /* SmolLM / StarCoder family. HF: Sequence[Digits(individual_digits=True), ByteLevel]: every
     * \p{N} character is a piece of its own, then the GPT-2 pattern splits the rest. */
    {"smollm", 2, {"\\p{N}", RE_GPT2}},
    {"starcoder", 2, {"\\p{N}", RE_GPT2}},
    {"gpt2", 1, {RE_GPT2}},
    /* llama.cpp's fallback chain for BPE vocabularies without a recognised pre-tokenizer. */
    {"default", 4, {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    /* Llama 3. The contractions are spelled case-insensitively by hand rather than with (?i:...):
     * under Unicode case folding 's' would also match U+017F and 'k' U+212A. */
    {"llama-bpe", 1,
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
      "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    /* Qwen2 / Qwen2.5: the Llama 3 pattern with single digits (\\p{N} instead of \\p{N}{1,3}), as the
     * models' tokenizer.json has it; llama.cpp uses the same for stablelm2 and hunyuan. */
    {"qwen2", 1,
     {"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
      "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
};

// ---- the tokenizer object ------------------------------------------------------------------------

typedef struct {
    int32_t left, right;   /* token ids of the pair; left = -1 marks an empty slot */
    int32_t rank;          /* index in tokenizer.ggml.merges: lower merges first */
    int32_t merged;        /* token id of left + right */
} merge_slot;

/* Token text -> id (open addressing over the token texts in pool). Each slot keeps 32 more bits of
 * the hash, so a probe reads the token's text only when those match: most SentencePiece lookups
 * are of pairs that are no token, and would otherwise miss the cache twice (offsets, text). */
typedef struct {
    int32_t id;      /* -1: empty */
    uint32_t tag;    /* hash >> 32 */
} text_slot;
typedef struct {
    text_slot *slot; // (mask + 1)
    uint64_t mask;
} text_index;

struct kvpq_tokenizer {
    int kind;                /* KIND_BPE / KIND_SPM */
    int32_t n_vocab;
    char *pool;              /* every token's text, concatenated: raw bytes (BPE), the file's text (SPM) */
    uint32_t *text_off;      // (n_vocab + 1) offsets into pool
    uint8_t *type;           // (n_vocab) token type (TOKEN_*)
    uint8_t *special_attr;   // (n_vocab) SPECIAL_* bits, 0 for tokens never cut out of text
    /* Token of each single byte; -1 where the vocabulary lacks it (SmolLM2 has no token for 21
     * bytes, e.g. 0x04 and 0xc0): such a byte in the text is an error rather than silently dropped
     * as HF tokenizers and llama.cpp do. SPM: the <0xNN> token, else the one-byte text's. */
    int32_t byte_token[256];

    merge_slot *merges;      // (merge_mask + 1) open-addressing table keyed by (left, right) (BPE)
    uint64_t merge_mask;

    /* Special tokens (special_attr != 0), sorted by their first two bytes, longest first within. */
    int32_t *special;        // (n_special)
    int32_t n_special;
    int32_t *special_start2; // (65537) specials of 2+ bytes starting with bytes (b0, b1) at [b0 << 8 | b1]
    int32_t special_single[256]; /* the special whose text is this one byte, -1 */
    uint8_t special_first[256];  /* some special starts with this byte */

    int n_regex;             /* BPE pre-tokenizer */
    pcre2_code *regex[MAX_PRE_REGEX];
    int jit;                 /* every regex was JIT-compiled */
    char pre[64];

    /* SPM */
    float *score;            // (n_vocab) tokenizer.ggml.scores: higher merges first
    text_index ix;           /* token text -> id */
    char *piece_pool;        /* decoded pieces: '▁' -> ' ', <0xNN> -> the byte */
    uint32_t *piece_off;     // (n_vocab + 1) offsets into piece_pool
    int add_space_prefix;

    int32_t bos, eos;        /* -1 when absent */
    int add_bos;
};

static inline const char *tok_text(const kvpq_tokenizer *t, int32_t id, size_t *len) {
    *len = t->text_off[id + 1] - t->text_off[id];
    return t->pool + t->text_off[id];
}

static inline uint64_t mix64(uint64_t x) {
    /* splitmix64 finalizer: a cheap full-avalanche hash for integer keys. */
    x ^= x >> 30; x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27; x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static inline uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ULL;
    return mix64(h);
}

static inline const merge_slot *merge_find(const kvpq_tokenizer *t, int32_t left, int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    for (uint64_t i = mix64(key) & t->merge_mask;; i = (i + 1) & t->merge_mask) {
        const merge_slot *s = &t->merges[i];
        if (s->left < 0) return NULL;
        if (s->left == left && s->right == right) return s;
    }
}

int32_t kvpq_tokenizer_n_vocab(const kvpq_tokenizer *t) { return t ? t->n_vocab : 0; }
int32_t kvpq_tokenizer_bos(const kvpq_tokenizer *t) { return t ? t->bos : -1; }
int32_t kvpq_tokenizer_eos(const kvpq_tokenizer *t) { return t ? t->eos : -1; }
int kvpq_tokenizer_add_bos_default(const kvpq_tokenizer *t) { return t ? t->add_bos : 0; }

unsigned kvpq_tokenizer_token_attr(const kvpq_tokenizer *t, int32_t token) {
    if (!t || token < 0 || token >= t->n_vocab) return 0;
    return ((t->special_attr[token] & SPECIAL_CTRL) ? KVPQ_TOKEN_ATTR_CONTROL : 0u) |
           ((t->special_attr[token] & SPECIAL_USER) ? KVPQ_TOKEN_ATTR_USER_DEFINED : 0u) |
           (t->kind == KIND_SPM && t->type[token] == TOKEN_BYTE ? KVPQ_TOKEN_ATTR_BYTE : 0u);
}

void kvpq_tokenizer_free(kvpq_tokenizer *t) {
    if (!t) return;
    for (int i = 0; i < t->n_regex; i++) pcre2_code_free(t->regex[i]);
    free(t->pool);
    free(t->text_off);
    free(t->type);
    free(t->special_attr);
    free(t->merges);
    free(t->special);
    free(t->special_start2);
    free(t->score);
    free(t->ix.slot);
    free(t->piece_pool);
    free(t->piece_off);
    free(t);
}

// ---- GPT-2 byte <-> unicode mapping --------------------------------------------------------------

/* GPT-2 maps bytes 33..126, 161..172 and 174..255 to the same code point and the 68 others, in
 * increasing order, to U+0100 onwards (Radford et al. 2019, encoder.py bytes_to_unicode). This is
 * the inverse: code point -> byte, -1 where a code point is not the image of a byte. */
static void unicode_to_byte_table(int16_t inv[324]) {
    for (int c = 0; c < 324; c++) inv[c] = -1;
    int n = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        inv[printable ? b : 256 + n++] = (int16_t)b;
    }
}

/* Decode one UTF-8 code point at s[0..n) (n >= 1); returns its length, or 0 if malformed. Only used
 * on vocabulary strings at load; input text is validated by PCRE2. */
static size_t utf8_decode(const uint8_t *s, size_t n, uint32_t *cp) {
    if (s[0] < 0x80) { *cp = s[0]; return 1; }
    size_t len = (s[0] & 0xe0) == 0xc0 ? 2 : (s[0] & 0xf0) == 0xe0 ? 3 : (s[0] & 0xf8) == 0xf0 ? 4 : 0;
    if (len == 0 || len > n) return 0;
    uint32_t c = s[0] & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    *cp = c;
    return len;
}

/* Map a token text from the byte-level form to raw bytes into out (at most n bytes: never longer).
 * Returns the byte count, or -1 if some character is not the image of a byte. */
static long byte_level_decode(const int16_t inv[324], const char *s, size_t n, char *out) {
    size_t i = 0, o = 0;
    while (i < n) {
        uint32_t cp;
        size_t l = utf8_decode((const uint8_t *)s + i, n - i, &cp);
        if (l == 0 || cp >= 324 || inv[cp] < 0) return -1;
        out[o++] = (char)inv[cp];
        i += l;
    }
    return (long)o;
}

// ---- construction --------------------------------------------------------------------------------

static int32_t text_index_find(const kvpq_tokenizer *t, const text_index *ix, const char *s, size_t n) {
    uint64_t h = hash_bytes(s, n);
    uint32_t tag = (uint32_t)(h >> 32);
    for (uint64_t i = h & ix->mask;; i = (i + 1) & ix->mask) {
        const text_slot *e = &ix->slot[i];
        if (e->id < 0) return -1;
        if (e->tag != tag) continue;
        size_t len;
        const char *txt = tok_text(t, e->id, &len);
        if (len == n && memcmp(txt, s, n) == 0) return e->id;
    }
}

static uint64_t pow2_at_least(uint64_t n) {
    uint64_t p = 16;
    while (p < n) p <<= 1;
    return p;
}

/* Index every non-empty token text. Where two tokens share a text, the first id wins (as HF
 * tokenizers' vocabulary, for BPE) or the last (as llama.cpp's token_to_id map, for SPM). */
static kvpq_status build_text_index(const kvpq_tokenizer *t, text_index *ix, int last_wins) {
    ix->mask = pow2_at_least((uint64_t)t->n_vocab * 2) - 1;
    ix->slot = malloc((ix->mask + 1) * sizeof *ix->slot);
    if (!ix->slot) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: token index of %d entries", t->n_vocab);
    memset(ix->slot, 0xff, (ix->mask + 1) * sizeof *ix->slot);
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t len;
        const char *s = tok_text(t, id, &len);
        if (len == 0) continue;
        uint64_t h = hash_bytes(s, len), i = h & ix->mask;
        for (; ix->slot[i].id >= 0; i = (i + 1) & ix->mask) {
            size_t l2;
            const char *s2 = tok_text(t, ix->slot[i].id, &l2);
            if (l2 == len && memcmp(s2, s, len) == 0) break;
        }
        if (ix->slot[i].id < 0 || last_wins) ix->slot[i] = (text_slot){id, (uint32_t)(h >> 32)};
    }
    return KVPQ_OK;
}

static kvpq_status load_vocab(kvpq_tokenizer *t, const gguf_file *f, const int16_t inv[324]) {
    gguf_type et;
    uint64_t n;
    KVPQ_TRY(gguf_get_arr_info(f, "tokenizer.ggml.tokens", &et, &n));
    if (et != GGUF_TYPE_STRING)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.tokens: array of type %d, expected strings", (int)et);
    if (n == 0 || n > INT32_MAX - 1)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.tokens: %llu tokens", (unsigned long long)n);
    t->n_vocab = (int32_t)n;

    t->type = malloc(n);
    t->text_off = malloc((n + 1) * sizeof *t->text_off);
    if (!t->type || !t->text_off) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: %llu tokens", (unsigned long long)n);

    if (gguf_find_key(f, "tokenizer.ggml.token_type") >= 0) {
        uint64_t nt;
        const void *data;
        KVPQ_TRY(gguf_get_arr_info(f, "tokenizer.ggml.token_type", &et, &nt));
        if (et != GGUF_TYPE_INT32 && et != GGUF_TYPE_UINT32)
            return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.token_type: array of type %d, expected int32", (int)et);
        if (nt != n)
            return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.token_type: %llu entries for %llu tokens",
                             (unsigned long long)nt, (unsigned long long)n);
        KVPQ_TRY(gguf_get_arr_data(f, "tokenizer.ggml.token_type", &data));
        for (uint64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, (const char *)data + 4 * i, 4); /* GGUF is little-endian, like every target */
            t->type[i] = (v >= TOKEN_NORMAL && v <= TOKEN_BYTE) ? (uint8_t)v : TOKEN_NORMAL;
        }
    } else {
        memset(t->type, TOKEN_NORMAL, n);
    }

    /* Raw bytes are never longer than the byte-level text, so the GGUF sizes bound the pool. */
    size_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        KVPQ_TRY(gguf_get_arr_str(f, "tokenizer.ggml.tokens", i, &s, &len));
        total += len;
    }
    if (total > UINT32_MAX)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.tokens: %zu bytes of text", total);
    t->pool = malloc(total ? total : 1);
    if (!t->pool) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: %zu bytes of token text", total);

    size_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        KVPQ_TRY(gguf_get_arr_str(f, "tokenizer.ggml.tokens", i, &s, &len));
        t->text_off[i] = (uint32_t)off;
        long raw = -1;
        if (t->kind == KIND_BPE && t->type[i] != TOKEN_CONTROL && t->type[i] != TOKEN_USER_DEFINED &&
            t->type[i] != TOKEN_UNKNOWN)
            raw = byte_level_decode(inv, s, len, t->pool + off);
        if (raw < 0) { /* special, or not byte-level text (as llama.cpp, give the text as is) */
            memcpy(t->pool + off, s, len);
            raw = (long)len;
        }
        off += (size_t)raw;
    }
    t->text_off[n] = (uint32_t)off;

    for (int b = 0; b < 256; b++) t->byte_token[b] = -1;
    return KVPQ_OK;
}

/* tokenizer.ggml.scores (float32, or int32 as llama.cpp also reads); all 0 when absent. */
static kvpq_status load_scores(kvpq_tokenizer *t, const gguf_file *f) {
    t->score = calloc((size_t)t->n_vocab, sizeof *t->score);
    if (!t->score) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: %d scores", t->n_vocab);
    if (gguf_find_key(f, "tokenizer.ggml.scores") < 0) return KVPQ_OK;
    gguf_type et;
    uint64_t n;
    const void *data;
    KVPQ_TRY(gguf_get_arr_info(f, "tokenizer.ggml.scores", &et, &n));
    if (et != GGUF_TYPE_FLOAT32 && et != GGUF_TYPE_INT32)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.scores: array of type %d, expected float32", (int)et);
    if (n != (uint64_t)t->n_vocab)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.scores: %llu entries for %d tokens", (unsigned long long)n,
                         t->n_vocab);
    KVPQ_TRY(gguf_get_arr_data(f, "tokenizer.ggml.scores", &data));
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (et == GGUF_TYPE_FLOAT32) {
            memcpy(&t->score[i], (const char *)data + 4 * (size_t)i, 4);
        } else {
            int32_t v;
            memcpy(&v, (const char *)data + 4 * (size_t)i, 4);
            t->score[i] = (float)v;
        }
    }
    return KVPQ_OK;
}

/* "<0xNN>" (two hex digits, either case) -> NN, else -1. */
static int byte_token_value(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    int v = 0;
    for (int k = 3; k < 5; k++) {
        char c = s[k];
        int d = (c >= '0' && c <= '9') ? c - '0' : (c >= 'A' && c <= 'F') ? c - 'A' + 10 : (c >= 'a' && c <= 'f') ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = 16 * v + d;
    }
    return v;
}

/* SPM pieces as detokenization gives them: NORMAL (and UNUSED) texts with '▁' as ' ', BYTE tokens as
 * their byte, special tokens as their text. llama.cpp gives UNUSED tokens no text at all; here every
 * token keeps a piece, so decoding never loses what a model emitted. */
static kvpq_status build_spm_pieces(kvpq_tokenizer *t) {
    size_t total = t->text_off[t->n_vocab]; /* a piece is never longer than its text */
    t->piece_pool = malloc(total ? total : 1);
    t->piece_off = malloc(((size_t)t->n_vocab + 1) * sizeof *t->piece_off);
    if (!t->piece_pool || !t->piece_off) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: %zu bytes of pieces", total);
    size_t o = 0;
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t n;
        const char *s = tok_text(t, id, &n);
        t->piece_off[id] = (uint32_t)o;
        int byte = t->type[id] == TOKEN_BYTE ? byte_token_value(s, n) : -1;
        if (byte >= 0) {
            t->piece_pool[o++] = (char)byte;
        } else if (t->type[id] == TOKEN_CONTROL || t->type[id] == TOKEN_USER_DEFINED || t->type[id] == TOKEN_UNKNOWN) {
            memcpy(t->piece_pool + o, s, n);
            o += n;
        } else {
            for (size_t i = 0; i < n;) {
                if (i + 3 <= n && memcmp(s + i, "\xe2\x96\x81", 3) == 0) {
                    t->piece_pool[o++] = ' ';
                    i += 3;
                } else {
                    t->piece_pool[o++] = s[i++];
                }
            }
        }
    }
    t->piece_off[t->n_vocab] = (uint32_t)o;
    return KVPQ_OK;
}

static kvpq_status load_merges(kvpq_tokenizer *t, const gguf_file *f, const text_index *ix,
                               const int16_t inv[324]) {
    gguf_type et;
    uint64_t n;
    KVPQ_TRY(gguf_get_arr_info(f, "tokenizer.ggml.merges", &et, &n));
    if (et != GGUF_TYPE_STRING)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.merges: array of type %d, expected strings", (int)et);
    if (n > INT32_MAX / 2)
        return kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.merges: %llu merges", (unsigned long long)n);
    t->merge_mask = pow2_at_least(n * 2 + 1) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof *t->merges);
    if (!t->merges) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: merge table of %llu entries", (unsigned long long)n);
    memset(t->merges, 0xff, (t->merge_mask + 1) * sizeof *t->merges);

    char *buf = NULL;
    size_t buf_cap = 0;
    kvpq_status st = KVPQ_OK;
    for (uint64_t r = 0; r < n && st == KVPQ_OK; r++) {
        const char *s;
        size_t len;
        st = gguf_get_arr_str(f, "tokenizer.ggml.merges", r, &s, &len);
        if (st != KVPQ_OK) break;
        /* "A B" in byte-level form: ' ' itself is never part of a byte-level token (it maps to U+0120). */
        const char *sp = memchr(s, ' ', len);
        if (!sp || sp == s || sp + 1 == s + len || memchr(sp + 1, ' ', (size_t)(s + len - sp - 1))) {
            st = kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.merges[%llu] '%.*s': expected 'A B'",
                           (unsigned long long)r, (int)(len > 64 ? 64 : len), s);
            break;
        }
        if (len > buf_cap) {
            char *nb = realloc(buf, len);
            if (!nb) { st = kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: merge buffer"); break; }
            buf = nb;
            buf_cap = len;
        }
        size_t la = (size_t)(sp - s), lb = len - la - 1;
        long ra = byte_level_decode(inv, s, la, buf);
        long rb = ra < 0 ? -1 : byte_level_decode(inv, sp + 1, lb, buf + ra);
        if (ra < 0 || rb < 0) {
            st = kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.merges[%llu] '%.*s': not byte-level text",
                           (unsigned long long)r, (int)(len > 64 ? 64 : len), s);
            break;
        }
        int32_t a = text_index_find(t, ix, buf, (size_t)ra);
        int32_t b = text_index_find(t, ix, buf + ra, (size_t)rb);
        int32_t ab = text_index_find(t, ix, buf, (size_t)(ra + rb));
        if (a < 0 || b < 0 || ab < 0) {
            /* As HF tokenizers, which refuses such a vocabulary ("merge token out of vocabulary"). */
            st = kvpq__err(KVPQ_ERR_FORMAT, "tokenizer.ggml.merges[%llu] '%.*s': %s not in tokenizer.ggml.tokens",
                           (unsigned long long)r, (int)(len > 64 ? 64 : len), s,
                           a < 0 ? "left part" : b < 0 ? "right part" : "merged token");
            break;
        }
        uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
        uint64_t i = mix64(key) & t->merge_mask;
        while (t->merges[i].left >= 0 && !(t->merges[i].left == a && t->merges[i].right == b))
            i = (i + 1) & t->merge_mask;
        if (t->merges[i].left >= 0) continue; /* repeated pair: the first (lowest) rank wins */
        t->merges[i] = (merge_slot){a, b, (int32_t)r, ab};
    }
    free(buf);
    return st;
}

/* Texts that llama.cpp's vocabulary loader treats as end-of-generation tokens and therefore marks
 * CONTROL whatever the file's token type says (llama_vocab::impl::load): Qwen2.5's "</s>" (a NORMAL
 * token) and Gemma-3's "</s>" (USER_DEFINED) are cut out of text only with parse_special. */
static const char *const k_eog_text[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xef\xbd\x9c" "end\xe2\x96\x81" "of\xe2\x96\x81" "sentence\xef\xbd\x9c>", "[e~[",
};

static int cmp_special(const void *pa, const void *pb, void *ctx) {
    const kvpq_tokenizer *t = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    size_t la, lb;
    const char *sa = tok_text(t, a, &la), *sb = tok_text(t, b, &lb);
    int ka = (uint8_t)sa[0] << 8 | (uint8_t)sa[1], kb = (uint8_t)sb[0] << 8 | (uint8_t)sb[1];
    if (ka != kb) return ka < kb ? -1 : 1;
    if (la != lb) return la > lb ? -1 : 1; /* longest first */
    return a < b ? -1 : a > b;
}

/* Which tokens are cut out of text (special_attr) and the index that finds them at a position. */
static kvpq_status load_specials(kvpq_tokenizer *t, const text_index *ix) {
    t->special_attr = calloc((size_t)t->n_vocab, 1);
    t->special_start2 = malloc(65537 * sizeof *t->special_start2);
    if (!t->special_attr || !t->special_start2) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: special tokens");
    for (int32_t id = 0; id < t->n_vocab; id++) {
        uint8_t ty = t->type[id];
        t->special_attr[id] = (ty == TOKEN_CONTROL || ty == TOKEN_UNKNOWN) ? SPECIAL_CTRL
                              : ty == TOKEN_USER_DEFINED                   ? SPECIAL_USER
                                                                           : 0;
    }
    /* Looked up by their text in t->pool (raw bytes for BPE). llama.cpp looks up the byte-level
     * text, which is the same for every ASCII name; only DeepSeek's name is not ASCII. */
    for (size_t k = 0; k < sizeof k_eog_text / sizeof k_eog_text[0]; k++) {
        int32_t id = text_index_find(t, ix, k_eog_text[k], strlen(k_eog_text[k]));
        if (id >= 0) t->special_attr[id] = SPECIAL_CTRL;
    }
    /* ... except that "</s>" stays a plain token beside another end marker (Gemma 4, PLaMo 2). */
    if (text_index_find(t, ix, "<|tool_response>", 16) >= 0 || text_index_find(t, ix, "<|plamo:eos|>", 13) >= 0) {
        int32_t id = text_index_find(t, ix, "</s>", 4);
        if (id >= 0) t->special_attr[id] = 0;
    }
    int32_t n = 0;
    for (int b = 0; b < 256; b++) t->special_single[b] = -1;
    memset(t->special_first, 0, sizeof t->special_first);
    for (int32_t id = 0; id < t->n_vocab; id++) {
        size_t len;
        const char *s = tok_text(t, id, &len);
        if (!t->special_attr[id] || len == 0) continue;
        t->special_first[(uint8_t)s[0]] = 1;
        if (len == 1) t->special_single[(uint8_t)s[0]] = id;
        else n++;
    }
    t->special = malloc((size_t)(n ? n : 1) * sizeof *t->special);
    if (!t->special) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: %d special tokens", n);
    t->n_special = 0;
    for (int32_t id = 0; id < t->n_vocab; id++)
        if (t->special_attr[id] && t->text_off[id + 1] - t->text_off[id] >= 2) t->special[t->n_special++] = id;
    qsort_r(t->special, (size_t)t->n_special, sizeof *t->special, cmp_special, t);
    int32_t k = 0;
    for (int key = 0; key < 65536; key++) {
        t->special_start2[key] = k;
        while (k < t->n_special) {
            const uint8_t *s = (const uint8_t *)t->pool + t->text_off[t->special[k]];
            if ((s[0] << 8 | s[1]) != key) break;
            k++;
        }
    }
    t->special_start2[65536] = k;
    return KVPQ_OK;
}

static kvpq_status compile_pre(kvpq_tokenizer *t, const char *pre, size_t pre_len) {
    const pre_spec *spec = NULL;
    for (size_t i = 0; i < sizeof k_pre / sizeof k_pre[0]; i++)
        if (strlen(k_pre[i].name) == pre_len && memcmp(k_pre[i].name, pre, pre_len) == 0) spec = &k_pre[i];
    if (!spec) {
        char names[256] = "";
        for (size_t i = 0; i < sizeof k_pre / sizeof k_pre[0]; i++) {
            if (i) strncat(names, ", ", sizeof names - strlen(names) - 1);
            strncat(names, k_pre[i].name, sizeof names - strlen(names) - 1);
        }
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "tokenizer.ggml.pre '%.*s': unknown pre-tokenizer (supported: %s)",
                         (int)(pre_len > 64 ? 64 : pre_len), pre, names);
    }
    snprintf(t->pre, sizeof t->pre, "%s", spec->name);
    t->jit = 1;
    for (int i = 0; i < spec->n_regex; i++) {
        int err;
        PCRE2_SIZE erroff;
        t->regex[i] = pcre2_compile((PCRE2_SPTR)spec->regex[i], PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP,
                                    &err, &erroff, NULL);
        if (!t->regex[i]) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(err, msg, sizeof msg);
            return kvpq__err(KVPQ_ERR_INTERNAL, "pre-tokenizer '%s' regex %d at %zu: %s", spec->name, i,
                             (size_t)erroff, (const char *)msg);
        }
        t->n_regex = i + 1;
        /* JIT is an optimisation only: pcre2_match interprets the pattern when it is unavailable. */
        if (pcre2_jit_compile(t->regex[i], PCRE2_JIT_COMPLETE) != 0) t->jit = 0;
    }
    return KVPQ_OK;
}

static kvpq_status get_token_id(const gguf_file *f, const kvpq_tokenizer *t, const char *key, int32_t *out) {
    *out = -1;
    if (gguf_find_key(f, key) < 0) return KVPQ_OK;
    int64_t v;
    KVPQ_TRY(gguf_get_i64(f, key, &v));
    if (v < 0 || v >= t->n_vocab)
        return kvpq__err(KVPQ_ERR_FORMAT, "%s = %lld: outside the vocabulary of %d tokens", key, (long long)v, t->n_vocab);
    *out = (int32_t)v;
    return KVPQ_OK;
}

static kvpq_status from_gguf(kvpq_tokenizer *t, const gguf_file *f) {
    const char *s;
    size_t len;
    KVPQ_TRY(gguf_get_str(f, "tokenizer.ggml.model", &s, &len));
    if (len == 4 && memcmp(s, "gpt2", 4) == 0) {
        t->kind = KIND_BPE;
    } else if (len == 5 && memcmp(s, "llama", 5) == 0) {
        t->kind = KIND_SPM;
    } else {
        return kvpq__err(KVPQ_ERR_UNSUPPORTED,
                         "tokenizer.ggml.model '%.*s': supported are 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)",
                         (int)(len > 64 ? 64 : len), s);
    }
    if (t->kind == KIND_BPE) {
        if (gguf_find_key(f, "tokenizer.ggml.pre") >= 0) {
            KVPQ_TRY(gguf_get_str(f, "tokenizer.ggml.pre", &s, &len));
        } else { /* older conversions: llama.cpp falls back to its default chain too */
            s = "default";
            len = strlen(s);
        }
        KVPQ_TRY(compile_pre(t, s, len));
    } else {
        /* SentencePiece splits nothing before BPE; llama.cpp ignores tokenizer.ggml.pre here too. */
        snprintf(t->pre, sizeof t->pre, "none");
    }

    int16_t inv[324];
    unicode_to_byte_table(inv);
    KVPQ_TRY(load_vocab(t, f, inv));

    KVPQ_TRY(build_text_index(t, &t->ix, t->kind == KIND_SPM));
    if (t->kind == KIND_BPE) {
        for (int b = 0; b < 256; b++) {
            char c = (char)b;
            t->byte_token[b] = text_index_find(t, &t->ix, &c, 1);
        }
        KVPQ_TRY(load_merges(t, f, &t->ix, inv));
    } else {
        static const char hex[] = "0123456789ABCDEF";
        for (int b = 0; b < 256; b++) { /* as llama.cpp's byte_to_token: <0xNN>, else the byte's own token */
            char name[6] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>'}, c = (char)b;
            t->byte_token[b] = text_index_find(t, &t->ix, name, 6);
            if (t->byte_token[b] < 0) t->byte_token[b] = text_index_find(t, &t->ix, &c, 1);
        }
        KVPQ_TRY(load_scores(t, f));
        KVPQ_TRY(build_spm_pieces(t));
    }
    KVPQ_TRY(load_specials(t, &t->ix));
    if (t->kind == KIND_BPE) { /* only SPM looks texts up while encoding */
        free(t->ix.slot);
        t->ix.slot = NULL;
    }

    /* SentencePiece conversions without these keys mean Llama 2's ids and habits (llama.cpp's defaults). */
    KVPQ_TRY(get_token_id(f, t, "tokenizer.ggml.bos_token_id", &t->bos));
    KVPQ_TRY(get_token_id(f, t, "tokenizer.ggml.eos_token_id", &t->eos));
    if (t->kind == KIND_SPM && gguf_find_key(f, "tokenizer.ggml.bos_token_id") < 0 && t->n_vocab > 1) t->bos = 1;
    if (t->kind == KIND_SPM && gguf_find_key(f, "tokenizer.ggml.eos_token_id") < 0 && t->n_vocab > 2) t->eos = 2;
    t->add_bos = t->kind == KIND_SPM;
    if (gguf_find_key(f, "tokenizer.ggml.add_bos_token") >= 0)
        KVPQ_TRY(gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &t->add_bos));
    t->add_space_prefix = t->kind == KIND_SPM;
    if (gguf_find_key(f, "tokenizer.ggml.add_space_prefix") >= 0)
        KVPQ_TRY(gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &t->add_space_prefix));
    return KVPQ_OK;
}

kvpq_status kvpq_tokenizer_from_gguf(kvpq_tokenizer **out, const gguf_file *f) {
    if (!out || !f) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_tokenizer_from_gguf: NULL argument");
    *out = NULL;
    kvpq_tokenizer *t = calloc(1, sizeof *t);
    if (!t) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer");
    kvpq_status st = from_gguf(t, f);
    if (st != KVPQ_OK) {
        kvpq_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KVPQ_OK;
}

// ---- encoding ------------------------------------------------------------------------------------

/* A candidate merge in a heap ordered by key, smallest first. BPE: key = rank << 32 | left, so the
 * lowest rank merges first and ties go leftmost; a, b = ids of the pair when pushed (stale if either
 * changed), merged = id of the result. SPM: key = ~order(score) << 32 | left, so the highest score
 * merges first and ties go leftmost; a = right symbol, b = byte length of the pair when pushed (stale
 * unless both symbols still have those lengths), merged = id of the pair's text. */
typedef struct {
    uint64_t key;
    int32_t left;
    int32_t a, b;
    int32_t merged;
} bpe_pair;

/* A piece already encoded in this call: text[off, off + len) -> pool[start, start + n_tok). */
typedef struct {
    size_t off;
    uint32_t len;            /* 0: empty slot */
    uint32_t start, n_tok;
} piece_slot;

#define CACHE_SLOTS (1u << 16) /* at most half filled: 32768 distinct pieces, ~1.3 MiB */
#define CACHE_MAX_PIECE 64     /* longer pieces are rare and not worth keeping */

/* Everything one encode call needs; per call, so a tokenizer may be shared by threads. */
typedef struct {
    const kvpq_tokenizer *t;
    const char *text;
    int32_t *out;
    size_t cap, n;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
    /* BPE / SPM work arrays, grown to the longest piece seen */
    int32_t *id, *next, *prev;  // (work_cap)
    int32_t *sym_off, *sym_len; // (work_cap) SPM: each symbol's bytes in esc
    bpe_pair *heap;             // (3 * work_cap): n-1 initial pairs + at most 2 per merge
    size_t work_cap;
    char *esc;                  // (esc_cap) SPM: the fragment with ' ' as U+2581
    size_t esc_cap;
    /* Pieces repeat (a novel has ~220k pieces but ~15k distinct ones), so each call memoizes BPE
     * results; NULL slots (allocation failed) just disable the cache. */
    piece_slot *cache;          // (CACHE_SLOTS)
    uint32_t cache_used;
    int32_t *pool;              // (pool_cap) token ids of cached pieces
    size_t pool_n, pool_cap;
} enc_ctx;

static inline void emit(enc_ctx *c, int32_t id) {
    if (c->n < c->cap) c->out[c->n] = id;
    c->n++;
}

static void heap_push(bpe_pair *h, size_t *n, bpe_pair p) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (p.key >= h[parent].key) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = p;
}

static bpe_pair heap_pop(bpe_pair *h, size_t *n) {
    bpe_pair top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1;
        if (l >= *n) break;
        size_t m = (l + 1 < *n && h[l + 1].key < h[l].key) ? l + 1 : l;
        if (h[m].key >= last.key) break;
        h[i] = h[m];
        i = m;
    }
    if (*n > 0) h[i] = last;
    return top;
}

static inline void push_pair(enc_ctx *c, size_t *hn, int32_t left, int32_t right) {
    const merge_slot *m = merge_find(c->t, c->id[left], c->id[right]);
    if (m)
        heap_push(c->heap, hn,
                  (bpe_pair){(uint64_t)(uint32_t)m->rank << 32 | (uint32_t)left, left, c->id[left], c->id[right], m->merged});
}

static kvpq_status work_reserve(enc_ctx *c, size_t n) {
    if (n <= c->work_cap) return KVPQ_OK;
    size_t cap = c->work_cap ? c->work_cap : 64;
    while (cap < n) cap *= 2;
    int32_t **arr[] = {&c->id, &c->next, &c->prev, &c->sym_off, &c->sym_len};
    int ok = 1;
    for (size_t k = 0; k < sizeof arr / sizeof arr[0]; k++) {
        int32_t *p = realloc(*arr[k], cap * sizeof **arr[k]);
        if (p) *arr[k] = p;
        else ok = 0;
    }
    bpe_pair *heap = realloc(c->heap, 3 * cap * sizeof *heap);
    if (heap) c->heap = heap;
    if (!ok || !heap) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: work space for a %zu-byte piece", n);
    c->work_cap = cap;
    return KVPQ_OK;
}

/* Room for n more ids in the cache pool; 0 if it cannot grow (the piece is then not cached). */
static int cache_reserve(enc_ctx *c, size_t n) {
    if (c->pool_n + n <= c->pool_cap) return 1;
    size_t cap = c->pool_cap ? 2 * c->pool_cap : 4096;
    while (cap < c->pool_n + n) cap *= 2;
    if (cap > UINT32_MAX) return 0;
    int32_t *pool = realloc(c->pool, cap * sizeof *pool);
    if (!pool) return 0;
    c->pool = pool;
    c->pool_cap = cap;
    return 1;
}

/* Byte-pair-encode one pre-tokenized piece text[s, e). */
static kvpq_status bpe_piece(enc_ctx *c, size_t s, size_t e) {
    const kvpq_tokenizer *t = c->t;
    const uint8_t *p = (const uint8_t *)c->text + s;
    size_t n = e - s;
    for (size_t i = 0; i < n; i++)
        if (t->byte_token[p[i]] < 0)
            return kvpq__err(KVPQ_ERR_UNSUPPORTED, "text: byte 0x%02x at byte offset %zu has no token in this vocabulary",
                             p[i], s + i);
    if (n == 1) {
        emit(c, t->byte_token[p[0]]);
        return KVPQ_OK;
    }
    piece_slot *slot = NULL;
    if (c->cache && n <= CACHE_MAX_PIECE) {
        uint64_t i = hash_bytes((const char *)p, n) & (CACHE_SLOTS - 1);
        for (;; i = (i + 1) & (CACHE_SLOTS - 1)) {
            piece_slot *q = &c->cache[i];
            if (q->len == 0) break;
            if (q->len == n && memcmp(c->text + q->off, p, n) == 0) {
                for (uint32_t k = 0; k < q->n_tok; k++) emit(c, c->pool[q->start + k]);
                return KVPQ_OK;
            }
        }
        if (c->cache_used < CACHE_SLOTS / 2) slot = &c->cache[i];
    }
    if (n > INT32_MAX) return kvpq__err(KVPQ_ERR_CAPACITY, "tokenizer: a %zu-byte piece", n);
    KVPQ_TRY(work_reserve(c, n));
    int32_t *id = c->id, *next = c->next, *prev = c->prev;
    for (size_t i = 0; i < n; i++) {
        id[i] = t->byte_token[p[i]];
        next[i] = (int32_t)i + 1;
        prev[i] = (int32_t)i - 1;
    }
    next[n - 1] = -1;
    size_t hn = 0;
    for (size_t i = 0; i + 1 < n; i++) push_pair(c, &hn, (int32_t)i, (int32_t)i + 1);
    while (hn > 0) {
        bpe_pair top = heap_pop(c->heap, &hn);
        int32_t l = top.left, r = next[l];
        /* Stale when the left symbol was absorbed (id -1), or either side changed since the push. */
        if (id[l] != top.a || r < 0 || id[r] != top.b) continue;
        id[l] = top.merged;
        id[r] = -1;
        next[l] = next[r];
        if (next[r] >= 0) prev[next[r]] = l;
        if (prev[l] >= 0) push_pair(c, &hn, prev[l], l);
        if (next[l] >= 0) push_pair(c, &hn, l, next[l]);
    }
    size_t n_out = c->n;
    for (int32_t i = 0; i >= 0; i = next[i]) emit(c, id[i]);
    n_out = c->n - n_out;
    if (slot && cache_reserve(c, n_out)) {
        *slot = (piece_slot){(size_t)(p - (const uint8_t *)c->text), (uint32_t)n, (uint32_t)c->pool_n, (uint32_t)n_out};
        for (int32_t i = 0; i >= 0; i = next[i]) c->pool[c->pool_n++] = id[i];
        c->cache_used++;
    }
    return KVPQ_OK;
}

static kvpq_status regex_error(int rc) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    return kvpq__err(KVPQ_ERR_INTERNAL, "tokenizer: PCRE2 match failed: %s", (const char *)msg);
}

static inline int run_regex(const enc_ctx *c, const pcre2_code *re, const char *subject, size_t len, size_t start) {
    /* The text was validated once; skip PCRE2's per-call UTF check (which would rescan the subject). */
    if (c->t->jit) return pcre2_jit_match(re, (PCRE2_SPTR)subject, len, start, 0, c->md, c->mctx);
    return pcre2_match(re, (PCRE2_SPTR)subject, len, start, PCRE2_NO_UTF_CHECK, c->md, c->mctx);
}

/* Split text[s, e) by regex `level`, recursing into the next regex for every match and every gap
 * between matches; after the last regex, the pieces go to BPE. Each regex sees only its piece, so
 * lookaheads stop at the piece's end (as in llama.cpp and HF tokenizers). */
static kvpq_status split(enc_ctx *c, int level, size_t s, size_t e) {
    if (s >= e) return KVPQ_OK;
    if (level == c->t->n_regex) return bpe_piece(c, s, e);
    const pcre2_code *re = c->t->regex[level];
    const char *sub = c->text + s;
    size_t len = e - s, off = 0, gap = 0;
    while (off < len) {
        int rc = run_regex(c, re, sub, len, off);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) return regex_error(rc);
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* an empty match splits nothing: step over one character */
            off = ms + 1;
            while (off < len && ((uint8_t)sub[off] & 0xc0) == 0x80) off++;
            continue;
        }
        if (ms > gap) KVPQ_TRY(split(c, level + 1, s + gap, s + ms));
        KVPQ_TRY(split(c, level + 1, s + ms, s + me));
        off = gap = me;
    }
    return split(c, level + 1, s + gap, e);
}

// ---- SentencePiece BPE ---------------------------------------------------------------------------

/* Scores as unsigned integers of the same order (IEEE-754 sign-magnitude to two's-complement-like). */
static inline uint32_t score_order(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static inline void spm_push(enc_ctx *c, size_t *hn, int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    size_t n = (size_t)c->sym_len[l] + (size_t)c->sym_len[r];
    int32_t id = text_index_find(c->t, &c->t->ix, c->esc + c->sym_off[l], n);
    if (id < 0) return;
    uint64_t key = (uint64_t)(~score_order(c->t->score[id])) << 32 | (uint32_t)l;
    heap_push(c->heap, hn, (bpe_pair){key, l, r, (int32_t)n, id});
}

/* Encode one raw fragment text[s, e) (no special token inside); prefix: write a '▁' in front. Any
 * bytes are accepted: a symbol is a UTF-8 lead byte and the continuation bytes it announces (cut at
 * the end), as llama.cpp's llm_tokenizer_spm_session, and what forms no token falls back to bytes. */
static kvpq_status spm_fragment(enc_ctx *c, size_t s, size_t e, int prefix) {
    static const char marker[3] = {'\xe2', '\x96', '\x81'}; /* U+2581 */
    const kvpq_tokenizer *t = c->t;
    size_t n = e - s, n_esc = 0;
    for (size_t i = s; i < e; i++) n_esc += c->text[i] == ' ' ? 3 : 1;
    n_esc += prefix ? 3 : 0;
    if (n_esc == 0) return KVPQ_OK;
    if (n_esc > INT32_MAX) return kvpq__err(KVPQ_ERR_CAPACITY, "tokenizer: a %zu-byte fragment", n);
    if (n_esc > c->esc_cap) {
        char *p = realloc(c->esc, n_esc);
        if (!p) return kvpq__err(KVPQ_ERR_NOMEM, "tokenizer: a %zu-byte fragment", n);
        c->esc = p;
        c->esc_cap = n_esc;
    }
    char *esc = c->esc;
    size_t o = 0;
    if (prefix) { memcpy(esc, marker, 3); o = 3; }
    for (size_t i = s; i < e; i++) {
        if (c->text[i] == ' ') { memcpy(esc + o, marker, 3); o += 3; }
        else esc[o++] = c->text[i];
    }
    KVPQ_TRY(work_reserve(c, n_esc));
    int32_t *off = c->sym_off, *len = c->sym_len, *next = c->next, *prev = c->prev, *id = c->id;
    int32_t n_sym = 0;
    for (size_t i = 0; i < n_esc; n_sym++) {
        uint8_t b = (uint8_t)esc[i];
        size_t l = b < 0xc0 ? 1 : b < 0xe0 ? 2 : b < 0xf0 ? 3 : 4; /* llama.cpp's unicode_len_utf8 */
        if (l > n_esc - i) l = n_esc - i;
        off[n_sym] = (int32_t)i;
        len[n_sym] = (int32_t)l;
        prev[n_sym] = n_sym - 1;
        next[n_sym] = n_sym + 1;
        id[n_sym] = -1; /* looked up at the end: merged symbols get their pair's id */
        i += l;
    }
    next[n_sym - 1] = -1;
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < n_sym; i++) spm_push(c, &hn, i, i + 1);
    while (hn > 0) {
        bpe_pair top = heap_pop(c->heap, &hn);
        int32_t l = top.left, r = top.a;
        if (len[l] == 0 || len[r] == 0 || len[l] + len[r] != top.b) continue; /* stale */
        len[l] += len[r];
        len[r] = 0;
        id[l] = top.merged;
        next[l] = next[r];
        if (next[r] >= 0) prev[next[r]] = l;
        spm_push(c, &hn, prev[l], l);
        spm_push(c, &hn, l, next[l]);
    }
    for (int32_t i = 0; i >= 0; i = next[i]) {
        int32_t tok = id[i] >= 0 ? id[i] : text_index_find(t, &t->ix, esc + off[i], (size_t)len[i]);
        if (tok >= 0) {
            emit(c, tok);
            continue;
        }
        for (int32_t k = 0; k < len[i]; k++) {
            uint8_t b = (uint8_t)esc[off[i] + k];
            if (t->byte_token[b] < 0)
                return kvpq__err(KVPQ_ERR_UNSUPPORTED, "text: byte 0x%02x in the fragment at byte offset %zu has no token "
                                 "(no <0x%02X> byte-fallback token) in this vocabulary", b, s, b);
            emit(c, t->byte_token[b]);
        }
    }
    return KVPQ_OK;
}

// ---- special tokens and the whole text -----------------------------------------------------------

typedef struct {
    size_t pos;
    int32_t id;
} special_cut;

static int cmp_cut(const void *pa, const void *pb) {
    const special_cut *a = pa, *b = pb;
    return a->pos < b->pos ? -1 : a->pos > b->pos;
}

static int cmp_len_desc(const void *pa, const void *pb, void *ctx) {
    const kvpq_tokenizer *t = ctx;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    uint32_t la = t->text_off[a + 1] - t->text_off[a], lb = t->text_off[b + 1] - t->text_off[b];
    if (la != lb) return la > lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* The special tokens to cut out of text[0, len), as llama.cpp's tokenizer_st_partition: tokens in
 * order of decreasing text length (then id), each cut at its leftmost occurrences that lie wholly in
 * text not cut yet. Only tokens that occur at all are searched for, found in one pass over the text
 * through the index by first two bytes; each then costs one memmem pass. *cuts (malloc'd, sorted
 * by position) gets *n_cuts entries. */
static kvpq_status find_specials(const kvpq_tokenizer *t, const char *text, size_t len, int parse_special,
                                 special_cut **cuts, size_t *n_cuts) {
    *cuts = NULL;
    *n_cuts = 0;
    uint8_t want = SPECIAL_USER | (parse_special ? SPECIAL_CTRL : 0);
    int32_t *present = NULL;
    size_t n_present = 0, cap_present = 0;
    uint8_t *seen = NULL, *claimed = NULL;
    special_cut *out = NULL;
    size_t n_out = 0, cap_out = 0;
    kvpq_status st = KVPQ_OK;
    for (size_t i = 0; i < len && st == KVPQ_OK; i++) {
        uint8_t b0 = (uint8_t)text[i];
        if (!t->special_first[b0]) continue;
        int32_t cand[2] = {t->special_single[b0], -1};
        int32_t k0 = 0, k1 = 0;
        if (i + 1 < len) {
            int key = b0 << 8 | (uint8_t)text[i + 1];
            k0 = t->special_start2[key];
            k1 = t->special_start2[key + 1];
        }
        for (int32_t k = k0 - 1; k < k1; k++) { /* k0 - 1: the one-byte special */
            int32_t id = k < k0 ? cand[0] : t->special[k];
            if (id < 0 || !(t->special_attr[id] & want) || (seen && seen[id])) continue;
            size_t l;
            const char *s = tok_text(t, id, &l);
            if (l > len - i || memcmp(s, text + i, l) != 0) continue;
            if (!seen) {
                seen = calloc((size_t)t->n_vocab, 1);
                if (!seen) { st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: special tokens"); break; }
            }
            seen[id] = 1;
            if (n_present == cap_present) {
                cap_present = cap_present ? 2 * cap_present : 16;
                int32_t *p = realloc(present, cap_present * sizeof *p);
                if (!p) { st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: special tokens"); break; }
                present = p;
            }
            present[n_present++] = id;
        }
    }
    if (st == KVPQ_OK && n_present > 0) {
        qsort_r(present, n_present, sizeof *present, cmp_len_desc, (void *)t);
        claimed = calloc(len, 1);
        if (!claimed) st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: %zu bytes of text", len);
        for (size_t k = 0; k < n_present && st == KVPQ_OK; k++) {
            size_t l;
            const char *s = tok_text(t, present[k], &l);
            for (size_t p = 0; p + l <= len;) {
                const char *q = memmem(text + p, len - p, s, l);
                if (!q) break;
                size_t at = (size_t)(q - text);
                /* It must lie wholly in text not cut yet; else no occurrence can start before the
                 * end of the cut run it overlaps (a run of 1 MiB of '\n' would otherwise cost one
                 * memmem call per byte for each of Gemma's 31 newline-run tokens). */
                size_t j = at + l;
                while (j > at && !claimed[j - 1]) j--;
                if (j > at) {
                    while (j < len && claimed[j]) j++;
                    p = j;
                    continue;
                }
                memset(claimed + at, 1, l);
                if (n_out == cap_out) {
                    cap_out = cap_out ? 2 * cap_out : 64;
                    special_cut *o = realloc(out, cap_out * sizeof *o);
                    if (!o) { st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: special tokens"); break; }
                    out = o;
                }
                out[n_out++] = (special_cut){at, present[k]};
                p = at + l;
            }
        }
    }
    free(present);
    free(seen);
    free(claimed);
    if (st != KVPQ_OK) {
        free(out);
        return st;
    }
    if (n_out > 1) qsort(out, n_out, sizeof *out, cmp_cut); /* qsort(NULL, 0, ...) is undefined */
    *cuts = out;
    *n_cuts = n_out;
    return KVPQ_OK;
}

static kvpq_status validate_utf8(enc_ctx *c, size_t len) {
    /* One pass of PCRE2's UTF-8 check over the whole text (pcre2_match checks before matching). */
    int rc = pcre2_match(c->t->regex[0], (PCRE2_SPTR)c->text, len, 0, 0, c->md, c->mctx);
    if (rc >= 0 || rc == PCRE2_ERROR_NOMATCH) return KVPQ_OK;
    if (rc <= PCRE2_ERROR_UTF8_ERR1 && rc >= PCRE2_ERROR_UTF8_ERR21) {
        size_t at = pcre2_get_startchar(c->md);
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "text: invalid UTF-8 at byte offset %zu (byte 0x%02x): %s", at,
                         at < len ? (unsigned)(uint8_t)c->text[at] : 0u, (const char *)msg);
    }
    return regex_error(rc);
}

/* One raw fragment: pre-tokenize + BPE, or SentencePiece BPE. */
static kvpq_status encode_fragment(enc_ctx *c, size_t s, size_t e, int after_special) {
    if (s >= e) return KVPQ_OK;
    if (c->t->kind == KIND_BPE) return split(c, 0, s, e);
    return spm_fragment(c, s, e, c->t->add_space_prefix && after_special);
}

static kvpq_status encode(enc_ctx *c, size_t len, int add_bos, int parse_special) {
    const kvpq_tokenizer *t = c->t;
    if (t->kind == KIND_BPE && len > 0) KVPQ_TRY(validate_utf8(c, len));
    if (add_bos) {
        if (t->bos < 0) return kvpq__err(KVPQ_ERR_INVALID_ARG, "add_bos: the vocabulary has no BOS token");
        emit(c, t->bos);
    }
    special_cut *cuts = NULL;
    size_t n_cuts = 0;
    KVPQ_TRY(find_specials(t, c->text, len, parse_special, &cuts, &n_cuts));
    kvpq_status st = KVPQ_OK;
    size_t start = 0;
    int after_special = 1; /* the start of the text counts as after a special token (llama.cpp) */
    for (size_t k = 0; k < n_cuts && st == KVPQ_OK; k++) {
        if (cuts[k].pos > start) {
            st = encode_fragment(c, start, cuts[k].pos, after_special);
            after_special = 0;
        }
        if (st != KVPQ_OK) break;
        emit(c, cuts[k].id);
        after_special = 1;
        start = cuts[k].pos + (t->text_off[cuts[k].id + 1] - t->text_off[cuts[k].id]);
    }
    if (st == KVPQ_OK) st = encode_fragment(c, start, len, after_special);
    free(cuts);
    return st;
}

kvpq_status kvpq_tokenizer_encode(const kvpq_tokenizer *t, const char *text, size_t len, int add_bos,
                                  int parse_special, int32_t *tokens, size_t cap, size_t *n_tokens) {
    if (n_tokens) *n_tokens = 0;
    if (!t || !n_tokens || (!text && len > 0) || (!tokens && cap > 0))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "tokenize: NULL %s",
                         !t ? "tokenizer" : !n_tokens ? "n_tokens" : (!text && len > 0) ? "text" : "tokens");
    enc_ctx c = {.t = t, .text = text ? text : "", .out = tokens, .cap = cap};
    kvpq_status st = KVPQ_OK;
    if (t->kind == KIND_BPE) {
        c.md = pcre2_match_data_create(4, NULL);
        c.mctx = pcre2_match_context_create(NULL);
        if (!c.md || !c.mctx) st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: PCRE2 match data");
        if (st == KVPQ_OK && t->jit) {
            /* The default 32 KiB JIT stack is too small for \s+(?!\S) over very long runs of spaces. */
            c.jit_stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, NULL);
            if (!c.jit_stack) st = kvpq__err(KVPQ_ERR_NOMEM, "tokenize: PCRE2 JIT stack");
            else pcre2_jit_stack_assign(c.mctx, NULL, c.jit_stack);
        }
        if (st == KVPQ_OK && len > 4096) c.cache = calloc(CACHE_SLOTS, sizeof *c.cache); /* worth it on long texts */
    }
    if (st == KVPQ_OK) st = encode(&c, len, add_bos, parse_special);
    if (st == KVPQ_OK) *n_tokens = c.n;
    pcre2_jit_stack_free(c.jit_stack);
    pcre2_match_context_free(c.mctx);
    pcre2_match_data_free(c.md);
    free(c.id);
    free(c.next);
    free(c.prev);
    free(c.sym_off);
    free(c.sym_len);
    free(c.heap);
    free(c.esc);
    free(c.cache);
    free(c.pool);
    return st;
}

// ---- decoding ------------------------------------------------------------------------------------

kvpq_status kvpq_tokenizer_piece(const kvpq_tokenizer *t, int32_t token, char *buf, size_t cap, size_t *len) {
    if (len) *len = 0;
    if (!t || !len || (!buf && cap > 0))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "token_to_piece: NULL %s", !t ? "tokenizer" : !len ? "len" : "buf");
    if (token < 0 || token >= t->n_vocab)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "token_to_piece: token %d outside the vocabulary of %d", token, t->n_vocab);
    size_t n;
    const char *s;
    if (t->kind == KIND_SPM) {
        n = t->piece_off[token + 1] - t->piece_off[token];
        s = t->piece_pool + t->piece_off[token];
    } else {
        s = tok_text(t, token, &n);
    }
    if (cap > 0) memcpy(buf, s, n < cap ? n : cap);
    *len = n;
    return KVPQ_OK;
}
