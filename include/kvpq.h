/*
 * kvpq.h — KV-cache compression by product quantization, and attention from codes.
 *
 * kvpq stores the keys and values of a transformer's KV cache as product-quantization (PQ) codes
 * (VecInfer, arXiv 2510.06175): each head vector of `d = head_dim` dims is split into `M`
 * sub-vectors of `dsub = d / M` dims, and each sub-vector is replaced by the index of its nearest
 * centroid in a codebook of `ksub = 2^nbits` centroids trained by k-means on real activations.
 * Before encoding, keys are centered per channel (k - mu; every score of a query then moves by the
 * same q . mu, added back exactly), divided per channel by smoothing factors
 * `lambda = sqrt(max |K - mu|)` and rotated by a normalized Walsh-Hadamard transform; queries are
 * multiplied by the same factors and rotated, so `q . k` is unchanged. Attention is computed
 * directly from the codes through a lookup table `LUT[m][c] = q_m . C[m][c]`.
 *
 * Header tiers (as zstd's ZSTD_STATIC_LINKING_ONLY):
 *   - Stable (always declared): status and errors, backends, a codebook file (load, save, read its
 *     shape and metadata), the KV cache (SPEC grammar, create, append, attend, read, truncate,
 *     reserve, stats, save, load), the page pool many caches share under one byte budget, and
 *     whether CUDA is usable. These keep their names and meaning across
 *     minor versions.
 *   - Advanced (declared when KVPQ_ADVANCED is defined before the #include): the PQ internals
 *     (quantizers, k-means, code packing, smoothing, Hadamard), building and editing codebooks layer
 *     by layer (calibration, bit allocation, TurboQuant's quantizer), SIMD level control, and the
 *     CUDA device-pointer layer with its kernel variants. The same library exports both; the
 *     advanced tier may change between minor versions.
 * The model runner (GGUF reader, tokenizer, forward pass, calibration from a model: kvpq_model_*,
 * kvpq_vocab_*) is kvpq_model.h, in libkvpq_model (pkg-config kvpq_model, CMake kvpq::kvpq_model),
 * which brings PCRE2 and OpenBLAS; it is tiered the same way. This header needs only libkvpq
 * (pkg-config kvpq, CMake kvpq::kvpq).
 *
 * Conventions (every function):
 *   - Fallible calls return kvpq_status: KVPQ_OK (0) or a negative error. kvpq_last_error() gives a
 *     thread-local message naming the problem. The library never calls exit() or abort().
 *   - Opaque handles are made by `*_new`/`*_load` and released by `*_free`; `*_free(NULL)` is a no-op.
 *   - Params structs are filled by `*_default()` and passed by const pointer.
 *   - The caller owns outputs; size helpers (kvpq_pq_code_size, ...) say how much to allocate.
 *   - Arrays are row-major float32 unless said otherwise; shapes are given as (outer, ..., inner).
 *
 * Usage (a compressed cache from a codebook file made by `kvpq calibrate`):
 *
 *     kvpq_codebook *cb;
 *     if (kvpq_codebook_load(&cb, "cb.safetensors") != KVPQ_OK) { fprintf(stderr, "%s\n", kvpq_last_error()); ... }
 *     kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
 *     kvpq_cache_params p = kvpq_cache_params_default();
 *     p.type = KVPQ_CACHE_VQ; p.codebook = cb;
 *     p.n_layer = cp.n_layer; p.n_head = n_head; p.n_head_kv = cp.n_head_kv; p.head_dim = cp.head_dim;
 *     p.max_seq = 4096;
 *     kvpq_cache_params_resolve(&p, -1, -1);             // the codebook's window and sinks
 *     kvpq_cache *c;
 *     kvpq_cache_new(&c, &p);
 *     kvpq_cache_append_attend(c, layer, n, k, v, q, out); // k, v: (n, n_head_kv, head_dim); q, out: (n, n_head, head_dim)
 *     kvpq_cache_free(c);
 *     kvpq_codebook_free(cb);
 */
#ifndef KVPQ_H
#define KVPQ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVPQ_VERSION_MAJOR 0
#define KVPQ_VERSION_MINOR 1
#define KVPQ_VERSION_PATCH 0
#define KVPQ_VERSION_NUMBER (KVPQ_VERSION_MAJOR * 10000 + KVPQ_VERSION_MINOR * 100 + KVPQ_VERSION_PATCH)

#if defined(_WIN32) && defined(KVPQ_BUILD_SHARED)
#define KVPQ_API __declspec(dllexport)
#elif defined(__GNUC__)
#define KVPQ_API __attribute__((visibility("default")))
#else
#define KVPQ_API
#endif

/* ---- status, errors, version ---------------------------------------------------------------- */

/* Return codes. Values are stable: never renumbered; new codes are added at the end. */
typedef enum {
    KVPQ_OK = 0,
    KVPQ_ERR_INVALID_ARG = -1,   /* a NULL pointer, a value out of range, an inconsistent shape */
    KVPQ_ERR_NOMEM = -2,         /* an allocation failed */
    KVPQ_ERR_IO = -3,            /* a file could not be opened, read, written or mapped */
    KVPQ_ERR_FORMAT = -4,        /* a file is truncated, corrupt or lies about its contents */
    KVPQ_ERR_UNSUPPORTED = -5,   /* valid input this build does not handle (tensor type, head_dim) */
    KVPQ_ERR_NONFINITE = -6,     /* NaN or Inf where finite numbers are required */
    KVPQ_ERR_MISMATCH = -7,      /* two inputs that must agree do not (codebook vs model) */
    KVPQ_ERR_NO_DEVICE = -8,     /* a GPU was required and none is usable */
    KVPQ_ERR_DEVICE = -9,        /* a GPU call failed */
    KVPQ_ERR_CAPACITY = -10,     /* a sequence or buffer limit would be exceeded */
    KVPQ_ERR_INTERNAL = -11,     /* a bug in kvpq: please report it */
    KVPQ_ERR_BUDGET = -12,       /* a page pool's byte budget would be exceeded (kvpq_page_pool): free or
                                  * truncate another cache of the pool, or raise its budget, and retry */
} kvpq_status;

/* Short fixed name of a status ("ok", "invalid argument", ...). Never NULL. */
KVPQ_API const char *kvpq_status_string(kvpq_status s);

/* Detail of the last error raised on the calling thread ("" if none). The string is owned by the
 * library and valid until the next failing kvpq call on the same thread. */
KVPQ_API const char *kvpq_last_error(void);

/* Library version as "MAJOR.MINOR.PATCH". */
KVPQ_API const char *kvpq_version(void);

/* Progress callback: `done` of `total` units of the named stage are complete. Return non-zero to
 * cancel the operation (it then fails with KVPQ_ERR_INVALID_ARG and "cancelled"). */
typedef int (*kvpq_progress_fn)(void *user, const char *stage, double done, double total);

/* ---- backends ------------------------------------------------------------------------------- */

/* Where a cache or quantizer runs. AUTO picks CUDA when it is built and a device is present, else
 * the CPU, and reports the choice; CUDA fails at creation with KVPQ_ERR_NO_DEVICE, naming why,
 * when CUDA is unavailable. */
typedef enum { KVPQ_BACKEND_AUTO = 0, KVPQ_BACKEND_CPU = 1, KVPQ_BACKEND_CUDA = 2 } kvpq_backend;

/* Resolve AUTO to CPU or CUDA; fails for CUDA when unavailable (message says why). */
KVPQ_API kvpq_status kvpq_backend_resolve(kvpq_backend want, kvpq_backend *got);
/* "auto", "cpu", "cuda". */
KVPQ_API const char *kvpq_backend_name(kvpq_backend b);

/* ---- product quantizer: parameters (the quantizer itself is in the advanced tier) ---------- */

/* Whether one codebook serves every sub-space, (ksub, dsub), as in the VecInfer reference code, or
 * each sub-space has its own, (M, ksub, dsub), as in faiss's ProductQuantizer, or each KV head has
 * its own, shared by that head's sub-spaces, (n_head, ksub, dsub) (HEAD; decision: one book per
 * head rather than per (head, sub-space), so a head's book still sees M times as many sub-vectors
 * as a per-sub-space book would, and the count of centroids grows with the heads only). A HEAD
 * quantizer codes rows that interleave the heads, as a KV cache lays them out: row i (of n, a
 * multiple of n_head) belongs to head i % n_head and is coded with that head's book. */
typedef enum {
    KVPQ_CODEBOOK_SHARED = 0,
    KVPQ_CODEBOOK_SUBSPACE = 1,
    KVPQ_CODEBOOK_HEAD = 2,
} kvpq_codebook_granularity;

typedef struct {
    int d;          /* vector dimension (head_dim); a multiple of dsub */
    int M;          /* number of sub-spaces; dsub = d / M must be 1, 2, 4, 8 or 16 */
    int nbits;      /* bits per code, 1..12; ksub = 2^nbits centroids */
    kvpq_codebook_granularity granularity;
    int n_head;     /* HEAD granularity: heads (books), 1..4096; ignored otherwise (0). A codebook
                     * sets it to its n_head_kv. */
} kvpq_pq_params;

typedef struct kvpq_pq kvpq_pq;

/* ---- codebook file (safetensors) ------------------------------------------------------------ */

/* A model's trained codebooks: per layer, key and value quantizers, key mean and smoothing factors.
 * Saved as safetensors (format version 4 when head granularity or two key stages are used, else 3;
 * version 1 files, without k.mean, load with mu = 0); tensors:
 *   layers.{i}.k.smooth    (n_head_kv, head_dim) F32   key smoothing factors lambda
 *   layers.{i}.k.mean      (n_head_kv, head_dim) F32   per-channel key mean mu (post-RoPE)
 *   layers.{i}.k.codebook  (ksub, dsub), (M, ksub, dsub) or (n_head_kv, ksub, dsub) (head) F32
 *   layers.{i}.k.codebook2 stage two of the keys (key_stages = 2), likewise with key2.M
 *   layers.{i}.v.codebook  likewise
 * and metadata (all strings): kvpq.format_version, n_layer, n_head_kv, head_dim, k.M, k.nbits,
 * k.granularity, v.M, v.nbits, v.granularity, v.rotate, k.norm, v.norm, k.M.{i} / v.M.{i} (a layer
 * whose key / value M differs from k.M / v.M, see kvpq_codebook_set_layer_key_M and _value_M), plus
 * free-form keys (model, text, tokens).
 * Format version 3 added k.norm and v.norm (norm-explicit quantizers); versions 1 and 2 load with
 * both 0. Version 4 added granularity "head" and k.stages, k2.M (docs/codebook_file.md).
 */
typedef struct kvpq_codebook kvpq_codebook;

