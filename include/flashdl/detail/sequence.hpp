// Where sequence b of a call lies in the arrays, for kernels that serve dense and variable-length
// batches alike (host+device; unit-tested by ctest).
#pragma once

#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/params.hpp"

namespace flashdl::detail {

// Rows [q0, q0 + sq) of q (out, lse, dout, dq) and [k0, k0 + sk) of k (v, dk, dv) belong to
// sequence b, on top of b times the batch strides (0 for varlen).
struct Sequence {
  int64_t q0 = 0, k0 = 0;
  int64_t sq = 0, sk = 0;
};

FLASHDL_HD int64_t clamp_to(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// Dense: every batch is [0, seqlen_q) x [0, seqlen_k). Varlen: the offsets of sequence b, clamped
// so that whatever the offsets hold (device arrays are not checked on the host), no row outside
// [0, total) is touched and no length exceeds its max_seqlen bound (the grid's extent).
FLASHDL_HD Sequence sequence_of(const Params& p, int64_t b) {
  Sequence s;
  if (p.cu_seqlens_q == nullptr) {
    s.sq = p.seqlen_q;
    s.sk = p.seqlen_k;
    return s;
  }
  const int64_t q_begin = p.cu_seqlens_q[b * p.cu_seqlens_q_stride];
  const int64_t q_end = p.cu_seqlens_q[(b + 1) * p.cu_seqlens_q_stride];
  const int64_t k_begin = p.cu_seqlens_k[b * p.cu_seqlens_k_stride];
  const int64_t k_end = p.cu_seqlens_k[(b + 1) * p.cu_seqlens_k_stride];
  s.q0 = clamp_to(q_begin, 0, p.total_q);
  s.k0 = clamp_to(k_begin, 0, p.total_k);
  s.sq = clamp_to(q_end, s.q0, p.total_q) - s.q0;
  s.sk = clamp_to(k_end, s.k0, p.total_k) - s.k0;
  if (s.sq > p.seqlen_q) s.sq = p.seqlen_q;
  if (s.sk > p.seqlen_k) s.sk = p.seqlen_k;
  return s;
}

}  // namespace flashdl::detail
