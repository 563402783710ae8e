# Sourced by the device scripts of this folder: unpack the carried files (xz, by Python's lzma: the
# device image may lack xz), set the library path, record the device, define `step`.
cd "$(dirname "${BASH_SOURCE[0]}")"
O=${1:-$OUT}
for f in bins/*.xz libs/*.xz data/*.xz; do
  [ -e "$f" ] || continue
  [ -e "${f%.xz}" ] || python3 -c "import lzma, sys; open(sys.argv[2], 'wb').write(lzma.open(sys.argv[1]).read())" "$f" "${f%.xz}"
done
chmod +x bins/* 2>/dev/null
export LD_LIBRARY_PATH=$(pwd)/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
date -u | tee -a $O/env.txt
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee -a $O/env.txt
# step NAME CMD...: CMD's output to $O/NAME.log, its exit status and seconds to $O/summary.txt
step() { local name=$1; shift; local t0=$SECONDS; "$@" > $O/$name.log 2>&1; local st=$?
         echo "$name: exit $st in $((SECONDS - t0)) s" | tee -a $O/summary.txt; }
