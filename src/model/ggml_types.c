/* ggml_types.c — GGML tensor types: sizes, fp16/bf16, dequantization (the scalar _ref is the
 * specification, bit-exact with ggml's dequantize_row_* and the PyPI gguf package), and the
 * matvec/matmul dispatcher over the per-ISA kernels of src/cpu/ggml_*.c. */
#if defined(__clang__)
/* Dequantization must round d*q and the + m separately, as ggml and numpy do: no FMA contraction. */
#pragma STDC FP_CONTRACT OFF
#endif
#include <cblas.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "cpu/dispatch.h"
#include "cpu/ggml_kernels.h"
#include "internal.h"
#include "model/ggml_types.h"

/* ---- type table (ggml.c type_traits: block size, bytes per block) ---- */

typedef struct {
    const char *name;
    int64_t blck;
    size_t size;
    int supported; /* kvpq dequantizes it */
} type_info;

static const type_info types[] = {
    [0] = {"F32", 1, 4, 1},        [1] = {"F16", 1, 2, 1},        [2] = {"Q4_0", 32, 18, 1},
    [3] = {"Q4_1", 32, 20, 1},     [6] = {"Q5_0", 32, 22, 1},     [7] = {"Q5_1", 32, 24, 1},
    [8] = {"Q8_0", 32, 34, 1},     [9] = {"Q8_1", 32, 36, 0},     [10] = {"Q2_K", 256, 84, 1},
    [11] = {"Q3_K", 256, 110, 1},  [12] = {"Q4_K", 256, 144, 1},  [13] = {"Q5_K", 256, 176, 1},
    [14] = {"Q6_K", 256, 210, 1},  [15] = {"Q8_K", 256, 292, 0},  [16] = {"IQ2_XXS", 256, 66, 0},
    [17] = {"IQ2_XS", 256, 74, 0}, [18] = {"IQ3_XXS", 256, 98, 0}, [19] = {"IQ1_S", 256, 50, 0},
    [20] = {"IQ4_NL", 32, 18, 0},  [21] = {"IQ3_S", 256, 110, 0}, [22] = {"IQ2_S", 256, 82, 0},
    [23] = {"IQ4_XS", 256, 136, 0}, [24] = {"I8", 1, 1, 0},       [25] = {"I16", 1, 2, 0},
    [26] = {"I32", 1, 4, 0},       [27] = {"I64", 1, 8, 0},       [28] = {"F64", 1, 8, 0},
    [29] = {"IQ1_M", 256, 56, 0},  [30] = {"BF16", 1, 2, 1},      [34] = {"TQ1_0", 256, 54, 0},
    [35] = {"TQ2_0", 256, 66, 0},  [39] = {"MXFP4", 32, 17, 0},
};
#define N_TYPES (sizeof types / sizeof types[0])

static const type_info *info(uint32_t t) { return t < N_TYPES && types[t].name ? &types[t] : NULL; }

const char *ggml_type_name(uint32_t type) {
    static _Thread_local char buf[24];
    const type_info *ti = info(type);
    if (ti) return ti->name;
    snprintf(buf, sizeof buf, "type %u", type);
    return buf;
}

int ggml_type_supported(uint32_t type) {
    const type_info *ti = info(type);
    return ti && ti->supported;
}

int64_t ggml_blck_size(uint32_t type) {
    const type_info *ti = info(type);
    return ti ? ti->blck : 0;
}

size_t ggml_type_size(uint32_t type) {
    const type_info *ti = info(type);
    return ti ? ti->size : 0;
}

size_t ggml_row_size(uint32_t type, int64_t n) {
    const type_info *ti = info(type);
    return ti ? (size_t)(n / ti->blck) * ti->size : 0;
}

/* ---- fp16 / bf16: the one scalar converter is core/fp16.h ---- */

float kvpq_fp16_to_fp32(uint16_t h) { return kvpq__h2f(h); }
uint16_t kvpq_fp32_to_fp16(float f) { return kvpq__f2h(f); }
float kvpq_bf16_to_fp32(uint16_t h) { return kvpq__bf2f(h); }

/* ---- dequantization (_ref) ---- */

/* Block layouts and the scalar block dequantization (bit-exact with ggml): core/ggml_common.h. */
#define DEQUANT_BLOCKS_REF(NAME, BLOCK, QK, FN)                         \
    static void NAME(const uint8_t *src, float *y, int64_t n) {        \
        for (int64_t b = 0; b < n / (QK); b++, src += sizeof(BLOCK), y += (QK)) FN(src, y); \
    }
