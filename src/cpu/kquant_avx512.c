/* kquant_avx512.c — the K-quant kernels of kquant_body.h at AVX512. */
#define KVPQ_ISA_AVX512
#if defined(__x86_64__)
#include "cpu/kquant_shim.h"
#include "cpu/kquant_body.h"
#else
#include "cpu/ggml_kernels.h"
kvpq__matvec_fn kvpq__kquant_matvec_avx512(uint32_t type) { return NULL; }
kvpq__dequant_fn kvpq__kquant_dequant_avx512(uint32_t type) { return NULL; }
#endif
