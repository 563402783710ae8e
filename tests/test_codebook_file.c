/* test_codebook_file.c — the codebook object and its safetensors file: round trips, and rejection
 * (with a named error) of every kind of corrupt or lying file. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "kvpq_model.h"

/* ---- helpers ---------------------------------------------------------------------------------- */

static char g_dir[64];

static void make_dir(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/kvpq_cbtest.XXXXXX");
    cr_assert_not_null(mkdtemp(g_dir));
}

/* Remove the test directory and what it holds (one level). */
static void remove_dir(void) {
    DIR *d = opendir(g_dir);
    if (!d) return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        snprintf(p, sizeof p, "%s/%s", g_dir, e->d_name);
        if (unlink(p) != 0) rmdir(p);
    }
    closedir(d);
    rmdir(g_dir);
}

static int count_dir_entries(void) {
    DIR *d = opendir(g_dir);
    cr_assert_not_null(d);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) n++;
    closedir(d);
    return n;
}

static char *path_in(const char *name) {
    static char p[8][256];
    static int k;
    char *r = p[k++ % 8];
    snprintf(r, 256, "%s/%s", g_dir, name);
    return r;
}

static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
/* Uniform in [lo, hi). */
static float frand(float lo, float hi) {
    g_rng = g_rng * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)((g_rng >> 40) / 16777216.0);
}

/* Small config used by the corruption tests: k.smooth [2,8] (64 B), k.codebook shared [4,2] (32 B),
 * v.codebook subspace [2,8,4] (256 B). */
static kvpq_codebook_params small_params(int n_layer) {
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = n_layer;
    p.n_head_kv = 2;
    p.head_dim = 8;
    p.key = (kvpq_pq_params){.d = 8, .M = 4, .nbits = 2, .granularity = KVPQ_CODEBOOK_SHARED};
    p.value = (kvpq_pq_params){.d = 8, .M = 2, .nbits = 3, .granularity = KVPQ_CODEBOOK_SUBSPACE};
    p.value_rotate = 1;
    return p;
}

/* A codebook with random contents (positive smoothing) and a few metadata entries; key_M: (n_layer)
 * each layer's key M (per-layer bit allocation), or NULL for p->key.M everywhere. */
static kvpq_codebook *random_codebook_m(const kvpq_codebook_params *p, const int *key_M) {
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_new(&cb, p), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; key_M && l < p->n_layer; l++)
        cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, l, key_M[l]), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; l < p->n_layer; l++) {
        float *sm = kvpq_codebook_key_smooth(cb, l);
        for (int i = 0; i < p->n_head_kv * p->head_dim; i++) sm[i] = frand(0.01f, 5.0f);
        float *mu = kvpq_codebook_key_mean(cb, l);
        for (int i = 0; i < p->n_head_kv * p->head_dim; i++) mu[i] = frand(-4.0f, 4.0f);
        for (int v = 0; v < 2; v++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb, l, v);
            size_t n = kvpq_pq_centroids_size(pq);
            float *c = malloc(n * sizeof *c);
            for (size_t i = 0; i < n; i++) c[i] = frand(-3.0f, 3.0f);
            cr_assert_eq(kvpq_pq_set_centroids(pq, c, n), KVPQ_OK);
            free(c);
        }
    }
    cr_assert_eq(kvpq_codebook_set_meta(cb, "model", "SmolLM2-135M-Instruct.Q4_1.gguf"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "text", "data/text/emma.txt"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "tokens", "12345"), KVPQ_OK);
    /* JSON escaping: quotes, backslash, control characters, non-ASCII. */
    cr_assert_eq(kvpq_codebook_set_meta(cb, "note \"q\"", "a\\b\n\t\x01 caf\xc3\xa9 \xe2\x9c\x93"), KVPQ_OK);
    return cb;
}

static kvpq_codebook *random_codebook(const kvpq_codebook_params *p) { return random_codebook_m(p, NULL); }

static void assert_same(const kvpq_codebook *a, const kvpq_codebook *b) {
    kvpq_codebook_params pa = kvpq_codebook_get_params(a), pb = kvpq_codebook_get_params(b);
    cr_assert_eq(memcmp(&pa, &pb, sizeof pa), 0, "params differ");
    for (int l = 0; l < pa.n_layer; l++) {
        cr_assert_eq(kvpq_codebook_layer_key_M(a, l), kvpq_codebook_layer_key_M(b, l), "layer %d key M", l);
        cr_assert_eq(kvpq_codebook_layer_value_M(a, l), kvpq_codebook_layer_value_M(b, l), "layer %d value M", l);
        cr_assert_eq(memcmp(kvpq_codebook_key_smooth_const(a, l), kvpq_codebook_key_smooth_const(b, l),
                            (size_t)pa.n_head_kv * pa.head_dim * sizeof(float)), 0, "layer %d smoothing", l);
        cr_assert_eq(memcmp(kvpq_codebook_key_mean_const(a, l), kvpq_codebook_key_mean_const(b, l),
                            (size_t)pa.n_head_kv * pa.head_dim * sizeof(float)), 0, "layer %d key mean", l);
        for (int v = 0; v < 2; v++) {
            const kvpq_pq *qa = kvpq_codebook_pq_const(a, l, v), *qb = kvpq_codebook_pq_const(b, l, v);
            cr_assert_eq(kvpq_pq_centroids_size(qa), kvpq_pq_centroids_size(qb));
            cr_assert_eq(memcmp(kvpq_pq_centroids(qa), kvpq_pq_centroids(qb),
                                kvpq_pq_centroids_size(qa) * sizeof(float)), 0, "layer %d %s codebook", l,
                         v ? "value" : "key");
        }
    }
    cr_assert_eq(kvpq_codebook_meta_count(a), kvpq_codebook_meta_count(b));
    for (size_t i = 0; i < kvpq_codebook_meta_count(a); i++) {
        const char *k = kvpq_codebook_meta_key(a, i);
        cr_assert_not_null(kvpq_codebook_get_meta(b, k), "meta %s lost", k);
        cr_assert_str_eq(kvpq_codebook_get_meta(a, k), kvpq_codebook_get_meta(b, k));
    }
}

typedef struct {
    uint8_t *buf;
    size_t len;
} blob;

static blob read_blob(const char *path) {
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "open %s", path);
    fseek(f, 0, SEEK_END);
    blob b = {.len = (size_t)ftell(f)};
    fseek(f, 0, SEEK_SET);
    b.buf = malloc(b.len + 1);
    cr_assert_eq(fread(b.buf, 1, b.len, f), b.len);
    fclose(f);
    return b;
}

static void write_bytes(const char *path, const void *buf, size_t len) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(buf, 1, len, f), len);
    fclose(f);
}

/* Write a file: 8-byte length field `n_field`, the header bytes, the data. */
static void write_raw(const char *path, uint64_t n_field, const char *hdr, size_t hlen, const uint8_t *data,
                      size_t dlen) {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    uint8_t le[8];
    for (int i = 0; i < 8; i++) le[i] = (uint8_t)(n_field >> (8 * i));
    fwrite(le, 1, 8, f);
    fwrite(hdr, 1, hlen, f);
    fwrite(data, 1, dlen, f);
    fclose(f);
}

/* A valid small file, parsed: its header as cJSON and its data section. */
typedef struct {
    cJSON *root;
    uint8_t *data;
    size_t dlen;
    blob b;
} parsed;

static parsed parse_file(const char *path) {
    parsed p = {.b = read_blob(path)};
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)p.b.buf[i] << (8 * i);
    p.root = cJSON_ParseWithLength((const char *)p.b.buf + 8, (size_t)n);
    cr_assert_not_null(p.root);
    p.data = p.b.buf + 8 + n;
    p.dlen = p.b.len - 8 - n;
    return p;
}

static void write_parsed(const char *path, const parsed *p) {
    char *json = cJSON_PrintUnformatted(p->root);
    write_raw(path, strlen(json), json, strlen(json), p->data, p->dlen);
    free(json);
}

static void free_parsed(parsed *p) {
    cJSON_Delete(p->root);
    free(p->b.buf);
}

/* Save a small valid codebook (n_layer 2) as "good.safetensors"; return its path. */
static const char *save_small(void) {
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *cb = random_codebook(&p);
    const char *path = path_in("good.safetensors");
    cr_assert_eq(kvpq_codebook_save(cb, path), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_free(cb);
    return path;
}

/* Load must fail with `want`, and the message must contain each of the given fragments. */
static void expect_fail(const char *path, kvpq_status want, const char *frag1, const char *frag2) {
    kvpq_codebook *cb = (kvpq_codebook *)1;
    kvpq_status s = kvpq_codebook_load(&cb, path);
    cr_assert_eq(s, want, "status %s (%d), expected %s: %s", kvpq_status_string(s), s, kvpq_status_string(want),
                 kvpq_last_error());
    cr_assert_null(cb);
    const char *m = kvpq_last_error();
    cr_assert(strstr(m, "codebook file '"), "message lacks the file: %s", m);
    if (frag1) cr_assert(strstr(m, frag1), "message lacks '%s': %s", frag1, m);
    if (frag2) cr_assert(strstr(m, frag2), "message lacks '%s': %s", frag2, m);
}

static cJSON *tensor(parsed *p, const char *name) {
    cJSON *t = cJSON_GetObjectItemCaseSensitive(p->root, name);
    cr_assert_not_null(t, "no %s", name);
    return t;
}

static void set_offsets(parsed *p, const char *name, double b, double e) {
    cJSON *t = tensor(p, name);
    cJSON *arr = cJSON_CreateArray();
    cJSON_AddItemToArray(arr, cJSON_CreateNumber(b));
    cJSON_AddItemToArray(arr, cJSON_CreateNumber(e));
    cJSON_ReplaceItemInObjectCaseSensitive(t, "data_offsets", arr);
}

static void get_offsets(parsed *p, const char *name, size_t *b, size_t *e) {
    cJSON *o = cJSON_GetObjectItemCaseSensitive(tensor(p, name), "data_offsets");
    *b = (size_t)cJSON_GetArrayItem(o, 0)->valuedouble;
    *e = (size_t)cJSON_GetArrayItem(o, 1)->valuedouble;
}

static void set_meta_str(parsed *p, const char *key, const char *value) {
    cJSON *meta = cJSON_GetObjectItemCaseSensitive(p->root, "__metadata__");
    cJSON_DeleteItemFromObjectCaseSensitive(meta, key);
    if (value) cJSON_AddStringToObject(meta, key, value);
}

TestSuite(codebook_file, .init = make_dir, .fini = remove_dir);

/* ---- object ----------------------------------------------------------------------------------- */

Test(codebook_file, new_validates_params) {
    kvpq_codebook *cb;
    kvpq_codebook_params p = kvpq_codebook_params_default();
    cr_assert_eq(p.n_layer, 30);
    cr_assert_eq(p.key.d, p.head_dim);
    p.head_dim = 48;
    p.key.d = p.value.d = 48;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_ERR_UNSUPPORTED);
    cr_assert_null(cb);
    cr_assert(strstr(kvpq_last_error(), "head_dim=48"), "%s", kvpq_last_error());
    p = kvpq_codebook_params_default();
    p.value.d = 32;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "value.d=32"), "%s", kvpq_last_error());
    p = kvpq_codebook_params_default();
    p.key.M = 3;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "key quantizer"), "%s", kvpq_last_error());
    p = kvpq_codebook_params_default();
    p.n_layer = 0;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_codebook_new(&cb, NULL), KVPQ_ERR_INVALID_ARG);
    kvpq_codebook_free(NULL);
}

