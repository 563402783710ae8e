/* cmd_chat.c — `kvpq chat`: a multi-turn conversation read from stdin, in the model's chat template,
 * with one KV cache kept across turns: each turn prefills only its own new tokens (the previous
 * reply's closing tokens, the user's message, the assistant header) on top of what the cache holds,
 * coded as the cache codes them (a vq or kivi cache holds the conversation as codes). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "cli_chat.h"
#include "cli_line.h"
#include "cli_json.h"
#include "cli_model.h"
#include "cli_spec.h"

#define PROMPT_BATCH 512

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq chat --model M [--cache SPEC] [--system TEXT] [-n N] [--temp T] [--top-p P] [--seed S]\n"
            "                 [--ctx N] [--template auto|chatml|gemma] [--threads N] [--json] [--quiet]\n"
            "                 [--render] [--render-ids] [--logits-out FILE]\n"
            "A conversation with the model in its chat template. Each line of stdin is one user message (a\n"
            "line ending in \\ goes on with the next: a multi-line message; on a terminal a '> ' prompt is\n"
            "shown); the reply streams to stdout; end of input ends the chat.\n"
            "The KV cache is kept across turns: a turn prefills only its own new tokens, so with a vq or kivi\n"
            "cache the conversation so far is held as codes. Lines: /reset starts a new conversation (empty\n"
            "cache), /exit ends; a line starting with // sends the rest starting with /; empty lines are skipped.\n"
            "Text you type never becomes a control token: \"<|im_end|>\" in a message is plain text.\n"
            "  --model M      GGUF model\n"
            "  --cache SPEC   KV cache: fp32 fp16 q8_0 q4_0 kivi2 kivi4 vq:CODEBOOK.safetensors (default fp32),\n"
            "                 with :wN, :sN, :force and :cuda as in kvpq generate\n"
            "  --system TEXT  system message (default: the template's own, if any: SmolLM2 and Qwen2.5 have one;\n"
            "                 Gemma has no system role: the text goes before the first user message)\n"
            "  -n N           most tokens per reply (default 256); a reply also ends at the model's end-of-turn\n"
            "                 token or any other control token (EOS too)\n"
            "  --temp T       sampling temperature (default 0.8); 0 = greedy\n"
            "  --top-p P      nucleus sampling mass (default 0.95)\n"
            "  --seed S       random seed (default 42)\n"
            "  --ctx N        positions the conversation may hold (default: the model's context length); a\n"
            "                 turn that does not fit is refused (/reset starts over)\n"
            "  --template T   auto (default): the form of the GGUF's tokenizer.chat_template (ChatML or\n"
            "                 Gemma), or Gemma's for a gemma3 model without one; chatml or gemma: that form\n"
            "  --threads N    CPU threads (default: OpenMP default)\n"
            "  --json         no streaming: at the end, one kvpq.chat/1 document on stdout, a row per turn\n"
            "                 (docs/json.md)\n"
            "  --quiet        no per-turn lines on stderr (tokens, tok/s, cache memory) and no progress\n"
            "  --render       print the conversation as the template renders it and exit, without running the\n"
            "                 model: stdin lines are the messages, user and assistant in turn, and the\n"
            "                 generation prompt ends it (transformers' apply_chat_template(...,\n"
            "                 add_generation_prompt=True)); --render-ids prints its token ids instead\n"
            "  --logits-out FILE  append the logits every token is sampled from (float32, n_vocab per row) to\n"
            "                 FILE (for tests: kvpq generate has the same option)\n");
}

static const char *const OPTS[] = {"--help", "-h", "--model", "-m", "--cache", "--system", "-n", "--n-predict",
                                   "--temp", "--top-p", "--seed", "--ctx", "--template", "--threads", "-t",
                                   "--json", "--quiet", "-q", "--render", "--render-ids", "--logits-out", NULL};

/* A growable byte buffer (a reply's text). */
typedef struct {
    char *b;
    size_t n, cap;
} buf_t;

static void buf_add(buf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = (b->n + n + 1) * 2;
        char *nb = realloc(b->b, cap);
        if (!nb) return; /* the text in the JSON row is cut; the chat goes on */
        b->b = nb;
        b->cap = cap;
    }
    memcpy(b->b + b->n, s, n);
    b->n += n;
    b->b[b->n] = '\0';
}

