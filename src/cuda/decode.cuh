// Attention over a KV cache (decoding) on tensor cores: a few query rows against many keys.
//
// Grid (split x row chunk, kv head, batch). A CTA owns up to 16 query rows of one kv head, the
// rows of every query head of its GQA group (row g: query g % seqlen_q of head
// hk * group + g / seqlen_q), so each K and V row of its split is read from global memory once
// for all of them. Tiles of 16 * warps keys stream through a double buffer in shared memory
// (cp.async, row by row: each row's element offset is resolved once through the page table, so
// a tile may span pages). Each warp takes 16 keys of a tile and runs the FA-2 steps on them
// (fa2_forward.cuh: S = Q K^T on tensor cores, score modifiers, mask, online softmax, O += P V),
// keeping its own {m, l} and O: the warps split the keys, not the rows, and never wait for each
// other inside a tile. At the end the warps' normalised (O, lse) are merged in warp order
// (detail::merge_weights) through shared memory laid over the K/V buffers, and written to out and
// lse, or, with several splits, to the float32 workspace that merge_rows.cuh combines in split
// order. An attention sink (Params::sinks_ptr) joins split 0's merged rows alone (merge_warps_and_store),
// so the combine adds it to each row's denominator once.
//
// Why tensor cores for 1 to 16 rows (decoding has 1 to 8 mostly): the kernel is bound by reading
// the cache, 4d bytes per key and kv head. A 16-row wmma tile does 64d flops per key whatever the
// rows, 16 flops per byte: 54 TFLOPS at an H100's 3.35 TB/s, about 5% of its dense fp16 tensor
// peak (17% of an A100's at 2 TB/s), so the padding rows cost no time. On CUDA cores one row is
// 1 flop per byte but each dot product also needs conversions and a cross-lane reduction, and a
// GQA group of 8 would already ask for 27 TFLOPS, half an H100's fp32 peak; and the tensor-core
// path reuses the FA-2 steps instead of re-deriving them.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "check.hpp"
#include "decode_launch.hpp"
#include "decode_plan.hpp"
#include "fa2_forward.cuh"
#include "flashdl/detail/kv_cache.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/softmax.hpp"
#include "fragment.cuh"
#include "score_mods.cuh"
#include "tile_io.cuh"

namespace flashdl::cuda {

// Every constant of the decode kernel for one (dtype, head dim, warps), from decode_layout. The
// k-prefixed names from kLdQKV on are the traits the FA-2 steps read: each warp's 16 x 16 score
// tile over its 16 keys (kFragsN = 1) is their block.
template <typename T_, int kHeadDim_, int kWarps_>
struct DecodeTraits {
  using T = T_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kWarps_;
  static constexpr int kThreads = decode_layout(kHeadDim_, kWarps_).threads;
  static constexpr int kBlockN = decode_layout(kHeadDim_, kWarps_).block_n;  // keys per tile
  static constexpr int kLdQKV = decode_layout(kHeadDim_, kWarps_).ld_qkv;
  static constexpr int kLdS = decode_layout(kHeadDim_, kWarps_).ld_s;
  static constexpr int kLdP = 2 * kLdS;
  static constexpr int kLdO = decode_layout(kHeadDim_, kWarps_).ld_o;
  static constexpr int kFragsN = 1;
  static constexpr int kFragsD = kHeadDim / kFrag;
  static constexpr int kColsPerLane = kFrag / 2;
  static constexpr std::size_t kOffQ = decode_layout(kHeadDim_, kWarps_).off_q;
  static constexpr std::size_t kOffK = decode_layout(kHeadDim_, kWarps_).off_k;
  static constexpr std::size_t kOffV = decode_layout(kHeadDim_, kWarps_).off_v;
  static constexpr std::size_t kOffS = decode_layout(kHeadDim_, kWarps_).off_s;
  static constexpr std::size_t kOffRows = decode_layout(kHeadDim_, kWarps_).off_rows;
  static constexpr std::size_t kOffStats = decode_layout(kHeadDim_, kWarps_).off_stats;
  static constexpr std::size_t kSmemBytes = decode_layout(kHeadDim_, kWarps_).bytes;
  static constexpr std::size_t kMergeBytes = decode_layout(kHeadDim_, kWarps_).merge_bytes;

