/* cli_spec.h — the CLI's view of the cache SPEC grammar (kvpq.h: kvpq_cache_spec_parse, its one
 * parser): the message into a buffer and the exit code, for generate, ppl, chat and serve. */
#ifndef KVPQ_CLI_SPEC_H
#define KVPQ_CLI_SPEC_H

#include <stddef.h>

#include "kvpq.h"

typedef kvpq_cache_spec cli_cache_spec;

/* Parse spec into *out. Returns 0, or 2 (a usage error: the exit code) with a message naming the
 * SPEC and the offending part in err (errlen bytes): an unknown kind or suffix, a duplicate suffix, a
 * suffix the kind does not take (:wN on a kind without a window, :sN on fp32/fp16, :force or :cuda on
 * a kind without a codebook), N out of range, a vq SPEC without a path, a SPEC longer than 255 bytes. */
int cli_cache_spec_parse(const char *spec, cli_cache_spec *out, char *err, size_t errlen);

/* Parse spec and print the refusal (kvpq: ...) on stderr: 0, or exit code 2. The commands check
 * every SPEC this way before loading the model. */
int cli_cache_spec_check(const char *spec);

#endif
