/* test_model_arch.c — the architecture table (src/model/arch.c) on small synthetic GGUF files
 * (float32 weights, random): the forward pass of llama, qwen2 and gemma3 against a plain fp64
 * implementation of each architecture written here from the papers' equations (biases, per-head
 * QK norm, post-norms, GELU-tanh gate, NEOX vs adjacent-pair RoPE, local rope base, sliding-window
 * attention, embedding scale, logit softcapping), and the refusals: a missing tensor, an
 * unexpected tensor, a cache whose sliding window differs. Needs no model file. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache_testutil.h"
#include "gguf_writer.h"
#include "kvpq_model.h"

/* kvpq (float32, RMS sums in double) vs the fp64 reference, relative to the largest logit, over 3
 * layers and 24 positions of a width-64 model: float32 rounding stays below 1e-5; a wrong rope
 * layout, base, window or norm moves logits by 1e-2 and more. */
#define LOGIT_RTOL 1e-4

/* ---- synthetic models, written by tests/gguf_writer.c -------------------------------------- */

typedef struct {
    char name[64];
    int n_dims;
    int64_t ne[2];
    float *data; /* owned */
} tensor;

typedef struct {
    char arch[16];
    int n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, n_vocab;
    float rope_base, eps;
    int swa, swa_pattern; /* sliding window (0 none), pattern key (0: not written) */
    float softcap;        /* 0: key not written */
    tensor t[128];
    int nt;
    uint64_t seed;
} model_spec;

static tensor *add_tensor(model_spec *s, const char *name, int64_t rows, int64_t cols, float scale, float offset) {
    cr_assert_lt(s->nt, 128);
    tensor *t = &s->t[s->nt++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = rows == 1 ? 1 : 2;
    t->ne[0] = cols, t->ne[1] = rows;
    t->data = malloc((size_t)rows * cols * sizeof(float));
    for (int64_t i = 0; i < rows * cols; i++) t->data[i] = offset + scale * rng_normal(&s->seed);
    return t;
}

static tensor *find_t(model_spec *s, const char *name) {
    for (int i = 0; i < s->nt; i++)
        if (!strcmp(s->t[i].name, name)) return &s->t[i];
    return NULL;
}

static void remove_t(model_spec *s, const char *name) {
    tensor *t = find_t(s, name);
    cr_assert_not_null(t, "%s", name);
    free(t->data);
    *t = s->t[--s->nt];
}

/* Random weights for every tensor the architecture reads. */
static void make_weights(model_spec *s) {
    const int E = s->n_embd, Q = s->n_head * s->head_dim, KV = s->n_head_kv * s->head_dim, F = s->n_ff;
    const int qwen = !strcmp(s->arch, "qwen2"), gemma = !strcmp(s->arch, "gemma3");
    const float ws = 1.0f / sqrtf((float)E);
    add_tensor(s, "token_embd.weight", s->n_vocab, E, gemma ? 0.1f : 1.0f, 0);
    add_tensor(s, "output_norm.weight", 1, E, 0.1f, 1.0f);
    if (!gemma) add_tensor(s, "output.weight", s->n_vocab, E, ws, 0);
    char n[64];
    for (int l = 0; l < s->n_layer; l++) {
#define T(suffix, r, c, sc, off) (snprintf(n, sizeof n, "blk.%d." suffix, l), add_tensor(s, n, r, c, sc, off))
        T("attn_norm.weight", 1, E, 0.1f, 1.0f);
        T("attn_q.weight", Q, E, ws, 0);
        T("attn_k.weight", KV, E, ws, 0);
        T("attn_v.weight", KV, E, ws, 0);
        T("attn_output.weight", E, Q, 1.0f / sqrtf((float)Q), 0);
        T("ffn_norm.weight", 1, E, 0.1f, 1.0f);
        T("ffn_gate.weight", F, E, ws, 0);
        T("ffn_up.weight", F, E, ws, 0);
        T("ffn_down.weight", E, F, 1.0f / sqrtf((float)F), 0);
        if (qwen) {
            T("attn_q.bias", 1, Q, 0.5f, 0);
            T("attn_k.bias", 1, KV, 0.5f, 0);
            T("attn_v.bias", 1, KV, 0.5f, 0);
        }
        if (gemma) {
            T("attn_q_norm.weight", 1, s->head_dim, 0.1f, 1.0f);
            T("attn_k_norm.weight", 1, s->head_dim, 0.1f, 1.0f);
            T("post_attention_norm.weight", 1, E, 0.1f, 1.0f);
            T("post_ffw_norm.weight", 1, E, 0.1f, 1.0f);
        }
#undef T
    }
}

static void kv_u32(gw_buf *b, const char *arch, const char *k, uint32_t v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    gw_kv_u32(b, key, v);
}
static void kv_f32(gw_buf *b, const char *arch, const char *k, float v) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, k);
    gw_kv_f32(b, key, v);
}

