/* bench_swa_memory.c — resident bytes of a model's KV cache at a long context, its sliding-window
 * (local) layers bounded by the window beside what they would take unbounded, for each cache kind.
 *
 * Two caches of each kind, one with the model's sliding window (kvpq_model_cache_params) and one
 * without, receive the same positions (random keys and values: the bytes held do not depend on
 * the values) one block of 512 at a time, as kvpq_model_eval appends them. An unbounded layer holds
 * the same bytes in every layer, so global = unbounded total * n_global / n_layer, local unbounded
 * = the rest, local windowed = windowed total - global.
 * Usage: bench_swa_memory [MODEL] [CTX] [SPEC,SPEC...]
 *   defaults: models/gemma-3-270m-Q4_K_M.gguf 32768 fp16,fp32,q8_0,q4_0,kivi2,kivi4
 *   (vq:CODEBOOK works too). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpq_model.h"

static float bench_normal(uint64_t *s) { /* splitmix64 + Box-Muller */
    double u[2];
    for (int i = 0; i < 2; i++) {
        uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        u[i] = (double)((z ^ (z >> 31)) >> 11) / 9007199254740992.0;
    }
    return (float)(sqrt(-2.0 * log(u[0] + 1e-300)) * cos(6.283185307179586 * u[1]));
}

#define BLOCK 512

static kvpq_cache *open_cache(const kvpq_model *m, const char *spec, int ctx, int windowed, kvpq_codebook **cb) {
    kvpq_cache_params p = kvpq_cache_params_default();
    const char *vq = NULL;
    if (kvpq_cache_type_parse(spec, &p.type, &vq) != KVPQ_OK) return NULL;
    if (vq && !*cb && kvpq_codebook_load(cb, vq) != KVPQ_OK) return NULL;
    p.codebook = *cb;
    kvpq_model_cache_params(m, &p);
    if (!windowed) p.sliding_window = 0, p.swa_layers = NULL;
    p.max_seq = ctx;
    p.backend = KVPQ_BACKEND_CPU;
    kvpq_cache *c = NULL;
    return kvpq_cache_new(&c, &p) == KVPQ_OK ? c : NULL;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : "models/gemma-3-270m-Q4_K_M.gguf";
    int ctx = argc > 2 ? atoi(argv[2]) : 32768;
    char specs[1024];
    snprintf(specs, sizeof specs, "%s", argc > 3 ? argv[3] : "fp16,fp32,q8_0,q4_0,kivi2,kivi4");
    kvpq_model *m = NULL;
    if (kvpq_model_load(&m, path, NULL) != KVPQ_OK) {
        fprintf(stderr, "bench_swa_memory: %s\n", kvpq_last_error());
        return 1;
    }
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    if (ctx < 1 || ctx > mi.n_ctx_train) {
        fprintf(stderr, "bench_swa_memory: context %d: expected 1..%d\n", ctx, mi.n_ctx_train);
        return 2;
    }
    const int n_local = mi.n_swa_layers, n_global = mi.n_layer - n_local;
    printf("model %s (%s): %d layers, %d local (sliding window %d), %d global; n_head_kv %d, head_dim %d; "
           "context %d\n",
           mi.name, mi.arch, mi.n_layer, n_local, mi.sliding_window, n_global, mi.n_head_kv, mi.head_dim, ctx);
    printf("%-8s %14s %16s %16s %14s %12s\n", "cache", "global [MiB]", "local unbnd [MiB]", "local windowed",
           "total w/ swa", "local ratio");
    const size_t row = (size_t)mi.n_head_kv * mi.head_dim;
    float *k = malloc(BLOCK * row * sizeof *k), *v = malloc(BLOCK * row * sizeof *v);
    uint64_t seed = 1;
    for (size_t i = 0; i < BLOCK * row; i++) k[i] = bench_normal(&seed), v[i] = bench_normal(&seed);
    kvpq_codebook *cb = NULL;
    for (char *spec = strtok(specs, ","); spec; spec = strtok(NULL, ",")) {
        kvpq_cache *cw = open_cache(m, spec, ctx, 1, &cb), *cf = open_cache(m, spec, ctx, 0, &cb);
        if (!cw || !cf) {
            fprintf(stderr, "bench_swa_memory: cache %s: %s\n", spec, kvpq_last_error());
            return 1;
        }
        for (int pos = 0; pos < ctx; pos += BLOCK) {
            int n = ctx - pos < BLOCK ? ctx - pos : BLOCK;
            for (int l = 0; l < mi.n_layer; l++)
                if (kvpq_cache_append(cw, l, n, k, v) != KVPQ_OK || kvpq_cache_append(cf, l, n, k, v) != KVPQ_OK) {
                    fprintf(stderr, "bench_swa_memory: append: %s\n", kvpq_last_error());
                    return 1;
                }
        }
        const double MiB = 1024.0 * 1024.0;
        double tf = (double)kvpq_cache_resident_bytes(cf), tw = (double)kvpq_cache_resident_bytes(cw);
        double global = tf * n_global / mi.n_layer, local_f = tf - global, local_w = tw - global;
        printf("%-8s %14.2f %16.2f %16.2f %14.2f %11.1fx\n", spec, global / MiB, local_f / MiB, local_w / MiB,
               tw / MiB, local_f / local_w);
        kvpq_cache_free(cw);
        kvpq_cache_free(cf);
    }
    free(k), free(v);
    kvpq_codebook_free(cb);
    kvpq_model_free(m);
    return 0;
}
