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

// The tiles of one axis (query rows or keys): [0, n) cut at every multiple of `segment` and each
// segment cut into tiles of at most `tile` elements, so that no tile straddles two segments. With a
// block-sparse mask the segment is the mask's block size and every tile lies in one mask block;
// dense, the segment is the whole axis and the tiles are the usual [t * tile, (t + 1) * tile).
struct AxisTiles {
  int64_t n = 0;            // length of the axis
  int64_t segment = 1;      // >= 1
  int64_t tile = 1;         // longest tile, 1 <= tile <= segment
  int64_t per_segment = 1;  // tiles in a full segment

  FLASHDL_HD int64_t count() const {
    return n <= 0 ? 0 : (n / segment) * per_segment + ceil_div(n % segment, tile);
  }
  FLASHDL_HD int64_t segment_of(int64_t t) const { return t / per_segment; }
  FLASHDL_HD int64_t start(int64_t t) const {
    return segment_of(t) * segment + (t % per_segment) * tile;
  }
  FLASHDL_HD int64_t size(int64_t t) const {
    const int64_t s = start(t);
    int64_t e = (segment_of(t) + 1) * segment;
    if (s + tile < e) e = s + tile;
    if (n < e) e = n;
    return e - s;
  }
  // The tile holding position x in [0, n); count() for x >= n.
  FLASHDL_HD int64_t tile_of(int64_t x) const {
    return x >= n ? count() : (x / segment) * per_segment + (x % segment) / tile;
  }
};

// segment <= 0: the whole axis is one segment. The tile is capped at the segment: a longer one
// would only add padding.
FLASHDL_HD AxisTiles make_axis_tiles(int64_t n, int64_t segment, int64_t tile) {
  AxisTiles a;
  a.n = n;
  a.segment = segment > 0 ? segment : (n > 1 ? n : 1);
  a.tile = tile < 1 ? 1 : (tile < a.segment ? tile : a.segment);
  a.per_segment = ceil_div(a.segment, a.tile);
  return a;
}

}  // namespace flashdl::detail