DEQUANT_BLOCKS_REF(dequant_q4_0_ref, block_q4_0, QK4_0, kvpq__block_q4_0_ref)
DEQUANT_BLOCKS_REF(dequant_q4_1_ref, block_q4_1, QK4_1, kvpq__block_q4_1_ref)
DEQUANT_BLOCKS_REF(dequant_q5_0_ref, block_q5_0, QK5_0, kvpq__block_q5_0_ref)
DEQUANT_BLOCKS_REF(dequant_q5_1_ref, block_q5_1, QK5_1, kvpq__block_q5_1_ref)
DEQUANT_BLOCKS_REF(dequant_q8_0_ref, block_q8_0, QK8_0, kvpq__block_q8_0_ref)
DEQUANT_BLOCKS_REF(dequant_q2_K_ref, block_q2_K, QK_K, kvpq__block_q2_K_ref)
DEQUANT_BLOCKS_REF(dequant_q3_K_ref, block_q3_K, QK_K, kvpq__block_q3_K_ref)
DEQUANT_BLOCKS_REF(dequant_q4_K_ref, block_q4_K, QK_K, kvpq__block_q4_K_ref)
DEQUANT_BLOCKS_REF(dequant_q5_K_ref, block_q5_K, QK_K, kvpq__block_q5_K_ref)
DEQUANT_BLOCKS_REF(dequant_q6_K_ref, block_q6_K, QK_K, kvpq__block_q6_K_ref)

static void dequant_f32_ref(const uint8_t *src, float *y, int64_t n) { memcpy(y, src, (size_t)n * 4); }

static void dequant_f16_ref(const uint8_t *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kvpq__h2f_at(src + 2 * i);
}

static void dequant_bf16_ref(const uint8_t *src, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kvpq_bf16_to_fp32((uint16_t)(src[2 * i] | (src[2 * i + 1] << 8)));
}

static kvpq__dequant_fn dequant_ref(uint32_t type) {
    switch (type) {
    case GGML_TYPE_F32: return dequant_f32_ref;
    case GGML_TYPE_F16: return dequant_f16_ref;
    case GGML_TYPE_BF16: return dequant_bf16_ref;
    case GGML_TYPE_Q4_0: return dequant_q4_0_ref;
    case GGML_TYPE_Q4_1: return dequant_q4_1_ref;
    case GGML_TYPE_Q5_0: return dequant_q5_0_ref;
    case GGML_TYPE_Q5_1: return dequant_q5_1_ref;
    case GGML_TYPE_Q8_0: return dequant_q8_0_ref;
    case GGML_TYPE_Q2_K: return dequant_q2_K_ref;
    case GGML_TYPE_Q3_K: return dequant_q3_K_ref;
    case GGML_TYPE_Q4_K: return dequant_q4_K_ref;
    case GGML_TYPE_Q5_K: return dequant_q5_K_ref;
    case GGML_TYPE_Q6_K: return dequant_q6_K_ref;
    }
    return NULL;
}

/* The SIMD level's kernel from the one CPU kernel table (cpu/dispatch.h), else the _ref. */
static kvpq__dequant_fn dequant_best(uint32_t type) {
    kvpq__dequant_fn fn = type < KVPQ_GGML_TYPE_SLOTS ? kvpq__cpu_kernels()->ggml_dequant[type] : NULL;
    return fn ? fn : dequant_ref(type);
}

/* Run fn (NULL: a type kvpq cannot dequantize) over one row of n elements, n a multiple of the block. */
static kvpq_status dequant_checked(kvpq__dequant_fn fn, uint32_t type, const void *src, float *dst, int64_t n) {
    if (!fn) return kvpq__err(KVPQ_ERR_UNSUPPORTED, "tensor type %s: kvpq cannot dequantize it", ggml_type_name(type));
    if (n < 0 || n % ggml_blck_size(type))
        return kvpq__err(KVPQ_ERR_INVALID_ARG, "dequantize %s: n = %lld is not a multiple of the block size %lld",
                         ggml_type_name(type), (long long)n, (long long)ggml_blck_size(type));
    fn(src, dst, n);
    return KVPQ_OK;
}

