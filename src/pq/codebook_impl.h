/* codebook_impl.h — codebook file internals shared with the fuzzer and tests. Internal. */
#ifndef KVPQ_CODEBOOK_IMPL_H
#define KVPQ_CODEBOOK_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "kvpq.h"

/* The safetensors format version this build writes and reads (metadata kvpq.format_version). */
#define KVPQ_CODEBOOK_FORMAT_VERSION "5" /* written when a codebook codes keys before RoPE */
#define KVPQ_CODEBOOK_FORMAT_VERSION_V4 "4" /* written when a codebook uses head granularity or two key
                                             * stages; else "3", so older builds still read it */
#define KVPQ_CODEBOOK_FORMAT_VERSION_PLAIN "3" /* versions 1 (no k.mean), 2 (no k.norm, v.norm) read too */

/* Largest JSON header accepted (the safetensors reference reader's limit is 100 MB as well). */
#define KVPQ_CODEBOOK_MAX_HEADER ((uint64_t)100 * 1000 * 1000)

/* Parse and validate a whole codebook file held in memory: buf: (len) bytes. `name` names the
 * source in error messages ("codebook file '<name>': ..."). Same checks and errors as
 * kvpq_codebook_load; used by it and by the fuzzer. */
kvpq_status kvpq__codebook_load_mem(kvpq_codebook **out, const uint8_t *buf, size_t len, const char *name);

#endif
