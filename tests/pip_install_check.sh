#!/usr/bin/env bash
# `pip install ./python` on a clean copy of the repository (its committed files, as a fresh clone
# has them) into a new virtual environment, then the installed package is used from outside the
# source tree: it must find its own libkvpq.so and header, and round-trip vectors.
# usage: tests/pip_install_check.sh SOURCE_DIR   (needs PyPI for numpy, cffi, scikit-build-core)
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$src" archive HEAD | tar -x -C "$tmp" && mkdir -p "$tmp/models"
python3 -m venv "$tmp/venv"
t0=$(date +%s)
KVPQ_CUDA=OFF "$tmp/venv/bin/pip" install -q "$tmp/python"
echo "pip install ./python: $(( $(date +%s) - t0 )) s"
cd "$tmp"  # not the source tree: the installed package must be the one imported
env -u KVPQ_LIB -u KVPQ_INCLUDE -u KVPQ_SOURCE_DIR -u PYTHONPATH "$tmp/venv/bin/python" - <<'PY'
import numpy as np, kvpq, kvpq._ffi as f
assert "venv" in f.LIB_PATH and f.CORE_PATH.endswith("kvpq/lib/libkvpq.so") and f.MODEL_PATH.endswith("kvpq/lib/libkvpq_model.so"), (f.CORE_PATH, f.MODEL_PATH)
assert str(f.HEADERS[0]).endswith("kvpq/include/kvpq.h"), f.HEADERS
x = np.random.default_rng(0).standard_normal((2000, 64)).astype(np.float32)
pq = kvpq.ProductQuantizer(64, preset="d4b8")
rep = pq.train(x, niter=3)
err = float(((pq.decode(pq.encode(x)) - x) ** 2).sum(1).mean())
assert abs(err - rep["mse_final"]) < 1e-3 * err, (err, rep)
assert kvpq.lib.kvpq_vocab_load and kvpq.lib.kvpq_cache_new  # both library tiers resolve
print(f"installed kvpq {kvpq.__version__} from {f.LIB_PATH}: PQ round trip MSE {err:.4f}; 1 passed, 0 failed")
PY
