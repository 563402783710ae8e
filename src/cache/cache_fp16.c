/* cache_fp16.c — the IEEE half KV cache (round to nearest even on append; F16C in the SIMD
 * kernels, bit-exact with the scalar conversion). */
#include "cache/cache_cpu.h"

static size_t fp16_row_bytes(int head_dim) { return (size_t)head_dim * sizeof(uint16_t); }

static void fp16_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    kr->f32_to_f16(x, rows, (size_t)n * head_dim);
}

static void fp16_decode(const void *rows, int n, int head_dim, float *x, const kvpq_attn_kernels *kr) {
    kr->f16_to_f32(rows, x, (size_t)n * head_dim);
}

static const kvpq__row_codec fp16_codec = {
    .name = "fp16", .row_bytes = fp16_row_bytes, .encode = fp16_encode, .decode = fp16_decode, .head_dim_multiple = 1,
    .max_abs = 65504.0f, .f16_rows = 1,
};

static kvpq_status fp16_create(void **state, const kvpq_cache_params *p) {
    return kvpq__rows_create(state, p, &fp16_codec);
}

const kvpq_cache_ops kvpq_cache_ops_fp16 = {
    .name = "fp16",
    .create = fp16_create,
    .destroy = kvpq__rows_destroy,
    .append = kvpq__rows_append,
    .attend = kvpq__rows_attend,
    .truncate = kvpq__rows_truncate,
    .read = kvpq__rows_read,
    .resident_bytes = kvpq__rows_resident_bytes,
    .drop = kvpq__rows_drop,
    .stats = kvpq__rows_stats,
    .serial = kvpq__rows_serial,
};