kvpq_status ggml_dequantize_row_ref(uint32_t type, const void *src, float *dst, int64_t n) {
    return dequant_checked(dequant_ref(type), type, src, dst, n);
}

kvpq_status ggml_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n) {
    return dequant_checked(dequant_best(type), type, src, dst, n);
}

/* ---- matvec / matmul ---- */

/* Elements dequantized at a time by the generic path (a multiple of every block size). */
#define CHUNK 256

static void fill_nan(float *y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = NAN;
}

/* The specification: y[r] = sum_i w_ri x_i with w dequantized by the _ref, summed in order in float. */
void ggml_matvec_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, const float *x, float *y) {
    kvpq__dequant_fn dq = dequant_ref(type);
    if (!dq) {
        fill_nan(y, (size_t)n_rows);
        return;
    }
    size_t rb = ggml_row_size(type, n);
    float buf[CHUNK];
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = (const uint8_t *)W + (size_t)r * rb;
        float s = 0;
        for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
            int64_t len = n - i0 < CHUNK ? n - i0 : CHUNK;
            dq(row + ggml_row_size(type, i0), buf, len);
            for (int64_t i = 0; i < len; i++) s += buf[i] * x[i0 + i];
        }
        y[r] = s;
    }
}

void ggml_matmul_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X,
                     float *Y) {
    for (int64_t t = 0; t < n_tok; t++) {
        float *yt = malloc((size_t)n_rows * sizeof *yt);
        if (!yt) {
            fill_nan(Y + t * n_rows, (size_t)n_rows);
            continue;
        }
        ggml_matvec_ref(type, W, n_rows, n, X + t * n, yt);
        memcpy(Y + t * n_rows, yt, (size_t)n_rows * sizeof *yt);
        free(yt);
    }
}

static kvpq__dot_fn dot_best(void) { return kvpq__cpu_kernels()->dot_f32; }

static kvpq__matvec_fn matvec_kernel(uint32_t type) {
    return type < KVPQ_GGML_TYPE_SLOTS ? kvpq__cpu_kernels()->ggml_matvec[type] : NULL;
}

/* Generic rows: dequantize CHUNK elements at a time, then the ISA's dot. */
static void matvec_generic(kvpq__dequant_fn dq, kvpq__dot_fn dot, uint32_t type, const uint8_t *W, size_t rb,
                           int64_t n_rows, int64_t n, const float *x, float *y) {
    float buf[CHUNK];
    for (int64_t r = 0; r < n_rows; r++) {
        const uint8_t *row = W + (size_t)r * rb;
        float s = 0;
        for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
            int64_t len = n - i0 < CHUNK ? n - i0 : CHUNK;
            dq(row + ggml_row_size(type, i0), buf, len);
            s += dot(buf, x + i0, len);
        }
        y[r] = s;
    }
}

/* Rows per OpenMP work item: enough to amortize scheduling, few enough to balance 576-row matrices. */
#define ROWS_PER_TASK 16

void ggml_matvec(uint32_t type, const void *W, int64_t n_rows, int64_t n, const float *x, float *y) {
    kvpq__dequant_fn dq = dequant_best(type);
    if (!dq || n_rows <= 0) {
        if (n_rows > 0) fill_nan(y, (size_t)n_rows);
        return;
    }
    if (kvpq_simd_get() == KVPQ_SIMD_SCALAR) {
        /* Scalar level: the _ref itself, in parallel over rows. */
        size_t rb = ggml_row_size(type, n);
#pragma omp parallel for schedule(static) if (n_rows * n >= 65536)
        for (int64_t r0 = 0; r0 < n_rows; r0 += ROWS_PER_TASK) {
            int64_t nr = n_rows - r0 < ROWS_PER_TASK ? n_rows - r0 : ROWS_PER_TASK;
            ggml_matvec_ref(type, (const uint8_t *)W + (size_t)r0 * rb, nr, n, x, y + r0);
        }
        return;
    }
    size_t rb = ggml_row_size(type, n);
    kvpq__matvec_fn kern = matvec_kernel(type);
    kvpq__dot_fn dot = dot_best();
    /* Sums of x over each group of g elements for the kernels that add a block offset or min once
     * per group: g = 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K), 16 (Q2_K, whose sub-blocks are 16). */
    float xs_stack[1024], *xs = NULL;
    int g = type == GGML_TYPE_Q2_K ? 16 : 32;
    int64_t nb = n / g;
    if (kern && (type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_0 ||
                 type == GGML_TYPE_Q5_1 || type == GGML_TYPE_Q2_K ||
                 type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K)) {
        xs = nb <= 1024 ? xs_stack : malloc((size_t)nb * sizeof *xs);
        if (!xs) kern = NULL;
        else
            for (int64_t b = 0; b < nb; b++) {
                float s = 0;
                for (int j = 0; j < g; j++) s += x[b * g + j];
                xs[b] = s;
            }
    }
#pragma omp parallel for schedule(static) if (n_rows * n >= 65536)
    for (int64_t r0 = 0; r0 < n_rows; r0 += ROWS_PER_TASK) {
        int64_t nr = n_rows - r0 < ROWS_PER_TASK ? n_rows - r0 : ROWS_PER_TASK;
        const uint8_t *Wr = (const uint8_t *)W + (size_t)r0 * rb;
        if (kern)
            kern(Wr, rb, nr, n, x, xs, y + r0);
        else
            matvec_generic(dq, dot, type, Wr, rb, nr, n, x, y + r0);
    }
    if (xs && xs != xs_stack) free(xs);
}

