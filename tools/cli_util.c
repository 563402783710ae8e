/* cli_util.c — helpers shared by the kvpq subcommands. */
#include <errno.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"

int cli_fail(const char *what, kvpq_status s) {
    const char *detail = kvpq_last_error();
    /* The detail may quote a file's strings (a tensor name, a metadata key): escaped. */
    fprintf(stderr, "kvpq %s: %s%s", what, kvpq_status_string(s), detail[0] ? ": " : "");
    cli_fput_escaped(stderr, detail, strlen(detail), (size_t)-1);
    fputc('\n', stderr);
    return 1;
}

/* Bytes of the valid UTF-8 sequence at s[0..n) that may go to a terminal as they are; 0 for a C0
 * control or DEL, a byte of an invalid or truncated sequence, or a C1 control (U+0080..U+009F,
 * e.g. U+009B CSI, which some terminals obey). */
static size_t printable_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    if (c < 0x20 || c == 0x7f) return 0;
    if (c < 0x80) return 1;
    size_t l = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    if (!l || l > n) return 0;
    unsigned cp = c & (0x7fu >> l);
    for (size_t i = 1; i < l; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3fu);
    }
    static const unsigned min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[l] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f)) return 0;
    return l;
}

size_t cli_fput_escaped(FILE *f, const char *str, size_t len, size_t max) {
    const unsigned char *s = (const unsigned char *)str;
    size_t w = 0;
    for (size_t i = 0; i < len && i < max;) {
        size_t l = printable_len(s + i, len - i);
        if (l == 1 && s[i] == '\\') w += (size_t)fprintf(f, "\\\\");
        else if (l) w += fwrite(s + i, 1, l, f);
        else if (s[i] == '\n') w += (size_t)fprintf(f, "\\n");
        else w += (size_t)fprintf(f, "\\x%02x", s[i]);
        i += l ? l : 1;
    }
    return w;
}

int cli_usage_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kvpq: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 2;
}

/* Plain decimal text only: strtol / strtod also take leading white space, and strtod hexadecimal
 * ("0x10"), "inf" and "nan", which no option means. */
static int plain_decimal(const char *s, int frac) {
    if (!s || !*s) return 0;
    for (const char *c = s; *c; c++)
        if (!((*c >= '0' && *c <= '9') || *c == '+' || *c == '-' || (frac && (*c == '.' || *c == 'e' || *c == 'E'))))
            return 0;
    return 1;
}

int cli_parse_int(const char *opt, const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = plain_decimal(s, 0) ? strtol(s, &end, 10) : 0;
    if (!plain_decimal(s, 0) || errno || end == s || *end || v < lo || v > hi) {
        cli_usage_error("%s: expected an integer in [%ld, %ld], got '%s'", opt, lo, hi, s ? s : "(missing)");
        return 0;
    }
    *out = v;
    return 1;
}

int cli_parse_double(const char *opt, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = plain_decimal(s, 1) ? strtod(s, &end) : 0;
    if (!plain_decimal(s, 1) || errno || end == s || *end || !(v >= lo && v <= hi)) {
        cli_usage_error("%s: expected a number in [%g, %g], got '%s'", opt, lo, hi, s ? s : "(missing)");
        return 0;
    }
    *out = v;
    return 1;
}

double cli_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- option names ---- */

/* Levenshtein distance of a and b (insertions, deletions, substitutions), capped at 99. */
static int edit_distance(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 64 || nb > 64) return 99;
    int row[65];
    for (size_t j = 0; j <= nb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            diag = up;
            row[j] = best;
        }
    }
    return row[nb];
}

const char *cli_nearest(const char *word, const char *const *known) {
    const char *best = NULL;
    int best_d = 99;
    for (size_t i = 0; known && known[i]; i++) {
        int d = edit_distance(word, known[i]);
        if (d < best_d) best_d = d, best = known[i];
    }
    /* Close enough to be a typo: a third of the word's letters, at least 2 edits. */
    size_t n = strlen(word);
    int limit = n / 3 > 2 ? (int)(n / 3) : 2;
    return best && best_d <= limit ? best : NULL;
}

int cli_option_known(const char *opt, const char *const *known) {
    for (size_t i = 0; known && known[i]; i++)
        if (!strcmp(opt, known[i])) return 1;
    return 0;
}

