/* info_json.c — `kvpq info FILE --json` (schema kvpq.info/1, docs/json.md): one flat row for a GGUF
 * model (what kvpq's forward pass sees of it) or a codebook file (its shape, quantizers and every
 * metadata entry as a "meta.KEY" string field). */
#include <cjson/cJSON.h>
#include <string.h>

#include "cli.h"
#include "cli_json.h"

/* The model's row: whether kvpq runs it, and the shape its KV cache gets. */
static int gguf_row(cJSON *o, const char *path) {
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, path, NULL);
    cJSON_AddBoolToObject(o, "runs", s == KVPQ_OK);
    if (s != KVPQ_OK) {
        cJSON_AddStringToObject(o, "error", kvpq_last_error());
        return 0;
    }
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    cJSON_AddStringToObject(o, "arch", mi.arch);
    cJSON_AddStringToObject(o, "name", mi.name);
    cJSON_AddStringToObject(o, "fingerprint", mi.fingerprint);
    const struct { const char *key; int v; } ints[] = {
        {"n_layer", mi.n_layer}, {"n_head", mi.n_head}, {"n_head_kv", mi.n_head_kv}, {"head_dim", mi.head_dim},
        {"n_embd", mi.n_embd}, {"n_vocab", mi.n_vocab}, {"n_ctx_train", mi.n_ctx_train},
        {"sliding_window", mi.sliding_window}, {"n_swa_layers", mi.n_swa_layers}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) cJSON_AddNumberToObject(o, ints[i].key, ints[i].v);
    kvpq_model_free(m);
    return 0;
}

static void quantizer(cJSON *o, const char *kind, const kvpq_pq_params *q) {
    char key[32];
    snprintf(key, sizeof key, "%s_M", kind);
    cJSON_AddNumberToObject(o, key, q->M);
    snprintf(key, sizeof key, "%s_nbits", kind);
    cJSON_AddNumberToObject(o, key, q->nbits);
    snprintf(key, sizeof key, "%s_granularity", kind);
    cJSON_AddStringToObject(o, key, q->granularity == KVPQ_CODEBOOK_SHARED     ? "shared"
                                    : q->granularity == KVPQ_CODEBOOK_SUBSPACE ? "subspace"
                                                                               : "head");
}

/* The codebook's row: shape, quantizers, and every metadata entry. */
static int codebook_row(cJSON *o, const char *path) {
    kvpq_codebook *cb = NULL;
    kvpq_status s = kvpq_codebook_load(&cb, path);
    if (s != KVPQ_OK) return cli_fail("info", s);
    const kvpq_codebook_params p = kvpq_codebook_get_params(cb);
    cJSON_AddNumberToObject(o, "n_layer", p.n_layer);
    cJSON_AddNumberToObject(o, "n_head_kv", p.n_head_kv);
    cJSON_AddNumberToObject(o, "head_dim", p.head_dim);
    quantizer(o, "key", &p.key);
    quantizer(o, "value", &p.value);
    cJSON_AddNumberToObject(o, "key_stages", p.key_stages > 1 ? 2 : 1);
    cJSON_AddBoolToObject(o, "value_rotate", p.value_rotate);
    cJSON_AddBoolToObject(o, "key_norm", p.key_norm);
    cJSON_AddBoolToObject(o, "value_norm", p.value_norm);
    cJSON_AddNumberToObject(o, "key_rope_dims", p.key_rope_dims); /* 0: keys coded after RoPE */
    if (p.key_rope_dims) cJSON_AddStringToObject(o, "key_rope", p.key_rope_neox ? "neox" : "norm");
    char key[300];
    for (size_t i = 0; i < kvpq_codebook_meta_count(cb); i++) {
        const char *k = kvpq_codebook_meta_key(cb, i);
        snprintf(key, sizeof key, "meta.%s", k);
        if (!cJSON_GetObjectItemCaseSensitive(o, key)) cJSON_AddStringToObject(o, key, kvpq_codebook_get_meta(cb, k));
    }
    kvpq_codebook_free(cb);
    return 0;
}

int info_json(const char *path, int is_gguf) {
    cJSON *settings = NULL, *rows = NULL, *doc = cli_json_new("info", &settings, &rows);
    cJSON *o = cJSON_CreateObject();
    if (!doc || !o) {
        cJSON_Delete(doc), cJSON_Delete(o);
        return cli_usage_error("info: out of memory");
    }
    cJSON_AddStringToObject(settings, "file", path);
    cJSON_AddStringToObject(settings, "kind", is_gguf ? "gguf" : "codebook");
    cJSON_AddItemToArray(rows, o);
    int rc = is_gguf ? gguf_row(o, path) : codebook_row(o, path);
    if (rc) {
        cJSON_Delete(doc);
        return rc;
    }
    return cli_json_print(doc);
}
