#!/usr/bin/env bash
# There (GPU machine): Nsight Compute on one shape, ours (sm80 family, forced) beside torch SDPA's
# FLASH backend (FlashAttention-2), forward and backward main kernels, one launch each. Clocks left
# alone (--clock-control none).
#   bash .device/profile.sh D S [causal]           sections, text: $OUT/ncu-*.txt
#   bash .device/profile.sh --source D S [causal]  per-SASS-instruction stall samples, CSV:
#                                                  $OUT/src-*.csv (and the .ncu-rep reports)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
source_mode=0
[ "${1:-}" = "--source" ] && { source_mode=1; shift; }
d=$1; s=$2; causal=${3:-}
tag="d${d}-s${s}${causal:+-causal}"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
          --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis
          --section MemoryWorkloadAnalysis --section InstructionStats)
one() {  # one NAME KERNEL_REGEX CMD...
  local name=$1 regex=$2; shift 2
  if [ $source_mode = 0 ]; then
    ncu --clock-control none "${sections[@]}" -k "regex:$regex" -c 1 --print-summary none \
      "$@" > "$OUT/ncu-$tag-$name.txt" 2>&1
    echo "ncu $name rc=$?"
    return
  fi
  local rep="$OUT/src-$tag-$name"
  ncu --clock-control none --section WarpStateStats --section SourceCounters \
    -k "regex:$regex" -c 1 -f -o "$rep" "$@" > "$rep.log" 2>&1
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2>>"$rep.log"
  echo "$name: $(wc -l < "$rep.csv") lines"
}
only="$d,$s${causal:+,causal},sm80"
one ours-fwd 'fwd_kernel' "$here/bin/example-bench_table" --only "$only"
one ours-bwd 'bwd_kernel' "$here/bin/example-bench_table" --only "$only"
one torch-fwd 'flash_fwd' python3 "$here/torch_step.py" "$d" "$s" $causal
one torch-bwd 'flash_bwd_dq_dk_dv|flash_bwd_kernel' python3 "$here/torch_step.py" "$d" "$s" $causal
