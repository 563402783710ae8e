/* cmd_generate.c — `kvpq generate`: text generation with a chosen KV cache, streamed as produced. */
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_model.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq generate --model M [--prompt P] [-n N] [--temp T] [--top-p P] [--seed S]\n"
            "                     [--cache SPEC] [--chat] [--threads N]\n"
            "  --model M      GGUF model (Llama family)\n"
            "  --prompt P     prompt text (default empty: starts from BOS when the model adds one)\n"
            "  -n N           tokens to generate (default 64); stops early at the end-of-sequence token\n"
            "  --temp T       sampling temperature (default 0.8); 0 = greedy (argmax)\n"
            "  --top-p P      nucleus sampling mass (default 0.95)\n"
            "  --seed S       random seed (default 42)\n"
            "  --cache SPEC   KV cache: fp32 fp16 q8_0 q4_0 kivi2 kivi4 vq:CODEBOOK.safetensors (default fp32);\n"
            "                 a suffix :wN sets the full-precision window of vq and kivi caches (default 128);\n"
            "                 a final :force uses a vq codebook calibrated on another model\n"
            "  --chat         wrap the prompt in the model's chat template. Implemented form: ChatML\n"
            "                 (used when tokenizer.chat_template contains \"<|im_start|>\"), with the\n"
            "                 template's default system message when it has one (SmolLM2 does);\n"
            "                 other templates are refused\n"
            "  --threads N    CPU threads (default: OpenMP default)\n"
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
    static const char sys_head[] = "<|im_start|>system\n";
    const char *p = strstr(tmpl, sys_head);
    if (p) {
        const char *b = p + strlen(sys_head), *e = strstr(b, "<|im_end|>");
        if (e && !memchr(b, '{', (size_t)(e - b)) && !memchr(b, '\'', (size_t)(e - b)))
            piece_add(c, p, (size_t)(e - p) + strlen("<|im_end|>"), 1); /* the template's own text */
        if (c->n) piece_add(c, "\n", 1, 1);
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

int cmd_generate(int argc, char **argv) {
    const char *model_path = NULL, *prompt = "", *cache_spec = "fp32";
    long n_gen = 64, seed = 42, threads = 0;
    double temp = 0.8, top_p = 0.95;
    int chat = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--chat")) {
            chat = 1;
            continue;
        }
        if (!v) return cli_usage_error("generate: option %s needs a value (see --help)", a);
        i++;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--prompt") || !strcmp(a, "-p")) prompt = v;
        else if (!strcmp(a, "--cache")) cache_spec = v;
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
    if (cli_cache_open(&cc, cache_spec, &mi, (int)(n_prompt + (size_t)n_gen + 1), (int)threads)) goto done;

    cli_utf8_stream us = {{0}, 0};
    if (!chat) { /* echo the prompt, as llama.cpp does, so the continuation reads on */
        fputs(prompt, stdout);
        fflush(stdout);
    }
    double t0 = cli_now();
    s = kvpq_model_eval(m, cc.cache, toks, (int)n_prompt, 0, logits);
    double t_prompt = cli_now() - t0;
    if (s != KVPQ_OK) {
        cli_fail("generate: prompt eval", s);
        goto done;
    }
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)seed);
    long n_done = 0, n_dec = 0;
    double t_dec = 0;
    char piece[256];
    for (; n_done < n_gen; n_done++) {
        int32_t t = cli_sample(logits, mi.n_vocab, (float)temp, (float)top_p, &rng, work, idx);
        if (t == mi.eos_id) break;
        size_t len = 0;
        s = kvpq_token_to_piece(m, t, piece, sizeof piece, &len);
        if (s != KVPQ_OK) {
            cli_fail("generate: token_to_piece", s);
            goto done;
        }
        cli_utf8_write(&us, stdout, piece, len < sizeof piece ? len : sizeof piece);
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