Test(codebook_file, accessors_and_metadata) {
    kvpq_codebook_params p = small_params(3);
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK);
    cr_assert_null(kvpq_codebook_pq(cb, 3, 0));
    cr_assert_null(kvpq_codebook_pq(cb, -1, 1));
    cr_assert_null(kvpq_codebook_key_smooth(cb, 3));
    cr_assert_eq(kvpq_pq_get_params(kvpq_codebook_pq(cb, 2, 1)).M, 2);
    cr_assert_eq(kvpq_pq_get_params(kvpq_codebook_pq(cb, 2, 0)).M, 4);
    cr_assert_eq(kvpq_codebook_key_smooth(cb, 1)[0], 1.0f); /* identity until trained */
    cr_assert_eq(kvpq_codebook_key_mean(cb, 2)[15], 0.0f);  /* no centering until trained */
    cr_assert_null(kvpq_codebook_key_mean(cb, 3));
    /* Config keys are listed and read-only. */
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "kvpq.format_version"), "3");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "n_layer"), "3");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "k.norm"), "0");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "v.norm"), "0");
    cr_assert_eq(kvpq_codebook_set_meta(cb, "k.norm", "1"), KVPQ_ERR_INVALID_ARG);
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "v.granularity"), "subspace");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "k.granularity"), "shared");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "v.rotate"), "1");
    size_t n0 = kvpq_codebook_meta_count(cb);
    cr_assert_eq(n0, 13);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "n_layer", "5"), KVPQ_ERR_INVALID_ARG);
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "n_layer"), "3");
    cr_assert_eq(kvpq_codebook_set_meta(cb, "bad", "\xff\xfe"), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "", "x"), KVPQ_ERR_INVALID_ARG);
    cr_assert_null(kvpq_codebook_get_meta(cb, "model"));
    cr_assert_eq(kvpq_codebook_set_meta(cb, "model", "a"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "model", "b"), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_meta_count(cb), n0 + 1);
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "model"), "b");
    cr_assert_str_eq(kvpq_codebook_meta_key(cb, n0), "model");
    cr_assert_null(kvpq_codebook_meta_key(cb, n0 + 1));
    kvpq_codebook_free(cb);
}

/* ---- round trip ------------------------------------------------------------------------------- */

Test(codebook_file, round_trip_is_bit_identical_for_both_granularities) {
    for (int combo = 0; combo < 4; combo++) {
        kvpq_codebook_params p = small_params(3);
        p.key.granularity = (combo & 1) ? KVPQ_CODEBOOK_SUBSPACE : KVPQ_CODEBOOK_SHARED;
        p.value.granularity = (combo & 2) ? KVPQ_CODEBOOK_SUBSPACE : KVPQ_CODEBOOK_SHARED;
        p.value_rotate = combo & 1;
        kvpq_codebook *a = random_codebook(&p), *b;
        const char *path = path_in("rt.safetensors");
        cr_assert_eq(kvpq_codebook_save(a, path), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_load(&b, path), KVPQ_OK, "%s", kvpq_last_error());
        assert_same(a, b);
        cr_assert_str_eq(kvpq_codebook_get_meta(b, "note \"q\""), "a\\b\n\t\x01 caf\xc3\xa9 \xe2\x9c\x93");
        /* Saving the loaded copy reproduces the file byte for byte. */
        const char *path2 = path_in("rt2.safetensors");
        cr_assert_eq(kvpq_codebook_save(b, path2), KVPQ_OK);
        blob x = read_blob(path), y = read_blob(path2);
        cr_assert_eq(x.len, y.len);
        cr_assert_eq(memcmp(x.buf, y.buf, x.len), 0);
        /* Layout: data section 8-byte aligned, tensors contiguous to the end of the file. */
        uint64_t n = 0;
        for (int i = 0; i < 8; i++) n |= (uint64_t)x.buf[i] << (8 * i);
        cr_assert_eq((8 + n) % 8, 0);
        size_t data = 0;
        for (int l = 0; l < p.n_layer; l++)
            for (int v = 0; v < 2; v++) data += kvpq_pq_centroids_size(kvpq_codebook_pq(a, l, v)) * 4;
        data += (size_t)2 * p.n_layer * p.n_head_kv * p.head_dim * 4; /* k.smooth and k.mean */
        cr_assert_eq(x.len, 8 + n + data);
        free(x.buf);
        free(y.buf);
        kvpq_codebook_free(a);
        kvpq_codebook_free(b);
    }
}

Test(codebook_file, round_trip_real_model_shape) {
    /* SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; K d8b12 subspace, V d4b8 shared. */
    kvpq_codebook_params p = kvpq_codebook_params_default();
    cr_assert_eq(kvpq_pq_params_preset(&p.key, "d8b12", 64), KVPQ_OK);
    p.key.granularity = KVPQ_CODEBOOK_SUBSPACE;
    kvpq_codebook *a = random_codebook(&p), *b;
    const char *path = path_in("big.safetensors");
    cr_assert_eq(kvpq_codebook_save(a, path), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_load(&b, path), KVPQ_OK, "%s", kvpq_last_error());
    assert_same(a, b);
    cr_assert_eq(kvpq_pq_get_params(kvpq_codebook_pq(b, 29, 0)).nbits, 12);
    kvpq_codebook_free(a);
    kvpq_codebook_free(b);
}

/* A version 1 file (before k.mean existed) still loads, with mu = 0; everything else as stored. */
Test(codebook_file, version_1_file_loads_without_key_mean) {
    const char *good = save_small(), *old = path_in("v1.safetensors");
    kvpq_codebook *a, *b;
    cr_assert_eq(kvpq_codebook_load(&a, good), KVPQ_OK, "%s", kvpq_last_error());
    parsed p = parse_file(good);
    for (int l = 0; l < 2; l++) {
        char name[32];
        snprintf(name, sizeof name, "layers.%d.k.mean", l);
        cJSON_DeleteItemFromObjectCaseSensitive(p.root, name);
    }
    /* A version 1 writer laid the remaining tensors out contiguously: close the holes (exact
     * coverage is checked). Tensors stay in their order. */
    uint8_t *packed = malloc(p.dlen);
    size_t at = 0;
    for (size_t lo = 0; lo < p.dlen;) {
        cJSON *next = NULL;
        size_t nb = SIZE_MAX, ne = 0;
        for (cJSON *t = p.root->child; t; t = t->next) {
            if (!strcmp(t->string, "__metadata__")) continue;
            size_t tb, te;
            get_offsets(&p, t->string, &tb, &te);
            if (tb >= lo && tb < nb) next = t, nb = tb, ne = te;
        }
        if (!next) break;
        memcpy(packed + at, p.data + nb, ne - nb);
        set_offsets(&p, next->string, (double)at, (double)(at + ne - nb));
        at += ne - nb;
        lo = ne;
    }
    p.data = packed;
    p.dlen = at;
    set_meta_str(&p, "k.norm", NULL); /* added in version 3 */
    set_meta_str(&p, "v.norm", NULL);
    set_meta_str(&p, "kvpq.format_version", "1");
    write_parsed(old, &p);
    free_parsed(&p);
    free(packed);
    cr_assert_eq(kvpq_codebook_load(&b, old), KVPQ_OK, "%s", kvpq_last_error());
    for (int l = 0; l < 2; l++) {
        const float *mu = kvpq_codebook_key_mean_const(b, l);
        for (int i = 0; i < 16; i++) cr_assert_eq(mu[i], 0.0f);
        cr_assert_eq(memcmp(kvpq_codebook_key_smooth_const(a, l), kvpq_codebook_key_smooth_const(b, l), 16 * 4), 0);
        for (int v = 0; v < 2; v++)
            cr_assert_eq(memcmp(kvpq_pq_centroids(kvpq_codebook_pq_const(a, l, v)),
                                kvpq_pq_centroids(kvpq_codebook_pq_const(b, l, v)),
                                kvpq_pq_centroids_size(kvpq_codebook_pq_const(a, l, v)) * 4), 0);
    }
    /* Saved again, it becomes a version 3 file (no norm-explicit quantizers). */
    cr_assert_str_eq(kvpq_codebook_get_meta(b, "kvpq.format_version"), "3");
    cr_assert_eq(kvpq_codebook_get_params(b).key_norm, 0);
    cr_assert_eq(kvpq_codebook_get_params(b).value_norm, 0);
    kvpq_codebook_free(a);
    kvpq_codebook_free(b);
}