/* Write the file; returns its path (a temporary file the caller unlinks). */
static char *write_gguf(const model_spec *s) {
    gw_buf kv = {0}, tens = {0}, data = {0};
    const char *a = s->arch;
    gw_kv_str(&kv, "general.architecture", a);
    /* A tokenizer kvpq does not run: the model still loads and evaluates token ids. */
    gw_kv_str(&kv, "tokenizer.ggml.model", "bert");
    kv_u32(&kv, a, "block_count", (uint32_t)s->n_layer);
    kv_u32(&kv, a, "embedding_length", (uint32_t)s->n_embd);
    kv_u32(&kv, a, "feed_forward_length", (uint32_t)s->n_ff);
    kv_u32(&kv, a, "attention.head_count", (uint32_t)s->n_head);
    kv_u32(&kv, a, "attention.head_count_kv", (uint32_t)s->n_head_kv);
    kv_u32(&kv, a, "attention.key_length", (uint32_t)s->head_dim);
    kv_u32(&kv, a, "attention.value_length", (uint32_t)s->head_dim);
    kv_u32(&kv, a, "context_length", 4096);
    kv_f32(&kv, a, "rope.freq_base", s->rope_base);
    kv_f32(&kv, a, "attention.layer_norm_rms_epsilon", s->eps);
    if (s->swa) kv_u32(&kv, a, "attention.sliding_window", (uint32_t)s->swa);
    if (s->swa_pattern) kv_u32(&kv, a, "attention.sliding_window_pattern", (uint32_t)s->swa_pattern);
    if (s->softcap > 0) kv_f32(&kv, a, "final_logit_softcapping", s->softcap);
    for (int i = 0; i < s->nt; i++) {
        const tensor *t = &s->t[i];
        const uint64_t ne[2] = {(uint64_t)t->ne[0], (uint64_t)t->ne[1]};
        gw_tensor_info(&tens, t->name, (uint32_t)t->n_dims, ne, 0 /* F32 */, data.n);
        gw_put(&data, t->data, (size_t)t->ne[0] * (t->n_dims > 1 ? t->ne[1] : 1) * 4);
        gw_pad(&data, 32);
    }
    gw_buf b = gw_file(&kv, (uint64_t)s->nt, &tens, &data, 32);
    char *path = gw_write_temp(&b, "/tmp/kvpq_arch.XXXXXX");
    cr_assert_not_null(path);
    gw_free(&b), gw_free(&kv), gw_free(&tens), gw_free(&data);
    return path;
}

static void free_spec(model_spec *s) {
    for (int i = 0; i < s->nt; i++) free(s->t[i].data);
    s->nt = 0;
}

static model_spec spec_of(const char *arch) {
    model_spec s;
    memset(&s, 0, sizeof s);
    snprintf(s.arch, sizeof s.arch, "%s", arch);
    s.n_layer = 3, s.n_embd = 64, s.n_ff = 96, s.n_vocab = 40, s.eps = 1e-6f, s.seed = 1234;
    if (!strcmp(arch, "gemma3")) { /* MQA, head_dim 32: n_head * head_dim (128) != n_embd */
        s.n_head = 4, s.n_head_kv = 1, s.head_dim = 32, s.rope_base = 1e6f, s.swa = 8, s.swa_pattern = 3;
    } else if (!strcmp(arch, "qwen2")) {
        s.n_head = 4, s.n_head_kv = 2, s.head_dim = 16, s.rope_base = 1e6f;
    } else {
        s.n_head = 4, s.n_head_kv = 2, s.head_dim = 16, s.rope_base = 1e4f;
    }
    return s;
}

/* ---- the fp64 reference ----------------------------------------------------------------------- */

static const float *W_(model_spec *s, int l, const char *suffix) {
    char n[64];
    if (l < 0)
        snprintf(n, sizeof n, "%s", suffix);
    else
        snprintf(n, sizeof n, "blk.%d.%s", l, suffix);
    tensor *t = find_t(s, n);
    return t ? t->data : NULL;
}

