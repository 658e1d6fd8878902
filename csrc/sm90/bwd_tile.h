// The sm90 backward's tile struct. The units build.rs generates define each head dim's tile from
// the tile table in src/registry.rs: kBlockM (query rows per block), kBlockN
// (keys per CTA), kStages (Q and dS buffers), kStagesdO (dO buffers), kSplitHeadDim (the
// consumer warpgroups split the head dim, bwd_kernel_split_d.h, instead of the keys,
// bwd_kernel.h) and kKeysAsN (they split the keys as the GEMMs' N, bwd_kernel_keys_n.h).
#pragma once

namespace flashattn::sm90 {

template <int kHeadDim, int kHeadDimV = kHeadDim> struct BwdTile;

}  // namespace flashattn::sm90
