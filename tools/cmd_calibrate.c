/* cmd_calibrate.c — `kvpq calibrate`: train a model's key/value codebooks on its real activations.
 * A thin client of the library's calibration (kvpq_model.h: kvpq_calibration_new / _train /
 * _allocate): options in, files and progress out. One forward pass can serve several codebooks
 * (--also: each job its own options and output file) and several budgets (--bits-also). */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "cli.h"
#include "cli_json.h"
#include "cli_model.h"

#define CALIB_MAX_ALSO 16

typedef struct {
    const char *model, *text, *out, *keys, *values, *granularity, *keys_layers, *values_layers, *kmeans_init, *keys2;
    long tokens, ctx, iters, threads, value_rotate, max_ppc, center, key_norm, value_norm, smooth_query, norm_bits;
    long key_rope;
    long seed;
    /* --bits: automatic per-layer allocation (docs/allocation.md) */
    double bits;
    const char *cands;
    long holdout_ctx, holdout_chunks, holdout_repeat, window, alloc_values, sinks, full_sens;
    const char *window_cands; /* --window-candidates; parsed into wins */
    long verify_ctx;          /* --verify-ctx: tokens of the joint check's chunk; -1: --ctx; 0: off */
    const char *window_select; /* --window-select predicted|measured|auto (NULL: auto) */
    double window_trust;       /* --window-trust (default 0.3) */
    int window_trust_given;
    int wins[16], n_wins;
    double more_bits[8];
    const char *more_out[8];
    int n_more_bits;
    const char *also[CALIB_MAX_ALSO]; /* --also option strings: more codebooks from the same forward pass */
    int n_also;
    int json; /* --json: one row per written file on stdout (schema kvpq.calibrate/1) */
} calib_args;

