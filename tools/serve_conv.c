/* serve_conv.c — the conversations `kvpq serve` holds: one KV cache per conversation with the tokens
 * it holds, found again by the longest shared token prefix, evicted least recently used first to
 * --cache-dir as a saved cache (kvpq_cache_save: checksummed, atomic) and loaded back when the
 * conversation continues. With --kv-budget (CPU caches) every cache takes its pages from one
 * kvpq_page_pool of that budget, and a page the pool refuses (KVPQ_ERR_BUDGET) is what evicts: the
 * engine reserves each sequence's next positions before a round (kvpq_cache_reserve) and, refused,
 * evicts the least recently used idle conversation and tries again (serve_convs_make_room).
 * Engine thread only. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "serve.h"

/* The saved cache's caller blob: magic, model fingerprint (16 hex digits), the last prompt's end
 * (uint64), the tokens (int32). */
#define BLOB_MAGIC "KVPQSRV1"
#define BLOB_HEAD (8 + 16 + 8)

struct serve_conv_store {
    serve_server *sv;
    serve_conv **c;
    int n, cap, next_id;
    uint64_t clock;
    double evictions, restores;
    kvpq_page_pool *pool; /* --kv-budget with CPU caches: every conversation's pages; else NULL */
    int over;             /* the pool's budget lifted until the round ends (no idle conversation was left) */
};

static void conv_path(const serve_conv_store *cs, int id, char *out, size_t cap) {
    snprintf(out, cap, "%s/conv-%d.kvpq", cs->sv->o.cache_dir, id);
}

static void conv_free(serve_conv *c) {
    if (!c) return;
    kvpq_cache_free(c->cache);
    free(c->toks);
    free(c);
}

static serve_conv *conv_add(serve_conv_store *cs, int id) {
    if (cs->n == cs->cap) {
        int cap = cs->cap ? 2 * cs->cap : 16;
        serve_conv **nc = realloc(cs->c, (size_t)cap * sizeof *nc);
        if (!nc) return NULL;
        cs->c = nc;
        cs->cap = cap;
    }
    serve_conv *c = calloc(1, sizeof *c);
    if (!c) return NULL;
    c->id = id;
    if (id >= cs->next_id) cs->next_id = id + 1;
    cs->c[cs->n++] = c;
    return c;
}

/* Remove conversation i (its saved file too). */
static void conv_remove(serve_conv_store *cs, int i) {
    serve_conv *c = cs->c[i];
    if (c->saved) {
        char p[4096];
        conv_path(cs, c->id, p, sizeof p);
        unlink(p);
    }
    conv_free(c);
    cs->c[i] = cs->c[--cs->n];
}

int serve_conv_push(serve_conv *c, const int32_t *t, size_t n) {
    if (c->n + n > c->cap) {
        size_t cap = (c->n + n) * 2 + 64;
        int32_t *nt = realloc(c->toks, cap * sizeof *nt);
        if (!nt) return -1;
        c->toks = nt;
        c->cap = cap;
    }
    memcpy(c->toks + c->n, t, n * sizeof *t);
    c->n += n;
    return 0;
}

/* ---- saving and loading ---- */

static unsigned char *blob_make(const serve_conv_store *cs, const serve_conv *c, size_t *len) {
    *len = BLOB_HEAD + c->n * sizeof(int32_t);
    unsigned char *b = malloc(*len);
    if (!b) return NULL;
    memcpy(b, BLOB_MAGIC, 8);
    memcpy(b + 8, cs->sv->mi.fingerprint, 16);
    uint64_t pe = c->prompt_end;
    memcpy(b + 24, &pe, 8);
    if (c->n) memcpy(b + BLOB_HEAD, c->toks, c->n * sizeof(int32_t));
    return b;
}

