/* test_ggml_types.c — GGML tensor types: sizes, fp16/bf16, dequantization of hand-built blocks with
 * known values, and every SIMD level's matvec / matmul / dequantize against the scalar _ref. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>
#include <omp.h>

#include "internal.h"
#include "cpu/dispatch.h"
#include "model/ggml_types.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) { /* xorshift64*: fresh but reproducible inputs */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 2685821657736338717ull) >> 32);
}
static float rndf(void) { return (float)rnd() / 4294967296.0f * 2.0f - 1.0f; } /* [-1, 1) */

static int quick(void) { return getenv("KVPQ_QUICK") && atoi(getenv("KVPQ_QUICK")); }

static void put_half(uint8_t *p, float v) {
    uint16_t h = kvpq_fp32_to_fp16(v);
    memcpy(p, &h, 2);
}

/* ---- sizes ---- */

Test(ggml_types, sizes_as_ggml) {
    struct { uint32_t t; int64_t blck; size_t size; int sup; const char *name; } want[] = {
        {GGML_TYPE_F32, 1, 4, 1, "F32"},    {GGML_TYPE_F16, 1, 2, 1, "F16"},    {GGML_TYPE_BF16, 1, 2, 1, "BF16"},
        {GGML_TYPE_Q4_0, 32, 18, 1, "Q4_0"}, {GGML_TYPE_Q4_1, 32, 20, 1, "Q4_1"}, {GGML_TYPE_Q5_0, 32, 22, 1, "Q5_0"},
        {GGML_TYPE_Q5_1, 32, 24, 1, "Q5_1"}, {GGML_TYPE_Q8_0, 32, 34, 1, "Q8_0"}, {GGML_TYPE_Q8_1, 32, 36, 0, "Q8_1"},
        {GGML_TYPE_Q2_K, 256, 84, 1, "Q2_K"}, {GGML_TYPE_Q3_K, 256, 110, 1, "Q3_K"}, {GGML_TYPE_Q4_K, 256, 144, 1, "Q4_K"},
        {GGML_TYPE_Q5_K, 256, 176, 1, "Q5_K"}, {GGML_TYPE_Q6_K, 256, 210, 1, "Q6_K"}, {GGML_TYPE_Q8_K, 256, 292, 0, "Q8_K"},
        {16, 256, 66, 0, "IQ2_XXS"},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        cr_assert_eq(ggml_blck_size(want[i].t), want[i].blck, "%s", want[i].name);
        cr_assert_eq(ggml_type_size(want[i].t), want[i].size, "%s", want[i].name);
        cr_assert_eq(ggml_type_supported(want[i].t), want[i].sup, "%s", want[i].name);
        cr_assert_str_eq(ggml_type_name(want[i].t), want[i].name);
    }
    cr_assert_eq(ggml_row_size(GGML_TYPE_Q4_1, 576), 18 * 20);
    cr_assert_eq(ggml_row_size(GGML_TYPE_Q8_0, 576), 18 * 34);
    cr_assert_eq(ggml_blck_size(4), 0); /* removed Q4_2 */
    cr_assert_eq(ggml_type_size(1000), 0);
    cr_assert_str_eq(ggml_type_name(1000), "type 1000");
}

/* ---- fp16 / bf16 ---- */

Test(ggml_types, fp16_known_values) {
    cr_assert_eq(kvpq_fp16_to_fp32(0x3c00), 1.0f);
    cr_assert_eq(kvpq_fp16_to_fp32(0xc000), -2.0f);
    cr_assert_eq(kvpq_fp16_to_fp32(0x7bff), 65504.0f);
    cr_assert_eq(kvpq_fp16_to_fp32(0x0001), 0x1p-24f); /* smallest subnormal */
    cr_assert_eq(kvpq_fp16_to_fp32(0x0400), 0x1p-14f); /* smallest normal */
    cr_assert(isinf(kvpq_fp16_to_fp32(0x7c00)) && kvpq_fp16_to_fp32(0xfc00) < 0);
    cr_assert(isnan(kvpq_fp16_to_fp32(0x7e00)));
    cr_assert(signbit(kvpq_fp16_to_fp32(0x8000)));
    cr_assert_eq(kvpq_fp32_to_fp16(1.0f), 0x3c00);
    cr_assert_eq(kvpq_fp32_to_fp16(65504.0f), 0x7bff);
    cr_assert_eq(kvpq_fp32_to_fp16(65519.0f), 0x7bff); /* below the halfway point to 2^16 */
    cr_assert_eq(kvpq_fp32_to_fp16(65520.0f), 0x7c00); /* halfway: ties to even = infinity */
    cr_assert_eq(kvpq_fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00); /* tie, to even (down) */
    cr_assert_eq(kvpq_fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02); /* tie, to even (up) */
    cr_assert_eq(kvpq_fp32_to_fp16(0x1p-25f), 0x0000);        /* tie between 0 and 2^-24: even = 0 */
    cr_assert_eq(kvpq_fp32_to_fp16(0x1.8p-25f), 0x0001);
    cr_assert_eq(kvpq_fp32_to_fp16(-0.0f), 0x8000);
    cr_assert_eq(kvpq_fp32_to_fp16(INFINITY), 0x7c00);
    uint16_t nan = kvpq_fp32_to_fp16(NAN);
    cr_assert(isnan(kvpq_fp16_to_fp32(nan)));
    cr_assert_eq(kvpq_bf16_to_fp32(0x3f80), 1.0f);
    cr_assert_eq(kvpq_bf16_to_fp32(0xc0a0), -5.0f);
}

Test(ggml_types, fp16_round_trips_every_half) {
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvpq_fp16_to_fp32((uint16_t)h);
        if (isnan(f)) continue;
        cr_assert_eq(kvpq_fp32_to_fp16(f), h, "half 0x%04x -> %g -> 0x%04x", h, f, kvpq_fp32_to_fp16(f));
    }
}

