/* internal.h — helpers shared by every module of libkvpq (not installed). */
#ifndef KVPQ_INTERNAL_H
#define KVPQ_INTERNAL_H

#include "kvpq.h"

/* Record a thread-local error message (printf format) and return `s`, so that a failing path is
 * one line: `return kvpq__err(KVPQ_ERR_INVALID_ARG, "dsub %d: expected 1, 2, 4, 8 or 16", dsub);` */
kvpq_status kvpq__err(kvpq_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prefix the current thread-local message with context: "codebook file 'x': <old message>". */
void kvpq__err_prefix(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;

/* 1 if every one of n floats is finite. */
int kvpq__all_finite(const float *x, size_t n);

/* KVPQ_OK if every field of a kvpq_cuda_kernels holds one of its listed values, else
 * KVPQ_ERR_INVALID_ARG naming `fn` and the field (src/core/cuda_stub.c; every build). */
kvpq_status kvpq__cuda_kernels_check(const kvpq_cuda_kernels *k, const char *fn);

#define KVPQ_TRY(expr)                     \
    do {                                   \
        kvpq_status kvpq__s = (expr);      \
        if (kvpq__s != KVPQ_OK) return kvpq__s; \
    } while (0)

#endif
