/* fuzz_codebook.c — libFuzzer target for the codebook file reader: any bytes must load cleanly or
 * fail with a status and a message, never crash, leak or read out of bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "pq/codebook_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* A private copy, exactly `size` bytes long, so ASan catches any read past the end. */
    uint8_t *copy = malloc(size ? size : 1);
    if (!copy) return 0;
    if (size) memcpy(copy, data, size);
    kvpq_codebook *cb = NULL;
    kvpq_status s = kvpq__codebook_load_mem(&cb, copy, size, "fuzz");
    if (s == KVPQ_OK) {
        /* Accepted: the object must be fully usable. */
        kvpq_codebook_params p = kvpq_codebook_get_params(cb);
        for (int l = 0; l < p.n_layer; l++) {
            const float *sm = kvpq_codebook_key_smooth_const(cb, l);
            for (size_t i = 0; i < (size_t)p.n_head_kv * p.head_dim; i++)
                if (!(sm[i] > 0)) abort(); /* the loader promised positive finite smoothing */
            if (!kvpq__all_finite(kvpq_codebook_key_mean_const(cb, l), (size_t)p.n_head_kv * p.head_dim)) abort();
            for (int v = 0; v < 2; v++) {
                const kvpq_pq *pq = kvpq_codebook_pq_const(cb, l, v);
                if (!kvpq__all_finite(kvpq_pq_centroids(pq), kvpq_pq_centroids_size(pq))) abort();
            }
        }
        for (size_t i = 0; i < kvpq_codebook_meta_count(cb); i++)
            if (!kvpq_codebook_get_meta(cb, kvpq_codebook_meta_key(cb, i))) abort();
    } else if (cb != NULL || kvpq_last_error()[0] == '\0') {
        abort(); /* a failure must leave *out NULL and say why */
    }
    kvpq_codebook_free(cb);
    free(copy);
    return 0;
}
