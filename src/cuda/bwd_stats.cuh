// The backward's row statistics: lse2 = lse * log2(e) and D = rowsum(dO * O) of every query row,
// into float32 workspace arrays indexed (batch * nheads + head) * seqlen_q + row. Step 1 of the
// fa2 backward (fa2_backward.cuh), and what the deterministic dBias kernel reads (fa2_dbias.cuh,
// for fa1 too, whose kernel keeps these in shared memory).
#pragma once

#include <cstdint>

#include "flashdl/detail/sequence.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/params.hpp"
#include "fragment.cuh"

namespace flashdl::cuda {
namespace fa2bwd {

constexpr int kPreRows = 8;  // rows per preprocess CTA: a warp each

template <typename T>
__global__ void __launch_bounds__(kPreRows * 32)
    preprocess_kernel(const __grid_constant__ Params p, float* ws_l2, float* ws_d) {
  const int lane = threadIdx.x % 32;
  const int64_t i = int64_t(blockIdx.x) * kPreRows + threadIdx.x / 32;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const detail::Sequence seq = detail::sequence_of(p, b);
  if (i >= seq.sq) return;
  const T* o = static_cast<const T*>(p.o_ptr) + b * p.o_batch_stride +
               (seq.q0 + i) * p.o_row_stride + h * p.o_head_stride;
  const T* dout = static_cast<const T*>(p.do_ptr) + b * p.do_batch_stride +
                  (seq.q0 + i) * p.do_row_stride + h * p.do_head_stride;
  float acc = 0.0f;
  for (int64_t c = lane; c < p.headdim; c += 32) acc += to_float(o[c]) * to_float(dout[c]);
  acc = warp_sum(acc);
  if (lane == 0) {
    const int64_t row = (b * p.nheads + h) * p.seqlen_q + i;
    const float lse =
        p.lse_ptr[b * p.lse_batch_stride + h * p.lse_head_stride + (seq.q0 + i) * p.lse_row_stride];
    ws_d[row] = acc;
    ws_l2[row] = lse * float(detail::kLog2e);  // -inf (an empty row) stays -inf
  }
}

}  // namespace fa2bwd
}  // namespace flashdl::cuda
