#!/usr/bin/env bash
# The Python package as users install it: scripts/build_wheel.sh on a clean copy of the repository
# (its committed files, as a fresh clone has them) makes the sdist and the manylinux wheel; then
#  - the sdist holds the C sources it builds from (and not the tests);
#  - the wheel is tagged py3-none-manylinux_*, holds py.typed, `auditwheel show` finds it consistent with that tag
#    (no library outside the policy but its own copies), and its libraries' run paths are $ORIGIN-relative
#    (no build folder);
#  - each artifact is installed into a fresh venv and used from outside the source tree
#    (tests/dist_probe.py: VQ cache round trip; the model's forward pass and tokenizer when MODEL exists),
#    the wheel with the system's OpenBLAS, PCRE2, cJSON, libgomp, libgfortran and libquadmath hidden
#    (bind-mounted /dev/null in a private mount namespace, where unshare is allowed; else the check
#    falls back to the probe's /proc/self/maps test), as on a machine without them;
#  - both installs give the same logits.
# usage: tests/dist_check.sh SOURCE_DIR [MODEL.gguf]   (needs PyPI; registered in ctest as py_dist)
set -euo pipefail
src=$(cd "${1:-$(dirname "$0")/..}" && pwd)
model=${2:-$src/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvpq_dist.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fail() { echo "dist_check: $*" >&2; exit 1; }
trap 'echo "dist_check: line $LINENO: \"$BASH_COMMAND\" failed (exit $?)" >&2' ERR
mkdir -p "$tmp/src"
git -C "$src" archive HEAD | tar -x -C "$tmp/src"
t0=$(date +%s)
KVPQ_WHEEL_TOOLS=${KVPQ_WHEEL_TOOLS:-$tmp/tools} "$tmp/src/scripts/build_wheel.sh" "$tmp/dist" >/dev/null
echo "scripts/build_wheel.sh: $(( $(date +%s) - t0 )) s"
tools=${KVPQ_WHEEL_TOOLS:-$tmp/tools}
sdist=$(ls "$tmp"/dist/kvpq-*.tar.gz) || fail "no sdist"
wheel=$(ls "$tmp"/dist/kvpq-*-py3-none-manylinux_*_x86_64.whl) || fail "no py3-none-manylinux wheel"

# ---- what the artifacts hold ----
tar -tzf "$sdist" > "$tmp/sdist.txt"
for f in CMakeLists.txt pyproject.toml include/kvpq.h src/pq/ src/cuda/ python/kvpq/_ffi.py; do
  grep -q "^kvpq-[^/]*/$f" "$tmp/sdist.txt" || fail "sdist lacks $f"
done
if grep -q "^kvpq-[^/]*/tests/" "$tmp/sdist.txt"; then fail "sdist holds tests/"; fi
tag=$(basename "$wheel" .whl | sed 's/.*-py3-none-//')
PATH="$tools/bin:$PATH" auditwheel show "$wheel" > "$tmp/show.txt" 2>&1
tr -s ' \n' ' ' < "$tmp/show.txt" | grep -q "consistent with the following platform tag: \"$tag\"" ||
  { cat "$tmp/show.txt" >&2; fail "auditwheel show: not consistent with $tag"; }
mkdir "$tmp/whl" && (cd "$tmp/whl" && python3 -m zipfile -e "$wheel" .)
for so in "$tmp"/whl/kvpq/lib/*.so; do
  rp=$(readelf -d "$so" | awk '/\((RUNPATH|RPATH)\)/ {print $NF}' | tr -d '[]')
  for d in ${rp//:/ }; do
    case "$d" in '$ORIGIN'*) ;; *) fail "$(basename "$so") run path $d is not \$ORIGIN-relative";; esac
  done
done
[ -f "$tmp/whl/kvpq/py.typed" ] || fail "wheel lacks kvpq/py.typed"
for l in openblas pcre2-8 cjson gomp; do
  ls "$tmp"/whl/kvpq.libs/lib$l* >/dev/null 2>&1 || fail "wheel lacks its copy of lib$l"
done
echo "artifacts: $(basename "$sdist") ($(wc -l < "$tmp/sdist.txt") files, C sources in), $(basename "$wheel")" \
  "($(du -k "$wheel" | cut -f1) KiB; auditwheel: consistent with $tag; run paths \$ORIGIN-relative)"

# ---- install each into a fresh venv, use it from outside the tree ----
model_arg=(); [ -f "$model" ] && model_arg=("$model")
probe() {  # probe KIND ARTIFACT [prefix command...]
  local kind=$1 art=$2; shift 2
  python3 -m venv "$tmp/venv_$kind"
  t0=$(date +%s)
  KVPQ_CUDA=OFF "$tmp/venv_$kind/bin/pip" install -q "$art"
  echo "pip install $(basename "$art"): $(( $(date +%s) - t0 )) s"
  (cd "$tmp" && env -u KVPQ_LIB -u KVPQ_INCLUDE -u KVPQ_SOURCE_DIR -u PYTHONPATH "$@" \
     "$tmp/venv_$kind/bin/python" "$tmp/src/tests/dist_probe.py" "$kind" "$tmp/logits_$kind.npy" "${model_arg[@]}")
}
# The system's copies of the libraries the wheel bundles; /dev/null is mounted over each (PCRE2 last:
# mount itself loads it). The namespace ends with the command.
hidden_libs=()
for n in libopenblas.so.0 libcjson.so.1 libgomp.so.1 libgfortran.so.5 libquadmath.so.0 libpcre2-8.so.0; do
  # awk reads to the end: an early exit would kill ldconfig with SIGPIPE when its list exceeds the pipe
  # buffer, and pipefail would then end this script without a word (seen on CI).
  p=$(ldconfig -p | awk -v n="$n" '$1 == n && !found {print $NF; found = 1}')
  [ -n "$p" ] && hidden_libs+=("$(realpath "$p")")
done
cat > "$tmp/hidden.sh" <<'SH'
# hidden.sh FILE... -- COMMAND...: COMMAND with /dev/null mounted over each FILE (private namespace)
while [ "$1" != -- ]; do mount --bind /dev/null "$1"; shift; done
shift; exec "$@"
SH
if unshare -m --propagation private true 2>/dev/null; then
  echo "wheel: run with the system's copies hidden: ${hidden_libs[*]}"
  probe wheel "$wheel" unshare -m --propagation private bash "$tmp/hidden.sh" "${hidden_libs[@]}" --
else
  echo "dist_check: unshare not allowed here: system libraries not hidden; /proc/self/maps checked instead"
  probe wheel "$wheel"
fi
probe sdist "$sdist"
if [ ${#model_arg[@]} -gt 0 ]; then
  python3 - "$tmp/logits_wheel.npy" "$tmp/logits_sdist.npy" <<'PY'
import sys, numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
d = float(np.abs(a - b).max())
assert a.argmax() == b.argmax() and d <= 1e-3, ("wheel and sdist logits differ", d)
print(f"wheel and sdist installs: same next token, logits max |diff| {d:.3g}")
PY
else
  echo "dist_check: no model at $model: forward pass not compared"
fi
echo "dist_check: 1 passed, 0 failed"
