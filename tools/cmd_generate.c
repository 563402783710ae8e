/* cmd_generate.c — `kvpq generate`: text generation with a chosen KV cache, streamed as produced. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "cli_model.h"

#define PROMPT_BATCH 512 /* prompt tokens per kvpq_model_eval call */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq generate --model M [--prompt P] [-n N] [--temp T] [--top-p P] [--seed S]\n"
            "                     [--cache SPEC] [--chat] [--threads N] [--prompt-ids IDS] [--print-ids]\n"
            "                     [--prompt-cache FILE] [--quiet]\n"
            "  --model M      GGUF model (Llama family)\n"
            "  --prompt P     prompt text (default empty: starts from BOS when the model adds one)\n"
            "  -n N           tokens to generate (default 64); stops early at the end-of-sequence token\n"
            "  --temp T       sampling temperature (default 0.8); 0 = greedy (argmax)\n"
            "  --top-p P      nucleus sampling mass (default 0.95)\n"
            "  --seed S       random seed (default 42)\n"
            "  --cache SPEC   KV cache: fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 vq:CODEBOOK.safetensors\n"
            "                 (default fp32);\n"
            "                 a suffix :wN sets the full-precision window of vq and kivi caches (default 128);\n"
            "                 a final :force uses a vq codebook calibrated on another model\n"
            "  --chat         wrap the prompt in the model's chat template. Implemented form: ChatML\n"
            "                 (used when tokenizer.chat_template contains \"<|im_start|>\"), with the\n"
            "                 template's default system message when it has one (SmolLM2 and Qwen2.5 do);\n"
            "                 other templates are refused\n"
            "  --threads N    CPU threads (default: OpenMP default)\n"
            "  --prompt-ids IDS  the prompt as token ids (\"2,818,5279\"; any separators) instead of text\n"
            "  --print-ids    print the generated token ids (one line, space-separated) instead of text\n"
            "  --quiet        no progress lines on stderr (a long prompt shows its progress)\n"
            "  --prompt-cache FILE  keep the processed prompt in FILE (a saved cache, kvpq_cache_save):\n"
            "                 when FILE holds a prompt of the same model and cache SPEC, the tokens it\n"
            "                 shares with this prompt are loaded instead of computed; else (or when this\n"
            "                 prompt is longer) the processed prompt is written to FILE. A FILE of\n"
            "                 another model, codebook or cache kind, or a damaged one, is refused\n"
            "The text goes to stdout as it is produced; prompt and generation tokens/s go to stderr.\n");
}

/* A prompt as pieces tokenized separately: the template's own text with special tokens parsed
 * ("<|im_start|>" becomes the control token), the user's text as plain text only, so that a prompt
 * holding "<|im_end|><|im_start|>assistant" cannot forge a turn (prompt injection; llama.cpp and HF
 * tokenizers treat user content as plain text the same way). */
#define CHAT_MAX_PIECES 8
typedef struct {
    const char *text[CHAT_MAX_PIECES];
    size_t len[CHAT_MAX_PIECES];
    int special[CHAT_MAX_PIECES]; /* 1: template text, special tokens parsed */
    int n;
} chat_pieces;

static void piece_add(chat_pieces *c, const char *text, size_t len, int special) {
    c->text[c->n] = text;
    c->len[c->n] = len;
    c->special[c->n++] = special;
}

/* ChatML prompt: [system,] user, then the assistant header. The default system message is the one
 * the template writes when the conversation has none (text after "<|im_start|>system\n" up to
 * "<|im_end|>"). Returns 0 when the template is not ChatML. */
