// The visibility predicate shared by every backend and schedule (DESIGN.md):
//   key j is visible to query i iff  c - left <= j <= c + right,  c = i + seqlen_k - seqlen_q,
// with left/right = -1 meaning unbounded; causal is (left, 0). Keys beyond seqlen_k never count.
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"

namespace flashdl::detail {

struct Mask {
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t left;   // -1: unbounded
  int64_t right;  // -1: unbounded

  FLASHDL_HD int64_t diag(int64_t i) const { return i + seqlen_k - seqlen_q; }

  FLASHDL_HD bool visible(int64_t i, int64_t j) const {
    const int64_t c = diag(i);
    return j >= 0 && j < seqlen_k && (left < 0 || j >= c - left) && (right < 0 || j <= c + right);
  }

  // First visible key of row i (clamped to [0, seqlen_k]). Non-decreasing in i.
  FLASHDL_HD int64_t col_begin(int64_t i) const {
    if (left < 0) return 0;
    const int64_t b = diag(i) - left;
    return b < 0 ? 0 : (b > seqlen_k ? seqlen_k : b);
  }

  // One past the last visible key of row i (clamped to [0, seqlen_k]). Non-decreasing in i.
  FLASHDL_HD int64_t col_end(int64_t i) const {
    if (right < 0) return seqlen_k;
    const int64_t e = diag(i) + right + 1;
    return e < 0 ? 0 : (e > seqlen_k ? seqlen_k : e);
  }

  // Keys any row of [i0, i1) can see: [col_begin(i0), col_end(i1 - 1)). Empty when i0 >= i1.
  FLASHDL_HD int64_t block_col_begin(int64_t i0) const { return col_begin(i0); }
  FLASHDL_HD int64_t block_col_end(int64_t i1) const { return col_end(i1 - 1); }

  // True when every row of [i0, i1) sees every key of [j0, j1): no element needs masking.
  FLASHDL_HD bool block_fully_visible(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return col_begin(i1 - 1) <= j0 && j1 <= col_end(i0);
  }

  // Queries any key of [j0, j1) is visible to: [row_begin(j0), row_end(j1 - 1)). Used by the
  // backward pass, which walks query blocks for a fixed key block.
  FLASHDL_HD int64_t row_begin(int64_t j) const {
    // smallest i with col_end(i) > j, i.e. diag(i) + right >= j
    if (right < 0) return 0;
    const int64_t r = j - right - (seqlen_k - seqlen_q);
    return r < 0 ? 0 : (r > seqlen_q ? seqlen_q : r);
  }
  FLASHDL_HD int64_t row_end(int64_t j) const {
    // one past the largest i with col_begin(i) <= j, i.e. diag(i) - left <= j
    if (left < 0) return seqlen_q;
    const int64_t r = j + left - (seqlen_k - seqlen_q) + 1;
    return r < 0 ? 0 : (r > seqlen_q ? seqlen_q : r);
  }
};

FLASHDL_HD Mask make_mask(int64_t seqlen_q, int64_t seqlen_k, int64_t left, int64_t right) {
  return Mask{seqlen_q, seqlen_k, left, right};
}

}  // namespace flashdl::detail
