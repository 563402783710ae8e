/* cmd_chat.c — `kvpq chat`: a multi-turn conversation read from stdin, in the model's chat template,
 * with one KV cache kept across turns: each turn prefills only its own new tokens (the previous
 * reply's closing tokens, the user's message, the assistant header) on top of what the cache holds,
 * coded as the cache codes them (a vq or kivi cache holds the conversation as codes). */
#include <stddef.h>
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

// ---- the command line ---------------------------------------------------------------------------

typedef struct {
    const char *model_path, *cache_spec, *system, *tmpl_name, *logits_out;
    long n_gen, seed, threads, ctx; /* ctx 0: the model's context length */
    double temp, top_p;
    int json, render, render_ids;   /* --render-ids wins over --render */
} chat_opts;

#define F(field) offsetof(chat_opts, field)
static const cli_opt OPTS[] = {
    {"--json", NULL, CLI_OPT_FLAG, F(json), 0, 0},
    {"--quiet", "-q", CLI_OPT_QUIET, 0, 0, 0},
    {"--render", NULL, CLI_OPT_FLAG, F(render), 0, 0},
    {"--render-ids", NULL, CLI_OPT_FLAG, F(render_ids), 0, 0},
    {"--model", "-m", CLI_OPT_STR, F(model_path), 0, 0},
    {"--cache", NULL, CLI_OPT_STR, F(cache_spec), 0, 0},
    {"--system", NULL, CLI_OPT_STR, F(system), 0, 0},
    {"--template", NULL, CLI_OPT_STR, F(tmpl_name), 0, 0},
    {"--logits-out", NULL, CLI_OPT_STR, F(logits_out), 0, 0},
    {"--n-predict", "-n", CLI_OPT_LONG, F(n_gen), 1, 1 << 20},
    {"--seed", NULL, CLI_OPT_LONG, F(seed), 0, 0x7fffffffL},
    {"--threads", "-t", CLI_OPT_LONG, F(threads), 0, 1024},
    {"--ctx", NULL, CLI_OPT_LONG, F(ctx), 2, 1 << 24},
    {"--temp", NULL, CLI_OPT_DOUBLE, F(temp), 0, 100},
    {"--top-p", NULL, CLI_OPT_DOUBLE, F(top_p), 0, 1},
    {NULL, NULL, 0, 0, 0, 0},
};
#undef F

/* argv into *o, checked as far as it can be without the model: -1 to go on, else the exit code
 * (0 after --help). */
static int parse_opts(int argc, char **argv, chat_opts *o) {
    *o = (chat_opts){.cache_spec = "fp32", .n_gen = 256, .seed = 42, .temp = 0.8, .top_p = 0.95};
    int rc = cli_parse_options("chat", argc, argv, OPTS, o, usage);
    if (rc >= 0) return rc;
    if (!o->model_path) return cli_usage_error("chat: --model is required (see --help)");
    size_t bad;
    if (o->system && !cli_utf8_valid((const unsigned char *)o->system, strlen(o->system), &bad))
        return cli_usage_error("chat: --system is not valid UTF-8 (byte %zu)", bad);
    if (cli_cache_spec_check(o->cache_spec)) return 2; /* before the model loads */
    return -1;
}

// ---- a chat: the model, its cache and what every turn reuses ------------------------------------

typedef struct {
    const chat_opts *o;
    kvpq_model *m;
    kvpq_model_info mi;
    cli_chat_template tmpl;
    cli_cache cc;
    float *logits, *work;         /* (n_vocab) */
    int32_t *idx;                 /* (n_vocab) */
    int32_t *reply;               /* (reply_cap) this turn's reply token ids */
    size_t reply_cap;
    buf_t text;                   /* this turn's reply text */
    FILE *lf;                     /* --logits-out, or NULL */
    cJSON *doc, *rows;            /* --json: the document and its results array */
    cli_chat_pieces pc;           /* this turn's new pieces */
    cli_rng rng;
    int first, conversation, turn; /* first: the cache holds no turn yet */
} chat_state;