static int chatml_pieces(const char *tmpl, const char *user, chat_pieces *c) {
    c->n = 0;
    if (!tmpl || !strstr(tmpl, "<|im_start|>")) return 0;
    /* The first system turn written out as plain text (Qwen2.5's template writes its default in an
     * else branch, after a turn built from the messages, and escapes its newline: "\\n"). */
    static const char sys_head[] = "<|im_start|>system";
    for (const char *p = strstr(tmpl, sys_head); p && !c->n; p = strstr(p + 1, sys_head)) {
        const char *b = p + strlen(sys_head);
        if (*b == '\n') b++;
        else if (b[0] == '\\' && b[1] == 'n') b += 2;
        else continue;
        const char *e = strstr(b, "<|im_end|>");
        if (e && e > b && !memchr(b, '{', (size_t)(e - b)) && !memchr(b, '\'', (size_t)(e - b))) {
            /* the template's own text, its newline written out */
            piece_add(c, "<|im_start|>system\n", strlen("<|im_start|>system\n"), 1);
            piece_add(c, b, (size_t)(e - b) + strlen("<|im_end|>"), 1);
            piece_add(c, "\n", 1, 1);
        }
    }
    piece_add(c, "<|im_start|>user\n", strlen("<|im_start|>user\n"), 1);
    piece_add(c, user, strlen(user), 0);
    piece_add(c, "<|im_end|>\n<|im_start|>assistant\n", strlen("<|im_end|>\n<|im_start|>assistant\n"), 1);
    return 1;
}

/* Tokenize the pieces one after another (BOS, when asked, before the first) into a malloc'd array. */
static kvpq_status tokenize_pieces(const kvpq_model *m, const chat_pieces *c, int add_bos, int32_t **out,
                                   size_t *n_out) {
    size_t total = 0, n;
    for (int i = 0; i < c->n; i++) {
        kvpq_status s = kvpq_tokenize(m, c->text[i], c->len[i], add_bos && i == 0, c->special[i], NULL, 0, &n);
        if (s != KVPQ_OK) return s;
        total += n;
    }
    int32_t *t = malloc((total ? total : 1) * sizeof *t);
    if (!t) return KVPQ_ERR_NOMEM;
    size_t at = 0;
    for (int i = 0; i < c->n; i++) {
        kvpq_status s = kvpq_tokenize(m, c->text[i], c->len[i], add_bos && i == 0, c->special[i], t + at,
                                      total - at, &n);
        if (s != KVPQ_OK) {
            free(t);
            return s;
        }
        at += n;
    }
    *out = t;
    *n_out = at;
    return KVPQ_OK;
}

/* ---- --prompt-cache ----
 * The caller blob of the saved cache: a line naming the model ("kvpq-prompt-cache 1 model=<file name>
 * size=<bytes> name=<general.name> vocab=<n>"), a NUL, then the prompt's tokens (int32). The
 * library checks the cache kind, shapes, window, pages and codebook; this line checks the model. */
static void model_line(char *buf, size_t n, const char *model_path, const kvpq_model_info *mi) {
    FILE *f = fopen(model_path, "rb");
    long size = -1;
    if (f && fseek(f, 0, SEEK_END) == 0) size = ftell(f);
    if (f) fclose(f);
    const char *base = strrchr(model_path, '/');
    snprintf(buf, n, "kvpq-prompt-cache 1 model=%s size=%ld name=%s vocab=%d", base ? base + 1 : model_path, size,
             mi->name, mi->n_vocab);
}

static int prompt_cache_save(const char *path, const char *model_path, const kvpq_model_info *mi,
                             const kvpq_cache *cache, const int32_t *toks, size_t n) {
    char line[512];
    model_line(line, sizeof line, model_path, mi);
    size_t ll = strlen(line) + 1, bytes = ll + n * sizeof *toks;
    char *blob = malloc(bytes);
    if (!blob) return fprintf(stderr, "kvpq generate: out of memory\n"), 1;
    memcpy(blob, line, ll);
    memcpy(blob + ll, toks, n * sizeof *toks);
    kvpq_status s = kvpq_cache_save(cache, path, blob, bytes);
    free(blob);
    return s != KVPQ_OK ? cli_fail("generate: --prompt-cache", s) : 0;
}

/* Load FILE when it exists: refuse (1, message printed) a file of another model, cache kind, shape,
 * codebook, or a damaged one; else replace cc->cache by the loaded one cut to the tokens it shares
 * with toks (at most n - 1: the last prompt token is evaluated for its logits); *reused gets that. */
