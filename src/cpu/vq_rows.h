/* vq_rows.h — the row kernels of decoding keys coded before RoPE (vq_kernels.h: gather_u8,
 * affine_rows, rope_steps), plain C included by vq_kernels.c (the _ref level, baseline ISA) and by
 * vq_avx2.c / vq_avx512.c (compiled for their ISA, where the compiler vectorizes the loops). Those
 * files are compiled with -ffp-contract=off (CMakeLists.txt; clang would otherwise fuse a * b + c
 * into an FMA even in ISO C mode), so every level does the same operations in the same order: the
 * results are bit-identical (tests/test_cache_vq.c). */
#ifndef KVPQ_VQ_ROWS_H
#define KVPQ_VQ_ROWS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The rows of one fixed dsub (a constant after inlining: whole-vector copies). */
static inline void vq_rows_gather_fixed(size_t n, int M, int dsub, size_t bstride, const float *cent,
                                        const uint8_t *codes, size_t stride, float *x) {
    for (size_t t = 0; t < n; t++) {
        const uint8_t *c = codes + t * stride;
        float *xr = x + t * (size_t)M * dsub;
        for (int m = 0; m < M; m++)
            memcpy(xr + (size_t)m * dsub, cent + m * bstride + (size_t)c[m] * dsub, (size_t)dsub * sizeof(float));
    }
}

static inline void vq_rows_gather_u8(size_t n, int M, int dsub, int n_books, int ksub, const float *cent,
                                     const uint8_t *codes, size_t stride, int add, float *x) {
    const size_t bstride = n_books == 1 ? 0 : (size_t)ksub * dsub; /* between sub-spaces' books */
    if (!add && (dsub == 2 || dsub == 4 || dsub == 8)) {
        if (dsub == 4) vq_rows_gather_fixed(n, M, 4, bstride, cent, codes, stride, x);
        else if (dsub == 2) vq_rows_gather_fixed(n, M, 2, bstride, cent, codes, stride, x);
        else vq_rows_gather_fixed(n, M, 8, bstride, cent, codes, stride, x);
        return;
    }
    for (size_t t = 0; t < n; t++) {
        const uint8_t *c = codes + t * stride;
        float *xr = x + t * (size_t)M * dsub;
        for (int m = 0; m < M; m++) {
            const float *cm = cent + m * bstride + (size_t)c[m] * dsub;
            float *xm = xr + (size_t)m * dsub;
            for (int j = 0; j < dsub; j++) xm[j] = add ? xm[j] + cm[j] : cm[j];
        }
    }
}

static inline void vq_rows_affine(size_t n, int d, const float *a, const float *b, float *x) {
    for (size_t r = 0; r < n; r++) {
        float *xr = x + r * (size_t)d;
        for (int j = 0; j < d; j++) xr[j] = xr[j] * a[j] + b[j];
    }
}

static inline void vq_rows_rope_steps(size_t n, int n_head, int half, int neox, size_t pos_stride,
                                      size_t head_stride, double *cs, float *cf, float *x) {
    double *c = cs, *s = cs + half;
    const double *cw = cs + 2 * half, *sw = cs + 3 * half;
    float *sf = cf + half;
    for (size_t t = 0; t < n; t++) {
        for (int i = 0; i < half; i++) cf[i] = (float)c[i], sf[i] = (float)s[i];
        for (int h = 0; h < n_head; h++) {
            float *r = x + t * pos_stride + h * head_stride;
            if (neox)
                for (int i = 0; i < half; i++) {
                    const float x0 = r[i], x1 = r[i + half];
                    r[i] = x0 * cf[i] - x1 * sf[i];
                    r[i + half] = x0 * sf[i] + x1 * cf[i];
                }
            else
                for (int i = 0; i < half; i++) {
                    const float x0 = r[2 * i], x1 = r[2 * i + 1];
                    r[2 * i] = x0 * cf[i] - x1 * sf[i];
                    r[2 * i + 1] = x0 * sf[i] + x1 * cf[i];
                }
        }
        for (int i = 0; i < half; i++) {
            const double c1 = c[i] * cw[i] - s[i] * sw[i];
            s[i] = s[i] * cw[i] + c[i] * sw[i];
            c[i] = c1;
        }
    }
}

#endif