#if defined(__FLT16_MAX__)
/* The compiler's own conversion (_Float16, IEEE round-to-nearest-even) as the peer. */
Test(ggml_types, fp32_to_fp16_matches_the_compiler) {
    int iters = quick() ? 200000 : 2000000;
    for (int i = 0; i < iters; i++) {
        uint32_t bits = rnd();
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f)) continue;
        _Float16 h = (_Float16)f;
        uint16_t want;
        memcpy(&want, &h, 2);
        cr_assert_eq(kvpq_fp32_to_fp16(f), want, "%a: got 0x%04x want 0x%04x", f, kvpq_fp32_to_fp16(f), want);
        cr_assert_eq(kvpq_fp16_to_fp32(want), (float)h);
    }
}
#endif

/* ---- dequantization of hand-built blocks ---- */

Test(ggml_types, dequant_q4_0_block) {
    uint8_t blk[18];
    put_half(blk, 2.0f);
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    float y[32];
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q4_0, blk, y, 32), KVPQ_OK);
    for (int j = 0; j < 16; j++) {
        cr_assert_eq(y[j], (float)(j - 8) * 2.0f, "element %d", j);          /* low nibbles first */
        cr_assert_eq(y[j + 16], (float)(15 - j - 8) * 2.0f, "element %d", j + 16); /* then high nibbles */
    }
}

Test(ggml_types, dequant_q4_1_block) {
    uint8_t blk[20];
    put_half(blk, 0.5f);
    put_half(blk + 2, -3.0f);
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)(j | ((15 - j) << 4));
    float y[32];
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q4_1, blk, y, 32), KVPQ_OK);
    for (int j = 0; j < 16; j++) {
        cr_assert_eq(y[j], (float)j * 0.5f - 3.0f);
        cr_assert_eq(y[j + 16], (float)(15 - j) * 0.5f - 3.0f);
    }
}

Test(ggml_types, dequant_q4_1_is_correctly_rounded) {
    /* q*d is exact in float32 (4-bit q times an 11-bit fp16 mantissa), so ggml's d*q + m has one
     * rounding, of the sum: the result is the float nearest the exact value, computed in double. */
    uint8_t blk[20];
    uint16_t d = 0x3c01, m = 0x9401; /* d = 1 + 2^-10, m = -(2^-10 + 2^-20) */
    memcpy(blk, &d, 2);
    memcpy(blk + 2, &m, 2);
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t)(j | ((15 - j) << 4));
    float y[32];
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q4_1, blk, y, 32), KVPQ_OK);
    for (int j = 0; j < 32; j++) {
        int q = j < 16 ? j : 31 - j;
        float want = (float)((double)q * kvpq_fp16_to_fp32(d) + kvpq_fp16_to_fp32(m));
        cr_assert_eq(y[j], want, "element %d: %a vs %a", j, y[j], want);
    }
}

Test(ggml_types, dequant_q8_0_block) {
    uint8_t blk[34];
    put_half(blk, 0.25f);
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t)(int8_t)(j * 8 - 128);
    float y[32];
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q8_0, blk, y, 32), KVPQ_OK);
    for (int j = 0; j < 32; j++) cr_assert_eq(y[j], (float)(j * 8 - 128) * 0.25f);
}

Test(ggml_types, dequant_q5_blocks) {
    /* qh bit j is the 5th bit of element j: set bits for elements 1, 16, 31 only. */
    uint32_t qh = (1u << 1) | (1u << 16) | (1u << 31);
    uint8_t b0[22], b1[24];
    put_half(b0, 1.0f);
    memcpy(b0 + 2, &qh, 4);
    put_half(b1, 1.0f);
    put_half(b1 + 2, 100.0f);
    memcpy(b1 + 4, &qh, 4);
    for (int j = 0; j < 16; j++) b0[6 + j] = b1[8 + j] = (uint8_t)(3 | (5 << 4));
    float y0[32], y1[32];
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q5_0, b0, y0, 32), KVPQ_OK);
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q5_1, b1, y1, 32), KVPQ_OK);
    for (int j = 0; j < 32; j++) {
        int q = (j < 16 ? 3 : 5) + (((qh >> j) & 1) ? 16 : 0);
        cr_assert_eq(y0[j], (float)(q - 16), "Q5_0 element %d", j);
        cr_assert_eq(y1[j], (float)q + 100.0f, "Q5_1 element %d", j);
    }
}

/* ---- K-quants: blocks packed here from chosen quants and scales, following ggml's packing (the
 * encoder side, written independently of the decoder in model/kquants.c), then dequantized. The
 * expected value is computed in double (every product is exact, so rounding the double once equals
 * float32's one rounding of the final subtraction). ---- */

static int rndi(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); } /* [lo, hi] */

static float fp16_round(float v) { return kvpq_fp16_to_fp32(kvpq_fp32_to_fp16(v)); }

Test(ggml_types, dequant_q2_K_block) {
    for (int it = 0; it < 20; it++) {
        uint8_t blk[84] = {0};
        int q[256], sc[16], m[16];
        float d = fp16_round(0.01f * (1 + rndf())), dmin = fp16_round(0.003f * (1 + rndf()));
        for (int i = 0; i < 16; i++) sc[i] = rndi(0, 15), m[i] = rndi(0, 15), blk[i] = (uint8_t)(sc[i] | m[i] << 4);
        for (int e = 0; e < 256; e++) q[e] = rndi(0, 3);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int l = 0; l < 32; l++) blk[16 + 32 * h + l] |= (uint8_t)(q[128 * h + 32 * j + l] << (2 * j));
        put_half(blk + 80, d);
        put_half(blk + 82, dmin);
        float y[256];
        cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q2_K, blk, y, 256), KVPQ_OK);
        for (int e = 0; e < 256; e++) {
            float want = (float)((double)d * sc[e / 16] * q[e] - (double)dmin * m[e / 16]);
            cr_assert_eq(y[e], want, "Q2_K element %d: %a vs %a", e, y[e], want);
        }
    }
}

