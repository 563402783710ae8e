/* test_page_pool.c — kvpq_page_pool (src/cache/page_pool.c): caches of every CPU kind take their
 * pages and window rings from one pool. Freed pages are reused (the pool's bytes do not grow over
 * repeated fill / free cycles); a budget refusal (KVPQ_ERR_BUDGET) changes nothing, and the cache
 * appends again once another cache of the pool gives pages back; two caches share one budget;
 * attention, read-back and the saved file of a pooled cache (on reused, dirty pages) equal an
 * unpooled cache's bit for bit; kvpq_cache_reserve makes later appends allocate nothing; threads
 * appending to caches of one pool at once keep the counts exact and the budget. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "kvpq.h"

#define N_LAYER 2
#define N_HEAD 8
#define N_HEAD_KV 2
#define HD 64
#define WINDOW 32
#define PAGE 32
#define KVW ((size_t)N_HEAD_KV * HD)
#define QW ((size_t)N_HEAD * HD)

static const kvpq_cache_type KINDS[] = {KVPQ_CACHE_FP32, KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,  KVPQ_CACHE_Q4_0,
                                        KVPQ_CACHE_Q8_0R, KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4, KVPQ_CACHE_VQ};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

static kvpq_codebook *g_cb;

/* A d4b8 codebook whose layer 1 codes keys with M 8 and values with M 32 (per-layer bit
 * allocation): the VQ cache's two layers have pages of different sizes. */
static void setup(void) {
    g_cb = test_codebook(&(test_codebook_spec){.n_layer = N_LAYER, .n_head_kv = N_HEAD_KV, .head_dim = HD, .norm = 1,
                                               .seed = 7, .seed_step = 1, .scale = 1.0f});
    cr_assert_not_null(g_cb, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_set_layer_key_M(g_cb, 1, 8), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_set_layer_value_M(g_cb, 1, 32), KVPQ_OK, "%s", kvpq_last_error());
}
static void teardown(void) { kvpq_codebook_free(g_cb); }

static kvpq_cache_params params(kvpq_cache_type t, kvpq_page_pool *pool) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = N_LAYER;
    p.n_head = N_HEAD;
    p.n_head_kv = N_HEAD_KV;
    p.head_dim = HD;
    p.max_seq = 1024;
    p.window = WINDOW;
    p.page_tokens = PAGE;
    p.codebook = t == KVPQ_CACHE_VQ ? g_cb : NULL;
    p.n_threads = 1;
    p.sinks = kvpq_cache_default_sinks(t);
    p.pool = pool;
    return p;
}

static kvpq_cache *new_cache(kvpq_cache_type t, kvpq_page_pool *pool) {
    kvpq_cache_params p = params(t, pool);
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s: %s", kvpq_cache_type_name(t), kvpq_last_error());
    return c;
}

/* Append n positions (K, V drawn from seed) to every layer; the first failing status. */
static kvpq_status append(kvpq_cache *c, int n, uint64_t seed) {
    float *k = rand_vec((size_t)n * KVW, seed, 1.0f), *v = rand_vec((size_t)n * KVW, seed + 1, 1.0f);
    kvpq_status s = KVPQ_OK;
    for (int l = 0; l < N_LAYER && s == KVPQ_OK; l++) s = kvpq_cache_append(c, l, n, k, v);
    free(k), free(v);
    return s;
}

/* L positions in uneven pieces (crossing pages and the window). */
static void fill(kvpq_cache *c, int L, uint64_t seed) {
    for (int pos = 0, piece = 1; pos < L; piece = piece * 2 + 3) {
        int n = piece < L - pos ? piece : L - pos;
        cr_assert_eq(append(c, n, seed + (uint64_t)pos * 2), KVPQ_OK, "%s", kvpq_last_error());
        pos += n;
    }
}

static kvpq_page_pool_stats stats(const kvpq_page_pool *pool) {
    kvpq_page_pool_stats st;
    cr_assert_eq(kvpq_page_pool_get_stats(pool, &st), KVPQ_OK);
    return st;
}