/* Floats per dequantized tile of W (4 MiB: fits L2/L3 alongside the sgemm panels). */
#define MATMUL_TILE_FLOATS (1 << 20)

/* The matrices of ggml_matvec_multi: task k is matrix tasks[k].mat, rows r0 .. r0 + ROWS_PER_TASK. */
typedef struct {
    int mat;
    int64_t r0;
} row_task;

/* Row tasks of every matrix into tasks (room for all); returns their count. */
static int64_t row_tasks(const ggml_mat *mats, int n_mat, row_task *tasks) {
    int64_t k = 0;
    for (int i = 0; i < n_mat; i++)
        for (int64_t r0 = 0; r0 < mats[i].n_rows; r0 += ROWS_PER_TASK) tasks[k++] = (row_task){i, r0};
    return k;
}

int ggml_matvec_multi(const ggml_mat *mats, int n_mat, int64_t n, const float *x) {
    if (kvpq_simd_get() == KVPQ_SIMD_SCALAR || n_mat <= 0 || n % 32) return 0;
    int64_t n_tasks = 0, work = 0;
    for (int i = 0; i < n_mat; i++) {
        /* the SIMD kernels whose xs are 32-element sums (or unused): not Q2_K (16) */
        if (!matvec_kernel(mats[i].type) || mats[i].type == GGML_TYPE_Q2_K || mats[i].n_rows < 0) return 0;
        n_tasks += (mats[i].n_rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        work += mats[i].n_rows * n;
    }
    row_task stack[512], *tasks = n_tasks <= 512 ? stack : malloc((size_t)n_tasks * sizeof *tasks);
    float xs_stack[1024], *xs = n / 32 <= 1024 ? xs_stack : malloc((size_t)(n / 32) * sizeof *xs);
    if (!tasks || !xs) {
        if (tasks != stack) free(tasks);
        if (xs != xs_stack) free(xs);
        return 0;
    }
    for (int64_t b = 0; b < n / 32; b++) {
        float s = 0;
        for (int j = 0; j < 32; j++) s += x[b * 32 + j];
        xs[b] = s;
    }
    row_tasks(mats, n_mat, tasks);
#pragma omp parallel for schedule(static) if (work >= 65536)
    for (int64_t k = 0; k < n_tasks; k++) {
        const ggml_mat *m = &mats[tasks[k].mat];
        int64_t r0 = tasks[k].r0, nr = m->n_rows - r0 < ROWS_PER_TASK ? m->n_rows - r0 : ROWS_PER_TASK;
        size_t rb = ggml_row_size(m->type, n);
        matvec_kernel(m->type)((const uint8_t *)m->W + (size_t)r0 * rb, rb, nr, n, x, xs, m->Y + r0);
    }
    if (tasks != stack) free(tasks);
    if (xs != xs_stack) free(xs);
    return 1;
}

void ggml_matmul(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X, float *Y) {
    kvpq__dequant_fn dq = dequant_best(type);
    if (n_tok <= 0 || n_rows <= 0) return;
    if (!dq) {
        fill_nan(Y, (size_t)(n_tok * n_rows));
        return;
    }
    if (n_tok == 1) {
        ggml_matvec(type, W, n_rows, n, X, Y);
        return;
    }
    size_t rb = ggml_row_size(type, n);
    if (n_tok >= GGML_MATMUL_BLAS_MIN_TOK) {
        int64_t tile_rows = MATMUL_TILE_FLOATS / n;
        if (tile_rows < 16) tile_rows = 16;
        if (tile_rows > n_rows) tile_rows = n_rows;
        float *Wt = malloc((size_t)tile_rows * (size_t)n * sizeof *Wt);
        const int blas_single = openblas_get_num_threads() <= 1;
        if (Wt) {
            for (int64_t r0 = 0; r0 < n_rows; r0 += tile_rows) {
                int64_t nr = n_rows - r0 < tile_rows ? n_rows - r0 : tile_rows;
#pragma omp parallel for schedule(static)
                for (int64_t r = 0; r < nr; r++) dq((const uint8_t *)W + (size_t)(r0 + r) * rb, Wt + r * n, n);
                /* Y[:, r0:r0+nr] = X (n_tok, n) @ Wt^T (n, nr), the nr output columns split evenly over the
                 * OpenMP threads, one single-threaded sgemm each: the CLI runs OpenBLAS with one thread
                 * (OPENBLAS_NUM_THREADS=1, so its pool does not spin beside OpenMP's), and one sgemm call
                 * took 63% of Gemma-3-270M's prefill on one thread while the others waited. Where
                 * OpenBLAS has its own threads (a library or Python caller that did not set
                 * OPENBLAS_NUM_THREADS=1), one call on one thread uses them instead: splitting then would
                 * run OpenMP threads x OpenBLAS threads. */
#pragma omp parallel if (blas_single)
                {
                    int64_t nth = omp_get_num_threads(), th = omp_get_thread_num();
                    int64_t c0 = nr * th / nth, c1 = nr * (th + 1) / nth;
                    if (c1 > c0)
                        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)n_tok, (int)(c1 - c0), (int)n, 1.0f,
                                    X, (int)n, Wt + c0 * n, (int)n, 0.0f, Y + r0 + c0, (int)n_rows);
                }
            }
            free(Wt);
            return;
        }
        /* No memory for a tile: fall through to the row-at-a-time path (needs n floats per thread). */
    }
    kvpq__dot_fn dot = dot_best();
    int failed = 0;