static void rms(double *x, int n, const float *w, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    double r = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) x[i] *= r * w[i];
}

static void matvec(const float *W, int rows, int cols, const double *x, double *y) {
    for (int r = 0; r < rows; r++) {
        double a = 0;
        for (int c = 0; c < cols; c++) a += (double)W[(size_t)r * cols + c] * x[c];
        y[r] = a;
    }
}

static void rope_ref(double *x, int hd, int pos, double base, int neox) {
    for (int i = 0; i < hd / 2; i++) {
        double th = pos * pow(base, -2.0 * i / hd), c = cos(th), s = sin(th);
        int a = neox ? i : 2 * i, b = neox ? i + hd / 2 : 2 * i + 1;
        double x0 = x[a], x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}

/* logits (n, n_vocab) of tokens at positions 0..n-1 */
static void ref_forward(model_spec *s, const int32_t *tok, int n, double *logits) {
    const int E = s->n_embd, hd = s->head_dim, H = s->n_head, HKV = s->n_head_kv, F = s->n_ff, V = s->n_vocab;
    const int Q = H * hd, KV = HKV * hd, L = s->n_layer;
    const int gemma = !strcmp(s->arch, "gemma3"), neox = strcmp(s->arch, "llama") != 0;
    double *K = calloc((size_t)L * n * KV, sizeof *K), *Vc = calloc((size_t)L * n * KV, sizeof *Vc);
    double *x = malloc(E * sizeof *x), *a = malloc(E * sizeof *a), *q = malloc(Q * sizeof *q),
           *att = malloc(Q * sizeof *att), *o = malloc(E * sizeof *o), *g = malloc(F * sizeof *g),
           *u = malloc(F * sizeof *u), *w = malloc(n * sizeof *w);
    for (int t = 0; t < n; t++) {
        const float *emb = W_(s, -1, "token_embd.weight") + (size_t)tok[t] * E;
        for (int i = 0; i < E; i++) x[i] = emb[i] * (gemma ? sqrt((double)E) : 1.0);
        for (int l = 0; l < L; l++) {
            const int local = s->swa > 0 && l % s->swa_pattern < s->swa_pattern - 1;
            const double base = local ? 10000.0 : s->rope_base;
            memcpy(a, x, E * sizeof *a);
            rms(a, E, W_(s, l, "attn_norm.weight"), s->eps);
            double *k = K + ((size_t)l * n + t) * KV, *v = Vc + ((size_t)l * n + t) * KV;
            matvec(W_(s, l, "attn_q.weight"), Q, E, a, q);
            matvec(W_(s, l, "attn_k.weight"), KV, E, a, k);
            matvec(W_(s, l, "attn_v.weight"), KV, E, a, v);
            const float *bq = W_(s, l, "attn_q.bias"), *bk = W_(s, l, "attn_k.bias"), *bv = W_(s, l, "attn_v.bias");
            for (int i = 0; bq && i < Q; i++) q[i] += bq[i];
            for (int i = 0; bk && i < KV; i++) k[i] += bk[i], v[i] += bv[i];
            for (int h = 0; h < H; h++) {
                if (W_(s, l, "attn_q_norm.weight")) rms(q + h * hd, hd, W_(s, l, "attn_q_norm.weight"), s->eps);
                rope_ref(q + h * hd, hd, t, base, neox);
            }
            for (int h = 0; h < HKV; h++) {
                if (W_(s, l, "attn_k_norm.weight")) rms(k + h * hd, hd, W_(s, l, "attn_k_norm.weight"), s->eps);
                rope_ref(k + h * hd, hd, t, base, neox);
            }
            const int t0 = local && t - s->swa + 1 > 0 ? t - s->swa + 1 : 0;
            for (int h = 0; h < H; h++) {
                const int kvh = h / (H / HKV);
                double m = -INFINITY, d = 0;
                for (int p = t0; p <= t; p++) {
                    const double *kp = K + ((size_t)l * n + p) * KV + kvh * hd;
                    double sc = 0;
                    for (int i = 0; i < hd; i++) sc += q[h * hd + i] * kp[i];
                    w[p] = sc / sqrt((double)hd);
                    m = w[p] > m ? w[p] : m;
                }
                for (int i = 0; i < hd; i++) att[h * hd + i] = 0;
                for (int p = t0; p <= t; p++) d += (w[p] = exp(w[p] - m));
                for (int p = t0; p <= t; p++)
                    for (int i = 0; i < hd; i++)
                        att[h * hd + i] += w[p] / d * Vc[((size_t)l * n + p) * KV + kvh * hd + i];
            }
            matvec(W_(s, l, "attn_output.weight"), E, Q, att, o);
            if (W_(s, l, "post_attention_norm.weight")) rms(o, E, W_(s, l, "post_attention_norm.weight"), s->eps);
            for (int i = 0; i < E; i++) x[i] += o[i];
            memcpy(a, x, E * sizeof *a);
            rms(a, E, W_(s, l, "ffn_norm.weight"), s->eps);
            matvec(W_(s, l, "ffn_gate.weight"), F, E, a, g);
            matvec(W_(s, l, "ffn_up.weight"), F, E, a, u);
            for (int i = 0; i < F; i++) {
                double z = g[i];
                double act = gemma ? 0.5 * z * (1 + tanh(sqrt(2 / M_PI) * (z + 0.044715 * z * z * z)))
                                   : z / (1 + exp(-z));
                g[i] = act * u[i];
            }
            matvec(W_(s, l, "ffn_down.weight"), E, F, g, o);
            if (W_(s, l, "post_ffw_norm.weight")) rms(o, E, W_(s, l, "post_ffw_norm.weight"), s->eps);
            for (int i = 0; i < E; i++) x[i] += o[i];
        }
        memcpy(a, x, E * sizeof *a);
        rms(a, E, W_(s, -1, "output_norm.weight"), s->eps);
        const float *out = W_(s, -1, "output.weight");
        matvec(out ? out : W_(s, -1, "token_embd.weight"), V, E, a, logits + (size_t)t * V);
        if (s->softcap > 0)
            for (int i = 0; i < V; i++) logits[(size_t)t * V + i] = s->softcap * tanh(logits[(size_t)t * V + i] / s->softcap);
    }
    free(K), free(Vc), free(x), free(a), free(q), free(att), free(o), free(g), free(u), free(w);
}

/* ---- tests ------------------------------------------------------------------------------------ */

static kvpq_model *load(const char *path) {
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = 2;
    kvpq_model *m = NULL;
    cr_assert_eq(kvpq_model_load(&m, path, &mp), KVPQ_OK, "load: %s", kvpq_last_error());
    return m;
}

static kvpq_cache *cache_for(const kvpq_model *m, kvpq_cache_type type, int max_seq) {
    kvpq_cache_params cp = kvpq_cache_params_default();
    cr_assert_eq(kvpq_model_cache_params(m, &cp), KVPQ_OK);
    cp.type = type;
    cp.max_seq = max_seq;
    cp.page_tokens = 4; /* so the local layers drop pages within the sequence */
    cp.n_threads = 2;
    cp.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &cp), KVPQ_OK, "%s", kvpq_last_error());
    return c;
}

