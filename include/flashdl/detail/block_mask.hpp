// The block-sparse mask of one (batch, head), shared by every backend and schedule: element (i, j)
// may be visible only where block (i / block_q, j / block_k) is set (the window must allow it too).
// A null pointer is the dense mask: every block set.
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

struct BlockMask {
  const uint8_t* blocks = nullptr;  // (nblocks_q, nblocks_k), rows row_stride apart; 0: zero block
  int64_t row_stride = 0;
  int64_t block_q = 1, block_k = 1;

  FLASHDL_HD bool dense() const { return blocks == nullptr; }
  FLASHDL_HD bool block(int64_t qb, int64_t kb) const {
    return blocks == nullptr || blocks[qb * row_stride + kb] != 0;
  }
  FLASHDL_HD bool visible(int64_t i, int64_t j) const { return block(i / block_q, j / block_k); }

  // Whether a set block covers query row i for some key of [j0, j1), or key j for some query row
  // of [i0, i1) (in-range indices, non-empty ranges). A row or key no set block covers is not
  // loaded: the CUDA kernels zero-fill it, so a NaN there cannot reach a product as 0 * NaN.
  FLASHDL_HD bool row_any(int64_t i, int64_t j0, int64_t j1) const {
    if (blocks == nullptr) return true;
    for (int64_t kb = j0 / block_k; kb <= (j1 - 1) / block_k; ++kb)
      if (block(i / block_q, kb)) return true;
    return false;
  }
  FLASHDL_HD bool col_any(int64_t j, int64_t i0, int64_t i1) const {
    if (blocks == nullptr) return true;
    for (int64_t qb = i0 / block_q; qb <= (i1 - 1) / block_q; ++qb)
      if (block(qb, j / block_k)) return true;
    return false;
  }

  // The blocks a tile [i0, i1) x [j0, j1) of in-range rows and keys touches (i1 <= seqlen_q,
  // j1 <= seqlen_k, both non-empty): `any` set means the tile must be computed, `all` set means
  // no element of it needs this mask. Used by the CUDA kernels, whose tiles need not line up
  // with the mask's blocks.
  struct Cover {
    bool any, all;
  };
  FLASHDL_HD Cover cover(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if (blocks == nullptr) return {true, true};
    bool any = false, all = true;
    for (int64_t qb = i0 / block_q; qb <= (i1 - 1) / block_q; ++qb)
      for (int64_t kb = j0 / block_k; kb <= (j1 - 1) / block_k; ++kb) {
        const bool b = block(qb, kb);
        any = any || b;
        all = all && b;
      }
    return {any, all};
  }
};

// The mask plane of batch b, head h (Params strides of 0 broadcast it over batches or heads).
FLASHDL_HD BlockMask block_mask_of(const Params& p, int64_t b, int64_t h) {
  BlockMask m;
  if (p.block_mask_ptr == nullptr) return m;
  m.blocks = p.block_mask_ptr + b * p.block_mask_batch_stride + h * p.block_mask_head_stride;
  m.row_stride = p.block_mask_row_stride;
  m.block_q = p.block_q;
  m.block_k = p.block_k;
  return m;
}

}  // namespace flashdl::detail
