/* gguf.c — memory-mapped GGUF (v2, v3) reader: the whole file is validated at open, so accessors
 * need no checks beyond their index. Format: ggml/docs/gguf.md (little-endian; header, metadata
 * key/values, tensor infos, padding to general.alignment, tensor data). */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* header-only use of xxHash (Debian libxxhash-dev), as src/cache/cache_file.c */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <xxhash.h>
#pragma GCC diagnostic pop

#include "internal.h"
#include "model/ggml_types.h"
#include "model/gguf.h"

#define GGUF_DEFAULT_ALIGNMENT 32
/* Nesting limit for arrays of arrays: the spec allows nesting, real files use none; a limit keeps a
 * hostile file from recursing deeply. */
#define GGUF_MAX_ARRAY_DEPTH 8
/* Smallest encodings, used to bound counts by the bytes left (no allocation larger than the file):
 * a key/value is a key length (8) + type (4) + a 1-byte value; a tensor info is a name length (8) +
 * n_dims (4) + one dim (8) + type (4) + offset (8). */
#define GGUF_MIN_KV_BYTES 13
#define GGUF_MIN_TENSOR_INFO_BYTES 32
/* An array element that is itself an array: element type (4) + count (8). */
#define GGUF_MIN_NESTED_ARRAY_BYTES 12

typedef struct {
    char *key;            /* NUL-terminated copy */
    gguf_type type;
    size_t off;           /* scalar/string: offset of the value; array: of the first element */
    gguf_type elem_type;  /* arrays */
    uint64_t n;           /* string: byte length; array: element count */
    size_t *str_off;      /* array of strings: (n) offsets of each element's length field */
} gguf_kv;

struct gguf_file {
    const uint8_t *base;
    size_t size;
    void *map;            /* mmap'ed region (gguf_open) or NULL (gguf_open_memory) */
    uint32_t version;
    size_t alignment;
    size_t data_off;      /* start of the tensor data section */
    size_t header_end;    /* end of the tensor infos (the data section follows after padding) */
    int64_t n_kv;
    gguf_kv *kv;          /* (n_kv) */
    int64_t n_tensors;
    gguf_tensor *tensors; /* (n_tensors) */
    int64_t *kv_index;    /* open-addressing hash: (kv_cap) index into kv, -1 empty */
    size_t kv_cap;
    int64_t *t_index;     /* likewise for tensor names: (t_cap) */
    size_t t_cap;
};

/* ---- value types ---- */

static const char *const type_names[] = {"uint8", "int8",  "uint16", "int16",  "uint32", "int32", "float32",
                                         "bool",  "string", "array", "uint64", "int64",  "float64"};
static const size_t type_sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8}; /* 0: variable size */

static int type_valid(uint32_t t) { return t <= GGUF_TYPE_FLOAT64; }

const char *gguf_type_name(gguf_type t) { return type_valid((uint32_t)t) ? type_names[t] : "invalid"; }

/* ---- little-endian reads (the mapping may be unaligned) ---- */

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t le32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t le64(const uint8_t *p) { return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32); }

typedef struct {
    const uint8_t *p;
    size_t size;
    size_t pos;
} reader;

static size_t rd_left(const reader *r) { return r->size - r->pos; }

/* Every read states what it reads, so a truncated file names the field. */
static kvpq_status rd_need(const reader *r, size_t n, const char *what) {
    if (n > rd_left(r))
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: needs %zu bytes at offset %zu, file size %zu (truncated?)", what, n,
                         r->pos, r->size);
    return KVPQ_OK;
}

static kvpq_status rd_u32(reader *r, uint32_t *v, const char *what) {
    KVPQ_TRY(rd_need(r, 4, what));
    *v = le32(r->p + r->pos);
    r->pos += 4;
    return KVPQ_OK;
}

static kvpq_status rd_u64(reader *r, uint64_t *v, const char *what) {
    KVPQ_TRY(rd_need(r, 8, what));
    *v = le64(r->p + r->pos);
    r->pos += 8;
    return KVPQ_OK;
}

/* A gguf_string_t: u64 length then bytes. */
static kvpq_status rd_str(reader *r, size_t *off, uint64_t *len, const char *what) {
    uint64_t n;
    KVPQ_TRY(rd_u64(r, &n, what));
    if (n > rd_left(r))
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: string length %llu at offset %zu exceeds the %zu bytes left (truncated or corrupt)", what,
                         (unsigned long long)n, r->pos - 8, rd_left(r));
    *off = r->pos;
    *len = n;
    r->pos += (size_t)n;
    return KVPQ_OK;
}

