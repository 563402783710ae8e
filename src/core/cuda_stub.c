/* cuda_stub.c — the CUDA section of kvpq.h in builds without CUDA: every call fails with
 * KVPQ_ERR_NO_DEVICE naming why, so programs link and report the reason instead of crashing.
 * The params defaults (kvpq_cuda_kernels_default, kvpq_cuda_pq_params_default,
 * kvpq_cuda_cache_params_default) and the kernel-variant check are defined here for every build
 * (CUDA or not). */
#include <stdio.h>
#include <string.h>

#include "internal.h"

kvpq_cuda_kernels kvpq_cuda_kernels_default(void) {
    kvpq_cuda_kernels k;
    k.attend_tc = 1;
    k.attend_tc_warps = 0;
    k.attend_lut16 = 1;
    k.attend_vrep = 1;
    k.attend_pvec = 1;
    k.encode_search = 5;
    k.attend_pdl = 1;
    k.attend_cluster = 1;
    k.attend_tc_regs = 0;
    k.attend_tc_heads = 0;
    return k;
}

kvpq_status kvpq__cuda_kernels_check(const kvpq_cuda_kernels *k, const char *fn) {
    const struct {
        const char *name;
        int v, lo, hi;
    } f[] = {{"attend_tc", k->attend_tc, 0, 1},       {"attend_lut16", k->attend_lut16, 0, 1},
             {"attend_vrep", k->attend_vrep, 0, 1},   {"attend_pvec", k->attend_pvec, 0, 1},
             {"encode_search", k->encode_search, 0, 5}, {"attend_pdl", k->attend_pdl, 0, 1},
             {"attend_cluster", k->attend_cluster, 0, 1}, {"attend_tc_regs", k->attend_tc_regs, 0, 1},
             {"attend_tc_heads", k->attend_tc_heads, 0, 8}};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].v < f[i].lo || f[i].v > f[i].hi)
            return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: kernels.%s=%d: expected %d..%d", fn, f[i].name, f[i].v, f[i].lo,
                             f[i].hi);
    if (k->attend_tc_warps != 0 && k->attend_tc_warps != 8 && k->attend_tc_warps != 16)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s: kernels.attend_tc_warps=%d: expected 0, 8 or 16", fn,
                         k->attend_tc_warps);
    return KVPQ_OK;
}

kvpq_cuda_pq_params kvpq_cuda_pq_params_default(void) {
    kvpq_cuda_pq_params p;
    memset(&p, 0, sizeof p);
    p.n_head_kv = 8;
    p.rotate = 1;
    p.kernels = kvpq_cuda_kernels_default();
    return p;
}

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
    p.kernels = kvpq_cuda_kernels_default();
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
kvpq_status kvpq_cuda_pq_new_params(kvpq_cuda_pq **out, const kvpq_pq *pq, const kvpq_cuda_pq_params *p) {
    if (out) *out = NULL;
    return KVPQ_NO_CUDA("kvpq_cuda_pq_new_params");
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
kvpq_status kvpq_cuda_cache_attend_async(kvpq_cuda_cache *c, int n_seq, const float *q, float *out, void *stream) {
    return KVPQ_NO_CUDA("kvpq_cuda_cache_attend_async");
}
int kvpq_cuda_cache_seq_len(const kvpq_cuda_cache *c, int seq) { return -1; }
kvpq_status kvpq_cuda_cache_clear(kvpq_cuda_cache *c, int seq) { return KVPQ_NO_CUDA("kvpq_cuda_cache_clear"); }
kvpq_status kvpq_cuda_cache_read(const kvpq_cuda_cache *c, int seq, int pos0, int n, int from_codes, float *k, float *v,
                                 void *stream) {
    return KVPQ_NO_CUDA("kvpq_cuda_cache_read");
}
size_t kvpq_cuda_cache_resident_bytes(const kvpq_cuda_cache *c) { return 0; }

/* internal.h: the host-pointer calls of kvpq_cache's CUDA backend (never reached without CUDA:
 * kvpq_backend_resolve refuses the backend first) */
kvpq_status kvpq__cuda_cache_append_host(kvpq_cuda_cache *c, int n, const float *k, const float *v) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) append");
}
kvpq_status kvpq__cuda_cache_attend_host(kvpq_cuda_cache *c, int n_q, const float *q, float *out, float *lse) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) attend");
}
kvpq_status kvpq__cuda_cache_truncate(kvpq_cuda_cache *c, int n) { return KVPQ_NO_CUDA("kvpq cache (cuda) truncate"); }
kvpq_status kvpq__cuda_cache_read_window(const kvpq_cuda_cache *c, int pos0, int n, float *k, float *v) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) read");
}
kvpq_status kvpq__cuda_cache_read_host(kvpq_cuda_cache *c, int pos0, int n, int from_codes, float *k, float *v) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) read");
}
kvpq_status kvpq__cuda_cache_write_window(kvpq_cuda_cache *c, int pos0, int n, const float *k, const float *v) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) truncate");
}
kvpq_status kvpq__cuda_cache_read_codes(const kvpq_cuda_cache *c, int seq, uint8_t *kc, uint8_t *vc, uint16_t *ks,
                                        uint16_t *vs) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) read");
}
kvpq_status kvpq__cuda_cache_write(kvpq_cuda_cache *c, int len, const uint8_t *kc, const uint8_t *vc,
                                   const uint16_t *ks, const uint16_t *vs, const float *kw, const float *vw) {
    return KVPQ_NO_CUDA("kvpq cache (cuda) load");
}

#else
/* ISO C forbids an empty translation unit. */
typedef int kvpq__cuda_stub_unused;
#endif
