/* cmd_calibrate.c — `kvpq calibrate`: train a model's key/value codebooks on its real activations.
 * One forward pass can serve several codebooks (--also: each job its own options and output file).
 *
 * Runs the model over a text with an fp32 cache, reads back every layer's post-RoPE keys and values,
 * subtracts the per-(KV head, channel) key mean mu (stored as layers.{i}.k.mean; exact at attention
 * time, see cache_vq.c), computes the key smoothing factors lambda = sqrt(max |K - mu|) per KV head
 * and channel, divides the keys by them and rotates them with the normalized Hadamard transform
 * (VecInfer, arXiv 2510.06175, sec. 3), rotates the values too when asked, and trains one key and one value codebook per layer by
 * k-means on the transformed data (all KV heads of a layer pooled). Writes a safetensors codebook
 * file (kvpq_codebook_save) with the model, text, token count and configuration as metadata. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "cli_model.h"
#include "cli_score.h"
#include "cli_spec.h"

#define CALIB_MAX_ALSO 16
/* Tokens per forward step of the activation collection (read back after each step). */
#define CALIB_STEP 512

typedef struct {
    const char *model, *text, *out, *keys, *values, *granularity, *keys_layers, *values_layers, *kmeans_init, *keys2;
    long tokens, ctx, iters, threads, value_rotate, max_ppc, center, key_norm, value_norm, smooth_query, norm_bits;
    /* (n_layer, n_head_kv, head_dim): max |q| per KV head's query group and channel over the
     * calibration text (kvpq_model_eval_query_absmax); set after the forward pass */
    const float *q_absmax;
    long seed;
    /* --bits: automatic per-layer allocation (docs/allocation.md) */
    double bits;
    const char *cands;
    long holdout_ctx, holdout_chunks, window, alloc_values, sinks, full_sens;
    const char *window_cands; /* --window-candidates; parsed into wins (ascending, distinct) */
    long verify_ctx;          /* --verify-ctx: tokens of the joint check's chunk; -1: --ctx; 0: off */
    const char *window_select; /* --window-select predicted|measured|auto (NULL: auto) */
    double window_trust;       /* --window-trust: auto trusts a prediction within this fraction of the
                                * held-out KL (default 0.3: issue #18's target for predicted vs measured) */
    int window_trust_given;
    int wins[16], n_wins;
    double more_bits[8];
    const char *more_out[8];
    int n_more_bits;
    const char *also[CALIB_MAX_ALSO]; /* --also option strings: more codebooks from the same forward pass */
    int n_also;
} calib_args;

static void calib_usage(FILE *f) {
    fprintf(f,
            "usage: kvpq calibrate --model M --text FILE -o OUT.safetensors [options]\n"
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
            "  --norm-bits 8|16      bits of each norm-explicit scale in the VQ cache: 16 (float16) or 8 (a\n"
            "                        log-coded byte, 1/16 octave steps; layers of at most 4 bits per element,\n"
            "                        finer ones keep float16; metadata k.norm_bits / v.norm_bits; the CUDA\n"
            "                        cache keeps float16) (default 8 with --bits, else 16)\n"
            "  --iters N             k-means Lloyd iterations (default 25)\n"
            "  --kmeans-init I       pp: k-means++ seeding; random: k distinct points, as faiss (default random)\n"
            "  --max-points-per-centroid N   k-means subsampling (default 256, as faiss; 32 for nbits>8)\n"
            "  --seed S              k-means seed (default 1234)\n"
            "  --quiet               no progress lines (forward pass, k-means) on stderr\n"
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
            "                        measured when the predicted KL of the chosen window is off its held-out KL\n"
            "                        by more than --window-trust (default auto; predicted with --verify-ctx 0)\n"
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
            "                        --key-norm, --value-norm, --norm-bits, --iters, --kmeans-init,\n"
            "                        --max-points-per-centroid, --seed); --keys-layers / --values-layers are not inherited and\n"
            "                        --values defaults to the job's --keys unless given on the main command\n");
}

/* Every option of calibrate (cli_unknown_option suggests the nearest). */
static const char *const CALIB_OPTS[] = {"--help", "-h", "--quiet", "-q", "--also", "--model", "--text", "-o", "--out",
                                         "--keys", "--keys-layers", "--values", "--values-layers", "--keys2",
                                         "--granularity", "--kmeans-init", "--tokens", "--ctx", "--iters", "--threads",
                                         "--value-rotate", "--center", "--smooth-query", "--key-norm", "--value-norm",
                                         "--norm-bits", "--max-points-per-centroid", "--seed", "--bits", "--candidates",
                                         "--holdout-ctx", "--holdout-chunks", "--window", "--window-candidates",
                                         "--sinks", "--alloc-values", "--full-sensitivity", "--bits-also",
                                         "--verify-ctx", "--window-select", "--window-trust", NULL};

/* The options an --also string may hold: those of one codebook (its help lists them) and its output.
 * Everything else (the forward pass, the allocation, --also itself) is the main command's: accepted
 * there, it was ignored here before (issue 31: --also "--bits 3 -o B" wrote a plain d4b8 book). */
