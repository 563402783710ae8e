/*
 * kvpq_model.h — the model runner of kvpq: GGUF files, the byte-level BPE tokenizer, and the forward
 * pass of Llama-family models (llama, qwen2, gemma3) over a kvpq_cache.
 *
 * This is the second library of kvpq's public API: it includes kvpq.h (the codebook and cache
 * API) and lives in its own library, libkvpq_model (pkg-config kvpq_model, CMake kvpq::kvpq_model),
 * which links libkvpq plus PCRE2 (pre-tokenizer regexes) and OpenBLAS (prompt matmuls). A program
 * that only compresses KV caches includes kvpq.h and links libkvpq alone.
 * Conventions as in kvpq.h (kvpq_status, kvpq_last_error, *_default, *_free(NULL)).
 * Tiers as in kvpq.h: loading a model, tokenizing, evaluating over a cache and calibrating codebooks
 * in one call (kvpq_model_calibrate) are stable; the calibration in steps, per-layer sensitivities,
 * the scoring primitives, query maxima and GGUF inspection need KVPQ_ADVANCED.
 *
 * Usage (greedy decoding):
 *
 *     kvpq_model *m;
 *     if (kvpq_model_load(&m, "model.gguf", NULL) != KVPQ_OK) { fprintf(stderr, "%s\n", kvpq_last_error()); ... }
 *     kvpq_model_info mi;
 *     kvpq_model_get_info(m, &mi);
 *     kvpq_cache_params cp = kvpq_cache_params_default();
 *     kvpq_model_cache_params(m, &cp);                     // shape and sliding window
 *     kvpq_cache *c;
 *     kvpq_cache_new(&c, &cp);
 *     int32_t ids[256]; size_t n;
 *     kvpq_tokenize(m, text, strlen(text), mi.add_bos, 0, ids, 256, &n);
 *     float *logits = malloc(mi.n_vocab * sizeof *logits);
 *     kvpq_model_eval(m, c, ids, (int)n, 0, logits);      // logits of the last token
 */
#ifndef KVPQ_MODEL_H
#define KVPQ_MODEL_H

#include "kvpq.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- models (GGUF: llama, qwen2, gemma3) --------------------------------------------------- */

typedef struct kvpq_model kvpq_model;

typedef struct {
    int n_threads;   /* 0 = OpenMP default; at most 1024 */
} kvpq_model_params;
KVPQ_API kvpq_model_params kvpq_model_params_default(void);

typedef struct {
    char arch[32];       /* general.architecture */
    char name[128];      /* general.name */
    int n_layer, n_head, n_head_kv, head_dim, n_embd, n_ff, n_vocab, n_ctx_train;
    float rope_freq_base;
    float rms_eps;
    int32_t bos_id, eos_id;
    int add_bos;         /* tokenizer.ggml.add_bos_token (0 when absent): prepend BOS to a text */
    char fingerprint[17]; /* 16 hex digits: a hash of the GGUF header (every metadata key and value,
                             every tensor's name, shape and type); recorded in codebooks */
    int sliding_window;  /* <arch>.attention.sliding_window: positions a local layer sees; 0 none */
    int n_swa_layers;    /* local (sliding-window) layers; the others attend to every position */
} kvpq_model_info;

/* Load a GGUF model (memory-mapped). Errors: KVPQ_ERR_IO, KVPQ_ERR_FORMAT (corrupt; names what),
 * KVPQ_ERR_UNSUPPORTED (architecture or tensor type, named). */
KVPQ_API kvpq_status kvpq_model_load(kvpq_model **out, const char *path, const kvpq_model_params *p);
KVPQ_API void kvpq_model_free(kvpq_model *m);
KVPQ_API kvpq_status kvpq_model_get_info(const kvpq_model *m, kvpq_model_info *info);
/* The model's chat template (tokenizer.chat_template, a Jinja string; NUL-terminated, owned by the
 * model), or NULL when the file has none. */
KVPQ_API const char *kvpq_model_chat_template(const kvpq_model *m);

/* A fingerprint of the model's weights: 16 hex digits and a NUL into out, the XXH64 (xxHash, Collet;
 * seed 0) of the GGUF's whole tensor data section. kvpq_model_info.fingerprint covers the header
 * only (metadata, tensor names, shapes, types); this tells apart two files whose headers are equal
 * and weights are not (a re-saved fine-tune, a damaged copy). Reads every weight byte once (~0.1 s
 * per GB from the page cache), so it is computed on demand, not at load. `kvpq generate
 * --prompt-cache` records both. Errors: NULL argument (KVPQ_ERR_INVALID_ARG). */
KVPQ_API kvpq_status kvpq_model_data_fingerprint(const kvpq_model *m, char out[17]);

