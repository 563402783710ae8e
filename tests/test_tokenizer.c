/* test_tokenizer.c — byte-level BPE tokenizer: on the real SmolLM2 vocabulary (ids checked against HF
 * tokenizers, round trips, special tokens, invalid UTF-8) and on small synthetic GGUF vocabularies
 * built here (merge order, errors). The exhaustive comparison with HF tokenizers on the novels is
 * tests/python/test_tokenizer_peer.py. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf_writer.h"
#include "model/gguf.h"
#include "kvpq.h"
#include "model/tokenizer.h"

#define MODEL_PATH KVPQ_SOURCE_DIR "/models/SmolLM2-135M-Instruct.Q4_1.gguf"

static int quick(void) {
    const char *q = getenv("KVPQ_QUICK");
    return q && strcmp(q, "1") == 0;
}

static kvpq_vocab *load_model_vocab(void) {
    FILE *f = fopen(MODEL_PATH, "rb");
    if (!f) return NULL;
    fclose(f);
    kvpq_vocab *v = NULL;
    kvpq_status st = kvpq_vocab_load(&v, MODEL_PATH);
    cr_assert_eq(st, KVPQ_OK, "kvpq_vocab_load: %s", kvpq_last_error());
    return v;
}

#define NEED_MODEL(v)                                                                         \
    kvpq_vocab *v = load_model_vocab();                                                       \
    if (!v) cr_skip_test("%s missing: run scripts/fetch_model.sh", MODEL_PATH)

/* Tokenize into a malloc'd array (sized by a first call with cap 0). */
static int32_t *tokenize(const kvpq_vocab *v, const char *text, size_t len, int add_bos, int parse_special, size_t *n) {
    kvpq_status st = kvpq_vocab_tokenize(v, text, len, add_bos, parse_special, NULL, 0, n);
    cr_assert_eq(st, KVPQ_OK, "sizing: %s", kvpq_last_error());
    int32_t *ids = malloc((*n ? *n : 1) * sizeof *ids);
    size_t n2;
    st = kvpq_vocab_tokenize(v, text, len, add_bos, parse_special, ids, *n, &n2);
    cr_assert_eq(st, KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(n2, *n);
    return ids;
}

static void expect_ids(const kvpq_vocab *v, const char *text, int parse_special, const int32_t *want, size_t n_want) {
    size_t n;
    int32_t *ids = tokenize(v, text, strlen(text), 0, parse_special, &n);
    cr_assert_eq(n, n_want, "'%s': %zu tokens, expected %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++) cr_assert_eq(ids[i], want[i], "'%s': token %zu is %d, expected %d", text, i, ids[i], want[i]);
    free(ids);
}

/* Concatenated pieces of the tokens of text[0..len) must give text back, byte for byte. */
static void expect_round_trip(const kvpq_vocab *v, const char *text, size_t len) {
    size_t n;
    int32_t *ids = tokenize(v, text, len, 0, 0, &n);
    cr_assert(n > 0 || len == 0);
    char *out = malloc(len + 1);
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        size_t pl;
        cr_assert_eq(kvpq_vocab_piece(v, ids[i], NULL, 0, &pl), KVPQ_OK); /* sizing call */
        cr_assert(o + pl <= len, "pieces longer than the text at token %zu", i);
        cr_assert_eq(kvpq_vocab_piece(v, ids[i], out + o, pl, &pl), KVPQ_OK);
        o += pl;
    }
    cr_assert_eq(o, len, "round trip: %zu bytes, expected %zu", o, len);
    cr_assert(memcmp(out, text, len) == 0, "round trip differs");
    free(out);
    free(ids);
}

static char *read_prefix(const char *path, size_t max_bytes, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(max_bytes + 1);
    *len = fread(buf, 1, max_bytes, f);
    fclose(f);
    /* Cut at a character boundary. */
    while (*len > 0 && ((unsigned char)buf[*len] & 0xc0) == 0x80 && *len == max_bytes) (*len)--;
    while (*len > 0 && ((unsigned char)buf[*len - 1] & 0xc0) == 0xc0) (*len)--;
    buf[*len] = 0;
    return buf;
}

static const char *UTF8_SAMPLE =
    "Café naïve résumé façade — “quoted” ‘single’ – en dash… Ångström Œuvre ß\n"
    "Emoji: 😀 👍🏽 🇺🇸 👩‍👩‍👧 ❤️ 你好，世界！ Россия مرحبا ١٢٣ ½ ² Ⅻ\n"
    "I'm sure they'll say it's fine. I'D SAY IT'S OK\ttabs\r\nCRLF   spaces  \n\n\n \u00a0nbsp";

// ---- the real vocabulary --------------------------------------------------------------------------

Test(tokenizer_model, header_values) {
    NEED_MODEL(v);
    cr_assert_eq(kvpq_vocab_n_tokens(v), 49152);
    cr_assert_eq(kvpq_vocab_bos(v), 1);
    cr_assert_eq(kvpq_vocab_eos(v), 2);
    kvpq_vocab_free(v);
}

/* Ids from HF tokenizers on the same vocabulary and pre-tokenizer (tests/python/test_tokenizer_peer.py
 * builds that peer), hard-coded as a regression. */
Test(tokenizer_model, known_ids) {
    NEED_MODEL(v);
    expect_ids(v, "Hello, world!", 0, (const int32_t[]){19556, 28, 905, 17}, 4);
    /* Digits are split one by one and the space before them stays alone (SmolLM's Digits step). */
    expect_ids(v, "The year 2024 had 366 days.", 0,
               (const int32_t[]){504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30}, 14);
    expect_ids(v, "Café — naïve 😀", 0, (const int32_t[]){51, 1939, 2756, 1841, 15486, 46494, 40303, 218}, 8);
    expect_ids(v, "  two  spaces\n\n", 0, (const int32_t[]){216, 827, 216, 5600, 1116}, 5);
    expect_ids(v, "Emma Woodhouse, handsome, clever, and rich", 0,
               (const int32_t[]){10809, 2432, 7817, 4404, 28, 35012, 28, 15355, 28, 284, 3428}, 11);
    kvpq_vocab_free(v);
}

Test(tokenizer_model, special_tokens_on_and_off) {
    NEED_MODEL(v);
    const char *chat = "<|im_start|>user\nWhat is PQ?<|im_end|>\n";
    expect_ids(v, chat, 1, (const int32_t[]){1, 4093, 198, 1780, 314, 377, 65, 47, 2, 198}, 10);
    /* Without parse_special the markers are plain text: no control token may appear. */
    size_t n;
    int32_t *ids = tokenize(v, chat, strlen(chat), 0, 0, &n);
    cr_assert(n > 10);
    for (size_t i = 0; i < n; i++) cr_assert(ids[i] > 16, "control token %d from plain text", ids[i]);
    free(ids);
    expect_round_trip(v, chat, strlen(chat));
    /* An unterminated marker is text even with parse_special; "<file_sep>" is a token. */
    ids = tokenize(v, "<|im_start<file_sep>", 20, 0, 1, &n);
    cr_assert_eq(ids[n - 1], 5);
    for (size_t i = 0; i + 1 < n; i++) cr_assert(ids[i] > 16);
    free(ids);
    /* The piece of a control token is its text. */
    char buf[32];
    size_t len;
    cr_assert_eq(kvpq_vocab_piece(v, 1, buf, sizeof buf, &len), KVPQ_OK);
    cr_assert(len == 12 && memcmp(buf, "<|im_start|>", 12) == 0);
    kvpq_vocab_free(v);
}

Test(tokenizer_model, add_bos_and_capacity) {
    NEED_MODEL(v);
    const char *s = "Hello, world!";
    size_t n;
    int32_t *ids = tokenize(v, s, strlen(s), 1, 0, &n);
    cr_assert_eq(n, 5);
    cr_assert_eq(ids[0], 1);
    cr_assert_eq(ids[1], 19556);
    free(ids);
    /* A short buffer gets the first cap ids and the full count. */
    int32_t two[3] = {-7, -7, -7};
    cr_assert_eq(kvpq_vocab_tokenize(v, s, strlen(s), 0, 0, two, 2, &n), KVPQ_OK);
    cr_assert_eq(n, 4);
    cr_assert(two[0] == 19556 && two[1] == 28 && two[2] == -7);
    /* Empty text: no tokens, or only BOS. */
    cr_assert_eq(kvpq_vocab_tokenize(v, "", 0, 0, 1, NULL, 0, &n), KVPQ_OK);
    cr_assert_eq(n, 0);
    cr_assert_eq(kvpq_vocab_tokenize(v, NULL, 0, 1, 1, two, 3, &n), KVPQ_OK);
    cr_assert(n == 1 && two[0] == 1);
    kvpq_vocab_free(v);
}

Test(tokenizer_model, round_trip_novels_and_utf8) {
    NEED_MODEL(v);
    expect_round_trip(v, UTF8_SAMPLE, strlen(UTF8_SAMPLE));
    const char *novels[] = {KVPQ_SOURCE_DIR "/data/text/emma.txt", KVPQ_SOURCE_DIR "/data/text/persuasion.txt",
                            KVPQ_SOURCE_DIR "/../shared/data/text/prideprejudice.txt"};
    int done = 0;
    for (size_t i = 0; i < sizeof novels / sizeof novels[0]; i++) {
        size_t len;
        char *text = read_prefix(novels[i], quick() ? 5000 : 50000, &len);
        if (!text) continue;
        expect_round_trip(v, text, len);
        free(text);
        done++;
    }
    cr_assert(done >= 2, "data/text novels missing");
    kvpq_vocab_free(v);
}

Test(tokenizer_model, invalid_utf8_names_offset) {
    NEED_MODEL(v);
    static const struct { const char *text; size_t len, offset; } bad[] = {
        {"abc\xff" "def", 7, 3},          /* byte never valid in UTF-8 */
        {"ok \xc3(", 5, 3},               /* lead byte without continuation */
        {"\xc0\xaf", 2, 0},               /* overlong '/' */
        {"x\xed\xa0\x80y", 5, 1},         /* UTF-16 surrogate */
        {"tail \xe2\x82", 7, 5},          /* truncated at the end */
        {"\xf4\x90\x80\x80", 4, 0},       /* beyond U+10FFFF */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t n = 99;
        int32_t out[16];
        kvpq_status st = kvpq_vocab_tokenize(v, bad[i].text, bad[i].len, 0, 1, out, 16, &n);
        cr_assert_eq(st, KVPQ_ERR_INVALID_ARG, "case %zu: status %d", i, st);
        char want[64];
        snprintf(want, sizeof want, "byte offset %zu ", bad[i].offset);
        cr_assert(strstr(kvpq_last_error(), want), "case %zu: message '%s' lacks '%s'", i, kvpq_last_error(), want);
        cr_assert_eq(n, 0);
    }
    /* A valid character the vocabulary has no byte token for is an error too, not silently dropped. */
    size_t n;
    cr_assert_eq(kvpq_vocab_tokenize(v, "a\x04z", 3, 0, 0, NULL, 0, &n), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "0x04 at byte offset 1"), "%s", kvpq_last_error());
    kvpq_vocab_free(v);
}