/* NUL-terminated copy of a key or tensor name; an embedded NUL would make lookups ambiguous. */
static kvpq_status copy_name(const reader *r, size_t off, uint64_t len, char **out, const char *what) {
    if (len == 0) return kvpq__err(KVPQ_ERR_FORMAT, "%s: empty name at offset %zu", what, off);
    if (memchr(r->p + off, 0, (size_t)len))
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: name at offset %zu contains a NUL byte", what, off);
    char *s = malloc((size_t)len + 1);
    if (!s) return kvpq__err(KVPQ_ERR_NOMEM, "%s: name of %llu bytes", what, (unsigned long long)len);
    memcpy(s, r->p + off, (size_t)len);
    s[len] = 0;
    *out = s;
    return KVPQ_OK;
}

/* ---- name index (FNV-1a, open addressing) ---- */

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) h = (h ^ (uint8_t)*s) * 1099511628211ull;
    return h;
}

static size_t index_cap(int64_t n) {
    size_t cap = 16;
    while (cap < (size_t)n * 2) cap *= 2;
    return cap;
}

/* Insert name #i; returns the index of an existing equal name, or -1 when inserted. */
static int64_t index_insert(int64_t *tab, size_t cap, const char *name, int64_t i, const char *(*name_of)(const gguf_file *, int64_t),
                            const gguf_file *f) {
    for (size_t h = hash_str(name) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        if (tab[h] < 0) {
            tab[h] = i;
            return -1;
        }
        if (!strcmp(name_of(f, tab[h]), name)) return tab[h];
    }
}

static int64_t index_find(const int64_t *tab, size_t cap, const char *name,
                          const char *(*name_of)(const gguf_file *, int64_t), const gguf_file *f) {
    if (!tab) return -1;
    for (size_t h = hash_str(name) & (cap - 1);; h = (h + 1) & (cap - 1)) {
        if (tab[h] < 0) return -1;
        if (!strcmp(name_of(f, tab[h]), name)) return tab[h];
    }
}

static const char *kv_name(const gguf_file *f, int64_t i) { return f->kv[i].key; }
static const char *tensor_name(const gguf_file *f, int64_t i) { return f->tensors[i].name; }

/* ---- metadata values ---- */

static kvpq_status check_bools(const reader *r, size_t off, uint64_t n, const char *what) {
    for (uint64_t i = 0; i < n; i++)
        if (r->p[off + i] > 1)
            return kvpq__err(KVPQ_ERR_FORMAT, "%s: bool value %u at offset %zu (expected 0 or 1)", what,
                             r->p[off + i], (size_t)(off + i));
    return KVPQ_OK;
}

/* Skip over one array body (after its element type and count), validating it. For a top-level
 * array of strings, str_off (n) receives the offset of each element. */
static kvpq_status skip_array(reader *r, uint32_t et, uint64_t n, int depth, size_t *str_off, const char *what) {
    if (!type_valid(et))
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: unknown array element type %u at offset %zu", what, et, r->pos - 12);
    if (et == GGUF_TYPE_STRING) {
        if (n > rd_left(r) / 8)
            return kvpq__err(KVPQ_ERR_FORMAT, "%s: array of %llu strings cannot fit in the %zu bytes left (truncated or corrupt)", what,
                             (unsigned long long)n, rd_left(r));
        for (uint64_t i = 0; i < n; i++) {
            size_t off, at = r->pos;
            uint64_t len;
            KVPQ_TRY(rd_str(r, &off, &len, what));
            if (str_off) str_off[i] = at;
        }
        return KVPQ_OK;
    }
    if (et == GGUF_TYPE_ARRAY) {
        if (depth >= GGUF_MAX_ARRAY_DEPTH)
            return kvpq__err(KVPQ_ERR_FORMAT, "%s: arrays nested deeper than %d at offset %zu", what,
                             GGUF_MAX_ARRAY_DEPTH, r->pos);
        if (n > rd_left(r) / GGUF_MIN_NESTED_ARRAY_BYTES)
            return kvpq__err(KVPQ_ERR_FORMAT, "%s: array of %llu arrays cannot fit in the %zu bytes left (truncated or corrupt)", what,
                             (unsigned long long)n, rd_left(r));
        for (uint64_t i = 0; i < n; i++) {
            uint32_t et2;
            uint64_t n2;
            KVPQ_TRY(rd_u32(r, &et2, what));
            KVPQ_TRY(rd_u64(r, &n2, what));
            KVPQ_TRY(skip_array(r, et2, n2, depth + 1, NULL, what));
        }
        return KVPQ_OK;
    }
    size_t es = type_sizes[et];
    if (n > rd_left(r) / es)
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: array of %llu %s (%zu bytes each) exceeds the %zu bytes left (truncated or corrupt)", what,
                         (unsigned long long)n, type_names[et], es, rd_left(r));
    if (et == GGUF_TYPE_BOOL) KVPQ_TRY(check_bools(r, r->pos, n, what));
    r->pos += (size_t)n * es;
    return KVPQ_OK;
}

