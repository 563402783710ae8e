/* body_scalar_vq.c — cpu/vq_body.h at width 1 (plain C11): compiled by the test build only, so the
 * body stays valid C at every width (docs/cpu_kernels.md). Not linked: the library's scalar level
 * is vq_kernels.c's _ref, which is also where this instance's narrower shapes would go. */
#define VQ_NEXT(name) kvpq__vq_##name##_ref
#include "cpu/vq_body.h"

void kvpq__vq_kernels_scalar(kvpq_vq_kernels *k);
void kvpq__vq_kernels_scalar(kvpq_vq_kernels *k) { vq_body_fill(k); }
