// The sm90 forward's compile-time shape (FwdTraits: tile, shared memory layouts, MMAs, TMA
// copies) and its run-time parameters (FwdParams), shared by the kernel's parts.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "../common/block_range.h"
#include "../common/page_table.h"
#include "../common/sequences.h"
#include "fwd_cache_staging.h"
#include "fwd_paged_rows.h"
#include "fwd_tail.h"
#include "pipeline.h"
#include "tma_tensor.h"
#include "wgmma.h"

namespace flashattn::sm90 {

using namespace cute;

// A paged cache whose pages hold no whole key block but whole pieces of kPieceRows rows is loaded
// a piece at a time: each piece its own TMA copy at its page, landing where the whole block's
// copy would have put it. Pieces of kWidePieceRows where both the pages and the key block are
// multiples of that (fewer, larger copies). Pages of other sizes are gathered row by row
// (fwd_paged_rows.h).
constexpr int kPieceRows = 16;
constexpr int kWidePieceRows = 64;

// Named barriers (CUTLASS reserves the first ids; NamedBarrier adds that offset).
enum class FwdBarrier : uint32_t {
  TurnWG0 = 0,  // ping-pong: consumer WG0 may issue its GEMMs
  TurnWG1 = 1,  // ping-pong: consumer WG1 may issue its GEMMs
  QRowsWG0 = 2,  // pack-GQA: consumer WG0's gathered Q rows are in its buffer (fwd_packed_q.h)
  QRowsWG1 = 3,
  VTailWG0 = 4,  // consumer WG0 has zeroed a V stage's rows past its entry's keys
  VTailWG1 = 5,
};

__device__ inline void named_sync(FwdBarrier b, uint32_t threads) {
  cutlass::arch::NamedBarrier::sync(threads, static_cast<uint32_t>(b));
}
__device__ inline void named_arrive(FwdBarrier b, uint32_t threads) {
  cutlass::arch::NamedBarrier::arrive(threads, static_cast<uint32_t>(b));
}

// The consumer's lambdas run at several call sites; an outlined call would put the accumulators
// on a local-memory stack.
#define FLASHATTN_INLINE __attribute__((always_inline))

// Tile: kBlockN (keys per block), kStages (K/V pipeline depth), kQStages (Q buffers), and the
// code-shape choices kUnmaskedLoop, kTailSplit and, FP8 tiles only, kIeeeDescaleRatio.
// kIntraWGOverlap: the tile's own (Tile::kIntraWGOverlap), or off for the ablation.
// kHeadDim: of Q and K; kHeadDimV: of V and O (the 16-bit kernels only may take another).
// Cache: the element type of K and V in global memory where it is not Element: an e4m3 KV cache
// of the 16-bit kernels, whose producer widens its rows (staged or gathered) to Element in
// shared memory.
template <class Element_, int kHeadDim_, class Tile, bool kIntraWGOverlap_,
          int kHeadDimV_ = kHeadDim_, class Cache_ = Element_>
struct FwdTraits {
  using Element = Element_;  // of Q, O, and K and V in shared memory
  using Cache = Cache_;      // of K and V in global memory
  static constexpr bool kFp8 = sizeof(Element) == 1;
  static constexpr bool kWidensCache = !kFp8 && sizeof(Cache) == 1;
  static_assert(sizeof(Cache) == sizeof(Element) || kWidensCache, "an e4m3 cache of 16-bit Q");
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static_assert(!kFp8 || kHeadDimV == kHeadDim, "the FP8 forward has one head dim");
  static constexpr int kBlockM = 128;  // two consumer warpgroups of 64 rows
  static constexpr int kRowsPerWG = 64;
  static constexpr int kBlockN = Tile::kBlockN;
  static constexpr int kStages = Tile::kStages;
  static constexpr int kQStages = Tile::kQStages;
  static constexpr bool kIntraWGOverlap = kIntraWGOverlap_;
  // A second copy of the key-block loop for the blocks that need no mask or softcap, so that
  // their loop has none of those tests (branches) in it; which kernels gain is measured.
  static constexpr bool kUnmaskedLoop = Tile::kUnmaskedLoop;
  // FP8: the V-descale ratio by IEEE division, whose slow path moves ptxas's P·V wait
  // (FwdMainloop::softmax_step).
  static constexpr bool kIeeeDescaleRatio = [] {
    if constexpr (kFp8) {
      return Tile::kIeeeDescaleRatio;
    } else {
      return false;
    }
  }();
  // Calls whose tiles all visit the same key blocks may split the last partial wave's tiles by
  // key blocks (fwd_tail.h): a second instantiation of the kernel, so not in the overlap
  // ablation (a tile's own serial loop has it).
  static constexpr bool kTailSplit = Tile::kTailSplit && kIntraWGOverlap_ == Tile::kIntraWGOverlap;
  static_assert(!kIntraWGOverlap_ || Tile::kIntraWGOverlap,
                "a tile without intra-warpgroup overlap runs the serial loop only (its registers "
                "do not hold the overlapped one's)");
  // The next tile's first Q·Kᵀ beside this tile's last P·V: needs the next Q in its own buffer.
  static constexpr bool kCrossTileOverlap = kIntraWGOverlap && kQStages > 1;
  static constexpr int kConsumerWGs = kBlockM / kRowsPerWG;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // The producer's registers and the consumers' (setmaxnreg: 128·P + 256·C is at most the
  // launch's 168 × 384). An e4m3 cache's producer widens every row, which in 24 registers spills
  // its loop's state to local memory on every chunk; 56 take most of its other spills away
  // beside two chunks' widening at once (CacheStaging::kPassesAtOnce; four at once spill in the
  // loop again) and leave the consumers 224, whose key-block loop spills nothing.
  static constexpr int kProducerRegs = kWidensCache ? 56 : 24;
  static constexpr int kConsumerRegs = kWidensCache ? 224 : 240;
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 168 * 384, "the launch's registers");

