/* test_alloc.c — automatic bit allocation (docs/allocation.md): the multiple-choice knapsack against
 * brute force, the VQ cache byte model against the cache's own count, per-layer sensitivity on a
 * synthetic model where one layer is made far more sensitive (it must get the most bits, and the
 * cache built from the allocation must respect the budget at the stated context), and a codebook
 * file with an allocation round-tripping. Needs no model file. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "gguf_writer.h"
#include "kvpq_model.h"

/* ---- the knapsack ------------------------------------------------------------------------------ */

static double brute(int G, int C, const double *cost, const int64_t *w, int64_t budget, int g, int64_t used) {
    if (g == G) return 0;
    double best = INFINITY;
    for (int c = 0; c < C; c++) {
        int64_t wc = w[g * C + c];
        if (wc < 0 || used + wc > budget) continue;
        double r = cost[g * C + c] + brute(G, C, cost, w, budget, g + 1, used + wc);
        if (r < best) best = r;
    }
    return best;
}

Test(alloc, mckp_equals_brute_force_on_random_instances) {
    uint64_t seed = 42;
    for (int it = 0; it < 400; it++) {
        int G = 1 + (int)(rng_unif(&seed) * 6), C = 1 + (int)(rng_unif(&seed) * 4);
        double cost[64];
        int64_t w[64], wmax = 0;
        for (int i = 0; i < G * C; i++) {
            cost[i] = rng_unif(&seed);
            w[i] = rng_unif(&seed) < 0.1 ? -1 : (int64_t)(rng_unif(&seed) * 20);
        }
        for (int g = 0; g < G; g++) { /* at least one usable choice per group */
            if (w[g * C] < 0) w[g * C] = 7;
            int64_t m = 0;
            for (int c = 0; c < C; c++) m = w[g * C + c] > m ? w[g * C + c] : m;
            wmax += m;
        }
        int64_t budget = (int64_t)(rng_unif(&seed) * (double)(wmax + 1));
        double want = brute(G, C, cost, w, budget, 0, 0);
        int choice[8];
        double got = -1;
        int64_t used = -1;
        kvpq_status s = kvpq_alloc_mckp(G, C, cost, w, budget, 0, choice, &got, &used);
        if (isinf(want)) {
            cr_assert_eq(s, KVPQ_ERR_CAPACITY, "instance %d: brute force finds nothing, mckp %d", it, s);
            continue;
        }
        cr_assert_eq(s, KVPQ_OK, "instance %d: %s", it, kvpq_last_error());
        cr_assert_leq(used, budget);
        cr_assert_float_eq(got, want, 1e-12, "instance %d: mckp %.17g, brute force %.17g", it, got, want);
        double sum = 0;
        int64_t ws = 0;
        for (int g = 0; g < G; g++) {
            cr_assert(choice[g] >= 0 && choice[g] < C && w[g * C + choice[g]] >= 0);
            sum += cost[g * C + choice[g]];
            ws += w[g * C + choice[g]];
        }
        cr_assert_float_eq(sum, got, 1e-12);
        cr_assert_eq(ws, used);
    }
}

