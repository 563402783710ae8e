/* bench_ggml.c — ggml_matvec / ggml_matmul on SmolLM2-135M's weight shapes, at every SIMD level,
 * beside baselines run in the same process: OpenBLAS sgemv/sgemm on the same weights dequantized to
 * float32 beforehand (4-8x more bytes to read, but no dequantization work).
 * Table: median of repeats; GB/s counts the quantized weight bytes read per call.
 * Usage: bench_ggml [repeats]   (OMP_NUM_THREADS sets the threads) */
#include <cblas.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "model/ggml_types.h"

static volatile uint64_t sink;

/* Memory-read ceiling: sum every 8-byte word of the two buffers (parallel, as the matvecs). */
static void read_sum(const uint8_t *a, size_t na, const uint8_t *b, size_t nb) {
    uint64_t acc = 0;
    const uint64_t *p = (const uint64_t *)(const void *)a, *q = (const uint64_t *)(const void *)b;
#pragma omp parallel for reduction(+ : acc)
    for (size_t i = 0; i < na / 8; i++) acc += p[i];
#pragma omp parallel for reduction(+ : acc)
    for (size_t i = 0; i < nb / 8; i++) acc += q[i];
    sink += acc;
}

/* SmolLM2-135M layer matrices as (rows, n): attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down. */
static const struct { int64_t rows, n; } lay[] = {{576, 576},   {192, 576},  {192, 576}, {576, 576},
                                                  {1536, 576}, {1536, 576}, {576, 1536}};

