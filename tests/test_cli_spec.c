/* test_cli_spec.c — the CLI's --cache SPEC parser (tools/cli_spec.c): kinds, the :wN / :sN / :force / :cuda
 * suffixes in any order, vq paths with ':' in them, and every refusal (exit code 2, the SPEC and the
 * offending part named); the CLI's default sinks per kind. */
#include <criterion/criterion.h>
#include <string.h>

#include "cli_spec.h"

static cli_cache_spec ok(const char *spec) {
    cli_cache_spec s;
    char err[512];
    int rc = cli_cache_spec_parse(spec, &s, err, sizeof err);
    cr_assert_eq(rc, 0, "'%s' refused: %s", spec, err);
    return s;
}

static void refused(const char *spec, const char *needle) {
    cli_cache_spec s;
    char err[512];
    int rc = cli_cache_spec_parse(spec, &s, err, sizeof err);
    cr_assert_eq(rc, 2, "'%s' accepted (or exit %d)", spec, rc);
    cr_assert(strstr(err, needle), "'%s': message '%s' lacks '%s'", spec, err, needle);
    cr_assert(strstr(err, spec) || strlen(spec) > 200, "'%s': message '%s' does not name the SPEC", spec, err);
}

Test(cli_spec, kinds_and_suffixes_in_any_order) {
    cli_cache_spec s = ok("q4_0");
    cr_assert(s.type == KVPQ_CACHE_Q4_0 && s.window == -1 && s.sinks == -1 && !s.force && !s.path[0]);
    s = ok("kivi2:w64:s4");
    cr_assert(s.type == KVPQ_CACHE_KIVI2 && s.window == 64 && s.sinks == 4);
    s = ok("kivi4:s0:w0");
    cr_assert(s.type == KVPQ_CACHE_KIVI4 && s.window == 0 && s.sinks == 0);
    s = ok("q4_0r:s1");
    cr_assert(s.type == KVPQ_CACHE_Q4_0R && s.sinks == 1 && s.window == -1);
    s = ok("vq:cb.safetensors");
    cr_assert(s.type == KVPQ_CACHE_VQ && !strcmp(s.path, "cb.safetensors") && s.window == -1 && s.sinks == -1);
    const char *orders[] = {"vq:d/cb.st:w32:s2:force", "vq:d/cb.st:force:s2:w32", "vq:d/cb.st:s2:force:w32"};
    for (int i = 0; i < 3; i++) {
        s = ok(orders[i]);
        cr_assert(!strcmp(s.path, "d/cb.st") && s.window == 32 && s.sinks == 2 && s.force, "%s", orders[i]);
    }
    s = ok("kivi2:w1048576:s65536"); /* the largest */
    cr_assert(s.window == 1 << 20 && s.sinks == 65536);
}

/* The path rule: the trailing parts that read as suffixes are suffixes; the first that does not, or
 * an empty part, ends them; everything before is the path. */
Test(cli_spec, vq_paths_with_colons) {
    cli_cache_spec s = ok("vq:run:2.safetensors:w64");
    cr_assert(!strcmp(s.path, "run:2.safetensors") && s.window == 64, "%s", s.path);
    s = ok("vq:a:b:c");
    cr_assert(!strcmp(s.path, "a:b:c") && s.window == -1);
    s = ok("vq:cb:w5:"); /* a file named cb:w5: the trailing ':' ends the path */
    cr_assert(!strcmp(s.path, "cb:w5") && s.window == -1, "%s", s.path);
    s = ok("vq:cb:w5::s1"); /* the same file, with one sink */
    cr_assert(!strcmp(s.path, "cb:w5") && s.window == -1 && s.sinks == 1, "%s", s.path);
    s = ok("vq:w5"); /* the first part is always the path */
    cr_assert(!strcmp(s.path, "w5") && s.window == -1);
    s = ok("vq:x::"); /* a file named 'x:' */
    cr_assert(!strcmp(s.path, "x:"), "%s", s.path);
    s = ok("vq:s1.safetensors:s1"); /* 's1.safetensors' is not a suffix */
    cr_assert(!strcmp(s.path, "s1.safetensors") && s.sinks == 1);
    s = ok("vq:cb:force:w0");
    cr_assert(!strcmp(s.path, "cb") && s.force && s.window == 0);
    s = ok("vq:d/cb.st:cuda:w64"); /* the cache on the GPU (kvpq_cache's CUDA backend) */
    cr_assert(!strcmp(s.path, "d/cb.st") && s.cuda && s.window == 64 && !s.force, "%s", s.path);
    s = ok("vq:cb.st");
    cr_assert(!s.cuda);
    s = ok("vq:cuda"); /* the first part is always the path: a file named cuda */
    cr_assert(!strcmp(s.path, "cuda") && !s.cuda);
}

Test(cli_spec, refusals_are_named) {
    refused("kivi2:w64:w32", "duplicate suffix ':w32'");
    refused("vq:cb:s1:s2", "duplicate suffix ':s1'");
    refused("vq:cb:force:force", "duplicate suffix ':force'");
    refused("q4_0:x3", "unknown suffix ':x3'");
    refused("kivi2:w64:bogus", "unknown suffix ':bogus'");
    refused("q4_0:force", ":force applies to vq");
    refused("kivi2:force:w8", ":force applies to vq");
    refused("q8_0:cuda", ":cuda applies to vq");
    refused("vq:cb:cuda:cuda", "duplicate suffix ':cuda'");
    refused("fp16:w8", "vq and kivi");
    refused("q4_0:w8", "vq and kivi");
    refused("fp16:s1", "quantized caches only");
    refused("fp32:s0", "quantized caches only");
    refused("kivi2:w", "expected :wN");
    refused("kivi2:w99999999", "expected :wN");
    refused("kivi2:w1048577", "expected :wN");
    refused("q4_0:s65537", "expected :sN");
    refused("vq:cb:s", "expected :sN");
    /* issue 31: a signed number read as part of the vq path ("missing file F:w-1") */
    refused("vq:cb:w-1", "window ':w-1': expected :wN with N in 0..1048576 (a file name ending so");
    refused("vq:cb:s+2:w8", "sinks ':s+2': expected :sN");
    refused("kivi2:w-1", "window ':w-1': expected :wN");
    refused("q4_0:", "empty suffix");
    refused("q4_0::s1", "empty suffix");
    refused("kivi2:w8:", "empty suffix");
    refused("q5_0", "unknown kind 'q5_0'");
    refused("vq", "needs a codebook file");
    refused("vq:", "needs a codebook file");
    refused("vq::w8", "needs a codebook file");
    char longspec[400];
    memset(longspec, 'a', sizeof longspec - 1);
    longspec[sizeof longspec - 1] = '\0';
    memcpy(longspec, "vq:", 3);
    refused(longspec, "longer than 255 bytes");
}

Test(cli_spec, default_sinks_per_kind) {
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_VQ), 1);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_KIVI2), 1);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_KIVI4), 1);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_Q4_0R), 1);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_Q4_0), 0);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_Q8_0), 0);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_Q8_0R), 0);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_FP16), 0);
    cr_assert_eq(kvpq_cache_default_sinks(KVPQ_CACHE_FP32), 0);
    /* the library's own default stays 0 */
    cr_assert_eq(kvpq_cache_params_default().sinks, 0);
}