Test(alloc, mckp_with_quantized_weights_stays_within_budget) {
    uint64_t seed = 7;
    enum { G = 40, C = 3 };
    double cost[G * C];
    int64_t w[G * C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) {
            w[g * C + c] = 100000 * (1 << c) + (int64_t)(rng_unif(&seed) * 999); /* more bytes, */
            cost[g * C + c] = rng_unif(&seed) / (1 << (2 * c));                 /* less loss */
        }
    int64_t budget = 0;
    for (int g = 0; g < G; g++) budget += w[g * C + 1];
    int choice[G];
    double got;
    int64_t used;
    cr_assert_eq(kvpq_alloc_mckp(G, C, cost, w, budget, 500, choice, &got, &used), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_leq(used, budget);
    double mid = 0; /* every group at its middle choice is feasible: the DP must do at least as well */
    for (int g = 0; g < G; g++) mid += cost[g * C + 1];
    cr_assert_leq(got, mid + 1e-12);
    /* refusals */
    cr_assert_eq(kvpq_alloc_mckp(G, C, cost, w, 10, 0, choice, NULL, NULL), KVPQ_ERR_CAPACITY);
    cr_assert(strstr(kvpq_last_error(), "lightest"));
    double bad[2] = {NAN, 1};
    int64_t bw[2] = {1, 1};
    cr_assert_eq(kvpq_alloc_mckp(1, 2, bad, bw, 10, 0, choice, NULL, NULL), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_alloc_mckp(0, 2, cost, w, 10, 0, choice, NULL, NULL), KVPQ_ERR_INVALID_ARG);
}

/* ---- the byte model ---------------------------------------------------------------------------- */

/* key2: NULL, or a residual second key stage's preset (key_stages = 2 in every layer) */
static kvpq_codebook *make_cb2(int n_layer, int H, int D, const char *key, const char *value, const char *key2) {
    kvpq_codebook_params cp = kvpq_codebook_params_default();
    cp.n_layer = n_layer, cp.n_head_kv = H, cp.head_dim = D;
    cr_assert_eq(kvpq_pq_params_preset(&cp.key, key, D), KVPQ_OK);
    if (key2) {
        cp.key_stages = 2;
        cr_assert_eq(kvpq_pq_params_preset(&cp.key2, key2, D), KVPQ_OK);
    }
    cr_assert_eq(kvpq_pq_params_preset(&cp.value, value, D), KVPQ_OK);
    cp.key_norm = cp.value_norm = 1;
    kvpq_codebook *cb = NULL;
    cr_assert_eq(kvpq_codebook_new(&cb, &cp), KVPQ_OK, "%s", kvpq_last_error());
    return cb;
}

static kvpq_codebook *make_cb(int n_layer, int H, int D, const char *key, const char *value) {
    return make_cb2(n_layer, H, D, key, value, NULL);
}

/* 1: the codebooks of check_bytes_stages have k.norm_bits = v.norm_bits = "8" (8-bit scales, one
 * float reference per page and KV head) and d1b8 keys in layer 1, which keep float16 scales. */
static int g_norm8 = 0;

/* stages2: 0, or a residual d8b8 second key stage in layers 0 and 2 (layer 1 keeps one stage) */
static void check_bytes_stages(int sliding_window, int window, int page, int len, int step, int sinks, int stages2) {
    const int L = 3, H = 2, D = 16;
    kvpq_codebook *cb = make_cb2(L, H, D, "d4b8", "d8b8", stages2 ? "d8b8" : NULL);
    if (stages2) cr_assert_eq(kvpq_codebook_set_layer_key_stages(cb, 1, 1), KVPQ_OK, "%s", kvpq_last_error());
    if (g_norm8) {
        cr_assert_eq(kvpq_codebook_set_meta(cb, "k.norm_bits", "8"), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_set_meta(cb, "v.norm_bits", "8"), KVPQ_OK);
    }
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 1, g_norm8 ? 16 : 8), KVPQ_OK); /* d2b8 (d1b8) keys in layer 1 */
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 2, 2), KVPQ_OK); /* d8b8 keys in layer 2 */
    cr_assert_eq(kvpq_codebook_set_layer_value_M(cb, 0, 8), KVPQ_OK); /* d2b8 values in layer 0 */
    uint8_t swa[3] = {1, 0, 1};
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_VQ, p.n_layer = L, p.n_head = 4, p.n_head_kv = H, p.head_dim = D;
    p.max_seq = len, p.window = window, p.page_tokens = page, p.codebook = cb, p.n_threads = 1;
    p.backend = KVPQ_BACKEND_CPU;
    p.sliding_window = sliding_window, p.swa_layers = sliding_window ? swa : NULL;
    p.sinks = sinks;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s", kvpq_last_error());
    float *k = rand_vec((size_t)len * H * D, 1, 1.0f), *v = rand_vec((size_t)len * H * D, 2, 1.0f);
    for (int t = 0; t < len; t += step) {
        int nb = len - t < step ? len - t : step;
        for (int l = 0; l < L; l++)
            cr_assert_eq(kvpq_cache_append(c, l, nb, k + (size_t)t * H * D, v + (size_t)t * H * D), KVPQ_OK, "%s",
                         kvpq_last_error());
    }
    kvpq_cache_stats st;
    cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
    size_t lb[6], fixed = 0, sum = 0;
    int64_t el = 0;
    cr_assert_eq(kvpq_vq_cache_bytes(cb, &p, len, step, lb, &fixed, &el), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < 6; i++) sum += lb[i];
    cr_assert_eq(sum + fixed, st.resident_bytes, "sw %d window %d page %d len %d step %d sinks %d: model %zu, cache %zu",
                 sliding_window, window, page, len, step, sinks, sum + fixed, st.resident_bytes);
    cr_assert_eq(el, st.elements, "elements: model %lld, cache %lld", (long long)el, (long long)st.elements);
    /* a layer's key part grows with its M: d2b8 (layer 1) > d4b8 (layer 0) > d8b8 (layer 2) */
    if (st.tokens_coded > 0 && !sliding_window && !sinks && !stages2) { /* codes only (centroids: the other way round) */
        size_t code[3];
        for (int l = 0; l < 3; l++) code[l] = lb[2 * l] - kvpq_pq_centroids_size(kvpq_codebook_pq_const(cb, l, 0)) * 4;
        cr_assert(code[1] > code[0] && code[0] > code[2], "%zu %zu %zu", code[0], code[1], code[2]);
    }
    kvpq_cache_free(c);
    kvpq_codebook_free(cb);
    free(k);
    free(v);
}