static void calib_usage(FILE *f) {
    fprintf(f,
            "usage: kvpq calibrate --model M --text FILE -o OUT.safetensors [options]\n"
            "  --model M             GGUF model (architecture llama, qwen2 or gemma3)\n"
            "  --text FILE           UTF-8 text whose keys and values train the codebooks\n"
            "  --tokens N            calibration tokens taken from the start of FILE (default 32768)\n"
            "  --ctx N               tokens per forward chunk; keys are seen at positions 0..N-1 (default 2048)\n"
            "  --keys CFG            key quantizer preset: d8b8 (1 bit), d8b12 (1.5), d4b8 (2), d4b12 (3), d2b8 (4),\n"
            "                        d1b8 (8) (default d4b8)\n"
            "  --keys-layers CFG:A-B[,CFG:A-B...]  layers A..B (inclusive, 0-based) get key preset CFG\n"
            "                        instead (its M; same nbits as --keys), e.g. d2b8:10-19\n"
            "  --values CFG          value quantizer preset, same names (default: as --keys)\n"
            "  --values-layers CFG:A-B[,...]  likewise for values (same nbits as --values), e.g. d2b8:0-1\n"
            "  --keys2 CFG           residual second key stage (Juang & Gray 1982): a preset with --keys's\n"
            "                        nbits coding stage one's error, e.g. --keys d8b8 --keys2 d8b8 (2 bits)\n"
            "  --granularity G       shared: one (ksub, dsub) codebook per layer and K/V, as VecInfer;\n"
            "                        subspace: (M, ksub, dsub), as faiss; head: (n_head_kv, ksub, dsub),\n"
            "                        one per KV head (default shared)\n"
            "  --value-rotate 0|1    Hadamard-rotate values before encoding (default 0)\n"
            "  --center 0|1          subtract the per-(KV head, channel) key mean before smoothing (default 1)\n"
            "  --smooth-query 0|1    1: query-aware smoothing factors lambda^2 = max|k| / max|q| per channel\n"
            "                        (SmoothQuant's balance; kvpq_smooth_compute_qk); 0: lambda^2 = max|k|,\n"
            "                        as VecInfer (default 1)\n"
            "  --key-norm 0|1        norm-explicit keys: code the direction, keep a float16 scale per vector\n"
            "                        (Dai et al., AAAI 2020; +16 bits per key vector) (default 1)\n"
            "  --value-norm 0|1      likewise for values (default 1)\n"
            "  --key-rope 0|1|auto   1: code keys before RoPE (KVQuant): the cache turns each key back by its\n"
            "                        position before coding and forward again at attention (codebook format\n"
            "                        version 5); auto (with --bits): every key candidate trained and measured\n"
            "                        both ways, the allocation chooses per layer (default 0)\n"
            "  --norm-bits 8|16      bits of each norm-explicit scale in the VQ cache: 16 (float16) or 8 (a\n"
            "                        log-coded byte, 1/16 octave steps; layers of at most 4 bits per element,\n"
            "                        finer ones keep float16; metadata k.norm_bits / v.norm_bits; the CUDA\n"
            "                        cache keeps float16) (default 8 with --bits, else 16)\n"
            "  --iters N             k-means Lloyd iterations (default 25)\n"
            "  --kmeans-init I       pp: k-means++ seeding; random: k distinct points, as faiss (default random)\n"
            "  --max-points-per-centroid N   k-means subsampling (default 256, as faiss; 32 for nbits>8)\n"
            "  --seed S              k-means seed (default 1234)\n"
            "  --quiet               no progress lines (forward pass, k-means) on stderr\n"
            "  --json                print one row per written file as JSON to stdout (schema\n"
            "                        kvpq.calibrate/1, docs/json.md)\n"
            "  --threads N           threads (default: all)\n"
            "  --bits B              choose each layer's key (and value) preset so that the VQ cache's effective\n"
            "                        bits per element at context --ctx stay <= B, minimizing the predicted loss\n"
            "                        (sum over layers of the KL each layer's coding costs alone, measured on\n"
            "                        text held back from k-means: the END of FILE); docs/allocation.md.\n"
            "                        Presets come from --candidates: not with --keys2, --keys-layers, --values-layers\n"
            "  --bits-also \"B OUT\"   also write the allocation for budget B to OUT, from the same\n"
            "                        measurements (repeatable, up to 8)\n"
            "  --candidates P,P,...  presets to choose among, one nbits; P1+P2 is a key candidate with a\n"
            "                        residual second stage P2 (one P2 per run), e.g. d4b8+d8b8 (3 bits);\n"
            "                        values take only single-stage presets (default\n"
            "                        d8b8,d4b8,d2b8,d8b8+d8b8,d4b8+d8b8: keys at 1, 2, 4, 2 and 3 bits)\n"
            "  --holdout-ctx N       tokens per held-out chunk of the measurement (default min(--ctx, 1024))\n"
            "  --holdout-chunks K    held-out chunks (default 1)\n"
            "  --holdout-repeat W    W >= 1: one more held-out chunk, the first one's first half twice,\n"
            "                        so the sensitivities also score copying from --holdout-ctx/2\n"
            "                        positions back (long-range retrieval, as a passkey needs), weighing W\n"
            "                        in their mean (each other chunk 1); 0: off (default 0, at most 16)\n"
            "  --window-candidates W,W,...  full-precision windows (newest positions in fp16) to choose\n"
            "                        among with the presets; the window's bytes count in the budget (default\n"
            "                        0,16,32,64,128; at most 16)\n"
            "  --window W            a fixed window instead (as --window-candidates W)\n"
            "  --sinks S             first positions kept in fp16 by that cache, counted in the budget\n"
            "                        (default 1)\n"
            "  --verify-ctx N        after each budget's allocation, check the written file as a whole: KL(fp16 ||\n"
            "                        file) mean and top-1 agreement, scored as kvpq ppl --kl-base fp16 scores, on\n"
            "                        one chunk of N tokens of FILE never seen by k-means nor the sensitivities\n"
            "                        (the tokens right after the k-means tokens); recorded as alloc.holdout_kl,\n"
            "                        alloc.holdout_top1 (default --ctx; 0: off)\n"
            "  --window-select S     predicted: keep the window whose allocation has the least predicted KL;\n"
            "                        measured: check every window's allocation (--verify-ctx) and keep the least\n"
            "                        held-out KL (one forward pass per window that fits); auto: predicted, and\n"
            "                        when the predicted KL of the chosen window is off its held-out KL by more\n"
            "                        than --window-trust, the next 2 windows by predicted KL checked too and\n"
            "                        the least held-out KL kept (default auto; predicted with --verify-ctx 0)\n"
            "  --window-trust F      auto's tolerance: |predicted / held-out - 1| <= F keeps the predicted\n"
            "                        choice (default 0.3)\n"
            "  --full-sensitivity 0|1  1: a forward pass per layer, kind and candidate; 0 (default): per layer\n"
            "                        and kind one pass at the --values candidate, the others scaled by the\n"
            "                        layer's attention-output error (3x cheaper with three candidates)\n"
            "  --alloc-values 0|1    also allocate values per layer (default 1 when per-layer value M exists;\n"
            "                        0: values keep --values in every layer)\n"
            "  --also \"OPTIONS -o OUT\"   also train and write another codebook from the same forward pass\n"
            "                        (repeatable, up to 16): OPTIONS override the codebook options above\n"
            "                        (--keys, --keys2, --values, --keys-layers, --values-layers, --granularity, --value-rotate, --center, --smooth-query,\n"
            "                        --key-norm, --value-norm, --key-rope, --norm-bits, --iters, --kmeans-init,\n"
            "                        --max-points-per-centroid, --seed); --keys-layers / --values-layers are not inherited and\n"
            "                        --values defaults to the job's --keys unless given on the main command\n");
}

/* Every option of calibrate (cli_unknown_option suggests the nearest). */
static const char *const CALIB_OPTS[] = {"--help", "-h", "--quiet", "-q", "--json", "--also", "--model", "--text", "-o", "--out",
                                         "--keys", "--keys-layers", "--values", "--values-layers", "--keys2",
                                         "--granularity", "--kmeans-init", "--tokens", "--ctx", "--iters", "--threads",
                                         "--value-rotate", "--center", "--smooth-query", "--key-norm", "--value-norm",
                                         "--key-rope", "--norm-bits", "--max-points-per-centroid", "--seed", "--bits", "--candidates",
                                         "--holdout-ctx", "--holdout-chunks", "--window", "--window-candidates",
                                         "--sinks", "--alloc-values", "--full-sensitivity", "--bits-also",
                                         "--verify-ctx", "--window-select", "--window-trust", NULL};

/* The options an --also string may hold: those of one codebook (its help lists them) and its output.
 * Everything else (the forward pass, the allocation, --also itself) is the main command's: accepted
 * there, it was ignored here before (issue 31: --also "--bits 3 -o B" wrote a plain d4b8 book). */
static int is_job_option(const char *o) {
    static const char *const JOB[] = {"--keys", "--keys2", "--values", "--keys-layers", "--values-layers",
                                      "--granularity", "--value-rotate", "--center", "--smooth-query", "--key-norm",
                                      "--value-norm", "--key-rope", "--norm-bits", "--iters", "--kmeans-init",
                                      "--max-points-per-centroid", "--seed", "-o", "--out", "--help", "-h",
                                      "--quiet", "-q"};
    for (size_t i = 0; i < sizeof JOB / sizeof JOB[0]; i++)
        if (!strcmp(o, JOB[i])) return 1;
    return 0;
}

