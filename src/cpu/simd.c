/* simd.c — CPU SIMD level: detected once (pthread_once), overridable by KVPQ_SIMD or
 * kvpq_simd_set(). The kernel table of each level is cpu/dispatch.c's. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/dispatch.h"
#include "internal.h"

static int detected = -1; /* best level the CPU supports */
static int current = -1;  /* level in use */

static int detect(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return KVPQ_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return KVPQ_SIMD_AVX2;
#endif
    return KVPQ_SIMD_SCALAR;
}

static pthread_once_t level_once = PTHREAD_ONCE_INIT;

static void level_init(void) {
    detected = detect();
    current = detected;
    const char *env = getenv("KVPQ_SIMD");
    if (env && *env) {
        int want = !strcmp(env, "scalar") ? KVPQ_SIMD_SCALAR
                   : !strcmp(env, "avx2") ? KVPQ_SIMD_AVX2
                   : !strcmp(env, "avx512") ? KVPQ_SIMD_AVX512
                                            : -1;
        /* An unknown or unsupported request keeps the detected level (a library never exits). */
        if (want >= 0 && want <= detected) current = want;
    }
}

static void init_once(void) { pthread_once(&level_once, level_init); }

kvpq_simd_level kvpq__simd_best(void) {
    init_once();
    return (kvpq_simd_level)detected;
}

kvpq_simd_level kvpq_simd_get(void) {
    init_once();
    return (kvpq_simd_level)current;
}

kvpq_status kvpq_simd_set(kvpq_simd_level level) {
    init_once();
    if ((int)level < KVPQ_SIMD_SCALAR || (int)level > KVPQ_SIMD_AVX512)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "SIMD level %d: expected 0 (scalar), 1 (avx2) or 2 (avx512)", (int)level);
    if ((int)level > detected)
        return kvpq__err(KVPQ_ERR_UNSUPPORTED, "SIMD level %s: this CPU supports at most %s",
                         kvpq_simd_name(level), kvpq_simd_name((kvpq_simd_level)detected));
    current = level;
    return KVPQ_OK;
}

const char *kvpq_simd_name(kvpq_simd_level level) {
    static const char *const names[] = {[KVPQ_SIMD_SCALAR] = "scalar", [KVPQ_SIMD_AVX2] = "avx2",
                                        [KVPQ_SIMD_AVX512] = "avx512"};
    return (unsigned)level < sizeof names / sizeof names[0] && names[level] ? names[level] : "unknown";
}
