// Every constant of the FA-2 forward kernel for one (dtype, head dim, tile): rows per warp, keys
// per block, threads and the shared-memory layout, all from fa2_plan.hpp. The launcher checks
// kSmemBytes against the device's opt-in limit at run time.
#pragma once

#include <cstddef>

#include "fa2_plan.hpp"
#include "fragment.cuh"

namespace flashdl::cuda {

// kRegsOnly_: the register-only instantiation (fa2_plan.hpp), which has no shared-memory softmax
// and the smaller scratch of fa2_fwd_layout's regs_only.
template <typename T_, int kHeadDim_, int kRowFrags_ = fa2_fwd_tile(kHeadDim_).row_frags,
          int kBlockN_ = fa2_fwd_tile(kHeadDim_).block_n, bool kRegsOnly_ = false>
struct Fa2Traits {
  using T = T_;
  static constexpr bool kRegsOnly = kRegsOnly_;
  static constexpr Fa2FwdTile kTile{kRowFrags_, kBlockN_};
  static constexpr Fa2FwdLayout kLayout = fa2_fwd_layout(kHeadDim_, kTile, int(sizeof(T_)),
                                                         kRegsOnly_);
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;      // keys per K/V block (Bc)
  static constexpr int kRowFrags = kRowFrags_;  // 16-row fragments per warp
  static constexpr int kNWarps = kFa2Warps;
  static constexpr int kThreads = kFa2Threads;
  static constexpr int kWarpRows = kRowFrags * kFrag;  // query rows owned by one warp
  static constexpr int kBlockM = kLayout.block_m;      // query rows per CTA (Br)
  static constexpr int kStages = 2;                    // K/V double buffering

  static constexpr int kLdQKV = kLayout.ld_qkv;  // elements of T
  static constexpr int kLdS = kLayout.ld_s;      // floats; P (elements of T) overwrites S in place
  static constexpr int kLdP = 2 * kLdS;          // so row r of P starts at row r of S

  static constexpr int kFragsN = kBlockN / kFrag;   // score fragments per 16-row band
  static constexpr int kFragsD = kHeadDim / kFrag;  // output fragments per 16-row band
  static constexpr int kColsPerLane = kBlockN / 2;  // shared-memory softmax: two lanes share a row

  static constexpr std::size_t kOffQ = kLayout.off_q;
  static constexpr std::size_t kOffK = kLayout.off_k;
  static constexpr std::size_t kOffV = kLayout.off_v;
  static constexpr std::size_t kOffS = kLayout.off_s;
  static constexpr std::size_t kOffRows = kLayout.off_rows;
  static constexpr std::size_t kOffRowF = kLayout.off_rowf;
  static constexpr std::size_t kSmemBytes = kLayout.bytes;
  static constexpr std::size_t kKVTileBytes = std::size_t(kBlockN) * kLdQKV * sizeof(T);

  static_assert(sizeof(T) == 2, "float16 or bfloat16 storage");
  static_assert(kRowFrags == 1 || kRowFrags == 2, "16 or 32 query rows per warp");
  static_assert(kHeadDim % kFrag == 0 && kBlockN % kFrag == 0, "whole wmma tiles");
  static_assert(kLdQKV % 8 == 0 && kLdS % 4 == 0 && kLdP % 8 == 0, "wmma ldm rules");
  static_assert(kThreads == 128, "two lanes per row in the shared-memory softmax");
  static_assert(kRegsOnly || kColsPerLane <= 32, "one visibility bit per column of a lane");
  static_assert(kLdP >= kBlockN && kLdS >= 16, "a band of P as T, the epilogue's 16 columns");
  static_assert(kOffK - kOffQ >= std::size_t(kBlockM) * kLdQKV * sizeof(T) &&
                    kOffV - kOffK >= kStages * kKVTileBytes &&
                    kOffS - kOffV >= kStages * kKVTileBytes,
                "regions do not overlap");
  static_assert(kSmemBytes <= 227 * 1024, "beyond any current GPU's shared memory");
};

}  // namespace flashdl::cuda