Test(ggml_types, dequant_q3_K_block) {
    for (int it = 0; it < 20; it++) {
        uint8_t blk[110] = {0};
        int q[256], sc[16];
        float d = fp16_round(0.01f * (1 + rndf()));
        for (int i = 0; i < 16; i++) {
            sc[i] = rndi(-32, 31);
            int ls = sc[i] + 32;
            blk[96 + (i % 8)] |= (uint8_t)((ls & 15) << (i < 8 ? 0 : 4));
            blk[96 + 8 + i % 4] |= (uint8_t)((ls >> 4) << (2 * (i / 4)));
        }
        for (int e = 0; e < 256; e++) {
            q[e] = rndi(-4, 3);
            int u = q[e] + 4; /* 0..7: low 2 bits in qs, bit 2 in hmask */
            blk[32 + 32 * (e / 128) + e % 32] |= (uint8_t)((u & 3) << (2 * ((e / 32) % 4)));
            if (u & 4) blk[e % 32] |= (uint8_t)(1u << (e / 32));
        }
        put_half(blk + 108, d);
        float y[256];
        cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q3_K, blk, y, 256), KVPQ_OK);
        for (int e = 0; e < 256; e++) {
            float want = (float)((double)d * sc[e / 16] * q[e]);
            cr_assert_eq(y[e], want, "Q3_K element %d: %a vs %a", e, y[e], want);
        }
    }
}

/* The 12 scale bytes of Q4_K / Q5_K from 8 scales and 8 mins of 6 bits. */
static void pack_k4_scales(uint8_t *s, const int *sc, const int *m) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            s[j] = (uint8_t)sc[j];
            s[j + 4] = (uint8_t)m[j];
        } else {
            s[j + 4] = (uint8_t)((sc[j] & 15) | (m[j] & 15) << 4);
            s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
            s[j] |= (uint8_t)((m[j] >> 4) << 6);
        }
    }
}

static void check_q45_K(int bits) {
    for (int it = 0; it < 20; it++) {
        uint8_t blk[176] = {0};
        int q[256], sc[8], m[8];
        float d = fp16_round(0.001f * (1 + rndf())), dmin = fp16_round(0.002f * (1 + rndf()));
        for (int j = 0; j < 8; j++) sc[j] = rndi(0, 63), m[j] = rndi(0, 63);
        put_half(blk, d);
        put_half(blk + 2, dmin);
        pack_k4_scales(blk + 4, sc, m);
        uint8_t *qh = blk + 16, *qs = bits == 5 ? blk + 48 : blk + 16;
        for (int e = 0; e < 256; e++) {
            q[e] = rndi(0, (1 << bits) - 1);
            qs[32 * (e / 64) + e % 32] |= (uint8_t)((q[e] & 15) << (4 * ((e / 32) % 2)));
            if (q[e] & 16) qh[e % 32] |= (uint8_t)(1u << (e / 32));
        }
        float y[256];
        uint32_t type = bits == 5 ? GGML_TYPE_Q5_K : GGML_TYPE_Q4_K;
        cr_assert_eq(ggml_dequantize_row_ref(type, blk, y, 256), KVPQ_OK);
        for (int e = 0; e < 256; e++) {
            float want = (float)((double)d * sc[e / 32] * q[e] - (double)dmin * m[e / 32]);
            cr_assert_eq(y[e], want, "Q%d_K element %d: %a vs %a", bits, e, y[e], want);
        }
    }
}

Test(ggml_types, dequant_q4_K_block) { check_q45_K(4); }
Test(ggml_types, dequant_q5_K_block) { check_q45_K(5); }

Test(ggml_types, dequant_q6_K_block) {
    for (int it = 0; it < 20; it++) {
        uint8_t blk[210] = {0};
        int q[256], sc[16];
        float d = fp16_round(0.0005f * (1 + rndf()));
        for (int i = 0; i < 16; i++) sc[i] = rndi(-128, 127), blk[192 + i] = (uint8_t)(int8_t)sc[i];
        for (int e = 0; e < 256; e++) q[e] = rndi(-32, 31);
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < 32; l++) {
                int u[4];
                for (int k = 0; k < 4; k++) u[k] = q[128 * h + 32 * k + l] + 32;
                blk[64 * h + l] = (uint8_t)((u[0] & 15) | (u[2] & 15) << 4);
                blk[64 * h + l + 32] = (uint8_t)((u[1] & 15) | (u[3] & 15) << 4);
                blk[128 + 32 * h + l] = (uint8_t)((u[0] >> 4) | (u[1] >> 4) << 2 | (u[2] >> 4) << 4 | (u[3] >> 4) << 6);
            }
        put_half(blk + 208, d);
        float y[256];
        cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_Q6_K, blk, y, 256), KVPQ_OK);
        for (int e = 0; e < 256; e++) {
            float want = (float)((double)d * sc[e / 16] * q[e]);
            cr_assert_eq(y[e], want, "Q6_K element %d: %a vs %a", e, y[e], want);
        }
    }
}

Test(ggml_types, dequant_f16_bf16_f32) {
    uint16_t h[3] = {0x3c00, 0xc000, 0x0001}, bf[2] = {0x3f80, 0x4049};
    float y[3], want_f32[3] = {1.5f, -0.0f, 1e30f};
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_F16, h, y, 3), KVPQ_OK);
    cr_assert(y[0] == 1.0f && y[1] == -2.0f && y[2] == 0x1p-24f);
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_BF16, bf, y, 2), KVPQ_OK);
    cr_assert(y[0] == 1.0f && y[1] == 3.140625f);
    cr_assert_eq(ggml_dequantize_row_ref(GGML_TYPE_F32, want_f32, y, 3), KVPQ_OK);
    cr_assert(!memcmp(y, want_f32, sizeof y));
}

Test(ggml_types, dequant_errors) {
    uint8_t blk[64] = {0};
    float y[64];
    cr_assert_eq(ggml_dequantize_row(GGML_TYPE_Q4_1, blk, y, 33), KVPQ_ERR_INVALID_ARG);
    cr_assert(strstr(kvpq_last_error(), "33"));
    cr_assert_eq(ggml_dequantize_row(16, blk, y, 256), KVPQ_ERR_UNSUPPORTED);
    cr_assert(strstr(kvpq_last_error(), "IQ2_XXS"), "%s", kvpq_last_error());
    cr_assert_eq(ggml_dequantize_row(GGML_TYPE_Q4_K, blk, y, 32), KVPQ_ERR_INVALID_ARG); /* not a multiple of 256 */
    cr_assert(strstr(kvpq_last_error(), "256"), "%s", kvpq_last_error());
    float x[32] = {0}, out[2];
    ggml_matvec(16, blk, 2, 32, x, out); /* unsupported: loud NaN, never plausible numbers */
    cr_assert(isnan(out[0]) && isnan(out[1]));
}

