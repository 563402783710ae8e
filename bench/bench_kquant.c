/* bench_kquant.c — ggml_matvec (the decode hot path) on the K-quant weight types beside Q4_1, Q5_0, Q5_1 and Q8_0
 * (older kernels) in the same run, at every SIMD level: "scalar" is the _ref specification (run in
 * parallel over rows), the others the SIMD kernels.
 *  1. one matrix of Qwen2.5-Coder-1.5B's ffn_gate shape (8960 x 1536) of each type, random blocks,
 *     warm in cache: us per call and GB/s of weight bytes;
 *  2. one decoded token of a real model file (every 2-D weight of every layer plus the output
 *     matrix, once each, the model's own types): ms per token, GB/s, and the fraction of a plain
 *     parallel read of the same bytes (the memory ceiling, measured here).
 * Each SIMD level's row is followed by "+q8": the integer-activation kernels (ggml_matmul_q8, one
 * token) on the same weights where the type has them.
 * Table: median of repeats (wall time; CPU time of the process with KVPQ_BENCH_CPU=1). OMP_NUM_THREADS sets the threads (the target: 2).
 * Usage: bench_kquant [repeats] [model.gguf]   (default models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf) */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "model/ggml_types.h"
#include "model/gguf.h"

static volatile uint64_t sink;

/* Memory-read ceiling: sum every 8-byte word of each tensor (parallel, as the matvecs). */
static void read_sum(const gguf_tensor **t, int nt) {
    uint64_t acc = 0;
    for (int k = 0; k < nt; k++) {
        const uint64_t *p = (const uint64_t *)t[k]->data;
        size_t n8 = t[k]->nbytes / 8;
#pragma omp parallel for reduction(+ : acc) if (n8 >= 8192)
        for (size_t i = 0; i < n8; i++) acc += p[i];
    }
    sink += acc;
}

/* Median seconds of `reps` runs of the statement. */

static void one_token(const gguf_tensor **t, int nt, const float *x, float *y) {
    for (int k = 0; k < nt; k++) ggml_matvec(t[k]->type, t[k]->data, t[k]->ne[1], t[k]->ne[0], x, y);
}

