/* test_cache_kivi.c — KIVI caches: the residual-window rule at its edges, per-channel key and
 * per-token value groups, honest byte counts, truncation. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache_testutil.h"
#include "cpu/attn_kernels.h"
#include "kvpq.h"

#define ATTN_RTOL 2e-5

static kvpq_cache *make_kivi(int bits, int hkv, int hd, int window, int page, int max_seq) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = bits == 2 ? KVPQ_CACHE_KIVI2 : KVPQ_CACHE_KIVI4;
    p.n_layer = 1;
    p.n_head = 2 * hkv;
    p.n_head_kv = hkv;
    p.head_dim = hd;
    p.window = window;
    p.page_tokens = page;
    p.max_seq = max_seq;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s", kvpq_last_error());
    return c;
}

/* The documented rule: n_coded = floor(max(0, L - W) / 32) * 32. */
static int n_coded(int L, int W) { return L > W ? (L - W) / 32 * 32 : 0; }

Test(kivi, window_edges) {
    const int hkv = 2, hd = 64, W = 128;
    const size_t kvw = (size_t)hkv * hd;
    const int lens[] = {0, 1, W - 1, W, W + 1, W + 31, W + 32, W + 33, W + 64, 3 * W + 5};
    float *k = rand_vec((size_t)(3 * W + 5) * kvw, 1, 1.0f), *v = rand_vec((size_t)(3 * W + 5) * kvw, 2, 1.0f);
    float *kr = malloc((size_t)(3 * W + 5) * kvw * 4), *vr = malloc((size_t)(3 * W + 5) * kvw * 4);
    float *q = rand_vec((size_t)2 * hkv * hd, 3, 1.0f), *out = malloc((size_t)2 * hkv * hd * 4);
    double *ref = malloc((size_t)2 * hkv * hd * 8);
    for (int bits = 2; bits <= 4; bits += 2)
        for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
            const int L = lens[i];
            kvpq_cache *c = make_kivi(bits, hkv, hd, W, 256, 1024);
            for (int t = 0; t < L; t++) /* one position at a time, as in decoding */
                cr_assert_eq(kvpq_cache_append(c, 0, 1, k + t * kvw, v + t * kvw), KVPQ_OK);
            kvpq_cache_stats st;
            cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
            cr_assert_eq(st.tokens_coded, n_coded(L, W), "kivi%d L %d: coded %lld", bits, L,
                         (long long)st.tokens_coded);
            cr_assert_eq(st.tokens_window, L - n_coded(L, W));
            cr_assert(st.tokens_window <= W + 31 && st.tokens_window >= (L < W ? L : W));
            if (L == 0) {
                cr_assert_eq(kvpq_cache_resident_bytes(c), 0, "nothing allocated before the first append");
                kvpq_cache_free(c);
                continue;
            }
            cr_assert_eq(kvpq_cache_read(c, 0, 0, L, kr, vr), KVPQ_OK);
            /* Window positions hold exactly the fp16 rounding of what was appended. */
            for (size_t e = (size_t)n_coded(L, W) * kvw; e < (size_t)L * kvw; e++) {
                cr_assert_eq(kr[e], kvpq__h2f(kvpq__f2h(k[e])));
                cr_assert_eq(vr[e], kvpq__h2f(kvpq__f2h(v[e])));
            }
            /* Quantized positions differ (lossy) but stay close. */
            double err = 0;
            for (size_t e = 0; e < (size_t)n_coded(L, W) * kvw; e++) err = fmax(err, fabs(kr[e] - k[e]));
            if (n_coded(L, W)) cr_assert(err > 1e-3 && err < (bits == 2 ? 2.5 : 0.5), "kivi%d max err %g", bits, err);
            cr_assert_eq(kvpq_cache_attend(c, 0, 1, q, out), KVPQ_OK);
            ref_attend(L, 1, 2 * hkv, hkv, hd, kr, vr, q, ref);
            double e = rel_err_f64(out, ref, (size_t)2 * hkv * hd);
            cr_assert(e < ATTN_RTOL, "kivi%d L %d: attend rel err %g", bits, L, e);
            kvpq_cache_free(c);
        }
    free(k), free(v), free(kr), free(vr), free(q), free(out), free(ref);
}

