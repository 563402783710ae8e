/* llama.c — the decoder forward pass of the architectures in arch.h (llama, qwen2, gemma3) over a
 * memory-mapped GGUF model, with attention through the kvpq KV cache (kvpq.h "models").
 *
 * One layer (Touvron et al. 2023, "LLaMA", arXiv 2302.13971, and llama.cpp's graphs for
 * LLM_ARCH_LLAMA / QWEN2 / GEMMA3); the bracketed steps are taken where the descriptor says so:
 *   a   = rmsnorm(x) . attn_norm
 *   q   = rope([qnorm](Wq a [+ bq])) [* attention scale], k = rope([knorm](Wk a [+ bk])), v = Wv a [+ bv]
 *   h   = x + [post_attention_norm](Wo . attend(q, k, v))
 *   f   = rmsnorm(h) . ffn_norm
 *   out = h + [post_ffw_norm](Wdown . (act(Wgate f) * (Wup f)))      act: silu (SwiGLU) or gelu_tanh
 * RoPE (Su et al. 2021, arXiv 2104.09864) rotates by pos * base^(-2i / n_rot) either adjacent pairs
 * (x[2i], x[2i+1]) (llama.cpp mode "normal": its GGUF converter permutes the Q/K rows of HF Llama
 * checkpoints so that this equals HF's rotate-half) or halves (x[i], x[i + n_rot/2]) (mode "neox").
 * Sliding-window (local) layers use their own rope base, and the cache lets their queries see only
 * the last sliding_window positions (kvpq_cache_params.sliding_window). Keys go into the cache after
 * RoPE; attention (causal, GQA, scale 1/sqrt(head_dim); another scale is folded into q) is the
 * cache's (kvpq_cache_attend), so every cache kind is tested by the same forward pass. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "arch.h"
#include "cpu/dispatch.h"
#include "ggml_types.h"
#include "gguf.h"
#include "internal.h"
#include "tokenizer.h"
#include "eval_hook.h"

/* Tokens per internal step of kvpq_model_eval: the scratch is sized for this many, so a long
 * prefill runs in steps of this size and decode allocates nothing. */
#define LLAMA_BLOCK 512

/* A layer's tensors, indexed by arch_tensor (shapes in arch.h): matrices stay in the mapping,
 * vectors (norms, biases) are dequantized to float. NULL where the layer has none. */
typedef struct {
    const gguf_tensor *w[ARCH_T_COUNT];
    float *vec[ARCH_T_COUNT];
    const float *inv_freq; /* (n_rot / 2) of this layer's rope base */
} llama_layer;

struct kvpq_model {
    gguf_file *gf;
    kvpq_tokenizer *tok;
    kvpq_model_info info;
    char *chat_template; /* NUL-terminated copy of tokenizer.chat_template, or NULL */
    char *tok_error;     /* why the tokenizer is missing (tok NULL): ids still run */
    const kvpq_arch *arch;
    int n_rot;           /* dims rotated by RoPE (<arch>.rope.dimension_count) */
    float q_scale;       /* folded into q: the model's attention scale * sqrt(head_dim) (1: none) */
    float embd_scale;    /* token embeddings are multiplied by it (1: none) */
    float logit_softcap; /* logits = c * tanh(logits / c) when > 0 (<arch>.final_logit_softcapping) */
    float rope_base_swa; /* rope base of sliding-window layers */
    uint8_t *swa;        /* (n_layer) 1 = sliding-window layer; NULL when the model has none */
    int n_threads;
    int act;                     /* ACT_*: how the matrices meet the activations (KVPQ_ACT) */
    const gguf_tensor *tok_embd; /* (n_vocab, n_embd) */
    const gguf_tensor *output;   /* (n_vocab, n_embd); token_embd when the file ties them */
    float *output_norm;          /* (n_embd) */
    llama_layer *layers;         /* (n_layer) */
    float *inv_freq;             /* (n_rot / 2) base^(-2i / n_rot) */
    float *inv_freq_swa;         /* (n_rot / 2) the same for rope_base_swa */

    /* ---- scratch for LLAMA_BLOCK tokens ---- */
    float *x;    /* (LLAMA_BLOCK, n_embd) residual stream */
    float *xb;   /* (LLAMA_BLOCK, n_embd) normed input of a sub-layer */
    float *xb2;  /* (LLAMA_BLOCK, n_embd) sub-layer output */
    float *q;    /* (LLAMA_BLOCK, n_head, head_dim) */
    float *k;    /* (LLAMA_BLOCK, n_head_kv, head_dim) */
    float *v;    /* (LLAMA_BLOCK, n_head_kv, head_dim) */
    float *att;  /* (LLAMA_BLOCK, n_head, head_dim) attention output */
    float *hb;   /* (LLAMA_BLOCK, n_ff) */
    float *hb2;  /* (LLAMA_BLOCK, n_ff) */
};

/* ---- loading -------------------------------------------------------------------------------- */

static kvpq_status get_u32_key(const gguf_file *f, const char *arch, const char *suffix, int required,
                               uint32_t dflt, int *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (gguf_find_key(f, key) < 0) {
        if (required) return kvpq__err(KVPQ_ERR_FORMAT, "metadata key %s: missing", key);
        *out = (int)dflt;
        return KVPQ_OK;
    }
    uint32_t v;
    KVPQ_TRY(gguf_get_u32(f, key, &v));
    if (v == 0 || v > (1u << 24)) return kvpq__err(KVPQ_ERR_FORMAT, "metadata key %s: value %u out of range", key, v);
    *out = (int)v;
    return KVPQ_OK;
}

static kvpq_status get_f32_key(const gguf_file *f, const char *arch, const char *suffix, float dflt, float *out) {
    char key[160];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    if (gguf_find_key(f, key) < 0) {
        *out = dflt;
        return KVPQ_OK;
    }
    KVPQ_TRY(gguf_get_f32(f, key, out));
    if (!isfinite(*out) || *out <= 0) return kvpq__err(KVPQ_ERR_FORMAT, "metadata key %s: value %g out of range", key, *out);
    return KVPQ_OK;
}

/* Find a 2-D matrix tensor of shape (rows, cols) (ggml ne = {cols, rows}) of a supported type. */
static kvpq_status find_matrix(const gguf_file *f, const char *name, int64_t rows, int64_t cols,
                               const gguf_tensor **out) {
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: missing", name);
    if (!ggml_type_supported(t->type))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "tensor %s: type %s is not supported", name, ggml_type_name(t->type));
    if (t->ne[0] != cols || t->ne[1] != rows || t->ne[2] != 1 || t->ne[3] != 1)
        return kvpq__err(KVPQ_ERR_FORMAT,
                         "tensor %s: shape [%lld, %lld, %lld, %lld], expected [%lld, %lld] (ggml order)", name,
                         (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                         (long long)cols, (long long)rows);
    if (cols % ggml_blck_size(t->type) != 0 || t->nbytes < (size_t)rows * ggml_row_size(t->type, cols))
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: %zu bytes is too small for its shape", name, t->nbytes);
    *out = t;
    return KVPQ_OK;
}

/* A 1-D weight of n elements, dequantized into a new float array. */
static kvpq_status load_vector(const gguf_file *f, const char *name, int64_t n, float **out) {
    const gguf_tensor *t = NULL;
    KVPQ_TRY(find_matrix(f, name, 1, n, &t));
    float *w = malloc((size_t)n * sizeof *w);
    if (!w) return kvpq__err(KVPQ_ERR_NOMEM, "tensor %s: out of memory", name);
    kvpq_status s = ggml_dequantize_row(t->type, t->data, w, n);
    if (s == KVPQ_OK && !kvpq__all_finite(w, (size_t)n)) s = kvpq__err(KVPQ_ERR_NONFINITE, "tensor %s: NaN or Inf", name);
    if (s != KVPQ_OK) {
        free(w);
        return s;
    }
    *out = w;
    return KVPQ_OK;
}

static char *dup_n(const char *s, size_t n) {
    char *d = malloc(n + 1);
    if (d) {
        memcpy(d, s, n);
        d[n] = 0;
    }
    return d;
}

