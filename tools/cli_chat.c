/* cli_chat.c — chat templates (cli_chat.h): ChatML and Gemma, rendered as pieces and tokenized with
 * user text kept plain. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_chat.h"

/* The one CONTROL token a control text stands for, or -1. */
static int32_t control_id(const kvpq_model *m, const char *text) {
    int32_t id[2];
    size_t n = 0;
    if (kvpq_tokenize(m, text, strlen(text), 0, 1, id, 2, &n) != KVPQ_OK || n != 1) return -1;
    return (kvpq_token_attr(m, id[0]) & KVPQ_TOKEN_ATTR_CONTROL) ? id[0] : -1;
}

/* ChatML's default system message: the first "<|im_start|>system" followed by a newline (written
 * out, or as the two characters \n inside a Jinja string: Qwen2.5) whose text up to "<|im_end|>" is
 * literal (no expression '{', no string end '\''). "" when there is none. */
static void chatml_default_system(const char *tmpl, char *out, size_t cap) {
    static const char head[] = "<|im_start|>system";
    out[0] = '\0';
    for (const char *p = strstr(tmpl, head); p; p = strstr(p + 1, head)) {
        const char *b = p + strlen(head);
        if (*b == '\n') b++;
        else if (b[0] == '\\' && b[1] == 'n') b += 2;
        else continue;
        const char *e = strstr(b, "<|im_end|>");
        if (!e || e == b || memchr(b, '{', (size_t)(e - b)) || memchr(b, '\'', (size_t)(e - b))) continue;
        size_t k = 0;
        for (const char *q = b; q < e && k + 1 < cap; q++) {
            if (q[0] == '\\' && q + 1 < e && q[1] == 'n') { /* an escaped newline of a Jinja string */
                out[k++] = '\n';
                q++;
            } else {
                out[k++] = *q;
            }
        }
        out[k] = '\0';
        return;
    }
}

int cli_chat_template_init(cli_chat_template *t, const kvpq_model *m, const char *force, const char *cmd,
                           const char **note) {
    memset(t, 0, sizeof *t);
    if (note) *note = NULL;
    const char *tmpl = kvpq_model_chat_template(m);
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    if (force && !strcmp(force, "auto")) force = NULL;
    if (force && strcmp(force, "chatml") && strcmp(force, "gemma")) {
        fprintf(stderr, "kvpq %s: --template '%s': expected chatml, gemma or auto\n", cmd, force);
        return 2;
    }
    if (force) {
        t->form = !strcmp(force, "chatml") ? CLI_CHAT_CHATML : CLI_CHAT_GEMMA;
    } else if (tmpl && strstr(tmpl, "<|im_start|>")) {
        t->form = CLI_CHAT_CHATML;
    } else if (tmpl && strstr(tmpl, "<start_of_turn>")) {
        t->form = CLI_CHAT_GEMMA;
    } else if (!tmpl && !strcmp(mi.arch, "gemma3")) {
        t->form = CLI_CHAT_GEMMA;
        if (note) *note = "the model file has no chat template (tokenizer.chat_template); using Gemma's turn format "
                          "for architecture gemma3 (--template chooses another)";
    } else {
        fprintf(stderr,
                "kvpq %s: the model's chat template is %s; the forms implemented are ChatML and Gemma "
                "(--template chatml|gemma uses one anyway)\n",
                cmd, tmpl ? "of another form" : "missing (no tokenizer.chat_template)");
        return 1;
    }
    if (t->form == CLI_CHAT_CHATML) {
        t->name = "chatml";
        t->start = "<|im_start|>";
        t->end = "<|im_end|>";
        t->assistant_role = "assistant";
        if (tmpl) chatml_default_system(tmpl, t->default_system, sizeof t->default_system);
    } else {
        t->name = "gemma";
        t->start = "<start_of_turn>";
        t->end = "<end_of_turn>";
        t->assistant_role = "model";
    }
    t->start_id = control_id(m, t->start);
    t->end_id = control_id(m, t->end);
    if (t->start_id < 0 || t->end_id < 0) {
        fprintf(stderr, "kvpq %s: %s template: '%s' is not one control token of this model's vocabulary\n", cmd,
                t->name, t->start_id < 0 ? t->start : t->end);
        return 1;
    }
    return 0;
}

/* ---- pieces ---- */

void cli_chat_pieces_free(cli_chat_pieces *c) {
    free(c->p);
    memset(c, 0, sizeof *c);
}

static void add(cli_chat_pieces *c, const char *text, size_t len, int control) {
    if (c->n == c->cap) {
        int cap = c->cap ? 2 * c->cap : 16;
        void *np = realloc(c->p, (size_t)cap * sizeof *c->p);
        if (!np) {
            c->oom = 1;
            return;
        }
        c->p = np;
        c->cap = cap;
    }
    c->p[c->n].text = text;
    c->p[c->n].len = len;
    c->p[c->n++].control = control;
}

static void text(cli_chat_pieces *c, const char *s) { add(c, s, strlen(s), 0); }
static void ctl(cli_chat_pieces *c, const char *s) { add(c, s, strlen(s), 1); }

