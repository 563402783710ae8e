/* serve_engine.c — the one thread of `kvpq serve` that runs the model. Jobs arrive on a queue; each
 * is rendered and tokenized (a prompt longer than the context fails here, before any work), then
 * waits for one of --parallel sequence slots. Every round takes each active sequence's next tokens,
 * a prompt chunk of up to PREFILL_CHUNK tokens or the one token it just sampled, and evaluates all of
 * them in one kvpq_model_eval_batch: the weight matrices take every sequence's rows together, and a
 * long prompt does not stall the others for more than a chunk. The model is used by this thread
 * only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "serve.h"

#define PREFILL_CHUNK 512 /* as kvpq chat's prompt batches: the same splits give the same cache */

typedef struct {
    serve_job *job;
    serve_conv *conv;
    int32_t *prompt; /* (n_prompt) */
    size_t n_prompt;
    float *logits;   /* (n_vocab) of the last evaluated token */
    cli_rng rng;
    long n_out, limit;
    /* this round's tokens (round_tokens): a prompt chunk, or the sampled token */
    const int32_t *row; /* (n_row) */
    int n_row;
    int32_t sampled;
    int decoding;    /* the row is a sampled token */
    int stopped;     /* a stop sequence ended the reply with that token */
} seq_t;

/* A prepared job waiting for a slot, with its prompt tokens. */
typedef struct wait_item {
    serve_job *job;
    int32_t *toks;
    size_t n;
    struct wait_item *next;
} wait_item;

typedef struct {
    serve_server *sv;
    seq_t *seq;      /* (parallel) slots; job NULL when free */
    int n_active;
    wait_item *wait_head, *wait_tail; /* FIFO */
    float *work;     /* (n_vocab) sampling scratch */
    int32_t *idx;    /* (n_vocab) */
    /* one round's batch (run_round), (parallel) each */
    int *slot;                 /* the active sequences' slots */
    kvpq_cache **caches;
    const int32_t **rows;
    int *n_rows;
    float *logits;             /* (parallel, n_vocab) */
} engine_t;

/* ---- job progress (each under sv->mu) ---- */

void serve_job_free(serve_job *j) {
    if (!j) return;
    for (int i = 0; i < j->n_msgs; i++) free(j->msgs[i].text);
    free(j->msgs);
    free(j->prompt);
    for (int i = 0; i < j->n_stop; i++) free(j->stop[i]);
    free(j->gen);
    free(j);
}

void serve_job_release_locked(serve_server *sv, serve_job *j) {
    if (--j->refs > 0) return;
    serve_job_free(j);
    pthread_cond_broadcast(&sv->job_cond);
}

static void job_fail(serve_server *sv, serve_job *j, int status, const char *code, const char *msg) {
    pthread_mutex_lock(&sv->mu);
    j->state = JOB_FAILED;
    j->http_status = status;
    j->err_type = status >= 500 ? "server_error" : "invalid_request_error";
    j->err_param = status == 400 ? (j->kind == SERVE_CHAT ? "messages" : "prompt") : NULL;
    j->err_code = code;
    snprintf(j->err_msg, sizeof j->err_msg, "%s", msg);
    sv->metrics.requests_failed++;
    serve_job_release_locked(sv, j);
    pthread_cond_broadcast(&sv->job_cond);
    pthread_mutex_unlock(&sv->mu);
}

int serve_submit(serve_server *sv, serve_job *j) {
    pthread_mutex_lock(&sv->mu);
    if (sv->draining) {
        pthread_mutex_unlock(&sv->mu);
        return -1;
    }
    j->refs++; /* the engine's */
    j->state = JOB_QUEUED;
    j->next = NULL;
    serve_job **tail = &sv->incoming;
    while (*tail) tail = &(*tail)->next;
    *tail = j;
    sv->metrics.requests++;
    pthread_cond_signal(&sv->engine_cond);
    pthread_mutex_unlock(&sv->mu);
    return 0;
}

/* ---- preparing: the template, the tokens, the context check ---- */

static void render_chat(const serve_server *sv, const serve_job *j, cli_chat_pieces *pc) {
    const char *system = j->msgs[0].role == SERVE_ROLE_SYSTEM ? j->msgs[0].text : NULL;
    int first = 1;
    cli_chat_begin(&sv->tmpl, pc, system);
    for (int i = system ? 1 : 0; i < j->n_msgs; i++) {
        if (j->msgs[i].role == SERVE_ROLE_USER) {
            cli_chat_user(&sv->tmpl, pc, j->msgs[i].text, first, system);
            first = 0;
        } else {
            cli_chat_assistant_open(&sv->tmpl, pc);
            cli_chat_assistant_text(&sv->tmpl, pc, j->msgs[i].text);
            cli_chat_assistant_close(&sv->tmpl, pc);
        }
    }
    cli_chat_assistant_open(&sv->tmpl, pc);
}

