// The steps of one (query block, key block) pair of the backward pass, shared by the fa1 and fa2
// backward kernels (Algorithm 4, lines 11-20):
//   S = Q K^T and dP = dO V^T on tensor cores (float, in shared memory for fa1; in registers for
//   fa2, probs_and_ds_in_registers);
//   P = exp2(S * scale * log2(e) - lse2) (masked entries 0), with dropout multipliers Z
//   (lines 14-18): P Z and dS = P * (dP Z - D), written as T over S and dP in place, ready for
//   the dV (P Z), dK and dQ (dS) products.
// With score modifiers (score_mods.cuh) P = exp2(score(S) + bias - lse2) and dS is multiplied by
// the softcap's d score / d (scale S), 1 - tanh^2, taken at the raw S (ALiBi has no gradient).
// The bias and mask (Options::bias, mask) ride on the same run-time branch: the bias joins the
// score, keys the mask hides get P = dS = 0, and dBias, dS before the softcap's factor (natural-log
// units, detail/extras.hpp), is added into its float32 accumulator (DBiasAcc; atomics: a
// broadcast bias sums over its size-1 axes; a full-size one receives each element once).
// The softmax scale is left out of dS; the callers apply it once to dK and dQ.
#pragma once

#include <cstdint>

#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/mask.hpp"
#include "fragment.cuh"
#include "score_mods.cuh"