/* The same with 8-bit activations where the type has integer kernels (as the model's KVPQ_ACT=q8). */
static void one_token_q8(const gguf_tensor **t, int nt, const float *x, float *y) {
    for (int k = 0; k < nt; k++)
        if (!ggml_matmul_q8(t[k]->type, t[k]->data, t[k]->ne[1], t[k]->ne[0], 1, x, y))
            ggml_matvec(t[k]->type, t[k]->data, t[k]->ne[1], t[k]->ne[0], x, y);
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 21;
    if (reps < 1 || reps > MAXREP) reps = 21;
    const char *model = argc > 2 ? argv[2] : "models/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf";
    kvpq_simd_level best = kvpq_simd_get();

    const uint32_t types[] = {GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
                              GGML_TYPE_Q6_K, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_Q8_0};
    const int64_t rows = 8960, n = 1536;
    printf("ggml_matvec %lld x %lld (Qwen2.5-1.5B ffn_gate shape), warm, threads %d, median of %d\n",
           (long long)rows, (long long)n, omp_get_max_threads(), reps);
    printf("%-6s %8s %-8s %10s %8s %10s\n", "type", "MB", "simd", "us/call", "GB/s", "vs scalar");
    float *x = malloc((size_t)(rows > n ? rows : n) * 4), *y = malloc((size_t)(rows > 262144 ? rows : 262144) * 4);
    for (int64_t i = 0; i < n; i++) x[i] = (float)(i % 7) * 0.1f - 0.3f;
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        uint32_t type = types[k];
        uint8_t *w = random_weights(type, rows, n);
        double bytes = (double)ggml_row_size(type, n) * (double)rows, t0 = 0;
        for (int l = 0; l <= (int)best; l++) {
            kvpq_simd_set((kvpq_simd_level)l);
            ggml_matvec(type, w, rows, n, x, y); /* warm */
            double t = TIME(l == 0 && reps > 5 ? 5 : reps, ggml_matvec(type, w, rows, n, x, y));
            if (l == 0) t0 = t;
            printf("%-6s %8.2f %-8s %10.1f %8.2f %9.2fx\n", ggml_type_name(type), bytes / 1e6,
                   kvpq_simd_name((kvpq_simd_level)l), t * 1e6, bytes / t / 1e9, t0 / t);
            if (l == 0 || !ggml_q8_supported(type)) continue;
            t = TIME(reps, ggml_matmul_q8(type, w, rows, n, 1, x, y)); /* 8-bit activations */
            printf("%-6s %8.2f %-4s+q8  %10.1f %8.2f %9.2fx\n", ggml_type_name(type), bytes / 1e6,
                   kvpq_simd_name((kvpq_simd_level)l), t * 1e6, bytes / t / 1e9, t0 / t);
        }
        free(w);
    }

    /* Several tokens (prefill): ggml_matmul (float32: row dequantized once and dotted with every
     * token below 32 tokens, OpenBLAS sgemm on dequantized tiles from 32) beside ggml_matmul_q8. */
    const int64_t toks[] = {2, 4, 8, 16, 32, 64, 256};
    float *X = malloc((size_t)256 * n * 4), *Y = malloc((size_t)256 * rows * 4);
    for (int64_t i = 0; i < 256 * n; i++) X[i] = (float)(i % 11) * 0.05f - 0.25f;
    printf("\nggml_matmul %lld x %lld, n_tok tokens, %s, threads %d: us per token (f32 / q8 / q8 GEMM)\n",
           (long long)rows, (long long)n, kvpq_simd_name(best), omp_get_max_threads());
    const uint32_t gtypes[] = {GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0};
    printf("%-6s", "n_tok");
    for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) printf(" %15lld", (long long)toks[k]);
    printf("\n");
    for (size_t g = 0; g < sizeof gtypes / sizeof gtypes[0]; g++) {
        uint8_t *w = random_weights(gtypes[g], rows, n);
        printf("%-6s", ggml_type_name(gtypes[g]));
        for (size_t k = 0; k < sizeof toks / sizeof toks[0]; k++) {
            int64_t nt = toks[k];
            int rr = reps > 5 ? 5 : reps;
            double tf = TIME(rr, ggml_matmul(gtypes[g], w, rows, n, nt, X, Y));
            double tq = TIME(rr, ggml_matmul_q8(gtypes[g], w, rows, n, nt, X, Y));
            ggml_mat gm = {gtypes[g], w, rows, Y};
            double tg = ggml_qgemm_multi(&gm, 1, n, nt, X) ? TIME(rr, ggml_qgemm_multi(&gm, 1, n, nt, X)) : 0.0;
            printf(" %5.0f/%4.0f/%4.0f", tf * 1e6 / (double)nt, tq * 1e6 / (double)nt, tg * 1e6 / (double)nt);
        }
        printf("\n");
        free(w);
    }
    free(X);
    free(Y);

    gguf_file *f;
    if (gguf_open(&f, model) != KVPQ_OK) {
        printf("\n(%s: %s; the real-model table needs it: scripts/fetch_model.sh all)\n", model, kvpq_last_error());
    } else {
        const gguf_tensor *t[1024];
        int nt = 0;
        size_t total = 0, by_type[64] = {0};
        int64_t max_n = 0;
        for (int64_t i = 0; i < gguf_n_tensors(f) && nt < 1024; i++) {
            const gguf_tensor *g = gguf_tensor_at(f, i);
            int is_out = !strcmp(g->name, "output.weight");
            if (g->n_dims != 2 || !ggml_type_supported(g->type) || (strncmp(g->name, "blk.", 4) && !is_out)) continue;
            t[nt++] = g;
            total += g->nbytes;
            if (g->type < 64) by_type[g->type] += g->nbytes;
            if (g->ne[0] > max_n) max_n = g->ne[0];
        }
        if (!gguf_find_tensor(f, "output.weight")) { /* tied output: the token embedding */
            const gguf_tensor *g = gguf_find_tensor(f, "token_embd.weight");
            if (g && ggml_type_supported(g->type) && nt < 1024) {
                t[nt++] = g;
                total += g->nbytes;
                if (g->type < 64) by_type[g->type] += g->nbytes;
            }
        }
        float *xm = malloc((size_t)max_n * 4), *ym = malloc((size_t)300000 * 4);
        for (int64_t i = 0; i < max_n; i++) xm[i] = (float)(i % 5) * 0.1f - 0.2f;
        printf("\none decoded token of %s: %d matrices, %.1f MB (", model, nt, (double)total / 1e6);
        for (int ty = 0; ty < 64; ty++)
            if (by_type[ty]) printf(" %s %.0f MB", ggml_type_name((uint32_t)ty), (double)by_type[ty] / 1e6);
        printf(" ), threads %d\n", omp_get_max_threads());
        printf("%-10s %10s %8s %10s\n", "simd", "ms/token", "GB/s", "of ceiling");
        int r = reps > 11 ? 11 : reps;
        read_sum(t, nt);
        double tc = TIME(r, read_sum(t, nt));
        printf("%-10s %10.2f %8.2f %10s\n", "read-sum", tc * 1e3, (double)total / tc / 1e9, "1.00");
        for (int l = 0; l <= (int)best; l++) {
            kvpq_simd_set((kvpq_simd_level)l);
            int rl = l == 0 && r > 3 ? 3 : r;
            double tt = TIME(rl, one_token(t, nt, xm, ym));
            printf("%-10s %10.2f %8.2f %10.2f\n", kvpq_simd_name((kvpq_simd_level)l), tt * 1e3,
                   (double)total / tt / 1e9, tc / tt);
            if (l == 0) continue;
            tt = TIME(rl, one_token_q8(t, nt, xm, ym));
            printf("%-7s+q8 %10.2f %8.2f %10.2f\n", kvpq_simd_name((kvpq_simd_level)l), tt * 1e3,
                   (double)total / tt / 1e9, tc / tt);
        }
        free(xm);
        free(ym);
        gguf_close(f);
    }
    kvpq_simd_set(best);
    free(x);
    free(y);
    return 0;
}