/* Everything a cache shows: attention of the newest 3 positions' queries and the read-back K/V of
 * every layer (malloc'd; *n floats). */
static float *snapshot(kvpq_cache *c, uint64_t seed, size_t *n) {
    const int L = kvpq_cache_seq_len(c, 0), nq = L < 3 ? L : 3;
    const size_t per = (size_t)nq * QW + 2 * (size_t)L * KVW;
    float *out = malloc(N_LAYER * per * sizeof *out), *q = rand_vec((size_t)nq * QW, seed, 1.0f);
    for (int l = 0; l < N_LAYER; l++) {
        float *o = out + l * per;
        cr_assert_eq(kvpq_cache_attend(c, l, nq, q, o), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_read(c, l, 0, L, o + (size_t)nq * QW, o + (size_t)nq * QW + (size_t)L * KVW), KVPQ_OK,
                     "%s", kvpq_last_error());
    }
    free(q);
    *n = N_LAYER * per;
    return out;
}

static void expect_same(kvpq_cache *a, kvpq_cache *b, const char *what) {
    cr_assert_eq(kvpq_cache_seq_len(a, 0), kvpq_cache_seq_len(b, 0), "%s", what);
    size_t na, nb;
    float *sa = snapshot(a, 99, &na), *sb = snapshot(b, 99, &nb);
    cr_assert_eq(na, nb);
    cr_assert(!memcmp(sa, sb, na * sizeof *sa), "%s: attention or read-back differs", what);
    free(sa), free(sb);
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*n ? *n : 1);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

TestSuite(page_pool, .init = setup, .fini = teardown);

Test(page_pool, pages_are_reused_after_free) {
    for (int i = 0; i < N_KINDS; i++) {
        const char *tn = kvpq_cache_type_name(KINDS[i]);
        kvpq_page_pool *pool = NULL;
        cr_assert_eq(kvpq_page_pool_new(&pool, 0), KVPQ_OK);
        size_t held = 0;
        for (int cycle = 0; cycle < 5; cycle++) {
            kvpq_cache *a = new_cache(KINDS[i], pool), *b = new_cache(KINDS[i], pool);
            fill(a, 300, 10 + cycle), fill(b, 170, 20 + cycle);
            kvpq_page_pool_stats st = stats(pool);
            cr_assert_gt(st.bytes_in_use, 0, "%s", tn);
            cr_assert_eq(st.caches, 2, "%s", tn);
            /* the pool holds what the caches' resident bytes count for their pages and rings */
            cr_assert_leq(st.bytes_in_use, kvpq_cache_resident_bytes(a) + kvpq_cache_resident_bytes(b), "%s", tn);
            if (cycle == 0) held = st.bytes_in_use + st.bytes_free;
            cr_assert_eq(st.bytes_in_use + st.bytes_free, held, "%s cycle %d: the pool grew from %zu to %zu bytes", tn,
                         cycle, held, st.bytes_in_use + st.bytes_free);
            /* truncate gives pages back; the refill takes the same ones */
            cr_assert_eq(kvpq_cache_truncate(a, 0), KVPQ_OK);
            cr_assert_lt(stats(pool).bytes_in_use, st.bytes_in_use, "%s", tn);
            fill(a, 300, 30 + cycle);
            cr_assert_eq(stats(pool).bytes_in_use + stats(pool).bytes_free, held, "%s cycle %d after refill", tn, cycle);
            kvpq_cache_free(a), kvpq_cache_free(b);
            st = stats(pool);
            cr_assert_eq(st.bytes_in_use, 0, "%s: %zu bytes still in use after every cache was freed", tn,
                         st.bytes_in_use);
            cr_assert_eq(st.bytes_free, held, "%s", tn);
            cr_assert_eq(st.caches, 0, "%s", tn);
            if (cycle > 0) cr_assert_gt(st.reused, 0, "%s", tn);
        }
        kvpq_page_pool_stats st = stats(pool);
        cr_assert_eq(st.allocs - st.reused, st.pages_free, "%s: pages taken from the system beyond the first cycle's", tn);
        kvpq_page_pool_trim(pool);
        cr_assert_eq(stats(pool).bytes_free, 0);
        cr_assert_eq(stats(pool).pages_free, 0);
        kvpq_page_pool_free(pool);
    }
}

