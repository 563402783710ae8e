#!/bin/bash
# device call 2 (GPU engineer, session 12): main's tensor-core attention kernel ("base") against build A
# (the cluster merge only for one split or for <= 8 splits of one-CTA-per-SM kernels; merge slots with o
# 16-byte aligned (kTcSO 4: vector slot stores and read-modify-writes); the window's q / k / v rows as
# 16-byte loads). Both KVPQ_ATTEND_DEV_SHAPES builds from the development machine, as in call 1. Then the
# co-resident cluster counts (cudaOccupancyMaxActiveClusters, sizes 1-16) of the 8- and 16-warp kernels,
# natural and padded to one CTA per SM, and clusters of 16 one-CTA-per-SM 8-warp CTAs at b1 (KVPQ_DEV_PAD,
# KVPQ_DEV_CLUSTER_WIDE: tuning knobs of the dev build only).
set -u
D=$(cd "$(dirname "$0")" && pwd); O=/tmp/o; rm -rf $O; mkdir -p $O
export LD_LIBRARY_PATH=$D/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
for r in 1 2; do
  for v in base A; do
    t0=$SECONDS
    if [ $v = base ]; then timeout 170 $D/bin/base/gpu_bench_kernels attends > $O/attends_${v}_$r.txt 2>&1
    else KVPQ_BENCH_ATTEND_VARIANTS=5679 timeout 170 $D/bin/A/gpu_bench_kernels attends > $O/attends_${v}_$r.txt 2>&1; fi
    echo "$v run $r exit $? in $((SECONDS-t0)) s" | tee -a $O/env.txt
  done
done
{ KVPQ_DEV_CLUSTER_REPORT=1 KVPQ_BENCH_ATTEND_VARIANTS=67 $D/bin/A/gpu_bench_kernels attend 1 4096
  KVPQ_DEV_PAD=120000 KVPQ_DEV_CLUSTER_REPORT=1 KVPQ_BENCH_ATTEND_VARIANTS=6 $D/bin/A/gpu_bench_kernels attend 1 4096; } 2>&1 | grep cluster_report | tee $O/cluster_report.txt
for r in 1 2; do for s in "1 4096" "1 32768" "8 32768"; do
  echo "pad16 $s run $r: $(KVPQ_DEV_PAD=120000 KVPQ_DEV_CLUSTER_WIDE=16 KVPQ_BENCH_ATTEND_VARIANTS=69 timeout 60 $D/bin/A/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $O/pad.txt
  echo "base $s run $r: $(timeout 60 $D/bin/base/gpu_bench_kernels attend $s 2>&1 | grep -E '"op"|rror' | head -2)" >> $O/pad.txt
done; done
python3 - $O > $O/summary.txt <<'PY'
import json,sys,glob,os,collections
O=sys.argv[1]; rows=collections.defaultdict(dict)
for f in sorted(glob.glob(O+'/attends_*.txt')):
    v,r=os.path.basename(f)[8:-4].split('_')
    for line in open(f):
        if not line.startswith('{"op"'): continue
        d=json.loads(line); rows[(d['op'],d['B'],d['L'])][(v,r)]=d
print(f"{'shape':22s} {'base tc r1/r2':>16s} {'A tc r1/r2':>16s} {'A nocl r1/r2':>16s} {'b tc8':>7s} {'A tc8':>7s} {'b tc16':>7s} {'A tc16':>7s}  fnv base==A (tc,tc8,tc16) A tc==nocl")
for k in sorted(rows):
    x=rows[k]; g=lambda v,r,key: x.get((v,r),{}).get('variant_us',{}).get(key,float('nan'))
    fb=x.get(('base','1'),{}).get('out_fnv',[]); fa=x.get(('A','1'),{}).get('out_fnv',[])
    eq=[a==b for a,b in zip(fb[:3],fa[:3])]; nc=(fa[0]==fa[4]) if len(fa)>4 else None
    print(f"{k[0]+' B'+str(k[1])+' L'+str(k[2]):22s} {g('base','1','tc'):7.2f}/{g('base','2','tc'):7.2f} {g('A','1','tc'):7.2f}/{g('A','2','tc'):7.2f} {g('A','1','tc_nocluster'):7.2f}/{g('A','2','tc_nocluster'):7.2f} {g('base','1','tc_8warps'):7.2f} {g('A','1','tc_8warps'):7.2f} {g('base','1','tc_16warps'):7.2f} {g('A','1','tc_16warps'):7.2f}  {eq} {nc}")
for line in open(O+'/pad.txt'):
    tag,js=line.split(': ',1)
    try: d=json.loads(js); v=d['variant_us']
    except Exception: print(tag,'FAILED',js[:200]); continue
    print(f"{tag:26s} tc {v['tc']:7.2f} tc8 {v['tc_8warps']:7.2f} " + (f"nocl {v['tc_nocluster']:7.2f} fnv8 {d['out_fnv'][1][:8]}" if 'tc_nocluster' in v else f"fnv8 {d['out_fnv'][1][:8]}"))
PY
cat $O/summary.txt $O/cluster_report.txt
cd $O && tar czf $OUT/call2.tgz . ; cp $O/summary.txt $OUT/
