/* serve_api.c — the OpenAI API's JSON for `kvpq serve`: request bodies checked field by field into
 * jobs, and jobs written back as chat.completion / text_completion objects, stream chunks and error
 * objects ({"error": {"message", "type", "param", "code"}}, as the OpenAI API returns them). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "cli_model.h"
#include "cli_json.h"
#include "serve.h"

/* ---- errors ---- */

static int fail(serve_error *e, int status, const char *param, const char *code, const char *fmt, const char *arg) {
    e->status = status;
    e->type = "invalid_request_error";
    e->param = param;
    e->code = code;
    snprintf(e->message, sizeof e->message, fmt, arg ? arg : "");
    return -1;
}

char *serve_error_json(const serve_error *e) {
    cJSON *root = cJSON_CreateObject(), *o = cJSON_AddObjectToObject(root, "error");
    cJSON_AddStringToObject(o, "message", e->message);
    cJSON_AddStringToObject(o, "type", e->type ? e->type : "invalid_request_error");
    if (e->param) cJSON_AddStringToObject(o, "param", e->param);
    else cJSON_AddNullToObject(o, "param");
    if (e->code) cJSON_AddStringToObject(o, "code", e->code);
    else cJSON_AddNullToObject(o, "code");
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return s;
}

/* ---- field readers: absent or null leaves *out as it is; a wrong type or range is an error ---- */

static int get_number(cJSON *body, const char *key, double lo, double hi, double *out, serve_error *e) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(body, key);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsNumber(v)) return fail(e, 400, key, "invalid_type", "'%s' must be a number", key);
    if (!(v->valuedouble >= lo && v->valuedouble <= hi)) {
        char m[200];
        snprintf(m, sizeof m, "'%s' must be in [%g, %g], got %g", key, lo, hi, v->valuedouble);
        return fail(e, 400, key, "invalid_value", "%s", m);
    }
    *out = v->valuedouble;
    return 0;
}

static int get_int(cJSON *body, const char *key, double lo, double hi, long *out, serve_error *e) {
    double d = NAN;
    if (get_number(body, key, lo, hi, &d, e)) return -1;
    if (isnan(d)) return 0;
    if (d != floor(d)) return fail(e, 400, key, "invalid_type", "'%s' must be an integer", key);
    *out = (long)d;
    return 0;
}

static int get_bool(cJSON *body, const char *key, int *out, serve_error *e) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(body, key);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v)) return fail(e, 400, key, "invalid_type", "'%s' must be a boolean", key);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* A string that must be valid UTF-8 (malloc'd copy into *out). */
static int dup_text(cJSON *v, const char *param, char **out, serve_error *e) {
    size_t bad = 0, n = strlen(v->valuestring);
    if (!cli_utf8_valid((const unsigned char *)v->valuestring, n, &bad))
        return fail(e, 400, param, "invalid_value", "'%s' is not valid UTF-8", param);
    if (!(*out = strdup(v->valuestring))) return fail(e, 500, NULL, NULL, "out of memory%s", NULL);
    return 0;
}

/* Fields the server accepts and ignores, checked for their type (a wrong type is still a 400), and
 * n, which must be 1. */
static int check_ignored(cJSON *body, serve_error *e) {
    static const char *const nums[] = {"presence_penalty", "frequency_penalty", NULL};
    static const char *const strs[] = {"user", NULL};
    for (int i = 0; nums[i]; i++) {
        double d;
        if (get_number(body, nums[i], -2, 2, &d, e)) return -1;
    }
    for (int i = 0; strs[i]; i++) {
        cJSON *v = cJSON_GetObjectItemCaseSensitive(body, strs[i]);
        if (v && !cJSON_IsNull(v) && !cJSON_IsString(v))
            return fail(e, 400, strs[i], "invalid_type", "'%s' must be a string", strs[i]);
    }
    long n = 1;
    if (get_int(body, "n", 1, 128, &n, e)) return -1;
    if (n != 1) return fail(e, 400, "n", "unsupported_value", "only n = 1 is supported%s", NULL);
    return 0;
}

static int get_stop(cJSON *body, serve_job *j, serve_error *e) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(body, "stop");
    if (!v || cJSON_IsNull(v)) return 0;
    if (cJSON_IsString(v)) {
        if (!v->valuestring[0]) return 0;
        j->n_stop = 1;
        return dup_text(v, "stop", &j->stop[0], e);
    }
    if (!cJSON_IsArray(v)) return fail(e, 400, "stop", "invalid_type", "'stop' must be a string or an array of strings%s", NULL);
    if (cJSON_GetArraySize(v) > SERVE_MAX_STOP)
        return fail(e, 400, "stop", "invalid_value", "'stop' holds at most 4 sequences%s", NULL);
    cJSON *s;
    cJSON_ArrayForEach(s, v) {
        if (!cJSON_IsString(s)) return fail(e, 400, "stop", "invalid_type", "'stop' must be an array of strings%s", NULL);
        if (!s->valuestring[0]) continue;
        if (dup_text(s, "stop", &j->stop[j->n_stop], e)) return -1;
        j->n_stop++;
    }
    return 0;
}

