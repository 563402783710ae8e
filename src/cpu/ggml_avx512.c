/* ggml_avx512.c — the GGML tensor-type kernels of ggml_body.h at AVX-512 F/BW/VL/DQ (16 lanes). */
#define KVPQ_ISA_AVX512
#if defined(__x86_64__)
#include "cpu/ggml_body.h"
#endif
