// Every constant of the FA-2 backward kernels for one (dtype, head dim, tile config): the warp grid
// over dK / dV, the dQ tiles per warp and the shared-memory layout (bwd_plan.hpp, host-tested).
#pragma once

#include "bwd_plan.hpp"
#include "fragment.cuh"

namespace flashdl::cuda {

// What a backward call has, as far as the main kernel's instantiation goes (fa2_backward.cuh).
enum class BwdCall { dense, features, extras };

template <typename T_, int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, int kBandFrags_ = 1,
          bool kPOnly_ = false>
struct Fa2BwdTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // Br: query rows per streamed block
  static constexpr int kBlockN = kBlockN_;  // Bc: keys per CTA of the main kernel
  static constexpr int kStages = kStages_;
  static constexpr int kBandFrags = kBandFrags_;  // 16-key fragments per warp's dK / dV band
  static constexpr bool kPOnly = kPOnly_;         // the main kernel's P/dS as T only (Fa2BwdConfig)
  static constexpr Fa2BwdConfig kConfig{kBlockM, kBlockN, kStages, kBandFrags, kPOnly};
  static constexpr int kNWarps = kBwdWarps;
  static constexpr int kThreads = kBwdThreads;

  static constexpr int kFragsM = kBlockM / kFrag;
  static constexpr int kFragsN = kBlockN / kFrag;
  static constexpr int kFragsD = kHeadDim / kFrag;

  // dK_j, dV_j: warp w owns key band w % kKeyBands (kBandFrags fragments) and head-dim slice
  // w / kKeyBands.
  static constexpr int kKeyBands = fa2_bwd_key_bands(kConfig);
  static constexpr int kDimSplits = fa2_bwd_dim_splits(kConfig);
  static constexpr int kFragsDW = kFragsD / kDimSplits;  // dK (and dV) fragments per warp

  // S and dP: each warp kSdPKeyFrags key fragments by kSdPRowFrags query fragments (bwd_block.cuh,
  // probs_and_ds_in_registers); 2 x 2 where that leaves whole blocks of at least two query
  // fragments (64 x 128: per 16-column step 8 fragment loads for 16 HMMA instead of 10), else
  // one key fragment.
  static constexpr bool kSdPPairs = kFragsN % 2 == 0 && kNWarps % (kFragsN / 2) == 0 &&
                                    kFragsM % (kNWarps / (kFragsN / 2)) == 0 &&
                                    kFragsM / (kNWarps / (kFragsN / 2)) >= 2;
  static constexpr int kSdPKeyFrags = kSdPPairs ? 2 : 1;

  // dQ tiles (kFragsM x kFragsD) dealt to the warps in turn: at most this many per warp.
  static constexpr int kDqTiles = kFragsM * kFragsD;
  static constexpr int kDqTilesPerWarp = (kDqTiles + kNWarps - 1) / kNWarps;

  static constexpr Fa2BwdLayout kMain = fa2_bwd_layout(kHeadDim, kConfig, kStages);
  // The deterministic dQ pass keeps float S and dP (never a p_only layout; dq_kernel refuses it).
  static constexpr Fa2BwdLayout kDqPass =
      fa2_bwd_layout(kHeadDim, Fa2BwdConfig{kBlockM, kBlockN, kStages, kBandFrags, false}, 1);
  static constexpr int kLd = kMain.ld_qkv;
  static constexpr int kLdS = kMain.ld_s;
  static constexpr int kLdP = kMain.ld_p;  // P and dS (elements of T): over S and dP, or alone

  static_assert(sizeof(T) == 2, "float16 or bfloat16 storage");
  static_assert(fa2_bwd_config_valid(kHeadDim, kConfig), "the warp grid must tile dK and dV");
  static_assert(kLd % 8 == 0 && kLdS % 4 == 0 && kLdP % 8 == 0, "wmma ldm rules");
  static_assert(kMain.bytes <= 227 * 1024, "beyond any current GPU's shared memory");
  static_assert(kPOnly || kDqPass.bytes <= kMain.bytes,
                "the dQ pass fits wherever the main kernel does");
  // The main kernel's start: the accumulator map's float tile (16 rows of kLdS) and, below it, a
  // 16 x 16 code tile of T, in S's region.
  static_assert(kMain.off_dp - kMain.off_s >= 16 * kLdS * sizeof(float) + 16 * 16 * sizeof(T),
                "S's region holds the kernel-start tiles");
  static_assert(kBlockM >= 2 * kFrag, "S holds a fragment-map tile and, below it, a code tile");
};

template <typename T, int kHeadDim>
using Fa2BwdStandard =
    Fa2BwdTraits<T, kHeadDim, fa2_bwd_config(kHeadDim).block_m, fa2_bwd_config(kHeadDim).block_n,
                 fa2_bwd_config(kHeadDim).stages>;
template <typename T, int kHeadDim>
using Fa2BwdDense =
    Fa2BwdTraits<T, kHeadDim, fa2_bwd_dense_config(kHeadDim).block_m,
                 fa2_bwd_dense_config(kHeadDim).block_n, fa2_bwd_dense_config(kHeadDim).stages,
                 fa2_bwd_dense_config(kHeadDim).band_frags, fa2_bwd_dense_config(kHeadDim).p_only>;
template <typename T, int kHeadDim>
using Fa2BwdFallback =
    Fa2BwdTraits<T, kHeadDim, fa2_bwd_fallback(kHeadDim).block_m,
                 fa2_bwd_fallback(kHeadDim).block_n, fa2_bwd_fallback(kHeadDim).stages>;

}  // namespace flashdl::cuda
