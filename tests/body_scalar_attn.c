/* body_scalar_attn.c — cpu/attn_body.h at width 1 (plain C11, no ISA macro): kvpq__attn_scalar.
 * Not part of the library, whose scalar level is cpu/attn_ref.c; built into test_attn_kernels,
 * which checks it against the _ref like every SIMD level, so the body stays valid (and right) C at
 * every width (docs/cpu_kernels.md). */
#include "cpu/attn_body.h"
