// The score modifiers (softcap, ALiBi; flashdl/detail/score_mod.hpp, the semantics shared with the
// CPU kernels and the float64 reference) as the CUDA kernels apply them. The launcher computes the
// per-call part once (call_score_mods: scale, cap) and passes it by value; a kernel completes it
// with the slope of its (batch or varlen sequence, head) (head_score_mods). The backward and fa1
// branch at run time (`modifies`); the fa2 forward has a compile-time switch (fa2_forward.cuh).
// A head with slope 0 and no cap gets the results of a call without modifiers bit for bit (its
// scores are S * scale * log2(e), rounded once, as there).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flashdl/detail/extras.hpp"
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

namespace flashdl::cuda {

// The additive bias and boolean mask (Options::bias, mask; detail/extras.hpp) of (batch or varlen
// sequence b, head h), with row 0 at the sequence's first query row q0 (0 when dense; a varlen
// bias is (nheads or 1, total_q or 1, max_seqlen_k), its rows the packed query rows). Read in
// place from global memory: strides in elements, 0 along a broadcast axis.
__device__ __forceinline__ detail::HeadExtras head_extras(const Params& p, int64_t b, int64_t h,
                                                          int64_t q0) {
  detail::HeadExtras e = detail::extras_of(p, b, h);
  if (e.bias != nullptr)
    e.bias = static_cast<const char*>(e.bias) + q0 * e.bias_row *
                                                    (e.bias_dtype == DType::float64   ? 8
                                                     : e.bias_dtype == DType::float32 ? 4
                                                                                      : 2);
  if (e.keep != nullptr) e.keep += q0 * e.mask_row;
  return e;
}

// Where the backward adds the dBias of (batch or varlen sequence b, head h): row i of the
// sequence (key j) at base[i * row + j] of the compact float32 accumulator (LaunchContext::
// dbias_acc; detail::dbias_index), row 0 at the sequence's first query row. Null: not wanted.
struct DBiasAcc {
  float* base = nullptr;
  int64_t row = 0;
};

__device__ __forceinline__ DBiasAcc head_dbias(const Params& p, float* acc, int64_t b, int64_t h,
                                               int64_t q0) {
  DBiasAcc d;
  if (acc == nullptr) return d;
  d.base = acc + detail::dbias_index(p, b, h, q0);
  d.row = p.bias_rows > 1 ? p.seqlen_k : 0;
  return d;
}

// The bias of query i (relative to the sequence) at key j, converted to float (natural log).
__device__ __forceinline__ float bias_at(const detail::HeadExtras& e, int64_t i, int64_t j) {
  const int64_t at = e.bias_offset(i, j);
  switch (e.bias_dtype) {
    case DType::float16: return __half2float(static_cast<const __half*>(e.bias)[at]);
    case DType::bfloat16: return __bfloat162float(static_cast<const __nv_bfloat16*>(e.bias)[at]);
    case DType::float64: return static_cast<float>(static_cast<const double*>(e.bias)[at]);
    default: return static_cast<const float*>(e.bias)[at];
  }
}

// The exp2-domain score t of query i at key j with the bias and mask applied: t plus the bias
// times log2(e), or -inf where the mask hides the key (after the bias, so a NaN or Inf score,
// bias or key a row cannot see never reaches it). `prescaled` (a bias or a modifier): t is the
// exp2-domain score; else (a mask alone) the raw q.k, which the softmax scales as without it.
__device__ __forceinline__ float extras_score(const detail::HeadExtras& e, float t, int64_t i,
                                              int64_t j) {
  if (e.bias != nullptr) t += bias_at(e, i, j) * float(detail::kLog2e);
  return e.kept(i, j) ? t : -INFINITY;
}

}  // namespace flashdl::cuda
