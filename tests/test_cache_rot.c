/* test_cache_rot.c — the rotated llama.cpp kinds q8_0r / q4_0r against an fp64 reference:
 * rotate (an explicit fp64 Sylvester Walsh-Hadamard matrix, llama.cpp's block sizes: K by the largest
 * power of two dividing head_dim, V by 64), quantize the blocks (the plain q8_0 / q4_0 kinds, which
 * tests/python/test_cache_peer.py holds bit-exact with gguf), rotate back, attend; and that the
 * rotation itself leaves float attention unchanged. */
#include <criterion/criterion.h>
#include <string.h>

#include "cache_testutil.h"
#include "kvpq.h"

#define ATTN_RTOL 2e-5

/* llama.cpp's key block: 64, doubled while head_dim % (2 n) == 0 (src/llama-kv-cache.cpp). */
static int rot_k_of(int hd) {
    int r = 64;
    while (hd % (2 * r) == 0) r *= 2;
    return r;
}

/* H_n (n x n) fp64, Sylvester order, scaled by 1/sqrt(n) (llama.cpp's ggml_gen_hadamard). */
static double *hadamard_matrix(int n) {
    double *h = malloc((size_t)n * n * sizeof *h);
    h[0] = 1.0 / sqrt((double)n);
    for (int s = 1; s < n; s *= 2)
        for (int i = 0; i < s; i++)
            for (int j = 0; j < s; j++) {
                double v = h[(size_t)i * n + j];
                h[(size_t)(i + s) * n + j] = v;
                h[(size_t)i * n + j + s] = v;
                h[(size_t)(i + s) * n + j + s] = -v;
            }
    return h;
}

/* y = blockdiag(H_r) x for n_vec vectors of hd, in fp64. */
static void rotate_ref(const double *x, double *y, size_t n_vec, int hd, int r) {
    double *h = hadamard_matrix(r);
    for (size_t v = 0; v < n_vec; v++)
        for (int b = 0; b < hd; b += r)
            for (int i = 0; i < r; i++) {
                double s = 0;
                for (int j = 0; j < r; j++) s += h[(size_t)i * r + j] * x[v * hd + b + j];
                y[v * hd + b + i] = s;
            }
    free(h);
}

static kvpq_cache *make(kvpq_cache_type t, int n_head, int hkv, int hd, int max_seq) {
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = t, p.n_layer = 1, p.n_head = n_head, p.n_head_kv = hkv, p.head_dim = hd, p.max_seq = max_seq;
    p.page_tokens = 64;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_OK, "%s: %s", kvpq_cache_type_name(t), kvpq_last_error());
    return c;
}

/* Small integers: the Walsh-Hadamard sums are exact in float, and at head_dim 64 and 256 so is the
 * 1/sqrt(r) scale (1/8, 1/16), so the library's float32 rotation equals the fp64 one bit for bit
 * and both quantize the same vectors. At 128 (scale 1/sqrt(128)) it equals kvpq_hadamard's. */
