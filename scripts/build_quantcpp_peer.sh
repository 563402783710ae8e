#!/usr/bin/env bash
# Build quant.cpp's library from its public sources for bench/quantcpp_peer.py (the turbo_kv_* KV types).
#   scripts/build_quantcpp_peer.sh [DIR]   DIR: where to clone and build (default build-quantcpp/ in the
#                                          repository, which .gitignore ignores); prints the library path
# Why a source build: the PyPI wheel quantcpp 0.13.0 (libquant.so, built from the single header
# quant.h) compiles turbo_kv_1b/2b/3b/4b into stubs (quantize writes nothing, dequantize returns
# zeros), as are polar, qjl, turbo and mixed; only uniform_2b/3b/4b are real there. The repository's sources
# (github.com/zetta-app/quant.cpp, pinned commit below) have them.
# Build: every C file of src/core, src/cache, src/backend/cpu and src/engine into one shared library
# with gcc -O3 -march=native (the repository's CMakeLists.txt needs tool sources that its tree lacks at
# this commit). -D__fp16=_Float16: one batched-prefill path (tq_forward_batch, unused by tq_forward)
# spells ARM's __fp16, which x86 gcc >= 12 knows as _Float16. 10 s of CPU (6 min wall on the loaded 2-core box).
# Sources: quant.cpp's turbo_kv code is on no package registry (the PyPI sdist holds only the stubbed
# quant.h), so this script downloads nothing itself: SRC=PATH names a checkout of the quant.cpp repository
# (e.g. a mirror) holding the pinned commit, or QUANTCPP_GIT=URL a git remote to clone it from.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build-quantcpp}
commit=5ef59213986b92c7ab8607d410a708ee94040359
die() { echo "build_quantcpp_peer: $*" >&2; exit 1; }

mkdir -p "$dir" || die "cannot create $dir"
dir=$(cd "$dir" && pwd)
src=$dir/quant.cpp
if [ ! -d "$src/src/engine" ]; then
  if [ -n "${SRC:-}" ]; then
    mkdir -p "$src" && git -C "$SRC" archive "$commit" src include | tar -x -C "$src" || die "cannot export $commit from $SRC"
  elif [ -n "${QUANTCPP_GIT:-}" ]; then
    git clone -q "$QUANTCPP_GIT" "$src" || die "git clone $QUANTCPP_GIT failed"
    git -C "$src" checkout -q "$commit" || die "commit $commit not found in $QUANTCPP_GIT"
  else
    die "no quant.cpp sources: set SRC=PATH (a checkout of the quant.cpp repository holding commit $commit) or QUANTCPP_GIT=URL (its git remote)"
  fi
fi
command -v gcc >/dev/null || die "gcc not found"
lib=$dir/libturboquant.so
# shellcheck disable=SC2046
nice gcc -O3 -march=native -std=gnu11 -fPIC -shared -D__fp16=_Float16 -I"$src/include" \
  $(ls "$src"/src/core/*.c "$src"/src/cache/*.c "$src"/src/backend/cpu/*.c "$src"/src/engine/*.c) \
  -o "$lib" -lm -lpthread 2>"$dir/build.log" || die "compile failed (see $dir/build.log)"
echo "$lib"
