/* cache_cpu.h — pieces shared by the CPU cache kinds: page lists, the blocked online-softmax
 * attention driver, and the "row" engine behind the per-token kinds (fp32, fp16, q8_0, q4_0).
 * Internal; additive to the cache_impl.h contract. */
#ifndef KVPQ_CACHE_CPU_H
#define KVPQ_CACHE_CPU_H

#include <stddef.h>
#include <stdint.h>

#include "cache/cache_impl.h"
#include "cpu/attn_kernels.h"

/* ---- pages ---------------------------------------------------------------------------------- */

/* A growable list of equal-size pages, allocated as the sequence grows (64-byte aligned, zeroed,
 * from `pool`: kvpq__pool_get). Page numbers are absolute: pages [base, n) exist; those before base
 * were dropped from the front (sliding-window layers), so a page keeps its number for the life of
 * the list. */
typedef struct {
    unsigned char **page; /* (cap) page[i] is page number base + i */
    int n;                /* page numbers below n were allocated */
    int cap;
    int base;             /* pages dropped from the front */
    size_t page_bytes;
    kvpq_page_pool *pool; /* the cache's params.pool, or NULL */
} kvpq__pages;

/* Page number i (base <= i < n). */
static inline unsigned char *kvpq__page(const kvpq__pages *pl, int i) { return pl->page[i - pl->base]; }
/* Make pages up to number n exist. On failure the list keeps the pages it had (KVPQ_ERR_NOMEM,
 * KVPQ_ERR_BUDGET). */
kvpq_status kvpq__pages_reserve(kvpq__pages *pl, int n);
/* Free the pages numbered n and beyond (and the page table when none is left; n <= base empties
 * the list and numbers it from n again). */
void kvpq__pages_shrink(kvpq__pages *pl, int n);
/* Free the pages numbered below k (sliding-window layers). */
void kvpq__pages_drop_front(kvpq__pages *pl, int k);
void kvpq__pages_free(kvpq__pages *pl);
/* Bytes held: pages plus the page table. */
size_t kvpq__pages_bytes(const kvpq__pages *pl);

/* ---- attention driver ----------------------------------------------------------------------- */

/* Give K and V of KV head `kvh`, positions [t0, t0+n) of `layer`, as float32 rows (n, head_dim):
 * either pointers into the kind's storage (zero copy) or kbuf/vbuf, which hold n*head_dim floats,
 * filled by dequantizing. The driver never asks for a range crossing a multiple of `align`. */
typedef void (*kvpq__load_fn)(const void *state, int layer, int kvh, int t0, int n, float *kbuf, float *vbuf,
                              const float **k, const float **v);

/* For kinds whose rows are IEEE halves: pointers to K and V (n, head_dim) fp16 in place. */
typedef void (*kvpq__load16_fn)(const void *state, int layer, int kvh, int t0, int n, const uint16_t **k,
                                const uint16_t **v);

/* Tokens per chunk of the driver (a load never asks for more). */
#define KVPQ_ATTN_CHUNK 64

/* Causal GQA attention of kvpq_cache_attend over any kind that can `load`; in a sliding-window
 * layer (kvpq__layer_window) the query at position t sees only [t - window + 1, t]. Queries of a KV head's
 * group are processed together, so each chunk of K/V is loaded once for all of them: per chunk,
 * scores S = Q K^T / sqrt(head_dim), the online-softmax update {m, d, o}, then o += P V
 * (FlashAttention-2, Dao 2023, alg. 1). Work is split over (KV head, block of query rows, token
 * range) and spread with OpenMP; token ranges of one row are combined with kvpq_softmax_merge
 * (split-KV decoding, "Flash-Decoding"). */
kvpq_status kvpq__attend_cpu(const kvpq_cache_params *p, const void *state, kvpq__load_fn load, int align,
                             int layer, int len, int n_q, const float *q, float *out, float *lse);
/* The same with two sources, for a windowed kind attending the queries of several window states at
 * once (cache_impl.h attend_staged): query i (position len - n_q + i) reads positions < bound[i]
 * through load and positions >= bound[i] through exact; bound (n_q) must not decrease with i. A
 * chunk that some rows read from both is scored and weighed twice, each part from its own rows. */
kvpq_status kvpq__attend_cpu_split(const kvpq_cache_params *p, const void *state, kvpq__load_fn load,
                                   kvpq__load_fn exact, const int *bound, int layer, int len, int n_q, const float *q,
                                   float *out, float *lse);
/* The same for fp16 rows: blocks of at most KVPQ_ATTN_F16_ROWS query rows use the fused fp16
 * kernels (qk_f16, pv_f16: conversion in registers, no fp32 copy); larger blocks (prefill)
 * convert each chunk once into fp32 and use the fp32 kernels. */
#define KVPQ_ATTN_F16_ROWS 4
kvpq_status kvpq__attend_cpu_f16(const kvpq_cache_params *p, const void *state, kvpq__load16_fn load16, int align,
                                 int layer, int len, int n_q, const float *q, float *out, float *lse);

/* kvpq_cache_read through `load`: k, v (n, n_head_kv, head_dim), either may be NULL. */
kvpq_status kvpq__read_cpu(const kvpq_cache_params *p, const void *state, kvpq__load_fn load, int align,
                           int layer, int pos0, int n, float *k, float *v);

/* ---- row engine: kinds that store each head vector on its own ------------------------------- */