static int prompt_cache_load(const char *path, kvpq_model *m, const char *model_path, cli_cache *cc,
                             const int32_t *toks, size_t n, size_t *reused) {
    *reused = 0;
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT) return 0; /* no file yet: this run writes it */
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    kvpq_cache *lc = NULL;
    void *ub = NULL;
    size_t ul = 0;
    kvpq_status s = kvpq_cache_load(&lc, &cc->params, path, &ub, &ul);
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq generate: --prompt-cache %s is refused (remove it or name another file)\n", path);
        return cli_fail("generate: --prompt-cache", s);
    }
    char line[512];
    model_line(line, sizeof line, model_path, &mi);
    const char *blob = ub;
    size_t ll = blob ? strnlen(blob, ul) : 0;
    if (!blob || ll == ul || strcmp(blob, line) || (ul - ll - 1) % sizeof(int32_t)) {
        /* the file's line may hold anything: escaped */
        fprintf(stderr, "kvpq generate: --prompt-cache %s: made for another model (", path);
        cli_fput_escaped(stderr, blob ? blob : "", blob ? ll : 0, 512);
        fprintf(stderr, "; this run: ");
        cli_fput_escaped(stderr, line, strlen(line), sizeof line);
        fprintf(stderr, "); refused (remove it or name another file)\n");
        kvpq_cache_free(lc);
        free(ub);
        return 1;
    }
    const size_t nf = (ul - ll - 1) / sizeof(int32_t);
    const char *ft = blob + ll + 1; /* int32 tokens, maybe unaligned: copied one by one */
    size_t p = 0;
    for (; p < nf && p < n; p++) {
        int32_t t;
        memcpy(&t, ft + p * sizeof t, sizeof t);
        if (t != toks[p]) break;
    }
    if ((int)nf != kvpq_cache_seq_len(lc, 0)) p = 0; /* the blob does not describe the cache: use nothing */
    if (p >= n) p = n - 1;
    free(ub);
    if ((s = kvpq_cache_truncate(lc, (int)p)) != KVPQ_OK) {
        kvpq_cache_free(lc);
        return cli_fail("generate: --prompt-cache", s);
    }
    kvpq_cache_free(cc->cache);
    cc->cache = lc;
    *reused = p;
    return 0;
}

static const char *const OPTS[] = {"--help",  "-h",     "--chat",      "--quiet", "-q",      "--prompt-cache",
                                   "--model", "-m",     "--prompt",    "-p",      "--cache", "-n",
                                   "--n-predict", "--seed", "--threads", "-t",     "--temp",  "--top-p", "--prompt-ids", "--print-ids", NULL};