Test(kivi, window_zero_and_block_append_same_as_token_by_token) {
    const int hkv = 1, hd = 32, L = 200;
    float *k = rand_vec((size_t)L * hd, 5, 1.0f), *v = rand_vec((size_t)L * hd, 6, 1.0f);
    float *a = malloc((size_t)L * hd * 4), *b = malloc((size_t)L * hd * 4);
    for (int W = 0; W <= 40; W += 40) {
        kvpq_cache *c1 = make_kivi(2, hkv, hd, W, 64, L), *c2 = make_kivi(2, hkv, hd, W, 64, L);
        cr_assert_eq(kvpq_cache_append(c1, 0, L, k, v), KVPQ_OK); /* one block much longer than the ring */
        for (int t = 0; t < L; t++) cr_assert_eq(kvpq_cache_append(c2, 0, 1, k + t * hd, v + t * hd), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c1, 0, 0, L, a, NULL), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c2, 0, 0, L, b, NULL), KVPQ_OK);
        cr_assert(!memcmp(a, b, (size_t)L * hd * 4), "W %d", W);
        kvpq_cache_stats st;
        kvpq_cache_get_stats(c1, &st);
        cr_assert_eq(st.tokens_window, L - n_coded(L, W), "W %d: window %lld", W, (long long)st.tokens_window);
        kvpq_cache_free(c1);
        kvpq_cache_free(c2);
    }
    free(k), free(v), free(a), free(b);
}

static int distinct(const float *x, size_t n, size_t stride) {
    float seen[64];
    int ns = 0;
    for (size_t i = 0; i < n; i++) {
        int found = 0;
        for (int j = 0; j < ns; j++) found |= seen[j] == x[i * stride];
        if (!found && ns < 64) seen[ns++] = x[i * stride];
    }
    return ns;
}

Test(kivi, keys_grouped_per_channel_values_per_token) {
    const int hkv = 2, hd = 64, L = 96, W = 0;
    const size_t kvw = (size_t)hkv * hd;
    float *k = rand_vec((size_t)L * kvw, 7, 1.0f), *v = rand_vec((size_t)L * kvw, 8, 1.0f);
    /* An outlier key channel (KIVI fig. 2): channel 5 of head 1 is 100x larger. Per-channel key
     * groups keep the other channels' error unaffected; a per-token scheme would not. */
    for (int t = 0; t < L; t++) k[t * kvw + hd + 5] *= 100.0f;
    /* An outlier value token: token 40 is 100x larger; per-token groups keep other tokens unaffected. */
    for (size_t c = 0; c < kvw; c++) v[40 * kvw + c] *= 100.0f;
    float *kr = malloc((size_t)L * kvw * 4), *vr = malloc((size_t)L * kvw * 4);
    for (int bits = 2; bits <= 4; bits += 2) {
        kvpq_cache *c = make_kivi(bits, hkv, hd, W, 256, L);
        cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, kr, vr), KVPQ_OK);
        for (int g = 0; g < L / 32; g++)
            for (int h = 0; h < hkv; h++)
                for (int ch = 0; ch < hd; ch++) /* a key channel over 32 tokens: at most 2^b values */
                    cr_assert_leq(distinct(kr + (size_t)g * 32 * kvw + h * hd + ch, 32, kvw), 1 << bits);
        for (int t = 0; t < L; t++)
            for (int j = 0; j < hkv * hd / 32; j++) /* a value token over 32 channels: at most 2^b */
                cr_assert_leq(distinct(vr + (size_t)t * kvw + j * 32, 32, 1), 1 << bits);
        double ek = 0, ev = 0;
        for (int t = 0; t < L; t++)
            for (size_t ch = 0; ch < kvw; ch++) {
                if (ch != (size_t)hd + 5) ek = fmax(ek, fabs(kr[t * kvw + ch] - k[t * kvw + ch]));
                if (t != 40) ev = fmax(ev, fabs(vr[t * kvw + ch] - v[t * kvw + ch]));
            }
        /* half a step of a group spanning ~[-4, 4] sigma, plus fp16 rounding of scale and min */
        double bound = (bits == 2 ? 8.0 / 3 : 8.0 / 15) * 0.5 * 1.05 + 0.01;
        cr_assert(ek < bound && ev < bound, "kivi%d: max error off the outliers K %g V %g (bound %g)", bits, ek, ev,
                  bound);
        kvpq_cache_free(c);
    }
    free(k), free(v), free(kr), free(vr);
}