/* Parse options into a (defaults already set). job: parsing an --also string, where the options of
 * the forward pass (--model, --text, --tokens, --ctx, --threads) and --also itself are refused.
 * Returns 1, 0 for --help, -2 after printing a usage error. */
static int parse_opts(int argc, char **argv, calib_args *a, int job) {
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(o, "--help") || !strcmp(o, "-h")) {
            calib_usage(stdout);
            return 0;
        }
        if (!strcmp(o, "--quiet") || !strcmp(o, "-q")) {
            cli_quiet = 1;
            continue;
        }
        if (!job && !strcmp(o, "--json")) {
            a->json = 1;
            continue;
        }
        int known = 0;
        for (int k = 0; CALIB_OPTS[k]; k++) known |= !strcmp(o, CALIB_OPTS[k]);
        if (job && known && !is_job_option(o)) {
            if (!strcmp(o, "--bits"))
                return cli_usage_error("calibrate: --also: --bits belongs to the main command; another budget from "
                                       "the same measurements is --bits-also \"B OUT\""), -2;
            return cli_usage_error("calibrate: --also: %s belongs to the main command (one forward pass and one "
                                   "allocation serve every codebook; --also takes codebook options, see --help)", o), -2;
        }
        if (!job && !strcmp(o, "--also")) {
            if (!v) return cli_usage_error("calibrate: --also needs a value"), -2;
            if (a->n_also == CALIB_MAX_ALSO) return cli_usage_error("calibrate: at most %d --also", CALIB_MAX_ALSO), -2;
            a->also[a->n_also++] = v;
            i++;
            continue;
        }
#define STR_OPT(name, field)                                                       \
    if (!strcmp(o, name)) {                                                        \
        if (!v) return cli_usage_error("calibrate: %s needs a value", name), -2;  \
        a->field = v;                                                              \
        i++;                                                                       \
        continue;                                                                  \
    }
#define INT_OPT(name, field, lo, hi)                                \
    if (!strcmp(o, name)) {                                         \
        if (!cli_parse_int(name, v, lo, hi, &a->field)) return -2; \
        i++;                                                        \
        continue;                                                   \
    }
        STR_OPT("--model", model)
        STR_OPT("--text", text)
        STR_OPT("-o", out)
        STR_OPT("--out", out)
        STR_OPT("--keys", keys)
        STR_OPT("--keys-layers", keys_layers)
        STR_OPT("--values", values)
        STR_OPT("--values-layers", values_layers)
        STR_OPT("--keys2", keys2)
        STR_OPT("--granularity", granularity)
        STR_OPT("--kmeans-init", kmeans_init)
        INT_OPT("--tokens", tokens, 16, 1L << 24)
        INT_OPT("--ctx", ctx, 16, 1L << 20)
        INT_OPT("--iters", iters, 1, 1000)
        INT_OPT("--threads", threads, 0, 1024)
        INT_OPT("--value-rotate", value_rotate, 0, 1)
        INT_OPT("--center", center, 0, 1)
        INT_OPT("--smooth-query", smooth_query, 0, 1)
        INT_OPT("--key-norm", key_norm, 0, 1)
        INT_OPT("--value-norm", value_norm, 0, 1)
        if (!strcmp(o, "--key-rope")) { /* 0, 1 or auto */
            if (!v || (strcmp(v, "0") && strcmp(v, "1") && strcmp(v, "auto")))
                return cli_usage_error("calibrate: --key-rope: expected 0, 1 or auto, got '%s'", v ? v : "(missing)"), -2;
            a->key_rope = !strcmp(v, "auto") ? KVPQ_KEY_ROPE_CHOOSE : v[0] - '0';
            i++;
            continue;
        }
        INT_OPT("--norm-bits", norm_bits, 8, 16)
        INT_OPT("--max-points-per-centroid", max_ppc, 1, 1L << 20)
        INT_OPT("--seed", seed, 0, 0x7fffffffL)
        STR_OPT("--candidates", cands)
        INT_OPT("--holdout-ctx", holdout_ctx, 64, 1L << 20)
        INT_OPT("--holdout-chunks", holdout_chunks, 1, 1024)
        INT_OPT("--holdout-repeat", holdout_repeat, 0, KVPQ_HOLDOUT_REPEAT_MAX)
        INT_OPT("--window", window, 0, 1L << 20)
        STR_OPT("--window-candidates", window_cands)
        INT_OPT("--sinks", sinks, 0, 1L << 20)
        INT_OPT("--alloc-values", alloc_values, 0, 1)
        INT_OPT("--full-sensitivity", full_sens, 0, 1)
        INT_OPT("--verify-ctx", verify_ctx, 0, 1L << 20)
        STR_OPT("--window-select", window_select)
        if (!strcmp(o, "--window-trust")) {
            if (!cli_parse_double("--window-trust", v, 0, 100, &a->window_trust)) return -2;
            a->window_trust_given = 1;
            i++;
            continue;
        }
        if (!strcmp(o, "--bits-also")) { /* "B OUT": another budget from the same measurements */
            char *end = NULL;
            if (!v || a->n_more_bits == 8) return cli_usage_error("calibrate: --bits-also needs \"B OUT\" (at most 8)"), -2;
            double b = strtod(v, &end);
            const size_t nb = strspn(v, "0123456789.eE+-"); /* plain decimal (not " 2", "0x10"): see --bits */
            if (end == v || v + nb != end || *end != ' ' || !(b > 0 && b <= 32) || !end[1])
                return cli_usage_error("calibrate: --bits-also '%s': expected \"B OUT\", B in (0, 32]", v), -2;
            a->more_bits[a->n_more_bits] = b;
            a->more_out[a->n_more_bits++] = end + 1;
            i++;
            continue;
        }
        if (!strcmp(o, "--bits")) { /* plain decimal (cli_parse_double: not " 2", "0x10", "inf") in (0, 32] */
            if (!cli_parse_double("calibrate: --bits", v, 0, 32, &a->bits)) return -2;
            if (!(a->bits > 0)) return cli_usage_error("calibrate: --bits '%s': expected a number in (0, 32]", v), -2;
            i++;
            continue;
        }