#define WHAT_CAP 320 /* "kv 123 'name'" of the messages, the name cut at 256 bytes */

/* The name of kv i (tensor = 0: its key) or tensor i (tensor = 1) into *name and the file's index
 * of such names; what (WHAT_CAP bytes) becomes "kv i 'name'" / "tensor i 'name'" for the messages
 * that follow. A name given twice is KVPQ_ERR_FORMAT (*name is set, and owned by the caller, as soon as
 * it is read). */
static kvpq_status read_name(reader *r, gguf_file *f, int tensor, int64_t i, char **name, char *what) {
    const char *kind = tensor ? "tensor" : "kv";
    snprintf(what, WHAT_CAP, "%s %lld", kind, (long long)i);
    size_t off = 0;
    uint64_t len = 0;
    KVPQ_TRY(rd_str(r, &off, &len, what));
    KVPQ_TRY(copy_name(r, off, len, name, what));
    snprintf(what, WHAT_CAP, "%s %lld '%.256s'", kind, (long long)i, *name);
    int64_t dup = tensor ? index_insert(f->t_index, f->t_cap, *name, i, tensor_name, f)
                         : index_insert(f->kv_index, f->kv_cap, *name, i, kv_name, f);
    if (dup >= 0)
        return kvpq__err(KVPQ_ERR_FORMAT, "%s: duplicate %s (first defined by %s %lld)", what,
                         tensor ? "tensor name" : "key", kind, (long long)dup);
    return KVPQ_OK;
}

static kvpq_status parse_kv(reader *r, gguf_file *f, int64_t i) {
    gguf_kv *kv = &f->kv[i];
    char what[WHAT_CAP];
    KVPQ_TRY(read_name(r, f, 0, i, &kv->key, what));
    uint32_t t;
    KVPQ_TRY(rd_u32(r, &t, what));
    if (!type_valid(t)) return kvpq__err(KVPQ_ERR_FORMAT, "%s: unknown value type %u at offset %zu", what, t, r->pos - 4);
    kv->type = (gguf_type)t;
    if (t == GGUF_TYPE_STRING) {
        KVPQ_TRY(rd_str(r, &kv->off, &kv->n, what));
    } else if (t == GGUF_TYPE_ARRAY) {
        uint32_t et;
        KVPQ_TRY(rd_u32(r, &et, what));
        KVPQ_TRY(rd_u64(r, &kv->n, what));
        kv->elem_type = (gguf_type)et;
        kv->off = r->pos;
        if (et == GGUF_TYPE_STRING && type_valid(et)) {
            if (kv->n > rd_left(r) / 8)
                return kvpq__err(KVPQ_ERR_FORMAT, "%s: array of %llu strings cannot fit in the %zu bytes left (truncated or corrupt)", what,
                                 (unsigned long long)kv->n, rd_left(r));
            kv->str_off = malloc(kv->n ? (size_t)kv->n * sizeof(size_t) : 1);
            if (!kv->str_off)
                return kvpq__err(KVPQ_ERR_NOMEM, "%s: index of %llu strings", what, (unsigned long long)kv->n);
        }
        KVPQ_TRY(skip_array(r, et, kv->n, 1, kv->str_off, what));
    } else {
        KVPQ_TRY(rd_need(r, type_sizes[t], what));
        kv->off = r->pos;
        if (t == GGUF_TYPE_BOOL) KVPQ_TRY(check_bools(r, r->pos, 1, what));
        r->pos += type_sizes[t];
    }
    return KVPQ_OK;
}

