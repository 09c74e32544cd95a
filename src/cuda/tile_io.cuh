// Moving tiles between global and shared memory. Loads are bounds-checked (rows past the end are
// zero-filled, so padded keys and values never carry stale NaN or Inf into a tensor-core product)
// and asynchronous (cp.async through cuda_pipeline) when rows start on 16-byte boundaries; stores
// are guarded by the caller and vectorised under the same condition.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <type_traits>

#include "fragment.cuh"

namespace flashdl::cuda {

struct KeepAllRows {
  __device__ __forceinline__ bool operator()(int) const { return true; }
};

// Copies rows [0, rows) of a (tile_rows x kHeadDim) tile at g (row stride g_stride elements) to s
// (row stride ld_s elements) and zero-fills rows [rows, tile_rows), and rows r with !keep(r) (rows
// that only zero blocks of a block mask cover: never read). With vec, the copies are
// cp.async: the caller commits and waits (__pipeline_commit / __pipeline_wait_prior) and then
// synchronises the block; otherwise they are plain loads, visible after the same barrier.
// One 16-byte chunk of row r of a tile: zeros where r >= rows or !keep(r), else the copy from
// src, by cp.async (kVec) or by eight 16-bit loads.
template <bool kVec, typename T, typename Keep>
__device__ __forceinline__ void load_chunk(T* dst, const T* src, int r, int rows,
                                           const Keep& keep) {
  if (r >= rows || !keep(r)) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  } else if (kVec) {
    __pipeline_memcpy_async(dst, src, 16);
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[e] = src[e];
  }
}

// The loaders below branch on `vec` once, around the whole tile, never per chunk: a choice per
// chunk was if-converted by ptxas into both paths, predicated, in every K/V block (the H100's
// source-level profile, 2026-11-27: the eight 16-bit loads, their packing and stores issued,
// predicated off, beside every cp.async; a quarter of the fa2 forward's stall samples).
template <int kHeadDim, int kThreads, bool kVec, typename T, typename Keep>
__device__ __forceinline__ void load_tile_as(T* s, int ld_s, const T* g, int64_t g_stride,
                                             int tile_rows, int rows, const Keep& keep) {
  static_assert(kHeadDim % 8 == 0, "16-byte chunks of 8 elements");
  constexpr int kChunks = kHeadDim / 8;
  const int n = tile_rows * kChunks;
  for (int idx = threadIdx.x; idx < n; idx += kThreads) {
    const int r = idx / kChunks;
    const int c = (idx % kChunks) * 8;
    load_chunk<kVec>(s + r * ld_s + c, g + r * g_stride + c, r, rows, keep);
  }
}

template <int kHeadDim, int kThreads, typename T, typename Keep = KeepAllRows>
__device__ __forceinline__ void load_tile(T* s, int ld_s, const T* g, int64_t g_stride,
                                          int tile_rows, int rows, bool vec, Keep keep = Keep()) {
  if (vec)
    load_tile_as<kHeadDim, kThreads, true>(s, ld_s, g, g_stride, tile_rows, rows, keep);
  else
    load_tile_as<kHeadDim, kThreads, false>(s, ld_s, g, g_stride, tile_rows, rows, keep);
}

