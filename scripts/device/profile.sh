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
pyc=False; [ -n "$causal" ] && pyc=True
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
cat > "$OUT/torch_step.py" <<PY
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
d, s, causal = $d, $s, $pyc
b, h = 16384 // s, 2048 // d
q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v): t.requires_grad_(True)
with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    torch.autograd.grad(o, (q, k, v), do.transpose(1, 2))
torch.cuda.synchronize()
PY
ncu_one torch-fwd 'flash_fwd' python3 "$OUT/torch_step.py"
ncu_one torch-bwd 'flash_bwd_dq_dk_dv|flash_bwd_kernel' python3 "$OUT/torch_step.py"