/* ---- tensor infos ---- */

static kvpq_status parse_tensor_info(reader *r, gguf_file *f, int64_t i, uint64_t *offset) {
    gguf_tensor *t = &f->tensors[i];
    char what[WHAT_CAP];
    char *name = NULL;
    kvpq_status st = read_name(r, f, 1, i, &name, what);
    t->name = name; /* freed with the file, whatever st is */
    KVPQ_TRY(st);
    uint32_t n_dims;
    KVPQ_TRY(rd_u32(r, &n_dims, what));
    if (n_dims < 1 || n_dims > 4) return kvpq__err(KVPQ_ERR_FORMAT, "%s: n_dims %u (expected 1..4)", what, n_dims);
    t->n_dims = (int)n_dims;
    uint64_t nelem = 1;
    for (int d = 0; d < 4; d++) {
        uint64_t ne = 1;
        if (d < (int)n_dims) {
            KVPQ_TRY(rd_u64(r, &ne, what));
            if (ne == 0 || ne > (uint64_t)INT64_MAX)
                return kvpq__err(KVPQ_ERR_FORMAT, "%s: ne[%d] = %llu (expected 1..2^63-1)", what, d, (unsigned long long)ne);
            if (nelem > (uint64_t)INT64_MAX / ne)
                return kvpq__err(KVPQ_ERR_FORMAT, "%s: element count overflows at ne[%d] = %llu", what, d,
                                 (unsigned long long)ne);
            nelem *= ne;
        }
        t->ne[d] = (int64_t)ne;
    }
    KVPQ_TRY(rd_u32(r, &t->type, what));
    KVPQ_TRY(rd_u64(r, offset, what));
    /* Sizes are known for every ggml type (kvpq dequantizes only some); a type unknown to ggml
     * opens with nbytes 0 and the model loader rejects it by name. */
    int64_t bs = ggml_blck_size(t->type);
    size_t ts = ggml_type_size(t->type);
    t->nbytes = 0;
    if (bs > 0 && ts > 0) {
        if (t->ne[0] % bs)
            return kvpq__err(KVPQ_ERR_FORMAT, "%s: ne[0] = %lld is not a multiple of the %s block size %lld", what,
                             (long long)t->ne[0], ggml_type_name(t->type), (long long)bs);
        uint64_t bytes = (uint64_t)(t->ne[0] / bs);
        if (bytes > UINT64_MAX / ts) goto too_big;
        bytes *= ts;
        for (int d = 1; d < 4; d++) {
            if (bytes > UINT64_MAX / (uint64_t)t->ne[d]) goto too_big;
            bytes *= (uint64_t)t->ne[d];
        }
        if (bytes > r->size) goto too_big;
        t->nbytes = (size_t)bytes;
    }
    return KVPQ_OK;
too_big:
    return kvpq__err(KVPQ_ERR_FORMAT, "%s: %s [%lld, %lld, %lld, %lld] needs more bytes than the file size %zu (truncated or corrupt)", what,
                     ggml_type_name(t->type), (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                     (long long)t->ne[3], r->size);
}

/* ---- open / close ---- */

void gguf_close(gguf_file *f) {
    if (!f) return;
    if (f->kv)
        for (int64_t i = 0; i < f->n_kv; i++) {
            free(f->kv[i].key);
            free(f->kv[i].str_off);
        }
    if (f->tensors)
        for (int64_t i = 0; i < f->n_tensors; i++) free((char *)f->tensors[i].name);
    free(f->kv);
    free(f->tensors);
    free(f->kv_index);
    free(f->t_index);
    if (f->map) munmap(f->map, f->size);
    free(f);
}

static kvpq_status parse(gguf_file *f) {
    reader rd = {f->base, f->size, 0}, *r = &rd;
    KVPQ_TRY(rd_need(r, 4, "magic"));
    if (memcmp(r->p, "GGUF", 4)) {
        const uint8_t *m = r->p;
        return kvpq__err(KVPQ_ERR_FORMAT, "bad magic %02x %02x %02x %02x (expected 'GGUF': not a GGUF file)", m[0], m[1],
                         m[2], m[3]);
    }
    r->pos = 4;
    KVPQ_TRY(rd_u32(r, &f->version, "version"));
    if (f->version == 1)
        return kvpq__err(KVPQ_ERR_FORMAT, "GGUF version 1 is not supported (expected 2 or 3; re-convert the model)");
    if (f->version != 2 && f->version != 3) {
        uint32_t sw = __builtin_bswap32(f->version);
        if (sw == 2 || sw == 3)
            return kvpq__err(KVPQ_ERR_FORMAT, "big-endian GGUF (version %u byte-swapped) is not supported", sw);
        return kvpq__err(KVPQ_ERR_FORMAT, "GGUF version %u is not supported (expected 2 or 3)", f->version);
    }
    uint64_t n_tensors, n_kv;
    KVPQ_TRY(rd_u64(r, &n_tensors, "tensor_count"));
    KVPQ_TRY(rd_u64(r, &n_kv, "metadata_kv_count"));
    if (n_kv > rd_left(r) / GGUF_MIN_KV_BYTES)
        return kvpq__err(KVPQ_ERR_FORMAT, "metadata_kv_count %llu cannot fit in the %zu bytes left (truncated or corrupt)",
                         (unsigned long long)n_kv, rd_left(r));

    f->kv = calloc(n_kv ? (size_t)n_kv : 1, sizeof *f->kv);
    f->kv_cap = index_cap((int64_t)n_kv);
    f->kv_index = malloc(f->kv_cap * sizeof *f->kv_index);
    if (!f->kv || !f->kv_index) return kvpq__err(KVPQ_ERR_NOMEM, "metadata table of %llu entries", (unsigned long long)n_kv);
    memset(f->kv_index, 0xff, f->kv_cap * sizeof *f->kv_index);
    for (uint64_t i = 0; i < n_kv; i++) {
        f->n_kv = (int64_t)i + 1; /* so that gguf_close frees what was parsed */
        KVPQ_TRY(parse_kv(r, f, (int64_t)i));
    }
    f->n_kv = (int64_t)n_kv;
    /* Checked after the metadata so that a file truncated inside it names the key that is cut. */
    if (n_tensors > rd_left(r) / GGUF_MIN_TENSOR_INFO_BYTES)
        return kvpq__err(KVPQ_ERR_FORMAT, "tensor_count %llu cannot fit in the %zu bytes left after the metadata "
                         "(truncated or corrupt)", (unsigned long long)n_tensors, rd_left(r));

    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    if (gguf_find_key(f, "general.alignment") >= 0) {
        uint32_t a;
        KVPQ_TRY(gguf_get_u32(f, "general.alignment", &a));
        if (a == 0 || (a & (a - 1)))
            return kvpq__err(KVPQ_ERR_FORMAT, "key general.alignment: %u is not a power of two", a);
        f->alignment = a;
    }

    f->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof *f->tensors);
    f->t_cap = index_cap((int64_t)n_tensors);
    f->t_index = malloc(f->t_cap * sizeof *f->t_index);
    uint64_t *offsets = malloc((n_tensors ? (size_t)n_tensors : 1) * sizeof *offsets);
    if (!f->tensors || !f->t_index || !offsets) {
        free(offsets);
        return kvpq__err(KVPQ_ERR_NOMEM, "tensor table of %llu entries", (unsigned long long)n_tensors);
    }
    memset(f->t_index, 0xff, f->t_cap * sizeof *f->t_index);
    kvpq_status s = KVPQ_OK;
    for (uint64_t i = 0; i < n_tensors && s == KVPQ_OK; i++) {
        f->n_tensors = (int64_t)i + 1;
        s = parse_tensor_info(r, f, (int64_t)i, &offsets[i]);
    }
    if (s != KVPQ_OK) {
        free(offsets);
        return s;
    }
    f->n_tensors = (int64_t)n_tensors;

    /* The data section starts at the next multiple of the alignment (it may be absent when the
     * file has no tensors). */
    f->header_end = r->pos;
    size_t pad = (f->alignment - r->pos % f->alignment) % f->alignment;
    f->data_off = r->pos + pad;
    uint64_t next = 0; /* where the next tensor's data must start, relative to the data section */
    uint64_t unknown_from = 0; /* after a tensor of unknown size: the least start of the next one */
    for (int64_t i = 0; i < f->n_tensors; i++) {
        gguf_tensor *t = &f->tensors[i];
        if (f->data_off > f->size) {
            s = kvpq__err(KVPQ_ERR_FORMAT, "tensor %lld '%.256s': data section at offset %zu beyond file size %zu",
                          (long long)i, t->name, f->data_off, f->size);
            break;
        }
        size_t room = f->size - f->data_off;
        if (offsets[i] % f->alignment) {
            s = kvpq__err(KVPQ_ERR_FORMAT, "tensor %lld '%.256s': data offset %llu is not a multiple of the alignment %zu",
                          (long long)i, t->name, (unsigned long long)offsets[i], f->alignment);
            break;
        }
        if (offsets[i] > room || t->nbytes > room - offsets[i]) {
            s = kvpq__err(KVPQ_ERR_FORMAT,
                          "tensor %lld '%.256s': data [%llu, %llu + %zu) (relative to the data section at %zu) beyond "
                          "file size %zu",
                          (long long)i, t->name, (unsigned long long)offsets[i], (unsigned long long)offsets[i],
                          t->nbytes, f->data_off, f->size);
            break;
        }
        /* As ggml's loader: each tensor starts where the previous one ends, padded to the alignment,
         * so none overlaps another and none was declared with a type smaller than its data. */
        /* after a tensor of a type unknown to ggml (its size unknown, nbytes 0) a tensor may start
         * anywhere past it, not before: overlaps stay refused */
        if (next == UINT64_MAX ? offsets[i] < unknown_from : offsets[i] != next) {
            s = kvpq__err(KVPQ_ERR_FORMAT,
                          "tensor %lld '%.256s': data offset %llu, expected %llu (tensors are stored in order, each "
                          "after the previous one's %s bytes: overlapping data or a wrong type or shape)",
                          (long long)i, t->name, (unsigned long long)offsets[i], (unsigned long long)next,
                          i ? "padded" : "0");
            break;
        }
        /* a type unknown to ggml has no known size (nbytes 0): nothing after it can be placed */
        if (next == UINT64_MAX || ggml_type_size(t->type) == 0) {
            next = UINT64_MAX;
            unknown_from = offsets[i] + (t->nbytes + f->alignment - 1) / f->alignment * f->alignment;
        } else {
            next = offsets[i] + (t->nbytes + f->alignment - 1) / f->alignment * f->alignment;
        }
        t->data = f->base + f->data_off + offsets[i];
    }
    /* ... and the data section ends with the last one, padded or not (stricter than ggml, which
     * reads past trailing bytes: they are how a last tensor retyped to a smaller type shows) */
    if (s == KVPQ_OK && f->n_tensors > 0 && next != UINT64_MAX) {
        const gguf_tensor *last = &f->tensors[f->n_tensors - 1];
        const uint64_t end = offsets[f->n_tensors - 1] + last->nbytes, room = f->size - f->data_off;
        if (room != end && room != next)
            s = kvpq__err(KVPQ_ERR_FORMAT, "tensor %lld '%.256s': the data section holds %llu bytes, its tensors %llu "
                          "(%llu padded): a wrong type or shape, or trailing data", (long long)(f->n_tensors - 1),
                          last->name, (unsigned long long)room, (unsigned long long)end, (unsigned long long)next);
    }
    free(offsets);
    return s;
}

