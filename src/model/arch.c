/* arch.c — the architecture table (arch.h). Sources for each row: the Hugging Face modelling code
 * of the architecture and llama.cpp's graph for it (what the GGUF file does not state: which
 * layers are local and their rope base, the RoPE layout of the converted weights). */
#include <string.h>

#include "arch.h"

static const char *const tensor_names[ARCH_T_COUNT] = {
    [ARCH_T_ATTN_NORM] = "attn_norm.weight",
    [ARCH_T_ATTN_Q] = "attn_q.weight",
    [ARCH_T_ATTN_K] = "attn_k.weight",
    [ARCH_T_ATTN_V] = "attn_v.weight",
    [ARCH_T_ATTN_OUT] = "attn_output.weight",
    [ARCH_T_ATTN_Q_BIAS] = "attn_q.bias",
    [ARCH_T_ATTN_K_BIAS] = "attn_k.bias",
    [ARCH_T_ATTN_V_BIAS] = "attn_v.bias",
    [ARCH_T_ATTN_Q_NORM] = "attn_q_norm.weight",
    [ARCH_T_ATTN_K_NORM] = "attn_k_norm.weight",
    [ARCH_T_ATTN_POST_NORM] = "post_attention_norm.weight",
    [ARCH_T_FFN_NORM] = "ffn_norm.weight",
    [ARCH_T_FFN_GATE] = "ffn_gate.weight",
    [ARCH_T_FFN_UP] = "ffn_up.weight",
    [ARCH_T_FFN_DOWN] = "ffn_down.weight",
    [ARCH_T_FFN_POST_NORM] = "post_ffw_norm.weight",
};

const char *arch_tensor_name(arch_tensor t) {
    return (int)t >= 0 && t < ARCH_T_COUNT ? tensor_names[t] : "?";
}

#define B ARCH_BIT
/* The pre-norm decoder layer every row shares. */
#define BASE_LAYER                                                                                  \
    (B(ARCH_T_ATTN_NORM) | B(ARCH_T_ATTN_Q) | B(ARCH_T_ATTN_K) | B(ARCH_T_ATTN_V) | B(ARCH_T_ATTN_OUT) | \
     B(ARCH_T_FFN_NORM) | B(ARCH_T_FFN_GATE) | B(ARCH_T_FFN_UP) | B(ARCH_T_FFN_DOWN))

static const kvpq_arch archs[] = {
    /* Llama (Touvron et al. 2023, arXiv 2302.13971). The GGUF converter permutes Q/K rows of HF
     * checkpoints so that adjacent-pair RoPE on them equals HF's rotate-half on the originals. */
    {.name = "llama", .layer_required = BASE_LAYER, .layer_optional = 0, .ffn = ARCH_FFN_SWIGLU,
     .rope = ARCH_ROPE_NORM},
    /* Qwen2 (Yang et al. 2024, arXiv 2407.10671): Llama with Q/K/V biases, RoPE on halves. */
    {.name = "qwen2",
     .layer_required = BASE_LAYER | B(ARCH_T_ATTN_Q_BIAS) | B(ARCH_T_ATTN_K_BIAS) | B(ARCH_T_ATTN_V_BIAS),
     .layer_optional = 0, .ffn = ARCH_FFN_SWIGLU, .rope = ARCH_ROPE_NEOX},
    /* Gemma 3 (Gemma Team 2025, arXiv 2503.19786): per-head RMSNorm of q and k before RoPE, RMSNorm
     * of each sub-layer's output before the residual add, GELU(tanh)-gated FFN, embeddings scaled
     * by sqrt(n_embd), 5 local (sliding-window, rope base 10000) layers per global one. The GGUF
     * converter stores Gemma's (1 + w) norm weights already incremented. */
    {.name = "gemma3",
     .layer_required = BASE_LAYER | B(ARCH_T_ATTN_Q_NORM) | B(ARCH_T_ATTN_K_NORM) | B(ARCH_T_ATTN_POST_NORM) |
                       B(ARCH_T_FFN_POST_NORM),
     .layer_optional = 0, .ffn = ARCH_FFN_GEGLU_TANH, .rope = ARCH_ROPE_NEOX, .embd_scale_sqrt = 1,
     .swa_pattern = 6, .swa_rope_base = 10000.0f},
};
#undef B

const kvpq_arch *kvpq_arch_find(const char *name) {
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (!strcmp(archs[i].name, name)) return &archs[i];
    return NULL;
}

const char *kvpq_arch_names(void) { return "llama, qwen2, gemma3"; }
