#!/usr/bin/env python3
"""faiss_compare.py — kvpq's CPU product quantizer beside faiss-cpu, same data, same process.

  encode : faiss ProductQuantizer.compute_codes vs kvpq_pq_encode. faiss's ProductQuantizer has one
           codebook per sub-space, so kvpq runs with SUBSPACE granularity and faiss's trained
           centroids (M, ksub, dsub): same M, nbits, data and codebook; codes are compared byte for
           byte (both pack a little-endian bit stream).
  kmeans : faiss.Kmeans vs kvpq_kmeans: same data, k, niter, max_points_per_centroid (256), seed.
           The final MSE of both codebooks is computed the same way (exact search with
           faiss.IndexFlatL2 over all points) so the quality comparison is like for like.

Both libraries run with the same number of OpenMP threads (--threads, default 2). Times are the
median of --repeats runs after one warm-up. kvpq is the Python package over the library at KVPQ_LIB (or --lib); the timed
encode is the raw kvpq_pq_encode call (kvpq.lib), without the package's argument checks.

  KVPQ_LIB=build/libkvpq.so python3 bench/faiss_compare.py [--threads 2] [--quick] [--json]
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("KVPQ_LIB", "build/libkvpq.so"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=["encode", "kmeans"], help="run one of the two comparisons")
    ap.add_argument("--wait-policy", default="PASSIVE", choices=["PASSIVE", "ACTIVE"],
                    help="OMP_WAIT_POLICY for both runtimes (faiss wheels bundle their own OpenMP; with two "
                         "runtimes in one process, spinning idle threads steal the other's cores)")
    return ap.parse_args()


args = parse()
os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before either runtime starts
os.environ["OMP_WAIT_POLICY"] = args.wait_policy
import faiss  # noqa: E402

faiss.omp_set_num_threads(args.threads)


os.environ.setdefault("KVPQ_LIB", args.lib)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import kvpq  # noqa: E402

lib, ffi = kvpq.lib, kvpq.ffi


def check(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: status {status}: {kvpq.last_error()}")


def ptr(a, t="float *"):
    return ffi.cast(t, a.ctypes.data)


def timed_pair(fa, fb, repeats):
    """Median wall time of fa and of fb, runs interleaved (a, b, a, b, ...) so both see the same
    machine load; one warm-up each first."""
    fa(), fb()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, ts in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def data(n, d, seed):
    """Keys-like data: Gaussian with a few heavy channels (not zeros, not uniform)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32)
    x[:, :: max(1, d // 8)] *= 3.0
    return np.ascontiguousarray(x)


def mse_of(x, cent):
    index = faiss.IndexFlatL2(cent.shape[1])
    index.add(cent)
    D, _ = index.search(x, 1)
    return float(D.mean())


def bench_encode(n, d, M, nbits, repeats):
    x = data(n, d, 1)
    pq = faiss.ProductQuantizer(d, M, nbits)
    pq.cp.min_points_per_centroid = 1  # codebook quality is not what is timed here
    pq.train(x[: min(n, 256 * (1 << nbits))])
    cent = faiss.vector_to_array(pq.centroids).astype(np.float32)  # (M, ksub, dsub)
    q = kvpq.ProductQuantizer(d, M, nbits, granularity="subspace")  # like faiss
    q.centroids = cent.reshape(M, 1 << nbits, d // M)
    ours = np.zeros((n, q.code_size), np.uint8)
    t_faiss, t_kvpq = timed_pair(lambda: pq.compute_codes(x),
                                 lambda: check(lib.kvpq_pq_encode(q._h, n, ptr(x), ptr(ours, "uint8_t *")),
                                               "kvpq_pq_encode"), repeats)
    theirs = pq.compute_codes(x)
    agree = float((theirs == ours).mean()) * 100
    nsub = n * M
    return dict(kind="encode", n=n, d=d, M=M, nbits=nbits, dsub=d // M, faiss_ms=t_faiss * 1e3,
                kvpq_ms=t_kvpq * 1e3, faiss_subvec_per_s=nsub / t_faiss, kvpq_subvec_per_s=nsub / t_kvpq,
                speedup=t_faiss / t_kvpq, code_bytes_agree_pct=agree)


def bench_kmeans(n, d, k, niter, repeats):
    """Repeat r uses seed 1000 + r for both libraries, interleaved: median time, mean +- std of the
    final MSE over the seeds (the seed-to-seed spread is the scale on which to read the MSE ratio)."""
    x = data(n, d, 2)
    tf, tk, mf, mk, its = [], [], [], [], []
    for r in range(repeats + 1):  # r = 0: warm-up, not recorded
        seed = 1000 + r
        t0 = time.perf_counter()
        km = faiss.Kmeans(d, k, niter=niter, seed=seed, max_points_per_centroid=256, verbose=False)
        km.cp.min_points_per_centroid = 1  # no warning spam for small quick runs
        km.train(x)
        t1 = time.perf_counter()
        cent, rep = kvpq.kmeans(x, k, niter=niter, max_points_per_centroid=256, seed=seed, init="pp",
                                n_threads=args.threads)
        t2 = time.perf_counter()
        if r == 0:
            continue
        tf.append(t1 - t0), tk.append(t2 - t1)
        mf.append(mse_of(x, km.centroids)), mk.append(mse_of(x, cent)), its.append(rep["iterations"])
    return dict(kind="kmeans", n=n, d=d, k=k, niter=niter, faiss_ms=statistics.median(tf) * 1e3,
                kvpq_ms=statistics.median(tk) * 1e3, speedup=statistics.median(tf) / statistics.median(tk),
                faiss_mse=float(np.mean(mf)), kvpq_mse=float(np.mean(mk)), faiss_mse_std=float(np.std(mf)),
                kvpq_mse_std=float(np.std(mk)), kvpq_iterations=its, n_used=rep["n_used"], seeds=repeats)


def main():
    q = args.quick
    rows = []
    enc = [(65536, 64, 16, 8), (65536, 128, 16, 8), (16384, 256, 64, 8), (65536, 64, 32, 8), (65536, 64, 8, 8),
           (65536, 64, 8, 12)]
    if q:
        enc = [(4096, 64, 16, 8), (4096, 64, 8, 4)]
    if args.only == "kmeans":
        enc = []
    for n, d, M, nbits in enc:
        rows.append(bench_encode(n, d, M, nbits, args.repeats))
    km = [(65536, 4, 256, 25), (65536, 8, 256, 25), (262144, 4, 256, 25), (65536, 16, 256, 25), (65536, 2, 256, 25)]
    if q:
        km = [(8192, 4, 64, 10)]
    if args.only == "encode":
        km = []
    for n, d, k, niter in km:
        rows.append(bench_kmeans(n, d, k, niter, max(3, args.repeats // 2)))
    simd = kvpq.simd_get()
    if args.json:
        print(json.dumps(dict(threads=args.threads, simd=simd, faiss=faiss.__version__, rows=rows), indent=1))
        return
    print(f"kvpq vs faiss {faiss.__version__}: {args.threads} threads each (OMP_WAIT_POLICY={args.wait_policy}), "
          f"kvpq SIMD {simd}; median of {args.repeats} (encode) / {max(3, args.repeats // 2)} (kmeans) runs, "
          f"interleaved, after a warm-up, same process; load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs\n")
    print("encode (SUBSPACE codebooks = faiss ProductQuantizer, same trained centroids)")
    print(f"{'n':>7} {'d':>4} {'M':>3} {'nbits':>5} {'dsub':>4} | {'faiss ms':>9} {'kvpq ms':>9} | "
          f"{'faiss Msv/s':>11} {'kvpq Msv/s':>10} | {'kvpq/faiss':>10} | codes equal")
    for r in rows:
        if r["kind"] != "encode":
            continue
        print(f"{r['n']:>7} {r['d']:>4} {r['M']:>3} {r['nbits']:>5} {r['dsub']:>4} | {r['faiss_ms']:>9.2f} "
              f"{r['kvpq_ms']:>9.2f} | {r['faiss_subvec_per_s'] / 1e6:>11.1f} {r['kvpq_subvec_per_s'] / 1e6:>10.1f} | "
              f"{r['speedup']:>9.2f}x | {r['code_bytes_agree_pct']:.3f}%")
    print("\nk-means (same data, k, niter, 256 points/centroid cap, seed; MSE by exact search over all points)")
    print("  (MSE: mean +- std over the seeds 1001.. of the timed runs; kvpq iterations run per seed)")
    print(f"{'n':>7} {'d':>3} {'k':>4} {'niter':>5} | {'faiss ms':>9} {'kvpq ms':>9} | {'kvpq/faiss':>10} | "
          f"{'faiss MSE':>18} {'kvpq MSE':>18} {'MSE ratio':>9} | iters")
    for r in rows:
        if r["kind"] != "kmeans":
            continue
        print(f"{r['n']:>7} {r['d']:>3} {r['k']:>4} {r['niter']:>5} | {r['faiss_ms']:>9.1f} {r['kvpq_ms']:>9.1f} | "
              f"{r['speedup']:>9.2f}x | {r['faiss_mse']:>9.5f} +-{r['faiss_mse_std']:>7.5f} "
              f"{r['kvpq_mse']:>9.5f} +-{r['kvpq_mse_std']:>7.5f} {r['kvpq_mse'] / r['faiss_mse']:>9.4f} | "
              f"{min(r['kvpq_iterations'])}-{max(r['kvpq_iterations'])}")
    print("\nkvpq/faiss > 1 means kvpq is faster; MSE ratio < 1 means kvpq's codebook is better.")


if __name__ == "__main__":
    sys.exit(main())