/* s without leading and trailing ASCII whitespace (Jinja's trim): into c as plain text. */
static void text_trimmed(cli_chat_pieces *c, const char *s) {
    static const char ws[] = " \t\n\r\v\f";
    s += strspn(s, ws);
    size_t n = strlen(s);
    while (n && strchr(ws, s[n - 1])) n--;
    add(c, s, n, 0);
}

void cli_chat_begin(const cli_chat_template *t, cli_chat_pieces *c, const char *system) {
    if (t->form != CLI_CHAT_CHATML) return;
    const char *sys = system ? system : t->default_system[0] ? t->default_system : NULL;
    if (!sys) return;
    ctl(c, t->start);
    text(c, "system\n");
    text(c, sys);
    ctl(c, t->end);
    text(c, "\n");
}

void cli_chat_user(const cli_chat_template *t, cli_chat_pieces *c, const char *user, int first, const char *system) {
    ctl(c, t->start);
    text(c, "user\n");
    if (t->form == CLI_CHAT_GEMMA) {
        if (first && system) {
            text(c, system); /* as the template: the system text untrimmed, the messages trimmed */
            text(c, "\n\n");
        }
        text_trimmed(c, user);
    } else {
        text(c, user);
    }
    ctl(c, t->end);
    text(c, "\n");
}

void cli_chat_assistant_open(const cli_chat_template *t, cli_chat_pieces *c) {
    ctl(c, t->start);
    text(c, t->assistant_role);
    text(c, "\n");
}

void cli_chat_assistant_text(const cli_chat_template *t, cli_chat_pieces *c, const char *s) {
    if (t->form == CLI_CHAT_GEMMA) text_trimmed(c, s);
    else text(c, s);
}

void cli_chat_user_plain(cli_chat_pieces *c, const char *s) { text(c, s); }

void cli_chat_assistant_close(const cli_chat_template *t, cli_chat_pieces *c) {
    ctl(c, t->end);
    text(c, "\n");
}

/* ---- tokenization ---- */

/* Tokenize one segment into t[at..] (t NULL: count only). */
static kvpq_status seg(const kvpq_model *m, const char *s, size_t len, int bos, int special, int32_t *t, size_t cap,
                       size_t *at) {
    size_t n = 0;
    kvpq_status st = kvpq_tokenize(m, s, len, bos, special, t ? t + *at : NULL, t ? cap - *at : 0, &n);
    if (st == KVPQ_OK) *at += n;
    return st;
}

/* Two passes (count, then fill): each control piece alone with special parsing, each run of
 * plain pieces joined into one string without it. */
#define TRY(x)                                                                                                 \
    do {                                                                                                       \
        kvpq_status s_ = (x);                                                                                  \
        if (s_ != KVPQ_OK) return s_;                                                                          \
    } while (0)

static kvpq_status run(const kvpq_model *m, const cli_chat_pieces *c, int add_bos, int32_t *t, size_t cap,
                       size_t *n_out, char *joined) {
    size_t at = 0;
    int bos = add_bos;
    if (bos && c->n == 0) TRY(seg(m, "", 0, 1, 0, t, cap, &at));
    for (int i = 0; i < c->n;) {
        if (c->p[i].control) {
            TRY(seg(m, c->p[i].text, c->p[i].len, bos, 1, t, cap, &at));
            bos = 0;
            i++;
            continue;
        }
        size_t jl = 0;
        for (; i < c->n && !c->p[i].control; i++) {
            memcpy(joined + jl, c->p[i].text, c->p[i].len);
            jl += c->p[i].len;
        }
        TRY(seg(m, joined, jl, bos, 0, t, cap, &at));
        bos = 0;
    }
    *n_out = at;
    return KVPQ_OK;
}

kvpq_status cli_chat_tokenize(const kvpq_model *m, const cli_chat_pieces *c, int add_bos, int32_t **out, size_t *n) {
    *out = NULL;
    *n = 0;
    if (c->oom) return KVPQ_ERR_NOMEM;
    size_t total = 1;
    for (int i = 0; i < c->n; i++) total += c->p[i].len;
    char *joined = malloc(total);
    if (!joined) return KVPQ_ERR_NOMEM;
    size_t count = 0;
    kvpq_status s = run(m, c, add_bos, NULL, 0, &count, joined);
    int32_t *t = s == KVPQ_OK ? malloc((count ? count : 1) * sizeof *t) : NULL;
    if (s == KVPQ_OK && !t) s = KVPQ_ERR_NOMEM;
    if (s == KVPQ_OK) s = run(m, c, add_bos, t, count, n, joined);
    free(joined);
    if (s != KVPQ_OK) {
        free(t);
        *n = 0;
        return s;
    }
    *out = t;
    return KVPQ_OK;
}

char *cli_chat_text(const cli_chat_pieces *c) {
    size_t total = 1;
    for (int i = 0; i < c->n; i++) total += c->p[i].len;
    char *s = malloc(total);
    if (!s) return NULL;
    size_t at = 0;
    for (int i = 0; i < c->n; i++) {
        memcpy(s + at, c->p[i].text, c->p[i].len);
        at += c->p[i].len;
    }
    s[at] = '\0';
    return s;
}
