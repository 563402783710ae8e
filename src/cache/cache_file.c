/* cache_file.c — saved caches: kvpq_cache_save / kvpq_cache_load (kvpq.h, docs/cache.md).
 *
 * File layout (little-endian, as the machines kvpq runs on; the header says which format version):
 *   "KVPQSAVE"                         8 bytes
 *   u32 format version (3 with sinks, else 2; 1 is read too), u32 cache kind (kvpq_cache_type; bit 8
 *                                      set: saved by the CUDA backend, src/cache/cache_vq_cuda.c)
 *   i32 n_layer, n_head, n_head_kv, head_dim, max_seq, window, page_tokens (as kvpq_cache_new set them)
 *   u64 codebook fingerprint (kvpq_codebook_fingerprint; 0 for kinds without a codebook)
 *   u64 user_len
 *   i32 lens[n_layer]                  positions held per layer
 *   i32 lo[n_layer]                    (version 2) first position held per layer: > 0 in sliding-window
 *                                      layers whose front pages were freed (version 1: all 0)
 *   i32 sinks S                        (version 3) attention sinks, 1..max_seq
 *   user bytes
 *   sinks                              (version 3) per layer, K then V of its first min(len, S) positions,
 *                                      fp16, (n, n_head_kv, head_dim) each
 *   the kind's payload                 ops->serial (its pages, windows and counters)
 *   u64 XXH64 (seed 0) of every byte before it
 * The checksum covers header and payload, so a flipped bit or a truncated file is refused; the
 * header is checked field by field first so that a file for another kind, model shape or codebook
 * gets a message naming what differs. A cache without sinks is written as version 2, byte for byte
 * what earlier versions of kvpq wrote. With sinks, the kind holds positions S.. as its own 0.., so
 * its payload is serialized with lens and lo shifted by S (payload_io). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL /* header-only use of xxHash (Debian libxxhash-dev): no link dependency */
/* gcc's -Warray-bounds misreads xxHash's inlined tail loop on small inputs (a false positive). */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <xxhash.h>
#pragma GCC diagnostic pop

#include "cache/cache_impl.h"
#include "internal.h"

#define MAGIC "KVPQSAVE"
#define MAX_USER ((uint64_t)1 << 30)
#define MAX_LAYERS 4096

struct kvpq__stream {
    FILE *f;
    int load;
    XXH64_state_t *h;
    const char *path;
};

kvpq_status kvpq__stream_io(kvpq__stream *s, void *buf, size_t n) {
    if (!n) return KVPQ_OK;
    if (s->load) {
        size_t got = fread(buf, 1, n, s->f);
        if (got != n) {
            if (ferror(s->f))
                return kvpq__err(KVPQ_ERR_IO, "saved cache '%s': read failed: %s", s->path, strerror(errno));
            return kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': truncated (the file ends inside its data)", s->path);
        }
    } else if (fwrite(buf, 1, n, s->f) != n) {
        return kvpq__err(KVPQ_ERR_IO, "saved cache '%s': write failed: %s", s->path, strerror(errno));
    }
    XXH64_update(s->h, buf, n);
    return KVPQ_OK;
}

// ---- codebook fingerprint ----------------------------------------------------------------------

