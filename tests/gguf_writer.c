/* gguf_writer.c — see gguf_writer.h. */
#include "gguf_writer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { GW_UINT32 = 4, GW_INT32 = 5, GW_FLOAT32 = 6, GW_BOOL = 7, GW_STRING = 8, GW_ARRAY = 9 }; /* gguf.md */

void gw_put(gw_buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 1024;
        b->p = realloc(b->p, b->cap);
        if (!b->p) {
            fprintf(stderr, "gguf_writer: out of memory (%zu bytes)\n", b->cap);
            abort();
        }
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}
void gw_u8(gw_buf *b, uint8_t v) { gw_put(b, &v, 1); }
void gw_u16(gw_buf *b, uint16_t v) { gw_put(b, &v, 2); }
void gw_u32(gw_buf *b, uint32_t v) { gw_put(b, &v, 4); }
void gw_u64(gw_buf *b, uint64_t v) { gw_put(b, &v, 8); }
void gw_f32(gw_buf *b, float v) { gw_put(b, &v, 4); }
void gw_f64(gw_buf *b, double v) { gw_put(b, &v, 8); }
void gw_strn(gw_buf *b, const char *s, uint64_t len_field) {
    gw_u64(b, len_field);
    gw_put(b, s, strlen(s));
}
void gw_str(gw_buf *b, const char *s) { gw_strn(b, s, strlen(s)); }
void gw_pad(gw_buf *b, size_t align) {
    static const uint8_t zero[64];
    while (b->n % align) gw_put(b, zero, (align - b->n % align) < sizeof zero ? align - b->n % align : sizeof zero);
}

void gw_key(gw_buf *b, const char *key, uint32_t type) {
    gw_str(b, key);
    gw_u32(b, type);
    b->n_kv++;
}
void gw_kv_str(gw_buf *b, const char *key, const char *val) {
    gw_key(b, key, GW_STRING);
    gw_str(b, val);
}
void gw_kv_u32(gw_buf *b, const char *key, uint32_t val) {
    gw_key(b, key, GW_UINT32);
    gw_u32(b, val);
}
void gw_kv_f32(gw_buf *b, const char *key, float val) {
    gw_key(b, key, GW_FLOAT32);
    gw_f32(b, val);
}
void gw_kv_bool(gw_buf *b, const char *key, int val) {
    gw_key(b, key, GW_BOOL);
    gw_u8(b, (uint8_t)(val != 0));
}
void gw_kv_arr(gw_buf *b, const char *key, uint32_t elem_type, uint64_t n) {
    gw_key(b, key, GW_ARRAY);
    gw_u32(b, elem_type);
    gw_u64(b, n);
}
void gw_kv_str_arr(gw_buf *b, const char *key, const char *const *vals, size_t n) {
    gw_kv_arr(b, key, GW_STRING, n);
    for (size_t i = 0; i < n; i++) gw_str(b, vals[i]);
}
void gw_kv_i32_arr(gw_buf *b, const char *key, const int32_t *vals, size_t n) {
    gw_kv_arr(b, key, GW_INT32, n);
    gw_put(b, vals, 4 * n);
}
void gw_kv_f32_arr(gw_buf *b, const char *key, const float *vals, size_t n) {
    gw_kv_arr(b, key, GW_FLOAT32, n);
    gw_put(b, vals, 4 * n);
}

void gw_header(gw_buf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    gw_put(b, "GGUF", 4);
    gw_u32(b, version);
    gw_u64(b, n_tensors);
    gw_u64(b, n_kv);
}
void gw_tensor_info(gw_buf *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                    uint64_t offset) {
    gw_str(b, name);
    gw_u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++) gw_u64(b, ne[d]);
    gw_u32(b, type);
    gw_u64(b, offset);
}

gw_buf gw_file(const gw_buf *kv, uint64_t n_tensors, const gw_buf *infos, const gw_buf *data, size_t align) {
    gw_buf f = {0};
    gw_header(&f, 3, n_tensors, kv->n_kv);
    gw_put(&f, kv->p, kv->n);
    if (infos) gw_put(&f, infos->p, infos->n);
    gw_pad(&f, align);
    if (data) gw_put(&f, data->p, data->n);
    return f;
}

char *gw_write_temp(const gw_buf *b, const char *tmpl) {
    char *path = strdup(tmpl);
    if (!path) return NULL;
    int fd = mkstemp(path);
    if (fd < 0) {
        free(path);
        return NULL;
    }
    size_t done = 0;
    while (done < b->n) {
        ssize_t w = write(fd, b->p + done, b->n - done);
        if (w <= 0) {
            close(fd);
            unlink(path);
            free(path);
            return NULL;
        }
        done += (size_t)w;
    }
    close(fd);
    return path;
}

void gw_free(gw_buf *b) {
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    b->n_kv = 0;
}
