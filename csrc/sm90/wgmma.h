// Which WGMMA atom a tiled MMA issues. CUTLASS's selector picks, for an N that is not one of its
// default atom sizes, the widest size that divides N, and the kernel then runs as several
// narrower GEMMs: correct and slow. The extended sizes the tiles take (80, 112, 160 keys) come
// from a header per shape that build.rs generates from the registry and includes in the units
// whose kernels take it (each specializes ExtendedSsAtom, which ss_atom picks first), and the
// traits assert that each atom covers its whole N.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <type_traits>

namespace flashattn::sm90 {

// The generated SS atom of (Element, N) with operands of majors A and B, where a unit includes
// one (build.rs, wgmma_atom_header); void otherwise.
template <class Element, int N, cute::GMMA::Major A = cute::GMMA::Major::K,
          cute::GMMA::Major B = cute::GMMA::Major::K>
struct ExtendedSsAtom {
  using type = void;
};

template <class TiledMma>
constexpr int wgmma_atom_n = decltype(cute::size<1>(typename TiledMma::AtomShape_MNK{}))::value;

// The SS atom (f32 accumulators; operands K-major unless A and B say otherwise) of a GEMM of tile
// TileShape (M, N, K): the generated one of an extended N, else CUTLASS's.
template <class Element, class TileShape, cute::GMMA::Major A = cute::GMMA::Major::K,
          cute::GMMA::Major B = cute::GMMA::Major::K>
CUTE_HOST_DEVICE constexpr auto ss_atom() {
  constexpr int kN = decltype(cute::size<1>(TileShape{}))::value;
  using Extended = typename ExtendedSsAtom<Element, kN, A, B>::type;
  if constexpr (!std::is_void_v<Extended>) {
    return Extended{};
  } else {
    return cute::GMMA::ss_op_selector<Element, Element, float, TileShape, A, B>();
  }
}

}  // namespace flashattn::sm90