/* A version 2 file (before k.norm / v.norm) loads with both 0; norm flags round-trip in version 3. */
Test(codebook_file, version_2_file_and_norm_flags) {
    const char *good = save_small(), *old = path_in("v2.safetensors"), *nf = path_in("norm.safetensors");
    parsed p = parse_file(good);
    cJSON *meta = cJSON_GetObjectItemCaseSensitive(p.root, "__metadata__");
    cJSON_DeleteItemFromObjectCaseSensitive(meta, "k.norm");
    cJSON_DeleteItemFromObjectCaseSensitive(meta, "v.norm");
    set_meta_str(&p, "kvpq.format_version", "2");
    write_parsed(old, &p);
    free_parsed(&p);
    kvpq_codebook *b, *c;
    cr_assert_eq(kvpq_codebook_load(&b, old), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_get_params(b).key_norm, 0);
    cr_assert_eq(kvpq_codebook_get_params(b).value_norm, 0);
    kvpq_codebook_free(b);
    for (int f = 1; f < 4; f++) {
        kvpq_codebook_params q = small_params(2);
        q.key_norm = f & 1;
        q.value_norm = f >> 1;
        kvpq_codebook *a = random_codebook(&q);
        cr_assert_eq(kvpq_codebook_save(a, nf), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_load(&c, nf), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_get_params(c).key_norm, f & 1);
        cr_assert_eq(kvpq_codebook_get_params(c).value_norm, f >> 1);
        cr_assert_str_eq(kvpq_codebook_get_meta(c, "k.norm"), (f & 1) ? "1" : "0");
        assert_same(a, c);
        kvpq_codebook_free(a);
        kvpq_codebook_free(c);
    }
    kvpq_codebook_params q = small_params(2);
    q.key_norm = 2;
    cr_assert_eq(kvpq_codebook_new(&c, &q), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "key_norm=2"), "%s", kvpq_last_error());
}

/* ---- rejection -------------------------------------------------------------------------------- */

Test(codebook_file, every_truncation_is_rejected) {
    kvpq_codebook_params p = small_params(1);
    kvpq_codebook *cb = random_codebook(&p);
    const char *path = path_in("t.safetensors"), *cut = path_in("cut.safetensors");
    cr_assert_eq(kvpq_codebook_save(cb, path), KVPQ_OK);
    kvpq_codebook_free(cb);
    blob b = read_blob(path);
    for (size_t n = 0; n < b.len; n++) {
        write_bytes(cut, b.buf, n);
        kvpq_codebook *x = NULL;
        kvpq_status s = kvpq_codebook_load(&x, cut);
        cr_assert_eq(s, KVPQ_ERR_FORMAT, "length %zu of %zu: %s", n, b.len, kvpq_last_error());
        cr_assert_null(x);
    }
    free(b.buf);
}

Test(codebook_file, lying_header_length_is_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    blob b = read_blob(good);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)b.buf[i] << (8 * i);
    const char *hdr = (const char *)b.buf + 8;
    const uint8_t *data = b.buf + 8 + n;
    size_t dlen = b.len - 8 - n;
    /* Past the end of the file. */
    write_raw(bad, b.len, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "header length", "exceeds");
    write_raw(bad, UINT64_MAX, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "header length", NULL);
    write_raw(bad, (uint64_t)1 << 40, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "header length", NULL);
    /* Too short: the JSON is cut. */
    write_raw(bad, n - 9, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "JSON", NULL);
    write_raw(bad, 0, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "JSON", NULL);
    /* Too long: data bytes read as header. */
    write_raw(bad, n + 8, hdr, n, data, dlen);
    expect_fail(bad, KVPQ_ERR_FORMAT, "after its JSON", NULL);
    free(b.buf);
}

Test(codebook_file, header_garbage_is_rejected) {
    const char *bad = path_in("bad.safetensors");
    static const uint8_t data[64];
    const char *cases[] = {"{not json}", "[1,2,3]  ", "{}      ", "{\"__metadata__\": 3}",
                           "{\"__metadata__\": {\"a\": 1}}", "\"x\"", "{\"__metadata__\":{}}",
                           "{\"a\":{\"b\":{\"c\":[[[[[[[[[[]]]]]]]]]]}}}"};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_raw(bad, strlen(cases[i]), cases[i], strlen(cases[i]), data, sizeof data);
        expect_fail(bad, KVPQ_ERR_FORMAT, NULL, NULL);
    }
    /* An embedded NUL inside an otherwise valid header. */
    const char *good = save_small();
    blob b = read_blob(good);
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)b.buf[i] << (8 * i);
    b.buf[8 + n / 2] = 0;
    write_bytes(bad, b.buf, b.len);
    expect_fail(bad, KVPQ_ERR_FORMAT, NULL, NULL);
    /* Not a regular file / absent. */
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_load(&cb, g_dir), KVPQ_ERR_IO);
    cr_assert_eq(kvpq_codebook_load(&cb, path_in("absent.safetensors")), KVPQ_ERR_IO);
    cr_assert(strstr(kvpq_last_error(), "absent.safetensors"));
    free(b.buf);
}

Test(codebook_file, wrong_dtype_is_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    parsed p = parse_file(good);
    cJSON_ReplaceItemInObjectCaseSensitive(tensor(&p, "layers.1.v.codebook"), "dtype", cJSON_CreateString("F16"));
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "tensor layers.1.v.codebook has dtype F16, expected F32", NULL);
    cJSON_ReplaceItemInObjectCaseSensitive(tensor(&p, "layers.1.v.codebook"), "dtype", cJSON_CreateNumber(0));
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "layers.1.v.codebook", "dtype");
    free_parsed(&p);
}

/* Per-layer key M (bit allocation by layer): head_dim 8, k.M = 4; layers 0 and 2 take M = 8
 * (dsub 1) and M = 1 (dsub 8), layer 1 keeps k.M. */
static const int mixed_M[3] = {8, 4, 1};

Test(codebook_file, mixed_key_M_set_and_errors) {
    kvpq_codebook_params p = small_params(3);
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_new(&cb, &p), KVPQ_OK);
    for (int l = 0; l < 3; l++) cr_assert_eq(kvpq_codebook_layer_key_M(cb, l), 4);
    cr_assert_eq(kvpq_codebook_layer_key_M(cb, 3), 0);
    cr_assert_eq(kvpq_codebook_layer_key_M(NULL, 0), 0);
    size_t n_meta = kvpq_codebook_meta_count(cb);
    float one[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    cr_assert_eq(kvpq_pq_set_centroids(kvpq_codebook_pq(cb, 0, 0), one, 8), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 0, 8), KVPQ_OK, "%s", kvpq_last_error());
    const kvpq_pq *q = kvpq_codebook_pq_const(cb, 0, 0);
    kvpq_pq_params qp = kvpq_pq_get_params(q);
    cr_assert_eq(qp.M, 8);
    cr_assert_eq(qp.nbits, 2);
    cr_assert_eq(qp.granularity, KVPQ_CODEBOOK_SHARED);
    cr_assert_eq(kvpq_pq_centroids_size(q), 4 * 1);
    cr_assert_eq(kvpq_pq_code_size(q), 2); /* 8 codes of 2 bits */
    cr_assert_eq(kvpq_pq_centroids(q)[0], 0.0f, "a fresh quantizer has zero centroids");
    cr_assert_eq(kvpq_codebook_layer_key_M(cb, 0), 8);
    cr_assert_eq(kvpq_codebook_get_params(cb).key.M, 4, "the file-wide k.M is unchanged");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "k.M.0"), "8");
    cr_assert_eq(kvpq_codebook_meta_count(cb), n_meta + 1);
    cr_assert_eq(kvpq_codebook_set_meta(cb, "k.M.1", "8"), KVPQ_ERR_INVALID_ARG, "k.M.{i} is derived");
    /* Errors leave the codebook unchanged. */
    struct { int layer, M; kvpq_status want; const char *msg; } bad[] = {
        {0, 3, KVPQ_ERR_INVALID_ARG, "layer 0 key M=3: expected a divisor of head_dim=8"},
        {1, 16, KVPQ_ERR_INVALID_ARG, "key M=16"},
        {1, 0, KVPQ_ERR_INVALID_ARG, "key M=0"},
        {3, 4, KVPQ_ERR_INVALID_ARG, "layer 3 out of range"},
        {-1, 4, KVPQ_ERR_INVALID_ARG, "layer -1 out of range"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, bad[i].layer, bad[i].M), bad[i].want, "case %zu", i);
        cr_assert(strstr(kvpq_last_error(), bad[i].msg), "case %zu: %s", i, kvpq_last_error());
        cr_assert_eq(kvpq_codebook_layer_key_M(cb, 0), 8);
        cr_assert_eq(kvpq_codebook_layer_key_M(cb, 1), 4);
    }
    cr_assert_eq(kvpq_codebook_set_layer_key_M(NULL, 0, 4), KVPQ_ERR_INVALID_ARG);
    /* Back to k.M: the k.M.0 entry goes. */
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 0, 4), KVPQ_OK);
    cr_assert_null(kvpq_codebook_get_meta(cb, "k.M.0"));
    cr_assert_eq(kvpq_codebook_meta_count(cb), n_meta);
    kvpq_codebook_free(cb);
    /* dsub outside {1, 2, 4, 8, 16}: head_dim 64, M = 2 gives dsub 32. */
    kvpq_codebook_params d = kvpq_codebook_params_default();
    d.n_layer = 1;
    cr_assert_eq(kvpq_codebook_new(&cb, &d), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 0, 2), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "layer 0 key M=2") && strstr(kvpq_last_error(), "dsub=32"), "%s",
              kvpq_last_error());
    cr_assert_eq(kvpq_codebook_layer_key_M(cb, 0), 16);
    kvpq_codebook_free(cb);
}