/* s (n bytes) as valid UTF-8: each byte of an invalid or truncated sequence becomes U+FFFD (a reply
 * cut inside a character, or a token of stray bytes); the JSON row needs valid UTF-8. */
static char *utf8_clean(const char *s, size_t n) {
    char *o = malloc(3 * n + 1);
    if (!o) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t bad = 0, l = 1;
        unsigned char c = (unsigned char)s[i];
        l = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
        if (l && i + l <= n && cli_utf8_valid((const unsigned char *)s + i, l, &bad)) {
            memcpy(o + k, s + i, l);
            k += l;
            i += l;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    o[k] = '\0';
    return o;
}

static cJSON *ids_json(const int32_t *t, size_t n) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber(t[i]));
    return a;
}

/* Read stdin lines: user, assistant, user, ...; print the rendered conversation (text or ids). */
static int render(const kvpq_model *m, const cli_chat_template *t, const char *system, int ids) {
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    cli_chat_pieces pc = {0};
    char **lines = NULL;
    size_t n_lines = 0, cap = 0, lcap = 0;
    char *line = NULL;
    ssize_t got;
    int rc = 1;
    while ((got = cli_read_message(&line, &lcap, stdin)) >= 0) {
        if (n_lines == cap) {
            char **nl = realloc(lines, (cap = cap ? 2 * cap : 16) * sizeof *nl);
            if (!nl) goto done;
            lines = nl;
        }
        if (!(lines[n_lines] = strdup(line))) goto done;
        n_lines++;
    }
    if (got == -2) goto done; /* a message too long or holding a NUL: reported */
    cli_chat_begin(t, &pc, system);
    for (size_t i = 0; i < n_lines; i++) {
        if (i % 2 == 0) {
            cli_chat_user(t, &pc, lines[i], i == 0, system);
        } else {
            cli_chat_assistant_open(t, &pc);
            cli_chat_assistant_text(t, &pc, lines[i]);
            cli_chat_assistant_close(t, &pc);
        }
    }
    cli_chat_assistant_open(t, &pc);
    if (ids) {
        int32_t *tok = NULL;
        size_t n = 0;
        kvpq_status s = cli_chat_tokenize(m, &pc, mi.add_bos, &tok, &n);
        if (s != KVPQ_OK) {
            cli_fail("chat: --render-ids", s);
            goto done;
        }
        for (size_t i = 0; i < n; i++) printf(i ? " %d" : "%d", tok[i]);
        printf("\n");
        free(tok);
    } else {
        char *txt = cli_chat_text(&pc);
        if (!txt) goto done;
        fputs(txt, stdout); /* the text as rendered, byte for byte (no newline added) */
        free(txt);
    }
    rc = 0;
done:
    if (rc && !ids) fprintf(stderr, "kvpq chat: --render: out of memory\n");
    for (size_t i = 0; i < n_lines; i++) free(lines[i]);
    free(lines);
    free(line);
    cli_chat_pieces_free(&pc);
    return rc;
}