int cli_unknown_option(const char *cmd, const char *opt, const char *const *known) {
    const char *near = cli_nearest(opt, known);
    if (near) return cli_usage_error("%s: unknown option '%s'; did you mean '%s'? (see kvpq %s --help)", cmd, opt, near, cmd);
    return cli_usage_error("%s: unknown option '%s' (see kvpq %s --help)", cmd, opt, cmd);
}

/* ---- options by table ---- */

int cli_parse_bytes(const char *opt, const char *s, size_t *out) {
    char *end;
    errno = 0;
    unsigned long long v = (s[0] >= '0' && s[0] <= '9') ? strtoull(s, &end, 10) : 0;
    if (s[0] < '0' || s[0] > '9' || errno) goto bad;
    int shift = !*end ? 0 : !strcmp(end, "K") ? 10 : !strcmp(end, "M") ? 20 : !strcmp(end, "G") ? 30 : -1;
    if (shift < 0 || v > (~0ull >> (shift + 1))) goto bad;
    *out = (size_t)(v << shift);
    return 1;
bad:
    cli_usage_error("%s: expected a byte count (e.g. 1048576, 512M, 2G), got '%s'", opt, s);
    return 0;
}

/* The table's entry named a (by name or alias), or NULL. */
static const cli_opt *opt_find(const cli_opt *t, const char *a) {
    for (; t->name; t++)
        if (!strcmp(a, t->name) || (t->alias && !strcmp(a, t->alias))) return t;
    return NULL;
}

/* "unknown option" for a, with the nearest of the table's names; returns 2. */
static int opt_unknown(const char *cmd, const char *a, const cli_opt *t) {
    const char *names[256];
    size_t n = 0;
    names[n++] = "--help";
    for (; t->name && n + 3 < sizeof names / sizeof *names; t++) {
        names[n++] = t->name;
        if (t->alias) names[n++] = t->alias;
    }
    names[n] = NULL;
    return cli_unknown_option(cmd, a, names);
}

/* Option o's value v into its field: 1, or 0 (message printed). */
static int opt_store(const char *cmd, const cli_opt *o, const char *a, const char *v, char *base) {
    long l;
    switch (o->kind) {
    case CLI_OPT_PATH:
        if (!*v) return cli_usage_error("%s: %s: expected a file name, got ''", cmd, a), 0;
        /* fallthrough */
    case CLI_OPT_STR: *(const char **)(base + o->off) = v; return 1;
    case CLI_OPT_LONG:
        if (!cli_parse_int(a, v, (long)o->lo, (long)o->hi, &l)) return 0;
        *(long *)(base + o->off) = l;
        return 1;
    case CLI_OPT_DOUBLE: return cli_parse_double(a, v, o->lo, o->hi, (double *)(base + o->off));
    case CLI_OPT_BYTES: return cli_parse_bytes(a, v, (size_t *)(base + o->off));
    default: return 1;
    }
}

int cli_parse_options(const char *cmd, int argc, char **argv, const cli_opt *table, void *opts,
                      void (*usage)(FILE *)) {
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage(stdout), 0;
        const cli_opt *o = opt_find(table, a);
        if (!o) return opt_unknown(cmd, a, table);
        if (o->kind == CLI_OPT_FLAG) *(int *)((char *)opts + o->off) = 1;
        if (o->kind == CLI_OPT_QUIET) cli_quiet = 1;
        if (o->kind == CLI_OPT_FLAG || o->kind == CLI_OPT_QUIET) continue;
        if (i + 1 >= argc) return cli_usage_error("%s: option %s needs a value (see --help)", cmd, a);
        if (!opt_store(cmd, o, a, argv[++i], opts)) return 2;
    }
    return -1;
}

/* ---- files of the source tree ---- */

const char *cli_find_data(const char *rel, char *buf, size_t n) {
    if (access(rel, R_OK) == 0) return rel;
#ifdef KVPQ_SOURCE_DIR
    if ((size_t)snprintf(buf, n, "%s/%s", KVPQ_SOURCE_DIR, rel) < n && access(buf, R_OK) == 0) return buf;
#endif
    (void)buf, (void)n;
    return NULL;
}

/* ---- progress ---- */

int cli_quiet = 0;

/* Seconds between plain progress lines when stderr is not a terminal (KVPQ_PROGRESS_SECONDS). */
static double plain_interval(void) {
    const char *e = getenv("KVPQ_PROGRESS_SECONDS");
    char *end;
    double v = e ? strtod(e, &end) : 0;
    return e && end != e && v >= 0 ? v : 10.0;
}