static kvpq_status open_common(gguf_file **out, gguf_file *f, const char *label) {
    kvpq_status s = parse(f);
    if (s != KVPQ_OK) {
        kvpq__err_prefix("gguf '%s'", label);
        gguf_close(f);
        return s;
    }
    *out = f;
    return KVPQ_OK;
}

kvpq_status gguf_open_memory(gguf_file **out, const void *data, size_t size) {
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "gguf_open_memory: out is NULL");
    *out = NULL;
    if (!data && size) return kvpq__err(KVPQ_ERR_INVALID_ARG, "gguf_open_memory: data is NULL");
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) return kvpq__err(KVPQ_ERR_NOMEM, "gguf_open_memory");
    f->base = data;
    f->size = size;
    return open_common(out, f, "<memory>");
}

kvpq_status gguf_open(gguf_file **out, const char *path) {
    if (!out || !path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "gguf_open: NULL argument");
    *out = NULL;
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below as not a regular
     * file); it changes nothing for a regular file. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kvpq__err(KVPQ_ERR_IO, "gguf '%s': cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        int e = errno;
        close(fd);
        return kvpq__err(KVPQ_ERR_IO, "gguf '%s': cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return kvpq__err(KVPQ_ERR_IO, "gguf '%s': not a regular file", path);
    }
    if (st.st_size < 24) {
        close(fd);
        return kvpq__err(KVPQ_ERR_FORMAT, "gguf '%s': file is %lld bytes, too small for a GGUF header (24 bytes)", path,
                         (long long)st.st_size);
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        close(fd);
        return kvpq__err(KVPQ_ERR_IO, "gguf '%s': file too large to map", path);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return kvpq__err(KVPQ_ERR_IO, "gguf '%s': cannot mmap: %s", path, strerror(e));
    gguf_file *f = calloc(1, sizeof *f);
    if (!f) {
        munmap(map, (size_t)st.st_size);
        return kvpq__err(KVPQ_ERR_NOMEM, "gguf '%s'", path);
    }
    f->map = map;
    f->base = map;
    f->size = (size_t)st.st_size;
    return open_common(out, f, path);
}

uint32_t gguf_version(const gguf_file *f) { return f->version; }
size_t gguf_alignment(const gguf_file *f) { return f->alignment; }
size_t gguf_data_offset(const gguf_file *f) { return f->data_off; }
size_t gguf_file_size(const gguf_file *f) { return f->size; }

uint64_t gguf_fingerprint(const gguf_file *f) {
    /* FNV-1a, 64-bit (Fowler, Noll, Vo): not cryptographic; it tells models apart, cheaply (a few
     * ms for the 1.8 MB header of SmolLM2, most of it the vocabulary). */
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < f->header_end; i++) h = (h ^ f->base[i]) * 0x100000001b3ull;
    return h;
}

