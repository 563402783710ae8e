/* test_cache_cuda_backend.c — kvpq_cache's CUDA backend as a machine without a usable GPU sees it:
 * asking for it fails at creation with KVPQ_ERR_NO_DEVICE and a message that names the backend and
 * why (built without CUDA, or no device), AUTO stays on the CPU, the kinds without a GPU form refuse
 * the backend by name, and a saved cache records the backend it was made on. The GPU side (the same
 * calls on a device, against the CPU cache) is tests/gpu/cache_backend_check.c. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"

static kvpq_codebook *small_codebook(void) {
    test_codebook_spec s = {.n_layer = 2, .n_head_kv = 2, .head_dim = 64, .norm = 0, .seed = 7, .seed_step = 1,
                            .scale = 1.0f, .train_points = 0, .smooth = 1};
    kvpq_codebook *cb = test_codebook(&s);
    cr_assert(cb, "test codebook: %s", kvpq_last_error());
    return cb;
}

static kvpq_cache_params vq_params(const kvpq_codebook *cb, kvpq_backend b) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.head_dim = 64;
    p.max_seq = 256;
    p.window = 32;
    p.codebook = cb;
    p.backend = b;
    return p;
}

Test(cache_cuda_backend, refused_with_the_reason_without_a_device) {
    char why[256];
    if (kvpq_cuda_available(why, sizeof why)) cr_skip_test("a CUDA device is usable here: tests/gpu covers it");
    kvpq_codebook *cb = small_codebook();
    kvpq_cache_params p = vq_params(cb, KVPQ_BACKEND_CUDA);
    kvpq_cache *c = (kvpq_cache *)1;
    kvpq_status s = kvpq_cache_new(&c, &p);
    cr_assert_eq(s, KVPQ_ERR_NO_DEVICE, "status %d (%s)", s, kvpq_last_error());
    cr_assert_null(c);
    const char *msg = kvpq_last_error();
    cr_assert(strstr(msg, "cache vq") && strstr(msg, "backend cuda") && strstr(msg, why), "message '%s' (why: '%s')",
              msg, why);
    kvpq_codebook_free(cb);
}

/* kvpq_cuda_cache_new checks the keys-before-RoPE fields (key_rope_*) before it looks for a device:
 * each bad value is refused by name in any CUDA build, device or not. (A build without CUDA has only
 * the stub, which refuses everything with KVPQ_ERR_NO_DEVICE.) */
Test(cache_cuda_backend, rope_fields_refused_by_name_before_device_work) {
    char why[256];
    kvpq_cuda_available(why, sizeof why);
    if (strstr(why, "built without CUDA")) cr_skip_test("built without CUDA: kvpq_cuda_cache_new is the stub");
    kvpq_codebook *cb = small_codebook();
    const float freq[40] = {1.0f, 0.5f, NAN}; /* freq + 3: 32 zeros */
    const struct {
        int dims, pos0, nan;
        kvpq_status want;
        const char *field;
    } cases[] = {{3, 0, 0, KVPQ_ERR_INVALID_ARG, "key_rope_dims=3"},
                 {66, 0, 0, KVPQ_ERR_INVALID_ARG, "key_rope_dims=66"},
                 {64, -1, 0, KVPQ_ERR_INVALID_ARG, "key_rope_pos0=-1"},
                 {64, 2147483647 - 100, 0, KVPQ_ERR_INVALID_ARG, "key_rope_pos0=2147483547"},
                 {64, 0, 1, KVPQ_ERR_NONFINITE, "key_rope_freq[2]"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        kvpq_cuda_cache_params p = kvpq_cuda_cache_params_default();
        p.n_head = 4, p.n_head_kv = 2, p.head_dim = 64, p.max_seq = 256;
        p.key = kvpq_codebook_pq_const(cb, 0, 0), p.value = kvpq_codebook_pq_const(cb, 0, 1);
        p.key_rope_dims = cases[i].dims, p.key_rope_pos0 = cases[i].pos0;
        p.key_rope_freq = cases[i].nan ? freq : freq + 3;
        kvpq_cuda_cache *c = NULL;
        const kvpq_status s = kvpq_cuda_cache_new(&c, &p);
        cr_assert_eq(s, cases[i].want, "case %zu: status %d (%s)", i, s, kvpq_last_error());
        cr_assert(strstr(kvpq_last_error(), cases[i].field), "case %zu: '%s'", i, kvpq_last_error());
        cr_assert_null(c);
    }
    kvpq_codebook_free(cb);
}

Test(cache_cuda_backend, auto_stays_on_the_cpu) {
    kvpq_codebook *cb = small_codebook();
    kvpq_cache_params p = vq_params(cb, KVPQ_BACKEND_AUTO);
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_params got;
    cr_assert_eq(kvpq_cache_get_params(c, &got), KVPQ_OK);
    cr_assert_eq(got.backend, KVPQ_BACKEND_CPU);
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
    cr_assert_eq(st.backend, KVPQ_BACKEND_CPU);
    kvpq_cache_free(c);
    kvpq_codebook_free(cb);
}

Test(cache_cuda_backend, kinds_without_a_gpu_form_name_it) {
    const kvpq_cache_type kinds[] = {KVPQ_CACHE_FP32, KVPQ_CACHE_Q8_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_Q4_0R};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = kinds[i];
        p.backend = KVPQ_BACKEND_CUDA;
        kvpq_cache *c = NULL;
        kvpq_status s = kvpq_cache_new(&c, &p);
        /* without a device the backend itself is refused first; with one, the kind */
        cr_assert(s == KVPQ_ERR_UNSUPPORTED || s == KVPQ_ERR_NO_DEVICE, "%s: status %d", kvpq_cache_type_name(kinds[i]),
                  s);
        cr_assert(strstr(kvpq_last_error(), kvpq_cache_type_name(kinds[i])) && strstr(kvpq_last_error(), "cuda"),
                  "%s: message '%s'", kvpq_cache_type_name(kinds[i]), kvpq_last_error());
        cr_assert_null(c);
    }
}

/* A CPU cache's file keeps the kind field of earlier versions (no backend bit): loads as before. */
Test(cache_cuda_backend, cpu_saved_cache_keeps_its_kind_field) {
    kvpq_codebook *cb = small_codebook();
    kvpq_cache_params p = vq_params(cb, KVPQ_BACKEND_CPU);
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s", kvpq_last_error());
    float *k = rand_vec(40 * 2 * 64, 1, 1.f), *v = rand_vec(40 * 2 * 64, 2, 1.f);
    for (int l = 0; l < 2; l++) cr_assert_eq(kvpq_cache_append(c, l, 40, k, v), KVPQ_OK, "%s", kvpq_last_error());
    char path[] = "/tmp/kvpq_cuda_backend_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    close(fd);
    cr_assert_eq(kvpq_cache_save(c, path, NULL, 0), KVPQ_OK, "%s", kvpq_last_error());
    FILE *f = fopen(path, "rb");
    unsigned char head[16];
    cr_assert(f && fread(head, 1, 16, f) == 16);
    fclose(f);
    uint32_t kind;
    memcpy(&kind, head + 12, 4);
    cr_assert_eq(kind, (uint32_t)KVPQ_CACHE_VQ, "kind field %u", kind);
    kvpq_cache *d = NULL;
    cr_assert_eq(kvpq_cache_load(&d, &p, path, NULL, NULL), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_seq_len(d, 1), 40);
    unlink(path);
    kvpq_cache_free(d);
    kvpq_cache_free(c);
    free(k), free(v);
    kvpq_codebook_free(cb);
}
