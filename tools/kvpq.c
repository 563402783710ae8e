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
            "usage: kvpq <command> [options]   (kvpq help <command>, or kvpq <command> --help, for its options)\n"
            "  info FILE                  what a GGUF model or a kvpq codebook file holds\n"
            "  calibrate --model M ...    train codebooks on a model's real keys and values\n"
            "  generate --model M ...     generate text, with a chosen KV cache\n"
            "  chat --model M ...         multi-turn chat from stdin in the model's chat template, cache kept\n"
            "  ppl --model M --text F ... perplexity, with a chosen KV cache beside a baseline\n"
            "  serve --model M ...        an OpenAI-compatible HTTP server, conversations kept in compressed caches\n"
            "  bench encode|attend|decode ... benchmarks (ours beside baselines, one table)\n"
            "  version                    version, SIMD level, CUDA (built / device found)\n"
            "  help [COMMAND]             this text, or a command's options\n",
            kvpq_version());
}

static const char *const COMMANDS[] = {"info", "calibrate", "generate", "chat", "ppl", "serve", "bench", "version", "help", NULL};
static const char *const BENCHES[] = {"encode", "attend", "decode", NULL};

static int cmd_info(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fprintf(argc < 2 ? stderr : stdout, "usage: kvpq info FILE [--json]   (a .gguf model or a .safetensors codebook "
                                            "file; --json: one row, schema kvpq.info/1, docs/json.md)\n");
        return argc < 2 ? 2 : 0;
    }
    int json = 0;
    for (int i = 2; i < argc; i++) json |= !strcmp(argv[i], "--json");
    for (int i = 2; json && i < argc; i++)
        if (strcmp(argv[i], "--json") && strcmp(argv[i], "--quiet") && strcmp(argv[i], "-q"))
            return cli_usage_error("info: --json takes no other option than --quiet (got '%s')", argv[i]);
    const char *path = argv[1];
    /* Non-blocking, and only a regular file: `kvpq info FIFO` waited forever for a writer. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) return cli_usage_error("info: cannot open '%s': %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return cli_usage_error("info: '%s' is not a regular file", path);
    }
    char magic[8] = {0};
    ssize_t n = read(fd, magic, 8);
    close(fd);
    if (n >= 4 && !memcmp(magic, "GGUF", 4)) return json ? info_json(path, 1) : cmd_info_gguf(argc, argv, path);
    /* A saved cache was read as a codebook ("header length 4996252662716454475 exceeds ..."). */
    if (n == 8 && !memcmp(magic, "KVPQSAVE", 8)) {
        fprintf(stderr, "kvpq info: '%s' is a saved kvpq cache (kvpq_cache_save, generate --prompt-cache), which info "
                        "does not describe: it takes a .gguf model or a .safetensors codebook\n", path);
        return 1;
    }
    return json ? info_json(path, 0) : cmd_info_codebook(argc, argv, path);
}

static void bench_usage(FILE *f) {
    fprintf(f, "usage: kvpq bench encode|attend|decode [options]   (kvpq bench encode --help, ...)\n"
               "  encode   fused PQ encode beside the materializing path\n"
               "  attend   decode attention from codes beside the fp32 and fp16 caches\n"
               "  decode   end-to-end decode tokens/s of the model with each cache\n");
}

static int cmd_bench(int argc, char **argv) {
    if (argc >= 2 && !strcmp(argv[1], "encode")) return cmd_bench_encode(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "attend")) return cmd_bench_attend(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "decode")) return cmd_bench_decode(argc - 1, argv + 1);
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        bench_usage(stdout);
        return 0;
    }
    bench_usage(stderr);
    if (argc < 2) return 2;
    const char *near = cli_nearest(argv[1], BENCHES);
    if (near) return cli_usage_error("bench: unknown benchmark '%s'; did you mean '%s'?", argv[1], near);
    return cli_usage_error("bench: unknown benchmark '%s'", argv[1]);
}

static int cmd_version(void) {
    char why[256] = "";
    int ok = kvpq_cuda_available(why, sizeof why);
    printf("kvpq %s\nsimd %s\n", kvpq_version(), kvpq_simd_name(kvpq_simd_get()));
    if (ok) printf("cuda built, device found: %s\n", why);
    else if (strstr(why, "built without")) printf("cuda not built\n");
    else printf("cuda built, no device: %s\n", why);
    return 0;
}

/* argv[0] is the command's name. */
static int dispatch(int argc, char **argv) {
    const char *c = argv[0];
    if (!strcmp(c, "version") || !strcmp(c, "--version")) return cmd_version();
    if (!strcmp(c, "info")) return cmd_info(argc, argv);
    if (!strcmp(c, "bench")) return cmd_bench(argc, argv);
    if (!strcmp(c, "calibrate")) return cmd_calibrate(argc, argv);
    if (!strcmp(c, "generate")) return cmd_generate(argc, argv);
    if (!strcmp(c, "chat")) return cmd_chat(argc, argv);
    if (!strcmp(c, "ppl")) return cmd_ppl(argc, argv);
#ifdef KVPQ_HAVE_SERVE
    if (!strcmp(c, "serve")) return cmd_serve(argc, argv);
#else
    if (!strcmp(c, "serve"))
        return cli_usage_error("serve: this kvpq was built without libmicrohttpd (apt-get install libmicrohttpd-dev, "
                               "then build again)");
#endif
    const char *near = cli_nearest(c, COMMANDS);
    if (near) return cli_usage_error("unknown command '%s'; did you mean '%s'? (kvpq help)", c, near);
    usage(stderr);
    return cli_usage_error("unknown command '%s'", c);
}

/* kvpq help [COMMAND [BENCH]]: the command's --help. */
static int cmd_help(int argc, char **argv) {
    if (argc < 2) {
        usage(stdout);
        return 0;
    }
    char help[] = "--help";
    char *args[4] = {argv[1], help, NULL, NULL};
    int n = 2;
    if (!strcmp(argv[1], "bench") && argc >= 3) args[1] = argv[2], args[2] = help, n = 3;
    if (!strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "version")) {
        printf("usage: kvpq version   (version, SIMD level in use, CUDA: built / device found / not built)\n");
        return 0;
    }
    return dispatch(n, args);
}

/* A signal that ends the process first removes the temp files of saves in progress (an interrupted
 * calibrate left OUT.kvpq.tmp.PID.XXXXXX), then ends it as the default action would. */
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
    cli_env_fixup(argv);
    install_signal_cleanup();
    if (!strcmp(argv[1], "help")) return cmd_help(argc - 1, argv + 1);
    return dispatch(argc - 1, argv + 1);
}