Test(codebook_file, mixed_key_M_round_trip_is_bit_identical) {
    for (int gran = 0; gran < 2; gran++) {
        kvpq_codebook_params p = small_params(3);
        p.key.granularity = (kvpq_codebook_granularity)gran;
        kvpq_codebook *a = random_codebook_m(&p, mixed_M), *b;
        const char *path = path_in("mix.safetensors"), *path2 = path_in("mix2.safetensors");
        cr_assert_eq(kvpq_codebook_save(a, path), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_load(&b, path), KVPQ_OK, "%s", kvpq_last_error());
        assert_same(a, b);
        for (int l = 0; l < 3; l++) {
            cr_assert_eq(kvpq_codebook_layer_key_M(b, l), mixed_M[l]);
            cr_assert_eq(kvpq_pq_get_params(kvpq_codebook_pq_const(b, l, 0)).M, mixed_M[l]);
        }
        cr_assert_eq(kvpq_codebook_set_layer_key_M(b, 1, 4), KVPQ_OK); /* same M, fresh: zero centroids */
        cr_assert_eq(kvpq_pq_set_centroids(kvpq_codebook_pq(b, 1, 0), kvpq_pq_centroids(kvpq_codebook_pq(a, 1, 0)),
                                           kvpq_pq_centroids_size(kvpq_codebook_pq(a, 1, 0))), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_save(b, path2), KVPQ_OK);
        blob x = read_blob(path), y = read_blob(path2);
        cr_assert_eq(x.len, y.len);
        cr_assert_eq(memcmp(x.buf, y.buf, x.len), 0, "granularity %d: re-saved file differs", gran);
        free(x.buf);
        free(y.buf);
        /* The file: k.M.{i} only where M differs; each layer's key tensor in its own shape. */
        parsed f = parse_file(path);
        cJSON *meta = cJSON_GetObjectItemCaseSensitive(f.root, "__metadata__");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.M")->valuestring, "4");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.M.0")->valuestring, "8");
        cr_assert_null(cJSON_GetObjectItemCaseSensitive(meta, "k.M.1"));
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.M.2")->valuestring, "1");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "kvpq.format_version")->valuestring, "3");
        const char *want[2][3] = {{"[4,1]", "[4,2]", "[4,8]"}, {"[8,4,1]", "[4,4,2]", "[1,4,8]"}};
        for (int l = 0; l < 3; l++) {
            char name[32];
            snprintf(name, sizeof name, "layers.%d.k.codebook", l);
            char *sh = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(tensor(&f, name), "shape"));
            cr_assert_str_eq(sh, want[gran][l], "%s", name);
            free(sh);
        }
        free_parsed(&f);
        kvpq_codebook_free(a);
        kvpq_codebook_free(b);
    }
}

/* Per-layer value M, symmetric to the key's: v.M.{i} written only where it differs, each layer's
 * v.codebook in its own shape, bit-identical round trip, and a file whose v.M.{i} disagrees with
 * the tensor (or names no layer) rejected naming both. Layer 1 keeps v.M; keys mixed too. */
Test(codebook_file, mixed_value_M_round_trip_and_rejects) {
    const int value_M[3] = {1, 2, 8}; /* v.M = 2, nbits 3 */
    for (int gran = 0; gran < 2; gran++) {
        kvpq_codebook_params p = small_params(3);
        p.value.granularity = (kvpq_codebook_granularity)gran;
        kvpq_codebook *a;
        cr_assert_eq(kvpq_codebook_new(&a, &p), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_layer_value_M(a, 0), p.value.M);
        cr_assert_eq(kvpq_codebook_layer_value_M(a, 3), 0);
        cr_assert_eq(kvpq_codebook_layer_value_M(NULL, 0), 0);
        cr_assert_eq(kvpq_codebook_set_layer_value_M(a, 0, 3), KVPQ_ERR_INVALID_ARG);
        cr_assert(strstr(kvpq_last_error(), "layer 0 value M=3: expected a divisor of head_dim=8"), "%s",
                  kvpq_last_error());
        cr_assert_eq(kvpq_codebook_set_layer_value_M(a, 3, 4), KVPQ_ERR_INVALID_ARG);
        cr_assert_eq(kvpq_codebook_set_layer_value_M(NULL, 0, 4), KVPQ_ERR_INVALID_ARG);
        cr_assert_eq(kvpq_codebook_set_meta(a, "v.M.1", "8"), KVPQ_ERR_INVALID_ARG, "v.M.{i} is derived");
        kvpq_codebook_free(a);
        /* random contents after the shapes are set */
        kvpq_codebook *tmp = random_codebook_m(&p, mixed_M);
        for (int l = 0; l < 3; l++)
            cr_assert_eq(kvpq_codebook_set_layer_value_M(tmp, l, value_M[l]), KVPQ_OK, "%s", kvpq_last_error());
        for (int l = 0; l < 3; l++) {
            kvpq_pq *pq = kvpq_codebook_pq(tmp, l, 1);
            cr_assert_eq(kvpq_pq_get_params(pq).M, value_M[l]);
            size_t n = kvpq_pq_centroids_size(pq);
            float *c = malloc(n * sizeof *c);
            for (size_t i = 0; i < n; i++) c[i] = frand(-3.0f, 3.0f);
            cr_assert_eq(kvpq_pq_set_centroids(pq, c, n), KVPQ_OK);
            free(c);
        }
        kvpq_codebook *b;
        const char *path = path_in("vmix.safetensors"), *path2 = path_in("vmix2.safetensors");
        cr_assert_eq(kvpq_codebook_save(tmp, path), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_load(&b, path), KVPQ_OK, "%s", kvpq_last_error());
        assert_same(tmp, b);
        for (int l = 0; l < 3; l++) {
            cr_assert_eq(kvpq_codebook_layer_value_M(b, l), value_M[l]);
            cr_assert_eq(kvpq_codebook_layer_key_M(b, l), mixed_M[l]);
        }
        cr_assert_eq(kvpq_codebook_save(b, path2), KVPQ_OK);
        blob x = read_blob(path), y = read_blob(path2);
        cr_assert_eq(x.len, y.len);
        cr_assert_eq(memcmp(x.buf, y.buf, x.len), 0, "granularity %d: re-saved file differs", gran);
        free(x.buf);
        free(y.buf);
        parsed f = parse_file(path);
        cJSON *meta = cJSON_GetObjectItemCaseSensitive(f.root, "__metadata__");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "v.M.0")->valuestring, "1");
        cr_assert_null(cJSON_GetObjectItemCaseSensitive(meta, "v.M.1"));
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "v.M.2")->valuestring, "8");
        const char *want[2][3] = {{"[8,8]", "[8,4]", "[8,1]"}, {"[1,8,8]", "[2,8,4]", "[8,8,1]"}};
        for (int l = 0; l < 3; l++) {
            char name[32];
            snprintf(name, sizeof name, "layers.%d.v.codebook", l);
            char *sh = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(tensor(&f, name), "shape"));
            cr_assert_str_eq(sh, want[gran][l], "%s", name);
            free(sh);
        }
        free_parsed(&f);
        if (gran == 0) {
            const char *bad = path_in("vbad.safetensors");
            struct { const char *key, *value, *msg1, *msg2; } cases[] = {
                {"v.M.1", "8", "tensor layers.1.v.codebook has shape [8,4], expected [8,1] (metadata v.M.1=8)", NULL},
                {"v.M.0", NULL, "tensor layers.0.v.codebook has shape [8,8], expected [8,4]", NULL},
                {"v.M.3", "8", "metadata 'v.M.3'", "layer in [0, 2]"},
                {"v.M.0", "3", "metadata v.M.0", "divisor of head_dim=8"},
            };
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                parsed g = parse_file(path);
                set_meta_str(&g, cases[i].key, cases[i].value);
                write_parsed(bad, &g);
                expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg1, cases[i].msg2);
                free_parsed(&g);
            }
        }
        kvpq_codebook_free(tmp);
        kvpq_codebook_free(b);
    }
}

Test(codebook_file, mixed_key_M_inconsistent_file_is_rejected) {
    kvpq_codebook_params p = small_params(3);
    kvpq_codebook *a = random_codebook_m(&p, mixed_M);
    const char *good = path_in("mix.safetensors"), *bad = path_in("bad.safetensors");
    cr_assert_eq(kvpq_codebook_save(a, good), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_free(a);
    struct { const char *key, *value, *msg1, *msg2; } cases[] = {
        /* metadata says one M, the tensor holds another */
        {"k.M.1", "8", "tensor layers.1.k.codebook has shape [4,2], expected [4,1] (metadata k.M.1=8)", NULL},
        {"k.M.0", "2", "tensor layers.0.k.codebook has shape [4,1], expected [4,4] (metadata k.M.0=2)", NULL},
        {"k.M.0", NULL, "tensor layers.0.k.codebook has shape [4,1], expected [4,2]", NULL},
        {"k.M.2", "4", "tensor layers.2.k.codebook has shape [4,8], expected [4,2]", NULL},
        /* bad names and values */
        {"k.M.3", "8", "metadata 'k.M.3'", "layer in [0, 2]"},
        {"k.M.01", "8", "metadata 'k.M.01'", NULL},
        {"k.M.x", "8", "metadata 'k.M.x'", NULL},
        {"k.M.", "8", "metadata 'k.M.'", NULL},
        {"k.M.0", "3", "metadata k.M.0", "divisor of head_dim=8"},
        {"k.M.0", "08", "metadata k.M.0='08'", NULL},
        {"k.M.0", "16", "metadata k.M.0='16'", NULL},
        {"k.M.0", "", "metadata k.M.0=''", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed f = parse_file(good);
        set_meta_str(&f, cases[i].key, cases[i].value);
        write_parsed(bad, &f);
        expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg1, cases[i].msg2);
        free_parsed(&f);
    }
}

Test(codebook_file, wrong_shapes_are_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    struct { const char *tensor, *shape, *msg; } cases[] = {
        {"layers.1.k.codebook", "[3,2]", "tensor layers.1.k.codebook has shape [3,2], expected [4,2]"},
        {"layers.0.k.codebook", "[2,4]", "tensor layers.0.k.codebook has shape [2,4], expected [4,2]"},
        {"layers.0.k.codebook", "[1,4,2]", "has shape [1,4,2], expected [4,2]"},
        {"layers.0.v.codebook", "[8,4]", "tensor layers.0.v.codebook has shape [8,4], expected [2,8,4]"},
        {"layers.1.k.smooth", "[16]", "tensor layers.1.k.smooth has shape [16], expected [2,8]"},
        {"layers.1.k.smooth", "[]", "has shape [], expected [2,8]"},
        {"layers.1.k.smooth", "[2,-8]", "layers.1.k.smooth: shape"},
        {"layers.1.k.smooth", "[2,8.5]", "layers.1.k.smooth: shape"},
        {"layers.1.k.smooth", "[\"2\",8]", "layers.1.k.smooth: shape"},
        {"layers.1.k.smooth", "[1,1,1,1,1,1,1,1,1,2,8]", "more than"},
        {"layers.1.k.smooth", "{\"a\":2}", "layers.1.k.smooth: shape"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed p = parse_file(good);
        cJSON_ReplaceItemInObjectCaseSensitive(tensor(&p, cases[i].tensor), "shape", cJSON_Parse(cases[i].shape));
        write_parsed(bad, &p);
        expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg, NULL);
        free_parsed(&p);
    }
    /* The exact message, file name included. */
    parsed p = parse_file(good);
    cJSON_ReplaceItemInObjectCaseSensitive(tensor(&p, "layers.1.k.codebook"), "shape", cJSON_Parse("[255,2]"));
    write_parsed(bad, &p);
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_load(&cb, bad), KVPQ_ERR_FORMAT);
    char want[512];
    snprintf(want, sizeof want, "codebook file '%s': tensor layers.1.k.codebook has shape [255,2], expected [4,2]",
             bad);
    cr_assert_str_eq(kvpq_last_error(), want);
    free_parsed(&p);
}