Test(kivi, kivi4_more_accurate_than_kivi2) {
    const int hkv = 3, hd = 64, L = 640, W = 128;
    const size_t n = (size_t)L * hkv * hd;
    float *k = rand_vec(n, 9, 1.0f), *v = rand_vec(n, 10, 1.0f), *r = malloc(n * 4);
    double err[2];
    for (int b = 0; b < 2; b++) {
        kvpq_cache *c = make_kivi(b ? 4 : 2, hkv, hd, W, 256, L);
        cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, r, NULL), KVPQ_OK);
        double e = 0, d = 0;
        for (size_t i = 0; i < n; i++) e += (r[i] - k[i]) * (double)(r[i] - k[i]), d += k[i] * (double)k[i];
        err[b] = sqrt(e / d);
        kvpq_cache_free(c);
    }
    cr_assert(err[1] < err[0] / 3, "kivi4 rel RMS %g vs kivi2 %g", err[1], err[0]);
    free(k), free(v), free(r);
}

Test(kivi, resident_bytes_as_documented) {
    const int hkv = 2, hd = 64, W = 128, page = 256;
    for (int bits = 2; bits <= 4; bits += 2) {
        const int lens[] = {1, 300, 1000};
        for (int i = 0; i < 3; i++) {
            const int L = lens[i];
            kvpq_cache *c = make_kivi(bits, hkv, hd, W, page, 2048);
            float *k = rand_vec((size_t)L * hkv * hd, 11, 1.0f);
            cr_assert_eq(kvpq_cache_append(c, 0, L, k, k), KVPQ_OK);
            const size_t blk = (size_t)hd * 4 + (size_t)hd * 32 * bits / 8; /* scale, min, codes */
            const int groups = n_coded(L, W) / 32, gp = page / 32, pages = (groups + gp - 1) / gp;
            const size_t want = 2 * (size_t)pages * gp * hkv * blk + 2 * (size_t)(W + 32) * hkv * hd * 2;
            size_t got = kvpq_cache_resident_bytes(c);
            cr_assert(got >= want && got < want + 4096, "kivi%d L %d: %zu bytes, layout says %zu", bits, L, got, want);
            kvpq_cache_stats st;
            kvpq_cache_get_stats(c, &st);
            cr_assert_float_eq(st.bits_per_element, got * 8.0 / (2.0 * L * hkv * hd), 1e-9);
            free(k);
            kvpq_cache_free(c);
        }
    }
}

Test(kivi, truncate) {
    const int hkv = 2, hd = 64, W = 64, L = 500;
    const size_t kvw = (size_t)hkv * hd;
    float *k = rand_vec((size_t)L * kvw, 12, 1.0f), *v = rand_vec((size_t)L * kvw, 13, 1.0f);
    float *a = malloc((size_t)L * kvw * 4), *b = malloc((size_t)L * kvw * 4), *before = malloc((size_t)L * kvw * 4);
    for (int bits = 2; bits <= 4; bits += 2) {
        /* Keeping n_coded (here 416 for both 500 and 490): exact, truncate+append equals fresh. */
        kvpq_cache *c = make_kivi(bits, hkv, hd, W, 64, 1024), *f = make_kivi(bits, hkv, hd, W, 64, 1024);
        cr_assert_eq(kvpq_cache_append(c, 0, L, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_truncate(c, 490), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(c, 0, 10, v, k), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(f, 0, 490, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(f, 0, 10, v, k), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, a, NULL), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(f, 0, 0, L, b, NULL), KVPQ_OK);
        cr_assert(!memcmp(a, b, (size_t)L * kvw * 4), "kivi%d: truncate keeping n_coded is exact", bits);
        /* Deeper (a rollback): whole groups below 200 stay quantized, unchanged; the 8 positions of
         * the group cut in two return to the window with their dequantized values in fp16. */
        cr_assert_eq(kvpq_cache_read(c, 0, 0, L, before, NULL), KVPQ_OK);
        cr_assert_eq(kvpq_cache_truncate(c, 200), KVPQ_OK);
        kvpq_cache_stats st;
        kvpq_cache_get_stats(c, &st);
        cr_assert_eq(st.tokens_coded, 192);
        cr_assert_eq(st.tokens_window, 8);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, 200, a, NULL), KVPQ_OK);
        cr_assert(!memcmp(a, before, (size_t)192 * kvw * 4), "whole groups kept as they were");
        for (size_t e = (size_t)192 * kvw; e < (size_t)200 * kvw; e++)
            cr_assert(fabs(a[e] - before[e]) <= 1e-3 * fabs(before[e]) + 1e-6, "element %zu: %g vs %g", e, a[e],
                      before[e]);
        /* It keeps working: appending catches up with the rule (at 300 positions, n_coded is
         * floor((300 - 64) / 32) * 32 again), and attention matches the reference over its read-back. */
        cr_assert_eq(kvpq_cache_append(c, 0, 100, k, v), KVPQ_OK);
        kvpq_cache_get_stats(c, &st);
        cr_assert_eq(st.tokens_coded, n_coded(300, W));
        float q[4 * 64], out[4 * 64];
        double ref[4 * 64];
        for (int i = 0; i < 4 * 64; i++) q[i] = k[i];
        cr_assert_eq(kvpq_cache_read(c, 0, 0, 300, a, b), KVPQ_OK);
        cr_assert_eq(kvpq_cache_attend(c, 0, 1, q, out), KVPQ_OK);
        ref_attend(300, 1, 4, hkv, hd, a, b, q, ref);
        cr_assert(rel_err_f64(out, ref, 4 * 64) < ATTN_RTOL);
        /* to 0: everything freed, as new */
        cr_assert_eq(kvpq_cache_truncate(c, 0), KVPQ_OK);
        cr_assert_eq(kvpq_cache_resident_bytes(c), 0);
        cr_assert_eq(kvpq_cache_append(c, 0, 490, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, 490, a, NULL), KVPQ_OK);
        kvpq_cache_free(f);
        f = make_kivi(bits, hkv, hd, W, 64, 1024);
        cr_assert_eq(kvpq_cache_append(f, 0, 490, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(f, 0, 0, 490, b, NULL), KVPQ_OK);
        cr_assert(!memcmp(a, b, (size_t)490 * kvw * 4));
        kvpq_cache_free(c);
        kvpq_cache_free(f);
    }
    free(k), free(v), free(a), free(b), free(before);
}