#undef STR_OPT
#undef INT_OPT
        return cli_unknown_option("calibrate", o, CALIB_OPTS), -2;
    }
    return 1;
}

/* Checks and defaults once all options of a job are in. */
static int finish_job(calib_args *a, const char *what) {
    if (!a->out) return cli_usage_error("calibrate: %s needs -o OUT (see kvpq calibrate --help)", what), -2;
    if (!a->values) a->values = a->keys;
    if (!a->kmeans_init) a->kmeans_init = "random";
    if (strcmp(a->kmeans_init, "pp") && strcmp(a->kmeans_init, "random"))
        return cli_usage_error("calibrate: --kmeans-init '%s': expected pp or random", a->kmeans_init), -2;
    if (strcmp(a->granularity, "shared") && strcmp(a->granularity, "subspace") && strcmp(a->granularity, "head"))
        return cli_usage_error("calibrate: --granularity '%s': expected shared, subspace or head", a->granularity), -2;
    if (a->norm_bits != 8 && a->norm_bits != 16)
        return cli_usage_error("calibrate: --norm-bits %ld: expected 8 or 16", a->norm_bits), -2;
    return 1;
}

/* --window W or --window-candidates W,W,... (default 0,16,32,64,128) into a->wins (the library
 * sorts them and names a repeated one). */
static int parse_windows(calib_args *a) {
    if (a->window >= 0 && a->window_cands)
        return cli_usage_error("calibrate: --window and --window-candidates: give one (--window W is "
                               "--window-candidates W)"), -2;
    if (a->window >= 0) {
        a->wins[0] = (int)a->window, a->n_wins = 1;
        return 1;
    }
    const char *w = a->window_cands ? a->window_cands : "0,16,32,64,128";
    for (a->n_wins = 0;; w++) {
        char *end = NULL;
        errno = 0;
        long x = strtol(w, &end, 10);
        if (end == w || (*end && *end != ',') || errno || x < 0 || x > (1L << 20) || a->n_wins == 16)
            return cli_usage_error("calibrate: --window-candidates '%s': expected up to 16 comma-separated "
                                   "windows in 0..%ld", a->window_cands ? a->window_cands : "", 1L << 20), -2;
        a->wins[a->n_wins++] = (int)x;
        if (!*end) return 1;
        w = end;
    }
}

/* The options that only --bits uses, given without it (before the model loads). */
static int check_bits_options(const calib_args *a) {
    if (a->verify_ctx >= 0 && !(a->bits > 0))
        return cli_usage_error("calibrate: --verify-ctx checks the allocation of --bits: not used without it"), -2;
    if (a->window_select && strcmp(a->window_select, "predicted") && strcmp(a->window_select, "measured") &&
        strcmp(a->window_select, "auto"))
        return cli_usage_error("calibrate: --window-select '%s': expected predicted, measured or auto",
                               a->window_select), -2;
    if (a->window_select && !(a->bits > 0))
        return cli_usage_error("calibrate: --window-select chooses the window of --bits: not used without it"), -2;
    if (a->window_trust_given && (!(a->bits > 0) || (a->window_select && strcmp(a->window_select, "auto"))))
        return cli_usage_error("calibrate: --window-trust is the tolerance of --window-select auto (with --bits): "
                               "not used with %s", a->bits > 0 ? "--window-select predicted or measured" : "no --bits"), -2;
    if (a->window_trust_given && a->verify_ctx == 0)
        return cli_usage_error("calibrate: --window-trust is the tolerance of the joint check's window choice: not "
                               "used with --verify-ctx 0"), -2;
    return 1;
}

/* jobs[j]: one --also string (split at spaces, over the main command's codebook options base). */
static int parse_also(const calib_args *base, int j, calib_args *jobs, char **split_buf) {
    calib_args *b = &jobs[1 + j];
    *b = *base;
    b->out = NULL;
    b->keys_layers = NULL;
    b->values_layers = NULL;
    b->n_also = 0;
    size_t len = strlen(base->also[j]) + 1;
    if (!(split_buf[j] = malloc(len))) return cli_usage_error("calibrate: out of memory"), -2;
    memcpy(split_buf[j], base->also[j], len);
    char *sv[64];
    int sc = 1, r;
    for (char *t = strtok(split_buf[j], " "); t; t = strtok(NULL, " ")) {
        if (sc == 64) return cli_usage_error("calibrate: --also '%s': too many words", base->also[j]), -2;
        sv[sc++] = t;
    }
    if ((r = parse_opts(sc, sv, b, 1)) <= 0) return r < 0 ? r : -2;
    char what[96];
    snprintf(what, sizeof what, "--also '%.60s'", base->also[j]);
    if ((r = finish_job(b, what)) <= 0) return r;
    for (int i = 0; i <= j; i++) /* jobs[0 .. j] */
        if (!strcmp(jobs[i].out, b->out))
            return cli_usage_error("calibrate: %s writes '%s', which another codebook of this command writes too",
                                   what, b->out), -2;
    return 1;
}