uint64_t kvpq_codebook_fingerprint(const kvpq_codebook *cb) {
    if (!cb) return 0;
    XXH64_state_t *h = XXH64_createState();
    if (!h) return 0;
    XXH64_reset(h, 0);
    kvpq_codebook_params cp = kvpq_codebook_get_params(cb);
    const int32_t flags[] = {cp.n_layer, cp.n_head_kv, cp.head_dim, cp.value_rotate, cp.key_norm, cp.value_norm};
    XXH64_update(h, flags, sizeof flags);
    const size_t row = (size_t)cp.n_head_kv * cp.head_dim;
    for (int l = 0; l < cp.n_layer; l++) {
        for (int w = 0; w < 2; w++) {
            const kvpq_pq *pq = kvpq_codebook_pq_const(cb, l, w);
            kvpq_pq_params pp = kvpq_pq_get_params(pq);
            const int32_t shape[] = {pp.d, pp.M, pp.nbits, (int32_t)pp.granularity};
            XXH64_update(h, shape, sizeof shape);
            XXH64_update(h, kvpq_pq_centroids(pq), kvpq_pq_centroids_size(pq) * sizeof(float));
        }
        const kvpq_pq *pq2 = kvpq_codebook_key_pq2_const(cb, l); /* residual second stage: only when present,
                                                                    * so one-stage fingerprints are unchanged */
        if (pq2) {
            kvpq_pq_params pp = kvpq_pq_get_params(pq2);
            const int32_t shape[] = {-2, pp.d, pp.M, pp.nbits, (int32_t)pp.granularity};
            XXH64_update(h, shape, sizeof shape);
            XXH64_update(h, kvpq_pq_centroids(pq2), kvpq_pq_centroids_size(pq2) * sizeof(float));
        }
        /* 8-bit norm-explicit scales (k.norm_bits / v.norm_bits): a different page layout; only when
         * present, so float16 fingerprints are unchanged */
        const int32_t sbits[] = {-8, kvpq_codebook_layer_scale_bits(cb, l, 0), kvpq_codebook_layer_scale_bits(cb, l, 1)};
        if (sbits[1] == 8 || sbits[2] == 8) XXH64_update(h, sbits, sizeof sbits);
        const float *lam = kvpq_codebook_key_smooth_const(cb, l), *mu = kvpq_codebook_key_mean_const(cb, l);
        if (lam) XXH64_update(h, lam, row * sizeof(float));
        if (mu) XXH64_update(h, mu, row * sizeof(float));
        const float *rf = kvpq_codebook_key_rope_freq_const(cb, l); /* keys before RoPE: only when present */
        const int32_t rope[] = {-5, cp.key_rope_dims, cp.key_rope_neox};
        if (rf) {
            XXH64_update(h, rope, sizeof rope);
            XXH64_update(h, rf, (size_t)(cp.key_rope_dims / 2) * sizeof(float));
        }
    }
    uint64_t v = XXH64_digest(h);
    XXH64_freeState(h);
    return v ? v : 1; /* 0 means "no codebook" */
}

// ---- header ------------------------------------------------------------------------------------

/* The header's kind field carries the backend of a VQ cache on the GPU (cache_vq_cuda.c: its own
 * payload) in bit 8, so that neither backend reads the other's payload. */
#define BACKEND_CUDA 0x100u
static uint32_t backend_flag(kvpq_backend b) { return b == KVPQ_BACKEND_CUDA ? BACKEND_CUDA : 0u; }

typedef struct {
    uint32_t version, type;
    int32_t n_layer, n_head, n_head_kv, head_dim, max_seq, window, page_tokens;
    uint64_t cb_fp, user_len;
} file_header;

static kvpq_status header_io(kvpq__stream *s, file_header *h) {
    char magic[8];
    memcpy(magic, MAGIC, 8);
    KVPQ_TRY(kvpq__stream_io(s, magic, 8));
    if (s->load && memcmp(magic, MAGIC, 8))
        return kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': not a kvpq saved cache (magic is not %s)", s->path, MAGIC);
    KVPQ_TRY(kvpq__stream_io(s, &h->version, sizeof h->version));
    if (s->load && (h->version < 1 || h->version > KVPQ_CACHE_FILE_VERSION))
        return kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': format version %u; this library reads versions 1 to %d",
                         s->path, (unsigned)h->version, KVPQ_CACHE_FILE_VERSION);
    KVPQ_TRY(kvpq__stream_io(s, &h->type, sizeof h->type));
    int32_t *ints[] = {&h->n_layer, &h->n_head, &h->n_head_kv, &h->head_dim, &h->max_seq, &h->window, &h->page_tokens};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) KVPQ_TRY(kvpq__stream_io(s, ints[i], sizeof(int32_t)));
    KVPQ_TRY(kvpq__stream_io(s, &h->cb_fp, sizeof h->cb_fp));
    KVPQ_TRY(kvpq__stream_io(s, &h->user_len, sizeof h->user_len));
    return KVPQ_OK;
}

/* The kind's payload (ops->serial). With S sinks the kind holds positions S.. as its 0.. (cache.c,
 * inner_lens), so its lens and lo are shifted by S; a layer's first held position lo is 0 or >= S
 * (cache.c sets lo = S + what the kind dropped). */