Test(tokenizer_model, bad_arguments) {
    NEED_MODEL(v);
    size_t n;
    char buf[8];
    cr_assert_eq(kvpq_vocab_tokenize(v, NULL, 3, 0, 0, NULL, 0, &n), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_vocab_tokenize(v, "abc", 3, 0, 0, NULL, 4, &n), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_vocab_tokenize(NULL, "abc", 3, 0, 0, NULL, 0, &n), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_vocab_piece(v, -1, buf, sizeof buf, &n), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_vocab_piece(v, 49152, buf, sizeof buf, &n), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "49152"));
    kvpq_vocab *none = NULL;
    cr_assert_eq(kvpq_vocab_load(&none, KVPQ_SOURCE_DIR "/no/such/file.gguf"), KVPQ_ERR_IO);
    cr_assert_null(none);
    kvpq_vocab_free(NULL);
    kvpq_vocab_free(v);
}

/* Pathological pieces: one 256 KiB run of spaces, of '!' and of one letter must tokenize (heap-based
 * merging, no regex stack overflow) and round-trip. */
Test(tokenizer_model, long_runs, .timeout = 120) {
    NEED_MODEL(v);
    size_t len = quick() ? 20000 : 1 << 18;
    char *text = malloc(len);
    const char fill[] = {' ', '!', 'a', '\n'};
    for (size_t k = 0; k < sizeof fill; k++) {
        memset(text, fill[k], len);
        expect_round_trip(v, text, len);
    }
    free(text);
    kvpq_vocab_free(v);
}

