// Every constant of the FA-2 forward kernel for one (dtype, head dim): tile sizes, threads and the
// shared-memory layout. The launcher checks kSmemBytes against the device's opt-in limit at run time.
#pragma once

#include <cstddef>

#include "fragment.cuh"

namespace flashdl::cuda {

// Keys per K/V block for a head dim: 64 up to d = 128, 32 above, so that the double-buffered K and
// V tiles plus Q stay within what an A100 (163 KiB per block) and an H100 (227 KiB) can give.
constexpr int fa2_block_n(int head_dim) { return head_dim <= 128 ? 64 : 32; }

// The smallest opt-in shared memory per block among sm_80+ parts (sm_86, sm_89, sm_120: 99 KiB).
// Head dims whose tiles exceed it also get a variant with half the keys per block.
constexpr std::size_t kFa2SmallestOptin = 99 * 1024;

template <typename T_, int kHeadDim_, int kBlockN_ = fa2_block_n(kHeadDim_)>
struct Fa2Traits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;            // keys per K/V block (Bc)
  static constexpr int kNWarps = 4;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kWarpRows = kFrag;             // query rows owned by one warp
  static constexpr int kBlockM = kNWarps * kWarpRows; // query rows per CTA (Br)
  static constexpr int kStages = 2;                   // K/V double buffering

  // Row strides in shared memory. The padding moves consecutive rows to different banks and keeps
  // every wmma pointer 32-byte aligned (ld a multiple of 8 halves / 4 floats, tiles at multiples
  // of 16 rows and 16 columns).
  static constexpr int kLdQKV = kHeadDim + 8;  // elements of T
  static constexpr int kLdS = kBlockN + 4;     // floats; P (elements of T) overwrites S in place
  static constexpr int kLdP = 2 * kLdS;        // with this stride, so row r of P starts at row r of S

  static constexpr int kFragsN = kBlockN / kFrag;   // score fragments per warp row band
  static constexpr int kFragsD = kHeadDim / kFrag;  // output fragments per warp row band
  static constexpr int kColsPerLane = kBlockN / 2;  // two lanes share a row in the softmax step

  static constexpr std::size_t kQBytes = std::size_t(kBlockM) * kLdQKV * sizeof(T);
  static constexpr std::size_t kKVTileBytes = std::size_t(kBlockN) * kLdQKV * sizeof(T);
  static constexpr std::size_t kSBytes = std::size_t(kNWarps) * kWarpRows * kLdS * sizeof(float);

  static constexpr std::size_t kOffQ = 0;
  static constexpr std::size_t kOffK = kOffQ + kQBytes;
  static constexpr std::size_t kOffV = kOffK + kStages * kKVTileBytes;
  static constexpr std::size_t kOffS = kOffV + kStages * kKVTileBytes;
  static constexpr std::size_t kSmemBytes = kOffS + kSBytes;

  static_assert(sizeof(T) == 2, "float16 or bfloat16 storage");
  static_assert(kHeadDim % kFrag == 0 && kBlockN % kFrag == 0, "whole wmma tiles");
  static_assert(kBlockM == kNWarps * kFrag, "each warp owns 16 query rows");
  static_assert(kLdQKV % 8 == 0 && kLdS % 4 == 0 && kLdP % 8 == 0, "wmma ldm rules");
  static_assert(kThreads == 128, "two lanes per row: 16 rows per warp");
  static_assert(kQBytes % 128 == 0 && kKVTileBytes % 128 == 0 && kSBytes % 128 == 0,
                "128-byte aligned regions");
  static_assert(kSmemBytes <= 227 * 1024, "beyond any current GPU's shared memory");
};

}  // namespace flashdl::cuda