static void check_bytes_sinks(int sliding_window, int window, int page, int len, int step, int sinks) {
    check_bytes_stages(sliding_window, window, page, len, step, sinks, 0);
}

static void check_bytes(int sliding_window, int window, int page, int len, int step) {
    check_bytes_sinks(sliding_window, window, page, len, step, 0);
}

Test(alloc, byte_model_equals_the_cache_resident_bytes) {
    /* attention sinks: fp16, allocated with the cache; the kind's positions start after them */
    check_bytes_sinks(0, 8, 16, 100, 24, 1);
    check_bytes_sinks(0, 8, 16, 100, 512, 4);
    check_bytes_sinks(0, 0, 32, 300, 512, 16);
    check_bytes_sinks(0, 8, 16, 3, 512, 4); /* only sinks held */
    check_bytes_sinks(20, 8, 16, 200, 24, 4);
    check_bytes_sinks(40, 4, 8, 333, 7, 1);
    check_bytes(0, 8, 16, 100, 24);
    check_bytes(0, 8, 16, 100, 1);
    check_bytes(0, 128, 256, 100, 512); /* nothing coded yet */
    check_bytes(0, 0, 32, 300, 512);
    check_bytes(20, 8, 16, 200, 24); /* sliding-window layers drop pages */
    check_bytes(40, 4, 8, 333, 7);
    /* residual second key stages (calibrate --candidates P1+P2): their codes and centroids too (the
     * model counted neither before) */
    check_bytes_stages(0, 8, 16, 100, 24, 0, 1);
    check_bytes_stages(0, 0, 32, 300, 512, 1, 1);
    check_bytes_stages(20, 8, 16, 200, 24, 4, 1);
    /* 8-bit scales: a byte per vector where the quantizer has <= 4 bits per element, float16 for the
     * d1b8 keys of layer 1, a float reference per (page, KV head) and kind */
    g_norm8 = 1;
    check_bytes(0, 8, 33, 300, 24); /* odd pages: the layout's alignment padding is counted too */
    check_bytes_sinks(20, 8, 7, 200, 24, 1);
    check_bytes_sinks(0, 8, 16, 100, 24, 1);
    check_bytes_sinks(20, 8, 16, 200, 24, 4);
    check_bytes(40, 4, 8, 333, 7);
    check_bytes_stages(0, 0, 32, 300, 512, 1, 1);
    g_norm8 = 0;
}

/* The 8-bit scales save what the byte model says: with k.norm_bits / v.norm_bits = "8" the d4b8
 * keys and d8b8 values of a layer hold one byte less per coded vector and kind (plus a float per
 * page and KV head) than with float16 scales. */
Test(alloc, norm8_bytes_per_layer) {
    const int L = 1, H = 2, D = 16, len = 300, page = 32;
    size_t lb[2][2], fixed[2];
    int64_t el[2];
    for (int e = 0; e < 2; e++) {
        kvpq_codebook *cb = make_cb(L, H, D, "d4b8", "d8b8");
        if (e) {
            cr_assert_eq(kvpq_codebook_set_meta(cb, "k.norm_bits", "8"), KVPQ_OK);
            cr_assert_eq(kvpq_codebook_set_meta(cb, "v.norm_bits", "8"), KVPQ_OK);
        }
        kvpq_cache_params p = kvpq_cache_params_default();
        p.type = KVPQ_CACHE_VQ, p.n_layer = L, p.n_head = 4, p.n_head_kv = H, p.head_dim = D;
        p.max_seq = len, p.window = 0, p.page_tokens = page, p.codebook = cb;
        cr_assert_eq(kvpq_vq_cache_bytes(cb, &p, len, 512, lb[e], &fixed[e], &el[e]), KVPQ_OK, "%s", kvpq_last_error());
        kvpq_codebook_free(cb);
    }
    const size_t coded = (size_t)len / 32 * 32, pages = (coded + page - 1) / page; /* window 0: flushed in 32s */
    for (int kind = 0; kind < 2; kind++)
        cr_assert_eq(lb[0][kind] - lb[1][kind], pages * page * H * 1 - pages * H * 4, "kind %d: %zu vs %zu", kind,
                     lb[0][kind], lb[1][kind]);
    cr_assert_eq(fixed[0], fixed[1]);
    cr_assert_eq(el[0], el[1]);
}