// ---- synthetic vocabularies -----------------------------------------------------------------------

/* Toy GGUF files with metadata only, written in memory by tests/gguf_writer.c. */

/* GPT-2 byte -> code point, written independently of the library's inverse table. */
static void byte_level_char(int byte, char out[3]) {
    int cp = byte, k = 0;
    int printable = (byte >= '!' && byte <= '~') || (byte >= 0xa1 && byte <= 0xac) || byte >= 0xae;
    if (!printable) {
        for (int b = 0; b < byte; b++)
            if (!((b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae)) k++;
        cp = 256 + k;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

typedef struct {
    const char *model, *pre;
    const char *extra_tokens[8];  /* appended after the 256 byte tokens (byte-level text) */
    int32_t extra_types[8];
    const char *merges[8];
    long bos;                     /* -1: key absent */
} toy_spec;

/* Build the toy GGUF in memory and open a tokenizer on it (which copies what it needs, so the
 * buffer is freed here); returns the status, the tokenizer in *out. */
static kvpq_status toy_tokenizer(const toy_spec *s, kvpq_tokenizer **out) {
    char byte_text[256][3];
    const char *tokens[256 + 8];
    int32_t types[256 + 8];
    size_t nt = 0, nm = 0;
    for (int b = 0; b < 256; b++) {
        byte_level_char(b, byte_text[b]);
        tokens[nt] = byte_text[b];
        types[nt++] = 1;
    }
    for (int i = 0; i < 8 && s->extra_tokens[i]; i++) {
        tokens[nt] = s->extra_tokens[i];
        types[nt++] = s->extra_types[i] ? s->extra_types[i] : 1;
    }
    while (nm < 8 && s->merges[nm]) nm++;
    gw_buf kv = {0};
    gw_kv_str(&kv, "general.architecture", "llama");
    gw_kv_str(&kv, "tokenizer.ggml.model", s->model ? s->model : "gpt2");
    if (s->pre) gw_kv_str(&kv, "tokenizer.ggml.pre", s->pre);
    gw_kv_str_arr(&kv, "tokenizer.ggml.tokens", tokens, nt);
    gw_kv_i32_arr(&kv, "tokenizer.ggml.token_type", types, nt);
    gw_kv_str_arr(&kv, "tokenizer.ggml.merges", s->merges, nm);
    if (s->bos >= 0) gw_kv_u32(&kv, "tokenizer.ggml.bos_token_id", (uint32_t)s->bos);
    gw_buf file = gw_file(&kv, 0, NULL, NULL, 32); /* no tensors */
    gguf_file *f = NULL;
    kvpq_status st = gguf_open_memory(&f, file.p, file.n);
    cr_assert_eq(st, KVPQ_OK, "toy GGUF: %s", kvpq_last_error());
    st = kvpq_tokenizer_from_gguf(out, f);
    gguf_close(f);
    gw_free(&kv);
    gw_free(&file);
    return st;
}

static void toy_expect(const kvpq_tokenizer *t, const char *text, int parse_special, const int32_t *want, size_t n_want) {
    int32_t ids[64];
    size_t n;
    kvpq_status st = kvpq_tokenizer_encode(t, text, strlen(text), 0, parse_special, ids, 64, &n);
    cr_assert_eq(st, KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(n, n_want, "'%s': %zu tokens, expected %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++) cr_assert_eq(ids[i], want[i], "'%s': token %zu is %d, expected %d", text, i, ids[i], want[i]);
}

/* Merges apply by rank, not left to right: with "b c" ranked before "a b", "abc" is a + bc -> abc;
 * a left-to-right merger would give ab + c. Equal pairs merge leftmost first: "aaa" -> aa + a. */
Test(tokenizer_toy, merge_order) {
    toy_spec s = {.pre = "gpt2",
                  .extra_tokens = {"bc", "ab", "abc", "aa", "Ġa"},
                  .merges = {"b c", "a b", "a bc", "a a", "Ġ a"},
                  .bos = -1};
    kvpq_tokenizer *t;
    cr_assert_eq(toy_tokenizer(&s, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "abc", 0, (const int32_t[]){258}, 1);
    toy_expect(t, "abca", 0, (const int32_t[]){258, 'a'}, 2);
    toy_expect(t, "aaa", 0, (const int32_t[]){259, 'a'}, 2);
    toy_expect(t, "aaaa", 0, (const int32_t[]){259, 259}, 2);
    /* The GPT-2 split keeps the space with the word: " a" is one piece and one token. */
    toy_expect(t, "ab a", 0, (const int32_t[]){257, 260}, 2);
    cr_assert_eq(kvpq_tokenizer_bos(t), -1);
    cr_assert_eq(kvpq_tokenizer_add_bos_default(t), 0);
    size_t n;
    int32_t id;
    cr_assert_eq(kvpq_tokenizer_encode(t, "x", 1, 1, 0, &id, 1, &n), KVPQ_ERR_INVALID_ARG); /* no BOS */
    char piece[8];
    size_t len;
    cr_assert_eq(kvpq_tokenizer_piece(t, 260, piece, sizeof piece, &len), KVPQ_OK);
    cr_assert(len == 2 && memcmp(piece, " a", 2) == 0, "byte-level text decoded to raw bytes");
    cr_assert_eq(kvpq_tokenizer_piece(t, 0x0a, piece, sizeof piece, &len), KVPQ_OK);
    cr_assert(len == 1 && piece[0] == '\n');
    kvpq_tokenizer_free(t);
}

/* Longest special token wins at a position; USER_DEFINED (4) tokens count as special too. */
Test(tokenizer_toy, specials_leftmost_longest) {
    toy_spec s = {.pre = "smollm",
                  .extra_tokens = {"<s>", "<s>x", "<u>"},
                  .extra_types = {3, 3, 4},
                  .bos = 256};
    kvpq_tokenizer *t;
    cr_assert_eq(toy_tokenizer(&s, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "a<s>x<s><u>", 1, (const int32_t[]){'a', 257, 256, 258}, 4);
    toy_expect(t, "<s", 1, (const int32_t[]){'<', 's'}, 2);
    int32_t ids[4];
    size_t n;
    cr_assert_eq(kvpq_tokenizer_encode(t, "z", 1, 1, 0, ids, 4, &n), KVPQ_OK);
    cr_assert(n == 2 && ids[0] == 256 && ids[1] == 'z');
    kvpq_tokenizer_free(t);
}

/* Every pre-tokenizer compiles; only GPT-2's keeps a space with the digits after it, so only there
 * can " 1" merge (smollm/starcoder isolate each digit, default and llama-bpe split \p{N} runs off). */
Test(tokenizer_toy, pre_tokenizers) {
    const char *names[] = {"gpt2", "default", "llama-bpe", "starcoder", "smollm", "qwen2"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        toy_spec s = {.pre = names[i], .extra_tokens = {"Ġ1"}, .merges = {"Ġ 1"}, .bos = -1};
        kvpq_tokenizer *t;
        cr_assert_eq(toy_tokenizer(&s, &t), KVPQ_OK, "%s: %s", names[i], kvpq_last_error());
        if (i == 0) toy_expect(t, " 12", 0, (const int32_t[]){256, '2'}, 2);
        else toy_expect(t, " 12", 0, (const int32_t[]){' ', '1', '2'}, 3);
        toy_expect(t, "It's!", 0, (const int32_t[]){'I', 't', '\'', 's', '!'}, 5);
        kvpq_tokenizer_free(t);
    }
    toy_spec none = {.pre = NULL, .bos = -1}; /* absent key: llama.cpp's default chain */
    kvpq_tokenizer *t;
    cr_assert_eq(toy_tokenizer(&none, &t), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_tokenizer_free(t);
}

Test(tokenizer_toy, errors_name_the_problem) {
    kvpq_tokenizer *t = (kvpq_tokenizer *)1;
    toy_spec unknown_pre = {.pre = "qwen9", .bos = -1};
    cr_assert_eq(toy_tokenizer(&unknown_pre, &t), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "qwen9") && strstr(kvpq_last_error(), "smollm") &&
              strstr(kvpq_last_error(), "qwen2"), "%s", kvpq_last_error());
    cr_assert_null(t);

    toy_spec wordpiece = {.model = "bert", .pre = "default", .bos = -1};
    cr_assert_eq(toy_tokenizer(&wordpiece, &t), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "'bert'") && strstr(kvpq_last_error(), "'llama'"), "%s", kvpq_last_error());

    toy_spec missing = {.pre = "gpt2", .merges = {"a b"}, .bos = -1}; /* "ab" is not a token */
    cr_assert_eq(toy_tokenizer(&missing, &t), KVPQ_ERR_FORMAT);
    cr_assert(strstr(kvpq_last_error(), "merges[0]") && strstr(kvpq_last_error(), "merged token"), "%s",
              kvpq_last_error());

    toy_spec malformed = {.pre = "gpt2", .merges = {"ab"}, .bos = -1};
    cr_assert_eq(toy_tokenizer(&malformed, &t), KVPQ_ERR_FORMAT);
    cr_assert(strstr(kvpq_last_error(), "expected 'A B'"), "%s", kvpq_last_error());

    toy_spec bad_bos = {.pre = "gpt2", .bos = 999};
    cr_assert_eq(toy_tokenizer(&bad_bos, &t), KVPQ_ERR_FORMAT);
    cr_assert(strstr(kvpq_last_error(), "bos_token_id = 999"), "%s", kvpq_last_error());
}

/* qwen2 splits digits one by one (\p{N}) where llama-bpe keeps runs of up to three together. */
Test(tokenizer_toy, qwen2_digits) {
    const char *names[] = {"qwen2", "llama-bpe"};
    for (int i = 0; i < 2; i++) {
        toy_spec s = {.pre = names[i], .extra_tokens = {"12", "123"}, .merges = {"1 2", "12 3"}, .bos = -1};
        kvpq_tokenizer *t;
        cr_assert_eq(toy_tokenizer(&s, &t), KVPQ_OK, "%s: %s", names[i], kvpq_last_error());
        if (i == 0) toy_expect(t, "x1234", 0, (const int32_t[]){'x', '1', '2', '3', '4'}, 5);
        else toy_expect(t, "x1234", 0, (const int32_t[]){'x', 257, '4'}, 3);
        kvpq_tokenizer_free(t);
    }
}

// ---- synthetic SentencePiece vocabularies ---------------------------------------------------------

/* SPM toy ids: 0 <unk> (UNKNOWN), 1 <s>, 2 </s> (CONTROL), 3 .. 258 the byte tokens <0x00> .. <0xFF>,
 * then the pieces below. */
enum { SPM_BYTE0 = 3, SPM_P = 259 };
static const struct { const char *text; float score; int type; } k_spm_pieces[] = {
    {"\xe2\x96\x81", -1.0f, 1}, /* 259 '▁' */
    {"a", -2.0f, 1},            /* 260 */
    {"b", -2.0f, 1},            /* 261 */
    {"c", -2.0f, 1},            /* 262 */
    {"ab", -6.0f, 1},           /* 263: worse than bc, so "abc" is a + bc */
    {"bc", -3.0f, 1},           /* 264 */
    {"aa", -4.0f, 1},           /* 265 */
    {"\xe2\x96\x81" "a", -0.5f, 1}, /* 266 '▁a' */
    {"<u>", 0.0f, 4},           /* 267 USER_DEFINED: cut out even without parse_special */
    {"uvw", 0.0f, 4},           /* 268 */
    {"vwxy", 0.0f, 4},          /* 269: longer, so cut before "uvw" */
    {"\xe2\x96\x81\xe2\x96\x81", -0.1f, 1}, /* 270 '▁▁' */
};

static kvpq_status spm_toy(int add_space_prefix, long add_bos, int with_bos_key, kvpq_tokenizer **out) {
    enum { N = SPM_P + sizeof k_spm_pieces / sizeof k_spm_pieces[0] };
    static char byte_names[256][8];
    const char *tokens[N];
    int32_t types[N];
    float scores[N];
    tokens[0] = "<unk>", types[0] = 2, scores[0] = 0;
    tokens[1] = "<s>", types[1] = 3, scores[1] = 0;
    tokens[2] = "</s>", types[2] = 3, scores[2] = 0;
    for (int b = 0; b < 256; b++) {
        snprintf(byte_names[b], sizeof byte_names[b], "<0x%02X>", b);
        tokens[SPM_BYTE0 + b] = byte_names[b], types[SPM_BYTE0 + b] = 6, scores[SPM_BYTE0 + b] = 0;
    }
    for (size_t i = 0; i < sizeof k_spm_pieces / sizeof k_spm_pieces[0]; i++) {
        tokens[SPM_P + i] = k_spm_pieces[i].text;
        types[SPM_P + i] = k_spm_pieces[i].type;
        scores[SPM_P + i] = k_spm_pieces[i].score;
    }
    gw_buf kv = {0};
    gw_kv_str(&kv, "general.architecture", "gemma3");
    gw_kv_str(&kv, "tokenizer.ggml.model", "llama");
    gw_kv_str(&kv, "tokenizer.ggml.pre", "default");
    gw_kv_str_arr(&kv, "tokenizer.ggml.tokens", tokens, N);
    gw_kv_f32_arr(&kv, "tokenizer.ggml.scores", scores, N);
    gw_kv_i32_arr(&kv, "tokenizer.ggml.token_type", types, N);
    if (with_bos_key) gw_kv_u32(&kv, "tokenizer.ggml.bos_token_id", 1);
    if (add_bos >= 0) gw_kv_bool(&kv, "tokenizer.ggml.add_bos_token", (int)add_bos);
    if (add_space_prefix >= 0) gw_kv_bool(&kv, "tokenizer.ggml.add_space_prefix", add_space_prefix);
    gw_buf file = gw_file(&kv, 0, NULL, NULL, 32); /* no tensors */
    gguf_file *f = NULL;
    kvpq_status st = gguf_open_memory(&f, file.p, file.n);
    cr_assert_eq(st, KVPQ_OK, "toy GGUF: %s", kvpq_last_error());
    st = kvpq_tokenizer_from_gguf(out, f);
    gguf_close(f);
    gw_free(&kv);
    gw_free(&file);
    return st;
}

static void toy_expect_len(const kvpq_tokenizer *t, const char *text, size_t len, int parse_special,
                           const int32_t *want, size_t n_want) {
    int32_t ids[64];
    size_t n;
    kvpq_status st = kvpq_tokenizer_encode(t, text, len, 0, parse_special, ids, 64, &n);
    cr_assert_eq(st, KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(n, n_want, "'%s': %zu tokens, expected %zu", text, n, n_want);
    for (size_t i = 0; i < n; i++) cr_assert_eq(ids[i], want[i], "'%s': token %zu is %d, expected %d", text, i, ids[i], want[i]);
}

/* The pair whose merged text has the highest score merges first, not the leftmost pair: "abc" is
 * a + bc though "ab" is a token too. Equal pairs merge leftmost first. */
Test(tokenizer_spm, merge_by_score) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "abc", 0, (const int32_t[]){260, 264}, 2);
    toy_expect(t, "ab", 0, (const int32_t[]){263}, 1);
    toy_expect(t, "aaa", 0, (const int32_t[]){265, 260}, 2);
    toy_expect(t, "aaaa", 0, (const int32_t[]){265, 265}, 2);
    kvpq_tokenizer_free(t);
}

/* ' ' is written '▁' before merging; add_space_prefix puts one in front of the text and after each
 * special token; without the key a SentencePiece vocabulary adds it (llama.cpp's default). */
Test(tokenizer_spm, space_marker_and_prefix) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "a a", 0, (const int32_t[]){260, 266}, 2);
    toy_expect(t, "a   a", 0, (const int32_t[]){260, 270, 266}, 3); /* '▁▁' first: its score is higher */
    kvpq_tokenizer_free(t);
    for (int key = 0; key < 2; key++) {
        cr_assert_eq(spm_toy(key ? 1 : -1, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
        toy_expect(t, "a", 0, (const int32_t[]){266}, 1);
        toy_expect(t, "a<s>a", 1, (const int32_t[]){266, 1, 266}, 3);
        toy_expect(t, "a<u>a", 0, (const int32_t[]){266, 267, 266}, 3); /* USER_DEFINED counts as special too */
        kvpq_tokenizer_free(t);
    }
}

/* A character that forms no token is written as the <0xNN> tokens of its bytes; so is invalid UTF-8
 * (a symbol is a lead byte with the continuation bytes it announces, as in llama.cpp). */
Test(tokenizer_spm, byte_fallback) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "a\xc3\xa9" "b", 0, (const int32_t[]){260, SPM_BYTE0 + 0xc3, SPM_BYTE0 + 0xa9, 261}, 4);
    toy_expect_len(t, "b\xff", 2, 0, (const int32_t[]){261, SPM_BYTE0 + 0xff}, 2);
    /* 0xff reads as the lead of a 4-byte character (llama.cpp's unicode_len_utf8), taking "a" along. */
    toy_expect_len(t, "\xff" "a", 2, 0, (const int32_t[]){SPM_BYTE0 + 0xff, SPM_BYTE0 + 'a'}, 2);
    /* "\xc3" announces two bytes, so it takes the 'a' along and neither forms a token. */
    toy_expect_len(t, "\xc3" "ab", 3, 0, (const int32_t[]){SPM_BYTE0 + 0xc3, SPM_BYTE0 + 'a', 261}, 3);
    toy_expect_len(t, "b\xe2\x82", 3, 0, (const int32_t[]){261, SPM_BYTE0 + 0xe2, SPM_BYTE0 + 0x82}, 3);
    kvpq_tokenizer_free(t);
}

/* CONTROL / UNKNOWN texts are tokens only with parse_special; USER_DEFINED always. Longer texts are
 * cut first (llama.cpp's order), so in "uvwxy" "vwxy" wins over the leftmost "uvw". */
Test(tokenizer_spm, specials) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    toy_expect(t, "<s><unk>", 1, (const int32_t[]){1, 0}, 2);
    int32_t ids[64];
    size_t n;
    cr_assert_eq(kvpq_tokenizer_encode(t, "<s></s><unk>", 12, 0, 0, ids, 64, &n), KVPQ_OK);
    cr_assert_eq(n, 12, "each byte of the control texts is a byte token");
    for (size_t i = 0; i < n; i++) cr_assert(ids[i] >= SPM_BYTE0, "control token %d from plain text", ids[i]);
    toy_expect(t, "uvwxy", 0, (const int32_t[]){SPM_BYTE0 + 'u', 269}, 2);
    toy_expect(t, "uvw", 0, (const int32_t[]){268}, 1);
    kvpq_tokenizer_free(t);
}

/* BOS: the key's value, else on for SentencePiece; BOS id 1 when the file names none (llama.cpp). */
Test(tokenizer_spm, bos_defaults_and_pieces) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 0, &t), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_tokenizer_add_bos_default(t), 1);
    cr_assert_eq(kvpq_tokenizer_bos(t), 1);
    cr_assert_eq(kvpq_tokenizer_eos(t), 2);
    int32_t ids[4];
    size_t n;
    cr_assert_eq(kvpq_tokenizer_encode(t, "a", 1, 1, 0, ids, 4, &n), KVPQ_OK);
    cr_assert(n == 2 && ids[0] == 1 && ids[1] == 260);
    char buf[16];
    size_t len;
    cr_assert_eq(kvpq_tokenizer_piece(t, 266, buf, sizeof buf, &len), KVPQ_OK);
    cr_assert(len == 2 && memcmp(buf, " a", 2) == 0, "'\xe2\x96\x81' decodes to a space");
    cr_assert_eq(kvpq_tokenizer_piece(t, SPM_BYTE0 + 0xc3, buf, sizeof buf, &len), KVPQ_OK);
    cr_assert(len == 1 && (uint8_t)buf[0] == 0xc3, "a byte token decodes to its byte");
    cr_assert_eq(kvpq_tokenizer_piece(t, 1, buf, sizeof buf, &len), KVPQ_OK);
    cr_assert(len == 3 && memcmp(buf, "<s>", 3) == 0, "a control token decodes to its text");
    kvpq_tokenizer_free(t);
    cr_assert_eq(spm_toy(0, 0, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_tokenizer_add_bos_default(t), 0);
    kvpq_tokenizer_free(t);
}

