// Where key j of sequence b lives in a KV cache, contiguous or paged (host+device; shared by the
// CPU backend's cache append, src/cpu/kvcache.cpp, and the kernels that read the cache).
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

// Element offset of key j of sequence b, kv head hk, in a cache with these strides (j counted
// from cache_leftpad[b] when set). Contiguous: batch b (cache_batch_idx[b] when set), row j. Paged (Params.block_table set): row j % page_size of page
// block_table[b][j / page_size], batch_stride then being the stride between pages.
FLASHDL_HD int64_t cache_offset(const Params& p, int64_t b, int64_t j, int64_t hk,
                                int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
  if (p.cache_leftpad != nullptr) j += p.cache_leftpad[b];
  if (p.block_table == nullptr) {
    const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    return row * batch_stride + j * row_stride + hk * head_stride;
  }
  const int64_t page = p.block_table[b * p.block_table_batch_stride + j / p.page_size];
  return page * batch_stride + (j % p.page_size) * row_stride + hk * head_stride;
}

FLASHDL_HD int64_t k_cache_offset(const Params& p, int64_t b, int64_t j, int64_t hk) {
  return cache_offset(p, b, j, hk, p.k_batch_stride, p.k_row_stride, p.k_head_stride);
}
FLASHDL_HD int64_t v_cache_offset(const Params& p, int64_t b, int64_t j, int64_t hk) {
  return cache_offset(p, b, j, hk, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
}

}  // namespace flashdl::detail