static kvpq_status load_hparams(kvpq_model *m) {
    const gguf_file *f = m->gf;
    kvpq_model_info *in = &m->info;
    const char *s;
    size_t n;
    KVPQ_TRY(gguf_get_str(f, "general.architecture", &s, &n));
    if (n >= sizeof in->arch) n = sizeof in->arch - 1;
    memcpy(in->arch, s, n);
    in->arch[n] = 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)in->arch[i] < 0x20 || (unsigned char)in->arch[i] > 0x7e) in->arch[i] = '?';
    m->arch = kvpq_arch_find(in->arch);
    if (!m->arch)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "architecture '%s' is not supported (supported: %s)", in->arch,
                         kvpq_arch_names());
    if (gguf_find_key(f, "general.name") >= 0 && gguf_get_str(f, "general.name", &s, &n) == KVPQ_OK) {
        if (n >= sizeof in->name) n = sizeof in->name - 1;
        memcpy(in->name, s, n);
        in->name[n] = 0;
    }
    const char *a = in->arch;
    KVPQ_TRY(get_u32_key(f, a, "block_count", 1, 0, &in->n_layer));
    /* Every layer holds the architecture's required tensors, so block_count is bounded by the file's
     * tensor count before anything is sized by it (the layer table, the sliding-window flags): a
     * 4 KB file claiming 2^24 layers made the layer table one 4.4 GB allocation (found by fuzz_model). */
    const int64_t per_layer = m->arch->layer_required ? __builtin_popcount(m->arch->layer_required) : 1;
    if ((int64_t)in->n_layer * per_layer > gguf_n_tensors(f))
        return kvpq__err(KVPQ_ERR_FORMAT,
                         "metadata key %s.block_count: %d layers of architecture %s need at least %lld tensors, the "
                         "file has %lld (truncated or corrupt)",
                         a, in->n_layer, m->arch->name, (long long)(in->n_layer * per_layer),
                         (long long)gguf_n_tensors(f));
    KVPQ_TRY(get_u32_key(f, a, "embedding_length", 1, 0, &in->n_embd));
    KVPQ_TRY(get_u32_key(f, a, "feed_forward_length", 1, 0, &in->n_ff));
    KVPQ_TRY(get_u32_key(f, a, "attention.head_count", 1, 0, &in->n_head));
    KVPQ_TRY(get_u32_key(f, a, "attention.head_count_kv", 0, (uint32_t)in->n_head, &in->n_head_kv));
    KVPQ_TRY(get_u32_key(f, a, "context_length", 1, 0, &in->n_ctx_train));
    if (in->n_embd % in->n_head != 0)
        return kvpq__err(KVPQ_ERR_FORMAT, "embedding_length %d is not a multiple of head_count %d", in->n_embd, in->n_head);
    KVPQ_TRY(get_u32_key(f, a, "attention.key_length", 0, (uint32_t)(in->n_embd / in->n_head), &in->head_dim));
    int v_len = 0;
    KVPQ_TRY(get_u32_key(f, a, "attention.value_length", 0, (uint32_t)in->head_dim, &v_len));
    if (v_len != in->head_dim)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "attention.value_length %d differs from key_length %d", v_len, in->head_dim);
    if (in->n_head % in->n_head_kv != 0)
        return kvpq__err(KVPQ_ERR_FORMAT, "head_count %d is not a multiple of head_count_kv %d", in->n_head, in->n_head_kv);
    KVPQ_TRY(get_u32_key(f, a, "rope.dimension_count", 0, (uint32_t)in->head_dim, &m->n_rot));
    if (m->n_rot > in->head_dim || m->n_rot % 2)
        return kvpq__err(KVPQ_ERR_FORMAT, "rope.dimension_count %d: expected an even number <= head_dim %d", m->n_rot, in->head_dim);
    KVPQ_TRY(get_f32_key(f, a, "rope.freq_base", 10000.0f, &in->rope_freq_base));
    KVPQ_TRY(get_f32_key(f, a, "attention.layer_norm_rms_epsilon", 1e-5f, &in->rms_eps));
    char key[160];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (gguf_find_key(f, key) >= 0 && gguf_get_str(f, key, &s, &n) == KVPQ_OK && !(n == 4 && !memcmp(s, "none", 4)))
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "%s '%.*s' is not supported", key, (int)(n > 32 ? 32 : n), s);
    /* Attention scale: <arch>.attention.scale where the file states it, else 1/sqrt(head_dim)
     * (Gemma 3's query_pre_attn_scalar equals head_dim in the sizes llama.cpp's graph maps so). The
     * cache scales by 1/sqrt(head_dim); the ratio is folded into q. */
    float att_scale = 0;
    KVPQ_TRY(get_f32_key(f, a, "attention.scale", 0, &att_scale));
    m->q_scale = att_scale > 0 ? att_scale * sqrtf((float)in->head_dim) : 1.0f;
    m->embd_scale = m->arch->embd_scale_sqrt ? sqrtf((float)in->n_embd) : 1.0f;
    KVPQ_TRY(get_f32_key(f, a, "final_logit_softcapping", 0, &m->logit_softcap));
    /* Sliding window: the size from the file, which layers are local from the descriptor's pattern
     * unless the file lists them (<arch>.attention.sliding_window_pattern, a count or a bool array). */
    int W = 0;
    KVPQ_TRY(get_u32_key(f, a, "attention.sliding_window", 0, 0, &W));
    if (W > 0 && m->arch->swa_pattern > 0) {
        m->swa = calloc((size_t)in->n_layer, 1);
        if (!m->swa) return kvpq__err(KVPQ_ERR_NOMEM, "model: out of memory");
        int pat = m->arch->swa_pattern;
        snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", a);
        gguf_type et;
        uint64_t cnt;
        const void *data;
        if (gguf_find_key(f, key) >= 0 && gguf_get_arr_info(f, key, &et, &cnt) == KVPQ_OK) {
            if ((et != GGUF_TYPE_BOOL && et != GGUF_TYPE_UINT8 && et != GGUF_TYPE_INT8) || cnt != (uint64_t)in->n_layer)
                return kvpq__err(KVPQ_ERR_FORMAT, "metadata key %s: expected %d bools", key, in->n_layer);
            KVPQ_TRY(gguf_get_arr_data(f, key, &data));
            for (int l = 0; l < in->n_layer; l++) m->swa[l] = ((const uint8_t *)data)[l] != 0;
        } else {
            KVPQ_TRY(get_u32_key(f, a, "attention.sliding_window_pattern", 0, (uint32_t)pat, &pat));
            for (int l = 0; l < in->n_layer; l++) m->swa[l] = l % pat < pat - 1;
        }
        for (int l = 0; l < in->n_layer; l++) in->n_swa_layers += m->swa[l];
        in->sliding_window = W;
        KVPQ_TRY(get_f32_key(f, a, "rope.freq_base_swa", m->arch->swa_rope_base, &m->rope_base_swa));
    }
    return KVPQ_OK;
}

/* Shape of a per-layer tensor: rows x cols for a matrix, (1, n) for a vector. */
static int layer_tensor_shape(const kvpq_model_info *in, arch_tensor t, int64_t *rows, int64_t *cols) {
    const int64_t E = in->n_embd, Q = (int64_t)in->n_head * in->head_dim, KV = (int64_t)in->n_head_kv * in->head_dim,
                  F = in->n_ff, D = in->head_dim;
    *rows = 1;
    switch (t) {
    case ARCH_T_ATTN_Q: *rows = Q, *cols = E; return 1;
    case ARCH_T_ATTN_K:
    case ARCH_T_ATTN_V: *rows = KV, *cols = E; return 1;
    case ARCH_T_ATTN_OUT: *rows = E, *cols = Q; return 1;
    case ARCH_T_FFN_GATE:
    case ARCH_T_FFN_UP: *rows = F, *cols = E; return 1;
    case ARCH_T_FFN_DOWN: *rows = E, *cols = F; return 1;
    case ARCH_T_ATTN_Q_BIAS: *cols = Q; return 0;
    case ARCH_T_ATTN_K_BIAS:
    case ARCH_T_ATTN_V_BIAS: *cols = KV; return 0;
    case ARCH_T_ATTN_Q_NORM:
    case ARCH_T_ATTN_K_NORM: *cols = D; return 0;
    default: *cols = E; return 0; /* the n_embd norms */
    }
}