#pragma omp parallel reduction(| : failed)
    {
        float *row = malloc((size_t)n * sizeof *row);
        if (!row) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < n_rows; r++) {
            if (!row) continue;
            dq((const uint8_t *)W + (size_t)r * rb, row, n);
            for (int64_t t = 0; t < n_tok; t++) Y[t * n_rows + r] = dot(row, X + t * n, n);
        }
        free(row);
    }
    if (failed) /* last resort without any allocation: one matvec per token */
        for (int64_t t = 0; t < n_tok; t++) ggml_matvec(type, W, n_rows, n, X + t * n, Y + t * n_rows);
}

/* ---- integer activations (8-bit activation blocks; cpu/ggml_kernels.h kvpq__q8row) ---- */

int ggml_q8_supported(uint32_t type) {
    switch (type) {
    case GGML_TYPE_Q4_0:
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q8_0:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K: return 1;
    }
    return 0;
}

size_t ggml_q8_row_bytes(int64_t n) {
    /* qs (n) int8, d (n/32) float, xs (n/32) float, s16 (n/16) int16 */
    return (size_t)n + (size_t)(n / 32) * 2 * sizeof(float) + (size_t)(n / 16) * sizeof(int16_t);
}

kvpq__q8row ggml_q8_row_at(void *buf, int64_t n) {
    uint8_t *p = buf;
    float *d = (float *)(void *)p, *xs = d + n / 32;
    int16_t *s16 = (int16_t *)(void *)(xs + n / 32);
    return (kvpq__q8row){(const int8_t *)(s16 + n / 16), d, s16, xs};
}

