/* llama_cpp_greedy_logits.c — a small client of llama.cpp's libllama (the peer, built elsewhere; not
 * part of kvpq's build): greedy decoding of prompt token ids, printing per step the chosen token and
 * the two largest logits with their ids, so that a divergence between kvpq and llama.cpp can be
 * classified as a near-tie or not (bench/greedy_margin.py runs it beside kvpq).
 * Build (bench/greedy_margin.py does it): cc -O2 -I LLAMA/include -I LLAMA/ggml/include
 *   bench/llama_cpp_greedy_logits.c -L LLAMA/build/bin -lllama -Wl,-rpath,LLAMA/build/bin
 * Usage: llama_cpp_greedy_logits MODEL.gguf N_PREDICT N_THREADS ID,ID,...
 * Output: one line per generated token: "step token top1_id top1_logit top2_id top2_logit". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "llama.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL N_PREDICT N_THREADS ID,ID,...\n", argv[0]);
        return 2;
    }
    int n_predict = atoi(argv[2]), n_threads = atoi(argv[3]);
    int cap = 1, n = 0;
    for (const char *c = argv[4]; *c; c++) cap += *c == ',';
    llama_token *ids = malloc((size_t)(cap + n_predict) * sizeof *ids);
    for (char *tok = strtok(argv[4], ","); tok; tok = strtok(NULL, ",")) ids[n++] = atoi(tok);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    struct llama_model *model = llama_model_load_from_file(argv[1], mp);
    if (!model) return 1;
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)(n + n_predict);
    cp.n_batch = (uint32_t)n;
    cp.n_threads = cp.n_threads_batch = n_threads;
    cp.no_perf = true;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) return 1;
    int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    struct llama_batch batch = llama_batch_get_one(ids, n);
    for (int step = 0; step < n_predict; step++) {
        if (llama_decode(ctx, batch)) return 1;
        const float *lg = llama_get_logits_ith(ctx, -1);
        int b1 = 0, b2 = -1;
        for (int i = 1; i < n_vocab; i++) {
            if (lg[i] > lg[b1]) b2 = b1, b1 = i;
            else if (b2 < 0 || lg[i] > lg[b2]) b2 = i;
        }
        printf("%d %d %d %.6f %d %.6f\n", step, b1, b1, lg[b1], b2, lg[b2]);
        fflush(stdout);
        ids[n] = b1;
        batch = llama_batch_get_one(&ids[n], 1);
        n++;
    }
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