/* ---- SIMD vs _ref ---- */

static const uint32_t supported[] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16, GGML_TYPE_Q4_0,
                                     GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0,
                                     GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
                                     GGML_TYPE_Q6_K};

/* Byte offsets of a block's fp16 scale (d) and min scale (dmin; -1 if none), as core/ggml_common.h. */
static void scale_offsets(uint32_t type, int *d, int *dmin) {
    *d = 0;
    *dmin = type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 ? 2 : -1;
    switch (type) {
    case GGML_TYPE_Q2_K: *d = 80, *dmin = 82; break;
    case GGML_TYPE_Q3_K: *d = 108; break;
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K: *dmin = 2; break;
    case GGML_TYPE_Q6_K: *d = 208; break;
    }
}

/* Random rows of a type: block scales like a real model's (|d| ~ 1e-3..1e-1), random quants. */
static uint8_t *random_rows(uint32_t type, int64_t n_rows, int64_t n) {
    size_t rb = ggml_row_size(type, n), total = rb * (size_t)n_rows;
    uint8_t *w = malloc(total);
    for (size_t i = 0; i < total; i++) w[i] = (uint8_t)rnd();
    size_t bs = ggml_type_size(type);
    for (size_t r = 0; r < (size_t)n_rows; r++) {
        uint8_t *row = w + r * rb;
        if (type == GGML_TYPE_F32)
            for (int64_t i = 0; i < n; i++) {
                float v = rndf();
                memcpy(row + 4 * i, &v, 4);
            }
        else if (type == GGML_TYPE_F16)
            for (int64_t i = 0; i < n; i++) put_half(row + 2 * i, rndf());
        else if (type == GGML_TYPE_BF16)
            for (int64_t i = 0; i < n; i++) {
                float v = rndf();
                uint32_t b;
                memcpy(&b, &v, 4);
                uint16_t h = (uint16_t)(b >> 16);
                memcpy(row + 2 * i, &h, 2);
            }
        else
            for (size_t b = 0; b < rb / bs; b++) {
                int od, om;
                scale_offsets(type, &od, &om);
                /* K-quants multiply d by 4- to 8-bit sub-block scales: smaller d for like magnitudes */
                float k = ggml_blck_size(type) == 256 ? 0.02f : 1.0f;
                put_half(row + b * bs + od, k * (0.001f + 0.1f * fabsf(rndf())));
                if (om >= 0) put_half(row + b * bs + om, (type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 ? -0.5f : k * 0.3f) * fabsf(rndf()));
            }
    }
    return w;
}

/* |y - y_ref| <= TOL * sum_i |w_i x_i| + tiny: the SIMD versions only reorder a float32 sum (and
 * fold the Q4 offsets per block), so the error is a few ulps of the absolute sum. */
#define TOL 2e-6

static void check_close(const float *got, const float *want, const float *abs_sum, int64_t n, const char *what) {
    for (int64_t i = 0; i < n; i++)
        cr_assert(fabsf(got[i] - want[i]) <= TOL * abs_sum[i] + 1e-30f, "%s: y[%lld] = %.9g, ref %.9g (|sum| %.9g)",
                  what, (long long)i, got[i], want[i], abs_sum[i]);
}

static void abs_dot(uint32_t type, const uint8_t *w, int64_t n_rows, int64_t n, const float *x, float *out) {
    float *row = malloc((size_t)n * sizeof *row);
    size_t rb = ggml_row_size(type, n);
    for (int64_t r = 0; r < n_rows; r++) {
        ggml_dequantize_row_ref(type, w + (size_t)r * rb, row, n);
        double s = 0;
        for (int64_t i = 0; i < n; i++) s += fabs((double)row[i] * x[i]);
        out[r] = (float)s;
    }
    free(row);
}

Test(ggml_types, simd_matches_ref_at_every_level) {
    kvpq_simd_level best = kvpq_simd_get();
    int64_t shapes[][2] = {{1, 32}, {3, 64}, {17, 96}, {40, 576}, {33, 1536}, {5, 4096}};
    for (int lvl = 0; lvl <= (int)best; lvl++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lvl), KVPQ_OK);
        for (size_t ti = 0; ti < sizeof supported / sizeof supported[0]; ti++) {
            uint32_t type = supported[ti];
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                int64_t n_rows = shapes[si][0], n = shapes[si][1];
                if (ggml_blck_size(type) == 1 && si % 2) n += 7; /* odd lengths for the SIMD tails */
                if (ggml_blck_size(type) == 256) n = (n + 255) / 256 * 256;
                uint8_t *w = random_rows(type, n_rows, n);
                float *x = malloc((size_t)n * 4), *y = malloc((size_t)n_rows * 4), *yr = malloc((size_t)n_rows * 4),
                      *as = malloc((size_t)n_rows * 4);
                for (int64_t i = 0; i < n; i++) x[i] = rndf();
                char what[96];
                snprintf(what, sizeof what, "%s %s matvec (%lld x %lld)", kvpq_simd_name((kvpq_simd_level)lvl),
                         ggml_type_name(type), (long long)n_rows, (long long)n);
                ggml_matvec_ref(type, w, n_rows, n, x, yr);
                ggml_matvec(type, w, n_rows, n, x, y);
                abs_dot(type, w, n_rows, n, x, as);
                check_close(y, yr, as, n_rows, what);

                /* dequantization is bit-exact at every level */
                float *d0 = malloc((size_t)n * 4), *d1 = malloc((size_t)n * 4);
                cr_assert_eq(ggml_dequantize_row_ref(type, w, d0, n), KVPQ_OK);
                cr_assert_eq(ggml_dequantize_row(type, w, d1, n), KVPQ_OK);
                cr_assert(!memcmp(d0, d1, (size_t)n * 4), "%s: dequantize differs from _ref", what);
                free(d0);
                free(d1);
                free(w);
                free(x);
                free(y);
                free(yr);
                free(as);
            }
        }
    }
    kvpq_simd_set(best);
}

