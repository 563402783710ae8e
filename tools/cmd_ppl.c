/* cmd_ppl.c — `kvpq ppl`: perplexity of a text with one or more KV caches, optionally beside a base
 * cache run on the same chunks in the same process (KL divergence, top-1 agreement). */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli_json.h"

#include "cli.h"
#include "cli_model.h"
#include "cli_spec.h"

#define PPL_MAX_CACHES 32

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq ppl --model M (--text FILE | --tokens FILE) [--ctx N] [--chunks K] [--batch B]\n"
            "                [--cache SPEC[,SPEC...]] [--kl-base SPEC] [--json] [--threads N]\n"
            "  --model M        GGUF model (architecture llama, qwen2 or gemma3)\n"
            "  --text FILE      UTF-8 text (a non-UTF-8 file is refused)\n"
            "  --tokens FILE    token ids instead of text (decimal, any separators, as llama-tokenize\n"
            "                   --ids prints them; BOS, if wanted, must be among them)\n"
            "  --ctx N          tokens per chunk (default 512; at most the model's training context)\n"
            "  --chunks K       chunks to score (default: every whole chunk of the text)\n"
            "  --batch B        tokens per kvpq_model_eval call (default: the chunk)\n"
            "  --cache SPECS    comma-separated KV caches to test: fp32 fp16 q8_0 q4_0 q8_0r q4_0r\n"
            "                   (llama.cpp's Hadamard-rotated q8_0 / q4_0) kivi2 kivi4\n"
            "                   vq:CODEBOOK.safetensors (default fp32); a suffix :wN sets the full-\n"
            "                   precision window of a vq or kivi cache (default 128), e.g. kivi2:w64; :sN\n"
            "                   keeps the first N positions of a quantized cache in fp16 (attention sinks,\n"
            "                   counted in bits/elem; default 1 for vq kivi2 kivi4 q4_0r, else 0; :s0\n"
            "                   turns it off), e.g. vq:cb.safetensors:s4; :force uses a vq codebook\n"
            "                   calibrated on another model; :cuda puts a vq cache on the GPU (the\n"
            "                   model's layers stay on the CPU; docs/CUDA.md); suffixes in any order,\n"
            "                   each once; a vq codebook from calibrate --bits brings its window and sinks\n"
            "  --kl-base SPEC   also run this cache on the same chunks and report, per test cache, the\n"
            "                   base perplexity, KL(base || test) per scored token (mean and 99th\n"
            "                   percentile, nats) and top-1 agreement; the base runs once per chunk\n"
            "  --json           print the results as JSON to stdout (schema kvpq.ppl/1, docs/json.md)\n"
            "  --threads N      CPU threads (default: OpenMP default)\n"
            "  --quiet          no progress lines on stderr\n"
            "Scoring as llama.cpp's perplexity tool: the text is tokenized once (BOS prepended when the\n"
            "model's tokenizer.ggml.add_bos_token says so), cut into non-overlapping chunks of N tokens;\n"
            "each chunk starts from an empty cache, its first token replaced by BOS when the model adds\n"
            "BOS; only the second half of each chunk is scored (the logits at positions N/2 .. N-2\n"
            "predict tokens N/2+1 .. N-1). PPL = exp(mean NLL); its standard error is\n"
            "sqrt(var(NLL) / (count - 1)) * PPL, as llama.cpp prints it.\n"
            "The matrices meet float32 activations (the reference path, so a cache's effect is measured\n"
            "alone) unless KVPQ_ACT is set: KVPQ_ACT=auto scores with the 8-bit activations that generate,\n"
            "chat and serve use (docs/cpu_kernels.md).\n");
}

typedef struct {
    cli_cache cc;
    kvpq_score_sums sums; /* over scored tokens (kvpq_score_test) */
    double seconds;     /* in kvpq_model_eval */
    float *kl;          /* (n_chunks * n_score) KL per scored token */
} ppl_run;