/* The sampling fields both endpoints share. */
static int get_sampling(cJSON *body, serve_job *j, serve_error *e) {
    long max_tokens = 0;
    double seed = NAN;
    j->temperature = 1.0;
    j->top_p = 1.0;
    if (get_int(body, "max_tokens", 1, 1 << 24, &max_tokens, e)) return -1;
    if (get_int(body, "max_completion_tokens", 1, 1 << 24, &max_tokens, e)) return -1;
    if (get_number(body, "temperature", 0, 2, &j->temperature, e)) return -1;
    if (get_number(body, "top_p", 0, 1, &j->top_p, e)) return -1;
    if (get_number(body, "seed", -9.2e18, 9.2e18, &seed, e)) return -1;
    if (!isnan(seed) && seed != floor(seed)) return fail(e, 400, "seed", "invalid_type", "'seed' must be an integer%s", NULL);
    if (get_bool(body, "stream", &j->stream, e)) return -1;
    if (get_stop(body, j, e)) return -1;
    cJSON *so = cJSON_GetObjectItemCaseSensitive(body, "stream_options");
    if (so && !cJSON_IsNull(so) && !cJSON_IsObject(so))
        return fail(e, 400, "stream_options", "invalid_type", "'%s' must be an object", "stream_options");
    if (so && get_bool(so, "include_usage", &j->include_usage, e)) return -1;
    j->max_tokens = max_tokens;
    /* no seed: one from the clock and the job's address (a different draw per request) */
    j->seed = !isnan(seed) ? (uint64_t)(int64_t)seed : (uint64_t)time(NULL) ^ ((uint64_t)(uintptr_t)j << 16);
    cJSON *model = cJSON_GetObjectItemCaseSensitive(body, "model");
    if (model && !cJSON_IsNull(model) && !cJSON_IsString(model))
        return fail(e, 400, "model", "invalid_type", "'model' must be a string%s", NULL);
    return check_ignored(body, e);
}

/* ---- messages ---- */

static int parse_role(cJSON *m, int i, serve_role *role, serve_error *e) {
    cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
    char p[64];
    snprintf(p, sizeof p, "messages[%d].role", i);
    if (!cJSON_IsString(r)) return fail(e, 400, "messages", "invalid_type", "%s must be a string", p);
    const char *s = r->valuestring;
    if (!strcmp(s, "system") || !strcmp(s, "developer")) *role = SERVE_ROLE_SYSTEM;
    else if (!strcmp(s, "user")) *role = SERVE_ROLE_USER;
    else if (!strcmp(s, "assistant")) *role = SERVE_ROLE_ASSISTANT;
    else return fail(e, 400, "messages", "invalid_value", "%s must be system, developer, user or assistant", p);
    return 0;
}