/* Fill the model's shape into cache params: n_layer, n_head, n_head_kv, head_dim, and its
 * sliding window (sliding_window, swa_layers: borrowed from the model, copied by kvpq_cache_new).
 * The other fields are left as they are. kvpq_model_eval refuses a cache whose sliding window
 * differs from the model's (KVPQ_ERR_MISMATCH). Errors: KVPQ_ERR_INVALID_ARG (NULL). */
KVPQ_API kvpq_status kvpq_model_cache_params(const kvpq_model *m, kvpq_cache_params *p);

/* The model's RoPE, in the terms of a codebook that codes keys before it
 * (kvpq_codebook_params.key_rope_dims, key_rope_neox; kvpq_codebook_key_rope_freq): n_rot, the
 * dims rotated (<arch>.rope.dimension_count); neox, 1 when pairs are (x[i], x[i + n_rot/2]) (qwen2,
 * gemma3), 0 for (x[2i], x[2i+1]) (llama); and, when inv_freq is not NULL, layer's (n_rot / 2)
 * frequencies (its rope base: local layers have their own). n_rot or neox may be NULL. Errors:
 * KVPQ_ERR_INVALID_ARG (m NULL, layer out of range). */
KVPQ_API kvpq_status kvpq_model_rope(const kvpq_model *m, int layer, int *n_rot, int *neox, float *inv_freq);

/* The model a codebook was calibrated on, recorded as metadata: model (general.name), model.arch
 * (general.architecture) and model.fingerprint (kvpq_model_info.fingerprint). Errors: NULL
 * argument (KVPQ_ERR_INVALID_ARG). */
KVPQ_API kvpq_status kvpq_codebook_set_model(kvpq_codebook *cb, const kvpq_model_info *mi);
/* Check that a codebook was calibrated on this model: its model.arch and model.fingerprint must
 * equal the model's, else KVPQ_ERR_MISMATCH naming both models (a codebook of another model with
 * the same shapes loads and runs, silently wrong: perplexity 815 instead of 34). A file without
 * model.fingerprint (written before kvpq recorded it) is KVPQ_OK with *unchecked = 1 (may be NULL),
 * for the caller to warn; shapes are checked by kvpq_cache_new. */
KVPQ_API kvpq_status kvpq_codebook_check_model(const kvpq_codebook *cb, const kvpq_model_info *mi, int *unchecked);

/* Tokenize text with the model's tokenizer (byte-level BPE or SentencePiece BPE, see kvpq_vocab
 * below for the whole contract). parse_special: text like "<|im_start|>" or "<start_of_turn>"
 * becomes the CONTROL token; pass 0 for text a user typed, which then never yields a CONTROL token
 * by being cut out of the text. Writes up to cap ids; *n_tokens gets the full count (call with cap 0
 * to size). Errors: invalid UTF-8 for a byte-level BPE vocabulary (KVPQ_ERR_INVALID_ARG with the
 * byte offset). */
KVPQ_API kvpq_status kvpq_tokenize(const kvpq_model *m, const char *text, size_t len, int add_bos,
                                   int parse_special, int32_t *tokens, size_t cap, size_t *n_tokens);
/* Bytes of one token's text (may be a partial UTF-8 sequence). *len gets the full length. */
KVPQ_API kvpq_status kvpq_token_to_piece(const kvpq_model *m, int32_t token, char *buf, size_t cap, size_t *len);
/* KVPQ_TOKEN_ATTR_* bits of a token of the model's vocabulary (see kvpq_vocab_token_attr below). */
KVPQ_API unsigned kvpq_token_attr(const kvpq_model *m, int32_t token);

/* Run n tokens at positions L .. L+n-1, L = kvpq_cache_seq_len(cache, 0), appending their K/V to
 * cache. logits: (n, n_vocab) if logits_all, else (n_vocab) for the last token. The cache must have
 * the model's n_layer, n_head, n_head_kv, head_dim and sliding window (else KVPQ_ERR_MISMATCH;
 * kvpq_model_cache_params sets them). Errors: L + n beyond
 * n_ctx_train or the cache's max_seq (KVPQ_ERR_CAPACITY), a token id out of range; on error the
 * cache is truncated back to L. One model serves one eval at a time (it owns the scratch). */
KVPQ_API kvpq_status kvpq_model_eval(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n,
                                     int logits_all, float *logits);