Test(codebook_file, bad_offsets_are_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    parsed p0 = parse_file(good);
    size_t kb, ke, sb, se, dlen = p0.dlen;
    get_offsets(&p0, "layers.1.k.codebook", &kb, &ke);
    get_offsets(&p0, "layers.1.k.smooth", &sb, &se);
    cr_assert_eq(ke - kb, 32);
    cr_assert_eq(kb, se, "tensors are written contiguously");
    free_parsed(&p0);
    struct { const char *tensor; double b, e; const char *msg; } cases[] = {
        {"layers.1.k.codebook", (double)dlen, (double)dlen + 32, "out of bounds"},
        {"layers.1.k.codebook", (double)dlen - 16, (double)dlen + 16, "out of bounds"},
        {"layers.1.k.codebook", 1e300, 1e300, "data_offsets"},
        {"layers.1.k.codebook", (double)ke, (double)kb, "out of bounds"},
        {"layers.1.k.codebook", (double)kb, (double)ke + 4, "span 36 bytes, shape needs 32"},
        {"layers.1.k.codebook", (double)kb - 4, (double)ke - 4, "overlap"},
        {"layers.1.k.codebook", (double)sb, (double)sb + 32, "overlap"},
        {"layers.0.k.smooth", (double)sb, (double)se, "overlap"},
        {"layers.1.k.codebook", -32, 0, "data_offsets"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed p = parse_file(good);
        set_offsets(&p, cases[i].tensor, cases[i].b, cases[i].e);
        write_parsed(bad, &p);
        expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg, NULL);
        free_parsed(&p);
    }
    /* Wrong arity / types. */
    parsed p = parse_file(good);
    cJSON_ReplaceItemInObjectCaseSensitive(tensor(&p, "layers.0.v.codebook"), "data_offsets", cJSON_Parse("[0]"));
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "layers.0.v.codebook", "data_offsets");
    cJSON_DeleteItemFromObjectCaseSensitive(tensor(&p, "layers.0.v.codebook"), "data_offsets");
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "layers.0.v.codebook", "data_offsets");
    free_parsed(&p);
    /* Issue 14 item 5: exact coverage, as safetensors requires. A hole between tensors (the
     * tensor moved to the end, its old bytes left unused), bytes before the first tensor and
     * trailing bytes after the last are refused. */
    p = parse_file(good);
    uint8_t *data = calloc(p.dlen + 64, 1);
    memcpy(data, p.data, p.dlen);
    memcpy(data + p.dlen + 32, p.data + kb, 32);
    p.data = data;
    p.dlen += 64;
    set_offsets(&p, "layers.1.k.codebook", (double)(p.dlen - 32), (double)p.dlen);
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "gap of 32 bytes between tensors layers.1.k.smooth", NULL);
    free(data);
    free_parsed(&p);
    p = parse_file(good);
    data = calloc(p.dlen + 5, 1);
    memcpy(data, p.data, p.dlen);
    p.data = data;
    p.dlen += 5;
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "5 trailing bytes after the last tensor", NULL);
    free(data);
    free_parsed(&p);
    /* Float-typed offsets: "16.0" or "1.6e1" read as 16 by a JSON parser, but are not integers. */
    blob g = read_blob(good);
    uint64_t hn = 0;
    for (int i = 0; i < 8; i++) hn |= (uint64_t)g.buf[i] << (8 * i);
    char *hdr = malloc((size_t)hn + 1);
    memcpy(hdr, g.buf + 8, (size_t)hn);
    hdr[hn] = '\0';
    char needle[64];
    snprintf(needle, sizeof needle, "\"data_offsets\":[%zu,%zu]", kb, ke);
    char *at = strstr(hdr, needle);
    cr_assert_not_null(at, "%s not in the header", needle);
    static const char *const fmt[] = {"\"data_offsets\":[%zu.0,%zu]", "\"data_offsets\":[%zu,%zue0]",
                                      "\"data_offsets\":[%zu,%zuE+0]"};
    for (size_t f = 0; f < sizeof fmt / sizeof fmt[0]; f++) {
        char repl[64], *h2 = malloc((size_t)hn + 16);
        int rl = snprintf(repl, sizeof repl, fmt[f], kb, ke);
        size_t pre = (size_t)(at - hdr), nl = strlen(needle);
        memcpy(h2, hdr, pre);
        memcpy(h2 + pre, repl, (size_t)rl);
        memcpy(h2 + pre + rl, at + nl, (size_t)hn - pre - nl);
        size_t h2n = (size_t)hn - nl + (size_t)rl;
        write_raw(bad, h2n, h2, h2n, g.buf + 8 + hn, g.len - 8 - (size_t)hn);
        expect_fail(bad, KVPQ_ERR_FORMAT, "must be integers", f == 0 ? ".0" : "e");
        free(h2);
    }
    free(hdr);
    free(g.buf);
}

Test(codebook_file, missing_unexpected_and_duplicate_tensors_are_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    parsed p = parse_file(good);
    cJSON_DeleteItemFromObjectCaseSensitive(p.root, "layers.1.v.codebook");
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "tensor layers.1.v.codebook is missing", NULL);
    free_parsed(&p);

    p = parse_file(good);
    cJSON_DeleteItemFromObjectCaseSensitive(p.root, "layers.0.k.mean");
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "tensor layers.0.k.mean is missing", NULL);
    free_parsed(&p);

    const char *extra[] = {"layers.2.k.smooth", "layers.2.k.mean", "layers.01.k.smooth", "layers.0.q.codebook", "weights",
                           "layers..k.smooth", "layers.0.k.smooth.x"};
    for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) {
        p = parse_file(good);
        cJSON_AddItemToObject(p.root, extra[i], cJSON_Duplicate(tensor(&p, "layers.0.k.smooth"), 1));
        write_parsed(bad, &p);
        expect_fail(bad, KVPQ_ERR_FORMAT, "unexpected tensor", extra[i]);
        free_parsed(&p);
    }
    p = parse_file(good);
    cJSON_AddItemToObject(p.root, "layers.0.k.smooth", cJSON_Duplicate(tensor(&p, "layers.0.k.smooth"), 1));
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "layers.0.k.smooth appears twice", NULL);
    free_parsed(&p);
    p = parse_file(good);
    cJSON_AddItemToObject(p.root, "__metadata__", cJSON_CreateObject());
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "__metadata__ appears twice", NULL);
    free_parsed(&p);
    p = parse_file(good);
    cJSON_AddStringToObject(cJSON_GetObjectItemCaseSensitive(p.root, "__metadata__"), "model", "again");
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "metadata key 'model' appears twice", NULL);
    free_parsed(&p);
}

/* Overwrite one float of a tensor's data. */
static void poke(parsed *p, const char *name, size_t elem, float v) {
    size_t b, e;
    get_offsets(p, name, &b, &e);
    cr_assert_lt(b + 4 * elem, e);
    memcpy(p->data + b + 4 * elem, &v, 4);
}

Test(codebook_file, nan_inf_and_non_positive_smoothing_are_rejected) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    struct { const char *tensor; size_t elem; float v; kvpq_status s; const char *msg; } cases[] = {
        {"layers.1.k.codebook", 3, NAN, KVPQ_ERR_NONFINITE, "tensor layers.1.k.codebook element 3 is NaN"},
        {"layers.0.v.codebook", 63, INFINITY, KVPQ_ERR_NONFINITE, "tensor layers.0.v.codebook element 63 is Inf"},
        {"layers.1.k.smooth", 0, -INFINITY, KVPQ_ERR_NONFINITE, "tensor layers.1.k.smooth element 0 is Inf"},
        {"layers.0.k.smooth", 15, NAN, KVPQ_ERR_NONFINITE, "layers.0.k.smooth element 15 is NaN"},
        {"layers.0.k.smooth", 2, 0.0f, KVPQ_ERR_FORMAT, "layers.0.k.smooth element 2 is 0: smoothing"},
        {"layers.1.k.mean", 5, NAN, KVPQ_ERR_NONFINITE, "tensor layers.1.k.mean element 5 is NaN"},
        {"layers.1.k.smooth", 7, -1.0f, KVPQ_ERR_FORMAT, "layers.1.k.smooth element 7 is -1"},
        /* Issue 14 item 10: finite but absurd values (they loaded, then overflowed or degraded). */
        {"layers.1.k.smooth", 3, 1e-45f, KVPQ_ERR_FORMAT, "layers.1.k.smooth element 3 is 1.4013e-45: smoothing factors must lie in"},
        {"layers.0.k.smooth", 1, 3e38f, KVPQ_ERR_FORMAT, "layers.0.k.smooth element 1 is 3e+38: smoothing factors must lie in"},
        {"layers.1.k.codebook", 2, 3e38f, KVPQ_ERR_FORMAT, "layers.1.k.codebook element 2 is 3e+38: expected |x| <="},
        {"layers.0.v.codebook", 9, -1e7f, KVPQ_ERR_FORMAT, "layers.0.v.codebook element 9 is -1e+07"},
        {"layers.1.k.mean", 0, 1e30f, KVPQ_ERR_FORMAT, "layers.1.k.mean element 0 is 1e+30"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed p = parse_file(good);
        poke(&p, cases[i].tensor, cases[i].elem, cases[i].v);
        write_parsed(bad, &p);
        expect_fail(bad, cases[i].s, cases[i].msg, NULL);
        free_parsed(&p);
    }
}