/* The specification of kvpq__q8act_fn (ggml_kernels.h). */
static void q8_act_ref(const float *x, int64_t n, int8_t *qs, float *d, int16_t *s16, float *xs) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0;
        int bad = 0;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(xb[j]);
            bad |= !(a <= FLT_MAX); /* NaN or Inf */
            amax = a > amax ? a : amax;
        }
        float db = bad ? NAN : amax / 127.0f, id = db > 0 ? 1.0f / db : 0.0f;
        const int div = id > FLT_MAX; /* d below 2^-128: 1 / d overflows, so x / d instead */
        int s[2] = {0, 0};
        for (int j = 0; j < 32; j++) {
            /* round to nearest even by the 1.5 * 2^23 trick (|x id| <= 127 + ulps), no libm call */
            int q = bad ? 0 : (int)(((div ? xb[j] / db : xb[j] * id) + 0x1.8p23f) - 0x1.8p23f);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            qs[32 * b + j] = (int8_t)q;
            s[j / 16] += q;
        }
        d[b] = db; /* NaN for a non-finite block: the products are NaN, never silently finite */
        s16[2 * b] = (int16_t)s[0];
        s16[2 * b + 1] = (int16_t)s[1];
        xs[b] = db * (float)(s[0] + s[1]);
    }
}

void ggml_quantize_act_row(const float *x, int64_t n, void *buf) {
    kvpq__q8row r = ggml_q8_row_at(buf, n);
    kvpq__q8act_fn fn = kvpq__cpu_kernels()->q8_act;
    (fn ? fn : q8_act_ref)(x, n, (int8_t *)r.qs, (float *)r.d, (int16_t *)r.s16, (float *)r.xs);
}

void ggml_quantize_act_row_ref(const float *x, int64_t n, void *buf) {
    kvpq__q8row r = ggml_q8_row_at(buf, n);
    q8_act_ref(x, n, (int8_t *)r.qs, (float *)r.d, (int16_t *)r.s16, (float *)r.xs);
}

/* The specification: Y[t, r] = sum_b d_b * sum_{j in b} w_j q_j, w dequantized by the _ref, each
 * block's sum and the sum over blocks in order in float. */
static void q8_row_ref(kvpq__dequant_fn dq, uint32_t type, const uint8_t *row, int64_t n, const kvpq__q8row *x,
                       float *y) {
    float buf[CHUNK], s = 0;
    for (int64_t i0 = 0; i0 < n; i0 += CHUNK) {
        int64_t len = n - i0 < CHUNK ? n - i0 : CHUNK;
        dq(row + ggml_row_size(type, i0), buf, len);
        for (int64_t b = 0; b < len / 32; b++) {
            float sb = 0;
            for (int j = 0; j < 32; j++) sb += buf[32 * b + j] * (float)x->qs[i0 + 32 * b + j];
            s += x->d[(i0 + 32 * b) / 32] * sb;
        }
    }
    *y = s;
}

void ggml_matmul_q8_ref(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X,
                        float *Y) {
    kvpq__dequant_fn dq = dequant_ref(type);
    void *buf = malloc(ggml_q8_row_bytes(n));
    if (!dq || !buf || n % 32) {
        free(buf);
        fill_nan(Y, (size_t)(n_tok * n_rows));
        return;
    }
    size_t rb = ggml_row_size(type, n);
    for (int64_t t = 0; t < n_tok; t++) {
        ggml_quantize_act_row(X + t * n, n, buf);
        kvpq__q8row x = ggml_q8_row_at(buf, n);
        for (int64_t r = 0; r < n_rows; r++) q8_row_ref(dq, type, (const uint8_t *)W + (size_t)r * rb, n, &x, Y + t * n_rows + r);
    }
    free(buf);
}

static kvpq__qmatmul_fn qmatmul_kernel(uint32_t type) {
    return type < KVPQ_GGML_TYPE_SLOTS ? kvpq__cpu_kernels()->ggml_qmatmul[type] : NULL;
}

/* One OpenMP region over every matrix's row tasks (tasks: their count, at most row_tasks_max). */
static void q8_run(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const kvpq__q8row *rows,
                   const row_task *tasks, int64_t n_tasks, int64_t work) {
    const kvpq_cpu_kernels *kt = kvpq__cpu_kernels();
    (void)n_mat;
#pragma omp parallel for schedule(static) if (work >= 65536)
    for (int64_t k = 0; k < n_tasks; k++) {
        const ggml_mat *m = &mats[tasks[k].mat];
        int64_t r0 = tasks[k].r0, nr = m->n_rows - r0 < ROWS_PER_TASK ? m->n_rows - r0 : ROWS_PER_TASK;
        size_t rb = ggml_row_size(m->type, n);
        kt->ggml_qmatmul[m->type]((const uint8_t *)m->W + (size_t)r0 * rb, rb, nr, n, rows, n_tok, m->Y + r0,
                                  m->n_rows);
    }
}

