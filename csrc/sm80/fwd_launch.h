// Host side of the sm80 forward: kernel params from the C ABI params, then the launch.
// Included by one small .cu per (head dims, dtype) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <type_traits>

#include "../common/fwd_sinks.h"
#include "../common/launch.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "fwd_tile.h"
#include "fwd_kernel.h"

namespace flashattn::sm80 {

// kHeadDim: of Q and K; kHeadDimV: of V and O.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
flashattn_result_t run_fwd(const flashattn_params_t& p, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim, kHeadDimV>;
  using Traits =
      FwdTraits<Element, kHeadDim, Tile::kBlockM, Tile::kBlockN, Tile::kWarps, Tile::kStages,
                Tile::kQInRegs, kHeadDimV>;
  const bool paged = p.page_table != nullptr;  // pages of any size (flash_api.h)
  // Grid (query blocks of the longest entry, heads, batch): y and z stop at 65535; the tile
  // order's linear block index is an int.
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
  const int64_t kv_bytes =
      int64_t(seqs.max_k) * (kHeadDim + kHeadDimV) * int64_t(sizeof(Element));
  params.order = TileOrder::make(params.num_m_blocks, p.batch * p.heads_q,
                                 params.keys.window_right >= 0, kv_bytes, l2_bytes() * 4 / 5);
  const float log2e = float(M_LOG2E);
  params.softcap = p.softcap > 0.f;
  params.softcap_pre = params.softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = params.softcap ? p.softcap * log2e : p.softmax_scale * log2e;
  if (paged) {
    params.page_table = p.page_table;
    params.page_table_stride = p.page_table_batch_stride;
    params.page_size = p.page_size;
    params.page_columns = p.seqlen_k / p.page_size;
    params.num_pages = p.num_pages;
  }

  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  const dim3 grid(params.num_m_blocks, p.heads_q, p.batch);
  auto launch = [&](auto paged_kernel) {  // the dense kernel or its paged twin
    constexpr auto kernel = &fwd_kernel<Traits, decltype(paged_kernel)::value>;
    if (const cudaError_t e = allow_dynamic_smem<kernel>(smem_bytes); e != cudaSuccess) return e;
    kernel<<<grid, Traits::kThreads, smem_bytes, stream>>>(params);
    return cudaGetLastError();
  };
  FLASHATTN_TRY_CUDA(paged ? launch(std::true_type{}) : launch(std::false_type{}));
  return cuda_status(launch_fwd_add_sinks<Element>(p, stream));  // the call's attention sinks
}

}  // namespace flashattn::sm80
