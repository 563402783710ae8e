/* test_status.c — status codes, error messages and version. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

Test(status, values_are_stable) {
    /* Public ABI: these numbers must never change. */
    cr_assert_eq(KVPQ_OK, 0);
    cr_assert_eq(KVPQ_ERR_INVALID_ARG, -1);
    cr_assert_eq(KVPQ_ERR_FORMAT, -4);
    cr_assert_eq(KVPQ_ERR_NONFINITE, -6);
    cr_assert_eq(KVPQ_ERR_NO_DEVICE, -8);
    cr_assert_eq(KVPQ_ERR_INTERNAL, -11);
    cr_assert_eq(KVPQ_ERR_BUDGET, -12);
}

Test(status, every_code_has_a_distinct_name) {
    for (int a = KVPQ_ERR_BUDGET; a <= 0; a++) {
        cr_assert_str_neq(kvpq_status_string((kvpq_status)a), "unknown status");
        for (int b = a + 1; b <= 0; b++)
            cr_assert_str_neq(kvpq_status_string((kvpq_status)a), kvpq_status_string((kvpq_status)b));
    }
    cr_assert_str_eq(kvpq_status_string((kvpq_status)-999), "unknown status");
}

Test(status, last_error_carries_the_message) {
    kvpq_status s = kvpq__err(KVPQ_ERR_INVALID_ARG, "dsub %d: expected 1, 2, 4, 8 or 16", 3);
    cr_assert_eq(s, KVPQ_ERR_INVALID_ARG);
    cr_assert_str_eq(kvpq_last_error(), "dsub 3: expected 1, 2, 4, 8 or 16");
    kvpq__err_prefix("codebook file '%s'", "x.safetensors");
    cr_assert_str_eq(kvpq_last_error(), "codebook file 'x.safetensors': dsub 3: expected 1, 2, 4, 8 or 16");
}

Test(status, version_matches_macros) {
    char want[32];
    snprintf(want, sizeof want, "%d.%d.%d", KVPQ_VERSION_MAJOR, KVPQ_VERSION_MINOR, KVPQ_VERSION_PATCH);
    cr_assert_str_eq(kvpq_version(), want);
}

Test(simd, set_rejects_levels_beyond_the_cpu) {
    kvpq_simd_level best = kvpq_simd_get();
    cr_assert_eq(kvpq_simd_set(KVPQ_SIMD_SCALAR), KVPQ_OK);
    cr_assert_eq(kvpq_simd_get(), KVPQ_SIMD_SCALAR);
    cr_assert_eq(kvpq_simd_set((kvpq_simd_level)7), KVPQ_ERR_INVALID_ARG);
    cr_assert_eq(kvpq_simd_set(best), KVPQ_OK);
}

/* kvpq__all_finite (the input guard of the caches, the encoder and the model) over blocks: a NaN,
 * +-Inf anywhere (the first element, the last, past a block of 256) is found; FLT_MAX, subnormals,
 * -0 and n = 0 are finite. */
Test(status, all_finite_finds_every_non_finite) {
    static float x[1000];
    for (int i = 0; i < 1000; i++) x[i] = (float)(i - 500) * 0.25f;
    x[3] = 3.4028235e38f;
    x[4] = 1e-45f;
    x[5] = -0.0f;
    cr_assert(kvpq__all_finite(x, 1000));
    cr_assert(kvpq__all_finite(x, 0));
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    const int at[4] = {0, 255, 256, 999};
    for (int b = 0; b < 3; b++)
        for (int k = 0; k < 4; k++) {
            const float keep = x[at[k]];
            x[at[k]] = bad[b];
            cr_assert(!kvpq__all_finite(x, 1000), "%g at %d", (double)bad[b], at[k]);
            cr_assert(kvpq__all_finite(x, (size_t)at[k]), "only the elements before %d", at[k]);
            x[at[k]] = keep;
        }
}