Test(ggml_types, matmul_matches_ref_at_every_level) {
    kvpq_simd_level best = kvpq_simd_get();
    /* token counts below and above the BLAS threshold; rows above one BLAS tile for n = 4096 */
    int64_t toks[] = {1, 2, 5, 8, 40};
    int64_t n_rows = quick() ? 70 : 300, n = 4096;
    for (int lvl = 0; lvl <= (int)best; lvl++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lvl), KVPQ_OK);
        for (size_t ti = 0; ti < sizeof supported / sizeof supported[0]; ti++) {
            uint32_t type = supported[ti];
            uint8_t *w = random_rows(type, n_rows, n);
            for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
                int64_t nt = toks[k];
                float *X = malloc((size_t)(nt * n) * 4), *Y = malloc((size_t)(nt * n_rows) * 4),
                      *Yr = malloc((size_t)(nt * n_rows) * 4), *as = malloc((size_t)n_rows * 4);
                for (int64_t i = 0; i < nt * n; i++) X[i] = rndf();
                ggml_matmul_ref(type, w, n_rows, n, nt, X, Yr);
                ggml_matmul(type, w, n_rows, n, nt, X, Y);
                for (int64_t t = 0; t < nt; t++) {
                    char what[96];
                    snprintf(what, sizeof what, "%s %s matmul n_tok %lld, token %lld",
                             kvpq_simd_name((kvpq_simd_level)lvl), ggml_type_name(type), (long long)nt, (long long)t);
                    abs_dot(type, w, n_rows, n, X + t * n, as);
                    check_close(Y + t * n_rows, Yr + t * n_rows, as, n_rows, what);
                }
                free(X);
                free(Y);
                free(Yr);
                free(as);
            }
            free(w);
        }
    }
    kvpq_simd_set(best);
}

/* ---- gated FFN activations (cpu/ggml_kernels.h kvpq__glu_*) ---- */

/* Every level's GELU-tanh and SiLU gate against the formulas in double: within 1e-6 of the value
 * plus 2e-7 |g u| (the _ref's libm tanhf form loses that much absolutely where 1 + tanh(y) cancels);
 * lengths around the vector widths; NaN stays NaN, +-large saturates, -0 and 0 give 0. */
Test(ggml_types, glu_kernels_at_every_level) {
    const kvpq_simd_level best = kvpq__simd_best();
    enum { N = 4099 };
    static float g0[N], u[N], g[N];
    for (int i = 0; i < N; i++) {
        g0[i] = 12.0f * rndf() * (i % 3 == 0 ? 0.1f : 1.0f);
        u[i] = 2.0f * rndf();
    }
    g0[0] = 0.0f, g0[1] = -0.0f, g0[2] = 90.0f, g0[3] = -90.0f, g0[4] = 1e-30f, g0[5] = NAN;
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        const kvpq_cpu_kernels *t = kvpq__cpu_kernels_for((kvpq_simd_level)lv);
        for (int kind = 0; kind < KVPQ_GLU_COUNT; kind++) {
            cr_assert(t->glu[kind], "level %d: glu %d missing", lv, kind);
            const int lens[] = {1, 7, 8, 15, 16, 17, 33, N};
            for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
                int n = lens[li];
                memcpy(g, g0, sizeof g);
                t->glu[kind](g, u, n);
                for (int i = 0; i < N; i++) {
                    if (i >= n) {
                        cr_assert(!memcmp(&g[i], &g0[i], 4), "level %d kind %d n %d: wrote past n at %d", lv, kind, n, i);
                        continue;
                    }
                    double x = g0[i], want;
                    if (kind == KVPQ_GLU_GELU_TANH)
                        want = 0.5 * x * (1.0 + tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))) * u[i];
                    else
                        want = x / (1.0 + exp(-x)) * u[i];
                    if (isnan(x)) {
                        cr_assert(isnan(g[i]), "level %d kind %d: NaN in, %g out", lv, kind, g[i]);
                        continue;
                    }
                    double tol = 1e-6 * fabs(want) + 2e-7 * fabs(x * u[i]) + 1e-37;
                    cr_assert(fabs(g[i] - want) <= tol, "level %d kind %d n %d: act(%.9g) * %.9g = %.9g, want %.9g",
                              lv, kind, n, x, u[i], g[i], want);
                }
            }
        }
    }
}

/* The BLAS path of ggml_matmul splits each tile's output columns over the OpenMP threads: with 1, 2, 3
 * and 7 threads (uneven shares, a thread with no column when 7 > the 6 rows of the last tile) every
 * output is written and every token's row is within TOL of the scalar reference. (Not bit-identical
 * across thread counts: OpenBLAS picks its kernel path by matrix size, so a narrower call may sum in
 * another order.) */
Test(ggml_types, matmul_blas_split_over_threads) {
    int saved = omp_get_max_threads(), saved_blas = openblas_get_num_threads();
    openblas_set_num_threads(1); /* as the CLI runs it: the sgemm is then split over the OpenMP threads */
    uint32_t types[] = {GGML_TYPE_Q8_0, GGML_TYPE_Q4_K};
    int64_t nt = 40, n = 256, n_rows = 4096 + 6; /* a 4096-row tile (1 Mi floats / 256) and one of 6 rows */
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        uint8_t *w = random_rows(types[ti], n_rows, n);
        float *X = malloc((size_t)(nt * n) * 4), *Y = malloc((size_t)(nt * n_rows) * 4),
              *Yr = malloc((size_t)(nt * n_rows) * 4), *as = malloc((size_t)n_rows * 4);
        cr_assert(w && X && Y && Yr && as);
        for (int64_t i = 0; i < nt * n; i++) X[i] = rndf();
        ggml_matmul_ref(types[ti], w, n_rows, n, nt, X, Yr);
        int threads[] = {1, 2, 3, 7};
        for (size_t k = 0; k < sizeof threads / sizeof threads[0]; k++) {
            omp_set_num_threads(threads[k]);
            for (int64_t i = 0; i < nt * n_rows; i++) Y[i] = NAN;
            ggml_matmul(types[ti], w, n_rows, n, nt, X, Y);
            for (int64_t t = 0; t < nt; t++) {
                char what[96];
                snprintf(what, sizeof what, "%s matmul at %d threads, token %lld", ggml_type_name(types[ti]),
                         threads[k], (long long)t);
                abs_dot(types[ti], w, n_rows, n, X + t * n, as);
                check_close(Y + t * n_rows, Yr + t * n_rows, as, n_rows, what);
            }
        }
        free(w);
        free(X);
        free(Y);
        free(Yr);
        free(as);
    }
    omp_set_num_threads(saved);
    openblas_set_num_threads(saved_blas);
}