/* Several sequences in one forward pass: sequence i's n_tokens[i] tokens tokens[i] run at positions
 * L_i .. L_i + n_tokens[i] - 1 of its own cache caches[i] (L_i = kvpq_cache_seq_len(caches[i], 0)),
 * appending their K/V there, and logits row i, (n_seq, n_vocab) floats, gets the logits of sequence
 * i's last token. The weight matrices meet the rows of all sequences together (the 8-bit kernels
 * pass over a matrix once per 4 rows: a decode step of 8 sequences reads the weights twice, not 8
 * times); RoPE, attention and the cache appends are each sequence's own. Each sequence's tokens are
 * cut into steps of 512 as kvpq_model_eval cuts them, and its rows take the path (8-bit or float32
 * activations, KVPQ_ACT) that its own kvpq_model_eval would take: rows of fewer than 32 tokens per
 * sequence (decode: the tile-of-4 integer kernels) and longer ones (prefill: the integer GEMM) are
 * never in one step. So a sequence's logits and cache equal those of kvpq_model_eval(m, caches[i],
 * tokens[i], n_tokens[i], 0, row i): the same bits with the default 8-bit activations (and with
 * KVPQ_ACT=q8), up to the summation order of the batched float32 kernels under KVPQ_ACT=f32
 * (tests/test_model_batch.c). Each cache must fit the model as kvpq_model_eval asks, and no
 * two sequences may share a cache. Errors (nothing evaluated; the message names the sequence):
 * n_seq < 1, a NULL argument, cache or tokens, n_tokens[i] < 1, a token id out of range, two
 * sequences with one cache (KVPQ_ERR_INVALID_ARG); a cache of another shape or sliding window
 * (KVPQ_ERR_MISMATCH); L_i + n_tokens[i] beyond n_ctx_train or the cache's max_seq
 * (KVPQ_ERR_CAPACITY); KVPQ_ERR_NOMEM. An error during the pass (a non-finite value, a cache
 * append) truncates every cache back to its L_i. One model serves one eval at a time. */
KVPQ_API kvpq_status kvpq_model_eval_batch(kvpq_model *m, int n_seq, kvpq_cache *const *caches,
                                           const int32_t *const *tokens, const int *n_tokens, float *logits);

/* ---- calibration: codebooks from a model's own keys and values (docs/allocation.md) ---------- */

/* kvpq_codebook_recipe.key_rope: before or after RoPE chosen per layer by the allocation. */
#define KVPQ_KEY_ROPE_CHOOSE 2

/* One codebook's recipe: the options of `kvpq calibrate` that shape one codebook. */
typedef struct {
    const char *keys;          /* key preset (kvpq_pq_params_preset): d8b8 d8b12 d4b8 d4b12 d2b8 d1b8; "d4b8" */
    const char *values;        /* value preset; NULL (default): as keys */
    const char *keys2;         /* residual second key stage, a preset of keys' nbits; NULL (default): none */
    const char *keys_layers;   /* "CFG:A-B[,CFG:A-B...]": layers A..B (inclusive) take preset CFG's key M */
    const char *values_layers; /* likewise for values; NULL (default): none */
    kvpq_codebook_granularity granularity; /* KVPQ_CODEBOOK_SHARED (default), _SUBSPACE, _HEAD */
    int value_rotate;          /* 1: Hadamard-rotate values (default 0) */
    int center;                /* 1 (default): subtract the keys' per-channel mean (exact at attention) */
    int smooth_query;          /* 1 (default): lambda^2 = max|k| / max|q| per channel; 0: max|k| (VecInfer) */
    int key_norm, value_norm;  /* 1 (default): norm-explicit (code the direction, keep one scale) */
    int key_rope;              /* 1: keys coded before RoPE (kvpq_codebook_params.key_rope_dims, every layer,
                                * the model's frequencies); 0 (default): after; KVPQ_KEY_ROPE_CHOOSE: each
                                * layer's keys as the allocation chooses (kvpq_calibration_allocate: every key
                                * candidate trained and measured both ways; needs budgets) */
    int norm_bits;             /* 8 or 16 bits per scale; 0 (default): 8 for an allocation, else 16 */
    int iters;                 /* k-means Lloyd iterations (default 25) */
    int kmeans_init;           /* KVPQ_KMEANS_INIT_RANDOM (default, as faiss) or KVPQ_KMEANS_INIT_PP */
    int max_points_per_centroid; /* k-means subsampling; 0 (default): 256, 32 for nbits > 8 */
    uint64_t seed;             /* k-means seed (default 1234) */
} kvpq_codebook_recipe;
KVPQ_API kvpq_codebook_recipe kvpq_codebook_recipe_default(void);

/* How an allocation's window is chosen among the window candidates. */
typedef enum {
    KVPQ_WINDOW_SELECT_AUTO = 0,  /* predicted; when off its held-out KL by more than window_trust, the 2 next windows by prediction checked too */
    KVPQ_WINDOW_SELECT_PREDICTED, /* the least predicted KL */
    KVPQ_WINDOW_SELECT_MEASURED   /* every window's allocation checked; the least held-out KL */
} kvpq_window_select;