typedef struct {
    const char *name;
    size_t (*row_bytes)(int head_dim);
    /* Encode n head vectors x (n, head_dim) into n rows of row_bytes each, consecutive. */
    void (*encode)(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr);
    /* Decode n consecutive rows into x (n, head_dim). NULL for fp32 (rows are the floats). */
    void (*decode)(const void *rows, int n, int head_dim, float *x, const kvpq_attn_kernels *kr);
    /* Multiple head_dim must be of (1 for any). */
    int head_dim_multiple;
    /* Largest |x| the format can hold (its fp16 parts overflow beyond); 0 for no limit. */
    float max_abs;
    /* Rows are IEEE halves (head_dim each): attention uses kvpq__attend_cpu_f16. */
    int f16_rows;
} kvpq__row_codec;

/* KVPQ_OK if every |x| <= max_abs in x (n, n_head_kv, head_dim); else KVPQ_ERR_INVALID_ARG naming
 * the kind, tensor, position, head and dim. */
kvpq_status kvpq__check_range(const kvpq_cache_params *p, const char *kind, const char *what, int layer, int pos0,
                              int n, const float *x, float max_abs);

/* Page layout: (n_head_kv, page_tokens, row_bytes) so a KV head's rows in a page are contiguous. */
kvpq_status kvpq__rows_create(void **state, const kvpq_cache_params *p, const kvpq__row_codec *codec);
/* The same with llama.cpp's rotation of K/V head vectors (the q4_0r / q8_0r kinds): K (and the
 * queries) by the normalized Walsh-Hadamard matrix of the largest power-of-two block dividing
 * head_dim, V by blocks of 64, before quantizing; the attention output is rotated back and
 * kvpq_cache_read returns the stored vectors rotated back. head_dim % 64 != 0: KVPQ_ERR_UNSUPPORTED. */
kvpq_status kvpq__rows_create_rotated(void **state, const kvpq_cache_params *p, const kvpq__row_codec *codec);
void kvpq__rows_destroy(void *state);
kvpq_status kvpq__rows_append(void *state, int layer, int len, int n, const float *k, const float *v);
kvpq_status kvpq__rows_attend(void *state, int layer, int len, int n_q, const float *q, float *out, float *lse);
kvpq_status kvpq__rows_truncate(void *state, const int *lens, int n_pos);
kvpq_status kvpq__rows_read(const void *state, int layer, int len, int pos0, int n, float *k, float *v);
size_t kvpq__rows_resident_bytes(const void *state, const int *lens);
void kvpq__rows_stats(const void *state, const int *lens, kvpq_cache_stats *st);
int kvpq__rows_drop(void *state, int layer, int len, int keep_from);
kvpq_status kvpq__rows_serial(void *state, const int *lens, const int *lo, kvpq__stream *s, int load);
kvpq_status kvpq__rows_reserve(void *state, const int *lens, int n_pos);

/* A row kind: its create (CREATE, kvpq__rows_create or kvpq__rows_create_rotated, over CODEC) and
 * its ops table kvpq_cache_ops_<KIND>, the row engine above for everything else. A rotated kind's
 * stats are the plain kind's blocks: rotation adds no stored bytes. */
#define KVPQ__ROWS_KIND(KIND, CODEC, CREATE)                                                            \
    static kvpq_status KIND##_create(void **state, const kvpq_cache_params *p) {                        \
        return CREATE(state, p, &CODEC);                                                                \
    }                                                                                                   \
    const kvpq_cache_ops kvpq_cache_ops_##KIND = {                                                      \
        .name = #KIND,                                                                                  \
        .create = KIND##_create,                                                                        \
        .destroy = kvpq__rows_destroy,                                                                  \
        .append = kvpq__rows_append,                                                                    \
        .attend = kvpq__rows_attend,                                                                    \
        .truncate = kvpq__rows_truncate,                                                                \
        .read = kvpq__rows_read,                                                                        \
        .resident_bytes = kvpq__rows_resident_bytes,                                                    \
        .drop = kvpq__rows_drop,                                                                        \
        .stats = kvpq__rows_stats,                                                                      \
        .serial = kvpq__rows_serial,                                                                    \
        .reserve = kvpq__rows_reserve,                                                                  \
    }

/* The two row kinds of a ggml block type (q8_0, q4_0: block_<KIND> of QK elements with an fp16 d,
 * x ~= d * q, |q| <= QMAX): <KIND> and <KIND>r, the same blocks over rotated head vectors (as
 * llama.cpp stores a quantized KV cache by default since April 2026, ggml-org/llama.cpp PR 21038:
 * kvpq__rows_create_rotated). The file defines KIND##_encode; rows decode through the kernel
 * table's dequant_<KIND>; the fp16 d overflows beyond |x| = 65504 * QMAX. */
#define KVPQ__GGML_ROWS_KINDS(KIND, QK, QMAX)                                                                 \
    static size_t KIND##_row_bytes(int head_dim) { return (size_t)head_dim / QK * sizeof(block_##KIND); }     \
    static void KIND##_decode(const void *rows, int n, int head_dim, float *x, const kvpq_attn_kernels *kr) { \
        kr->dequant_##KIND(rows, (size_t)n * head_dim / QK, x);                                               \
    }                                                                                                         \
    static const kvpq__row_codec KIND##_codec = {                                                             \
        .name = #KIND, .row_bytes = KIND##_row_bytes, .encode = KIND##_encode, .decode = KIND##_decode,       \
        .head_dim_multiple = QK, .max_abs = 65504.0f * (QMAX),                                                \
    };                                                                                                        \
    static const kvpq__row_codec KIND##r_codec = {                                                            \
        .name = #KIND "r", .row_bytes = KIND##_row_bytes, .encode = KIND##_encode, .decode = KIND##_decode,   \
        .head_dim_multiple = QK, .max_abs = 65504.0f * (QMAX),                                                \
    };                                                                                                        \
    KVPQ__ROWS_KIND(KIND, KIND##_codec, kvpq__rows_create);                                                   \
    KVPQ__ROWS_KIND(KIND##r, KIND##r_codec, kvpq__rows_create_rotated)

#endif
