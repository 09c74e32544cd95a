// Rotary embedding for the KV-cache call: the checks of its tables (src/rotary.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "flashdl/api.hpp"

namespace flashdl {

// Rotary embedding: the checked cos/sin and what to rotate.
struct Rotary {
  bool on = false;
  bool interleaved = false;
  bool per_row_q = false;  // q row i at cache_seqlens + i (causal or windowed), else all at it
  int64_t dim = 0;         // rotary_dim
};

// rotary_cos and rotary_sin checked against q, and against the positions the call reads
// (cache_seqlens plus the new rows, q's rows when causal or windowed); off when neither is given.
Rotary check_rotary(const KvCacheExtras& x, const TensorView& q,
                    const std::vector<int32_t>& seqlens, int64_t seqlen_new, int64_t capacity,
                    const Options& o);

}  // namespace flashdl