/* content: a string, or an array of {"type": "text", "text": ...} parts (joined). */
static int parse_content(cJSON *m, int i, char **out, serve_error *e) {
    cJSON *c = cJSON_GetObjectItemCaseSensitive(m, "content");
    char p[64];
    snprintf(p, sizeof p, "messages[%d].content", i);
    if (cJSON_IsString(c)) return dup_text(c, "messages", out, e);
    if (!cJSON_IsArray(c)) return fail(e, 400, "messages", "invalid_type", "%s must be a string or an array of text parts", p);
    size_t n = 1;
    cJSON *part;
    cJSON_ArrayForEach(part, c) {
        cJSON *t = cJSON_GetObjectItemCaseSensitive(part, "type"), *x = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(t) || strcmp(t->valuestring, "text") || !cJSON_IsString(x))
            return fail(e, 400, "messages", "invalid_value", "%s: only text parts are supported", p);
        n += strlen(x->valuestring);
    }
    char *s = malloc(n);
    if (!s) return fail(e, 500, NULL, NULL, "out of memory%s", NULL);
    s[0] = '\0';
    cJSON_ArrayForEach(part, c) strcat(s, cJSON_GetObjectItemCaseSensitive(part, "text")->valuestring);
    size_t bad;
    if (!cli_utf8_valid((const unsigned char *)s, strlen(s), &bad)) {
        free(s);
        return fail(e, 400, "messages", "invalid_value", "%s is not valid UTF-8", p);
    }
    *out = s;
    return 0;
}

static int parse_messages(cJSON *body, serve_job *j, serve_error *e) {
    cJSON *ms = cJSON_GetObjectItemCaseSensitive(body, "messages");
    if (!ms) return fail(e, 400, "messages", "missing_required_parameter", "'messages' is required%s", NULL);
    if (!cJSON_IsArray(ms)) return fail(e, 400, "messages", "invalid_type", "'messages' must be an array%s", NULL);
    int n = cJSON_GetArraySize(ms);
    if (n == 0) return fail(e, 400, "messages", "invalid_value", "'messages' must not be empty%s", NULL);
    if (!(j->msgs = calloc((size_t)n, sizeof *j->msgs))) return fail(e, 500, NULL, NULL, "out of memory%s", NULL);
    cJSON *m;
    cJSON_ArrayForEach(m, ms) {
        int i = j->n_msgs;
        if (!cJSON_IsObject(m)) return fail(e, 400, "messages", "invalid_type", "each message must be an object%s", NULL);
        if (parse_role(m, i, &j->msgs[i].role, e) || parse_content(m, i, &j->msgs[i].text, e)) return -1;
        j->n_msgs++;
        if (j->msgs[i].role == SERVE_ROLE_SYSTEM && i > 0)
            return fail(e, 400, "messages", "unsupported_value", "a system message is supported only as the first message%s", NULL);
    }
    if (j->msgs[n - 1].role != SERVE_ROLE_USER)
        return fail(e, 400, "messages", "invalid_value", "the last message must be the user's%s", NULL);
    return 0;
}

static int parse_prompt(cJSON *body, serve_job *j, serve_error *e) {
    cJSON *p = cJSON_GetObjectItemCaseSensitive(body, "prompt");
    if (!p) return fail(e, 400, "prompt", "missing_required_parameter", "'prompt' is required%s", NULL);
    if (cJSON_IsArray(p) && cJSON_GetArraySize(p) == 1) p = cJSON_GetArrayItem(p, 0);
    if (!cJSON_IsString(p)) return fail(e, 400, "prompt", "invalid_type", "'prompt' must be a string (or an array of one string)%s", NULL);
    return dup_text(p, "prompt", &j->prompt, e);
}

serve_job *serve_parse_request(serve_kind kind, const char *body, size_t len, serve_error *err) {
    memset(err, 0, sizeof *err);
    cJSON *root = cJSON_ParseWithLength(body, len);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        fail(err, 400, NULL, "invalid_json", "the request body is not a JSON object%s", NULL);
        return NULL;
    }
    serve_job *j = calloc(1, sizeof *j);
    if (!j) {
        cJSON_Delete(root);
        fail(err, 500, NULL, NULL, "out of memory%s", NULL);
        return NULL;
    }
    j->kind = kind;
    int bad = kind == SERVE_CHAT ? parse_messages(root, j, err) : parse_prompt(root, j, err);
    if (!bad) bad = get_sampling(root, j, err);
    cJSON_Delete(root);
    if (bad) {
        serve_job_free(j);
        return NULL;
    }
    return j;
}