/* kvpq_eval_chunk, its wall seconds added to *seconds. */
static kvpq_status timed_eval_chunk(kvpq_model *m, kvpq_cache *c, const int32_t *toks, int n, int first, int batch,
                                    float *out, float *row, double *seconds) {
    const double t0 = cli_now();
    kvpq_status s = kvpq_eval_chunk(m, c, toks, n, first, batch, out, row);
    *seconds += cli_now() - t0;
    return s;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Percentile by linear interpolation between closest ranks (numpy's default). Sorts x. */
static double percentile(float *x, size_t n, double q) {
    if (n == 0) return NAN;
    qsort(x, n, sizeof *x, cmp_float);
    double r = q / 100.0 * (double)(n - 1);
    size_t lo = (size_t)r;
    size_t hi = lo + 1 < n ? lo + 1 : lo;
    return x[lo] + (r - (double)lo) * (x[hi] - x[lo]);
}

static void ppl_stats(double nll, double nll2, int64_t count, double *ppl, double *se) {
    double mean = nll / (double)count, var = nll2 / (double)count - mean * mean;
    *ppl = exp(mean);
    *se = var > 0 && count > 1 ? sqrt(var / (double)(count - 1)) * *ppl : NAN;
}

#define json_num cli_json_num

typedef struct {
    const char *model_path, *text_path, *ids_path, *kl_base; /* text_path is ids_path with --tokens */
    const char *cache_list;              /* --cache as given */
    char *specs_buf;                     /* a copy of it, split at ',' into specs */
    const char *specs[PPL_MAX_CACHES];
    int n_caches, json;
    long ctx, max_chunks, batch, threads;
} ppl_opts;

#define F(field) offsetof(ppl_opts, field)
static const cli_opt OPTS[] = {
    {"--json", NULL, CLI_OPT_FLAG, F(json), 0, 0},
    {"--quiet", "-q", CLI_OPT_QUIET, 0, 0, 0},
    {"--model", "-m", CLI_OPT_STR, F(model_path), 0, 0},
    {"--text", "-f", CLI_OPT_STR, F(text_path), 0, 0},
    {"--tokens", NULL, CLI_OPT_STR, F(ids_path), 0, 0},
    {"--cache", NULL, CLI_OPT_STR, F(cache_list), 0, 0},
    {"--kl-base", NULL, CLI_OPT_STR, F(kl_base), 0, 0},
    {"--ctx", "-c", CLI_OPT_LONG, F(ctx), 4, 1 << 24},
    {"--chunks", NULL, CLI_OPT_LONG, F(max_chunks), 1, 1L << 30},
    {"--batch", "-b", CLI_OPT_LONG, F(batch), 1, 1 << 24},
    {"--threads", "-t", CLI_OPT_LONG, F(threads), 0, 1024},
    {NULL, NULL, 0, 0, 0, 0},
};
#undef F

/* The cache list (default fp32) into o->specs: 0, or the exit code. */
static int split_specs(ppl_opts *o) {
    o->specs_buf = strdup(o->cache_list ? o->cache_list : "fp32");
    if (!o->specs_buf) return fprintf(stderr, "kvpq ppl: out of memory\n"), 1;
    for (char *tok = strtok(o->specs_buf, ","); tok; tok = strtok(NULL, ",")) {
        if (o->n_caches == PPL_MAX_CACHES) return cli_usage_error("ppl: at most %d caches in --cache", PPL_MAX_CACHES);
        o->specs[o->n_caches++] = tok;
    }
    if (o->n_caches == 0) return cli_usage_error("ppl: --cache: empty list");
    return 0;
}

/* argv into *o: -1 to go on, else the exit code (0 after --help). o->specs_buf is the caller's to free. */
static int parse_opts(int argc, char **argv, ppl_opts *o) {
    memset(o, 0, sizeof *o);
    o->ctx = 512;
    o->max_chunks = 1L << 30;
    int rc = cli_parse_options("ppl", argc, argv, OPTS, o, usage);
    if (rc >= 0) return rc;
    if (!o->model_path || !(o->text_path || o->ids_path) || (o->text_path && o->ids_path))
        return cli_usage_error("ppl: --model and one of --text, --tokens are required (see --help)");
    if (o->ids_path) o->text_path = o->ids_path;
    if (o->batch == 0 || o->batch > o->ctx) o->batch = o->ctx;
    rc = split_specs(o);
    return rc ? rc : -1;
}

/* A run: the model, the text's tokens, a cache per SPEC (and the base), the buffers and the sums. */
typedef struct {
    const ppl_opts *o;
    kvpq_model *m;
    kvpq_model_info mi;
    char *text;
    size_t text_len, n_tok;
    int32_t *toks;                 /* (n_tok) */
    long n_chunks;
    int C, first, n_score;         /* chunk tokens; the first logits row kept; scored tokens per chunk */
    float *logits, *base_lp, *row; /* (C - first, n_vocab), the same for the base, (n_vocab) */
    int *base_top;                 /* (n_score) the base's top-1 tokens */
    ppl_run runs[PPL_MAX_CACHES], base;
    int64_t count;                 /* tokens scored so far */
} ppl_state;

/* The text (or ids) file, UTF-8 checked for text: 0, or 1 (message printed). */
static int read_text(ppl_state *st) {
    const ppl_opts *o = st->o;
    size_t bad;
    st->text = cli_read_file(o->text_path, &st->text_len);
    if (!st->text) {
        fprintf(stderr, "kvpq ppl: cannot read text file '%s': %s\n", o->text_path, cli_read_error());
        return 1;
    }
    if (!o->ids_path && !cli_utf8_valid((const unsigned char *)st->text, st->text_len, &bad)) {
        fprintf(stderr, "kvpq ppl: text file '%s' is not valid UTF-8 (first bad byte at offset %zu)\n", o->text_path,
                bad);
        return 1;
    }
    return 0;
}

/* Every SPEC, the base's last, checked before the model loads: 0, or 2 (message printed). */
static int check_specs(const ppl_opts *o) {
    for (int i = 0; i < o->n_caches; i++)
        if (cli_cache_spec_check(o->specs[i])) return 2;
    return o->kl_base && cli_cache_spec_check(o->kl_base) ? 2 : 0;
}

/* The model, its context checked against --ctx: 0, or 1 (message printed). */
static int load_model(ppl_state *st) {
    setenv("KVPQ_ACT", "f32", 0); /* the reference path unless the user asks otherwise (usage) */
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)st->o->threads;
    kvpq_status s = kvpq_model_load(&st->m, st->o->model_path, &mp);
    if (s != KVPQ_OK) return cli_fail("ppl", s);
    kvpq_model_get_info(st->m, &st->mi);
    if (st->o->ctx > st->mi.n_ctx_train) {
        fprintf(stderr, "kvpq ppl: --ctx %ld exceeds the model's training context of %d tokens\n", st->o->ctx,
                st->mi.n_ctx_train);
        return 1;
    }
    return 0;
}

/* --tokens: the ids of the file, each checked against the vocabulary: 0, or 1 (message printed). */
static int parse_tokens(ppl_state *st) {
    const char *path = st->o->ids_path;
    st->toks = cli_parse_ids(st->text, st->text_len, &st->n_tok);
    if (!st->toks) {
        fprintf(stderr, "kvpq ppl: --tokens '%s': out of memory, or a negative number or one beyond int32\n", path);
        return 1;
    }
    for (size_t i = 0; i < st->n_tok; i++)
        if (st->toks[i] >= st->mi.n_vocab) {
            fprintf(stderr, "kvpq ppl: --tokens '%s': id %d at index %zu is beyond the vocabulary (%d)\n", path,
                    st->toks[i], i, st->mi.n_vocab);
            return 1;
        }
    return 0;
}

/* --text: the text tokenized (BOS as the model says): 0, or 1 (message printed). */
static int tokenize_text(ppl_state *st) {
    kvpq_status s = kvpq_tokenize(st->m, st->text, st->text_len, st->mi.add_bos, 0, NULL, 0, &st->n_tok);
    if (s == KVPQ_OK) {
        st->toks = malloc((st->n_tok ? st->n_tok : 1) * sizeof *st->toks);
        if (!st->toks) return fprintf(stderr, "kvpq ppl: out of memory\n"), 1;
        s = kvpq_tokenize(st->m, st->text, st->text_len, st->mi.add_bos, 0, st->toks, st->n_tok, &st->n_tok);
    }
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq ppl: text file '%s': ", st->o->text_path);
        return cli_fail("tokenize", s);
    }
    return 0;
}