/* The largest weight of the repeated held-out chunk (kvpq_alloc_params.holdout_repeat). */
#define KVPQ_HOLDOUT_REPEAT_MAX 16

/* A per-layer bit allocation (kvpq_calibration_allocate): for each budget, every layer's key and value
 * preset chosen among the candidates so that the VQ cache's effective bits per element at context ctx
 * stay within the budget, minimizing the predicted loss (the sum over layers of the KL each layer's
 * coding costs alone, kvpq_model_layer_sensitivity, on held-out text). */
typedef struct {
    const double *bits;       /* (n_bits) budgets in effective bits per element, each in (0, 32] */
    int n_bits;               /* budgets: one codebook each (0: no allocation) */
    const char *candidates;   /* comma-separated presets of one nbits; "P1+P2": a key candidate with a residual
                               * second stage P2 (one P2 per call); default "d8b8,d4b8,d2b8,d8b8+d8b8,d4b8+d8b8" */
    const int *windows;       /* (n_windows) fp16 windows to choose among (distinct, >= 0; sorted here); NULL:
                               * 0, 16, 32, 64, 128 */
    int n_windows;            /* 1..16 (ignored when windows is NULL) */
    int sinks;                /* first positions kept in fp16, counted in the budget (default 1) */
    int holdout_ctx;          /* tokens per held-out chunk of the sensitivities; 0 (default): min(ctx, 1024) */
    int holdout_chunks;       /* held-out chunks, taken from the END of the text (default 1) */
    int holdout_repeat;       /* W >= 1: one more held-out chunk, the first one's first half twice ([A; A]): its
                               * scored second half is predictable by copying from holdout_ctx / 2 positions back,
                               * so the sensitivities see what a layer's codes cost long-range retrieval
                               * (passkey); it weighs W in their mean, each other chunk 1 (1: one chunk among the
                               * others). 0 (default): off. At most KVPQ_HOLDOUT_REPEAT_MAX */
    int full_sensitivity;     /* 1: a forward pass per layer, kind and candidate; 0 (default): scaled from one */
    int alloc_values;         /* 1: values allocated per layer too; 0: values keep the recipe's preset; -1 (default): 1 */
    int verify_ctx;           /* tokens of the joint check of each allocation (KL against fp16 on text right after
                               * the k-means tokens); -1 (default): ctx, skipped with a note if the text is too
                               * short; 0: off */
    kvpq_window_select window_select; /* default AUTO (PREDICTED when there is no joint check) */
    double window_trust;      /* AUTO's tolerance |predicted / held-out - 1| (default 0.3) */
} kvpq_alloc_params;

typedef struct {
    size_t tokens;            /* k-means tokens from the start of the text (default 32768; fewer if the text is short) */
    int ctx;                  /* tokens per forward chunk, and the context of an allocation's budget (default 2048) */
    int n_threads;            /* 0 = OpenMP default */
    kvpq_codebook_recipe recipe;
    kvpq_alloc_params alloc;
    const char *model_file;   /* metadata "model_file" (a file name), or NULL */
    const char *text_name;    /* metadata "text" (a file name), or NULL */
    /* optional: stages "forward" (tokens), "k-means" (layers), "sensitivity" (measurements), "check"
     * (allocations checked); a nonzero return cancels (KVPQ_ERR_INVALID_ARG "cancelled") */
    kvpq_progress_fn progress;
    void *progress_user;
} kvpq_calibrate_opts;
KVPQ_API kvpq_calibrate_opts kvpq_calibrate_opts_default(void);

/* Check o against the model and a text of n_tokens tokens before any work: the recipe (presets,
 * per-layer items, granularity, k-means settings), the budgets, windows, joint check and the split
 * of the text. m NULL: only the checks that need no model (n_tokens unused), e.g. before loading one.
 * Errors: KVPQ_ERR_INVALID_ARG naming the field (as the CLI's option) and the problem. */
KVPQ_API kvpq_status kvpq_calibrate_opts_check(const kvpq_model *m, const kvpq_calibrate_opts *o, size_t n_tokens);

/* What an allocation found for one budget. */
typedef struct {
    double bits;              /* the budget */
    double effective_bits;    /* the allocation's effective bits per element at ctx (NaN: none fits) */
    double lightest_bits;     /* when none fits: the lightest allocation's effective bits */
    double predicted_kl;      /* sum of the chosen layers' sensitivities (nats) */
    int window;               /* the chosen fp16 window */
    int predicted_window;     /* the window of the least predicted KL (the first checked, unless MEASURED) */
    double holdout_kl, holdout_top1, holdout_ppl, base_ppl; /* the joint check (NaN without one) */
    /* per window candidate: predicted KL (+Inf: none fits), held-out KL and top-1 (NaN: not checked) */
    double predicted_kl_w[16], measured_kl_w[16], measured_top1_w[16];
    int windows[16], n_windows;
    int rechecked;            /* AUTO checked more windows (the prediction was off) */
    double kmeans_seconds, sensitivity_seconds, check_seconds; /* wall time of the stages (shared by the budgets) */
} kvpq_alloc_report;

