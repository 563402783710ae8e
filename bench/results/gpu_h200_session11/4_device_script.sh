#!/bin/bash
# device call 4 (device helper, session 11), the last: (a) main's tensor-core attention kernel
# ("base") against window CTAs ("new", 3b_attend_window_ctas.diff), both KVPQ_ATTEND_DEV_SHAPES
# builds, alternated twice; (b) on the final tree: build B (this branch + window CTAs) if "new" is
# faster at b1@4k by > 0.3 us in both runs and no more than 1% slower elsewhere, else build A (this
# branch, attention as at main): gpu_check, compute-sanitizer memcheck and racecheck at the same time
# (run_gpu_tests.sh, KVPQ_GPU_PARALLEL=1, KVPQ_NO_BENCH=1), then bench/gpu_bench.py and
# bench/gpu_decode_step.py. Both builds: development machine, nvcc 13.0, -DKVPQ_CUDA=ON
# -DCMAKE_CUDA_ARCHITECTURES=90-real, Release; they travel as one tar.xz (the three binaries of a build
# share their kernels, which xz's window folds).
set -u
cd "$(dirname "$0")/../../.."
W=$(cd .. && pwd); O=/tmp/o; mkdir -p $O
python3 -c "import tarfile; tarfile.open('$W/bins/bins.tar.xz').extractall('$W')" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/whl/*.whl && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH=$W/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
python3 -c "import torch; print('torch', torch.__version__)" | tee -a $O/env.txt
for s in "1 4096" "1 32768" "8 32768"; do
  for r in 1 2; do for v in base new; do
    echo "$v $s run $r: $(timeout 60 $W/devbin/$v/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $O/times.txt
  done; done
done
python3 - $O/times.txt $O/choice.txt <<'PY'
import json,sys,collections
t=collections.defaultdict(dict)
for line in open(sys.argv[1]):
    tag,js=line.split(': ',1)
    try: d=json.loads(js)
    except Exception: print(tag,'FAILED',js[:300]); continue
    v=d['variant_us']
    print(f"{tag:24s} tc {v['tc']:7.2f} tc8 {v['tc_8warps']:7.2f} tc16 {v['tc_16warps']:7.2f} nopdl {v['tc_nopdl']:7.2f} fnv {' '.join(x[:8] for x in d['out_fnv'])}")
    w=tag.split(); t[(w[1],w[2])].setdefault(w[0],[]).append(v['tc'])
ok=len(t)==3
for k,x in t.items():
    b,n=x.get('base',[]),x.get('new',[])
    if len(b)!=2 or len(n)!=2: ok=False; continue
    if k==('1','4096'): ok = ok and all(nn < bb - 0.3 for nn,bb in zip(n,b))
    else: ok = ok and sum(n) <= 1.01*sum(b)
open(sys.argv[2],'w').write('B' if ok else 'A')
print('choice:', 'B (window CTAs)' if ok else 'A (attention as at main)')
PY
C=$(cat $O/choice.txt); BD=$W/build$C
t0=$SECONDS
KVPQ_GPU_PARALLEL=1 KVPQ_NO_BENCH=1 timeout 330 tests/gpu/run_gpu_tests.sh $BD $O/checks > $O/checks.out 2>&1; echo "run_gpu_tests (build $C) exit $? in $((SECONDS-t0)) s"
date -u
grep -E "FAIL|passed|clean|skipped|seed" $O/checks.out | head -12
tail -n 2 $O/checks/sanitizer_memcheck.log $O/checks/sanitizer_racecheck.log 2>/dev/null
cat $O/checks/*.status 2>/dev/null
t0=$SECONDS
timeout 150 python3 bench/gpu_bench.py --bin $BD/gpu_bench_kernels --out $O/bench > $O/bench.log 2>&1; echo "gpu_bench exit $? in $((SECONDS-t0)) s"
t0=$SECONDS
timeout 80 python3 bench/gpu_decode_step.py --lib $BD/libkvpq.so --out $O/step > $O/step.log 2>&1; echo "decode_step exit $? in $((SECONDS-t0)) s"
date -u
cd $O && tar czf $OUT/res.tgz . 2>/dev/null; cp $O/times.txt $O/checks.out $O/bench.log $O/step.log $OUT/ 2>/dev/null
grep -A5 "^| S | H | D" $O/bench/table.md | head -6
grep -A8 "^| B | context | SDPA fp16 | SDPA GB" $O/bench/table.md | head -8
grep -A8 "^| B | context | SDPA eager" $O/step/decode_step.md
python3 - $O/bench/results.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
for e in (d.get('encode') or []):
    print('encode', e['S'], e['H'], e['D'], e['dsub'], 'variant_us', e.get('variant_us'))
PY
tail -2 $O/step.log | cut -c1-300
