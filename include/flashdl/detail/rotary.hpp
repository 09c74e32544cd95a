// Rotary position embedding (RoPE) as flash-attn's apply_rotary_emb computes it (host+device;
// the KV-cache call rotates q and the new keys with it before they are used or written).
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"

namespace flashdl::detail {

// The columns pair m (0 <= m < rotary_dim / 2) of a head row rotates together: (2m, 2m + 1)
// interleaved (GPT-J), (m, m + rotary_dim / 2) otherwise (GPT-NeoX). Columns from rotary_dim
// on are left as they are.
struct RotaryPair {
  int64_t first, second;
};
FLASHDL_HD RotaryPair rotary_pair(int64_t m, int64_t rotary_dim, bool interleaved) {
  return interleaved ? RotaryPair{2 * m, 2 * m + 1} : RotaryPair{m, m + rotary_dim / 2};
}

// (x1, x2) rotated by the angle whose cosine and sine are c and s: x1 c - x2 s, x1 s + x2 c,
// each product rounded before the sum (as flash-attn's kernel and its torch reference, which
// multiply then add, and unlike a fused multiply-add).
template <typename T>
FLASHDL_HD void rotate(T x1, T x2, T c, T s, T* y1, T* y2) {
#if defined(__CUDA_ARCH__)
  // nvcc contracts a * b - c * d into a fused multiply-add by default: the _rn intrinsics keep
  // each product rounded, so the device writes the cache the host would.
  if constexpr (sizeof(T) == 4) {
    *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    *y2 = __fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c));
    return;
  }
#endif
  const T a = x1 * c, b = x2 * s, e = x1 * s, f = x2 * c;
  *y1 = a - b;
  *y2 = e + f;
}

}  // namespace flashdl::detail