/* ---- integer activations (ggml_matmul_q8) ---- */

static const uint32_t q8_types[] = {GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
                                    GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};

/* Every block: d = max |x| / 127, |x - d q| <= d / 2 (+ 1 ulp of x), |q| <= 127, the 16-sums and xs
 * as stated; an all-zero block is d = 0, q = 0; a block with a NaN or an Inf has d = NaN. */
Test(ggml_types, quantize_act_row) {
    const int64_t n = 160;
    float x[160];
    for (int64_t i = 0; i < n; i++) x[i] = rndf() * (i < 32 ? 1e-3f : 50.0f);
    for (int j = 64; j < 96; j++) x[j] = 0.0f;
    x[100] = NAN;
    x[130] = INFINITY;
    _Alignas(8) uint8_t buf[512];
    cr_assert(ggml_q8_row_bytes(n) <= sizeof buf);
    ggml_quantize_act_row(x, n, buf);
    kvpq__q8row r = ggml_q8_row_at(buf, n);
    for (int64_t b = 0; b < n / 32; b++) {
        if (b >= 3) {
            cr_assert(isnan(r.d[b]), "block %lld holds a NaN / Inf: d = %g", (long long)b, r.d[b]);
            continue;
        }
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        cr_assert_eq(r.d[b], amax / 127.0f, "block %lld: d %g, max/127 %g", (long long)b, r.d[b], amax / 127.0f);
        int s[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            int q = r.qs[32 * b + j];
            float v = x[32 * b + j];
            cr_assert(q >= -127 && q <= 127);
            cr_assert(fabsf(v - r.d[b] * (float)q) <= r.d[b] * 0.5f * (1 + 1e-6f) + 1e-7f * fabsf(v),
                      "x[%lld] = %g, d q = %g", (long long)(32 * b + j), v, r.d[b] * (float)q);
            s[j / 16] += q;
        }
        cr_assert_eq(r.s16[2 * b], s[0]);
        cr_assert_eq(r.s16[2 * b + 1], s[1]);
        cr_assert_eq(r.xs[b], r.d[b] * (float)(s[0] + s[1]));
        if (b == 2) cr_assert(r.d[b] == 0 && s[0] == 0 && s[1] == 0, "zero block");
    }
}

/* Every SIMD level's quantizer gives the scalar specification's bytes: scales from 1e-38 to 1e30,
 * rounding ties (max 127 makes d = 1 and x = k + 0.5 a tie, to even), zero and -0 blocks, NaN and
 * Inf blocks, a block whose largest |x| is negative. */
Test(ggml_types, quantize_act_row_levels_match_ref) {
    const int64_t n = 32 * 12;
    float x[32 * 12];
    const float scale[12] = {1e-38f, 1e-3f, 1.0f, 50.0f, 1e30f, 0.0f, -0.0f, 1.0f, 1.0f, 1.0f, 1.0f, 3.0f};
    for (int64_t i = 0; i < n; i++) x[i] = rndf() * scale[i / 32];
    for (int j = 0; j < 32; j++) x[7 * 32 + j] = (float)(j - 16) + 0.5f; /* ties */
    x[7 * 32] = 127.0f;
    x[8 * 32 + 5] = NAN;
    x[9 * 32 + 31] = INFINITY;
    x[10 * 32] = -INFINITY;
    x[11 * 32 + 3] = -400.0f;
    const size_t nb = ggml_q8_row_bytes(n);
    _Alignas(8) uint8_t want[2048], got[2048];
    cr_assert(nb <= sizeof want);
    memset(want, 0xAB, sizeof want);
    ggml_quantize_act_row_ref(x, n, want);
    const kvpq_simd_level best = kvpq_simd_get();
    for (int lvl = KVPQ_SIMD_SCALAR; lvl <= (int)best; lvl++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lvl), KVPQ_OK);
        memset(got, 0xAB, sizeof got);
        ggml_quantize_act_row(x, n, got);
        for (size_t i = 0; i < nb; i++)
            cr_assert_eq(got[i], want[i], "level %d: byte %zu of the quantized row: %d vs %d", lvl, i, got[i], want[i]);
    }
    kvpq_simd_set(best);
    kvpq__q8row r = ggml_q8_row_at(want, n);
    cr_assert(r.qs[7 * 32 + 1] == -14 && r.qs[7 * 32 + 2] == -14 && r.qs[7 * 32 + 3] == -12, "ties to even: %d %d %d",
              r.qs[7 * 32 + 1], r.qs[7 * 32 + 2], r.qs[7 * 32 + 3]);
    cr_assert(isnan(r.d[8]) && isnan(r.d[9]) && isnan(r.d[10]) && r.d[5] == 0 && !signbit(r.d[6]));
}

/* Row sums for the bounds: aq[r] = sum_j |w_j| |d_b q_j| (the scale of the kernel's float rounding)
 * and rnd[r] = sum_b (d_b / 2) sum_{j in b} |w_j| (the activation rounding: how far the q8 result
 * may be from the float32 one). */
static void q8_bounds(uint32_t type, const uint8_t *w, int64_t n_rows, int64_t n, const float *x, float *aq,
                      float *rnd_) {
    float *row = malloc((size_t)n * sizeof *row);
    uint8_t *qb = malloc(ggml_q8_row_bytes(n));
    ggml_quantize_act_row(x, n, qb);
    kvpq__q8row q = ggml_q8_row_at(qb, n);
    size_t rb = ggml_row_size(type, n);
    for (int64_t r = 0; r < n_rows; r++) {
        ggml_dequantize_row_ref(type, w + (size_t)r * rb, row, n);
        double s = 0, e = 0;
        for (int64_t i = 0; i < n; i++) {
            s += fabs((double)row[i] * q.d[i / 32] * q.qs[i]);
            e += fabs((double)row[i]) * q.d[i / 32] * 0.5;
        }
        aq[r] = (float)s;
        rnd_[r] = (float)e;
    }
    free(row);
    free(qb);
}

