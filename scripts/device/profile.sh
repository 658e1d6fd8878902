#!/usr/bin/env bash
# There (GPU machine): Nsight Compute on one shape, ours (sm80 family, forced) beside torch SDPA's
# FLASH backend (FlashAttention-2), forward and backward main kernels, one launch each. Reports
# (text, details page) go under $OUT/ncu-*.txt. Clocks left alone (--clock-control none).
# Usage: bash .device/profile.sh D S [causal]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
d=$1; s=$2; causal=${3:-}
tag="d${d}-s${s}${causal:+-causal}"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
          --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis
          --section MemoryWorkloadAnalysis --section InstructionStats)
ncu_one() {  # ncu_one NAME KERNEL_REGEX CMD...
  local name=$1 regex=$2; shift 2
  ncu --clock-control none "${sections[@]}" -k "regex:$regex" -c 1 --print-summary none \
    "$@" > "$OUT/ncu-$tag-$name.txt" 2>&1
  echo "ncu $name rc=$?"
}
only="$d,$s${causal:+,causal},sm80"
ncu_one ours-fwd 'fwd_kernel' "$here/bin/example-bench_table" --only "$only"
ncu_one ours-bwd 'bwd_kernel' "$here/bin/example-bench_table" --only "$only"
ncu_one torch-fwd 'flash_fwd' python3 "$here/torch_step.py" "$d" "$s" $causal
ncu_one torch-bwd 'flash_bwd_dq_dk_dv|flash_bwd_kernel' python3 "$here/torch_step.py" "$d" "$s" $causal