typedef struct {
    int n_layer;
    int n_head_kv;
    int head_dim;
    kvpq_pq_params key;     /* key.d == head_dim */
    kvpq_pq_params value;   /* value.d == head_dim */
    int value_rotate;       /* 1: values are Hadamard-rotated before encoding */
    /* Norm-explicit quantization (Dai et al., "Norm-Explicit Quantization: Improving Vector
     * Quantization for Maximum Inner Product Search", AAAI 2020), 1 = on, default 0. The layer's key
     * (key_norm) or value (value_norm) quantizer then codes the direction u = x / |x| of each
     * transformed vector x (k' = H ((k - mu) / lambda) for keys, v or H v for values), and the VQ
     * cache stores beside the codes one float16 scale per (token, KV head),
     * s = x . r / |r|^2 with r the decoded direction (the least-squares fit of x on r; 0 when x or
     * r is 0), so x_hat = s r. A key's score from codes is s * sum_m LUT[m][code_m] (+ q . mu / sqrt(d));
     * a value's softmax weight is multiplied by its s before the per-centroid sums. Costs 16 bits
     * per (token, KV head) on top of the codes (0.25 bits per element at head_dim 64). The codebooks
     * must be trained on directions (kvpq calibrate --key-norm 1 --value-norm 1, its default). The
     * CUDA cache (kvpq_cuda_cache_new) does the same on the GPU (docs/CUDA.md); the standalone
     * kvpq_cuda_pq_* functions code whatever vectors they are given, directions included. With
     * norm-explicit keys the cache's vq_fast_scan option is ignored (exact scores). */
    int key_norm;
    int value_norm;
    /* Residual vector quantization of keys (Juang & Gray, "Multiple stage vector quantization for
     * speech coding", ICASSP 1982; "residual VQ", Chen, Guan & Wang, Sensors 2010): key_stages = 2
     * adds a second quantizer (key2) per layer that codes the error of the first, e = x - r1 (x the
     * transformed key, or its direction with key_norm; r1 its stage-one reconstruction), so
     * x_hat = r1 + r2. The VQ cache stores both code sets per (token, KV head) and scores from codes
     * with the two tables added: sum_m LUT1[m][c1_m] + sum_m LUT2[m][c2_m], LUT2[m][c] = q'_m .
     * C2[m][c]; with key_norm the scale is the least-squares fit on the two-stage reconstruction,
     * s = x . r / |r|^2 with r = r1 + r2. Calibration trains stage two by k-means on the stage-one
     * residuals of the calibration keys. 1 (default; 0 is taken as 1) or 2: every layer gets a second
     * stage, which kvpq_codebook_set_layer_key_stages can then drop layer by layer. */
    int key_stages;
    /* Stage two's quantizer (key_stages = 2): d = head_dim, any allowed M, nbits and granularity
     * those of key (KVPQ_ERR_INVALID_ARG otherwise: the cache adds the two tables as one). Ignored
     * (set to key) with one stage. File: metadata k.stages, k2.M and tensors layers.{i}.k.codebook2
     * (format version 4). The CUDA cache refuses a two-stage layer (KVPQ_ERR_UNSUPPORTED). */
    kvpq_pq_params key2;
    /* Keys coded before RoPE (KVQuant, Hooper et al., arXiv 2401.18079, sec. 3.2: pre-RoPE keys keep
     * their per-channel structure, which RoPE smears across each rotated pair). key_rope_dims = n_rot
     * > 0 (even, <= head_dim): the first n_rot channels of a key were rotated by RoPE, in pairs
     * (x[2i], x[2i+1]) (key_rope_neox 0, llama.cpp's rope mode 0) or (x[i], x[i + n_rot/2])
     * (key_rope_neox 1, GPT-NeoX / transformers' rotate_half), by the angle pos * inv_freq[i], with
     * each layer's inv_freq (n_rot/2) in kvpq_codebook_key_rope_freq. The VQ cache still takes
     * post-RoPE keys: it turns each back by -pos before centering (exact up to float rounding),
     * codes it, and turns the decoded key forward by +pos again before its scores, so attention is
     * that of the reconstruction with RoPE applied (kvpq_rope_rotate, the one rotation both use).
     * A layer whose inv_freq are all 0 codes keys as given (the rotation by 0 is the identity).
     * Default 0 (off). File: metadata k.rope_dims, k.rope ("norm" or "neox") and tensors
     * layers.{i}.k.rope_freq (format version 5). kvpq_cache's CUDA backend and the Python CudaCache
     * serve it too (kvpq_cuda_cache_params.key_rope_*, which a caller of kvpq_cuda_cache_new with the
     * quantizers of such a layer must set). */
    int key_rope_dims;
    int key_rope_neox;
} kvpq_codebook_params;
KVPQ_API void kvpq_codebook_free(kvpq_codebook *cb);
KVPQ_API kvpq_codebook_params kvpq_codebook_get_params(const kvpq_codebook *cb);
/* Free-form metadata (UTF-8 strings). set copies; get returns NULL when absent. The config keys
 * (kvpq.format_version, n_layer, ... v.rotate, k.M.{i}, v.M.{i}) are listed and readable too, derived from the params;
 * set fails on them with KVPQ_ERR_INVALID_ARG. Values of k.granularity: "shared" or "subspace". */
KVPQ_API kvpq_status kvpq_codebook_set_meta(kvpq_codebook *cb, const char *key, const char *value);
KVPQ_API const char *kvpq_codebook_get_meta(const kvpq_codebook *cb, const char *key);
/* Number of metadata entries and the i-th key (for listing). */
KVPQ_API size_t kvpq_codebook_meta_count(const kvpq_codebook *cb);
KVPQ_API const char *kvpq_codebook_meta_key(const kvpq_codebook *cb, size_t i);

/* Write atomically (temp file PATH.kvpq.tmp.PID.XXXXXX, fsync, rename over PATH: an existing file is never
 * left half-written; on failure the temp file is removed). A PATH that is a symbolic link has the
 * file it names replaced, not the link. Fails
 * with KVPQ_ERR_NONFINITE / KVPQ_ERR_INVALID_ARG (NaN/Inf, smoothing factor <= 0) rather than write
 * a file that load would reject. New codebooks hold lambda = 1, mu = 0 and zero centroids. */
KVPQ_API kvpq_status kvpq_codebook_save(const kvpq_codebook *cb, const char *path);
/* Load and validate every offset, shape and dtype; rejects NaN/Inf (KVPQ_ERR_NONFINITE) and any
 * inconsistency (KVPQ_ERR_FORMAT naming the tensor and what was expected). */
KVPQ_API kvpq_status kvpq_codebook_load(kvpq_codebook **out, const char *path);

/* Remove the temporary files of saves in progress (kvpq_codebook_save's PATH.kvpq.tmp.PID.XXXXXX).
 * Async-signal-safe: call it from a SIGINT/SIGTERM handler before the process dies, so that an
 * interrupted save leaves nothing behind (the kvpq CLI does). The library installs no handlers. */
KVPQ_API void kvpq_remove_temp_files(void);

/* ---- KV cache ------------------------------------------------------------------------------- */

/* Largest max_seq a cache takes (2^30 positions): page and position arithmetic then stays in int. */
#define KVPQ_CACHE_MAX_SEQ (1 << 30)
/* Largest n_layer and n_head (query heads) a cache takes (KVPQ_ERR_INVALID_ARG beyond); the largest
 * published models have 126 layers and 128 query heads. */
#define KVPQ_CACHE_MAX_LAYERS 4096
#define KVPQ_CACHE_MAX_HEADS 4096

/* Cache kinds. Enum values are stable; new kinds are added at the end. */
typedef enum {
    KVPQ_CACHE_FP32 = 0,
    KVPQ_CACHE_FP16 = 1,
    KVPQ_CACHE_Q8_0 = 2,   /* llama.cpp-style blocks of 32: fp16 scale + 32 int8 */
    KVPQ_CACHE_Q4_0 = 3,   /* blocks of 32: fp16 scale + 32 4-bit */
    KVPQ_CACHE_KIVI2 = 4,  /* KIVI (arXiv 2402.02750): keys per channel, values per token, 2 bits */
    KVPQ_CACHE_KIVI4 = 5,  /* likewise, 4 bits */
    KVPQ_CACHE_VQ = 6,     /* product-quantization codes with attention from codes */
    /* llama.cpp's rotated quantized KV cache (its default for quantized K/V since April 2026,
     * src/llama-kv-cache.cpp): keys and queries multiplied by the normalized Walsh-Hadamard matrix
     * of the largest power-of-two block dividing head_dim (64 at head_dim 64, 128 at 128, 256 at
     * 256), values by blocks of 64, then q8_0 / q4_0 blocks; the attention output is rotated back.
     * Needs head_dim % 64 == 0 (else KVPQ_ERR_UNSUPPORTED). */
    KVPQ_CACHE_Q8_0R = 7,
    KVPQ_CACHE_Q4_0R = 8,
} kvpq_cache_type;

/* A page pool (docs/cache.md "Page pool"): the storage of many CPU caches under one byte budget.
 * Defined with kvpq_cache_params below; its calls follow kvpq_cache_get_params. */
typedef struct kvpq_page_pool kvpq_page_pool;