/* The tokens of a blob of this model (malloc'd, *n; *prompt_end), NULL when it is not one. */
static int32_t *blob_tokens(const serve_conv_store *cs, const unsigned char *b, size_t len, size_t *n,
                            size_t *prompt_end) {
    if (!b || len < BLOB_HEAD || (len - BLOB_HEAD) % sizeof(int32_t) || memcmp(b, BLOB_MAGIC, 8) ||
        memcmp(b + 8, cs->sv->mi.fingerprint, 16))
        return NULL;
    *n = (len - BLOB_HEAD) / sizeof(int32_t);
    uint64_t pe;
    memcpy(&pe, b + 24, 8);
    *prompt_end = pe < *n ? (size_t)pe : *n;
    int32_t *t = malloc((*n ? *n : 1) * sizeof *t);
    if (t && *n) memcpy(t, b + BLOB_HEAD, *n * sizeof *t);
    return t;
}

/* Save c's cache to --cache-dir and free it; 0, or -1 (message printed, cache kept). */
static int conv_save(serve_conv_store *cs, serve_conv *c) {
    char p[4096];
    conv_path(cs, c->id, p, sizeof p);
    size_t len;
    unsigned char *b = blob_make(cs, c, &len);
    kvpq_status s = b ? kvpq_cache_save(c->cache, p, b, len) : KVPQ_ERR_NOMEM;
    free(b);
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq serve: saving conversation %d: %s: %s\n", c->id, kvpq_status_string(s), kvpq_last_error());
        return -1;
    }
    struct stat st;
    c->saved_bytes = stat(p, &st) == 0 ? (size_t)st.st_size : 0;
    kvpq_cache_free(c->cache);
    c->cache = NULL;
    c->saved = 1;
    return 0;
}

/* Load c's saved cache; 0, or -1 (the file is unusable: the conversation starts empty). */
static int conv_restore(serve_conv_store *cs, serve_conv *c) {
    char p[4096];
    conv_path(cs, c->id, p, sizeof p);
    void *user = NULL;
    size_t ulen = 0, n = 0, pe = 0;
    kvpq_cache *cache = NULL;
    kvpq_status s;
    while ((s = kvpq_cache_load(&cache, &cs->sv->proto.params, p, &user, &ulen)) == KVPQ_ERR_BUDGET &&
           serve_convs_make_room(cs))
        ;
    int32_t *t = s == KVPQ_OK ? blob_tokens(cs, user, ulen, &n, &pe) : NULL;
    free(user);
    unlink(p);
    c->saved = 0;
    c->saved_bytes = 0;
    if (!t || n != c->n || memcmp(t, c->toks, n * sizeof *t) || kvpq_cache_seq_len(cache, 0) != (int)n) {
        fprintf(stderr, "kvpq serve: conversation %d: its saved cache is unusable (%s); evaluated again\n", c->id,
                s != KVPQ_OK ? kvpq_last_error() : "tokens differ");
        free(t);
        kvpq_cache_free(cache);
        c->n = 0;
        return -1;
    }
    free(t);
    c->cache = cache;
    cs->restores++;
    return 0;
}

/* Conversations a previous run saved in --cache-dir (files of another model or cache are skipped).
 * Each is loaded to check it, outside the pool (the budget is for the conversations kept). */
static void convs_scan(serve_conv_store *cs) {
    DIR *d = opendir(cs->sv->o.cache_dir);
    if (!d) return;
    kvpq_cache_params cp = cs->sv->proto.params;
    cp.pool = NULL;
    struct dirent *e;
    while ((e = readdir(d))) {
        int id, end = 0;
        if (sscanf(e->d_name, "conv-%d.kvpq%n", &id, &end) != 1 || e->d_name[end] || id < 0) continue;
        char p[4096];
        conv_path(cs, id, p, sizeof p);
        void *user = NULL;
        size_t ulen = 0, n = 0, pe = 0;
        kvpq_cache *cache = NULL;
        kvpq_status s = kvpq_cache_load(&cache, &cp, p, &user, &ulen);
        int32_t *t = s == KVPQ_OK ? blob_tokens(cs, user, ulen, &n, &pe) : NULL;
        free(user);
        kvpq_cache_free(cache);
        serve_conv *c = t ? conv_add(cs, id) : NULL;
        if (!c) {
            fprintf(stderr, "kvpq serve: %s: not a conversation of this model and cache; left alone\n", p);
            free(t);
            continue;
        }
        struct stat st;
        c->toks = t;
        c->n = c->cap = n;
        c->prompt_end = pe;
        c->saved = 1;
        c->saved_bytes = stat(p, &st) == 0 ? (size_t)st.st_size : 0;
    }
    closedir(d);
}