/* The tokens and the chunks they make (at least one): 0, or 1 (message printed). */
static int read_tokens(ppl_state *st) {
    const ppl_opts *o = st->o;
    if (o->ids_path ? parse_tokens(st) : tokenize_text(st)) return 1;
    st->n_chunks = (long)(st->n_tok / (size_t)o->ctx);
    if (st->n_chunks > o->max_chunks) st->n_chunks = o->max_chunks;
    if (st->n_chunks < 1) {
        fprintf(stderr, "kvpq ppl: text file '%s' has %zu tokens, fewer than one chunk of --ctx %ld\n", o->text_path,
                st->n_tok, o->ctx);
        return 1;
    }
    st->C = (int)o->ctx;
    st->first = st->C / 2;
    st->n_score = st->C - 1 - st->first;
    return 0;
}

/* Every cache (and the base) opened, the logits and KL buffers: 0, or 1 (message printed). */
static int open_caches(ppl_state *st) {
    const ppl_opts *o = st->o;
    const int C = st->C, V = st->mi.n_vocab;
    for (int i = 0; i < o->n_caches; i++) {
        if (cli_cache_open(&st->runs[i].cc, o->specs[i], st->m, C, (int)o->threads)) return 1;
        st->runs[i].kl = o->kl_base ? malloc((size_t)st->n_chunks * st->n_score * sizeof(float)) : NULL;
        if (o->kl_base && !st->runs[i].kl) return fprintf(stderr, "kvpq ppl: out of memory\n"), 1;
    }
    if (o->kl_base && cli_cache_open(&st->base.cc, o->kl_base, st->m, C, (int)o->threads)) return 1;
    st->logits = malloc((size_t)(C - st->first) * V * sizeof *st->logits);
    st->row = malloc((size_t)V * sizeof *st->row);
    if (o->kl_base) {
        st->base_lp = malloc((size_t)(C - st->first) * V * sizeof *st->base_lp);
        st->base_top = malloc((size_t)st->n_score * sizeof *st->base_top);
    }
    if (!st->logits || !st->row || (o->kl_base && (!st->base_lp || !st->base_top)))
        return fprintf(stderr, "kvpq ppl: out of memory\n"), 1;
    return 0;
}