/* Y (nt, n_rows), an integer-activation product of X (nt, n) and w, against the _ref (the same math
 * in float: within 1e-5 of the absolute sum, from the weight scales' float rounding and the sum
 * order) and against the float32 path within the activation rounding bound. `what` names the kernel. */
static void q8_expect_bounds(const char *what, kvpq_simd_level lvl, uint32_t type, const uint8_t *w, int64_t n_rows,
                             int64_t n, int64_t nt, const float *X, const float *Y) {
    size_t ny = (size_t)(nt * n_rows) * 4;
    float *Yr = malloc(ny), *Yf = malloc(ny), *aq = malloc((size_t)n_rows * 4), *er = malloc((size_t)n_rows * 4);
    ggml_matmul_q8_ref(type, w, n_rows, n, nt, X, Yr);
    ggml_matmul_ref(type, w, n_rows, n, nt, X, Yf);
    for (int64_t t = 0; t < nt; t++) {
        q8_bounds(type, w, n_rows, n, X + t * n, aq, er);
        for (int64_t r = 0; r < n_rows; r++) {
            float y = Y[t * n_rows + r], yr = Yr[t * n_rows + r], yf = Yf[t * n_rows + r];
            cr_assert(fabsf(y - yr) <= 1e-5f * aq[r] + 1e-30f, "%s %s %s (%lld x %lld) n_tok %lld: y[%lld][%lld] = %.9g, "
                      "ref %.9g (|sum| %g)", kvpq_simd_name(lvl), ggml_type_name(type), what, (long long)n_rows,
                      (long long)n, (long long)nt, (long long)t, (long long)r, y, yr, aq[r]);
            cr_assert(fabsf(y - yf) <= er[r] * 1.0001f + 1e-5f * aq[r], "%s %s %s vs f32: y[%lld][%lld] = %.9g, f32 %.9g, "
                      "rounding bound %g", kvpq_simd_name(lvl), ggml_type_name(type), what, (long long)t, (long long)r, y,
                      yf, er[r]);
        }
    }
    free(Yr), free(Yf), free(aq), free(er);
}

/* The integer kernels of every level against the _ref (the same math in float: within 1e-5 of the
 * absolute sum, from the weight scales' float rounding and the sum order), and against the float32
 * path within the activation rounding bound; token counts 1 (decode), 2, 5 (a tile of 4 and one
 * left), 9; lengths of an odd and an even number of blocks. */
Test(ggml_types, q8_matmul_matches_ref_and_f32) {
    kvpq_simd_level best = kvpq_simd_get();
    int64_t shapes[][2] = {{1, 96}, {17, 576}, {33, 1536}};
    int64_t toks[] = {1, 2, 3, 5, 7, 9};
    for (int lvl = 0; lvl <= (int)best; lvl++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lvl), KVPQ_OK);
        for (size_t ti = 0; ti < sizeof q8_types / sizeof q8_types[0]; ti++) {
            uint32_t type = q8_types[ti];
            cr_assert(ggml_q8_supported(type));
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
                int64_t n_rows = shapes[si][0], n = shapes[si][1];
                if (ggml_blck_size(type) == 256) n = (n + 255) / 256 * 256;
                uint8_t *w = random_rows(type, n_rows, n);
                for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
                    int64_t nt = toks[k];
                    size_t ny = (size_t)(nt * n_rows) * 4;
                    float *X = malloc((size_t)(nt * n) * 4), *Y = malloc(ny), *Y1 = malloc((size_t)n_rows * 4);
                    for (int64_t i = 0; i < nt * n; i++) X[i] = rndf() * (i % 7 == 0 ? 4.0f : 1.0f);
                    cr_assert(ggml_matmul_q8(type, w, n_rows, n, nt, X, Y));
                    q8_expect_bounds("q8", (kvpq_simd_level)lvl, type, w, n_rows, n, nt, X, Y);
                    for (int64_t t = 0; t < nt; t++) {
                        /* the same bits as the token alone (kvpq_model_eval_batch relies on it) */
                        cr_assert(ggml_matmul_q8(type, w, n_rows, n, 1, X + t * n, Y1));
                        cr_assert(!memcmp(Y1, Y + t * n_rows, (size_t)n_rows * 4), "%s %s q8 n_tok %lld: token %lld "
                                  "differs from the token alone", kvpq_simd_name((kvpq_simd_level)lvl),
                                  ggml_type_name(type), (long long)nt, (long long)t);
                    }
                    free(X), free(Y), free(Y1);
                }
                free(w);
            }
        }
    }
    kvpq_simd_set(best);
    /* a NaN or an Inf in the activations: every product of that token is NaN (never finite) */
    for (size_t ti = 0; ti < sizeof q8_types / sizeof q8_types[0]; ti++) {
        uint8_t *w = random_rows(q8_types[ti], 3, 512);
        float X[2 * 512], Y[6];
        for (int i = 0; i < 2 * 512; i++) X[i] = rndf();
        X[512 + 300] = ti % 2 ? NAN : INFINITY;
        cr_assert(ggml_matmul_q8(q8_types[ti], w, 3, 512, 2, X, Y));
        for (int r = 0; r < 3; r++)
            cr_assert(isfinite(Y[r]) && isnan(Y[3 + r]), "%s: token 0 row %d = %g, token 1 (non-finite x) = %g",
                      ggml_type_name(q8_types[ti]), r, Y[r], Y[3 + r]);
        free(w);
    }
    cr_assert(!ggml_q8_supported(GGML_TYPE_F16) && !ggml_q8_supported(GGML_TYPE_Q2_K));
    float x[32] = {0}, y[1];
    cr_assert(!ggml_matmul_q8(GGML_TYPE_F16, x, 1, 32, 1, x, y), "no integer kernel for F16: 0, the caller's f32");
}

/* The GEMM kernels (ggml_qgemm_multi) of every level that has them: against the _ref within 1e-5 of
 * the absolute sum and against float32 within the activation rounding bound (as the tile-of-4
 * kernels above); a token's result the same bits wherever it sits in a call (another token count,
 * another offset in the tiles of 12); rows not a multiple of 16 and the scalar level refused (0). */