static kvpq_status payload_io(kvpq__stream *st, kvpq_cache *c, int load) {
    const int S = c->p.sinks, n = c->p.n_layer;
    if (S == 0) return c->ops->serial(c->state, c->len, c->lo, st, load);
    int *ilen = malloc((size_t)n * 2 * sizeof *ilen), *ilo = ilen + n;
    if (!ilen) return kvpq__err(KVPQ_ERR_NOMEM, "%s: out of memory", load ? "kvpq_cache_load" : "kvpq_cache_save");
    for (int l = 0; l < n; l++) {
        ilen[l] = c->len[l] > S ? c->len[l] - S : 0;
        ilo[l] = c->lo[l] > S ? c->lo[l] - S : 0;
    }
    kvpq_status s = c->ops->serial(c->state, ilen, ilo, st, load);
    free(ilen);
    return s;
}

/* The sink section (version 3): per layer, K then V of positions [0, min(len, S)), fp16. On load,
 * every value must be a finite fp16 (what kvpq_cache_append stores: it refuses non-finite input and
 * values beyond fp16's range), so a damaged section is refused by name even where the checksum is
 * not checked (fuzz builds). */
static kvpq_status sinks_io(kvpq__stream *st, kvpq_cache *c, const int *lens, int load) {
    const int S = c->p.sinks;
    const size_t kvw = (size_t)c->p.n_head_kv * c->p.head_dim;
    for (int l = 0; l < c->p.n_layer; l++) {
        const int ns = lens[l] < S ? lens[l] : S;
        uint16_t *part[2] = {c->sk + (size_t)l * S * kvw, c->sv + (size_t)l * S * kvw};
        for (int w = 0; w < 2; w++) {
            KVPQ_TRY(kvpq__stream_io(st, part[w], (size_t)ns * kvw * sizeof(uint16_t)));
            for (size_t i = 0; load && i < (size_t)ns * kvw; i++)
                if ((part[w][i] & 0x7c00) == 0x7c00)
                    return kvpq__err(KVPQ_ERR_FORMAT,
                                     "saved cache '%s': sink section: layer %d %s at position %d (head %d, dim %d) is "
                                     "not a finite fp16 value (0x%04x): corrupted",
                                     st->path, l, w ? "V" : "K", (int)(i / kvw), (int)(i / c->p.head_dim % c->p.n_head_kv),
                                     (int)(i % c->p.head_dim), part[w][i]);
        }
    }
    return KVPQ_OK;
}

// ---- save --------------------------------------------------------------------------------------

