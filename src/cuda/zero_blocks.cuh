// Which key rows of a K/V tile a CTA needs, when it keeps the tile for many query tiles (fa2's
// backward, both fa1 kernels): a row that only zero blocks of the block mask cover, for every
// head and query row the CTA computes, is zero-filled instead of loaded, so that a NaN or Inf
// there never meets a zero probability in a tensor-core product (0 * NaN is NaN).
#pragma once

#include <cstdint>

#include "flashdl/detail/block_mask.hpp"
#include "flashdl/params.hpp"

namespace flashdl::cuda {

// flags[r] = 1 when some set block of heads [h0, h0 + heads) covers key j0 + r for some query
// row of [i0, i1), for r in [0, rows). flags holds 2 * rows bytes of shared memory (the second
// half is scratch). Every thread of the CTA calls it; it ends with a barrier.
__device__ __forceinline__ void needed_key_rows(const Params& p, int64_t batch, int64_t h0,
                                                int64_t heads, int64_t i0, int64_t i1, int64_t j0,
                                                int rows, unsigned char* flags, int threads) {
  if (p.block_mask_ptr == nullptr || i1 <= i0) {
    for (int r = threadIdx.x; r < rows; r += threads) flags[r] = p.block_mask_ptr == nullptr;
    __syncthreads();
    return;
  }
  const int64_t kb0 = j0 / p.block_k, nkb = (j0 + rows - 1) / p.block_k - kb0 + 1;  // <= rows
  const int64_t qb0 = i0 / p.block_q, nqb = (i1 - 1) / p.block_q - qb0 + 1;
  unsigned char* any = flags + rows;  // per key block of the tile
  for (int64_t k = threadIdx.x; k < nkb; k += threads) any[k] = 0;
  __syncthreads();
  const int64_t items = nkb * heads * nqb;
  for (int64_t it = threadIdx.x; it < items; it += threads) {
    const int64_t k = it % nkb, h = (it / nkb) % heads, qb = it / (nkb * heads);
    if (detail::block_mask_of(p, batch, h0 + h).block(qb0 + qb, kb0 + k)) any[k] = 1;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < rows; r += threads) flags[r] = any[(j0 + r) / p.block_k - kb0];
  __syncthreads();
}

}  // namespace flashdl::cuda
