// The (seqlen, head_dim, heads, batch) view of a caller's tensor that the sm90 kernels' TMA
// descriptors are made from; shared by the forward and backward launchers.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

#include "../flash_api.h"

namespace flashattn::sm90 {

using namespace cute;

// Strides of dimensions of extent 1 are never used, but TMA still wants them 16-byte multiples.
inline int64_t tma_stride(int64_t stride, int extent, int head_dim) {
  return extent == 1 ? head_dim : stride;
}

// kDim: the tensor's head dim, the kernel's kHeadDim unless given (V and O may have another).
template <class Traits, int kDim = Traits::kHeadDim, class Ptr>
auto gmem_tensor(Ptr ptr, const flashattn_tensor_t& t, int seqlen, int heads, int batch) {
  constexpr int d = kDim;
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, d, heads, batch),
                     make_stride(tma_stride(t.row_stride, seqlen, d), _1{},
                                 tma_stride(t.head_stride, heads, d),
                                 tma_stride(t.batch_stride, batch, d)));
}

// The type of that view, for the kernel traits that spell their TMA copies' types.
template <class Element>
using GmemTensor = decltype(make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                        Shape<int32_t, int32_t, int32_t, int32_t>{},
                                        Stride<int64_t, _1, int64_t, int64_t>{}));

}  // namespace flashattn::sm90