Test(codebook_file, format_version_and_config_metadata_are_checked) {
    const char *good = save_small(), *bad = path_in("bad.safetensors");
    struct { const char *key, *value; kvpq_status s; const char *msg; } cases[] = {
        {"kvpq.format_version", "6", KVPQ_ERR_UNSUPPORTED, "format version '6'"},
        /* version 5 features in a version 3 file */
        {"k.rope_dims", "8", KVPQ_ERR_FORMAT, "k.rope_dims / k.rope appear in a version 3 file"},
        /* version 4 features in a version 3 file */
        {"k.granularity", "head", KVPQ_ERR_FORMAT, "'head' in a version 3 file"},
        {"k.stages", "2", KVPQ_ERR_FORMAT, "k.stages / k2.M appear in a version 3 file"},
        {"k2.M", "8", KVPQ_ERR_FORMAT, "k.stages / k2.M appear in a version 3 file"},
        {"kvpq.format_version", "2", KVPQ_ERR_FORMAT, "k.norm / v.norm appear in a version 2 file"},
        {"k.norm", NULL, KVPQ_ERR_FORMAT, "metadata k.norm is missing"},
        {"v.norm", "2", KVPQ_ERR_FORMAT, "v.norm"},
        {"kvpq.format_version", "1", KVPQ_ERR_FORMAT, "k.norm / v.norm appear in a version 1 file"},
        {"kvpq.format_version", "", KVPQ_ERR_UNSUPPORTED, "format version ''"},
        {"kvpq.format_version", NULL, KVPQ_ERR_FORMAT, "kvpq.format_version is missing"},
        {"n_layer", "3", KVPQ_ERR_FORMAT, "tensor layers.2.k.smooth is missing"},
        {"n_layer", "1", KVPQ_ERR_FORMAT, "unexpected tensor 'layers.1."},
        {"n_layer", "0", KVPQ_ERR_FORMAT, "metadata n_layer='0'"},
        {"n_layer", "02", KVPQ_ERR_FORMAT, "metadata n_layer='02'"},
        {"n_layer", "-2", KVPQ_ERR_FORMAT, "metadata n_layer"},
        {"n_layer", "2x", KVPQ_ERR_FORMAT, "metadata n_layer"},
        {"n_layer", "99999999999999", KVPQ_ERR_FORMAT, "metadata n_layer"},
        {"n_layer", NULL, KVPQ_ERR_FORMAT, "metadata n_layer is missing"},
        {"head_dim", "12", KVPQ_ERR_FORMAT, "head_dim=12"},
        {"head_dim", "16", KVPQ_ERR_FORMAT, "expected [2,16]"},
        {"k.M", "3", KVPQ_ERR_FORMAT, "M=3"},
        {"k.M", "8", KVPQ_ERR_FORMAT, "expected [4,1]"},
        {"k.nbits", "13", KVPQ_ERR_FORMAT, "nbits=13"},
        {"k.nbits", "0", KVPQ_ERR_FORMAT, "k.nbits"},
        {"v.granularity", "both", KVPQ_ERR_FORMAT, "v.granularity='both'"},
        {"v.granularity", "shared", KVPQ_ERR_FORMAT, "expected [8,4]"},
        {"v.rotate", "2", KVPQ_ERR_FORMAT, "v.rotate"},
        {"n_head_kv", "1", KVPQ_ERR_FORMAT, "expected [1,8]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed p = parse_file(good);
        set_meta_str(&p, cases[i].key, cases[i].value);
        write_parsed(bad, &p);
        expect_fail(bad, cases[i].s, cases[i].msg, NULL);
        free_parsed(&p);
    }
    /* A version 1 file must not hold k.mean (added in version 2). */
    parsed p = parse_file(good);
    set_meta_str(&p, "k.norm", NULL);
    set_meta_str(&p, "v.norm", NULL);
    set_meta_str(&p, "kvpq.format_version", "1");
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "unexpected tensor 'layers.0.k.mean' (a version 1 file", NULL);
    free_parsed(&p);
    /* A metadata value that is not a string. */
    p = parse_file(good);
    cJSON *meta = cJSON_GetObjectItemCaseSensitive(p.root, "__metadata__");
    cJSON_ReplaceItemInObjectCaseSensitive(meta, "n_layer", cJSON_CreateNumber(2));
    write_parsed(bad, &p);
    expect_fail(bad, KVPQ_ERR_FORMAT, "metadata 'n_layer' is not a string", NULL);
    free_parsed(&p);
}

/* ---- saving never loses an existing file ------------------------------------------------------ */

static void assert_unchanged(const char *path, const blob *before) {
    blob now = read_blob(path);
    cr_assert_eq(now.len, before->len);
    cr_assert_eq(memcmp(now.buf, before->buf, now.len), 0, "existing file was modified");
    free(now.buf);
}

Test(codebook_file, failed_save_leaves_existing_file_intact) {
    const char *good = save_small();
    blob before = read_blob(good);
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *cb = random_codebook(&p);

    /* Directory does not exist. */
    cr_assert_eq(kvpq_codebook_save(cb, path_in("no/such/dir/x.safetensors")), KVPQ_ERR_IO);
    cr_assert(strstr(kvpq_last_error(), "no/such/dir/x.safetensors"), "%s", kvpq_last_error());
    /* The target is a directory: the rename fails after the temp file was written; it is removed. */
    cr_assert_eq(mkdir(path_in("adir"), 0755), 0);
    cr_assert_eq(kvpq_codebook_save(cb, path_in("adir")), KVPQ_ERR_IO);
    cr_assert_eq(count_dir_entries(), 2, "a temporary file was left behind");
    /* Values load would reject: nothing is written. */
    kvpq_codebook_key_smooth(cb, 1)[5] = NAN;
    cr_assert_eq(kvpq_codebook_save(cb, good), KVPQ_ERR_NONFINITE);
    cr_assert(strstr(kvpq_last_error(), "layers.1.k.smooth"), "%s", kvpq_last_error());
    kvpq_codebook_key_smooth(cb, 1)[5] = 0.0f;
    cr_assert_eq(kvpq_codebook_save(cb, good), KVPQ_ERR_INVALID_ARG);
    kvpq_codebook_key_smooth(cb, 1)[5] = 1.0f;
    assert_unchanged(good, &before);
    /* The disk fills up mid-write (file size limit below the file's size): the write fails, the old
     * file is intact and no temporary file is left. Criterion runs each test in its own process. */
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = before.len / 2, .rlim_max = RLIM_INFINITY};
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    cr_assert_eq(kvpq_codebook_save(cb, good), KVPQ_ERR_IO);
    cr_assert(strstr(kvpq_last_error(), "unchanged"), "%s", kvpq_last_error());
    rl.rlim_cur = RLIM_INFINITY;
    cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
    assert_unchanged(good, &before);
    cr_assert_eq(count_dir_entries(), 2, "a temporary file was left behind");
    /* And a successful save replaces it. */
    cr_assert_eq(kvpq_codebook_save(cb, good), KVPQ_OK);
    kvpq_codebook *back;
    cr_assert_eq(kvpq_codebook_load(&back, good), KVPQ_OK);
    assert_same(cb, back);
    kvpq_codebook_free(back);
    kvpq_codebook_free(cb);
    free(before.buf);
}

/* Issue 14 item 10: saving to a symbolic link replaces the file it names (rename replaced the link),
 * through a chain of links and to a dangling link (the file is created). */
Test(codebook_file, save_through_symlink_writes_the_named_file) {
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *cb = random_codebook(&p), *back;
    write_bytes(path_in("real.safetensors"), "old", 3);
    cr_assert_eq(symlink("real.safetensors", path_in("link1")), 0);
    cr_assert_eq(symlink(path_in("link1"), path_in("link2")), 0); /* absolute, to a relative link */
    cr_assert_eq(kvpq_codebook_save(cb, path_in("link2")), KVPQ_OK, "%s", kvpq_last_error());
    struct stat st;
    cr_assert_eq(lstat(path_in("link2"), &st), 0);
    cr_assert(S_ISLNK(st.st_mode), "link2 is still a link");
    cr_assert_eq(lstat(path_in("link1"), &st), 0);
    cr_assert(S_ISLNK(st.st_mode), "link1 is still a link");
    cr_assert_eq(kvpq_codebook_load(&back, path_in("real.safetensors")), KVPQ_OK, "%s", kvpq_last_error());
    assert_same(cb, back);
    kvpq_codebook_free(back);
    cr_assert_eq(symlink("new.safetensors", path_in("dangling")), 0);
    cr_assert_eq(kvpq_codebook_save(cb, path_in("dangling")), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_load(&back, path_in("new.safetensors")), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_free(back);
    cr_assert_eq(count_dir_entries(), 5, "no temporary file left");
    kvpq_codebook_free(cb);
}

/* Issue 14 item 9: a signal that ends the process during a save removes the temp file when the
 * program's handler calls kvpq_remove_temp_files (as the CLI's does). The signal is SIGXFSZ, raised
 * by the file-size limit in the middle of the write, so it lands inside the save every time. */
static void die_cleanly(int sig) {
    kvpq_remove_temp_files();
    signal(sig, SIG_DFL);
    raise(sig);
}

Test(codebook_file, temp_file_removed_when_a_signal_ends_the_save) {
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *cb = random_codebook(&p);
    const char *out = path_in("cb.safetensors");
    pid_t pid = fork();
    cr_assert(pid >= 0);
    if (pid == 0) {
        signal(SIGXFSZ, die_cleanly);
        struct rlimit rl = {.rlim_cur = 256, .rlim_max = RLIM_INFINITY};
        setrlimit(RLIMIT_FSIZE, &rl);
        kvpq_codebook_save(cb, out);
        _exit(0); /* not reached: the write past 256 bytes raises SIGXFSZ */
    }
    int status = 0;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGXFSZ, "child status %d", status);
    cr_assert_eq(count_dir_entries(), 0, "a temporary file was left behind");
    kvpq_codebook_free(cb);
}

