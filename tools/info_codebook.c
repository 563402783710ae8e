/* info_codebook.c — placeholder until this subcommand is built (fails loudly, never pretends). */
#include "cli.h"

int cmd_info_codebook(int argc, char **argv, const char *path) {
    (void)path;
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvpq: '%s' is not built yet\n", argv[0]);
    return 3;
}
