/* attn_body.h — the SIMD kernels of the cache attention paths (see attn_kernels.h), written once on
 * simd.h and compiled per ISA by attn_avx2.c and attn_avx512.c. attn_ref.c is the specification.
 * Every kernel takes any size: vector loops, then a masked tail (vf_load_n / vf_store_n) or the
 * scalar reference where a shape does not fit the width. */
#include <float.h>
#include <math.h>

#include "core/ggml_common.h"
#include "cpu/attn_kernels.h"
#include "cpu/ggml_kernels.h"
#include "cpu/simd.h"

#define W KVPQ_VW

/* S = Q K^T, four keys at a time: one reduction tree for four dot products instead of four. The keys
 * are float32 (LOAD = vf_load) or halves (vf_load_f16); rows of hd % W != 0 take the caller's tail. */
#define QK_BODY(T, LOAD)                                                                               \
    for (; t + 4 <= n; t += 4) {                                                                     \
        const T *k0 = K + (size_t)t * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;               \
        for (int r = 0; r < R; r++) {                                                                \
            const float *q = Q + (size_t)r * hd;                                                     \
            kvpq_vf a0 = vf_zero(), a1 = vf_zero(), a2 = vf_zero(), a3 = vf_zero();                  \
            for (int c = 0; c < hd; c += W) {                                                        \
                kvpq_vf qv = vf_load(q + c);                                                         \
                a0 = vf_fma(qv, LOAD(k0 + c), a0);                                                   \
                a1 = vf_fma(qv, LOAD(k1 + c), a1);                                                   \
                a2 = vf_fma(qv, LOAD(k2 + c), a2);                                                   \
                a3 = vf_fma(qv, LOAD(k3 + c), a3);                                                   \
            }                                                                                        \
            vf_reduce4(a0, a1, a2, a3, S + (size_t)r * lds + t);                                     \
        }                                                                                            \
    }

static void qk(const float *Q, int R, const float *K, int n, int hd, float *S, int lds) {
    int t = 0;
    if (hd % W == 0) QK_BODY(float, vf_load)
    for (; t < n; t++)
        for (int r = 0; r < R; r++) S[(size_t)r * lds + t] = vf_dot(Q + (size_t)r * hd, K + (size_t)t * hd, hd);
}

static void qk_f16(const float *Q, int R, const uint16_t *K, int n, int hd, float *S, int lds) {
    if (hd % W) {
        kvpq__attn_ref.qk_f16(Q, R, K, n, hd, S, lds);
        return;
    }
    int t = 0;
    QK_BODY(uint16_t, vf_load_f16)
    for (; t < n; t++)
        for (int r = 0; r < R; r++) {
            kvpq_vf a = vf_zero();
            for (int c = 0; c < hd; c += W) a = vf_fma(vf_load(Q + (size_t)r * hd + c), vf_load_f16(K + (size_t)t * hd + c), a);
            S[(size_t)r * lds + t] = vf_reduce_add(a);
        }
}

/* O[r] += sum_t p[t] V[t], columns in blocks of 4W held in registers across all t, then W-column
 * blocks, then a masked tail of < W columns. The value rows are float32 (LOAD = vf_load) or halves
 * (vf_load_f16; those need hd % W == 0, checked by the caller). */
#define PV_BODY(T, LOAD)                                                                                \
    for (int r = 0; r < R; r++) {                                                                     \
        const float *p = P + (size_t)r * ldp;                                                         \
        float *o = O + (size_t)r * hd;                                                                \
        int c = 0;                                                                                    \
        for (; c + 4 * W <= hd; c += 4 * W) {                                                         \
            kvpq_vf a0 = vf_load(o + c), a1 = vf_load(o + c + W);                                     \
            kvpq_vf a2 = vf_load(o + c + 2 * W), a3 = vf_load(o + c + 3 * W);                         \
            for (int t = 0; t < n; t++) {                                                             \
                const T *v = V + (size_t)t * hd + c;                                                  \
                kvpq_vf pt = vf_set1(p[t]);                                                           \
                a0 = vf_fma(pt, LOAD(v), a0);                                                         \
                a1 = vf_fma(pt, LOAD(v + W), a1);                                                     \
                a2 = vf_fma(pt, LOAD(v + 2 * W), a2);                                                 \
                a3 = vf_fma(pt, LOAD(v + 3 * W), a3);                                                 \
            }                                                                                         \
            vf_store(o + c, a0);                                                                      \
            vf_store(o + c + W, a1);                                                                  \
            vf_store(o + c + 2 * W, a2);                                                              \
            vf_store(o + c + 3 * W, a3);                                                              \
        }                                                                                             \
        for (; c + W <= hd; c += W) {                                                                 \
            kvpq_vf a0 = vf_load(o + c);                                                              \
            for (int t = 0; t < n; t++) a0 = vf_fma(vf_set1(p[t]), LOAD(V + (size_t)t * hd + c), a0); \
            vf_store(o + c, a0);                                                                      \
        }                                                                                             \
        PV_TAIL                                                                                       \
    }

