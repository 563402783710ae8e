/* gguf.h — memory-mapped GGUF (v2, v3) reader. Internal; every count, offset and size is
 * bounds-checked at open, so a corrupt or hostile file fails there with KVPQ_ERR_FORMAT naming the
 * problem, and later accessors cannot read out of bounds. Names follow the GGUF spec
 * (ggml/docs/gguf.md). */
#ifndef KVPQ_GGUF_H
#define KVPQ_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq_model.h"

/* Metadata value types, numbered as in the GGUF spec. */
typedef enum {
    GGUF_TYPE_UINT8 = 0, GGUF_TYPE_INT8 = 1, GGUF_TYPE_UINT16 = 2, GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4, GGUF_TYPE_INT32 = 5, GGUF_TYPE_FLOAT32 = 6, GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8, GGUF_TYPE_ARRAY = 9, GGUF_TYPE_UINT64 = 10, GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
} gguf_type;

typedef struct gguf_file gguf_file;

typedef struct {
    const char *name;      /* NUL-terminated copy */
    uint32_t type;         /* ggml_type (ggml_types.h) */
    int n_dims;            /* 1..4 */
    int64_t ne[4];         /* elements per dimension, ne[0] innermost (as ggml); unused dims = 1 */
    const void *data;      /* into the mapping, aligned to general.alignment (relative to the file start) */
    size_t nbytes;         /* checked to lie within the file; 0 for a type unknown to ggml (the
                              tensor opens, ggml_type_supported() is false, the model loader rejects it) */
} gguf_tensor;

/* Open and validate. Errors: KVPQ_ERR_IO (open/mmap), KVPQ_ERR_FORMAT (with what and where). */
kvpq_status gguf_open(gguf_file **out, const char *path);
/* Same over a caller-owned buffer (fuzzing, tests); the buffer must outlive the gguf_file. */
kvpq_status gguf_open_memory(gguf_file **out, const void *data, size_t size);
void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
size_t gguf_alignment(const gguf_file *f);
/* Byte offset of the tensor data section (after the header, padded to the alignment), file size. */
size_t gguf_data_offset(const gguf_file *f);
size_t gguf_file_size(const gguf_file *f);
/* A 64-bit hash of the header: magic, version, every metadata key and value (architecture,
 * hyperparameters, vocabulary, name) and every tensor's name, shape, type and offset. Two files
 * differ in it unless they describe the same model in the same layout (the weights themselves are
 * not read: a fine-tune saved with identical metadata would not be told apart). */
uint64_t gguf_fingerprint(const gguf_file *f);
/* XXH64 (xxHash, Collet; seed 0) of the tensor data: every byte from the data offset to the end of
 * the file. Reads the whole mapping (~0.1 s per GB from the page cache). */
uint64_t gguf_data_fingerprint(const gguf_file *f);
/* "uint8", ..., "float64"; "invalid" for a value outside the enum. */
const char *gguf_type_name(gguf_type t);

/* ---- metadata ---- */
int64_t gguf_n_kv(const gguf_file *f);
const char *gguf_key_at(const gguf_file *f, int64_t i);     /* NUL-terminated copy; NULL out of range */
gguf_type gguf_type_at(const gguf_file *f, int64_t i);       /* (gguf_type)-1 out of range */
int64_t gguf_find_key(const gguf_file *f, const char *key);  /* -1 when absent */

/* Typed getters by key. Integers of any GGUF integer type convert when the value fits; a float32
 * getter accepts FLOAT32/FLOAT64. Errors: KVPQ_ERR_FORMAT "key X: missing" / "has type T". */
kvpq_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
kvpq_status gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
kvpq_status gguf_get_f32(const gguf_file *f, const char *key, float *out);
kvpq_status gguf_get_bool(const gguf_file *f, const char *key, int *out);
/* String: pointer into the mapping (NOT NUL-terminated) and its length. */
kvpq_status gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len);
/* Array: element type and count. */
kvpq_status gguf_get_arr_info(const gguf_file *f, const char *key, gguf_type *elem_type, uint64_t *n);
/* Array of numbers: pointer to the packed little-endian elements in the mapping. */
kvpq_status gguf_get_arr_data(const gguf_file *f, const char *key, const void **data);
/* Array of strings: element i (pointer into the mapping, not NUL-terminated). */
kvpq_status gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s, size_t *len);

/* ---- tensors ---- */
int64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);              /* NULL out of range */
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL when absent */

#endif
