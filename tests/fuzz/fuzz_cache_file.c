/* fuzz_cache_file.c — libFuzzer target for the saved-cache reader (kvpq_cache_load): any bytes must
 * load cleanly or fail with a status and a message, never crash, leak or read out of bounds; a
 * cache that loads must attend and read back. In fuzz builds (KVPQ_FUZZING) the reader ignores a
 * checksum mismatch, so that mutations reach the header and payload checks behind it. The input's
 * first byte picks the cache the loader expects; the rest is the file, written to a memfd and loaded
 * through /proc/self/fd. First byte, bit 7 clear (the older seeds): bits 0-1 the kind (fp16, q4_0,
 * kivi2, vq), bit 2 two attention sinks (quantized kinds). Bit 7 set (every kind, issue 31): bits 0-3
 * the kind (index mod 9 into KINDS), bit 4 two sinks (quantized kinds), bit 5 a sliding window of 16
 * on layer 0, bit 6 (vq) a norm-explicit codebook with 8-bit scales. Seeds: tests/fuzz/corpus/cache_file/;
 * KVPQ_FUZZ_WRITE_SEEDS=DIR ./fuzz_cache_file writes a 44-position seed of every kind and variant
 * into DIR and exits. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvpq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Shapes of the seeds (small: 2 layers, 4/2 heads, head_dim 32 (64 for q8_0r / q4_0r), window 8, pages
 * of 8). */
static kvpq_cache_params params(kvpq_cache_type t, const kvpq_codebook *cb) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.head_dim = t == KVPQ_CACHE_Q8_0R || t == KVPQ_CACHE_Q4_0R ? 64 : 32; /* the rotated kinds need 64 */
    p.max_seq = 256;
    p.window = 8;
    p.page_tokens = 8;
    p.codebook = cb;
    p.n_threads = 1;
    return p;
}

/* Fixed d4b8 codebooks (centroids from a fixed formula), the same in every run: norm 0 plain, norm 1
 * norm-explicit with 8-bit scales. */
static kvpq_codebook *codebook(int norm) {
    static kvpq_codebook *cb[2];
    if (cb[norm]) return cb[norm];
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = 2, p.n_head_kv = 2, p.head_dim = 32;
    if (norm) p.key_norm = p.value_norm = 1;
    if (kvpq_pq_params_preset(&p.key, "d4b8", 32) != KVPQ_OK || kvpq_pq_params_preset(&p.value, "d4b8", 32) != KVPQ_OK ||
        kvpq_codebook_new(&cb[norm], &p) != KVPQ_OK)
        abort();
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < 2; w++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb[norm], l, w);
            size_t n = kvpq_pq_centroids_size(pq);
            float *c = malloc(n * sizeof *c);
            for (size_t i = 0; i < n; i++) c[i] = (float)((i * 2654435761u + 97u * l + w) % 1000) / 500.0f - 1.0f;
            if (kvpq_pq_set_centroids(pq, c, n) != KVPQ_OK) abort();
            free(c);
        }
    if (norm && (kvpq_codebook_set_meta(cb[norm], "k.norm_bits", "8") != KVPQ_OK ||
                 kvpq_codebook_set_meta(cb[norm], "v.norm_bits", "8") != KVPQ_OK))
        abort();
    return cb[norm];
}

static const kvpq_cache_type KINDS[9] = {KVPQ_CACHE_FP32,  KVPQ_CACHE_FP16,  KVPQ_CACHE_Q8_0,
                                         KVPQ_CACHE_Q4_0,  KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q4_0R,
                                         KVPQ_CACHE_KIVI2, KVPQ_CACHE_KIVI4, KVPQ_CACHE_VQ};
static uint8_t SWA_LAYERS[2] = {1, 0};

/* The cache the first byte asks for (see the top of the file). */
static kvpq_cache_params params_of(uint8_t b) {
    static const kvpq_cache_type legacy[4] = {KVPQ_CACHE_FP16, KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_VQ};
    const int every = b >> 7;
    const kvpq_cache_type t = every ? KINDS[(b & 15) % 9] : legacy[b & 3];
    kvpq_cache_params p = params(t, codebook(every && (b & 64) ? 1 : 0));
    const int quantized = t != KVPQ_CACHE_FP32 && t != KVPQ_CACHE_FP16;
    if (quantized && (every ? b & 16 : b & 4)) p.sinks = 2;
    if (every && (b & 32)) {
        p.sliding_window = 16;
        p.swa_layers = SWA_LAYERS;
    }
    return p;
}