/* The whole calibration in one call: kvpq_calibration_new, then kvpq_calibration_allocate (budgets
 * given) or kvpq_calibration_train (none). out: max(1, o->alloc.n_bits) codebooks. */
KVPQ_API kvpq_status kvpq_model_calibrate(kvpq_model *m, const int32_t *tokens, size_t n, const kvpq_calibrate_opts *o,
                                          kvpq_codebook **out, kvpq_alloc_report *report);

/* ---- tokenizer ------------------------------------------------------------------------------ */

/* A model's tokenizer alone, loaded from the tokenizer.ggml.* keys of a GGUF file without its
 * weights. Two kinds, as llama.cpp converts them:
 *   - tokenizer.ggml.model "gpt2": byte-level BPE (GPT-2 style; SmolLM2, Qwen2.5, Llama 3) with the
 *     pre-tokenizer named by tokenizer.ggml.pre ("smollm", "starcoder", "gpt2", "default",
 *     "llama-bpe", "qwen2"), split by PCRE2, merges by rank (tokenizer.ggml.merges);
 *   - tokenizer.ggml.model "llama": SentencePiece-style BPE (Gemma, Llama 2): ' ' written as U+2581,
 *     a U+2581 in front when tokenizer.ggml.add_space_prefix (default on), merges by
 *     tokenizer.ggml.scores (highest first), and <0xNN> byte-fallback tokens for what forms no token.
 * Token ids equal llama.cpp's llama_tokenize on the same file (tests/test_tokenizer_golden.c).
 * It gives the same ids as kvpq_tokenize() on a model loaded from the same file. */
typedef struct kvpq_vocab kvpq_vocab;

/* Errors: KVPQ_ERR_IO, KVPQ_ERR_FORMAT (a missing or inconsistent tokenizer key, named),
 * KVPQ_ERR_UNSUPPORTED (another tokenizer model, or an unknown pre-tokenizer, named). */
KVPQ_API kvpq_status kvpq_vocab_load(kvpq_vocab **out, const char *gguf_path);
KVPQ_API void kvpq_vocab_free(kvpq_vocab *v);
/* Number of tokens; ids are 0 .. n_tokens - 1. */
KVPQ_API int32_t kvpq_vocab_n_tokens(const kvpq_vocab *v);
/* BOS / EOS ids (tokenizer.ggml.bos_token_id / eos_token_id), -1 when the file has none
 * (SentencePiece vocabularies without the keys: 1 / 2, as llama.cpp). */
KVPQ_API int32_t kvpq_vocab_bos(const kvpq_vocab *v);
KVPQ_API int32_t kvpq_vocab_eos(const kvpq_vocab *v);
/* tokenizer.ggml.add_bos_token: whether a text of this model starts with BOS (absent: 0 for
 * byte-level BPE, 1 for SentencePiece, as llama.cpp). */
KVPQ_API int kvpq_vocab_add_bos(const kvpq_vocab *v);

/* What a token is (bits of kvpq_vocab_token_attr). */
#define KVPQ_TOKEN_ATTR_CONTROL 1u      /* CONTROL / UNKNOWN, or an end-of-generation text llama.cpp marks
                                         * control ("</s>", "<|im_end|>", "<end_of_turn>", ...): cut out
                                         * of text only with parse_special */
#define KVPQ_TOKEN_ATTR_USER_DEFINED 2u /* USER_DEFINED: cut out of text always (Gemma's "\n\n", "<td>") */
#define KVPQ_TOKEN_ATTR_BYTE 4u         /* a SentencePiece byte-fallback token <0xNN> */
/* Bits of KVPQ_TOKEN_ATTR_* for a token, 0 for a plain token or an id out of range. */
KVPQ_API unsigned kvpq_vocab_token_attr(const kvpq_vocab *v, int32_t token);