/* kvpq's logits of a 24-token sequence (a prefill of 10, then one token at a time) against the
 * fp64 reference of the architecture. */
static void check_arch(model_spec *s) {
    make_weights(s);
    char *path = write_gguf(s);
    kvpq_model *m = load(path);
    unlink(path);
    free(path);
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    cr_assert_str_eq(mi.arch, s->arch);
    cr_assert_eq(mi.sliding_window, s->swa);
    cr_assert_eq(mi.n_swa_layers, s->swa ? 2 : 0);
    enum { N = 24, P = 10 };
    int32_t tok[N];
    uint64_t seed = 77;
    for (int i = 0; i < N; i++) tok[i] = (int32_t)(rng_next(&seed) % (uint64_t)s->n_vocab);
    double *ref = malloc((size_t)N * s->n_vocab * sizeof *ref);
    ref_forward(s, tok, N, ref);
    float *got = malloc((size_t)N * s->n_vocab * sizeof *got);
    kvpq_cache *c = cache_for(m, KVPQ_CACHE_FP32, N);
    cr_assert_eq(kvpq_model_eval(m, c, tok, P, 1, got), KVPQ_OK, "%s", kvpq_last_error());
    for (int t = P; t < N; t++)
        cr_assert_eq(kvpq_model_eval(m, c, tok + t, 1, 0, got + (size_t)t * s->n_vocab), KVPQ_OK, "%s",
                     kvpq_last_error());
    double e = rel_err_f64(got, ref, (size_t)N * s->n_vocab);
    cr_assert(e < LOGIT_RTOL, "%s: logits vs fp64 reference: rel err %.3g", s->arch, e);
    if (s->softcap > 0)
        for (size_t i = 0; i < (size_t)N * s->n_vocab; i++) cr_assert(fabsf(got[i]) <= s->softcap);
    kvpq_cache_free(c);
    if (s->swa) { /* a cache without the model's window is refused, naming the layer */
        kvpq_cache_params cp = kvpq_cache_params_default();
        kvpq_model_cache_params(m, &cp);
        cp.sliding_window = 0, cp.max_seq = N;
        cr_assert_eq(kvpq_cache_new(&c, &cp), KVPQ_OK);
        cr_assert_eq(kvpq_model_eval(m, c, tok, 4, 0, got), KVPQ_ERR_MISMATCH);
        cr_assert(strstr(kvpq_last_error(), "sliding window"), "%s", kvpq_last_error());
        kvpq_cache_free(c);
    }
    free(ref), free(got);
    kvpq_model_free(m);
    free_spec(s);
}