static void pv(const float *P, int R, int ldp, const float *V, int n, int hd, float *O) {
#define PV_TAIL                                                                                       \
    if (c < hd) {                                                                                     \
        const int nl = hd - c;                                                                        \
        kvpq_vf a0 = vf_load_n(o + c, nl);                                                            \
        for (int t = 0; t < n; t++) a0 = vf_fma(vf_set1(p[t]), vf_load_n(V + (size_t)t * hd + c, nl), a0); \
        vf_store_n(o + c, a0, nl);                                                                    \
    }
    PV_BODY(float, vf_load)
#undef PV_TAIL
}

static void pv_f16(const float *P, int R, int ldp, const uint16_t *V, int n, int hd, float *O) {
    if (hd % W) {
        kvpq__attn_ref.pv_f16(P, R, ldp, V, n, hd, O);
        return;
    }
#define PV_TAIL
    PV_BODY(uint16_t, vf_load_f16)
#undef PV_TAIL
}

/* Rows in lanes (attn_kernels.h qk_t, pv_t, softmax_t). Tiles of 4 keys (qk_t) or 4 value columns
 * (pv_t) by RV vectors of rows held in registers: per step RV loads and 4 broadcasts feed 4 RV
 * FMAs, and no sum crosses lanes. RV = 4 with 32 registers, 2 with 16. R % W != 0: the reference. */
#define RV (W >= 16 ? 4 : 2)

/* The one tile both use: C[i][v] (+)= sum_s B[i bi + s bs] * A[s][v] for i < ni (ni <= 4), v < rv,
 * s < steps, A's rows lda floats apart, C's rows ldc apart; C starts at 0 or, load, at its contents. */
KVPQ_INLINE void lanes_tile(const float *A, int lda, const float *B, size_t bi, size_t bs, int steps, int ni,
                            float *C, int ldc, int rv, int load) {
    kvpq_vf acc[4][4];
    for (int i = 0; i < ni; i++)
        for (int v = 0; v < rv; v++) acc[i][v] = load ? vf_load(C + (size_t)i * ldc + v * W) : vf_zero();
    for (int s = 0; s < steps; s++) {
        kvpq_vf a[4];
        for (int v = 0; v < rv; v++) a[v] = vf_load(A + (size_t)s * lda + v * W);
        for (int i = 0; i < ni; i++) {
            const kvpq_vf x = vf_set1(B[i * bi + s * bs]);
            for (int v = 0; v < rv; v++) acc[i][v] = vf_fma(x, a[v], acc[i][v]);
        }
    }
    for (int i = 0; i < ni; i++)
        for (int v = 0; v < rv; v++) vf_store(C + (size_t)i * ldc + v * W, acc[i][v]);
}

/* Scores of a tile of nk keys: ST[i] = sum_c K[i][c] QT[c] (keys' rows hd apart). */
KVPQ_INLINE void qk_t_tile(const float *QT, int ldq, const float *K, int nk, int hd, float *ST, int lds, int rv) {
    lanes_tile(QT, ldq, K, (size_t)hd, 1, hd, nk, ST, lds, rv, 0);
}

/* Scores of rv vectors of rows (rv a constant where inlined) against all n keys. */
KVPQ_INLINE void qk_t_rows(const float *QT, int ldq, const float *K, int n, int hd, float *ST, int lds, int rv) {
    int t = 0;
    for (; t + 4 <= n; t += 4) qk_t_tile(QT, ldq, K + (size_t)t * hd, 4, hd, ST + (size_t)t * lds, lds, rv);
    for (; t < n; t++) qk_t_tile(QT, ldq, K + (size_t)t * hd, 1, hd, ST + (size_t)t * lds, lds, rv);
}