// load_tile for a tile of compile-time height kTileRows: the loop is unrolled, and every thread's
// chunks sit at offsets known at compile time from its first one (row and column computed once).
template <int kTileRows, int kHeadDim, int kThreads, bool kVec, typename T, typename Keep>
__device__ __forceinline__ void load_tile_rows_as(T* s, int ld_s, const T* g, int64_t g_stride,
                                                  int rows, const Keep& keep) {
  static_assert(kHeadDim % 8 == 0, "16-byte chunks of 8 elements");
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kN = kTileRows * kChunks;
  constexpr int kIters = (kN + kThreads - 1) / kThreads;
  const int r0 = threadIdx.x / kChunks, c0 = (threadIdx.x % kChunks) * 8;
  // A whole tile of every row (no Keep, rows >= kTileRows) whose chunks fall evenly on the
  // threads: the copies with no test each, a thread's addresses one constant row step apart (one
  // 64-bit add per copy, against a row test, a keep test and the address recomputed).
  constexpr int kStepRows = kThreads / kChunks;
  if constexpr (kVec && std::is_same<Keep, KeepAllRows>::value && kThreads % kChunks == 0 &&
                kN % kThreads == 0) {
    if (rows >= kTileRows) {
      const T* gp = g + r0 * g_stride + c0;
      T* sp = s + r0 * ld_s + c0;
      const int64_t g_step = int64_t(kStepRows) * g_stride;
#pragma unroll
      for (int it = 0; it < kIters; ++it, gp += g_step)
        __pipeline_memcpy_async(sp + it * kStepRows * ld_s, gp, 16);
      return;
    }
  }
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    // Chunk threadIdx.x + it * kThreads, kThreads = kQ rows and kRem chunks: with kRem = 0 (head
    // dims 32, 64, 128, 256) the same column and a constant row step.
    constexpr int kQ = kThreads / kChunks, kRem = kThreads % kChunks;
    const int cc = c0 / 8 + it * kRem;
    const int r = r0 + it * kQ + cc / kChunks, c = (cc % kChunks) * 8;
    if (kN % kThreads != 0 && r >= kTileRows) break;
    load_chunk<kVec>(s + r * ld_s + c, g + r * g_stride + c, r, rows, keep);
  }
}

template <int kTileRows, int kHeadDim, int kThreads, typename T, typename Keep = KeepAllRows>
__device__ __forceinline__ void load_tile_rows(T* s, int ld_s, const T* g, int64_t g_stride,
                                               int rows, bool vec, Keep keep = Keep()) {
  if (vec)
    load_tile_rows_as<kTileRows, kHeadDim, kThreads, true>(s, ld_s, g, g_stride, rows, keep);
  else
    load_tile_rows_as<kTileRows, kHeadDim, kThreads, false>(s, ld_s, g, g_stride, rows, keep);
}

// Whether this thread's share of a (tile_rows x kHeadDim) tile of 16-bit floats in shared memory
// (row stride ld elements, 16-byte aligned rows) holds a NaN or Inf: all-ones exponent bits, kExp
// (0x7c00 for float16, 0x7f80 for bfloat16), tested two elements per 32-bit word. Callers OR it
// over the block (__syncthreads_or) to choose the slow path of a masked block; per thread it is
// tile_rows * kHeadDim / (8 kThreads) 16-byte loads and 4 AND-XOR-test triples per load.
template <int kHeadDim, int kThreads, typename T>
__device__ __forceinline__ bool tile_has_nonfinite(const T* s, int ld, int tile_rows) {
  static_assert(sizeof(T) == 2 && kHeadDim % 8 == 0, "16-byte chunks of 8 16-bit floats");
  constexpr unsigned kExp = std::is_same<T, __half>::value ? 0x7c00u : 0x7f80u;
  constexpr unsigned kExp2 = kExp | (kExp << 16);
  constexpr int kChunks = kHeadDim / 8;
  const int kN = tile_rows * kChunks;
  unsigned hit = 0u;  // some 16-bit half of some word had every exponent bit set
  for (int idx = threadIdx.x; idx < kN; idx += kThreads) {
    const uint4 u = *reinterpret_cast<const uint4*>(s + (idx / kChunks) * ld + (idx % kChunks) * 8);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const unsigned x = (w[q] & kExp2) ^ kExp2;  // a zero half: that element is NaN or Inf
      hit |= unsigned((x & 0xffffu) == 0u) | unsigned((x >> 16) == 0u);
    }
  }
  return hit != 0u;
}

// Converts 8 floats to T and writes them to dst (16 bytes at once with vec).
template <typename T>
__device__ __forceinline__ void store8(T* dst, const float* v, bool vec) {
  if (vec) {
    union {
      uint4 u;
      T t[8];
    } pack;
#pragma unroll
    for (int e = 0; e < 8; ++e) pack.t[e] = from_float<T>(v[e]);
    *reinterpret_cast<uint4*>(dst) = pack.u;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[e] = from_float<T>(v[e]);
  }
}

}  // namespace flashdl::cuda
