/* cli_chat.h — chat templates for `kvpq chat` and `generate --chat`: a conversation rendered as
 * pieces (control-token texts and plain text) and tokenized so that text a user typed never becomes
 * a control token (issue 14, prompt injection).
 *
 * Two template forms are implemented, chosen from the GGUF's tokenizer.chat_template (a Jinja
 * string, which kvpq does not evaluate; it recognizes the form):
 *   - ChatML (SmolLM2, Qwen2.5; the template holds "<|im_start|>"):
 *       <|im_start|>system\nSYSTEM<|im_end|>\n<|im_start|>user\nUSER<|im_end|>\n<|im_start|>assistant\n
 *     The system turn is written when --system is given, else the template's default system message
 *     when it has one (the text the template writes after "<|im_start|>system\n" outside any
 *     expression: SmolLM2 and Qwen2.5 have one), else none.
 *   - Gemma (the template holds "<start_of_turn>", or the model's architecture is gemma3 and the
 *     file has no template, as gemma-3-270m):
 *       <bos><start_of_turn>user\nSYSTEM\n\nUSER<end_of_turn>\n<start_of_turn>model\n
 *     The system text is put in front of the first user turn (Gemma has no system role); message
 *     text is trimmed of leading and trailing whitespace (the template's `| trim`; ASCII whitespace).
 * An assistant reply is closed by the turn-end control token and "\n" in both forms.
 *
 * Tokenization (cli_chat_tokenize): each control-token text of the template becomes its one CONTROL
 * token; the text between two of them (template text and message text joined, as a Jinja render
 * would join them) is tokenized with special-token parsing off. The ids are those of tokenizing the
 * rendered string with special tokens parsed (as transformers' apply_chat_template and llama.cpp
 * do) whenever the messages hold no control-token text; when they do, that text stays plain text. */
#ifndef KVPQ_CLI_CHAT_H
#define KVPQ_CLI_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq_model.h"

typedef enum { CLI_CHAT_CHATML = 1, CLI_CHAT_GEMMA = 2 } cli_chat_form;

typedef struct {
    cli_chat_form form;
    const char *name;           /* "chatml" or "gemma" */
    char default_system[1024];  /* ChatML: the template's default system message ("" when none) */
    const char *start, *end;    /* control texts opening and closing a turn */
    int32_t start_id, end_id;   /* their tokens in the model's vocabulary */
    const char *assistant_role; /* "assistant" or "model" */
} cli_chat_template;

/* Pick the template form for a model: `force` ("chatml", "gemma", or NULL/"auto" for the model's
 * own: tokenizer.chat_template, else by architecture). Returns 0, or a non-zero exit code with the
 * reason printed to stderr (prefixed with cmd): no template and no known default, a template of
 * another form, or a control text that is not one control token of the vocabulary. `*note` (may be
 * NULL) gets a line to show the user when the form was not read from the file's template. */
int cli_chat_template_init(cli_chat_template *t, const kvpq_model *m, const char *force, const char *cmd,
                           const char **note);

/* A rendered (part of a) conversation: pieces in order. Texts are borrowed: they must live until
 * cli_chat_tokenize has run. */
typedef struct {
    struct {
        const char *text;
        size_t len;
        int control; /* 1: one control token's text; 0: plain text */
    } *p;
    int n, cap;
    int oom;
} cli_chat_pieces;

void cli_chat_pieces_free(cli_chat_pieces *c);
/* What opens a conversation: ChatML's system turn (system, else the default, else nothing); Gemma:
 * nothing (its system text goes into the first user turn, BOS comes from cli_chat_tokenize). */
void cli_chat_begin(const cli_chat_template *t, cli_chat_pieces *c, const char *system);
/* One user message; first: the conversation's first user message (Gemma puts system before it). */
void cli_chat_user(const cli_chat_template *t, cli_chat_pieces *c, const char *user, int first, const char *system);
/* The generation prompt: the opening of the assistant's turn. */
void cli_chat_assistant_open(const cli_chat_template *t, cli_chat_pieces *c);
/* An assistant message's text (rendering a given conversation; a generated reply is kept as tokens). */
void cli_chat_assistant_text(const cli_chat_template *t, cli_chat_pieces *c, const char *text);
/* Plain text outside any template (generate without --chat): never control tokens. */
void cli_chat_user_plain(cli_chat_pieces *c, const char *text);
/* What closes an assistant turn (the turn-end control token and "\n"). */
void cli_chat_assistant_close(const cli_chat_template *t, cli_chat_pieces *c);

/* Tokenize the pieces (BOS first when add_bos): a malloc'd array (*out, at least one slot) of *n ids.
 * Errors as kvpq_tokenize's (invalid UTF-8 for byte-level BPE vocabularies, ...), KVPQ_ERR_NOMEM. */
kvpq_status cli_chat_tokenize(const kvpq_model *m, const cli_chat_pieces *c, int add_bos, int32_t **out, size_t *n);
/* The rendered text (control texts as their text), NUL-terminated, malloc'd; NULL when out of memory. */
char *cli_chat_text(const cli_chat_pieces *c);

#endif
