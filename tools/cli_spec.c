/* cli_spec.c — the CLI's wrappers of kvpq_cache_spec_parse (cli_spec.h). */
#include <stdio.h>

#include "cli_spec.h"

int cli_cache_spec_parse(const char *spec, cli_cache_spec *out, char *err, size_t errlen) {
    if (err && errlen) err[0] = '\0';
    if (kvpq_cache_spec_parse(spec, out) == KVPQ_OK) return 0;
    if (err && errlen) snprintf(err, errlen, "%s", kvpq_last_error());
    return 2;
}

int cli_cache_spec_check(const char *spec) {
    cli_cache_spec s;
    char err[512];
    if (cli_cache_spec_parse(spec, &s, err, sizeof err) == 0) return 0;
    fprintf(stderr, "kvpq: %s\n", err);
    return 2;
}
