// Online softmax in the exp2 domain, shared by the CPU and the CUDA kernels.
// Scores arrive already multiplied by scale * log2(e), so exp(scale * s - m) = exp2(t - m2).
#pragma once

#include <cmath>
#include <type_traits>

#include "flashdl/detail/macros.hpp"

namespace flashdl::detail {

constexpr double kLog2e = 1.4426950408889634074;
constexpr double kLn2 = 0.69314718055994530942;

// The one place that guards (-inf) - (-inf): a running max of -inf (every key so far masked) is
// replaced by 0 as the reference point, so exp2(-inf - 0) = 0 and nothing becomes NaN.
template <typename T>
FLASHDL_HD T softmax_reference_point(T m) {
  return m == -INFINITY ? T(0) : m;
}

// exp2/log2/exp/log in the argument's own precision, on the host and the device alike (an
// unqualified exp2(float) on the host would be the double C function).
FLASHDL_HD float exp2_of(float x) { return exp2f(x); }
FLASHDL_HD double exp2_of(double x) { return exp2(x); }
FLASHDL_HD float log2_of(float x) { return log2f(x); }
FLASHDL_HD double log2_of(double x) { return log2(x); }
FLASHDL_HD float exp_of(float x) { return expf(x); }
FLASHDL_HD double exp_of(double x) { return exp(x); }
FLASHDL_HD float log_of(float x) { return logf(x); }
FLASHDL_HD double log_of(double x) { return log(x); }

template <typename T>
FLASHDL_HD T fast_max(T a, T b) {
  return a > b ? a : b;
}

// Per-row state {m, l} of the online softmax (the accumulator o lives with the caller).
template <typename T>
struct OnlineSoftmax {
  T m;  // running max of the scaled log2-domain scores
  T l;  // running sum of exp2(t - m)

  // A constructor, not default member initializers: nvcc 13.0 (cicc) zero-initialises the second
  // row of a two-dimensional array of an aggregate with default member initializers (the fa2
  // forward's sm[2][2]: its second 16-row band started at m = 0, not -inf, on the GPU: rows whose
  // scores all lie far below 0 lost P to float16 underflow; the host compilers and the emulator
  // are right). With a user-provided constructor every element is initialised (PTX checked).
  FLASHDL_HD OnlineSoftmax() : m(-INFINITY), l(T(0)) {}

  // Step 1: a new block with row max `block_max` arrives. Returns the factor by which the
  // accumulator and l must be multiplied, and updates m. After this call, reference() is the
  // point to subtract from the block's scores before exp2.
  FLASHDL_HD T rescale_factor(T block_max) {
    const T m_new = fast_max(m, block_max);
    const T alpha = exp2_of(m - softmax_reference_point(m_new));
    m = m_new;
    return alpha;
  }
  FLASHDL_HD T reference() const { return softmax_reference_point(m); }

  // Step 2: add the block's row sum of exp2(t - reference()), after rescaling by alpha.
  FLASHDL_HD void accumulate(T alpha, T block_sum) { l = l * alpha + block_sum; }

  // Step 3: the factor that normalises the accumulator; 0 for a row that saw no key.
  FLASHDL_HD T inv_l() const { return l > T(0) ? T(1) / l : T(0); }

  // Step 4: natural-log logsumexp of the scaled scores; -inf for a row that saw no key, NaN for
  // a row whose sum is NaN (it saw a NaN or an infinite score, as the float64 reference gives):
  // never -inf, which would pass for an empty row (merge_states would drop its NaN output).
  FLASHDL_HD T lse() const {
    return l > T(0) ? (m + log2_of(l)) * T(kLn2) : l == T(0) ? T(-INFINITY) : l;
  }
};

// The constructor above is the fix, not a style choice: an aggregate here would bring the nvcc
// 13.0 miscompilation back (the fa2 forward's sm[2][2]).
static_assert(!std::is_aggregate_v<OnlineSoftmax<float>>, "keep the user-provided constructor");

// Steps 3 and 4 for a row with an attention sink: a logit `sink2` (exp2 domain, finite) that joins
// the denominator and carries no value. Given the row's state {m, l} (l = sum exp2(t - ref(m)), the
// accumulator summed against the same reference point), returns the factor that turns the
// unnormalised accumulator into out, and the natural-log lse including the sink. The larger of m and
// sink2 is the reference, so neither exp2 overflows; a row that saw no key (m = -inf, l = 0, o = 0)
// gets o_scale finite (out 0) and lse = sink.
template <typename T>
struct SinkFinal {
  T o_scale;
  T lse;
};

template <typename T>
FLASHDL_HD SinkFinal<T> finalize_with_sink(T m, T l, T sink2) {
  const T top = fast_max(m, sink2);
  const T a = exp2_of(softmax_reference_point(m) - top);  // the accumulator's reference to top
  const T denom = l * a + exp2_of(sink2 - top);           // >= 1 term of exp2(0)
  return {a / denom, (top + log2_of(denom)) * T(kLn2)};
}

// Merges two normalised partial results over disjoint key sets: (o_a, lse_a) and (o_b, lse_b)
// give the o and lse of the union. Returns the weights to apply to o_a and o_b.
template <typename T>
struct MergeWeights {
  T wa, wb, lse;
};

template <typename T>
FLASHDL_HD MergeWeights<T> merge_weights(T lse_a, T lse_b) {
  const T m = fast_max(lse_a, lse_b);
  if (m == -INFINITY) return {T(0), T(0), T(-INFINITY)};
  const T ea = exp_of(lse_a - m);
  const T eb = exp_of(lse_b - m);
  const T s = ea + eb;
  return {ea / s, eb / s, m + log_of(s)};
}

}  // namespace flashdl::detail