int cmd_generate(int argc, char **argv) {
    const char *model_path = NULL, *prompt = "", *cache_spec = "fp32", *prompt_cache = NULL;
    long n_gen = 64, seed = 42, threads = 0;
    double temp = 0.8, top_p = 0.95;
    int chat = 0, print_ids = 0;
    const char *prompt_ids = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!cli_option_known(a, OPTS)) return cli_unknown_option("generate", a, OPTS);
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
            continue;
        } else if (!strcmp(a, "--print-ids")) {
            print_ids = 1;
            continue;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
            continue;
        }
        if (!v) return cli_usage_error("generate: option %s needs a value (see --help)", a);
        i++;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--prompt") || !strcmp(a, "-p")) prompt = v;
        else if (!strcmp(a, "--cache")) cache_spec = v;
        else if (!strcmp(a, "--prompt-ids")) prompt_ids = v;
        else if (!strcmp(a, "--prompt-cache")) prompt_cache = v;
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            if (!cli_parse_int(a, v, 0, 1 << 20, &n_gen)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!cli_parse_int(a, v, 0, 0x7fffffffL, &seed)) return 2;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (!cli_parse_int(a, v, 0, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--temp")) {
            if (!cli_parse_double(a, v, 0, 100, &temp)) return 2;
        } else if (!strcmp(a, "--top-p")) {
            if (!cli_parse_double(a, v, 0, 1, &top_p)) return 2;
        } else
            return cli_usage_error("generate: unknown option '%s' (see --help)", a);
    }
    if (!model_path) return cli_usage_error("generate: --model is required (see --help)");
    if (prompt_ids && (chat || *prompt))
        return cli_usage_error("generate: --prompt-ids replaces --prompt and --chat (give one)");
    size_t bad;
    if (!cli_utf8_valid((const unsigned char *)prompt, strlen(prompt), &bad))
        return cli_usage_error("generate: --prompt is not valid UTF-8 (byte %zu)", bad);

    int rc = 1;
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)threads;
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("generate", s);
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);

    int32_t *toks = NULL, *idx = NULL;
    float *logits = NULL, *work = NULL;
    cli_cache cc = {0};
    chat_pieces pieces = {.n = 0};
    if (chat) {
        if (!chatml_pieces(kvpq_model_chat_template(m), prompt, &pieces)) {
            fprintf(stderr, "kvpq generate: --chat: the model's chat template is %s; only ChatML is implemented\n",
                    kvpq_model_chat_template(m) ? "not ChatML" : "missing");
            goto done;
        }
    } else {
        piece_add(&pieces, prompt, strlen(prompt), 0); /* a plain prompt is plain text too */
    }
    size_t n_prompt = 0;
    if (prompt_ids) { /* ids as given: BOS, if wanted, among them */
        toks = cli_parse_ids(prompt_ids, strlen(prompt_ids), &n_prompt);
        s = KVPQ_OK;
        if (toks && n_prompt == 0) { /* at least one slot, as tokenize_pieces gives */
            free(toks);
            toks = malloc(sizeof *toks);
        }
        if (!toks) {
            fprintf(stderr, "kvpq generate: --prompt-ids: out of memory or a number beyond int32\n");
            goto done;
        }
    } else
        s = tokenize_pieces(m, &pieces, mi.add_bos, &toks, &n_prompt);
    if (s != KVPQ_OK) {
        cli_fail("generate: prompt", s);
        goto done;
    }
    if (n_prompt == 0) { /* nothing to condition on: start from BOS */
        if (mi.bos_id < 0) {
            fprintf(stderr, "kvpq generate: empty prompt and the model has no BOS token\n");
            goto done;
        }
        toks[0] = mi.bos_id; /* tokenize_pieces allocated at least one slot */
        n_prompt = 1;
    }
    if ((long)n_prompt + n_gen > mi.n_ctx_train) {
        fprintf(stderr, "kvpq generate: %zu prompt tokens + %ld to generate exceed the model's context of %d\n",
                n_prompt, n_gen, mi.n_ctx_train);
        goto done;
    }
    logits = malloc((size_t)mi.n_vocab * sizeof *logits);
    work = malloc((size_t)mi.n_vocab * sizeof *work);
    idx = malloc((size_t)mi.n_vocab * sizeof *idx);
    if (!toks || !logits || !work || !idx) {
        fprintf(stderr, "kvpq generate: out of memory\n");
        goto done;
    }
    /* With --prompt-cache the cache is sized for the model's context, so that its window and pages
     * (clamped to max_seq) are the same in every run and a saved prompt fits the next run. */
    if (cli_cache_open(&cc, cache_spec, m, prompt_cache ? mi.n_ctx_train : (int)(n_prompt + (size_t)n_gen + 1),
                       (int)threads))
        goto done;
    double t0 = cli_now(), t_load = 0;
    size_t reused = 0;
    if (prompt_cache && (rc = prompt_cache_load(prompt_cache, m, model_path, &cc, toks, n_prompt, &reused)) != 0) {
        rc = 1;
        goto done;
    }
    rc = 1;
    t_load = cli_now() - t0;

    cli_utf8_stream us = {{0}, 0};
    if (!chat && !print_ids) { /* echo the prompt, as llama.cpp does, so the continuation reads on */
        fputs(prompt, stdout);
        fflush(stdout);
    }
    /* The prompt in batches of PROMPT_BATCH tokens, so a long prompt shows progress. */
    cli_progress pr;
    cli_progress_begin(&pr, "generate: prompt", "tokens", (double)(n_prompt - reused));
    t0 = cli_now();
    for (size_t b = reused; b < n_prompt; b += PROMPT_BATCH) {
        int nb = (int)(n_prompt - b < PROMPT_BATCH ? n_prompt - b : PROMPT_BATCH);
        s = kvpq_model_eval(m, cc.cache, toks + b, nb, 0, logits);
        if (s != KVPQ_OK) {
            cli_fail("generate: prompt eval", s);
            goto done;
        }
        cli_progress_update(&pr, (double)(b + (size_t)nb - reused), NULL);
    }
    cli_progress_end(&pr, (double)(n_prompt - reused), NULL);
    double t_prompt = cli_now() - t0;
    if (prompt_cache && reused + 1 < n_prompt) { /* new prompt content: keep it for the next run */
        double ts = cli_now();
        if (prompt_cache_save(prompt_cache, model_path, &mi, cc.cache, toks, n_prompt)) goto done;
        fprintf(stderr, "kvpq generate: --prompt-cache %s: saved %zu prompt tokens (%.3f s)\n", prompt_cache,
                n_prompt, cli_now() - ts);
    }
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)seed);
    const double t_first_start = cli_now();
    int first_reported = 0;
    long n_done = 0, n_dec = 0;
    double t_dec = 0;
    char piece[256];
    for (; n_done < n_gen; n_done++) {
        int32_t t = cli_sample(logits, mi.n_vocab, (float)temp, (float)top_p, &rng, work, idx);
        if (!first_reported) { /* time to first token: loading the saved prompt + the rest + sampling */
            first_reported = 1;
            fprintf(stderr,
                    "kvpq generate: first token after %.3f s (prompt cache load %.3f s for %zu tokens, prompt eval "
                    "%.3f s for %zu tokens)\n",
                    t_load + t_prompt + (cli_now() - t_first_start), t_load, reused, t_prompt, n_prompt - reused);
        }
        if (t == mi.eos_id) break;
        if (print_ids) {
            printf(n_done ? " %d" : "%d", t);
            fflush(stdout);
        } else {
            size_t len = 0;
            s = kvpq_token_to_piece(m, t, piece, sizeof piece, &len);
            if (s != KVPQ_OK) {
                cli_fail("generate: token_to_piece", s);
                goto done;
            }
            cli_utf8_write(&us, stdout, piece, len < sizeof piece ? len : sizeof piece);
        }
        if (n_done + 1 == n_gen) {
            n_done++;
            break; /* the last token needs no eval */
        }
        t0 = cli_now();
        s = kvpq_model_eval(m, cc.cache, &t, 1, 0, logits);
        t_dec += cli_now() - t0;
        n_dec++;
        if (s != KVPQ_OK) {
            cli_fail("generate: eval", s);
            goto done;
        }
    }
    cli_utf8_flush(&us, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    fprintf(stderr,
            "kvpq generate: prompt %zu tokens in %.3f s (%.1f tok/s); generated %ld tokens, %ld one-token evals in "
            "%.3f s (%.1f tok/s); cache %s\n",
            n_prompt, t_prompt, n_prompt / (t_prompt > 0 ? t_prompt : 1e-9), n_done, n_dec, t_dec,
            n_dec / (t_dec > 0 ? t_dec : 1e-9), cache_spec);
    kvpq_cache_stats cst;
    if (kvpq_cache_get_stats(cc.cache, &cst) == KVPQ_OK)
        fprintf(stderr, "kvpq generate: cache %s holds %d positions in %zu bytes (%.2f MiB), %.3f bits per element\n",
                cache_spec, kvpq_cache_seq_len(cc.cache, 0), cst.resident_bytes, cst.resident_bytes / 1048576.0,
                cst.bits_per_element);
    rc = 0;
done:
    cli_cache_close(&cc);
    free(toks);
    free(logits);
    free(work);
    free(idx);
    kvpq_model_free(m);
    return rc;
}
