/* cache_fp32.c — the float32 KV cache: the reference every other kind is measured against. Rows
 * are the floats themselves, so attention reads the pages in place (zero copy). */
#include <string.h>

#include "cache/cache_cpu.h"

static size_t fp32_row_bytes(int head_dim) { return (size_t)head_dim * sizeof(float); }

static void fp32_encode(const float *x, int n, int head_dim, void *rows, const kvpq_attn_kernels *kr) {
    (void)kr;
    memcpy(rows, x, (size_t)n * head_dim * sizeof(float));
}

static const kvpq__row_codec fp32_codec = {
    .name = "fp32", .row_bytes = fp32_row_bytes, .encode = fp32_encode, .decode = NULL, .head_dim_multiple = 1,
    .max_abs = 0.0f,
};

KVPQ__ROWS_KIND(fp32, fp32_codec, kvpq__rows_create);
