// The FlashAttention-2-style backward kernels (sm_80 and later: mma.sync, ldmatrix, cp.async).
//
// preprocess: D = rowsum(dO ∘ O) and LSE·log2(e) per query row (f32), padded with D = 0,
//             LSE = +inf to whole query blocks (common/bwd_passes.h).
// main:       one CTA per (key block, head, batch) keeps its K and V blocks in shared memory and
//             its dK, dV accumulators in registers, and walks the query blocks that see its keys:
//               S = Q·Kᵀ and P = exp(S·scale − LSE) recomputed, dP = dO·Vᵀ, dS = P ∘ (dP − D),
//               dV += Pᵀ·dO, dK += dSᵀ·Q   (P and dS through shared memory, read transposed),
//               dQ += dS·K                  (f32 atomics into the workspace, in the order the
//                                            MMA holds it: one 128-byte line per warp atomic).
//             dK·scale and dV go straight to the caller's tensors, or, when several query heads
//             share a KV head (GQA), into f32 workspace sums by atomics.
//             Deterministic mode (its own instantiation): CTA s of dq_splits walks key blocks s,
//             s + dq_splits, ... into its own dQ slice, GQA dK/dV go per query head.
// postprocess: dQ (and the GQA dK, dV sums) from f32 to the element type, scaled; slices and
//             heads summed in a fixed order.
// V, O, dO and dV may have another head dim than Q and K (kHeadDimV: dP = dO·Vᵀ sums over it,
// dV has its columns; S, dQ and dK stay over Q's).
// The Q/dO buffer count is a run-time choice (two where the device's shared memory allows them).
// Packed (varlen) calls run the same code: a CTA's batch index names a sequence, whose rows,
// lengths and workspace rows its prologue looks up (Sequences, bwd_rows_start); the grid covers
// the longest sequence's key blocks, and CTAs past their sequence's keys return at once.
#pragma once

#include "bwd_traits.h"

namespace flashattn::sm80 {

using namespace cute;

// Stores a (rows, cols) f32 accumulator of `mma` into a row-major shared-memory tile (swizzled
// layout `sTile`) as 32-bit Element pairs: an accumulator's elements i, i+1 (i even) are
// neighbouring columns, which the 16-byte swizzle keeps neighbours.
template <class Element, class Acc, class Thr, class STensor>
__device__ void acc_to_smem(Acc const& acc, Thr const& thr, STensor& sTile) {
  Tensor dst = thr.partition_C(sTile);
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    cutlass::Array<Element, 2> pair;
    pair[0] = Element(acc(i));
    pair[1] = Element(acc(i + 1));
    *reinterpret_cast<cutlass::Array<Element, 2>*>(&dst(i)) = pair;
  }
}

