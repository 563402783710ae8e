#!/bin/bash
# check_docs.sh — run every command that README.md and docs/*.md show in their indented or fenced
# command blocks, as written but with small settings, and fail if any fails (registered in ctest as
# check_docs). Commands run in a scratch folder that holds only links to the clone's models/ and
# data/ (paths in the docs are relative to the clone's root; outputs land in the scratch folder),
# with the kvpq of this build first on PATH, in one bash session per block (so `M=...` carries on).
# Small settings are appended (later options win): calibrate --tokens 128 --ctx 64 --iters 1 (and
# budgets of 32 bits with --bits / --bits-also: no allocation fits 2.5 bits at 64 positions),
# ppl --ctx 64 --chunks 1, generate -n 4, chat -n 4 (a command may read stdin from printf/echo |), bench encode --shape 256,2,64 --repeats 1, bench attend
# --ctx 256 --layers 1 --repeats 1, bench decode --ctx 32 --steps 2. Not run, by name: the main job
# and the CI script (hours; they run on their own) and the cmake lines (this build and
# tests/install_check.sh run them).
# Usage: scripts/check_docs.sh [KVPQ_BIN]   (default build/kvpq)
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(realpath "${1:-${KVPQ_BIN:-$root/build/kvpq}}")
[ -x "$bin" ] || { echo "check_docs: no kvpq binary at $bin (build first)" >&2; exit 2; }
[ -e "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" ] ||
  { echo "check_docs: models/SmolLM2-135M-Instruct.Q4_1.gguf missing (scripts/fetch_model.sh); skipped" >&2; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/bin" "$work/run"
ln -s "$bin" "$work/bin/kvpq"
mkdir -p "$work/run/build"
ln -s "$bin" "$work/run/build/kvpq" # docs that say build/kvpq
ln -s "$root/models" "$work/run/models"
ln -s "$root/data" "$work/run/data"

python3 - "$root" "$work" <<'EOF'
import glob, os, re, sys
root, work = sys.argv[1], sys.argv[2]
CMD = re.compile(r"^(?:    |\t)\s*((?:\./)?(?:build/)?kvpq\s|(?:printf|echo)\s.*\|\s*(?:\./)?(?:build/)?kvpq\s|[A-Z_]+=\S*\s*$|[A-Z_]+=\S+\s+(?:\./)?(?:build/)?kvpq\s|\./scripts/|scripts/|cmake\s|bench/)")
SKIP = re.compile(r"^(\./)?scripts/(main_job|test|deps|fetch_model|build_wheel)\.sh|^cmake\s|^bench/")
SMALL = [(r"\bkvpq calibrate\b", " --tokens 128 --ctx 64 --iters 1"), (r"\bkvpq ppl\b", " --ctx 64 --chunks 1"),
         (r"\bkvpq generate\b", " -n 4"), (r"\bkvpq chat\b", " -n 4"), (r"\bkvpq bench encode\b", " --shape 256,2,64 --repeats 1"),
         (r"\bkvpq bench attend\b", " --ctx 256 --layers 1 --repeats 1"), (r"\bkvpq bench decode\b", " --ctx 32 --steps 2")]
def strip_comment(cmd):
    """The command without a trailing shell comment (a # after a blank, outside quotes)."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and cmd[i - 1] in " \t":
            return cmd[:i].rstrip()
    return cmd


blocks = []
for f in ["README.md"] + sorted(glob.glob(os.path.join(root, "docs", "*.md"))):
    path = os.path.join(root, f) if not os.path.isabs(f) else f
    lines = open(path, encoding="utf-8").read().split("\n")
    block, i = [], 0
    while i < len(lines):
        m = CMD.match(lines[i])
        if m:
            start = i + 1
            cmd = lines[i].strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1].rstrip() + " " + lines[i].strip()
            block.append((os.path.relpath(path, root), start, cmd))
        elif block and lines[i].strip() == "" or (block and not lines[i].startswith(("    ", "\t"))):
            blocks.append(block)
            block = []
        i += 1
    if block:
        blocks.append(block)
n = 0
with open(os.path.join(work, "plan.sh"), "w") as out:
    for b, block in enumerate(blocks):
        out.write(f"( cd run\n")
        for f, line, cmd in block:
            shown = strip_comment(cmd)
            if SKIP.match(shown):
                out.write(f"  echo 'check_docs: {f}:{line}: skipped (runs on its own): {shown[:60]}'\n")
                continue
            run = re.sub(r"^(\./)?(build/)?kvpq\b", "kvpq", shown)
            run = re.sub(r"^([A-Z_]+=\S+\s+)(\./)?(build/)?kvpq\b", r"\1kvpq", run)
            for pat, extra in SMALL:
                if re.search(pat, run):
                    run += extra
            if re.search(r"\bkvpq calibrate\b.*--bits\b", run):  # budgets that fit at --ctx 64 (codebooks' bytes)
                run = re.sub(r"--bits-also ([\"'])[0-9.]+ ", r"--bits-also \g<1>32 ", run) + " --bits 32"
            q = shown.replace("'", "'\\''")
            out.write(f"  echo 'check_docs: {f}:{line}: {q[:100]}'\n")
            out.write(f"  {run} > /dev/null 2> err.txt || {{ echo \"check_docs: FAILED {f}:{line}: {q}\"; "
                      f"cat err.txt; exit 1; }}\n")
            n += 1
        out.write(") || fail=1\n")
print(f"check_docs: {n} documented commands in {len(blocks)} blocks", file=sys.stderr)
EOF
fail=0
cd "$work" && export PATH="$work/bin:$PATH" KVPQ_PROGRESS_SECONDS=60 && source ./plan.sh
[ "$fail" = 0 ] && echo "check_docs: every documented command ran" || echo "check_docs: some documented commands FAILED"
exit "$fail"