typedef struct {
    kvpq_cache_type type;
    int n_layer;        /* 1..KVPQ_CACHE_MAX_LAYERS */
    int n_head;         /* query heads, 1..KVPQ_CACHE_MAX_HEADS */
    int n_head_kv;      /* KV heads; n_head % n_head_kv == 0 (GQA) */
    int head_dim;       /* 1..1024 */
    int max_seq;        /* positions the cache may hold (KVPQ_ERR_CAPACITY beyond), 1..KVPQ_CACHE_MAX_SEQ */
    int window;         /* VQ/KIVI: newest tokens kept in full precision (default 128); a window
                         * longer than max_seq is clamped to max_seq (the whole sequence) */
    int page_tokens;    /* tokens per allocated page (default 256); clamped to max_seq likewise */
    const kvpq_codebook *codebook; /* VQ: borrowed, must outlive the cache; checked against shapes */
    int n_threads;      /* 0 = OpenMP default; at most 1024 */
    /* CPU (and AUTO, default: the CPU whatever the machine, so results do not depend on it) or CUDA:
     * a VQ cache on the GPU, the same calls with the same host arrays (copied to and from the device
     * at each call), its codebook uploaded at creation (docs/CUDA.md "One cache API"). Only VQ has a
     * GPU form (another kind: KVPQ_ERR_UNSUPPORTED); without CUDA or a device: KVPQ_ERR_NO_DEVICE
     * naming why. The GPU form codes every position at its append and keeps the newest `window` in
     * float32 (the CPU: fp16, coded as they leave the window in batches of 32), so the two agree to
     * the kernels' rounding where their windows cover the same positions; norm-explicit scales are
     * float16 there whatever k.norm_bits says; vq_fast_scan is ignored; head-granularity and two-stage
     * key codebooks, sliding windows and head_dim other than 64, 128, 256 are refused
     * (KVPQ_ERR_UNSUPPORTED naming it). kvpq_cache_attend with n_q > 1 beyond the window is refused
     * (KVPQ_ERR_UNSUPPORTED): kvpq_cache_append_attend takes any n. Saved files record the backend:
     * a file loads into a cache of the backend that saved it (else KVPQ_ERR_MISMATCH). */
    kvpq_backend backend;
    /* VQ, 8-bit key codes: 1 = approximate key scores by "fast-scan" (André et al., VLDB 2015;
     * faiss PQ fast-scan): the float LUT of each query head is quantized to 8 bits with one step
     * delta = max_m (max_c LUT[m][c] - min_c LUT[m][c]) / 255 and summed in 16-bit integers with
     * in-register byte lookups (AVX-512 VBMI; the scalar reference elsewhere). Each score (a logit
     * already divided by sqrt(head_dim)) gains an error of at most M * delta / 2, so softmax weights
     * move by a factor within exp(+-M * delta). Default 0: exact float LUT. Ignored (exact scores)
     * when the codebook's keys are norm-explicit (kvpq_codebook_params.key_norm). */
    int vq_fast_scan;
    /* Sliding-window attention (local layers of Gemma 2/3; Beltagy et al. 2020, "Longformer",
     * arXiv 2004.05150): in a layer l with swa_layers[l] != 0, the query at position p attends only
     * to positions p - sliding_window + 1 .. p, and the cache frees what no later query can see:
     * such a layer keeps at most sliding_window - 1 positions before each append, plus up to one
     * storage unit (a page of page_tokens; for kivi a page of groups) and the appended ones.
     * kvpq_cache_read and kvpq_cache_truncate refuse (KVPQ_ERR_INVALID_ARG) positions that are
     * gone. 0 (default): no sliding window. */
    int sliding_window;
    const uint8_t *swa_layers; /* (n_layer) 1 = local layer; NULL with sliding_window > 0 = every
                                  layer. Copied by kvpq_cache_new (need not outlive the call). */
    /* Attention sinks (Xiao et al. 2023, "StreamingLLM", arXiv 2309.17453): the first `sinks`
     * positions of every layer are held apart in fp16 (IEEE half, round to nearest even, like the
     * window) and never quantized; the kind stores positions sinks.. as its own sequence (its window,
     * groups and pages count from there). Attention merges the two parts exactly (online softmax:
     * each part's output and log-sum-exp). Counted in resident_bytes (2 * sinks * n_head_kv *
     * head_dim * 2 bytes per layer, allocated with the cache). 0 (default): none. Any kind but fp32
     * and fp16 (KVPQ_ERR_INVALID_ARG there), 0..65536; kvpq_cache_save stores them (saved-cache
     * format version 3). In a sliding-window layer a sink is seen only while inside the window. */
    int sinks;
    /* NULL (default): the cache allocates its own storage. Else a kvpq_page_pool whose pages and
     * budget it shares with the other caches made with it: every CPU kind takes its pages (fp32,
     * fp16, q8_0, q4_0, q8_0r, q4_0r rows; kivi groups; vq codes and scales) and its fp16 window
     * rings (kivi, vq) from the pool and gives them back on truncate and free; an append or load the
     * budget does not allow fails with KVPQ_ERR_BUDGET and changes nothing (a refused
     * kvpq_cache_reserve keeps only the storage the positions held need: nothing held is lost). The cache holds
     * a reference to the pool (kvpq_page_pool_free may come before kvpq_cache_free). Ignored by the
     * CUDA backend (its storage is on the device). Not part of a saved cache. */
    kvpq_page_pool *pool;
} kvpq_cache_params;
KVPQ_API kvpq_cache_params kvpq_cache_params_default(void);

/* Parse a SPEC string: fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 vq:FILE. Sets p->type; for vq: returns the
 * FILE part in *vq_path (pointer into spec; NULL otherwise). Errors name the SPEC. */
KVPQ_API kvpq_status kvpq_cache_type_parse(const char *spec, kvpq_cache_type *type, const char **vq_path);
KVPQ_API const char *kvpq_cache_type_name(kvpq_cache_type t);

/* A cache SPEC: the one grammar of the CLI's --cache and of the Python package.
 *
 *   SPEC   = KIND { ":" SUFFIX }  |  "vq:" PATH { ":" SUFFIX }  |  "vq:" PATH ":" { ":" SUFFIX }
 *   KIND   = fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 | tq2 tq3 tq4 (TurboQuant's MSE quantizer at
 *            2, 3, 4 bits per coordinate: a vq cache of kvpq_codebook_turboquant's codebook for the
 *            model; window and sinks 0 unless :wN / :sN)
 *   SUFFIX = "w" N   (fp16 window of vq / kivi caches, N in 0..2^20)
 *          | "s" N   (attention sinks of a quantized cache, N in 0..65536)
 *          | "force" (vq:FILE only: use a codebook calibrated on another model)
 *          | "cuda"  (vq only: the cache on the GPU, kvpq_cache's CUDA backend)
 * Suffixes come in any order, each at most once. After a kind every ":" part must be a suffix. A vq
 * PATH may contain ':': the suffixes are the trailing ":" parts that read as suffixes, scanning from
 * the end; the first part that does not (or an empty part, "::" or a trailing ":") ends them, and
 * everything before is the path. So `vq:run:2.safetensors:w64` is the file `run:2.safetensors` with a
 * window of 64, and a file whose own name ends in a suffix-like part (`cb:w5`) is named with an empty
 * part after it: `vq:cb:w5:` (no suffixes) or `vq:cb:w5::s1`. */
typedef struct {
    kvpq_cache_type type;
    char path[256]; /* vq: the codebook file; "" for the other kinds and tqN */
    int window;     /* :wN, -1 when not given (kvpq_cache_params_resolve's window argument) */
    int sinks;      /* :sN, -1 when not given */
    int force;      /* :force given */
    int tq_bits;    /* tqN: N (type KVPQ_CACHE_VQ, path ""); 0 otherwise */
    int cuda;       /* :cuda given: backend KVPQ_BACKEND_CUDA */
} kvpq_cache_spec;
/* Parse spec into *out. Errors (KVPQ_ERR_INVALID_ARG, the message naming the SPEC and the offending
 * part): an unknown kind or suffix, a duplicate suffix, a suffix the kind does not take (:wN on a
 * kind without a window, :sN on fp32/fp16, :force or :cuda elsewhere than vq), N out of range, a vq
 * SPEC without a path, a SPEC longer than 255 bytes. */
KVPQ_API kvpq_status kvpq_cache_spec_parse(const char *spec, kvpq_cache_spec *out);

typedef struct kvpq_cache kvpq_cache;

/* Attention sinks a cache of kind t keeps unless told otherwise (kvpq_cache_params_resolve, the CLI,
 * kvpq.Model.new_cache and KVPQCache in Python): 1 for vq, kivi2, kivi4 and q4_0r, where one fp16
 * sink lowered the loss on SmolLM2 (docs/cache.md); 0 for the others (q4_0 lost with it; q8_0 /
 * q8_0r lose nearly nothing to keep; fp32 / fp16 take none). kvpq_cache_params_default() itself
 * keeps 0 for every kind: explicit params are taken as given. */
KVPQ_API int kvpq_cache_default_sinks(kvpq_cache_type t);

/* Window and sinks of a cache as a user of the library expects them: `window` / `sinks` when given
 * (>= 0); else, for a VQ cache, what its codebook's allocation was made for (metadata alloc.window /
 * alloc.sinks, written by `kvpq calibrate --bits`); else the defaults (p->window as set, the library's
 * 128 from kvpq_cache_params_default; sinks kvpq_cache_default_sinks(p->type)). Reads p->type and
 * p->codebook, sets p->window and p->sinks. The one rule the CLI's --cache SPEC (:wN, :sN) and the
 * Python package apply, so the same codebook gives the same cache everywhere. Errors:
 * KVPQ_ERR_INVALID_ARG (p NULL, window or sinks below -1), KVPQ_ERR_FORMAT (the codebook's
 * alloc.window / alloc.sinks not a number in 0..2^20 / 0..65536; the key is named). */
KVPQ_API kvpq_status kvpq_cache_params_resolve(kvpq_cache_params *p, int window, int sinks);

KVPQ_API kvpq_status kvpq_cache_new(kvpq_cache **out, const kvpq_cache_params *p);
KVPQ_API void kvpq_cache_free(kvpq_cache *c);

/* Append n positions to a layer, after the ones it holds. k, v: (n, n_head_kv, head_dim) float32;
 * keys post-RoPE. Errors: NaN/Inf, capacity, KVPQ_ERR_BUDGET (the pool of params.pool refused a
 * page), KVPQ_ERR_NOMEM. On error the cache is unchanged. */
KVPQ_API kvpq_status kvpq_cache_append(kvpq_cache *c, int layer, int n, const float *k, const float *v);

/* Causal attention for the newest n_q positions of a layer (the queries of the positions just
 * appended): query i, at position L - n_q + i (L = positions held), attends to positions
 * 0 .. L - n_q + i with scale 1/sqrt(head_dim). Query head h reads KV head h / (n_head/n_head_kv).
 * q: (n_q, n_head, head_dim); out: (n_q, n_head, head_dim). */
KVPQ_API kvpq_status kvpq_cache_attend(kvpq_cache *c, int layer, int n_q, const float *q, float *out);

/* Append n positions to a layer and attend their n queries, query i (at position L + i, L = positions
 * held before) seeing the cache exactly as it was right after its own position was appended: the
 * outputs of n one-position append + attend calls, whatever n. So a sequence fed in any split (a
 * saved prefix continued, a prompt in batches of any size) leaves bit-identical keys and values in
 * the cache, and attention equal to within float rounding (the CPU kernels' order of summation
 * depends on how many queries come together). With kvpq_cache_append of n positions then
 * kvpq_cache_attend of n queries, a windowed kind (kivi2, kivi4, vq) would show the earlier queries
 * the positions that left its window during the batch already coded. k, v: (n, n_head_kv, head_dim);
 * q, out: (n, n_head, head_dim); float32. Errors: as kvpq_cache_append and kvpq_cache_attend;
 * NaN/Inf in k, v, q and capacity are found before anything is appended; a value beyond a kind's
 * range (fp16 parts: 65504), out of memory or a pool's budget (KVPQ_ERR_BUDGET; kvpq_cache_reserve
 * first avoids it) may leave some of the n positions appended: truncate to L. */
KVPQ_API kvpq_status kvpq_cache_append_attend(kvpq_cache *c, int layer, int n, const float *k, const float *v,
                                              const float *q, float *out);

/* The longest prefix of at most n_pos positions (and of what every layer holds) that
 * kvpq_cache_truncate keeps exactly as a fresh cache fed those positions would hold it, so that
 * continuing after the truncation holds bit-identical keys and values (kvpq_cache_append_attend).
 * A sliding-window layer may still refuse the truncation (it freed positions the cut needs). Row kinds
 * (fp32, fp16, q8_0, q4_0, q8_0r, q4_0r): every prefix. Windowed kinds: a prefix whose cut leaves as
 * many positions coded as appends alone would (a cut below the coded positions keeps codes where a
 * fresh cache would hold the window in fp16, and a KIVI group cut in two returns decoded values);
 * 0 when none but the empty one is. Returns 0 for a NULL cache. */
KVPQ_API int kvpq_cache_exact_prefix(const kvpq_cache *c, int n_pos);

/* Keep only positions [0, n_pos) of every layer. Pages no longer needed (and storage
 * kvpq_cache_reserve took beyond the positions) go back to the system or to the cache's pool. */
KVPQ_API kvpq_status kvpq_cache_truncate(kvpq_cache *c, int n_pos);

/* Positions held by a layer. */
KVPQ_API int kvpq_cache_seq_len(const kvpq_cache *c, int layer);

