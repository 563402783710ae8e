/* ggml_avx2.c — the GGML tensor-type kernels of ggml_body.h at AVX2 + FMA + F16C (8 lanes). */
#define KVPQ_ISA_AVX2
#if defined(__x86_64__)
#include "cpu/ggml_body.h"
#endif
