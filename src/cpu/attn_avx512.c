/* attn_avx512.c — the cache attention kernels of attn_body.h at AVX-512 F/BW/VL/DQ (16 lanes). */
#define KVPQ_ISA_AVX512
#if defined(__x86_64__)
#include "cpu/attn_body.h"
#endif
