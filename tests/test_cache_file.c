/* test_cache_file.c — saved caches (kvpq_cache_save / kvpq_cache_load, src/cache/cache_file.c): a
 * round trip for every kind gives bit-identical attention and read-back, before and after more
 * appends; corrupted, truncated and mismatched files (kind, shape, window, codebook) are refused
 * with a named error; a failed save leaves an existing file as it was and no temporary behind. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <fcntl.h>
#include <time.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "kvpq.h"

#define N_LAYER 2
#define N_HEAD 9
#define N_HEAD_KV 3
#define HD 64
#define WINDOW 64
#define PAGE 64

static kvpq_codebook *make_codebook(int norm, uint64_t seed) {
    kvpq_codebook *cb = test_codebook(&(test_codebook_spec){.n_layer = N_LAYER, .n_head_kv = N_HEAD_KV, .head_dim = HD,
                                                            .norm = norm, .seed = seed, .seed_step = 1, .scale = 1.0f});
    cr_assert_not_null(cb, "%s", kvpq_last_error());
    return cb;
}

static kvpq_cache_params params(kvpq_cache_type t, const kvpq_codebook *cb) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = N_LAYER;
    p.n_head = N_HEAD;
    p.n_head_kv = N_HEAD_KV;
    p.head_dim = HD;
    p.max_seq = 1024;
    p.window = WINDOW;
    p.page_tokens = PAGE;
    p.codebook = cb;
    p.n_threads = 2;
    return p;
}

/* A cache holding L positions per layer, appended in uneven pieces (crossing pages and the window). */
static kvpq_cache *filled(const kvpq_cache_params *p, int L, uint64_t seed) {
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, p), KVPQ_OK, "%s", kvpq_last_error());
    const size_t kvw = (size_t)N_HEAD_KV * HD;
    float *k = rand_vec((size_t)L * kvw, seed, 1.0f), *v = rand_vec((size_t)L * kvw, seed + 1, 1.0f);
    for (int l = 0; l < N_LAYER; l++) {
        int pos = 0, piece = 1;
        while (pos < L) {
            int n = piece < L - pos ? piece : L - pos;
            cr_assert_eq(kvpq_cache_append(c, l, n, k + pos * kvw, v + pos * kvw), KVPQ_OK, "%s", kvpq_last_error());
            pos += n;
            piece = piece * 2 + 3;
        }
    }
    free(k), free(v);
    return c;
}

static unsigned char *slurp(const char *path, size_t *n);
static void spit(const char *path, const unsigned char *b, size_t n);

static void tmp_path(char *buf, size_t n, const char *name) {
    snprintf(buf, n, "/tmp/kvpq_test_cache_file_%d_%s", (int)getpid(), name);
}