Test(page_pool, budget_refusal_leaves_the_cache_intact) {
    for (int i = 0; i < N_KINDS; i++) {
        const char *tn = kvpq_cache_type_name(KINDS[i]);
        /* the budget: what a cache of 100 positions (a, below) and one of 200 hold */
        kvpq_page_pool *probe = NULL;
        cr_assert_eq(kvpq_page_pool_new(&probe, 0), KVPQ_OK);
        kvpq_cache *pc = new_cache(KINDS[i], probe), *pd = new_cache(KINDS[i], probe);
        fill(pc, 100, 1), fill(pd, 200, 1);
        const size_t budget = stats(probe).bytes_in_use;
        kvpq_cache_free(pc), kvpq_cache_free(pd);
        kvpq_page_pool_free(probe);

        kvpq_page_pool *pool = NULL;
        cr_assert_eq(kvpq_page_pool_new(&pool, budget), KVPQ_OK);
        kvpq_cache *a = new_cache(KINDS[i], pool), *b = new_cache(KINDS[i], pool), *ref = new_cache(KINDS[i], NULL);
        fill(a, 100, 2);
        /* b grows in steps of 7 positions, each reserved first (as kvpq serve does: a refusal then
         * comes before any layer changed), until the pool refuses; ref, unpooled, takes the same */
        int n_b = 0;
        kvpq_status s = KVPQ_OK;
        for (; n_b < 1000; n_b += 7) {
            if ((s = kvpq_cache_reserve(b, n_b + 7)) != KVPQ_OK) break;
            const int64_t allocs = stats(pool).allocs;
            cr_assert_eq(append(b, 7, 1000 + (uint64_t)n_b), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
            cr_assert_eq(stats(pool).allocs, allocs, "%s: an append after reserve allocated", tn);
            cr_assert_eq(append(ref, 7, 1000 + (uint64_t)n_b), KVPQ_OK);
        }
        cr_assert_geq(n_b, 196, "%s: refused at %d positions: %s", tn, n_b, kvpq_last_error());
        cr_assert_eq(s, KVPQ_ERR_BUDGET, "%s: %s (%s)", tn, kvpq_status_string(s), kvpq_last_error());
        cr_assert(strstr(kvpq_last_error(), "budget"), "%s: message '%s'", tn, kvpq_last_error());
        cr_assert_str_eq(kvpq_status_string(s), "budget exceeded");
        kvpq_page_pool_stats st = stats(pool);
        cr_assert_leq(st.bytes_in_use + st.bytes_free, budget, "%s", tn);
        cr_assert_gt(st.refused, 0);
        /* the refused reserve changed nothing: b holds n_b positions in every layer, as ref does */
        for (int l = 0; l < N_LAYER; l++) cr_assert_eq(kvpq_cache_seq_len(b, l), n_b, "%s layer %d", tn, l);
        expect_same(b, ref, tn);
        /* after a gives its pages back, b carries on, and still equals the unpooled cache */
        kvpq_cache_free(a);
        cr_assert_eq(append(b, 7, 1000 + (uint64_t)n_b), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
        cr_assert_eq(append(ref, 7, 1000 + (uint64_t)n_b), KVPQ_OK);
        expect_same(b, ref, tn);
        kvpq_cache_free(b), kvpq_cache_free(ref);
        cr_assert_eq(stats(pool).bytes_in_use, 0, "%s", tn);
        kvpq_page_pool_free(pool);
    }
}

Test(page_pool, refusal_within_one_append_changes_nothing) {
    /* One layer's append refused: its length, attention and read-back are those before the call. */
    for (int i = 0; i < N_KINDS; i++) {
        const char *tn = kvpq_cache_type_name(KINDS[i]);
        kvpq_page_pool *pool = NULL;
        cr_assert_eq(kvpq_page_pool_new(&pool, 0), KVPQ_OK);
        kvpq_cache *c = new_cache(KINDS[i], pool);
        fill(c, 90, 3);
        const kvpq_page_pool_stats before = stats(pool);
        cr_assert_eq(kvpq_page_pool_set_budget(pool, before.bytes_in_use), KVPQ_OK); /* nothing more */
        size_t n0, n1;
        float *s0 = snapshot(c, 5, &n0);
        float *k = rand_vec(200 * KVW, 4, 1.0f), *v = rand_vec(200 * KVW, 5, 1.0f);
        kvpq_status s = kvpq_cache_append(c, 0, 200, k, v);
        cr_assert_eq(s, KVPQ_ERR_BUDGET, "%s: %s", tn, kvpq_status_string(s));
        cr_assert_eq(kvpq_cache_seq_len(c, 0), 90, "%s", tn);
        cr_assert_eq(stats(pool).bytes_in_use, before.bytes_in_use, "%s: the refused append kept pages", tn);
        float *s1 = snapshot(c, 5, &n1);
        cr_assert(n0 == n1 && !memcmp(s0, s1, n0 * sizeof *s0), "%s: the refused append changed the cache", tn);
        /* reserve refused likewise; with room, reserve then append takes nothing more */
        cr_assert_eq(kvpq_cache_reserve(c, 290), KVPQ_ERR_BUDGET, "%s", tn);
        cr_assert_eq(stats(pool).bytes_in_use, before.bytes_in_use, "%s: the refused reserve kept pages", tn);
        cr_assert_eq(kvpq_page_pool_set_budget(pool, 0), KVPQ_OK);
        cr_assert_eq(kvpq_cache_reserve(c, 290), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
        const int64_t allocs = stats(pool).allocs;
        for (int l = 0; l < N_LAYER; l++) cr_assert_eq(kvpq_cache_append(c, l, 200, k, v), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(stats(pool).allocs, allocs, "%s: appends after reserve allocated", tn);
        /* the reserved cache equals one that never reserved */
        kvpq_cache *ref = new_cache(KINDS[i], NULL);
        fill(ref, 90, 3);
        for (int l = 0; l < N_LAYER; l++) cr_assert_eq(kvpq_cache_append(ref, l, 200, k, v), KVPQ_OK);
        expect_same(c, ref, tn);
        /* spare reserved storage goes back at truncate to the current length */
        cr_assert_eq(kvpq_cache_reserve(c, 600), KVPQ_OK);
        const size_t reserved = stats(pool).bytes_in_use;
        cr_assert_eq(kvpq_cache_truncate(c, 290), KVPQ_OK);
        cr_assert_lt(stats(pool).bytes_in_use, reserved, "%s", tn);
        cr_assert_eq(kvpq_cache_reserve(c, 1025), KVPQ_ERR_CAPACITY);
        cr_assert_eq(kvpq_cache_reserve(c, -1), KVPQ_ERR_INVALID_ARG);
        free(s0), free(s1), free(k), free(v);
        kvpq_cache_free(c), kvpq_cache_free(ref);
        kvpq_page_pool_free(pool);
    }
}

Test(page_pool, two_caches_share_the_budget) {
    for (int i = 0; i < N_KINDS; i++) {
        const char *tn = kvpq_cache_type_name(KINDS[i]);
        kvpq_page_pool *pool = NULL;
        const size_t budget = 256 * 1024;
        cr_assert_eq(kvpq_page_pool_new(&pool, budget), KVPQ_OK);
        kvpq_cache *c[2] = {new_cache(KINDS[i], pool), new_cache(KINDS[i], pool)};
        int n[2] = {0, 0}, full[2] = {0, 0};
        for (int step = 0; !(full[0] && full[1]) && step < 400; step++) {
            const int w = step % 2;
            if (full[w]) continue;
            kvpq_status s = append(c[w], 5, 50 + (uint64_t)step);
            if (s == KVPQ_ERR_BUDGET) {
                full[w] = 1;
                cr_assert_eq(kvpq_cache_truncate(c[w], n[w]), KVPQ_OK);
            } else {
                cr_assert_eq(s, KVPQ_OK, "%s: %s", tn, kvpq_last_error());
                n[w] += 5;
            }
            kvpq_page_pool_stats st = stats(pool);
            cr_assert_leq(st.bytes_in_use + st.bytes_free, budget, "%s: the pool holds %zu bytes", tn,
                          st.bytes_in_use + st.bytes_free);
        }
        cr_assert(full[0] && full[1], "%s: the budget never bound (%d, %d positions)", tn, n[0], n[1]);
        /* both grew, and the pool counts both caches' storage */
        cr_assert(n[0] > 0 && n[1] > 0 && n[0] - n[1] <= 40 && n[1] - n[0] <= 40, "%s: %d vs %d positions", tn, n[0],
                  n[1]);
        kvpq_cache_free(c[0]);
        cr_assert_eq(append(c[1], 5, 9999), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
        kvpq_cache_free(c[1]);
        kvpq_page_pool_free(pool);
    }
}

Test(page_pool, pooled_equals_unpooled_bit_for_bit) {
    char pa[256], pb[256];
    snprintf(pa, sizeof pa, "/tmp/kvpq_test_page_pool_%d_a.kvc", (int)getpid());
    snprintf(pb, sizeof pb, "/tmp/kvpq_test_page_pool_%d_b.kvc", (int)getpid());
    for (int i = 0; i < N_KINDS; i++) {
        const char *tn = kvpq_cache_type_name(KINDS[i]);
        kvpq_page_pool *pool = NULL;
        cr_assert_eq(kvpq_page_pool_new(&pool, 0), KVPQ_OK);
        /* dirty free lists: another cache's pages (other data) given back first */
        kvpq_cache *junk = new_cache(KINDS[i], pool);
        fill(junk, 400, 77);
        kvpq_cache_free(junk);
        kvpq_cache *a = new_cache(KINDS[i], pool), *b = new_cache(KINDS[i], NULL);
        fill(a, 333, 8), fill(b, 333, 8);
        cr_assert_gt(stats(pool).reused, 0, "%s", tn);
        expect_same(a, b, tn);
        /* the same saved bytes: reused pages come back zeroed */
        cr_assert_eq(kvpq_cache_save(a, pa, "u", 1), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_save(b, pb, "u", 1), KVPQ_OK, "%s", kvpq_last_error());
        size_t na, nb;
        unsigned char *fa = slurp(pa, &na), *fb = slurp(pb, &nb);
        cr_assert(na == nb && !memcmp(fa, fb, na), "%s: the saved files differ", tn);
        free(fa), free(fb);
        /* a load into the pool takes its pages from it, and equals the original */
        kvpq_cache_params p = params(KINDS[i], pool);
        kvpq_cache *c = NULL;
        const size_t in_use = stats(pool).bytes_in_use;
        cr_assert_eq(kvpq_cache_load(&c, &p, pa, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_gt(stats(pool).bytes_in_use, in_use, "%s", tn);
        expect_same(c, b, tn);
        /* a load the budget does not allow: KVPQ_ERR_BUDGET, nothing kept */
        kvpq_cache_free(c);
        cr_assert_eq(kvpq_page_pool_set_budget(pool, stats(pool).bytes_in_use + 64), KVPQ_OK);
        c = (kvpq_cache *)1;
        cr_assert_eq(kvpq_cache_load(&c, &p, pa, NULL, NULL), KVPQ_ERR_BUDGET, "%s: %s", tn, kvpq_last_error());
        cr_assert_null(c);
        cr_assert_eq(stats(pool).bytes_in_use, in_use, "%s", tn);
        /* continued the same way */
        for (int r = 0; r < 3; r++) {
            cr_assert_eq(kvpq_page_pool_set_budget(pool, 0), KVPQ_OK);
            cr_assert_eq(append(a, 31, 500 + (uint64_t)r), KVPQ_OK);
            cr_assert_eq(append(b, 31, 500 + (uint64_t)r), KVPQ_OK);
            expect_same(a, b, tn);
        }
        /* the pool outlives its creator's reference while a cache holds it */
        kvpq_page_pool_free(pool);
        cr_assert_eq(append(a, 40, 600), KVPQ_OK);
        cr_assert_eq(append(b, 40, 600), KVPQ_OK);
        expect_same(a, b, tn);
        kvpq_cache_free(a), kvpq_cache_free(b);
    }
    unlink(pa), unlink(pb);
}

/* ---- threads ---- */

typedef struct {
    kvpq_page_pool *pool;
    kvpq_cache_type type;
    uint64_t seed;
    int positions, refused;
} worker_arg;

static void *worker(void *p) {
    worker_arg *w = p;
    kvpq_cache_params cp = params(w->type, w->pool);
    for (int round = 0; round < 3; round++) {
        kvpq_cache *c = NULL;
        if (kvpq_cache_new(&c, &cp) != KVPQ_OK) return NULL;
        for (int n = 0; n < 400; n += 9) {
            kvpq_status s = append(c, 9, w->seed + (uint64_t)n);
            if (s == KVPQ_ERR_BUDGET) {
                w->refused++;
                kvpq_cache_truncate(c, n);
                break;
            }
            if (s != KVPQ_OK) {
                kvpq_cache_free(c);
                return NULL;
            }
            w->positions += 9;
        }
        kvpq_cache_free(c);
    }
    return p;
}

Test(page_pool, threads_share_one_pool) {
    enum { T = 4 };
    for (int bounded = 0; bounded < 2; bounded++) {
        const size_t budget = bounded ? 300 * 1024 : 0;
        kvpq_page_pool *pool = NULL;
        cr_assert_eq(kvpq_page_pool_new(&pool, budget), KVPQ_OK);
        pthread_t th[T];
        worker_arg args[T];
        for (int t = 0; t < T; t++) {
            args[t] = (worker_arg){pool, KINDS[t * 2 + 1], 1000 * (uint64_t)t, 0, 0};
            cr_assert_eq(pthread_create(&th[t], NULL, worker, &args[t]), 0);
        }
        int refused = 0;
        for (int t = 0; t < T; t++) {
            void *r;
            pthread_join(th[t], &r);
            cr_assert_not_null(r, "thread %d failed: %s", t, kvpq_last_error());
            refused += args[t].refused;
        }
        kvpq_page_pool_stats st = stats(pool);
        cr_assert_eq(st.bytes_in_use, 0);
        cr_assert_eq(st.pages_in_use, 0);
        cr_assert_eq(st.caches, 0);
        if (bounded) cr_assert_leq(st.bytes_free, budget);
        if (!bounded) cr_assert_eq(refused, 0);
        kvpq_page_pool_free(pool);
    }
}

Test(page_pool, api_errors) {
    cr_assert_eq(kvpq_page_pool_new(NULL, 0), KVPQ_ERR_INVALID_ARG);
    kvpq_page_pool_stats st;
    cr_assert_eq(kvpq_page_pool_get_stats(NULL, &st), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_page_pool_set_budget(NULL, 1), KVPQ_ERR_INVALID_ARG);
    kvpq_page_pool_free(NULL);
    kvpq_page_pool_trim(NULL);
    cr_assert_eq(kvpq_cache_reserve(NULL, 1), KVPQ_ERR_INVALID_ARG);
    kvpq_cache_params p = kvpq_cache_params_default();
    cr_assert_null(p.pool);
}