/* Every tensor of the file must be one the architecture reads: a tensor it does not expect (a
 * mislabelled file, or a feature kvpq would silently drop) is refused by name. */
static kvpq_status check_no_unexpected(const kvpq_model *m) {
    const unsigned allowed = m->arch->layer_required | m->arch->layer_optional;
    for (int64_t i = 0; i < gguf_n_tensors(m->gf); i++) {
        const char *name = gguf_tensor_at(m->gf, i)->name;
        if (!strcmp(name, "token_embd.weight") || !strcmp(name, "output_norm.weight") || !strcmp(name, "output.weight"))
            continue;
        int l = -1, off = 0;
        if (sscanf(name, "blk.%d.%n", &l, &off) == 1 && off > 0 && l >= 0 && l < m->info.n_layer) {
            int ok = 0;
            for (int t = 0; t < ARCH_T_COUNT && !ok; t++)
                ok = (allowed & ARCH_BIT(t)) && !strcmp(name + off, arch_tensor_name((arch_tensor)t));
            if (ok) continue;
        }
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: not expected by architecture %s (refused rather than ignored)",
                         name, m->arch->name);
    }
    return KVPQ_OK;
}

static kvpq_status load_tensors(kvpq_model *m) {
    const gguf_file *f = m->gf;
    const kvpq_model_info *in = &m->info;
    int64_t E = in->n_embd;
    const gguf_tensor *te = gguf_find_tensor(f, "token_embd.weight");
    if (!te) return kvpq__err(KVPQ_ERR_FORMAT, "tensor token_embd.weight: missing");
    if (te->ne[1] < 1 || te->ne[1] > (1 << 24)) return kvpq__err(KVPQ_ERR_FORMAT, "tensor token_embd.weight: bad vocabulary size");
    m->info.n_vocab = (int)te->ne[1];
    KVPQ_TRY(find_matrix(f, "token_embd.weight", in->n_vocab, E, &m->tok_embd));
    if (gguf_find_tensor(f, "output.weight"))
        KVPQ_TRY(find_matrix(f, "output.weight", in->n_vocab, E, &m->output));
    else
        m->output = m->tok_embd; /* tied embeddings */
    KVPQ_TRY(load_vector(f, "output_norm.weight", E, &m->output_norm));
    KVPQ_TRY(check_no_unexpected(m));
    m->layers = calloc((size_t)in->n_layer, sizeof *m->layers);
    if (!m->layers) return kvpq__err(KVPQ_ERR_NOMEM, "model layers: out of memory");
    char name[96];
    for (int l = 0; l < in->n_layer; l++) {
        llama_layer *L = &m->layers[l];
        for (int t = 0; t < ARCH_T_COUNT; t++) {
            const int required = (m->arch->layer_required & ARCH_BIT(t)) != 0;
            snprintf(name, sizeof name, "blk.%d.%s", l, arch_tensor_name((arch_tensor)t));
            if (!gguf_find_tensor(f, name)) {
                if (required)
                    return kvpq__err(KVPQ_ERR_FORMAT, "tensor %s: missing (architecture %s requires it)", name,
                                     m->arch->name);
                continue;
            }
            int64_t rows, cols;
            if (layer_tensor_shape(in, (arch_tensor)t, &rows, &cols))
                KVPQ_TRY(find_matrix(f, name, rows, cols, &L->w[t]));
            else
                KVPQ_TRY(load_vector(f, name, cols, &L->vec[t]));
        }
    }
    return KVPQ_OK;
}

static kvpq_status alloc_scratch(kvpq_model *m) {
    const kvpq_model_info *in = &m->info;
    size_t B = LLAMA_BLOCK, E = (size_t)in->n_embd, Q = (size_t)in->n_head * in->head_dim,
           KV = (size_t)in->n_head_kv * in->head_dim, F = (size_t)in->n_ff;
    float **bufs[] = {&m->x, &m->xb, &m->xb2, &m->q, &m->k, &m->v, &m->att, &m->hb, &m->hb2};
    size_t sizes[] = {E, E, E, Q, KV, KV, Q, F, F};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        *bufs[i] = malloc(B * sizes[i] * sizeof(float));
        if (!*bufs[i]) return kvpq__err(KVPQ_ERR_NOMEM, "model scratch: out of memory");
    }
    m->inv_freq = malloc((size_t)(m->n_rot / 2 + 1) * sizeof(float));
    m->inv_freq_swa = malloc((size_t)(m->n_rot / 2 + 1) * sizeof(float));
    if (!m->inv_freq || !m->inv_freq_swa) return kvpq__err(KVPQ_ERR_NOMEM, "model scratch: out of memory");
    for (int i = 0; i < m->n_rot / 2; i++) {
        m->inv_freq[i] = (float)pow((double)in->rope_freq_base, -2.0 * i / m->n_rot);
        m->inv_freq_swa[i] = m->swa ? (float)pow((double)m->rope_base_swa, -2.0 * i / m->n_rot) : m->inv_freq[i];
    }
    for (int l = 0; l < in->n_layer; l++)
        m->layers[l].inv_freq = m->swa && m->swa[l] ? m->inv_freq_swa : m->inv_freq;
    return KVPQ_OK;
}

/* KVPQ_ACT: how the matrices meet the activations. "auto" (the default): activations quantized to
 * 8-bit blocks and integer dot products (model/ggml_types.h) for the types that have kernels, the
 * tile-of-4 kernels below GGML_MATMUL_BLAS_MIN_TOK tokens per step (decode) and the GEMM kernels from
 * there (prefill), float32 for the rest (OpenBLAS sgemm on long steps); "q8": the same, but a matrix
 * without a GEMM kernel takes the tile-of-4 kernels in prefill too; "f32": float32 activations
 * everywhere (the reference path). docs/cpu_kernels.md. */
enum { ACT_F32, ACT_AUTO, ACT_Q8 };
static kvpq_status act_mode(int *act) {
    const char *e = getenv("KVPQ_ACT");
    *act = ACT_AUTO;
    if (!e || !*e || !strcmp(e, "auto")) return KVPQ_OK;
    if (!strcmp(e, "q8") || !strcmp(e, "f32")) {
        *act = e[0] == 'q' ? ACT_Q8 : ACT_F32;
        return KVPQ_OK;
    }
    return kvpq__err(KVPQ_ERR_INVALID_ARG, "KVPQ_ACT=%s: expected auto (the default), q8 or f32", e);
}

int kvpq__model_act_reference(kvpq_model *m) {
    const int act = m->act;
    m->act = ACT_F32;
    return act;
}

void kvpq__model_act_restore(kvpq_model *m, int act) { m->act = act; }

kvpq_model_params kvpq_model_params_default(void) {
    kvpq_model_params p = {.n_threads = 0};
    return p;
}