  static_assert(sizeof(T) == 2, "float16 or bfloat16 storage");
  static_assert(kHeadDim % kFrag == 0, "whole wmma tiles");
  static_assert(kThreads == 2 * kBlockN, "one thread per K row and one per V row of a tile");
  static_assert(decode_layout(kHeadDim_, kWarps_).kv_stage_bytes ==
                    std::size_t(kBlockN) * kLdQKV * sizeof(T),
                "stages follow each other with no padding");
  static_assert(kMergeBytes <= kOffS - kOffK, "the epilogue's O fits over the K/V buffers");
  static_assert(kLdQKV % 8 == 0 && kLdS % 4 == 0 && kLdP % 8 == 0 && kLdO % 4 == 0,
                "wmma ldm rules");
  static_assert(kSmemBytes <= 227 * 1024, "beyond any current GPU's shared memory");
};

namespace decode {

// K or V element offsets of the rows of tile n (keys t_lo + n * kBlockN onward) into `rows`:
// threads [0, kBlockN) take K rows, the others V rows; -1 past t_hi (zero-filled, never read).
template <typename Tr>
__device__ __forceinline__ void row_offsets(const Params& p, int64_t b, int64_t hk, int64_t j0,
                                            int64_t t_hi, int64_t* rows) {
  const int r = threadIdx.x % Tr::kBlockN;
  const bool v = threadIdx.x >= Tr::kBlockN;
  const int64_t j = j0 + r;
  rows[threadIdx.x] = j >= t_hi ? int64_t{-1}
                      : v       ? detail::v_cache_offset(p, b, j, hk)
                                : detail::k_cache_offset(p, b, j, hk);
}

// Copies the K and V rows named by `rows` (K offsets then V offsets) into the stage's tiles,
// zero-filling rows with offset -1: a row of P that is 0 there must not meet a NaN of the cache's
// unused rows in P V. cp.async with vec (the caller commits, waits and synchronises), else plain
// loads visible after the same barrier.
template <typename Tr>
__device__ __forceinline__ void load_kv(typename Tr::T* sK, typename Tr::T* sV, const int64_t* rows,
                                        const typename Tr::T* gK, const typename Tr::T* gV,
                                        bool vec) {
  using T = typename Tr::T;
  constexpr int kChunks = Tr::kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kPerTile = Tr::kBlockN * kChunks;
  for (int idx = threadIdx.x; idx < 2 * kPerTile; idx += Tr::kThreads) {
    const bool is_v = idx >= kPerTile;
    const int r = (idx % kPerTile) / kChunks, c = (idx % kChunks) * 8;
    const int64_t off = rows[(is_v ? Tr::kBlockN : 0) + r];
    T* dst = (is_v ? sV : sK) + r * Tr::kLdQKV + c;
    if (off < 0) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const T* src = (is_v ? gV : gK) + off + c;
    if (vec) {
      __pipeline_memcpy_async(dst, src, 16);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = src[e];
    }
  }
}

// The CTA's rows of Q (rows >= `rows` zero-filled), each from its own head.
template <typename Tr>
__device__ __forceinline__ void load_q(typename Tr::T* sQ, const Params& p, int64_t b,
                                       int64_t head0, int64_t g0, int rows, bool vec) {
  using T = typename Tr::T;
  constexpr int kChunks = Tr::kHeadDim / 8;
  for (int idx = threadIdx.x; idx < kDecodeRows * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    T* dst = sQ + r * Tr::kLdQKV + c;
    if (r >= rows) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
      continue;
    }
    const int64_t g = g0 + r, head = head0 + g / p.seqlen_q, i = g % p.seqlen_q;
    const T* src = static_cast<const T*>(p.q_ptr) + b * p.q_batch_stride + i * p.q_row_stride +
                   head * p.q_head_stride + c;
    if (vec) {
      __pipeline_memcpy_async(dst, src, 16);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = src[e];
    }
  }
}

// Whether the warp's 16 value rows (row stride ld) hold a NaN or Inf: tile_has_nonfinite's test
// on the lanes of one warp, the same answer in every lane.
template <typename Tr>
__device__ __forceinline__ bool warp_rows_nonfinite(const typename Tr::T* s) {
  constexpr unsigned kExp = std::is_same<typename Tr::T, __half>::value ? 0x7c00u : 0x7f80u;
  constexpr unsigned kExp2 = kExp | (kExp << 16);
  constexpr int kChunks = Tr::kHeadDim / 8;
  unsigned hit = 0u;
  for (int idx = threadIdx.x % 32; idx < kFrag * kChunks; idx += 32) {
    const uint4 u = *reinterpret_cast<const uint4*>(s + (idx / kChunks) * Tr::kLdQKV +
                                                    (idx % kChunks) * 8);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const unsigned x = (w[q] & kExp2) ^ kExp2;  // a zero half: that element is NaN or Inf
      hit |= unsigned((x & 0xffffu) == 0u) | unsigned((x >> 16) == 0u);
    }
  }
  return __any_sync(kFullMask, hit != 0u);
}