  using TileQ = Shape<Int<kRowsPerWG>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using TileO = Shape<Int<kRowsPerWG>, Int<kHeadDimV>>;

  // K-major rows swizzled over the widest span (128, 64 or 32 bytes) that divides a row: 64 for
  // 16-bit at d96 and e4m3 at d64 and d192, 32 for e4m3 at d96 (96-byte rows).
  template <int kDim>
  using SmemAtomOf =
      conditional_t<kDim * sizeof(Element) % 128 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                    conditional_t<kDim * sizeof(Element) % 64 == 0,
                                  GMMA::Layout_K_SW64_Atom<Element>,
                                  GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemAtom = SmemAtomOf<kHeadDim>;
  using SmemLayoutQ = decltype(tile_to_shape(  // per consumer WG
      SmemAtom{}, Shape<Int<kRowsPerWG>, Int<kHeadDim>, Int<kQStages>>{}));
  using SmemLayoutK = decltype(tile_to_shape(
      SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // Vᵀ is the (head_dim, kBlockN) B operand of P·V. 16-bit: V is stored as it comes and Vᵀ is
  // the same bytes, MN-major. FP8 WGMMA takes K-major operands only: the quantize step wrote V
  // key-major (rows in fp8_v_row_head_dim order), and the TMA loads Vᵀ as it is.
  using SmemLayoutVRows = decltype(tile_to_shape(
      SmemAtomOf<kHeadDimV>{}, Shape<Int<kBlockN>, Int<kHeadDimV>, Int<kStages>>{}));
  using SmemLayoutVtOfV = decltype(composition(
      SmemLayoutVRows{}, make_ordered_layout(Shape<Int<kHeadDimV>, Int<kBlockN>, Int<kStages>>{},
                                             Step<_2, _1, _3>{})));
  using SmemAtomVtFp8 =
      conditional_t<kBlockN % 128 == 0, GMMA::Layout_K_SW128_Atom<Element>,
                    conditional_t<kBlockN % 64 == 0, GMMA::Layout_K_SW64_Atom<Element>,
                                  GMMA::Layout_K_SW32_Atom<Element>>>;
  using SmemLayoutVtFp8 = decltype(tile_to_shape(
      SmemAtomVtFp8{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}));
  using SmemLayoutVt = conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVtOfV>;
  using SmemLayoutV = conditional_t<kFp8, SmemLayoutVtFp8, SmemLayoutVRows>;  // as the TMA writes it
  using TileV = conditional_t<kFp8, Shape<Int<kHeadDim>, Int<kBlockN>>,
                              Shape<Int<kBlockN>, Int<kHeadDimV>>>;

  using MmaQK = decltype(make_tiled_mma(
      ss_atom<Element, Shape<Int<kRowsPerWG>, Int<kBlockN>, Int<kHeadDim>>>()));
  using MmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float,
                           Shape<Int<kRowsPerWG>, Int<kHeadDimV>, Int<kBlockN>>,
                           GMMA::Major::K, kFp8 ? GMMA::Major::K : GMMA::Major::MN>()));
  static_assert(wgmma_atom_n<MmaQK> == kBlockN && wgmma_atom_n<MmaPV> == kHeadDimV,
                "a WGMMA atom narrower than its GEMM (registry::extended_wgmma_n)");

