// The C ABI's operand checks (csrc/common/views.h) on layouts callers really pass: dQ, dK, dV
// interleaved in one packed buffer share no element, while views shifted into each other do;
// zero, negative and misaligned strides; spans past int64. Built and run by tests/c_abi/main.rs
// with the system's C++ compiler; exits non-zero on the first wrong answer.
#include <cstdint>
#include <cstdio>

#include "common/views.h"

using flashattn::View;

static int failures = 0;

static void expect(bool got, bool want, const char* what) {
  if (got != want) {
    std::printf("%s: got %d, want %d\n", what, got, want);
    ++failures;
  }
}

static void* at(int64_t byte) { return reinterpret_cast<void*>((int64_t(1) << 40) + byte); }

int main() {
  const int64_t b = 2, s = 8, h = 4, d = 64, e = 2;  // bf16
  // (b, s, 3, h, d) packed: Q, K, V (or dQ, dK, dV) at head offsets 0, h, 2h.
  const int64_t row = 3 * h * d, batch = s * row;
  auto part = [&](int which) {
    return View::of({at(which * h * d * e), batch, row, d}, e, b, s, h, d);
  };
  const View dq = part(0), dk = part(1), dv = part(2);
  expect(dq.addressable() && dk.addressable() && dv.addressable(), true, "packed parts");
  expect(dq.one_to_one(), true, "a packed part reaches each element once");
  expect(flashattn::overlap(dq, dk) || flashattn::overlap(dk, dv) || flashattn::overlap(dq, dv),
         false, "interleaved parts");
  expect(flashattn::overlap(dq, dq), true, "a view and itself");
  // Shifted by one row, by half a head, by one element: they share elements.
  expect(flashattn::overlap(dq, View::of({at(row * e), batch, row, d}, e, b, s, h, d)), true,
         "shifted a row");
  expect(flashattn::overlap(dq, View::of({at(32 * e), batch, row, d}, e, b, s, h, d)), true,
         "shifted half a head");
  expect(flashattn::overlap(dq, View::of({at(e), batch, row, d}, e, b, s, h, d)), true,
         "shifted an element");
  // Another buffer, and a view of other strides over the same bytes.
  expect(flashattn::overlap(dq, View::of({at(int64_t(1) << 30), s * h * d, h * d, d}, e, b, s,
                                         h, d)),
         false, "separate buffers");
  expect(flashattn::overlap(dq, View::of({at(0), s * h * d, h * d, d}, e, b, s, h, d)), true,
         "other strides over the same bytes");
  // A packed f32 LSE after O, and one starting inside it.
  const View o = View::of({at(0), s * h * d, h * d, d}, e, b, s, h, d);
  const int64_t o_bytes = b * s * h * d * e;
  expect(flashattn::overlap(o, View::packed(at(o_bytes), 4, b * h * s, 4)), false, "LSE after O");
  expect(flashattn::overlap(o, View::packed(at(o_bytes - 4), 4, b * h * s, 4)), true,
         "LSE inside O");
  // Strides.
  expect(View::of({at(0), s * h * d, 0, d}, e, b, s, h, d).one_to_one(), false, "zero row stride");
  expect(View::of({at(0), s * h * d, 0, d}, e, b, s, h, d).addressable(), true,
         "zero row stride is addressable (inputs may broadcast)");
  expect(View::of({at(0), s * h * d, h * d, 32}, e, b, s, h, d).one_to_one(), false,
         "heads half over each other");
  expect(View::of({at(0), -s * h * d, h * d, d}, e, b, s, h, d).addressable(), false,
         "negative batch stride");
  expect(View::of({at(0), s * h * d, 7, d}, e, b, s, h, d).addressable(), false,
         "row stride of 7 elements");
  expect(View::of({at(2), s * h * d, h * d, d}, e, b, s, h, d).addressable(), false,
         "pointer misaligned by 2 bytes");
  expect(View::of({at(0), int64_t(1) << 39, h * d, d}, e, b, s, h, d).addressable(), false,
         "a 1 TiB stride (TMA's limit)");
  expect(View::of({at(0), s * h * d, h * d, d}, e, 1, s, h, d).addressable(), true,
         "one batch entry");
  expect(View::of({at(0), -7, h * d, d}, e, 1, s, h, d).addressable(), true,
         "the stride of a dimension of extent 1 is never used");
  expect(View::of({at(0), (int64_t(1) << 62), 16, d}, 1, 3, 1, 1, d).addressable(), false,
         "a span past int64");
  // Spans past int64 of strides within TMA's limit: offsets that overflow, and offsets that
  // fit but bytes that do not; and a large span that fits.
  expect(View::of({at(0), int64_t(1) << 39, 16, d}, 1, int64_t(1) << 25, 1, 1, d).addressable(),
         false, "offsets past int64 (a 2^39-byte stride, 2^25 entries)");
  expect(View::of({at(0), int64_t(1) << 38, 16, d}, 2, (int64_t(1) << 24) + 1, 1, 1, d)
             .addressable(),
         false, "bytes past int64 (offsets up to 2^62 of 2 bytes)");
  expect(View::of({at(0), int64_t(1) << 39, 16, d}, 1, int64_t(1) << 20, 1, 1, d).addressable(),
         true, "a 2^59-byte span");
  expect(View::packed(at(2), 4, 8, 4).addressable(), false, "f32 misaligned");
  expect(View::packed(nullptr, 4, 8, 4).addressable(), false, "null");
  if (failures == 0) std::printf("operand checks: all cases as expected\n");
  return failures == 0 ? 0 : 1;
}