/* The job's prompt tokens (malloc'd, *n), or NULL after failing the job. */
static int32_t *prepare(serve_server *sv, serve_job *j, size_t *n) {
    cli_chat_pieces pc = {0};
    if (j->kind == SERVE_CHAT) render_chat(sv, j, &pc);
    else cli_chat_user_plain(&pc, j->prompt);
    int32_t *t = NULL;
    kvpq_status s = cli_chat_tokenize(sv->model, &pc, sv->mi.add_bos, &t, n);
    cli_chat_pieces_free(&pc);
    char msg[384];
    if (s != KVPQ_OK) {
        snprintf(msg, sizeof msg, "the prompt cannot be tokenized: %s", kvpq_last_error());
        job_fail(sv, j, s == KVPQ_ERR_NOMEM ? 500 : 400, "invalid_value", msg);
        return NULL;
    }
    if (*n == 0 && sv->mi.bos_id >= 0) t[(*n)++] = sv->mi.bos_id; /* an empty completion prompt: from BOS */
    if (*n == 0 || (long)*n >= sv->o.ctx) {
        snprintf(msg, sizeof msg, "the prompt has %zu tokens; this server's context holds %ld (--ctx), and at least one "
                 "more is needed for the reply", *n, sv->o.ctx);
        job_fail(sv, j, 400, "context_length_exceeded", msg);
        free(t);
        return NULL;
    }
    return t;
}

/* ---- sequences ---- */

static void set_state(serve_server *sv, serve_job *j, serve_job_state st) {
    pthread_mutex_lock(&sv->mu);
    j->state = st;
    pthread_cond_broadcast(&sv->job_cond);
    pthread_mutex_unlock(&sv->mu);
}

static int admit(engine_t *e, seq_t *q, serve_job *j, int32_t *prompt, size_t n) {
    serve_server *sv = e->sv;
    char err[256];
    memset(q, 0, sizeof *q);
    q->logits = malloc((size_t)sv->mi.n_vocab * sizeof *q->logits);
    q->conv = q->logits ? serve_conv_acquire(sv->convs, prompt, n, err, sizeof err) : NULL;
    if (!q->conv) {
        if (!q->logits) snprintf(err, sizeof err, "out of memory");
        free(q->logits);
        free(prompt);
        q->logits = NULL;
        job_fail(sv, j, 500, NULL, err);
        return -1;
    }
    q->job = j;
    q->prompt = prompt;
    q->n_prompt = n;
    q->limit = j->max_tokens > 0 ? j->max_tokens : sv->o.ctx;
    cli_rng_seed(&q->rng, j->seed);
    pthread_mutex_lock(&sv->mu);
    j->prompt_tokens = (int)n;
    j->cached_tokens = (int)q->conv->n;
    sv->metrics.prompt_tokens += (double)n;
    sv->metrics.prompt_tokens_cached += (double)q->conv->n;
    pthread_mutex_unlock(&sv->mu);
    set_state(sv, j, JOB_RUNNING);
    e->n_active++;
    return 0;
}

static void finish(engine_t *e, seq_t *q, const char *reason) {
    serve_server *sv = e->sv;
    serve_conv_release(sv->convs, q->conv);
    pthread_mutex_lock(&sv->mu);
    q->job->finish_reason = reason;
    q->job->completion_tokens = (int)q->n_out;
    q->job->n_ready = q->job->n_gen;
    q->job->state = JOB_DONE;
    sv->metrics.completion_tokens += (double)q->n_out;
    sv->metrics.requests_cancelled += !strcmp(reason, "cancelled");
    serve_job_release_locked(sv, q->job);
    pthread_cond_broadcast(&sv->job_cond);
    pthread_mutex_unlock(&sv->mu);
    free(q->prompt);
    free(q->logits);
    memset(q, 0, sizeof *q);
    e->n_active--;
}

/* An evaluation of q's row failed (why: the reason): the cache back to the tokens it held, the
 * sequence finished as failed. */