// The slow path of a warp's 16 keys that some of its rows do not all see, when their values hold
// a NaN or Inf: O += P V by scalar FMAs over the keys each row sees (the tensor-core product adds
// 0 * NaN = NaN to rows that cannot see such a key). sP: the warp's P (T, ld kLdP); sV: its 16
// value rows; shown: bit c set where this lane pair's row sees the warp's key c (its window and
// its boolean mask); rows, cols: the accumulator's element map. Per lane 16 x (kFragsD * 8) FMAs.
template <typename Tr>
__device__ __forceinline__ void accumulate_pv_seen(const typename Tr::T* sP,
                                                   const typename Tr::T* sV, unsigned shown,
                                                   const FragRows& rows, const FragRows& cols,
                                                   FragAcc (&acc)[Tr::kFragsD]) {
  unsigned shown_i[FragAcc::num_elements];
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i)
    shown_i[i] = __shfl_sync(kFullMask, shown, 2 * rows.r[i]);
#pragma unroll 1
  for (int c = 0; c < kFrag; ++c)
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; ++i) {
      if (!((shown_i[i] >> c) & 1u)) continue;  // a select: 0 * NaN is never formed
      const float pk = to_float(sP[rows.r[i] * Tr::kLdP + c]);
#pragma unroll
      for (int df = 0; df < Tr::kFragsD; ++df)
        acc[df].x[i] = fmaf(pk, to_float(sV[c * Tr::kLdQKV + df * kFrag + cols.r[i]]),
                            acc[df].x[i]);
    }
}

__device__ __forceinline__ int64_t warp_min(int64_t x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const int64_t y = __shfl_xor_sync(kFullMask, x, off);
    x = y < x ? y : x;
  }
  return x;
}
__device__ __forceinline__ int64_t warp_max(int64_t x) {
#pragma unroll
  for (int off = 16; off > 0; off /= 2) {
    const int64_t y = __shfl_xor_sync(kFullMask, x, off);
    x = y > x ? y : x;
  }
  return x;
}

