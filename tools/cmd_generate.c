/* cmd_generate.c — `kvpq generate`: text generation with a chosen KV cache, streamed as produced. */
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_json.h"
#include "cli_chat.h"
#include "cli_model.h"
#include "cli_spec.h"

#define PROMPT_BATCH 512 /* prompt tokens per kvpq_model_eval call */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq generate --model M [--prompt P] [-n N] [--temp T] [--top-p P] [--seed S]\n"
            "                     [--cache SPEC] [--chat] [--threads N] [--prompt-ids IDS] [--print-ids]\n"
            "                     [--prompt-cache FILE] [--quiet] [--logits-out FILE] [--json]\n"
            "  --model M      GGUF model (architecture llama, qwen2 or gemma3)\n"
            "  --prompt P     prompt text (default empty: starts from BOS when the model adds one)\n"
            "  -n N           tokens to generate (default 64); stops early at the end-of-sequence token\n"
            "  --temp T       sampling temperature (default 0.8); 0 = greedy (argmax)\n"
            "  --top-p P      nucleus sampling mass (default 0.95)\n"
            "  --seed S       random seed (default 42)\n"
            "  --cache SPEC   KV cache: fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 vq:CODEBOOK.safetensors\n"
            "                 (default fp32); a suffix :wN sets the full-precision window of vq and kivi\n"
            "                 caches (default 128); :sN keeps the first N positions in fp16 (attention\n"
            "                 sinks, quantized caches; default 1 for vq kivi2 kivi4 q4_0r, else 0; :s0\n"
            "                 turns it off; a --bits codebook brings its own window and sinks); :force\n"
            "                 uses a vq codebook calibrated on another model; :cuda puts a vq cache on the\n"
            "                 GPU (the model's layers stay on the CPU; docs/CUDA.md); suffixes in any order,\n"
            "                 each once\n"
            "  --chat         wrap the prompt in the model's chat template, as one user turn (forms: ChatML,\n"
            "                 with the template's default system message when it has one, and Gemma; see\n"
            "                 kvpq chat --help); the prompt's text never yields control tokens\n"
            "  --threads N    CPU threads (default: OpenMP default)\n"
            "  --prompt-ids IDS  the prompt as token ids (\"2,818,5279\"; any separators) instead of text\n"
            "  --print-ids    print the generated token ids (one line, space-separated) instead of text\n"
            "  --json         print one row as JSON to stdout instead of the text: the text, ids, timings and the\n"
            "                 cache's bytes (schema kvpq.generate/1, docs/json.md)\n"
            "  --quiet        no progress lines on stderr (a long prompt shows its progress)\n"
            "  --prompt-cache FILE  keep the processed prompt in FILE (a saved cache, kvpq_cache_save):\n"
            "                 when FILE holds a prompt of the same model and cache SPEC, the tokens it\n"
            "                 shares with this prompt are loaded instead of computed; else (or when this\n"
            "                 prompt is longer) the processed prompt is written to FILE. A FILE of\n"
            "                 another model, codebook or cache kind, or a damaged one, is refused\n"
            "  --logits-out FILE  write the logits every token is sampled from (float32, n_vocab per row) to\n"
            "                 FILE (for tests; kvpq chat has the same option)\n"
            "The text goes to stdout as it is produced; prompt and generation tokens/s go to stderr.\n");
}

/* ---- --prompt-cache ----
 * The caller blob of the saved cache: a line naming the model ("kvpq-prompt-cache 2 fingerprint=<the
 * GGUF header's, kvpq_model_info.fingerprint> data=<XXH64 of the tensor data,
 * kvpq_model_data_fingerprint> name=<general.name> vocab=<n>"), a NUL, then the prompt's tokens
 * (int32). The library checks the cache kind, shapes, window, pages and codebook; this line checks
 * the model: the file name and size, which version 1 recorded, say nothing about the weights (a
 * different model saved under the same name was accepted). */
