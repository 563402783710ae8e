/* ggml_avx512vnni.c — the integer-activation kernels of ggml_body.h at AVX-512 with VNNI (vpdpbusd
 * for vb_dot): chosen at the AVX-512 level when the CPU has AVX512_VNNI (cpu/dispatch.c). */
#define KVPQ_ISA_AVX512
#define KVPQ_ISA_SUFFIX avx512vnni
#define KVPQ_GGML_Q8_ONLY
#if defined(__x86_64__)
#include "cpu/ggml_body.h"
#endif
