// Which blocks of one axis a block of the other axis must visit, from the visibility window alone
// (host+device, shared by the CUDA backward kernels and tested against brute force by ctest).
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/tiles.hpp"

namespace flashdl::detail {

// Block indices [begin, end); empty when begin == end.
struct BlockRange {
  int64_t begin = 0, end = 0;
  FLASHDL_HD int64_t size() const { return end - begin; }
};

// The query blocks of `block` rows holding every row that some key of [j0, j1) is visible to
// (the backward's loop for one key block). Empty when no query sees those keys.
FLASHDL_HD BlockRange query_blocks_for_keys(const Mask& m, int64_t j0, int64_t j1, int64_t block) {
  if (j1 <= j0) return {};
  const int64_t lo = m.row_begin(j0), hi = m.row_end(j1 - 1);
  if (hi <= lo) return {};
  return {lo / block, ceil_div(hi, block)};
}

// The key blocks of `block` keys holding every key visible to some row of [i0, i1) (the forward's
// loop, and the deterministic dQ pass). Empty when those rows see no key.
FLASHDL_HD BlockRange key_blocks_for_queries(const Mask& m, int64_t i0, int64_t i1, int64_t block) {
  if (i1 <= i0) return {};
  const int64_t lo = m.block_col_begin(i0), hi = m.block_col_end(i1);
  if (hi <= lo) return {};
  return {lo / block, ceil_div(hi, block)};
}

}  // namespace flashdl::detail
