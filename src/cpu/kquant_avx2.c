/* kquant_avx2.c — the K-quant kernels of kquant_body.h at AVX2. */
#define KVPQ_ISA_AVX2
#if defined(__x86_64__)
#include "cpu/kquant_shim.h"
#include "cpu/kquant_body.h"
#else
#include "cpu/ggml_kernels.h"
kvpq__matvec_fn kvpq__kquant_matvec_avx2(uint32_t type) { return NULL; }
kvpq__dequant_fn kvpq__kquant_dequant_avx2(uint32_t type) { return NULL; }
#endif