/* Read back positions [pos0, pos0+n) of a layer as the cache would attend over them (dequantized,
 * in the model's original space). k, v: (n, n_head_kv, head_dim); either may be NULL. */
KVPQ_API kvpq_status kvpq_cache_read(const kvpq_cache *c, int layer, int pos0, int n, float *k, float *v);

/* Bytes resident for the stored K and V: codes, window, scales, pages, codebooks, smoothing factors
 * and key means. */
KVPQ_API size_t kvpq_cache_resident_bytes(const kvpq_cache *c);

typedef struct {
    size_t resident_bytes;
    int64_t elements;          /* K and V elements stored: 2 * n_layer * seq_len * n_head_kv * head_dim */
    double bits_per_element;   /* resident_bytes * 8 / elements (0 when empty) */
    int64_t tokens_coded;      /* per layer, summed: positions held as codes (VQ/KIVI) */
    int64_t tokens_window;     /* per layer, summed: positions held in full precision */
    kvpq_backend backend;      /* where it runs */
    /* The bytes of the tokens held, in their stored form: per coded token its share of a page
     * (codes, scales), per window token its fp16 K and V; without what resident_bytes adds for
     * capacity (the unused slots of the last page and of the window ring) and for codebooks. After
     * a short run resident_bytes is mostly empty capacity (a 4-token fp16 cache holds a whole
     * 256-token page); stored_bytes is what the tokens themselves take. CPU kinds; 0 on the GPU. */
    size_t stored_bytes;
    double stored_bits_per_element; /* stored_bytes * 8 / elements (0 when empty) */
} kvpq_cache_stats;
KVPQ_API kvpq_status kvpq_cache_get_stats(const kvpq_cache *c, kvpq_cache_stats *st);

/* ---- saved caches (docs/cache.md, "Saved caches") ----
 * A cache's stored state (codes, scales, windows: every kind, exactly as held, so attention after a
 * load equals attention before the save) in one file: a header (magic "KVPQSAVE", format version,
 * cache kind, shapes, max_seq, window, page_tokens, an XXH64 fingerprint of the VQ codebook, the
 * positions held and the first one still held per layer), an optional caller blob (e.g. the model and the prompt's tokens),
 * the attention sinks (fp16, version 3 only), the kind's payload, then an XXH64 checksum (xxHash,
 * Collet) over everything before it. A cache without sinks is written as version 2, so readers
 * of version 2 read it; versions 1 and 2 load. */
#define KVPQ_CACHE_FILE_VERSION 3 /* newest version read and written: 3 added attention sinks (written only when
                                   * sinks > 0), 2 the first position held per layer (sliding windows) */

/* Write c to path atomically: a temporary file in the same folder, flushed and fsync'd, renamed over
 * path; on any error it is removed and an existing file at path is left as it was. user: user_len
 * bytes stored with the cache (may be NULL with 0). Errors: KVPQ_ERR_IO naming the path and errno's
 * text, KVPQ_ERR_INVALID_ARG, KVPQ_ERR_UNSUPPORTED for a kind without a saved form. */
KVPQ_API kvpq_status kvpq_cache_save(const kvpq_cache *c, const char *path, const void *user, size_t user_len);

/* Load a saved cache into a new cache made from *p (kind, shapes, codebook, max_seq, threads, ...).
 * The file must hold the same kind, n_layer, n_head, n_head_kv, head_dim, window and page_tokens (as
 * kvpq_cache_new clamps them) and, for VQ, a codebook with the same fingerprint as p->codebook;
 * p->max_seq may be larger than the file's (KVPQ_ERR_CAPACITY when the positions held exceed it);
 * a file whose max_seq was below the window or page size holds them clamped to it, and then the
 * loaded cache keeps the file's (clamped) window and page size, so it carries on as the saved one.
 * *user (malloc'd, caller frees; NULL when none) and *user_len get the caller blob; either may be
 * NULL. Errors, each naming the file: KVPQ_ERR_IO (cannot open or read), KVPQ_ERR_FORMAT (not a
 * saved cache, another format version, truncated, checksum mismatch: corrupted, a sink that is not a
 * finite fp16 value), KVPQ_ERR_MISMATCH (another kind, shape, window, page size, codebook or number
 * of sinks: the field is named; a file from before version 3 holds 0 sinks), KVPQ_ERR_BUDGET (p->pool
 * refused a page: nothing of the file is kept). On error *out is NULL. */
KVPQ_API kvpq_status kvpq_cache_load(kvpq_cache **out, const kvpq_cache_params *p, const char *path, void **user,
                                     size_t *user_len);

/* XXH64 fingerprint of a codebook's contents (shapes, flags, centroids, smoothing factors, key
 * means): equal for codebooks that code identically. 0 for NULL. */
KVPQ_API uint64_t kvpq_codebook_fingerprint(const kvpq_codebook *cb);

/* The params the cache was created with (as resolved: backend is CPU or CUDA, never AUTO), copied
 * into *p; pointer fields (the codebook) are borrowed from the cache and live as long as it does.
 * Errors: KVPQ_ERR_INVALID_ARG for NULL. */
KVPQ_API kvpq_status kvpq_cache_get_params(const kvpq_cache *c, kvpq_cache_params *p);

/* Allocate now the storage that holding n_pos positions in every layer needs (what appends up to
 * n_pos would allocate: pages, window rings), so that appends up to there take nothing more from the
 * pool: a server reserves each sequence's next positions before a batched evaluation, and a refusal
 * then comes before any cache has changed. Layers holding n_pos or more are left as they are; the
 * storage beyond the positions held goes back at the next truncate (kvpq_cache_truncate to the
 * current length frees it). Counted in resident_bytes. n_pos: 0..max_seq (KVPQ_ERR_CAPACITY beyond,
 * KVPQ_ERR_INVALID_ARG below 0). Errors: KVPQ_ERR_BUDGET (the cache's pool refused a page: the cache
 * then keeps only the storage its positions need; nothing held is lost), KVPQ_ERR_NOMEM. A no-op on
 * the CUDA backend. */
KVPQ_API kvpq_status kvpq_cache_reserve(kvpq_cache *c, int n_pos);

/* ---- page pool (docs/cache.md "Page pool") ----
 * One byte budget over the storage of many CPU caches (a server's conversations), as
 * kvpq_cuda_cache's pool shares device pages between sequences. A cache made with
 * kvpq_cache_params.pool takes every page and window ring from the pool and gives it back when it
 * truncates or is freed; given-back memory is kept on free lists keyed by its size (pages differ in
 * size between kinds and, with per-layer bit allocation, between a VQ cache's layers) and handed out
 * again, zeroed, for the next request of that size. All sizes are bytes, each allocation rounded up
 * to 64 (its alignment). The budget bounds in_use + free bytes (memory the pool holds): a request
 * beyond it first releases free pages of other sizes to the system, then fails with
 * KVPQ_ERR_BUDGET ("page pool: a page of N bytes would exceed the budget of B bytes (U in use)").
 * Thread safety: the pool has a mutex; caches of one pool may be appended, truncated, created and
 * freed from different threads at once (kvpq_model_eval_batch appends several sequences' caches in
 * parallel). A single cache is still used by one thread at a time. */

/* Create a pool. budget_bytes: 0 = unbounded. Errors: KVPQ_ERR_INVALID_ARG (out NULL), KVPQ_ERR_NOMEM. */
KVPQ_API kvpq_status kvpq_page_pool_new(kvpq_page_pool **out, size_t budget_bytes);
/* Drop the creator's reference: the pool's memory goes when the last cache made with it is freed
 * too (caches hold references). NULL is a no-op. */
KVPQ_API void kvpq_page_pool_free(kvpq_page_pool *pool);
/* Change the budget (0 = unbounded), for the next requests: memory already handed out is not taken
 * back (a budget below bytes_in_use refuses every new page until caches give enough back); free
 * pages beyond it are released. Errors: KVPQ_ERR_INVALID_ARG (NULL). */
KVPQ_API kvpq_status kvpq_page_pool_set_budget(kvpq_page_pool *pool, size_t budget_bytes);
/* Release every free page to the system (bytes_free becomes 0). NULL is a no-op. */
KVPQ_API void kvpq_page_pool_trim(kvpq_page_pool *pool);

typedef struct {
    size_t budget_bytes;  /* 0 = unbounded */
    size_t bytes_in_use;  /* held by caches (64-byte rounded) */
    size_t bytes_free;    /* given back, kept for reuse: the pool holds bytes_in_use + bytes_free */
    int64_t pages_in_use; /* allocations held by caches (pages and window rings) */
    int64_t pages_free;
    int64_t allocs;       /* requests served since creation */
    int64_t reused;       /* of which from a free list */
    int64_t refused;      /* requests refused by the budget (KVPQ_ERR_BUDGET) */
    int64_t caches;       /* caches holding a reference now */
} kvpq_page_pool_stats;
/* A consistent snapshot (taken under the pool's mutex). Errors: KVPQ_ERR_INVALID_ARG (NULL). */
KVPQ_API kvpq_status kvpq_page_pool_get_stats(const kvpq_page_pool *pool, kvpq_page_pool_stats *st);

/* ---- CUDA ----------------------------------------------------------------------------------- */


/* 1 if the library was built with CUDA and a device is usable; else 0 and `why` (n bytes, may be
 * NULL) says why ("built without CUDA", "no CUDA device: <cuda error>", ...). */
KVPQ_API int kvpq_cuda_available(char *why, size_t n);

/* ================================================================================================
 * Advanced tier: defined only with KVPQ_ADVANCED (see the top of this header). PQ internals, codebooks
 * built and edited layer by layer, SIMD control and the CUDA device-pointer layer. May change between
 * minor versions.
 * ============================================================================================== */
#if defined(KVPQ_ADVANCED)

/* Usage (encode and decode vectors with a trained quantizer):
 *
 *     kvpq_pq_params pp = kvpq_pq_params_default();      // d=64, M=16 (dsub=4), nbits=8
 *     kvpq_pq *pq;
 *     if (kvpq_pq_new(&pq, &pp) != KVPQ_OK) { fprintf(stderr, "%s\n", kvpq_last_error()); ... }
 *     kvpq_kmeans_params kp = kvpq_kmeans_params_default();
 *     kvpq_pq_train(pq, &kp, n_train, x_train, NULL);    // x_train: (n_train, d)
 *     uint8_t *codes = malloc(n * kvpq_pq_code_size(pq));
 *     kvpq_pq_encode(pq, n, x, codes);                   // x: (n, d) -> codes: (n, code_size)
 *     kvpq_pq_decode(pq, n, codes, x_hat);               // x_hat: (n, d)
 *     kvpq_pq_free(pq);
 */

/* ---- CPU SIMD dispatch ---------------------------------------------------------------------- */

/* SIMD levels of the CPU kernels. The best level the CPU supports is chosen at first use; the
 * environment variable KVPQ_SIMD=scalar|avx2|avx512 forces a lower one (tests run every level). */
typedef enum { KVPQ_SIMD_SCALAR = 0, KVPQ_SIMD_AVX2 = 1, KVPQ_SIMD_AVX512 = 2 } kvpq_simd_level;

