// Counter-based Philox4x32-10 and the dropout decision for one attention element. The mask depends
// only on (seed, offset, batch, head, row, col): the same on the CPU and the GPU, in forward and
// backward, for any schedule or tile size.
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"

namespace flashdl::detail {

struct Philox4 {
  uint32_t x[4];
};

FLASHDL_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

FLASHDL_HD Philox4 philox4x32_10(Philox4 ctr, uint32_t k0, uint32_t k1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(kM0, ctr.x[0], hi0, lo0);
    mulhilo32(kM1, ctr.x[2], hi1, lo1);
    ctr = Philox4{{hi1 ^ ctr.x[1] ^ k0, lo1, hi0 ^ ctr.x[3] ^ k1, lo0}};
    k0 += kW0;
    k1 += kW1;
  }
  return ctr;
}

// A uniform number in [0, 1) with 24 random bits for element (bh, row, col) of stream
// (seed, offset), bh = batch * nheads + head. The counter is (col, row, bh, offset) and the key
// the 64-bit seed, so distinct (seed, offset, element) never share a draw; validation keeps offset
// below 2^32 (bh, row and col are far below it for any array that fits in memory).
FLASHDL_HD float dropout_uniform(uint64_t seed, uint64_t offset, uint64_t bh, uint64_t row,
                                 uint64_t col) {
  const Philox4 ctr{{static_cast<uint32_t>(col), static_cast<uint32_t>(row),
                     static_cast<uint32_t>(bh), static_cast<uint32_t>(offset)}};
  const Philox4 r = philox4x32_10(ctr, static_cast<uint32_t>(seed),
                                  static_cast<uint32_t>(seed >> 32));
  return static_cast<float>(r.x[0] >> 8) * (1.0f / 16777216.0f);
}

// True when the element is kept (then scaled by 1 / (1 - p)).
FLASHDL_HD bool dropout_keep(float p, uint64_t seed, uint64_t offset, uint64_t bh, uint64_t row,
                             uint64_t col) {
  return dropout_uniform(seed, offset, bh, row, col) >= p;
}

}  // namespace flashdl::detail
