// Host side of the sm90 forward: TMA descriptors from the C ABI params, then the launch.
// Included by one small .cu per (head dim, dtype) instantiation.
#pragma once

#include <cuda_runtime.h>

#include <cmath>

#include "../common/launch.h"
#include "../common/status.h"
#include "../flash_api.h"
#include "fwd_instantiations.h"
#include "fwd_kernel.h"
#include "tma_tensor.h"

namespace flashattn::sm90 {

template <class Traits>
flashattn_result_t run_fwd(const flashattn_params_t& p, bool pingpong, cudaStream_t stream) {
  using Element = typename Traits::Element;
  FwdParams<Traits> params;
  auto q = gmem_tensor<Traits>(static_cast<Element const*>(p.q.ptr), p.q, p.seqlen_q, p.heads_q, p.batch);
  auto k = gmem_tensor<Traits>(static_cast<Element const*>(p.k.ptr), p.k, p.seqlen_k, p.heads_kv, p.batch);
  const int num_n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
  // FP8: V key-major, (head_dim, keys padded to whole key blocks), as the quantize step wrote it.
  auto v = [&] {
    if constexpr (Traits::kFp8) {
      constexpr int d = Traits::kHeadDim;
      return make_tensor(make_gmem_ptr(static_cast<Element const*>(p.v.ptr)),
                         make_shape(d, num_n_blocks * Traits::kBlockN, p.heads_kv, p.batch),
                         make_stride(int64_t(p.v.row_stride), _1{},
                                     tma_stride(p.v.head_stride, p.heads_kv, d),
                                     tma_stride(p.v.batch_stride, p.batch, d)));
    } else {
      return gmem_tensor<Traits>(static_cast<Element const*>(p.v.ptr), p.v, p.seqlen_k,
                                 p.heads_kv, p.batch);
    }
  }();
  params.tma_q = make_tma_copy(SM90_TMA_LOAD{}, q, take<0, 2>(typename Traits::SmemLayoutQ{}),
                               typename Traits::TileQ{}, _1{});
  params.tma_k = make_tma_copy(SM90_TMA_LOAD{}, k, take<0, 2>(typename Traits::SmemLayoutK{}),
                               typename Traits::TileKV{}, _1{});
  params.tma_v = make_tma_copy(SM90_TMA_LOAD{}, v, take<0, 2>(typename Traits::SmemLayoutV{}),
                               typename Traits::TileV{}, _1{});
  params.o = p.o.ptr;
  params.o_batch_stride = p.o.batch_stride;
  params.o_row_stride = p.o.row_stride;
  params.o_head_stride = p.o.head_stride;
  params.lse = p.lse;
  params.batch = p.batch;
  params.heads_q = p.heads_q;
  params.heads_kv = p.heads_kv;
  params.seqlen_q = p.seqlen_q;
  params.seqlen_k = p.seqlen_k;
  params.keys = key_range(p);
  params.num_m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t tiles = int64_t(params.num_m_blocks) * p.heads_q * p.batch;
  if (tiles > INT32_MAX) return status(FLASHATTN_UNSUPPORTED);
  params.num_tiles = int(tiles);
  const float log2e = float(M_LOG2E);
  params.softcap = p.softcap > 0.f;
  params.softcap_pre = params.softcap ? p.softmax_scale / p.softcap : 0.f;
  params.scale_log2 = params.softcap ? p.softcap * log2e : p.softmax_scale * log2e;
  params.pingpong = pingpong;
  params.q_descale = p.q_descale;
  params.k_descale = p.k_descale;
  params.v_descale = p.v_descale;
  params.num_n_blocks = num_n_blocks;
  params.o_bf16 = p.out_dtype == FLASHATTN_BF16;

  auto kernel = fwd_kernel<Traits>;
  const int smem_bytes = sizeof(typename Traits::SharedStorage);
  FLASHATTN_TRY_CUDA(allow_dynamic_smem<Traits>(kernel, smem_bytes));
  // Persistent: one CTA per SM (shared memory allows no more) walking its share of the work
  // units (see decode_tile); on request, with a right bound on the keys, one CTA per unit.
  const bool uniform = params.keys.window_right < 0;
  params.tiles_per_unit = uniform ? 1 : 2;
  const int units = (params.num_tiles + params.tiles_per_unit - 1) / params.tiles_per_unit;
  const bool persistent = uniform || (p.sm90_flags & FLASHATTN_SM90_PERSISTENT_CAUSAL);
  const int ctas = persistent && p.sm_count > 0 && p.sm_count < units ? p.sm_count : units;
  kernel<<<ctas, Traits::kThreads, smem_bytes, stream>>>(params);
  after_fwd_launch(stream);
  return check_launch();
}

// The tile table's instantiation for this call: the narrow-key-block tile when a right bound on
// the keys (causal) makes diagonal blocks frequent or the caller asks for it, else the default.
template <class Element, int kHeadDim>
flashattn_result_t run_fwd_tiled(const flashattn_params_t& p, FwdOptions o, cudaStream_t stream) {
  using Tile = FwdTile<kHeadDim>;
  using Masked = FwdTileMasked<kHeadDim>;
  if constexpr (Masked::kBlockN != Tile::kBlockN) {
    if (key_range(p).window_right >= 0 || (p.sm90_flags & FLASHATTN_SM90_NARROW_KEY_BLOCKS))
      return run_fwd<FwdTraits<Element, kHeadDim, Masked, true>>(p, o.pingpong, stream);
  }
  return run_fwd<FwdTraits<Element, kHeadDim, Tile, true>>(p, o.pingpong, stream);
}

}  // namespace flashattn::sm90
