/* cmd_ppl.c — `kvpq ppl`: perplexity of a text with one or more KV caches, optionally beside a base
 * cache run on the same chunks in the same process (KL divergence, top-1 agreement). */
#include <math.h>
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
            "sqrt(var(NLL) / (count - 1)) * PPL, as llama.cpp prints it.\n");
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

static const char *const OPTS[] = {"--help", "-h", "--json", "--quiet", "-q", "--model", "-m", "--text", "-f", "--tokens", "--cache", "--kl-base",
                                   "--ctx", "-c", "--chunks", "--batch", "-b", "--threads", "-t", NULL};

int cmd_ppl(int argc, char **argv) {
    const char *model_path = NULL, *text_path = NULL, *kl_base = NULL, *ids_path = NULL;
    char *cache_list = NULL;
    long ctx = 512, max_chunks = 1L << 30, batch = 0, threads = 0;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!cli_option_known(a, OPTS)) return cli_unknown_option("ppl", a, OPTS);
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--json")) {
            as_json = 1;
            continue;
        } else if (!strcmp(a, "--quiet") || !strcmp(a, "-q")) {
            cli_quiet = 1;
            continue;
        }
        if (!v) return cli_usage_error("ppl: option %s needs a value (see --help)", a);
        i++;
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) model_path = v;
        else if (!strcmp(a, "--text") || !strcmp(a, "-f")) text_path = v;
        else if (!strcmp(a, "--tokens")) ids_path = v;
        else if (!strcmp(a, "--cache")) cache_list = (char *)v;
        else if (!strcmp(a, "--kl-base")) kl_base = v;
        else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            if (!cli_parse_int(a, v, 4, 1 << 24, &ctx)) return 2;
        } else if (!strcmp(a, "--chunks")) {
            if (!cli_parse_int(a, v, 1, 1L << 30, &max_chunks)) return 2;
        } else if (!strcmp(a, "--batch") || !strcmp(a, "-b")) {
            if (!cli_parse_int(a, v, 1, 1 << 24, &batch)) return 2;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (!cli_parse_int(a, v, 0, 1024, &threads)) return 2;
        } else
            return cli_usage_error("ppl: unknown option '%s' (see --help)", a);
    }
    if (!model_path || !(text_path || ids_path) || (text_path && ids_path))
        return cli_usage_error("ppl: --model and one of --text, --tokens are required (see --help)");
    if (ids_path) text_path = ids_path;
    if (batch == 0 || batch > ctx) batch = ctx;

    /* the cache list: split a copy on ',' */
    char *specs_buf = strdup(cache_list ? cache_list : "fp32");
    const char *specs[PPL_MAX_CACHES];
    int n_caches = 0;
    for (char *tok = strtok(specs_buf, ","); tok; tok = strtok(NULL, ",")) {
        if (n_caches == PPL_MAX_CACHES) {
            free(specs_buf);
            return cli_usage_error("ppl: at most %d caches in --cache", PPL_MAX_CACHES);
        }
        specs[n_caches++] = tok;
    }
    if (n_caches == 0) {
        free(specs_buf);
        return cli_usage_error("ppl: --cache: empty list");
    }

    int rc = 1;
    kvpq_model *m = NULL;
    char *text = NULL;
    int32_t *toks = NULL;
    float *logits = NULL, *base_lp = NULL, *row = NULL;
    int *base_top = NULL;
    ppl_run runs[PPL_MAX_CACHES];
    memset(runs, 0, sizeof runs);
    ppl_run base;
    memset(&base, 0, sizeof base);

    size_t text_len = 0;
    text = cli_read_file(text_path, &text_len);
    if (!text) {
        fprintf(stderr, "kvpq ppl: cannot read text file '%s': %s\n", text_path, cli_read_error());
        goto done;
    }
    size_t bad;
    if (!ids_path && !cli_utf8_valid((const unsigned char *)text, text_len, &bad)) {
        fprintf(stderr, "kvpq ppl: text file '%s' is not valid UTF-8 (first bad byte at offset %zu)\n", text_path, bad);
        goto done;
    }
    for (int i = 0; i <= n_caches; i++) /* every SPEC checked before the model loads: exit code 2 */
        if (i < n_caches ? cli_cache_spec_check(specs[i]) : kl_base ? cli_cache_spec_check(kl_base) : 0) {
            rc = 2;
            goto done;
        }
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)threads;
    kvpq_status s = kvpq_model_load(&m, model_path, &mp);
    if (s != KVPQ_OK) {
        cli_fail("ppl", s);
        goto done;
    }
    kvpq_model_info mi;
    kvpq_model_get_info(m, &mi);
    if (ctx > mi.n_ctx_train) {
        fprintf(stderr, "kvpq ppl: --ctx %ld exceeds the model's training context of %d tokens\n", ctx, mi.n_ctx_train);
        goto done;
    }
    size_t n_tok = 0;
    if (ids_path) {
        toks = cli_parse_ids(text, text_len, &n_tok);
        if (!toks) {
            fprintf(stderr, "kvpq ppl: --tokens '%s': out of memory, or a negative number or one beyond int32\n", ids_path);
            goto done;
        }
        for (size_t i = 0; i < n_tok; i++)
            if (toks[i] >= mi.n_vocab) {
                fprintf(stderr, "kvpq ppl: --tokens '%s': id %d at index %zu is beyond the vocabulary (%d)\n",
                        ids_path, toks[i], i, mi.n_vocab);
                goto done;
            }
        s = KVPQ_OK;
    } else
        s = kvpq_tokenize(m, text, text_len, mi.add_bos, 0, NULL, 0, &n_tok);
    if (s == KVPQ_OK && !ids_path) {
        toks = malloc((n_tok ? n_tok : 1) * sizeof *toks);
        if (!toks) {
            fprintf(stderr, "kvpq ppl: out of memory\n");
            goto done;
        }
        s = kvpq_tokenize(m, text, text_len, mi.add_bos, 0, toks, n_tok, &n_tok);
    }
    if (s != KVPQ_OK) {
        fprintf(stderr, "kvpq ppl: text file '%s': ", text_path);
        cli_fail("tokenize", s);
        goto done;
    }
    long n_chunks = (long)(n_tok / (size_t)ctx);
    if (n_chunks > max_chunks) n_chunks = max_chunks;
    if (n_chunks < 1) {
        fprintf(stderr, "kvpq ppl: text file '%s' has %zu tokens, fewer than one chunk of --ctx %ld\n", text_path,
                n_tok, ctx);
        goto done;
    }
    int C = (int)ctx, V = mi.n_vocab, first = C / 2, n_score = C - 1 - first;
    for (int i = 0; i < n_caches; i++) {
        if (cli_cache_open(&runs[i].cc, specs[i], m, C, (int)threads)) goto done;
        runs[i].kl = kl_base ? malloc((size_t)n_chunks * n_score * sizeof(float)) : NULL;
        if (kl_base && !runs[i].kl) {
            fprintf(stderr, "kvpq ppl: out of memory\n");
            goto done;
        }
    }
    if (kl_base && cli_cache_open(&base.cc, kl_base, m, C, (int)threads)) goto done;
    logits = malloc((size_t)(C - first) * V * sizeof *logits);
    row = malloc((size_t)V * sizeof *row);
    if (kl_base) {
        base_lp = malloc((size_t)(C - first) * V * sizeof *base_lp);
        base_top = malloc((size_t)n_score * sizeof *base_top);
    }
    if (!logits || !row || (kl_base && (!base_lp || !base_top))) {
        fprintf(stderr, "kvpq ppl: out of memory\n");
        goto done;
    }

    int64_t count = 0;
    char what[160];
    cli_progress pr;
    cli_progress_begin(&pr, "ppl", "chunks", (double)n_chunks);
    for (long ch = 0; ch < n_chunks; ch++) {
        int32_t *ct = toks + (size_t)ch * C;
        int32_t saved = ct[0];
        if (mi.add_bos) ct[0] = mi.bos_id;
        if (kl_base) {
            s = timed_eval_chunk(m, base.cc.cache, ct, C, first, (int)batch, base_lp, row, &base.seconds);
            if (s != KVPQ_OK) {
                fprintf(stderr, "kvpq ppl: base cache '%s': ", kl_base);
                cli_fail("eval", s);
                goto done;
            }
            kvpq_score_base(base_lp, n_score, V, ct + first + 1, base_top, &base.sums);
        }
        for (int i = 0; i < n_caches; i++) {
            ppl_run *r = &runs[i];
            s = timed_eval_chunk(m, r->cc.cache, ct, C, first, (int)batch, logits, row, &r->seconds);
            if (s != KVPQ_OK) {
                fprintf(stderr, "kvpq ppl: cache '%s': ", r->cc.spec);
                cli_fail("eval", s);
                goto done;
            }
            kvpq_score_test(logits, n_score, V, ct + first + 1, kl_base ? base_lp : NULL, base_top,
                           r->kl ? r->kl + (size_t)ch * n_score : NULL, &r->sums);
        }
        ct[0] = saved;
        count += n_score;
        double p0, se0;
        ppl_stats(runs[0].sums.nll, runs[0].sums.nll2, count, &p0, &se0);
        snprintf(what, sizeof what, "ppl[%.60s] %.4f", runs[0].cc.spec, p0);
        cli_progress_update(&pr, (double)(ch + 1), what);
    }
    cli_progress_end(&pr, (double)n_chunks, what);

    cJSON *settings = NULL, *arr = NULL;
    cJSON *root = cli_json_new("ppl", &settings, &arr);
    if (!root) {
        fprintf(stderr, "kvpq ppl: out of memory\n");
        goto done;
    }
    cJSON_AddStringToObject(settings, "model", model_path);
    cJSON_AddStringToObject(settings, "text", text_path);
    cJSON_AddNumberToObject(settings, "ctx", C);
    cJSON_AddNumberToObject(settings, "chunks", (double)n_chunks);
    cJSON_AddNumberToObject(settings, "batch", (double)batch);
    cJSON_AddNumberToObject(settings, "threads", (double)threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    if (kl_base) cJSON_AddStringToObject(settings, "kl_base", kl_base);
    else cJSON_AddNullToObject(settings, "kl_base");
    double pb = NAN, seb = NAN;
    kvpq_cache_stats bst;
    memset(&bst, 0, sizeof bst);
    if (kl_base) {
        ppl_stats(base.sums.nll, base.sums.nll2, count, &pb, &seb);
        kvpq_cache_get_stats(base.cc.cache, &bst);
        if (!as_json)
            printf("base %-28s PPL = %.4f +/- %.5f   kv_bytes %zu (%.3f bits/elem)   %.1f tok/s\n", kl_base, pb, seb,
                   bst.resident_bytes, bst.bits_per_element, (double)n_chunks * C / base.seconds);
    }
    for (int i = 0; i < n_caches; i++) {
        ppl_run *r = &runs[i];
        double p, se;
        ppl_stats(r->sums.nll, r->sums.nll2, count, &p, &se);
        kvpq_cache_stats st;
        memset(&st, 0, sizeof st);
        kvpq_cache_get_stats(r->cc.cache, &st);
        double tps = (double)n_chunks * C / r->seconds;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "cache", r->cc.spec);
        json_num(o, "ppl", p);
        json_num(o, "ppl_stderr", se);
        cJSON_AddNumberToObject(o, "tokens", (double)count);
        cJSON_AddNumberToObject(o, "chunks", (double)n_chunks);
        cJSON_AddNumberToObject(o, "ctx", C);
        cJSON_AddNumberToObject(o, "kv_bytes", (double)st.resident_bytes);
        json_num(o, "bits_per_element", st.bits_per_element);
        json_num(o, "tok_per_s", tps);
        double kl_mean = NAN, kl_p99 = NAN, top1 = NAN;
        if (kl_base) {
            kl_mean = r->sums.kl_sum / (double)count;
            kl_p99 = percentile(r->kl, (size_t)count, 99.0);
            top1 = (double)r->sums.agree / (double)count;
            cJSON_AddStringToObject(o, "kl_base", kl_base);
            json_num(o, "ppl_base", pb);
            json_num(o, "ppl_base_stderr", seb);
            json_num(o, "kl_mean", kl_mean);
            json_num(o, "kl_p99", kl_p99);
            json_num(o, "top1_agree", top1);
            cJSON_AddNumberToObject(o, "kv_bytes_base", (double)bst.resident_bytes);
            json_num(o, "bits_per_element_base", bst.bits_per_element);
        }
        cJSON_AddItemToArray(arr, o);
        if (!as_json) {
            printf("cache %-27s PPL = %.4f +/- %.5f   kv_bytes %zu (%.3f bits/elem)   %.1f tok/s", r->cc.spec, p, se,
                   st.resident_bytes, st.bits_per_element, tps);
            if (kl_base) printf("   KL mean %.3g p99 %.3g   top-1 %.4f", kl_mean, kl_p99, top1);
            printf("\n");
        }
    }
    if (!as_json)
        printf("%ld chunks of %d tokens, %lld scored tokens (second half of each chunk), text %s\n", n_chunks, C,
               (long long)count, text_path);
    if (as_json) {
        rc = cli_json_print(root);
    } else {
        cJSON_Delete(root);
        rc = 0;
    }
done:
    for (int i = 0; i < n_caches; i++) {
        cli_cache_close(&runs[i].cc);
        free(runs[i].kl);
    }
    cli_cache_close(&base.cc);
    free(specs_buf);
    free(text);
    free(toks);
    free(logits);
    free(base_lp);
    free(base_top);
    free(row);
    kvpq_model_free(m);
    return rc;
}
