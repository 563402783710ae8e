/* bench_decode.c — `kvpq bench decode`: end-to-end decode tokens/s of the real model with several KV
 * caches side by side in one process (issue 4's target: the 2-bit VQ cache at 4096 context decodes
 * at least as fast as the fp32 cache).
 *
 * Every cache gets the same prompt (the first --ctx tokens of --text), evaluated in one call, then
 * the same --steps one-token evals fed from the text's next tokens (teacher forcing, so every cache
 * does the same work whatever it would have sampled). The caches take turns step by step (cache 1
 * step i, cache 2 step i, ...), so a slow moment of a shared machine falls on all of them alike.
 * Decode tokens/s = 1 / median one-token eval time (the mean is printed beside). Uses kvpq.h only. */
#include <cjson/cJSON.h>

#include "cli_json.h"
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "cli_model.h"

#define MAX_CACHES 8
#define PROMPT_BATCH 512

static void usage(FILE *f) {
    fprintf(f,
            "usage: kvpq bench decode --cache SPEC[,SPEC...] [--model M] [--text FILE] [--ctx N] [--steps N]\n"
            "                         [--threads N] [--json] [--quiet]\n"
            "  Decode tokens/s of the model with each cache SPEC (fp32 fp16 q8_0 q4_0 q8_0r q4_0r kivi2 kivi4 vq:FILE),\n"
            "  side by side in one process: a --ctx-token prompt from FILE (default 4096 tokens of\n"
            "  data/text/persuasion.txt), then --steps one-token evals (default 32) fed from the text's next\n"
            "  tokens, the caches taking turns each step. The prompt runs in batches of 512 tokens. Model default:\n"
            "  models/SmolLM2-135M-Instruct.Q4_1.gguf. Speedups are against the first SPEC.\n");
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct {
    const char *model_path, *text_path, *specs_arg;
    char model_buf[4096], text_buf[4096]; /* the default files' paths, where found */
    char specs_buf[2048], *specs[MAX_CACHES]; /* --cache split at ',' */
    int n_cache, json;
    long ctx, steps, threads;
} decode_opts;

#define F(field) offsetof(decode_opts, field)
static const cli_opt OPTS[] = {
    {"--json", NULL, CLI_OPT_FLAG, F(json), 0, 0},
    {"--quiet", "-q", CLI_OPT_QUIET, 0, 0, 0},
    {"--model", "-m", CLI_OPT_STR, F(model_path), 0, 0},
    {"--text", NULL, CLI_OPT_STR, F(text_path), 0, 0},
    {"--cache", NULL, CLI_OPT_STR, F(specs_arg), 0, 0},
    {"--ctx", NULL, CLI_OPT_LONG, F(ctx), 1, 1 << 20},
    {"--steps", NULL, CLI_OPT_LONG, F(steps), 1, 1 << 16},
    {"--threads", "-t", CLI_OPT_LONG, F(threads), 0, 1024},
    {NULL, NULL, 0, 0, 0, 0},
};
#undef F

/* The SPEC list into o->specs: 0, or the exit code. */
static int split_specs(decode_opts *o) {
    const char *specs_arg = o->specs_arg;
    if (strlen(specs_arg) >= sizeof o->specs_buf) return cli_usage_error("bench decode: --cache list too long");
    strcpy(o->specs_buf, specs_arg);
    for (char *tok = strtok(o->specs_buf, ","); tok; tok = strtok(NULL, ",")) {
        if (o->n_cache == MAX_CACHES) return cli_usage_error("bench decode: at most %d caches", MAX_CACHES);
        o->specs[o->n_cache++] = tok;
    }
    if (!o->n_cache) return cli_usage_error("bench decode: --cache names no cache");
    return 0;
}

/* argv into *o: -1 to go on, else the exit code (0 after --help). */
static int parse_opts(int argc, char **argv, decode_opts *o) {
    static const char DEF_MODEL[] = "models/SmolLM2-135M-Instruct.Q4_1.gguf", DEF_TEXT[] = "data/text/persuasion.txt";
    memset(o, 0, sizeof *o);
    o->ctx = 4096;
    o->steps = 32;
    int rc = cli_parse_options("bench decode", argc, argv, OPTS, o, usage);
    if (rc >= 0) return rc;
    if (!o->specs_arg) return cli_usage_error("bench decode: --cache SPEC[,SPEC...] is required (see --help)");
    /* The defaults are files of the source tree: found from the current directory or the tree the
     * CLI was built from, whichever has them. */
    if (!o->model_path && !(o->model_path = cli_find_data(DEF_MODEL, o->model_buf, sizeof o->model_buf)))
        return cli_usage_error("bench decode: no --model given and the default %s is not found here or in the source "
                               "tree (scripts/fetch_model.sh fetches it); pass --model FILE.gguf", DEF_MODEL);
    if (!o->text_path && !(o->text_path = cli_find_data(DEF_TEXT, o->text_buf, sizeof o->text_buf)))
        return cli_usage_error("bench decode: no --text given and the default %s is not found here or in the source "
                               "tree; pass --text FILE", DEF_TEXT);
    rc = split_specs(o);
    return rc ? rc : -1;
}

/* A run: the model, the text's tokens, a cache per SPEC and the times measured. */
typedef struct {
    const decode_opts *o;
    kvpq_model *m;
    kvpq_model_info mi;
    int32_t *toks;                 /* (n_tok) the text's tokens */
    float *logits;                 /* (n_vocab) */
    double *dt;                    /* (n_cache, steps) seconds of each one-token eval */
    double t_prompt[MAX_CACHES];   /* seconds of each cache's prompt */
    double med[MAX_CACHES], mean[MAX_CACHES]; /* seconds per one-token eval */
    cli_cache cc[MAX_CACHES];
} decode_run;

/* The text's tokens (at least --ctx + --steps of them) and the buffers: 0, or 1 (message printed). */
static int run_setup(decode_run *r, const char *text, size_t text_len) {
    const decode_opts *o = r->o;
    size_t n_tok = 0;
    const size_t need = (size_t)o->ctx + (size_t)o->steps;
    kvpq_status s;
    if (need > (size_t)r->mi.n_ctx_train) {
        fprintf(stderr, "kvpq bench decode: --ctx %ld + --steps %ld exceed the model's context of %d\n", o->ctx,
                o->steps, r->mi.n_ctx_train);
        return 1;
    }
    if ((s = kvpq_tokenize(r->m, text, text_len, r->mi.add_bos, 0, NULL, 0, &n_tok)) != KVPQ_OK)
        return cli_fail("bench decode: tokenize", s);
    if (n_tok < need) {
        fprintf(stderr, "kvpq bench decode: %s has %zu tokens; --ctx + --steps need %zu\n", o->text_path, n_tok, need);
        return 1;
    }
    r->toks = malloc(n_tok * sizeof *r->toks);
    r->logits = malloc((size_t)r->mi.n_vocab * sizeof *r->logits);
    r->dt = malloc((size_t)o->n_cache * o->steps * sizeof *r->dt);
    if (!r->toks || !r->logits || !r->dt) {
        fprintf(stderr, "kvpq bench decode: out of memory\n");
        return 1;
    }
    if ((s = kvpq_tokenize(r->m, text, text_len, r->mi.add_bos, 0, r->toks, n_tok, &n_tok)) != KVPQ_OK)
        return cli_fail("bench decode: tokenize", s);
    return 0;
}

/* Open every cache and give it the prompt: 0, or 1 (message printed). */
static int run_prompts(decode_run *r) {
    const decode_opts *o = r->o;
    const long ctx = o->ctx;
    cli_progress pr;
    cli_progress_begin(&pr, "bench decode: prompts", "tokens", (double)ctx * o->n_cache);
    for (int c = 0; c < o->n_cache; c++) {
        if (cli_cache_open(&r->cc[c], o->specs[c], r->m, (int)(ctx + o->steps), (int)o->threads)) return 1;
        /* The prompt in batches of PROMPT_BATCH tokens (as llama.cpp's default micro-batch), so
         * progress shows while it runs; the prompt time is their sum. */
        for (long b = 0; b < ctx; b += PROMPT_BATCH) {
            int nb = (int)(ctx - b < PROMPT_BATCH ? ctx - b : PROMPT_BATCH);
            double t0 = cli_now();
            kvpq_status s = kvpq_model_eval(r->m, r->cc[c].cache, r->toks + b, nb, 0, r->logits);
            if (s != KVPQ_OK) return cli_fail("bench decode: prompt eval", s);
            r->t_prompt[c] += cli_now() - t0;
            cli_progress_update(&pr, (double)c * ctx + b + nb, r->cc[c].spec);
        }
    }
    cli_progress_end(&pr, (double)ctx * o->n_cache, NULL);
    return 0;
}

/* The one-token evals, the caches taking turns each step, then each cache's median and mean: 0,
 * or 1 (message printed). */
static int run_steps(decode_run *r) {
    const decode_opts *o = r->o;
    const long steps = o->steps;
    cli_progress pr;
    cli_progress_begin(&pr, "bench decode: steps", "steps", (double)steps);
    for (long i = 0; i < steps; i++) {
        cli_progress_update(&pr, (double)i, NULL);
        for (int c = 0; c < o->n_cache; c++) {
            double t0 = cli_now();
            kvpq_status s = kvpq_model_eval(r->m, r->cc[c].cache, r->toks + o->ctx + i, 1, 0, r->logits);
            if (s != KVPQ_OK) return cli_fail("bench decode: eval", s);
            r->dt[(size_t)c * steps + i] = cli_now() - t0;
        }
    }
    cli_progress_end(&pr, (double)steps, NULL);
    for (int c = 0; c < o->n_cache; c++) {
        double *d = r->dt + (size_t)c * steps, sum = 0.0;
        for (long i = 0; i < steps; i++) sum += d[i];
        r->mean[c] = sum / steps;
        qsort(d, steps, sizeof *d, cmp_double);
        r->med[c] = steps % 2 ? d[steps / 2] : 0.5 * (d[steps / 2 - 1] + d[steps / 2]);
    }
    return 0;
}

/* The table, or the kvpq.bench.decode/1 document with --json: the exit code. */
static int print_results(const decode_run *r) {
    const decode_opts *o = r->o;
    const long ctx = o->ctx;
    cJSON *settings = NULL, *arr = NULL, *root = cli_json_new("bench.decode", &settings, &arr);
    if (!root) {
        fprintf(stderr, "kvpq bench decode: out of memory\n");
        return 1;
    }
    cJSON_AddStringToObject(settings, "model", o->model_path);
    cJSON_AddStringToObject(settings, "text", o->text_path);
    cJSON_AddNumberToObject(settings, "ctx", (double)ctx);
    cJSON_AddNumberToObject(settings, "steps", (double)o->steps);
    cJSON_AddNumberToObject(settings, "threads", (double)o->threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    if (!o->json)
        printf("kvpq bench decode: %s, prompt %ld tokens of %s, %ld one-token evals per cache (taking turns); "
               "simd %s; threads %ld (0 = default)\n%-40s %12s %14s %14s %13s %9s\n",
               o->model_path, ctx, o->text_path, o->steps, kvpq_simd_name(kvpq_simd_get()), o->threads, "cache",
               "prompt tok/s", "decode ms med", "decode ms mean", "decode tok/s", "vs first");
    const double *med = r->med, *mean = r->mean;
    for (int c = 0; c < o->n_cache; c++) {
        cJSON *jc = cJSON_CreateObject();
        cJSON_AddStringToObject(jc, "cache", o->specs[c]);
        cJSON_AddNumberToObject(jc, "prompt_tok_per_s", ctx / r->t_prompt[c]);
        cJSON_AddNumberToObject(jc, "decode_ms_median", med[c] * 1e3);
        cJSON_AddNumberToObject(jc, "decode_ms_mean", mean[c] * 1e3);
        cJSON_AddNumberToObject(jc, "decode_tok_per_s", 1.0 / med[c]);
        cJSON_AddNumberToObject(jc, "decode_speedup_vs_first", med[0] / med[c]);
        kvpq_cache_stats cst; /* the cache after the prompt and the steps: ctx + steps positions */
        if (kvpq_cache_get_stats(r->cc[c].cache, &cst) == KVPQ_OK) {
            cJSON_AddNumberToObject(jc, "stored_bytes", (double)cst.stored_bytes);
            cJSON_AddNumberToObject(jc, "resident_bytes", (double)cst.resident_bytes);
        }
        cJSON_AddItemToArray(arr, jc);
        if (!o->json)
            printf("%-40s %12.1f %14.3f %14.3f %13.1f %8.2fx\n", o->specs[c], ctx / r->t_prompt[c], med[c] * 1e3,
                   mean[c] * 1e3, 1.0 / med[c], med[0] / med[c]);
    }
    if (o->json) return cli_json_print(root);
    cJSON_Delete(root);
    return 0;
}

int cmd_bench_decode(int argc, char **argv) {
    decode_opts o;
    int rc = parse_opts(argc, argv, &o);
    if (rc >= 0) return rc;
    size_t text_len = 0;
    char *text = cli_read_file(o.text_path, &text_len);
    if (!text) {
        fprintf(stderr, "kvpq bench decode: cannot read --text %s: %s\n", o.text_path, cli_read_error());
        return 1;
    }
    decode_run r;
    memset(&r, 0, sizeof r);
    r.o = &o;
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)o.threads;
    kvpq_status s = kvpq_model_load(&r.m, o.model_path, &mp);
    if (s != KVPQ_OK) {
        free(text);
        return cli_fail("bench decode: model", s);
    }
    kvpq_model_get_info(r.m, &r.mi);
    rc = run_setup(&r, text, text_len) || run_prompts(&r) || run_steps(&r) ? 1 : print_results(&r);
    for (int c = 0; c < o.n_cache; c++) cli_cache_close(&r.cc[c]);
    free(text);
    free(r.toks);
    free(r.logits);
    free(r.dt);
    kvpq_model_free(r.m);
    return rc;
}
