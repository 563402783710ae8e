/* info_gguf.c — `kvpq info model.gguf`: what a GGUF file holds (through kvpq_gguf_describe). */
#include <string.h>

#include "cli.h"

int cmd_info_gguf(int argc, char **argv, const char *path) {
    int verbose = 0;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-v") || !strcmp(argv[i], "--verbose")) verbose = 1;
        else return cli_usage_error("info: unknown option '%s' (usage: kvpq info FILE.gguf [-v])", argv[i]);
    }
    kvpq_status s = kvpq_gguf_describe(path, stdout, verbose);
    if (s != KVPQ_OK) return cli_fail("info", s);
    /* Whether kvpq's forward pass runs it, and the shape its KV cache gets. */
    kvpq_model *m = NULL;
    s = kvpq_model_load(&m, path, NULL);
    printf("\nkvpq:\n");
    if (s != KVPQ_OK) {
        printf("  runs: no: %s: %s\n", kvpq_status_string(s), kvpq_last_error());
        return 0;
    }
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    size_t nt = 0;
    kvpq_status ts = kvpq_tokenize(m, "", 0, 0, 0, NULL, 0, &nt);
    printf("  runs: yes (architecture %s); tokenizer: %s%s\n", mi.arch, ts == KVPQ_OK ? "yes" : "no (token ids only): ",
           ts == KVPQ_OK ? "" : kvpq_last_error());
    printf("  KV cache: %d layers x %d KV heads x head_dim %d (%d query heads, %s %d:1)\n", mi.n_layer, mi.n_head_kv,
           mi.head_dim, mi.n_head, mi.n_head_kv == 1 ? "MQA" : "GQA", mi.n_head / mi.n_head_kv);
    if (mi.sliding_window > 0)
        printf("  sliding window: %d positions in %d of %d layers (their cache holds only those)\n", mi.sliding_window,
               mi.n_swa_layers, mi.n_layer);
    kvpq_model_free(m);
    return 0;
}
