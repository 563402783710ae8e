/* kvpq.c — the kvpq command-line tool: dispatch to subcommands. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

static void usage(FILE *f) {
    fprintf(f,
            "kvpq %s — KV-cache compression by product quantization\n"
            "\n"
            "usage: kvpq <command> [options]   (kvpq <command> --help for its options)\n"
            "  info FILE                  what a GGUF model or a kvpq codebook file holds\n"
            "  calibrate --model M ...    train codebooks on a model's real keys and values\n"
            "  generate --model M ...     generate text, with a chosen KV cache\n"
            "  ppl --model M --text F ... perplexity, with a chosen KV cache beside a baseline\n"
            "  bench encode|attend|decode ... benchmarks (ours beside baselines, one table)\n"
            "  version                    print the version\n",
            kvpq_version());
}

static int cmd_info(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fprintf(argc < 2 ? stderr : stdout, "usage: kvpq info FILE   (a .gguf model or a .safetensors codebook file)\n");
        return argc < 2 ? 2 : 0;
    }
    const char *path = argv[1];
    /* Non-blocking, and only a regular file: `kvpq info FIFO` waited forever for a writer. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return cli_usage_error("info: cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return cli_usage_error("info: '%s' is not a regular file", path);
    }
    char magic[4] = {0};
    ssize_t n = read(fd, magic, 4);
    close(fd);
    if (n == 4 && !memcmp(magic, "GGUF", 4)) return cmd_info_gguf(argc, argv, path);
    return cmd_info_codebook(argc, argv, path);
}

static int cmd_bench(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "encode")) return cmd_bench_encode(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "attend")) return cmd_bench_attend(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "decode")) return cmd_bench_decode(argc - 1, argv + 1);
    fprintf(stderr, "usage: kvpq bench encode|attend|decode [options]   (kvpq bench encode --help)\n");
    return 2;
}

/* A signal that ends the process first removes the temp files of saves in progress (an interrupted
 * calibrate left OUT.tmp.XXXXXX), then ends it as the default action would. */
static void on_fatal_signal(int sig) {
    kvpq_remove_temp_files();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void install_signal_cleanup(void) {
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGXFSZ};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa, old;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        /* An ignored signal (nohup, a shell's background job) stays ignored. */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN) continue;
        sigaction(sigs[i], &sa, NULL);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *c = argv[1];
    cli_blas_fixup(argv);
    install_signal_cleanup();
    if (!strcmp(c, "version") || !strcmp(c, "--version")) {
        printf("kvpq %s (simd %s)\n", kvpq_version(), kvpq_simd_name(kvpq_simd_get()));
        return 0;
    }
    if (!strcmp(c, "info")) return cmd_info(argc - 1, argv + 1);
    if (!strcmp(c, "bench")) return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(c, "calibrate")) return cmd_calibrate(argc - 1, argv + 1);
    if (!strcmp(c, "generate")) return cmd_generate(argc - 1, argv + 1);
    if (!strcmp(c, "ppl")) return cmd_ppl(argc - 1, argv + 1);
    usage(stderr);
    return cli_usage_error("unknown command '%s'", c);
}
