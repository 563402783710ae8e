"""kvpq: KV-cache compression by product quantization, and attention from codes (Python binding).

    import numpy as np, kvpq
    pq = kvpq.ProductQuantizer(d=64, preset="d4b8")       # 16 sub-vectors of 4 dims, 8 bits each
    pq.train(x)                                           # x: (n, 64) float32
    codes = pq.encode(x)                                  # (n, 16) uint8
    x_hat = pq.decode(codes)                              # (n, 64) float32

The binding is cffi over libkvpq, declared from the C header (kvpq._ffi); errors raise kvpq.Error (a RuntimeError;
bad arguments: kvpq.ArgumentError, also a ValueError).
kvpq.transformers holds the Hugging Face transformers cache (needs torch and transformers).
"""
from ._core import (ERR_BUDGET, ArgumentError, Cache, Codebook, PagePool, cache_settings, CudaCache, Error, Model, ProductQuantizer, Vocab, calibrate, calibrate_layer,
                    codes_pack, codes_unpack, gguf_dequantize, hadamard, kmeans, last_error, normalize_rows,
                    simd_get, simd_set, smooth_apply, smooth_apply_query, smooth_compute, version, cuda_available)
from ._ffi import ffi, lib
from ._turboquant import turboquant_centroids, turboquant_codebook

__version__ = version()
__all__ = ["ERR_BUDGET", "ArgumentError", "Cache", "Codebook", "PagePool", "cache_settings", "CudaCache", "Error", "Model", "ProductQuantizer", "Vocab", "calibrate", "calibrate_layer",
           "codes_pack", "codes_unpack", "gguf_dequantize", "hadamard", "kmeans", "last_error", "normalize_rows",
           "simd_get", "simd_set", "smooth_apply", "smooth_apply_query", "smooth_compute", "version", "cuda_available", "ffi", "lib",
           "turboquant_centroids", "turboquant_codebook"]