/* One turn: its new tokens, its reply and their times. */
typedef struct {
    int32_t *toks; /* (n_new) the prompt's new tokens */
    size_t n_new;
    double t_prompt, t_dec;
    long n_reply, n_sampled;
    const char *stop; /* why the reply ended */
} chat_turn;

/* The JSON document's settings: the options as the chat runs them. */
static int json_open(chat_state *st) {
    const chat_opts *o = st->o;
    cJSON *settings = NULL;
    if (!(st->doc = cli_json_new("chat", &settings, &st->rows))) return 1;
    cJSON_AddStringToObject(settings, "model", o->model_path);
    cJSON_AddStringToObject(settings, "cache", o->cache_spec);
    cJSON_AddStringToObject(settings, "template", st->tmpl.name);
    const char *sys_used = o->system;
    if (!sys_used && st->tmpl.form == CLI_CHAT_CHATML && st->tmpl.default_system[0]) sys_used = st->tmpl.default_system;
    if (sys_used) cJSON_AddStringToObject(settings, "system", sys_used);
    else cJSON_AddNullToObject(settings, "system");
    cJSON_AddNumberToObject(settings, "n_predict", (double)o->n_gen);
    cJSON_AddNumberToObject(settings, "temp", o->temp);
    cJSON_AddNumberToObject(settings, "top_p", o->top_p);
    cJSON_AddNumberToObject(settings, "seed", (double)o->seed);
    cJSON_AddNumberToObject(settings, "ctx", (double)o->ctx);
    cJSON_AddNumberToObject(settings, "threads", (double)o->threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    return 0;
}

/* Buffers, --logits-out, the cache and the JSON document: 0, or 1 (message printed). */
static int chat_open(chat_state *st) {
    const chat_opts *o = st->o;
    const size_t nv = (size_t)st->mi.n_vocab;
    st->logits = malloc(nv * sizeof *st->logits);
    st->work = malloc(nv * sizeof *st->work);
    st->idx = malloc(nv * sizeof *st->idx);
    if (!st->logits || !st->work || !st->idx) {
        fprintf(stderr, "kvpq chat: out of memory\n");
        return 1;
    }
    if (o->logits_out && !(st->lf = fopen(o->logits_out, "wb"))) {
        fprintf(stderr, "kvpq chat: --logits-out '%s': cannot write: ", o->logits_out);
        perror(NULL);
        return 1;
    }
    if (cli_cache_open(&st->cc, o->cache_spec, st->m, (int)o->ctx, (int)o->threads)) return 1;
    if (o->json && json_open(st)) return 1;
    cli_rng_seed(&st->rng, (uint64_t)o->seed);
    st->first = 1;
    st->conversation = 1;
    return 0;
}

static void chat_close(chat_state *st) {
    if (st->lf) fclose(st->lf);
    cJSON_Delete(st->doc);
    cli_chat_pieces_free(&st->pc);
    cli_cache_close(&st->cc);
    free(st->text.b);
    free(st->reply);
    free(st->logits);
    free(st->work);
    free(st->idx);
}

// ---- one turn ------------------------------------------------------------------------------------

enum { LINE_SEND, LINE_SKIP, LINE_END, LINE_FAIL };

/* What a line of stdin asks for: a message to send (*msg), a command done here (/reset), or the end
 * (/exit, /quit). got: the line's length. */
static int line_kind(chat_state *st, const char *line, ssize_t got, const char **msg) {
    *msg = line;
    if (!strcmp(line, "/exit") || !strcmp(line, "/quit")) return LINE_END;
    if (!strcmp(line, "/reset")) {
        kvpq_status s = kvpq_cache_truncate(st->cc.cache, 0);
        if (s != KVPQ_OK) {
            cli_fail("chat: /reset", s);
            return LINE_FAIL;
        }
        st->first = 1;
        st->conversation++;
        if (!cli_quiet) fprintf(stderr, "kvpq chat: new conversation (cache emptied)\n");
        return LINE_SKIP;
    }
    if (line[0] == '/' && line[1] == '/') *msg = line + 1;
    else if (line[0] == '/') {
        fprintf(stderr, "kvpq chat: unknown command '");
        cli_fput_escaped(stderr, line, (size_t)got, 64);
        fprintf(stderr, "' (/reset, /exit; start a message with // to send a '/')\n");
        return LINE_SKIP;
    }
    if (!(*msg)[0]) return LINE_SKIP;
    size_t bad;
    if (!cli_utf8_valid((const unsigned char *)*msg, strlen(*msg), &bad)) {
        fprintf(stderr, "kvpq chat: message not sent: not valid UTF-8 (byte %zu)\n", bad);
        return LINE_SKIP;
    }
    return LINE_SEND;
}

/* This turn's new tokens (the previous reply's close, the user's message, the assistant header)
 * into tr->toks, checked against --ctx: LINE_SEND, or LINE_SKIP (message printed). */
static int turn_tokens(chat_state *st, const char *msg, chat_turn *tr) {
    st->pc.n = 0;
    if (st->first) cli_chat_begin(&st->tmpl, &st->pc, st->o->system);
    else cli_chat_assistant_close(&st->tmpl, &st->pc);
    cli_chat_user(&st->tmpl, &st->pc, msg, st->first, st->o->system);
    cli_chat_assistant_open(&st->tmpl, &st->pc);
    kvpq_status s = cli_chat_tokenize(st->m, &st->pc, st->first && st->mi.add_bos, &tr->toks, &tr->n_new);
    if (s != KVPQ_OK) {
        cli_fail("chat: message not sent", s);
        return LINE_SKIP;
    }
    const int held = kvpq_cache_seq_len(st->cc.cache, 0);
    if ((long)held + (long)tr->n_new + 1 > st->o->ctx) {
        fprintf(stderr,
                "kvpq chat: message not sent: the conversation holds %d positions and this turn adds %zu; "
                "the limit is %ld (--ctx; /reset starts a new conversation)\n",
                held, tr->n_new, st->o->ctx);
        return LINE_SKIP;
    }
    return LINE_SEND;
}

/* Evaluate the turn's new tokens on top of the cache, in batches: 0, or 1 (message printed). */
static int turn_prefill(chat_state *st, chat_turn *tr) {
    cli_progress pr;
    kvpq_status s = KVPQ_OK;
    cli_progress_begin(&pr, "chat: prompt", "tokens", (double)tr->n_new);
    double t0 = cli_now();
    for (size_t b = 0; b < tr->n_new; b += PROMPT_BATCH) {
        int nb = (int)(tr->n_new - b < PROMPT_BATCH ? tr->n_new - b : PROMPT_BATCH);
        s = kvpq_model_eval(st->m, st->cc.cache, tr->toks + b, nb, 0, st->logits);
        if (s != KVPQ_OK) break;
        cli_progress_update(&pr, (double)(b + (size_t)nb), NULL);
    }
    if (s != KVPQ_OK) return cli_fail("chat: prompt eval", s);
    cli_progress_end(&pr, (double)tr->n_new, NULL);
    tr->t_prompt = cli_now() - t0;
    st->first = 0;
    return 0;
}

/* Keep token t of the reply (its id and its text): 0, or 1 (message printed). */
static int reply_keep(chat_state *st, const chat_turn *tr, int32_t t, cli_utf8_stream *us) {
    char piece[256];
    size_t len = 0;
    kvpq_status s = kvpq_token_to_piece(st->m, t, piece, sizeof piece, &len);
    if (s != KVPQ_OK) return cli_fail("chat: token_to_piece", s);
    if (len > sizeof piece) len = sizeof piece;
    if (!st->o->json) cli_utf8_write(us, stdout, piece, len);
    buf_add(&st->text, piece, len);
    if ((size_t)tr->n_reply == st->reply_cap) {
        int32_t *nr = realloc(st->reply, (st->reply_cap = st->reply_cap ? 2 * st->reply_cap : 256) * sizeof *nr);
        if (!nr) {
            fprintf(stderr, "kvpq chat: out of memory\n");
            return 1;
        }
        st->reply = nr;
    }
    st->reply[tr->n_reply] = t;
    return 0;
}

/* The reply: sample, stream, and append each token to the cache (the next turn builds on it), up
 * to -n tokens, the context's end or a control token: 0, or 1 (message printed). */
static int turn_reply(chat_state *st, chat_turn *tr) {
    const chat_opts *o = st->o;
    const size_t nv = (size_t)st->mi.n_vocab;
    cli_utf8_stream us = {{0}, 0};
    st->text.n = 0;
    if (st->text.b) st->text.b[0] = '\0';
    tr->stop = "length";
    while (tr->n_reply < o->n_gen) {
        if (kvpq_cache_seq_len(st->cc.cache, 0) >= o->ctx) {
            tr->stop = "context";
            break;
        }
        if (st->lf && fwrite(st->logits, sizeof *st->logits, nv, st->lf) != nv) {
            fprintf(stderr, "kvpq chat: --logits-out '%s': write failed\n", o->logits_out);
            return 1;
        }
        int32_t t = cli_sample(st->logits, st->mi.n_vocab, (float)o->temp, (float)o->top_p, &st->rng, st->work, st->idx);
        tr->n_sampled++;
        if (t == st->tmpl.end_id || t == st->mi.eos_id || (kvpq_token_attr(st->m, t) & KVPQ_TOKEN_ATTR_CONTROL)) {
            tr->stop = t == st->tmpl.end_id ? "end_of_turn" : t == st->mi.eos_id ? "eos" : "control";
            break;
        }
        if (reply_keep(st, tr, t, &us)) return 1;
        tr->n_reply++;
        double t0 = cli_now();
        kvpq_status s = kvpq_model_eval(st->m, st->cc.cache, &t, 1, 0, st->logits);
        tr->t_dec += cli_now() - t0;
        if (s != KVPQ_OK) return cli_fail("chat: eval", s);
    }
    if (!o->json) {
        cli_utf8_flush(&us, stdout);
        fputc('\n', stdout);
        fflush(stdout);
    }
    return 0;
}

/* The turn's row of the JSON document: 0, or 1 (out of memory, message printed). */
static int turn_json(chat_state *st, const chat_turn *tr, const kvpq_cache_stats *cst) {
    cJSON *r = cJSON_CreateObject();
    char *clean = cli_utf8_clean(st->text.b ? st->text.b : "", st->text.n);
    if (!r || !clean) {
        free(clean);
        cJSON_Delete(r);
        fprintf(stderr, "kvpq chat: out of memory\n");
        return 1;
    }
    cJSON_AddNumberToObject(r, "conversation", st->conversation);
    cJSON_AddNumberToObject(r, "turn", st->turn);
    cJSON_AddNumberToObject(r, "prompt_tokens", (double)tr->n_new);
    cJSON_AddNumberToObject(r, "prompt_s", tr->t_prompt);
    cli_json_num(r, "prompt_tok_per_s", tr->n_new / tr->t_prompt);
    cJSON_AddNumberToObject(r, "reply_tokens", (double)tr->n_reply);
    cJSON_AddNumberToObject(r, "sampled", (double)tr->n_sampled);
    cJSON_AddNumberToObject(r, "reply_s", tr->t_dec);
    cli_json_num(r, "reply_tok_per_s", tr->n_reply ? tr->n_reply / tr->t_dec : 0);
    cJSON_AddStringToObject(r, "stop", tr->stop);
    cJSON_AddNumberToObject(r, "positions", kvpq_cache_seq_len(st->cc.cache, 0));
    cJSON_AddNumberToObject(r, "stored_bytes", (double)cst->stored_bytes);
    cli_json_num(r, "stored_bits_per_element", cst->stored_bits_per_element);
    cJSON_AddNumberToObject(r, "resident_bytes", (double)cst->resident_bytes);
    cli_json_num(r, "bits_per_element", cst->bits_per_element);
    cJSON_AddStringToObject(r, "reply", clean);
    cJSON_AddItemToObject(r, "prompt_ids", cli_json_ids(tr->toks, tr->n_new));
    cJSON_AddItemToObject(r, "reply_ids", cli_json_ids(st->reply, (size_t)tr->n_reply));
    cJSON_AddItemToArray(st->rows, r);
    free(clean);
    return 0;
}

/* A turn that was sent: prefill, reply, then its line on stderr and its JSON row. */
static int turn_run(chat_state *st, chat_turn *tr) {
    st->turn++;
    if (turn_prefill(st, tr) || turn_reply(st, tr)) return 1;
    kvpq_cache_stats cst;
    kvpq_cache_get_stats(st->cc.cache, &cst);
    if (!cli_quiet) {
        fprintf(stderr,
                "kvpq chat: turn %d: prompt %zu new tokens in %.3f s (%.1f tok/s); reply %ld tokens in %.3f s "
                "(%.1f tok/s), ended by %s\n",
                st->turn, tr->n_new, tr->t_prompt, tr->n_new / (tr->t_prompt > 0 ? tr->t_prompt : 1e-9), tr->n_reply,
                tr->t_dec, tr->n_reply / (tr->t_dec > 0 ? tr->t_dec : 1e-9), tr->stop);
        cli_print_cache_memory("chat", st->o->cache_spec, st->cc.cache, &cst);
    }
    return st->o->json ? turn_json(st, tr, &cst) : 0;
}

// ---- the conversation ----------------------------------------------------------------------------

/* Turns until the end of stdin or /exit, then --logits-out closed and the JSON printed: the exit
 * code. */
static int chat_run(chat_state *st) {
    const int tty_in = isatty(fileno(stdin));
    char *line = NULL;
    size_t lcap = 0;
    int rc = 1;
    for (;;) {
        if (tty_in && !st->o->json) {
            fputs("> ", stderr);
            fflush(stderr);
        }
        ssize_t got = cli_read_message(&line, &lcap, stdin);
        if (got == -2) goto done; /* too long or holding a NUL: reported */
        if (got < 0) break;       /* end of input: the chat ends */
        const char *msg;
        const int kind = line_kind(st, line, got, &msg);
        if (kind == LINE_FAIL) goto done;
        if (kind == LINE_END) break;
        if (kind == LINE_SKIP) continue;
        chat_turn tr = {0};
        if (turn_tokens(st, msg, &tr) == LINE_SEND && turn_run(st, &tr)) {
            free(tr.toks);
            goto done;
        }
        free(tr.toks);
    }
    if (ferror(stdin)) {
        perror("kvpq chat: reading stdin");
        goto done;
    }
    FILE *lf = st->lf;
    st->lf = NULL;
    if (lf && fclose(lf) != 0) {
        fprintf(stderr, "kvpq chat: --logits-out '%s': write failed\n", st->o->logits_out);
        goto done;
    }
    rc = 0;
    if (st->o->json) {
        rc = cli_json_print(st->doc);
        st->doc = NULL;
    }
done:
    free(line);
    return rc;
}

int cmd_chat(int argc, char **argv) {
    chat_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0) return rc;
    chat_state st = {.o = &o};
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)o.threads;
    kvpq_status s = kvpq_model_load(&st.m, o.model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("chat", s);
    kvpq_model_get_info(st.m, &st.mi);
    const char *note = NULL;
    rc = cli_chat_template_init(&st.tmpl, st.m, o.tmpl_name, "chat", &note);
    if (!rc) {
        if (note && !cli_quiet) fprintf(stderr, "kvpq chat: %s\n", note);
        if (o.render || o.render_ids) {
            rc = render(st.m, &st.tmpl, o.system, o.render_ids);
        } else {
            if (o.ctx == 0 || o.ctx > st.mi.n_ctx_train) o.ctx = st.mi.n_ctx_train;
            rc = chat_open(&st) ? 1 : chat_run(&st);
            chat_close(&st);
        }
    }
    kvpq_model_free(st.m);
    return rc;
}
