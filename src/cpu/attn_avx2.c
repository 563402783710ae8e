/* attn_avx2.c — the cache attention kernels of attn_body.h at AVX2 + FMA + F16C (8 lanes). */
#define KVPQ_ISA_AVX2
#if defined(__x86_64__)
#include "cpu/attn_body.h"
#endif