/* Valid UTF-8 round-trips through the pieces when parse_special is off, whatever the vocabulary lacks.
 * Not so invalid UTF-8 before a space: the space is written as U+2581 first, so a stray lead byte
 * swallows part of it and the bytes come back as "\xc3\xe2\x96\x81" (llama.cpp does the same). */
Test(tokenizer_spm, round_trip) {
    kvpq_tokenizer *t;
    cr_assert_eq(spm_toy(0, -1, 1, &t), KVPQ_OK, "%s", kvpq_last_error());
    uint64_t x = 88172645463325252ULL;
    char text[400], back[400];
    static const char *const alpha[] = {"a", "b", "c", " ", "\xc3\xa9", "\xf0\x9f\x98\x80", "<u>", "<s>", "u"};
    for (int round = 0; round < 200; round++) {
        size_t len = 0;
        for (int i = 0; i < round % 60; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const char *c = alpha[x % (sizeof alpha / sizeof alpha[0])];
            memcpy(text + len, c, strlen(c));
            len += strlen(c);
        }
        int32_t ids[400];
        size_t n, o = 0;
        cr_assert_eq(kvpq_tokenizer_encode(t, text, len, 0, 0, ids, 400, &n), KVPQ_OK, "%s", kvpq_last_error());
        for (size_t i = 0; i < n; i++) {
            size_t pl;
            cr_assert_eq(kvpq_tokenizer_piece(t, ids[i], back + o, sizeof back - o, &pl), KVPQ_OK);
            o += pl;
        }
        cr_assert(o == len && memcmp(back, text, len) == 0, "round %d: round trip differs", round);
    }
    toy_expect_len(t, "\xc3 ", 2, 0,
                   (const int32_t[]){SPM_BYTE0 + 0xc3, SPM_BYTE0 + 0xe2, SPM_BYTE0 + 0x96, SPM_BYTE0 + 0x81}, 4);
    kvpq_tokenizer_free(t);
}

