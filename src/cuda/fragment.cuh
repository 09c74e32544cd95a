// Tensor-core building blocks: wmma fragment types for 16x16x16 half/bfloat16 -> float, element
// conversions, warp reductions, and the row map of an accumulator fragment.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

namespace flashdl::cuda {

namespace wmma = nvcuda::wmma;

constexpr int kFrag = 16;           // wmma tile: m = n = k = 16
constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::row_major>;
// B = K^T read from K stored row-major: element (k, n) sits at K[n][k], i.e. column-major.
template <typename T>
using FragBt = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::col_major>;
template <typename T>
using FragB = wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, wmma::row_major>;
// A = X^T read from X stored row-major (the backward's P^T and dS^T): column-major.
template <typename T>
using FragAt = wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, wmma::col_major>;
using FragAcc = wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float>;

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// wmma leaves the mapping of accumulator elements to (row, col) unspecified, but it is fixed for a
// fragment type on a given architecture. A warp learns the row of each element it holds once, by
// loading a 16x16 tile whose entries are their own row index; per-row factors (the online-softmax
// rescale, 1/l) can then be applied to the accumulators in registers.
struct FragRows {
  int r[FragAcc::num_elements];
};

// scratch: 16 x ld floats of this warp's shared memory, 32-byte aligned, ld a multiple of 4.
__device__ __forceinline__ FragRows accumulator_rows(float* scratch, int ld) {
  const int lane = threadIdx.x % 32;
  for (int e = lane; e < kFrag * kFrag; e += 32) scratch[(e / kFrag) * ld + e % kFrag] = float(e / kFrag);
  __syncwarp();
  FragAcc f;
  wmma::load_matrix_sync(f, scratch, ld, wmma::mem_row_major);
  FragRows rows;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) rows.r[i] = static_cast<int>(f.x[i]);
  __syncwarp();  // the scratch is reused by the caller
  return rows;
}

// The (row, col) of every accumulator element this lane holds, for kernels that write
// accumulators straight from registers to global memory (the backward's dK, dV, dQ).
struct FragMap {
  unsigned char r[FragAcc::num_elements];
  unsigned char c[FragAcc::num_elements];
};

// Learnt by every warp from two 16 x 16 float tiles at `rows` and `cols` (ld floats apart, 32-byte
// aligned) that the whole CTA filled with their own row and column indices (fill_fragment_map).
__device__ __forceinline__ FragMap accumulator_map(const float* rows, const float* cols, int ld) {
  FragAcc fr, fc;
  wmma::load_matrix_sync(fr, rows, ld, wmma::mem_row_major);
  wmma::load_matrix_sync(fc, cols, ld, wmma::mem_row_major);
  FragMap m;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) {
    m.r[i] = static_cast<unsigned char>(fr.x[i]);
    m.c[i] = static_cast<unsigned char>(fc.x[i]);
  }
  return m;
}

// The CTA's half of accumulator_map: tile `rows` gets entry (r, c) = r, tile `cols` gets c. The
// caller synchronises the block before the warps read them.
__device__ __forceinline__ void fill_fragment_map(float* rows, float* cols, int ld, int threads) {
  for (int e = threadIdx.x; e < kFrag * kFrag; e += threads) {
    rows[(e / kFrag) * ld + e % kFrag] = float(e / kFrag);
    cols[(e / kFrag) * ld + e % kFrag] = float(e % kFrag);
  }
}

}  // namespace flashdl::cuda
