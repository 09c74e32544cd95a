// Exact merging of normalised partial attention results over disjoint key sets on the device:
// (o_i, lse_i) -> lse = log sum_i exp(lse_i), o = sum_i exp(lse_i - lse) o_i, folded in order
// with detail::merge_weights (the host loop of src/merge.cpp, the CPU's split-KV merge). One
// kernel body for both of its jobs: the combine step of split-KV decoding (the parts are the
// splits of a float32 workspace, equally spaced, any number of them) and merge_states on CUDA
// arrays (the parts are the caller's arrays, up to kMergeMaxParts a launch; more run as a chain
// of launches that carry the running (o, lse) in a workspace).
//
// A warp per output row (batch, seqlen, head): every lane computes the same weights from the
// parts' lse (one broadcast load each) and owns the columns lane, lane + 32, ... of the row, so
// the loads and stores are coalesced whatever the arrays' alignment, and no barrier is needed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "check.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"
#include "fragment.cuh"

namespace flashdl::cuda {

constexpr int kMergeMaxParts = 8;  // explicit parts per launch: 8 x 64 bytes of kernel parameters
constexpr int kMergeThreads = 128;

// A partial result (or the output): o (batch, seqlen, nheads, head_dim) and lse float32 (batch,
// nheads, seqlen), strides in elements.
struct MergeView {
  const void* o;
  const float* lse;
  int64_t o_batch, o_row, o_head;
  int64_t lse_batch, lse_head, lse_row;
};

struct MergeArgs {
  int64_t batch, seqlen, nheads, head_dim;
  int count;                               // parts merged by this launch, in order
  MergeView part[kMergeMaxParts];          // explicit parts, or the first of equally spaced ones:
  int64_t o_part_stride, lse_part_stride;  // non-zero: part i is part[0] moved by i strides
  MergeView out;                           // written unless carry_out (o and lse cast to writable)
  // Running state between chained launches: Acc values, o (rows x head_dim) then lse (rows),
  // row = (b * seqlen + s) * nheads + h. carry_in: start from it instead of (0, -inf);
  // carry_out: write it instead of out.
  void* carry;
  bool carry_in, carry_out;
};

__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <typename Out, typename Acc>
__device__ __forceinline__ Out narrow(Acc x) {
  if constexpr (std::is_same_v<Out, Acc>)
    return x;
  else
    return from_float<Out>(x);  // 16-bit outputs accumulate in float
}

// In: the parts' element type, Out: the output's, Acc: float (float64 for float64 arrays).
template <typename In, typename Out, typename Acc>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ MergeArgs a) {
  // Columns per lane per pass over the row (128 a pass). One for double: the double division in
  // merge_weights is a called subroutine, and ptxas spilled the other columns' accumulators
  // around the call (sm_90: 4 bytes with 4, 8 with 2, none with 1).
  constexpr int kVals = sizeof(Acc) == 8 ? 1 : 4;
  const int lane = threadIdx.x % 32;
  const int64_t rows = a.batch * a.seqlen * a.nheads, d = a.head_dim;
  const int64_t warps = int64_t(gridDim.x) * (kMergeThreads / 32);
  Acc* carry_o = static_cast<Acc*>(a.carry);
  Acc* carry_lse = carry_o + rows * d;
  for (int64_t row = int64_t(blockIdx.x) * (kMergeThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t h = row % a.nheads, s = (row / a.nheads) % a.seqlen,
                  b = row / (a.nheads * a.seqlen);
    const Acc start = a.carry_in ? carry_lse[row] : Acc(-INFINITY);
    Acc total = start;
    for (int64_t c0 = 0; c0 < d; c0 += 32 * kVals) {
      Acc acc[kVals];
#pragma unroll
      for (int v = 0; v < kVals; ++v) {
        const int64_t c = c0 + lane + 32 * v;
        acc[v] = a.carry_in && c < d ? carry_o[row * d + c] : Acc(0);
      }
      total = start;  // every pass recomputes the same weights
      for (int i = 0; i < a.count; ++i) {
        const MergeView& P = a.part[a.o_part_stride != 0 ? 0 : i];
        const int64_t shift_o = a.o_part_stride * i, shift_l = a.lse_part_stride * i;
        const float lse_i = P.lse[shift_l + b * P.lse_batch + h * P.lse_head + s * P.lse_row];
        const detail::MergeWeights<Acc> w = detail::merge_weights<Acc>(total, Acc(lse_i));
        total = w.lse;
        // A part that weighs nothing (lse -inf, or far below the others) is not read: its o may
        // be anything, and 0 * NaN would not be 0.
        const bool read = w.wb != Acc(0);
        const In* o = static_cast<const In*>(P.o) + shift_o + b * P.o_batch + s * P.o_row +
                      h * P.o_head;
#pragma unroll
        for (int v = 0; v < kVals; ++v) {
          const int64_t c = c0 + lane + 32 * v;
          const Acc x = read && c < d ? w.wb * Acc(widen(o[c])) : Acc(0);
          acc[v] = w.wa * acc[v] + x;
        }
      }
#pragma unroll
      for (int v = 0; v < kVals; ++v) {
        const int64_t c = c0 + lane + 32 * v;
        if (c >= d) continue;
        if (a.carry_out)
          carry_o[row * d + c] = acc[v];
        else
          static_cast<Out*>(const_cast<void*>(
              a.out.o))[b * a.out.o_batch + s * a.out.o_row + h * a.out.o_head + c] =
              narrow<Out>(acc[v]);
      }
    }
    __syncwarp();  // every lane has read carry_lse[row] before lane 0 replaces it
    if (lane == 0) {
      if (a.carry_out)
        carry_lse[row] = total;
      else
        const_cast<float*>(
            a.out.lse)[b * a.out.lse_batch + h * a.out.lse_head + s * a.out.lse_row] =
            static_cast<float>(total);
    }
  }
}

// One launch on `stream`: a warp per row, at most 2^20 CTAs (the warps stride over the rest).
template <typename In, typename Out, typename Acc>
void launch_merge(const MergeArgs& a, cudaStream_t stream) {
  const int64_t rows = a.batch * a.seqlen * a.nheads;
  if (rows == 0) return;
  const int64_t blocks = detail::ceil_div(rows, kMergeThreads / 32);
  const auto grid = static_cast<unsigned>(blocks < (int64_t{1} << 20) ? blocks : int64_t{1} << 20);
  FLASHDL_LAUNCH(grid, kMergeThreads, 0, stream, merge_kernel<In, Out, Acc>)(a);
  FLASHDL_CUDA_CHECK_LAUNCH("merge kernel launch");
}

}  // namespace flashdl::cuda