/* jobs[0] gets the main command's options, jobs[1..] one --also string each. *n_jobs = 1 + number
 * of --also. Returns 1, 0 for --help, -2 after printing a usage error. */
static int parse_args(int argc, char **argv, calib_args *jobs, int *n_jobs, char **split_buf) {
    calib_args *a = &jobs[0];
    *a = (calib_args){.keys = "d4b8", .granularity = "shared", .tokens = 32768, .ctx = 2048, .iters = 25,
                      .seed = 1234, .max_ppc = -1, .center = 1, .smooth_query = 1, .key_norm = 1, .value_norm = 1,
                      .cands = "d8b8,d4b8,d2b8,d8b8+d8b8,d4b8+d8b8", .holdout_chunks = 1, .window = -1,
                      .alloc_values = -1, .sinks = 1, .verify_ctx = -1, .window_trust = 0.3};
    int r = parse_opts(argc, argv, a, 0);
    if (r <= 0) return r;
    /* --norm-bits: 8 with --bits (the budget is the CPU cache's effective bits, which the byte saves;
     * docs/vq_cache.md "8-bit scales"), else 16 (uniform files; the CUDA cache keeps float16) */
    if (!a->norm_bits) a->norm_bits = a->bits > 0 ? 8 : 16;
    if (!a->model || !a->text || !a->out)
        return cli_usage_error("calibrate: --model, --text and -o are required (see kvpq calibrate --help)"), -2;
    if ((r = parse_windows(a)) <= 0 || (r = check_bits_options(a)) <= 0) return r;
    calib_args base = *a; /* before defaults: --values stays unset unless given */
    if ((r = finish_job(a, "the main command")) <= 0) return r;
    *n_jobs = 1 + base.n_also;
    for (int j = 0; j < base.n_also; j++)
        if ((r = parse_also(&base, j, jobs, split_buf)) <= 0) return r;
    return 1;
}

/* ---- the library's options from the CLI's ---- */

