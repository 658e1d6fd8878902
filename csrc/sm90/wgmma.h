// Which WGMMA atom a tiled MMA issues. CUTLASS's selector picks, for an N that is not one of its
// atom sizes (an extended shape such as 160 or 224 in a unit built without them, see
// registry::extended_wgmma), the widest size that divides N, and the kernel then runs as several
// narrower GEMMs: correct and slow. The traits assert that each atom covers its whole N.
#pragma once

#include <cute/tensor.hpp>

namespace flashattn::sm90 {

template <class TiledMma>
constexpr int wgmma_atom_n = decltype(cute::size<1>(typename TiledMma::AtomShape_MNK{}))::value;

}  // namespace flashattn::sm90
