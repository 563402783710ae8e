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

static const char *const OPTS[] = {"--help", "-h", "--json", "--quiet", "-q", "--model", "-m", "--text", "--cache", "--ctx",
                                   "--steps", "--threads", "-t", NULL};

int cmd_bench_decode(int argc, char **argv) {
    static const char DEF_MODEL[] = "models/SmolLM2-135M-Instruct.Q4_1.gguf", DEF_TEXT[] = "data/text/persuasion.txt";
    const char *model_path = NULL, *text_path = NULL;
    char model_buf[4096], text_buf[4096];
    const char *specs_arg = NULL;
    long ctx = 4096, steps = 32, threads = 0;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!cli_option_known(a, OPTS)) return cli_unknown_option("bench decode", a, OPTS);
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
            continue;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) return cli_usage_error("bench decode: option %s needs a value (see --help)", a);
        i++;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--text")) text_path = v;
        else if (!strcmp(a, "--cache")) specs_arg = v;
        else if (!strcmp(a, "--ctx")) {
            if (!cli_parse_int(a, v, 1, 1 << 20, &ctx)) return 2;
        } else if (!strcmp(a, "--steps")) {
            if (!cli_parse_int(a, v, 1, 1 << 16, &steps)) return 2;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (!cli_parse_int(a, v, 0, 1024, &threads)) return 2;
        } else
            return cli_usage_error("bench decode: unknown option '%s' (see --help)", a);
    }
    if (!specs_arg) return cli_usage_error("bench decode: --cache SPEC[,SPEC...] is required (see --help)");
    /* The defaults are files of the source tree: found from the current directory or the tree the
     * CLI was built from, whichever has them. */
    if (!model_path && !(model_path = cli_find_data(DEF_MODEL, model_buf, sizeof model_buf)))
        return cli_usage_error("bench decode: no --model given and the default %s is not found here or in the source "
                               "tree (scripts/fetch_model.sh fetches it); pass --model FILE.gguf", DEF_MODEL);
    if (!text_path && !(text_path = cli_find_data(DEF_TEXT, text_buf, sizeof text_buf)))
        return cli_usage_error("bench decode: no --text given and the default %s is not found here or in the source "
                               "tree; pass --text FILE", DEF_TEXT);
    /* Split the SPEC list. */
    char specs_buf[2048], *specs[MAX_CACHES];
    int n_cache = 0;
    if (strlen(specs_arg) >= sizeof specs_buf) return cli_usage_error("bench decode: --cache list too long");
    strcpy(specs_buf, specs_arg);
    for (char *tok = strtok(specs_buf, ","); tok; tok = strtok(NULL, ",")) {
        if (n_cache == MAX_CACHES) return cli_usage_error("bench decode: at most %d caches", MAX_CACHES);
        specs[n_cache++] = tok;
    }
    if (!n_cache) return cli_usage_error("bench decode: --cache names no cache");

    size_t text_len = 0;
    char *text = cli_read_file(text_path, &text_len);
    if (!text) {
        fprintf(stderr, "kvpq bench decode: cannot read --text %s: %s\n", text_path, cli_read_error());
        return 1;
    }
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)threads;
    kvpq_model *m = NULL;
    kvpq_status s = kvpq_model_load(&m, model_path, &mp);
    if (s != KVPQ_OK) {
        free(text);
        return cli_fail("bench decode: model", s);
    }
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    int rc = 1;
    int32_t *toks = NULL;
    float *logits = NULL;
    double *dt = NULL, t_prompt[MAX_CACHES] = {0};
    cli_cache cc[MAX_CACHES];
    memset(cc, 0, sizeof cc);
    size_t n_tok = 0;
    const size_t need = (size_t)ctx + (size_t)steps;
    if (need > (size_t)mi.n_ctx_train) {
        fprintf(stderr, "kvpq bench decode: --ctx %ld + --steps %ld exceed the model's context of %d\n", ctx, steps,
                mi.n_ctx_train);
        goto done;
    }
    if ((s = kvpq_tokenize(m, text, text_len, mi.add_bos, 0, NULL, 0, &n_tok)) != KVPQ_OK) {
        cli_fail("bench decode: tokenize", s);
        goto done;
    }
    if (n_tok < need) {
        fprintf(stderr, "kvpq bench decode: %s has %zu tokens; --ctx + --steps need %zu\n", text_path, n_tok, need);
        goto done;
    }
    toks = malloc(n_tok * sizeof *toks);
    logits = malloc((size_t)mi.n_vocab * sizeof *logits);
    dt = malloc((size_t)n_cache * steps * sizeof *dt);
    if (!toks || !logits || !dt) {
        fprintf(stderr, "kvpq bench decode: out of memory\n");
        goto done;
    }
    if ((s = kvpq_tokenize(m, text, text_len, mi.add_bos, 0, toks, n_tok, &n_tok)) != KVPQ_OK) {
        cli_fail("bench decode: tokenize", s);
        goto done;
    }
    cli_progress pr;
    cli_progress_begin(&pr, "bench decode: prompts", "tokens", (double)ctx * n_cache);
    for (int c = 0; c < n_cache; c++) {
        if (cli_cache_open(&cc[c], specs[c], m, (int)need, (int)threads)) goto done;
        /* The prompt in batches of PROMPT_BATCH tokens (as llama.cpp's default micro-batch), so
         * progress shows while it runs; the prompt time is their sum. */
        for (long b = 0; b < ctx; b += PROMPT_BATCH) {
            int nb = (int)(ctx - b < PROMPT_BATCH ? ctx - b : PROMPT_BATCH);
            double t0 = cli_now();
            if ((s = kvpq_model_eval(m, cc[c].cache, toks + b, nb, 0, logits)) != KVPQ_OK) {
                cli_fail("bench decode: prompt eval", s);
                goto done;
            }
            t_prompt[c] += cli_now() - t0;
            cli_progress_update(&pr, (double)c * ctx + b + nb, cc[c].spec);
        }
    }
    cli_progress_end(&pr, (double)ctx * n_cache, NULL);
    cli_progress_begin(&pr, "bench decode: steps", "steps", (double)steps);
    for (long i = 0; i < steps; i++) {
        cli_progress_update(&pr, (double)i, NULL);
        for (int c = 0; c < n_cache; c++) {
            double t0 = cli_now();
            if ((s = kvpq_model_eval(m, cc[c].cache, toks + ctx + i, 1, 0, logits)) != KVPQ_OK) {
                cli_fail("bench decode: eval", s);
                goto done;
            }
            dt[(size_t)c * steps + i] = cli_now() - t0;
        }
    }
    cli_progress_end(&pr, (double)steps, NULL);
    double med[MAX_CACHES], mean[MAX_CACHES];
    for (int c = 0; c < n_cache; c++) {
        double *d = dt + (size_t)c * steps, sum = 0.0;
        for (long i = 0; i < steps; i++) sum += d[i];
        mean[c] = sum / steps;
        qsort(d, steps, sizeof *d, cmp_double);
        med[c] = steps % 2 ? d[steps / 2] : 0.5 * (d[steps / 2 - 1] + d[steps / 2]);
    }
    cJSON *settings = NULL, *arr = NULL, *root = cli_json_new("bench.decode", &settings, &arr);
    if (!root) {
        fprintf(stderr, "kvpq bench decode: out of memory\n");
        goto done;
    }
    cJSON_AddStringToObject(settings, "model", model_path);
    cJSON_AddStringToObject(settings, "text", text_path);
    cJSON_AddNumberToObject(settings, "ctx", (double)ctx);
    cJSON_AddNumberToObject(settings, "steps", (double)steps);
    cJSON_AddNumberToObject(settings, "threads", (double)threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    if (!json)
        printf("kvpq bench decode: %s, prompt %ld tokens of %s, %ld one-token evals per cache (taking turns); "
               "simd %s; threads %ld (0 = default)\n%-40s %12s %14s %14s %13s %9s\n",
               model_path, ctx, text_path, steps, kvpq_simd_name(kvpq_simd_get()), threads, "cache", "prompt tok/s",
               "decode ms med", "decode ms mean", "decode tok/s", "vs first");
    for (int c = 0; c < n_cache; c++) {
        cJSON *jc = cJSON_CreateObject();
        cJSON_AddStringToObject(jc, "cache", specs[c]);
        cJSON_AddNumberToObject(jc, "prompt_tok_per_s", ctx / t_prompt[c]);
        cJSON_AddNumberToObject(jc, "decode_ms_median", med[c] * 1e3);
        cJSON_AddNumberToObject(jc, "decode_ms_mean", mean[c] * 1e3);
        cJSON_AddNumberToObject(jc, "decode_tok_per_s", 1.0 / med[c]);
        cJSON_AddNumberToObject(jc, "decode_speedup_vs_first", med[0] / med[c]);
        cJSON_AddItemToArray(arr, jc);
        if (!json)
            printf("%-40s %12.1f %14.3f %14.3f %13.1f %8.2fx\n", specs[c], ctx / t_prompt[c], med[c] * 1e3,
                   mean[c] * 1e3, 1.0 / med[c], med[0] / med[c]);
    }
    if (json) {
        rc = cli_json_print(root);
    } else {
        cJSON_Delete(root);
        rc = 0;
    }
done:
    for (int c = 0; c < n_cache; c++) cli_cache_close(&cc[c]);
    free(text);
    free(toks);
    free(logits);
    free(dt);
    kvpq_model_free(m);
    return rc;
}