// kDeterministic: CTA s walks key blocks s, s + gridDim.x, ... (see BwdParams::deterministic);
// otherwise one key block per CTA. Two instantiations: in one, the loop made the atomic path slower.
// kSinkParts: sums the sinks' gradient parts where the call has them (bwd_sink_grad; with
// softcap before dS takes the cap's slope); the plain kernel has an instantiation without, so
// that calls without sinks run its code as it was.
template <class Traits, bool kDeterministic, bool kSinkParts>
__global__ void __launch_bounds__(Traits::kThreads)
    bwd_kernel(__grid_constant__ const BwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kHeadDimV = Traits::kHeadDimV;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(128) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  // Atomic mode: key block and head from the tile order (heavy-first under a right bound: key
  // block 0 sees the most query rows). Deterministic: grid (dQ slice, head, batch).
  int first_block = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
  if constexpr (!kDeterministic) {
    int bh;
    params.order.at(blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z), first_block,
                    bh);
    head = bh % params.heads_q;
    batch = bh / params.heads_q;
  }
  const int head_kv = head / (params.heads_q / params.heads_kv);
  const int tid = threadIdx.x;
  // The entry (dense: batch entry `batch`; packed: a sequence) attends to its first seqlen_k
  // keys, but writes dK and dV for every key it owns: a packed sequence's used keys (seqused_k)
  // may stop short of its offsets' range, whose other keys get dK = dV = 0 here. Key rows that
  // no sequence owns are not written. The entry is read again where it is needed, before and
  // after the query block loop, rather than held in registers across the loops: the d64 kernels
  // have none to spare there.
  auto keys_owned = [&]() { return params.seqs.at(batch).keys_owned; };
  auto key_block = [&](const int n_block) {
    const int col_begin = n_block * kBlockN;
    // The entry's rows and lengths, its keys, and where its rows lie in the query workspace rows.
    const Sequences::Entry entry = params.seqs.at(batch);
    const int seqlen_q = entry.seqlen_q, seqlen_k = entry.seqlen_k;
    const KeyRange keys = entry.keys(params.keys);
    const int64_t rows_at_entry =
        bwd_rows_start(params.seqs, entry, batch, head, params.heads_q, params.dq_rows);
    // Query rows that see any key of this block (none past the used keys: rows_seeing knows
    // only the windows).
    int row_lo, row_hi;
    keys.rows_seeing(col_begin, col_begin + kBlockN, row_lo, row_hi);
    const int m_first = row_lo / kBlockM;
    const int m_count =
        row_hi > row_lo && col_begin < seqlen_k ? (row_hi - 1) / kBlockM + 1 - m_first : 0;
    // Step j visits query block m_first + (j + n_block) mod m_count: the key blocks of a head start
    // on different query blocks, so their dQ atomics do not all hit the same lines at once.
    auto block_at = [&](int j) {
      const int k = j + n_block % (m_count > 0 ? m_count : 1);
      return m_first + (k < m_count ? k : k - m_count);
    };

    // The entry's rows of head h from row `start` of the tensors' rows, of `cols` (a head dim)
    // (64-bit: a packed start times the row stride can pass 2^31).
    auto gmem = [&](const void* ptr, int64_t b_stride, int64_t h_stride, int64_t row_stride, int h,
                    int start, int seqlen, auto cols) {
      auto base = static_cast<const Element*>(ptr) + entry.batch * b_stride + h * h_stride +
                  int64_t(start) * row_stride;
      return make_tensor(make_gmem_ptr(base), make_shape(seqlen, cols),
                         make_stride(row_stride, _1{}));
    };
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    using TileO = Shape<Int<kBlockM>, Int<kHeadDimV>>;  // dO's
    using TileK = Shape<Int<kBlockN>, Int<kHeadDim>>;
    using TileV = Shape<Int<kBlockN>, Int<kHeadDimV>>;
    Tensor gQ = local_tile(gmem(params.q, params.q_batch_stride, params.q_head_stride,
                                params.q_row_stride, head, entry.q_start, seqlen_q,
                                Int<kHeadDim>{}),
                           TileQ{}, make_coord(_, 0));  // (M, d, m)
    Tensor gdO = local_tile(gmem(params.dout, params.do_batch_stride, params.do_head_stride,
                                 params.do_row_stride, head, entry.q_start, seqlen_q,
                                 Int<kHeadDimV>{}),
                            TileO{}, make_coord(_, 0));
    Tensor gK = local_tile(gmem(params.k, params.k_batch_stride, params.k_head_stride,
                                params.k_row_stride, head_kv, entry.k_start, seqlen_k,
                                Int<kHeadDim>{}),
                           TileK{}, make_coord(n_block, 0));
    Tensor gV = local_tile(gmem(params.v, params.v_batch_stride, params.v_head_stride,
                                params.v_row_stride, head_kv, entry.k_start, seqlen_k,
                                Int<kHeadDimV>{}),
                           TileV{}, make_coord(n_block, 0));

    // Q and dO of buffer 0; buffer s is QStage s (at_stage).
    Tensor sQ = make_tensor(make_smem_ptr(smem.stage[0].q.begin()), typename Traits::SmemLayoutQ{});
    Tensor sdO =
        make_tensor(make_smem_ptr(smem.stage[0].dout.begin()), typename Traits::SmemLayoutdO{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.begin()), typename Traits::SmemLayoutV{});
    Tensor sP = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutP{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutP{});
    Tensor sQt =
        make_tensor(make_smem_ptr(smem.stage[0].q.begin()), typename Traits::SmemLayoutQt{});
    Tensor sdOt =
        make_tensor(make_smem_ptr(smem.stage[0].dout.begin()), typename Traits::SmemLayoutdOt{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.begin()), typename Traits::SmemLayoutKt{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.p.begin()), typename Traits::SmemLayoutPt{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.ds.begin()), typename Traits::SmemLayoutPt{});

    typename Traits::GmemCopy gmem_copy;
    auto thr_gmem = gmem_copy.get_thread_slice(tid);
    Tensor tQgQ = thr_gmem.partition_S(gQ);  // (CPY, CPY_M, CPY_K, m)
    Tensor tQsQ = thr_gmem.partition_D(sQ);
    Tensor tdOgdO = thr_gmem.partition_S(gdO);
    Tensor tdOsdO = thr_gmem.partition_D(sdO);
    Tensor tQc = thr_gmem.partition_S(make_identity_tensor(TileQ{}));
    Tensor tdOc = thr_gmem.partition_S(make_identity_tensor(TileO{}));
    Tensor tKc = thr_gmem.partition_S(make_identity_tensor(TileK{}));
    Tensor tVc = thr_gmem.partition_S(make_identity_tensor(TileV{}));
    {
      Tensor tKsK = thr_gmem.partition_D(sK);
      Tensor tVsV = thr_gmem.partition_D(sV);
      copy_rows(thr_gmem.partition_S(gK), tKsK, tKc, seqlen_k - col_begin);
      copy_rows(thr_gmem.partition_S(gV), tVsV, tVc, seqlen_k - col_begin);
      cp_async_fence();
    }

    // S and dP.
    typename Traits::MmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tid);
    Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
    Tensor tSrK = thr_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
    auto copy_sdp_a = make_tiled_copy_A(typename Traits::LoadN{}, mma_sdp);
    auto copy_sdp_b = make_tiled_copy_B(typename Traits::LoadN{}, mma_sdp);
    Tensor tSsQ = copy_sdp_a.get_thread_slice(tid).partition_S(sQ);
    Tensor tdPsdO = copy_sdp_a.get_thread_slice(tid).partition_S(sdO);
    Tensor tSsK = copy_sdp_b.get_thread_slice(tid).partition_S(sK);
    Tensor tdPsV = copy_sdp_b.get_thread_slice(tid).partition_S(sV);
    using TileS = Shape<Int<kBlockM>, Int<kBlockN>>;
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(TileS{}));
    Tensor rowcol_cS = make_tensor(cS.data(), acc_rowcol(cS.layout()));

    // dV and dK.
    typename Traits::MmadKV mma_dkv;
    auto thr_dkv = mma_dkv.get_thread_slice(tid);
    Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);
    Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);
    auto copy_dkv_a = make_tiled_copy_A(typename Traits::LoadT{}, mma_dkv);
    auto copy_dkv_b = make_tiled_copy_B(typename Traits::LoadT{}, mma_dkv);
    Tensor tdVsPt = copy_dkv_a.get_thread_slice(tid).partition_S(sPt);
    Tensor tdKsdSt = copy_dkv_a.get_thread_slice(tid).partition_S(sdSt);
    Tensor tdVsdOt = copy_dkv_b.get_thread_slice(tid).partition_S(sdOt);
    Tensor tdKsQt = copy_dkv_b.get_thread_slice(tid).partition_S(sQt);
    Tensor acc_dv = partition_fragment_C(mma_dkv, TileV{});
    Tensor acc_dk = partition_fragment_C(mma_dkv, TileK{});
    // dV's accumulator is dK's first size(acc_dv) elements over: the same warps and rows, and
    // the column mode last in both, so element i sits at the same (row, column) in either. The
    // epilogue walks dK's elements and stores dV's where i < size(acc_dv).
    static_assert(size<0>(acc_dv) == size<0>(acc_dk) && size<1>(acc_dv) == size<1>(acc_dk));
    clear(acc_dv);
    clear(acc_dk);

    // dQ.
    typename Traits::MmadQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(tid);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
    auto copy_dq_a = make_tiled_copy_A(typename Traits::LoadN{}, mma_dq);
    auto copy_dq_b = make_tiled_copy_B(typename Traits::LoadT{}, mma_dq);
    Tensor tdQsdS = copy_dq_a.get_thread_slice(tid).partition_S(sdS);
    Tensor tdQsKt = copy_dq_b.get_thread_slice(tid).partition_S(sKt);

    // Buffer `stage` of a partitioned Q or dO tensor of buffer 0.
    constexpr int kStageElems = int(sizeof(typename Traits::QStage) / sizeof(Element));
    static_assert(sizeof(typename Traits::QStage) % sizeof(Element) == 0);
    auto at_stage = [](auto const& t, int stage) {
      return make_tensor(t.data() + stage * kStageElems, t.layout());
    };
    // Q, dO, and the rows' LSE and D of query block m into buffer `stage`, one cp.async group.
    auto load_q_block = [&](int m, int stage) {
      const int row_begin = m * kBlockM;
      auto sq = at_stage(tQsQ, stage);
      auto sdo = at_stage(tdOsdO, stage);
      copy_rows(tQgQ(_, _, _, m), sq, tQc, seqlen_q - row_begin);
      copy_rows(tdOgdO(_, _, _, m), sdo, tdOc, seqlen_q - row_begin);
      constexpr int kChunks = kBlockM / 4;  // 16-byte chunks per row vector
      static_assert(2 * kChunks <= Traits::kThreads);
      const int64_t rows_at = rows_at_entry + row_begin;
      if (tid < 2 * kChunks) {
        const int chunk = tid % kChunks;
        const bool is_lse = tid < kChunks;
        const float* src = (is_lse ? params.lse_log2 : params.softmax_d) + rows_at + chunk * 4;
        float* dst = (is_lse ? smem.stage[stage].lse : smem.stage[stage].d) + chunk * 4;
        SM80_CP_ASYNC_CACHEALWAYS<cute::uint128_t>::copy(
            *reinterpret_cast<const cute::uint128_t*>(src),
            *reinterpret_cast<cute::uint128_t*>(dst));
      }
      cp_async_fence();
    };

    // P and dS from S and dP, element by element. Masks and softcap take their own paths (folded
    // into the common one, ptxas predicates them and issues them on every block).
    auto each_element = [&](auto const& rowcol, int row_begin, int stage, auto slow_path,
                            auto&& f) {
      constexpr bool kSlow = decltype(slow_path)::value;
  #pragma unroll
      for (int r = 0; r < size<0>(rowcol); ++r) {
        const int row_in = get<0>(rowcol_cS(r, 0));
        const float lse = smem.stage[stage].lse[row_in];
        const float d = smem.stage[stage].d[row_in];
        int lo = 0, hi = kBlockN;
        if constexpr (kSlow) {
          lo = keys.lo(row_begin + row_in) - col_begin;
          hi = keys.hi(row_begin + row_in) - col_begin;
        }
  #pragma unroll
        for (int c = 0; c < size<1>(rowcol); ++c) {
          const int col = get<1>(rowcol_cS(r, c));
          f(r, c, lse, d, !kSlow || (col >= lo && col < hi));
        }
      }
    };

    int stage = 0;
    // The sinks' gradient: this thread's share over the block's keys (bwd_sink_grad).
    const bool sink_grad = kSinkParts && params.sink_parts != nullptr;
    float sink_part = 0.f;
    if (m_count > 0) load_q_block(block_at(0), 0);
  #pragma unroll 1
    for (int j = 0; j < m_count; ++j) {
      const int row_begin = block_at(j) * kBlockM;
      cp_async_wait<0>();
      __syncthreads();  // this block's Q, dO landed; every warp is done with the block before
      if (params.q_stages > 1 && j + 1 < m_count) load_q_block(block_at(j + 1), stage ^ 1);

      Tensor acc_s = partition_fragment_C(mma_sdp, TileS{});
      clear(acc_s);
      gemm_smem(mma_sdp, acc_s, tSrQ, tSrK, at_stage(tSsQ, stage), tSsK, copy_sdp_a, copy_sdp_b);
      Tensor rowcol_s = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      const bool masked =
          keys.template block_needs_mask<kBlockN>(n_block, row_begin, row_begin + kBlockM);

      // P = exp2(s·c − lse·log2 e) to shared memory before the dP GEMM, so the stores drain
      // under it.
      // Under softcap acc_s keeps tanh(s·scale/softcap) for dS's derivative, and P is built in
      // acc_dp's registers (free until the dP GEMM) and recomputed for dS.
      Tensor acc_dp = partition_fragment_C(mma_sdp, TileS{});
      Tensor rowcol_dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      if (params.softcap) {
        each_element(rowcol_s, row_begin, stage, cute::true_type{},
                     [&](int r, int c, float lse, float, bool visible) {
                       const float t = fast_tanh(rowcol_s(r, c) * params.softcap_pre);
                       rowcol_s(r, c) = t;
                       rowcol_dp(r, c) = visible ? fast_exp2(t * params.scale_log2 - lse) : 0.f;
                     });
        acc_to_smem<Element>(acc_dp, thr_sdp, sP);
      } else if (masked) {
        each_element(rowcol_s, row_begin, stage, cute::true_type{},
                     [&](int r, int c, float lse, float, bool visible) {
                       rowcol_s(r, c) =
                           visible ? fast_exp2(rowcol_s(r, c) * params.scale_log2 - lse) : 0.f;
                     });
        acc_to_smem<Element>(acc_s, thr_sdp, sP);
      } else {
        each_element(rowcol_s, row_begin, stage, cute::false_type{},
                     [&](int r, int c, float lse, float, bool) {
                       rowcol_s(r, c) = fast_exp2(rowcol_s(r, c) * params.scale_log2 - lse);
                     });
        acc_to_smem<Element>(acc_s, thr_sdp, sP);
      }

      clear(acc_dp);
      gemm_smem(mma_sdp, acc_dp, tdPrdO, tdPrV, at_stage(tdPsdO, stage), tdPsV, copy_sdp_a,
                copy_sdp_b);
      // dS = P ∘ (dP − D), times the softcap's tanh derivative.
      if (params.softcap) {
        // With sinks, Σ_j P_ij·(dP_ij − D_i) of this thread's rows before dS takes the slope.
        float rows_part[decltype(size<0>(rowcol_dp))::value] = {};
        each_element(rowcol_s, row_begin, stage, cute::true_type{},
                     [&](int r, int c, float lse, float d, bool visible) {
                       const float t = rowcol_s(r, c);
                       const float p = visible ? fast_exp2(t * params.scale_log2 - lse) : 0.f;
                       const float ds = p * (rowcol_dp(r, c) - d);
                       if constexpr (kSinkParts) rows_part[r] += ds;
                       rowcol_dp(r, c) = ds * (1.f - t * t);
                     });
        if (kSinkParts && sink_grad) {  // w_i·Σ_j P_ij·(dP_ij − D_i) of this thread's rows
          const float sink_log2 = params.sinks[head] * float(M_LOG2E);
  #pragma unroll
          for (int r = 0; r < size<0>(rowcol_dp); ++r) {
            const float lse = smem.stage[stage].lse[get<0>(rowcol_cS(r, 0))];
            sink_part += exp2f(sink_log2 - lse) * rows_part[r];
          }
        }
      } else {
        each_element(rowcol_s, row_begin, stage, cute::false_type{},
                     [&](int r, int c, float, float d, bool) {
                       rowcol_dp(r, c) = rowcol_s(r, c) * (rowcol_dp(r, c) - d);
                     });
        if (kSinkParts && sink_grad) {  // w_i·Σ_j dS_ij of this thread's rows
          const float sink_log2 = params.sinks[head] * float(M_LOG2E);
  #pragma unroll
          for (int r = 0; r < size<0>(rowcol_dp); ++r) {
            float row = 0.f;
  #pragma unroll
            for (int c = 0; c < size<1>(rowcol_dp); ++c) row += rowcol_dp(r, c);
            const float lse = smem.stage[stage].lse[get<0>(rowcol_cS(r, 0))];
            sink_part += exp2f(sink_log2 - lse) * row;
          }
        }
      }
      acc_to_smem<Element>(acc_dp, thr_sdp, sdS);
      __syncthreads();

      gemm_smem(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, at_stage(tdVsdOt, stage), copy_dkv_a,
                copy_dkv_b);

      // dQ before dK, so that its atomics drain under the dK GEMM. Each thread adds its MMA
      // elements at i·kThreads + tid of the query block's accumulator (bwd_convert_dq reads them
      // back the same way): one warp atomic covers 32 consecutive floats.
      Tensor acc_dq = partition_fragment_C(mma_dq, TileQ{});
      clear(acc_dq);
      gemm_smem(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b);
      // This CTA's dQ slice, recomputed here rather than held in registers across the loop.
      float* dq_accum = params.dq_accum + (rows_at_entry + row_begin) * kHeadDim + tid;
      if constexpr (kDeterministic) dq_accum += blockIdx.x * params.dq_split_stride;
  #pragma unroll
      for (int i = 0; i < size(acc_dq); ++i) atomicAdd(dq_accum + i * Traits::kThreads, acc_dq(i));

      gemm_smem(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, at_stage(tdKsQt, stage), copy_dkv_a,
                copy_dkv_b);

      if (params.q_stages == 1) {
        __syncthreads();  // every warp is done with Q and dO: the next block may land
        if (j + 1 < m_count) load_q_block(block_at(j + 1), 0);
      } else {
        stage ^= 1;
      }
    }

    static_assert(Traits::kThreads / 32 <= kSinkWarps);
    if (kSinkParts && sink_grad)
      store_sink_part(params.sink_parts + ((int64_t(batch) * params.heads_q + head) *
                                               params.sink_blocks + n_block) * kSinkWarps,
                      tid / 32, sink_part);

    // dK·scale and dV: rows of this key block that the entry owns (keys_out), from the entry's
    // first key row.
    const Sequences::Entry out = params.seqs.at(batch);
    const int keys_out = keys_owned();
    const int64_t k_start = out.k_start, k_batch = out.batch;
    // (row, column) of dK's elements, and of dV's below size(acc_dv) (see acc_dv).
    Tensor cKV = thr_dkv.partition_C(make_identity_tensor(TileK{}));
    constexpr int kElemsV = decltype(size(acc_dv))::value;
    // Through shared memory (K and V are free once every warp is past its last GEMM), so that
    // each global store is a 16-byte piece of a row, not a 4-byte pair spread over 8 rows:
    // measured faster at d128 and d256, but slower at d64 (ptxas then spills more in its loop).
    constexpr bool kStoreThroughSmem = kHeadDim >= 128;
    if (params.dk_accum == nullptr && kStoreThroughSmem) {
      // A key block that no query row sees never waited for its K and V: they must land first.
      cp_async_wait<0>();
      __syncthreads();
  #pragma unroll
      for (int i = 0; i < size(acc_dk); i += 2) {  // elements i, i+1 are neighbouring columns
        const int row = get<0>(cKV(i)), col = get<1>(cKV(i));
        cutlass::Array<Element, 2> k2, v2;
        k2[0] = Element(acc_dk(i) * params.scale);
        k2[1] = Element(acc_dk(i + 1) * params.scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(&sK(row, col)) = k2;
        if (i < kElemsV) {
          v2[0] = Element(acc_dv(i));
          v2[1] = Element(acc_dv(i + 1));
          *reinterpret_cast<cutlass::Array<Element, 2>*>(&sV(row, col)) = v2;
        }
      }
      __syncthreads();
      auto out_rows = [&](void* ptr, int64_t b_stride, int64_t h_stride, int64_t row_stride,
                          auto tile) {
        Element* base = static_cast<Element*>(ptr) + k_batch * b_stride + head * h_stride +
                        k_start * row_stride;
        return thr_gmem.partition_D(local_tile(
            make_tensor(make_gmem_ptr(base), make_shape(keys_out, get<1>(tile)),
                        make_stride(row_stride, _1{})),
            tile, make_coord(n_block, 0)));
      };
      Tensor tdKgdK = out_rows(params.dk, params.dk_batch_stride, params.dk_head_stride,
                               params.dk_row_stride, TileK{});
      Tensor tdVgdV = out_rows(params.dv, params.dv_batch_stride, params.dv_head_stride,
                               params.dv_row_stride, TileV{});
      Tensor tKsK = thr_gmem.partition_D(sK);
      Tensor tVsV = thr_gmem.partition_D(sV);
  #pragma unroll
      for (int m = 0; m < size<1>(tdKgdK); ++m) {
        if (get<0>(tKc(0, m, 0)) >= keys_out - col_begin) continue;  // dV's rows are dK's
  #pragma unroll
        for (int k = 0; k < size<2>(tdKgdK); ++k) {
          *reinterpret_cast<cute::uint128_t*>(raw_pointer_cast(&tdKgdK(0, m, k))) =
              *reinterpret_cast<const cute::uint128_t*>(raw_pointer_cast(&tKsK(0, m, k)));
          if (k < size<2>(tdVgdV))
            *reinterpret_cast<cute::uint128_t*>(raw_pointer_cast(&tdVgdV(0, m, k))) =
                *reinterpret_cast<const cute::uint128_t*>(raw_pointer_cast(&tVsV(0, m, k)));
        }
      }
    } else if (params.dk_accum == nullptr) {
      Element* dk = static_cast<Element*>(params.dk) + k_batch * params.dk_batch_stride +
                    head * params.dk_head_stride + k_start * params.dk_row_stride;
      Element* dv = static_cast<Element*>(params.dv) + k_batch * params.dv_batch_stride +
                    head * params.dv_head_stride + k_start * params.dv_row_stride;
  #pragma unroll
      for (int i = 0; i < size(acc_dk); i += 2) {  // elements i, i+1 are neighbouring columns
        const int row = col_begin + get<0>(cKV(i));
        if (row >= keys_out) continue;
        const int col = get<1>(cKV(i));
        cutlass::Array<Element, 2> k2, v2;
        k2[0] = Element(acc_dk(i) * params.scale);
        k2[1] = Element(acc_dk(i + 1) * params.scale);
        *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + row * params.dk_row_stride + col) = k2;
        if (i < kElemsV) {
          v2[0] = Element(acc_dv(i));
          v2[1] = Element(acc_dv(i + 1));
          *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + row * params.dv_row_stride + col) =
              v2;
        }
      }
    } else if (kDeterministic) {  // this query head's share, summed later in head order
      // Plain stores into an accumulator nothing zeroed: every owned row, the unused ones too.
      const int64_t base = bwd_key_rows_start(out, head, params.heads_q, params.seqlen_k);
  #pragma unroll
      for (int i = 0; i < size(acc_dk); i += 2) {
        const int row = col_begin + get<0>(cKV(i));
        if (row >= keys_out) continue;
        const int64_t at = (base + row) * kHeadDim + get<1>(cKV(i));
        const int64_t at_v = (base + row) * kHeadDimV + get<1>(cKV(i));
        *reinterpret_cast<float2*>(params.dk_accum + at) = make_float2(acc_dk(i), acc_dk(i + 1));
        if (i < kElemsV) {
          *reinterpret_cast<float2*>(params.dv_accum + at_v) =
              make_float2(acc_dv(i), acc_dv(i + 1));
        }
      }
    } else {
      // Sums zeroed before the kernel: the owned keys past the used ones keep their zeros.
      const int64_t base = bwd_key_rows_start(out, head_kv, params.heads_kv, params.seqlen_k);
  #pragma unroll
      for (int i = 0; i < size(acc_dk); ++i) {
        const int row = col_begin + get<0>(cKV(i));
        if (row >= out.seqlen_k) continue;
        const int64_t at = (base + row) * kHeadDim + get<1>(cKV(i));
        const int64_t at_v = (base + row) * kHeadDimV + get<1>(cKV(i));
        atomicAdd(params.dk_accum + at, acc_dk(i));
        if (i < kElemsV) atomicAdd(params.dv_accum + at_v, acc_dv(i));
      }
    }
  };

  if constexpr (kDeterministic) {
    const int n_blocks = (keys_owned() + kBlockN - 1) / kBlockN;
#pragma unroll 1
    for (int n_block = first_block; n_block < n_blocks; n_block += gridDim.x) {
      if (n_block != first_block) __syncthreads();  // every warp is done with the last one
      key_block(n_block);
    }
  } else {
    // The grid covers the longest entry's key blocks (packed: max_seqlen_k).
    if (first_block * kBlockN >= keys_owned()) return;
    key_block(first_block);
  }
}

}  // namespace flashattn::sm80