// The epilogue after every warp has stored its normalised O (sO: warps x 16 x kLdO floats) and
// lse: the merge weights of each row in warp order, then the merged rows written to out and lse
// (one split) or to the split's part of the workspace. Every thread calls it.
template <typename Tr>
__device__ __forceinline__ void merge_warps_and_store(const Params& p, const DecodeArgs& a,
                                                      const float* sO, float* stats, int64_t b,
                                                      int64_t hk, int64_t split, int64_t g0,
                                                      int rows) {
  using T = typename Tr::T;
  constexpr int kW = Tr::kNWarps, kD = Tr::kHeadDim, kChunks = kD / 8;
  float* s_lse = stats;                           // [warp][row]
  float* s_wa = stats + kW * kDecodeRows;         // [warp][row]
  float* s_wb = stats + 2 * kW * kDecodeRows;     // [warp][row]
  float* s_total = stats + 3 * kW * kDecodeRows;  // [row]
  if (threadIdx.x < kDecodeRows) {
    const int r = threadIdx.x;
    float total = -INFINITY;
    for (int w = 0; w < kW; ++w) {
      const detail::MergeWeights<float> mw = detail::merge_weights(total,
                                                                   s_lse[w * kDecodeRows + r]);
      s_wa[w * kDecodeRows + r] = mw.wa;
      s_wb[w * kDecodeRows + r] = mw.wb;
      total = mw.lse;
    }
    if (p.sinks_ptr != nullptr && split == 0 && r < rows) {
      // The attention sink joins the row's denominator once, here in split 0's result (a
      // partial with o = 0 and lse = sink, merged last): the split combine carries it into the
      // other splits' weights. Scaling the last warp's weights scales the whole fold.
      const int64_t head = hk * p.h_h_k_ratio + (g0 + r) / p.seqlen_q;
      const detail::MergeWeights<float> ms =
          detail::merge_weights(total, p.sinks_ptr[head * p.sinks_stride]);
      s_wa[(kW - 1) * kDecodeRows + r] *= ms.wa;
      s_wb[(kW - 1) * kDecodeRows + r] *= ms.wa;
      total = ms.lse;
    }
    s_total[r] = total;
  }
  __syncthreads();

  const int64_t group = p.h_h_k_ratio, sq = p.seqlen_q;
  const int64_t rows_all = p.nheads * sq;  // workspace rows per (batch, split)
  const int64_t part = (b * a.splits + split) * rows_all + hk * group * sq + g0;  // row 0's
  for (int idx = threadIdx.x; idx < rows * kChunks; idx += Tr::kThreads) {
    const int r = idx / kChunks, c = (idx % kChunks) * 8;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      const float wa = s_wa[w * kDecodeRows + r], wb = s_wb[w * kDecodeRows + r];
      const float* o = sO + (w * kDecodeRows + r) * Tr::kLdO + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = wa * v[e] + (wb == 0.0f ? 0.0f : wb * o[e]);
    }
    if (a.splits > 1) {
      float4* dst = reinterpret_cast<float4*>(a.o_part + (part + r) * kD + c);
      dst[0] = make_float4(v[0], v[1], v[2], v[3]);
      dst[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      const int64_t g = g0 + r, head = hk * group + g / sq, i = g % sq;
      store8(static_cast<T*>(p.o_ptr) + b * p.o_batch_stride + i * p.o_row_stride +
                 head * p.o_head_stride + c,
             v, a.vec_store);
    }
  }
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    const int64_t g = g0 + r, head = hk * group + g / sq, i = g % sq;
    if (a.splits > 1)
      a.lse_part[part + r] = s_total[r];
    else
      p.lse_ptr[b * p.lse_batch_stride + head * p.lse_head_stride + i * p.lse_row_stride] =
          s_total[r];
  }
}