/* ---- responses ---- */

static cJSON *head(const serve_server *sv, const serve_job *j, const char *object) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "id", j->id);
    cJSON_AddStringToObject(r, "object", object);
    cJSON_AddNumberToObject(r, "created", (double)j->created);
    cJSON_AddStringToObject(r, "model", sv->model_id);
    return r;
}

static void add_text(cJSON *o, const char *key, const char *s, size_t n) {
    char *clean = cli_utf8_clean(s ? s : "", s ? n : 0);
    cJSON_AddStringToObject(o, key, clean ? clean : "");
    free(clean);
}

static char *print_free(cJSON *r) {
    char *s = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    return s;
}

static void add_usage(cJSON *r, const serve_job *j) {
    cJSON *u = cJSON_AddObjectToObject(r, "usage");
    cJSON_AddNumberToObject(u, "prompt_tokens", j->prompt_tokens);
    cJSON_AddNumberToObject(u, "completion_tokens", j->completion_tokens);
    cJSON_AddNumberToObject(u, "total_tokens", j->prompt_tokens + j->completion_tokens);
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(u, "prompt_tokens_details"), "cached_tokens", j->cached_tokens);
}

char *serve_response_json(const serve_server *sv, const serve_job *j) {
    const int chat = j->kind == SERVE_CHAT;
    cJSON *r = head(sv, j, chat ? "chat.completion" : "text_completion");
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(choice, "index", 0);
    if (chat) {
        cJSON *msg = cJSON_AddObjectToObject(choice, "message");
        cJSON_AddStringToObject(msg, "role", "assistant");
        add_text(msg, "content", j->gen, j->n_gen);
    } else {
        add_text(choice, "text", j->gen, j->n_gen);
    }
    cJSON_AddNullToObject(choice, "logprobs");
    cJSON_AddStringToObject(choice, "finish_reason", j->finish_reason ? j->finish_reason : "stop");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(r, "choices"), choice);
    add_usage(r, j);
    return print_free(r);
}

char *serve_chunk_json(const serve_server *sv, const serve_job *j, const char *delta, size_t n_delta,
                       const char *finish, int role_only) {
    const int chat = j->kind == SERVE_CHAT;
    cJSON *r = head(sv, j, chat ? "chat.completion.chunk" : "text_completion");
    cJSON *choice = cJSON_CreateObject();
    cJSON_AddNumberToObject(choice, "index", 0);
    if (chat) {
        cJSON *d = cJSON_AddObjectToObject(choice, "delta");
        if (role_only) cJSON_AddStringToObject(d, "role", "assistant");
        if (delta || role_only) add_text(d, "content", delta, n_delta);
    } else {
        add_text(choice, "text", delta, n_delta);
        cJSON_AddNullToObject(choice, "logprobs");
    }
    if (finish) cJSON_AddStringToObject(choice, "finish_reason", finish);
    else cJSON_AddNullToObject(choice, "finish_reason");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(r, "choices"), choice);
    return print_free(r);
}

char *serve_usage_chunk_json(const serve_server *sv, const serve_job *j) {
    cJSON *r = head(sv, j, j->kind == SERVE_CHAT ? "chat.completion.chunk" : "text_completion");
    cJSON_AddArrayToObject(r, "choices");
    add_usage(r, j);
    return print_free(r);
}

char *serve_models_json(const serve_server *sv) {
    cJSON *r = cJSON_CreateObject(), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "object", "list");
    cJSON_AddStringToObject(m, "id", sv->model_id);
    cJSON_AddStringToObject(m, "object", "model");
    cJSON_AddNumberToObject(m, "created", 0);
    cJSON_AddStringToObject(m, "owned_by", "kvpq");
    cJSON_AddItemToArray(cJSON_AddArrayToObject(r, "data"), m);
    return print_free(r);
}