static void eval_failed(engine_t *e, seq_t *q, const char *why) {
    kvpq_cache_truncate(q->conv->cache, (int)q->conv->n);
    char msg[384];
    snprintf(msg, sizeof msg, "evaluation failed: %s", why);
    fprintf(stderr, "kvpq serve: %s\n", msg);
    pthread_mutex_lock(&e->sv->mu);
    snprintf(q->job->err_msg, sizeof q->job->err_msg, "%s", msg);
    pthread_mutex_unlock(&e->sv->mu);
    finish(e, q, "error");
}

/* ---- generated text: stop sequences and what may be sent ---- */

/* Bytes at the end of g that may be the start of a stop sequence or of an incomplete UTF-8 character. */
static size_t held_back(const serve_job *j) {
    size_t held = 0, n = j->n_gen;
    for (int s = 0; s < j->n_stop; s++) {
        size_t ls = strlen(j->stop[s]);
        for (size_t k = ls - 1; k > held; k--)
            if (k <= n && !memcmp(j->gen + n - k, j->stop[s], k)) {
                held = k;
                break;
            }
    }
    for (size_t k = 1; k <= 3 && k <= n; k++) { /* a lead byte whose sequence is not complete yet */
        unsigned char c = (unsigned char)j->gen[n - k];
        if ((c & 0xc0) == 0x80) continue;
        size_t l = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
        if (l > k && k > held) held = k;
        break;
    }
    return held;
}

/* Append a piece; returns 1 when a stop sequence now ends the text (cut before it). Under sv->mu. */
static int gen_append_locked(serve_job *j, const char *p, size_t n) {
    if (j->n_gen + n + 1 > j->cap_gen) {
        size_t cap = (j->n_gen + n + 1) * 2;
        char *g = realloc(j->gen, cap);
        if (!g) return 1; /* out of memory: the reply ends here */
        j->gen = g;
        j->cap_gen = cap;
    }
    memcpy(j->gen + j->n_gen, p, n);
    j->n_gen += n;
    size_t cut = j->n_gen;
    for (int s = 0; s < j->n_stop; s++) {
        const char *hit = memmem(j->gen + j->n_ready, j->n_gen - j->n_ready, j->stop[s], strlen(j->stop[s]));
        if (hit && (size_t)(hit - j->gen) < cut) cut = (size_t)(hit - j->gen);
    }
    if (cut < j->n_gen) {
        j->n_gen = j->n_ready = cut;
        return 1;
    }
    j->n_ready = j->n_gen - held_back(j);
    return 0;
}

/* ---- one round: every active sequence's next tokens in one forward pass ---- */

static int is_end(const serve_server *sv, int32_t t) {
    return t == sv->tmpl.end_id || t == sv->mi.eos_id || (kvpq_token_attr(sv->model, t) & KVPQ_TOKEN_ATTR_CONTROL);
}

/* A decoding sequence samples its next token from its logits and sends its text; 0 when the token
 * ends the reply (the sequence is finished, nothing to evaluate). */
static int sample_next(engine_t *e, seq_t *q) {
    serve_server *sv = e->sv;
    serve_job *j = q->job;
    int32_t t = cli_sample(q->logits, sv->mi.n_vocab, (float)j->temperature, (float)j->top_p, &q->rng, e->work, e->idx);
    if (is_end(sv, t)) {
        finish(e, q, "stop");
        return 0;
    }
    char piece[256];
    size_t len = 0;
    if (kvpq_token_to_piece(sv->model, t, piece, sizeof piece, &len) != KVPQ_OK) len = 0;
    if (len > sizeof piece) len = sizeof piece;
    q->n_out++;
    pthread_mutex_lock(&sv->mu);
    q->stopped = gen_append_locked(j, piece, len);
    pthread_cond_broadcast(&sv->job_cond);
    pthread_mutex_unlock(&sv->mu);
    q->sampled = t;
    return 1;
}

/* The tokens q evaluates this round (q->row, q->n_row): its next prompt chunk, or the token it
 * samples now. The sampled token is evaluated even when it ends the reply by a stop sequence, so
 * the cache holds the whole reply as `kvpq chat` holds it and a continuation evaluates only its own
 * new tokens. 0: nothing to evaluate (cancelled or finished). */
