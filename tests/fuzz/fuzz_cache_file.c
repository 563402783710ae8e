/* fuzz_cache_file.c — libFuzzer target for the saved-cache reader (kvpq_cache_load): any bytes must
 * load cleanly or fail with a status and a message, never crash, leak or read out of bounds; a
 * cache that loads must attend and read back. In fuzz builds (KVPQ_FUZZING) the reader ignores a
 * checksum mismatch, so that mutations reach the header and payload checks behind it. The input's
 * first byte picks the kind the loader expects (bits 0-1: fp16, q4_0, kivi2, vq) and whether it has 2
 * attention sinks (bit 2, quantized kinds: format version 3's sink section); the rest is the file,
 * written to a memfd and loaded through /proc/self/fd. Seeds: tests/fuzz/corpus/cache_file/. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvpq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Shapes of the seeds (small: 2 layers, 4/2 heads, head_dim 32, window 8, pages of 8). */
static kvpq_cache_params params(kvpq_cache_type t, const kvpq_codebook *cb) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_head_kv = 2;
    p.head_dim = 32;
    p.max_seq = 256;
    p.window = 8;
    p.page_tokens = 8;
    p.codebook = cb;
    p.n_threads = 1;
    return p;
}

/* A fixed d4b8 codebook (centroids from a fixed formula), the same in every run. */
static kvpq_codebook *codebook(void) {
    static kvpq_codebook *cb;
    if (cb) return cb;
    kvpq_codebook_params p = kvpq_codebook_params_default();
    p.n_layer = 2, p.n_head_kv = 2, p.head_dim = 32;
    if (kvpq_pq_params_preset(&p.key, "d4b8", 32) != KVPQ_OK || kvpq_pq_params_preset(&p.value, "d4b8", 32) != KVPQ_OK ||
        kvpq_codebook_new(&cb, &p) != KVPQ_OK)
        abort();
    for (int l = 0; l < 2; l++)
        for (int w = 0; w < 2; w++) {
            kvpq_pq *pq = kvpq_codebook_pq(cb, l, w);
            size_t n = kvpq_pq_centroids_size(pq);
            float *c = malloc(n * sizeof *c);
            for (size_t i = 0; i < n; i++) c[i] = (float)((i * 2654435761u + 97u * l + w) % 1000) / 500.0f - 1.0f;
            if (kvpq_pq_set_centroids(pq, c, n) != KVPQ_OK) abort();
            free(c);
        }
    return cb;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    static const kvpq_cache_type kinds[4] = {KVPQ_CACHE_FP16, KVPQ_CACHE_Q4_0, KVPQ_CACHE_KIVI2, KVPQ_CACHE_VQ};
    kvpq_cache_params p = params(kinds[data[0] & 3], codebook());
    if ((data[0] & 4) && p.type != KVPQ_CACHE_FP16) p.sinks = 2;
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
        float q[4 * 32], out[4 * 32], kv[256 * 2 * 32];
        for (int i = 0; i < 4 * 32; i++) q[i] = (float)(i % 7) - 3.0f;
        for (int l = 0; l < 2; l++) {
            const int n = kvpq_cache_seq_len(c, l);
            if (n > 0 && kvpq_cache_attend(c, l, 1, q, out) != KVPQ_OK) abort(); /* loaded: must attend */
            if (n > 0 && kvpq_cache_read(c, l, 0, n, kv, kv) != KVPQ_OK) abort();
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