/* ---- a synthetic model (float32 GGUF, the writer of test_model_arch.c reduced to llama) -------- */

static void kv_u32(gw_buf *b, const char *k, uint32_t v) {
    char key[128];
    snprintf(key, sizeof key, "llama.%s", k);
    gw_kv_u32(b, key, v);
}
static void kv_f32(gw_buf *b, const char *k, float v) {
    char key[128];
    snprintf(key, sizeof key, "llama.%s", k);
    gw_kv_f32(b, key, v);
}

enum { SL = 4, SE = 64, SF = 96, SH = 4, SHKV = 2, SD = 16, SV = 64 };
#define SENSITIVE 2 /* the layer made far more sensitive */

/* Random llama weights; layer SENSITIVE's attention output projection is scaled by 8 and its query
 * projection by 3 (sharper attention): that layer's attention dominates the residual stream, so an
 * error in its keys or values moves the logits far more than the same error elsewhere. */
static char *write_model(void) {
    gw_buf kv = {0}, tens = {0}, data = {0};
    int nt = 0;
    uint64_t seed = 99;
    gw_kv_str(&kv, "general.architecture", "llama");
    gw_kv_str(&kv, "tokenizer.ggml.model", "bert");
    kv_u32(&kv, "block_count", SL);
    kv_u32(&kv, "embedding_length", SE);
    kv_u32(&kv, "feed_forward_length", SF);
    kv_u32(&kv, "attention.head_count", SH);
    kv_u32(&kv, "attention.head_count_kv", SHKV);
    kv_u32(&kv, "attention.key_length", SD);
    kv_u32(&kv, "attention.value_length", SD);
    kv_u32(&kv, "context_length", 4096);
    kv_f32(&kv, "rope.freq_base", 1e4f);
    kv_f32(&kv, "attention.layer_norm_rms_epsilon", 1e-6f);
    uint64_t off = 0;
#define TENSOR(name, rows, cols, scale, offset)                                                   \
    do {                                                                                          \
        const uint64_t ne_[2] = {(uint64_t)(cols), (uint64_t)(rows)};                             \
        gw_tensor_info(&tens, name, (rows) == 1 ? 1 : 2, ne_, 0 /* F32 */, off);                 \
        size_t cnt = (size_t)(rows) * (cols);                                                     \
        for (size_t i = 0; i < cnt; i++) {                                                        \
            float x = (offset) + (scale) * rng_normal(&seed);                                     \
            gw_f32(&data, x);                                                                     \
        }                                                                                         \
        gw_pad(&data, 32);                                                                        \
        off += (cnt * 4 + 31) / 32 * 32;                                                          \
        nt++;                                                                                     \
    } while (0)
    const float ws = 1.0f / sqrtf((float)SE);
    TENSOR("token_embd.weight", SV, SE, 1.0f, 0);
    TENSOR("output_norm.weight", 1, SE, 0.1f, 1.0f);
    TENSOR("output.weight", SV, SE, 4 * ws, 0);
    char n[64];
    for (int l = 0; l < SL; l++) {
        const float qs = l == SENSITIVE ? 3.0f : 1.0f, os = l == SENSITIVE ? 8.0f : 1.0f;
#define T(suffix, r, c, sc, o) (snprintf(n, sizeof n, "blk.%d." suffix, l), ({ TENSOR(n, r, c, sc, o); }))
        T("attn_norm.weight", 1, SE, 0.1f, 1.0f);
        T("attn_q.weight", SH * SD, SE, qs * ws, 0);
        T("attn_k.weight", SHKV * SD, SE, ws, 0);
        T("attn_v.weight", SHKV * SD, SE, ws, 0);
        T("attn_output.weight", SE, SH * SD, os / sqrtf((float)(SH * SD)), 0);
        T("ffn_norm.weight", 1, SE, 0.1f, 1.0f);
        T("ffn_gate.weight", SF, SE, ws, 0);
        T("ffn_up.weight", SF, SE, ws, 0);
        T("ffn_down.weight", SE, SF, 1.0f / sqrtf((float)SF), 0);
#undef T
    }
#undef TENSOR
    gw_buf b = gw_file(&kv, (uint64_t)nt, &tens, &data, 32);
    char *path = gw_write_temp(&b, "/tmp/kvpq_alloc.XXXXXX");
    cr_assert_not_null(path);
    gw_free(&b), gw_free(&kv), gw_free(&tens), gw_free(&data);
    return path;
}