  // (seqlen, head_dim, heads, batch) with head_dim contiguous.
  using GmemTensor = sm90::GmemTensor<Element>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutQ{}),
                                      TileQ{}, _1{}));
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{},
                                       take<0, 2>(SmemLayoutK{}), TileKV{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, GmemTensor{}, take<0, 2>(SmemLayoutV{}),
                                      TileV{}, _1{}));
  static constexpr uint32_t kBytesQ = kRowsPerWG * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = kBlockN * kHeadDimV * sizeof(Element);

  // An e4m3 cache whose pages hold whole pieces is staged (fwd_cache_staging.h) where the tile
  // has room for the staging slots beside its stages; its other pages, and all its pages where
  // there is no room, are gathered (fwd_paged_rows.h).
  using StagingK = CacheStaging<Element, kBlockN, kHeadDim, SmemLayoutK>;
  using StagingV = CacheStaging<Element, kBlockN, kHeadDimV, SmemLayoutV>;
  struct NoStaging {};
  template <bool kStaging>
  struct SharedStorageOf {
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutQ>> q[kConsumerWGs];
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
    alignas(1024) ArrayEngine<Element, cosize_v<SmemLayoutV>> v;
    TmaPipeline<kQStages> pipe_q;
    TmaPipeline<kStages> pipe_k;
    TmaPipeline<kStages> pipe_v;
    conditional_t<kStaging, typename StagingK::Storage, NoStaging> staging;
  };
  static constexpr int kSmemBytes = 232448;  // 227 KiB of shared memory per CTA on sm_90
  static constexpr bool kStagesCache = [] {
    if constexpr (kWidensCache && kHeadDimV == kHeadDim && kBlockN % (2 * kPieceRows) == 0) {
      return sizeof(SharedStorageOf<true>) <= kSmemBytes;
    } else {
      return false;
    }
  }();
  using SharedStorage = SharedStorageOf<kStagesCache>;
  static_assert(sizeof(SharedStorage) <= kSmemBytes, "227 KiB of shared memory per CTA on sm_90");

  // Pieces of a paged cache's key blocks (kPieceRows above): the 16-bit kernels' own caches',
  // each into its rows of a stage, and a staged e4m3 cache's, each into its rows of a staging
  // slot (half a block). FP8 takes no paged cache.
  static constexpr bool kTakesPieces = !kFp8 && (!kWidensCache || kStagesCache);
  static constexpr int kPiecesSpan = kWidensCache ? kBlockN / 2 : kBlockN;  // what pieces fill
  static constexpr bool kTakesWidePieces = kTakesPieces && kPiecesSpan % kWidePieceRows == 0;
  static_assert(kBlockN % kPieceRows == 0, "a key block of whole pieces");
  static_assert(kPiecesSpan / kPieceRows <= 32, "a piece for each lane of a warp at most");
  using PieceElement = conditional_t<kWidensCache, Cache, Element>;
  template <int kRows>
  using TilePieceK = Shape<Int<kRows>, Int<kHeadDim>>;
  template <int kRows>
  using TilePieceV = Shape<Int<kRows>, Int<kHeadDimV>>;
  // Where a piece lands: a stage's swizzled rows, or a staging slot's plain ones.
  template <int kRows, int kDim>
  using PieceSmemLayout =
      conditional_t<kWidensCache, Layout<Shape<Int<kRows>, Int<kDim>>, Stride<Int<kDim>, _1>>,
                    decltype(tile_to_shape(SmemAtomOf<kDim>{}, Shape<Int<kRows>, Int<kDim>>{}))>;
  template <int kRows>
  using TmaPieceK = decltype(make_tma_copy(SM90_TMA_LOAD{}, sm90::GmemTensor<PieceElement>{},
                                           PieceSmemLayout<kRows, kHeadDim>{},
                                           TilePieceK<kRows>{}, _1{}));
  template <int kRows>
  using TmaPieceV = decltype(make_tma_copy(SM90_TMA_LOAD{}, sm90::GmemTensor<PieceElement>{},
                                           PieceSmemLayout<kRows, kHeadDimV>{},
                                           TilePieceV<kRows>{}, _1{}));
};

