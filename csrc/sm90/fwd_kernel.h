// The FlashAttention-3-style forward kernel for sm_90a: the shell that wires its parts.
//
// One CTA computes a kBlockM = 128 row tile of O for one (batch entry, head): three warpgroups.
//   producer (WG 0, fwd_producer.h): lane 0 of its first warp issues TMA loads — Q into a
//                    kQStages-deep ring, K and V blocks into two kStages-deep mbarrier
//                    pipelines (pipeline.h); pages of no whole key block come as pieces, a
//                    TMA copy each, or are copied row by row by the whole warpgroup
//                    (fwd_paged_rows.h) where they hold no whole pieces; an e4m3 cache's
//                    pieces are staged and widened by the warpgroup (fwd_cache_staging.h)
//                    — walking key blocks last to
//                    first so that only the first block visited needs the sequence-end mask;
//   consumers (WG 1, WG 2): 64 query rows each (fwd_mainloop.h: GEMMs, mask, softmax step;
//                    fwd_epilogue.h: O and LSE stores).
// Every CTA walks its share of the tiles (fwd_scheduler.h: persistent, the causal pairing, the
// tail launch's pieces). In packed batches an entry is one sequence: its tile's WorkTile says
// where its rows lie in the tensors and its key range has its lengths, and the parts take rows,
// masks and stores from those alone.
// Intra-warpgroup overlap (template): the next block's Q·Kᵀ is issued with this block's P·V,
// before the softmax that needs only the former; with two Q buffers this runs on across tiles
// (the next tile's first Q·Kᵀ goes out beside this tile's last P·V, and this tile's O is stored
// while the next tile's first softmax waits on nothing). Whether the softmax also runs beside
// the P·V is where ptxas puts the wait for it (scripts/sass_report.py, 'EX2 before wait').
// Ping-pong (run-time flag): two named barriers hand the tensor cores back and forth between
// the consumer warpgroups, so that one warpgroup's softmax hides under the other's GEMMs. Key
// blocks that need no mask may run a copy of the loop without the mask and softcap tests
// (Tile::kUnmaskedLoop). setmaxnreg moves registers from the producer (24; 56 over an e4m3
// cache) to the consumers (240; 224), FwdTraits::kProducerRegs. Without intra-warpgroup overlap (a tile's choice, or the FlashAttention-3 paper's
// ablation) each tile runs fwd_serial.h's loop.
// The partial-results instantiation (kPartials) also runs pack-GQA tiles, whose rows are
// (query row, query head) pairs of one KV head (fwd_packed_q.h gathers their Q), and key splits,
// whose O and LSE go to workspace slots for fwd_merge.h to merge; the whole-tile instantiation
// has none of that code.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "fwd_epilogue.h"
#include "fwd_mainloop.h"
#include "fwd_packed_q.h"
#include "fwd_producer.h"
#include "fwd_scheduler.h"
#include "fwd_serial.h"
#include "fwd_traits.h"
#include "grid_dependency.h"
#include "pipeline.h"

namespace flashattn::sm90 {

// kPartials: the partial-results kernel (the tail launch's pieces, fwd_tail.h; pack-GQA tiles;
// key splits); else whole tiles.
template <class Traits, bool kPartials = false>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    fwd_kernel(__grid_constant__ const FwdParams<Traits> params) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kRowsPerWG = Traits::kRowsPerWG;
  constexpr int kConsumerWGs = Traits::kConsumerWGs;
  using SharedStorage = typename Traits::SharedStorage;
  // Pack-GQA and key splits: the 16-bit partial-results kernel's.
  constexpr bool kPackable = kPartials && !Traits::kFp8;
  using Mainloop = FwdMainloop<Traits, kPackable>;
  constexpr int kRows = Mainloop::kRows;

  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // The tail launches may start as SMs free up (fwd_tail.h); no launch of anyone else's.
  if constexpr (Traits::kTailSplit) {
    if (params.tail.tiles > 0) launch_dependent_grids();
  }
  const int warp_group = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    // One arrival per consumer warp releases a stage (see TmaPipeline::consumer_release); one
    // per producer thread fills a K or V stage whose rows the producer warpgroup writes.
    const uint32_t kv_fills = params.threads_fill_stages() ? kGatherThreads : 1;
    smem.pipe_q.init(4 * kConsumerWGs);
    smem.pipe_k.init(4 * kConsumerWGs, kv_fills);
    smem.pipe_v.init(4 * kConsumerWGs, kv_fills);
    if constexpr (Traits::kStagesCache) smem.staging.init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  // A packed call's schedule (fwd_packed_schedule) may still be running: every warp decodes tiles.
  if (params.slot_entries != nullptr) wait_for_prior_grids();

