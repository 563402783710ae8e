/* gguf_info.c — public GGUF inspection (kvpq.h "GGUF inspection"): a readable summary of a file
 * (`kvpq info model.gguf`) and whole-tensor dequantization (peer checks against the gguf package). */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "model/ggml_types.h"
#include "model/gguf.h"

/* ---- value printing ---- */

/* Length of the valid UTF-8 sequence at s[0..n) that is safe to print as it is, 0 when s[0] must
 * be escaped: a C0 control or DEL, a byte of an invalid or truncated sequence, or a C1 control
 * (U+0080..U+009F, which some terminals obey as escape sequences, e.g. U+009B CSI). */
static size_t printable_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x20 || c == 0x7f) return 0;
    if (c < 0x80) return 1;
    size_t l = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    if (!l || l > n) return 0;
    unsigned cp = c & (0x7f >> l);
    for (size_t i = 1; i < l; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    static const unsigned min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[l] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f)) return 0;
    return l;
}

/* Escape a string from the file for the terminal: '"' and '\\' backslashed, '\n' as \n, every
 * byte printable_len refuses as \xNN; at most max input bytes (then "... (N bytes)" when quoted).
 * Every string read from a file goes through here: an ESC in a key or tensor name must never reach
 * the terminal (issue 14). */
static size_t print_escaped(FILE *out, const char *str, size_t len, size_t max, int quoted) {
    const unsigned char *s = (const unsigned char *)str;
    size_t w = 0; /* bytes written */
    if (quoted) fputc('"', out);
    for (size_t i = 0; i < len && i < max;) {
        size_t l = printable_len(s + i, len - i);
        if (l == 1 && (s[i] == '"' || s[i] == '\\')) w += (size_t)fprintf(out, "\\%c", s[i]);
        else if (l) w += fwrite(s + i, 1, l, out);
        else if (s[i] == '\n') w += (size_t)fprintf(out, "\\n");
        else w += (size_t)fprintf(out, "\\x%02x", s[i]);
        i += l ? l : 1;
    }
    if (quoted) fputc('"', out);
    if (quoted && len > max) fprintf(out, "... (%zu bytes)", len);
    if (!quoted && len > max) w += (size_t)fprintf(out, "...");
    return w;
}

static void print_str(FILE *out, const char *s, size_t len, size_t max) { print_escaped(out, s, len, max, 1); }

/* A name (metadata key, tensor name) escaped and left-aligned in `width` bytes, as %-*s did. */
static void print_name(FILE *out, const char *name, int width) {
    for (size_t i = print_escaped(out, name, strlen(name), 256, 0); i < (size_t)width; i++) fputc(' ', out);
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
    fputs("  ", out);
    print_name(out, k, 44);
    fprintf(out, " %-8s = ", gguf_type_name(gguf_type_at(f, gguf_find_key(f, k))));
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
    /* The reader opens tensors of a type unknown to ggml (size unknown, shown as 0 bytes before);
     * the model loader rejects them, and so does inspection, by name. */
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor *t = gguf_tensor_at(f, i);
        if (ggml_blck_size(t->type) <= 0 || ggml_type_size(t->type) == 0) {
            kvpq_status s = kvpq__err(KVPQ_ERR_UNSUPPORTED, "gguf '%s': tensor %lld '%.64s' has %s, not a ggml tensor "
                                      "type (its size is unknown)", path, (long long)i, t->name, ggml_type_name(t->type));
            gguf_close(f);
            return s;
        }
    }
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
        fputs("\nhyperparameters (", out);
        print_escaped(out, arch_prefix, strlen(arch_prefix), sizeof arch_prefix, 0);
        fputs("*):\n", out);
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
        fprintf(out, "  %4" PRId64 "  ", i);
        print_name(out, t->name, 32);
        fprintf(out, " %-6s %-20s %12zu bytes\n", ggml_type_name(t->type), shape, t->nbytes);
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