kvpq_status kvpq_cache_save(const kvpq_cache *c, const char *path, const void *user, size_t user_len) {
    if (!c || !path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_save: cache or path is NULL");
    if (user_len && !user) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_save: user is NULL, user_len %zu", user_len);
    if ((uint64_t)user_len > MAX_USER)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_save: user_len %zu exceeds %llu", user_len,
                         (unsigned long long)MAX_USER);
    if (!c->ops->serial)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "kvpq_cache_save: cache %s has no saved form", c->ops->name);
    /* A sliding-window cache has freed the pages of positions its local layers no longer see: the
     * file records where each layer starts (lo) and holds the pages from there on. */
    /* The file replaced is the one a symbolic link names (tempfile.c); the temporary file sits
     * beside it, so the rename stays on one file system, and is listed for kvpq_remove_temp_files
     * (a signal handler's clean-up) until renamed or removed. */
    char *target = kvpq__resolve_target(path);
    if (!target) return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_save: out of memory");
    struct stat sb;
    if (lstat(target, &sb) == 0 && !S_ISREG(sb.st_mode)) {
        free(target);
        return kvpq__err(KVPQ_ERR_IO, "saved cache '%s': not a regular file (any existing file is unchanged)", path);
    }
    char *tmp = kvpq__temp_name(target);
    if (!tmp) {
        free(target);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_save: out of memory");
    }
    int fd = kvpq__temp_create(tmp);
    if (fd < 0 || fchmod(fd, 0644) != 0) {
        kvpq_status s = kvpq__err(KVPQ_ERR_IO, "saved cache '%s': cannot create a temporary file beside it: %s", path,
                                  strerror(errno));
        if (fd >= 0) close(fd);
        kvpq__temp_done(tmp, 0);
        free(tmp);
        free(target);
        return s;
    }
    FILE *f = fdopen(fd, "wb");
    XXH64_state_t *h = XXH64_createState();
    kvpq_status s = KVPQ_OK;
    if (!f || !h) s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_save: out of memory");
    kvpq__stream st = {f, 0, h, path};
    if (s == KVPQ_OK) {
        XXH64_reset(h, 0);
        const int S = c->p.sinks;
        file_header hd = {S > 0 ? 3u : 2u, (uint32_t)c->p.type | backend_flag(c->p.backend), c->p.n_layer, c->p.n_head, c->p.n_head_kv,
                          c->p.head_dim, c->p.max_seq, c->p.window, c->p.page_tokens,
                          c->cb_fp, user_len};
        s = header_io(&st, &hd);
        for (int l = 0; l < c->p.n_layer && s == KVPQ_OK; l++) {
            int32_t len = c->len[l];
            s = kvpq__stream_io(&st, &len, sizeof len);
        }
        for (int l = 0; l < c->p.n_layer && s == KVPQ_OK; l++) {
            int32_t lo = c->lo[l];
            s = kvpq__stream_io(&st, &lo, sizeof lo);
        }
        int32_t sinks = S;
        if (s == KVPQ_OK && S > 0) s = kvpq__stream_io(&st, &sinks, sizeof sinks);
        if (s == KVPQ_OK) s = kvpq__stream_io(&st, (void *)user, user_len);
        if (s == KVPQ_OK && S > 0) s = sinks_io(&st, (kvpq_cache *)c, c->len, 0);
        if (s == KVPQ_OK) s = payload_io(&st, (kvpq_cache *)c, 0);
        if (s == KVPQ_OK) {
            uint64_t sum = XXH64_digest(h);
            if (fwrite(&sum, sizeof sum, 1, f) != 1)
                s = kvpq__err(KVPQ_ERR_IO, "saved cache '%s': write failed: %s", path, strerror(errno));
        }
        if (s == KVPQ_OK && (fflush(f) != 0 || fsync(fileno(f)) != 0))
            s = kvpq__err(KVPQ_ERR_IO, "saved cache '%s': write failed: %s", path, strerror(errno));
    }
    if (h) XXH64_freeState(h);
    if (f) {
        if (fclose(f) != 0 && s == KVPQ_OK)
            s = kvpq__err(KVPQ_ERR_IO, "saved cache '%s': write failed: %s", path, strerror(errno));
    } else {
        close(fd);
    }
    if (s == KVPQ_OK && rename(tmp, target) != 0)
        s = kvpq__err(KVPQ_ERR_IO, "saved cache '%s': cannot rename the temporary file onto it: %s", path,
                      strerror(errno));
    kvpq__temp_done(tmp, s == KVPQ_OK); /* removes the temporary file unless it was renamed */
    free(tmp);
    free(target);
    return s;
}

// ---- load --------------------------------------------------------------------------------------

static kvpq_status check_field(const char *path, const char *what, long file, long ours) {
    if (file == ours) return KVPQ_OK;
    return kvpq__err(KVPQ_ERR_MISMATCH, "saved cache '%s': %s %ld, this cache has %ld", path, what, file, ours);
}

/* Every position a loaded cache holds reads back finite (non-finite policy, docs/robustness.md): a
 * file with NaN or Inf in its payload (fp16 rows, KIVI scales, window rings, norm scales), even with
 * a recomputed checksum, is refused by name instead of giving NaN attention. */
static kvpq_status check_payload_finite(const kvpq_cache *c, const char *path) {
    const size_t row = (size_t)c->p.n_head_kv * c->p.head_dim;
    enum { BLOCK = 256 };
    float *k = malloc(BLOCK * row * sizeof *k), *v = malloc(BLOCK * row * sizeof *v);
    kvpq_status s = k && v ? KVPQ_OK : kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_load: out of memory");
    for (int l = 0; l < c->p.n_layer && s == KVPQ_OK; l++)
        for (int p0 = c->lo[l]; p0 < c->len[l] && s == KVPQ_OK; p0 += BLOCK) {
            const int n = c->len[l] - p0 < BLOCK ? c->len[l] - p0 : BLOCK;
            s = kvpq_cache_read(c, l, p0, n, k, v);
            if (s == KVPQ_OK && !(kvpq__all_finite(k, (size_t)n * row) && kvpq__all_finite(v, (size_t)n * row)))
                s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': layer %d holds NaN or Inf among positions %d..%d",
                              path, l, p0, p0 + n - 1);
        }
    free(k);
    free(v);
    return s;
}

