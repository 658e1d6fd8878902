#!/usr/bin/env bash
# There: per-SASS-instruction stall samples (ncu source page, CSV) for one kernel launch, ours or
# torch FLASH's, so that two kernels' stalls can be compared line by line.
# Usage: bash .device/profile_source.sh D S [causal]   (writes $OUT/src-*.csv and *.ncu-rep)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
d=$1; s=$2; causal=${3:-}
tag="d${d}-s${s}${causal:+-causal}"
one() {  # one NAME KERNEL_REGEX CMD...
  local name=$1 regex=$2; shift 2
  local rep="$OUT/src-$tag-$name"
  ncu --clock-control none --section WarpStateStats --section SourceCounters \
    --metrics smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle \
    -k "regex:$regex" -c 1 -f -o "$rep" "$@" > "$rep.log" 2>&1
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.csv" 2>>"$rep.log"
  ncu -i "$rep.ncu-rep" --page raw --csv 2>>"$rep.log" | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
if len(rows) >= 3:
    for name, unit, val in zip(rows[0], rows[1], rows[2]):
        if "stall" in name and "pcsamp" in name: print(name, val)
' > "$rep.stalls.txt"
  echo "$name: $(wc -l < "$rep.csv") lines"
}
only="$d,$s${causal:+,causal},sm80"
one ours-fwd 'fwd_kernel' "$here/bin/example-bench_table" --only "$only"
one ours-bwd 'bwd_kernel' "$here/bin/example-bench_table" --only "$only"
one torch-fwd 'flash_fwd' python3 "$here/torch_step.py" "$d" "$s" $causal
one torch-bwd 'flash_bwd_dq_dk_dv' python3 "$here/torch_step.py" "$d" "$s" $causal