static int round_tokens(engine_t *e, seq_t *q) {
    int cancelled;
    pthread_mutex_lock(&e->sv->mu);
    cancelled = q->job->cancelled;
    pthread_mutex_unlock(&e->sv->mu);
    if (cancelled) {
        finish(e, q, "cancelled");
        return 0;
    }
    q->decoding = q->conv->n >= q->n_prompt;
    if (!q->decoding) {
        size_t left = q->n_prompt - q->conv->n;
        q->row = q->prompt + q->conv->n;
        q->n_row = (int)(left < PREFILL_CHUNK ? left : PREFILL_CHUNK);
        return 1;
    }
    if (!sample_next(e, q)) return 0;
    q->row = &q->sampled;
    q->n_row = 1;
    return 1;
}

/* After q's row was evaluated: the conversation records it; a reply ends at a stop sequence,
 * max_tokens or the context's end. */
static void round_done(engine_t *e, seq_t *q) {
    if (serve_conv_push(q->conv, q->row, (size_t)q->n_row)) {
        eval_failed(e, q, "out of memory");
        return;
    }
    if (!q->decoding) return;
    if (q->stopped) finish(e, q, "stop");
    else if (q->n_out >= q->limit || (long)q->conv->n >= e->sv->o.ctx) finish(e, q, "length");
}

/* The pages q's row will take, reserved before the round (kvpq_cache_reserve), so that a refusal of
 * the page pool comes before any cache changed and evicts an idle conversation (serve_convs_make_room)
 * instead of failing a batch half done. Other errors are left to the evaluation to report. */
static void reserve_row(engine_t *e, seq_t *q) {
    const int want = (int)(q->conv->n + (size_t)q->n_row);
    while (kvpq_cache_reserve(q->conv->cache, want) == KVPQ_ERR_BUDGET && serve_convs_make_room(e->sv->convs))
        ;
}

/* The round's sequences (e->slot, k of them) evaluated: all in one kvpq_model_eval_batch, their
 * logits copied to each sequence. If the batch fails (it changed no cache), each is evaluated alone,
 * so only the sequence at fault fails. The round's time is split between decode and prefill by rows. */
static void eval_round(engine_t *e, int k) {
    serve_server *sv = e->sv;
    const size_t V = (size_t)sv->mi.n_vocab;
    int decode_rows = 0, rows = 0;
    for (int i = 0; i < k; i++) reserve_row(e, &e->seq[e->slot[i]]);
    for (int i = 0; i < k; i++) {
        seq_t *q = &e->seq[e->slot[i]];
        e->caches[i] = q->conv->cache;
        e->rows[i] = q->row;
        e->n_rows[i] = q->n_row;
        rows += q->n_row;
        decode_rows += q->decoding;
    }
    double t0 = cli_now();
    kvpq_status s = kvpq_model_eval_batch(sv->model, k, e->caches, e->rows, e->n_rows, e->logits);
    for (int i = 0; i < k; i++) {
        seq_t *q = &e->seq[e->slot[i]];
        kvpq_status si = s;
        if (s == KVPQ_OK) memcpy(q->logits, e->logits + i * V, V * sizeof *q->logits);
        else
            while ((si = kvpq_model_eval(sv->model, q->conv->cache, q->row, q->n_row, 0, q->logits)) == KVPQ_ERR_BUDGET &&
                   serve_convs_make_room(sv->convs))
                ;
        if (si != KVPQ_OK) {
            char why[320];
            snprintf(why, sizeof why, "%s: %s", kvpq_status_string(si), kvpq_last_error());
            eval_failed(e, q, why);
        } else {
            round_done(e, q);
        }
    }
    double dt = cli_now() - t0;
    pthread_mutex_lock(&sv->mu);
    sv->metrics.decode_seconds += dt * decode_rows / rows;
    sv->metrics.prefill_seconds += dt * (rows - decode_rows) / rows;
    pthread_mutex_unlock(&sv->mu);
}

static void run_round(engine_t *e) {
    int k = 0;
    for (int i = 0; i < e->sv->o.parallel; i++)
        if (e->seq[i].job && round_tokens(e, &e->seq[i])) e->slot[k++] = i;
    if (k > 0) eval_round(e, k);
}

/* ---- the loop ---- */

static void take_incoming(engine_t *e) {
    serve_server *sv = e->sv;
    pthread_mutex_lock(&sv->mu);
    serve_job *j = sv->incoming;
    sv->incoming = NULL;
    pthread_mutex_unlock(&sv->mu);
    while (j) {
        serve_job *next = j->next;
        size_t n = 0;
        int32_t *t = prepare(sv, j, &n);
        wait_item *w = t ? malloc(sizeof *w) : NULL;
        if (t && !w) {
            free(t);
            job_fail(sv, j, 500, NULL, "out of memory");
        } else if (w) {
            *w = (wait_item){j, t, n, NULL};
            if (e->wait_tail) e->wait_tail->next = w;
            else e->wait_head = w;
            e->wait_tail = w;
            set_state(sv, j, JOB_WAITING);
        }
        j = next;
    }
}