/* Issue 14 item 4: the model a codebook belongs to is recorded, survives a save, and is checked. */
Test(codebook_file, model_recorded_and_checked) {
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *cb = random_codebook(&p), *back;
    kvpq_model_info a = {.arch = "llama", .name = "Model A", .fingerprint = "0123456789abcdef"};
    kvpq_model_info b = a, c = a;
    snprintf(b.fingerprint, sizeof b.fingerprint, "0123456789abcdee");
    snprintf(b.name, sizeof b.name, "Model B");
    snprintf(c.arch, sizeof c.arch, "qwen2");
    int unchecked = -1;
    cr_assert_eq(kvpq_codebook_check_model(cb, &a, &unchecked), KVPQ_OK);
    cr_assert_eq(unchecked, 1, "no fingerprint recorded: unchecked");
    cr_assert_eq(kvpq_codebook_set_model(cb, &a), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_save(cb, path_in("cb.safetensors")), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_load(&back, path_in("cb.safetensors")), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_str_eq(kvpq_codebook_get_meta(back, "model.fingerprint"), "0123456789abcdef");
    cr_assert_str_eq(kvpq_codebook_get_meta(back, "model.arch"), "llama");
    cr_assert_str_eq(kvpq_codebook_get_meta(back, "model"), "Model A");
    cr_assert_eq(kvpq_codebook_check_model(back, &a, &unchecked), KVPQ_OK);
    cr_assert_eq(unchecked, 0);
    cr_assert_eq(kvpq_codebook_check_model(back, &b, &unchecked), KVPQ_ERR_MISMATCH);
    cr_assert(strstr(kvpq_last_error(), "model 'Model A'") && strstr(kvpq_last_error(), "'Model B'"), "%s",
              kvpq_last_error());
    cr_assert_eq(kvpq_codebook_check_model(back, &c, NULL), KVPQ_ERR_MISMATCH);
    cr_assert(strstr(kvpq_last_error(), "qwen2"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_check_model(NULL, &a, NULL), KVPQ_ERR_INVALID_ARG);
    kvpq_codebook_free(back);
    kvpq_codebook_free(cb);
}

// ---- version 4: head granularity and two key stages ----------------------------------------------

/* Head granularity (one book per KV head) and a residual second key stage round-trip bit for bit;
 * the file is version 4 with k.stages / k2.M and tensors (n_head_kv, ksub, dsub) and
 * layers.{i}.k.codebook2; a plain codebook still writes version 3. */
Test(codebook_file, head_and_two_stage_round_trip) {
    for (int two = 0; two < 2; two++) {
        kvpq_codebook_params p = small_params(3);
        p.key.granularity = KVPQ_CODEBOOK_HEAD;
        if (two) {
            p.key_stages = 2;
            p.key2 = (kvpq_pq_params){.d = 8, .M = 2, .nbits = 2, .granularity = KVPQ_CODEBOOK_HEAD};
        }
        kvpq_codebook *a = random_codebook_m(&p, mixed_M), *b;
        kvpq_codebook_params ap = kvpq_codebook_get_params(a);
        cr_assert_eq(ap.key.n_head, 2, "a codebook sets its HEAD quantizers' n_head to n_head_kv");
        cr_assert_eq(ap.key_stages, 1 + two);
        cr_assert_eq(kvpq_pq_centroids_size(kvpq_codebook_pq_const(a, 1, 0)), (size_t)2 * 4 * 2);
        if (two) {
            /* per-layer stages: layer 1 keeps one stage */
            cr_assert_eq(kvpq_codebook_set_layer_key_stages(a, 1, 1), KVPQ_OK, "%s", kvpq_last_error());
            cr_assert_eq(kvpq_codebook_layer_key_stages(a, 1), 1);
            cr_assert_eq(kvpq_codebook_layer_key_stages(a, 0), 2);
            cr_assert_null(kvpq_codebook_key_pq2(a, 1));
            cr_assert_eq(kvpq_codebook_set_layer_key_stages(a, 1, 3), KVPQ_ERR_INVALID_ARG);
            cr_assert_eq(kvpq_codebook_set_layer_key_stages(a, 3, 1), KVPQ_ERR_INVALID_ARG);
            for (int l = 0; l < 3; l++) {
                kvpq_pq *q2 = kvpq_codebook_key_pq2(a, l);
                if (l == 1) continue;
                cr_assert_not_null(q2);
                size_t n = kvpq_pq_centroids_size(q2);
                cr_assert_eq(n, (size_t)2 * 4 * 4);
                float c[32];
                for (size_t i = 0; i < n; i++) c[i] = frand(-1.0f, 1.0f);
                cr_assert_eq(kvpq_pq_set_centroids(q2, c, n), KVPQ_OK);
            }
        } else {
            cr_assert_null(kvpq_codebook_key_pq2(a, 0));
        }
        const char *path = path_in("hv4.safetensors"), *path2 = path_in("hv4b.safetensors");
        cr_assert_eq(kvpq_codebook_save(a, path), KVPQ_OK, "%s", kvpq_last_error());
        cr_assert_eq(kvpq_codebook_load(&b, path), KVPQ_OK, "%s", kvpq_last_error());
        assert_same(a, b);
        for (int l = 0; two && l < 3; l++) {
            const kvpq_pq *x = kvpq_codebook_key_pq2_const(a, l), *y = kvpq_codebook_key_pq2_const(b, l);
            cr_assert_eq(kvpq_codebook_layer_key_stages(b, l), l == 1 ? 1 : 2);
            if (l == 1) {
                cr_assert_null(y);
                continue;
            }
            cr_assert_eq(memcmp(kvpq_pq_centroids(x), kvpq_pq_centroids(y), kvpq_pq_centroids_size(x) * 4), 0);
        }
        cr_assert_eq(kvpq_codebook_save(b, path2), KVPQ_OK);
        blob x = read_blob(path), y = read_blob(path2);
        cr_assert(x.len == y.len && !memcmp(x.buf, y.buf, x.len), "stages %d: re-saved file differs", 1 + two);
        free(x.buf);
        free(y.buf);
        parsed f = parse_file(path);
        cJSON *meta = cJSON_GetObjectItemCaseSensitive(f.root, "__metadata__");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "kvpq.format_version")->valuestring, "4");
        cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.granularity")->valuestring, "head");
        char *sh = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(tensor(&f, "layers.0.k.codebook"), "shape"));
        cr_assert_str_eq(sh, "[2,4,1]"); /* layer 0: M 8 (dsub 1), 2 heads, ksub 4 */
        free(sh);
        if (two) {
            cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.stages")->valuestring, "2");
            cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k2.M")->valuestring, "2");
            sh = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(tensor(&f, "layers.2.k.codebook2"), "shape"));
            cr_assert_str_eq(sh, "[2,4,4]");
            free(sh);
            cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "k.stages.1")->valuestring, "1");
            cr_assert_null(cJSON_GetObjectItemCaseSensitive(meta, "k.stages.0"));
            cr_assert_null(cJSON_GetObjectItemCaseSensitive(f.root, "layers.1.k.codebook2"));
            /* Inconsistent files are refused, naming what is wrong. */
            const char *bad = path_in("hv4bad.safetensors");
            struct { const char *key, *value, *msg1; } cases[] = {
                {"k2.M", "4", "tensor layers.0.k.codebook2 has shape [2,4,4], expected [2,4,2]"},
                {"k.stages", "1", "metadata k2.M appears without k.stages=2"},
                {"k.stages", "3", "metadata k.stages='3'"},
                {"k2.M", NULL, "metadata k2.M is missing"},
                {"kvpq.format_version", "3", "appear in a version 3 file"},
                {"k.stages.1", "2", "tensor layers.1.k.codebook2 is missing"},
                {"k.stages.1", NULL, "tensor layers.1.k.codebook2 is missing"},
                {"k.stages.0", "3", "metadata k.stages.0='3': expected 1 or 2"},
                {"k.stages.7", "1", "metadata 'k.stages.7'"},
            };
            for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
                parsed g = parse_file(path);
                set_meta_str(&g, cases[i].key, cases[i].value);
                write_parsed(bad, &g);
                expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg1, NULL);
                free_parsed(&g);
            }
        } else {
            cr_assert_null(cJSON_GetObjectItemCaseSensitive(meta, "k.stages"));
            cr_assert_null(cJSON_GetObjectItemCaseSensitive(f.root, "layers.0.k.codebook2"));
        }
        free_parsed(&f);
        kvpq_codebook_free(a);
        kvpq_codebook_free(b);
    }
    /* A plain codebook (no head granularity, one stage) is written as version 3, as before. */
    kvpq_codebook_params p = small_params(2);
    kvpq_codebook *c = random_codebook(&p);
    cr_assert_str_eq(kvpq_codebook_get_meta(c, "kvpq.format_version"), "3");
    kvpq_codebook_free(c);
    /* Stage two must share key's nbits and granularity. */
    p.key_stages = 2;
    p.key2 = (kvpq_pq_params){.d = 8, .M = 2, .nbits = 3, .granularity = KVPQ_CODEBOOK_SHARED};
    cr_assert_eq(kvpq_codebook_new(&c, &p), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "key2 (stage two): nbits=3"), "%s", kvpq_last_error());
    p.key_stages = 3;
    cr_assert_eq(kvpq_codebook_new(&c, &p), KVPQ_ERR_INVALID_ARG);
    /* stages 2 in a one-stage codebook: no key2 params */
    p = small_params(2);
    c = random_codebook(&p);
    cr_assert_eq(kvpq_codebook_set_layer_key_stages(c, 0, 2), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "needs a codebook made with key_stages=2"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_set_layer_key_stages(c, 0, 1), KVPQ_OK);
    kvpq_codebook_free(c);
}