kvpq_status kvpq_model_load(kvpq_model **out, const char *path, const kvpq_model_params *p) {
    if (!out || !path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_load: NULL argument");
    *out = NULL;
    if (p && (p->n_threads < 0 || p->n_threads > KVPQ_MAX_THREADS))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "n_threads %d: expected 0..%d", p->n_threads, KVPQ_MAX_THREADS);
    kvpq_model *m = calloc(1, sizeof *m);
    if (!m) return kvpq__err(KVPQ_ERR_NOMEM, "model: out of memory");
    m->n_threads = p ? p->n_threads : 0;
    kvpq_status s = act_mode(&m->act);
    if (s == KVPQ_OK) s = gguf_open(&m->gf, path);
    if (s == KVPQ_OK)
        snprintf(m->info.fingerprint, sizeof m->info.fingerprint, "%016llx",
                 (unsigned long long)gguf_fingerprint(m->gf));
    if (s == KVPQ_OK) s = load_hparams(m);
    if (s == KVPQ_OK) s = load_tensors(m);
    if (s == KVPQ_OK) {
        s = kvpq_tokenizer_from_gguf(&m->tok, m->gf);
        if (s == KVPQ_ERR_UNSUPPORTED) { /* the weights still run on token ids */
            m->tok_error = dup_n(kvpq_last_error(), strlen(kvpq_last_error()));
            m->tok = NULL;
            s = m->tok_error ? KVPQ_OK : kvpq__err(KVPQ_ERR_NOMEM, "model: out of memory");
        }
    }
    if (s == KVPQ_OK && m->tok && kvpq_tokenizer_n_vocab(m->tok) > m->info.n_vocab)
        s = kvpq__err(KVPQ_ERR_FORMAT, "tokenizer has %d tokens but token_embd.weight only %d rows",
                      kvpq_tokenizer_n_vocab(m->tok), m->info.n_vocab);
    m->info.bos_id = m->info.eos_id = -1;
    if (s == KVPQ_OK && !m->tok) { /* ids only: the special ids as the file states them */
        uint32_t id;
        int b;
        if (gguf_find_key(m->gf, "tokenizer.ggml.bos_token_id") >= 0 &&
            gguf_get_u32(m->gf, "tokenizer.ggml.bos_token_id", &id) == KVPQ_OK && id < (uint32_t)m->info.n_vocab)
            m->info.bos_id = (int32_t)id;
        if (gguf_find_key(m->gf, "tokenizer.ggml.eos_token_id") >= 0 &&
            gguf_get_u32(m->gf, "tokenizer.ggml.eos_token_id", &id) == KVPQ_OK && id < (uint32_t)m->info.n_vocab)
            m->info.eos_id = (int32_t)id;
        if (gguf_find_key(m->gf, "tokenizer.ggml.add_bos_token") >= 0 &&
            gguf_get_bool(m->gf, "tokenizer.ggml.add_bos_token", &b) == KVPQ_OK)
            m->info.add_bos = b && m->info.bos_id >= 0;
    }
    if (s == KVPQ_OK && m->tok) {
        m->info.bos_id = kvpq_tokenizer_bos(m->tok);
        m->info.eos_id = kvpq_tokenizer_eos(m->tok);
        m->info.add_bos = kvpq_tokenizer_add_bos_default(m->tok);
        const char *t;
        size_t n;
        if (gguf_find_key(m->gf, "tokenizer.chat_template") >= 0 &&
            gguf_get_str(m->gf, "tokenizer.chat_template", &t, &n) == KVPQ_OK) {
            m->chat_template = dup_n(t, n);
            if (!m->chat_template) s = kvpq__err(KVPQ_ERR_NOMEM, "chat template: out of memory");
        }
    }
    if (s == KVPQ_OK) s = alloc_scratch(m);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("model '%s'", path);
        kvpq_model_free(m);
        return s;
    }
    *out = m;
    return KVPQ_OK;
}

void kvpq_model_free(kvpq_model *m) {
    if (!m) return;
    if (m->layers)
        for (int l = 0; l < m->info.n_layer; l++)
            for (int t = 0; t < ARCH_T_COUNT; t++) free(m->layers[l].vec[t]);
    free(m->layers);
    free(m->output_norm);
    free(m->inv_freq);
    free(m->inv_freq_swa);
    free(m->swa);
    free(m->tok_error);
    free(m->chat_template);
    free(m->x);
    free(m->xb);
    free(m->xb2);
    free(m->q);
    free(m->k);
    free(m->v);
    free(m->att);
    free(m->hb);
    free(m->hb2);
    kvpq_tokenizer_free(m->tok);
    gguf_close(m->gf);
    free(m);
}

kvpq_status kvpq_model_get_info(const kvpq_model *m, kvpq_model_info *info) {
    if (!m || !info) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_get_info: NULL argument");
    *info = m->info;
    return KVPQ_OK;
}

const char *kvpq_model_chat_template(const kvpq_model *m) { return m ? m->chat_template : NULL; }