static const char *const PRESETS[3] = {"d8b8", "d4b8", "d2b8"}; /* 1, 2, 4 bits per element at dsub 8/4/2 */

Test(alloc, the_sensitive_layer_gets_the_most_bits_and_the_budget_holds, .timeout = 600) {
    char *path = write_model();
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    kvpq_model *m = NULL;
    cr_assert_eq(kvpq_model_load(&m, path, &mp), KVPQ_OK, "%s", kvpq_last_error());
    unlink(path);
    free(path);
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    /* training activations: 1024 random tokens through an fp32 cache */
    enum { NT = 1024, NH = 256, CTX = 2048 };
    uint64_t seed = 5;
    int32_t *tok = malloc(sizeof *tok * (NT + NH + CTX));
    for (int i = 0; i < NT + NH + CTX; i++) tok[i] = (int32_t)(rng_unif(&seed) * SV);
    kvpq_cache_params cp = kvpq_cache_params_default();
    kvpq_model_cache_params(m, &cp);
    cp.type = KVPQ_CACHE_FP32, cp.max_seq = NT, cp.n_threads = 2, cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *fc = NULL;
    cr_assert_eq(kvpq_cache_new(&fc, &cp), KVPQ_OK);
    float *logits = malloc(sizeof(float) * SV);
    cr_assert_eq(kvpq_model_eval(m, fc, tok, NT, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    const size_t row = SHKV * SD;
    float *K = malloc(sizeof(float) * SL * NT * row), *V = malloc(sizeof(float) * SL * NT * row);
    for (int l = 0; l < SL; l++)
        cr_assert_eq(kvpq_cache_read(fc, l, 0, NT, K + (size_t)l * NT * row, V + (size_t)l * NT * row), KVPQ_OK);
    kvpq_codebook *cc[3];
    for (int c = 0; c < 3; c++) {
        cc[c] = make_cb(SL, SHKV, SD, PRESETS[c], PRESETS[c]);
        for (int l = 0; l < SL; l++)
            cr_assert_eq(kvpq_codebook_calibrate_layer(cc[c], l, NT, K + (size_t)l * NT * row, V + (size_t)l * NT * row,
                                                       NULL, NULL, NULL),
                         KVPQ_OK, "%s", kvpq_last_error());
    }
    /* sensitivities on held-out tokens (not seen by k-means), every candidate measured */
    kvpq_sensitivity_params sp = kvpq_sensitivity_params_default();
    sp.window = 16;
    sp.n_threads = 2;
    double kl[3 * 2 * SL], klr[3 * 2 * SL];
    cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &sp, kl), KVPQ_OK,
                 "%s", kvpq_last_error());
    sp.ref_cand = 1;
    cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &sp, klr), KVPQ_OK,
                 "%s", kvpq_last_error());
    for (int c = 0; c < 3; c++)
        for (int kind = 0; kind < 2; kind++) {
            fprintf(stderr, "%s %s:", PRESETS[c], kind ? "values" : "keys");
            for (int l = 0; l < SL; l++) fprintf(stderr, " %.4g (%.4g)", kl[(c * 2 + kind) * SL + l], klr[(c * 2 + kind) * SL + l]);
            fprintf(stderr, "\n");
        }
    for (int c = 0; c < 3; c++)
        for (int kind = 0; kind < 2; kind++)
            for (int l = 0; l < SL; l++) {
                double x = kl[(c * 2 + kind) * SL + l];
                cr_assert(x >= 0 && isfinite(x));
                if (c == 1) cr_assert_float_eq(klr[(c * 2 + kind) * SL + l], x, 1e-12 + 1e-9 * x); /* measured */
                if (l != SENSITIVE)
                    for (int r = 0; r < 2; r++) { /* measured and scaled: layer SENSITIVE costs the most */
                        const double *t = r ? klr : kl;
                        cr_assert_gt(t[(c * 2 + kind) * SL + SENSITIVE], 1.5 * t[(c * 2 + kind) * SL + l],
                                     "%s, %s kind %d: layer %d KL %g, layer %d KL %g", r ? "scaled" : "measured",
                                     PRESETS[c], kind, SENSITIVE, t[(c * 2 + kind) * SL + SENSITIVE], l,
                                     t[(c * 2 + kind) * SL + l]);
                    }
            }
    /* Other windows (calibrate --window-candidates), scaled from the measured window (16) by each
     * candidate's attention-output error: the measured window scales to itself; a window holding
     * every position codes none (0); against a forward-pass measurement at window 64, within a factor
     * WIN_TOL per layer where it matters, the same total ordering of windows, and the sensitive layer
     * still costs the most. */
    {
        const int wins[3] = {16, 64, NH};
        double klw[3 * 3 * 2 * SL], kl16[3 * 2 * SL], kl64[3 * 2 * SL];
        sp.ref_cand = -1;
        sp.window = 16, sp.windows = wins, sp.n_windows = 3, sp.kl_windows = klw;
        cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &sp, kl16),
                     KVPQ_OK, "%s", kvpq_last_error());
        sp.window = 64, sp.windows = NULL, sp.n_windows = 0, sp.kl_windows = NULL;
        cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &sp, kl64),
                     KVPQ_OK, "%s", kvpq_last_error());
        /* the scaled KL at 64 vs the measured: KL is second order in the logit change, the error ratio
         * first order in the attention output's. With each query seeing the cache at its own position
         * (kvpq_cache_append_attend, 2026-12-05) fewer positions are coded per query and the ratio
         * spreads more: measured 0.86-1.54 here (before, with the step's end deciding, within 10%),
         * asserted within 1.6 */
        const double WIN_TOL = 1.6;
        double s16 = 0, s64w = 0, s64m = 0;
        for (int i = 0; i < 3 * 2 * SL; i++) {
            cr_assert_float_eq(klw[i], kl16[i], 1e-12 + 1e-9 * kl16[i], "window 16 scaled to itself: %g vs %g", klw[i],
                               kl16[i]);
            cr_assert_eq(klw[2 * 3 * 2 * SL + i], 0.0, "a window of every position codes none");
            const double sc = klw[3 * 2 * SL + i], me = kl64[i];
            fprintf(stderr, "window 64, %s %s layer %d: scaled %.4g measured %.4g\n", PRESETS[i / (2 * SL)],
                    i / SL % 2 ? "values" : "keys", i % SL, sc, me);
            if (me > 0.05 * kl16[i] && me > 1e-5)
                cr_assert(sc < WIN_TOL * me && me < WIN_TOL * sc, "window 64, item %d: scaled %g, measured %g", i, sc, me);
            s16 += kl16[i], s64w += sc, s64m += me;
        }
        cr_assert(s64w < s16 && s64m < s16, "a longer window loses less: 16: %g, 64: scaled %g, measured %g", s16, s64w,
                  s64m);
        for (int c = 0; c < 3; c++)
            for (int l = 0; l < SL; l++)
                if (l != SENSITIVE)
                    cr_assert_gt(klw[3 * 2 * SL + (c * 2 + 0) * SL + SENSITIVE], klw[3 * 2 * SL + (c * 2 + 0) * SL + l]);
        /* The same bits whatever the threads (calibrate compares these sums to choose the window, and
         * a tie broken by the order the threads finished made its file differ from run to run): the
         * scaled path's per-query errors and the KL sums are added in a fixed order. */
        {
            double klw1[3 * 3 * 2 * SL], kl1[3 * 2 * SL], klw2[3 * 3 * 2 * SL], kl2[3 * 2 * SL];
            for (int t = 1; t <= 2; t++) {
                kvpq_sensitivity_params s1 = kvpq_sensitivity_params_default();
                s1.window = 16, s1.windows = wins, s1.n_windows = 3, s1.ref_cand = 1, s1.n_threads = t;
                s1.kl_windows = t == 1 ? klw1 : klw2;
                cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &s1,
                                                          t == 1 ? kl1 : kl2),
                             KVPQ_OK, "%s", kvpq_last_error());
            }
            cr_assert(memcmp(kl1, kl2, sizeof kl1) == 0, "KL sums differ between 1 and 2 threads");
            cr_assert(memcmp(klw1, klw2, sizeof klw1) == 0, "window-scaled KLs differ between 1 and 2 threads");
        }
        sp.window = 16;
        const int bad[1] = {-1};
        sp.windows = bad, sp.n_windows = 1, sp.kl_windows = klw;
        cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, NH, (const kvpq_codebook *const *)cc, 3, &sp, kl16),
                     KVPQ_ERR_INVALID_ARG);
        sp.windows = NULL, sp.n_windows = 0, sp.kl_windows = NULL;
    }
    /* Sinks move the VQ cache's flush boundary: its kind holds positions S.., so with window 64 and
     * one sink a query at pos sees codes only once pos >= 96 (its pos + 1 - 1 >= 64 + 32); without
     * the sink once pos >= 95 ([0, 32)). Over 97 positions (the last one's logits predict nothing)
     * only the query at 95, without a sink, sees codes among the scored ones. The measurement must
     * see the same: every KL ~0 with the sink (it coded [1, 32) before 2026-12-02: KL up to 1.1),
     * some > 1e-3 without; by forward pass and by the scaled path. */
    {
        double z[3 * 2 * SL];
        for (int ref = -1; ref <= 1; ref += 2) {
            for (int S = 1; S >= 0; S--) {
                kvpq_sensitivity_params s1 = kvpq_sensitivity_params_default();
                s1.window = 64, s1.sinks = S, s1.n_threads = 2, s1.ref_cand = ref;
                cr_assert_eq(kvpq_model_layer_sensitivity(m, tok + NT, 97, (const kvpq_codebook *const *)cc, 3, &s1, z),
                             KVPQ_OK, "%s", kvpq_last_error());
                double mx = 0;
                for (int i = 0; i < 3 * 2 * SL; i++) mx = z[i] > mx ? z[i] : mx;
                /* (the measuring pass's own attention differs from the cache's in rounding: ~1e-8) */
                if (S) cr_assert_lt(mx, 1e-6, "ref %d: one sink, nothing coded, yet KL up to %g", ref, mx);
                else cr_assert_gt(mx, 1e-3, "ref %d: no sink, [0, 32) coded, yet KL only %g", ref, mx);
            }
        }
    }
    /* more bits, less loss, in the sensitive layer */
    cr_assert_gt(kl[(0 * 2 + 0) * SL + SENSITIVE], kl[(2 * 2 + 0) * SL + SENSITIVE]);
    /* the knapsack over keys and values at a budget of 2.2 bits at context CTX */
    kvpq_cache_params vp = cp;
    vp.type = KVPQ_CACHE_VQ, vp.max_seq = CTX, vp.window = 16;
    size_t lb[3][2 * SL], fixed = 0;
    int64_t el = 0;
    for (int c = 0; c < 3; c++) cr_assert_eq(kvpq_vq_cache_bytes(cc[c], &vp, CTX, 512, lb[c], &fixed, &el), KVPQ_OK);
    /* the budget: what d4b8 everywhere costs (about 2.8 bits here, codebooks included) */
    double mid = (double)fixed;
    for (int i = 0; i < 2 * SL; i++) mid += (double)lb[1][i];
    const double B = 8 * mid / (double)el;
    cr_assert(B > 2 && B < 4, "B %g", B);
    double cost[2 * SL * 3];
    int64_t w[2 * SL * 3];
    for (int g = 0; g < 2 * SL; g++)
        for (int c = 0; c < 3; c++) {
            const int l = g % SL, kind = g / SL;
            cost[g * 3 + c] = kl[(c * 2 + kind) * SL + l];
            w[g * 3 + c] = (int64_t)lb[c][2 * l + kind];
        }
    int choice[2 * SL];
    int64_t used;
    cr_assert_eq(kvpq_alloc_mckp(2 * SL, 3, cost, w, (int64_t)(B * (double)el / 8 - (double)fixed), 0, choice, NULL,
                                 &used),
                 KVPQ_OK, "%s", kvpq_last_error());
    for (int kind = 0; kind < 2; kind++)
        for (int l = 0; l < SL; l++)
            cr_assert_geq(choice[kind * SL + SENSITIVE], choice[kind * SL + l], "kind %d: layer %d got %s, layer %d %s",
                          kind, SENSITIVE, PRESETS[choice[kind * SL + SENSITIVE]], l, PRESETS[choice[kind * SL + l]]);
    cr_assert_eq(choice[SENSITIVE], 2, "the sensitive layer's keys get 4 bits");
    /* the cache built from the allocation (per-layer key and value M, each layer's trained
     * quantizers) holds what the byte model predicts at CTX, within the budget */
    kvpq_codebook *fin = make_cb(SL, SHKV, SD, "d4b8", "d4b8");
    double bytes = (double)fixed;
    for (int l = 0; l < SL; l++) {
        const kvpq_pq *kq = kvpq_codebook_pq_const(cc[choice[l]], l, 0), *vq = kvpq_codebook_pq_const(cc[choice[SL + l]], l, 1);
        cr_assert_eq(kvpq_codebook_set_layer_key_M(fin, l, kvpq_pq_get_params(kq).M), KVPQ_OK);
        cr_assert_eq(kvpq_codebook_set_layer_value_M(fin, l, kvpq_pq_get_params(vq).M), KVPQ_OK);
        kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 0), kvpq_pq_centroids(kq), kvpq_pq_centroids_size(kq));
        kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 1), kvpq_pq_centroids(vq), kvpq_pq_centroids_size(vq));
        memcpy(kvpq_codebook_key_smooth(fin, l), kvpq_codebook_key_smooth_const(cc[0], l), sizeof(float) * row);
        memcpy(kvpq_codebook_key_mean(fin, l), kvpq_codebook_key_mean_const(cc[0], l), sizeof(float) * row);
        bytes += (double)lb[choice[l]][2 * l] + (double)lb[choice[SL + l]][2 * l + 1];
    }
    const double predicted = 8 * bytes / (double)el;
    cr_assert_float_eq(bytes, (double)(used + (int64_t)fixed), 0.5);
    vp.codebook = fin;
    kvpq_cache *vc = NULL;
    cr_assert_eq(kvpq_cache_new(&vc, &vp), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_model_eval(m, vc, tok + NT + NH, CTX, 0, logits), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_cache_stats st;
    kvpq_cache_get_stats(vc, &st);
    cr_assert_float_eq(st.bits_per_element, predicted, 1e-9, "cache %.6f bits, predicted %.6f", st.bits_per_element,
                       predicted);
    /* the allocation itself (values as chosen) is within the budget */
    cr_assert_leq(8.0 * ((double)used + (double)fixed) / (double)el, B + 1e-12);
    kvpq_cache_free(vc);
    kvpq_codebook_free(fin);
    for (int c = 0; c < 3; c++) kvpq_codebook_free(cc[c]);
    kvpq_cache_free(fc);
    kvpq_model_free(m);
    free(tok), free(K), free(V), free(logits);
}