/* The level in use now. */
KVPQ_API kvpq_simd_level kvpq_simd_get(void);
/* Force a level. Fails with KVPQ_ERR_UNSUPPORTED if the CPU (or build) lacks it. */
KVPQ_API kvpq_status kvpq_simd_set(kvpq_simd_level level);
/* "scalar", "avx2", "avx512". */
KVPQ_API const char *kvpq_simd_name(kvpq_simd_level level);

/* ---- product quantizer ---------------------------------------------------------------------- */

/* d=64, M=16 (dsub 4), nbits 8: 2 bits per element; granularity SHARED. */
KVPQ_API kvpq_pq_params kvpq_pq_params_default(void);

/* Fill M and nbits from a preset name and d: "d8b8" (1 bit/elem), "d8b12" (1.5), "d4b8" (2),
 * "d4b12" (3), "d2b8" (4), "d1b8" (8: each channel coded alone by 256 scalar levels, one set for
 * every channel with KVPQ_CODEBOOK_SHARED, one per channel with KVPQ_CODEBOOK_SUBSPACE). Fails with
 * KVPQ_ERR_INVALID_ARG naming the preset if unknown or d % dsub != 0. */
KVPQ_API kvpq_status kvpq_pq_params_preset(kvpq_pq_params *p, const char *preset, int d);


/* Create a quantizer with zeroed centroids. Errors: KVPQ_ERR_INVALID_ARG naming the bad field. */
KVPQ_API kvpq_status kvpq_pq_new(kvpq_pq **out, const kvpq_pq_params *p);
KVPQ_API void kvpq_pq_free(kvpq_pq *pq);
KVPQ_API kvpq_pq_params kvpq_pq_get_params(const kvpq_pq *pq);

/* Number of centroid floats: ksub*dsub (SHARED), M*ksub*dsub (SUBSPACE), n_head*ksub*dsub (HEAD). */
KVPQ_API size_t kvpq_pq_centroids_size(const kvpq_pq *pq);
/* Borrowed pointer to the centroids: (ksub, dsub), (M, ksub, dsub) or (n_head, ksub, dsub) float32. */
KVPQ_API const float *kvpq_pq_centroids(const kvpq_pq *pq);
/* Copy `n` centroid floats in (n must equal kvpq_pq_centroids_size). Rejects NaN/Inf. */
KVPQ_API kvpq_status kvpq_pq_set_centroids(kvpq_pq *pq, const float *centroids, size_t n);

/* Bytes of one packed code vector: ceil(M * nbits / 8). */
KVPQ_API size_t kvpq_pq_code_size(const kvpq_pq *pq);

typedef struct {
    int niter;                    /* Lloyd iterations (default 25, as faiss Kmeans) */
    int max_points_per_centroid;  /* subsample to at most ksub * this points (default 256, faiss) */
    uint64_t seed;                /* same seed, same data -> same codebook (any thread count) */
    int n_threads;                /* 0 = OpenMP default; at most 1024 */
    kvpq_progress_fn progress;    /* optional */
    void *progress_user;
    /* Initial centroids: KVPQ_KMEANS_INIT_PP (default) k-means++ seeding (Arthur & Vassilvitskii
     * 2007) on a subsample of 16 k points; KVPQ_KMEANS_INIT_RANDOM k distinct points drawn
     * uniformly, as faiss Clustering does. */
    int init;
} kvpq_kmeans_params;
enum { KVPQ_KMEANS_INIT_PP = 0, KVPQ_KMEANS_INIT_RANDOM = 1 };
KVPQ_API kvpq_kmeans_params kvpq_kmeans_params_default(void);

typedef struct {
    double mse_init;     /* mean squared error per vector after k-means++ initialization */
    double mse_final;    /* after the last iteration */
    int iterations;      /* Lloyd iterations run */
    int empty_repaired;  /* clusters that were empty and were re-seeded (total over iterations) */
    size_t n_used;       /* points used after subsampling */
} kvpq_kmeans_report;

/* k-means (k-means++ initialization, Lloyd iterations, empty clusters split from the largest).
 * x: (n, d) float32; centroids out: (k, d). Uses at most k * max_points_per_centroid points (a
 * uniform subsample, as faiss); k-means++ seeds from a uniform subsample of at most 16 k of them.
 * MSE (sum of squared distances / n_used) never rises between iterations: an iteration whose MSE
 * would rise (rounding at a fixed point) is rolled back and ends the run early (report->iterations
 * says how many ran). The result depends only on (x, k, params, seed), not on the thread count.
 * d = 1, 2, 4, 8, 16 use the fused nearest-centroid kernels; other d use OpenBLAS sgemm blocks.
 * Progress: stage "kmeans", done = iterations finished of niter. kp may be NULL (defaults).
 * Errors: n < k, bad params (named), NaN/Inf in x (KVPQ_ERR_NONFINITE), cancelled by progress. */
KVPQ_API kvpq_status kvpq_kmeans(int d, int k, size_t n, const float *x, const kvpq_kmeans_params *kp,
                                 float *centroids, kvpq_kmeans_report *report);

/* Train the quantizer's codebook(s) on x: (n, d). SHARED pools the n*M sub-vectors into one
 * k-means; SUBSPACE runs M k-means; HEAD runs one per head on the (n / n_head) * M sub-vectors of its
 * rows (rows i % n_head == h; n a multiple of n_head, else KVPQ_ERR_INVALID_ARG). report may be NULL; its MSEs are per d-dim vector (SUBSPACE:
 * summed over sub-spaces; SHARED: M x the sub-vector MSE), its counts summed over the k-means runs.
 * Progress: stage "pq_train", done/total over all sub-spaces. On error the codebook is unchanged.
 * Errors: as kvpq_kmeans; n*M < ksub (SHARED) or n < ksub (SUBSPACE). */
KVPQ_API kvpq_status kvpq_pq_train(kvpq_pq *pq, const kvpq_kmeans_params *kp, size_t n, const float *x,
                                   kvpq_kmeans_report *report);

/* Encode x: (n, d) float32 into packed codes: (n, code_size) bytes. Fused nearest-centroid search
 * (||c||^2 - 2 x.c with precomputed norms, no (n, ksub, dsub) intermediate); ties go to the lowest
 * index. Packing: the M codes of a vector form a little-endian bit stream, code m in bits
 * [m*nbits, (m+1)*nbits). Errors: NaN/Inf in x (KVPQ_ERR_NONFINITE). */
KVPQ_API kvpq_status kvpq_pq_encode(const kvpq_pq *pq, size_t n, const float *x, uint8_t *codes);

/* Unpacked variant: idx (n, M) uint16 centroid indices. */
KVPQ_API kvpq_status kvpq_pq_assign(const kvpq_pq *pq, size_t n, const float *x, uint16_t *idx);

/* Decode (gather): codes (n, code_size) -> x (n, d). */
KVPQ_API kvpq_status kvpq_pq_decode(const kvpq_pq *pq, size_t n, const uint8_t *codes, float *x);

/* Pack idx (n, M) uint16 (each < 2^nbits) into (n, ceil(M*nbits/8)) bytes, and back. */
KVPQ_API size_t kvpq_codes_size(int M, int nbits);
KVPQ_API kvpq_status kvpq_codes_pack(int M, int nbits, size_t n, const uint16_t *idx, uint8_t *packed);
KVPQ_API kvpq_status kvpq_codes_unpack(int M, int nbits, size_t n, const uint8_t *packed, uint16_t *idx);

/* ---- outlier suppression for keys (VecInfer sec. 3) ----------------------------------------- */

/* In-place normalized fast Walsh-Hadamard transform (Sylvester order, scaled by 1/sqrt(d)) of n
 * vectors x: (n, d). Orthonormal and self-inverse; O(d log d) per vector. d must be a power of
 * two (else KVPQ_ERR_UNSUPPORTED naming d). */
KVPQ_API kvpq_status kvpq_hadamard(float *x, size_t n, int d);

/* Rotary position embedding (RoPE; Su et al., RoFormer, arXiv 2104.09864) of n vectors x: (n,
 * n_head, head_dim) in place, vector t at position pos[t] (pos NULL: pos0 + t), by the angle
 * sign * pos * inv_freq[i] (computed in double) on pair i of the first n_rot channels: (x[2i],
 * x[2i+1]) (neox 0) or (x[i], x[i + n_rot/2]) (neox 1). sign -1 undoes sign +1 up to float rounding.
 * The rotation the VQ cache applies to keys coded before RoPE (kvpq_codebook_params.key_rope_dims).
 * Errors: x or inv_freq NULL with n > 0, n_rot odd, < 0 or > head_dim, sign not +-1
 * (KVPQ_ERR_INVALID_ARG). */
KVPQ_API kvpq_status kvpq_rope_rotate(float *x, size_t n, int n_head, int head_dim, int n_rot, int neox,
                                      const float *inv_freq, const int32_t *pos, int pos0, int sign);

/* Divide each row of x: (n, d) in place by its L2 norm (the direction u = x / |x| that a
 * norm-explicit quantizer codes, see kvpq_codebook_params.key_norm); a zero row stays zero.
 * norms: (n) gets |x| of each row (float of the double-precision sum), or NULL. Errors: d < 1, x
 * NULL with n > 0 (KVPQ_ERR_INVALID_ARG); a NaN/Inf element or a norm beyond float's range
 * (KVPQ_ERR_NONFINITE, naming the row; x is then unchanged). */
KVPQ_API kvpq_status kvpq_normalize_rows(float *x, size_t n, int d, float *norms);

/* Smoothing factors lambda_c = sqrt(max_t |k_tc|), floored at `floor` (default 1e-2 keeps
 * near-silent channels from blowing up), per KV head and channel.
 * k: (n_tokens, n_head_kv, head_dim); lambda out: (n_head_kv, head_dim). */
KVPQ_API kvpq_status kvpq_smooth_compute(size_t n_tokens, int n_head_kv, int head_dim, const float *k,
                                         float floor, float *lambda);

/* Query-aware smoothing factors: lambda_c = sqrt(max_t |k_tc| * qbar_h / qm_c), floored at `floor`,
 * per KV head h and channel c, where qm_c = max(q_absmax_c, 1e-3 * max_c' q_absmax_c') is the largest
 * |q| that channel c of the head's queries took (over its GQA group's query heads) and qbar_h the mean
 * of qm over the head's channels. As kvpq_smooth_compute (keys divided by lambda, queries multiplied),
 * but the split of each channel's magnitude between k and q follows SmoothQuant's alpha = 0.5 balance,
 * lambda_c^2 ~ max|k_c| / max|q_c| (Xiao et al., ICML 2023, eq. 4), instead of keys alone: channels the
 * queries weigh heavily keep more of the key's resolution, so the PQ error lands where q . k is least
 * sensitive. With equal q_absmax in every channel it equals kvpq_smooth_compute exactly. On SmolLM2-135M
 * (d4b8 keys, exact values, held-out text) it lowered the attention-distribution KL of all 30 layers,
 * by 21% on average (docs/vq_quality.md). k: (n_tokens, n_head_kv, head_dim); q_absmax: (n_head_kv,
 * head_dim), finite and >= 0 (all zero in a head: that head falls back to kvpq_smooth_compute);
 * lambda out: (n_head_kv, head_dim). Errors: as kvpq_smooth_compute, and a q_absmax entry negative or
 * not finite (KVPQ_ERR_INVALID_ARG naming the index). */
