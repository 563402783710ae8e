/* cuda_stub.c — the CUDA section of kvpq.h in builds without CUDA: every call fails with
 * KVPQ_ERR_NO_DEVICE naming why, so programs link and report the reason instead of crashing.
 * kvpq_cuda_cache_params_default is defined here for every build (CUDA or not). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The defaults are the same with and without CUDA (key_mean, key_smooth, codebooks NULL). */
kvpq_cuda_cache_params kvpq_cuda_cache_params_default(void) {
    kvpq_cuda_cache_params p;
    memset(&p, 0, sizeof p);
    p.n_head = 32;
    p.n_head_kv = 8;
    p.head_dim = 128;
    p.n_seq = 1;
    p.max_seq = 4096;
    p.window = 128;
    p.page_tokens = 256;
    return p;
}

#ifndef KVPQ_HAVE_CUDA

#define KVPQ_NO_CUDA(fn) kvpq__err(KVPQ_ERR_NO_DEVICE, "%s: this library was built without CUDA", fn)

int kvpq_cuda_available(char *why, size_t n) {
    if (why && n) snprintf(why, n, "built without CUDA");
    return 0;
}

kvpq_status kvpq_cuda_pq_new(kvpq_cuda_pq **out, const kvpq_pq *pq, int n_head_kv, const float *lambda, int rotate) {
    if (out) *out = NULL;
    return KVPQ_NO_CUDA("kvpq_cuda_pq_new");
}
void kvpq_cuda_pq_free(kvpq_cuda_pq *q) { (void)q; }
kvpq_status kvpq_cuda_pq_encode(const kvpq_cuda_pq *q, size_t n_tokens, const float *x, uint8_t *codes) {
    return KVPQ_NO_CUDA("kvpq_cuda_pq_encode");
}
kvpq_status kvpq_cuda_pq_decode(const kvpq_cuda_pq *q, size_t n_tokens, const uint8_t *codes, float *x) {
    return KVPQ_NO_CUDA("kvpq_cuda_pq_decode");
}
kvpq_status kvpq_cuda_cache_new(kvpq_cuda_cache **out, const kvpq_cuda_cache_params *p) {
    if (out) *out = NULL;
    return KVPQ_NO_CUDA("kvpq_cuda_cache_new");
}
void kvpq_cuda_cache_free(kvpq_cuda_cache *c) { (void)c; }
kvpq_status kvpq_cuda_cache_append(kvpq_cuda_cache *c, int seq, int n, const float *k, const float *v) {
    return KVPQ_NO_CUDA("kvpq_cuda_cache_append");
}
kvpq_status kvpq_cuda_cache_attend(kvpq_cuda_cache *c, int n_seq, const float *q, float *out) {
    return KVPQ_NO_CUDA("kvpq_cuda_cache_attend");
}
int kvpq_cuda_cache_seq_len(const kvpq_cuda_cache *c, int seq) { return -1; }
kvpq_status kvpq_cuda_cache_clear(kvpq_cuda_cache *c, int seq) { return KVPQ_NO_CUDA("kvpq_cuda_cache_clear"); }
size_t kvpq_cuda_cache_resident_bytes(const kvpq_cuda_cache *c) { return 0; }

#else
/* ISO C forbids an empty translation unit. */
typedef int kvpq__cuda_stub_unused;
#endif
