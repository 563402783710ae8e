/* body_scalar_ggml.c — cpu/ggml_body.h at width 1 (plain C11): compiled by the test build only, so
 * the body stays valid C at every width (docs/cpu_kernels.md). Not linked: the library's scalar
 * level is model/ggml_types.c's _ref. */
#include "cpu/ggml_body.h"
