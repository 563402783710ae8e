/* cache_spec.c — the cache SPEC grammar (kvpq.h, kvpq_cache_spec_parse): the one parser of the CLI's
 * --cache and of the Python package. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../core/internal.h"

static int fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return 2;
}

enum { SUF_NONE, SUF_W, SUF_S, SUF_FORCE, SUF_CUDA };

/* What the part [p, p + n) is: a suffix (its number in *val), or SUF_NONE. -1 (message in err): it
 * reads as a suffix but its number is missing or out of range. */
static int classify(const char *spec, const char *p, size_t n, long *val, char *err, size_t errlen) {
    if (n == 5 && !memcmp(p, "force", 5)) return SUF_FORCE;
    if (n == 4 && !memcmp(p, "cuda", 4)) return SUF_CUDA;
    if (n < 1 || (p[0] != 'w' && p[0] != 's')) return SUF_NONE;
    const int w = p[0] == 'w';
    const long max = w ? 1L << 20 : 65536;
    const size_t signed_from = n > 2 && (p[1] == '-' || p[1] == '+') ? 2 : 1; /* :w-1 reads as a suffix too */
    for (size_t i = signed_from; i < n; i++)
        if (p[i] < '0' || p[i] > '9') return SUF_NONE;
    if (signed_from == 2) {
        fail(err, errlen, "cache '%s': %s ':%.*s': expected :%cN with N in 0..%ld%s", spec, w ? "window" : "sinks",
             (int)n, p, p[0], max, strncmp(spec, "vq", 2) ? "" : " (a file name ending so: end the path with ':')");
        return -1;
    }
    char num[16] = {0};
    if (n - 1 <= 7) memcpy(num, p + 1, n - 1);
    if (n == 1 || n - 1 > 7 || strtol(num, NULL, 10) > max) {
        fail(err, errlen, "cache '%s': %s ':%.*s': expected :%cN with N in 0..%ld", spec, w ? "window" : "sinks",
             (int)n, p, p[0], max);
        return -1;
    }
    *val = strtol(num, NULL, 10);
    return w ? SUF_W : SUF_S;
}

static int apply(const char *spec, kvpq_cache_spec *out, int k, long val, const char *p, size_t n, char *err,
                 size_t errlen) {
    if ((k == SUF_W && out->window >= 0) || (k == SUF_S && out->sinks >= 0) || (k == SUF_FORCE && out->force) ||
        (k == SUF_CUDA && out->cuda))
        return fail(err, errlen, "cache '%s': duplicate suffix ':%.*s' (each of :wN, :sN, :force, :cuda at most once)",
                    spec, (int)n, p);
    if (k == SUF_W) out->window = (int)val;
    if (k == SUF_S) out->sinks = (int)val;
    if (k == SUF_FORCE) out->force = 1;
    if (k == SUF_CUDA) out->cuda = 1;
    return 0;
}

static int parse(const char *spec, kvpq_cache_spec *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    out->window = out->sinks = -1;
    if (err && errlen) err[0] = '\0';
    const size_t len = strlen(spec);
    if (len >= sizeof out->path)
        return fail(err, errlen, "cache spec '%.64s...' is longer than %zu bytes", spec, sizeof out->path - 1);
    const char *rest, *end = spec + len;
    int vq = !strncmp(spec, "vq:", 3) || !strcmp(spec, "vq");
    if (vq) {
        out->type = KVPQ_CACHE_VQ;
        rest = spec[2] ? spec + 3 : spec + 2;
    } else {
        const char *colon = strchr(spec, ':');
        char kind[32];
        size_t kl = colon ? (size_t)(colon - spec) : len;
        if (kl < sizeof kind) {
            memcpy(kind, spec, kl);
            kind[kl] = '\0';
        }
        if (kl == 3 && !strncmp(kind, "tq", 2) && kind[2] >= '2' && kind[2] <= '4')
            out->type = KVPQ_CACHE_VQ, out->tq_bits = kind[2] - '0';
        else if (kl >= sizeof kind || kvpq_cache_type_parse(kind, &out->type, NULL) != KVPQ_OK)
            return fail(err, errlen, "cache '%s': unknown kind '%.*s' (expected fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 "
                                     "kivi4 tq2 tq3 tq4 vq:FILE)", spec, (int)(kl < 32 ? kl : 32), spec);
        rest = colon ? colon + 1 : end;
        if (colon && rest == end) return fail(err, errlen, "cache '%s': an empty suffix", spec);
    }
    if (!vq) { /* after a kind, every part is a suffix */
        for (const char *p = rest; p < end;) {
            const char *c = memchr(p, ':', (size_t)(end - p));
            const size_t n = c ? (size_t)(c - p) : (size_t)(end - p);
            if (n == 0 || (c && c + 1 == end)) return fail(err, errlen, "cache '%s': an empty suffix", spec);
            long val = 0;
            int k = classify(spec, p, n, &val, err, errlen);
            if (k < 0) return 2;
            if (k == SUF_NONE)
                return fail(err, errlen, "cache '%s': unknown suffix ':%.*s' (expected :wN, :sN, :force or :cuda)", spec,
                            (int)n, p);
            if (apply(spec, out, k, val, p, n, err, errlen)) return 2;
            p += n + (c ? 1 : 0);
        }
    } else { /* vq: suffixes from the end, up to the first part that is none (or empty) */
        while (1) {
            const char *c = end;
            while (c > rest && c[-1] != ':') c--;
            if (c == rest) break; /* the path's first part is always path */
            const size_t n = (size_t)(end - c);
            if (n == 0) {
                end = c - 1; /* a trailing ':' (or "::" before suffixes): the path ends here */
                break;
            }
            long val = 0;
            int k = classify(spec, c, n, &val, err, errlen);
            if (k < 0) return 2;
            if (k == SUF_NONE) break; /* part of the path */
            if (apply(spec, out, k, val, c, n, err, errlen)) return 2;
            end = c - 1;
        }
    }
    if (vq) {
        if (end <= rest) return fail(err, errlen, "cache '%s': vq needs a codebook file (vq:FILE)", spec);
        memcpy(out->path, rest, (size_t)(end - rest));
        out->path[end - rest] = '\0';
    }
    const kvpq_cache_type t = out->type;
    if (out->window >= 0 && t != KVPQ_CACHE_VQ && t != KVPQ_CACHE_KIVI2 && t != KVPQ_CACHE_KIVI4)
        return fail(err, errlen, "cache '%s': a window (:w%d) applies to vq and kivi caches only", spec, out->window);
    if (out->sinks >= 0 && (t == KVPQ_CACHE_FP32 || t == KVPQ_CACHE_FP16))
        return fail(err, errlen, "cache '%s': sinks (:s%d) apply to the quantized caches only", spec, out->sinks);
    if (out->force && (t != KVPQ_CACHE_VQ || out->tq_bits))
        return fail(err, errlen, "cache '%s': :force applies to vq:FILE caches only (it accepts a codebook of another "
                                 "model)", spec);
    if (out->cuda && t != KVPQ_CACHE_VQ)
        return fail(err, errlen, "cache '%s': :cuda applies to vq:FILE caches only (the other kinds run on the CPU)",
                    spec);
    return 0;
}

kvpq_status kvpq_cache_spec_parse(const char *spec, kvpq_cache_spec *out) {
    if (!spec || !out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_spec_parse: NULL argument");
    char err[512];
    if (parse(spec, out, err, sizeof err) == 0) return KVPQ_OK;
    return kvpq__err(KVPQ_ERR_INVALID_ARG, "%s", err);
}
