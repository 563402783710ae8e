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

KVPQ__ROWS_KIND(fp16, fp16_codec, kvpq__rows_create);
