// The score modifiers (softcap, ALiBi; flashdl/detail/score_mod.hpp, the semantics shared with the
// CPU kernels and the float64 reference) as the CUDA kernels apply them. The launcher computes the
// per-call part once (call_score_mods: scale, cap) and passes it by value; a kernel completes it
// with the slope of its (batch or varlen sequence, head) (head_score_mods). The backward and fa1
// branch at run time (`modifies`); the fa2 forward has a compile-time switch (fa2_forward.cuh).
// A head with slope 0 and no cap gets the results of a call without modifiers bit for bit (its
// scores are S * scale * log2(e), rounded once, as there).
#pragma once

#include <cstdint>

#include "flashdl/detail/score_mod.hpp"

namespace flashdl::cuda {

using ScoreModF = detail::ScoreMod<float>;

// Whether `mod` changes any score: a softcap, or a non-zero ALiBi slope.
__device__ __forceinline__ bool modifies(const ScoreModF& mod) {
  return mod.capped() || mod.biased();
}

// The exp2-domain score of a raw product q.k of the query with diagonal `diag` (Mask::diag) at
// key j: scale (and softcap) from `mod`, plus the ALiBi term when there is one.
__device__ __forceinline__ float modified_score(const ScoreModF& mod, float qk, int64_t diag,
                                                int64_t j) {
  const float t = mod.score(qk);
  return mod.biased() ? t + mod.bias(diag, j) : t;
}

// The per-call part of the modifiers (scale and cap; no slope), computed once on the host by
// score_mod_of itself and passed to the kernels by value (kernel parameters live in constant
// memory: no registers).
inline ScoreModF call_score_mods(const Params& p) {
  Params q = p;
  q.alibi_slopes_ptr = nullptr;  // device memory: the slope is read by the kernels
  return detail::score_mod_of<float>(q, 0, 0);
}

// The modifiers of (batch or varlen sequence b, head h): the call's, with the head's slope.
__device__ __forceinline__ ScoreModF head_score_mods(const ScoreModF& call, const Params& p,
                                                     int64_t b, int64_t h) {
  ScoreModF m = call;
  m.slope = detail::score_mod_of<float>(p, b, h).slope;  // the rest is dead code
  return m;
}

}  // namespace flashdl::cuda