/* Attention of every layer for a few queries, and the read-back K/V, must be bit-identical. */
static void expect_same(kvpq_cache *a, kvpq_cache *b, int n_q, uint64_t seed, const char *what) {
    const int L = kvpq_cache_seq_len(a, 0);
    cr_assert_eq(kvpq_cache_seq_len(b, 0), L, "%s: %d vs %d positions", what, kvpq_cache_seq_len(b, 0), L);
    const size_t qw = (size_t)N_HEAD * HD, kvw = (size_t)N_HEAD_KV * HD;
    float *q = rand_vec((size_t)n_q * qw, seed, 1.0f);
    float *oa = malloc((size_t)n_q * qw * sizeof *oa), *ob = malloc((size_t)n_q * qw * sizeof *ob);
    float *ka = malloc((size_t)L * kvw * sizeof *ka), *kb = malloc((size_t)L * kvw * sizeof *kb);
    for (int l = 0; l < N_LAYER; l++) {
        cr_assert_eq(kvpq_cache_attend(a, l, n_q, q, oa), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_attend(b, l, n_q, q, ob), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert(!memcmp(oa, ob, (size_t)n_q * qw * sizeof *oa), "%s layer %d: attention differs after load", what, l);
        cr_assert_eq(kvpq_cache_read(a, l, 0, L, ka, NULL), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(b, l, 0, L, kb, NULL), KVPQ_OK);
        cr_assert(!memcmp(ka, kb, (size_t)L * kvw * sizeof *ka), "%s layer %d: keys differ after load", what, l);
        cr_assert_eq(kvpq_cache_read(a, l, 0, L, NULL, ka), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(b, l, 0, L, NULL, kb), KVPQ_OK);
        cr_assert(!memcmp(ka, kb, (size_t)L * kvw * sizeof *ka), "%s layer %d: values differ after load", what, l);
    }
    kvpq_cache_stats sa, sb;
    kvpq_cache_get_stats(a, &sa), kvpq_cache_get_stats(b, &sb);
    /* bytes: equal but for page-table slack a truncate leaves in the original (a few pointers) */
    cr_assert(sa.resident_bytes >= sb.resident_bytes && sa.resident_bytes - sb.resident_bytes <= 1024,
              "%s: %zu vs %zu bytes", what, sa.resident_bytes, sb.resident_bytes);
    cr_assert_eq(sa.tokens_coded, sb.tokens_coded, "%s", what);
    cr_assert_eq(sa.tokens_window, sb.tokens_window, "%s", what);
    free(q), free(oa), free(ob), free(ka), free(kb);
}

static void append_both(kvpq_cache *a, kvpq_cache *b, int n, uint64_t seed) {
    const size_t kvw = (size_t)N_HEAD_KV * HD;
    float *k = rand_vec((size_t)n * kvw, seed, 1.0f), *v = rand_vec((size_t)n * kvw, seed + 1, 1.0f);
    for (int l = 0; l < N_LAYER; l++) {
        cr_assert_eq(kvpq_cache_append(a, l, n, k, v), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_cache_append(b, l, n, k, v), KVPQ_OK, "%s", kvpq_last_error());
    }
    free(k), free(v);
}

static void round_trip_sinks(kvpq_cache_type t, const kvpq_codebook *cb, int L, int truncate_to, uint64_t seed,
                             int sinks) {
    const char *tn = kvpq_cache_type_name(t);
    kvpq_cache_params p = params(t, cb);
    p.sinks = sinks;
    kvpq_cache *a = filled(&p, L, seed);
    if (truncate_to >= 0) cr_assert_eq(kvpq_cache_truncate(a, truncate_to), KVPQ_OK, "%s", kvpq_last_error());
    char path[256];
    tmp_path(path, sizeof path, "rt.kvc");
    const char blob[] = "model=smol;tokens=1,2,3";
    cr_assert_eq(kvpq_cache_save(a, path, blob, sizeof blob), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
    size_t fn;
    unsigned char *fb = slurp(path, &fn);
    cr_assert_eq(fb[8], sinks > 0 ? 3 : 2, "%s sinks %d: format version %d", tn, sinks, fb[8]); /* v2 unless sinks */
    free(fb);
    kvpq_cache *b = NULL;
    void *user = NULL;
    size_t user_len = 0;
    p.max_seq = 2048; /* a larger max_seq is fine */
    cr_assert_eq(kvpq_cache_load(&b, &p, path, &user, &user_len), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
    cr_assert_eq(user_len, sizeof blob);
    cr_assert(!memcmp(user, blob, sizeof blob));
    free(user);
    char what[64];
    snprintf(what, sizeof what, "%s L %d trunc %d sinks %d", tn, L, truncate_to, sinks);
    if (kvpq_cache_seq_len(a, 0) > 0) expect_same(a, b, 3 < kvpq_cache_seq_len(a, 0) ? 3 : 1, seed + 7, what);
    /* The loaded cache carries on exactly as the original: encode, window flushes, pages. */
    append_both(a, b, 70, seed + 11);
    expect_same(a, b, 1, seed + 13, what);
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    unlink(path);
}

static void round_trip(kvpq_cache_type t, const kvpq_codebook *cb, int L, int truncate_to, uint64_t seed) {
    round_trip_sinks(t, cb, L, truncate_to, seed, 0);
}

static void expect_load_fails(const kvpq_cache_params *p, const char *path, kvpq_status want, const char *needle);

Test(cache_file, round_trip_every_kind_identical_attention) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,  KVPQ_CACHE_Q4_0,
                                            KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4, KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q4_0R};
    static const int lens[] = {1, WINDOW + 31, 300};
    const int nk = (int)(sizeof kinds / sizeof kinds[0]);
    for (int k = 0; k < nk; k++)
        for (int i = 0; i < 3; i++) round_trip(kinds[k], NULL, lens[i], -1, 100u * k + i);
    for (int k = 0; k < nk; k++) round_trip(kinds[k], NULL, 300, 150, 700u + k); /* after a truncate */
    for (int norm = 0; norm < 2; norm++) {
        kvpq_codebook *cb = make_codebook(norm, 50u + norm);
        for (int i = 0; i < 3; i++) round_trip(KVPQ_CACHE_VQ, cb, lens[i], -1, 900u + 10u * norm + i);
        round_trip(KVPQ_CACHE_VQ, cb, 300, 150, 950u + norm);
        kvpq_codebook_free(cb);
    }
    /* 8-bit norm-explicit scales (k.norm_bits / v.norm_bits = "8"): the codes, bytes and each page's
     * references come back; a cache saved with them is refused by the same codebook with float16
     * scales (another page layout: the fingerprint differs) */
    kvpq_codebook *cb8 = make_codebook(1, 52u);
    const uint64_t fp16_fp = kvpq_codebook_fingerprint(cb8);
    cr_assert_eq(kvpq_codebook_set_meta(cb8, "k.norm_bits", "8"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_meta(cb8, "v.norm_bits", "8"), KVPQ_OK);
    cr_assert_neq(kvpq_codebook_fingerprint(cb8), fp16_fp);
    for (int i = 0; i < 3; i++) round_trip(KVPQ_CACHE_VQ, cb8, lens[i], -1, 960u + i);
    round_trip(KVPQ_CACHE_VQ, cb8, 300, 150, 970u);
    /* the codebook's scale bits changed after the cache was made: the cache keeps its 8-bit pages, so
     * its file carries the 8-bit fingerprint; the float16 book refuses it (it once carried the
     * float16 one and loaded under the wrong layout), the 8-bit book loads it */
    {
        kvpq_cache_params p = params(KVPQ_CACHE_VQ, cb8);
        kvpq_cache *a = filled(&p, 300, 980u);
        const uint64_t fp8 = kvpq_codebook_fingerprint(cb8);
        cr_assert_eq(kvpq_codebook_set_meta(cb8, "k.norm_bits", "16"), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_set_meta(cb8, "v.norm_bits", "16"), KVPQ_OK);
        char path[256];
        tmp_path(path, sizeof path, "norm_bits_changed.kvc");
        cr_assert_eq(kvpq_cache_save(a, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
        expect_load_fails(&p, path, KVPQ_ERR_MISMATCH, "another codebook");
        cr_assert_eq(kvpq_codebook_set_meta(cb8, "k.norm_bits", "8"), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_set_meta(cb8, "v.norm_bits", "8"), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_fingerprint(cb8), fp8);
        kvpq_cache *b = NULL;
        cr_assert_eq(kvpq_cache_load(&b, &p, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
        kvpq_cache_free(b);
        kvpq_cache_free(a);
        unlink(path);
    }
    kvpq_codebook_free(cb8);
}

/* The same cache saves to the same bytes whatever the allocator left in its memory: glibc's M_PERTURB
 * fills every new allocation with a byte; two caches built alike under two fill bytes must save
 * identical files (a page's slots past the last position were written out uninitialized before). */
static void save_under_perturb(kvpq_cache_type t, const kvpq_codebook *cb, int L, int fill, unsigned char **b,
                               size_t *n) {
    mallopt(M_PERTURB, fill);
    kvpq_cache_params p = params(t, cb);
    kvpq_cache *c = filled(&p, L, 77u);
    mallopt(M_PERTURB, 0);
    char path[256];
    tmp_path(path, sizeof path, "perturb.kvc");
    cr_assert_eq(kvpq_cache_save(c, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    *b = slurp(path, n);
    kvpq_cache_free(c);
    unlink(path);
}

Test(cache_file, saved_bytes_do_not_depend_on_uninitialized_memory) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,  KVPQ_CACHE_Q4_0,
                                            KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4, KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q4_0R,
                                            KVPQ_CACHE_VQ};
    kvpq_codebook *cb = make_codebook(1, 52u);
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        const kvpq_codebook *b = kinds[k] == KVPQ_CACHE_VQ ? cb : NULL;
        unsigned char *a0, *a1;
        size_t n0, n1;
        save_under_perturb(kinds[k], b, WINDOW + 37, 0x11, &a0, &n0);
        save_under_perturb(kinds[k], b, WINDOW + 37, 0xEE, &a1, &n1);
        size_t at = 0;
        while (at < n0 && at < n1 && a0[at] == a1[at]) at++;
        cr_assert(n0 == n1 && at == n0, "kind %d: saves differ at byte %zu of %zu (sizes %zu / %zu)", (int)kinds[k],
                  at, n0, n0, n1);
        free(a0), free(a1);
    }
    kvpq_codebook_free(cb);
}

/* Sliding-window caches (issue 15 item 7, every kind): layer 0 local (window SW), layer 1 global. The
 * local layer has freed its front pages; the file holds the pages from there on and the loaded cache
 * starts at the same position: identical attention, read-back of what is held, bytes; then it
 * carries on the same. A cache without that sliding window refuses the file. */
#define SW 40
static void expect_load_fails(const kvpq_cache_params *p, const char *path, kvpq_status want, const char *needle);
static void swa_round_trip_sinks(kvpq_cache_type t, const kvpq_codebook *cb, int L, uint64_t seed, int sinks) {
    static const uint8_t swa[N_LAYER] = {1, 0};
    const char *tn = kvpq_cache_type_name(t);
    kvpq_cache_params p = params(t, cb);
    p.sinks = sinks;
    p.sliding_window = SW;
    p.swa_layers = swa;
    kvpq_cache *a = filled(&p, L, seed);
    kvpq_cache_stats sa, sb;
    kvpq_cache_get_stats(a, &sa);
    cr_assert_lt(sa.elements, (int64_t)2 * N_LAYER * L * N_HEAD_KV * HD, "%s: the local layer dropped nothing", tn);
    char path[256];
    tmp_path(path, sizeof path, "swa.kvc");
    cr_assert_eq(kvpq_cache_save(a, path, NULL, 0), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
    kvpq_cache *b = NULL;
    cr_assert_eq(kvpq_cache_load(&b, &p, path, NULL, NULL), KVPQ_OK, "%s: %s", tn, kvpq_last_error());
    const size_t qw = (size_t)N_HEAD * HD, kvw = (size_t)N_HEAD_KV * HD;
    for (int round = 0; round < 2; round++) {
        const int n = kvpq_cache_seq_len(a, 0), from = n - SW + 1 > 0 ? n - SW + 1 : 0;
        cr_assert_eq(kvpq_cache_seq_len(b, 0), n);
        float *q = rand_vec(qw, seed + 5 + round, 1.0f), *oa = malloc(qw * sizeof *oa), *ob = malloc(qw * sizeof *ob);
        float *ka = malloc((size_t)n * kvw * sizeof *ka), *kb = malloc((size_t)n * kvw * sizeof *kb);
        for (int l = 0; l < N_LAYER; l++) {
            cr_assert_eq(kvpq_cache_attend(a, l, 1, q, oa), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_cache_attend(b, l, 1, q, ob), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert(!memcmp(oa, ob, qw * sizeof *oa), "%s round %d layer %d: attention differs", tn, round, l);
            const int r0 = l == 0 ? from : 0; /* the global layer still holds every position */
            cr_assert_eq(kvpq_cache_read(a, l, r0, n - r0, ka, kb), KVPQ_OK, "%s", kvpq_last_error());
            float *ka2 = malloc((size_t)n * kvw * sizeof *ka2), *kb2 = malloc((size_t)n * kvw * sizeof *kb2);
            cr_assert_eq(kvpq_cache_read(b, l, r0, n - r0, ka2, kb2), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert(!memcmp(ka, ka2, (size_t)(n - r0) * kvw * sizeof *ka), "%s layer %d: keys differ", tn, l);
            cr_assert(!memcmp(kb, kb2, (size_t)(n - r0) * kvw * sizeof *kb), "%s layer %d: values differ", tn, l);
            free(ka2), free(kb2);
        }
        /* the dropped front stays dropped in both */
        cr_assert_neq(kvpq_cache_read(b, 0, 0, 1, ka, NULL), KVPQ_OK, "%s: position 0 of the local layer", tn);
        kvpq_cache_get_stats(a, &sa), kvpq_cache_get_stats(b, &sb);
        cr_assert(sa.resident_bytes >= sb.resident_bytes && sa.resident_bytes - sb.resident_bytes <= 1024,
                  "%s: %zu vs %zu bytes", tn, sa.resident_bytes, sb.resident_bytes);
        cr_assert_eq(sa.stored_bytes, sb.stored_bytes, "%s", tn);
        cr_assert_eq(sa.elements, sb.elements, "%s", tn);
        cr_assert_eq(sa.tokens_coded, sb.tokens_coded, "%s", tn);
        free(q), free(oa), free(ob), free(ka), free(kb);
        append_both(a, b, 70, seed + 11); /* carries on: more pages freed alike */
    }
    kvpq_cache_params g = params(t, cb); /* the same shapes, no sliding window */
    g.sinks = sinks;
    expect_load_fails(&g, path, KVPQ_ERR_MISMATCH, "sliding window");
    kvpq_cache_free(a);
    kvpq_cache_free(b);
    unlink(path);
}

static void swa_round_trip(kvpq_cache_type t, const kvpq_codebook *cb, int L, uint64_t seed) {
    swa_round_trip_sinks(t, cb, L, seed, 0);
}

static void expect_load_fails(const kvpq_cache_params *p, const char *path, kvpq_status want, const char *needle) {
    kvpq_cache *c = (kvpq_cache *)p; /* must come back NULL */
    void *user = (void *)p;
    kvpq_status s = kvpq_cache_load(&c, p, path, &user, NULL);
    cr_assert_eq(s, want, "expected %s (%s), got %s: %s", kvpq_status_string(want), needle, kvpq_status_string(s),
                 kvpq_last_error());
    cr_assert_null(c);
    cr_assert_null(user);
    cr_assert(strstr(kvpq_last_error(), needle), "message '%s' lacks '%s'", kvpq_last_error(), needle);
    cr_assert(strstr(kvpq_last_error(), path), "message '%s' does not name the file", kvpq_last_error());
}

static unsigned char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f);
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc(*n);
    cr_assert_eq(fread(b, 1, *n, f), *n);
    fclose(f);
    return b;
}

static void spit(const char *path, const unsigned char *b, size_t n) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(b, 1, n, f), n);
    fclose(f);
}

Test(cache_file, corrupted_truncated_and_mismatched_are_refused) {
    kvpq_codebook *cb = make_codebook(1, 3), *other = make_codebook(1, 4);
    kvpq_cache_params p = params(KVPQ_CACHE_VQ, cb);
    kvpq_cache *a = filled(&p, 200, 17);
    char path[256], bad[256];
    tmp_path(path, sizeof path, "good.kvc");
    tmp_path(bad, sizeof bad, "bad.kvc");
    cr_assert_eq(kvpq_cache_save(a, path, "u", 1), KVPQ_OK, "%s", kvpq_last_error());
    size_t n;
    unsigned char *good = slurp(path, &n);
    /* one flipped bit anywhere: in the header's lens, in the payload, in the checksum */
    const size_t spots[] = {70, n / 2, n - 3};
    for (int i = 0; i < 3; i++) {
        unsigned char *b = malloc(n);
        memcpy(b, good, n);
        b[spots[i]] ^= 0x10;
        spit(bad, b, n);
        expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, i == 0 ? "" : "checksum");
        free(b);
    }
    /* truncated at several places, and a byte too many */
    const size_t cuts[] = {0, 5, 40, n / 3, n - 8, n - 1};
    for (int i = 0; i < 6; i++) {
        spit(bad, good, cuts[i]);
        expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, i < 2 ? "" : "truncated");
    }
    unsigned char *longer = malloc(n + 1);
    memcpy(longer, good, n);
    longer[n] = 0;
    spit(bad, longer, n + 1);
    expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "trailing");
    free(longer);
    /* not a saved cache; another format version */
    spit(bad, (const unsigned char *)"GGUF and then some bytes", 24);
    expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "not a kvpq saved cache");
    unsigned char *v2 = malloc(n);
    memcpy(v2, good, n);
    v2[8] = 4;
    spit(bad, v2, n);
    expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "format version 4");
    free(v2);
    /* mismatches: kind, codebook, shape, window, pages, capacity */
    kvpq_cache_params q;
    q = params(KVPQ_CACHE_KIVI2, NULL);
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "cache kind vq");
    q = p, q.codebook = other;
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "another codebook");
    q = p, q.window = WINDOW / 2;
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "window 64");
    q = p, q.page_tokens = PAGE * 2;
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "page_tokens 64");
    q = p, q.n_head = 3; /* same KV heads, another model's query heads */
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "n_head 9");
    q = p, q.max_seq = 100;
    expect_load_fails(&q, path, KVPQ_ERR_CAPACITY, "max_seq");
    q = p;
    expect_load_fails(&q, "/nonexistent/dir/x.kvc", KVPQ_ERR_IO, "cannot open");
    expect_load_fails(&q, "/tmp", KVPQ_ERR_IO, "not a regular file");
    char fifo[256];
    tmp_path(fifo, sizeof fifo, "fifo");
    cr_assert_eq(mkfifo(fifo, 0600), 0);
    expect_load_fails(&q, fifo, KVPQ_ERR_IO, "not a regular file"); /* returns: does not wait for a writer */
    unlink(fifo);
    /* the good file still loads */
    kvpq_cache *b = NULL;
    cr_assert_eq(kvpq_cache_load(&b, &p, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
    expect_same(a, b, 1, 5, "good file");
    kvpq_cache_free(b);
    kvpq_cache_free(a);
    free(good);
    unlink(path), unlink(bad);
    kvpq_codebook_free(cb), kvpq_codebook_free(other);
}

static int temporaries_left(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));)
        if (!strncmp(e->d_name, prefix, strlen(prefix)) && strstr(e->d_name, ".tmp.")) n++;
    if (d) closedir(d);
    return n;
}

