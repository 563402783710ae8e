/* cli_util.c — helpers shared by the kvpq subcommands. */
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <time.h>

#include "cli.h"

int cli_fail(const char *what, kvpq_status s) {
    const char *detail = kvpq_last_error();
    fprintf(stderr, "kvpq %s: %s%s%s\n", what, kvpq_status_string(s), detail[0] ? ": " : "", detail);
    return 1;
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

int cli_parse_int(const char *opt, const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || errno || end == s || *end || v < lo || v > hi) {
        cli_usage_error("%s: expected an integer in [%ld, %ld], got '%s'", opt, lo, hi, s ? s : "(missing)");
        return 0;
    }
    *out = v;
    return 1;
}

int cli_parse_double(const char *opt, const char *s, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = s ? strtod(s, &end) : 0;
    if (!s || errno || end == s || *end || !(v >= lo && v <= hi)) {
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
