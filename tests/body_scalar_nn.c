/* body_scalar_nn.c — cpu/nn_body.h at width 1 (plain C11): compiled by the test build only, so the
 * body stays valid C at every width (docs/cpu_kernels.md). Not linked: the library's scalar level
 * is kvpq__nn_ref. */
#include "cpu/nn_body.h"
