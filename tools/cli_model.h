/* cli_model.h — helpers shared by the model subcommands (generate, ppl): cache SPEC handling,
 * sampling, streaming of token pieces. Uses kvpq.h only. */
#ifndef KVPQ_CLI_MODEL_H
#define KVPQ_CLI_MODEL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvpq_model.h"

/* A KV cache made from a SPEC string (fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 vq:FILE) for a model. */
typedef struct {
    char spec[256];
    kvpq_cache *cache;
    kvpq_codebook *codebook; /* vq: only */
    kvpq_cache_params params; /* what the cache was made from (kvpq_cache_load takes the same) */
} cli_cache;

/* Create a cache sized for the model (its shape and sliding window) and max_seq positions. Prints
 * the error (naming the SPEC) and returns a non-zero exit code on failure. A vq codebook must have
 * been calibrated on this model (kvpq_codebook_check_model) unless the SPEC ends in ":force"; a file
 * that records no model loads with a warning. */
int cli_cache_open(cli_cache *c, const char *spec, const kvpq_model *m, int max_seq, int n_threads);
void cli_cache_close(cli_cache *c);
/* One stderr line on a cache's memory, its two figures labelled apart: the stored tokens' bytes and
 * bits per element (what the held positions take) and the resident bytes and bits per element
 * (allocated: whole pages, the window ring, codebooks; a short run is mostly this capacity). */
void cli_print_cache_memory(const char *cmd, const char *spec, const kvpq_cache *c, const kvpq_cache_stats *st);

/* ---- sampling ---- */
typedef struct {
    uint64_t s[4]; /* xoshiro256** state (Blackman & Vigna 2018) */
} cli_rng;
void cli_rng_seed(cli_rng *r, uint64_t seed);
/* Uniform in [0, 1). */
double cli_rng_uniform(cli_rng *r);

/* Next token from logits (n_vocab): greedy (argmax, lowest id on ties) when temp <= 0, else
 * softmax(logits / temp) restricted to the smallest set of most likely tokens whose probability
 * reaches top_p (nucleus sampling, Holtzman et al. 2019). work: (n_vocab) floats + (n_vocab) ints
 * of scratch the caller owns. */
int32_t cli_sample(const float *logits, int n_vocab, float temp, float top_p, cli_rng *r, float *work_p,
                   int32_t *work_idx);

/* ---- streaming text ---- */
/* Writes bytes of token pieces to a FILE, holding back an incomplete UTF-8 sequence at the end until
 * the bytes completing it arrive (a token may end in the middle of a character). On a terminal,
 * control characters and invalid bytes are written as \xNN (pieces are the model file's strings). */
typedef struct {
    unsigned char pend[8];
    size_t n_pend;
} cli_utf8_stream;
void cli_utf8_write(cli_utf8_stream *st, FILE *f, const char *bytes, size_t n);
/* Flush what is held back (invalid or truncated bytes are written as they are). */
void cli_utf8_flush(cli_utf8_stream *st, FILE *f);

/* 1 if the n bytes are valid UTF-8; else 0 and *bad_offset the offset of the first bad byte. */
int cli_utf8_valid(const unsigned char *s, size_t n, size_t *bad_offset);

/* Token ids written as decimal numbers with any separators ("[2, 818, 5279]" as llama-tokenize
 * --ids prints them, or "2 818 5279"): a malloc'd array and its count *n. NULL when out of memory,
 * a number exceeds int32 or is negative ('-' right before a digit). */
int32_t *cli_parse_ids(const char *s, size_t len, size_t *n);

/* Read a whole text file into a NUL-terminated buffer (caller frees). NULL with errno set on
 * failure, cli_read_error() then says why: a file that is not regular (a FIFO would block, a device
 * like /dev/zero never ends) is refused before reading, and so is one over CLI_MAX_TEXT_BYTES. */
#define CLI_MAX_TEXT_BYTES (256 << 20) /* 256 MiB: ~50 million tokens; a novel is ~1 MB */
char *cli_read_file(const char *path, size_t *len);
const char *cli_read_error(void);

#endif
