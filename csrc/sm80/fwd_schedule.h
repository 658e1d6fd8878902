// The sm80 forward's schedules, shared by the kernel and the tile table.
#pragma once

namespace flashattn::sm80 {

// How a key block's work is ordered. LateK / EarlyK: one K and one V buffer; the next K block's
// load is issued after (LateK) or before (EarlyK) the softmax. Overlap: two K and two V buffers,
// and the next block's S = Q·Kᵀ is issued beside this block's softmax, so that the tensor pipe
// has work while the exponentials run (FlashAttention-3's intra-warpgroup overlap, done by the
// instruction scheduler here since mma.sync has no asynchronous form).
enum class FwdSchedule { LateK, EarlyK, Overlap };

}  // namespace flashattn::sm80
