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
    return 0;
}
