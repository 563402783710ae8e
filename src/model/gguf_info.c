/* gguf_info.c — public GGUF inspection (kvpq.h "GGUF inspection"): a readable summary of a file
 * (`kvpq info model.gguf`) and whole-tensor dequantization (peer checks against the gguf package). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "model/ggml_types.h"
#include "model/gguf.h"

/* ---- value printing ---- */

static void print_str(FILE *out, const char *s, size_t len, size_t max) {
    fputc('"', out);
    for (size_t i = 0; i < len && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\') fprintf(out, "\\%c", c);
        else if (c == '\n') fputs("\\n", out);
        else if (c < 0x20 || c == 0x7f) fprintf(out, "\\x%02x", c);
        else fputc(c, out);
    }
    fputc('"', out);
    if (len > max) fprintf(out, "... (%zu bytes)", len);
}

/* One packed little-endian scalar of type t at p. */
static void print_scalar(FILE *out, gguf_type t, const uint8_t *p) {
    uint64_t u = 0;
    size_t sz = t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_INT8 || t == GGUF_TYPE_BOOL     ? 1
                : t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_INT16                        ? 2
                : t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_FLOAT32 ? 4
                                                                                       : 8;
    for (size_t i = 0; i < sz; i++) u |= (uint64_t)p[i] << (8 * i);
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
        fprintf(out, "%" PRIu64, u);
        break;
    case GGUF_TYPE_INT8: fprintf(out, "%d", (int)(int8_t)u); break;
    case GGUF_TYPE_INT16: fprintf(out, "%d", (int)(int16_t)u); break;
    case GGUF_TYPE_INT32: fprintf(out, "%" PRId32, (int32_t)u); break;
    case GGUF_TYPE_INT64: fprintf(out, "%" PRId64, (int64_t)u); break;
    case GGUF_TYPE_BOOL: fputs(u ? "true" : "false", out); break;
    case GGUF_TYPE_FLOAT32: {
        uint32_t b = (uint32_t)u;
        float f;
        memcpy(&f, &b, 4);
        fprintf(out, "%.9g", f);
        break;
    }
    case GGUF_TYPE_FLOAT64: {
        double d;
        memcpy(&d, &u, 8);
        fprintf(out, "%.17g", d);
        break;
    }
    default: fputs("?", out);
    }
}

static size_t scalar_size(gguf_type t) {
    static const size_t sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return (unsigned)t <= GGUF_TYPE_FLOAT64 ? sz[t] : 0;
}

/* Print the value of key k; arrays show their first `show` elements. */
static void print_value(FILE *out, const gguf_file *f, const char *k, int show) {
    int64_t i = gguf_find_key(f, k);
    gguf_type t = gguf_type_at(f, i);
    if (t == GGUF_TYPE_STRING) {
        const char *s;
        size_t len;
        if (gguf_get_str(f, k, &s, &len) == KVPQ_OK) print_str(out, s, len, 120);
    } else if (t == GGUF_TYPE_ARRAY) {
        gguf_type et;
        uint64_t n;
        if (gguf_get_arr_info(f, k, &et, &n) != KVPQ_OK) return;
        fprintf(out, "[%" PRIu64 " x %s]", n, gguf_type_name(et));
        if (show <= 0 || n == 0 || et == GGUF_TYPE_ARRAY) return;
        fputs(" ", out);
        for (uint64_t j = 0; j < n && j < (uint64_t)show; j++) {
            if (j) fputs(", ", out);
            if (et == GGUF_TYPE_STRING) {
                const char *s;
                size_t len;
                if (gguf_get_arr_str(f, k, j, &s, &len) == KVPQ_OK) print_str(out, s, len, 40);
            } else {
                const void *d;
                if (gguf_get_arr_data(f, k, &d) == KVPQ_OK)
                    print_scalar(out, et, (const uint8_t *)d + j * scalar_size(et));
            }
        }
        if (n > (uint64_t)show) fputs(", ...", out);
    } else {
        int64_t iv;
        float fv;
        int bv;
        if (t == GGUF_TYPE_BOOL && gguf_get_bool(f, k, &bv) == KVPQ_OK) fputs(bv ? "true" : "false", out);
        else if ((t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64) && gguf_get_f32(f, k, &fv) == KVPQ_OK)
            fprintf(out, "%.9g", fv);
        else if (gguf_get_i64(f, k, &iv) == KVPQ_OK) fprintf(out, "%" PRId64, iv);
        else {
            uint32_t uv;
            if (gguf_get_u32(f, k, &uv) == KVPQ_OK) fprintf(out, "%u", uv);
            else fputs("(out of range)", out); /* a uint64 above INT64_MAX */
        }
    }
}