static void qk_t(const float *QT, int ldq, int R, const float *K, int n, int hd, float *ST, int lds) {
    if (R % W) {
        kvpq__attn_ref.qk_t(QT, ldq, R, K, n, hd, ST, lds);
        return;
    }
    int r = 0;
    for (; r + RV * W <= R; r += RV * W) qk_t_rows(QT + r, ldq, K, n, hd, ST + r, lds, RV);
    for (; r < R; r += W) qk_t_rows(QT + r, ldq, K, n, hd, ST + r, lds, 1);
}

/* Outputs of a tile of nc value columns: OT[i] += sum_t V[t][i] PT[t] (values' rows hd apart). */
KVPQ_INLINE void pv_t_tile(const float *PT, int ldp, const float *V, int n, int hd, int nc, float *OT, int ldo, int rv) {
    lanes_tile(PT, ldp, V, 1, (size_t)hd, n, nc, OT, ldo, rv, 1);
}

/* Outputs of rv vectors of rows (rv a constant where inlined), every value column. */
KVPQ_INLINE void pv_t_rows(const float *PT, int ldp, const float *V, int n, int hd, float *OT, int ldo, int rv) {
    int c = 0;
    for (; c + 4 <= hd; c += 4) pv_t_tile(PT, ldp, V + c, n, hd, 4, OT + (size_t)c * ldo, ldo, rv);
    for (; c < hd; c++) pv_t_tile(PT, ldp, V + c, n, hd, 1, OT + (size_t)c * ldo, ldo, rv);
}

static void pv_t(const float *PT, int ldp, int R, const float *V, int n, int hd, float *OT, int ldo) {
    if (R % W) {
        kvpq__attn_ref.pv_t(PT, ldp, R, V, n, hd, OT, ldo);
        return;
    }
    int r = 0;
    for (; r + RV * W <= R; r += RV * W) pv_t_rows(PT + r, ldp, V, n, hd, OT + r, ldo, RV);
    for (; r < R; r += W) pv_t_rows(PT + r, ldp, V, n, hd, OT + r, ldo, 1);
}

static void softmax_t(float *ST, int lds, int n, int R, float *m, float *d, float *OT, int ldo, int hd) {
    if (R % W) {
        kvpq__attn_ref.softmax_t(ST, lds, n, R, m, d, OT, ldo, hd);
        return;
    }
    const kvpq_vf lowest = vf_set1(-FLT_MAX);
    for (int r = 0; r < R; r += W) {
        const kvpq_vf mo = vf_load(m + r);
        kvpq_vf mx = mo;
        for (int t = 0; t < n; t++) mx = vf_max(mx, vf_load(ST + (size_t)t * lds + r));
        /* rows masked so far everywhere: exponents against 0, the weights blended to 0 */
        const kvpq_vf ms = vf_blend(mx, vf_zero(), vf_lt(mx, lowest));
        const kvpq_vf e = vf_blend(vf_exp(vf_sub(mo, ms)), vf_zero(), vf_lt(mo, lowest));
        kvpq_vf sum = vf_zero();
        for (int t = 0; t < n; t++) {
            float *x = ST + (size_t)t * lds + r;
            const kvpq_vf s = vf_load(x), w = vf_blend(vf_exp(vf_sub(s, ms)), vf_zero(), vf_lt(s, lowest));
            vf_store(x, w);
            sum = vf_add(sum, w);
        }
        vf_store(d + r, vf_fma(vf_load(d + r), e, sum));
        vf_store(m + r, mx);
        for (int c = 0; c < hd; c++) vf_store(OT + (size_t)c * ldo + r, vf_mul(vf_load(OT + (size_t)c * ldo + r), e));
    }
}
#undef RV

