// Toolchain self-test for sm_90a: proves, end to end on the GPU, the two Hopper features the
// FlashAttention-3 kernels stand on. One thread issues TMA loads of a 64x16 A tile and a 64x16
// B tile (bf16, K-major, 32-byte swizzle) completing on one mbarrier; one warpgroup then runs a
// single WGMMA (SS) computing C = A * B^T (64x64, f32 accumulators) and stores C row-major.
#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "../common/status.h"

namespace flashattn::sm90 {
namespace {

using namespace cute;
using Element = cutlass::bfloat16_t;

constexpr int kM = 64, kN = 64, kK = 16;
using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<Element>{},
                                           Shape<Int<kM>, Int<kK>>{}));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<Element>{},
                                           Shape<Int<kN>, Int<kK>>{}));
using TiledMma = decltype(make_tiled_mma(
    SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{}));
using Barrier = cutlass::arch::ClusterTransactionBarrier;

struct SharedStorage {
  alignas(128) ArrayEngine<Element, cosize_v<SmemLayoutA>> a;
  alignas(128) ArrayEngine<Element, cosize_v<SmemLayoutB>> b;
  alignas(8) uint64_t full;
};

template <class TmaA, class TmaB>
__global__ void __launch_bounds__(128, 1)
    selftest_kernel(__grid_constant__ const TmaA tma_a, __grid_constant__ const TmaB tma_b,
                    float* c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ SharedStorage smem;
  const int tid = threadIdx.x;

  Tensor sA = make_tensor(make_smem_ptr(smem.a.begin()), SmemLayoutA{});  // (M,K)
  Tensor sB = make_tensor(make_smem_ptr(smem.b.begin()), SmemLayoutB{});  // (N,K)
  Tensor mA = tma_a.get_tma_tensor(make_shape(kM, kK));                    // (M,K) coords
  Tensor mB = tma_b.get_tma_tensor(make_shape(kN, kK));                    // (N,K) coords

  if (tid == 0) {
    Barrier::init(&smem.full, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (tid == 0) {
    constexpr uint32_t kBytes = (kM + kN) * kK * sizeof(Element);
    Barrier::arrive_and_expect_tx(&smem.full, kBytes);
    auto cta_a = tma_a.get_slice(0);
    auto cta_b = tma_b.get_slice(0);
    copy(tma_a.with(smem.full), cta_a.partition_S(mA), cta_a.partition_D(sA));
    copy(tma_b.with(smem.full), cta_b.partition_S(mB), cta_b.partition_D(sB));
  }
  Barrier::wait(&smem.full, 0);

  TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor gC = make_tensor(make_gmem_ptr(c), make_shape(Int<kM>{}, Int<kN>{}),
                          make_stride(Int<kN>{}, Int<1>{}));  // (M,N) row-major
  Tensor tCsA = thr_mma.partition_A(sA);
  Tensor tCsB = thr_mma.partition_B(sB);
  Tensor tCrA = thr_mma.make_fragment_A(tCsA);  // smem descriptors
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);
  Tensor tCgC = thr_mma.partition_C(gC);
  Tensor tCrC = thr_mma.make_fragment_C(tCgC);

  mma.accumulate_ = GMMA::ScaleOut::Zero;
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  gemm(mma, tCrA, tCrB, tCrC);
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(tCrC);
  copy(tCrC, tCgC);
#endif
}

}  // namespace
}  // namespace flashattn::sm90

extern "C" flashattn_result_t flashattn_selftest_tma_wgmma(const void* a, const void* b,
                                                           float* c, void* stream) {
  using namespace cute;
  using namespace flashattn::sm90;
  if (a == nullptr || b == nullptr || c == nullptr) return flashattn::status(FLASHATTN_INVALID_ARGUMENT);
  // TMA needs 16-byte aligned global addresses.
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (!aligned(a) || !aligned(b)) return flashattn::status(FLASHATTN_INVALID_ARGUMENT);

  Tensor gA = make_tensor(make_gmem_ptr(static_cast<const Element*>(a)),
                          make_shape(kM, kK), make_stride(kK, Int<1>{}));
  Tensor gB = make_tensor(make_gmem_ptr(static_cast<const Element*>(b)),
                          make_shape(kN, kK), make_stride(kK, Int<1>{}));
  auto tma_a = make_tma_copy(SM90_TMA_LOAD{}, gA, SmemLayoutA{});
  auto tma_b = make_tma_copy(SM90_TMA_LOAD{}, gB, SmemLayoutB{});
  selftest_kernel<<<1, 128, 0, static_cast<cudaStream_t>(stream)>>>(tma_a, tma_b, c);
  return flashattn::check_launch();
}