  if (warp_group == 0) {
    FwdProducer<Traits, kPartials>::run(params, smem);
    return;
  }

  // ---------------- consumers ----------------
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int wg = warp_group - 1;      // 0 or 1
  const int tid = threadIdx.x % 128;  // thread within the warpgroup
  Mainloop ml(params, smem, wg, tid);
  FwdEpilogue<Traits, kPartials> epilogue{params, wg, tid};

  PipelineState<Traits::kStages> st_k, st_v;  // carried across tiles, like the producer's
  PipelineState<Traits::kQStages> st_q;
  // Cross-tile overlap: the tile whose last P·V is not issued yet (its P is in tOrP).
  bool pending = false;
  WorkTile pending_tile{};
  auto finish_pending = [&]() FLASHATTN_INLINE {
    pv_and_release(ml, smem, st_v);
    float inv_sum[kRows], lse[kRows];
    ml.finalize_pending(inv_sum, lse);
    epilogue.store(pending_tile, ml.tOrO, inv_sum, lse);
    pending = false;
  };

  WorkTile t;
#pragma unroll 1
  for (FwdTileScheduler<Traits, kPartials> walk{params}; walk.next(t);) {
    const int row0 = t.m_block * Traits::kBlockM + wg * kRowsPerWG;  // first query row of this WG
    ml.begin_tile(t);

    if (t.n_blocks() == 0) {  // no key for any row: O = 0, LSE = +inf
      if (pending) finish_pending();
      if (!has_rows<Traits>(t)) continue;  // a packed entry's tiles past its end
      ml.softmax = typename Mainloop::Softmax();
      // FP8: O is 0 in any units, not in the last tile's V descale's (a bad one is NaN).
      if constexpr (Traits::kFp8) ml.v_unit = 1.f;
      clear(ml.tOrO);
      float inv_sum[kRows], lse[kRows];
      ml.finalize(inv_sum, lse);
      epilogue.store(t, ml.tOrO, inv_sum, lse);
      continue;
    }

    smem.pipe_q.consumer_wait(st_q);
    if constexpr (kPackable) {
      if (params.group > 1) gather_packed_q(params, t, smem, wg, tid, st_q.index);
      // A warpgroup holding none of the tile's rows (the second of a decode step's pack-GQA
      // tile, whose rows the first holds) computes nothing: it releases the stages and takes
      // the ping-pong turns as the loop below does, a turn a key block, and leaves the tile
      // pending as it does (its last P·V then multiplies nothing that is stored). A P·V pending
      // from the tile before goes out first, on a turn that stands for this tile's first. No
      // GEMM here but finish_pending's: a GEMM under a branch of its own in the loop below
      // would have ptxas serialize every WGMMA of the kernel. (The overlapped loop's rhythm:
      // the serial one takes two turns a block.)
      if (Traits::kIntraWGOverlap && row0 >= t.rows) {
        const bool turn_taken = pending;
        if (pending) finish_pending();
#pragma unroll 1
        for (int n = t.n_max - 1; n >= t.n_min; --n) {
          const bool first = n == t.n_max - 1;
          smem.pipe_k.consumer_wait(st_k);
          if (!first) smem.pipe_v.consumer_wait(st_v);  // the block before's
          if (!first || !turn_taken) {
            ml.turn_wait();
            ml.turn_pass();
          }
          smem.pipe_k.consumer_release(st_k);
          st_k.advance();
          if (!first) {
            smem.pipe_v.consumer_release(st_v);
            st_v.advance();
          }
        }
        smem.pipe_q.consumer_release(st_q);
        st_q.advance();
        pending = true;
        pending_tile = t;
        ml.hold_pending();
        if constexpr (!Traits::kCrossTileOverlap) finish_pending();
        continue;
      }
    }
    if constexpr (!Traits::kIntraWGOverlap) {
      fwd_serial_tile<Traits>(ml, epilogue, smem, st_q, st_k, st_v, t, row0);
      continue;
    }
    // First block of the tile, with the last P·V of the tile before when one is pending. The two
    // paths share no GEMM in flight (ptxas would serialize the WGMMAs of a join).
    auto release_k_first = [&]() FLASHATTN_INLINE {
      smem.pipe_k.consumer_release(st_k);
      st_k.advance();
      if (t.n_blocks() == 1) {  // also the tile's last Q·Kᵀ
        smem.pipe_q.consumer_release(st_q);
        st_q.advance();
      }
      ml.softmax = typename Mainloop::Softmax();
    };
    const BlockScales first = ml.block_scales(t.n_max - 1);
    smem.pipe_k.consumer_wait(st_k);
    if (pending) {
      smem.pipe_v.consumer_wait(st_v);
      ml.zero_v_tail(smem, st_v.index);  // the tile before's, where it had one block
      ml.turn_wait();
      ml.gemm_qk(st_q.index, st_k.index);
      ml.gemm_pv(st_v.index);
      ml.turn_pass();
      warpgroup_wait<1>();
      float inv_sum[kRows], lse[kRows];
      ml.finalize_pending(inv_sum, lse);  // the tile before: all keys seen
      release_k_first();
      ml.template softmax_step<false>(t.n_max - 1, row0, first);
      warpgroup_wait<0>();
      smem.pipe_v.consumer_release(st_v);
      st_v.advance();
      epilogue.store(pending_tile, ml.tOrO, inv_sum, lse);
      pending = false;
    } else {
      ml.turn_wait();
      ml.gemm_qk(st_q.index, st_k.index);
      ml.turn_pass();
      warpgroup_wait<0>();
      release_k_first();
      ml.template softmax_step<false>(t.n_max - 1, row0, first);
    }
    ml.mark_v_tail(t);
    clear(ml.tOrO);
    ml.convert_p();
    // One key block after the first. kPlain: a block that needs no mask (and no softcap, and is
    // not the tile's last), for the loop's copy without those tests.
    auto key_block = [&](int n, auto plain) FLASHATTN_INLINE {
      constexpr bool kPlain = decltype(plain)::value;
      const BlockScales scales = ml.block_scales(n);
      smem.pipe_k.consumer_wait(st_k);
      smem.pipe_v.consumer_wait(st_v);
      ml.zero_v_tail(smem, st_v.index);
      ml.turn_wait();
      ml.gemm_qk(st_q.index, st_k.index);
      ml.gemm_pv(st_v.index);
      ml.turn_pass();
      warpgroup_wait<1>();  // S of block n is ready; P·V of the previous block still runs
      smem.pipe_k.consumer_release(st_k);
      st_k.advance();
      if (!kPlain && n == t.n_min) {  // the tile's last Q·Kᵀ: its Q buffer may take a later
        smem.pipe_q.consumer_release(st_q);  // tile's Q
        st_q.advance();
      }
      ml.template softmax_step<kPlain>(n, row0, scales);
      warpgroup_wait<0>();
      smem.pipe_v.consumer_release(st_v);
      st_v.advance();
      ml.rescale_o();
      ml.convert_p();
    };
    // The blocks [plain_lo, plain_hi] for the copy (none without it). From the tile's rows, not
    // this warpgroup's: bounds that ptxas sees as uniform keep the loop's pipeline state in
    // uniform registers (per warpgroup they were slower than no copy at all).
    int plain_lo = 0, plain_hi = -1;
    if (Traits::kUnmaskedLoop && !params.softcap) {
      int q_begin, q_end;
      query_rows(ml.group(), t.m_block * Traits::kBlockM, (t.m_block + 1) * Traits::kBlockM,
                 q_begin, q_end);
      t.keys.template unmasked_blocks<Traits::kBlockN>(q_begin, q_end, plain_lo, plain_hi);
      if (plain_lo <= t.n_min) plain_lo = t.n_min + 1;
    }
#pragma unroll 1
    for (int n = t.n_max - 2; n >= t.n_min;) {
      if constexpr (Traits::kUnmaskedLoop) {
        if (n <= plain_hi && n >= plain_lo) {
#pragma unroll 1
          for (; n >= plain_lo; --n) key_block(n, std::true_type{});
          continue;
        }
      }
      key_block(n, std::false_type{});
      --n;
    }
    pending = true;
    pending_tile = t;
    ml.hold_pending();
    if constexpr (!Traits::kCrossTileOverlap) finish_pending();
  }
  if (pending) finish_pending();
  ml.take_last_turn(wg);
#endif
}

}  // namespace flashattn::sm90