kvpq_status kvpq_model_data_fingerprint(const kvpq_model *m, char out[17]) {
    if (!m || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_data_fingerprint: NULL argument");
    snprintf(out, 17, "%016llx", (unsigned long long)gguf_data_fingerprint(m->gf));
    return KVPQ_OK;
}

kvpq_status kvpq_model_cache_params(const kvpq_model *m, kvpq_cache_params *p) {
    if (!m || !p) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_cache_params: NULL argument");
    p->n_layer = m->info.n_layer;
    p->n_head = m->info.n_head;
    p->n_head_kv = m->info.n_head_kv;
    p->head_dim = m->info.head_dim;
    p->sliding_window = m->swa ? m->info.sliding_window : 0;
    p->swa_layers = m->swa;
    return KVPQ_OK;
}

kvpq_status kvpq_model_rope(const kvpq_model *m, int layer, int *n_rot, int *neox, float *inv_freq) {
    if (!m || layer < 0 || layer >= m->info.n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_rope: %s", m ? "layer out of range" : "NULL model");
    if (n_rot) *n_rot = m->n_rot;
    if (neox) *neox = m->arch->rope == ARCH_ROPE_NEOX;
    if (inv_freq) memcpy(inv_freq, m->layers[layer].inv_freq, sizeof(float) * (size_t)(m->n_rot / 2));
    return KVPQ_OK;
}

kvpq_status kvpq_tokenize(const kvpq_model *m, const char *text, size_t len, int add_bos, int parse_special,
                          int32_t *tokens, size_t cap, size_t *n_tokens) {
    if (!m) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_tokenize: NULL model");
    if (!m->tok) return kvpq__err(KVPQ_ERR_UNSUPPORTED, "%s", m->tok_error);
    return kvpq_tokenizer_encode(m->tok, text, len, add_bos, parse_special, tokens, cap, n_tokens);
}

kvpq_status kvpq_token_to_piece(const kvpq_model *m, int32_t token, char *buf, size_t cap, size_t *len) {
    if (!m) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_token_to_piece: NULL model");
    if (!m->tok) return kvpq__err(KVPQ_ERR_UNSUPPORTED, "%s", m->tok_error);
    return kvpq_tokenizer_piece(m->tok, token, buf, cap, len);
}

unsigned kvpq_token_attr(const kvpq_model *m, int32_t token) { return m ? kvpq_tokenizer_token_attr(m->tok, token) : 0; }

/* ---- forward pass --------------------------------------------------------------------------- */

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, for n rows of E (ggml_rms_norm then mul; the sum of
 * squares is accumulated in double as ggml does). */
static void rmsnorm(int n, int E, const float *x, const float *w, float eps, float *y) {
#pragma omp parallel for schedule(static) if (n > 8)
    for (int t = 0; t < n; t++) {
        const float *xr = x + (size_t)t * E;
        float *yr = y + (size_t)t * E;
        double ss = 0;
        for (int i = 0; i < E; i++) ss += (double)xr[i] * xr[i];
        float scale = 1.0f / sqrtf((float)(ss / E) + eps);
        for (int i = 0; i < E; i++) yr[i] = xr[i] * scale * w[i];
    }
}

/* Rotate the first n_rot dims of each head, x: (n, n_heads, head_dim) at positions pos0 .. pos0+n-1,
 * by pos * inv_freq[i]: pairs (x[2i], x[2i+1]) (ARCH_ROPE_NORM) or (x[i], x[i + n_rot/2])
 * (ARCH_ROPE_NEOX). */
static void rope(const kvpq_model *m, const float *inv_freq, int n, int n_heads, int pos0, float *x) {
    const int hd = m->info.head_dim, half = m->n_rot / 2, neox = m->arch->rope == ARCH_ROPE_NEOX;
    const int stride = neox ? 1 : 2, other = neox ? half : 1;
#pragma omp parallel for schedule(static) if (n > 8)
    for (int t = 0; t < n; t++) {
        double pos = (double)(pos0 + t);
        for (int i = 0; i < half; i++) {
            double th = pos * inv_freq[i];
            float c = (float)cos(th), s = (float)sin(th);
            for (int h = 0; h < n_heads; h++) {
                float *p = x + ((size_t)t * n_heads + h) * hd + (size_t)i * stride;
                float x0 = p[0], x1 = p[other];
                p[0] = x0 * c - x1 * s;
                p[other] = x0 * s + x1 * c;
            }
        }
    }
}

/* x (n, dim) += b (dim) */
static void add_bias(int n, int dim, const float *b, float *x) {
    for (size_t t = 0; t < (size_t)n; t++)
        for (int i = 0; i < dim; i++) x[t * dim + i] += b[i];
}

/* How the rows of a step meet the matrices (their activation class): float32; 8-bit activations
 * through the tile-of-4 kernels (ggml_matmul_q8); or through the GEMM kernels (ggml_qgemm_multi), a
 * matrix without one taking float32 (ROWS_GEMM, KVPQ_ACT=auto) or the tile-of-4 kernels
 * (ROWS_GEMM_Q8, KVPQ_ACT=q8). */
enum { ROWS_F32, ROWS_Q8, ROWS_GEMM, ROWS_GEMM_Q8, ROWS_CLASSES };

/* The class of n rows of one sequence (KVPQ_ACT; see act_mode): below GGML_MATMUL_BLAS_MIN_TOK
 * (decode, short steps) the tile-of-4 kernels, from there (prefill) the GEMM. */
static int act_class(const kvpq_model *m, int n) {
    if (m->act == ACT_F32) return ROWS_F32;
    if (n < GGML_MATMUL_BLAS_MIN_TOK) return ROWS_Q8;
    return m->act == ACT_Q8 ? ROWS_GEMM_Q8 : ROWS_GEMM;
}

static int rows_q8(int act) { return act == ROWS_Q8 || act == ROWS_GEMM_Q8; }
static int rows_gemm(int act) { return act == ROWS_GEMM || act == ROWS_GEMM_Q8; }

/* Y (n, rows) = X (n, cols) @ W^T as the rows' class asks (act_class) where the type has kernels,
 * else float32 (matvec for one row, the batched kernel otherwise). */
static void project(int act, const gguf_tensor *W, int n, const float *X, float *Y) {
    ggml_mat g = {W->type, W->data, W->ne[1], Y};
    if (rows_gemm(act) && ggml_qgemm_multi(&g, 1, W->ne[0], n, X)) return;
    if (rows_q8(act) && ggml_matmul_q8(W->type, W->data, W->ne[1], W->ne[0], n, X, Y)) return;
    if (n == 1)
        ggml_matvec(W->type, W->data, W->ne[1], W->ne[0], X, Y);
    else
        ggml_matmul(W->type, W->data, W->ne[1], W->ne[0], n, X, Y);
}

/* Several projections of the same input X (n, cols): Y_i = X @ W_i^T. One OpenMP region covers
 * every matrix's rows, with 8-bit activations (ggml_qgemm_multi or ggml_matmul_q8_multi, X quantized
 * once) or for one float32 row (ggml_matvec_multi): fewer, longer regions, so the threads are woken
 * once per group (Q, K, V; gate, up) instead of once per matrix. Else one project() each. */
static void project_many(int act, int n, const float *X, int n_mat, const gguf_tensor *const *W, float *const *Y) {
    ggml_mat mats[4];
    int ok = n_mat <= 4;
    const int64_t cols = W[0]->ne[0];
    for (int i = 0; ok && i < n_mat; i++) {
        ok = W[i]->ne[0] == cols;
        mats[i] = (ggml_mat){W[i]->type, W[i]->data, W[i]->ne[1], Y[i]};
    }
    if (ok && rows_gemm(act) && ggml_qgemm_multi(mats, n_mat, cols, n, X)) return;
    if (ok && rows_q8(act) && ggml_matmul_q8_multi(mats, n_mat, cols, n, X)) return;
    if (ok && act == ROWS_F32 && n == 1 && ggml_matvec_multi(mats, n_mat, cols, X)) return;
    for (int i = 0; i < n_mat; i++) project(act, W[i], n, X, Y[i]);
}

/* Non-finite policy (docs/robustness.md): NaN/Inf are caught where they enter results, and named.
 * K/V at the cache's append; here the residual stream after each attention and FFN block, so a
 * NaN or Inf weight (or an overflow) is reported with its layer and block at its first use; and
 * the logits. x: (n, width) of the rows at positions pos0 .. pos0+n-1. */
static kvpq_status check_rows_finite(const float *x, int n, int width, int pos0, const char *what, int layer) {
    if (kvpq__all_finite(x, (size_t)n * width)) return KVPQ_OK;
    for (size_t i = 0; i < (size_t)n * width; i++)
        if (!isfinite(x[i])) {
            if (layer < 0)
                return kvpq__err(KVPQ_ERR_NONFINITE, "%s of position %d: %s at index %d (a NaN or Inf weight, or "
                                 "an overflow, in the model)", what, pos0 + (int)(i / width),
                                 isnan(x[i]) ? "NaN" : "Inf", (int)(i % width));
            return kvpq__err(KVPQ_ERR_NONFINITE, "layer %d: %s at position %d is %s at index %d (a NaN or Inf "
                             "weight of this layer, or an overflow)", layer, what, pos0 + (int)(i / width),
                             isnan(x[i]) ? "NaN" : "Inf", (int)(i % width));
        }
    return KVPQ_OK;
}

/* ---- one step: the rows of one or more sequences through every layer ------------------------ */

/* The rows of one sequence in a step. The matrices see the rows of all segments together; RoPE,
 * attention and the cache append are per segment. */
typedef struct {
    kvpq_cache *cache;
    const int32_t *tokens; /* (n) */
    int r0, n;             /* rows r0 .. r0+n-1 of the step */
    int pos0;              /* position of row r0 in its sequence (the cache holds pos0 positions) */
    float *logits;         /* (n_vocab): the logits of the segment's last row; NULL: none */
} eval_seg;

/* At most LLAMA_BLOCK rows (the scratch's size). */
typedef struct {
    const eval_seg *seg;
    int n_seg;
    int n;  /* rows: the segments' sum */
    int act; /* how the layer matrices meet the rows (act_class of the rows one segment has) */
    int cpu; /* every segment's cache runs on the CPU: their attention may run side by side */
} eval_step;

/* Every segment's rows checked finite (check_rows_finite, named by the segment's positions). */
static kvpq_status check_step_finite(const eval_step *st, const float *x, int width, const char *what, int layer) {
    for (int i = 0; i < st->n_seg; i++)
        KVPQ_TRY(check_rows_finite(x + (size_t)st->seg[i].r0 * width, st->seg[i].n, width, st->seg[i].pos0, what, layer));
    return KVPQ_OK;
}

/* m->x = the token embeddings of every row (times the model's embedding scale). */
static kvpq_status embed(kvpq_model *m, const eval_step *st) {
    const int E = m->info.n_embd;
    const size_t erow = ggml_row_size(m->tok_embd->type, E);
    for (int i = 0; i < st->n_seg; i++)
        for (int t = 0; t < st->seg[i].n; t++)
            KVPQ_TRY(ggml_dequantize_row(m->tok_embd->type, (const char *)m->tok_embd->data + (size_t)st->seg[i].tokens[t] * erow,
                                         m->x + (size_t)(st->seg[i].r0 + t) * E, E));
    if (m->embd_scale != 1.0f)
        for (size_t i = 0; i < (size_t)st->n * E; i++) m->x[i] *= m->embd_scale;
    return KVPQ_OK;
}

/* The hooks that watch the queries and keys of one layer (one-segment steps; see kvpq__eval_hook). */
static void hook_qk(const kvpq_model *m, const eval_step *st, int l, const kvpq__eval_hook *hook) {
    const kvpq_model_info *in = &m->info;
    const int hd = in->head_dim, Q = in->n_head * hd, KV = in->n_head_kv * hd, n = st->n, pos0 = st->seg[0].pos0;
    if (hook->save_q)
        memcpy(hook->save_q + ((size_t)l * hook->save_tokens + pos0) * Q, m->q, sizeof(float) * (size_t)n * Q);
    if (hook->q_absmax) {
        const int g = in->n_head / in->n_head_kv;
        float *mx = hook->q_absmax + (size_t)l * KV;
        for (int t = 0; t < n; t++)
            for (int h = 0; h < in->n_head; h++) {
                const float *qh = m->q + (size_t)t * Q + (size_t)h * hd;
                float *mh = mx + (size_t)(h / g) * hd;
                for (int c = 0; c < hd; c++) {
                    float a = fabsf(qh[c]);
                    mh[c] = a > mh[c] ? a : mh[c];
                }
            }
    }
    if (hook->save_k) {
        memcpy(hook->save_k + ((size_t)l * hook->save_tokens + pos0) * KV, m->k, sizeof(float) * (size_t)n * KV);
        memcpy(hook->save_v + ((size_t)l * hook->save_tokens + pos0) * KV, m->v, sizeof(float) * (size_t)n * KV);
    }
}

/* Segment i's keys and values appended to its cache, its queries attended (m->att). */
static kvpq_status attend_segment(kvpq_model *m, const eval_step *st, int i, int l, const kvpq__eval_hook *hook) {
    const int hd = m->info.head_dim, Q = m->info.n_head * hd, KV = m->info.n_head_kv * hd;
    const eval_seg *g = &st->seg[i];
    const float *k = m->k + (size_t)g->r0 * KV, *v = m->v + (size_t)g->r0 * KV, *q = m->q + (size_t)g->r0 * Q;
    float *att = m->att + (size_t)g->r0 * Q;
    if (!hook || !hook->attend || l != hook->attend_layer) return kvpq_cache_append_attend(g->cache, l, g->n, k, v, q, att);
    KVPQ_TRY(kvpq_cache_append(g->cache, l, g->n, k, v));
    return hook->attend(hook->user, l, g->n, g->pos0, q, att);
}

/* Every segment's attention. Several segments of CPU caches run side by side, one OpenMP region for
 * all of them (one per sequence and layer cost a thread wake-up each: 240 per step of 8 sequences
 * of a 30-layer model); each cache's own region then runs on its thread alone. Its work split does
 * not depend on the threads that run it (cache_attend.c sizes it by the thread count setting), so
 * the results are those of the segment alone. On errors, the first segment's is reported. */
static kvpq_status attend_step(kvpq_model *m, const eval_step *st, int l, const kvpq__eval_hook *hook) {
    kvpq_status s = KVPQ_OK;
    if (st->n_seg > 1 && st->cpu && !hook) {
        int first = st->n_seg;
        char msg[1024] = "";
#pragma omp parallel for schedule(dynamic, 1)
        for (int i = 0; i < st->n_seg; i++) {
            kvpq_status si = attend_segment(m, st, i, l, hook);
            if (si != KVPQ_OK) {
#pragma omp critical(kvpq_attend_step)
                if (i < first) {
                    first = i;
                    s = si;
                    snprintf(msg, sizeof msg, "%s", kvpq_last_error());
                }
            }
        }
        if (s != KVPQ_OK) kvpq__err(s, "%s", msg);
    } else {
        for (int i = 0; i < st->n_seg && s == KVPQ_OK; i++) s = attend_segment(m, st, i, l, hook);
    }
    if (s != KVPQ_OK) kvpq__err_prefix("layer %d", l);
    return s;
}

/* h = x + [post_attention_norm](Wo . attend(q, k, v)) for layer l (the header's formula). */
static kvpq_status layer_attention(kvpq_model *m, const eval_step *st, int l, const kvpq__eval_hook *hook) {
    const kvpq_model_info *in = &m->info;
    const int E = in->n_embd, hd = in->head_dim, Q = in->n_head * hd, KV = in->n_head_kv * hd, n = st->n;
    const float eps = in->rms_eps;
    const llama_layer *L = &m->layers[l];
    float *const *V = L->vec;
    rmsnorm(n, E, m->x, V[ARCH_T_ATTN_NORM], eps, m->xb);
    {
        const gguf_tensor *W[3] = {L->w[ARCH_T_ATTN_Q], L->w[ARCH_T_ATTN_K], L->w[ARCH_T_ATTN_V]};
        float *Y[3] = {m->q, m->k, m->v};
        project_many(st->act, n, m->xb, 3, W, Y);
    }
    if (V[ARCH_T_ATTN_Q_BIAS]) add_bias(n, Q, V[ARCH_T_ATTN_Q_BIAS], m->q);
    if (V[ARCH_T_ATTN_K_BIAS]) add_bias(n, KV, V[ARCH_T_ATTN_K_BIAS], m->k);
    if (V[ARCH_T_ATTN_V_BIAS]) add_bias(n, KV, V[ARCH_T_ATTN_V_BIAS], m->v);
    if (V[ARCH_T_ATTN_Q_NORM]) rmsnorm(n * in->n_head, hd, m->q, V[ARCH_T_ATTN_Q_NORM], eps, m->q);
    if (V[ARCH_T_ATTN_K_NORM]) rmsnorm(n * in->n_head_kv, hd, m->k, V[ARCH_T_ATTN_K_NORM], eps, m->k);
    for (int i = 0; i < st->n_seg; i++) {
        const eval_seg *g = &st->seg[i];
        rope(m, L->inv_freq, g->n, in->n_head, g->pos0, m->q + (size_t)g->r0 * Q);
        rope(m, L->inv_freq, g->n, in->n_head_kv, g->pos0, m->k + (size_t)g->r0 * KV);
    }
    if (m->q_scale != 1.0f)
        for (size_t i = 0; i < (size_t)n * Q; i++) m->q[i] *= m->q_scale;
    if (hook) hook_qk(m, st, l, hook);
    KVPQ_TRY(attend_step(m, st, l, hook));
    project(st->act, L->w[ARCH_T_ATTN_OUT], n, m->att, m->xb2);
    if (V[ARCH_T_ATTN_POST_NORM]) rmsnorm(n, E, m->xb2, V[ARCH_T_ATTN_POST_NORM], eps, m->xb2);
    for (size_t i = 0; i < (size_t)n * E; i++) m->x[i] += m->xb2[i];
    return check_step_finite(st, m->x, E, "the residual stream after attention", l);
}

/* out = h + [post_ffw_norm](Wdown . (act(Wgate f) * (Wup f))) for layer l. */
static kvpq_status layer_ffn(kvpq_model *m, const eval_step *st, int l) {
    const kvpq_model_info *in = &m->info;
    const int E = in->n_embd, F = in->n_ff, n = st->n;
    const llama_layer *L = &m->layers[l];
    float *const *V = L->vec;
    rmsnorm(n, E, m->x, V[ARCH_T_FFN_NORM], in->rms_eps, m->xb);
    {
        const gguf_tensor *W[2] = {L->w[ARCH_T_FFN_GATE], L->w[ARCH_T_FFN_UP]};
        float *Y[2] = {m->hb, m->hb2};
        project_many(st->act, n, m->xb, 2, W, Y);
    }
    { /* act(gate) * up: GELU (tanh form) or SiLU, the table's SIMD kernel (cpu/ggml_kernels.h) */
        kvpq__glu_fn glu = kvpq__cpu_kernels()->glu[m->arch->ffn == ARCH_FFN_GEGLU_TANH ? KVPQ_GLU_GELU_TANH
                                                                                      : KVPQ_GLU_SILU];
        const int64_t total = (int64_t)n * F, chunk = 4096;
#pragma omp parallel for schedule(static) if (n > 8)
        for (int64_t i0 = 0; i0 < total; i0 += chunk)
            glu(m->hb + i0, m->hb2 + i0, total - i0 < chunk ? total - i0 : chunk);
    }
    project(st->act, L->w[ARCH_T_FFN_DOWN], n, m->hb, m->xb2);
    if (V[ARCH_T_FFN_POST_NORM]) rmsnorm(n, E, m->xb2, V[ARCH_T_FFN_POST_NORM], in->rms_eps, m->xb2);
    for (size_t i = 0; i < (size_t)n * E; i++) m->x[i] += m->xb2[i];
    return check_step_finite(st, m->x, E, "the residual stream after the FFN", l);
}

/* logits (n, n_vocab) of the n rows of x: output norm, output matrix (as act_class says), soft cap. */
static void output_rows(kvpq_model *m, int act, const float *x, int n, float *logits) {
    const kvpq_model_info *in = &m->info;
    rmsnorm(n, in->n_embd, x, m->output_norm, in->rms_eps, m->xb);
    project(act, m->output, n, m->xb, logits);
    if (m->logit_softcap > 0) {
        const float c = m->logit_softcap;
        for (size_t i = 0; i < (size_t)n * in->n_vocab; i++) logits[i] = c * tanhf(logits[i] / c);
    }
}

/* output_rows of n rows of one sequence (as act_class of n rows), checked finite;
 * pos0: the first row's position. */
static kvpq_status logits_rows(kvpq_model *m, const float *x, int n, int pos0, float *logits) {
    output_rows(m, act_class(m, n), x, n, logits);
    return check_rows_finite(logits, n, m->info.n_vocab, pos0, "the logits", -1);
}

/* Each segment's last-row logits (seg.logits), one output projection per run of segments whose
 * logits rows are adjacent in memory (a batch's decode step is one run). The rows are gathered into
 * m->x's first rows (the layers are done with it). The output matrix takes 8-bit activations as
 * one sequence's last row alone would (act_class of 1 row), so each row's logits equal its own eval's. */
static kvpq_status segment_logits(kvpq_model *m, const eval_step *st) {
    const kvpq_model_info *in = &m->info;
    const int E = in->n_embd, V = in->n_vocab;
    for (int i = 0; i < st->n_seg;) {
        if (!st->seg[i].logits) {
            i++;
            continue;
        }
        int j = i + 1;
        while (j < st->n_seg && st->seg[j].logits == st->seg[j - 1].logits + V) j++;
        for (int k = i; k < j; k++) /* row r0+n-1 >= k - i: moving rows down never overwrites one still to move */
            memmove(m->x + (size_t)(k - i) * E, m->x + (size_t)(st->seg[k].r0 + st->seg[k].n - 1) * E, sizeof(float) * E);
        output_rows(m, act_class(m, 1), m->x, j - i, st->seg[i].logits);
        for (int k = i; k < j; k++)
            KVPQ_TRY(check_rows_finite(st->seg[k].logits, 1, V, st->seg[k].pos0 + st->seg[k].n - 1, "the logits", -1));
        i = j;
    }
    return KVPQ_OK;
}

/* One step of at most LLAMA_BLOCK rows. Logits: rows_logits not NULL (one-segment steps only): those
 * of rows rows_from .. n-1, ((n - rows_from, n_vocab)); else each segment's last row's into its
 * seg.logits (where not NULL). hook (NULL for a plain eval, one-segment steps only, see
 * kvpq__eval_hook): start at layer hook->layer0 from the residual stream hook->x0 instead of the
 * embeddings, save each layer's input, and let hook->attend compute one layer's attention. */
static kvpq_status eval_step_run(kvpq_model *m, const eval_step *st, int rows_from, float *rows_logits,
                                 const kvpq__eval_hook *hook) {
    const kvpq_model_info *in = &m->info;
    const int E = in->n_embd, l0 = hook ? hook->layer0 : 0;
    if (l0 > 0) memcpy(m->x, hook->x0, sizeof(float) * (size_t)st->n * E);
    else KVPQ_TRY(embed(m, st));
    for (int l = l0; l < in->n_layer; l++) {
        if (hook && hook->save_x)
            memcpy(hook->save_x + ((size_t)l * hook->save_tokens + st->seg[0].pos0) * E, m->x,
                   sizeof(float) * (size_t)st->n * E);
        KVPQ_TRY(layer_attention(m, st, l, hook));
        KVPQ_TRY(layer_ffn(m, st, l));
    }
    if (!rows_logits) return segment_logits(m, st);
    if (rows_from >= st->n) return KVPQ_OK;
    return logits_rows(m, m->x + (size_t)rows_from * E, st->n - rows_from, st->seg[0].pos0 + rows_from, rows_logits);
}

/* One sequence's rows as a step: tokens (n) at positions pos0.., last-row logits into logits (may be NULL). */
static kvpq_status eval_one(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n, int pos0, int rows_from,
                            float *rows_logits, float *logits, const kvpq__eval_hook *hook) {
    eval_seg g = {cache, tokens, 0, n, pos0, logits};
    eval_step st = {&g, 1, n, act_class(m, n), 0};
    return eval_step_run(m, &st, rows_from, rows_logits, hook);
}

/* ---- evaluation calls ----------------------------------------------------------------------- */

/* A cache fits the model: n_layer, heads, head_dim, sliding window; its layers hold one length,
 * *len; n more positions fit n_ctx_train and the cache's max_seq. *backend (may be NULL): where it runs. */
static kvpq_status check_cache(const kvpq_model *m, kvpq_cache *cache, int n, int *len, kvpq_backend *backend) {
    const kvpq_model_info *in = &m->info;
    kvpq_cache_params cache_params;
    KVPQ_TRY(kvpq_cache_get_params(cache, &cache_params));
    const kvpq_cache_params *cp = &cache_params;
    if (cp->n_layer != in->n_layer || cp->n_head != in->n_head || cp->n_head_kv != in->n_head_kv ||
        cp->head_dim != in->head_dim)
        return kvpq__err(KVPQ_ERR_MISMATCH,
                         "cache (n_layer %d, n_head %d, n_head_kv %d, head_dim %d) does not fit the model "
                         "(n_layer %d, n_head %d, n_head_kv %d, head_dim %d)",
                         cp->n_layer, cp->n_head, cp->n_head_kv, cp->head_dim, in->n_layer, in->n_head,
                         in->n_head_kv, in->head_dim);
    for (int l = 0; l < in->n_layer; l++) {
        const int want_w = m->swa && m->swa[l] ? in->sliding_window : 0;
        const int got_w = cp->sliding_window > 0 && (!cp->swa_layers || cp->swa_layers[l]) ? cp->sliding_window : 0;
        if (want_w != got_w)
            return kvpq__err(KVPQ_ERR_MISMATCH,
                             "cache layer %d: sliding window %d, the model's is %d (set the cache's with "
                             "kvpq_model_cache_params)",
                             l, got_w, want_w);
    }
    int L = kvpq_cache_seq_len(cache, 0);
    for (int l = 1; l < in->n_layer; l++)
        if (kvpq_cache_seq_len(cache, l) != L)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "cache layers hold different lengths (layer 0: %d, layer %d: %d)", L,
                             l, kvpq_cache_seq_len(cache, l));
    if ((int64_t)L + n > in->n_ctx_train)
        return kvpq__err(KVPQ_ERR_CAPACITY, "context of %lld tokens exceeds the model's n_ctx_train %d",
                         (long long)L + n, in->n_ctx_train);
    if ((int64_t)L + n > cp->max_seq)
        return kvpq__err(KVPQ_ERR_CAPACITY, "context of %lld tokens exceeds the cache's max_seq %d", (long long)L + n,
                         cp->max_seq);
    *len = L;
    if (backend) *backend = cp->backend;
    return KVPQ_OK;
}

static kvpq_status check_tokens(const kvpq_model *m, const int32_t *tokens, int n) {
    for (int t = 0; t < n; t++)
        if (tokens[t] < 0 || tokens[t] >= m->info.n_vocab)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "token %d at index %d: out of range [0, %d)", tokens[t], t,
                             m->info.n_vocab);
    return KVPQ_OK;
}