static int is_job_option(const char *o) {
    static const char *const JOB[] = {"--keys", "--keys2", "--values", "--keys-layers", "--values-layers",
                                      "--granularity", "--value-rotate", "--center", "--smooth-query", "--key-norm",
                                      "--value-norm", "--norm-bits", "--iters", "--kmeans-init",
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
        INT_OPT("--norm-bits", norm_bits, 8, 16)
        INT_OPT("--max-points-per-centroid", max_ppc, 1, 1L << 20)
        INT_OPT("--seed", seed, 0, 0x7fffffffL)
        STR_OPT("--candidates", cands)
        INT_OPT("--holdout-ctx", holdout_ctx, 64, 1L << 20)
        INT_OPT("--holdout-chunks", holdout_chunks, 1, 1024)
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

/* jobs[0] gets the main command's options, jobs[1..] one --also string each (split at spaces, over
 * the main command's codebook options). *n_jobs = 1 + number of --also. */
static int parse_args(int argc, char **argv, calib_args *jobs, int *n_jobs, char **split_buf) {
    calib_args *a = &jobs[0];
    *a = (calib_args){.keys = "d4b8", .granularity = "shared", .tokens = 32768, .ctx = 2048, .iters = 25,
                      .seed = 1234, .max_ppc = -1, .center = 1, .smooth_query = 1, .key_norm = 1, .value_norm = 1, .norm_bits = 0,
                      .cands = "d8b8,d4b8,d2b8,d8b8+d8b8,d4b8+d8b8", .holdout_chunks = 1, .window = -1, .alloc_values = -1,
                      .sinks = 1, .verify_ctx = -1, .window_trust = 0.3};
    int r = parse_opts(argc, argv, a, 0);
    if (r <= 0) return r;
    /* --norm-bits: 8 with --bits (the budget is the CPU cache's effective bits, which the byte saves;
     * docs/vq_cache.md "8-bit scales"), else 16 (uniform files, as before; the CUDA cache keeps float16) */
    if (!a->norm_bits) a->norm_bits = a->bits > 0 ? 8 : 16;
    if (!a->model || !a->text || !a->out)
        return cli_usage_error("calibrate: --model, --text and -o are required (see kvpq calibrate --help)"), -2;
    /* --window-candidates: checked here, before the model is loaded and any k-means runs */
    if (a->window >= 0 && a->window_cands)
        return cli_usage_error("calibrate: --window and --window-candidates: give one (--window W is "
                               "--window-candidates W)"), -2;
    /* --bits takes every layer's presets from --candidates (a second key stage: a P1+P2 candidate);
     * these options were silently dropped, yet written to the file's metadata */
    if (a->bits > 0 && (a->keys2 || a->keys_layers || a->values_layers))
        return cli_usage_error("calibrate: --bits chooses every layer's presets from --candidates: %s is not used "
                               "with it (a residual second key stage: a candidate P1+P2, e.g. d4b8+d8b8)",
                               a->keys2 ? "--keys2" : a->keys_layers ? "--keys-layers" : "--values-layers"), -2;
    /* the joint check (--verify-ctx, --window-select): checked before the model loads */
    if (a->verify_ctx > 0 && a->verify_ctx < 16)
        return cli_usage_error("calibrate: --verify-ctx %ld: expected 0 (off) or at least 16 tokens", a->verify_ctx), -2;
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
    if (a->window_select && !strcmp(a->window_select, "measured") && a->verify_ctx == 0)
        return cli_usage_error("calibrate: --window-select measured needs the joint check: not with --verify-ctx 0"), -2;
    if (a->window_trust_given && a->verify_ctx == 0)
        return cli_usage_error("calibrate: --window-trust is the tolerance of the joint check's window choice: not "
                               "used with --verify-ctx 0"), -2;
    /* The joint check opens each written file through the cache SPEC "vq:PATH:" (as kvpq ppl would),
     * whose length cli_cache_spec_parse caps: a longer -o / --bits-also path failed after all the work,
     * the file written without the check. Asked for (--verify-ctx N, --window-select measured): an
     * error; by default: a warning, no check (as for a text too short for it). */
    if (a->bits > 0 && a->verify_ctx != 0) {
        const size_t max_path = sizeof ((cli_cache_spec *)0)->path - 1 - strlen("vq::");
        for (int i = 0; i <= a->n_more_bits; i++) {
            const char *o = i ? a->more_out[i - 1] : a->out;
            if (strlen(o) <= max_path) continue;
            if (a->verify_ctx > 0 || (a->window_select && !strcmp(a->window_select, "measured")))
                return cli_usage_error("calibrate: output path '%.64s...' has %zu bytes: the joint check (--verify-ctx, "
                                       "--window-select measured) opens it as the cache SPEC vq:PATH, which takes at most "
                                       "%zu (a shorter path, or --verify-ctx 0)", o, strlen(o), max_path), -2;
            fprintf(stderr, "kvpq calibrate: warning: no joint check of the allocation: output path '%.64s...' has %zu "
                            "bytes, more than the %zu a cache SPEC vq:PATH takes; alloc.holdout_kl not written\n", o,
                    strlen(o), max_path);
            a->verify_ctx = 0;
            break;
        }
    }
    if (a->window >= 0) {
        a->wins[0] = (int)a->window, a->n_wins = 1;
    } else {
        const char *w = a->window_cands ? a->window_cands : "0,16,32,64,128";
        a->n_wins = 0;
        while (1) {
            char *end = NULL;
            errno = 0;
            long x = strtol(w, &end, 10);
            if (end == w || (*end && *end != ',') || errno || x < 0 || x > (1L << 20) || a->n_wins == 16)
                return cli_usage_error("calibrate: --window-candidates '%s': expected up to 16 comma-separated "
                                       "windows in 0..%ld", a->window_cands ? a->window_cands : "", 1L << 20), -2;
            for (int i = 0; i < a->n_wins; i++)
                if (a->wins[i] == (int)x)
                    return cli_usage_error("calibrate: --window-candidates '%s': window %ld is listed twice",
                                           a->window_cands, x), -2;
            int at = a->n_wins++; /* insertion: ascending */
            while (at > 0 && a->wins[at - 1] > (int)x) a->wins[at] = a->wins[at - 1], at--;
            a->wins[at] = (int)x;
            if (!*end) break;
            w = end + 1;
        }
    }
    calib_args base = *a; /* before defaults: --values stays unset unless given */
    if ((r = finish_job(a, "the main command")) <= 0) return r;
    *n_jobs = 1 + base.n_also;
    for (int j = 0; j < base.n_also; j++) {
        calib_args *b = &jobs[1 + j];
        *b = base;
        b->out = NULL;
        b->keys_layers = NULL;
        b->values_layers = NULL;
        b->n_also = 0;
        /* Split the string at spaces into an argv (element 0 unused), in a copy we own. */
        size_t len = strlen(base.also[j]) + 1;
        if (!(split_buf[j] = malloc(len))) return cli_usage_error("calibrate: out of memory"), -2;
        memcpy(split_buf[j], base.also[j], len);
        char *sv[64];
        int sc = 1;
        for (char *t = strtok(split_buf[j], " "); t; t = strtok(NULL, " ")) {
            if (sc == 64) return cli_usage_error("calibrate: --also '%s': too many words", base.also[j]), -2;
            sv[sc++] = t;
        }
        if ((r = parse_opts(sc, sv, b, 1)) <= 0) return r < 0 ? r : -2;
        char what[96];
        snprintf(what, sizeof what, "--also '%.60s'", base.also[j]);
        if ((r = finish_job(b, what)) <= 0) return r;
        for (int i = 0; i <= j; i++) /* jobs[0 .. j] */
            if (!strcmp(jobs[i].out, b->out))
                return cli_usage_error("calibrate: %s writes '%s', which another codebook of this command writes too",
                                       what, b->out), -2;
    }
    return 1;
}

static int progress_cb(void *user, const char *stage, double done, double total) {
    (void)user;
    (void)stage;
    (void)done;
    (void)total;
    return 0;
}

/* Apply --keys-layers (is_value 0) or --values-layers (1) "CFG:A-B[,CFG:A-B...]" (A-B inclusive;
 * "CFG:A" is one layer) to cb: each named layer's key (value) quantizer takes CFG's M. Returns 1, or
 * 0 after printing the problem. */
/* seen (n_layer): the layers an earlier item set, so an overlap is named (issue 31: the last item
 * silently won). */
static int apply_layer_items(kvpq_codebook *cb, const char *spec, int n_layer, int head_dim, int key_nbits,
                             int is_value, unsigned char *seen) {
    const char *p = spec;
    const char *opt = is_value ? "--values-layers" : "--keys-layers", *base = is_value ? "--values" : "--keys";
    if (!*p) return cli_usage_error("calibrate: %s is empty", opt), 0;
    while (*p) {
        const char *end = strchr(p, ','), *colon = strchr(p, ':');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (!colon || colon >= p + n || colon == p || (size_t)(colon - p) > 31)
            return cli_usage_error("calibrate: %s item '%.*s': expected CFG:A-B (e.g. d2b8:10-19)", opt, (int)n, p),
                   0;
        char cfg[32];
        memcpy(cfg, p, (size_t)(colon - p));
        cfg[colon - p] = '\0';
        int a, b, used = 0;
        const char *r = colon + 1;
        size_t rn = n - (size_t)(r - p);
        char range[32];
        if (rn == 0 || rn > 31)
            return cli_usage_error("calibrate: %s item '%.*s': expected CFG:A-B", opt, (int)n, p), 0;
        memcpy(range, r, rn);
        range[rn] = '\0';
        int ok = sscanf(range, "%d-%d%n", &a, &b, &used) == 2 && used == (int)rn;
        if (!ok) {
            used = 0;
            ok = sscanf(range, "%d%n", &a, &used) == 1 && used == (int)rn;
            b = a;
        }
        if (!ok)
            return cli_usage_error("calibrate: %s item '%.*s': layer range '%s' is not A-B", opt, (int)n, p, range),
                   0;
        if (a < 0 || b < a || b >= n_layer)
            return cli_usage_error("calibrate: %s item '%.*s': layers %d-%d out of the model's 0-%d", opt,
                                   (int)n, p, a, b, n_layer - 1),
                   0;
        kvpq_pq_params q;
        kvpq_status s = kvpq_pq_params_preset(&q, cfg, head_dim);
        if (s != KVPQ_OK) return cli_fail(is_value ? "calibrate: --values-layers" : "calibrate: --keys-layers", s), 0;
        if (q.nbits != key_nbits)
            return cli_usage_error("calibrate: %s preset %s has nbits=%d, %s has nbits=%d (a layer may "
                                   "change only M)", opt, cfg, q.nbits, base, key_nbits),
                   0;
        for (int l = a; l <= b; l++)
            if (seen[l])
                return cli_usage_error("calibrate: %s item '%.*s': layer %d is already set by an earlier item", opt,
                                       (int)n, p, l),
                       0;
        for (int l = a; l <= b; l++) {
            seen[l] = 1;
            if ((s = is_value ? kvpq_codebook_set_layer_value_M(cb, l, q.M) : kvpq_codebook_set_layer_key_M(cb, l, q.M)) !=
                KVPQ_OK)
                return cli_fail(is_value ? "calibrate: --values-layers" : "calibrate: --keys-layers", s), 0;
        }
        p = end ? end + 1 : p + n;
        if (end && !*p) return cli_usage_error("calibrate: %s ends with ','", opt), 0;
    }
    return 1;
}

static int apply_layers(kvpq_codebook *cb, const char *spec, int n_layer, int head_dim, int key_nbits, int is_value) {
    unsigned char *seen = calloc((size_t)n_layer, 1);
    if (!seen) return cli_usage_error("calibrate: out of memory"), 0;
    int ok = apply_layer_items(cb, spec, n_layer, head_dim, key_nbits, is_value, seen);
    free(seen);
    return ok;
}

static const char *base_name(const char *p) {
    const char *s = strrchr(p, '/');
    return s ? s + 1 : p;
}

/* A job's codebook: configuration from its options, checked before the (long) forward pass. */
static int make_codebook(const calib_args *a, const kvpq_model_info *mi, kvpq_codebook **cb) {
    kvpq_codebook_params cp = kvpq_codebook_params_default();
    cp.n_layer = mi->n_layer;
    cp.n_head_kv = mi->n_head_kv;
    cp.head_dim = mi->head_dim;
    cp.value_rotate = (int)a->value_rotate;
    cp.key_norm = (int)a->key_norm;
    cp.value_norm = (int)a->value_norm;
    kvpq_status s;
    if ((s = kvpq_pq_params_preset(&cp.key, a->keys, mi->head_dim)) != KVPQ_OK ||
        (s = kvpq_pq_params_preset(&cp.value, a->values, mi->head_dim)) != KVPQ_OK)
        return cli_fail("calibrate", s);
    cp.key.granularity = cp.value.granularity = !strcmp(a->granularity, "shared")     ? KVPQ_CODEBOOK_SHARED
                                                : !strcmp(a->granularity, "subspace") ? KVPQ_CODEBOOK_SUBSPACE
                                                                                       : KVPQ_CODEBOOK_HEAD;
    if (a->keys2) {
        if ((s = kvpq_pq_params_preset(&cp.key2, a->keys2, mi->head_dim)) != KVPQ_OK)
            return cli_fail("calibrate: --keys2", s);
        cp.key_stages = 2;
        cp.key2.granularity = cp.key.granularity;
        if (cp.key2.nbits != cp.key.nbits)
            return cli_usage_error("calibrate: --keys2 %s has nbits=%d, --keys has nbits=%d (the two stages' tables "
                                   "are added as one)", a->keys2, cp.key2.nbits, cp.key.nbits);
    }
    if ((s = kvpq_codebook_new(cb, &cp)) != KVPQ_OK) return cli_fail("calibrate: codebook", s);
    if ((s = kvpq_codebook_set_model(*cb, mi)) != KVPQ_OK) return cli_fail("calibrate: codebook", s);
    /* 8-bit norm-explicit scales (cache_vq.c): every candidate and the written file count and
     * measure them, since the VQ cache reads this metadata */
    if (a->norm_bits == 8 && ((cp.key_norm && (s = kvpq_codebook_set_meta(*cb, "k.norm_bits", "8")) != KVPQ_OK) ||
                              (cp.value_norm && (s = kvpq_codebook_set_meta(*cb, "v.norm_bits", "8")) != KVPQ_OK)))
        return cli_fail("calibrate: codebook", s);
    if (a->keys_layers && !apply_layers(*cb, a->keys_layers, mi->n_layer, mi->head_dim, cp.key.nbits, 0)) return 2;
    if (a->values_layers && !apply_layers(*cb, a->values_layers, mi->n_layer, mi->head_dim, cp.value.nbits, 1))
        return 2;
    return 0;
}

/* Train every layer of cb on the collected activations kall, vall (n_layer, n_use, n_head_kv,
 * head_dim) (left unchanged: kvpq_codebook_calibrate_layer works in copies); the summed k-means
 * MSEs go to *mse_k_sum, *mse_v_sum. */
static int train_layers(const calib_args *a, const kvpq_model_info *mi, kvpq_codebook *cb, const float *kall,
                        const float *vall, size_t n_use, double *mse_k_sum, double *mse_v_sum) {
    const int L = mi->n_layer;
    const size_t row = (size_t)mi->n_head_kv * mi->head_dim;
    kvpq_status s;
    kvpq_calibrate_params clp = kvpq_calibrate_params_default();
    clp.center = (int)a->center;
    clp.kmeans.niter = (int)a->iters;
    clp.kmeans.seed = (uint64_t)a->seed;
    clp.kmeans.n_threads = (int)a->threads;
    clp.kmeans.progress = progress_cb;
    clp.kmeans.init = strcmp(a->kmeans_init, "pp") ? KVPQ_KMEANS_INIT_RANDOM : KVPQ_KMEANS_INIT_PP;
    clp.kmeans.max_points_per_centroid = a->max_ppc > 0 ? (int)a->max_ppc : 0; /* 0: 256, or 32 for nbits > 8 */
    double mse_k = 0, mse_v = 0;
    char what[128], note[96] = "";
    snprintf(what, sizeof what, "calibrate: %s: k-means", base_name(a->out));
    cli_progress pr;
    cli_progress_begin(&pr, what, "layers", L);
    for (int l = 0; l < L; l++) {
        /* centering, smoothing, rotation, normalization, k-means: the library's recipe */
        kvpq_kmeans_report rk, rv;
        clp.query_absmax = a->smooth_query && a->q_absmax ? a->q_absmax + (size_t)l * row : NULL;
        if ((s = kvpq_codebook_calibrate_layer(cb, l, n_use, kall + (size_t)l * n_use * row,
                                               vall + (size_t)l * n_use * row, &clp, &rk, &rv)) != KVPQ_OK)
            return cli_fail("calibrate", s);
        mse_k += rk.mse_final;
        mse_v += rv.mse_final;
        snprintf(note, sizeof note, "key mse %.4g, value mse %.4g", rk.mse_final, rv.mse_final);
        cli_progress_update(&pr, l + 1, note);
    }
    cli_progress_end(&pr, L, note);
    *mse_k_sum = mse_k;
    *mse_v_sum = mse_v;
    return 0;
}

/* kvpq_codebook_set_meta with a printf-formatted value (at most 63 characters). */
__attribute__((format(printf, 3, 4))) static void set_meta_fmt(kvpq_codebook *cb, const char *key, const char *fmt,
                                                               ...) {
    char buf[64];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    kvpq_codebook_set_meta(cb, key, buf);
}

/* The metadata every codebook of calibrate records. */
static void set_common_meta(const calib_args *a, const kvpq_model_info *mi, const char *model_path, kvpq_codebook *cb,
                            size_t n_use, double mse_k, double mse_v) {
    const int L = mi->n_layer;
    kvpq_codebook_set_meta(cb, "model", mi->name);
    kvpq_codebook_set_meta(cb, "model_file", base_name(model_path));
    kvpq_codebook_set_meta(cb, "text", base_name(a->text));
    set_meta_fmt(cb, "tokens", "%zu", n_use);
    set_meta_fmt(cb, "ctx", "%ld", a->ctx);
    kvpq_codebook_set_meta(cb, "keys", a->keys);
    if (a->keys2) kvpq_codebook_set_meta(cb, "keys2", a->keys2);
    if (a->keys_layers) kvpq_codebook_set_meta(cb, "keys_layers", a->keys_layers);
    if (a->values_layers) kvpq_codebook_set_meta(cb, "values_layers", a->values_layers);
    kvpq_codebook_set_meta(cb, "values", a->values);
    set_meta_fmt(cb, "seed", "%ld", a->seed);
    set_meta_fmt(cb, "kmeans_iters", "%ld", a->iters);
    kvpq_codebook_set_meta(cb, "kmeans_init", a->kmeans_init);
    kvpq_codebook_set_meta(cb, "key_center", a->center ? "1" : "0");
    kvpq_codebook_set_meta(cb, "key_smooth", a->smooth_query ? "query" : "keys");
    /* With norm-explicit quantizers these are errors of the unit directions. */
    set_meta_fmt(cb, "key_mse_mean", "%.6g", mse_k / L);
    set_meta_fmt(cb, "value_mse_mean", "%.6g", mse_v / L);
}

/* Train one job's codebook cb (train_layers) and write it to a->out with its metadata. */
static int train_and_save(const calib_args *a, const kvpq_model_info *mi, const char *model_path, kvpq_codebook *cb,
                          const float *kall, const float *vall, size_t n_use, double t0, double t_fwd) {
    const int L = mi->n_layer;
    kvpq_status s;
    double mse_k = 0, mse_v = 0, t1 = cli_now();
    int r = train_layers(a, mi, cb, kall, vall, n_use, &mse_k, &mse_v);
    if (r) return r;
    set_common_meta(a, mi, model_path, cb, n_use, mse_k, mse_v);
    if ((s = kvpq_codebook_save(cb, a->out)) != KVPQ_OK) return cli_fail("calibrate: writing the codebook file", s);
    fprintf(stderr,
            "kvpq calibrate: wrote %s (%d layers, keys %s%s%s%s, values %s%s%s, %zu tokens; forward %.1f s, k-means "
            "%.1f s, total %.1f s)\n",
            a->out, L, a->keys, a->keys_layers ? " with " : "", a->keys_layers ? a->keys_layers : "",
            a->key_norm ? " norm-explicit" : "", a->values, a->value_rotate ? " rotated" : "",
            a->value_norm ? " norm-explicit" : "", n_use, t_fwd, cli_now() - t1, cli_now() - t0);
    return 0;
}

/* Per-layer value M (kvpq_codebook_set_layer_value_M): --bits allocates values per layer too. */

#define CALIB_HAVE_VALUE_M 1

static int sens_progress(void *user, const char *stage, double done, double total) {
    (void)stage;
    (void)total;
    cli_progress_update((cli_progress *)user, done, NULL);
    return 0;
}

static double cpu_seconds(void) { return (double)clock() / CLOCKS_PER_SEC; }

/* Append "x" (a number with %.4g, or a string) to a comma-separated list in buf. */
static void list_add(char *buf, size_t cap, const char *item) {
    size_t n = strlen(buf);
    snprintf(buf + n, cap - n, "%s%s", n ? "," : "", item);
}

/* ---- the joint check of an allocation (docs/allocation.md, "Held-out KL of the whole allocation") ----
 * The written file is opened as `kvpq ppl --cache vq:FILE` opens it (cli_cache_open: its window,
 * sinks and per-layer presets) and scored against the fp16 cache on one chunk of held-out text by
 * ppl's own code (cli_score.h): KL(fp16 || file) mean over the second half of the chunk, top-1
 * agreement, perplexity. */
typedef struct {
    kvpq_model *model;
    int C, first, n_score, V, threads;
    size_t start;      /* the chunk's first token in the text, tokenized without BOS */
    int32_t *tk;       /* (C) the chunk; token 0 replaced by BOS when the model adds one (as ppl does) */
    float *base_lp;    /* (C - first, V) the fp16 cache's log-probabilities of the scored rows */
    float *lp;         /* (C - first, V) scratch: the tested cache's logits */
    float *row;        /* (V) scratch */
    int *base_top;     /* (n_score) the fp16 cache's argmax per scored row */
    double base_ppl;   /* the fp16 cache's perplexity on the scored tokens */
    double cpu;        /* CPU seconds spent in the check so far (the fp16 pass included) */
} calib_verify;

/* What the check of one written file found, and the allocation it checked. */
typedef struct {
    double kl, top1, ppl; /* KL(fp16 || file) mean (nats), top-1 agreement (fraction), perplexity */
    double eff, pred;     /* the allocation's effective bits and predicted KL */
    int win;              /* its fp16 window */
} calib_checked;

static void verify_free(calib_verify *v) {
    free(v->tk);
    free(v->base_lp);
    free(v->lp);
    free(v->row);
    free(v->base_top);
    memset(v, 0, sizeof *v);
}

/* Set up the check on toks (C tokens at index start of the text) and run the fp16 base once. */
static int verify_init(calib_verify *v, kvpq_model *model, const kvpq_model_info *mi, const int32_t *toks, int C,
                       size_t start, int threads) {
    const double c0 = cpu_seconds();
    memset(v, 0, sizeof *v);
    v->model = model, v->C = C, v->first = C / 2, v->n_score = C - 1 - C / 2, v->V = mi->n_vocab;
    v->threads = threads, v->start = start;
    const size_t rows = (size_t)(C - v->first) * (size_t)v->V;
    v->tk = malloc(sizeof *v->tk * (size_t)C);
    v->base_lp = malloc(sizeof *v->base_lp * rows);
    v->lp = malloc(sizeof *v->lp * rows);
    v->row = malloc(sizeof *v->row * (size_t)v->V);
    v->base_top = malloc(sizeof *v->base_top * (size_t)v->n_score);
    if (!v->tk || !v->base_lp || !v->lp || !v->row || !v->base_top)
        return cli_usage_error("calibrate: out of memory for the joint check at --verify-ctx %d (%.0f MiB of logits)",
                               C, 2.0 * (double)rows * sizeof(float) / 1048576.0), 1;
    memcpy(v->tk, toks, sizeof *v->tk * (size_t)C);
    if (mi->add_bos) v->tk[0] = mi->bos_id;
    cli_cache base;
    if (cli_cache_open(&base, "fp16", model, C, threads)) return 1;
    double sec = 0;
    kvpq_status s = cli_eval_chunk(model, base.cache, v->tk, C, v->first, C, v->V, v->base_lp, v->row, &sec);
    cli_cache_close(&base);
    if (s != KVPQ_OK) return cli_fail("calibrate: joint check (fp16 base)", s);
    cli_score_sums sums = {0};
    cli_score_base(v->base_lp, v->n_score, v->V, v->tk + v->first + 1, v->base_top, &sums);
    v->base_ppl = exp(sums.nll / v->n_score);
    v->cpu += cpu_seconds() - c0;
    return 0;
}

/* The check of the file at path: out->kl, out->top1, out->ppl. Returns 0 or an exit code. */
static int verify_file(calib_verify *v, const char *path, calib_checked *out) {
    const double c0 = cpu_seconds();
    char spec[300];
    /* "vq:PATH:": the empty part after PATH ends the suffixes (cli_spec.h), so any file name works */
    if (snprintf(spec, sizeof spec, "vq:%s:", path) >= (int)sizeof spec)
        return cli_usage_error("calibrate: joint check: output path '%s' is too long for a cache SPEC", path);
    cli_cache c;
    if (cli_cache_open(&c, spec, v->model, v->C, v->threads)) return 1;
    double sec = 0;
    kvpq_status s = cli_eval_chunk(v->model, c.cache, v->tk, v->C, v->first, v->C, v->V, v->lp, v->row, &sec);
    cli_cache_close(&c);
    if (s != KVPQ_OK) return cli_fail("calibrate: joint check", s);
    cli_score_sums sums = {0};
    cli_score_test(v->lp, v->n_score, v->V, v->tk + v->first + 1, v->base_lp, v->base_top, NULL, &sums);
    out->kl = sums.kl_sum / (double)v->n_score; /* as kvpq ppl: kl_sum / scored tokens */
    out->top1 = (double)sums.agree / (double)v->n_score;
    out->ppl = exp(sums.nll / v->n_score);
    v->cpu += cpu_seconds() - c0;
    return 0;
}

/* The check's result in the file's metadata (docs/allocation.md). */
static void set_verify_meta(kvpq_codebook *cb, const calib_verify *v, const calib_checked *c) {
    set_meta_fmt(cb, "alloc.holdout_kl", "%.17g", c->kl);
    set_meta_fmt(cb, "alloc.holdout_top1", "%.17g", c->top1);
    set_meta_fmt(cb, "alloc.holdout_ppl", "%.6f", c->ppl);
    set_meta_fmt(cb, "alloc.holdout_ppl_base", "%.6f", v->base_ppl);
    set_meta_fmt(cb, "alloc.verify_ctx", "%d", v->C);
    set_meta_fmt(cb, "alloc.verify_start", "%zu", v->start);
    set_meta_fmt(cb, "alloc.verify_scored", "%d", v->n_score);
    kvpq_codebook_set_meta(cb, "alloc.verify_base", "fp16");
}

/* --bits: train a codebook per candidate preset (every layer, keys and values), measure on the
 * held-out chunks hold (n_chunks x hctx tokens) what each layer's keys / values cost at each preset
 * alone (kvpq_model_layer_sensitivity), pick per-layer presets by the multiple-choice knapsack
 * (kvpq_alloc_mckp) under the effective-bits budget at context a->ctx (kvpq_vq_cache_bytes), and
 * write the assembled codebook with the allocation in its metadata. */
static int run_alloc(const calib_args *a, kvpq_model *model, const kvpq_model_info *mi, const int32_t *hold,
                     int hctx, int n_chunks, const int32_t *ver, int vctx, size_t ver_start, const float *kall,
                     const float *vall, size_t n_use, double t0, double t_fwd) {
    enum { MAXC = 8 };
    const int L = mi->n_layer;
    const double c0 = cpu_seconds();
    /* names[c] as given; a key candidate "P1+P2" is P1 with a residual second stage P2 (k1, k2) */
    char names[MAXC][32], k1[MAXC][16], k2[MAXC][16];
    int n_cand = 0, rc = 1;
    kvpq_codebook *cc[MAXC] = {0}, *fin = NULL, *fin_kept = NULL;
    calib_verify vf = {0};
    /* --window-select: measured (every window checked), auto (measured when the prediction of the
     * window chosen is off by more than a->window_trust), or predicted (also whenever there is no check) */
    const int measured = vctx > 0 && a->window_select && !strcmp(a->window_select, "measured");
    const int auto_sel = vctx > 0 && (!a->window_select || !strcmp(a->window_select, "auto"));
    const char *sel_name = measured ? "measured" : auto_sel ? "auto" : "predicted";
    double *kl = NULL, *klc = NULL, *cost = NULL;
    int64_t *weight = NULL;
    size_t *lb = NULL;
    int *choice = NULL;
    int32_t *tk = NULL;
    char *list = NULL;
    kvpq_status s;
    const int alloc_values = a->alloc_values < 0 ? CALIB_HAVE_VALUE_M : (int)a->alloc_values;
    if (alloc_values && !CALIB_HAVE_VALUE_M)
        return cli_usage_error("calibrate: --alloc-values 1 needs per-layer value M (not in this build)");
    /* the candidate presets */
    const char *p = a->cands;
    int nbits = -1, vfix = -1, n_plain = 0;
    const char *stage2 = NULL; /* the one second-stage preset of the "+" candidates (k2.M is per file) */
    while (*p) {
        size_t n = strcspn(p, ",");
        if (n == 0 || n >= sizeof names[0] || n_cand == MAXC)
            return cli_usage_error("calibrate: --candidates '%s': expected up to %d comma-separated presets", a->cands,
                                   MAXC);
        memcpy(names[n_cand], p, n);
        names[n_cand][n] = '\0';
        const char *plus = strchr(names[n_cand], '+');
        size_t n1 = plus ? (size_t)(plus - names[n_cand]) : n;
        if (n1 == 0 || n1 >= sizeof k1[0] || (plus && (strlen(plus + 1) == 0 || strlen(plus + 1) >= sizeof k2[0])))
            return cli_usage_error("calibrate: --candidates: '%s': expected PRESET or PRESET+PRESET", names[n_cand]);
        memcpy(k1[n_cand], names[n_cand], n1);
        k1[n_cand][n1] = '\0';
        snprintf(k2[n_cand], sizeof k2[0], "%s", plus ? plus + 1 : "");
        kvpq_pq_params q, q2;
        if ((s = kvpq_pq_params_preset(&q, k1[n_cand], mi->head_dim)) != KVPQ_OK)
            return cli_fail("calibrate: --candidates", s);
        if (nbits >= 0 && q.nbits != nbits)
            return cli_usage_error("calibrate: --candidates: %s has nbits %d, the others %d (a layer may change only M)",
                                   names[n_cand], q.nbits, nbits);
        nbits = q.nbits;
        if (plus) {
            if ((s = kvpq_pq_params_preset(&q2, k2[n_cand], mi->head_dim)) != KVPQ_OK)
                return cli_fail("calibrate: --candidates (second stage)", s);
            if (q2.nbits != q.nbits)
                return cli_usage_error("calibrate: --candidates: %s: the second stage has nbits %d, the first %d (the "
                                       "two stages' tables are added as one)", names[n_cand], q2.nbits, q.nbits);
            if (stage2 && strcmp(stage2, k2[n_cand]))
                return cli_usage_error("calibrate: --candidates: second stages %s and %s: one second-stage preset per "
                                       "file (k2.M); the first stage may differ", stage2, k2[n_cand]);
            stage2 = k2[n_cand];
        } else {
            n_plain++;
            if (!strcmp(names[n_cand], a->values)) vfix = n_cand;
        }
        n_cand++;
        p += n;
        if (*p) p++;
    }
    if (n_cand < 1) return cli_usage_error("calibrate: --candidates is empty");
    if (n_plain < 1)
        return cli_usage_error("calibrate: --candidates '%s': needs a single-stage preset too (values have one stage)",
                               a->cands);
    if (!alloc_values && vfix < 0)
        return cli_usage_error("calibrate: --values %s must be one of --candidates %s (values are not allocated)",
                               a->values, a->cands);
    /* 1. a codebook per candidate, every layer (one forward pass served them all) */
    double mse_k = 0, mse_v = 0, mk, mv;
    for (int c = 0; c < n_cand; c++) {
        calib_args b = *a;
        b.keys = b.values = k1[c];
        b.keys2 = k2[c][0] ? k2[c] : NULL;
        b.keys_layers = b.values_layers = NULL;
        if ((rc = make_codebook(&b, mi, &cc[c])) != 0) goto done;
        if ((rc = train_layers(&b, mi, cc[c], kall, vall, n_use, &mk, &mv)) != 0) goto done;
        if (c == (vfix >= 0 ? vfix : 0)) mse_k = mk, mse_v = mv;
    }
    double t_km = cli_now();
    /* 2. sensitivities on the held-out chunks */
    rc = 1;
    const size_t nkl = (size_t)n_cand * 2 * L;
    const int NW = a->n_wins; /* window candidates, ascending: the smallest is measured, the others scaled */
    kl = calloc(nkl * NW, sizeof *kl);
    klc = calloc(nkl * NW, sizeof *klc);
    tk = malloc(sizeof *tk * (size_t)hctx);
    if (!kl || !klc || !tk) goto oom;
    kvpq_sensitivity_params sp = kvpq_sensitivity_params_default();
    sp.window = a->wins[0];
    sp.sinks = (int)a->sinks;
    sp.windows = a->wins + 1;
    sp.n_windows = NW - 1;
    sp.kl_windows = klc + nkl;
    sp.n_threads = (int)a->threads;
    sp.ref_cand = a->full_sens ? -1 : (vfix >= 0 ? vfix : n_cand / 2);
    while (sp.ref_cand > 0 && k2[sp.ref_cand][0]) sp.ref_cand--; /* a single-stage reference */
    while (sp.ref_cand >= 0 && k2[sp.ref_cand][0]) sp.ref_cand++;
    cli_progress pr;
    cli_progress_begin(&pr, "calibrate: per-layer sensitivity", "measurements", (double)nkl);
    sp.progress = sens_progress;
    sp.progress_user = &pr;
    for (int ch = 0; ch < n_chunks; ch++) {
        memcpy(tk, hold + (size_t)ch * hctx, sizeof *tk * (size_t)hctx);
        if (mi->add_bos) tk[0] = mi->bos_id; /* as kvpq ppl scores a chunk */
        if ((s = kvpq_model_layer_sensitivity(model, tk, hctx, (const kvpq_codebook *const *)cc, n_cand, &sp, klc)) !=
            KVPQ_OK) {
            rc = cli_fail("calibrate: sensitivity", s);
            goto done;
        }
        for (size_t i = 0; i < nkl * NW; i++) kl[i] += klc[i] / n_chunks; /* kl + w * nkl: window wins[w] */
    }
    cli_progress_end(&pr, (double)nkl, NULL);
    double t_sens = cli_now();
    /* 3. bytes of each choice at context a->ctx, per window candidate, the budget, the knapsack */
    kvpq_cache_params cp = kvpq_cache_params_default();
    cp.type = KVPQ_CACHE_VQ;
    kvpq_model_cache_params(model, &cp);
    cp.max_seq = (int)a->ctx;
    cp.sinks = (int)a->sinks;
    lb = malloc(sizeof *lb * (size_t)NW * n_cand * 2 * L);
    const int G = alloc_values ? 2 * L : L;
    cost = malloc(sizeof *cost * (size_t)G * n_cand);
    weight = malloc(sizeof *weight * (size_t)G * n_cand);
    choice = malloc(sizeof *choice * (size_t)G * NW); /* each window's knapsack choice */
    if (!lb || !cost || !weight || !choice) goto oom;
    size_t fixed_w[16] = {0};
    int64_t elements = 0;
    for (int w = 0; w < NW; w++) {
        cp.window = a->wins[w];
        for (int c = 0; c < n_cand; c++)
            if ((s = kvpq_vq_cache_bytes(cc[c], &cp, (int)a->ctx, 512, lb + ((size_t)w * n_cand + c) * 2 * L,
                                         &fixed_w[w], &elements)) != KVPQ_OK) {
                rc = cli_fail("calibrate: cache bytes", s);
                goto done;
            }
    }
    if (vctx > 0 && (rc = verify_init(&vf, model, mi, ver, vctx, ver_start, (int)a->threads)) != 0) goto done;
    rc = 1;
    int n_failed = 0;
    for (int bi = 0; bi <= a->n_more_bits; bi++) {
        const double bits_i = bi ? a->more_bits[bi - 1] : a->bits;
        const char *out_i = bi ? a->more_out[bi - 1] : a->out;
        kvpq_codebook_free(fin);
        fin = NULL;
        /* every window candidate: its knapsack; the least predicted KL wins (ties: the fewer bytes, then
         * the first, smaller window) */
        double pred_w[16], best_pred = INFINITY, light_min = INFINITY;
        int64_t best_bytes = INT64_MAX;
        int best_w = -1;
        for (int w = 0; w < NW; w++) {
            const double *klw = kl + (size_t)w * nkl;
            const size_t *lbw = lb + (size_t)w * n_cand * 2 * L;
            double budget = bits_i * (double)elements / 8.0 - (double)fixed_w[w], pf = 0;
            for (int g = 0; g < G; g++) {
                const int l = g % L, kind = g / L;
                for (int c = 0; c < n_cand; c++) {
                    /* values have one stage: a "P1+P2" candidate is not a value choice (+inf:
                     * kvpq_alloc_mckp's "unavailable"; a large finite cost was still picked when
                     * P1's values were lighter than every single-stage candidate's) */
                    cost[(size_t)g * n_cand + c] = kind && k2[c][0] ? INFINITY : klw[((size_t)c * 2 + kind) * L + l];
                    weight[(size_t)g * n_cand + c] = (int64_t)lbw[((size_t)c * L + l) * 2 + kind];
                }
            }
            if (!alloc_values)
                for (int l = 0; l < L; l++) {
                    budget -= (double)lbw[((size_t)vfix * L + l) * 2 + 1];
                    pf += klw[((size_t)vfix * 2 + 1) * L + l];
                }
            double pr_ = 0;
            int64_t used = 0;
            pred_w[w] = INFINITY;
            if (budget >= 0 &&
                kvpq_alloc_mckp(G, n_cand, cost, weight, (int64_t)budget, 0, choice + (size_t)G * w, &pr_, &used) ==
                    KVPQ_OK) {
                pred_w[w] = pr_ + pf;
                const int64_t bytes_w = (int64_t)fixed_w[w] + used;
                if (pred_w[w] < best_pred || (pred_w[w] == best_pred && bytes_w < best_bytes))
                    best_pred = pred_w[w], best_bytes = bytes_w, best_w = w;
            } else {
                /* the lightest allocation's effective bits at this window, so the user knows what fits */
                double light = (double)fixed_w[w];
                for (int g = 0; g < G; g++) {
                    double m = INFINITY;
                    for (int c = 0; c < n_cand; c++) /* not a "P1+P2" candidate for values (above) */
                        if (!(g >= L && k2[c][0]) && (double)weight[(size_t)g * n_cand + c] < m)
                            m = (double)weight[(size_t)g * n_cand + c];
                    light += m;
                }
                if (!alloc_values)
                    for (int l = 0; l < L; l++) light += (double)lbw[((size_t)vfix * L + l) * 2 + 1];
                if (light < light_min) light_min = light;
            }
        }
        if (best_w < 0) {
            fprintf(stderr, "kvpq calibrate: --bits %g at ctx %ld: no allocation fits at any window (the lightest needs "
                            "%.4f effective bits); %s not written\n", bits_i, a->ctx, 8.0 * light_min / (double)elements,
                    out_i);
            n_failed++;
            continue; /* the other budgets still get their files */
        }
        /* the windows whose allocation is written and checked: the predicted best, or (--window-select
         * measured, or auto when the best's prediction is off) every window where an allocation fits, the
         * least held-out KL kept */
        int tries[16], n_tries = 0, kept = -1;
        double meas_w[16];
        for (int w = 0; w < NW; w++) meas_w[w] = NAN;
        if (measured)
            for (int w = 0; w < NW; w++)
                if (isfinite(pred_w[w])) tries[n_tries++] = w;
        if (!measured) tries[n_tries++] = best_w;
        kvpq_codebook_free(fin_kept);
        fin_kept = NULL;
        calib_checked kept_chk = {0};
        for (int t = 0; t < n_tries; t++) {
            const int bw = tries[t];
            const int win = a->wins[bw];
            const double *klb = kl + (size_t)bw * nkl;
            const size_t *lbb = lb + (size_t)bw * n_cand * 2 * L;
            const size_t fixed = fixed_w[bw];
            const int *chw = choice + (size_t)G * bw; /* that window's knapsack choice */
            const double pred = pred_w[bw];
            kvpq_codebook_free(fin);
            fin = NULL;
            /* 4. the codebook: each layer takes its chosen candidate's trained quantizers */
            int kc[4096], vc_[4096], count[MAXC] = {0}, base_k = 0;
            for (int l = 0; l < L; l++) {
                kc[l] = chw[l];
                vc_[l] = alloc_values ? chw[L + l] : vfix;
                count[kc[l]]++;
            }
            for (int c = 1; c < n_cand; c++)
                if (count[c] > count[base_k]) base_k = c;
            int vcount[MAXC] = {0}, base_v = 0;
            for (int l = 0; l < L; l++) vcount[vc_[l]]++;
            for (int c = 1; c < n_cand; c++)
                if (vcount[c] > vcount[base_v]) base_v = c;
            int any2 = 0;
            for (int l = 0; l < L; l++) any2 |= k2[kc[l]][0] != '\0';
            {
                calib_args b = *a;
                b.keys = k1[base_k];
                b.keys2 = any2 ? stage2 : NULL;
                b.values = k1[base_v];
                b.keys_layers = NULL;
                b.values_layers = NULL;
                if ((rc = make_codebook(&b, mi, &fin)) != 0) goto done;
                rc = 1;
            }
            int64_t total_bytes = (int64_t)fixed;
            for (int l = 0; l < L; l++) {
                const kvpq_pq *kq = kvpq_codebook_pq_const(cc[kc[l]], l, 0), *vq = kvpq_codebook_pq_const(cc[vc_[l]], l, 1);
                if ((s = kvpq_codebook_set_layer_key_M(fin, l, kvpq_pq_get_params(kq).M)) != KVPQ_OK ||
                    (s = kvpq_codebook_set_layer_value_M(fin, l, kvpq_pq_get_params(vq).M)) != KVPQ_OK ||
                    (s = kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 0), kvpq_pq_centroids(kq), kvpq_pq_centroids_size(kq))) !=
                        KVPQ_OK ||
                    (s = kvpq_pq_set_centroids(kvpq_codebook_pq(fin, l, 1), kvpq_pq_centroids(vq), kvpq_pq_centroids_size(vq))) !=
                        KVPQ_OK ||
                    (any2 && (s = kvpq_codebook_set_layer_key_stages(fin, l, k2[kc[l]][0] ? 2 : 1)) != KVPQ_OK)) {
                    rc = cli_fail("calibrate: assembling the codebook", s);
                    goto done;
                }
                if (k2[kc[l]][0]) { /* the chosen candidate's stage-two centroids */
                    const kvpq_pq *kq2 = kvpq_codebook_key_pq2_const(cc[kc[l]], l);
                    s = kvpq_pq_set_centroids(kvpq_codebook_key_pq2(fin, l), kvpq_pq_centroids(kq2), kvpq_pq_centroids_size(kq2));
                }
                if (s != KVPQ_OK) {
                    rc = cli_fail("calibrate: assembling the codebook", s);
                    goto done;
                }
                const size_t row = (size_t)mi->n_head_kv * mi->head_dim;
                memcpy(kvpq_codebook_key_smooth(fin, l), kvpq_codebook_key_smooth_const(cc[0], l), sizeof(float) * row);
                memcpy(kvpq_codebook_key_mean(fin, l), kvpq_codebook_key_mean_const(cc[0], l), sizeof(float) * row);
                total_bytes += (int64_t)lbb[((size_t)kc[l] * L + l) * 2] + (int64_t)lbb[((size_t)vc_[l] * L + l) * 2 + 1];
            }
            const double eff = 8.0 * (double)total_bytes / (double)elements;
            /* 5. metadata */
            set_common_meta(a, mi, a->model, fin, n_use, mse_k, mse_v);
            char buf[128];
            const size_t lcap = (size_t)L * 24 + 64;
            free(list);
            if (!(list = malloc(lcap))) goto oom;
            snprintf(buf, sizeof buf, "%g", bits_i);
            kvpq_codebook_set_meta(fin, "alloc.bits", buf);
            snprintf(buf, sizeof buf, "%ld", a->ctx);
            kvpq_codebook_set_meta(fin, "alloc.ctx", buf);
            snprintf(buf, sizeof buf, "%d", win);
            kvpq_codebook_set_meta(fin, "alloc.window", buf);
            list[0] = '\0';
            for (int w = 0; w < NW; w++) {
                snprintf(buf, sizeof buf, "%d", a->wins[w]);
                list_add(list, lcap, buf);
            }
            kvpq_codebook_set_meta(fin, "alloc.window_candidates", list);
            list[0] = '\0';
            for (int w = 0; w < NW; w++) { /* the predicted KL at each window ("none": no allocation fits) */
                if (isfinite(pred_w[w])) snprintf(buf, sizeof buf, "%d:%.4g", a->wins[w], pred_w[w]);
                else snprintf(buf, sizeof buf, "%d:none", a->wins[w]);
                list_add(list, lcap, buf);
            }
            kvpq_codebook_set_meta(fin, "alloc.window_predicted_kl", list);
            snprintf(buf, sizeof buf, "%ld", a->sinks);
            kvpq_codebook_set_meta(fin, "alloc.sinks", buf);
            kvpq_codebook_set_meta(fin, "alloc.candidates", a->cands);
            kvpq_codebook_set_meta(fin, "alloc.method", "mckp-dp");
            kvpq_codebook_set_meta(fin, "alloc.sensitivity", a->full_sens ? "full" : names[sp.ref_cand]);
            kvpq_codebook_set_meta(fin, "alloc.values", alloc_values ? "allocated" : "fixed");
            snprintf(buf, sizeof buf, "%d", n_chunks * hctx);
            kvpq_codebook_set_meta(fin, "alloc.holdout_tokens", buf);
            snprintf(buf, sizeof buf, "%d", hctx);
            kvpq_codebook_set_meta(fin, "alloc.holdout_ctx", buf);
            snprintf(buf, sizeof buf, "%.6g", pred);
            kvpq_codebook_set_meta(fin, "alloc.predicted_kl", buf);
            snprintf(buf, sizeof buf, "%.6g", eff);
            kvpq_codebook_set_meta(fin, "alloc.effective_bits", buf);
            for (int kind = 0; kind < 2; kind++) {
                list[0] = '\0';
                for (int l = 0; l < L; l++) list_add(list, lcap, names[kind ? vc_[l] : kc[l]]);
                kvpq_codebook_set_meta(fin, kind ? "alloc.v" : "alloc.k", list);
                list[0] = '\0';
                for (int l = 0; l < L; l++) {
                    snprintf(buf, sizeof buf, "%.4g", klb[((size_t)(kind ? vc_[l] : kc[l]) * 2 + kind) * L + l]);
                    list_add(list, lcap, buf);
                }
                kvpq_codebook_set_meta(fin, kind ? "alloc.kl.v" : "alloc.kl.k", list);
                for (int c = 0; c < n_cand; c++) { /* the whole measured table */
                    list[0] = '\0';
                    for (int l = 0; l < L; l++) {
                        snprintf(buf, sizeof buf, "%.4g", klb[((size_t)c * 2 + kind) * L + l]);
                        list_add(list, lcap, buf);
                    }
                    char key[64];
                    snprintf(key, sizeof key, "alloc.sens.%s.%s", kind ? "v" : "k", names[c]);
                    kvpq_codebook_set_meta(fin, key, list);
                }
            }
            if (vctx > 0) kvpq_codebook_set_meta(fin, "alloc.window_select", sel_name);
            if (auto_sel) {
                char tb[32];
                snprintf(tb, sizeof tb, "%g", a->window_trust);
                kvpq_codebook_set_meta(fin, "alloc.window_trust", tb);
            }
            if ((s = kvpq_codebook_save(fin, out_i)) != KVPQ_OK) {
                rc = cli_fail("calibrate: writing the codebook file", s);
                goto done;
            }
            /* 6. the joint check: the file as `kvpq ppl --cache vq:FILE` opens it, on the verification chunk */
            calib_checked chk = {.eff = eff, .pred = pred, .win = win};
            if (vctx > 0) {
                if ((rc = verify_file(&vf, out_i, &chk)) != 0) goto done;
                rc = 1;
                meas_w[bw] = chk.kl;
                set_verify_meta(fin, &vf, &chk);
                if ((s = kvpq_codebook_save(fin, out_i)) != KVPQ_OK) {
                    rc = cli_fail("calibrate: writing the codebook file", s);
                    goto done;
                }
                if (measured || n_tries > 1)
                    fprintf(stderr, "kvpq calibrate: --bits %.3g, window %d: predicted KL %.4f, held-out KL %.4f (top-1 "
                                    "%.1f%%)\n", bits_i, win, pred, chk.kl, 100.0 * chk.top1);
                int n_other = 0; /* the other windows where an allocation fits (none: nothing else to check) */
                for (int w = 0; w < NW; w++) n_other += w != bw && isfinite(pred_w[w]);
                if (auto_sel && t == 0 && n_tries == 1 && n_other > 0 && fabs(pred / chk.kl - 1) > a->window_trust) {
                    fprintf(stderr, "kvpq calibrate: --bits %.3g, window %d: predicted KL %.4f is %.2f x the held-out "
                                    "KL %.4f (off by more than %.0f%%): checking every window's allocation\n", bits_i,
                            win, pred, pred / chk.kl, chk.kl, 100 * a->window_trust);
                    for (int w = 0; w < NW; w++)
                        if (w != bw && isfinite(pred_w[w])) tries[n_tries++] = w;
                }
            }
            /* ties: the fewer effective bits, then the first checked (measured: the smaller window;
             * auto: the predicted choice) */
            if (kept < 0 || ((measured || auto_sel) &&
                             (chk.kl < kept_chk.kl || (chk.kl == kept_chk.kl && chk.eff < kept_chk.eff)))) {
                kept = bw, kept_chk = chk;
                kvpq_codebook_free(fin_kept);
                fin_kept = fin;
                fin = NULL;
            }
        }
        if (n_tries > 1) { /* the kept window's file, with every window's measured KL */
            list[0] = '\0';
            char buf[64];
            for (int w = 0; w < NW; w++) {
                if (isfinite(meas_w[w])) snprintf(buf, sizeof buf, "%d:%.4g", a->wins[w], meas_w[w]);
                else snprintf(buf, sizeof buf, "%d:none", a->wins[w]);
                list_add(list, (size_t)L * 24 + 64, buf);
            }
            kvpq_codebook_set_meta(fin_kept, "alloc.window_measured_kl", list);
            if ((s = kvpq_codebook_save(fin_kept, out_i)) != KVPQ_OK) {
                rc = cli_fail("calibrate: writing the codebook file", s);
                goto done;
            }
        }
        {
            const int bw = kept, win = kept_chk.win;
            const double *klb = kl + (size_t)bw * nkl;
            const double eff = kept_chk.eff, pred = kept_chk.pred;
            int kc[4096], vc_[4096];
            for (int l = 0; l < L; l++) {
                kc[l] = (choice + (size_t)G * bw)[l];
                vc_[l] = alloc_values ? (choice + (size_t)G * bw)[L + l] : vfix;
            }
            fprintf(stderr, "kvpq calibrate: allocation for %.3g bits at ctx %ld (window %d of", bits_i, a->ctx, win);
            for (int w = 0; w < NW; w++) {
                if (isfinite(pred_w[w])) fprintf(stderr, " %d (KL %.4g)", a->wins[w], pred_w[w]);
                else fprintf(stderr, " %d (none fits)", a->wins[w]);
            }
            fprintf(stderr, ", sinks %ld): effective %.4f bits, predicted KL %.4f", a->sinks, eff, pred);
            if (vctx > 0)
                fprintf(stderr, ", held-out KL %.4f (top-1 %.1f%%, ppl %.4f vs fp16 %.4f, ctx %d; predicted / held-out %.2f)",
                        kept_chk.kl, 100.0 * kept_chk.top1, kept_chk.ppl, vf.base_ppl, vctx, pred / kept_chk.kl);
            fprintf(stderr, "\n  layer: key preset (KL) / value preset (KL)\n");
            for (int l = 0; l < L; l++)
                fprintf(stderr, "  %3d: %s (%.4f) / %s (%.4f)\n", l, names[kc[l]], klb[((size_t)kc[l] * 2) * L + l],
                        names[vc_[l]], klb[((size_t)vc_[l] * 2 + 1) * L + l]);
            fprintf(stderr,
                    "kvpq calibrate: wrote %s (%d layers, %d candidates, %zu tokens for k-means, %d held out; forward %.1f s, "
                    "k-means %.1f s, sensitivity %.1f s, total %.1f s wall, %.1f s CPU; joint check %.1f s CPU so far)\n",
                    out_i, L, n_cand, n_use, n_chunks * hctx, t_fwd, t_km - t0 - t_fwd, t_sens - t_km, cli_now() - t0,
                    cpu_seconds() - c0, vf.cpu);
        }
    }
    rc = n_failed ? 1 : 0;
    goto done;
oom:
    rc = cli_usage_error("calibrate: out of memory");
done:
    for (int c = 0; c < MAXC; c++) kvpq_codebook_free(cc[c]);
    kvpq_codebook_free(fin);
    kvpq_codebook_free(fin_kept);
    verify_free(&vf);
    free(kl);
    free(klc);
    free(cost);
    free(weight);
    free(lb);
    free(choice);
    free(tk);
    free(list);
    return rc;
}

