/* serve_http.c — `kvpq serve`'s HTTP side on libmicrohttpd (one thread per connection): request
 * bodies up to --max-body, the API key, the routes, JSON responses and server-sent event streams. */
#include <errno.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <microhttpd.h>

#include "serve.h"

struct serve_http {
    struct MHD_Daemon *d;
    serve_server *sv;
};

typedef struct {
    char *body;
    size_t n, cap;
    int too_big;
} req_t;

/* ---- responses ---- */

/* Queue body (malloc'd; taken) with a status and a content type. */
static enum MHD_Result send_body(struct MHD_Connection *c, unsigned status, const char *ctype, char *body) {
    if (!body) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    if (status == 401) MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_error(struct MHD_Connection *c, const serve_error *e) {
    return send_body(c, (unsigned)e->status, "application/json", serve_error_json(e));
}

static enum MHD_Result send_error_msg(struct MHD_Connection *c, int status, const char *type, const char *code,
                                      const char *msg) {
    serve_error e = {.status = status, .type = type, .code = code};
    snprintf(e.message, sizeof e.message, "%s", msg);
    return send_error(c, &e);
}

/* ---- authorization ---- */

/* a == key, in time that depends on the key's length only (not on where a differs). */
static int equal_const_time(const char *a, const char *key) {
    size_t na = strlen(a), nk = strlen(key);
    volatile unsigned d = na != nk;
    for (size_t i = 0; i < nk; i++) d |= (unsigned char)key[i] ^ (unsigned char)(i < na ? a[i] : 0);
    return d == 0;
}

static int authorized(const serve_server *sv, struct MHD_Connection *c) {
    if (!sv->o.api_key) return 1;
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    return h && !strncmp(h, "Bearer ", 7) && equal_const_time(h + 7, sv->o.api_key);
}

/* ---- /metrics ---- */

static void metric(char *buf, size_t cap, size_t *at, const char *name, const char *type, const char *help, double v) {
    int n = snprintf(buf + *at, cap - *at, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
    if (n > 0 && *at + (size_t)n < cap) *at += (size_t)n;
}

static char *metrics_text(serve_server *sv) {
    size_t cap = 8192, at = 0;
    char *b = malloc(cap);
    if (!b) return NULL;
    b[0] = '\0';
    pthread_mutex_lock(&sv->mu);
    serve_metrics m = sv->metrics;
    pthread_mutex_unlock(&sv->mu);
    metric(b, cap, &at, "kvpq_requests_total", "counter", "Completion requests accepted.", m.requests);
    metric(b, cap, &at, "kvpq_requests_failed_total", "counter", "Accepted requests that ended in an error.", m.requests_failed);
    metric(b, cap, &at, "kvpq_requests_cancelled_total", "counter", "Sequences dropped because their client went away.", m.requests_cancelled);
    metric(b, cap, &at, "kvpq_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", m.prompt_tokens);
    metric(b, cap, &at, "kvpq_prompt_tokens_cached_total", "counter", "Prompt tokens found in a held conversation's cache (not evaluated).", m.prompt_tokens_cached);
    metric(b, cap, &at, "kvpq_completion_tokens_total", "counter", "Tokens generated.", m.completion_tokens);
    metric(b, cap, &at, "kvpq_decode_seconds_total", "counter", "Seconds spent sampling and evaluating generated tokens.", m.decode_seconds);
    metric(b, cap, &at, "kvpq_prefill_seconds_total", "counter", "Seconds spent evaluating prompt tokens.", m.prefill_seconds);
    metric(b, cap, &at, "kvpq_decode_tokens_per_second", "gauge", "Generated tokens per second of decoding, since start.",
           m.decode_seconds > 0 ? m.completion_tokens / m.decode_seconds : 0);
    metric(b, cap, &at, "kvpq_active_sequences", "gauge", "Sequences being evaluated (at most --parallel).", m.active);
    metric(b, cap, &at, "kvpq_waiting_requests", "gauge", "Requests waiting for a sequence slot.", m.waiting);
    metric(b, cap, &at, "kvpq_conversations", "gauge", "Conversations held (resident or saved).", m.conversations);
    metric(b, cap, &at, "kvpq_conversations_saved", "gauge", "Conversations saved to --cache-dir.", m.conversations_saved);
    metric(b, cap, &at, "kvpq_kv_resident_bytes", "gauge", "Bytes of the KV caches in memory.", m.kv_resident_bytes);
    metric(b, cap, &at, "kvpq_kv_saved_bytes", "gauge", "Bytes of the saved conversation files.", m.kv_saved_bytes);
    metric(b, cap, &at, "kvpq_kv_budget_bytes", "gauge", "--kv-budget (0: none).", (double)sv->o.kv_budget);
    metric(b, cap, &at, "kvpq_kv_pool_bytes_in_use", "gauge", "Bytes of the page pool held by caches (--kv-budget).",
           m.kv_pool_bytes_in_use);
    metric(b, cap, &at, "kvpq_kv_pool_bytes_free", "gauge", "Bytes of the page pool kept free for reuse.",
           m.kv_pool_bytes_free);
    metric(b, cap, &at, "kvpq_kv_pool_refusals_total", "counter", "Pages the pool refused for the budget.",
           m.kv_pool_refused);
    metric(b, cap, &at, "kvpq_evictions_total", "counter", "Conversations evicted for the budget.", m.evictions);
    metric(b, cap, &at, "kvpq_restores_total", "counter", "Saved conversations loaded back.", m.restores);
    return b;
}

/* ---- completions ---- */

typedef struct {
    serve_server *sv;
    serve_job *job;
    char *out;       /* the event being sent */
    size_t n_out, off;
    size_t sent;     /* bytes of job->gen sent */
    int role_sent, ended;
} stream_t;

static char *sse(char *json) {
    if (!json) return NULL;
    size_t n = strlen(json);
    char *s = malloc(n + 9);
    if (s) memcpy(s, "data: ", 6), memcpy(s + 6, json, n), memcpy(s + 6 + n, "\n\n", 3);
    free(json);
    return s;
}

static char *error_event_locked(const serve_job *j) {
    serve_error e = {.status = j->http_status, .type = j->err_type, .param = j->err_param, .code = j->err_code};
    snprintf(e.message, sizeof e.message, "%s", j->err_msg);
    return sse(serve_error_json(&e));
}

static int set_out(stream_t *s, char *ev) {
    if (!ev) return -1;
    free(s->out);
    s->out = ev;
    s->n_out = strlen(ev);
    s->off = 0;
    return 0;
}

/* The last events: the finish reason, the usage when asked for, then [DONE]. The job is over: its
 * counts no longer change. */
static char *final_event(const stream_t *s, const char *finish) {
    const serve_job *j = s->job;
    char *fin = sse(serve_chunk_json(s->sv, j, j->kind == SERVE_CHAT ? NULL : "", 0, finish ? finish : "stop", 0));
    char *usage = j->include_usage ? sse(serve_usage_chunk_json(s->sv, j)) : NULL;
    char *ev = fin ? malloc(strlen(fin) + (usage ? strlen(usage) : 0) + 16) : NULL;
    if (ev) sprintf(ev, "%s%sdata: [DONE]\n\n", fin, usage ? usage : "");
    free(fin);
    free(usage);
    return ev;
}

/* The next event into s->out (the role first, for chat); waits for the engine. -1: out of memory. */
static int stream_next(stream_t *s) {
    serve_server *sv = s->sv;
    serve_job *j = s->job;
    if (!s->role_sent) {
        s->role_sent = 1;
        if (j->kind == SERVE_CHAT) return set_out(s, sse(serve_chunk_json(sv, j, NULL, 0, NULL, 1)));
    }
    char *err = NULL, *delta = NULL;
    size_t n_delta = 0;
    pthread_mutex_lock(&sv->mu);
    while (j->n_ready == s->sent && j->state != JOB_DONE && j->state != JOB_FAILED)
        pthread_cond_wait(&sv->job_cond, &sv->mu);
    const int state = j->state;
    if (j->n_ready > s->sent && (delta = malloc(j->n_ready - s->sent))) {
        n_delta = j->n_ready - s->sent;
        memcpy(delta, j->gen + s->sent, n_delta);
        s->sent = j->n_ready;
    }
    const char *finish = j->finish_reason;
    if (state == JOB_FAILED) err = error_event_locked(j);
    pthread_mutex_unlock(&sv->mu);
    if (delta) {
        free(err);
        int rc = set_out(s, sse(serve_chunk_json(sv, j, delta, n_delta, NULL, 0)));
        free(delta);
        return rc;
    }
    s->ended = 1;
    return set_out(s, state == JOB_FAILED ? err : final_event(s, finish));
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    stream_t *s = cls;
    (void)pos;
    while (s->off == s->n_out) {
        if (s->ended) return MHD_CONTENT_READER_END_OF_STREAM;
        if (stream_next(s)) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = s->n_out - s->off < max ? s->n_out - s->off : max;
    memcpy(buf, s->out + s->off, n);
    s->off += n;
    return (ssize_t)n;
}

/* The stream is over (sent, or the client went away): a sequence still running is cancelled. */
static void stream_free(void *cls) {
    stream_t *s = cls;
    pthread_mutex_lock(&s->sv->mu);
    if (s->job->state != JOB_DONE && s->job->state != JOB_FAILED) s->job->cancelled = 1;
    serve_job_release_locked(s->sv, s->job);
    pthread_mutex_unlock(&s->sv->mu);
    free(s->out);
    free(s);
}

static enum MHD_Result start_stream(serve_server *sv, struct MHD_Connection *c, serve_job *j) {
    stream_t *s = calloc(1, sizeof *s);
    struct MHD_Response *r = s ? MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, s, stream_free) : NULL;
    if (!r) {
        free(s);
        pthread_mutex_lock(&sv->mu);
        j->cancelled = 1;
        serve_job_release_locked(sv, j);
        pthread_mutex_unlock(&sv->mu);
        return MHD_NO;
    }
    s->sv = sv;
    s->job = j;
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

/* 1 when the client has closed its end of the connection (a read would see end of file). */
static int client_gone(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    char b;
    if (!ci) return 0;
    ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* Wait (under sv->mu) until the job leaves the queue, or, with `to_end`, until it is over; a client
 * that goes away meanwhile (checked 4 times a second) has its job cancelled. */
static void wait_job_locked(serve_server *sv, struct MHD_Connection *c, serve_job *j, int to_end) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    while (j->state == JOB_QUEUED || (to_end && j->state != JOB_DONE && j->state != JOB_FAILED)) {
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        if (now.tv_sec > t.tv_sec || (now.tv_sec == t.tv_sec && now.tv_nsec >= t.tv_nsec)) {
            if (!j->cancelled && client_gone(c)) j->cancelled = 1;
            t = now; /* the next check: in 250 ms (the condition is signalled at every token) */
            t.tv_nsec += 250000000L;
            if (t.tv_nsec >= 1000000000L) t.tv_sec++, t.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&sv->job_cond, &sv->mu, &t);
    }
}

static enum MHD_Result completion(serve_server *sv, struct MHD_Connection *c, serve_kind kind, const req_t *r) {
    serve_error e;
    serve_job *j = serve_parse_request(kind, r->body ? r->body : "", r->n, &e);
    if (!j) return send_error(c, &e);
    static unsigned long counter;
    j->refs = 1;
    j->created = (long)time(NULL);
    snprintf(j->id, sizeof j->id, "%s-kvpq%lx%lx", kind == SERVE_CHAT ? "chatcmpl" : "cmpl", (unsigned long)j->created,
             __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
    if (serve_submit(sv, j)) {
        serve_job_free(j);
        return send_error_msg(c, 503, "server_error", "shutting_down", "the server is shutting down");
    }
    pthread_mutex_lock(&sv->mu);
    wait_job_locked(sv, c, j, !j->stream);
    if (j->state == JOB_FAILED) {
        serve_error fe = {.status = j->http_status, .type = j->err_type, .param = j->err_param, .code = j->err_code};
        snprintf(fe.message, sizeof fe.message, "%s", j->err_msg);
        serve_job_release_locked(sv, j);
        pthread_mutex_unlock(&sv->mu);
        return send_error(c, &fe);
    }
    if (j->stream) {
        pthread_mutex_unlock(&sv->mu);
        return start_stream(sv, c, j);
    }
    char *body = serve_response_json(sv, j);
    serve_job_release_locked(sv, j);
    pthread_mutex_unlock(&sv->mu);
    return send_body(c, MHD_HTTP_OK, "application/json", body);
}

/* ---- routing ---- */

static enum MHD_Result route(serve_server *sv, struct MHD_Connection *c, const char *url, const char *method,
                             const req_t *r) {
    const int get = !strcmp(method, "GET"), post = !strcmp(method, "POST");
    if (!strcmp(url, "/health")) {
        if (!get) return send_error_msg(c, 405, "invalid_request_error", "method_not_allowed", "use GET");
        return send_body(c, MHD_HTTP_OK, "application/json", strdup("{\"status\":\"ok\"}"));
    }
    if (!authorized(sv, c))
        return send_error_msg(c, 401, "invalid_request_error", "invalid_api_key",
                              "missing or wrong API key (Authorization: Bearer KEY)");
    struct { const char *path; int post; } routes[] = {{"/v1/models", 0}, {"/metrics", 0},
                                                       {"/v1/chat/completions", 1}, {"/v1/completions", 1}};
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++) {
        if (strcmp(url, routes[i].path)) continue;
        if (routes[i].post ? !post : !get)
            return send_error_msg(c, 405, "invalid_request_error", "method_not_allowed",
                                  routes[i].post ? "use POST" : "use GET");
        if (i == 0) return send_body(c, MHD_HTTP_OK, "application/json", serve_models_json(sv));
        if (i == 1) return send_body(c, MHD_HTTP_OK, "text/plain; version=0.0.4", metrics_text(sv));
        return completion(sv, c, i == 2 ? SERVE_CHAT : SERVE_COMPLETION, r);
    }
    char msg[300];
    snprintf(msg, sizeof msg, "no such endpoint: %.200s", url);
    return send_error_msg(c, 404, "invalid_request_error", "unknown_url", msg);
}

static enum MHD_Result too_large(serve_server *sv, struct MHD_Connection *c) {
    char msg[128];
    snprintf(msg, sizeof msg, "the request body is over the limit of %zu bytes (--max-body)", sv->o.max_body);
    return send_error_msg(c, 413, "invalid_request_error", "request_too_large", msg);
}

/* Keep a chunk of the body; past the limit, the rest is read and dropped (a 413 follows). */
static void body_add(req_t *r, const char *data, size_t n, size_t limit) {
    if (r->too_big || r->n + n > limit) {
        r->too_big = 1;
        return;
    }
    if (r->n + n + 1 > r->cap) {
        size_t cap = (r->n + n + 1) * 2;
        char *b = realloc(r->body, cap);
        if (!b) {
            r->too_big = 1;
            return;
        }
        r->body = b;
        r->cap = cap;
    }
    memcpy(r->body + r->n, data, n);
    r->n += n;
    r->body[r->n] = '\0';
}

/* Requests in flight, counted from their headers to their completion; a drain waits for none. */
static void live_requests_add(serve_server *sv, int d) {
    pthread_mutex_lock(&sv->mu);
    sv->live_requests += d;
    pthread_cond_broadcast(&sv->job_cond);
    pthread_mutex_unlock(&sv->mu);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *data, size_t *data_size, void **con_cls) {
    serve_http *h = cls;
    req_t *r = *con_cls;
    (void)version;
    if (!r) { /* the headers are in: a declared body over the limit is refused before it is read */
        if (!(r = calloc(1, sizeof *r))) return MHD_NO;
        *con_cls = r;
        live_requests_add(h->sv, 1);
        const char *len = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (len && strtoull(len, NULL, 10) > h->sv->o.max_body) {
            r->too_big = 1;
            return too_large(h->sv, c);
        }
        return MHD_YES;
    }
    if (*data_size) {
        body_add(r, data, *data_size, h->sv->o.max_body);
        *data_size = 0;
        return MHD_YES;
    }
    if (r->too_big) return too_large(h->sv, c);
    return route(h->sv, c, url, method, r);
}

/* The response's last byte is sent (or the connection is gone): the request no longer keeps a drain waiting. */
static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    serve_http *h = cls;
    req_t *r = *con_cls;
    (void)c, (void)toe;
    if (!r) return;
    live_requests_add(h->sv, -1);
    free(r->body);
    free(r);
    *con_cls = NULL;
}

/* ---- the daemon ---- */

serve_http *serve_http_start(serve_server *sv) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai = NULL;
    char port[16];
    snprintf(port, sizeof port, "%ld", sv->o.port);
    int g = getaddrinfo(sv->o.host, port, &hints, &ai);
    if (g) {
        fprintf(stderr, "kvpq serve: --host '%s': %s\n", sv->o.host, gai_strerror(g));
        return NULL;
    }
    serve_http *h = calloc(1, sizeof *h);
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    if (h) {
        h->sv = sv;
        h->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                                MHD_OPTION_NOTIFY_COMPLETED, on_completed, h, MHD_OPTION_CONNECTION_TIMEOUT,
                                (unsigned)300, MHD_OPTION_CONNECTION_LIMIT, (unsigned)256, MHD_OPTION_END);
    }
    freeaddrinfo(ai);
    if (!h || !h->d) {
        fprintf(stderr, "kvpq serve: cannot listen on %s port %ld (in use, or not an address of this machine)\n",
                sv->o.host, sv->o.port);
        free(h);
        return NULL;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    if (info) sv->o.port = info->port;
    return h;
}

void serve_http_quiesce(serve_http *h) {
    MHD_socket s = MHD_quiesce_daemon(h->d);
    if (s != MHD_INVALID_SOCKET) close(s);
}

void serve_http_stop(serve_http *h) {
    if (!h) return;
    MHD_stop_daemon(h->d);
    free(h);
}