Test(kivi, head_dim_must_be_multiple_of_32) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_KIVI2;
    p.head_dim = 48;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "head_dim 48"));
    cr_assert_null(c);
}

/* Issue 14 item 1: truncate, then append again. With W = 128: 300 + 100 positions (n_coded 256),
 * truncate to 300 (n_coded stays 256, above the rule's 160 for 300), append 100 other positions.
 * The append must start from the coded count truncate left, not recompute it from the length (that
 * re-quantized groups 160..255 from window slots the ring had reused: errors up to ~2 on values in
 * [-1, 1]). Every position then reads back exactly as a fresh cache fed the same 400 positions. */
Test(kivi, truncate_then_append_keeps_coded_groups) {
    const int hkv = 2, hd = 64, W = 128;
    const size_t kvw = (size_t)hkv * hd;
    float *k = rand_vec((size_t)500 * kvw, 21, 1.0f), *v = rand_vec((size_t)500 * kvw, 22, 1.0f);
    float *a = malloc((size_t)400 * kvw * 4), *b = malloc((size_t)400 * kvw * 4);
    float *av = malloc((size_t)400 * kvw * 4), *bv = malloc((size_t)400 * kvw * 4);
    for (int bits = 2; bits <= 4; bits += 2) {
        kvpq_cache *c = make_kivi(bits, hkv, hd, W, 256, 1024), *f = make_kivi(bits, hkv, hd, W, 256, 1024);
        cr_assert_eq(kvpq_cache_append(c, 0, 300, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(c, 0, 100, k + 400 * kvw, v + 400 * kvw), KVPQ_OK); /* 300..399: other data */
        cr_assert_eq(kvpq_cache_truncate(c, 300), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(c, 0, 100, k + 300 * kvw, v + 300 * kvw), KVPQ_OK);
        cr_assert_eq(kvpq_cache_append(f, 0, 400, k, v), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(c, 0, 0, 400, a, av), KVPQ_OK);
        cr_assert_eq(kvpq_cache_read(f, 0, 0, 400, b, bv), KVPQ_OK);
        for (size_t e = 0; e < (size_t)400 * kvw; e++) {
            cr_assert_eq(a[e], b[e], "kivi%d: key of position %zu: %g, fresh cache %g", bits, e / kvw, a[e], b[e]);
            cr_assert_eq(av[e], bv[e], "kivi%d: value of position %zu: %g, fresh cache %g", bits, e / kvw, av[e],
                         bv[e]);
        }
        kvpq_cache_stats st;
        kvpq_cache_get_stats(c, &st);
        cr_assert_eq(st.tokens_coded, n_coded(400, W));
        kvpq_cache_free(c);
        kvpq_cache_free(f);
    }
    free(k), free(v), free(a), free(b), free(av), free(bv);
}