/* The model's thread count for a call (m->n_threads, 0: OpenMP's); returns the one to restore. */
static int threads_enter(const kvpq_model *m) {
    int saved = omp_get_max_threads();
    if (m->n_threads > 0) omp_set_num_threads(m->n_threads);
    return saved;
}
static void threads_leave(const kvpq_model *m, int saved) {
    if (m->n_threads > 0) omp_set_num_threads(saved);
}

/* After a failed evaluation: the caches back to their lengths before it (len (n)), so no cache
 * keeps some layers longer than others; the error (status s, message) kept. */
static kvpq_status restore_caches(kvpq_status s, kvpq_cache *const *caches, const int *len, int n) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s", kvpq_last_error());
    for (int i = 0; i < n; i++) kvpq_cache_truncate(caches[i], len[i]);
    return kvpq__err(s, "%s", msg);
}

static kvpq_status model_eval(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n, int logits_all,
                              float *logits, float *q_absmax) {
    if (!m || !cache || !tokens || !logits) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval: NULL argument");
    if (n < 1) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval: n = %d tokens, expected >= 1", n);
    int L = 0;
    KVPQ_TRY(check_cache(m, cache, n, &L, NULL));
    KVPQ_TRY(check_tokens(m, tokens, n));
    const int V = m->info.n_vocab, saved = threads_enter(m);
    kvpq_status s = KVPQ_OK;
    kvpq__eval_hook qh = {.q_absmax = q_absmax};
    const kvpq__eval_hook *hk = q_absmax ? &qh : NULL;
    for (int t0 = 0; t0 < n && s == KVPQ_OK; t0 += LLAMA_BLOCK) {
        int nb = n - t0 < LLAMA_BLOCK ? n - t0 : LLAMA_BLOCK;
        if (logits_all)
            s = eval_one(m, cache, tokens + t0, nb, L + t0, 0, logits + (size_t)t0 * V, NULL, hk);
        else
            s = eval_one(m, cache, tokens + t0, nb, L + t0, 0, NULL, t0 + nb == n ? logits : NULL, hk);
    }
    threads_leave(m, saved);
    return s == KVPQ_OK ? s : restore_caches(s, &cache, &L, 1);
}

