/* page_pool.c — kvpq_page_pool: the pages and window rings of many CPU caches under one byte budget
 * (kvpq.h "page pool", docs/cache.md "Page pool").
 *
 * Memory given back is kept on a free list per size class (its size rounded up to 64) and handed
 * out again, zeroed, for the next request of that size: the kinds' page sizes differ (and, with
 * per-layer bit allocation, a VQ cache's layers differ), so one list per size rather than one page
 * size for all. A free block holds the list's link in its first bytes. The budget bounds what the
 * pool holds, in use plus free; a request over it first releases free blocks of other sizes.
 * One mutex guards the counters and lists; the system allocator and the zeroing run outside it. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache_impl.h"
#include "internal.h"

typedef struct free_block {
    struct free_block *next;
} free_block;

typedef struct {
    size_t bytes;     /* a 64-byte multiple */
    free_block *head; /* given back, kept for reuse */
    int64_t n;        /* blocks on the list */
} size_class;

struct kvpq_page_pool {
    pthread_mutex_t mu;
    size_t budget;      /* 0 = unbounded */
    size_t in_use, free_bytes;
    int64_t pages_in_use, allocs, reused, refused;
    size_class *cls;    /* (n_cls) */
    int n_cls, cap_cls;
    int64_t refs;       /* the creator's (until kvpq_page_pool_free) plus one per cache */
    int64_t caches;
};

static size_t round64(size_t bytes) { return bytes ? (bytes + 63) / 64 * 64 : 64; }

static size_class *find_class(kvpq_page_pool *pool, size_t bytes) {
    for (int i = 0; i < pool->n_cls; i++)
        if (pool->cls[i].bytes == bytes) return &pool->cls[i];
    return NULL;
}

/* Move c's first free block onto *dead (to be given to the system after the mutex is released). */
static void class_pop_free(kvpq_page_pool *pool, size_class *c, free_block **dead) {
    free_block *b = c->head;
    c->head = b->next;
    c->n--;
    pool->free_bytes -= c->bytes;
    b->next = *dead;
    *dead = b;
}

/* Release free blocks (of any size) while the pool would hold more than `limit` bytes after taking
 * `more`: unlinked onto the returned list under the mutex, for free_blocks once it is released. */
static free_block *release_free(kvpq_page_pool *pool, size_t more, size_t limit) {
    free_block *dead = NULL;
    for (int i = 0; i < pool->n_cls; i++)
        while (pool->cls[i].head && pool->in_use + pool->free_bytes + more > limit)
            class_pop_free(pool, &pool->cls[i], &dead);
    return dead;
}

static void free_blocks(free_block *b) {
    while (b) {
        free_block *next = b->next;
        free(b);
        b = next;
    }
}

static kvpq_status system_get(size_t sz, void **out) {
    void *p = aligned_alloc(64, sz);
    if (!p) return kvpq__err(KVPQ_ERR_NOMEM, "cache: out of memory for a page of %zu bytes", sz);
    /* zeroed: a saved cache writes whole pages, and the slots past the last position must not carry
     * whatever the allocator (or the page's previous cache) left there */
    memset(p, 0, sz);
    *out = p;
    return KVPQ_OK;
}

kvpq_status kvpq__pool_get(kvpq_page_pool *pool, size_t bytes, void **out) {
    const size_t sz = round64(bytes);
    *out = NULL;
    if (!pool) return system_get(sz, out);
    pthread_mutex_lock(&pool->mu);
    size_class *c = find_class(pool, sz);
    if (c && c->head) {
        free_block *b = c->head;
        c->head = b->next;
        c->n--;
        pool->free_bytes -= sz;
        pool->in_use += sz;
        pool->pages_in_use++;
        pool->allocs++;
        pool->reused++;
        pthread_mutex_unlock(&pool->mu);
        memset(b, 0, sz);
        *out = b;
        return KVPQ_OK;
    }
    free_block *dead = NULL;
    if (pool->budget && pool->in_use + pool->free_bytes + sz > pool->budget) {
        dead = release_free(pool, sz, pool->budget);
        if (pool->in_use + sz > pool->budget) {
            const size_t budget = pool->budget, in_use = pool->in_use;
            pool->refused++;
            pthread_mutex_unlock(&pool->mu);
            free_blocks(dead);
            return kvpq__err(KVPQ_ERR_BUDGET,
                             "page pool: a page of %zu bytes would exceed the budget of %zu bytes (%zu in use)", sz,
                             budget, in_use);
        }
    }
    /* counted now, so that threads allocating at once cannot pass the budget together */
    pool->in_use += sz;
    pool->pages_in_use++;
    pool->allocs++;
    pthread_mutex_unlock(&pool->mu);
    free_blocks(dead);
    kvpq_status s = system_get(sz, out);
    if (s != KVPQ_OK) {
        pthread_mutex_lock(&pool->mu);
        pool->in_use -= sz;
        pool->pages_in_use--;
        pool->allocs--;
        pthread_mutex_unlock(&pool->mu);
    }
    return s;
}