KVPQ_API kvpq_status kvpq_smooth_compute_qk(size_t n_tokens, int n_head_kv, int head_dim, const float *k,
                                            const float *q_absmax, float floor, float *lambda);

/* Apply smoothing factors in place to x: (n, n_head_kv, head_dim), lambda: (n_head_kv, head_dim).
 * inverse = 0: x /= lambda (what keys get before rotation and encoding, VecInfer sec. 3);
 * inverse = 1: x *= lambda (undoes it: decoded keys back to the model's space).
 * Then (q * lambda) . (k / lambda) = q . k. Errors: lambda not finite and > 0 (names the index). */
KVPQ_API kvpq_status kvpq_smooth_apply(float *x, size_t n, int n_head_kv, int head_dim, const float *lambda,
                                       int inverse);

/* Multiply queries q: (n, n_head, head_dim) in place by the factors of their KV head (GQA: query head
 * h uses lambda row h / (n_head / n_head_kv)). lambda: (n_head_kv, head_dim). Errors: n_head not a
 * multiple of n_head_kv, lambda not finite and > 0. */
KVPQ_API kvpq_status kvpq_smooth_apply_query(float *q, size_t n, int n_head, int n_head_kv, int head_dim,
                                             const float *lambda);

/* ---- codebooks built and edited layer by layer ------------------------------------------------ */

KVPQ_API kvpq_codebook_params kvpq_codebook_params_default(void);

KVPQ_API kvpq_status kvpq_codebook_new(kvpq_codebook **out, const kvpq_codebook_params *p);
/* Borrowed: the key (is_value=0) or value (is_value=1) quantizer of a layer. NULL if out of range. */
KVPQ_API kvpq_pq *kvpq_codebook_pq(kvpq_codebook *cb, int layer, int is_value);
KVPQ_API const kvpq_pq *kvpq_codebook_pq_const(const kvpq_codebook *cb, int layer, int is_value);
/* Per-layer key bit allocation: replace a layer's key quantizer by a fresh one (zero centroids) of
 * M sub-vectors; nbits and granularity stay those of params.key, dsub = head_dim / M. Saved as
 * metadata k.M.{layer} (only for layers whose M differs from k.M) and a k.codebook tensor of that
 * layer's shape. Errors: cb NULL or layer out of range (KVPQ_ERR_INVALID_ARG), M not a divisor of
 * head_dim (KVPQ_ERR_INVALID_ARG), dsub outside {1, 2, 4, 8, 16} (KVPQ_ERR_UNSUPPORTED); on error
 * the codebook is unchanged. */
KVPQ_API kvpq_status kvpq_codebook_set_layer_key_M(kvpq_codebook *cb, int layer, int M);
/* A layer's key M (params.key.M unless set_layer_key_M changed it); 0 if cb is NULL or the layer
 * is out of range. */
KVPQ_API int kvpq_codebook_layer_key_M(const kvpq_codebook *cb, int layer);
/* Borrowed: a layer's stage-two key quantizer (params.key_stages = 2), NULL with one stage or a
 * layer out of range. */
KVPQ_API kvpq_pq *kvpq_codebook_key_pq2(kvpq_codebook *cb, int layer);
KVPQ_API const kvpq_pq *kvpq_codebook_key_pq2_const(const kvpq_codebook *cb, int layer);
/* Per-layer residual stages (bit allocation by layer): in a codebook made with key_stages = 2, give
 * layer `layer` one stage (its stage-two quantizer is dropped) or two again (a fresh stage two,
 * zero centroids, params key2). Saved as metadata k.stages.{layer} = "1" for the layers without
 * stage two (their layers.{i}.k.codebook2 is then absent). Errors: cb NULL, layer out of range,
 * stages not 1 or 2, stages 2 in a codebook with key_stages = 1 (KVPQ_ERR_INVALID_ARG); on error the
 * codebook is unchanged. */
KVPQ_API kvpq_status kvpq_codebook_set_layer_key_stages(kvpq_codebook *cb, int layer, int stages);
/* A layer's key stages (1 or 2); 0 if cb is NULL or the layer is out of range. */
KVPQ_API int kvpq_codebook_layer_key_stages(const kvpq_codebook *cb, int layer);
/* A new codebook for KV heads [h0, h0 + n_head_kv) of cb: the same quantizers (every layer's M,
 * stages and centroids) with those heads' smoothing factors and key means, cb's free metadata, and
 * "heads" = "h0:h1/N". For tensor parallelism, where each rank holds some of a layer's KV heads
 * (transformers' column-wise k_proj / v_proj shards give rank r heads [r N / R, (r + 1) N / R)):
 * codes and attention of those heads equal the whole codebook's. Errors: KVPQ_ERR_INVALID_ARG (NULL,
 * heads outside [0, n_head_kv)), KVPQ_ERR_UNSUPPORTED (a quantizer with a codebook per KV head,
 * granularity head), KVPQ_ERR_NOMEM. *out is NULL on error; free with kvpq_codebook_free. */
KVPQ_API kvpq_status kvpq_codebook_slice_heads(kvpq_codebook **out, const kvpq_codebook *cb, int h0, int n_head_kv);
/* Bits of the VQ cache's norm-explicit scale of one coded vector of a layer's keys (is_value 0) or
 * values: 0 without a norm-explicit quantizer for that kind, 16 (float16), or 8 when the codebook's
 * metadata k.norm_bits / v.norm_bits (set with kvpq_codebook_set_meta: "8" or "16", default 16) is
 * "8" and the layer's codes have at most 4 bits per element (both key stages counted: nbits (M1 +
 * M2) <= 4 head_dim; finer quantizers keep float16, whose error the 8-bit code would exceed). The
 * 8-bit code is s = m 2^((c - 128) / 16) with m a power of two per (page, KV head, kind), set by the
 * page's first nonzero scale: 1/16-octave steps, relative error <= 2.24% (with the float16 rounding of
 * the decoded value) for scales within m 2^(+-7.9); others are clamped to that window, and codes never
 * decode beyond float16's 65504 (docs/vq_cache.md "8-bit scales"). The CUDA cache keeps float16 scales whatever this says. -1 if cb
 * is NULL, the layer is out of range or the metadata holds another value. */
KVPQ_API int kvpq_codebook_layer_scale_bits(const kvpq_codebook *cb, int layer, int is_value);
/* Per-layer value bit allocation, the same for a layer's value quantizer: a fresh one (zero
 * centroids) of M sub-vectors, nbits and granularity those of params.value, dsub = head_dim / M.
 * Saved as metadata v.M.{layer} (only for layers whose M differs from v.M) and a v.codebook tensor of
 * that layer's shape. Errors as kvpq_codebook_set_layer_key_M; on error the codebook is unchanged. */
KVPQ_API kvpq_status kvpq_codebook_set_layer_value_M(kvpq_codebook *cb, int layer, int M);
/* A layer's value M (params.value.M unless set_layer_value_M changed it); 0 if cb is NULL or the
 * layer is out of range. */
KVPQ_API int kvpq_codebook_layer_value_M(const kvpq_codebook *cb, int layer);
/* Borrowed: a layer's key smoothing factors, (n_head_kv, head_dim), writable. */
KVPQ_API float *kvpq_codebook_key_smooth(kvpq_codebook *cb, int layer);
KVPQ_API const float *kvpq_codebook_key_smooth_const(const kvpq_codebook *cb, int layer);
/* Borrowed: a layer's per-channel key mean mu, (n_head_kv, head_dim), writable; 0 until set. Keys
 * are stored centered, k - mu, before smoothing and rotation: every score of a query then moves by
 * the same q . mu, which the softmax cancels exactly, while the quantization error of the coded
 * keys shrinks (the mean no longer spends codebook resolution). */
KVPQ_API float *kvpq_codebook_key_mean(kvpq_codebook *cb, int layer);
KVPQ_API const float *kvpq_codebook_key_mean_const(const kvpq_codebook *cb, int layer);
/* Borrowed: a layer's RoPE frequencies inv_freq, (key_rope_dims / 2), writable; 0 (no rotation)
 * until set (kvpq_codebook_params.key_rope_dims). NULL when key_rope_dims is 0, cb is NULL or the
 * layer is out of range. A VQ cache and calibration refuse a negative or non-finite one
 * (KVPQ_ERR_INVALID_ARG), saving also one above 2^21, as for the other tensors. */
KVPQ_API float *kvpq_codebook_key_rope_freq(kvpq_codebook *cb, int layer);
KVPQ_API const float *kvpq_codebook_key_rope_freq_const(const kvpq_codebook *cb, int layer);
/* ---- TurboQuant's MSE quantizer as a codebook (a peer in kvpq's own harness) ----------------- */

/* The 2^nbits Lloyd-Max centroids (ascending) for one coordinate of a uniformly random unit vector in
 * R^d, density ~ (1 - x^2)^((d - 3) / 2) on [-1, 1] (TurboQuant, Zandieh et al., arXiv 2504.19874,
 * sec. 3.1), by Lloyd iterations on a 65536-point grid. out: (2^nbits). Errors: d < 4, nbits not in
 * 1..8 (KVPQ_ERR_INVALID_ARG). */
KVPQ_API kvpq_status kvpq_turboquant_centroids(int d, int nbits, float *out);
/* A codebook that makes the VQ cache TurboQuant's MSE quantizer (its Algorithm 1) at nbits bits per
 * coordinate: keys and values Hadamard-rotated (mu 0, lambda 1), norm-explicit, each coordinate of the
 * direction coded by the kvpq_turboquant_centroids quantizer (a PQ with dsub 1 and that fixed shared
 * codebook; attention from codes as for any VQ cache). Differs from the paper in the rotation
 * (kvpq's deterministic normalized Walsh-Hadamard, not a random orthogonal matrix) and the kept scale
 * (the least-squares x . r / |r|^2, not |x|). Records metadata method "turboquant-mse", tq.bits, and
 * alloc.window 0 / alloc.sinks 0 (TurboQuant keeps no fp16 positions; kvpq_cache_params_resolve
 * applies them unless overridden). norm_bits: 16 (float16 scales, as TurboQuant keeps the norm) or 8
 * (nbits <= 4). Effective bits per element: nbits + norm_bits / head_dim. Errors:
 * KVPQ_ERR_INVALID_ARG (shapes as kvpq_codebook_new, nbits, norm_bits). */
KVPQ_API kvpq_status kvpq_codebook_turboquant(kvpq_codebook **out, int n_layer, int n_head_kv, int head_dim, int nbits,
                                              int norm_bits);

/* ---- calibration: a codebook from collected keys and values --------------------------------- */

/* How kvpq_codebook_calibrate_layer trains a layer. kvpq_calibrate_params_default() gives the
 * defaults of `kvpq calibrate` (which calls this function), so equal inputs give equal files. */