serve_conv_store *serve_convs_new(serve_server *sv) {
    serve_conv_store *cs = calloc(1, sizeof *cs);
    if (!cs) return NULL;
    cs->sv = sv;
    if (sv->o.cache_dir) convs_scan(cs);
    /* the CUDA form keeps its pages on the device: its budget stays the sum of resident bytes */
    if (sv->o.kv_budget && sv->proto.params.backend != KVPQ_BACKEND_CUDA) {
        if (kvpq_page_pool_new(&cs->pool, sv->o.kv_budget) != KVPQ_OK) {
            serve_convs_free(cs); /* with the conversations convs_scan found */
            return NULL;
        }
        sv->proto.params.pool = cs->pool;
    }
    return cs;
}

void serve_convs_free(serve_conv_store *cs) {
    if (!cs) return;
    for (int i = 0; i < cs->n; i++) conv_free(cs->c[i]);
    free(cs->c);
    if (cs->pool) cs->sv->proto.params.pool = NULL;
    kvpq_page_pool_free(cs->pool);
    free(cs);
}

/* ---- finding a conversation ---- */

static size_t lcp(const int32_t *a, size_t na, const int32_t *b, size_t nb) {
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i]) i++;
    return i;
}

/* The idle conversation this prompt continues: the one sharing the longest prefix, taken when the
 * prompt holds all of that conversation's last prompt (it may differ within the reply the server
 * generated: a reply cut by a stop sequence, or whose text tokenizes differently). A prompt that
 * shares less (another user with the same system prompt, an edited message) starts its own
 * conversation and leaves the other one as it is. */
static serve_conv *find(serve_conv_store *cs, const int32_t *prompt, size_t n, size_t *shared) {
    serve_conv *best = NULL;
    size_t best_l = 0;
    for (int i = 0; i < cs->n; i++) {
        serve_conv *c = cs->c[i];
        if (c->busy) continue;
        size_t l = lcp(c->toks, c->n, prompt, n);
        if (l > best_l && l >= c->prompt_end) best = c, best_l = l;
    }
    *shared = best_l;
    return best;
}

serve_conv *serve_conv_acquire(serve_conv_store *cs, const int32_t *prompt, size_t n, char *err, size_t errlen) {
    size_t shared = 0;
    serve_conv *c = find(cs, prompt, n, &shared);
    if (!c && !(c = conv_add(cs, cs->next_id))) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->busy = 1; /* not evicted to make room for its own restore */
    if (!c->cache && c->saved && conv_restore(cs, c)) shared = 0;
    if (!c->cache) {
        kvpq_status s = kvpq_cache_new(&c->cache, &cs->sv->proto.params);
        if (s != KVPQ_OK) {
            snprintf(err, errlen, "cache: %s: %s", kvpq_status_string(s), kvpq_last_error());
            c->busy = 0;
            return NULL;
        }
        c->n = shared = 0;
    }
    if (shared > n - 1) shared = n - 1; /* the last prompt token is evaluated again: its logits */
    int keep = kvpq_cache_exact_prefix(c->cache, (int)shared);
    if (kvpq_cache_truncate(c->cache, keep) != KVPQ_OK) { /* a sliding window freed the cut: start over */
        kvpq_cache_free(c->cache);
        c->cache = NULL;
        keep = 0;
        kvpq_status s = kvpq_cache_new(&c->cache, &cs->sv->proto.params);
        if (s != KVPQ_OK) {
            snprintf(err, errlen, "cache: %s: %s", kvpq_status_string(s), kvpq_last_error());
            c->n = 0;
            c->busy = 0;
            return NULL;
        }
    }
    c->n = (size_t)keep;
    c->prompt_end = n;
    c->busy = 1;
    c->last_used = ++cs->clock;
    return c;
}