static float max_(const float *x, int n) {
    kvpq_vf vm = vf_set1(x[0]);
    int i = 0;
    for (; i + W <= n; i += W) vm = vf_max(vm, vf_load(x + i));
    float m = vf_reduce_max(vm);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static float exp_sum(float *x, int n, float m) {
    kvpq_vf vm = vf_set1(m), s = vf_zero();
    int i = 0;
    for (; i + W <= n; i += W) {
        kvpq_vf e = vf_exp(vf_sub(vf_load(x + i), vm));
        vf_store(x + i, e);
        s = vf_add(s, e);
    }
    if (i < n) { /* masked tail: the lanes past n add nothing */
        kvpq_vf e = vf_exp(vf_sub(vf_load_n(x + i, n - i), vm));
        vf_store_n(x + i, e, n - i);
        s = vf_add(s, vf_blend(vf_zero(), e, vm_first(n - i)));
    }
    return vf_reduce_add(s);
}

static void scale(float *x, int n, float s) {
    kvpq_vf vs = vf_set1(s);
    int i = 0;
    for (; i + W <= n; i += W) vf_store(x + i, vf_mul(vf_load(x + i), vs));
    if (i < n) vf_store_n(x + i, vf_mul(vf_load_n(x + i, n - i), vs), n - i);
}

static void f16_to_f32(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + W <= n; i += W) vf_store(dst + i, vf_load_f16(src + i));
    for (; i < n; i++) dst[i] = vs_h2f(src[i]);
}

static void f32_to_f16(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + W <= n; i += W) vf_store_f16(dst + i, vf_load(src + i));
    for (; i < n; i++) dst[i] = vs_f2h(src[i]);
}

/* ggml blocks (n elements of a type): the ISA's row dequantization of ggml_body.h (bit-exact); at
 * W = 1 (plain C, where the library has no ggml_body.h instance) the _ref's. */
static void dequant_ggml(uint32_t type, const void *blocks, int64_t n, float *x) {
#if KVPQ_VW == 1
    if (type == GGML_TYPE_Q8_0) kvpq__attn_ref.dequant_q8_0(blocks, (size_t)n / QK8_0, x);
    else kvpq__attn_ref.dequant_q4_0(blocks, (size_t)n / QK4_0, x);
#else
    KVPQ_ISA_FN(kvpq__ggml_dequant)(type)(blocks, x, n);
#endif
}

static void dequant_q8_0(const void *blocks, size_t n_blocks, float *x) {
    dequant_ggml(GGML_TYPE_Q8_0, blocks, (int64_t)n_blocks * QK8_0, x);
}

static void dequant_q4_0(const void *blocks, size_t n_blocks, float *x) {
    dequant_ggml(GGML_TYPE_Q4_0, blocks, (int64_t)n_blocks * QK4_0, x);
}

/* KIVI rows: x = code * scale + min with one FMA (scale, min per element or per 32 codes). */
static void dequant_bits(const unsigned char *codes, int bits, int n, const float *scl, const float *mn, float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        kvpq_vf f[32 / W];
        vf_load_codes32(codes, bits, f);
        for (int k = 0; k < 32 / W; k++) {
            const int o = c + k * W;
            vf_store(x + o, vf_fma(f[k], vf_load(scl + o), vf_load(mn + o)));
        }
    }
}

static void dequant_bits_g32(const unsigned char *codes, int bits, int n, const float *scale32, const float *min32,
                             float *x) {
    for (int c = 0; c < n; c += 32, codes += 4 * bits) {
        kvpq_vf f[32 / W];
        vf_load_codes32(codes, bits, f);
        const kvpq_vf sc = vf_set1(scale32[c / 32]), mn = vf_set1(min32[c / 32]);
        for (int k = 0; k < 32 / W; k++) vf_store(x + c + k * W, vf_fma(f[k], sc, mn));
    }
}

const kvpq_attn_kernels KVPQ_ISA_FN(kvpq__attn) = {
    .name = KVPQ_ISA_NAME,
    .qk = qk,
    .pv = pv,
    .qk_f16 = qk_f16,
    .pv_f16 = pv_f16,
    .qk_t = qk_t,
    .pv_t = pv_t,
    .softmax_t = softmax_t,
    .max = max_,
    .exp_sum = exp_sum,
    .scale = scale,
    .f16_to_f32 = f16_to_f32,
    .f32_to_f16 = f32_to_f16,
    .dequant_q8_0 = dequant_q8_0,
    .dequant_q4_0 = dequant_q4_0,
    .dequant_bits = dequant_bits,
    .dequant_bits_g32 = dequant_bits_g32,
};

#undef W
#undef PV_BODY
#undef QK_BODY
