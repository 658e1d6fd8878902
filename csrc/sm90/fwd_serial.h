// The sm90 forward without intra-warpgroup overlap: each key block's GEMMs wait on its softmax,
// and with ping-pong each GEMM takes its own turn. Tiles that ask for it run it (Tile::
// kIntraWGOverlap off: the FP8 d128 256-key block, where the next block's S would not fit the
// registers beside this block's P and O), and the 16-bit kernels built with the ablation (the
// FlashAttention-3 paper's, to measure what the overlap gains).
#pragma once

#include "fwd_mainloop.h"
#include "fwd_scheduler.h"
#include "fwd_traits.h"
#include "pipeline.h"

namespace flashattn::sm90 {

// The P·V of the P converted last, on this warpgroup's turn, waited for; its V stage released.
// Also the overlapped loop's last P·V of a tile (fwd_kernel.h).
template <class Mainloop, class SharedStorage, class State>
__device__ __forceinline__ void pv_and_release(Mainloop& ml, SharedStorage& smem, State& st_v) {
  smem.pipe_v.consumer_wait(st_v);
  ml.zero_v_tail(smem, st_v.index);
  ml.turn_wait();
  ml.gemm_pv(st_v.index);
  ml.turn_pass();
  warpgroup_wait<0>();
  smem.pipe_v.consumer_release(st_v);
  st_v.advance();
}

// One tile whose Q the caller has waited for (Mainloop: the kernel's FwdMainloop, packing or
// not).
template <class Traits, class Mainloop, class Epilogue>
__device__ __forceinline__ void fwd_serial_tile(Mainloop& ml, Epilogue& epilogue,
                                                 typename Traits::SharedStorage& smem,
                                                 PipelineState<Traits::kQStages>& st_q,
                                                 PipelineState<Traits::kStages>& st_k,
                                                 PipelineState<Traits::kStages>& st_v,
                                                 const WorkTile& t, int row0) {
  constexpr int kRows = Mainloop::kRows;
  ml.softmax = typename Mainloop::Softmax();
  clear(ml.tOrO);
  // FP8: O's units start afresh, so that the first block's rescale of the clear O is by 0 (by the
  // last tile's V descale, NaN say, it would be NaN).
  if constexpr (Traits::kFp8) ml.v_unit = 1.f;
  ml.mark_v_tail(t);  // the first block's P·V, in the loop's first pv_and_release
#pragma unroll 1
  for (int n = t.n_max - 1; n >= t.n_min; --n) {
    const BlockScales scales = ml.block_scales(n);
    smem.pipe_k.consumer_wait(st_k);
    ml.turn_wait();
    ml.gemm_qk(st_q.index, st_k.index);
    ml.turn_pass();
    warpgroup_wait<0>();
    smem.pipe_k.consumer_release(st_k);
    st_k.advance();
    if (n == t.n_min) {
      smem.pipe_q.consumer_release(st_q);
      st_q.advance();
    }
    ml.template softmax_step<false>(n, row0, scales);
    ml.rescale_o();
    ml.convert_p();
    pv_and_release(ml, smem, st_v);
  }
  float inv_sum[kRows], lse[kRows];
  ml.finalize(inv_sum, lse);
  epilogue.store(t, ml.tOrO, inv_sum, lse);
}

}  // namespace flashattn::sm90
