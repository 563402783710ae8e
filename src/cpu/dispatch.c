/* dispatch.c — the CPU kernel table and the scalar reference kernels (the specification). */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "cpu/dispatch.h"

// ---- codebook preparation ----------------------------------------------------------------------

void kvpq__nn_book_init(kvpq_nn_book *b, int dsub, int ksub, const float *C, float *ct, float *norms) {
    int kpad = kvpq__nn_kpad(ksub);
    for (int c = 0; c < kpad; c++) {
        float s = 0;
        for (int j = 0; j < dsub; j++) {
            float v = c < ksub ? C[(size_t)c * dsub + j] : 0.0f;
            ct[(size_t)j * kpad + c] = v;
            s += v * v;
        }
        norms[c] = c < ksub ? s : INFINITY;
    }
    b->dsub = dsub;
    b->ksub = ksub;
    b->kpad = kpad;
    b->ct = ct;
    b->norms = norms;
}

// ---- reference kernels -------------------------------------------------------------------------

void kvpq__nn_ref(const kvpq_nn_book *book, size_t n, const float *x, size_t x_stride, int32_t *idx,
                  size_t idx_stride) {
    const int dsub = book->dsub, ksub = book->ksub, kpad = book->kpad;
    for (size_t i = 0; i < n; i++) {
        const float *xi = x + i * x_stride;
        float m2x[16]; /* -2 x_j: exact, so fmaf(m2x, c, acc) = one rounding of acc - 2 x c */
        for (int j = 0; j < dsub; j++) m2x[j] = -2.0f * xi[j];
        float best = INFINITY;
        int32_t bi = 0;
        for (int c = 0; c < ksub; c++) {
            float acc = book->norms[c];
            for (int j = 0; j < dsub; j++) acc = fmaf(m2x[j], book->ct[(size_t)j * kpad + c], acc);
            if (acc < best) { /* strict: ties keep the lowest index; NaN never wins */
                best = acc;
                bi = c;
            }
        }
        idx[i * idx_stride] = bi;
    }
}

