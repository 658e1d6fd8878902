// Host side of the sm90 FP8 forward: its tile table and launch, included by the three
// fwd_fp8_d*.cu units alone, so that retuning a tile rebuilds those (and the units that read the
// key block, fp8_layout.h: the quantize step) and no bf16/fp16 forward.
#pragma once

#include <cutlass/float8.h>

#include "fp8_layout.h"
#include "fwd_launch.h"

namespace flashattn::sm90 {

// e4m3 Q, K, V take half the bytes of bf16, so key blocks are wider; the key block is also the
// block of K and V rows that one descale covers. Registers per consumer thread: O d/2, S
// kBlockN/2, P kBlockN/8; shared memory Q kQStages·128·d + (K + V) 2·kStages·kBlockN·d bytes.
template <int kHeadDim> struct Fp8FwdTile {
  static constexpr int kBlockN = fp8_key_block(kHeadDim), kStages = 2;
  static constexpr int kQStages = kHeadDim == 256 ? 1 : 2;
  // Measured (benchmarks/README.md): the unmasked-block loop pays at d256 only; at d64 it is
  // slower with either division, at d128 no faster with the approximate one and slower with the
  // IEEE one. The IEEE division (see the kernel) is faster at d64/d128 without the copy, the
  // approximate one at d256.
  static constexpr bool kUnmaskedLoop = kHeadDim == 256;
  static constexpr bool kIeeeDescaleRatio = kHeadDim != 256;
  static constexpr bool kTailSplit = true;
};

template <int kHeadDim>
flashattn_result_t run_fwd_fp8(const flashattn_params_t& p, FwdOptions o, cudaStream_t stream) {
  return run_fwd<FwdTraits<cutlass::float_e4m3_t, kHeadDim, Fp8FwdTile<kHeadDim>, true>>(
      p, o.pingpong, stream);
}

}  // namespace flashattn::sm90
