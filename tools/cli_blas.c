/* cli_blas.c — make OpenBLAS use the CPU's kernels when its own detection fails.
 *
 * OpenBLAS built with DYNAMIC_ARCH picks its kernels once, when the library loads, from the CPU
 * model; a CPU it does not know (0.3.21 on a virtualized Sapphire Rapids reports a generic "Intel
 * Xeon Processor") falls back to "Prescott" (SSE3) kernels, which made the model's prefill 3.6x
 * slower here (kvpq ppl --ctx 512, one thread: 6.7 s vs 1.9 s user time with SkylakeX kernels).
 * The only control is the OPENBLAS_CORETYPE environment variable, read at load time, so the CLI
 * re-executes itself once with it set. Programs using the library set it themselves. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

char *openblas_get_corename(void); /* OpenBLAS extension (cblas.h of openblas) */

void cli_blas_fixup(char **argv) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (getenv("OPENBLAS_CORETYPE") || getenv("KVPQ_NO_BLAS_FIXUP")) return;
    const char *core = openblas_get_corename();
    if (!core || (strcmp(core, "Prescott") != 0 && strcmp(core, "Core2") != 0 && strcmp(core, "Nehalem") != 0))
        return;
    const char *want = NULL;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        want = "SkylakeX";
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        want = "Haswell";
    if (!want) return;
    setenv("OPENBLAS_CORETYPE", want, 1);
    execv("/proc/self/exe", argv); /* returns only on failure: carry on with the slow kernels */
    unsetenv("OPENBLAS_CORETYPE");
#else
    (void)argv;
#endif
}