int cmd_chat(int argc, char **argv) {
    const char *model_path = NULL, *cache_spec = "fp32", *system = NULL, *tmpl_name = NULL, *logits_out = NULL;
    long n_gen = 256, seed = 42, threads = 0, ctx = 0;
    double temp = 0.8, top_p = 0.95;
    int json = 0, render_mode = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!cli_option_known(a, OPTS)) return cli_unknown_option("chat", a, OPTS);
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
            continue;
        } else if (!strcmp(a, "--render")) {
            render_mode = 1;
            continue;
        } else if (!strcmp(a, "--render-ids")) {
            render_mode = 2;
            continue;
        }
        if (!v) return cli_usage_error("chat: option %s needs a value (see --help)", a);
        i++;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--cache")) cache_spec = v;
        else if (!strcmp(a, "--system")) system = v;
        else if (!strcmp(a, "--template")) tmpl_name = v;
        else if (!strcmp(a, "--logits-out")) logits_out = v;
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            if (!cli_parse_int(a, v, 1, 1 << 20, &n_gen)) return 2;
        } else if (!strcmp(a, "--seed")) {
            if (!cli_parse_int(a, v, 0, 0x7fffffffL, &seed)) return 2;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (!cli_parse_int(a, v, 0, 1024, &threads)) return 2;
        } else if (!strcmp(a, "--ctx")) {
            if (!cli_parse_int(a, v, 2, 1 << 24, &ctx)) return 2;
        } else if (!strcmp(a, "--temp")) {
            if (!cli_parse_double(a, v, 0, 100, &temp)) return 2;
        } else if (!strcmp(a, "--top-p")) {
            if (!cli_parse_double(a, v, 0, 1, &top_p)) return 2;
        } else
            return cli_usage_error("chat: unknown option '%s' (see --help)", a);
    }
    if (!model_path) return cli_usage_error("chat: --model is required (see --help)");
    size_t bad;
    if (system && !cli_utf8_valid((const unsigned char *)system, strlen(system), &bad))
        return cli_usage_error("chat: --system is not valid UTF-8 (byte %zu)", bad);
    if (cli_cache_spec_check(cache_spec)) return 2; /* before the model loads */

    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)threads;
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("chat", s);
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    cli_chat_template tmpl;
    const char *note = NULL;
    int rc = cli_chat_template_init(&tmpl, m, tmpl_name, "chat", &note);
    if (rc) {
        kvpq_model_free(m);
        return rc;
    }
    if (note && !cli_quiet) fprintf(stderr, "kvpq chat: %s\n", note);
    if (render_mode) {
        rc = render(m, &tmpl, system, render_mode == 2);
        kvpq_model_free(m);
        return rc;
    }
    rc = 1;
    if (ctx == 0 || ctx > mi.n_ctx_train) ctx = mi.n_ctx_train;

    cli_cache cc = {0};
    float *logits = malloc((size_t)mi.n_vocab * sizeof *logits), *work = malloc((size_t)mi.n_vocab * sizeof *work);
    int32_t *idx = malloc((size_t)mi.n_vocab * sizeof *idx), *reply = NULL;
    size_t reply_cap = 0;
    char *line = NULL;
    size_t lcap = 0;
    FILE *lf = NULL;
    cJSON *doc = NULL, *settings = NULL, *rows = NULL;
    buf_t text = {0};
    cli_chat_pieces pc = {0};
    if (!logits || !work || !idx) {
        fprintf(stderr, "kvpq chat: out of memory\n");
        goto done;
    }
    if (logits_out && !(lf = fopen(logits_out, "wb"))) {
        fprintf(stderr, "kvpq chat: --logits-out '%s': cannot write: ", logits_out);
        perror(NULL);
        goto done;
    }
    if (cli_cache_open(&cc, cache_spec, m, (int)ctx, (int)threads)) goto done;
    if (json) {
        doc = cli_json_new("chat", &settings, &rows);
        if (!doc) goto done;
        cJSON_AddStringToObject(settings, "model", model_path);
        cJSON_AddStringToObject(settings, "cache", cache_spec);
        cJSON_AddStringToObject(settings, "template", tmpl.name);
        const char *sys_used = system ? system : tmpl.form == CLI_CHAT_CHATML && tmpl.default_system[0] ? tmpl.default_system : NULL;
        if (sys_used) cJSON_AddStringToObject(settings, "system", sys_used);
        else cJSON_AddNullToObject(settings, "system");
        cJSON_AddNumberToObject(settings, "n_predict", (double)n_gen);
        cJSON_AddNumberToObject(settings, "temp", temp);
        cJSON_AddNumberToObject(settings, "top_p", top_p);
        cJSON_AddNumberToObject(settings, "seed", (double)seed);
        cJSON_AddNumberToObject(settings, "ctx", (double)ctx);
        cJSON_AddNumberToObject(settings, "threads", (double)threads);
        cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    }
    cli_rng rng;
    cli_rng_seed(&rng, (uint64_t)seed);
    const int tty_in = isatty(fileno(stdin));
    int first = 1, conversation = 1, turn = 0;
    char piece[256];
    for (;;) {
        if (tty_in && !json) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        ssize_t got = cli_read_message(&line, &lcap, stdin);
        if (got == -2) goto done; /* too long or holding a NUL: reported */
        if (got < 0) break;       /* end of input: the chat ends */
        const char *msg = line;
        if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) break;
        if (!strcmp(line, "/reset")) {
            if ((s = kvpq_cache_truncate(cc.cache, 0)) != KVPQ_OK) {
                cli_fail("chat: /reset", s);
                goto done;
            }
            first = 1;
            conversation++;
            if (!cli_quiet) fprintf(stderr, "kvpq chat: new conversation (cache emptied)\n");
            continue;
        }
        if (line[0] == '/' && line[1] == '/') msg = line + 1;
        else if (line[0] == '/') {
            fprintf(stderr, "kvpq chat: unknown command '");
            cli_fput_escaped(stderr, line, (size_t)got, 64);
            fprintf(stderr, "' (/reset, /exit; start a message with // to send a '/')\n");
            continue;
        }
        if (!msg[0]) continue;
        if (!cli_utf8_valid((const unsigned char *)msg, strlen(msg), &bad)) {
            fprintf(stderr, "kvpq chat: message not sent: not valid UTF-8 (byte %zu)\n", bad);
            continue;
        }
        /* This turn's new tokens: the previous reply's close, the user's message, the header. */
        pc.n = 0;
        if (first) cli_chat_begin(&tmpl, &pc, system);
        else cli_chat_assistant_close(&tmpl, &pc);
        cli_chat_user(&tmpl, &pc, msg, first, system);
        cli_chat_assistant_open(&tmpl, &pc);
        int32_t *toks = NULL;
        size_t n_new = 0;
        s = cli_chat_tokenize(m, &pc, first && mi.add_bos, &toks, &n_new);
        if (s != KVPQ_OK) {
            cli_fail("chat: message not sent", s);
            continue;
        }
        const int held = kvpq_cache_seq_len(cc.cache, 0);
        if ((long)held + (long)n_new + 1 > ctx) {
            fprintf(stderr,
                    "kvpq chat: message not sent: the conversation holds %d positions and this turn adds %zu; "
                    "the limit is %ld (--ctx; /reset starts a new conversation)\n",
                    held, n_new, ctx);
            free(toks);
            continue;
        }
        turn++;
        cli_progress pr;
        cli_progress_begin(&pr, "chat: prompt", "tokens", (double)n_new);
        double t0 = cli_now();
        for (size_t b = 0; b < n_new; b += PROMPT_BATCH) {
            int nb = (int)(n_new - b < PROMPT_BATCH ? n_new - b : PROMPT_BATCH);
            s = kvpq_model_eval(m, cc.cache, toks + b, nb, 0, logits);
            if (s != KVPQ_OK) break;
            cli_progress_update(&pr, (double)(b + (size_t)nb), NULL);
        }
        if (s != KVPQ_OK) {
            free(toks);
            cli_fail("chat: prompt eval", s);
            goto done;
        }
        cli_progress_end(&pr, (double)n_new, NULL);
        const double t_prompt = cli_now() - t0;
        first = 0;
        /* The reply: sample, stream, and append each token to the cache (the next turn builds on it). */
        cli_utf8_stream us = {{0}, 0};
        text.n = 0;
        if (text.b) text.b[0] = '\0';
        long n_reply = 0, n_sampled = 0;
        double t_dec = 0;
        const char *stop = "length";
        for (;;) {
            if (n_reply == n_gen) break;
            if (kvpq_cache_seq_len(cc.cache, 0) >= ctx) {
                stop = "context";
                break;
            }
            if (lf && fwrite(logits, sizeof *logits, (size_t)mi.n_vocab, lf) != (size_t)mi.n_vocab) {
                fprintf(stderr, "kvpq chat: --logits-out '%s': write failed\n", logits_out);
                free(toks);
                goto done;
            }
            int32_t t = cli_sample(logits, mi.n_vocab, (float)temp, (float)top_p, &rng, work, idx);
            n_sampled++;
            if (t == tmpl.end_id || t == mi.eos_id || (kvpq_token_attr(m, t) & KVPQ_TOKEN_ATTR_CONTROL)) {
                stop = t == tmpl.end_id ? "end_of_turn" : t == mi.eos_id ? "eos" : "control";
                break;
            }
            size_t len = 0;
            if ((s = kvpq_token_to_piece(m, t, piece, sizeof piece, &len)) != KVPQ_OK) {
                free(toks);
                cli_fail("chat: token_to_piece", s);
                goto done;
            }
            if (len > sizeof piece) len = sizeof piece;
            if (!json) cli_utf8_write(&us, stdout, piece, len);
            buf_add(&text, piece, len);
            if ((size_t)n_reply == reply_cap) {
                int32_t *nr = realloc(reply, (reply_cap = reply_cap ? 2 * reply_cap : 256) * sizeof *nr);
                if (!nr) {
                    free(toks);
                    fprintf(stderr, "kvpq chat: out of memory\n");
                    goto done;
                }
                reply = nr;
            }
            reply[n_reply++] = t;
            t0 = cli_now();
            s = kvpq_model_eval(m, cc.cache, &t, 1, 0, logits);
            t_dec += cli_now() - t0;
            if (s != KVPQ_OK) {
                free(toks);
                cli_fail("chat: eval", s);
                goto done;
            }
        }
        if (!json) {
            cli_utf8_flush(&us, stdout);
            fputc('\n', stdout);
            fflush(stdout);
        }
        kvpq_cache_stats cst;
        kvpq_cache_get_stats(cc.cache, &cst);
        if (!cli_quiet) {
            fprintf(stderr,
                    "kvpq chat: turn %d: prompt %zu new tokens in %.3f s (%.1f tok/s); reply %ld tokens in %.3f s "
                    "(%.1f tok/s), ended by %s\n",
                    turn, n_new, t_prompt, n_new / (t_prompt > 0 ? t_prompt : 1e-9), n_reply, t_dec,
                    n_reply / (t_dec > 0 ? t_dec : 1e-9), stop);
            cli_print_cache_memory("chat", cache_spec, cc.cache, &cst);
        }
        if (json) {
            cJSON *r = cJSON_CreateObject();
            char *clean = utf8_clean(text.b ? text.b : "", text.n);
            if (!r || !clean) {
                free(clean);
                cJSON_Delete(r);
                free(toks);
                fprintf(stderr, "kvpq chat: out of memory\n");
                goto done;
            }
            cJSON_AddNumberToObject(r, "conversation", conversation);
            cJSON_AddNumberToObject(r, "turn", turn);
            cJSON_AddNumberToObject(r, "prompt_tokens", (double)n_new);
            cJSON_AddNumberToObject(r, "prompt_s", t_prompt);
            cli_json_num(r, "prompt_tok_per_s", n_new / t_prompt);
            cJSON_AddNumberToObject(r, "reply_tokens", (double)n_reply);
            cJSON_AddNumberToObject(r, "sampled", (double)n_sampled);
            cJSON_AddNumberToObject(r, "reply_s", t_dec);
            cli_json_num(r, "reply_tok_per_s", n_reply ? n_reply / t_dec : 0);
            cJSON_AddStringToObject(r, "stop", stop);
            cJSON_AddNumberToObject(r, "positions", kvpq_cache_seq_len(cc.cache, 0));
            cJSON_AddNumberToObject(r, "stored_bytes", (double)cst.stored_bytes);
            cli_json_num(r, "stored_bits_per_element", cst.stored_bits_per_element);
            cJSON_AddNumberToObject(r, "resident_bytes", (double)cst.resident_bytes);
            cli_json_num(r, "bits_per_element", cst.bits_per_element);
            cJSON_AddStringToObject(r, "reply", clean);
            cJSON_AddItemToObject(r, "prompt_ids", ids_json(toks, n_new));
            cJSON_AddItemToObject(r, "reply_ids", ids_json(reply, (size_t)n_reply));
            cJSON_AddItemToArray(rows, r);
            free(clean);
        }
        free(toks);
    }
    if (ferror(stdin)) {
        perror("kvpq chat: reading stdin");
        goto done;
    }
    if (lf && fclose(lf) != 0) {
        lf = NULL;
        fprintf(stderr, "kvpq chat: --logits-out '%s': write failed\n", logits_out);
        goto done;
    }
    lf = NULL;
    rc = 0;
    if (json) {
        rc = cli_json_print(doc);
        doc = NULL;
    }
done:
    if (lf) fclose(lf);
    cJSON_Delete(doc);
    cli_chat_pieces_free(&pc);
    cli_cache_close(&cc);
    free(text.b);
    free(reply);
    free(line);
    free(logits);
    free(work);
    free(idx);
    kvpq_model_free(m);
    return rc;
}
