/* internal.h — helpers shared by every module of libkvpq (not installed). */
#ifndef KVPQ_INTERNAL_H
#define KVPQ_INTERNAL_H

#include "kvpq.h"

/* The few internal functions that libkvpq_model (the second library tier, src/model) calls in
 * libkvpq: exported from libkvpq.so under their kvpq__ names although no public header declares
 * them (everything else internal stays hidden by -fvisibility=hidden). */
#if defined(__GNUC__)
#define KVPQ_INTERNAL_API __attribute__((visibility("default")))
#else
#define KVPQ_INTERNAL_API
#endif

/* Record a thread-local error message (printf format) and return `s`, so that a failing path is
 * one line: `return kvpq__err(KVPQ_ERR_INVALID_ARG, "dsub %d: expected 1, 2, 4, 8 or 16", dsub);` */
KVPQ_INTERNAL_API kvpq_status kvpq__err(kvpq_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prefix the current thread-local message with context: "codebook file 'x': <old message>". */
KVPQ_INTERNAL_API void kvpq__err_prefix(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* 1 if every one of n floats is finite. */
KVPQ_INTERNAL_API int kvpq__all_finite(const float *x, size_t n);
/* max_i |x[i]| (0 for n == 0; NaN elements are skipped). */
KVPQ_INTERNAL_API float kvpq__max_abs(const float *x, size_t n);

/* ---- atomic saves (tempfile.c) ---- */
/* The file a save to `path` must replace: path itself, or, when it is a symbolic link, the file the
 * chain of links names (which may not exist yet). malloc'd; NULL when out of memory. */
char *kvpq__resolve_target(const char *path);
/* mkstemp(tmpl) (tmpl ends in XXXXXX), the file listed for kvpq_remove_temp_files until
 * kvpq__temp_done. Returns the descriptor, or -1 with errno set. */
int kvpq__temp_create(char *tmpl);
/* The temporary file name (malloc'd; NULL when out of memory) of an atomic save of target:
 * TARGET.kvpq.tmp.PID.XXXXXX, a template for kvpq__temp_create. Temporary files of the same target
 * left by a process no longer running (killed mid-save) are removed first. */
char *kvpq__temp_name(const char *target);
/* Unlist a temp file; remove it too unless keep (it has been renamed into place). */
void kvpq__temp_done(const char *tmpl, int keep);

/* KVPQ_OK if every field of a kvpq_cuda_kernels holds one of its listed values, else
 * KVPQ_ERR_INVALID_ARG naming `fn` and the field (src/core/cuda_stub.c; every build). */
kvpq_status kvpq__cuda_kernels_check(const kvpq_cuda_kernels *k, const char *fn);

/* ---- host-pointer calls on sequence 0 of a kvpq_cuda_cache (src/cuda/cache_cuda.cu; without CUDA
 * src/core/cuda_stub.c fails them with KVPQ_ERR_NO_DEVICE): the VQ kind of kvpq_cache on the GPU,
 * src/cache/cache_vq_cuda.c. Host arrays in and out; each call synchronous. */
/* Append n positions, k and v host (n, n_head_kv, head_dim), staged through device memory. */
kvpq_status kvpq__cuda_cache_append_host(kvpq_cuda_cache *c, int n, const float *k, const float *v);
/* Causal attention of the newest n_q positions, query i seeing [0, L - n_q + i] (L held), one
 * launch each; q, out host (n_q, n_head, head_dim); lse host (n_q, n_head) or NULL gets each row's
 * log-sum-exp of its scaled scores without the q . mu of key centering. KVPQ_ERR_UNSUPPORTED for
 * n_q > 1 when L exceeds the window (the earlier queries' window positions left the ring). */
kvpq_status kvpq__cuda_cache_attend_host(kvpq_cuda_cache *c, int n_q, const float *q, float *out, float *lse);
/* Keep positions [0, n) (pages past them go back to the pool; the ring is left as it is). */
kvpq_status kvpq__cuda_cache_truncate(kvpq_cuda_cache *c, int n);
/* Positions [pos0, pos0 + n) of sequence 0 as kvpq_cuda_cache_read gives them (keys with the key mean;
 * from_codes 1: every one decoded from its codes), into host k, v (n, n_head_kv, head_dim), either
 * may be NULL. */
kvpq_status kvpq__cuda_cache_read_host(kvpq_cuda_cache *c, int pos0, int n, int from_codes, float *k, float *v);
/* Ring rows of positions [pos0, pos0 + n), all among the newest `window`: k (minus the key mean) and
 * v host (n, n_head_kv, head_dim), either may be NULL. */
kvpq_status kvpq__cuda_cache_read_window(const kvpq_cuda_cache *c, int pos0, int n, float *k, float *v);
/* Overwrite the ring rows of positions [pos0, pos0 + n), all among the newest `window`, from host
 * k (minus the key mean) and v (n, n_head_kv, head_dim). */
kvpq_status kvpq__cuda_cache_write_window(kvpq_cuda_cache *c, int pos0, int n, const float *k, const float *v);
/* Codes (and float16 scales of norm-explicit quantizers) of positions [0, len) of sequence seq, host
 * kc (len, n_head_kv, k_code_size), vc, ks / vs (len, n_head_kv); each may be NULL. */
kvpq_status kvpq__cuda_cache_read_codes(const kvpq_cuda_cache *c, int seq, uint8_t *kc, uint8_t *vc, uint16_t *ks,
                                        uint16_t *vs);
/* Fill an empty sequence 0 with len positions: codes and scales as read_codes gives them, the ring
 * rows kw (minus the key mean) and vw of positions [len - min(len, window), len). */
kvpq_status kvpq__cuda_cache_write(kvpq_cuda_cache *c, int len, const uint8_t *kc, const uint8_t *vc,
                                   const uint16_t *ks, const uint16_t *vs, const float *kw, const float *vw);

/* Largest n_threads the library takes (kmeans, cache, model params; the CLI's --threads has the same
 * bound). Above it OpenMP may fail to build the thread team, and libgomp then ends the process
 * ("Out of memory allocating ...") instead of returning. */
#define KVPQ_MAX_THREADS 1024

#define KVPQ_TRY(expr)                     \
    do {                                   \
        kvpq_status kvpq__s = (expr);      \
        if (kvpq__s != KVPQ_OK) return kvpq__s; \
    } while (0)

#endif