static void fmt_duration(char *buf, size_t n, double s) {
    if (!(s >= 0) || s > 360000) snprintf(buf, n, "?");
    else if (s < 60) snprintf(buf, n, "%.0fs", s);
    else if (s < 3600) snprintf(buf, n, "%dm%02ds", (int)s / 60, (int)s % 60);
    else snprintf(buf, n, "%dh%02dm", (int)s / 3600, (int)s % 3600 / 60);
}

void cli_progress_begin(cli_progress *p, const char *what, const char *unit, double total) {
    memset(p, 0, sizeof *p);
    snprintf(p->what, sizeof p->what, "%s", what);
    p->unit = unit;
    p->total = total;
    p->t0 = p->last = cli_now();
    p->tty = isatty(fileno(stderr));
    p->interval = p->tty ? 0.2 : plain_interval();
}

static void progress_print(cli_progress *p, double done, const char *note, int final) {
    const double el = cli_now() - p->t0, rate = el > 0 ? done / el : 0;
    char eta[16], took[16];
    fmt_duration(eta, sizeof eta, rate > 0 ? (p->total - done) / rate : -1);
    fmt_duration(took, sizeof took, el);
    fprintf(stderr, "%skvpq %s: %.0f/%.0f %s (%.0f%%), %.3g %s/s, %s %s%s%s%s%s", p->tty ? "\r" : "", p->what, done,
            p->total, p->unit, p->total > 0 ? 100.0 * done / p->total : 100.0, rate, p->unit,
            final ? "took" : "ETA", final ? took : eta, note && *note ? "; " : "", note ? note : "",
            p->tty ? "\033[K" : "", p->tty && !final ? "" : "\n");
    fflush(stderr);
    p->printed = 1;
}

void cli_progress_update(cli_progress *p, double done, const char *note) {
    if (cli_quiet) return;
    const double now = cli_now();
    if (now - p->last < p->interval) return;
    p->last = now;
    progress_print(p, done, note, 0);
}

void cli_progress_end(cli_progress *p, double done, const char *note) {
    if (cli_quiet) return;
    /* A run too short to have printed anything ends silently, unless lines are asked for always. */
    if (!p->printed && cli_now() - p->t0 < 2.0 && p->interval > 0) return;
    progress_print(p, done, note, 1);
}

/* The file a write to path replaces: path, or the file its chain of symbolic links names. */
static void resolve_links(const char *path, char *out, size_t cap) {
    snprintf(out, cap, "%s", path);
    for (int hop = 0; hop < 40; hop++) {
        char link[PATH_MAX];
        ssize_t n = readlink(out, link, sizeof link - 1);
        if (n < 0) return;
        link[n] = '\0';
        char *slash = strrchr(out, '/');
        if (link[0] != '/' && slash) {
            size_t dir = (size_t)(slash - out + 1);
            if (dir + (size_t)n >= cap) return;
            memcpy(out + dir, link, (size_t)n + 1);
        } else {
            snprintf(out, cap, "%s", link);
        }
    }
}

int cli_check_output(const char *cmd, const char *out, int n_inputs, const char *const *in_opts,
                     const char *const *inputs) {
    char target[PATH_MAX];
    resolve_links(out, target, sizeof target);
    struct stat so;
    if (stat(target, &so) == 0) {
        if (!S_ISREG(so.st_mode))
            return cli_usage_error("%s: -o '%s' is not a regular file (%s)", cmd, out,
                                   S_ISDIR(so.st_mode) ? "a directory" : "a device, FIFO or socket");
        for (int i = 0; i < n_inputs; i++) {
            struct stat si;
            if (inputs[i] && stat(inputs[i], &si) == 0 && si.st_dev == so.st_dev && si.st_ino == so.st_ino)
                return cli_usage_error("%s: -o '%s' is the same file as %s '%s': it would be overwritten", cmd, out,
                                       in_opts[i], inputs[i]);
        }
    }
    /* Writable? Create (and remove) a file where the save will create its temporary file. */
    char probe[PATH_MAX + 32];
    snprintf(probe, sizeof probe, "%s.kvpq.tmp.probe.XXXXXX", target);
    int fd = mkstemp(probe);
    if (fd < 0) return cli_usage_error("%s: -o '%s': cannot write there: %s", cmd, out, strerror(errno));
    close(fd);
    unlink(probe);
    return 0;
}
