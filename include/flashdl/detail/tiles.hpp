// Tile sizes from an on-chip budget, shared by the CPU and the CUDA code.
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"

namespace flashdl::detail {

FLASHDL_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
FLASHDL_HD int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

struct Fa1Tiles {
  int64_t Bc;  // key/value rows per block
  int64_t Br;  // query rows per block
};

// Algorithm 1, line 1: Bc = ceil(M / 4d), Br = min(Bc, d), with M the on-chip budget in elements.
// At least one row each, whatever the budget.
FLASHDL_HD Fa1Tiles fa1_tiles(int64_t m_elements, int64_t headdim) {
  int64_t bc = ceil_div(m_elements, 4 * headdim);
  if (bc < 1) bc = 1;
  const int64_t br = bc < headdim ? bc : headdim;
  return Fa1Tiles{bc, br};
}

}  // namespace flashdl::detail