int cmd_calibrate(int argc, char **argv) {
    calib_args jobs[1 + CALIB_MAX_ALSO];
    char *split_buf[CALIB_MAX_ALSO] = {0};
    kvpq_codebook *cbs[1 + CALIB_MAX_ALSO] = {0};
    int n_jobs = 1;
    int rc = 1;
    kvpq_status s;
    kvpq_model *model = NULL;
    kvpq_cache *cache = NULL;
    char *text = NULL;
    int32_t *tokens = NULL;
    float *logits = NULL, *kall = NULL, *vall = NULL, *qabs = NULL;
    double t0 = cli_now();
    int pr = parse_args(argc, argv, jobs, &n_jobs, split_buf);
    if (pr <= 0) {
        rc = pr == 0 ? 0 : 2;
        goto done;
    }
    const calib_args *a = &jobs[0];
    /* Every output checked before any work: not an input, writable (issue 14). */
    const char *in_opts[2] = {"--model", "--text"}, *inputs[2] = {a->model, a->text};
    for (int j = 0; j < n_jobs; j++)
        if ((rc = cli_check_output("calibrate", jobs[j].out, 2, in_opts, inputs)) != 0) goto done;
    for (int i = 0; i < a->n_more_bits; i++) { /* --bits-also "B OUT": its OUT as well (it was written unchecked) */
        if ((rc = cli_check_output("calibrate --bits-also", a->more_out[i], 2, in_opts, inputs)) != 0) goto done;
        /* one file per budget: a repeated name (as given) kept only the last budget's file */
        for (int j = -1; j < i; j++)
            if (!strcmp(a->more_out[i], j < 0 ? a->out : a->more_out[j])) {
                rc = cli_usage_error("calibrate: --bits-also %g %s: the same output as %s (one file per budget)",
                                     a->more_bits[i], a->more_out[i], j < 0 ? "-o" : "an earlier --bits-also");
                goto done;
            }
    }

    kvpq_model_params mp = kvpq_model_params_default();
    mp.n_threads = (int)a->threads;
    if ((s = kvpq_model_load(&model, a->model, &mp)) != KVPQ_OK) {
        rc = cli_fail("calibrate: loading the model", s);
        goto done;
    }
    kvpq_model_info mi;
    kvpq_model_get_info(model, &mi);
    if (a->ctx > mi.n_ctx_train) {
        rc = cli_usage_error("calibrate: --ctx %ld exceeds the model's context length %d", a->ctx, mi.n_ctx_train);
        goto done;
    }
    for (int j = 0; j < n_jobs; j++)
        if ((rc = make_codebook(&jobs[j], &mi, &cbs[j])) != 0) goto done;
    rc = 1;

    size_t text_len = 0;
    if (!(text = cli_read_file(a->text, &text_len))) {
        rc = cli_usage_error("calibrate: cannot read text file '%s': %s", a->text, cli_read_error());
        goto done;
    }
    size_t n_tok = 0;
    if ((s = kvpq_tokenize(model, text, text_len, 0, 0, NULL, 0, &n_tok)) != KVPQ_OK) {
        rc = cli_fail("calibrate: tokenizing the text file", s);
        goto done;
    }
    if (!(tokens = malloc((n_tok ? n_tok : 1) * sizeof *tokens))) goto oom;
    if ((s = kvpq_tokenize(model, text, text_len, 0, 0, tokens, n_tok, &n_tok)) != KVPQ_OK) {
        rc = cli_fail("calibrate: tokenizing", s);
        goto done;
    }
    /* --bits: the end of the text is held back from k-means for the sensitivity measurements */
    int hctx = 0, hchunks = 0;
    size_t n_avail = n_tok;
    if (a->bits > 0) {
        hctx = (int)(a->holdout_ctx ? a->holdout_ctx : (a->ctx < 1024 ? a->ctx : 1024));
        hchunks = (int)a->holdout_chunks;
        if (hctx > mi.n_ctx_train) hctx = mi.n_ctx_train;
        if ((size_t)hctx * hchunks + 16 > n_tok) {
            rc = cli_usage_error("calibrate: --bits: the text has %zu tokens, too few to hold back %d x %d", n_tok,
                                 hchunks, hctx);
            goto done;
        }
        n_avail = n_tok - (size_t)hctx * hchunks;
    }
    size_t n_use = n_avail < (size_t)a->tokens ? n_avail : (size_t)a->tokens;
    if (n_use < 16) {
        rc = cli_usage_error("calibrate: text file '%s' has only %zu tokens (need at least 16)", a->text, n_tok);
        goto done;
    }
    if (n_use < (size_t)a->tokens)
        fprintf(stderr, "kvpq calibrate: the text has %zu tokens; using all of them (asked for %ld)\n", n_tok, a->tokens);
    /* --bits: the joint check's chunk: the tokens right after the k-means tokens (never seen by
     * k-means, before the sensitivities' hold-out at the end of the text). Asked for by --verify-ctx
     * and missing: an error; by default (--ctx): a warning, no check. */
    int vctx = 0;
    if (a->bits > 0 && a->verify_ctx != 0) {
        vctx = (int)(a->verify_ctx > 0 ? a->verify_ctx : a->ctx);
        if (vctx > mi.n_ctx_train) {
            rc = cli_usage_error("calibrate: --verify-ctx %d exceeds the model's context length %d", vctx,
                                 mi.n_ctx_train);
            goto done;
        }
        if (n_use + (size_t)vctx > n_avail) {
            if (a->verify_ctx > 0) {
                rc = cli_usage_error("calibrate: --verify-ctx %d: the text has %zu tokens: %zu for k-means and %d x %d "
                                     "held out for the sensitivities leave %zu, fewer than %d (lower --tokens or "
                                     "--verify-ctx, or --verify-ctx 0)", vctx, n_tok, n_use, hchunks, hctx,
                                     n_avail - n_use, vctx);
                goto done;
            }
            if (a->window_select && !strcmp(a->window_select, "measured")) {
                rc = cli_usage_error("calibrate: --window-select measured: the text has %zu tokens: %zu for k-means "
                                     "and %d x %d held out for the sensitivities leave %zu, fewer than the %d of the "
                                     "joint check (--verify-ctx)", n_tok, n_use, hchunks, hctx, n_avail - n_use, vctx);
                goto done;
            }
            fprintf(stderr, "kvpq calibrate: warning: no joint check of the allocation: the text has %zu tokens: %zu "
                            "for k-means and %d x %d held out for the sensitivities leave %zu, fewer than --verify-ctx "
                            "%d (default: --ctx); alloc.holdout_kl not written\n", n_tok, n_use, hchunks, hctx,
                    n_avail - n_use, vctx);
            vctx = 0;
        }
    }

    /* ---- forward pass: collect post-RoPE keys and values of every layer ---- */
    const int L = mi.n_layer, H = mi.n_head_kv, D = mi.head_dim;
    const size_t row = (size_t)H * D; /* floats per token per layer */
    kvpq_cache_params kp = kvpq_cache_params_default();
    kp.type = KVPQ_CACHE_FP32;
    kvpq_model_cache_params(model, &kp); /* shape and sliding window */
    kp.max_seq = (int)a->ctx;
    kp.n_threads = (int)a->threads;
    if ((s = kvpq_cache_new(&cache, &kp)) != KVPQ_OK) {
        rc = cli_fail("calibrate: cache", s);
        goto done;
    }
    kall = malloc(sizeof(float) * (size_t)L * n_use * row);
    vall = malloc(sizeof(float) * (size_t)L * n_use * row);
    logits = malloc(sizeof(float) * (size_t)mi.n_vocab);
    qabs = calloc((size_t)L * row, sizeof(float));
    if (!kall || !vall || !logits || !qabs) goto oom;
    cli_progress pf;
    cli_progress_begin(&pf, "calibrate: forward", "tokens", (double)n_use);
    for (size_t p0 = 0; p0 < n_use; p0 += (size_t)a->ctx) {
        int n = (int)((n_use - p0) < (size_t)a->ctx ? (n_use - p0) : (size_t)a->ctx);
        if ((s = kvpq_cache_truncate(cache, 0)) != KVPQ_OK) {
            rc = cli_fail("calibrate: forward pass", s);
            goto done;
        }
        /* In steps, each read back at once: a sliding-window layer frees positions its later
         * queries no longer see, but never those of the step just appended. */
        for (int q0 = 0; q0 < n; q0 += CALIB_STEP) {
            int nq = n - q0 < CALIB_STEP ? n - q0 : CALIB_STEP;
            if ((s = kvpq_model_eval_query_absmax(model, cache, tokens + p0 + q0, nq, 0, logits, qabs)) != KVPQ_OK) {
                rc = cli_fail("calibrate: forward pass", s);
                goto done;
            }
            for (int l = 0; l < L; l++) {
                float *kl = kall + ((size_t)l * n_use + p0 + q0) * row, *vl = vall + ((size_t)l * n_use + p0 + q0) * row;
                if ((s = kvpq_cache_read(cache, l, q0, nq, kl, vl)) != KVPQ_OK) {
                    rc = cli_fail("calibrate: reading keys and values", s);
                    goto done;
                }
            }
            cli_progress_update(&pf, (double)(p0 + (size_t)(q0 + nq)), NULL);
        }
    }
    double t_fwd = cli_now() - t0;
    cli_progress_end(&pf, (double)n_use, NULL);

    /* ---- per job and layer: centering, smoothing, rotation, k-means; then the file ---- */
    for (int j = 0; j < n_jobs; j++) jobs[j].q_absmax = qabs;
    for (int j = 0; j < n_jobs; j++) {
        if (j == 0 && a->bits > 0)
            rc = run_alloc(a, model, &mi, tokens + n_avail, hctx, hchunks, tokens + n_use, vctx, n_use, kall, vall, n_use,
                           t0, t_fwd);
        else
            rc = train_and_save(&jobs[j], &mi, a->model, cbs[j], kall, vall, n_use, t0, t_fwd);
        if (rc != 0) goto done;
    }
    rc = 0;
    goto done;
oom:
    rc = cli_usage_error("calibrate: out of memory");
done:
    for (int j = 0; j < CALIB_MAX_ALSO; j++) free(split_buf[j]);
    for (int j = 0; j < 1 + CALIB_MAX_ALSO; j++) kvpq_codebook_free(cbs[j]);
    free(text);
    free(tokens);
    free(logits);
    free(kall);
    free(vall);
    free(qabs);
    kvpq_cache_free(cache);
    kvpq_model_free(model);
    return rc;
}