namespace flashdl::cuda::bwd {

// S = Q K^T and dP = dO V^T for an (m_tiles x 16) x (n_tiles x 16) block: the CTA's warps take the
// 2 * m_tiles * n_tiles output tiles in turn. Q, dO: rows x kD (ld_qkv); K, V: keys x kD (ld_qkv);
// S, dP: float, ld_s.
template <typename T, int kD>
__device__ __forceinline__ void scores_and_dp(const T* sQ, const T* sdO, const T* sK, const T* sV,
                                              int ld_qkv, float* sS, float* sdP, int ld_s,
                                              int m_tiles, int n_tiles, int nwarps) {
  const int per = m_tiles * n_tiles;
  for (int t = threadIdx.x / 32; t < 2 * per; t += nwarps) {
    const bool dp = t >= per;
    const int u = dp ? t - per : t, rf = u / n_tiles, nf = u % n_tiles;
    const T* a_base = (dp ? sdO : sQ) + rf * kFrag * ld_qkv;
    const T* b_base = (dp ? sV : sK) + nf * kFrag * ld_qkv;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kf = 0; kf < kD / kFrag; ++kf) {
      FragA<T> a;
      FragBt<T> b;
      wmma::load_matrix_sync(a, a_base + kf * kFrag, ld_qkv);
      wmma::load_matrix_sync(b, b_base + kf * kFrag, ld_qkv);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync((dp ? sdP : sS) + rf * kFrag * ld_s + nf * kFrag, acc, ld_s,
                            wmma::mem_row_major);
  }
}

// P = exp2(t - lse2) of an exp2-domain score t, at most 1 exactly: lse is float32, and where |t| is
// huge (|softmax_scale * q.k| near 1e30) its rounding alone can put lse2 below the score
// recomputed here, and exp2 overflowed (P = inf, the gradients NaN). A NaN exponent (a NaN lse2 of
// a row that sees a NaN key) stays NaN.
__device__ __forceinline__ float prob_of(float t, float l2) {
  const float e = t - l2;
  return exp2f(e > 0.0f ? 0.0f : e);
}

// Lines 13-20 for one element: P Z and dS of score x and dP value y at query i, key j (diag:
// mask.diag(i)), row statistics l2 (lse2) and d (D). kMasked applies the window and the block
// mask; l2 = -inf (a row with no visible key, or a padding row) gives 0 without looking at
// either. `modded`: modifies(mod) or ex.any(), hoisted by the caller. ex: the bias and mask
// (rows and columns relative to the sequence, i < seqlen_q and j < seqlen_k wherever l2 is finite
// and the pair is masked). ds_bias: dS before the cap's factor, what dBias sums (0 unless
// modded).
template <bool kMasked>
__device__ __forceinline__ void prob_and_ds_terms(float x, float y, float l2, float d, int64_t i,
                                                  int64_t j, int64_t diag, const detail::Mask& mask,
                                                  const detail::BlockMask& bm,
                                                  const detail::Dropout& drop, const ScoreModF& mod,
                                                  bool modded, const detail::HeadExtras& ex,
                                                  float& p, float& ds, float& ds_bias) {
  p = 0.0f;
  ds = 0.0f;
  ds_bias = 0.0f;
  if (l2 != -INFINITY && (!kMasked || (mask.visible(i, j) && bm.visible(i, j)))) {
    float t;
    if (modded) {
      t = modified_score(mod, x, diag, j);
      if (ex.any()) {
        if (!ex.kept(i, j)) return;  // hidden by the mask: P = dS = 0
        if (ex.bias != nullptr) t += bias_at(ex, i, j) * float(detail::kLog2e);
      }
    } else {
      t = x * mod.qk_scale;
    }
    const float prob = prob_of(t, l2);
    const float z = drop.on() ? drop.multiplier(i, j) : 1.0f;
    p = prob * z;
    ds = prob * (y * z - d);
    // softcap: 1 - tanh^2 (a second tanhf: computing both from one cost the deterministic
    // dQ pass up to 13 registers, over 128 at bfloat16 d = 64); 1 with ALiBi alone. The bias
    // is added after the cap: its gradient is dS before that factor.
    if (modded) {
      ds_bias = ds;
      ds *= mod.grad(x);
    }
  }
}

// prob_and_ds_terms, with dS before the cap's factor added into dBias where one is wanted.
template <bool kMasked>
__device__ __forceinline__ void prob_and_ds(float x, float y, float l2, float d, int64_t i,
                                            int64_t j, int64_t diag, const detail::Mask& mask,
                                            const detail::BlockMask& bm,
                                            const detail::Dropout& drop, const ScoreModF& mod,
                                            bool modded, const detail::HeadExtras& ex,
                                            const DBiasAcc& dbias, float& p, float& ds) {
  float ds_bias;
  prob_and_ds_terms<kMasked>(x, y, l2, d, i, j, diag, mask, bm, drop, mod, modded, ex, p, ds,
                             ds_bias);
  if (dbias.base != nullptr && ds_bias != 0.0f) atomicAdd(dbias.base + i * dbias.row + j, ds_bias);
}

// prob_and_ds_terms for an unmasked element with no modifier, bias, mask, dropout or dBias: the
// same arithmetic, with selects instead of its branches (which, around each element,
// were most of the instructions of the fa2 backward's softmax step on the H100, 2026-11-27).
// l2 = -inf (a row that sees no key, or a padding row) gives P = dS = 0.
__device__ __forceinline__ void plain_prob_and_ds(float x, float y, float l2, float d,
                                                  float qk_scale, float& p, float& ds) {
  const float prob = prob_of(x * qk_scale, l2);
  const bool seen = l2 != -INFINITY;
  p = seen ? prob : 0.0f;
  ds = seen ? prob * (y - d) : 0.0f;
}

// Lines 11-20 with S and dP kept in registers (the fa2 backward): the kMTiles x kNTiles tiles
// (query fragment rf, key fragment nf) are dealt to the kWarps warps in turn; a warp computes both
// S = Q K^T and dP = dO V^T of its tiles on tensor cores, then P Z and dS element by element from
// the accumulators (map: the accumulator's (row, col) of each element, learnt at kernel start),
// written as T at sP and sdS (ld_p elements a row). No float S or dP in shared memory and no
// barrier between the products and the softmax; the caller synchronises before P and dS are
// read. Operands through load_frag: the kernel checks twin_loads_hold_backward at its start.
// Where the tiles deal out evenly, each warp owns kNPer key fragments by kMTiles * kNPer / kWarps
// query fragments and its products run side by side, each K and V fragment loaded once for all
// its query fragments (and, with kNPer 2, each Q and dO fragment once for both key fragments):
// one tile at a time, each of its two chains of kD / 16 products waited for in turn, left the
// tensor cores idle (the H100's source-level profile, 2026-11-27).
template <typename T, int kD, bool kMasked, int kMTiles, int kNTiles, int kWarps, int kNPer = 1>
__device__ __forceinline__ void probs_and_ds_in_registers(
    const T* sQ, const T* sdO, const T* sK, const T* sV, int ld_qkv, T* sP, T* sdS, int ld_p,
    const FragMap& map, const float* sL2, const float* sD, int64_t i0, int64_t j0,
    const detail::Mask& mask, const detail::BlockMask& bm, const detail::Dropout& drop,
    const ScoreModF& mod, const detail::HeadExtras& ex, const DBiasAcc& dbias) {
  const bool modded = modifies(mod) || ex.any();
  // No modifier, bias, mask, dropout or dBias (the same in every thread): plain_prob_and_ds.
  const bool plain = !modded && !drop.on() && dbias.base == nullptr;
  // lse2 and D of the rows of query fragment rf's elements, read before any of its tiles' P and
  // dS are stored (stores the compiler cannot tell from these loads: read inside finish, they
  // were read again for each tile).
  struct RowStats {
    float l2[FragAcc::num_elements], d[FragAcc::num_elements];
  };
  auto stats_of = [&](int rf) {
    RowStats st;
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; ++e) {
      st.l2[e] = sL2[rf * kFrag + map.r[e]];
      st.d[e] = sD[rf * kFrag + map.r[e]];
    }
    return st;
  };
  // P and dS of tile (rf, nf) from its accumulators, stored as T.
  auto finish = [&](int rf, int nf, const FragAcc& s, const FragAcc& dp, const RowStats& st) {
    float p[FragAcc::num_elements], ds[FragAcc::num_elements];
    if (!kMasked && plain) {
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e)
        plain_prob_and_ds(s.x[e], dp.x[e], st.l2[e], st.d[e], mod.qk_scale, p[e], ds[e]);
    } else {
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) {
        const int r = rf * kFrag + map.r[e], c = nf * kFrag + map.c[e];
        prob_and_ds<kMasked>(s.x[e], dp.x[e], st.l2[e], st.d[e], i0 + r, j0 + c, mask.diag(i0 + r),
                             mask, bm, drop, mod, modded, ex, dbias, p[e], ds[e]);
      }
    }
    if (map.pairs) {  // sm_80/sm_90: adjacent pairs, half the stores
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; e += 2) {
        const int at = (rf * kFrag + map.r[e]) * ld_p + nf * kFrag + map.c[e];
        store_pair(sP + at, p[e], p[e + 1]);
        store_pair(sdS + at, ds[e], ds[e + 1]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) {
        const int at = (rf * kFrag + map.r[e]) * ld_p + nf * kFrag + map.c[e];
        sP[at] = from_float<T>(p[e]);
        sdS[at] = from_float<T>(ds[e]);
      }
    }
  };
  const int warp = threadIdx.x / 32;
  // Warp w: key fragments (w % kNGroups) * kNPer + j, query fragments w / kNGroups + i * kMWarps.
  constexpr int kNGroups = kNTiles / kNPer;
  constexpr int kMWarps = kWarps / (kNGroups > 0 ? kNGroups : 1);
  if constexpr (kNTiles % kNPer == 0 && kWarps % kNGroups == 0 && kMTiles % kMWarps == 0) {
    // The warp's query fragments in chunks of at most kChunk (4: every tile of the dense kernels
    // in one chunk, each K and V fragment loaded once a pair; with 2, ptxas sm_90 float16 d 64:
    // 254 registers, SASS model 6% more cycles, the fragments loaded again for each chunk).
    constexpr int kMPerAll = kMTiles / kMWarps;
    constexpr int kChunk = kMPerAll < 4 ? kMPerAll : 4;
    static_assert(kMPerAll % kChunk == 0, "whole chunks of query fragments");
    const int ng = warp % kNGroups, mg = warp / kNGroups;
#pragma unroll 1
    for (int c0 = 0; c0 < kMPerAll; c0 += kChunk) {
      constexpr int kMPer = kChunk;
      FragAcc s[kMPer][kNPer], dp[kMPer][kNPer];
#pragma unroll
      for (int i = 0; i < kMPer; ++i)
#pragma unroll
        for (int j = 0; j < kNPer; ++j) {
          wmma::fill_fragment(s[i][j], 0.0f);
          wmma::fill_fragment(dp[i][j], 0.0f);
        }
#pragma unroll
      for (int kf = 0; kf < kD / kFrag; ++kf) {
        FragBt<T> bk[kNPer], bv[kNPer];
#pragma unroll
        for (int j = 0; j < kNPer; ++j) {
          load_frag(bk[j], sK + (ng * kNPer + j) * kFrag * ld_qkv + kf * kFrag, ld_qkv);
          load_frag(bv[j], sV + (ng * kNPer + j) * kFrag * ld_qkv + kf * kFrag, ld_qkv);
        }
#pragma unroll
        for (int i = 0; i < kMPer; ++i) {
          const int rf = mg + (c0 + i) * kMWarps;
          FragA<T> a;
          load_frag(a, sQ + rf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
#pragma unroll
          for (int j = 0; j < kNPer; ++j) wmma::mma_sync(s[i][j], a, bk[j], s[i][j]);
          load_frag(a, sdO + rf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
#pragma unroll
          for (int j = 0; j < kNPer; ++j) wmma::mma_sync(dp[i][j], a, bv[j], dp[i][j]);
        }
      }
#pragma unroll
      for (int i = 0; i < kMPer; ++i) {
        const int rf = mg + (c0 + i) * kMWarps;
        const RowStats st = stats_of(rf);
#pragma unroll
        for (int j = 0; j < kNPer; ++j) finish(rf, ng * kNPer + j, s[i][j], dp[i][j], st);
      }
    }
  } else {
    for (int t = warp; t < kMTiles * kNTiles; t += kWarps) {
      const int rf = t / kNTiles, nf = t % kNTiles;
      FragAcc s, dp;
      wmma::fill_fragment(s, 0.0f);
      wmma::fill_fragment(dp, 0.0f);
#pragma unroll
      for (int kf = 0; kf < kD / kFrag; ++kf) {
        FragA<T> a;
        FragBt<T> b;
        load_frag(a, sQ + rf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
        load_frag(b, sK + nf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
        wmma::mma_sync(s, a, b, s);
        load_frag(a, sdO + rf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
        load_frag(b, sV + nf * kFrag * ld_qkv + kf * kFrag, ld_qkv);
        wmma::mma_sync(dp, a, b, dp);
      }
      finish(rf, nf, s, dp, stats_of(rf));
    }
  }
}

// Lines 13 and 20, a warp per row: P and dS of `rows` x `cols` (whole tiles), written as T over S
// and dP with row stride 2 * ld_s (row r of the T matrix starts where row r of the float one
// does). Row r is query i0 + r, column c key j0 + c; kMasked applies the window and the block mask
// (and drops keys past seqlen_k). lse2 = -inf (a row with no visible key, or a padding row) gives
// P = 0 without looking at either mask. `mod`: the head's score modifiers; without any, scores
// are S * mod.qk_scale (scale * log2(e)) as before, a branch per element uniform over the CTA.
template <typename T, bool kMasked>
__device__ __forceinline__ void probs_and_ds(float* sS, float* sdP, int ld_s, int rows, int cols,
                                             const float* sL2, const float* sD, int64_t i0,
                                             int64_t j0, const detail::Mask& mask,
                                             const detail::BlockMask& bm,
                                             const detail::Dropout& drop, const ScoreModF& mod,
                                             const detail::HeadExtras& ex, const DBiasAcc& dbias,
                                             int nwarps) {
  const int lane = threadIdx.x % 32;
  const bool modded = modifies(mod) || ex.any();
  for (int r = threadIdx.x / 32; r < rows; r += nwarps) {
    float* s = sS + r * ld_s;
    float* dp = sdP + r * ld_s;
    T* p_out = reinterpret_cast<T*>(s);
    T* ds_out = reinterpret_cast<T*>(dp);
    const float l2 = sL2[r], d = sD[r];
    const int64_t diag = mask.diag(i0 + r);
    for (int c0 = 0; c0 < cols; c0 += 32) {
      const int c = c0 + lane;
      float p = 0.0f, ds = 0.0f;
      if (c < cols)
        prob_and_ds<kMasked>(s[c], dp[c], l2, d, i0 + r, j0 + c, diag, mask, bm, drop, mod, modded,
                             ex, dbias, p, ds);
      // T values [c0, c0 + 32) overwrite floats [c0 / 2, c0 / 2 + 16): all read by now.
      __syncwarp();
      if (c < cols) {
        p_out[c] = from_float<T>(p);
        ds_out[c] = from_float<T>(ds);
      }
    }
  }
}

// lse2 and D of query rows [i0, i0 + tile_rows) of one (batch, head) from the fa2 workspace
// (rows past seqlen_q: lse2 = -inf, D = 0, so their P and dS are 0).
__device__ __forceinline__ void load_stats(float* sL2, float* sD, const float* gL2, const float* gD,
                                           int64_t i0, int tile_rows, int64_t seqlen_q,
                                           int threads) {
  for (int r = threadIdx.x; r < tile_rows; r += threads) {
    const bool in = i0 + r < seqlen_q;
    sL2[r] = in ? gL2[i0 + r] : -INFINITY;
    sD[r] = in ? gD[i0 + r] : 0.0f;
  }
}

}  // namespace flashdl::cuda::bwd