/* Same contract as kvpq_tokenize(): text (len bytes) -> up to cap ids in tokens; *n_tokens gets the
 * full count (call with cap 0 to size). add_bos prepends the BOS id. Special tokens are cut out of
 * the text first, as llama.cpp does: USER_DEFINED texts always, CONTROL texts only with
 * parse_special; longer texts first, each at its leftmost occurrences outside earlier cuts. Without
 * parse_special no CONTROL token comes from a cut; merging could in principle still reach a token
 * whose text is a control text (as in llama.cpp), which none of the three models here does on text
 * spelling their special tokens (tests/test_tokenizer_golden.c). Byte-level BPE: text must be UTF-8
 * (else KVPQ_ERR_INVALID_ARG with the byte offset, where llama.cpp would silently put U+FFFD for
 * each bad byte) and every byte must have a token (else KVPQ_ERR_UNSUPPORTED: SmolLM2 lacks 21
 * control / never-valid bytes, e.g. 0x04).
 * SentencePiece: any bytes are accepted; what forms no token is written as <0xNN> tokens, so even
 * invalid UTF-8 round-trips (except before a space, which is written U+2581 first). */
KVPQ_API kvpq_status kvpq_vocab_tokenize(const kvpq_vocab *v, const char *text, size_t len, int add_bos,
                                         int parse_special, int32_t *tokens, size_t cap, size_t *n_tokens);
/* Same contract as kvpq_token_to_piece(): the raw bytes of a token (special tokens give their
 * text; SentencePiece: U+2581 as ' ', <0xNN> as that byte), up to cap bytes into buf, no NUL added;
 * *len gets the full length. Concatenating the pieces of kvpq_vocab_tokenize's output gives back
 * the text (SentencePiece: except a literal U+2581, which comes back as ' '). Errors: token out of
 * range. */
KVPQ_API kvpq_status kvpq_vocab_piece(const kvpq_vocab *v, int32_t token, char *buf, size_t cap, size_t *len);

/* ================================================================================================
 * Advanced tier (KVPQ_ADVANCED, see kvpq.h): the calibration in steps, sensitivities, scoring
 * primitives, query maxima, GGUF inspection. May change between minor versions.
 * ============================================================================================== */
#if defined(KVPQ_ADVANCED)

/* ---- models: query maxima --------------------------------------------------------------------- */

/* kvpq_model_eval, and for every token evaluated and every layer, q_absmax: (n_layer, n_head_kv,
 * head_dim) is raised to the largest |q| of that channel among the KV head's query heads (GQA group),
 * q as attention takes it (after RoPE, the query norm and the model's query scale). A running max:
 * the caller zeroes it once and may call again for more text. It feeds query-aware smoothing
 * (kvpq_smooth_compute_qk, kvpq_calibrate_params.query_absmax). Errors: as kvpq_model_eval, and
 * q_absmax NULL (KVPQ_ERR_INVALID_ARG); on error q_absmax may hold part of the block's maxima. */
KVPQ_API kvpq_status kvpq_model_eval_query_absmax(kvpq_model *m, kvpq_cache *cache, const int32_t *tokens, int n,
                                                  int logits_all, float *logits, float *q_absmax);

/* ---- per-layer sensitivity of the VQ cache (bit allocation, docs/allocation.md) ---------------- */

typedef struct {
    int window;     /* newest positions kept exact, as the VQ cache's window (default 128) */
    int sinks;      /* first positions of the sequence kept exact (attention sinks; default 0) */
    int score_from; /* positions score_from .. n-2 are compared (their next-token distributions);
                     * -1 (default): n/2, as kvpq ppl scores the second half of a chunk */
    int kinds;      /* bit 0: measure keys, bit 1: values (default 3) */
    /* -1 (default): every candidate is measured by a forward pass. c >= 0: only candidate c is; the
     * others are scaled from it by the layer's attention-output error, kl(c') = kl(c) * e(c') / e(c),
     * e = sum over the scored positions and query heads of |attn(reconstruction) - attn(exact)|^2
     * (KL is second order in a small perturbation of the logits; the same layer's error propagates
     * through the same later layers). n_cand times cheaper; an approximation (docs/allocation.md). */
    int ref_cand;
    int n_threads;  /* 0 = OpenMP default */
    kvpq_progress_fn progress; /* optional: stage "sensitivity", done/total over measurements */
    void *progress_user;
    /* Other windows (optional, 0..15; `window` is the one measured): for each windows[w] (>= 0),
     * kl_windows[((w * n_cand + c) * 2 + kind) * n_layer + l] (caller's, n_windows * n_cand * 2 *
     * n_layer doubles) gets kl(c, window) * e(c, W) / e(c, window), e the attention-output error as
     * for ref_cand with the coded positions of window W (KL second order in the logit change, as
     * above); +inf where W codes positions and `window` codes none (measure at the smallest window).
     * The errors of every window come from one pass over each layer's scores (nested coded
     * prefixes). Default 0: none. */
    const int *windows;
    int n_windows;
    double *kl_windows;
} kvpq_sensitivity_params;
KVPQ_API kvpq_sensitivity_params kvpq_sensitivity_params_default(void);