/* Every matvec of one decoded token, 30 layers then the output (Q8_0 token_embd, tied). */
static void one_token(const uint8_t *wq, const uint8_t *wo, const float *x, float *y) {
    const uint8_t *w = wq;
    for (int L = 0; L < 30; L++)
        for (size_t j = 0; j < 7; j++) {
            ggml_matvec(GGML_TYPE_Q4_1, w, lay[j].rows, lay[j].n, x, y);
            w += ggml_row_size(GGML_TYPE_Q4_1, lay[j].n) * (size_t)lay[j].rows;
        }
    ggml_matvec(GGML_TYPE_Q8_0, wo, 49152, 576, x, y);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 31;
    if (reps < 1 || reps > MAXREP) reps = 31;
    struct { const char *name; uint32_t type; int64_t rows, n; } shapes[] = {
        {"attn_q/attn_output 576x576", GGML_TYPE_Q4_1, 576, 576},
        {"attn_k/attn_v 192x576", GGML_TYPE_Q4_1, 192, 576},
        {"ffn_gate/ffn_up 1536x576", GGML_TYPE_Q4_1, 1536, 576},
        {"ffn_down 576x1536", GGML_TYPE_Q4_1, 576, 1536},
        {"output (token_embd) 49152x576", GGML_TYPE_Q8_0, 49152, 576},
    };
    kvpq_simd_level best = kvpq_simd_get();
    printf("ggml_matvec (n_tok = 1), threads %d, median of %d; baseline: OpenBLAS sgemv on f32 weights\n",
           omp_get_max_threads(), reps);
    printf("%-32s %-5s %-8s %10s %8s %10s\n", "shape (rows x n)", "type", "simd", "us/call", "GB/s", "vs sgemv");
    double decode_us[3] = {0}, decode_blas = 0;
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        uint32_t type = shapes[k].type;
        int64_t rows = shapes[k].rows, n = shapes[k].n;
        uint8_t *w = random_weights(type, rows, n);
        float *wf = malloc((size_t)(rows * n) * 4), *x = malloc((size_t)n * 4), *y = malloc((size_t)rows * 4);
        for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 7) * 0.1f - 0.3f;
        ggml_dequantize_row(type, w, wf, rows * n);
        double tb = TIME(reps, cblas_sgemv(CblasRowMajor, CblasNoTrans, (int)rows, (int)n, 1.0f, wf, (int)n, x, 1, 0.0f,
                                           y, 1));
        double bytes = (double)ggml_row_size(type, n) * (double)rows;
        /* per decoded token: q,o (2x 576x576), k,v (2x 192x576), gate,up (2x), down: per layer x 30; output once */
        double mult = k == 4 ? 1 : 2 * 30;
        if (k == 3) mult = 30;
        decode_blas += mult * tb * 1e6;
        printf("%-32s %-5s %-8s %10.1f %8.2f %10s\n", shapes[k].name, "f32", "sgemv", tb * 1e6, (double)rows * n * 4 / tb / 1e9,
               "1.00");
        for (int l = 0; l <= (int)best; l++) {
            kvpq_simd_set((kvpq_simd_level)l);
            ggml_matvec(type, w, rows, n, x, y); /* warm */
            double t = TIME(reps, ggml_matvec(type, w, rows, n, x, y));
            decode_us[l] += mult * t * 1e6;
            printf("%-32s %-5s %-8s %10.1f %8.2f %9.2fx\n", shapes[k].name, ggml_type_name(type),
                   kvpq_simd_name((kvpq_simd_level)l), t * 1e6, bytes / t / 1e9, tb / t);
        }
        free(w);
        free(wf);
        free(x);
        free(y);
    }
    printf("\nall matvecs of one decoded token (30 layers + output): sgemv on f32 %.0f us", decode_blas);
    for (int l = 0; l <= (int)best; l++) printf(", %s %.0f us", kvpq_simd_name((kvpq_simd_level)l), decode_us[l]);
    printf("\n");

    /* One decoded token as the forward pass sees it: every layer's weights touched once, so they
     * stream from DRAM (96 MB) instead of sitting in cache as in the table above. Ceiling: reading
     * the same bytes with a plain parallel sum, measured here. */
    {
        int64_t nl = 30, nb_layer = 0;
        for (size_t j = 0; j < 7; j++) nb_layer += (int64_t)ggml_row_size(GGML_TYPE_Q4_1, lay[j].n) * lay[j].rows;
        size_t out_bytes = ggml_row_size(GGML_TYPE_Q8_0, 576) * 49152, total = (size_t)(nb_layer * nl) + out_bytes;
        uint8_t *wq = random_weights(GGML_TYPE_Q4_1, nl * nb_layer / 20, 32);
        uint8_t *wo = random_weights(GGML_TYPE_Q8_0, 49152, 576);
        float *x = malloc(1536 * 4), *y = malloc(49152 * 4);
        for (int i = 0; i < 1536; i++) x[i] = (float)(i % 5) * 0.1f - 0.2f;
        int r = reps > 15 ? 15 : reps;
        double tc = TIME(r, read_sum(wq, (size_t)(nb_layer * nl), wo, out_bytes));
        printf("one decoded token, cold weights (%.1f MB: 30 layers of Q4_1 + Q8_0 output)\n", (double)total / 1e6);
        printf("%-10s %10s %8s %10s\n", "simd", "ms/token", "GB/s", "of ceiling");
        printf("%-10s %10.2f %8.2f %10s\n", "read-sum", tc * 1e3, (double)total / tc / 1e9, "1.00");
        for (int l = 0; l <= (int)best; l++) {
            kvpq_simd_set((kvpq_simd_level)l);
            double t = TIME(r, one_token(wq, wo, x, y));
            printf("%-10s %10.2f %8.2f %10.2f\n", kvpq_simd_name((kvpq_simd_level)l), t * 1e3, (double)total / t / 1e9,
                   tc / t);
        }
        free(wq);
        free(wo);
        free(x);
        free(y);
    }

    printf("\nggml_matmul (prompt batches), ffn_gate 1536x576 Q4_1; baseline: OpenBLAS sgemm on f32 weights\n");
    printf("%-8s %-8s %12s %12s %10s\n", "n_tok", "simd", "us/call", "GFLOP/s", "vs sgemm");
    int64_t rows = 1536, n = 576;
    uint8_t *w = random_weights(GGML_TYPE_Q4_1, rows, n);
    float *wf = malloc((size_t)(rows * n) * 4);
    ggml_dequantize_row(GGML_TYPE_Q4_1, w, wf, rows * n);
    int64_t toks[] = {2, 4, 8, 16, 64, 256};
    for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
        int64_t nt = toks[k];
        float *X = malloc((size_t)(nt * n) * 4), *Y = malloc((size_t)(nt * rows) * 4);
        for (int64_t i = 0; i < nt * n; i++) X[i] = (float)(i % 13) * 0.05f - 0.3f;
        int r = reps > 11 ? 11 : reps;
        double tb = TIME(r, cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nt, (int)rows, (int)n, 1.0f, X,
                                        (int)n, wf, (int)n, 0.0f, Y, (int)rows));
        double flop = 2.0 * (double)nt * rows * n;
        printf("%-8lld %-8s %12.1f %12.2f %10s\n", (long long)nt, "sgemm", tb * 1e6, flop / tb / 1e9, "1.00");
        for (int l = 0; l <= (int)best; l++) {
            kvpq_simd_set((kvpq_simd_level)l);
            double t = TIME(r, ggml_matmul(GGML_TYPE_Q4_1, w, rows, n, nt, X, Y));
            printf("%-8lld %-8s %12.1f %12.2f %9.2fx\n", (long long)nt, kvpq_simd_name((kvpq_simd_level)l), t * 1e6,
                   flop / t / 1e9, tb / t);
        }
        free(X);
        free(Y);
    }
    free(w);
    free(wf);
    kvpq_simd_set(best);
    return 0;
}
