/* cli_env.c — the environment the CLI's libraries read once, when they load: set the defaults that
 * keep the CLI fast on a shared machine, then re-execute once so that they take effect.
 *
 * OpenMP waiting: libgomp's default (OMP_WAIT_POLICY unset) spins idle worker threads for a while
 * before sleeping. On a machine where other processes hold the cores, a spinning worker burns the
 * time slices the working thread needs: `kvpq generate --cache fp16 -n 30` decoded at 0.3 tok/s by
 * default and 15.6 tok/s with OMP_WAIT_POLICY=PASSIVE on the 2-core machine shared by ~8 agents
 * (issue 15; numbers in docs/model.md). libgomp reads the variable in its constructor, before main,
 * so setting it in main needs one re-exec. A value the user set is kept.
 *
 * OpenBLAS threads: the prefill's sgemm runs OpenBLAS's own pthread pool beside the OpenMP one; its
 * threads spin after each call too. OPENBLAS_NUM_THREADS defaults to 1 (the OpenMP threads already
 * use the cores; see docs/model.md for the measurement); a value the user set is kept.
 *
 * OpenBLAS kernels: OpenBLAS built with DYNAMIC_ARCH picks its kernels once, when the library loads,
 * from the CPU model; a CPU it does not know (0.3.21 on a virtualized Sapphire Rapids reports a
 * generic "Intel Xeon Processor") falls back to "Prescott" (SSE3) kernels, which made the model's
 * prefill 3.6x slower here (kvpq ppl --ctx 512, one thread: 6.7 s vs 1.9 s user time with SkylakeX
 * kernels). The only control is OPENBLAS_CORETYPE, read at load time; the CLI sets it as the Python
 * package does (blas_coretype), also where OpenBLAS knows the CPU, so that both give the same bits.
 *
 * KVPQ_NO_ENV_FIXUP=1 (or the older KVPQ_NO_BLAS_FIXUP=1) turns all of this off. Programs using the
 * library set these variables themselves. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"

char *openblas_get_corename(void); /* OpenBLAS extension (cblas.h of openblas) */

/* The OpenBLAS core type to force (NULL: none): the Python package's rule (python/kvpq/_ffi.py
 * _openblas_coretype), SkylakeX on AVX-512 and Haswell on AVX2 + FMA CPUs, whatever OpenBLAS
 * detected, so that the CLI and the package run the same sgemm kernels and give the same bits (on
 * this project's AMD EPYC VM OpenBLAS 0.3.21 picks "Cooperlake" by itself, whose sgemm rounds
 * differently: the CLI's and Python's calibrate then differed by 1-3 ulps in the key smoothing
 * factors, tests/python/test_calibrate_peer.py). */
static const char *blas_coretype(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (getenv("OPENBLAS_CORETYPE")) return NULL;
    const char *core = openblas_get_corename();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return core && !strcmp(core, "SkylakeX") ? NULL : "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return core && !strcmp(core, "Haswell") ? NULL : "Haswell";
#endif
    return NULL;
}

void cli_env_fixup(char **argv) {
    if (getenv("KVPQ_NO_ENV_FIXUP") || getenv("KVPQ_NO_BLAS_FIXUP")) return;
    int changed = 0;
    if (!getenv("OMP_WAIT_POLICY")) changed |= !setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    if (!getenv("OPENBLAS_NUM_THREADS")) changed |= !setenv("OPENBLAS_NUM_THREADS", "1", 1);
    const char *core = blas_coretype();
    if (core) changed |= !setenv("OPENBLAS_CORETYPE", core, 1);
    if (!changed) return;
    /* Once: the re-executed process finds every variable set and returns above. */
    execv("/proc/self/exe", argv); /* returns only on failure: carry on with the defaults as loaded */
}