// One query slot of a packed call's schedule: its entry, whole (as Sequences::at gives it, so
// that decoding a tile is one load and not a load of the slot and then of the offsets), and the
// entry's first slot. Slots past the last entry's hold an entry without rows.
struct alignas(16) PackedSlot {
  Sequences::Entry seq;
  int first;
};

template <class Traits>
struct FwdParams {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  void* o;  // Element, or for FP8 bf16 (o_bf16) or fp16
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  float* lse;  // (batch, heads_q, seqlen_q); packed: (heads_q, seqlen_q), or by sequence
  // `batch < 0` is the FP8 softmax's run-time false (ScaledOnlineSoftmax::step): never let the
  // compiler know batch is positive.
  int batch;  // entries (packed: sequences)
  int heads_q, heads_kv;
  int seqlen_q, seqlen_k;  // the tensors' rows (packed: all sequences')
  int num_m_blocks;        // query blocks of the longest entry
  int num_tiles;
  // Packed calls: each query slot's entry and the entry's first slot (fwd_packed_schedule);
  // null when dense.
  const PackedSlot* slot_entries;
  int tiles_per_unit;  // 2 with a right bound on the keys over several query blocks, else 1
  KeyRange keys;       // the call's; each tile's has its entry's lengths (WorkTile::keys)
  Sequences seqs;      // where each entry's rows lie (packed: the caller's offsets)
  float scale_log2;   // scale·log2(e), or softcap·log2(e) when softcap is on
  float softcap_pre;  // scale/softcap when softcap is on (scores become tanh(s·scale/softcap))
  bool softcap;
  bool pingpong;
  // FP8: descales (batch, heads, blocks), packed (heads, packed blocks): Q per query tile, K and
  // V per key block. An e4m3 cache (kWidensCache): K's and V's (batch, heads_kv) by sequence, or
  // null (1).
  const float* q_descale;
  const float* k_descale;
  const float* v_descale;
  // FP8: descale blocks per head of Q and of K and V (V's key-major rows hold
  // num_n_blocks·kBlockN keys); packed, packed_blocks (sequences.h).
  int num_q_blocks, num_n_blocks;
  bool o_bf16;
  FwdTail tail;  // the tail launch's pieces (fwd_tail.h)
  // A paged KV cache (flash_api.h; page_table null without one): K and V are num_pages pages of
  // page_size rows, and entry b's key j lies in row j % page_size of page
  // page_table[b·page_table_stride + j / page_size]. Pages of page_blocks whole key blocks are
  // loaded a block at a time (tma_k, tma_v); others (page_blocks 0) in pieces of piece_rows rows
  // (kPieceRows: tma_piece_k, tma_piece_v; kWidePieceRows: tma_wide_piece_k, tma_wide_piece_v,
  // which tiles that take no wide pieces do without), or, piece_rows 0, row by row from k_pages
  // and v_pages (fwd_paged_rows.h). A staged e4m3 cache's pieces land in staging slots.
  const int32_t* page_table;
  int64_t page_table_stride;
  int num_pages, page_size, page_blocks, piece_rows;
  int page_columns;  // seqlen_k / page_size: the table columns a sequence's keys span
  PagedRows k_pages, v_pages;
  template <class Tma>
  using PieceTma = conditional_t<Traits::kTakesPieces, Tma, tuple<>>;
  template <class Tma>
  using WidePieceTma = conditional_t<Traits::kTakesWidePieces, Tma, tuple<>>;
  PieceTma<typename Traits::template TmaPieceK<kPieceRows>> tma_piece_k;
  PieceTma<typename Traits::template TmaPieceV<kPieceRows>> tma_piece_v;
  WidePieceTma<typename Traits::template TmaPieceK<kWidePieceRows>> tma_wide_piece_k;
  WidePieceTma<typename Traits::template TmaPieceV<kWidePieceRows>> tma_wide_piece_v;
  // Pack-GQA (flash_api.h pack_gqa; the partial-results kernel only): with group > 1 a tile's
  // rows are (query row, query head) pairs, tile row i query row i / group of head
  // head_kv·group + i % group, and the tiles run per KV head; each consumer warpgroup then
  // gathers its Q rows itself (fwd_packed_q.h), from q and its strides. 1: rows are query rows.
  int group;
  const void* q;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  // Split-KV (the partial-results kernel only): each tile's key blocks cut into num_splits
  // ranges, work unit tile·num_splits + split, whose O and LSE go in f32 to slot unit of
  // tail.partials (tail_slot_floats each; fwd_merge.h merges them). 1: none.
  int num_splits;

