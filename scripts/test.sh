#!/usr/bin/env bash
# The test command: installs dependencies, fetches the models (SmolLM2-135M, Qwen2.5-Coder-1.5B,
# Gemma-3-270M), builds with warnings as errors, runs the whole suite (C tests through ctest, Python
# peer checks through pytest), then runs the C suite again under AddressSanitizer +
# UndefinedBehaviorSanitizer, and runs each libFuzzer target briefly.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=$(nproc)
./scripts/deps.sh
./scripts/fetch_model.sh all
echo "== build (Release, -Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKVPQ_WERROR=ON >/dev/null
cmake --build build -j"$jobs"
echo "== tests"
(cd build && ctest --output-on-failure -j"$jobs")
echo "== tests under ASan+UBSan (C tests; Python peers and long model runs are covered above)"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKVPQ_SANITIZE=ON -DKVPQ_WERROR=ON -DKVPQ_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 KVPQ_QUICK=1 \
   ctest --output-on-failure -j"$jobs" -E '^py_')
echo "== fuzz targets (libFuzzer + ASan/UBSan, ${KVPQ_FUZZ_SECONDS:-10}s each; longer: scripts/fuzz.sh 600)"
./scripts/fuzz.sh "${KVPQ_FUZZ_SECONDS:-10}"