Test(cache_file, failed_save_keeps_the_existing_file) {
    kvpq_cache_params p = params(KVPQ_CACHE_FP32, NULL);
    kvpq_cache *small = filled(&p, 4, 1), *big = filled(&p, 400, 2);
    char path[256], prefix[64];
    tmp_path(path, sizeof path, "keep.kvc");
    snprintf(prefix, sizeof prefix, "kvpq_test_cache_file_%d_keep", (int)getpid());
    cr_assert_eq(kvpq_cache_save(small, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    size_t n0;
    unsigned char *before = slurp(path, &n0);
    /* The big cache's file (~1.8 MB) cannot be written under a 256 KiB file-size limit (EFBIG). */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {256 << 10, 256 << 10};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    kvpq_status s = kvpq_cache_save(big, path, NULL, 0);
    cr_assert_eq(s, KVPQ_ERR_IO, "save past the limit: %s (%s)", kvpq_status_string(s), kvpq_last_error());
    cr_assert(strstr(kvpq_last_error(), path), "%s", kvpq_last_error());
    size_t n1;
    unsigned char *after = slurp(path, &n1);
    cr_assert(n1 == n0 && !memcmp(before, after, n0), "the existing file changed after a failed save");
    cr_assert_eq(temporaries_left("/tmp", prefix), 0, "a temporary file was left behind");
    /* into a folder that does not exist: refused, named */
    cr_assert_eq(kvpq_cache_save(small, "/nonexistent/dir/x.kvc", NULL, 0), KVPQ_ERR_IO);
    cr_assert(strstr(kvpq_last_error(), "/nonexistent/dir/x.kvc"));
    kvpq_cache *b = NULL;
    cr_assert_eq(kvpq_cache_load(&b, &p, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
    expect_same(small, b, 1, 3, "kept file");
    kvpq_cache_free(b), kvpq_cache_free(small), kvpq_cache_free(big);
    free(before), free(after);
    unlink(path);
}

Test(cache_file, sliding_window_round_trip_every_kind) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,
                                            KVPQ_CACHE_Q4_0,  KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4};
    for (int k = 0; k < 6; k++) swa_round_trip(kinds[k], NULL, 300, 1300u + k);
    kvpq_codebook *cb = make_codebook(1, 77u);
    swa_round_trip(KVPQ_CACHE_VQ, cb, 300, 1400u);
    kvpq_codebook_free(cb);
}

// ---- a signal in the middle of a save (issue 14 item 9) ------------------------------------------

/* What kvpq's CLI installs for SIGINT / SIGTERM (tools/kvpq.c): remove the temporary files of saves
 * in progress, then end as the default action would. */
static void end_cleanly(int sig) {
    kvpq_remove_temp_files();
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Child: fill and save an fp32 cache of `scale` x 8 MiB (what) or a codebook of scale x 4 MiB into
 * dir/out; exits 0 if the save finished. */
static void save_in_child(const char *dir, int what, int scale) {
    signal(SIGINT, end_cleanly), signal(SIGTERM, end_cleanly);
    char out[512];
    snprintf(out, sizeof out, "%s/out", dir);
    if (what == 0) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = KVPQ_CACHE_FP32, p.n_layer = 4 * scale, p.n_head = 4, p.n_head_kv = 4, p.head_dim = 128;
        p.max_seq = 512, p.page_tokens = 512, p.n_threads = 1;
        kvpq_cache *c = NULL;
        if (kvpq_cache_new(&c, &p) != KVPQ_OK) _exit(2);
        float *x = calloc((size_t)512 * 4 * 128, sizeof *x);
        for (int l = 0; l < p.n_layer; l++)
            if (kvpq_cache_append(c, l, 512, x, x) != KVPQ_OK) _exit(2);
        _exit(kvpq_cache_save(c, out, NULL, 0) == KVPQ_OK ? 0 : 3);
    }
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = 8 * scale, p.n_head_kv = 2, p.head_dim = 128;
    if (kvpq_pq_params_preset(&p.key, "d2b8", 128) != KVPQ_OK) _exit(2);
    p.key.granularity = KVPQ_CODEBOOK_SUBSPACE; /* (64, 256, 2) float32: 128 KiB per quantizer */
    p.value = p.key;
    kvpq_codebook *cb = NULL;
    if (kvpq_codebook_new(&cb, &p) != KVPQ_OK) _exit(2);
    _exit(kvpq_codebook_save(cb, out) == KVPQ_OK ? 0 : 3);
}

/* Send sig to a saving child the moment its temporary file appears (inotify); returns 1 if the
 * signal ended the save (the child died of it), 0 if the save had already finished. */
static int interrupt_save(const char *dir, int what, int scale, int sig) {
    int in = inotify_init1(IN_NONBLOCK);
    cr_assert_geq(in, 0);
    cr_assert_geq(inotify_add_watch(in, dir, IN_CREATE), 0);
    pid_t pid = fork();
    cr_assert_geq(pid, 0);
    if (pid == 0) save_in_child(dir, what, scale);
    int sent = 0;
    for (int waited = 0; !sent && waited < 120000;) {
        struct pollfd pf = {.fd = in, .events = POLLIN};
        if (poll(&pf, 1, 100) <= 0) {
            waited += 100;
            int st;
            if (waitpid(pid, &st, WNOHANG) == pid) { /* ended before any temporary appeared */
                cr_assert(0, "child ended (status %d) before creating its temporary file", st);
            }
            continue;
        }
        char ev[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
        ssize_t n = read(in, ev, sizeof ev);
        for (ssize_t i = 0; i < n;) {
            const struct inotify_event *e = (const struct inotify_event *)(ev + i);
            if (e->len && strstr(e->name, ".tmp.")) sent = kill(pid, sig) == 0;
            i += (ssize_t)(sizeof *e + e->len);
        }
    }
    close(in);
    cr_assert(sent, "no temporary file appeared");
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    if (WIFEXITED(status)) {
        cr_assert_eq(WEXITSTATUS(status), 0, "the save failed");
        return 0;
    }
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == sig, "child status %d", status);
    return 1;
}

/* SIGINT or SIGTERM while a cache file or a codebook is being written: the handler removes
 * OUT.tmp.XXXXXX and the target is never created. The signal is sent when inotify reports the
 * temporary file; if the save still won the race, it is retried 4x and 16x larger. */
Test(cache_file, sigint_or_sigterm_mid_save_leaves_no_temporary, .timeout = 600) {
    const int sigs[2] = {SIGINT, SIGTERM};
    for (int what = 0; what < 2; what++)
        for (int si = 0; si < 2; si++) {
            char dir[] = "/tmp/kvpq_sigsave_XXXXXX";
            cr_assert_not_null(mkdtemp(dir));
            int hit = 0;
            for (int scale = 1; !hit && scale <= 16; scale *= 4) {
                hit = interrupt_save(dir, what, scale, sigs[si]);
                char out[600];
                snprintf(out, sizeof out, "%s/out", dir);
                if (!hit) unlink(out);
            }
            cr_assert(hit, "%s %s: every save finished before the signal", what ? "codebook" : "cache",
                      strsignal(sigs[si]));
            cr_assert_eq(temporaries_left(dir, ""), 0, "%s %s: a temporary file was left behind",
                         what ? "codebook" : "cache", strsignal(sigs[si]));
            struct stat sb;
            cr_assert_neq(stat(dir, &sb), -1);
            DIR *d = opendir(dir);
            int entries = 0;
            for (struct dirent *e; d && (e = readdir(d));) entries += e->d_name[0] != '.';
            closedir(d);
            cr_assert_eq(entries, 0, "%s %s: %d files left in %s", what ? "codebook" : "cache", strsignal(sigs[si]),
                         entries, dir);
            rmdir(dir);
        }
}

/* Attention sinks (format version 3): every quantized kind, sinks shorter and longer than the
 * sequence, after a truncate and with a sliding-window layer: identical attention, read-back and
 * bytes, and the loaded cache carries on the same. */
Test(cache_file, sinks_round_trip_every_quantized_kind) {
    static const kvpq_cache_type kinds[] = {KVPQ_CACHE_Q8_0,  KVPQ_CACHE_Q4_0,  KVPQ_CACHE_Q8_0R,
                                            KVPQ_CACHE_Q4_0R, KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4};
    const int nk = (int)(sizeof kinds / sizeof kinds[0]);
    for (int k = 0; k < nk; k++) {
        round_trip_sinks(kinds[k], NULL, 3, -1, 2000u + k, 4);   /* all positions are sinks */
        round_trip_sinks(kinds[k], NULL, 300, -1, 2100u + k, 1);
        round_trip_sinks(kinds[k], NULL, 300, 150, 2200u + k, 4); /* after a truncate */
    }
    kvpq_cache_type swa_kinds[] = {KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2};
    for (int k = 0; k < 2; k++) swa_round_trip_sinks(swa_kinds[k], NULL, 300, 2300u + k, 4);
    kvpq_codebook *cb = make_codebook(1, 61u);
    round_trip_sinks(KVPQ_CACHE_VQ, cb, 3, -1, 2400u, 4);
    round_trip_sinks(KVPQ_CACHE_VQ, cb, 300, -1, 2401u, 1);
    round_trip_sinks(KVPQ_CACHE_VQ, cb, 300, 150, 2402u, 16);
    swa_round_trip_sinks(KVPQ_CACHE_VQ, cb, 300, 2403u, 4);
    kvpq_codebook_free(cb);
}

/* A file with sinks loads only into a cache with as many (and a file without into one without);
 * a damaged sink section or sink count is refused by name (before the checksum is reached). */
Test(cache_file, sinks_mismatch_and_corrupted_section_refused) {
    kvpq_cache_params p = params(KVPQ_CACHE_Q4_0, NULL);
    p.sinks = 4;
    kvpq_cache *a = filled(&p, 200, 31);
    char path[256], bad[256], plain[256];
    tmp_path(path, sizeof path, "sinks.kvc");
    tmp_path(bad, sizeof bad, "sinks_bad.kvc");
    tmp_path(plain, sizeof plain, "plain.kvc");
    cr_assert_eq(kvpq_cache_save(a, path, "u", 1), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_params q = p;
    q.sinks = 0;
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "sinks 4, this cache has 0");
    q.sinks = 2;
    expect_load_fails(&q, path, KVPQ_ERR_MISMATCH, "sinks 4, this cache has 2");
    kvpq_cache_params r = p;
    r.sinks = 0;
    kvpq_cache *w = filled(&r, 200, 31);
    cr_assert_eq(kvpq_cache_save(w, plain, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    expect_load_fails(&p, plain, KVPQ_ERR_MISMATCH, "sinks 0, this cache has 4");
    kvpq_cache_free(w);
    size_t n;
    unsigned char *good = slurp(path, &n);
    /* header 60 bytes, lens and lo (4 + 4 per layer), sinks (i32), user (1 byte), then the sinks */
    const size_t at_sinks = 60 + 8 * N_LAYER, at_section = at_sinks + 4 + 1;
    int32_t S;
    memcpy(&S, good + at_sinks, 4);
    cr_assert_eq(S, 4);
    unsigned char *b = malloc(n);
    const int32_t bad_counts[] = {0, -3, 2000};
    for (int i = 0; i < 3; i++) {
        memcpy(b, good, n);
        memcpy(b + at_sinks, &bad_counts[i], 4);
        spit(bad, b, n);
        expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "sinks");
    }
    /* an fp16 Inf and a NaN inside layer 1's V sinks */
    const size_t kvw = (size_t)N_HEAD_KV * HD, layer_bytes = 2 * 4 * kvw * 2;
    const uint16_t nonfinite[] = {0x7c00, 0xfe01};
    for (int i = 0; i < 2; i++) {
        memcpy(b, good, n);
        memcpy(b + at_section + layer_bytes + 4 * kvw * 2 + 2 * (kvw + 5), &nonfinite[i], 2);
        spit(bad, b, n);
        expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "sink section: layer 1 V at position 1 (head 0, dim 5)");
    }
    /* a flipped bit in a sink that stays finite: the checksum */
    memcpy(b, good, n);
    b[at_section + 3] ^= 0x01;
    spit(bad, b, n);
    expect_load_fails(&p, bad, KVPQ_ERR_FORMAT, "checksum");
    free(b), free(good);
    kvpq_cache_free(a);
    unlink(path), unlink(bad), unlink(plain);
}

/* A version 2 file written by kvpq before version 3 existed (tests/data/cache/v2_fp16.kvc: an fp16
 * cache, 1 layer, 2 heads, 1 KV head, head_dim 32, max_seq 64, pages of 16, 20 positions of
 * rand_vec seeds 5 and 6, user blob "v2 fixture") still loads and reads back those values; the same
 * cache saved today is the same bytes (a cache without sinks is still written as version 2). */
Test(cache_file, version_2_fixture_loads_and_is_still_written) {
    const char *fx = KVPQ_SOURCE_DIR "/tests/data/cache/v2_fp16.kvc";
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_FP16, p.n_layer = 1, p.n_head = 2, p.n_head_kv = 1, p.head_dim = 32;
    p.max_seq = 64, p.window = 8, p.page_tokens = 16, p.n_threads = 1;
    kvpq_cache *c = NULL;
    void *user = NULL;
    size_t user_len = 0;
    cr_assert_eq(kvpq_cache_load(&c, &p, fx, &user, &user_len), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert(user_len == 10 && !memcmp(user, "v2 fixture", 10));
    free(user);
    cr_assert_eq(kvpq_cache_seq_len(c, 0), 20);
    kvpq_cache *d = NULL;
    cr_assert_eq(kvpq_cache_new(&d, &p), KVPQ_OK);
    float *k = rand_vec(20 * 32, 5, 1.0f), *v = rand_vec(20 * 32, 6, 1.0f);
    cr_assert_eq(kvpq_cache_append(d, 0, 20, k, v), KVPQ_OK);
    float ka[20 * 32], kb[20 * 32], va[20 * 32], vb[20 * 32];
    cr_assert_eq(kvpq_cache_read(c, 0, 0, 20, ka, va), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(d, 0, 0, 20, kb, vb), KVPQ_OK);
    cr_assert(!memcmp(ka, kb, sizeof ka) && !memcmp(va, vb, sizeof va), "the fixture reads back other values");
    char path[256];
    tmp_path(path, sizeof path, "v2_again.kvc");
    cr_assert_eq(kvpq_cache_save(d, path, "v2 fixture", 10), KVPQ_OK, "%s", kvpq_last_error());
    size_t n0, n1;
    unsigned char *a0 = slurp(fx, &n0), *a1 = slurp(path, &n1);
    cr_assert(n0 == n1 && !memcmp(a0, a1, n0), "a cache without sinks is no longer saved as the same version 2 bytes");
    free(a0), free(a1), free(k), free(v);
    kvpq_cache_free(c), kvpq_cache_free(d);
    unlink(path);
}

/* Issue 31: a cache saved with a max_seq below the window and page size (kvpq_cache_new clamped both
 * to it) loads under a larger max_seq, as documented, keeping the file's window and page size; it
 * was refused, blaming "window" or "page_tokens" (fp32 too). */
Test(cache_file, larger_max_seq_loads_a_cache_saved_below_window_and_page) {
    kvpq_codebook *cb = make_codebook(0, 61u);
    const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32, KVPQ_CACHE_KIVI2, KVPQ_CACHE_VQ};
    for (int k = 0; k < 3; k++) {
        kvpq_cache_params p = params(kinds[k], kinds[k] == KVPQ_CACHE_VQ ? cb : NULL);
        p.max_seq = 40; /* below WINDOW and PAGE (64) */
        kvpq_cache *a = filled(&p, 40, 610u + k);
        char path[256];
        tmp_path(path, sizeof path, "small_max_seq.kvc");
        cr_assert_eq(kvpq_cache_save(a, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
        kvpq_cache_params big = params(kinds[k], p.codebook);
        big.max_seq = 1024;
        kvpq_cache *b = NULL;
        cr_assert_eq(kvpq_cache_load(&b, &big, path, NULL, NULL), KVPQ_OK, "%s: %s", kvpq_cache_type_name(kinds[k]),
                     kvpq_last_error());
        kvpq_cache_params got;
        cr_assert_eq(kvpq_cache_get_params(b, &got), KVPQ_OK);
        cr_assert_eq(got.max_seq, 1024);
        cr_assert_eq(got.window, 40, "the file's clamped window");
        cr_assert_eq(got.page_tokens, 40, "the file's clamped page size");
        expect_same(a, b, 3, 620u + k, kvpq_cache_type_name(kinds[k]));
        /* a window that clamps otherwise (the request's is 16 < 40): still refused, by name */
        big.window = 16;
        expect_load_fails(&big, path, KVPQ_ERR_MISMATCH, "window");
        kvpq_cache_free(a);
        kvpq_cache_free(b);
        unlink(path);
    }
    kvpq_codebook_free(cb);
}

/* Issue 31: NaN or Inf in a saved cache's payload, with the checksum recomputed to match (what a
 * writer with a bug, not a damaged disk, produces), is refused by name at load; it loaded and
 * attention returned NaN. fp16 rows and KIVI's fp16 window / group scales. */
#define XXH_INLINE_ALL /* as the library uses it: header only */
#include <xxhash.h>
Test(cache_file, non_finite_payload_refused_even_with_a_matching_checksum) {
    const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP16, KVPQ_CACHE_KIVI2};
    for (int k = 0; k < 2; k++) {
        kvpq_cache_params p = params(kinds[k], NULL);
        kvpq_cache *a = NULL;
        cr_assert_eq(kvpq_cache_new(&a, &p), KVPQ_OK);
        const size_t kvw = (size_t)N_HEAD_KV * HD, n = 100;
        float *x = malloc(n * kvw * sizeof *x);
        for (size_t i = 0; i < n * kvw; i++) x[i] = 0.375f; /* float16 0x3600: found in the payload below */
        for (int l = 0; l < N_LAYER; l++) cr_assert_eq(kvpq_cache_append(a, l, (int)n, x, x), KVPQ_OK);
        free(x);
        char path[256];
        tmp_path(path, sizeof path, "nan_payload.kvc");
        cr_assert_eq(kvpq_cache_save(a, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
        size_t fn;
        unsigned char *b = slurp(path, &fn);
        size_t at = fn - 8 - 2; /* the last float16 0x3600 of the payload: a window or row value */
        while (at > 64 && !(b[at] == 0x00 && b[at + 1] == 0x36)) at--;
        cr_assert_gt(at, 64u, "%s: no 0x3600 in the payload", kvpq_cache_type_name(kinds[k]));
        b[at] = 0x00, b[at + 1] = 0x7e; /* NaN */
        const uint64_t sum = XXH64(b, fn - 8, 0);
        memcpy(b + fn - 8, &sum, 8);
        spit(path, b, fn);
        expect_load_fails(&p, path, KVPQ_ERR_FORMAT, "NaN or Inf");
        b[at + 1] = 0x7c; /* Inf */
        const uint64_t sum2 = XXH64(b, fn - 8, 0);
        memcpy(b + fn - 8, &sum2, 8);
        spit(path, b, fn);
        expect_load_fails(&p, path, KVPQ_ERR_FORMAT, "NaN or Inf");
        free(b);
        kvpq_cache_free(a);
        unlink(path);
    }
}

/* Issue 31: SIGKILL during a save (no handler runs) left a full-size temporary file that nothing
 * removed. Temporary files are named TARGET.kvpq.tmp.PID.XXXXXX; a save removes those of its own
 * target whose process no longer runs and that are over a minute old, and keeps one of a running
 * process (another writer) and a recent one. */
Test(cache_file, save_removes_stale_temporaries_of_a_dead_process) {
    char path[256], stale[300], live[300], other[300];
    tmp_path(path, sizeof path, "stale.kvc");
    pid_t dead = fork();
    if (dead == 0) _exit(0);
    cr_assert_gt(dead, 0);
    waitpid(dead, NULL, 0); /* a PID that no longer runs (reuse within the test is unlikely) */
    snprintf(stale, sizeof stale, "%s.kvpq.tmp.%d.AbC123", path, (int)dead);
    snprintf(live, sizeof live, "%s.kvpq.tmp.%d.XyZ789", path, (int)getpid());
    snprintf(other, sizeof other, "%s2.kvpq.tmp.%d.AbC123", path, (int)dead); /* another target's */
    const unsigned char junk[4] = {1, 2, 3, 4};
    spit(stale, junk, 4), spit(live, junk, 4), spit(other, junk, 4);
    char recent[300]; /* a dead PID's, but written a moment ago: maybe a writer in another PID namespace */
    snprintf(recent, sizeof recent, "%s.kvpq.tmp.%d.ReC456", path, (int)dead);
    spit(recent, junk, 4);
    const struct timespec old_times[2] = {{.tv_sec = time(NULL) - 3600}, {.tv_sec = time(NULL) - 3600}};
    cr_assert_eq(utimensat(AT_FDCWD, stale, old_times, 0), 0);
    cr_assert_eq(utimensat(AT_FDCWD, live, old_times, 0), 0);
    cr_assert_eq(utimensat(AT_FDCWD, other, old_times, 0), 0);
    kvpq_cache_params p = params(KVPQ_CACHE_FP16, NULL);
    kvpq_cache *c = filled(&p, 10, 5u);
    cr_assert_eq(kvpq_cache_save(c, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert(access(stale, F_OK) != 0, "the dead process's temporary file is still there");
    cr_assert(access(live, F_OK) == 0, "a running process's temporary file was removed");
    cr_assert(access(other, F_OK) == 0, "another target's temporary file was removed");
    cr_assert(access(recent, F_OK) == 0, "a temporary file written a moment ago was removed");
    unlink(live), unlink(other), unlink(recent), unlink(path);
    kvpq_cache_free(c);
}