kvpq_status kvpq_model_eval(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n, int logits_all,
                            float *logits) {
    return model_eval(m, cache, tokens, n, logits_all, logits, NULL);
}

kvpq_status kvpq_model_eval_query_absmax(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n,
                                         int logits_all, float *logits, float *q_absmax) {
    if (!q_absmax) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_query_absmax: q_absmax is NULL");
    return model_eval(m, cache, tokens, n, logits_all, logits, q_absmax);
}

/* kvpq_model_eval_batch's arguments, each sequence's cache length into len; *cpu: every cache runs
 * on the CPU. */
static kvpq_status check_batch(const kvpq_model *m, int n_seq, kvpq_cache *const *caches, const int32_t *const *tokens,
                               const int *n_tokens, int *len, int *cpu) {
    *cpu = 1;
    for (int i = 0; i < n_seq; i++) {
        if (!caches[i] || !tokens[i])
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_batch: sequence %d: NULL %s", i,
                             caches[i] ? "tokens" : "cache");
        if (n_tokens[i] < 1)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_batch: sequence %d: %d tokens, expected >= 1", i,
                             n_tokens[i]);
        for (int j = 0; j < i; j++)
            if (caches[j] == caches[i])
                return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_batch: sequences %d and %d share one cache", j, i);
        kvpq_backend b = KVPQ_BACKEND_CPU;
        kvpq_status s = check_cache(m, caches[i], n_tokens[i], &len[i], &b);
        *cpu &= b == KVPQ_BACKEND_CPU;
        if (s == KVPQ_OK) s = check_tokens(m, tokens[i], n_tokens[i]);
        if (s != KVPQ_OK) {
            kvpq__err_prefix("kvpq_model_eval_batch: sequence %d", i);
            return s;
        }
    }
    return KVPQ_OK;
}

