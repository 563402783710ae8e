/* backend.c — where caches and quantizers run: CPU, or CUDA when built and a device is present. */
#include <stddef.h>
#include <stdio.h>

#include "internal.h"

#ifdef KVPQ_HAVE_CUDA
/* Implemented by the CUDA backend (src/cuda/): 1 if a usable device is present, else 0 with the
 * reason written into why[n]. Weak, so that a CUDA build links (and reports "no probe") before the
 * probe exists. */
int kvpq__cuda_available(char *why, size_t n) __attribute__((weak));
#endif

kvpq_status kvpq_backend_resolve(kvpq_backend want, kvpq_backend *got) {
    if (!got) return kvpq__err(KVPQ_ERR_INVALID_ARG, "kvpq_backend_resolve: got is NULL");
    if (want != KVPQ_BACKEND_AUTO && want != KVPQ_BACKEND_CPU && want != KVPQ_BACKEND_CUDA)
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "backend %d: expected auto (0), cpu (1) or cuda (2)", (int)want);
    if (want == KVPQ_BACKEND_CPU) {
        *got = KVPQ_BACKEND_CPU;
        return KVPQ_OK;
    }
    char why[256] = "built without CUDA";
#ifdef KVPQ_HAVE_CUDA
    int ok = 0;
    if (kvpq__cuda_available) {
        why[0] = '\0';
        ok = kvpq__cuda_available(why, sizeof why);
        if (!ok && !why[0]) snprintf(why, sizeof why, "no CUDA device");
    } else {
        snprintf(why, sizeof why, "CUDA built but the device probe is not linked");
    }
    if (ok) {
        *got = KVPQ_BACKEND_CUDA;
        return KVPQ_OK;
    }
#endif
    if (want == KVPQ_BACKEND_AUTO) {
        *got = KVPQ_BACKEND_CPU;
        return KVPQ_OK;
    }
    return kvpq__err(KVPQ_ERR_NO_DEVICE, "backend cuda: %s", why);
}

const char *kvpq_backend_name(kvpq_backend b) {
    static const char *const names[] = {[KVPQ_BACKEND_AUTO] = "auto", [KVPQ_BACKEND_CPU] = "cpu",
                                        [KVPQ_BACKEND_CUDA] = "cuda"};
    return (unsigned)b < sizeof names / sizeof names[0] && names[b] ? names[b] : "unknown";
}
