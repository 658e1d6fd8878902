// What the FP8 quantize step (fp8_quantize.cu) and the FP8 forward (fwd_mainloop.h) agree on: the
// block of rows one descale covers and the order of V's keys; the order of its head dims is in
// fp8_v_rows.h (which the forward kernel includes alone). Host and device.
#pragma once

#include "fp8_v_rows.h"

namespace flashattn::sm90 {

// Query rows per Q descale: the forward's query tile.
constexpr int kFp8QueryBlock = 128;

// Keys per K and V descale: the FP8 forward's key block for this head dim (0: no FP8 kernel in
// the registry, built or not).
constexpr int fp8_key_block(int head_dim) {
  return head_dim == 64    ? 192
         : head_dim == 96  ? 192
         : head_dim == 128 ? 256
         : head_dim == 192 ? 128
         : head_dim == 256 ? 128
                           : 0;
}

// The column of key `key` in V's key-major rows. The kernel converts P from the S accumulator
// without moving values between threads; in a 32-key slice, K index 4t + i + 16h of the P·V
// operand then holds key 16h + 8⌊i/2⌋ + 2t + i%2 (t: the lane within its quad, i < 4, h < 2),
// so V lists its keys in that order: key 16h + 8a + 2t + c sits at column 16h + 4t + 2a + c.
__host__ __device__ constexpr int fp8_key_position(int key) {
  const int j = key % 32;
  return key - j + 16 * (j / 16) + 4 * ((j / 2) % 4) + 2 * ((j / 8) % 2) + j % 2;
}

// The key at column `position` of V's key-major rows: the inverse of fp8_key_position.
__host__ __device__ constexpr int fp8_key_at(int position) {
  const int j = position % 32;
  return position - j + 16 * (j / 16) + 8 * ((j / 2) % 2) + 2 * ((j / 4) % 4) + j % 2;
}
constexpr bool fp8_key_order_inverts() {
  for (int key = 0; key < 64; ++key)
    if (fp8_key_at(fp8_key_position(key)) != key) return false;
  return true;
}
static_assert(fp8_key_order_inverts(), "fp8_key_at must invert fp8_key_position");

}  // namespace flashattn::sm90
