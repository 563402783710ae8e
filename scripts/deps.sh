#!/usr/bin/env bash
# Install what kvpq needs on a fresh Debian/Ubuntu machine (apt packages, then PyPI packages).
# Idempotent: skips what is already there. Run as root or with sudo available.
set -euo pipefail
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_pkgs=(build-essential cmake pkg-config libcriterion-dev libcjson-dev libpcre2-dev libopenblas-dev libxxhash-dev libmicrohttpd-dev
          clang python3 python3-pip python3-venv)
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
root=$(cd "$(dirname "$0")/.." && pwd)
# requirements-dev.txt: the peers and tooling of the tests, benchmarks and figures;
# requirements-transformers.txt: torch, accelerate and optimum-quanto for kvpq.transformers and its test
# (tests/python/test_transformers.py). PyPI's torch wheel for x86_64 Linux depends on its CUDA runtime
# wheels (nvidia-*; no CPU-only torch is on PyPI, and torch does not import without
# them): 6.4 minutes and +5.3 GB cold on this VM, once per machine (README "Dependencies").
mods="['numpy','cffi','safetensors','gguf','faiss','tokenizers','transformers','matplotlib','pytest','jsonschema','hypothesis','torch','accelerate','optimum.quanto','turboquant','scipy','quantcpp']"
if ! python3 -c "import sys; import importlib.util as u; sys.exit(any(u.find_spec(m.split('.')[0]) is None or u.find_spec(m) is None for m in $mods))" 2>/dev/null; then
  reqs=(-r "$root/python/requirements-dev.txt" -r "$root/python/requirements-transformers.txt")
  echo "deps: pip install -r python/requirements-dev.txt -r python/requirements-transformers.txt"
  # A Debian system python refuses installs (PEP 668); then install beside its packages.
  python3 -m pip install -q "${reqs[@]}" || python3 -m pip install -q --break-system-packages "${reqs[@]}"
fi
# openai: the client tests/python/test_serve.py drives `kvpq serve` with (not in python/: the package
# does not need it).
if ! python3 -c "import openai" 2>/dev/null; then
  echo "deps: pip install openai"
  python3 -m pip install -q openai || python3 -m pip install -q --break-system-packages openai
fi