static void admit_waiting(engine_t *e) {
    for (int i = 0; i < e->sv->o.parallel && e->wait_head; i++) {
        if (e->seq[i].job) continue;
        wait_item *w = e->wait_head;
        e->wait_head = w->next;
        if (!e->wait_head) e->wait_tail = NULL;
        admit(e, &e->seq[i], w->job, w->toks, w->n);
        free(w);
    }
}

static void update_metrics(engine_t *e) {
    serve_server *sv = e->sv;
    serve_metrics m;
    int waiting = 0;
    for (wait_item *w = e->wait_head; w; w = w->next) waiting++;
    serve_convs_measure(sv->convs, &m);
    pthread_mutex_lock(&sv->mu);
    sv->metrics.kv_resident_bytes = m.kv_resident_bytes;
    sv->metrics.kv_saved_bytes = m.kv_saved_bytes;
    sv->metrics.conversations = m.conversations;
    sv->metrics.conversations_saved = m.conversations_saved;
    sv->metrics.evictions = m.evictions;
    sv->metrics.kv_pool_bytes_in_use = m.kv_pool_bytes_in_use;
    sv->metrics.kv_pool_bytes_free = m.kv_pool_bytes_free;
    sv->metrics.kv_pool_refused = m.kv_pool_refused;
    sv->metrics.restores = m.restores;
    sv->metrics.active = e->n_active;
    sv->metrics.waiting = waiting;
    pthread_mutex_unlock(&sv->mu);
}

/* Sleep until there is work; 0 when the engine should end. */
static int wait_for_work(engine_t *e) {
    serve_server *sv = e->sv;
    pthread_mutex_lock(&sv->mu);
    while (!sv->incoming && !e->wait_head && e->n_active == 0 && !sv->stop_engine)
        pthread_cond_wait(&sv->engine_cond, &sv->mu);
    int go = sv->incoming || e->wait_head || e->n_active > 0;
    pthread_mutex_unlock(&sv->mu);
    return go;
}

static void *engine_main(void *arg) {
    engine_t *e = arg;
    while (wait_for_work(e)) {
        take_incoming(e);
        admit_waiting(e);
        run_round(e);
        serve_convs_enforce(e->sv->convs);
        update_metrics(e);
    }
    return NULL;
}

static engine_t g_engine;

int serve_engine_start(serve_server *sv) {
    engine_t *e = &g_engine;
    memset(e, 0, sizeof *e);
    e->sv = sv;
    e->seq = calloc((size_t)sv->o.parallel, sizeof *e->seq);
    e->work = malloc((size_t)sv->mi.n_vocab * sizeof *e->work);
    e->idx = malloc((size_t)sv->mi.n_vocab * sizeof *e->idx);
    e->slot = malloc((size_t)sv->o.parallel * sizeof *e->slot);
    e->caches = malloc((size_t)sv->o.parallel * sizeof *e->caches);
    e->rows = malloc((size_t)sv->o.parallel * sizeof *e->rows);
    e->n_rows = malloc((size_t)sv->o.parallel * sizeof *e->n_rows);
    e->logits = malloc((size_t)sv->o.parallel * sv->mi.n_vocab * sizeof *e->logits);
    if (!e->seq || !e->work || !e->idx || !e->slot || !e->caches || !e->rows || !e->n_rows || !e->logits ||
        pthread_create(&sv->engine, NULL, engine_main, e)) {
        fprintf(stderr, "kvpq serve: cannot start the engine thread (out of memory)\n");
        return -1;
    }
    return 0;
}

void serve_engine_stop(serve_server *sv) {
    pthread_mutex_lock(&sv->mu);
    sv->stop_engine = 1;
    pthread_cond_signal(&sv->engine_cond);
    pthread_mutex_unlock(&sv->mu);
    pthread_join(sv->engine, NULL);
    free(g_engine.seq);
    free(g_engine.work);
    free(g_engine.idx);
    free(g_engine.slot);
    free(g_engine.caches);
    free(g_engine.rows);
    free(g_engine.n_rows);
    free(g_engine.logits);
}