void kvpq__pool_put(kvpq_page_pool *pool, void *p, size_t bytes) {
    if (!p) return;
    if (!pool) {
        free(p);
        return;
    }
    const size_t sz = round64(bytes);
    pthread_mutex_lock(&pool->mu);
    pool->in_use -= sz;
    pool->pages_in_use--;
    size_class *c = find_class(pool, sz);
    if (!c && pool->n_cls == pool->cap_cls) { /* a new size: grow the class table */
        int cap = pool->cap_cls ? 2 * pool->cap_cls : 8;
        size_class *nc = realloc(pool->cls, (size_t)cap * sizeof *nc);
        if (nc) pool->cls = nc, pool->cap_cls = cap;
    }
    if (!c && pool->n_cls < pool->cap_cls) {
        c = &pool->cls[pool->n_cls++];
        *c = (size_class){.bytes = sz};
    }
    /* kept unless there is no list for it or the pool already holds more than a lowered budget */
    int keep = c && !(pool->budget && pool->in_use + pool->free_bytes + sz > pool->budget);
    if (keep) {
        free_block *b = p;
        b->next = c->head;
        c->head = b;
        c->n++;
        pool->free_bytes += sz;
    }
    pthread_mutex_unlock(&pool->mu);
    if (!keep) free(p);
}

static void pool_destroy(kvpq_page_pool *pool) {
    free_blocks(release_free(pool, 0, 0)); /* the last reference: no other thread holds the pool */
    free(pool->cls);
    pthread_mutex_destroy(&pool->mu);
    free(pool);
}

void kvpq__pool_ref(kvpq_page_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->refs++;
    pool->caches++;
    pthread_mutex_unlock(&pool->mu);
}

static void unref(kvpq_page_pool *pool, int cache) {
    pthread_mutex_lock(&pool->mu);
    pool->caches -= cache;
    const int64_t left = --pool->refs;
    pthread_mutex_unlock(&pool->mu);
    if (left == 0) pool_destroy(pool);
}

void kvpq__pool_unref(kvpq_page_pool *pool) {
    if (pool) unref(pool, 1);
}

// ---- public API ------------------------------------------------------------------------------

kvpq_status kvpq_page_pool_new(kvpq_page_pool **out, size_t budget_bytes) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_page_pool_new: out is NULL");
    *out = NULL;
    kvpq_page_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_page_pool_new: out of memory");
    if (pthread_mutex_init(&pool->mu, NULL)) {
        free(pool);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_page_pool_new: cannot create its mutex");
    }
    pool->budget = budget_bytes;
    pool->refs = 1;
    *out = pool;
    return KVPQ_OK;
}

void kvpq_page_pool_free(kvpq_page_pool *pool) {
    if (pool) unref(pool, 0);
}

kvpq_status kvpq_page_pool_set_budget(kvpq_page_pool *pool, size_t budget_bytes) {
    if (!pool) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_page_pool_set_budget: pool is NULL");
    pthread_mutex_lock(&pool->mu);
    pool->budget = budget_bytes;
    free_block *dead = budget_bytes ? release_free(pool, 0, budget_bytes) : NULL;
    pthread_mutex_unlock(&pool->mu);
    free_blocks(dead);
    return KVPQ_OK;
}

void kvpq_page_pool_trim(kvpq_page_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    free_block *dead = release_free(pool, 0, 0);
    pthread_mutex_unlock(&pool->mu);
    free_blocks(dead);
}

kvpq_status kvpq_page_pool_get_stats(const kvpq_page_pool *cpool, kvpq_page_pool_stats *st) {
    if (!cpool || !st) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_page_pool_get_stats: NULL argument");
    kvpq_page_pool *pool = (kvpq_page_pool *)cpool; /* the mutex only */
    pthread_mutex_lock(&pool->mu);
    int64_t n_free = 0;
    for (int i = 0; i < pool->n_cls; i++) n_free += pool->cls[i].n;
    *st = (kvpq_page_pool_stats){
        .budget_bytes = pool->budget,
        .bytes_in_use = pool->in_use,
        .bytes_free = pool->free_bytes,
        .pages_in_use = pool->pages_in_use,
        .pages_free = n_free,
        .allocs = pool->allocs,
        .reused = pool->reused,
        .refused = pool->refused,
        .caches = pool->caches,
    };
    pthread_mutex_unlock(&pool->mu);
    return KVPQ_OK;
}