/* A version 3 file written by kvpq before version 4 existed (tests/data/codebook/v3_small.safetensors:
 * shared keys with layer 1 at M 8, subspace values, norm-explicit keys, rotated values) loads with
 * the same params and values, and re-saves byte for byte. */
Test(codebook_file, version_3_fixture_still_loads) {
    const char *fx = KVPQ_SOURCE_DIR "/tests/data/codebook/v3_small.safetensors";
    kvpq_codebook *cb;
    cr_assert_eq(kvpq_codebook_load(&cb, fx), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_params p = kvpq_codebook_get_params(cb);
    cr_assert(p.n_layer == 2 && p.n_head_kv == 2 && p.head_dim == 8);
    cr_assert(p.key.M == 4 && p.key.nbits == 2 && p.key.granularity == KVPQ_CODEBOOK_SHARED);
    cr_assert(p.value.M == 2 && p.value.nbits == 3 && p.value.granularity == KVPQ_CODEBOOK_SUBSPACE);
    cr_assert(p.key_norm == 1 && p.value_norm == 0 && p.value_rotate == 1 && p.key_stages == 1);
    cr_assert_eq(kvpq_codebook_layer_key_M(cb, 1), 8);
    cr_assert_null(kvpq_codebook_key_pq2(cb, 0));
    cr_assert_float_eq(kvpq_pq_centroids(kvpq_codebook_pq_const(cb, 1, 0))[0], -0.09989116f, 1e-7f);
    cr_assert_float_eq(kvpq_pq_centroids(kvpq_codebook_pq_const(cb, 0, 1))[(8 + 2) * 4 + 1], -0.52786773f, 1e-7f);
    const char *out = path_in("v3_resave.safetensors");
    cr_assert_eq(kvpq_codebook_save(cb, out), KVPQ_OK, "%s", kvpq_last_error());
    blob x = read_blob(fx), y = read_blob(out);
    cr_assert(x.len == y.len && !memcmp(x.buf, y.buf, x.len), "re-saved v3 fixture differs");
    free(x.buf);
    free(y.buf);
    kvpq_codebook_free(cb);
}

/* kvpq_codebook_slice_heads: the same quantizers (per-layer M too), the heads' smoothing and key-mean
 * rows, the free metadata plus "heads"; it saves and loads like any codebook; bad ranges and
 * per-head quantizers are refused by name. */
Test(codebook_file, slice_heads_keeps_quantizers_and_takes_head_rows) {
    kvpq_codebook_params p = small_params(3);
    p.n_head_kv = 4;
    const int key_M[3] = {4, 2, 4};
    kvpq_codebook *cb = random_codebook_m(&p, key_M), *s;
    cr_assert_eq(kvpq_codebook_slice_heads(&s, cb, 1, 2), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook_params ps = kvpq_codebook_get_params(s);
    cr_assert_eq(ps.n_head_kv, 2);
    const size_t row = (size_t)p.head_dim * sizeof(float);
    for (int l = 0; l < p.n_layer; l++) {
        cr_assert_eq(kvpq_codebook_layer_key_M(s, l), key_M[l]);
        cr_assert_eq(memcmp(kvpq_codebook_key_smooth_const(s, l), kvpq_codebook_key_smooth_const(cb, l) + p.head_dim,
                            2 * row), 0, "layer %d smoothing rows", l);
        cr_assert_eq(memcmp(kvpq_codebook_key_mean_const(s, l), kvpq_codebook_key_mean_const(cb, l) + p.head_dim,
                            2 * row), 0, "layer %d key mean rows", l);
        for (int v = 0; v < 2; v++) {
            const kvpq_pq *a = kvpq_codebook_pq_const(cb, l, v), *b = kvpq_codebook_pq_const(s, l, v);
            cr_assert_eq(kvpq_pq_centroids_size(a), kvpq_pq_centroids_size(b));
            cr_assert_eq(memcmp(kvpq_pq_centroids(a), kvpq_pq_centroids(b), kvpq_pq_centroids_size(a) * sizeof(float)), 0);
        }
    }
    cr_assert_str_eq(kvpq_codebook_get_meta(s, "heads"), "1:3/4");
    cr_assert_str_eq(kvpq_codebook_get_meta(s, "model"), kvpq_codebook_get_meta(cb, "model"));
    make_dir();
    char *path = path_in("slice.safetensors");
    kvpq_codebook *back;
    cr_assert_eq(kvpq_codebook_save(s, path), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_OK, "%s", kvpq_last_error());
    assert_same(s, back);
    kvpq_codebook *bad = (kvpq_codebook *)1;
    cr_assert_eq(kvpq_codebook_slice_heads(&bad, cb, 3, 2), KVPQ_ERR_INVALID_ARG);
    cr_assert_null(bad);
    cr_assert(strstr(kvpq_last_error(), "KV heads [3, 5) outside the codebook's 4"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_slice_heads(&bad, cb, 0, 0), KVPQ_ERR_INVALID_ARG);
    kvpq_codebook_params ph = small_params(1);
    ph.key.granularity = KVPQ_CODEBOOK_HEAD;
    kvpq_codebook *head;
    cr_assert_eq(kvpq_codebook_new(&head, &ph), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_codebook_slice_heads(&bad, head, 0, 1), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "key quantizer has a codebook per KV head"), "%s", kvpq_last_error());
    kvpq_codebook_free(head);
    kvpq_codebook_free(back);
    kvpq_codebook_free(s);
    kvpq_codebook_free(cb);
    remove_dir();
}

/* Keys coded before RoPE (format version 5): the params, the per-layer frequencies and the
 * metadata round-trip bit for bit; a layer left at 0 stays 0; the fingerprint sees the frequencies;
 * bad params, bad frequencies and inconsistent metadata are refused by name. */
Test(codebook_file, key_rope_round_trip_and_rejects) {
    kvpq_codebook_params p = small_params(2);
    p.key_rope_dims = 6;
    p.key_rope_neox = 1;
    kvpq_codebook *cb = random_codebook(&p);
    float *f0 = kvpq_codebook_key_rope_freq(cb, 0);
    cr_assert_not_null(f0);
    for (int i = 0; i < 3; i++) cr_assert_eq(f0[i], 0.0f, "new codebooks hold inv_freq 0");
    for (int i = 0; i < 3; i++) f0[i] = powf(10000.0f, -2.0f * i / 6);
    cr_assert_null(kvpq_codebook_key_rope_freq(cb, 2));
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "kvpq.format_version"), "5");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "k.rope"), "neox");
    cr_assert_str_eq(kvpq_codebook_get_meta(cb, "k.rope_dims"), "6");
    cr_assert_eq(kvpq_codebook_set_meta(cb, "k.rope", "norm"), KVPQ_ERR_INVALID_ARG, "a config key");
    const char *path = path_in("rope.safetensors"), *bad = path_in("bad.safetensors");
    cr_assert_eq(kvpq_codebook_save(cb, path), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook *back;
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_OK, "%s", kvpq_last_error());
    assert_same(cb, back);
    cr_assert_eq(memcmp(kvpq_codebook_key_rope_freq_const(back, 0), f0, 3 * sizeof(float)), 0);
    const float *f1 = kvpq_codebook_key_rope_freq_const(back, 1);
    cr_assert(f1[0] == 0.0f && f1[1] == 0.0f && f1[2] == 0.0f, "layer 1 keeps inv_freq 0");
    const uint64_t fp = kvpq_codebook_fingerprint(back);
    kvpq_codebook_key_rope_freq(back, 1)[2] = 1e-3f;
    cr_assert_neq(kvpq_codebook_fingerprint(back), fp, "the fingerprint covers the frequencies");
    kvpq_codebook_key_rope_freq(back, 1)[2] = -1.0f;
    cr_assert_eq(kvpq_codebook_save(back, bad), KVPQ_ERR_INVALID_ARG, "a negative frequency is not saved");
    cr_assert(strstr(kvpq_last_error(), "layers.1.k.rope_freq"), "%s", kvpq_last_error());
    kvpq_codebook_free(back);
    /* the params' checks */
    kvpq_codebook *x = NULL;
    kvpq_codebook_params q = p;
    q.key_rope_dims = 5;
    cr_assert_eq(kvpq_codebook_new(&x, &q), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "key_rope_dims=5"), "%s", kvpq_last_error());
    q.key_rope_dims = 10;
    cr_assert_eq(kvpq_codebook_new(&x, &q), KVPQ_ERR_INVALID_ARG);
    q.key_rope_dims = 6, q.key_rope_neox = 2;
    cr_assert_eq(kvpq_codebook_new(&x, &q), KVPQ_ERR_INVALID_ARG);
    /* the file's checks */
    struct { const char *key, *value; const char *msg; } cases[] = {
        {"k.rope", "both", "k.rope='both'"},
        {"k.rope", NULL, "appear only together"},
        {"k.rope_dims", "7", "key_rope_dims=7"},
        {"k.rope_dims", "4", "tensor layers.0.k.rope_freq has shape [3], expected [2]"},
        {"kvpq.format_version", "4", "k.rope_dims / k.rope appear in a version 4 file"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        parsed pp = parse_file(path);
        set_meta_str(&pp, cases[i].key, cases[i].value);
        write_parsed(bad, &pp);
        expect_fail(bad, KVPQ_ERR_FORMAT, cases[i].msg, NULL);
        free_parsed(&pp);
    }
    parsed pp = parse_file(path);
    poke(&pp, "layers.0.k.rope_freq", 1, NAN);
    write_parsed(bad, &pp);
    expect_fail(bad, KVPQ_ERR_NONFINITE, "layers.0.k.rope_freq", NULL);
    free_parsed(&pp);
    kvpq_codebook_free(cb);
}