static void print_kv_line(FILE *out, const gguf_file *f, const char *k, int show) {
    fprintf(out, "  %-44s %-8s = ", k, gguf_type_name(gguf_type_at(f, gguf_find_key(f, k))));
    print_value(out, f, k, show);
    fputc('\n', out);
}

static int has_prefix(const char *s, const char *p) { return !strncmp(s, p, strlen(p)); }

/* Text of token id from tokenizer.ggml.tokens, for the summary line. */
static void print_token(FILE *out, const gguf_file *f, const char *id_key) {
    uint32_t id;
    if (gguf_find_key(f, id_key) < 0 || gguf_get_u32(f, id_key, &id) != KVPQ_OK) {
        fputs("-", out);
        return;
    }
    fprintf(out, "%u", id);
    const char *s;
    size_t len;
    if (gguf_get_arr_str(f, "tokenizer.ggml.tokens", id, &s, &len) == KVPQ_OK) {
        fputs(" ", out);
        print_str(out, s, len, 40);
    }
}

kvpq_status kvpq_gguf_describe(const char *path, FILE *out, int verbose) {
    if (!path || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_gguf_describe: NULL argument");
    gguf_file *f;
    KVPQ_TRY(gguf_open(&f, path));
    fprintf(out, "file:     %s\n", path);
    fprintf(out, "format:   GGUF v%u, alignment %zu, %" PRId64 " metadata keys, %" PRId64
                 " tensors, data at offset %zu, %zu bytes\n",
            gguf_version(f), gguf_alignment(f), gguf_n_kv(f), gguf_n_tensors(f), gguf_data_offset(f),
            gguf_file_size(f));

    const char *arch = NULL;
    size_t arch_len = 0;
    char arch_prefix[72] = "";
    if (gguf_find_key(f, "general.architecture") >= 0 &&
        gguf_get_str(f, "general.architecture", &arch, &arch_len) == KVPQ_OK && arch_len < 64)
        snprintf(arch_prefix, sizeof arch_prefix, "%.*s.", (int)arch_len, arch);

    fputs("\ngeneral:\n", out);
    for (int64_t i = 0; i < gguf_n_kv(f); i++)
        if (has_prefix(gguf_key_at(f, i), "general.")) print_kv_line(out, f, gguf_key_at(f, i), 8);

    if (arch_prefix[0]) {
        fprintf(out, "\nhyperparameters (%s*):\n", arch_prefix);
        for (int64_t i = 0; i < gguf_n_kv(f); i++)
            if (has_prefix(gguf_key_at(f, i), arch_prefix)) print_kv_line(out, f, gguf_key_at(f, i), 8);
    }

    if (gguf_find_key(f, "tokenizer.ggml.model") >= 0) {
        fputs("\ntokenizer:\n", out);
        const char *s;
        size_t len;
        fputs("  model ", out);
        if (gguf_get_str(f, "tokenizer.ggml.model", &s, &len) == KVPQ_OK) print_str(out, s, len, 40);
        fputs(", pre ", out);
        if (gguf_find_key(f, "tokenizer.ggml.pre") >= 0 && gguf_get_str(f, "tokenizer.ggml.pre", &s, &len) == KVPQ_OK)
            print_str(out, s, len, 40);
        else
            fputs("-", out);
        uint64_t n_vocab = 0, n_merges = 0;
        gguf_type et;
        if (gguf_find_key(f, "tokenizer.ggml.tokens") >= 0) gguf_get_arr_info(f, "tokenizer.ggml.tokens", &et, &n_vocab);
        if (gguf_find_key(f, "tokenizer.ggml.merges") >= 0) gguf_get_arr_info(f, "tokenizer.ggml.merges", &et, &n_merges);
        fprintf(out, ", vocab %" PRIu64 ", merges %" PRIu64 "\n  bos ", n_vocab, n_merges);
        print_token(out, f, "tokenizer.ggml.bos_token_id");
        fputs(", eos ", out);
        print_token(out, f, "tokenizer.ggml.eos_token_id");
        fputs(", unk ", out);
        print_token(out, f, "tokenizer.ggml.unknown_token_id");
        fputs(", pad ", out);
        print_token(out, f, "tokenizer.ggml.padding_token_id");
        int add_bos;
        if (gguf_find_key(f, "tokenizer.ggml.add_bos_token") >= 0 &&
            gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &add_bos) == KVPQ_OK)
            fprintf(out, ", add_bos_token %s", add_bos ? "true" : "false");
        fputc('\n', out);
    }

    int other = 0;
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        const char *k = gguf_key_at(f, i);
        if (has_prefix(k, "general.") || (arch_prefix[0] && has_prefix(k, arch_prefix))) continue;
        if (!verbose && has_prefix(k, "tokenizer.")) continue;
        if (!other++) fprintf(out, "\n%s:\n", verbose ? "other metadata" : "other metadata (tokenizer.* with -v)");
        print_kv_line(out, f, k, verbose ? 8 : 4);
    }

    fprintf(out, "\ntensors (shape as ne[0], ne[1], ...: ne[0] innermost, as gguf lists it):\n");
    size_t total = 0;
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        char shape[96];
        int o = snprintf(shape, sizeof shape, "[");
        for (int d = 0; d < t->n_dims && o < (int)sizeof shape; d++)
            o += snprintf(shape + o, sizeof shape - (size_t)o, "%s%" PRId64, d ? ", " : "", t->ne[d]);
        if (o < (int)sizeof shape) snprintf(shape + o, sizeof shape - (size_t)o, "]");
        fprintf(out, "  %4" PRId64 "  %-32s %-6s %-20s %12zu bytes\n", i, t->name, ggml_type_name(t->type), shape,
                t->nbytes);
        total += t->nbytes;
    }
    fprintf(out, "  total %zu bytes of tensor data\n", total);
    gguf_close(f);
    return KVPQ_OK;
}