static kvpq_codebook_recipe to_recipe(const calib_args *a) {
    kvpq_codebook_recipe r = kvpq_codebook_recipe_default();
    r.keys = a->keys, r.values = a->values, r.keys2 = a->keys2;
    r.keys_layers = a->keys_layers, r.values_layers = a->values_layers;
    r.granularity = !strcmp(a->granularity, "shared")     ? KVPQ_CODEBOOK_SHARED
                    : !strcmp(a->granularity, "subspace") ? KVPQ_CODEBOOK_SUBSPACE
                                                           : KVPQ_CODEBOOK_HEAD;
    r.value_rotate = (int)a->value_rotate, r.center = (int)a->center, r.smooth_query = (int)a->smooth_query;
    r.key_norm = (int)a->key_norm, r.value_norm = (int)a->value_norm, r.norm_bits = (int)a->norm_bits;
    r.key_rope = (int)a->key_rope;
    r.iters = (int)a->iters, r.seed = (uint64_t)a->seed;
    r.kmeans_init = strcmp(a->kmeans_init, "pp") ? KVPQ_KMEANS_INIT_RANDOM : KVPQ_KMEANS_INIT_PP;
    r.max_points_per_centroid = a->max_ppc > 0 ? (int)a->max_ppc : 0;
    return r;
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* budgets: (9) filled with --bits and --bits-also. */
static kvpq_calibrate_opts to_opts(const calib_args *a, double *budgets) {
    kvpq_calibrate_opts o = kvpq_calibrate_opts_default();
    o.tokens = (size_t)a->tokens, o.ctx = (int)a->ctx, o.n_threads = (int)a->threads;
    o.recipe = to_recipe(a);
    o.model_file = base_name(a->model), o.text_name = base_name(a->text);
    kvpq_alloc_params *p = &o.alloc;
    if (a->bits > 0) {
        budgets[0] = a->bits;
        for (int i = 0; i < a->n_more_bits; i++) budgets[1 + i] = a->more_bits[i];
        p->bits = budgets, p->n_bits = 1 + a->n_more_bits;
    }
    p->candidates = a->cands, p->windows = a->wins, p->n_windows = a->n_wins, p->sinks = (int)a->sinks;
    p->holdout_ctx = (int)a->holdout_ctx, p->holdout_chunks = (int)a->holdout_chunks;
    p->holdout_repeat = (int)a->holdout_repeat;
    p->full_sensitivity = (int)a->full_sens, p->alloc_values = (int)a->alloc_values, p->verify_ctx = (int)a->verify_ctx;
    p->window_select = !a->window_select || !strcmp(a->window_select, "auto") ? KVPQ_WINDOW_SELECT_AUTO
                       : !strcmp(a->window_select, "measured")                ? KVPQ_WINDOW_SELECT_MEASURED
                                                                              : KVPQ_WINDOW_SELECT_PREDICTED;
    p->window_trust = a->window_trust;
    return o;
}

/* ---- progress: one cli_progress line per stage of the library's calibration ---- */

typedef struct {
    cli_progress p;
    char stage[32];
    double last;
    int active;
} stage_progress;

static int on_progress(void *user, const char *stage, double done, double total) {
    stage_progress *sp = user;
    if (!strcmp(stage, "check")) return 0;
    if (sp->active && (strcmp(sp->stage, stage) || done < sp->last)) {
        cli_progress_end(&sp->p, sp->last, NULL);
        sp->active = 0;
    }
    if (!sp->active) {
        const int fwd = !strcmp(stage, "forward"), km = !strcmp(stage, "k-means");
        cli_progress_begin(&sp->p, fwd ? "calibrate: forward" : km ? "calibrate: k-means" : "calibrate: per-layer sensitivity",
                           fwd ? "tokens" : km ? "layers" : "measurements", total);
        snprintf(sp->stage, sizeof sp->stage, "%s", stage);
        sp->active = 1;
    }
    sp->last = done;
    if (done < total) {
        cli_progress_update(&sp->p, done, NULL);
        return 0;
    }
    cli_progress_end(&sp->p, done, NULL);
    sp->active = 0;
    return 0;
}

/* End the line of the stage in progress (before results are printed). */
static void stage_end(stage_progress *sp) {
    if (sp->active) cli_progress_end(&sp->p, sp->last, NULL);
    sp->active = 0;
}

/* ---- what an allocation found, on stderr ---- */

/* Each window's check, when more than one was checked (--window-select measured, or auto when the
 * prediction was off). */
static void print_windows(const kvpq_alloc_report *r, double trust) {
    int n_checked = 0;
    for (int w = 0; w < r->n_windows; w++) n_checked += !isnan(r->measured_kl_w[w]);
    for (int w = 0; w < r->n_windows && n_checked > 1; w++) {
        if (isnan(r->measured_kl_w[w])) continue;
        fprintf(stderr, "kvpq calibrate: --bits %.3g, window %d: predicted KL %.4f, held-out KL %.4f (top-1 %.1f%%)\n",
                r->bits, r->windows[w], r->predicted_kl_w[w], r->measured_kl_w[w], 100.0 * r->measured_top1_w[w]);
        if (r->rechecked && r->windows[w] == r->predicted_window)
            fprintf(stderr, "kvpq calibrate: --bits %.3g, window %d: predicted KL %.4f is %.2f x the held-out KL %.4f (off "
                            "by more than %.0f%%): checking the next %d window%s by predicted KL\n", r->bits, r->windows[w],
                    r->predicted_kl_w[w], r->predicted_kl_w[w] / r->measured_kl_w[w], r->measured_kl_w[w], 100 * trust,
                    n_checked - 1, n_checked > 2 ? "s" : "");
    }
}

/* The i-th comma-separated item of a metadata list into buf. */
static const char *list_item(const char *list, int i, char *buf, size_t cap) {
    for (; list && i > 0; i--) list = strchr(list, ','), list = list ? list + 1 : NULL;
    if (!list) return "?";
    snprintf(buf, cap, "%.*s", (int)strcspn(list, ","), list);
    return buf;
}

static void print_allocation(const kvpq_codebook *cb, const kvpq_alloc_report *r, const calib_args *a, int L) {
    const long ctx = a->ctx, sinks = a->sinks;
    print_windows(r, a->window_trust);
    fprintf(stderr, "kvpq calibrate: allocation for %.3g bits at ctx %ld (window %d of", r->bits, ctx, r->window);
    for (int w = 0; w < r->n_windows; w++) {
        if (isfinite(r->predicted_kl_w[w])) fprintf(stderr, " %d (KL %.4g)", r->windows[w], r->predicted_kl_w[w]);
        else fprintf(stderr, " %d (none fits)", r->windows[w]);
    }
    fprintf(stderr, ", sinks %ld): effective %.4f bits, predicted KL %.4f", sinks, r->effective_bits, r->predicted_kl);
    if (!isnan(r->holdout_kl))
        fprintf(stderr, ", held-out KL %.4f (top-1 %.1f%%, ppl %.4f vs fp16 %.4f; predicted / held-out %.2f)",
                r->holdout_kl, 100.0 * r->holdout_top1, r->holdout_ppl, r->base_ppl, r->predicted_kl / r->holdout_kl);
    fprintf(stderr, "\n  layer: key preset (KL) / value preset (KL)\n");
    const char *k = kvpq_codebook_get_meta(cb, "alloc.k"), *v = kvpq_codebook_get_meta(cb, "alloc.v");
    const char *klk = kvpq_codebook_get_meta(cb, "alloc.kl.k"), *klv = kvpq_codebook_get_meta(cb, "alloc.kl.v");
    char b1[32], b2[32], b3[32], b4[32];
    for (int l = 0; l < L; l++)
        fprintf(stderr, "  %3d: %s (%s) / %s (%s)\n", l, list_item(k, l, b1, sizeof b1), list_item(klk, l, b2, sizeof b2),
                list_item(v, l, b3, sizeof b3), list_item(klv, l, b4, sizeof b4));
}

/* ---- --json: settings, and a row per written file ---- */

static cJSON *json_doc(const calib_args *a, const kvpq_calibration *cal, cJSON **rows) {
    cJSON *settings = NULL, *doc = cli_json_new("calibrate", &settings, rows);
    if (!doc) return NULL;
    kvpq_calibration_info in;
    kvpq_calibration_info_get(cal, &in);
    cJSON_AddStringToObject(settings, "model", a->model);
    cJSON_AddStringToObject(settings, "text", a->text);
    cJSON_AddNumberToObject(settings, "text_tokens", (double)in.n_text);
    cJSON_AddNumberToObject(settings, "tokens", (double)in.n_kmeans);
    cJSON_AddNumberToObject(settings, "ctx", (double)a->ctx);
    cJSON_AddNumberToObject(settings, "threads", (double)a->threads);
    cJSON_AddStringToObject(settings, "simd", kvpq_simd_name(kvpq_simd_get()));
    cJSON_AddNumberToObject(settings, "forward_s", in.forward_seconds);
    return doc;
}

/* The row of a written file: what the codebook's metadata says, and an allocation's report. */
static void json_row(cJSON *rows, const char *out, const kvpq_codebook *cb, const kvpq_alloc_report *r) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return;
    cJSON_AddStringToObject(o, "file", out);
    cJSON_AddStringToObject(o, "keys", kvpq_codebook_get_meta(cb, "keys"));
    cJSON_AddStringToObject(o, "values", kvpq_codebook_get_meta(cb, "values"));
    cli_json_num(o, "key_mse_mean", atof(kvpq_codebook_get_meta(cb, "key_mse_mean")));
    cli_json_num(o, "value_mse_mean", atof(kvpq_codebook_get_meta(cb, "value_mse_mean")));
    if (r) {
        cli_json_num(o, "bits", r->bits);
        cli_json_num(o, "effective_bits", r->effective_bits);
        cli_json_num(o, "predicted_kl", r->predicted_kl);
        cJSON_AddNumberToObject(o, "window", r->window);
        cJSON_AddNumberToObject(o, "sinks", atof(kvpq_codebook_get_meta(cb, "alloc.sinks")));
        cli_json_num(o, "holdout_kl", r->holdout_kl);
        cli_json_num(o, "holdout_top1", r->holdout_top1);
        cli_json_num(o, "holdout_ppl", r->holdout_ppl);
        cli_json_num(o, "holdout_ppl_base", r->base_ppl);
        cli_json_num(o, "kmeans_s", r->kmeans_seconds);
        cli_json_num(o, "sensitivity_s", r->sensitivity_seconds);
        cli_json_num(o, "check_s", r->check_seconds);
    }
    cJSON_AddItemToArray(rows, o);
}