/* ---- the integer GEMM (kvpq__qgemm_fn, ggml_qgemm_multi) for prefill steps ---- */

/* 1 when every matrix has a GEMM kernel at this level and rows in whole 16-row tasks. */
_Static_assert(ROWS_PER_TASK == KVPQ_QG_ROWS, "a row task is one GEMM call");
static int qgemm_ok(const ggml_mat *mats, int n_mat) {
    const kvpq_cpu_kernels *kt = kvpq__cpu_kernels();
    for (int i = 0; i < n_mat; i++)
        if (mats[i].type >= KVPQ_GGML_TYPE_SLOTS || !kt->ggml_qgemm[mats[i].type] || mats[i].n_rows % ROWS_PER_TASK)
            return 0;
    return 1;
}

/* Token row t's quantized row r into its tile (kvpq__q8tiles' layout). */
static void q8_tile_put(kvpq__q8tiles *x, int64_t n, int64_t t, const kvpq__q8row *r) {
    const int64_t T = KVPQ_QG_TILE, i = t / T, tt = t % T;
    int32_t *q = (int32_t *)x->q + i * (n / 4) * T + tt;
    float *d = (float *)x->d + i * (n / 32) * T + tt, *xs = (float *)x->xs + i * (n / 32) * T + tt;
    float *x16 = (float *)x->x16 + i * (n / 16) * T + tt;
    for (int64_t k = 0; k < n / 4; k++) memcpy(&q[k * T], r->qs + 4 * k, 4);
    for (int64_t b = 0; b < n / 32; b++) d[b * T] = r->d[b], xs[b * T] = r->xs[b];
    for (int64_t g = 0; g < n / 16; g++) x16[g * T] = r->d[g / 2] * (float)r->s16[g];
}

/* The tiles of n_tok rows of n activations: the byte offsets of q, d, xs and x16 in one buffer
 * (off, 4 entries); returns its size. */
static size_t q8_tiles_layout(int64_t n, int64_t n_tok, size_t off[4]) {
    const size_t rows_p = (size_t)((n_tok + KVPQ_QG_TILE - 1) / KVPQ_QG_TILE * KVPQ_QG_TILE);
    off[0] = 0;
    off[1] = off[0] + rows_p * (size_t)(n / 4) * sizeof(int32_t);
    off[2] = off[1] + rows_p * (size_t)(n / 32) * sizeof(float);
    off[3] = off[2] + rows_p * (size_t)(n / 32) * sizeof(float);
    return off[3] + rows_p * (size_t)(n / 16) * sizeof(float);
}

/* The tiles of n_tok quantized rows in buf (q8_tiles_layout's bytes), padding rows 0. */
static kvpq__q8tiles q8_tiles_fill(void *buf, int64_t n, int64_t n_tok, const kvpq__q8row *rows) {
    const int64_t tiles = (n_tok + KVPQ_QG_TILE - 1) / KVPQ_QG_TILE, rows_p = tiles * KVPQ_QG_TILE;
    size_t off[4];
    q8_tiles_layout(n, n_tok, off);
    char *b = buf;
    int32_t *q = (int32_t *)(void *)b;
    float *d = (float *)(void *)(b + off[1]), *xs = (float *)(void *)(b + off[2]), *x16 = (float *)(void *)(b + off[3]);
    kvpq__q8tiles x = {q, d, xs, x16};
    if (rows_p > n_tok) { /* the last tile's padding rows: zeros */
        const int64_t i = tiles - 1, T = KVPQ_QG_TILE;
        memset(q + i * (n / 4) * T, 0, (size_t)(n / 4) * T * sizeof *q);
        memset(d + i * (n / 32) * T, 0, (size_t)(n / 32) * T * sizeof *d);
        memset(xs + i * (n / 32) * T, 0, (size_t)(n / 32) * T * sizeof *xs);
        memset(x16 + i * (n / 16) * T, 0, (size_t)(n / 16) * T * sizeof *x16);
    }
#pragma omp parallel for schedule(static) if (n_tok > 8)
    for (int64_t t = 0; t < n_tok; t++) q8_tile_put(&x, n, t, &rows[t]);
    return x;
}

/* The row tasks through the GEMM kernels: one panel buffer per thread. Returns 0 (nothing written)
 * when memory fails. */