/* Chunk ch (tokens ct) through the base, then every cache, each scored: 0, or 1 (message printed). */
static int run_chunk(ppl_state *st, long ch, const int32_t *ct) {
    const ppl_opts *o = st->o;
    const int C = st->C, V = st->mi.n_vocab, first = st->first, n_score = st->n_score;
    kvpq_status s;
    if (o->kl_base) {
        s = timed_eval_chunk(st->m, st->base.cc.cache, ct, C, first, (int)o->batch, st->base_lp, st->row,
                             &st->base.seconds);
        if (s != KVPQ_OK) {
            fprintf(stderr, "kvpq ppl: base cache '%s': ", o->kl_base);
            return cli_fail("eval", s);
        }
        kvpq_score_base(st->base_lp, n_score, V, ct + first + 1, st->base_top, &st->base.sums);
    }
    for (int i = 0; i < o->n_caches; i++) {
        ppl_run *r = &st->runs[i];
        s = timed_eval_chunk(st->m, r->cc.cache, ct, C, first, (int)o->batch, st->logits, st->row, &r->seconds);
        if (s != KVPQ_OK) {
            fprintf(stderr, "kvpq ppl: cache '%s': ", r->cc.spec);
            return cli_fail("eval", s);
        }
        kvpq_score_test(st->logits, n_score, V, ct + first + 1, o->kl_base ? st->base_lp : NULL, st->base_top,
                        r->kl ? r->kl + (size_t)ch * n_score : NULL, &r->sums);
    }
    return 0;
}