float kvpq__dot_f32_ref(const float *a, const float *b, int64_t n) {
    float s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void kvpq__glu_ref(kvpq_glu_kind kind, float *g, const float *u, int64_t n) {
    if (kind == KVPQ_GLU_GELU_TANH)
        for (int64_t i = 0; i < n; i++) {
            float x = g[i];
            g[i] = 0.5f * x * (1.0f + tanhf(0.7978845608f * x * (1.0f + 0.044715f * x * x))) * u[i];
        }
    else
        for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void glu_silu_ref(float *g, const float *u, int64_t n) { kvpq__glu_ref(KVPQ_GLU_SILU, g, u, n); }
static void glu_gelu_tanh_ref(float *g, const float *u, int64_t n) { kvpq__glu_ref(KVPQ_GLU_GELU_TANH, g, u, n); }

// ---- the table ---------------------------------------------------------------------------------

static kvpq_cpu_kernels tables[3];
static pthread_once_t tables_once = PTHREAD_ONCE_INIT;

static void fill_ref(kvpq_cpu_kernels *t) {
    t->level = KVPQ_SIMD_SCALAR;
    t->nn = kvpq__nn_ref;
    t->attn = &kvpq__attn_ref;
    kvpq__vq_kernels_ref(&t->vq);
    t->dot_f32 = kvpq__dot_f32_ref;
    t->glu[KVPQ_GLU_SILU] = glu_silu_ref;
    t->glu[KVPQ_GLU_GELU_TANH] = glu_gelu_tanh_ref;
    t->q8_act = NULL;
    for (int ty = 0; ty < KVPQ_GGML_TYPE_SLOTS; ty++) t->ggml_matvec[ty] = NULL, t->ggml_dequant[ty] = NULL, t->ggml_qmatmul[ty] = NULL, t->ggml_qgemm[ty] = NULL;
}

#if defined(__x86_64__)
/* Override with what one ISA's bodies have (ISA = avx2 or avx512). */
#define FILL_ISA(ISA, LEVEL)                                                                  \
    static void fill_##ISA(kvpq_cpu_kernels *t) {                                             \
        t->level = LEVEL;                                                                     \
        t->nn = kvpq__nn_##ISA;                                                               \
        t->attn = &kvpq__attn_##ISA;                                                          \
        kvpq__vq_kernels_##ISA(&t->vq);                                                       \
        t->dot_f32 = kvpq__dot_f32_##ISA;                                                     \
        t->q8_act = kvpq__q8act_##ISA();                                                      \
        for (int k = 0; k < KVPQ_GLU_COUNT; k++)                                              \
            if (kvpq__glu_##ISA((kvpq_glu_kind)k)) t->glu[k] = kvpq__glu_##ISA((kvpq_glu_kind)k); \
        for (uint32_t ty = 0; ty < KVPQ_GGML_TYPE_SLOTS; ty++) {                              \
            kvpq__matvec_fn mv = kvpq__ggml_matvec_##ISA(ty);                                 \
            kvpq__dequant_fn dq = kvpq__ggml_dequant_##ISA(ty);                               \
            if (mv) t->ggml_matvec[ty] = mv;                                                  \
            kvpq__qmatmul_fn qm = kvpq__ggml_qmatmul_##ISA(ty);                               \
            if (dq) t->ggml_dequant[ty] = dq;                                                 \
            if (qm) t->ggml_qmatmul[ty] = qm;                                                 \
            kvpq__qgemm_fn qg = kvpq__ggml_qgemm_##ISA(ty);                                   \
            if (qg) t->ggml_qgemm[ty] = qg;                                                   \
        }                                                                                     \
    }
FILL_ISA(avx2, KVPQ_SIMD_AVX2)
FILL_ISA(avx512, KVPQ_SIMD_AVX512)
#endif

int kvpq__vnni_on(void) {
#if defined(__x86_64__)
    const char *e = getenv("KVPQ_VNNI");
    return __builtin_cpu_supports("avx512vnni") && !(e && !strcmp(e, "0"));
#else
    return 0;
#endif
}

static void tables_init(void) {
    fill_ref(&tables[KVPQ_SIMD_SCALAR]);
    tables[KVPQ_SIMD_AVX2] = tables[KVPQ_SIMD_SCALAR];
    tables[KVPQ_SIMD_AVX512] = tables[KVPQ_SIMD_SCALAR];
#if defined(__x86_64__)
    fill_avx2(&tables[KVPQ_SIMD_AVX2]);
    tables[KVPQ_SIMD_AVX512] = tables[KVPQ_SIMD_AVX2];
    fill_avx512(&tables[KVPQ_SIMD_AVX512]);
    __builtin_cpu_init();
    if (kvpq__vnni_on()) /* vpdpbusd for the integer-activation kernels */
        for (uint32_t ty = 0; ty < KVPQ_GGML_TYPE_SLOTS; ty++) {
            kvpq__qmatmul_fn qm = kvpq__ggml_qmatmul_avx512vnni(ty);
            if (qm) tables[KVPQ_SIMD_AVX512].ggml_qmatmul[ty] = qm;
            kvpq__qgemm_fn qg = kvpq__ggml_qgemm_avx512vnni(ty);
            if (qg) tables[KVPQ_SIMD_AVX512].ggml_qgemm[ty] = qg;
        }
#endif
}

const kvpq_cpu_kernels *kvpq__cpu_kernels_for(kvpq_simd_level level) {
    pthread_once(&tables_once, tables_init);
    int l = (int)level, best = (int)kvpq__simd_best();
    if (l < KVPQ_SIMD_SCALAR) l = KVPQ_SIMD_SCALAR;
    if (l > best) l = best; /* never a level the CPU lacks */
    return &tables[l];
}

/* The hot lookup (callers take it per call): kvpq_simd_get() never exceeds the CPU's level. */
const kvpq_cpu_kernels *kvpq__cpu_kernels(void) {
    pthread_once(&tables_once, tables_init);
    return &tables[kvpq_simd_get()];
}
