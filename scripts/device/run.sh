#!/usr/bin/env bash
# There (GPU machine, no Rust): run every test (GPU tests included), the example, the sanitizer
# on the small GPU tests, the benches and the peers. Logs and JSON go under $OUT.
# Usage: [PEERS=0] [BENCH=0] bash .device/run.sh [--quick]
#   (--quick: fewer peer shapes; PEERS=0: no peers; BENCH=0: tests and sanitizers alone)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[ -f "$here/bin.tar.xz" ] && [ ! -d "$here/bin" ] && tar -C "$here" -xJf "$here/bin.tar.xz"
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
commit=$(tr '\n' ' ' < "$here/COMMIT" | sed 's/ $//; s/ //g')
log="$OUT/run.log"
failures=()

step() {  # step NAME CMD...: run, log, remember failure
  local name=$1; shift
  echo "=== $name" | tee -a "$log"
  local t0=$(date +%s)
  "$@" >> "$log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc ($(( $(date +%s) - t0 )) s)" | tee -a "$log"
  [ $rc -eq 0 ] || failures+=("$name")
}

. "$here/nccl_env.sh"
step nvidia-smi nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
for t in "$here"/bin/test-*; do
  step "$(basename "$t")" "$t" --include-ignored --show-output --test-threads=4 --skip nccl
done
# The rings over NCCL on their own: a rank that fails early leaves the others waiting.
# shellcheck disable=SC2086  # SKIP_TWO_DEVICES: two words or none
step nccl timeout -k 10 240 "$here/bin/test-gpu_varlen" --include-ignored --show-output \
  --test-threads=1 nccl $SKIP_TWO_DEVICES
# The self-test steps below run it only in a bundle built with the `selftest` feature.
"$here/bin/test-gpu" --list --include-ignored 2>/dev/null | grep -q '^selftest_tma_wgmma_matches_cpu: test' ||
  failures+=("selftest-missing (bundle built without --features selftest)")
for tool in memcheck racecheck synccheck; do
  step "sanitizer-$tool" compute-sanitizer --tool $tool --error-exitcode 9 \
    "$here/bin/test-gpu" --include-ignored --test-threads=1 selftest
  step "sanitizer-$tool-fwd" compute-sanitizer --tool $tool --error-exitcode 9 \
    "$here/bin/test-gpu_fwd" --include-ignored --test-threads=1 sanitizer
  step "sanitizer-$tool-bwd" compute-sanitizer --tool $tool --error-exitcode 9 \
    "$here/bin/test-gpu_bwd" --include-ignored --test-threads=1 sanitizer
  step "sanitizer-$tool-fp8" compute-sanitizer --tool $tool --error-exitcode 9 \
    "$here/bin/test-gpu_fp8" --include-ignored --test-threads=1 pre_quantized
  step "sanitizer-$tool-varlen" compute-sanitizer --tool $tool --error-exitcode 9 \
    "$here/bin/test-gpu_varlen" --include-ignored --test-threads=1 sanitizer
done
# Refused calls, broadcast inputs and the tile order over many blocks, under memcheck.
step sanitizer-memcheck-validation compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$here/bin/test-gpu_validation" --include-ignored --test-threads=1
step sanitizer-memcheck-tile-order compute-sanitizer --tool memcheck --error-exitcode 9 \
  "$here/bin/test-gpu_tile_order" --include-ignored --test-threads=1
step quickstart "$here/bin/example-quickstart"
if [ "${BENCH:-1}" = 0 ]; then
  grep -E "^(test result|selftest|device:|dispatch|backend|device forward)" "$log"
  echo "commit $commit; failed steps: ${failures[*]:-none}"
  [ ${#failures[@]} -eq 0 ]
  exit
fi
step fp8-accuracy "$here/bin/example-fp8_accuracy" --out "$OUT/fp8_accuracy.json" --commit "$commit"
step bench-fp8 "$here/bin/example-bench_fp8" --out "$OUT/fp8_fwd.json" --commit "$commit"
step bench-table "$here/bin/example-bench_table" --out "$OUT/sm90_fwd.json" --commit "$commit"
step bench-varlen "$here/bin/example-bench_varlen" --out "$OUT/varlen.json" \
  --mixes-out "$OUT/varlen_mixes.json" --commit "$commit"
peers=()
[ "${1:-}" = "--quick" ] && peers+=(--quick)
if [ "${PEERS:-1}" = 1 ]; then
  step peers python3 "$here/compare_torch.py" --out "$OUT/peers.json" --commit "$commit" "${peers[@]}"
  step varlen-peers python3 "$here/varlen_peers.py" --mixes "$OUT/varlen_mixes.json" \
    --out "$OUT/varlen_peers.json" --commit "$commit"
fi
python3 "$here/table.py" "$OUT"/*.json >> "$log" 2>&1

grep -E "^(test result|selftest|device:|dispatch|backend|device forward)" "$log"
echo "commit $commit; failed steps: ${failures[*]:-none}"
[ ${#failures[@]} -eq 0 ]