/* Every chunk, its first token BOS when the model adds one, with progress: 0, or 1 (message printed). */
static int run_chunks(ppl_state *st) {
    char what[160];
    cli_progress pr;
    cli_progress_begin(&pr, "ppl", "chunks", (double)st->n_chunks);
    for (long ch = 0; ch < st->n_chunks; ch++) {
        int32_t *ct = st->toks + (size_t)ch * st->C;
        int32_t saved = ct[0];
        if (st->mi.add_bos) ct[0] = st->mi.bos_id;
        if (run_chunk(st, ch, ct)) return 1;
        ct[0] = saved;
        st->count += st->n_score;
        double p0, se0;
        ppl_stats(st->runs[0].sums.nll, st->runs[0].sums.nll2, st->count, &p0, &se0);
        snprintf(what, sizeof what, "ppl[%.60s] %.4f", st->runs[0].cc.spec, p0);
        cli_progress_update(&pr, (double)(ch + 1), what);
    }
    cli_progress_end(&pr, (double)st->n_chunks, what);
    return 0;
}

/* One cache's figures: perplexity, its memory, speed and (with a base) KL and top-1 agreement. */
typedef struct {
    double ppl, se, tps, kl_mean, kl_p99, top1;
    kvpq_cache_stats st;
} ppl_result;

static void run_result(const ppl_state *st, ppl_run *r, ppl_result *res) {
    const double count = (double)st->count;
    ppl_stats(r->sums.nll, r->sums.nll2, st->count, &res->ppl, &res->se);
    memset(&res->st, 0, sizeof res->st);
    kvpq_cache_get_stats(r->cc.cache, &res->st);
    res->tps = (double)st->n_chunks * st->C / r->seconds;
    res->kl_mean = res->kl_p99 = res->top1 = NAN;
    if (st->o->kl_base) {
        res->kl_mean = r->sums.kl_sum / count;
        res->kl_p99 = percentile(r->kl, (size_t)st->count, 99.0);
        res->top1 = (double)r->sums.agree / count;
    }
}

static void settings_json(const ppl_state *st, cJSON *settings) {
    const ppl_opts *o = st->o;
    cJSON_AddStringToObject(settings, "model", o->model_path);
    cJSON_AddStringToObject(settings, "text", o->text_path);
    cJSON_AddNumberToObject(settings, "ctx", st->C);
    cJSON_AddNumberToObject(settings, "chunks", (double)st->n_chunks);
    cJSON_AddNumberToObject(settings, "batch", (double)o->batch);
    cJSON_AddNumberToObject(settings, "threads", (double)o->threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    if (o->kl_base) cJSON_AddStringToObject(settings, "kl_base", o->kl_base);
    else cJSON_AddNullToObject(settings, "kl_base");
}

/* The JSON object of one cache's result (r) beside the base's (b, with --kl-base). */
static cJSON *result_json(const ppl_state *st, const ppl_run *r, const ppl_result *res, const ppl_result *b) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "cache", r->cc.spec);
    json_num(o, "ppl", res->ppl);
    json_num(o, "ppl_stderr", res->se);
    cJSON_AddNumberToObject(o, "tokens", (double)st->count);
    cJSON_AddNumberToObject(o, "chunks", (double)st->n_chunks);
    cJSON_AddNumberToObject(o, "ctx", st->C);
    cJSON_AddNumberToObject(o, "kv_bytes", (double)res->st.resident_bytes);
    json_num(o, "bits_per_element", res->st.bits_per_element);
    json_num(o, "tok_per_s", res->tps);
    if (st->o->kl_base) {
        cJSON_AddStringToObject(o, "kl_base", st->o->kl_base);
        json_num(o, "ppl_base", b->ppl);
        json_num(o, "ppl_base_stderr", b->se);
        json_num(o, "kl_mean", res->kl_mean);
        json_num(o, "kl_p99", res->kl_p99);
        json_num(o, "top1_agree", res->top1);
        cJSON_AddNumberToObject(o, "kv_bytes_base", (double)b->st.resident_bytes);
        json_num(o, "bits_per_element_base", b->st.bits_per_element);
    }
    return o;
}

