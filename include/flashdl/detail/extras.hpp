// The additive bias and boolean mask of one (batch, head), shared by every backend and schedule
// (Params::bias_ptr, mask_ptr). The order of the score modifiers, in natural-log units:
//   s = scale * q.k;  s = softcap * tanh(s / softcap);  s -= ALiBi;  s += bias[b, h, i, j];
//   then the window/causal mask, the block mask and the boolean mask (-inf where any hides key j),
//   then the softmax (with the sink, when given, in its denominator).
// A broadcast axis has stride 0, so every (b, h, i, j) reads through the same arithmetic. dBias is
// dS = P * (dP - D) before the softcap's derivative and the softmax scale, summed over the
// broadcast axes into (bias_batch, bias_heads, bias_rows, seqlen_k) (dbias_index).
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

struct HeadExtras {
  const void* bias = nullptr;  // at (b, h, 0, 0); null: none
  DType bias_dtype = DType::float32;
  int64_t bias_row = 0, bias_col = 0;
  const uint8_t* keep = nullptr;  // at (b, h, 0, 0); null: every key kept
  int64_t mask_row = 0, mask_col = 0;

  FLASHDL_HD bool any() const { return bias != nullptr || keep != nullptr; }
  FLASHDL_HD int64_t bias_offset(int64_t i, int64_t j) const { return i * bias_row + j * bias_col; }
  FLASHDL_HD bool kept(int64_t i, int64_t j) const {
    return keep == nullptr || keep[i * mask_row + j * mask_col] != 0;
  }
};

FLASHDL_HD HeadExtras extras_of(const Params& p, int64_t b, int64_t h) {
  HeadExtras e;
  if (p.bias_ptr != nullptr) {
    e.bias = static_cast<const char*>(p.bias_ptr) +
             (b * p.bias_batch_stride + h * p.bias_head_stride) *
                 (p.bias_dtype == DType::float64   ? 8
                  : p.bias_dtype == DType::float32 ? 4
                                                   : 2);
    e.bias_dtype = p.bias_dtype;
    e.bias_row = p.bias_row_stride;
    e.bias_col = p.bias_col_stride;
  }
  if (p.mask_ptr != nullptr) {
    e.keep = p.mask_ptr + b * p.mask_batch_stride + h * p.mask_head_stride;
    e.mask_row = p.mask_row_stride;
    e.mask_col = p.mask_col_stride;
  }
  return e;
}

// Whether a call has a bias or a mask (the kernels keep their plain path otherwise).
FLASHDL_HD bool has_extras(const Params& p) {
  return p.bias_ptr != nullptr || p.mask_ptr != nullptr;
}

// The row of the compact dBias, (bias_batch, bias_heads, bias_rows, seqlen_k) row-major, that
// score (b, h, i, j) adds into, and (dbias_index) its first element.
FLASHDL_HD int64_t dbias_row(const Params& p, int64_t b, int64_t h, int64_t i) {
  const int64_t bb = p.bias_batch > 1 ? b : 0, hh = p.bias_heads > 1 ? h : 0,
                ii = p.bias_rows > 1 ? i : 0;
  return (bb * p.bias_heads + hh) * p.bias_rows + ii;
}
FLASHDL_HD int64_t dbias_index(const Params& p, int64_t b, int64_t h, int64_t i) {
  return dbias_row(p, b, h, i) * p.seqlen_k;
}

// Whether each element of the compact dBias receives exactly one score: the bias has every axis of
// its own (its batch, heads and query rows; a varlen bias its packed rows), no broadcast.
FLASHDL_HD bool dbias_direct(const Params& p) {
  return (p.cu_seqlens_q != nullptr || p.bias_batch == p.batch) && p.bias_heads == p.nheads &&
         p.bias_rows == (p.cu_seqlens_q != nullptr ? p.total_q : p.seqlen_q);
}

}  // namespace flashdl::detail
