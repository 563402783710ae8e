/* gguf_writer.h — a small in-memory GGUF writer shared by the tests and fuzz targets (format:
 * ggml/docs/gguf.md). Values are written in host byte order: the test hosts are little-endian
 * (x86-64, aarch64), as GGUF is. Nothing is checked: the tests use it to write hostile files too
 * (a string length field that lies, any type code, any n_dims). Allocation failure aborts (a test
 * helper, never linked into the library).
 *
 * A file is built from three buffers: key/value pairs (gw_kv_*, counted in kv.n_kv), tensor infos
 * (gw_tensor_info) and tensor data; gw_file joins them as header, pairs, infos, zero padding to the
 * alignment, data. */
#ifndef KVPQ_TESTS_GGUF_WRITER_H
#define KVPQ_TESTS_GGUF_WRITER_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint8_t *p;    /* (cap) bytes, n of them written */
    size_t n, cap;
    uint64_t n_kv; /* key/value pairs begun by gw_key / gw_kv_* */
} gw_buf;

/* raw values */
void gw_put(gw_buf *b, const void *src, size_t n);
void gw_u8(gw_buf *b, uint8_t v);
void gw_u16(gw_buf *b, uint16_t v);
void gw_u32(gw_buf *b, uint32_t v);
void gw_u64(gw_buf *b, uint64_t v);
void gw_f32(gw_buf *b, float v);
void gw_f64(gw_buf *b, double v);
/* A GGUF string: u64 length, then the bytes. gw_strn writes len_field as the length (it may lie)
 * and strlen(s) bytes. */
void gw_str(gw_buf *b, const char *s);
void gw_strn(gw_buf *b, const char *s, uint64_t len_field);
/* Zero bytes until b->n is a multiple of align. */
void gw_pad(gw_buf *b, size_t align);

/* key/value pairs: gw_key writes the key and the value type and counts the pair; the value follows */
void gw_key(gw_buf *b, const char *key, uint32_t type);
void gw_kv_str(gw_buf *b, const char *key, const char *val);
void gw_kv_u32(gw_buf *b, const char *key, uint32_t val);
void gw_kv_f32(gw_buf *b, const char *key, float val);
void gw_kv_bool(gw_buf *b, const char *key, int val);
/* An array's key, element type and count; the caller writes the n elements. */
void gw_kv_arr(gw_buf *b, const char *key, uint32_t elem_type, uint64_t n);
void gw_kv_str_arr(gw_buf *b, const char *key, const char *const *vals, size_t n);
void gw_kv_i32_arr(gw_buf *b, const char *key, const int32_t *vals, size_t n);
void gw_kv_f32_arr(gw_buf *b, const char *key, const float *vals, size_t n);

/* The fixed header: "GGUF", version, tensor count, key/value count. */
void gw_header(gw_buf *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv);
/* One tensor info: name, n_dims, ne[0 .. n_dims-1], ggml type, offset into the data section. */
void gw_tensor_info(gw_buf *b, const char *name, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                    uint64_t offset);

/* A GGUF v3 file: header (n_tensors, kv->n_kv), kv's bytes, infos' bytes (NULL: none), zeros to a
 * multiple of align, data's bytes (NULL: none). The caller frees the result with gw_free. */
gw_buf gw_file(const gw_buf *kv, uint64_t n_tensors, const gw_buf *infos, const gw_buf *data, size_t align);
/* Write b to a new file made by mkstemp from tmpl ("/tmp/name.XXXXXX"); returns its path (malloc'd,
 * the caller unlinks and frees it), NULL on failure. */
char *gw_write_temp(const gw_buf *b, const char *tmpl);
void gw_free(gw_buf *b);

#endif