// The score pass with a bias or a boolean mask (detail/extras.hpp), and the modifiers: the
// forward's (fa2_forward.cuh) for the row this lane pair owns, query i of `head` (row_ok: a row of
// the CTA), keys n0 + c read at column n0 + c + cache_leftpad[b] of the bias and mask (columns are
// cache positions); keys past the sequence's are left alone (the softmax masks them). Not inlined, as the forward's: the plain decode path keeps its registers.
template <typename Tr>
__device__ __noinline__ void apply_extras(float* sS, const ScoreModF& mod, bool modded,
                                          const Params& p, int64_t b, int64_t head, int64_t i,
                                          bool row_ok, int64_t diag, int64_t n0) {
  const detail::HeadExtras ex = row_ok ? detail::extras_of(p, b, head) : detail::HeadExtras{};
  const int64_t keys = p.seqused_k[b], pad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
  // Without a modifier the raw q.k is scaled here when there is a bias (the softmax then scales
  // by 1), left for the softmax's scaling with a mask alone.
  const float pre = p.bias_ptr != nullptr ? float(p.scale_softmax_log2) : 1.0f;
  fa2::score_pass<Tr>(sS, mod, modded, ex, pre, diag, i, n0, keys, pad);
}

// Bit c set where row i of `head` sees key n0 + c of the warp's 16: within [lo, hi) (relative to
// n0, clamped to [0, 16]) and kept by the boolean mask (column n0 + c + cache_leftpad[b]), if any.
// Not inlined: only the rare slow path of masked calls runs it.
template <typename Tr>
__device__ __noinline__ unsigned shown_keys(const Params& p, int64_t b, int64_t head, int64_t i,
                                            int lo, int hi, int64_t n0) {
  unsigned shown = hi > lo ? (((1u << hi) - 1u) & ~((1u << lo) - 1u)) : 0u;
  if (p.mask_ptr != nullptr && shown != 0u) {
    const detail::HeadExtras ex = detail::extras_of(p, b, head);
    const int64_t pad = p.cache_leftpad != nullptr ? p.cache_leftpad[b] : 0;
#pragma unroll 1
    for (int c = lo; c < hi; ++c)
      if (!ex.kept(i, n0 + c + pad)) shown &= ~(1u << c);
  }
  return shown;
}