uint64_t gguf_data_fingerprint(const gguf_file *f) {
    return XXH64(f->base + f->data_off, f->size - f->data_off, 0);
}

/* ---- metadata accessors ---- */

int64_t gguf_n_kv(const gguf_file *f) { return f->n_kv; }

const char *gguf_key_at(const gguf_file *f, int64_t i) { return i >= 0 && i < f->n_kv ? f->kv[i].key : NULL; }

gguf_type gguf_type_at(const gguf_file *f, int64_t i) {
    return i >= 0 && i < f->n_kv ? f->kv[i].type : (gguf_type)-1;
}

int64_t gguf_find_key(const gguf_file *f, const char *key) {
    return key ? index_find(f->kv_index, f->kv_cap, key, kv_name, f) : -1;
}

static kvpq_status find_typed(const gguf_file *f, const char *key, const gguf_kv **kv) {
    int64_t i = gguf_find_key(f, key);
    if (i < 0) return kvpq__err(KVPQ_ERR_FORMAT, "key %s: missing", key ? key : "(null)");
    *kv = &f->kv[i];
    return KVPQ_OK;
}

/* An integer value: as int64 (s, saturated) and as uint64 (u, 0 when negative). */
typedef struct {
    int64_t s;
    uint64_t u;
    int neg;
} gguf_int;

