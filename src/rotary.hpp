// Rotary embedding for the KV-cache call: checks and the host rotation (src/rotary.cpp).
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

// x (batch, rows, heads, d) rotated into a contiguous buffer of its dtype, row i of sequence b
// at position first[b] + i (per_row) or first[b]: float32 arithmetic (float64 for float64),
// rounded once.
std::vector<unsigned char> rotate_rows(const TensorView& x, const KvCacheExtras& e,
                                       const Rotary& r, const std::vector<int32_t>& first,
                                       bool per_row);

// A contiguous (batch, rows, heads, d) view of buf, otherwise like x.
TensorView contiguous_view(const TensorView& x, std::vector<unsigned char>& buf);

}  // namespace flashdl
