#!/bin/bash
# device call 1 (GPU engineer, session 12): main's tensor-core attention kernel ("base") against the
# split merge through a thread-block cluster ("new": attend_cluster = 1, its variant "tc_nocluster" the
# workspace-and-counter merge of main in the same binary), both KVPQ_ATTEND_DEV_SHAPES builds made on the
# development machine (nvcc 13.0, -DKVPQ_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DKVPQ_TESTS=OFF
# -DCMAKE_CUDA_ARCHITECTURES=90-real -DCMAKE_CUDA_FLAGS=-DKVPQ_ATTEND_DEV_SHAPES, target gpu_bench_kernels).
# `gpu_bench_kernels attends` (every attention shape, plain and norm-explicit, 20 launches per graph,
# median of 15 replays) alternated base, new, base, new; out_fnv compares output bits across builds.
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
for r in 1 2; do for v in base new; do
  t0=$SECONDS
  timeout 170 $D/bin/$v/gpu_bench_kernels attends > $O/attends_${v}_$r.txt 2>&1; echo "$v run $r exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
done; done
cuobjdump -sass $D/bin/new/gpu_bench_kernels 2>/dev/null | grep -oE "(UCGABAR_[A-Z]+|CGAERRBAR|MAPA|LD\.E[.A-Z0-9]*|LDS[.A-Z0-9]*)" | sort | uniq -c > $O/sass_ops_new.txt
python3 - $O > $O/summary.txt <<'PY'
import json,sys,glob,os,collections
O=sys.argv[1]; rows=collections.defaultdict(dict)
for f in sorted(glob.glob(O+'/attends_*.txt')):
    v,r=os.path.basename(f)[8:-4].split('_')
    for line in open(f):
        if not line.startswith('{"op"'): continue
        d=json.loads(line); k=(d['op'],d['B'],d['L'])
        rows[k][(v,r)]=d
print(f"{'shape':22s} {'base tc r1/r2':>16s} {'new tc r1/r2':>16s} {'new nocl r1/r2':>16s} {'new tc8':>8s} {'new tc16':>8s} {'new nopdl':>9s} fnv base==new(tc,tc8,tc16,nopdl) new tc==nocl")
for k in sorted(rows):
    x=rows[k]; g=lambda v,r,key: x.get((v,r),{}).get('variant_us',{}).get(key,float('nan'))
    fb=x.get(('base','1'),{}).get('out_fnv',[]); fn=x.get(('new','1'),{}).get('out_fnv',[])
    eq=[a==b for a,b in zip(fb,fn)]; nc=(fn[0]==fn[4]) if len(fn)>4 else None
    print(f"{k[0]+' B'+str(k[1])+' L'+str(k[2]):22s} {g('base','1','tc'):7.2f}/{g('base','2','tc'):7.2f} {g('new','1','tc'):7.2f}/{g('new','2','tc'):7.2f} {g('new','1','tc_nocluster'):7.2f}/{g('new','2','tc_nocluster'):7.2f} {g('new','1','tc_8warps'):8.2f} {g('new','1','tc_16warps'):8.2f} {g('new','1','tc_nopdl'):9.2f} {eq} {nc}")
PY
cat $O/summary.txt; cat $O/sass_ops_new.txt | head -20
cd $O && tar czf $OUT/call1.tgz . ; cp $O/summary.txt $OUT/
