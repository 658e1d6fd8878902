// Host side of the sm80 forward: kernel params from the C ABI params, then the launch.
// Included by one small .cu per (head dims, dtype) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <cutlass/float8.h>

#include <climits>
#include <cmath>

#include "../common/fwd_sinks.h"
#include "../common/launch.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "fwd_tile.h"
#include "fwd_kernel.h"

namespace flashattn::sm80 {

// The forward's traits for head dims kHeadDim (Q and K) and kHeadDimV (V and O), from the tile
// table's row.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
using FwdTraitsOf =
    FwdTraits<Element, kHeadDim, FwdTile<kHeadDim, kHeadDimV>::kBlockM,
              FwdTile<kHeadDim, kHeadDimV>::kBlockN, FwdTile<kHeadDim, kHeadDimV>::kWarps,
              FwdTile<kHeadDim, kHeadDimV>::kStages, FwdTile<kHeadDim, kHeadDimV>::kQInRegs,
              kHeadDimV>;

// Launches fwd_kernel<Traits, kPaged, Cache> for `p` (K and V of `Cache`), then the attention
// sinks' step. Grid (query blocks of the longest entry, heads, batch): y and z stop at 65535;
// the tile order's linear block index is an int.
template <class Traits, bool kPaged, class Cache>
flashattn_result_t launch_fwd(const flashattn_params_t& p, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim, kHeadDimV = Traits::kHeadDimV;
  const Sequences seqs = sequences(p);
  if (p.heads_q > 65535 || p.batch > 65535 ||
      int64_t(seqs.max_q / Traits::kBlockM + 1) * p.heads_q * p.batch > INT_MAX)
    return status(FLASHATTN_UNSUPPORTED);
  FwdParams params{};
  params.q = p.q.ptr;
  params.k = p.k.ptr;
  params.v = p.v.ptr;
  params.o = p.o.ptr;
  params.lse = p.lse;
  params.q_batch_stride = p.q.batch_stride;
  params.q_row_stride = p.q.row_stride;
  params.q_head_stride = p.q.head_stride;
  params.k_batch_stride = p.k.batch_stride;
  params.k_row_stride = p.k.row_stride;
  params.k_head_stride = p.k.head_stride;
  params.v_batch_stride = p.v.batch_stride;
  params.v_row_stride = p.v.row_stride;
  params.v_head_stride = p.v.head_stride;
  params.o_batch_stride = p.o.batch_stride;
  params.o_row_stride = p.o.row_stride;
  params.o_head_stride = p.o.head_stride;
  params.heads_q = p.heads_q;
  params.heads_kv = p.heads_kv;
  params.seqs = seqs;
  params.num_m_blocks = (seqs.max_q + Traits::kBlockM - 1) / Traits::kBlockM;
  params.keys = key_range(p);
  // Causal (any right bound): later query blocks see more keys, so heaviest first, heads
  // grouped by the K and V they share within 4/5 of the L2 (see TileOrder::make).
  const int64_t kv_bytes = int64_t(seqs.max_k) * (kHeadDim + kHeadDimV) * int64_t(sizeof(Cache));
  params.order = TileOrder::make(params.num_m_blocks, p.batch * p.heads_q,
                                 params.keys.window_right >= 0, kv_bytes, l2_bytes() * 4 / 5);
  const float log2e = float(M_LOG2E);
  params.softcap = p.softcap > 0.f;
  params.softcap_pre = params.softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = params.softcap ? p.softcap * log2e : p.softmax_scale * log2e;
  if constexpr (kPaged) {
    params.page_table = p.page_table;
    params.page_table_stride = p.page_table_batch_stride;
    params.page_size = p.page_size;
    params.page_columns = p.seqlen_k / p.page_size;
    params.num_pages = p.num_pages;
  }
  params.k_descale = p.k_descale;
  params.v_descale = p.v_descale;

  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  const dim3 grid(params.num_m_blocks, p.heads_q, p.batch);
  constexpr auto kernel = &fwd_kernel<Traits, kPaged, Cache>;
  FLASHATTN_TRY_CUDA(allow_dynamic_smem<kernel>(smem_bytes));
  kernel<<<grid, Traits::kThreads, smem_bytes, stream>>>(params);
  FLASHATTN_TRY_CUDA(cudaGetLastError());
  return cuda_status(launch_fwd_add_sinks<Element>(p, stream));  // the call's attention sinks
}

// kHeadDim: of Q and K; kHeadDimV: of V and O. The dense kernel, or its paged twin (pages of
// any size, flash_api.h).
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
flashattn_result_t run_fwd(const flashattn_params_t& p, cudaStream_t stream) {
  using Traits = FwdTraitsOf<Element, kHeadDim, kHeadDimV>;
  return p.page_table != nullptr ? launch_fwd<Traits, true, Element>(p, stream)
                                 : launch_fwd<Traits, false, Element>(p, stream);
}

// Over an e4m3 KV cache (paged, flash_api.h's kv_cache_e4m3): the paged kernel widening each
// row to Element in shared memory.
template <class Element, int kHeadDim>
flashattn_result_t run_fwd_fp8_cache(const flashattn_params_t& p, cudaStream_t stream) {
  if (p.page_table == nullptr || !p.kv_cache_e4m3) return status(FLASHATTN_INVALID_ARGUMENT);
  return launch_fwd<FwdTraitsOf<Element, kHeadDim>, true, cutlass::float_e4m3_t>(p, stream);
}

}  // namespace flashattn::sm80