/* The next step of a batch: each unfinished sequence's next chunk (its tokens cut every LLAMA_BLOCK
 * from the call's first, as kvpq_model_eval cuts them) of the activation class `act` (act_class of
 * its rows), while the rows fit LLAMA_BLOCK. Chunks of two classes never share a step, so every
 * row takes the matrices' path its own kvpq_model_eval would take. Returns the segments' count. */
static int plan_step(const kvpq_model *m, int n_seq, kvpq_cache *const *caches, const int32_t *const *tokens,
                     const int *n_tokens, float *logits, const int *len, int *done, int act, int cpu,
                     eval_seg *seg, eval_step *st) {
    int k = 0, rows = 0;
    for (int i = 0; i < n_seq; i++) {
        const int left = n_tokens[i] - done[i], nb = left < LLAMA_BLOCK ? left : LLAMA_BLOCK;
        if (left == 0 || act_class(m, nb) != act || rows + nb > LLAMA_BLOCK) continue;
        seg[k++] = (eval_seg){caches[i], tokens[i] + done[i], rows, nb, len[i] + done[i],
                              nb == left ? logits + (size_t)i * m->info.n_vocab : NULL};
        rows += nb;
        done[i] += nb;
    }
    *st = (eval_step){seg, k, rows, act, cpu};
    return k;
}

kvpq_status kvpq_model_eval_batch(kvpq_model *m, int n_seq, kvpq_cache *const *caches, const int32_t *const *tokens,
                                  const int *n_tokens, float *logits) {
    if (!m || !caches || !tokens || !n_tokens || !logits)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_batch: NULL argument");
    if (n_seq < 1) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_model_eval_batch: n_seq = %d, expected >= 1", n_seq);
    int *len = malloc(sizeof(int) * 2 * (size_t)n_seq);
    eval_seg *seg = malloc(sizeof *seg * (size_t)n_seq);
    if (!len || !seg) {
        free(len);
        free(seg);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_model_eval_batch: out of memory");
    }
    int *done = len + n_seq;
    memset(done, 0, sizeof(int) * (size_t)n_seq);
    int cpu = 0;
    kvpq_status s = check_batch(m, n_seq, caches, tokens, n_tokens, len, &cpu);
    if (s == KVPQ_OK) {
        const int saved = threads_enter(m);
        eval_step st;
        for (int more = 1; more && s == KVPQ_OK;) {
            more = 0;
            for (int act = 0; act < ROWS_CLASSES && s == KVPQ_OK; act++)
                if (plan_step(m, n_seq, caches, tokens, n_tokens, logits, len, done, act, cpu, seg, &st)) {
                    s = eval_step_run(m, &st, 0, NULL, NULL);
                    more = 1;
                }
        }
        threads_leave(m, saved);
        if (s != KVPQ_OK) s = restore_caches(s, caches, len, n_seq);
    }
    free(len);
    free(seg);
    return s;
}

kvpq_status kvpq__model_eval_hooked(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n, int pos0,
                                    int logits_from, float *logits, const kvpq__eval_hook *hook) {
    if (!m || !cache || !tokens || !hook || n < 1)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__model_eval_hooked: bad argument");
    const kvpq_model_info *in = &m->info;
    if (hook->layer0 < 0 || hook->layer0 >= in->n_layer)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq__model_eval_hooked: layer0 %d", hook->layer0);
    const int saved = threads_enter(m);
    kvpq_status s = KVPQ_OK;
    for (int t0 = 0; t0 < n && s == KVPQ_OK; t0 += LLAMA_BLOCK) {
        int nb = n - t0 < LLAMA_BLOCK ? n - t0 : LLAMA_BLOCK;
        kvpq__eval_hook h = *hook;
        if (h.layer0 > 0) h.x0 = hook->x0 + (size_t)t0 * in->n_embd;
        /* logits of tokens logits_from .. n-1, rows in order */
        h.logits_from = logits_from > t0 ? logits_from - t0 : 0;
        float *lg = logits && t0 + nb > logits_from
                        ? logits + (size_t)(t0 + h.logits_from - logits_from) * in->n_vocab
                        : NULL;
        s = lg ? eval_one(m, cache, tokens + t0, nb, pos0 + t0, h.logits_from, lg, NULL, &h)
               : eval_one(m, cache, tokens + t0, nb, pos0 + t0, 0, NULL, NULL, &h);
    }
    threads_leave(m, saved);
    return s;
}