  // The heads a call's tiles run over: the KV heads when packed by group, else the query heads.
  __host__ __device__ int tile_heads() const { return group > 1 ? heads_kv : heads_q; }
  // The KV head of a tile's head.
  __host__ __device__ int kv_head(int tile_head) const {
    return group > 1 ? tile_head : tile_head / (heads_q / heads_kv);
  }

  // Entries on the tensors' batch axis: one when the sequences are packed along the rows.
  __host__ __device__ int tensor_batch() const { return seqs.packed() ? 1 : batch; }
  // K's and V's rows and batch entries: a page's and the pages in a paged cache.
  __host__ __device__ bool paged() const { return page_table != nullptr; }
  __host__ __device__ int kv_rows() const { return paged() ? page_size : seqlen_k; }
  __host__ __device__ int kv_batch() const { return paged() ? num_pages : tensor_batch(); }
  // Whether the producer gathers K's and V's rows by cp.async: pages of neither whole key blocks
  // nor whole pieces (FP8 takes no paged cache; an e4m3 cache's pages are never whole blocks).
  __host__ __device__ bool gathers_pages() const {
    return !Traits::kFp8 && paged() && page_blocks == 0 && piece_rows == 0;
  }
  // Whether the producer warpgroup's threads fill the K and V stages, each arriving on a stage's
  // full barrier (gathered rows, and an e4m3 cache's widened ones); else one TMA arrival.
  __host__ __device__ bool threads_fill_stages() const {
    return Traits::kWidensCache || gathers_pages();
  }
  // Entry b's page of table column `column` (common/page_table.h: within the columns the call's
  // keys span, page_columns, and the cache's pages).
  __device__ int page(int b, int column) const {
    return table_page(page_table + int64_t(b) * page_table_stride, column, page_columns,
                      num_pages);
  }
  // Entry b's key block n: the page that holds it, and its block there (page_blocks > 0).
  __device__ int page_of(int b, int n, int& block) const {
    block = n % page_blocks;
    return page(b, n / page_blocks);
  }
};

}  // namespace flashattn::sm90
