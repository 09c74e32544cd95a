// The score modifiers shared by every backend and schedule, in flash-attn's order:
//   s = scale * q.k
//   s = softcap * tanh(s / softcap)              (softcap > 0: logit soft-capping, Gemma 2, Grok)
//   s = s - slope_h * |i + seqlen_k - seqlen_q - j|   (ALiBi: BLOOM, MPT; bottom-right aligned)
//   s = s + bias[b, h, i, j]                      (Options::bias, detail/extras.hpp)
//   then the masks (-inf where the window/causal mask, the block mask or Options::mask hides key
//   j from query i) and the softmax, with the sink of head h (sink_of) in its denominator.
// The kernels work in the exp2 domain (t = s * log2 e), so the factors here carry log2(e).
// Backward: the gradient of s with respect to scale * q.k is 1 - tanh^2 with softcap (1 without);
// the ALiBi bias is a constant of (i, j) and is not differentiated (as in flash-attn).
#pragma once

#include <cmath>
#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

FLASHDL_HD float tanh_of(float x) { return tanhf(x); }
FLASHDL_HD double tanh_of(double x) { return tanh(x); }

template <typename T>
struct ScoreMod {
  T qk_scale;  // multiplies q.k: scale * log2(e), or scale / softcap with a cap
  T cap;       // softcap * log2(e); 0: no cap
  T slope;     // the ALiBi slope of this (batch, head) times log2(e); 0: no bias

  FLASHDL_HD bool capped() const { return cap != T(0); }
  FLASHDL_HD bool biased() const { return slope != T(0); }

  // t (exp2 domain, before the bias) of a raw product q.k.
  FLASHDL_HD T score(T qk) const { return capped() ? cap * tanh_of(qk * qk_scale) : qk * qk_scale; }

  // The ALiBi term of query i at key j, in the exp2 domain, given diag = i + seqlen_k - seqlen_q
  // (Mask::diag): -slope * |diag - j|. The distance is exact in T up to 2^24 (float).
  FLASHDL_HD T bias(int64_t diag, int64_t j) const {
    const int64_t dist = diag - j;
    return -slope * static_cast<T>(dist < 0 ? -dist : dist);
  }

  // d s / d (scale * q.k) at a raw product q.k: 1 - tanh^2(scale * q.k / softcap), 1 uncapped.
  // The backward multiplies dS by it before the products with Q and K.
  FLASHDL_HD T grad(T qk) const {
    if (!capped()) return T(1);
    const T th = tanh_of(qk * qk_scale);
    return T(1) - th * th;
  }
};

// The modifiers of batch b (the sequence, in a varlen call), head h. A slopes stride of 0
// broadcasts one row of slopes over the batch.
template <typename T>
FLASHDL_HD ScoreMod<T> score_mod_of(const Params& p, int64_t b, int64_t h) {
  ScoreMod<T> m;
  const bool capped = p.softcap > 0.0;
  // scale / softcap can exceed float (a softcap near its floor of 1e-30): clamped to the largest
  // finite T, tanh of the product is +-1 wherever the exact one is (and 0 at q.k = 0, where an
  // infinite factor would give NaN).
  const double big = sizeof(T) == sizeof(float) ? 3.4028234663852886e38 : 1.7976931348623157e308;
  const double ratio = capped ? p.scale_softmax / p.softcap : p.scale_softmax_log2;
  m.qk_scale = static_cast<T>(ratio > big ? big : (ratio < -big ? -big : ratio));
  m.cap = capped ? static_cast<T>(p.softcap * kLog2e) : T(0);
  m.slope = p.alibi_slopes_ptr == nullptr
                ? T(0)
                : static_cast<T>(
                      static_cast<double>(
                          p.alibi_slopes_ptr[b * p.alibi_batch_stride + h * p.alibi_head_stride]) *
                      kLog2e);
  return m;
}

// The attention sink of head h in the exp2 domain (Params::sinks_ptr non-null).
template <typename T>
FLASHDL_HD T sink_of(const Params& p, int64_t h) {
  return static_cast<T>(static_cast<double>(p.sinks_ptr[h * p.sinks_stride]) * kLog2e);
}

// Whether a call has any modifier (kernels keep their unmodified fast path otherwise).
FLASHDL_HD bool has_score_mod(const Params& p) {
  return p.softcap > 0.0 || p.alibi_slopes_ptr != nullptr;
}

}  // namespace flashdl::detail
