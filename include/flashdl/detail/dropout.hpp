// The dropout of one (batch, head) plane as the kernels apply it: element (row, col) of the
// attention probabilities is multiplied by 0 (dropped) or 1 / (1 - p) (kept), decided by
// dropout_keep (philox.hpp), so every backend, schedule and tiling drops the same elements.
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/detail/philox.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

struct Dropout {
  float p = 0.0f;  // probability of dropping; 0: no dropout
  float kept_scale = 1.0f;
  uint64_t seed = 0, offset = 0, bh = 0;

  FLASHDL_HD bool on() const { return p > 0.0f; }
  FLASHDL_HD bool keep(int64_t row, int64_t col) const {
    return dropout_keep(p, seed, offset, bh, static_cast<uint64_t>(row),
                        static_cast<uint64_t>(col));
  }
  FLASHDL_HD float multiplier(int64_t row, int64_t col) const {
    return keep(row, col) ? kept_scale : 0.0f;
  }
};

// The dropout stream key of batch b, head h of this call: its plane in the whole (unsliced) call,
// (b + dropout_batch_offset) * dropout_nheads + (h + dropout_head_offset). Every backend's mask
// goes through here (dropout_of, the CPU blocks and reference).
FLASHDL_HD uint64_t dropout_bh(const Params& p, int64_t b, int64_t h) {
  return static_cast<uint64_t>((b + p.dropout_batch_offset) * p.dropout_nheads +
                               (h + p.dropout_head_offset));
}

// The plane of batch b (of this call), head h (keyed by dropout_bh).
FLASHDL_HD Dropout dropout_of(const Params& p, int64_t b, int64_t h) {
  Dropout d;
  if (!(p.p_dropout > 0.0f)) return d;
  d.p = p.p_dropout;
  d.kept_scale = 1.0f / (1.0f - p.p_dropout);
  d.seed = p.seed;
  d.offset = p.offset;
  d.bh = dropout_bh(p, b, h);
  return d;
}

}  // namespace flashdl::detail
