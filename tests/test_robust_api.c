/* test_robust_api.c — hostile arguments to library functions outside the cache and file readers
 * (issue 14's "go further" pass): each must give a named error or a correct result, never undefined
 * behaviour (the sanitizer build runs this file too). */
#include <criterion/criterion.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>

#include "kvpq.h"

/* kvpq_alloc_mckp formed budget + max_units - 1 and w + q - 1 in int64 (UBSan: signed overflow for
 * a budget or a weight near INT64_MAX), and with budget = max_units = INT64_MAX sized its tables as
 * (U + 1) * 8 bytes with U + 1 overflowing: a tiny allocation, then writes far past it. */
Test(robust_api, alloc_mckp_extreme_budgets_and_weights) {
    const double cost[4] = {4, 1, 3, 2};
    const int64_t w[4] = {1, 5, 2, INT64_MAX - 1};
    int choice[2] = {-1, -1};
    double tc = 0;
    int64_t tw = 0;
    /* budget near INT64_MAX, max_units 64: quanta q = 2^57, U = 63 units; INT64_MAX - 1 rounds up
     * to 64 units (unavailable), so group 0 takes weight 5 (cost 1) and group 1 weight 2 (cost 3) */
    cr_assert_eq(kvpq_alloc_mckp(2, 2, cost, w, INT64_MAX, 64, choice, &tc, &tw), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert(choice[0] == 1 && choice[1] == 0 && tc == 4.0 && tw == 7, "%d %d %g %lld", choice[0], choice[1], tc,
              (long long)tw);
    /* exact weights, small budget: the one fitting pick per group */
    cr_assert_eq(kvpq_alloc_mckp(2, 2, cost, w, 3, 0, choice, &tc, &tw), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert(choice[0] == 0 && choice[1] == 0 && tw == 3 && tc == 7.0, "%d %d %lld %g", choice[0], choice[1],
              (long long)tw, tc);
    /* max_units beyond the bound: refused by name, not a wrapped allocation */
    cr_assert_eq(kvpq_alloc_mckp(2, 2, cost, w, INT64_MAX, INT64_MAX, choice, &tc, &tw), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "max_units 9223372036854775807"), "%s", kvpq_last_error());
    cr_assert_eq(kvpq_alloc_mckp(2, 2, cost, w, 100, KVPQ_ALLOC_MAX_UNITS + 1, choice, &tc, &tw), KVPQ_ERR_INVALID_ARG);
    /* the lightest allocation over budget: its weight in the message saturates instead of wrapping */
    const int64_t heavy[4] = {INT64_MAX - 1, INT64_MAX, INT64_MAX - 1, INT64_MAX};
    cr_assert_eq(kvpq_alloc_mckp(2, 2, cost, heavy, 10, 0, choice, &tc, &tw), KVPQ_ERR_CAPACITY);
    cr_assert(strstr(kvpq_last_error(), "(9223372036854775807)"), "%s", kvpq_last_error());
}
