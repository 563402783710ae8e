/* nn_avx512.c — the nearest-centroid search of nn_body.h at AVX-512 F/BW/VL/DQ (16 lanes). */
#define KVPQ_ISA_AVX512
#if defined(__x86_64__)
#include "cpu/nn_body.h"
#endif