kvpq_status kvpq_cache_load(kvpq_cache **out, const kvpq_cache_params *p, const char *path, void **user,
                            size_t *user_len) {
    if (user) *user = NULL;
    if (user_len) *user_len = 0;
    if (!out) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_load: out is NULL");
    *out = NULL;
    if (!p || !path) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_cache_load: params or path is NULL");
    /* Non-blocking and a regular file only: a FIFO or a device would block or never end. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return kvpq__err(KVPQ_ERR_IO, "saved cache '%s': cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return kvpq__err(KVPQ_ERR_IO, "saved cache '%s': not a regular file", path);
    }
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_load: out of memory");
    }
    XXH64_state_t *h = XXH64_createState();
    kvpq_cache *c = NULL;
    int32_t *lens = NULL, *lo = NULL, file_sinks = 0;
    void *ub = NULL;
    kvpq_status s = h ? KVPQ_OK : kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_load: out of memory");
    kvpq__stream st = {f, 1, h, path};
    file_header hd;
    memset(&hd, 0, sizeof hd);
    if (s == KVPQ_OK) {
        XXH64_reset(h, 0);
        s = header_io(&st, &hd);
    }
    if (s == KVPQ_OK && (hd.n_layer <= 0 || hd.n_layer > MAX_LAYERS || hd.user_len > MAX_USER))
        s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': header holds n_layer %d, user data %llu bytes", path,
                      (int)hd.n_layer, (unsigned long long)hd.user_len);
    if (s == KVPQ_OK && (hd.type & ~BACKEND_CUDA) != (uint32_t)p->type)
        s = kvpq__err(KVPQ_ERR_MISMATCH, "saved cache '%s': cache kind %s, this cache is %s", path,
                      kvpq_cache_type_name((kvpq_cache_type)(hd.type & ~BACKEND_CUDA)), kvpq_cache_type_name(p->type));
    kvpq_cache_params pf = *p;
    if (s == KVPQ_OK) {
        /* A file saved with a smaller max_seq holds the window and page size kvpq_cache_new clamped
         * to it: when the requested ones clamp the same way, the cache takes the file's (its state
         * is laid out for them), so a larger max_seq loads as documented. */
        const int fmax = hd.max_seq;
        if (fmax > 0 && fmax < p->max_seq) {
            if (p->window > fmax && hd.window == fmax) pf.window = fmax;
            if (p->page_tokens > fmax && hd.page_tokens == fmax) pf.page_tokens = fmax;
        }
        s = kvpq_cache_new(&c, &pf);
    }
    if (s == KVPQ_OK) {
        const kvpq_cache_params *q = &c->p; /* as kvpq_cache_new clamped window and pages */
        s = check_field(path, "n_layer", hd.n_layer, q->n_layer);
        if (s == KVPQ_OK) s = check_field(path, "n_head", hd.n_head, q->n_head);
        if (s == KVPQ_OK) s = check_field(path, "n_head_kv", hd.n_head_kv, q->n_head_kv);
        if (s == KVPQ_OK) s = check_field(path, "head_dim", hd.head_dim, q->head_dim);
        if (s == KVPQ_OK) s = check_field(path, "window", hd.window, q->window);
        if (s == KVPQ_OK) s = check_field(path, "page_tokens", hd.page_tokens, q->page_tokens);
        if (s == KVPQ_OK && (hd.type & BACKEND_CUDA) != backend_flag(q->backend))
            s = kvpq__err(KVPQ_ERR_MISMATCH, "saved cache '%s': saved by the %s backend, this cache runs on %s (the two "
                          "hold a VQ cache's window in different forms)", path, hd.type & BACKEND_CUDA ? "cuda" : "cpu",
                          kvpq_backend_name(q->backend));
        if (s == KVPQ_OK && q->type == KVPQ_CACHE_VQ && hd.cb_fp != c->cb_fp)
            s = kvpq__err(KVPQ_ERR_MISMATCH,
                          "saved cache '%s': made with another codebook (fingerprint %016llx, this one %016llx)", path,
                          (unsigned long long)hd.cb_fp, (unsigned long long)c->cb_fp);
    }
    if (s == KVPQ_OK && (!(lens = malloc((size_t)hd.n_layer * sizeof *lens)) || !(lo = calloc((size_t)hd.n_layer, sizeof *lo))))
        s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_load: out of memory");
    for (int l = 0; l < hd.n_layer && s == KVPQ_OK; l++) {
        s = kvpq__stream_io(&st, &lens[l], sizeof lens[l]);
        if (s == KVPQ_OK && lens[l] < 0)
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': layer %d holds %d positions", path, l, (int)lens[l]);
        if (s == KVPQ_OK && lens[l] > c->p.max_seq)
            s = kvpq__err(KVPQ_ERR_CAPACITY, "saved cache '%s': layer %d holds %d positions, this cache's max_seq is %d",
                          path, l, (int)lens[l], c->p.max_seq);
    }
    for (int l = 0; l < hd.n_layer && s == KVPQ_OK && hd.version >= 2; l++) {
        s = kvpq__stream_io(&st, &lo[l], sizeof lo[l]);
        if (s == KVPQ_OK && (lo[l] < 0 || lo[l] > lens[l]))
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': layer %d starts at position %d of %d", path, l, (int)lo[l],
                          (int)lens[l]);
        /* only a layer with a sliding window frees positions; the file's layer did, this cache's
         * layer attends to every position: another model (or sliding window) */
        if (s == KVPQ_OK && lo[l] > 0 && kvpq__window_start(&c->p, l, lens[l]) < lo[l])
            s = kvpq__err(KVPQ_ERR_MISMATCH,
                          "saved cache '%s': layer %d dropped the positions before %d (a sliding window); this "
                          "cache's layer %d %s",
                          path, l, (int)lo[l], l, kvpq__layer_window(&c->p, l) ? "still needs them" : "has no sliding window");
    }
    if (s == KVPQ_OK && hd.version >= 3) {
        s = kvpq__stream_io(&st, &file_sinks, sizeof file_sinks);
        if (s == KVPQ_OK && (file_sinks < 1 || file_sinks > hd.max_seq))
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': sinks %d (a version 3 file holds 1 to max_seq %d)", path,
                          (int)file_sinks, (int)hd.max_seq);
    }
    /* sinks as kvpq_cache_new clamped them (to max_seq); a file from before version 3 holds none */
    if (s == KVPQ_OK) s = check_field(path, "sinks", file_sinks, c->p.sinks);
    for (int l = 0; l < hd.n_layer && s == KVPQ_OK && file_sinks > 0; l++)
        if (lo[l] > 0 && lo[l] < file_sinks)
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': layer %d starts at position %d, inside its %d sinks", path,
                          l, (int)lo[l], (int)file_sinks);
    if (s == KVPQ_OK && hd.user_len && !(ub = malloc((size_t)hd.user_len)))
        s = kvpq__err(KVPQ_ERR_NOMEM, "kvpq_cache_load: out of memory for %llu bytes of user data",
                      (unsigned long long)hd.user_len);
    if (s == KVPQ_OK) s = kvpq__stream_io(&st, ub, (size_t)hd.user_len);
    if (s == KVPQ_OK) {
        /* lo == S: a file saved before kvpq_cache_append kept lo at 0 while the kind had freed nothing */
        for (int l = 0; l < c->p.n_layer; l++)
            c->len[l] = lens[l], c->lo[l] = file_sinks > 0 && lo[l] == file_sinks ? 0 : lo[l];
        if (file_sinks > 0) s = sinks_io(&st, c, c->len, 1); /* file_sinks == c->p.sinks: checked above */
        if (s == KVPQ_OK) s = payload_io(&st, c, 1);
        if (s != KVPQ_OK && !strstr(kvpq_last_error(), path)) kvpq__err_prefix("saved cache '%s'", path);
    }
    if (s == KVPQ_OK) {
        uint64_t sum = 0, want = XXH64_digest(h);
#ifdef KVPQ_FUZZING
        (void)want;
#endif
        if (fread(&sum, sizeof sum, 1, f) != 1)
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': truncated (no checksum at the end)", path);
#ifndef KVPQ_FUZZING /* fuzz builds read on past a wrong checksum, to reach the checks behind it */
        else if (sum != want)
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': checksum mismatch (file %016llx, contents %016llx): corrupted",
                          path, (unsigned long long)sum, (unsigned long long)want);
#endif
        else if (fgetc(f) != EOF)
            s = kvpq__err(KVPQ_ERR_FORMAT, "saved cache '%s': trailing bytes after the checksum", path);
    }
    fclose(f);
    if (h) XXH64_freeState(h);
    free(lens);
    free(lo);
    if (s == KVPQ_OK) s = check_payload_finite(c, path);
    if (s != KVPQ_OK) {
        kvpq_cache_free(c);
        free(ub);
        return s;
    }
    *out = c;
    if (user) *user = ub;
    else free(ub);
    if (user_len) *user_len = (size_t)hd.user_len;
    return KVPQ_OK;
}