/* The value of key, a scalar of any integer type. KVPQ_ERR_FORMAT when the key is missing or not an
 * integer. */
static kvpq_status get_int(const gguf_file *f, const char *key, gguf_int *v) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    const uint8_t *p = f->base + kv->off;
    int64_t s = 0;
    uint64_t u = 0;
    int is_signed = 0;
    switch (kv->type) {
    case GGUF_TYPE_UINT8: u = p[0]; break;
    case GGUF_TYPE_INT8: s = (int8_t)p[0]; is_signed = 1; break;
    case GGUF_TYPE_UINT16: u = le16(p); break;
    case GGUF_TYPE_INT16: s = (int16_t)le16(p); is_signed = 1; break;
    case GGUF_TYPE_UINT32: u = le32(p); break;
    case GGUF_TYPE_INT32: s = (int32_t)le32(p); is_signed = 1; break;
    case GGUF_TYPE_UINT64: u = le64(p); break;
    case GGUF_TYPE_INT64: s = (int64_t)le64(p); is_signed = 1; break;
    default:
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected an integer", key, gguf_type_name(kv->type));
    }
    if (is_signed) {
        v->neg = s < 0;
        v->s = s;
        v->u = s < 0 ? 0 : (uint64_t)s;
    } else {
        v->neg = 0;
        v->u = u;
        v->s = u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)u;
    }
    return KVPQ_OK;
}

