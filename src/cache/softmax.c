/* softmax.c — the online-softmax merge {m, d, o} shared by every CPU attention path.
 *
 * Two partial states over disjoint key sets A and B (FlashAttention, Dao et al. 2022, sec. 3.1;
 * Milakov & Gimelshein 2018, "Online normalizer calculation for softmax", alg. 3):
 *   m = max(m_a, m_b)
 *   d = d_a exp(m_a - m) + d_b exp(m_b - m)
 *   o = o_a exp(m_a - m) + o_b exp(m_b - m)
 * An empty state has m = -inf, d = 0, o = 0 and is the identity of the merge. */
#include <math.h>
#include <string.h>

#include "cache/cache_impl.h"

void kvpq_softmax_merge(kvpq_softmax_state *a, float *oa, const kvpq_softmax_state *b, const float *ob,
                        int head_dim) {
    if (b->d == 0.0f || b->m == -INFINITY) return; /* b is empty */
    if (a->d == 0.0f || a->m == -INFINITY) {
        *a = *b;
        memcpy(oa, ob, (size_t)head_dim * sizeof *oa);
        return;
    }
    float m = a->m > b->m ? a->m : b->m;
    float sa = expf(a->m - m), sb = expf(b->m - m);
    for (int c = 0; c < head_dim; c++) oa[c] = oa[c] * sa + ob[c] * sb;
    a->d = a->d * sa + b->d * sb;
    a->m = m;
}