static float *int_vec(size_t n, uint64_t seed, int amp) {
    float *x = malloc(n * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = (float)((int)(rng_next(&seed) % (2u * amp + 1)) - amp);
    return x;
}

static void check_kind(kvpq_cache_type rot, kvpq_cache_type plain, int n_head, int hkv, int hd, int L, int n_q,
                       uint64_t seed) {
    const size_t ne = (size_t)L * hkv * hd, nv = (size_t)L * hkv;
    const int rk = rot_k_of(hd), rv = 64;
    float *k = int_vec(ne, seed, 7), *v = int_vec(ne, seed + 1, 9);
    k[3] = 200.0f; /* an outlier channel value */
    float *q = rand_vec((size_t)n_q * n_head * hd, seed + 2, 0.05f);
    /* Reference: rotate in fp64, quantize with the plain kind, read back, rotate back in fp64. */
    double *xd = calloc(ne, sizeof *xd), *yd = calloc(ne, sizeof *yd);
    float *kr = malloc(ne * sizeof *kr), *vr = malloc(ne * sizeof *vr);
    for (size_t i = 0; i < ne; i++) xd[i] = k[i];
    rotate_ref(xd, yd, nv, hd, rk);
    for (size_t i = 0; i < ne; i++) kr[i] = (float)yd[i];
    for (size_t i = 0; i < ne; i++) xd[i] = v[i];
    rotate_ref(xd, yd, nv, hd, rv);
    for (size_t i = 0; i < ne; i++) vr[i] = (float)yd[i];
    if (hd == 128) { /* 1/sqrt(128) is not a float: quantize what the library's rotation gives */
        memcpy(kr, k, ne * sizeof *kr);
        memcpy(vr, v, ne * sizeof *vr);
        cr_assert_eq(kvpq_hadamard(kr, nv * (hd / rk), rk), KVPQ_OK);
        cr_assert_eq(kvpq_hadamard(vr, nv * (hd / rv), rv), KVPQ_OK);
    }
    kvpq_cache *cp = make(plain, n_head, hkv, hd, L);
    cr_assert_eq(kvpq_cache_append(cp, 0, L, kr, vr), KVPQ_OK, "%s", kvpq_last_error());
    float *dk = malloc(ne * sizeof *dk), *dv = malloc(ne * sizeof *dv);
    cr_assert_eq(kvpq_cache_read(cp, 0, 0, L, dk, dv), KVPQ_OK);
    double *refk = malloc(ne * sizeof *refk), *refv = malloc(ne * sizeof *refv);
    for (size_t i = 0; i < ne; i++) xd[i] = dk[i];
    rotate_ref(xd, refk, nv, hd, rk);
    for (size_t i = 0; i < ne; i++) xd[i] = dv[i];
    rotate_ref(xd, refv, nv, hd, rv);

    /* The rotated kind, appended in two pieces. */
    kvpq_cache *c = make(rot, n_head, hkv, hd, L);
    const int a = L / 3;
    cr_assert_eq(kvpq_cache_append(c, 0, a, k, v), KVPQ_OK, "%s", kvpq_last_error());
    cr_assert_eq(kvpq_cache_append(c, 0, L - a, k + (size_t)a * hkv * hd, v + (size_t)a * hkv * hd), KVPQ_OK);
    float *ok = malloc(ne * sizeof *ok), *ov = malloc(ne * sizeof *ov);
    cr_assert_eq(kvpq_cache_read(c, 0, 0, L, ok, ov), KVPQ_OK);
    double emax = 0, xmax = 0, err_rot = 0, err_plain = 0;
    for (size_t i = 0; i < ne; i++) {
        emax = fmax(emax, fmax(fabs(ok[i] - refk[i]), fabs(ov[i] - refv[i])));
        xmax = fmax(xmax, fmax(fabs(refk[i]), fabs(refv[i])));
    }
    const char *tn = kvpq_cache_type_name(rot);
    /* Only the float32 rotation back (sums of r products) separates the two. */
    cr_assert(emax <= 1e-5 * xmax, "%s hd %d: read-back differs from the fp64 reference by %.3g (max %.3g)", tn, hd,
              emax, xmax);
    /* Attention against fp64 attention over the reference K/V. */
    float *out = malloc((size_t)n_q * n_head * hd * sizeof *out);
    cr_assert_eq(kvpq_cache_attend(c, 0, n_q, q, out), KVPQ_OK, "%s", kvpq_last_error());
    for (size_t i = 0; i < ne; i++) dk[i] = (float)refk[i], dv[i] = (float)refv[i];
    double *ref = malloc((size_t)n_q * n_head * hd * sizeof *ref);
    ref_attend(L, n_q, n_head, hkv, hd, dk, dv, q, ref);
    double e = rel_err_f64(out, ref, (size_t)n_q * n_head * hd);
    cr_assert(e < ATTN_RTOL, "%s hd %d n_q %d: attention rel err %.3g vs fp64 reference", tn, hd, n_q, e);
    /* And the rotation pays: on these keys (an outlier, integer steps) the rotated kind's key error
     * is below the plain kind's. */
    kvpq_cache *cq = make(plain, n_head, hkv, hd, L);
    cr_assert_eq(kvpq_cache_append(cq, 0, L, k, v), KVPQ_OK);
    cr_assert_eq(kvpq_cache_read(cq, 0, 0, L, dk, NULL), KVPQ_OK);
    for (size_t i = 0; i < (size_t)hd; i++) { /* the head vector holding the outlier */
        err_rot += (ok[i] - k[i]) * (double)(ok[i] - k[i]);
        err_plain += (dk[i] - k[i]) * (double)(dk[i] - k[i]);
    }
    cr_assert(err_rot < err_plain, "%s hd %d: rotated key SSE %.4g not below plain %.4g", tn, hd, err_rot, err_plain);
    kvpq_cache_free(c), kvpq_cache_free(cp), kvpq_cache_free(cq);
    free(k), free(v), free(q), free(xd), free(yd), free(kr), free(vr), free(dk), free(dv), free(refk), free(refv);
    free(ok), free(ov), free(out), free(ref);
}

Test(cache_rot, matches_fp64_rotate_quantize_attend) {
    static const int shapes[][3] = {{9, 3, 64}, {12, 2, 128}, {4, 1, 256}}; /* SmolLM2, Qwen2.5-1.5B, Gemma-3 */
    for (int s = 0; s < 3; s++) {
        check_kind(KVPQ_CACHE_Q4_0R, KVPQ_CACHE_Q4_0, shapes[s][0], shapes[s][1], shapes[s][2], 150, 1, 10u + s);
        check_kind(KVPQ_CACHE_Q4_0R, KVPQ_CACHE_Q4_0, shapes[s][0], shapes[s][1], shapes[s][2], 150, 40, 20u + s);
        check_kind(KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q8_0, shapes[s][0], shapes[s][1], shapes[s][2], 150, 7, 30u + s);
    }
}

Test(cache_rot, library_hadamard_is_the_fp64_matrix) {
    for (int r = 64; r <= 256; r *= 4) { /* scales 1/8 and 1/16: exact in float */
        float *x = int_vec((size_t)r, 5u + r, 9);
        double *xd = malloc((size_t)r * sizeof *xd), *yd = malloc((size_t)r * sizeof *yd);
        for (int i = 0; i < r; i++) xd[i] = x[i];
        rotate_ref(xd, yd, 1, r, r);
        cr_assert_eq(kvpq_hadamard(x, 1, r), KVPQ_OK);
        for (int i = 0; i < r; i++) cr_assert_eq((double)x[i], yd[i], "r %d i %d: %g vs %g", r, i, x[i], yd[i]);
        free(x), free(xd), free(yd);
    }
}

Test(cache_rot, rotation_leaves_float_attention_unchanged) {
    /* fp32 attention over (H_k q, H_k k, H_v v), output rotated back by H_v, equals attention over
     * (q, k, v): what the rotated kinds rely on, here with no quantization in between. */
    const int n_head = 12, hkv = 2, hd = 128, L = 200, n_q = 5, rk = rot_k_of(hd);
    const size_t ne = (size_t)L * hkv * hd, nqe = (size_t)n_q * n_head * hd;
    float *k = rand_vec(ne, 1, 1.0f), *v = rand_vec(ne, 2, 1.0f), *q = rand_vec(nqe, 3, 1.0f);
    float *o1 = malloc(nqe * sizeof *o1), *o2 = malloc(nqe * sizeof *o2);
    kvpq_cache *c1 = make(KVPQ_CACHE_FP32, n_head, hkv, hd, L), *c2 = make(KVPQ_CACHE_FP32, n_head, hkv, hd, L);
    cr_assert_eq(kvpq_cache_append(c1, 0, L, k, v), KVPQ_OK);
    cr_assert_eq(kvpq_cache_attend(c1, 0, n_q, q, o1), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(k, ne / rk, rk), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(v, ne / 64, 64), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(q, nqe / rk, rk), KVPQ_OK);
    cr_assert_eq(kvpq_cache_append(c2, 0, L, k, v), KVPQ_OK);
    cr_assert_eq(kvpq_cache_attend(c2, 0, n_q, q, o2), KVPQ_OK);
    cr_assert_eq(kvpq_hadamard(o2, nqe / 64, 64), KVPQ_OK);
    double num = 0, den = 0;
    for (size_t i = 0; i < nqe; i++) num = fmax(num, fabs(o1[i] - o2[i])), den = fmax(den, fabs(o1[i]));
    cr_assert(num / den < 1e-5, "rotated fp32 attention differs by %.3g (relative)", num / den);
    kvpq_cache_free(c1), kvpq_cache_free(c2);
    free(k), free(v), free(q), free(o1), free(o2);
}

Test(cache_rot, names_specs_and_head_dim_errors) {
    kvpq_cache_type t;
    cr_assert_eq(kvpq_cache_type_parse("q4_0r", &t, NULL), KVPQ_OK);
    cr_assert_eq(t, KVPQ_CACHE_Q4_0R);
    cr_assert_eq(kvpq_cache_type_parse("q8_0r", &t, NULL), KVPQ_OK);
    cr_assert_eq(t, KVPQ_CACHE_Q8_0R);
    cr_assert_str_eq(kvpq_cache_type_name(KVPQ_CACHE_Q4_0R), "q4_0r");
    cr_assert_str_eq(kvpq_cache_type_name(KVPQ_CACHE_Q8_0R), "q8_0r");
    cr_assert_eq((int)KVPQ_CACHE_Q8_0R, 7); /* enum values are stable */
    cr_assert_eq((int)KVPQ_CACHE_Q4_0R, 8);
    kvpq_cache_params p = kvpq_cache_params_default();
    p.type = KVPQ_CACHE_Q4_0R, p.n_head = 4, p.n_head_kv = 2, p.head_dim = 96, p.max_seq = 16;
    kvpq_cache *c = NULL;
    cr_assert_eq(kvpq_cache_new(&c, &p), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "multiple of 64"), "%s", kvpq_last_error());
    cr_assert_null(c);
}