kvpq_status gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out) {
    gguf_int v = {0};
    KVPQ_TRY(get_int(f, key, &v));
    if (v.neg || v.u > UINT32_MAX)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: value %s%llu does not fit uint32", key, v.neg ? "-" : "",
                         v.neg ? (unsigned long long)(-(v.s + 1)) + 1 : (unsigned long long)v.u);
    *out = (uint32_t)v.u;
    return KVPQ_OK;
}

kvpq_status gguf_get_i64(const gguf_file *f, const char *key, int64_t *out) {
    gguf_int v = {0};
    KVPQ_TRY(get_int(f, key, &v));
    if (!v.neg && v.u > (uint64_t)INT64_MAX)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: value %llu does not fit int64", key, (unsigned long long)v.u);
    *out = v.s;
    return KVPQ_OK;
}

kvpq_status gguf_get_f32(const gguf_file *f, const char *key, float *out) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    const uint8_t *p = f->base + kv->off;
    if (kv->type == GGUF_TYPE_FLOAT32) {
        uint32_t b = le32(p);
        memcpy(out, &b, 4);
    } else if (kv->type == GGUF_TYPE_FLOAT64) {
        uint64_t b = le64(p);
        double d;
        memcpy(&d, &b, 8);
        *out = (float)d;
    } else {
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected float32 or float64", key,
                         gguf_type_name(kv->type));
    }
    return KVPQ_OK;
}

kvpq_status gguf_get_bool(const gguf_file *f, const char *key, int *out) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    if (kv->type != GGUF_TYPE_BOOL)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected bool", key, gguf_type_name(kv->type));
    *out = f->base[kv->off] != 0;
    return KVPQ_OK;
}

kvpq_status gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    if (kv->type != GGUF_TYPE_STRING)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected string", key, gguf_type_name(kv->type));
    *s = (const char *)f->base + kv->off;
    *len = (size_t)kv->n;
    return KVPQ_OK;
}

kvpq_status gguf_get_arr_info(const gguf_file *f, const char *key, gguf_type *elem_type, uint64_t *n) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    if (kv->type != GGUF_TYPE_ARRAY)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected array", key, gguf_type_name(kv->type));
    if (elem_type) *elem_type = kv->elem_type;
    if (n) *n = kv->n;
    return KVPQ_OK;
}

kvpq_status gguf_get_arr_data(const gguf_file *f, const char *key, const void **data) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    if (kv->type != GGUF_TYPE_ARRAY)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s, expected array", key, gguf_type_name(kv->type));
    if (kv->elem_type == GGUF_TYPE_STRING || kv->elem_type == GGUF_TYPE_ARRAY)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: array of %s has no packed data", key, gguf_type_name(kv->elem_type));
    *data = f->base + kv->off;
    return KVPQ_OK;
}

kvpq_status gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s, size_t *len) {
    const gguf_kv *kv;
    KVPQ_TRY(find_typed(f, key, &kv));
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem_type != GGUF_TYPE_STRING)
        return kvpq__err(KVPQ_ERR_FORMAT, "key %s: has type %s%s%s, expected array of string", key,
                         gguf_type_name(kv->type), kv->type == GGUF_TYPE_ARRAY ? " of " : "",
                         kv->type == GGUF_TYPE_ARRAY ? gguf_type_name(kv->elem_type) : "");
    if (i >= kv->n)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "key %s: index %llu out of range (array of %llu)", key,
                         (unsigned long long)i, (unsigned long long)kv->n);
    size_t at = kv->str_off[i];
    *len = (size_t)le64(f->base + at);
    *s = (const char *)f->base + at + 8;
    return KVPQ_OK;
}

/* ---- tensors ---- */

int64_t gguf_n_tensors(const gguf_file *f) { return f->n_tensors; }

const gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i) {
    return i >= 0 && i < f->n_tensors ? &f->tensors[i] : NULL;
}

const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name) {
    int64_t i = name ? index_find(f->t_index, f->t_cap, name, tensor_name, f) : -1;
    return i >= 0 ? &f->tensors[i] : NULL;
}
