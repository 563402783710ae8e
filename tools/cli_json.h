/* cli_json.h — the one shape of every `--json` output (docs/json.md):
 *   {"schema": "kvpq.<command>/1", "kvpq_version": "...", "settings": {...}, "results": [{...}, ...]}
 * settings: the run's options and environment (model, text, threads, simd, ...); results: one flat
 * object per row of the command's table. A change that renames or removes a field bumps the /1. */
#ifndef KVPQ_CLI_JSON_H
#define KVPQ_CLI_JSON_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

/* A new document for `command` ("ppl", "bench.decode", ...); *settings and *results point into it.
 * NULL when out of memory. */
cJSON *cli_json_new(const char *command, cJSON **settings, cJSON **results);
/* Print the document to stdout and free it. Returns 0, or 1 (message printed) when printing failed. */
int cli_json_print(cJSON *root);
/* A number, or null when it is not finite (JSON has no NaN). */
void cli_json_num(cJSON *o, const char *key, double v);

/* s (n bytes) as valid UTF-8 (malloc'd; NULL when out of memory): each byte of an invalid or
 * truncated sequence becomes U+FFFD (a reply cut inside a character, a token of stray bytes). */
char *cli_utf8_clean(const char *s, size_t n);
/* A JSON array of token ids. */
cJSON *cli_json_ids(const int32_t *t, size_t n);

#endif
