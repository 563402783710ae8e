/* bench_attend.c — placeholder until this subcommand is built (fails loudly, never pretends). */
#include "cli.h"

int cmd_bench_attend(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "kvpq: '%s' is not built yet\n", argv[0]);
    return 3;
}
