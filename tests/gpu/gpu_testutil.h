/* gpu_testutil.h — the failure macros of the GPU checks (gpu_check.c, cache_backend_check.c):
 * CHECK counts a failed condition in g_fail (each check file defines it) and goes on; KV_OK and
 * CUDA_OK end the process on a kvpq or CUDA runtime error, naming the call. */
#ifndef KVPQ_GPU_TESTUTIL_H
#define KVPQ_GPU_TESTUTIL_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvpq.h"

#define CHECK(cond, ...)                                \
    do {                                                \
        if (!(cond)) {                                  \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
            g_fail++;                                   \
        }                                               \
    } while (0)
#define CUDA_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            printf("FAIL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)
#define KV_OK(call)                                                                                \
    do {                                                                                           \
        kvpq_status s_ = (call);                                                                   \
        if (s_ != KVPQ_OK) {                                                                       \
            printf("FAIL %s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, kvpq_status_string(s_), \
                   kvpq_last_error());                                                             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#endif
