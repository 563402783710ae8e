/* cli_model.c — cache SPEC handling, sampling and UTF-8 streaming for generate and ppl. */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"
#include "cli_model.h"
#include "cli_spec.h"

/* ---- caches ---- */

int cli_cache_open(cli_cache *c, const char *spec, const kvpq_model *m, int max_seq, int n_threads) {
    kvpq_model_info info;
    kvpq_model_get_info(m, &info);
    const kvpq_model_info *mi = &info;
    memset(c, 0, sizeof *c);
    snprintf(c->spec, sizeof c->spec, "%s", spec);
    kvpq_cache_params cp = kvpq_cache_params_default();
    cli_cache_spec sp;
    char err[512];
    if (cli_cache_spec_parse(spec, &sp, err, sizeof err) != 0) return cli_usage_error("%s", err);
    cp.type = sp.type;
    const char *vq_path = sp.type == KVPQ_CACHE_VQ && !sp.tq_bits ? sp.path : NULL;
    const int force = sp.force;
    kvpq_status s;
    if (vq_path) {
        s = kvpq_codebook_load(&c->codebook, vq_path);
        if (s != KVPQ_OK) {
            fprintf(stderr, "kvpq: cache '%s': ", spec);
            return cli_fail("codebook", s);
        }
        cp.codebook = c->codebook;
        int unchecked = 0;
        s = kvpq_codebook_check_model(c->codebook, mi, &unchecked);
        if (s != KVPQ_OK && !force) {
            fprintf(stderr, "kvpq: cache '%s': ", spec);
            cli_fail("codebook", s);
            fprintf(stderr, "kvpq: (append :force to the cache SPEC to use it anyway)\n");
            kvpq_codebook_free(c->codebook);
            c->codebook = NULL;
            return 1;
        }
        if (s != KVPQ_OK)
            fprintf(stderr, "kvpq: cache '%s': warning: the codebook was calibrated on another model (used as asked "
                            "by :force)\n", spec);
        if (unchecked)
            fprintf(stderr, "kvpq: cache '%s': warning: the codebook file records no model fingerprint (written "
                            "before kvpq recorded one): cannot check that it belongs to this model\n", spec);
    }
    if (sp.tq_bits) { /* TurboQuant's MSE quantizer for this model's shape, float16 norms */
        s = kvpq_codebook_turboquant(&c->codebook, mi->n_layer, mi->n_head_kv, mi->head_dim, sp.tq_bits, 16);
        if (s != KVPQ_OK) {
            fprintf(stderr, "kvpq: cache '%s': ", spec);
            return cli_fail("codebook", s);
        }
        cp.codebook = c->codebook;
    }
    /* window and sinks: the SPEC's suffixes; else, for vq, what the codebook's allocation was made
     * for; else the defaults (kvpq_cache_params_resolve: the rule Python applies too) */
    if ((s = kvpq_cache_params_resolve(&cp, sp.window, sp.sinks)) != KVPQ_OK) {
        fprintf(stderr, "kvpq: cache '%s': ", spec);
        kvpq_codebook_free(c->codebook);
        c->codebook = NULL;
        return cli_fail("cache", s);
    }
    kvpq_model_cache_params(m, &cp); /* shape and sliding window */
    cp.max_seq = max_seq;
    cp.n_threads = n_threads;
    cp.backend = sp.cuda ? KVPQ_BACKEND_CUDA : KVPQ_BACKEND_CPU; /* :cuda: the cache alone on the GPU */
    c->params = cp;
    s = kvpq_cache_new(&c->cache, &cp);
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq: cache '%s': ", spec);
        kvpq_codebook_free(c->codebook);
        c->codebook = NULL;
        return cli_fail("cache", s);
    }
    return 0;
}

void cli_cache_close(cli_cache *c) {
    kvpq_cache_free(c->cache);
    kvpq_codebook_free(c->codebook);
    c->cache = NULL;
    c->codebook = NULL;
}

void cli_print_cache_memory(const char *cmd, const char *spec, const kvpq_cache *c, const kvpq_cache_stats *st) {
    fprintf(stderr,
            "kvpq %s: cache %s holds %d positions: stored tokens %zu bytes (%.3f bits per element); resident %zu "
            "bytes (%.2f MiB, %.3f bits per element: whole pages, window ring, codebooks)\n",
            cmd, spec, kvpq_cache_seq_len(c, 0), st->stored_bytes, st->stored_bits_per_element, st->resident_bytes,
            st->resident_bytes / 1048576.0, st->bits_per_element);
}