// Two CTAs per SM is what the shared memory allows for d = 128 on an A100 and an H100 (82 KiB);
// the bound keeps ptxas within the registers that leaves.
template <typename Tr>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    decode_kernel(const __grid_constant__ Params p, const DecodeArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  using T = typename Tr::T;
  constexpr int kBlockN = Tr::kBlockN, kLd = Tr::kLdQKV;
  FLASHDL_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  float* sS = reinterpret_cast<float*>(smem + Tr::kOffS) + warp * kDecodeRows * Tr::kLdS;
  int64_t* sRows = reinterpret_cast<int64_t*>(smem + Tr::kOffRows);  // [stage][K rows, V rows]

  const int64_t split = blockIdx.x / a.row_chunks, chunk = blockIdx.x % a.row_chunks;
  const int64_t hk = blockIdx.y, b = blockIdx.z;
  const int64_t sq = p.seqlen_q, group = p.h_h_k_ratio;
  const int64_t g0 = chunk * kDecodeRows;  // the CTA's first row among the kv head's group * sq
  const int rows = int(group * sq - g0 < kDecodeRows ? group * sq - g0 : kDecodeRows);
  const detail::Mask mask = detail::make_mask(sq, p.seqused_k[b], p.window_left, p.window_right);
  const KeyRange keys = split_keys(visible_keys(mask), split, a.splits, kBlockN);

  // The row this lane pair owns (every warp holds the same 16 rows): the keys it sees within the
  // split (empty for padding rows), its diagonal and its head's modifiers.
  const int r = lane / 2;
  const int64_t g = g0 + r, head = hk * group + g / sq, i = g % sq;
  int64_t col_lo = 0, col_hi = 0, diag = 0;
  if (r < rows) {
    col_lo = mask.col_begin(i) > keys.begin ? mask.col_begin(i) : keys.begin;
    col_hi = mask.col_end(i) < keys.end ? mask.col_end(i) : keys.end;
    diag = mask.diag(i);
  }
  const bool mods = detail::has_score_mod(p), extras = detail::has_extras(p);
  const ScoreModF mod = mods && r < rows ? head_score_mods(a.mods, p, b, head) : a.mods;
  // Keys some row sees: only their tiles are read (a window's, not the whole split's).
  const bool seen = col_lo < col_hi;
  const int64_t t_lo = warp_min(seen ? col_lo : INT64_MAX);
  const int64_t t_hi = warp_max(seen ? col_hi : INT64_MIN);
  const int n_tiles = t_lo < t_hi ? int(detail::ceil_div(t_hi - t_lo, kBlockN)) : 0;

  const T* gK = static_cast<const T*>(p.k_ptr);
  const T* gV = static_cast<const T*>(p.v_ptr);
  auto tile_start = [&](int n) { return t_lo + int64_t(n) * kBlockN; };
  // Offsets of tiles 0 and 1, then Q and tile 0 in flight.
  if (n_tiles > 0) decode::row_offsets<Tr>(p, b, hk, tile_start(0), t_hi, sRows);
  if (n_tiles > 1) decode::row_offsets<Tr>(p, b, hk, tile_start(1), t_hi, sRows + 2 * kBlockN);
  __syncthreads();
  decode::load_q<Tr>(sQ, p, b, hk * group, g0, rows, a.vec_load);
  if (n_tiles > 0) decode::load_kv<Tr>(sK, sV, sRows, gK, gV, a.vec_load);
  __pipeline_commit();

  const FragRows frag_rows = accumulator_rows(sS, Tr::kLdS);
  const FragRows frag_cols = accumulator_cols(sS, Tr::kLdS);
  const detail::BlockMask dense{};
  const detail::Dropout no_dropout{};
  detail::OnlineSoftmax<float> softmax;
  FragAcc acc_o[Tr::kFragsD];
#pragma unroll
  for (int df = 0; df < Tr::kFragsD; ++df) wmma::fill_fragment(acc_o[df], 0.0f);
  // With a modifier or a bias the score pass leaves scores in the exp2 domain (a bias adds in
  // it); a mask alone keeps the softmax's scaling.
  const float scale_log2 = mods || p.bias_ptr != nullptr ? 1.0f : float(p.scale_softmax_log2);

  for (int n = 0, stage = 0; n < n_tiles; ++n, stage ^= 1) {
    // Invariant: the offsets of tile n + 1 are in stage ^ 1's slots, visible; its buffers free.
    T* sKn = sK + stage * kBlockN * kLd;
    T* sVn = sV + stage * kBlockN * kLd;
    if (n + 1 < n_tiles)
      decode::load_kv<Tr>(sK + (stage ^ 1) * kBlockN * kLd, sV + (stage ^ 1) * kBlockN * kLd,
                          sRows + (stage ^ 1) * 2 * kBlockN, gK, gV, a.vec_load);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // tile n (and Q) landed; tile n + 1 may still be in flight
    __syncthreads();

    const int64_t n0 = tile_start(n) + warp * kFrag;  // this warp's 16 keys
    if (n0 < t_hi) {  // warp-uniform: a last tile's warps past the keys have nothing to do
      fa2::compute_scores<Tr>(sQ, sKn + warp * kFrag * kLd, sS);  // S = Q K^T
      __syncwarp();
      if (extras)
        decode::apply_extras<Tr>(sS, mod, mods, p, b, head, i, r < rows, diag, n0);
      else if (mods)
        fa2::apply_score_mods<Tr>(sS, mod, diag, n0);
      const float alpha = fa2::softmax_step<Tr, true>(sS, softmax, scale_log2, n0, col_lo, col_hi,
                                                      dense, 0, no_dropout, 0);
      fa2::scale_rows(acc_o, frag_rows, alpha);
      // Keys some row of the CTA cannot see (padding rows aside) whose values hold a NaN or Inf
      // take the scalar P V over each row's visible keys; the vote is the warp's own (warps
      // split the keys), no barrier. Cost on finite values: a scan of the warp's 16 value rows
      // where its keys cut some row's range (with one query row, only the warp holding the
      // split's last keys), and 8 registers for the column map (ptxas sm_80 float16 d 128:
      // 146 -> 154, bfloat16 d 256: 254 -> 255, no spill).
      const int64_t lo_rel = col_lo - n0, hi_rel = col_hi - n0;
      // (A boolean mask may hide keys inside every row's range: masked calls always check.)
      const bool cut = p.mask_ptr != nullptr ||
                       __any_sync(kFullMask, r < rows && (lo_rel > 0 || hi_rel < kFrag));
      const T* sVw = sVn + warp * kFrag * kLd;
      if (cut && decode::warp_rows_nonfinite<Tr>(sVw)) {
        const int lo = r < rows ? int(lo_rel < 0 ? 0 : lo_rel > kFrag ? kFrag : lo_rel) : 0;
        const int hi = r < rows ? int(hi_rel < 0 ? 0 : hi_rel > kFrag ? kFrag : hi_rel) : 0;
        decode::accumulate_pv_seen<Tr>(reinterpret_cast<const T*>(sS), sVw,
                                       decode::shown_keys<Tr>(p, b, head, i, lo, hi, n0), frag_rows,
                                       frag_cols, acc_o);
      } else {
        fa2::accumulate_pv<Tr>(reinterpret_cast<const T*>(sS), sVw, acc_o);
      }
    }
    // Stage's offset slots were read by the load of tile n (before this iteration's barrier):
    // they take tile n + 2's now, visible after the barrier that also frees the stage's buffers.
    if (n + 2 < n_tiles)
      decode::row_offsets<Tr>(p, b, hk, tile_start(n + 2), t_hi, sRows + stage * 2 * kBlockN);
    __syncthreads();
  }
  __pipeline_wait_prior(0);  // Q's copies when there was no tile
  __syncthreads();           // every warp is done with K and V: the epilogue's O goes over them

  float* sO = reinterpret_cast<float*>(smem + Tr::kOffK);
  float* stats = reinterpret_cast<float*>(smem + Tr::kOffStats);
  fa2::scale_rows(acc_o, frag_rows, softmax.inv_l());
#pragma unroll
  for (int df = 0; df < Tr::kFragsD; ++df)
    wmma::store_matrix_sync(sO + warp * kDecodeRows * Tr::kLdO + df * kFrag, acc_o[df], Tr::kLdO,
                            wmma::mem_row_major);
  if (lane % 2 == 0) stats[warp * kDecodeRows + r] = softmax.lse();
  __syncthreads();
  merge_warps_and_store<Tr>(p, a, sO, stats, b, hk, split, g0, rows);
#endif
}