/* ---- the command ---- */

/* Save cb to path; 0 or an exit code. */
static int save(const kvpq_codebook *cb, const char *path) {
    kvpq_status s = kvpq_codebook_save(cb, path);
    return s == KVPQ_OK ? 0 : cli_fail("calibrate: writing the codebook file", s);
}

/* --bits: every budget's codebook written (or named as not fitting). */
static int run_alloc(const calib_args *a, kvpq_calibration *cal, int L, stage_progress *sp, cJSON *rows, double t0) {
    kvpq_codebook *cb[9] = {0};
    kvpq_alloc_report rep[9];
    const int n = 1 + a->n_more_bits;
    kvpq_status s = kvpq_calibration_allocate(cal, cb, rep);
    stage_end(sp);
    if (s != KVPQ_OK && s != KVPQ_ERR_CAPACITY) return cli_fail("calibrate", s);
    int rc = 0;
    for (int i = 0; i < n; i++) {
        const char *out = i ? a->more_out[i - 1] : a->out;
        if (!cb[i]) {
            fprintf(stderr, "kvpq calibrate: --bits %g at ctx %ld: no allocation fits at any window (the lightest "
                            "needs %.4f effective bits); %s not written\n", rep[i].bits, a->ctx, rep[i].lightest_bits, out);
            rc = 1;
            continue;
        }
        print_allocation(cb[i], &rep[i], a, L);
        const int failed = save(cb[i], out);
        rc |= failed;
        if (!failed && rows) json_row(rows, out, cb[i], &rep[i]);
        if (!failed)
            fprintf(stderr, "kvpq calibrate: wrote %s (k-means %.1f s, sensitivity %.1f s, joint check %.1f s, total "
                            "%.1f s)\n", out, rep[i].kmeans_seconds, rep[i].sensitivity_seconds, rep[i].check_seconds,
                    cli_now() - t0);
        kvpq_codebook_free(cb[i]);
    }
    return rc;
}

/* One job's codebook trained and written. */
static int run_job(const calib_args *a, kvpq_calibration *cal, stage_progress *sp, cJSON *rows, double t0) {
    const kvpq_codebook_recipe r = to_recipe(a);
    kvpq_codebook *cb = NULL;
    const double t1 = cli_now();
    kvpq_status s = kvpq_calibration_train(cal, &r, &cb);
    stage_end(sp);
    if (s != KVPQ_OK) return cli_fail("calibrate", s);
    int rc = save(cb, a->out);
    if (!rc && rows) json_row(rows, a->out, cb, NULL);
    if (!rc)
        fprintf(stderr, "kvpq calibrate: wrote %s (keys %s%s%s%s%s, values %s%s%s, %s tokens; k-means %.1f s, total "
                        "%.1f s)\n", a->out, a->keys, a->keys_layers ? " with " : "", a->keys_layers ? a->keys_layers : "",
                a->key_norm ? " norm-explicit" : "", a->key_rope ? " before RoPE" : "", a->values, a->value_rotate ? " rotated" : "",
                a->value_norm ? " norm-explicit" : "", kvpq_codebook_get_meta(cb, "tokens"), cli_now() - t1, cli_now() - t0);
    kvpq_codebook_free(cb);
    return rc;
}

/* Every output checked before any work: not an input, writable, one file per budget. */
static int check_outputs(const calib_args *jobs, int n_jobs) {
    const calib_args *a = &jobs[0];
    const char *in_opts[2] = {"--model", "--text"}, *inputs[2] = {a->model, a->text};
    int rc;
    for (int j = 0; j < n_jobs; j++)
        if ((rc = cli_check_output("calibrate", jobs[j].out, 2, in_opts, inputs)) != 0) return rc;
    for (int i = 0; i < a->n_more_bits; i++) {
        if ((rc = cli_check_output("calibrate --bits-also", a->more_out[i], 2, in_opts, inputs)) != 0) return rc;
        for (int j = -1; j < i; j++)
            if (!strcmp(a->more_out[i], j < 0 ? a->out : a->more_out[j]))
                return cli_usage_error("calibrate: --bits-also %g %s: the same output as %s (one file per budget)",
                                       a->more_bits[i], a->more_out[i], j < 0 ? "-o" : "an earlier --bits-also");
    }
    return 0;
}

