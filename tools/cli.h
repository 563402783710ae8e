/* cli.h — the kvpq command-line tool's subcommands and small shared helpers. Uses kvpq.h only. */
#ifndef KVPQ_CLI_H
#define KVPQ_CLI_H

#include <stdio.h>
#include "kvpq_model.h"

/* Each subcommand gets argv starting at its own name (argv[0] = "info", ...); returns the exit code. */
int cmd_info_gguf(int argc, char **argv, const char *path);      /* info_gguf.c */
int cmd_info_codebook(int argc, char **argv, const char *path);  /* info_codebook.c */
int info_json(const char *path, int is_gguf);                    /* info_json.c: kvpq info FILE --json */
int cmd_bench_encode(int argc, char **argv);                     /* bench_encode.c */
int cmd_bench_attend(int argc, char **argv);                     /* bench_attend.c */
int cmd_bench_decode(int argc, char **argv);                     /* bench_decode.c */
int cmd_calibrate(int argc, char **argv);                        /* cmd_calibrate.c */
int cmd_generate(int argc, char **argv);                         /* cmd_generate.c */
int cmd_chat(int argc, char **argv);                             /* cmd_chat.c */
int cmd_ppl(int argc, char **argv);                              /* cmd_ppl.c */
int cmd_serve(int argc, char **argv);                            /* cmd_serve.c */

/* Print "kvpq <what>: <status string>: <kvpq_last_error()>" to stderr; returns exit code 1. */
int cli_fail(const char *what, kvpq_status s);
/* Write len bytes of a string read from a file (at most max) for a terminal: control characters
 * (C0, DEL, C1), invalid UTF-8 and '\n' as \xNN / \n escapes, '\\' doubled, the rest as it is.
 * Every string from a file that kvpq prints goes through here (issue 14: an ESC sequence in a
 * codebook's metadata reached the terminal). Returns the bytes written. */
size_t cli_fput_escaped(FILE *f, const char *s, size_t len, size_t max);
/* Check an output path before any work: refuse it (usage error printed, returns 2) when it names
 * the same file as one of the n_inputs (same device and inode, through symbolic and hard links:
 * `calibrate --model m.gguf -o m.gguf` replaced the model), when it exists and is not a regular
 * file, or when no file can be created where it will be written (the file a symbolic link names).
 * in_opts[i] names inputs[i] in the message ("--model"); an input may be NULL. Returns 0 if fine. */
int cli_check_output(const char *cmd, const char *out, int n_inputs, const char *const *in_opts,
                     const char *const *inputs);
/* Print "kvpq: <printf message>" to stderr; returns exit code 2 (usage error). */
int cli_usage_error(const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 1, 2)))
#endif
    ;
/* Strict number parsing: the whole string must be a number in range; else a usage error message
 * naming the option and 0 is returned. */
int cli_parse_int(const char *opt, const char *s, long lo, long hi, long *out);
int cli_parse_double(const char *opt, const char *s, double lo, double hi, double *out);
/* Set the defaults the CLI's libraries read at load time (OMP_WAIT_POLICY=PASSIVE,
 * OPENBLAS_NUM_THREADS=1, OPENBLAS_CORETYPE where OpenBLAS misdetects the CPU; a value the user set
 * is kept) and re-execute once so they take effect (cli_env.c). Returns when nothing needs doing. */
void cli_env_fixup(char **argv);
/* Option names: `known` is a NULL-terminated list of a command's options. cli_option_known: 1 if
 * opt is one of them. cli_nearest: the known name within a few edits of `word` (a typo), or NULL.
 * cli_unknown_option prints "kvpq: CMD: unknown option 'X'; did you mean 'Y'?" and returns 2. */
int cli_option_known(const char *opt, const char *const *known);
const char *cli_nearest(const char *word, const char *const *known);
int cli_unknown_option(const char *cmd, const char *opt, const char *const *known);
/* ---- options by table ----
 * A command lists its options once: name, alias (or NULL), what the value is and the field of the
 * command's options struct (offsetof) it goes to. --help / -h print the command's usage. */
typedef enum {
    CLI_OPT_FLAG,   /* no value: int field set to 1 */
    CLI_OPT_QUIET,  /* no value: cli_quiet = 1 (no field) */
    CLI_OPT_STR,    /* const char * field */
    CLI_OPT_PATH,   /* const char * field, not empty ("expected a file name") */
    CLI_OPT_LONG,   /* long field, an integer in [lo, hi] */
    CLI_OPT_DOUBLE, /* double field, a number in [lo, hi] */
    CLI_OPT_BYTES,  /* size_t field, a byte count with an optional K, M or G (powers of 1024) */
} cli_opt_kind;
typedef struct {
    const char *name, *alias;
    cli_opt_kind kind;
    size_t off;
    double lo, hi;
} cli_opt;
/* argv[1..] into the struct at opts by the table (ended by an entry with name NULL): -1 to go on, 0
 * after --help (usage(stdout) printed), else the exit code (message printed: unknown option with the
 * nearest name, a missing value, a value out of range, all naming `cmd`). Later options win. */
int cli_parse_options(const char *cmd, int argc, char **argv, const cli_opt *table, void *opts,
                      void (*usage)(FILE *));
/* "123", "64K", "512M", "2G" (powers of 1024) into *out: 1, or 0 with a usage error naming opt. */
int cli_parse_bytes(const char *opt, const char *s, size_t *out);
/* A file the CLI uses by default (rel: a path inside the source tree, e.g. data/text/persuasion.txt):
 * rel itself when readable from the current directory, else the copy in the source tree the CLI was
 * built from (written to buf, n bytes); NULL when neither is readable. */
const char *cli_find_data(const char *rel, char *buf, size_t n);
/* ---- progress (stderr) ----
 * On a terminal: one line rewritten in place (\r) at most every 0.2 s; otherwise a plain line every
 * KVPQ_PROGRESS_SECONDS (default 10; 0: every update). Each line: done/total, percent, rate and ETA;
 * the end line says how long it took (omitted for a run under 2 s that printed nothing). --quiet
 * (cli_quiet = 1) silences them. */
extern int cli_quiet;
typedef struct {
    char what[128];
    const char *unit;
    double total, t0, last, interval;
    int tty, printed;
} cli_progress;
void cli_progress_begin(cli_progress *p, const char *what, const char *unit, double total);
void cli_progress_update(cli_progress *p, double done, const char *note);
void cli_progress_end(cli_progress *p, double done, const char *note);
/* Seconds from a monotonic clock. */
double cli_now(void);

#endif
