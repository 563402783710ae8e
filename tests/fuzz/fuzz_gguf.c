/* fuzz_gguf.c — libFuzzer target for the GGUF reader: any input must either be rejected with an
 * error or open into a gguf_file whose every accessor stays in bounds (ASan/UBSan check it).
 * Build: CC=clang cmake -S . -B build-fuzz -DKVPQ_FUZZ=ON -DKVPQ_TESTS=OFF
 *        cmake --build build-fuzz --target fuzz_gguf
 * Run:   ./build-fuzz/fuzz_gguf -max_total_time=300 tests/fuzz/corpus_gguf  (seeds: small valid files) */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/ggml_types.h"
#include "model/gguf.h"

static volatile uint64_t sink;

static void touch(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t s = 0;
    for (size_t i = 0; i < n; i++) s += b[i];
    sink += s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* An exactly-sized copy: reads one byte past the input are caught. */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    memcpy(copy, data, size);
    gguf_file *f;
    if (gguf_open_memory(&f, copy, size) != KVPQ_OK) {
        free(copy);
        return 0;
    }
    sink += gguf_version(f) + gguf_alignment(f) + gguf_data_offset(f) + gguf_file_size(f);
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        const char *key = gguf_key_at(f, i);
        if (gguf_find_key(f, key) != i) abort(); /* keys are unique */
        gguf_type t = gguf_type_at(f, i);
        sink += strlen(gguf_type_name(t));
        uint32_t u;
        int64_t v;
        float x;
        int b;
        const char *s;
        size_t len;
        if (gguf_get_u32(f, key, &u) == KVPQ_OK) sink += u;
        if (gguf_get_i64(f, key, &v) == KVPQ_OK) sink += (uint64_t)v;
        if (gguf_get_f32(f, key, &x) == KVPQ_OK) sink += (uint64_t)(x == x);
        if (gguf_get_bool(f, key, &b) == KVPQ_OK) sink += (uint64_t)b;
        if (gguf_get_str(f, key, &s, &len) == KVPQ_OK) touch(s, len);
        gguf_type et;
        uint64_t n;
        if (gguf_get_arr_info(f, key, &et, &n) == KVPQ_OK) {
            const void *d;
            static const size_t esz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
            if (gguf_get_arr_data(f, key, &d) == KVPQ_OK) touch(d, (size_t)n * esz[et]);
            for (uint64_t j = 0; j < n && j < 100000; j++)
                if (gguf_get_arr_str(f, key, j, &s, &len) == KVPQ_OK) touch(s, len);
            if (gguf_get_arr_str(f, key, n, &s, &len) == KVPQ_OK) abort(); /* one past the end */
        }
    }
    if (gguf_key_at(f, gguf_n_kv(f)) || gguf_tensor_at(f, gguf_n_tensors(f))) abort();
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_find_tensor(f, t->name) != t) abort();
        if (t->n_dims < 1 || t->n_dims > 4) abort();
        touch(t->data, t->nbytes);
        if (!ggml_type_supported(t->type) || t->nbytes > (1u << 20)) continue;
        /* Dequantize and multiply the first rows: the row size must agree with nbytes. */
        int64_t n = t->ne[0], rows = t->ne[1] < 4 ? t->ne[1] : 4;
        if ((size_t)rows * ggml_row_size(t->type, n) > t->nbytes) abort();
        float *buf = malloc((size_t)n * sizeof(float)), *y = malloc((size_t)rows * sizeof(float));
        float *x = calloc((size_t)n, sizeof(float));
        if (buf && x && y) {
            if (ggml_dequantize_row(t->type, t->data, buf, n) != KVPQ_OK) abort();
            ggml_matvec(t->type, t->data, rows, n, x, y);
            sink += (uint64_t)(y[0] == y[0]);
        }
        free(buf);
        free(x);
        free(y);
    }
    gguf_close(f);
    free(copy);
    return 0;
}
