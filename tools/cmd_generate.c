/* cmd_generate.c — `kvpq generate`: text generation with a chosen KV cache, streamed as produced. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "cli_chat.h"
#include "cli_model.h"
#include "cli_spec.h"

#define PROMPT_BATCH 512 /* prompt tokens per kvpq_model_eval call */

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq generate --model M [--prompt P] [-n N] [--temp T] [--top-p P] [--seed S]\n"
            "                     [--cache SPEC] [--chat] [--threads N] [--prompt-ids IDS] [--print-ids]\n"
            "                     [--prompt-cache FILE] [--quiet] [--logits-out FILE]\n"
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

static const char *const OPTS[] = {"--help",  "-h",     "--chat",      "--quiet", "-q",      "--prompt-cache",
                                   "--model", "-m",     "--prompt",    "-p",      "--cache", "-n",
                                   "--n-predict", "--seed", "--threads", "-t",     "--temp",  "--top-p", "--prompt-ids", "--print-ids", "--logits-out", NULL};

int cmd_generate(int argc, char **argv) {
    const char *model_path = NULL, *prompt = "", *cache_spec = "fp32", *prompt_cache = NULL, *logits_out = NULL;
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
        else if (!strcmp(a, "--prompt-cache")) {
            if (!*v) return cli_usage_error("generate: --prompt-cache: expected a file name, got ''");
            prompt_cache = v;
        } else if (!strcmp(a, "--logits-out")) logits_out = v;
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

    if (cli_cache_spec_check(cache_spec)) return 2; /* before the model loads */
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
    cli_chat_pieces pieces = {0};
    FILE *lf = NULL;
    if (chat) {
        cli_chat_template tmpl;
        const char *note = NULL;
        if (cli_chat_template_init(&tmpl, m, NULL, "generate: --chat", &note)) goto done;
        if (note) fprintf(stderr, "kvpq generate: --chat: %s\n", note);
        cli_chat_begin(&tmpl, &pieces, NULL);
        cli_chat_user(&tmpl, &pieces, prompt, 1, NULL);
        cli_chat_assistant_open(&tmpl, &pieces);
    } else {
        cli_chat_user_plain(&pieces, prompt); /* a plain prompt is plain text too */
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
            fprintf(stderr, "kvpq generate: --prompt-ids: out of memory, or a negative number or one beyond int32\n");
            goto done;
        }
    } else
        s = cli_chat_tokenize(m, &pieces, mi.add_bos, &toks, &n_prompt);
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
    char pc_line[512];
    if (prompt_cache && model_line(pc_line, sizeof pc_line, m, &mi)) goto done;
    if (prompt_cache && (rc = prompt_cache_load(prompt_cache, pc_line, &cc, toks, n_prompt, &reused)) != 0) {
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
    /* The prompt in batches of PROMPT_BATCH tokens, so a long prompt shows progress. With
     * --prompt-cache, all but its last token first, saved, then the last one (for its logits): a
     * later run of the same prompt, or of a longer one, continues the file without cutting it, so
     * exactly as this run (kvpq_cache_exact_prefix). */
    cli_progress pr;
    cli_progress_begin(&pr, "generate: prompt", "tokens", (double)(n_prompt - reused));
    t0 = cli_now();
    const size_t upto = prompt_cache ? n_prompt - 1 : n_prompt;
    double t_save = 0; /* not counted as prompt time */
    if (eval_prompt(m, cc.cache, toks, reused, upto, reused, logits, &pr)) goto done;
    if (prompt_cache && reused < upto) { /* new prompt content: keep it for the next run */
        double ts = cli_now();
        /* a failed save (full disk, read-only folder) is reported and the generation goes on: the
         * prompt is evaluated, and any existing file is left as it was (kvpq_cache_save) */
        if (prompt_cache_save(prompt_cache, pc_line, cc.cache, toks, upto) == 0)
            fprintf(stderr, "kvpq generate: --prompt-cache %s: saved %zu prompt tokens (%.3f s)\n", prompt_cache,
                    upto, cli_now() - ts);
        else
            fprintf(stderr, "kvpq generate: --prompt-cache %s: not saved (see above); generating anyway\n",
                    prompt_cache);
        t_save = cli_now() - ts;
    }
    if (eval_prompt(m, cc.cache, toks, upto, n_prompt, reused, logits, &pr)) goto done;
    cli_progress_end(&pr, (double)(n_prompt - reused), NULL);
    double t_prompt = cli_now() - t0 - t_save;
    lf = logits_out ? fopen(logits_out, "wb") : NULL;
    if (logits_out && !lf) {
        fprintf(stderr, "kvpq generate: --logits-out '%s': cannot write: ", logits_out);
        perror(NULL);
        goto done;
    }
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)seed);
    const double t_first_start = cli_now();
    int first_reported = 0;
    long n_done = 0, n_dec = 0;
    double t_dec = 0;
    char piece[256];
    for (; n_done < n_gen; n_done++) {
        if (lf && fwrite(logits, sizeof *logits, (size_t)mi.n_vocab, lf) != (size_t)mi.n_vocab) {
            fprintf(stderr, "kvpq generate: --logits-out '%s': write failed\n", logits_out);
            goto done;
        }
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
    if (lf) {
        int close_failed = fclose(lf) != 0;
        lf = NULL;
        if (close_failed) {
            fprintf(stderr, "kvpq generate: --logits-out '%s': write failed\n", logits_out);
            goto done;
        }
    }
    cli_utf8_flush(&us, stdout);
    fputc('\n', stdout);
    fflush(stdout);
    fprintf(stderr,
            "kvpq generate: prompt %zu tokens in %.3f s (%.1f tok/s%s); generated %ld tokens, %ld one-token evals in "
            "%.3f s (%.1f tok/s); cache %s\n",
            n_prompt, t_prompt, (n_prompt - reused) / (t_prompt > 0 ? t_prompt : 1e-9),
            reused ? " over the tokens evaluated; the rest came from --prompt-cache" : "", n_done, n_dec, t_dec,
            n_dec / (t_dec > 0 ? t_dec : 1e-9), cache_spec);
    kvpq_cache_stats cst;
    if (kvpq_cache_get_stats(cc.cache, &cst) == KVPQ_OK)
        cli_print_cache_memory("generate", cache_spec, cc.cache, &cst);
    rc = 0;
done:
    if (lf) fclose(lf);
    cli_chat_pieces_free(&pieces);
    cli_cache_close(&cc);
    free(toks);
    free(logits);
    free(work);
    free(idx);
    kvpq_model_free(m);
    return rc;
}