/* ---- sampling ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void cli_rng_seed(cli_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

double cli_rng_uniform(cli_rng *r) {
    uint64_t *s = r->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double)(result >> 11) * 0x1.0p-53;
}

static const float *g_sort_p; /* qsort has no context argument; sampling runs on one thread */
static int by_prob_desc(const void *a, const void *b) {
    float pa = g_sort_p[*(const int32_t *)a], pb = g_sort_p[*(const int32_t *)b];
    if (pa != pb) return pa < pb ? 1 : -1;
    return *(const int32_t *)a - *(const int32_t *)b;
}

int32_t cli_sample(const float *logits, int n_vocab, float temp, float top_p, cli_rng *r, float *p, int32_t *idx) {
    int32_t best = 0;
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] > logits[best]) best = i;
    if (temp <= 0) return best;
    double sum = 0;
    for (int i = 0; i < n_vocab; i++) {
        p[i] = expf((logits[i] - logits[best]) / temp);
        sum += p[i];
    }
    int n = 0;
    /* Only tokens that can matter for the nucleus need sorting: drop those below 1e-9 of the max. */
    for (int i = 0; i < n_vocab; i++) {
        p[i] = (float)(p[i] / sum);
        if (p[i] >= 1e-9f * p[best] || i == best) idx[n++] = i;
    }
    g_sort_p = p;
    qsort(idx, (size_t)n, sizeof *idx, by_prob_desc);
    double cum = 0;
    int keep = n;
    for (int i = 0; i < n; i++) {
        cum += p[idx[i]];
        if (cum >= top_p) {
            keep = i + 1;
            break;
        }
    }
    /* cum is now the mass of the kept tokens: draw within it (renormalized nucleus). */
    double u = cli_rng_uniform(r) * cum, acc = 0;
    for (int i = 0; i < keep; i++) {
        acc += p[idx[i]];
        if (u < acc) return idx[i];
    }
    return idx[keep - 1];
}

/* ---- UTF-8 ---- */

/* Length of the sequence a lead byte starts (0 for a continuation or invalid byte). */
static int utf8_len(unsigned char c) {
    if (c < 0x80) return 1;
    if ((c & 0xe0) == 0xc0) return c >= 0xc2 ? 2 : 0;
    if ((c & 0xf0) == 0xe0) return 3;
    if ((c & 0xf8) == 0xf0) return c <= 0xf4 ? 4 : 0;
    return 0;
}

int cli_utf8_valid(const unsigned char *s, size_t n, size_t *bad) {
    size_t i = 0;
    while (i < n) {
        int l = utf8_len(s[i]);
        if (l == 0 || i + (size_t)l > n) goto fail;
        for (int k = 1; k < l; k++)
            if ((s[i + k] & 0xc0) != 0x80) goto fail;
        if (l == 3) {
            unsigned cp = ((s[i] & 0x0fu) << 12) | ((s[i + 1] & 0x3fu) << 6) | (s[i + 2] & 0x3fu);
            if (cp < 0x800 || (cp >= 0xd800 && cp <= 0xdfff)) goto fail;
        } else if (l == 4) {
            unsigned cp = ((s[i] & 0x07u) << 18) | ((s[i + 1] & 0x3fu) << 12);
            if (cp < 0x10000 || cp > 0x10ffff) goto fail;
        }
        i += (size_t)l;
    }
    return 1;
fail:
    if (bad) *bad = i;
    return 0;
}

/* Token pieces come from the model file's vocabulary: on a terminal, control characters (C0 but
 * newline, tab and carriage return; DEL; C1 as UTF-8) and bytes of invalid UTF-8 are written as
 * \xNN, so a vocabulary cannot send escape sequences to it. Redirected output stays byte-exact. */
static void put_bytes(FILE *f, const unsigned char *b, size_t n, int valid) {
    static int tty = -1;
    if (tty < 0) tty = isatty(fileno(f));
    if (!tty) {
        fwrite(b, 1, n, f);
        return;
    }
    int ctl = !valid || (n == 1 && ((b[0] < 0x20 && b[0] != '\n' && b[0] != '\t' && b[0] != '\r') || b[0] == 0x7f)) ||
              (n == 2 && b[0] == 0xc2 && b[1] < 0xa0);
    if (!ctl) {
        fwrite(b, 1, n, f);
        return;
    }
    for (size_t i = 0; i < n; i++) fprintf(f, "\\x%02x", b[i]);
}

