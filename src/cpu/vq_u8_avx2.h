/* vq_u8_avx2.h — vq_avx2.c's nbits = 8 table kernels for one row width, written once. vq_avx2.c
 * includes it twice: VQ_GP 4 (a row is one __m128) and VQ_GP 8 (one __m256); each inclusion
 * defines score_u8_gGP, accum_u8_gGP (sub-spaces in L1-sized groups) and score_u8_off_gGP,
 * accum_u8_off_gGP (precomputed row offsets), then undefines its macros. The order of the
 * additions is the same at both widths, so each kernel gives what its former hand-written twin gave.
 * Needs VQ_MG, VQ_OB and make_offsets from vq_avx2.c. */
#if VQ_GP == 4
#define RV __m128
#define RV_LOAD _mm_loadu_ps
#define RV_STORE _mm_storeu_ps
#define RV_ADD _mm_add_ps
#define VQ_LG 2 /* log2(VQ_GP) */
#elif VQ_GP == 8
#define RV __m256
#define RV_LOAD _mm256_loadu_ps
#define RV_STORE _mm256_storeu_ps
#define RV_ADD _mm256_add_ps
#define VQ_LG 3
#else
#error "define VQ_GP as 4 or 8 before including vq_u8_avx2.h"
#endif
#define VQ_G__(name, gp) name##_g##gp
#define VQ_G_(name, gp) VQ_G__(name, gp)
#define VQ_G(name) VQ_G_(name, VQ_GP)
/* Sub-spaces per pass of the offset kernels: their table slices (256 rows of VQ_GP floats each,
 * 32 KiB in all) still fit L1 with the scores. */
#define VQ_PASS (32 / VQ_GP)

// ---- sub-spaces in groups of VQ_MG that stay in L1 ----------------------------------------------

static void VQ_G(score_u8)(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    const size_t ms = (size_t)ksub * VQ_GP;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        const float *L0 = lut + m0 * ms, *L1 = L0 + ms, *L2 = L1 + ms, *L3 = L2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            RV a = RV_ADD(RV_LOAD(L0 + (size_t)(w & 0xff) * VQ_GP), RV_LOAD(L1 + (size_t)(w >> 8 & 0xff) * VQ_GP));
            RV b = RV_ADD(RV_LOAD(L2 + (size_t)(w >> 16 & 0xff) * VQ_GP), RV_LOAD(L3 + (size_t)(w >> 24) * VQ_GP));
            a = RV_ADD(a, b);
            if (m0) a = RV_ADD(a, RV_LOAD(s + (size_t)t * VQ_GP));
            RV_STORE(s + (size_t)t * VQ_GP, a);
        }
    }
    for (; m0 < M; m0++) {
        const float *L0 = lut + m0 * ms;
        for (int t = 0; t < n; t++) {
            RV a = RV_LOAD(L0 + (size_t)codes[(size_t)t * M + m0] * VQ_GP);
            if (m0) a = RV_ADD(a, RV_LOAD(s + (size_t)t * VQ_GP));
            RV_STORE(s + (size_t)t * VQ_GP, a);
        }
    }
}

/* row += pv */
#define RV_ACC(row, pv) RV_STORE(row, RV_ADD(RV_LOAD(row), pv))

static void VQ_G(accum_u8)(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    const size_t ms = (size_t)ksub * VQ_GP;
    int m0 = 0;
    for (; m0 + VQ_MG <= M; m0 += VQ_MG) {
        float *T0 = table + m0 * ms, *T1 = T0 + ms, *T2 = T1 + ms, *T3 = T2 + ms;
        for (int t = 0; t < n; t++) {
            uint32_t w;
            memcpy(&w, codes + (size_t)t * M + m0, 4);
            const RV pv = RV_LOAD(p + (size_t)t * VQ_GP);
            RV_ACC(T0 + (size_t)(w & 0xff) * VQ_GP, pv);
            RV_ACC(T1 + (size_t)(w >> 8 & 0xff) * VQ_GP, pv);
            RV_ACC(T2 + (size_t)(w >> 16 & 0xff) * VQ_GP, pv);
            RV_ACC(T3 + (size_t)(w >> 24) * VQ_GP, pv);
        }
    }
    for (; m0 < M; m0++) {
        float *T0 = table + m0 * ms;
        for (int t = 0; t < n; t++) RV_ACC(T0 + (size_t)codes[(size_t)t * M + m0] * VQ_GP, RV_LOAD(p + (size_t)t * VQ_GP));
    }
}

// ---- precomputed row offsets ----------------------------------------------------------------------

static void VQ_G(score_u8_off)(int n, int M, int ksub, const uint8_t *codes, const float *lut, float *s) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, VQ_LG, codes + (size_t)t0 * M, offs);
        float *sb = s + (size_t)t0 * VQ_GP;
        for (int m0 = 0; m0 < M; m0 += VQ_PASS)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                RV a = RV_ADD(RV_ADD(RV_LOAD(lut + o[0]), RV_LOAD(lut + o[1])),
                              RV_ADD(RV_LOAD(lut + o[2]), RV_LOAD(lut + o[3])));
                if (VQ_PASS == 8)
                    a = RV_ADD(a, RV_ADD(RV_ADD(RV_LOAD(lut + o[4]), RV_LOAD(lut + o[5])),
                                         RV_ADD(RV_LOAD(lut + o[6]), RV_LOAD(lut + o[7]))));
                if (m0) a = RV_ADD(a, RV_LOAD(sb + (size_t)t * VQ_GP));
                RV_STORE(sb + (size_t)t * VQ_GP, a);
            }
    }
}

static void VQ_G(accum_u8_off)(int n, int M, int ksub, const uint8_t *codes, const float *p, float *table) {
    uint16_t offs[VQ_OB * 64];
    for (int t0 = 0; t0 < n; t0 += VQ_OB) {
        const int nb = n - t0 < VQ_OB ? n - t0 : VQ_OB;
        make_offsets(nb, M, ksub, VQ_LG, codes + (size_t)t0 * M, offs);
        const float *pb = p + (size_t)t0 * VQ_GP;
        for (int m0 = 0; m0 < M; m0 += VQ_PASS)
            for (int t = 0; t < nb; t++) {
                const uint16_t *o = offs + (size_t)t * M + m0;
                const RV pv = RV_LOAD(pb + (size_t)t * VQ_GP);
                for (int u = 0; u < VQ_PASS; u++) RV_ACC(table + o[u], pv);
            }
    }
}

#undef RV
#undef RV_LOAD
#undef RV_STORE
#undef RV_ADD
#undef RV_ACC
#undef VQ_LG
#undef VQ_G__
#undef VQ_G_
#undef VQ_G
#undef VQ_PASS
#undef VQ_GP
