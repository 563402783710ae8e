/* bench_util.h — what the C benchmarks share: a monotonic clock, the median of repeated timings,
 * and random GGML weight blocks with sane fp16 scales (so that dequantized values stay finite). */
#ifndef KVPQ_BENCH_UTIL_H
#define KVPQ_BENCH_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/ggml_types.h"

/* Seconds on the monotonic clock; with KVPQ_BENCH_CPU=1, CPU time of the process (all threads)
 * instead, for a loaded machine where a preempted run's wall time says nothing about the kernel. */
static inline double now(void) {
    static int cpu = -1;
    if (cpu < 0) cpu = getenv("KVPQ_BENCH_CPU") && atoi(getenv("KVPQ_BENCH_CPU")) > 0;
    struct timespec ts;
    clock_gettime(cpu ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* qsort comparator of doubles, ascending. */
static inline int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define MAXREP 200

/* Median seconds of `reps` (1..MAXREP) runs of the statement. */
#define TIME(reps, stmt)                                       \
    ({                                                         \
        double t_[MAXREP];                                     \
        for (int r_ = 0; r_ < (reps); r_++) {                  \
            double t0_ = now();                                \
            stmt;                                              \
            t_[r_] = now() - t0_;                              \
        }                                                      \
        qsort(t_, (size_t)(reps), sizeof(double), cmp_double); \
        t_[(reps) / 2];                                        \
    })

/* xorshift64 bytes: the same sequence in every run. */
static inline uint8_t rnd8(void) {
    static uint64_t s = 88172645463325252ull;
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return (uint8_t)s;
}

/* Byte offsets of a block's fp16 scales (d, and dmin or m where the type has one; -1 if none). */
static inline void scale_offsets(uint32_t type, int *d, int *m) {
    *d = 0;
    *m = -1;
    switch (type) {
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_1: *m = 2; break;
    case GGML_TYPE_Q2_K: *d = 80, *m = 82; break;
    case GGML_TYPE_Q3_K: *d = 108; break;
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: *m = 2; break;
    case GGML_TYPE_Q6_K: *d = 208; break;
    }
}

/* rows x n weights of a GGML type: random bytes, then every block's scales set to 0.01 (0.001 for
 * 256-element K-quant blocks) and its offset/dmin, where it has one, to -0.05. malloc'd. */
static inline uint8_t *random_weights(uint32_t type, int64_t rows, int64_t n) {
    size_t rb = ggml_row_size(type, n), bs = ggml_type_size(type), total = rb * (size_t)rows;
    uint8_t *w = malloc(total);
    if (!w) return NULL;
    for (size_t i = 0; i < total; i++) w[i] = rnd8();
    int od, om;
    scale_offsets(type, &od, &om);
    uint16_t d = kvpq_fp32_to_fp16(ggml_blck_size(type) == 256 ? 0.001f : 0.01f), m = kvpq_fp32_to_fp16(-0.05f);
    for (size_t b = 0; b < total / bs; b++) {
        memcpy(w + b * bs + od, &d, 2);
        if (om >= 0) memcpy(w + b * bs + om, &m, 2);
    }
    return w;
}

#endif