static int q8_gemm_run(const ggml_mat *mats, int64_t n, int64_t n_tok, const kvpq__q8row *rows, const row_task *tasks,
                       int64_t n_tasks) {
    const kvpq_cpu_kernels *kt = kvpq__cpu_kernels();
    const int nth = omp_get_max_threads();
    const size_t pb = (kvpq__qgemm_panel_bytes(n) + 63) / 64 * 64;
    size_t off[4];
    void *tb = malloc(q8_tiles_layout(n, n_tok, off)), *panels = aligned_alloc(64, pb * (size_t)nth);
    if (!tb || !panels) {
        free(tb), free(panels);
        return 0;
    }
    const kvpq__q8tiles x = q8_tiles_fill(tb, n, n_tok, rows);
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < n_tasks; k++) {
        const ggml_mat *m = &mats[tasks[k].mat];
        const size_t rb = ggml_row_size(m->type, n);
        kt->ggml_qgemm[m->type]((const uint8_t *)m->W + (size_t)tasks[k].r0 * rb, rb, ROWS_PER_TASK, n, &x, n_tok,
                                m->Y + tasks[k].r0, m->n_rows, (char *)panels + pb * (size_t)omp_get_thread_num());
    }
    free(tb), free(panels);
    return 1;
}

/* ggml_matmul_q8_multi and ggml_qgemm_multi: X's rows quantized once (kvpq__q8row, in parallel), then
 * the row tasks of every matrix through the GEMM kernels (gemm) or the tile-of-4 ones. */
static int q8_multi(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const float *X, int gemm) {
    if (n_tok <= 0 || n_mat <= 0) return 1;
    if (n % 32) return 0;
    int64_t n_tasks = 0, work = 0;
    int have_kernels = 1;
    for (int i = 0; i < n_mat; i++) {
        if (!ggml_q8_supported(mats[i].type) || mats[i].n_rows < 0) return 0;
        have_kernels &= qmatmul_kernel(mats[i].type) != NULL;
        n_tasks += (mats[i].n_rows + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
        work += mats[i].n_rows * n * n_tok;
    }
    if (gemm && !qgemm_ok(mats, n_mat)) return 0;
    if (!have_kernels) { /* scalar level: the _ref */
        for (int i = 0; i < n_mat; i++) ggml_matmul_q8_ref(mats[i].type, mats[i].W, mats[i].n_rows, n, n_tok, X, mats[i].Y);
        return 1;
    }
    size_t qb = ggml_q8_row_bytes(n);
    size_t need = (size_t)n_tok * (qb + sizeof(kvpq__q8row)) + (size_t)n_tasks * sizeof(row_task);
    _Alignas(64) uint8_t stack[16384];
    uint8_t *buf = need <= sizeof stack ? stack : malloc(need);
    if (!buf) return 0;
    kvpq__q8row *rows = (kvpq__q8row *)(void *)buf;
    row_task *tasks = (row_task *)(void *)(rows + n_tok);
    uint8_t *data = (uint8_t *)(tasks + n_tasks);
    data += (size_t)(-(uintptr_t)data & 7); /* 8-byte aligned rows (qb is a multiple of 4) */
    row_tasks(mats, n_mat, tasks);
#pragma omp parallel for schedule(static) if (n_tok > 8)
    for (int64_t t = 0; t < n_tok; t++) {
        ggml_quantize_act_row(X + t * n, n, data + (size_t)t * qb);
        rows[t] = ggml_q8_row_at(data + (size_t)t * qb, n);
    }
    int done = 1;
    if (gemm)
        done = q8_gemm_run(mats, n, n_tok, rows, tasks, n_tasks);
    else
        q8_run(mats, n_mat, n, n_tok, rows, tasks, n_tasks, work);
    if (buf != stack) free(buf);
    return done;
}

int ggml_matmul_q8_multi(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const float *X) {
    return q8_multi(mats, n_mat, n, n_tok, X, 0);
}

int ggml_qgemm_multi(const ggml_mat *mats, int n_mat, int64_t n, int64_t n_tok, const float *X) {
    return q8_multi(mats, n_mat, n, n_tok, X, 1);
}

int ggml_matmul_q8(uint32_t type, const void *W, int64_t n_rows, int64_t n, int64_t n_tok, const float *X, float *Y) {
    ggml_mat m = {type, W, n_rows, Y};
    return ggml_matmul_q8_multi(&m, 1, n, n_tok, X);
}