static void print_result(const ppl_state *st, const ppl_run *r, const ppl_result *res) {
    printf("cache %-27s PPL = %.4f +/- %.5f   kv_bytes %zu (%.3f bits/elem)   %.1f tok/s", r->cc.spec, res->ppl,
           res->se, res->st.resident_bytes, res->st.bits_per_element, res->tps);
    if (st->o->kl_base) printf("   KL mean %.3g p99 %.3g   top-1 %.4f", res->kl_mean, res->kl_p99, res->top1);
    printf("\n");
}

/* The base's figures (with --kl-base; its line printed unless --json). */
static void base_result(ppl_state *st, ppl_result *b) {
    const ppl_opts *o = st->o;
    b->ppl = b->se = NAN;
    memset(&b->st, 0, sizeof b->st);
    if (!o->kl_base) return;
    ppl_stats(st->base.sums.nll, st->base.sums.nll2, st->count, &b->ppl, &b->se);
    kvpq_cache_get_stats(st->base.cc.cache, &b->st);
    if (!o->json)
        printf("base %-28s PPL = %.4f +/- %.5f   kv_bytes %zu (%.3f bits/elem)   %.1f tok/s\n", o->kl_base, b->ppl,
               b->se, b->st.resident_bytes, b->st.bits_per_element, (double)st->n_chunks * st->C / st->base.seconds);
}

/* The results: a table on stdout, or the JSON (schema kvpq.ppl/1) with --json. Returns the exit code. */
static int report(ppl_state *st) {
    const ppl_opts *o = st->o;
    cJSON *settings = NULL, *arr = NULL;
    cJSON *root = cli_json_new("ppl", &settings, &arr);
    if (!root) return fprintf(stderr, "kvpq ppl: out of memory\n"), 1;
    settings_json(st, settings);
    ppl_result b, res;
    base_result(st, &b);
    for (int i = 0; i < o->n_caches; i++) {
        run_result(st, &st->runs[i], &res);
        cJSON_AddItemToArray(arr, result_json(st, &st->runs[i], &res, &b));
        if (!o->json) print_result(st, &st->runs[i], &res);
    }
    if (o->json) return cli_json_print(root);
    printf("%ld chunks of %d tokens, %lld scored tokens (second half of each chunk), text %s\n", st->n_chunks, st->C,
           (long long)st->count, o->text_path);
    cJSON_Delete(root);
    return 0;
}

static void state_free(ppl_state *st) {
    for (int i = 0; i < st->o->n_caches; i++) {
        cli_cache_close(&st->runs[i].cc);
        free(st->runs[i].kl);
    }
    cli_cache_close(&st->base.cc);
    free(st->text);
    free(st->toks);
    free(st->logits);
    free(st->base_lp);
    free(st->base_top);
    free(st->row);
    kvpq_model_free(st->m);
}

/* Setup, the chunks and the report: the exit code. */
static int ppl_run_all(ppl_state *st) {
    if (read_text(st)) return 1;
    if (check_specs(st->o)) return 2;
    if (load_model(st) || read_tokens(st) || open_caches(st) || run_chunks(st)) return 1;
    return report(st);
}

int cmd_ppl(int argc, char **argv) {
    ppl_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc < 0) {
        ppl_state st;
        memset(&st, 0, sizeof st);
        st.o = &o;
        rc = ppl_run_all(&st);
        state_free(&st);
    }
    free(o.specs_buf);
    return rc;
}