/* The rotated kinds reported stored_bytes 0 (their ops table had no stats function): a previous
 * review's finding. Stored bytes are those of the plain kinds' blocks: q8_0 34 bytes per 32
 * elements (8.5 bits), q4_0 18 (4.5 bits), rotation or not. */
Test(cache_rot, stats_count_the_stored_blocks) {
    const kvpq_cache_type kinds[4] = {KVPQ_CACHE_Q8_0, KVPQ_CACHE_Q8_0R, KVPQ_CACHE_Q4_0, KVPQ_CACHE_Q4_0R};
    const size_t block_bytes[4] = {34, 34, 18, 18};
    enum { HKV = 2, HD = 64, N = 100 };
    float *k = rand_vec((size_t)N * HKV * HD, 3, 1.0f), *v = rand_vec((size_t)N * HKV * HD, 4, 1.0f);
    for (int i = 0; i < 4; i++) {
        kvpq_cache *c = make(kinds[i], 4, HKV, HD, 256);
        cr_assert_eq(kvpq_cache_append(c, 0, N, k, v), KVPQ_OK, "%s", kvpq_last_error());
        kvpq_cache_stats st;
        cr_assert_eq(kvpq_cache_get_stats(c, &st), KVPQ_OK);
        const size_t want = (size_t)2 * N * HKV * (HD / 32) * block_bytes[i];
        cr_assert_eq(st.stored_bytes, want, "%s: stored_bytes %zu, expected %zu", kvpq_cache_type_name(kinds[i]),
                     st.stored_bytes, want);
        cr_assert_float_eq(st.stored_bits_per_element, block_bytes[i] * 8.0 / 32.0, 1e-12, "%s",
                           kvpq_cache_type_name(kinds[i]));
        kvpq_cache_free(c);
    }
    free(k), free(v);
}