static void qgemm_check(kvpq_simd_level lvl, uint32_t type, int64_t n_rows, int64_t n, int64_t nt) {
    uint8_t *w = random_rows(type, n_rows, n);
    size_t ny = (size_t)(nt * n_rows) * 4;
    float *X = malloc((size_t)(nt * n) * 4), *Y = malloc(ny), *Y2 = malloc(ny);
    for (int64_t i = 0; i < nt * n; i++) X[i] = rndf() * (i % 7 == 0 ? 4.0f : 1.0f);
    ggml_mat m = {type, w, n_rows, Y};
    cr_assert(ggml_qgemm_multi(&m, 1, n, nt, X), "%s %s: GEMM refused", kvpq_simd_name(lvl), ggml_type_name(type));
    q8_expect_bounds("GEMM", lvl, type, w, n_rows, n, nt, X, Y);
    const int64_t off = nt / 3; /* tokens off .. nt-1 alone: the same bits */
    m.Y = Y2;
    cr_assert(ggml_qgemm_multi(&m, 1, n, nt - off, X + off * n));
    cr_assert(!memcmp(Y2, Y + off * n_rows, (size_t)((nt - off) * n_rows) * 4), "%s %s GEMM: tokens %lld.. at another "
              "place in the tiles differ", kvpq_simd_name(lvl), ggml_type_name(type), (long long)off);
    free(w), free(X), free(Y), free(Y2);
}

Test(ggml_types, qgemm_matches_ref_and_f32_and_is_placement_free) {
    const kvpq_simd_level best = kvpq_simd_get();
    const int64_t shapes[][2] = {{16, 96}, {48, 1536}}, toks[] = {1, 13, 30};
    for (int lvl = 1; lvl <= (int)best; lvl++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lvl), KVPQ_OK);
        for (size_t ti = 0; ti < sizeof q8_types / sizeof q8_types[0]; ti++) {
            const uint32_t type = q8_types[ti];
            static const uint8_t zw[16 * 256]; /* 16 zero rows of one block (<= 210 bytes each) */
            float x[256] = {0}, y[16];
            ggml_mat m = {type, zw, 16, y};
            if (!ggml_qgemm_multi(&m, 1, ggml_blck_size(type), 1, x)) { /* only Q8_0 where maddubs would saturate */
                cr_assert(type == GGML_TYPE_Q8_0 && !(lvl == KVPQ_SIMD_AVX512 && kvpq__vnni_on()), "%s %s: no GEMM kernel",
                          kvpq_simd_name((kvpq_simd_level)lvl), ggml_type_name(type));
                continue;
            }
            for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
                for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
                    int64_t n = shapes[si][1];
                    if (ggml_blck_size(type) == 256) n = (n + 255) / 256 * 256;
                    qgemm_check((kvpq_simd_level)lvl, type, shapes[si][0], n, toks[k]);
                }
        }
    }
    static const uint8_t zw[17 * 20]; /* 17 zero Q4_1 rows of one block */
    float x[64] = {0}, y[64];
    ggml_mat odd = {GGML_TYPE_Q4_1, zw, 17, y};
    cr_assert(!ggml_qgemm_multi(&odd, 1, 32, 2, x), "17 rows: refused");
    cr_assert_eq(kvpq_simd_set(KVPQ_SIMD_SCALAR), KVPQ_OK);
    ggml_mat sc = {GGML_TYPE_Q4_1, zw, 16, y};
    cr_assert(!ggml_qgemm_multi(&sc, 1, 32, 2, x), "scalar level: refused");
    kvpq_simd_set(best);
}

/* Several matrices in one region (a layer's Q, K, V) give exactly one call each: the same kernels
 * on the same rows; types mixed as in a Q4_K_M file. The float32 form refuses (0) what it has no
 * kernel for, and the scalar level. */
Test(ggml_types, multi_matrix_regions_equal_one_call_each) {
    const int64_t n = 512, rows[3] = {100, 36, 36};
    const uint32_t types[3] = {GGML_TYPE_Q4_K, GGML_TYPE_Q4_1, GGML_TYPE_Q6_K};
    uint8_t *w[3];
    float *y1[3], *y2[3], x[3 * 512];
    for (int64_t i = 0; i < 3 * n; i++) x[i] = rndf();
    ggml_mat mats[3];
    for (int i = 0; i < 3; i++) {
        w[i] = random_rows(types[i], rows[i], n);
        y1[i] = malloc((size_t)(3 * rows[i]) * 4);
        y2[i] = malloc((size_t)(3 * rows[i]) * 4);
        mats[i] = (ggml_mat){types[i], w[i], rows[i], y2[i]};
    }
    for (int64_t nt = 1; nt <= 3; nt += 2) {
        cr_assert(ggml_matmul_q8_multi(mats, 3, n, nt, x));
        for (int i = 0; i < 3; i++) {
            cr_assert(ggml_matmul_q8(types[i], w[i], rows[i], n, nt, x, y1[i]));
            cr_assert(!memcmp(y1[i], y2[i], (size_t)(nt * rows[i]) * 4), "q8 multi, matrix %d, n_tok %lld", i,
                      (long long)nt);
        }
    }
    cr_assert(ggml_matvec_multi(mats, 3, n, x));
    for (int i = 0; i < 3; i++) {
        ggml_matvec(types[i], w[i], rows[i], n, x, y1[i]);
        cr_assert(!memcmp(y1[i], y2[i], (size_t)rows[i] * 4), "f32 multi, matrix %d", i);
    }
    ggml_mat q2 = {GGML_TYPE_Q2_K, w[0], 1, y2[0]};
    cr_assert(!ggml_matvec_multi(&q2, 1, n, x), "Q2_K has 16-element sums: refused");
    kvpq_simd_level best = kvpq_simd_get();
    kvpq_simd_set(KVPQ_SIMD_SCALAR);
    cr_assert(!ggml_matvec_multi(mats, 3, n, x), "scalar level: refused");
    kvpq_simd_set(best);
    for (int i = 0; i < 3; i++) {
        free(w[i]);
        free(y1[i]);
        free(y2[i]);
    }
}
