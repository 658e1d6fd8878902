#!/usr/bin/env bash
# There (GPU machine, no Rust): the candle op on candle's CUDA tensors — its GPU tests and the
# training example — from the binaries candle_bundle.sh packed under .device/candle. candle-core
# links cuBLAS, cuRAND and NVRTC: the machine's PyTorch install has them (CUDA 13).
# Usage: [TESTS=0] [TRAIN=0] bash .device/candle.sh [train_lm arguments...]
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$here/out}
mkdir -p "$OUT"
bin="$here/candle"
[ -f "$bin.tar.xz" ] && [ ! -d "$bin" ] && tar -C "$here" -xJf "$bin.tar.xz"
cublas=$(find / -name 'libcublas.so.13' -path '*nvidia*' 2>/dev/null | head -1)
[ -n "$cublas" ] || { echo "no libcublas.so.13 under an nvidia folder"; exit 1; }
export LD_LIBRARY_PATH="$(dirname "$cublas"):${LD_LIBRARY_PATH:-}"
commit=$(tr "\n" " " < "$bin/COMMIT" | sed "s/ $//; s/ //g")
rc=0
if [ "${TESTS:-1}" = 1 ]; then
  "$bin/test-gpu_candle" --include-ignored --show-output --test-threads=1 \
    > "$OUT/gpu_candle.log" 2>&1 || rc=1
  grep -E "^test |test result" "$OUT/gpu_candle.log"
fi
if [ "${TRAIN:-1}" = 1 ]; then
  # The progress bar goes to stderr, rewritten in place: keep its last state per run.
  "$bin/example-train_lm" --out "$OUT/train_lm.json" --commit "$commit" "$@" \
    > "$OUT/train_lm.log" 2> >(tr '\r' '\n' | grep -v '^$' | awk 'NR % 50 == 0' > "$OUT/train_lm.progress") || rc=1
  cat "$OUT/train_lm.log"
fi
exit $rc
