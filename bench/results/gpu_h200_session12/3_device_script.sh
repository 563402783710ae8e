#!/bin/bash
# device call 3 (GPU engineer, session 12): main's kernel ("base") against three KVPQ_ATTEND_DEV_SHAPES
# builds of this branch (development machine, nvcc 13.0, flags as in call 1 plus):
#   B: the cluster merge only (-DKVPQ_TC_SLOT_OFF=2 -DKVPQ_WIN_VEC=0 -DKVPQ_TC_WINDOW_WARPS=0: main's slots,
#      scalar window loads, no window warps)
#   F: B + window warps (16-warp CTAs with 8 tile-taking warps at a short batch; -DKVPQ_TC_SLOT_OFF=2 -DKVPQ_WIN_VEC=0)
#   E: F + 16-byte-aligned slots and 16-byte window loads (the branch's defaults)
# `gpu_bench_kernels attends` alternated base, B, F, E twice (new builds: variants tc, tc_8warps, tc_16warps,
# tc_nocluster only). Then gpu_check's attention checks (every tensor-core variant, 5-8; no encode checks)
# on the full build of this branch (E's defaults; -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF
# -DKVPQ_WERROR=ON -DCMAKE_CUDA_ARCHITECTURES=90-real).
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
for r in 1 2; do
  for v in base B F E; do
    t0=$SECONDS
    if [ $v = base ]; then timeout 170 $D/bin/base/gpu_bench_kernels attends > $O/attends_${v}_$r.txt 2>&1
    else KVPQ_BENCH_ATTEND_VARIANTS=5679 timeout 170 $D/bin/$v/gpu_bench_kernels attends > $O/attends_${v}_$r.txt 2>&1; fi
    echo "$v run $r exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
  done
done
t0=$SECONDS
KVPQ_ENCODE_VARIANTS= KVPQ_ATTEND_VARIANTS=5678 timeout 240 $D/full/gpu_check > $O/gpu_check_attend.log 2>&1; echo "gpu_check (attention, variants 5-8) exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
grep -E "FAIL|seed|passed|failed" $O/gpu_check_attend.log | head -20
python3 - $O > $O/summary.txt <<'PY'
import json,sys,glob,os,collections
O=sys.argv[1]; rows=collections.defaultdict(dict)
for f in sorted(glob.glob(O+'/attends_*.txt')):
    v,r=os.path.basename(f)[8:-4].split('_')
    for line in open(f):
        if not line.startswith('{"op"'): continue
        d=json.loads(line.replace(': inf',': null')); rows[(d['op'],d['B'],d['L'])][(v,r)]=d
vs=['base','B','F','E']
print(f"{'shape':20s} " + ' '.join(f"{v+' tc':>15s}" for v in vs) + f" {'b tc8':>6s} {'E tc8':>6s} {'F tc8':>6s} {'E nocl':>6s} {'b tc16':>6s} {'E tc16':>6s}  fnv base==B tc, B tc==nocl")
for k in sorted(rows):
    x=rows[k]; g=lambda v,r,key: (x.get((v,r),{}).get('variant_us',{}).get(key) or float('nan'))
    fb=x.get(('base','1'),{}).get('out_fnv',[]); fB=x.get(('B','1'),{}).get('out_fnv',[])
    print(f"{k[0]+' B'+str(k[1])+' L'+str(k[2]):20s} " + ' '.join(f"{g(v,'1','tc'):7.2f}/{g(v,'2','tc'):7.2f}" for v in vs) +
          f" {g('base','1','tc_8warps'):6.2f} {g('E','1','tc_8warps'):6.2f} {g('F','1','tc_8warps'):6.2f} {g('E','1','tc_nocluster'):6.2f} {g('base','1','tc_16warps'):6.2f} {g('E','1','tc_16warps'):6.2f}  {fb[:1]==fB[:1]} {fB[0]==fB[4] if len(fB)>4 else None}")
PY
cat $O/summary.txt
cd $O && tar czf $OUT/call3.tgz . ; cp $O/summary.txt $O/gpu_check_attend.log $OUT/