Test(model_arch, llama_matches_fp64_reference) {
    model_spec s = spec_of("llama");
    check_arch(&s);
}

Test(model_arch, qwen2_biases_and_neox_rope_match_fp64_reference) {
    model_spec s = spec_of("qwen2");
    check_arch(&s);
}

Test(model_arch, gemma3_norms_gelu_sliding_window_match_fp64_reference) {
    model_spec s = spec_of("gemma3");
    check_arch(&s);
}

Test(model_arch, gemma3_final_logit_softcapping) {
    model_spec s = spec_of("gemma3");
    s.softcap = 0.5f;
    check_arch(&s);
}

static void expect_refused(model_spec *s, const char *needle) {
    char *path = write_gguf(s);
    kvpq_model *m = NULL;
    kvpq_status st = kvpq_model_load(&m, path, NULL);
    unlink(path);
    free(path);
    cr_assert_eq(st, KVPQ_ERR_FORMAT, "%s: status %d: %s", s->arch, st, kvpq_last_error());
    cr_assert_null(m);
    cr_assert(strstr(kvpq_last_error(), needle), "message names %s: %s", needle, kvpq_last_error());
    free_spec(s);
}

Test(model_arch, missing_tensor_is_refused_by_name) {
    model_spec s = spec_of("qwen2");
    make_weights(&s);
    remove_t(&s, "blk.1.attn_k.bias"); /* a Qwen2 file without its biases would run silently wrong */
    expect_refused(&s, "blk.1.attn_k.bias");
    s = spec_of("gemma3");
    make_weights(&s);
    remove_t(&s, "blk.2.post_ffw_norm.weight");
    expect_refused(&s, "blk.2.post_ffw_norm.weight");
}

/* block_count is checked against the file's tensors before the layer table is allocated: fuzz_model
 * found 4 KB files claiming up to 2^24 layers, a 2.2-4.4 GB allocation before any layer was looked
 * at (the inputs: tests/fuzz/regressions/model/). */
Test(model_arch, block_count_beyond_the_tensors_is_refused_before_allocating) {
    const int counts[] = {4, 1 << 23, 1 << 24};
    for (int i = 0; i < 3; i++) {
        model_spec s = spec_of(i == 1 ? "gemma3" : "llama"); /* gemma3: the sliding-window flags too */
        make_weights(&s);
        s.n_layer = counts[i];
        expect_refused(&s, "block_count");
    }
}

Test(model_arch, unexpected_tensor_is_refused_by_name) {
    model_spec s = spec_of("llama");
    make_weights(&s);
    add_tensor(&s, "blk.0.attn_q.bias", 1, s.n_head * s.head_dim, 1.0f, 0); /* a qwen2 file labelled llama */
    expect_refused(&s, "blk.0.attn_q.bias");
    s = spec_of("qwen2");
    make_weights(&s);
    add_tensor(&s, "rope_freqs.weight", 1, s.head_dim / 2, 1.0f, 1.0f);
    expect_refused(&s, "rope_freqs.weight");
    s = spec_of("llama");
    make_weights(&s);
    add_tensor(&s, "blk.3.attn_norm.weight", 1, s.n_embd, 1.0f, 1.0f); /* a layer beyond block_count */
    expect_refused(&s, "blk.3.attn_norm.weight");
}
