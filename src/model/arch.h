/* arch.h — the model architectures kvpq runs, one descriptor each. Internal.
 *
 * A descriptor names the tensors an architecture's GGUF file holds and the flags the forward pass
 * (llama.c) reads; the forward pass branches on these flags, never on the architecture's name, so
 * an architecture is a row of the table in arch.c (llama.cpp keeps one graph builder per
 * architecture over shared blocks: src/models/llama.cpp, qwen2.cpp, gemma3.cpp). */
#ifndef KVPQ_ARCH_H
#define KVPQ_ARCH_H

/* Per-layer tensors, "blk.N.<name>", as bits of kvpq_arch.layer_required / layer_optional. */
typedef enum {
    ARCH_T_ATTN_NORM = 0,      /* attn_norm.weight (n_embd) */
    ARCH_T_ATTN_Q,             /* attn_q.weight (n_head*head_dim, n_embd) */
    ARCH_T_ATTN_K,             /* attn_k.weight (n_head_kv*head_dim, n_embd) */
    ARCH_T_ATTN_V,             /* attn_v.weight (n_head_kv*head_dim, n_embd) */
    ARCH_T_ATTN_OUT,           /* attn_output.weight (n_embd, n_head*head_dim) */
    ARCH_T_ATTN_Q_BIAS,        /* attn_q.bias (n_head*head_dim) */
    ARCH_T_ATTN_K_BIAS,        /* attn_k.bias (n_head_kv*head_dim) */
    ARCH_T_ATTN_V_BIAS,        /* attn_v.bias (n_head_kv*head_dim) */
    ARCH_T_ATTN_Q_NORM,        /* attn_q_norm.weight (head_dim): per-head RMSNorm of q */
    ARCH_T_ATTN_K_NORM,        /* attn_k_norm.weight (head_dim): per-head RMSNorm of k */
    ARCH_T_ATTN_POST_NORM,     /* post_attention_norm.weight (n_embd): RMSNorm of the attention output */
    ARCH_T_FFN_NORM,           /* ffn_norm.weight (n_embd) */
    ARCH_T_FFN_GATE,           /* ffn_gate.weight (n_ff, n_embd) */
    ARCH_T_FFN_UP,             /* ffn_up.weight (n_ff, n_embd) */
    ARCH_T_FFN_DOWN,           /* ffn_down.weight (n_embd, n_ff) */
    ARCH_T_FFN_POST_NORM,      /* post_ffw_norm.weight (n_embd): RMSNorm of the FFN output */
    ARCH_T_COUNT
} arch_tensor;

/* The GGUF name of a per-layer tensor without "blk.N." ("attn_q.weight"). */
const char *arch_tensor_name(arch_tensor t);

#define ARCH_BIT(t) (1u << (t))

typedef enum {
    ARCH_FFN_SWIGLU = 0,   /* silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer") */
    ARCH_FFN_GEGLU_TANH,   /* gelu_tanh(gate) * up (the same paper; Gemma) */
} arch_ffn;

typedef enum {
    ARCH_ROPE_NORM = 0,    /* adjacent pairs (x[2i], x[2i+1]) rotate (llama.cpp rope mode 0) */
    ARCH_ROPE_NEOX,        /* halves (x[i], x[i + n_rot/2]) rotate (GPT-NeoX / HF rotate_half) */
} arch_rope;

typedef struct {
    const char *name;          /* general.architecture */
    unsigned layer_required;   /* ARCH_BIT set of per-layer tensors every layer must have */
    unsigned layer_optional;   /* ARCH_BIT set of per-layer tensors a layer may have */
    arch_ffn ffn;
    arch_rope rope;
    int embd_scale_sqrt;       /* 1: token embeddings are multiplied by sqrt(n_embd) (Gemma) */
    /* Sliding-window layers: used when the file has <arch>.attention.sliding_window > 0. Layer l
     * is local unless l % swa_pattern == swa_pattern - 1 (llama.cpp's set_swa_pattern; overridden
     * by <arch>.attention.sliding_window_pattern when the file has it). 0: no sliding window. */
    int swa_pattern;
    float swa_rope_base;       /* rope base of local layers unless <arch>.rope.freq_base_swa is set */
} kvpq_arch;

/* The descriptor named `name`, or NULL. */
const kvpq_arch *kvpq_arch_find(const char *name);
/* "llama, qwen2, gemma3": the supported names, for error messages. */
const char *kvpq_arch_names(void);

#endif