void serve_conv_release(serve_conv_store *cs, serve_conv *c) {
    c->busy = 0;
    c->last_used = ++cs->clock;
}

/* ---- memory ---- */

/* The least recently used idle conversation (resident ones only when `resident`), or -1. */
static int lru(const serve_conv_store *cs, int resident) {
    int best = -1;
    for (int i = 0; i < cs->n; i++) {
        const serve_conv *c = cs->c[i];
        if (c->busy || (resident && !c->cache)) continue;
        if (best < 0 || c->last_used < cs->c[best]->last_used) best = i;
    }
    return best;
}

static size_t resident_total(const serve_conv_store *cs) {
    size_t t = 0;
    for (int i = 0; i < cs->n; i++) t += cs->c[i]->cache ? kvpq_cache_resident_bytes(cs->c[i]->cache) : 0;
    return t;
}

/* Evict conversation i: saved to --cache-dir, else dropped (evaluated again if it comes back). */
static void evict(serve_conv_store *cs, int i) {
    cs->evictions++;
    if (cs->sv->o.cache_dir && cs->c[i]->n && conv_save(cs, cs->c[i]) == 0) return;
    conv_remove(cs, i);
}

int serve_convs_make_room(serve_conv_store *cs) {
    if (!cs->pool) return 0;
    int i = lru(cs, 1);
    if (i >= 0) {
        evict(cs, i);
        return 1;
    }
    if (cs->over) return 0;
    cs->over = 1; /* only active sequences left: they exceed the budget until serve_convs_enforce */
    kvpq_page_pool_set_budget(cs->pool, 0);
    return 1;
}

/* Bytes the budget binds: what the pool has handed out, or without one the caches' resident bytes. */
static size_t held_total(const serve_conv_store *cs) {
    if (!cs->pool) return resident_total(cs);
    kvpq_page_pool_stats st;
    kvpq_page_pool_get_stats(cs->pool, &st);
    return st.bytes_in_use;
}

void serve_convs_enforce(serve_conv_store *cs) {
    const size_t budget = cs->sv->o.kv_budget;
    for (int i = cs->n - 1; i >= 0; i--) /* empty ones (a request that failed before any token) */
        if (!cs->c[i]->busy && !cs->c[i]->n && !cs->c[i]->saved) conv_remove(cs, i);
    if (cs->over) { /* the budget back (its free pages beyond it released) */
        kvpq_page_pool_set_budget(cs->pool, budget);
        cs->over = 0;
    }
    for (size_t total = held_total(cs); budget && total > budget; total = held_total(cs)) {
        int i = lru(cs, 1);
        if (i < 0) break; /* only active sequences left: the budget is exceeded until they end */
        evict(cs, i);
    }
    while (cs->n > cs->sv->o.max_conversations) {
        int i = lru(cs, 0);
        if (i < 0) break;
        conv_remove(cs, i);
    }
}

void serve_convs_save_all(serve_conv_store *cs) {
    if (!cs->sv->o.cache_dir) return;
    for (int i = 0; i < cs->n; i++)
        if (!cs->c[i]->busy && cs->c[i]->cache && cs->c[i]->n) conv_save(cs, cs->c[i]);
}

void serve_convs_measure(serve_conv_store *cs, serve_metrics *m) {
    m->kv_resident_bytes = (double)resident_total(cs);
    m->kv_saved_bytes = 0;
    m->conversations = cs->n;
    m->conversations_saved = 0;
    for (int i = 0; i < cs->n; i++) {
        m->conversations_saved += cs->c[i]->saved;
        m->kv_saved_bytes += cs->c[i]->saved ? (double)cs->c[i]->saved_bytes : 0;
    }
    m->evictions = cs->evictions;
    m->restores = cs->restores;
    kvpq_page_pool_stats st = {0};
    if (cs->pool) kvpq_page_pool_get_stats(cs->pool, &st);
    m->kv_pool_bytes_in_use = (double)st.bytes_in_use;
    m->kv_pool_bytes_free = (double)st.bytes_free;
    m->kv_pool_refused = (double)st.refused;
}