/* Gemma-3: a 256 KiB run of spaces, of newlines or of tabs is cut into its USER_DEFINED run tokens,
 * the longest (31 characters) first, in well under a second (each run token costs one pass, not one
 * per byte), and the pieces give the run back. */
Test(tokenizer_model, gemma_long_whitespace_runs, .timeout = 120) {
    const char *path = KVPQ_SOURCE_DIR "/models/gemma-3-270m-Q4_K_M.gguf";
    FILE *f = fopen(path, "rb");
    if (!f) cr_skip_test("%s missing: run scripts/fetch_model.sh", path);
    fclose(f);
    kvpq_vocab *v;
    cr_assert_eq(kvpq_vocab_load(&v, path), KVPQ_OK, "%s", kvpq_last_error());
    size_t len = quick() ? 20000 : 1 << 18;
    char *text = malloc(len);
    const char fill[] = {' ', '\n', '\t'};
    for (size_t k = 0; k < sizeof fill; k++) {
        memset(text, fill[k], len);
        size_t n;
        int32_t *ids = tokenize(v, text, len, 0, 0, &n);
        cr_assert_eq(n, len / 31 + (len % 31 != 0), "fill 0x%02x: %zu tokens", fill[k], n);
        for (size_t i = 0; i + 1 < n; i++) cr_assert_eq(ids[i], ids[0]);
        cr_assert(kvpq_vocab_token_attr(v, ids[0]) & KVPQ_TOKEN_ATTR_USER_DEFINED);
        free(ids);
        expect_round_trip(v, text, len);
    }
    free(text);
    kvpq_vocab_free(v);
}
