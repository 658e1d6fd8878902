// The order of V's head dims in the FP8 forward's key-major V (its rows), on which the quantize
// step (fp8_quantize.cu, through fp8_layout.h) and the forward's epilogue (fwd_epilogue.h) agree.
// Host and device.
#pragma once

namespace flashattn::sm90 {

// The head-dim index that row `row` of V's key-major layout holds (its own inverse). O = P·V
// leaves accumulator column n with V's row n, and a WGMMA accumulator gives lane t of a quad
// columns 8j + 2t, 8j + 2t + 1 of each 8-column group j. With rows 32g + 8i + 2t + c holding
// head dims 32g + 8t + 2i + c (i, t < 4, c < 2), groups 4g .. 4g + 3 give lane t the 8 head dims
// from 32g + 8t on: one 16-byte store of O, with no values moved between lanes.
__host__ __device__ constexpr int fp8_v_row_head_dim(int row) {
  const int j = row % 32;
  return row - j + 8 * ((j / 2) % 4) + 2 * (j / 8) + j % 2;
}
// Its own inverse, and for head dims up to 256: words 4g .. 4g + 3 of lane t (accumulator
// columns 8(4g + i) + 2t + c) are head dims 32g + 8t .. 32g + 8t + 7 in order.
constexpr bool fp8_v_rows_hold_whole_chunks() {
  for (int row = 0; row < 256; ++row)
    if (fp8_v_row_head_dim(fp8_v_row_head_dim(row)) != row) return false;
  for (int g = 0; g < 8; ++g)
    for (int t = 0; t < 4; ++t)
      for (int i = 0; i < 4; ++i)
        for (int c = 0; c < 2; ++c)
          if (fp8_v_row_head_dim(8 * (4 * g + i) + 2 * t + c) != 32 * g + 8 * t + 2 * i + c)
            return false;
  return true;
}
static_assert(fp8_v_rows_hold_whole_chunks(), "fp8_v_row_head_dim: whole 16-byte chunks of O");

}  // namespace flashattn::sm90