/* KVPQ_FUZZ_WRITE_SEEDS=DIR: a 44-position cache of every kind and variant (past the window and one
 * 32-position flush: some positions coded), saved, as seeds. */
static void write_seeds(const char *dir) {
    static const uint8_t variants[] = {0x80, 0x90, 0xA0, 0xB0}; /* plain, sinks, sliding window, both */
    for (int k = 0; k < 9; k++)
        for (int v = 0; v < 5; v++) {
            uint8_t b = v < 4 ? (uint8_t)(variants[v] | k) : (uint8_t)(0xC0 | k); /* v 4: 8-bit norm scales */
            if (v == 4 && KINDS[k] != KVPQ_CACHE_VQ) continue;
            kvpq_cache_params p = params_of(b);
            if ((b & 16) && !p.sinks) continue; /* fp32 / fp16 take no sinks */
            kvpq_cache *c = NULL;
            if (kvpq_cache_new(&c, &p) != KVPQ_OK) abort();
            float kv[44 * 2 * 64];
            for (int i = 0; i < 44 * 2 * 64; i++) kv[i] = (float)((i * 7919u + 13u * k) % 2001) / 1000.0f - 1.0f;
            for (int l = 0; l < 2; l++)
                if (kvpq_cache_append(c, l, 44, kv, kv) != KVPQ_OK) abort();
            char tmp[] = "/tmp/kvpq_fuzz_seed_XXXXXX", path[512];
            int fd = mkstemp(tmp);
            if (fd < 0 || kvpq_cache_save(c, tmp, "seed", 4) != KVPQ_OK) abort();
            snprintf(path, sizeof path, "%s/seed_%s%s%s%s_44", dir, kvpq_cache_type_name(KINDS[k]),
                     (b & 16) ? "_sinks2" : "", (b & 32) ? "_swa16" : "", (b & 64) ? "_norm8" : "");
            FILE *in = fopen(tmp, "rb"), *out = fopen(path, "wb");
            if (!in || !out) abort();
            fputc(b, out);
            for (int ch; (ch = fgetc(in)) != EOF;) fputc(ch, out);
            fclose(in), fclose(out), close(fd), unlink(tmp);
            kvpq_cache_free(c);
        }
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *dir = getenv("KVPQ_FUZZ_WRITE_SEEDS");
    if (dir) {
        write_seeds(dir);
        exit(0);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    kvpq_cache_params p = params_of(data[0]);
    int fd = memfd_create("kvpq_fuzz", 0);
    if (fd < 0) return 0;
    if (size > 1 && write(fd, data + 1, size - 1) != (ssize_t)(size - 1)) {
        close(fd);
        return 0;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    kvpq_cache *c = NULL;
    void *user = NULL;
    size_t user_len = 0;
    kvpq_status s = kvpq_cache_load(&c, &p, path, &user, &user_len);
    if (s == KVPQ_OK) {
        const int len = kvpq_cache_seq_len(c, 0);
        float q[4 * 64], out[4 * 64], kv[256 * 2 * 64];
        for (int i = 0; i < 4 * 64; i++) q[i] = (float)(i % 7) - 3.0f;
        for (int l = 0; l < 2; l++) {
            const int n = kvpq_cache_seq_len(c, l);
            /* loaded: must attend (or name an overflow: an fp32 cache may hold values near 3e38) */
            kvpq_status a = n > 0 ? kvpq_cache_attend(c, l, 1, q, out) : KVPQ_OK;
            if (a != KVPQ_OK && !(a == KVPQ_ERR_NONFINITE && p.type == KVPQ_CACHE_FP32)) abort();
            /* a sliding-window layer holds at least the positions the next query sees */
            const int from = p.sliding_window > 0 && l == 0 && n > p.sliding_window - 1 ? n - (p.sliding_window - 1) : 0;
            if (n > 0 && kvpq_cache_read(c, l, from, n - from, kv, kv) != KVPQ_OK) abort();
        }
        (void)len;
        if (user_len && !user) abort();
    } else if (c != NULL || user != NULL || kvpq_last_error()[0] == '\0') {
        abort(); /* a failure must leave the outputs NULL and say why */
    }
    free(user);
    kvpq_cache_free(c);
    close(fd);
    return 0;
}
