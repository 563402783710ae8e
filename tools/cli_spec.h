/* cli_spec.h — the `--cache SPEC` grammar of the CLI (generate, ppl, chat), parsed without a model
 * so that it can be tested alone (tests/test_cli_spec.c). Uses kvpq.h only.
 *
 *   SPEC   = KIND { ":" SUFFIX }  |  "vq:" PATH { ":" SUFFIX }  |  "vq:" PATH ":" { ":" SUFFIX }
 *   KIND   = fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 | tq2 tq3 tq4 (TurboQuant's MSE quantizer at
 *            2, 3, 4 bits per coordinate: a vq cache of the codebook kvpq_codebook_turboquant builds for
 *            the model; window and sinks 0 unless :wN / :sN)
 *   SUFFIX = "w" N  (fp16 window of vq / kivi caches, N in 0..2^20)
 *          | "s" N  (attention sinks of a quantized cache, N in 0..65536)
 *          | "force" (vq only: use a codebook calibrated on another model)
          | "cuda"  (vq only: the cache on the GPU, kvpq_cache's CUDA backend; the model's layers stay
                     on the CPU)
 * Suffixes come in any order, each at most once. After a kind every ":" part must be a suffix. A vq
 * PATH may contain ':': the suffixes are the trailing ":" parts that read as suffixes, scanning from
 * the end; the first part that does not (or an empty part, "::" or a trailing ":") ends them, and
 * everything before is the path. So `vq:run:2.safetensors:w64` is the file `run:2.safetensors` with a
 * window of 64, and a file whose own name ends in a suffix-like part (`cb:w5`) is named with an empty
 * part after it: `vq:cb:w5:` (no suffixes) or `vq:cb:w5::s1`. */
#ifndef KVPQ_CLI_SPEC_H
#define KVPQ_CLI_SPEC_H

#include <stddef.h>

#include "kvpq.h"

typedef struct {
    kvpq_cache_type type;
    char path[256]; /* vq: the codebook file; "" for the other kinds */
    int window;     /* :wN, -1 when not given */
    int sinks;      /* :sN, -1 when not given */
    int force;      /* :force given */
    int tq_bits;    /* tqN: N (type is then KVPQ_CACHE_VQ, path ""); 0 otherwise */
    int cuda;       /* :cuda given: backend KVPQ_BACKEND_CUDA */
} cli_cache_spec;

/* Parse spec into *out. Returns 0, or 2 (a usage error: the exit code) with a message naming the
 * SPEC and the offending part in err (errlen bytes): an unknown kind or suffix, a duplicate suffix, a
 * suffix the kind does not take (:wN on a kind without a window, :sN on fp32/fp16, :force or :cuda on
 * a kind without a codebook), N out of range, a vq SPEC without a path, a SPEC longer than 255 bytes. */
int cli_cache_spec_parse(const char *spec, cli_cache_spec *out, char *err, size_t errlen);

/* Parse spec and print the refusal (kvpq: ...) on stderr: 0, or exit code 2. The commands check
 * every SPEC this way before loading the model. */
int cli_cache_spec_check(const char *spec);

#endif
