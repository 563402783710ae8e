/* test_cpu_kernels.c — the one CPU kernel table (cpu/dispatch.h): built once under concurrent first
 * use, one complete table per level, each level overriding the one below it with its own kernels,
 * and KVPQ_SIMD / kvpq_simd_set selecting the table. Kernel results are the other tests' business
 * (test_attn_kernels, test_cache_vq, test_ggml_types, test_pq_encode run every level). */
#include <criterion/criterion.h>
#include <pthread.h>

#include "core/ggml_common.h"
#include "cpu/dispatch.h"

#define N_THREADS 8

static void *first_use(void *arg) {
    (void)arg;
    return (void *)kvpq__cpu_kernels_for(KVPQ_SIMD_SCALAR);
}

Test(cpu_kernels, first_use_from_many_threads_builds_one_table) {
    pthread_t th[N_THREADS];
    void *got[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) cr_assert_eq(pthread_create(&th[i], NULL, first_use, NULL), 0);
    for (int i = 0; i < N_THREADS; i++) cr_assert_eq(pthread_join(th[i], &got[i]), 0);
    const kvpq_cpu_kernels *t = kvpq__cpu_kernels_for(KVPQ_SIMD_SCALAR);
    for (int i = 0; i < N_THREADS; i++) cr_assert_eq(got[i], (void *)t, "thread %d saw another table", i);
    cr_assert_eq(t->nn, kvpq__nn_ref);
    cr_assert_eq(t->attn, &kvpq__attn_ref);
}

/* Every entry of every level is set; the scalar level is exactly the _ref kernels. */
Test(cpu_kernels, every_level_is_complete) {
    const kvpq_simd_level best = kvpq__simd_best();
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        const kvpq_cpu_kernels *t = kvpq__cpu_kernels_for((kvpq_simd_level)lv);
        cr_assert_eq((int)t->level, lv);
        cr_assert(t->nn && t->attn && t->dot_f32 && t->glu[KVPQ_GLU_SILU] && t->glu[KVPQ_GLU_GELU_TANH], "level %d", lv);
        const kvpq_vq_kernels *v = &t->vq;
        cr_assert(v->score_u8 && v->score_u16 && v->accum_u8 && v->accum_u16 && v->score_fs_u8 && v->softmax_step &&
                      v->exp_sum && v->lane_max && v->scale_rows && v->scale_tokens && v->lut_build && v->table_out &&
                      v->weighted_sum && v->dot_rows && v->f16_to_f32 && v->f32_to_f16,
                  "level %d: a vq kernel is missing", lv);
        cr_assert_eq(kvpq__vq_kernels((kvpq_simd_level)lv), v);
        cr_assert_eq(kvpq__attn_kernels_for((kvpq_simd_level)lv), t->attn);
    }
    const kvpq_cpu_kernels *s = kvpq__cpu_kernels_for(KVPQ_SIMD_SCALAR);
    cr_assert_eq(s->dot_f32, kvpq__dot_f32_ref);
    cr_assert_eq(s->vq.exp_sum, kvpq__vq_exp_sum_ref);
    for (int ty = 0; ty < KVPQ_GGML_TYPE_SLOTS; ty++)
        cr_assert(!s->ggml_matvec[ty] && !s->ggml_dequant[ty], "scalar ggml type %d: the _ref is the model's", ty);
    /* A level above the CPU's gives the CPU's best, never an instruction it lacks. */
    cr_assert_eq(kvpq__cpu_kernels_for((kvpq_simd_level)99), kvpq__cpu_kernels_for(best));
}

#if defined(__x86_64__)
/* Each SIMD level overrides the kernels its bodies have, and keeps the narrower level's elsewhere. */
Test(cpu_kernels, levels_override_from_ref_upward) {
    const kvpq_simd_level best = kvpq__simd_best();
    if (best < KVPQ_SIMD_AVX2) cr_skip_test("no AVX2 on this CPU");
    const kvpq_cpu_kernels *s = kvpq__cpu_kernels_for(KVPQ_SIMD_SCALAR), *a = kvpq__cpu_kernels_for(KVPQ_SIMD_AVX2);
    cr_assert_eq(a->nn, kvpq__nn_avx2);
    cr_assert_eq(a->attn, &kvpq__attn_avx2);
    cr_assert_eq(a->dot_f32, kvpq__dot_f32_avx2);
    cr_assert_eq(a->ggml_matvec[GGML_TYPE_Q4_1], kvpq__ggml_matvec_avx2(GGML_TYPE_Q4_1));
    cr_assert_eq(a->ggml_dequant[GGML_TYPE_Q8_0], kvpq__ggml_dequant_avx2(GGML_TYPE_Q8_0));
    cr_assert_eq(a->vq.score_fs_u8, s->vq.score_fs_u8, "AVX2 has no fast-scan kernel: the _ref stays");
    cr_assert_neq(a->vq.scale_tokens, s->vq.scale_tokens);
    cr_assert(a->vq.accum_dec_u8 && a->vq.accum_dec_ok(16, 4, 3), "AVX2 decodes values per token for GQA groups of 3");
    if (best < KVPQ_SIMD_AVX512) return;
    const kvpq_cpu_kernels *z = kvpq__cpu_kernels_for(KVPQ_SIMD_AVX512);
    cr_assert_eq(z->nn, kvpq__nn_avx512);
    cr_assert_eq(z->attn, &kvpq__attn_avx512);
    cr_assert_neq(z->vq.scale_tokens, s->vq.scale_tokens);
    cr_assert_eq(z->vq.score_u8 == a->vq.score_u8, 0, "AVX-512 has its own 16-lane scores");
}
#endif

Test(cpu_kernels, simd_set_selects_the_table) {
    const kvpq_simd_level best = kvpq__simd_best();
    for (int lv = KVPQ_SIMD_SCALAR; lv <= (int)best; lv++) {
        cr_assert_eq(kvpq_simd_set((kvpq_simd_level)lv), KVPQ_OK);
        cr_assert_eq(kvpq__cpu_kernels(), kvpq__cpu_kernels_for((kvpq_simd_level)lv));
        cr_assert_eq((int)kvpq__cpu_kernels()->level, lv);
    }
    if (best < KVPQ_SIMD_AVX512) cr_assert_eq(kvpq_simd_set(KVPQ_SIMD_AVX512), KVPQ_ERR_UNSUPPORTED);
}