/* How much coding ONE layer's keys (or values) with a candidate codebook costs the model, every other
 * layer and kind in full precision: for each candidate c, layer l and kind (0 keys, 1 values),
 * kl[(c * 2 + kind) * n_layer + l] = mean over the scored positions of KL(p || p~), p the next-token
 * distribution with the float32 cache, p~ with layer l's keys (values) replaced by candidate c's
 * reconstruction (the VQ cache's: centering, smoothing, rotation, norm-explicit scale, codes) at the
 * positions the VQ cache would hold as codes when it evaluates the chunk in kvpq_model_eval's steps
 * of 512 tokens (all but the newest `window`, in batches of 32, and the first `sinks`), exactly
 * elsewhere. One pass stores every layer's input and keys/values; each measurement then reruns only
 * layers l .. n_layer-1. Kinds not asked for in p->kinds are left as they are in kl.
 * tokens: (n) one chunk, positions 0 .. n-1 (BOS, if the model wants it, already first); 64 <= n <=
 * the model's context. cands: (n_cand) codebooks of this model's shape (kvpq_cache_new's checks).
 * Cost: about n_cand * 2 * n_layer / 2 forward passes of the chunk (with ref_cand: 2 * n_layer / 2).
 * Errors: KVPQ_ERR_INVALID_ARG (named), KVPQ_ERR_MISMATCH (a codebook of another shape),
 * KVPQ_ERR_NOMEM, errors of the forward pass. */
KVPQ_API kvpq_status kvpq_model_layer_sensitivity(kvpq_model *m, const int32_t *tokens, int n,
                                                  const kvpq_codebook *const *cands, int n_cand,
                                                  const kvpq_sensitivity_params *p, double *kl);

/* ---- calibration in steps (kvpq_model_calibrate runs them all) ----------------------------- */

/* A calibration in progress: the text split, the forward pass done, its keys and values held. */
typedef struct kvpq_calibration kvpq_calibration;

/* How the text was split (kvpq_calibration_info). */
typedef struct {
    size_t n_text;            /* tokens of the text */
    size_t n_kmeans;          /* the first n_kmeans tokens: the forward pass and k-means */
    int verify_ctx;           /* the joint check's chunk, right after them; 0: none */
    int verify_skipped;       /* 1: verify_ctx was -1 and the text too short for it (no check, as asked by default) */
    int holdout_ctx, holdout_chunks; /* the sensitivities' chunks at the end of the text (0 without budgets) */
    double forward_seconds;   /* wall time of the forward pass */
} kvpq_calibration_info;

/* Split tokens (n, the text without BOS) and run the forward pass over the k-means part, collecting
 * every layer's post-RoPE keys and values (float32, n_layer x n_kmeans x n_head_kv x head_dim x 2
 * floats) and the queries' per-channel maxima. With budgets (o->alloc.n_bits > 0) the end of the text
 * is held back (holdout_chunks x holdout_ctx tokens) and the joint check's chunk follows the k-means
 * tokens. The strings of o must outlive the calibration. Errors: KVPQ_ERR_INVALID_ARG naming the
 * option (presets, windows, budgets, a text too short, ctx beyond the model's context),
 * KVPQ_ERR_NOMEM, errors of the forward pass. */
KVPQ_API kvpq_status kvpq_calibration_new(kvpq_calibration **out, kvpq_model *m, const int32_t *tokens, size_t n,
                                          const kvpq_calibrate_opts *o);
KVPQ_API void kvpq_calibration_free(kvpq_calibration *c);
KVPQ_API kvpq_status kvpq_calibration_info_get(const kvpq_calibration *c, kvpq_calibration_info *info);

/* One codebook trained on the collected activations with recipe r (NULL: the calibration's own):
 * per layer centering, smoothing, Hadamard rotation, normalization and k-means
 * (kvpq_codebook_calibrate_layer), with the metadata of `kvpq calibrate` (model, text, tokens, ctx,
 * presets, k-means settings, mean MSEs). Errors: KVPQ_ERR_INVALID_ARG naming the recipe's field. */
KVPQ_API kvpq_status kvpq_calibration_train(kvpq_calibration *c, const kvpq_codebook_recipe *r, kvpq_codebook **out);

/* The allocation of every budget of the calibration's options: trains a codebook per candidate,
 * measures each layer's sensitivity on the held-out chunks, solves the multiple-choice knapsack per
 * window candidate (kvpq_alloc_mckp over kvpq_vq_cache_bytes), assembles each budget's codebook and
 * checks it (joint check). out: (n_bits) codebooks, NULL where no allocation fits that budget (its
 * report says the lightest); report (n_bits, may be NULL). A codebook carries its window and sinks as
 * alloc.window / alloc.sinks, which kvpq_cache_params_resolve applies. Returns KVPQ_OK when every
 * budget got a codebook, KVPQ_ERR_CAPACITY when some did not (the others are in out), other errors
 * as kvpq_calibration_new. */