kvpq_status kvpq_gguf_dequantize_tensor(const char *path, const char *name, float *out, size_t cap, size_t *numel) {
    if (!path || !name) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_gguf_dequantize_tensor: NULL argument");
    gguf_file *f;
    KVPQ_TRY(gguf_open(&f, path));
    kvpq_status s = KVPQ_OK;
    const gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) {
        s = kvpq__err(KVPQ_ERR_INVALID_ARG, "gguf '%s': no tensor named '%s'", path, name);
        goto done;
    }
    size_t n = 1;
    for (int d = 0; d < 4; d++) n *= (size_t)t->ne[d]; /* the reader checked that this does not overflow */
    if (numel) *numel = n;
    if (!ggml_type_supported(t->type)) {
        s = kvpq__err(KVPQ_ERR_UNSUPPORTED, "gguf '%s': tensor '%s' has type %s, which kvpq cannot dequantize", path,
                      name, ggml_type_name(t->type));
        goto done;
    }
    if (!out && cap == 0) goto done;
    if (!out || cap < n) {
        s = kvpq__err(KVPQ_ERR_INVALID_ARG, "gguf '%s': tensor '%s' has %zu elements, output holds %zu", path, name, n,
                      cap);
        goto done;
    }
    s = ggml_dequantize_row(t->type, t->data, out, (int64_t)n);
done:
    gguf_close(f);
    return s;
}