/* The text's tokens (no BOS) into *toks, *n. 0 or an exit code. */
static int read_tokens(const kvpq_model *m, const char *path, int32_t **toks, size_t *n) {
    size_t len = 0;
    char *text = cli_read_file(path, &len);
    if (!text) return cli_usage_error("calibrate: cannot read text file '%s': %s", path, cli_read_error());
    kvpq_status s = kvpq_tokenize(m, text, len, 0, 0, NULL, 0, n);
    if (s == KVPQ_OK && !(*toks = malloc((*n ? *n : 1) * sizeof **toks))) s = KVPQ_ERR_NOMEM;
    if (s == KVPQ_OK) s = kvpq_tokenize(m, text, len, 0, 0, *toks, *n, n);
    free(text);
    return s == KVPQ_OK ? 0 : cli_fail("calibrate: tokenizing the text file", s);
}

/* Every job's options checked (m NULL: what needs no model, before it loads; else against the
 * model and the text, before the forward pass). */
static int check_jobs(const kvpq_model *m, const calib_args *jobs, int n_jobs, const kvpq_calibrate_opts *o, size_t n) {
    kvpq_calibrate_opts x = *o;
    for (int j = 0; j < n_jobs; j++) {
        if (j) x.recipe = to_recipe(&jobs[j]), x.alloc.n_bits = 0;
        if (kvpq_calibrate_opts_check(m, &x, n) == KVPQ_OK) continue;
        const char *msg = kvpq_last_error();
        if (!strncmp(msg, "calibrate: ", 11)) msg += 11;
        if (j) return cli_usage_error("calibrate: --also '%.60s': %s", jobs[0].also[j - 1], msg);
        return cli_usage_error("calibrate: %s", msg);
    }
    return 0;
}

/* The notes on how the text was split. */
static void print_split(const calib_args *a, const kvpq_calibration *cal) {
    kvpq_calibration_info in;
    kvpq_calibration_info_get(cal, &in);
    if (in.n_kmeans < (size_t)a->tokens)
        fprintf(stderr, "kvpq calibrate: the text has %zu tokens; using %zu of them for k-means (asked for %ld)\n",
                in.n_text, in.n_kmeans, a->tokens);
    if (in.verify_skipped)
        fprintf(stderr, "kvpq calibrate: warning: no joint check of the allocation: the text has %zu tokens: %zu for "
                        "k-means and %d x %d held out for the sensitivities leave %zu, fewer than --verify-ctx %ld "
                        "(default: --ctx); alloc.holdout_kl not written\n", in.n_text, in.n_kmeans, in.holdout_chunks,
                in.holdout_ctx, in.n_text - (size_t)in.holdout_chunks * in.holdout_ctx - in.n_kmeans, a->ctx);
}

int cmd_calibrate(int argc, char **argv) {
    calib_args jobs[1 + CALIB_MAX_ALSO];
    char *split_buf[CALIB_MAX_ALSO] = {0};
    int n_jobs = 1, rc = 1;
    kvpq_model *model = NULL;
    kvpq_calibration *cal = NULL;
    cJSON *doc = NULL;
    int32_t *tokens = NULL;
    size_t n_tok = 0;
    const double t0 = cli_now();
    int pr = parse_args(argc, argv, jobs, &n_jobs, split_buf);
    if (pr <= 0) {
        rc = pr == 0 ? 0 : 2;
        goto done;
    }
    const calib_args *a = &jobs[0];
    if ((rc = check_outputs(jobs, n_jobs)) != 0) goto done;
    double budgets[9];
    kvpq_calibrate_opts o = to_opts(a, budgets);
    if ((rc = check_jobs(NULL, jobs, n_jobs, &o, 0)) != 0) goto done;
    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)a->threads;
    kvpq_status s = kvpq_model_load(&model, a->model, &mp);
    if (s != KVPQ_OK) {
        rc = cli_fail("calibrate: loading the model", s);
        goto done;
    }
    if ((rc = read_tokens(model, a->text, &tokens, &n_tok)) != 0) goto done;
    if ((rc = check_jobs(model, jobs, n_jobs, &o, n_tok)) != 0) goto done;
    stage_progress sp = {0};
    o.progress = on_progress, o.progress_user = &sp;
    if ((s = kvpq_calibration_new(&cal, model, tokens, n_tok, &o)) != KVPQ_OK) {
        rc = cli_fail("calibrate", s);
        goto done;
    }
    stage_end(&sp);
    print_split(a, cal);
    kvpq_model_info mi;
    kvpq_model_get_info(model, &mi);
    cJSON *rows = NULL;
    if (a->json && !(doc = json_doc(a, cal, &rows))) {
        rc = cli_usage_error("calibrate: out of memory");
        goto done;
    }
    for (int j = 0; j < n_jobs && rc == 0; j++)
        rc = j == 0 && a->bits > 0 ? run_alloc(a, cal, mi.n_layer, &sp, rows, t0) : run_job(&jobs[j], cal, &sp, rows, t0);
    if (doc && rc == 0) rc = cli_json_print(doc), doc = NULL;
done:
    cJSON_Delete(doc);
    for (int j = 0; j < CALIB_MAX_ALSO; j++) free(split_buf[j]);
    kvpq_calibration_free(cal);
    free(tokens);
    kvpq_model_free(model);
    return rc;
}