static int model_line(char *buf, size_t n, kvpq_model *m, const kvpq_model_info *mi) {
    char data[17];
    kvpq_status s = kvpq_model_data_fingerprint(m, data);
    if (s != KVPQ_OK) return cli_fail("generate: --prompt-cache", s);
    snprintf(buf, n, "kvpq-prompt-cache 2 fingerprint=%s data=%s name=%s vocab=%d", mi->fingerprint, data, mi->name,
             mi->n_vocab);
    return 0;
}

static int prompt_cache_save(const char *path, const char *line, const kvpq_cache *cache, const int32_t *toks,
                             size_t n) {
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
static int prompt_cache_load(const char *path, const char *line, cli_cache *cc, const int32_t *toks, size_t n,
                             size_t *reused) {
    *reused = 0;
    struct stat sb;
    if (stat(path, &sb) != 0 && errno == ENOENT) return 0; /* no file yet: this run writes it */
    kvpq_cache *lc = NULL;
    void *ub = NULL;
    size_t ul = 0;
    kvpq_status s = kvpq_cache_load(&lc, &cc->params, path, &ub, &ul);
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq generate: --prompt-cache %s is refused (remove it or name another file)\n", path);
        if (s == KVPQ_ERR_MISMATCH && strstr(kvpq_last_error(), ": sinks "))
            fprintf(stderr, "kvpq generate: the CLI keeps 1 sink by default for vq, kivi2, kivi4 and q4_0r since "
                            "cache file v3; a file saved without sinks is read with the SPEC suffix :s0\n");
        return cli_fail("generate: --prompt-cache", s);
    }
    const char *blob = ub;
    size_t ll = blob ? strnlen(blob, ul) : 0;
    if (!blob || ll == ul || strcmp(blob, line) || (ul - ll - 1) % sizeof(int32_t)) {
        /* the file's line may hold anything: escaped */
        fprintf(stderr, "kvpq generate: --prompt-cache %s: made for another model, or by an older kvpq (file: ", path);
        cli_fput_escaped(stderr, blob ? blob : "", blob ? ll : 0, 512);
        fprintf(stderr, "; this run: ");
        cli_fput_escaped(stderr, line, strlen(line), 512);
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
    /* Only a prefix the cut keeps as a fresh run would have it: the continuation is then the fresh
     * run's, bit for bit (a windowed kind cut below its coded positions would not be). */
    p = (size_t)kvpq_cache_exact_prefix(lc, (int)p);
    free(ub);
    if (p < nf && (s = kvpq_cache_truncate(lc, (int)p)) != KVPQ_OK) {
        /* A sliding-window layer has freed positions the shorter prompt would need again: the saved
         * prompt is of no use for this one, which is computed (and saved) in full. */
        fprintf(stderr, "kvpq generate: --prompt-cache %s: not used: ", path);
        cli_fput_escaped(stderr, kvpq_last_error(), strlen(kvpq_last_error()), 512);
        fputc('\n', stderr);
        kvpq_cache_free(lc);
        return 0;
    }
    kvpq_cache_free(cc->cache);
    cc->cache = lc;
    *reused = p;
    return 0;
}

/* Evaluate prompt tokens [from, to) in batches of PROMPT_BATCH, the progress counted from base; the
 * logits of the last one land in logits. 0, or 1 (reported). */
static int eval_prompt(kvpq_model *m, kvpq_cache *cache, const int32_t *toks, size_t from, size_t to, size_t base,
                       float *logits, cli_progress *pr) {
    for (size_t b = from; b < to; b += PROMPT_BATCH) {
        int nb = (int)(to - b < PROMPT_BATCH ? to - b : PROMPT_BATCH);
        kvpq_status s = kvpq_model_eval(m, cache, toks + b, nb, 0, logits);
        if (s != KVPQ_OK) return cli_fail("generate: prompt eval", s), 1;
        cli_progress_update(pr, (double)(b + (size_t)nb - base), NULL);
    }
    return 0;
}

typedef struct {
    const char *model_path, *prompt, *cache_spec, *prompt_cache, *logits_out, *prompt_ids;
    long n_gen, seed, threads;
    double temp, top_p;
    int chat, print_ids, json;
} gen_opts;

#define F(field) offsetof(gen_opts, field)
static const cli_opt OPTS[] = {
    {"--chat", NULL, CLI_OPT_FLAG, F(chat), 0, 0},
    {"--print-ids", NULL, CLI_OPT_FLAG, F(print_ids), 0, 0},
    {"--json", NULL, CLI_OPT_FLAG, F(json), 0, 0},
    {"--quiet", "-q", CLI_OPT_QUIET, 0, 0, 0},
    {"--model", "-m", CLI_OPT_STR, F(model_path), 0, 0},
    {"--prompt", "-p", CLI_OPT_STR, F(prompt), 0, 0},
    {"--cache", NULL, CLI_OPT_STR, F(cache_spec), 0, 0},
    {"--prompt-ids", NULL, CLI_OPT_STR, F(prompt_ids), 0, 0},
    {"--prompt-cache", NULL, CLI_OPT_PATH, F(prompt_cache), 0, 0},
    {"--logits-out", NULL, CLI_OPT_STR, F(logits_out), 0, 0},
    {"--n-predict", "-n", CLI_OPT_LONG, F(n_gen), 0, 1 << 20},
    {"--seed", NULL, CLI_OPT_LONG, F(seed), 0, 0x7fffffffL},
    {"--threads", "-t", CLI_OPT_LONG, F(threads), 0, 1024},
    {"--temp", NULL, CLI_OPT_DOUBLE, F(temp), 0, 100},
    {"--top-p", NULL, CLI_OPT_DOUBLE, F(top_p), 0, 1},
    {NULL, NULL, 0, 0, 0, 0},
};
#undef F

/* argv into *o, checked: -1 to go on, else the exit code (0 after --help). */
static int parse_opts(int argc, char **argv, gen_opts *o) {
    memset(o, 0, sizeof *o);
    o->prompt = "";
    o->cache_spec = "fp32";
    o->n_gen = 64;
    o->seed = 42;
    o->temp = 0.8;
    o->top_p = 0.95;
    int rc = cli_parse_options("generate", argc, argv, OPTS, o, usage);
    if (rc >= 0) return rc;
    if (!o->model_path) return cli_usage_error("generate: --model is required (see --help)");
    if (o->prompt_ids && (o->chat || *o->prompt))
        return cli_usage_error("generate: --prompt-ids replaces --prompt and --chat (give one)");
    size_t bad;
    if (!cli_utf8_valid((const unsigned char *)o->prompt, strlen(o->prompt), &bad))
        return cli_usage_error("generate: --prompt is not valid UTF-8 (byte %zu)", bad);
    if (cli_cache_spec_check(o->cache_spec)) return 2; /* before the model loads */
    return -1;
}

/* A run: the model, the prompt's tokens, the cache, the sampling buffers and the times. */
typedef struct {
    const gen_opts *o;
    kvpq_model *m;
    kvpq_model_info mi;
    cli_chat_pieces pieces;
    int32_t *toks, *idx;     /* (n_prompt, at least 1) the prompt; (n_vocab) sampling work */
    size_t n_prompt, reused; /* prompt tokens; those loaded from --prompt-cache */
    float *logits, *work;    /* (n_vocab) each */
    cli_cache cc;
    char pc_line[512];       /* the --prompt-cache model line */
    FILE *lf;                /* --logits-out */
    cli_utf8_stream us;
    double t_load, t_prompt, t_dec; /* seconds: prompt cache load, prompt eval, one-token evals */
    long n_done, n_dec;      /* tokens generated; one-token evals */
    const char *stop;        /* why generation ended: "eos" or "length" */
    char *text;              /* --json: the generated text (text_n bytes) and ids (out_ids, n_done) */
    size_t text_n, text_cap;
    int32_t *out_ids;
} gen_state;

/* The prompt as pieces: in the chat template (--chat) or plain text. 0, or 1 (message printed). */
static int prompt_pieces(gen_state *st) {
    if (!st->o->chat) {
        cli_chat_user_plain(&st->pieces, st->o->prompt); /* a plain prompt is plain text too */
        return 0;
    }
    cli_chat_template tmpl;
    const char *note = NULL;
    if (cli_chat_template_init(&tmpl, st->m, NULL, "generate: --chat", &note)) return 1;
    if (note) fprintf(stderr, "kvpq generate: --chat: %s\n", note);
    cli_chat_begin(&tmpl, &st->pieces, NULL);
    cli_chat_user(&tmpl, &st->pieces, st->o->prompt, 1, NULL);
    cli_chat_assistant_open(&tmpl, &st->pieces);
    return 0;
}

/* The prompt's tokens (--prompt-ids as given, else the pieces tokenized), BOS for an empty one, the
 * context checked; the sampling buffers. 0, or 1 (message printed). */
static int prompt_tokens(gen_state *st) {
    const gen_opts *o = st->o;
    kvpq_status s = KVPQ_OK;
    if (o->prompt_ids) { /* ids as given: BOS, if wanted, among them */
        st->toks = cli_parse_ids(o->prompt_ids, strlen(o->prompt_ids), &st->n_prompt);
        if (st->toks && st->n_prompt == 0) { /* at least one slot, as tokenize_pieces gives */
            free(st->toks);
            st->toks = malloc(sizeof *st->toks);
        }
        if (!st->toks)
            return fprintf(stderr, "kvpq generate: --prompt-ids: out of memory, or a negative number or one beyond "
                                   "int32\n"), 1;
    } else
        s = cli_chat_tokenize(st->m, &st->pieces, st->mi.add_bos, &st->toks, &st->n_prompt);
    if (s != KVPQ_OK) return cli_fail("generate: prompt", s);
    if (st->n_prompt == 0) { /* nothing to condition on: start from BOS */
        if (st->mi.bos_id < 0) return fprintf(stderr, "kvpq generate: empty prompt and the model has no BOS token\n"), 1;
        st->toks[0] = st->mi.bos_id; /* tokenize_pieces allocated at least one slot */
        st->n_prompt = 1;
    }
    if ((long)st->n_prompt + o->n_gen > st->mi.n_ctx_train) {
        fprintf(stderr, "kvpq generate: %zu prompt tokens + %ld to generate exceed the model's context of %d\n",
                st->n_prompt, o->n_gen, st->mi.n_ctx_train);
        return 1;
    }
    st->logits = malloc((size_t)st->mi.n_vocab * sizeof *st->logits);
    st->work = malloc((size_t)st->mi.n_vocab * sizeof *st->work);
    st->idx = malloc((size_t)st->mi.n_vocab * sizeof *st->idx);
    if (!st->toks || !st->logits || !st->work || !st->idx)
        return fprintf(stderr, "kvpq generate: out of memory\n"), 1;
    return 0;
}

/* The cache, and with --prompt-cache the saved prompt it shares with this one. 0, or 1 (message printed). */
static int open_cache(gen_state *st) {
    const gen_opts *o = st->o;
    /* With --prompt-cache the cache is sized for the model's context, so that its window and pages
     * (clamped to max_seq) are the same in every run and a saved prompt fits the next run. */
    if (cli_cache_open(&st->cc, o->cache_spec, st->m,
                       o->prompt_cache ? st->mi.n_ctx_train : (int)(st->n_prompt + (size_t)o->n_gen + 1),
                       (int)o->threads))
        return 1;
    const double t0 = cli_now();
    if (o->prompt_cache && model_line(st->pc_line, sizeof st->pc_line, st->m, &st->mi)) return 1;
    if (o->prompt_cache && prompt_cache_load(o->prompt_cache, st->pc_line, &st->cc, st->toks, st->n_prompt,
                                             &st->reused) != 0)
        return 1;
    st->t_load = cli_now() - t0;
    return 0;
}

/* The evaluated prompt tokens [0, upto) into --prompt-cache; a failed save is reported and the
 * generation goes on. Returns the seconds it took. */
static double save_prompt(gen_state *st, size_t upto) {
    const char *path = st->o->prompt_cache;
    const double ts = cli_now();
    /* a failed save (full disk, read-only folder) is reported and the generation goes on: the
     * prompt is evaluated, and any existing file is left as it was (kvpq_cache_save) */
    if (prompt_cache_save(path, st->pc_line, st->cc.cache, st->toks, upto) == 0)
        fprintf(stderr, "kvpq generate: --prompt-cache %s: saved %zu prompt tokens (%.3f s)\n", path, upto,
                cli_now() - ts);
    else
        fprintf(stderr, "kvpq generate: --prompt-cache %s: not saved (see above); generating anyway\n", path);
    return cli_now() - ts;
}

/* The prompt (echoed unless --chat or --print-ids) evaluated past the reused tokens; the logits of
 * its last token land in st->logits. 0, or 1 (message printed). */
static int prefill(gen_state *st) {
    const gen_opts *o = st->o;
    const size_t n_prompt = st->n_prompt, reused = st->reused;
    if (!o->chat && !o->print_ids && !o->json) { /* echo the prompt, as llama.cpp does, so the continuation reads on */
        fputs(o->prompt, stdout);
        fflush(stdout);
    }
    /* The prompt in batches of PROMPT_BATCH tokens, so a long prompt shows progress. With
     * --prompt-cache, all but its last token first, saved, then the last one (for its logits): a
     * later run of the same prompt, or of a longer one, continues the file without cutting it, so
     * exactly as this run (kvpq_cache_exact_prefix). */
    cli_progress pr;
    cli_progress_begin(&pr, "generate: prompt", "tokens", (double)(n_prompt - reused));
    const double t0 = cli_now();
    const size_t upto = o->prompt_cache ? n_prompt - 1 : n_prompt;
    double t_save = 0; /* not counted as prompt time */
    if (eval_prompt(st->m, st->cc.cache, st->toks, reused, upto, reused, st->logits, &pr)) return 1;
    if (o->prompt_cache && reused < upto) t_save = save_prompt(st, upto); /* new prompt content: kept */
    if (eval_prompt(st->m, st->cc.cache, st->toks, upto, n_prompt, reused, st->logits, &pr)) return 1;
    cli_progress_end(&pr, (double)(n_prompt - reused), NULL);
    st->t_prompt = cli_now() - t0 - t_save;
    return 0;
}

/* Token t to stdout: its id (--print-ids) or its text. 0, or 1 (message printed). */
/* --json: the token and its text kept for the row. 0, or 1 (message printed). */
static int keep_token(gen_state *st, int32_t t, const char *piece, size_t len) {
    if (!st->out_ids && !(st->out_ids = malloc(sizeof *st->out_ids * (size_t)(st->o->n_gen ? st->o->n_gen : 1))))
        return fprintf(stderr, "kvpq generate: out of memory\n"), 1;
    if (st->text_n + len + 1 > st->text_cap) {
        size_t cap = 2 * (st->text_n + len + 1) + 256;
        char *b = realloc(st->text, cap);
        if (!b) return fprintf(stderr, "kvpq generate: out of memory\n"), 1;
        st->text = b, st->text_cap = cap;
    }
    memcpy(st->text + st->text_n, piece, len);
    st->text_n += len;
    st->out_ids[st->n_done] = t;
    return 0;
}

static int emit_token(gen_state *st, int32_t t) {
    if (st->o->json) {
        char piece[256];
        size_t len = 0;
        kvpq_status s = kvpq_token_to_piece(st->m, t, piece, sizeof piece, &len);
        if (s != KVPQ_OK) return cli_fail("generate: token_to_piece", s);
        return keep_token(st, t, piece, len < sizeof piece ? len : sizeof piece);
    }
    if (st->o->print_ids) {
        printf(st->n_done ? " %d" : "%d", t);
        fflush(stdout);
        return 0;
    }
    char piece[256];
    size_t len = 0;
    kvpq_status s = kvpq_token_to_piece(st->m, t, piece, sizeof piece, &len);
    if (s != KVPQ_OK) return cli_fail("generate: token_to_piece", s);
    cli_utf8_write(&st->us, stdout, piece, len < sizeof piece ? len : sizeof piece);
    return 0;
}

/* Time to first token: loading the saved prompt + the rest + sampling (t_start: sampling began). */
static void report_first(const gen_state *st, double t_start) {
    fprintf(stderr,
            "kvpq generate: first token after %.3f s (prompt cache load %.3f s for %zu tokens, prompt eval "
            "%.3f s for %zu tokens)\n",
            st->t_load + st->t_prompt + (cli_now() - t_start), st->t_load, st->reused, st->t_prompt,
            st->n_prompt - st->reused);
}

/* Sample, print and evaluate up to -n tokens, stopping at end-of-sequence; each sampled-from row of
 * logits to --logits-out. 0, or 1 (message printed). */
static int decode(gen_state *st) {
    const gen_opts *o = st->o;
    const int V = st->mi.n_vocab;
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)o->seed);
    const double t_first_start = cli_now();
    st->stop = "length";
    for (; st->n_done < o->n_gen; st->n_done++) {
        if (st->lf && fwrite(st->logits, sizeof *st->logits, (size_t)V, st->lf) != (size_t)V)
            return fprintf(stderr, "kvpq generate: --logits-out '%s': write failed\n", o->logits_out), 1;
        int32_t t = cli_sample(st->logits, V, (float)o->temp, (float)o->top_p, &rng, st->work, st->idx);
        if (st->n_done == 0) report_first(st, t_first_start);
        if (t == st->mi.eos_id) {
            st->stop = "eos";
            break;
        }
        if (emit_token(st, t)) return 1;
        if (st->n_done + 1 == o->n_gen) {
            st->n_done++;
            break; /* the last token needs no eval */
        }
        const double t0 = cli_now();
        kvpq_status s = kvpq_model_eval(st->m, st->cc.cache, &t, 1, 0, st->logits);
        st->t_dec += cli_now() - t0;
        st->n_dec++;
        if (s != KVPQ_OK) return cli_fail("generate: eval", s);
    }
    return 0;
}