typedef struct {
    int center;                /* 1 (default): subtract the per-(KV head, channel) key mean mu first */
    float smooth_floor;        /* floor of the smoothing factors lambda (default 1e-2, kvpq_smooth_compute) */
    /* k-means of both quantizers: defaults niter 25, seed 1234, init KVPQ_KMEANS_INIT_RANDOM (as faiss),
     * max_points_per_centroid 0 = per quantizer 256, or 32 when its nbits > 8. */
    kvpq_kmeans_params kmeans;
    /* NULL (default): lambda = kvpq_smooth_compute of the centered keys. Else (n_head_kv, head_dim):
     * the largest |q| per KV head's query group and channel over the calibration text (post-RoPE, as
     * attention takes them; kvpq_model_eval_query_absmax), and lambda = kvpq_smooth_compute_qk. */
    const float *query_absmax;
    /* NULL (default), or a codebook this function trained on the same k, v with the same params and
     * presets but one key stage: the layer's stage-one key and value quantizers are copied from it,
     * and only the second key stage is trained (k-means is deterministic, so the result is what
     * training all three gives, at a third of the k-means). Needs a second key stage at the layer. */
    const kvpq_codebook *stage1_from;
    /* NULL (default), or (n_tokens) the position of each token (its index in the sequence the model
     * ran): needed when the layer codes keys before RoPE (its kvpq_codebook_key_rope_freq not all 0),
     * whose post-RoPE k are turned back by -position before centering. */
    const int32_t *positions;
} kvpq_calibrate_params;
KVPQ_API kvpq_calibrate_params kvpq_calibrate_params_default(void);

/* Train layer `layer` of cb from keys and values a model produced: its key mean mu (when
 * p->center; else mu is left 0), key smoothing factors lambda = sqrt(max_t |k - mu|) per KV head and
 * channel (floored at p->smooth_floor), and its key and value codebooks, by k-means over the
 * transformed vectors of all KV heads pooled. Keys become H((k - mu) / lambda) (VecInfer, arXiv
 * 2510.06175, sec. 3); values H v when the codebook's value_rotate is set, else v; each is divided
 * by its L2 norm when the codebook's key_norm / value_norm is set (norm-explicit quantizers are
 * trained on directions, Dai et al., AAAI 2020). The quantizer shapes (presets, a layer's own key M,
 * granularity) are those cb was created with.
 * k, v: (n_tokens, n_head_kv, head_dim) float32 post-RoPE keys and values of that layer (read only;
 * the work is done in copies). A layer coding keys before RoPE (its kvpq_codebook_key_rope_freq not
 * all 0) turns each key back by -p->positions[t] first, so mu, lambda and the codebooks are those of
 * pre-RoPE keys (KVPQ_ERR_INVALID_ARG without positions). p may be NULL (defaults). key_report, value_report may be NULL; they
 * get the k-means reports (MSE per transformed vector; with two key stages, key_report's mse_final
 * is stage two's, i.e. the error left after both stages). Two key stages (params.key_stages = 2):
 * stage two is trained by k-means on the stage-one residuals x - r1 of the same keys (residual VQ).
 * Head granularity: each KV head's book is trained on that head's vectors only. Progress: p->kmeans.progress, as
 * kvpq_pq_train. Errors: cb NULL, layer out of range, n_tokens too small for a quantizer's ksub
 * (KVPQ_ERR_INVALID_ARG, naming it); NaN/Inf in k or v (KVPQ_ERR_NONFINITE, naming which);
 * KVPQ_ERR_NOMEM. On error the layer may be partly trained. */
KVPQ_API kvpq_status kvpq_codebook_calibrate_layer(kvpq_codebook *cb, int layer, size_t n_tokens, const float *k,
                                                   const float *v, const kvpq_calibrate_params *p,
                                                   kvpq_kmeans_report *key_report, kvpq_kmeans_report *value_report);

/* ---- bit allocation (docs/allocation.md) ------------------------------------------------------ */

/* Multiple-choice knapsack: pick one choice per group minimizing the summed cost subject to the
 * summed weight <= budget. Exact dynamic programming over the weight (Kellerer, Pferschy & Pisinger,
 * "Knapsack Problems", Springer 2004, ch. 11; Dudzinski & Walukiewicz, EJOR 1987): when
 * budget <= max_units the weights are used as they are and the optimum is exact; otherwise weights
 * are counted in quanta q = ceil(budget / max_units), each rounded UP, so the result still respects
 * the budget and is optimal for the rounded weights (within one quantum per group of the optimum's
 * weight). O(n_groups * n_choices * min(budget, max_units)) time, n_groups * (units + 1) bytes.
 * cost, weight: (n_groups, n_choices); a choice with weight < 0 or cost +Inf is unavailable.
 * max_units 0: 65536, at most KVPQ_ALLOC_MAX_UNITS. choice: (n_groups) the chosen index per group; total_cost, total_weight (may be
 * NULL) its sums (ties: the lowest total weight is not guaranteed, the lowest-index choice is kept).
 * Errors: KVPQ_ERR_INVALID_ARG (sizes, NaN cost, a group with no usable choice), KVPQ_ERR_CAPACITY
 * (even the lightest choices exceed the budget; the message says their weight), KVPQ_ERR_NOMEM. */
#define KVPQ_ALLOC_MAX_UNITS ((int64_t)1 << 30) /* largest max_units (tables of n_groups x units bytes) */
KVPQ_API kvpq_status kvpq_alloc_mckp(int n_groups, int n_choices, const double *cost, const int64_t *weight,
                                     int64_t budget, int64_t max_units, int *choice, double *total_cost,
                                     int64_t *total_weight);


/* Resident bytes of a VQ cache made from p (its window, page_tokens, max_seq and sliding window,
 * clamped as kvpq_cache_new does) with codebook cb, after `len` positions were appended in steps of
 * `step` (kvpq_model_eval appends in steps of 512), split as kvpq_cache_resident_bytes counts them:
 * layer_bytes (n_layer, 2) (may be NULL): per layer, the key [.., 0] and value [.., 1] part: codes
 * and norm-explicit scales of the coded positions held (whole pages) plus that quantizer's
 * centroids (a layer with a residual second key stage: both stages' codes, packed as one bit stream
 * as the cache stores them, and both stages' centroids); *fixed_bytes: what no quantizer choice changes (the fp16 window rings, the attention
 * sinks of p->sinks, smoothing factors, key means); *elements: K and V elements held (as kvpq_cache_stats.elements; a
 * sliding-window layer holds fewer positions). Effective bits = 8 * (sum + fixed) / elements.
 * Errors: KVPQ_ERR_INVALID_ARG (NULL, shapes that differ, len beyond max_seq). */
KVPQ_API kvpq_status kvpq_vq_cache_bytes(const kvpq_codebook *cb, const kvpq_cache_params *p, int len, int step,
                                         size_t *layer_bytes, size_t *fixed_bytes, int64_t *elements);

/* ---- CUDA: the device-pointer layer ------------------------------------------------------------- */
/*
 * Device-pointer API (docs/CUDA.md). Every function below exists in every build; without CUDA, or
 * without a usable GPU, they fail with KVPQ_ERR_NO_DEVICE naming why. Pointers documented as
 * "device" are cudaMalloc'd memory of the current device. Calls are synchronous: they return after
 * the GPU work finished, and a CUDA failure comes back as KVPQ_ERR_DEVICE with CUDA's error string.
 * The one cache API on the GPU is kvpq_cache with backend KVPQ_BACKEND_CUDA (a VQ cache; host
 * arrays, the codebook uploaded by the library; kvpq_cache_params.backend). kvpq_cuda_cache_* below
 * is the layer under it, kept for callers that hold device memory and batches of sequences (the
 * Python package's CudaCache and KVPQCache, CUDA graphs of a decode step): one layer, device
 * pointers, several sequences per call. New host-side code should use kvpq_cache.
 */
/* Kernel variants of the CUDA backend (docs/CUDA.md), chosen per quantizer or cache at creation,
 * so that tests and benchmarks can run each one side by side in one process. The defaults
 * (kvpq_cuda_kernels_default) are the fastest measured on an H200; every variant computes the same
 * function to within its own rounding (tests/gpu/gpu_check.c checks each against float64). A value
 * outside the listed ones fails creation with KVPQ_ERR_INVALID_ARG naming the field. */
typedef struct {
    int attend_tc;       /* 1 (default): shared K and V codebooks with dsub 4 and nbits 8 take the
                          * tensor-core attention kernel; 0: the LUT kernel for every codebook */
    int attend_tc_warps; /* tensor-core kernel, warps per CTA: 8 (two CTAs per SM), 16 (one), or 0
                          * (default): chosen per launch from the work */
    int attend_lut16;    /* LUT kernel: 1 (default) float16 LUT entries summed in float32; 0: float32 */
    int attend_vrep;     /* LUT kernel: 1 (default) the value codebook as 8 bank-private replicas in
                          * shared memory where it fits; 0: one copy */
    int attend_pvec;     /* LUT kernel, whole-byte value codes: 1 (default) vector loads of a
                          * position's probabilities; 0: the previous scalar loop */
    int encode_search;   /* encode search: 5 (default) tensor cores, grouped argmin and exact
                          * re-rank, A fragments loaded by index; 3 (the previous default) the same
                          * with A fragments selected per quad position, 4 that with 2 row tiles and
                          * 4 CTAs per SM, 2 with accumulator input; 1 tensor cores with a per-key
                          * argmin; 0 float32 on the CUDA cores. All give the same codes but for
                          * near-ties. Codebooks without tensor-core fragments take 0 whatever the
                          * value */
    int attend_pdl;      /* tensor-core kernel launched by kvpq_cuda_cache_attend_async on a stream
                          * other than the legacy default (NULL): 1 (default) as a programmatic
                          * dependent launch (Hopper), so that its prologue (codebook image, page
                          * table, first code tiles: none of them written by attention calls) overlaps
                          * the previous kernel of the stream, and only then waits for that kernel to
                          * finish before reading q or writing anything; 0: a plain launch. The
                          * synchronous kvpq_cuda_cache_attend always launches plainly */
    int attend_cluster;  /* tensor-core kernel: 1 (default) the CTAs of one (sequence, head group)
                          * form a thread-block cluster (Hopper, up to 16 splits) and merge their
                          * partials through distributed shared memory; 0: through a device-memory
                          * workspace, the last CTA to finish merging (a counter). Same output bits */
    int attend_tc_regs;  /* tensor-core kernel: 1 the code rows of a tile loaded straight from device
                          * memory into registers, software-pipelined one tile ahead; 0 (default)
                          * staged through a per-warp cp.async ring in shared memory. Same output bits */
    int attend_tc_heads; /* tensor-core kernel: at most this many query heads per CTA (the largest
                          * divisor of n_head / n_head_kv up to it; fewer heads per CTA, more CTAs,
                          * each reading the codes again); 0 (default): up to 8 */
} kvpq_cuda_kernels;
KVPQ_API kvpq_cuda_kernels kvpq_cuda_kernels_default(void);

/* A product quantizer resident on the GPU: codebook(s) and norms uploaded once, plus the key
 * transforms of VecInfer sec. 3 for n_head_kv heads: x / lambda (per head and channel) when lambda
 * is given, then the normalized Hadamard rotation when rotate != 0. */
