/* backend.cu — CUDA device detection and properties (the hook behind backend resolution). */
#include <stdio.h>
#include <string.h>

#include "common.cuh"

/* Cached once per process: detection costs a driver initialization (~100 ms). Races between
 * threads on first use only repeat the same query. */
static int g_checked = 0, g_ok = 0, g_n_sm = 0;
static size_t g_smem_optin = 0;
static char g_why[256];

static void kvpq__cuda_detect(void) {
    if (g_checked) return;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(g_why, sizeof g_why, "no usable CUDA device: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
        (void)cudaGetLastError();
    } else if (n == 0) {
        snprintf(g_why, sizeof g_why, "no CUDA device present");
    } else {
        int dev = 0, major = 0, minor = 0, smem = 0;
        cudaGetDevice(&dev);
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
        cudaDeviceGetAttribute(&g_n_sm, cudaDevAttrMultiProcessorCount, dev);
        cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
        g_smem_optin = (size_t)smem;
        if (major < 8) {
            snprintf(g_why, sizeof g_why, "CUDA device %d has compute capability %d.%d; kvpq needs 8.0 or newer", dev,
                     major, minor);
        } else {
            g_ok = 1;
            snprintf(g_why, sizeof g_why, "CUDA device %d, compute capability %d.%d, %d SMs", dev, major, minor, g_n_sm);
        }
    }
    g_checked = 1;
}

extern "C" int kvpq__cuda_available(char *why, size_t n) {
    kvpq__cuda_detect();
    if (why && n) snprintf(why, n, "%s", g_why);
    return g_ok;
}

extern "C" KVPQ_API int kvpq_cuda_available(char *why, size_t n) { return kvpq__cuda_available(why, n); }

kvpq_status kvpq__cuda_require(const char *what) {
    kvpq__cuda_detect();
    if (!g_ok) return kvpq__err(KVPQ_ERR_NO_DEVICE, "%s: %s", what, g_why);
    return KVPQ_OK;
}

kvpq_status kvpq__cuda_props(int *n_sm, size_t *smem_optin) {
    KVPQ_TRY(kvpq__cuda_require("CUDA"));
    if (n_sm) *n_sm = g_n_sm;
    if (smem_optin) *smem_optin = g_smem_optin;
    return KVPQ_OK;
}
