/* nn_avx2.c — the nearest-centroid search of nn_body.h at AVX2 + FMA (8 lanes). */
#define KVPQ_ISA_AVX2
#if defined(__x86_64__)
#include "cpu/nn_body.h"
#endif