/* --json: the run's settings and its one row (schema kvpq.generate/1, docs/json.md). The exit code. */
static int print_json(const gen_state *st, const kvpq_cache_stats *cst) {
    const gen_opts *o = st->o;
    cJSON *settings = NULL, *rows = NULL, *doc = cli_json_new("generate", &settings, &rows);
    cJSON *r = cJSON_CreateObject();
    char *text = cli_utf8_clean(st->text ? st->text : "", st->text_n);
    if (!doc || !r || !text) {
        cJSON_Delete(doc), cJSON_Delete(r), free(text);
        return fprintf(stderr, "kvpq generate: out of memory\n"), 1;
    }
    cJSON_AddStringToObject(settings, "model", o->model_path);
    cJSON_AddStringToObject(settings, "cache", o->cache_spec);
    cJSON_AddNumberToObject(settings, "n_predict", (double)o->n_gen);
    cJSON_AddNumberToObject(settings, "temp", o->temp);
    cJSON_AddNumberToObject(settings, "top_p", o->top_p);
    cJSON_AddNumberToObject(settings, "seed", (double)o->seed);
    cJSON_AddNumberToObject(settings, "threads", (double)o->threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    cJSON_AddNumberToObject(r, "prompt_tokens", (double)st->n_prompt);
    cJSON_AddNumberToObject(r, "reused_tokens", (double)st->reused);
    cJSON_AddNumberToObject(r, "prompt_s", st->t_prompt);
    cJSON_AddNumberToObject(r, "generated", (double)st->n_done);
    cJSON_AddNumberToObject(r, "decode_s", st->t_dec);
    cli_json_num(r, "decode_tok_per_s", st->n_dec ? st->n_dec / st->t_dec : 0);
    cJSON_AddStringToObject(r, "stop", st->stop ? st->stop : "length");
    cJSON_AddStringToObject(r, "text", text);
    cJSON_AddItemToObject(r, "ids", cli_json_ids(st->out_ids, st->out_ids ? (size_t)st->n_done : 0));
    cJSON_AddNumberToObject(r, "positions", kvpq_cache_seq_len(st->cc.cache, 0));
    cJSON_AddNumberToObject(r, "stored_bytes", (double)cst->stored_bytes);
    cli_json_num(r, "stored_bits_per_element", cst->stored_bits_per_element);
    cJSON_AddNumberToObject(r, "resident_bytes", (double)cst->resident_bytes);
    cJSON_AddItemToArray(rows, r);
    free(text);
    return cli_json_print(doc);
}

/* --logits-out closed, the text's end and newline, the speeds and the cache's memory to stderr.
 * 0, or 1 (message printed). */
static int finish(gen_state *st) {
    const gen_opts *o = st->o;
    if (st->lf) {
        int close_failed = fclose(st->lf) != 0;
        st->lf = NULL;
        if (close_failed) return fprintf(stderr, "kvpq generate: --logits-out '%s': write failed\n", o->logits_out), 1;
    }
    if (!o->json) {
        cli_utf8_flush(&st->us, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    const double tp = st->t_prompt, td = st->t_dec;
    fprintf(stderr,
            "kvpq generate: prompt %zu tokens in %.3f s (%.1f tok/s%s); generated %ld tokens, %ld one-token evals in "
            "%.3f s (%.1f tok/s); cache %s\n",
            st->n_prompt, tp, (st->n_prompt - st->reused) / (tp > 0 ? tp : 1e-9),
            st->reused ? " over the tokens evaluated; the rest came from --prompt-cache" : "", st->n_done, st->n_dec,
            td, st->n_dec / (td > 0 ? td : 1e-9), o->cache_spec);
    kvpq_cache_stats cst;
    if (kvpq_cache_get_stats(st->cc.cache, &cst) != KVPQ_OK) memset(&cst, 0, sizeof cst);
    else cli_print_cache_memory("generate", o->cache_spec, st->cc.cache, &cst);
    return o->json ? print_json(st, &cst) : 0;
}

/* Everything after the model loads: the exit code. */
static int gen_run(gen_state *st) {
    const char *lo = st->o->logits_out;
    if (prompt_pieces(st) || prompt_tokens(st) || open_cache(st) || prefill(st)) return 1;
    st->lf = lo ? fopen(lo, "wb") : NULL;
    if (lo && !st->lf) {
        fprintf(stderr, "kvpq generate: --logits-out '%s': cannot write: ", lo);
        perror(NULL);
        return 1;
    }
    return decode(st) || finish(st) ? 1 : 0;
}

int cmd_generate(int argc, char **argv) {
    gen_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0) return rc;
    gen_state st;
    memset(&st, 0, sizeof st);
    st.o = &o;
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)o.threads;
    kvpq_status s = kvpq_model_load(&st.m, o.model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("generate", s);
    kvpq_model_get_info(st.m, &st.mi);
    rc = gen_run(&st);
    if (st.lf) fclose(st.lf);
    cli_chat_pieces_free(&st.pieces);
    cli_cache_close(&st.cc);
    free(st.toks);
    free(st.logits);
    free(st.work);
    free(st.idx);
    free(st.text);
    free(st.out_ids);
    kvpq_model_free(st.m);
    return rc;
}