template <typename Tr>
void launch(const Params& p, const DecodeArgs& a, const LaunchContext& ctx) {
  const auto kernel = decode_kernel<Tr>;
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(Tr::kSmemBytes)));
  const dim3 grid(static_cast<unsigned>(a.splits * a.row_chunks),
                  static_cast<unsigned>(p.nheads_kv), static_cast<unsigned>(p.batch));
  FLASHDL_LAUNCH(grid, Tr::kThreads, Tr::kSmemBytes, ctx.stream, kernel)(p, a);
  FLASHDL_CUDA_CHECK_LAUNCH("decode kernel launch");
}

}  // namespace decode

// The grid's limits and the warps were checked by kvcache.cu's plan, before the cache was written.
template <typename T, int kHeadDim>
void launch_decode(const Params& p, const DecodeArgs& a, int warps, const LaunchContext& ctx) {
  if (warps == 4) return decode::launch<DecodeTraits<T, kHeadDim, 4>>(p, a, ctx);
  if constexpr (decode_has_fallback(kHeadDim)) {
    if (warps == 2) return decode::launch<DecodeTraits<T, kHeadDim, 2>>(p, a, ctx);
  }
  throw Error(ErrorKind::unsupported, "q: no decode kernel with " + std::to_string(warps) +
                                          " warps for headdim " + std::to_string(kHeadDim));
}

}  // namespace flashdl::cuda