void cli_utf8_write(cli_utf8_stream *st, FILE *f, const char *bytes, size_t n) {
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)bytes[i];
        if (st->n_pend == 0) {
            int l = utf8_len(c);
            if (l <= 1) {
                put_bytes(f, &c, 1, l == 1);
                continue;
            }
            st->pend[st->n_pend++] = c;
            continue;
        }
        if ((c & 0xc0) != 0x80) { /* broken sequence: write what was held and restart on c */
            put_bytes(f, st->pend, st->n_pend, 0);
            st->n_pend = 0;
            i--;
            continue;
        }
        st->pend[st->n_pend++] = c;
        if ((int)st->n_pend == utf8_len(st->pend[0])) {
            put_bytes(f, st->pend, st->n_pend, 1);
            st->n_pend = 0;
        }
    }
    fflush(f);
}

void cli_utf8_flush(cli_utf8_stream *st, FILE *f) {
    put_bytes(f, st->pend, st->n_pend, 0);
    st->n_pend = 0;
    fflush(f);
}

static char g_read_error[160];

const char *cli_read_error(void) { return g_read_error; }

char *cli_read_file(const char *path, size_t *len) {
    g_read_error[0] = '\0';
    /* O_NONBLOCK: a FIFO must not block the open; it is refused just below, as is any file that is
     * not regular (/dev/zero would be read without end). */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        int e = errno;
        snprintf(g_read_error, sizeof g_read_error, "%s", strerror(e));
        if (fd >= 0) close(fd);
        errno = e;
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(g_read_error, sizeof g_read_error, "not a regular file (%s)",
                 S_ISFIFO(st.st_mode) ? "a FIFO" : S_ISCHR(st.st_mode) ? "a character device"
                 : S_ISDIR(st.st_mode) ? "a directory" : S_ISSOCK(st.st_mode) ? "a socket" : "a device");
        close(fd);
        errno = EINVAL;
        return NULL;
    }
    if (st.st_size > CLI_MAX_TEXT_BYTES) {
        snprintf(g_read_error, sizeof g_read_error, "%lld bytes, over the %d MiB limit on text files",
                 (long long)st.st_size, CLI_MAX_TEXT_BYTES >> 20);
        close(fd);
        errno = EFBIG;
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    int err = buf ? 0 : ENOMEM;
    while (buf) {
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) {
            err = errno;
            break;
        }
        if (got == 0) break;
        n += (size_t)got;
        if (n > CLI_MAX_TEXT_BYTES) { /* counted as read: a file that grows or lies about its size */
            err = EFBIG;
            snprintf(g_read_error, sizeof g_read_error, "over the %d MiB limit on text files (grew while read)",
                     CLI_MAX_TEXT_BYTES >> 20);
            break;
        }
        if (n == cap) {
            cap *= 2;
            char *nb = realloc(buf, cap + 1);
            if (!nb) err = ENOMEM;
            else buf = nb;
            if (!nb) break;
        }
    }
    close(fd);
    if (err) {
        if (!g_read_error[0]) snprintf(g_read_error, sizeof g_read_error, "%s", strerror(err));
        free(buf);
        errno = err;
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
}

int32_t *cli_parse_ids(const char *s, size_t len, size_t *n) {
    size_t cap = 64, k = 0;
    int32_t *ids = malloc(cap * sizeof *ids);
    for (size_t i = 0; ids && i < len;) {
        if (s[i] < '0' || s[i] > '9') {
            /* "-5" is a negative number, not a separator and the id 5 (it was read as 5) */
            if (s[i] == '-' && i + 1 < len && s[i + 1] >= '0' && s[i + 1] <= '9') {
                free(ids);
                return NULL;
            }
            i++;
            continue;
        }
        long v = 0;
        while (i < len && s[i] >= '0' && s[i] <= '9' && v <= 0x7fffffffL) v = v * 10 + (s[i++] - '0');
        if (v > 0x7fffffffL) { /* not a token id */
            free(ids);
            return NULL;
        }
        if (k == cap) {
            int32_t *ni = realloc(ids, (cap *= 2) * sizeof *ids);
            if (!ni) free(ids);
            ids = ni;
            if (!ids) break;
        }
        ids[k++] = (int32_t)v;
    }
    *n = k;
    return ids;
}