KVPQ_API kvpq_status kvpq_calibration_allocate(kvpq_calibration *c, kvpq_codebook **out, kvpq_alloc_report *report);

/* ---- scoring: what `kvpq ppl`, calibrate's joint check and the sensitivities compare ---------- */

/* Evaluate one chunk toks (n tokens) from an empty cache c (truncated to 0) in calls of at most batch
 * tokens: positions 0 .. first-1 without logits (scratch_row: (n_vocab) floats), then the logits of
 * positions first .. n-1 into out: (n - first, n_vocab) floats. Returns kvpq_model_eval's status. */
KVPQ_API kvpq_status kvpq_eval_chunk(kvpq_model *m, kvpq_cache *c, const int32_t *toks, int n, int first, int batch,
                                     float *out, float *scratch_row);

/* Sums over scored positions (the caller divides by their count). */
typedef struct {
    double nll, nll2; /* sum of -log p(next token), and of its square (nats) */
    double kl_sum;    /* sum of KL(base || test) (nats); kvpq_score_test with a base only */
    int64_t agree;    /* positions whose argmax equals the base's; kvpq_score_test with a base only */
} kvpq_score_sums;

/* The base cache's rows: lp (n_score, V) logits -> log-probabilities in place (log-softmax, sums in
 * double), top[j] = argmax of row j (top may be NULL), and the NLL of next[j] (the token row j
 * predicts; next may be NULL: no NLL) added to *s. */
KVPQ_API void kvpq_score_base(float *lp, int n_score, int V, const int32_t *next, int *top, kvpq_score_sums *s);

/* A test cache's rows: lp (n_score, V) logits -> log-probabilities in place, the NLL of next[j] added
 * to *s (next may be NULL); with base_lp (n_score, V) log-probabilities and base_top (n_score) from
 * kvpq_score_base (NULL: no comparison), also KL(base || test) = sum_t p_base(t) (log p_base(t) -
 * log p_test(t)) per row (rounding below 0 clamped to 0; written to kl_out[j] when kl_out is not NULL)
 * and the top-1 agreement (base_top NULL: not counted). Rows are summed in a fixed order (blocks of 32
 * rows, each in row order, the blocks in order): the same bits whatever the number of threads. */
KVPQ_API void kvpq_score_test(float *lp, int n_score, int V, const int32_t *next, const float *base_lp,
                              const int *base_top, float *kl_out, kvpq_score_sums *s);

/* ---- GGUF inspection ------------------------------------------------------------------------ */

/* Print what a GGUF (v2/v3) file holds to `out`: format (version, alignment, counts, data offset),
 * the general.* keys, the hyperparameters (every `<general.architecture>.*` key), a tokenizer summary
 * (tokenizer.ggml.model, pre, vocab size, merges count, bos/eos/unk/pad ids with their text), other
 * metadata keys (tokenizer.* arrays too when verbose), then one line per tensor: index, name, type,
 * shape as ne[0], ne[1], ... (ne[0] innermost, the order gguf lists) and bytes. The whole file is
 * validated first (as kvpq_model_load does). Errors: KVPQ_ERR_IO, KVPQ_ERR_FORMAT naming what and
 * where ("gguf 'x.gguf': tensor 12 'blk.0.attn_q.weight': data [...] beyond file size N"). */
KVPQ_API kvpq_status kvpq_gguf_describe(const char *path, FILE *out, int verbose);

/* Dequantize one whole tensor of a GGUF file to float32, bit-exact with ggml's dequantize_row_*
 * (and the PyPI gguf package's gguf.quants.dequantize). out: (ne[3], ne[2], ne[1], ne[0]) float32,
 * ne[0] fastest; cap: floats available at out. *numel (may be NULL) gets ne[0]*ne[1]*ne[2]*ne[3];
 * call with out NULL and cap 0 to query it. Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
 * Errors: KVPQ_ERR_IO / KVPQ_ERR_FORMAT (the file), KVPQ_ERR_INVALID_ARG (no such tensor, or
 * cap < numel), KVPQ_ERR_UNSUPPORTED (tensor type, named). */
KVPQ_API kvpq_status kvpq_gguf_dequantize_tensor(const char *path, const char *name, float *out, size_t cap,
                                                 size_t *numel);

#endif /* KVPQ_ADVANCED */

#ifdef __cplusplus
}
#endif
#endif /* KVPQ_MODEL_H */
