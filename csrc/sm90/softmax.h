// WGMMA accumulator layouts as the online softmax (common/online_softmax.h) and the P·V GEMM
// want them.
#pragma once

#include <cute/tensor.hpp>

#include "../common/online_softmax.h"

namespace flashattn::sm90 {

using namespace cute;

// ((2,2,N/8), MMA_M, MMA_N) accumulator layout -> ((2, MMA_M), (2, N/8, MMA_N)) rows x cols.
template <class Layout>
__device__ constexpr auto acc_rowcol(Layout l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The fp32 accumulator of S = Q·Kᵀ, ((2,2,N/8), MMA_M, MMA_N), reused as the A operand of
// O += P·V: ((2,2,2), MMA_M, K/16), i.e. every two 8-column groups of S form one 16-wide K slice
// of P. MMA_N > 1 when the selected atom is narrower than the key block.
template <class Layout>
__device__ constexpr auto acc_as_operand_a(Layout l) {
  auto split = logical_divide(get<0>(l), Shape<Underscore, Underscore, _2>{});  // (2,2,(2,N/16))
  return make_layout(make_layout(get<0>(split), get<1>(split), get<2, 0>(split)), get<1>(l),
                     coalesce(make_layout(get<2, 1>(split), get<2>(l))));
}

}  // namespace flashattn::sm90