Test(alloc, sensitivity_refuses_bad_arguments) {
    kvpq_codebook *cb = make_cb(3, 2, 16, "d4b8", "d4b8");
    double kl[6];
    int32_t tok[64] = {0};
    const kvpq_codebook *cs[1] = {cb};
    cr_assert_eq(kvpq_model_layer_sensitivity(NULL, tok, 64, cs, 1, NULL, kl), KVPQ_ERR_INVALID_ARG);
    kvpq_codebook_free(cb);
}

/* ---- the codebook file ---------------------------------------------------------------------- */

Test(alloc, codebook_with_an_allocation_round_trips_and_older_files_load) {
    kvpq_codebook *cb = make_cb(3, 2, 16, "d4b8", "d4b8");
    cr_assert_eq(kvpq_codebook_set_layer_key_M(cb, 1, 8), KVPQ_OK);
    const char *keys[] = {"alloc.bits", "alloc.ctx", "alloc.k", "alloc.v", "alloc.kl.k", "alloc.kl.v", "alloc.predicted_kl",
                          "alloc.effective_bits"};
    const char *vals[] = {"2.5", "4096", "d4b8,d2b8,d4b8", "d4b8,d4b8,d4b8", "0.01,0.002,0.03", "0.001,0.001,0.001",
                          "0.045", "2.4871"};
    for (int i = 0; i < 8; i++) cr_assert_eq(kvpq_codebook_set_meta(cb, keys[i], vals[i]), KVPQ_OK);
    char path[] = "/tmp/kvpq_alloc_cb.XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    cr_assert_eq(kvpq_codebook_save(cb, path), KVPQ_OK, "%s", kvpq_last_error());
    kvpq_codebook *back = NULL;
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < 8; i++) cr_assert_str_eq(kvpq_codebook_get_meta(back, keys[i]), vals[i]);
    for (int l = 0; l < 3; l++) cr_assert_eq(kvpq_codebook_layer_key_M(back, l), l == 1 ? 8 : 4);
    cr_assert_eq(kvpq_codebook_fingerprint(back), kvpq_codebook_fingerprint(cb));
    kvpq_codebook_free(back);
    /* a file written without an allocation (as every file before --bits) loads, with no alloc.* keys */
    kvpq_codebook *old = make_cb(3, 2, 16, "d4b8", "d4b8");
    cr_assert_eq(kvpq_codebook_save(old, path), KVPQ_OK);
    cr_assert_eq(kvpq_codebook_load(&back, path), KVPQ_OK, "%s", kvpq_last_error());
    for (int i = 0; i < 8; i++) cr_assert_null(kvpq_codebook_get_meta(back, keys[i]));
    kvpq_codebook_free(back);
    kvpq_codebook_free(old);
    kvpq_codebook_free(cb);
    unlink(path);
}