typedef struct kvpq_cuda_pq kvpq_cuda_pq;

typedef struct {
    int n_head_kv;             /* heads of each row (default 8) */
    const float *lambda;       /* host (n_head_kv, d) smoothing factors (> 0, finite; copied), or NULL */
    int rotate;                /* 1 (default): normalized Hadamard rotation after smoothing */
    kvpq_cuda_kernels kernels; /* encode_search is the one that applies (default kvpq_cuda_kernels_default) */
} kvpq_cuda_pq_params;
KVPQ_API kvpq_cuda_pq_params kvpq_cuda_pq_params_default(void);

/* pq: trained host quantizer (d = 64, 128 or 256; copied, may be freed after). Errors:
 * KVPQ_ERR_UNSUPPORTED (d), KVPQ_ERR_INVALID_ARG (naming the field), KVPQ_ERR_NO_DEVICE,
 * KVPQ_ERR_DEVICE. */
KVPQ_API kvpq_status kvpq_cuda_pq_new_params(kvpq_cuda_pq **out, const kvpq_pq *pq, const kvpq_cuda_pq_params *p);
/* kvpq_cuda_pq_new_params with the default kernels and the given n_head_kv, lambda, rotate. */
KVPQ_API kvpq_status kvpq_cuda_pq_new(kvpq_cuda_pq **out, const kvpq_pq *pq, int n_head_kv, const float *lambda,
                                      int rotate);
KVPQ_API void kvpq_cuda_pq_free(kvpq_cuda_pq *q);

/* Encode n_tokens rows: x device (n_tokens, n_head_kv, d) float32 -> codes device
 * (n_tokens, n_head_kv, code_size) bytes, packed as kvpq_pq_encode. One fused kernel (transforms,
 * nearest centroid by ||c||^2 - 2 x.c, packing); no intermediate in device memory. Same codes as
 * the CPU except where two centroid distances are within float rounding. Errors:
 * KVPQ_ERR_NONFINITE (NaN/Inf in x; codes are then unspecified), KVPQ_ERR_DEVICE. */
KVPQ_API kvpq_status kvpq_cuda_pq_encode(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, uint8_t *codes);

/* Decode (gather) back to the original space: centroids, inverse rotation, times lambda.
 * codes device (n_tokens, n_head_kv, code_size) -> x device (n_tokens, n_head_kv, d). */
KVPQ_API kvpq_status kvpq_cuda_pq_decode(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes, float *x);

/* A device-resident VQ cache of ONE layer for a batch of sequences: pages of key/value codes in
 * device memory (a page holds page_tokens positions of every KV head), a page table per sequence,
 * and the newest `window` positions of each sequence also kept in float32. */
typedef struct kvpq_cuda_cache kvpq_cuda_cache;

typedef struct {
    int n_head;          /* query heads; n_head % n_head_kv == 0 */
    int n_head_kv;
    int head_dim;        /* 64, 128 or 256 */
    int n_seq;           /* sequences (batch rows) the cache holds */
    int max_seq;         /* positions per sequence */
    int window;          /* newest positions kept in float32 (default 128; 0 = none; clamped to max_seq) */
    int page_tokens;     /* positions per page, a multiple of 32 (default 256); one longer than
                          * max_seq is cut to the smallest power of two >= max_seq (>= 32) */
    int n_pages;         /* pages in the pool shared by all sequences, allocated at creation; 0 (default):
                          * a pool that starts with one page per sequence and grows on demand (at least
                          * doubling, new device arrays, contents copied) up to enough for n_seq * max_seq,
                          * so a large batch x max_seq holds device memory only for the pages in use */
    const kvpq_pq *key;  /* key quantizer (d = head_dim), copied */
    const kvpq_pq *value;/* value quantizer (d = head_dim), copied */
    const float *key_smooth; /* host (n_head_kv, head_dim) lambda, or NULL for none */
    int value_rotate;    /* 1: values are Hadamard-rotated before encoding */
    const float *key_mean; /* host (n_head_kv, head_dim) per-channel key mean mu, or NULL for none.
                            * Keys are stored as k - mu (codes of H((k - mu) / lambda), window k - mu):
                            * every score of a query shifts by the same q.mu, so attention is unchanged
                            * (exact) while the codes quantize centered keys. Finite values; copied. */
    kvpq_cuda_kernels kernels; /* kernel variants of the cache's encode and attention (default
                                * kvpq_cuda_kernels_default) */
    /* Keys coded before RoPE (kvpq_codebook_params.key_rope_dims; KVQuant): key_rope_dims = n_rot > 0
     * (even, <= head_dim) with key_rope_freq host (key_rope_dims / 2) inv_freq (finite, copied; all 0
     * or NULL: keys coded as given) and key_rope_neox the pair layout. Keys still come in after RoPE:
     * each is turned back by -(key_rope_pos0 + position) before it is coded, and decoded keys are
     * turned forward again (kvpq_cuda_cache_read; attention decodes each coded key, adds the key
     * mean and rotates it, then scores it: a kernel of its own, src/cuda/rope.cu). key_rope_pos0:
     * the RoPE position of the cache's position 0 (kvpq_cache's sinks; 0 .. INT_MAX - max_seq, else
     * KVPQ_ERR_INVALID_ARG). Default 0 (off). */
    int key_rope_dims;
    int key_rope_neox;
    const float *key_rope_freq;
    int key_rope_pos0;
} kvpq_cuda_cache_params;
KVPQ_API kvpq_cuda_cache_params kvpq_cuda_cache_params_default(void);

/* Quantizers from a norm-explicit codebook (kvpq_codebook_params.key_norm / value_norm; Dai et al.,
 * AAAI 2020) are taken as the CPU VQ cache takes them: the codes are those of the direction
 * u = x'/|x'| of the transformed vector x', and a float16 scale s = x'.r/|r|^2 (r = u's
 * reconstruction) per (position, KV head) is stored beside the code pages (device memory, counted
 * by kvpq_cuda_cache_resident_bytes); a coded key's score is s_k times that of its codes, a coded
 * value's softmax weight p enters the value sum as p s_v. docs/CUDA.md.
 * Head-granularity quantizers and key quantizers of a two-stage codebook (key_stages = 2) are refused
 * with KVPQ_ERR_UNSUPPORTED (the CPU VQ cache takes both).
 * Errors: KVPQ_ERR_INVALID_ARG / KVPQ_ERR_UNSUPPORTED naming the field, KVPQ_ERR_NONFINITE (key_mean),
 * KVPQ_ERR_NO_DEVICE, KVPQ_ERR_DEVICE (including out of device memory), KVPQ_ERR_NOMEM (host). */
KVPQ_API kvpq_status kvpq_cuda_cache_new(kvpq_cuda_cache **out, const kvpq_cuda_cache_params *p);
KVPQ_API void kvpq_cuda_cache_free(kvpq_cuda_cache *c);

/* Append n positions to sequence `seq`: k, v device (n, n_head_kv, head_dim) float32, keys
 * post-RoPE. Runs on the legacy default stream and returns when done (work on other streams that
 * writes k or v, or reads the cache, must be finished first). Errors: KVPQ_ERR_NONFINITE, KVPQ_ERR_CAPACITY, KVPQ_ERR_INVALID_ARG (a norm-explicit
 * scale beyond float16's range, naming the position and KV head, as the CPU cache), KVPQ_ERR_DEVICE;
 * on error the sequence is unchanged. */
KVPQ_API kvpq_status kvpq_cuda_cache_append(kvpq_cuda_cache *c, int seq, int n, const float *k, const float *v);

/* Decode attention of one query per sequence for sequences 0..n_seq-1 (each holding >= 1
 * position; the query is the newest one and attends to all positions held), scale 1/sqrt(head_dim),
 * query head h reading KV head h / (n_head / n_head_kv). Shared key and value codebooks with dsub 4
 * and nbits 8 (the 2-bit preset): keys and values dequantized on the fly into float16 tensor-core
 * products (centroids rounded to float16 after a power-of-two scale, q split into float16 hi + lo;
 * relative error against float64 a few 1e-4 on random data, growing with the context); other
 * codebooks: scores from per-query LUTs (float16 entries), values decoded from the value codebook.
 * The window in float32; splits of the sequence merged by the online-softmax {m, d, o} rule
 * (flash-decoding). docs/CUDA.md has both kernels.
 * q, out: device (n_seq, n_head, head_dim) float32. */
KVPQ_API kvpq_status kvpq_cuda_cache_attend(kvpq_cuda_cache *c, int n_seq, const float *q, float *out);
/* kvpq_cuda_cache_attend enqueued on `stream` (a cudaStream_t; NULL: the legacy default stream)
 * without waiting for it: the kernel launch only, so a decode step can capture the attention of
 * every layer into one CUDA graph (bench/gpu_decode_step.py). The launch is planned from the
 * lengths the sequences hold at the call: a captured graph replays that plan (and the page
 * pool's device address, which a growing default pool changes), so capture again once sequences grow. Errors: those of kvpq_cuda_cache_attend found before or at the launch;
 * faults inside the kernel surface at the caller's next synchronization. */
KVPQ_API kvpq_status kvpq_cuda_cache_attend_async(kvpq_cuda_cache *c, int n_seq, const float *q, float *out,
                                                  void *stream);

/* Positions held by sequence seq (-1 if out of range). */
KVPQ_API int kvpq_cuda_cache_seq_len(const kvpq_cuda_cache *c, int seq);
/* Drop every position of sequence seq (its pages go back to the pool). */
KVPQ_API kvpq_status kvpq_cuda_cache_clear(kvpq_cuda_cache *c, int seq);
/* Positions [pos0, pos0 + n) of sequence seq as the cache holds them, into k and v: device
 * (n, n_head_kv, head_dim) float32 (either may be NULL), keys with the key mean added back, in the
 * original space (no smoothing, no rotation). from_codes 1: every position decoded from its codes
 * (norm-explicit scales applied); 0: positions in the float32 window (the newest `window`) read from
 * it, earlier ones decoded. Enqueued on `stream` (a cudaStream_t; NULL: the legacy default stream)
 * without waiting. KVPQCache's prompt attention reads the codes this way (each query attends to its
 * window exactly and to earlier positions through their codes, as kvpq_cache_append_attend does on
 * the CPU). Errors: KVPQ_ERR_INVALID_ARG (positions outside [0, seq_len), both outputs NULL),
 * KVPQ_ERR_DEVICE (launch). */
KVPQ_API kvpq_status kvpq_cuda_cache_read(const kvpq_cuda_cache *c, int seq, int pos0, int n, int from_codes,
                                          float *k, float *v, void *stream);
/* Device bytes held: code pages in use (with their norm-explicit float16 scales), window, codebooks
 * (with the tensor-core attention's 64 KiB codebook image where it applies), page tables. Not
 * counted: workspaces allocated at creation, i.e. the attention's split partials and, with a
 * norm-explicit codebook, the encode workspace (up to 4 MiB of directions plus their norms). */
KVPQ_API size_t kvpq_cuda_cache_resident_bytes(const kvpq_cuda_cache *c);

#endif /* KVPQ_ADVANCED */

#ifdef __cplusplus
}
#endif
#endif /* KVPQ_H */
