/* status.c — return codes, thread-local error messages, version. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define KVPQ_STR2(x) #x
#define KVPQ_STR(x) KVPQ_STR2(x)

static _Thread_local char tl_error[1024];

const char *kvpq_status_string(kvpq_status s) {
    switch (s) {
    case KVPQ_OK: return "ok";
    case KVPQ_ERR_INVALID_ARG: return "invalid argument";
    case KVPQ_ERR_NOMEM: return "out of memory";
    case KVPQ_ERR_IO: return "i/o error";
    case KVPQ_ERR_FORMAT: return "bad file format";
    case KVPQ_ERR_UNSUPPORTED: return "unsupported";
    case KVPQ_ERR_NONFINITE: return "non-finite value";
    case KVPQ_ERR_MISMATCH: return "mismatch";
    case KVPQ_ERR_NO_DEVICE: return "no usable GPU";
    case KVPQ_ERR_DEVICE: return "GPU error";
    case KVPQ_ERR_CAPACITY: return "capacity exceeded";
    case KVPQ_ERR_INTERNAL: return "internal error";
    case KVPQ_ERR_BUDGET: return "budget exceeded";
    }
    return "unknown status";
}

const char *kvpq_last_error(void) { return tl_error; }

const char *kvpq_version(void) {
    return KVPQ_STR(KVPQ_VERSION_MAJOR) "." KVPQ_STR(KVPQ_VERSION_MINOR) "." KVPQ_STR(KVPQ_VERSION_PATCH);
}

kvpq_status kvpq__err(kvpq_status s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_error, sizeof tl_error, fmt, ap);
    va_end(ap);
    return s;
}

void kvpq__err_prefix(const char *fmt, ...) {
    char prefix[512], old[sizeof tl_error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    memcpy(old, tl_error, sizeof old);
    /* Truncation of a very long message is acceptable; the prefix comes first. */
    size_t np = strlen(prefix);
    if (np > sizeof tl_error - 3) np = sizeof tl_error - 3;
    memcpy(tl_error, prefix, np);
    memcpy(tl_error + np, ": ", 2);
    size_t room = sizeof tl_error - np - 3, no = strlen(old);
    if (no > room) no = room;
    memcpy(tl_error + np + 2, old, no);
    tl_error[np + 2 + no] = '\0';
}

/* Exponent bits all ones (NaN or Inf), OR-ed over blocks of 256 without a branch per element so the
 * compiler vectorizes it (the early-exit loop was 1-2% of a prefill). */
int kvpq__all_finite(const float *x, size_t n) {
    for (size_t i0 = 0; i0 < n; i0 += 256) {
        const size_t m = n - i0 < 256 ? n - i0 : 256;
        uint32_t bad = 0;
        for (size_t i = 0; i < m; i++) {
            uint32_t u;
            memcpy(&u, x + i0 + i, sizeof u);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        }
        if (bad) return 0;
    }
    return 1;
}

float kvpq__max_abs(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}
