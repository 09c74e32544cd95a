// The FlashAttention-2 backward on tensor cores.
//
// 1. preprocess: D = rowsum(dO * O) and lse2 = lse * log2(e) for every query row (a warp per row).
// 2. main kernel, grid (key block, kv head, batch), 8 warps: K_j and V_j are loaded once; for each
//    query head of the group and each query block some key of the block can see, Q_i, dO_i, lse2
//    and D stream through a double buffer (cp.async); each warp computes S = Q K^T and
//    dP = dO V^T for its tiles and, from the accumulators in registers, P and dS
//    (bwd_block.cuh, with the dropout mask regenerated from its Philox counters, and the head's
//    score modifiers: softcap, ALiBi), stored as T for the products that need them transposed
//    or as operands; then dV_j += (P Z)^T dO_i
//    and dK_j += dS^T Q_i into registers (each warp a band of 16 or 32 keys and a slice of the
//    head dim)
//    and, unless deterministic, dQ_i += dS K_j into a float32 accumulator with atomics. dK_j
//    (times the scale) and dV_j are written once at the end; with GQA they already sum over the
//    group, so no reduction follows.
// 3. dQ: either converted from the accumulator (times the scale), or, with deterministic=True, a
//    second pass parallel over query blocks recomputes S, dP and dS for each visible key block
//    and accumulates dQ_i in registers: no atomics, bitwise reproducible, at the cost of
//    recomputing two of the five products.
// 4. dBias of a bias broadcast over an axis with deterministic=True: fa2_dbias.cuh, after the
//    main kernel (which then adds none by atomics).
// The translation units are compiled with -ftz=true (src/cuda/CMakeLists.txt): exp2f is one
// MUFU.EX2.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "bwd_block.cuh"
#include "bwd_stats.cuh"
#include "check.hpp"
#include "fa2_bwd_traits.cuh"
#include "fa2_dbias.cuh"
#include "fa2_traits.cuh"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/block_range.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/sequence.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"
#include "fragment.cuh"
#include "score_mods.cuh"
#include "tile_io.cuh"
#include "zero_blocks.cuh"

namespace flashdl::cuda {
namespace fa2bwd {

// dq = scale * dQ accumulator, converted to T: a thread per 8 elements.
template <typename T>
__global__ void __launch_bounds__(256)
    convert_dq_kernel(const __grid_constant__ Params p, const float* ws_dq, const bool vec_store) {
  const int64_t chunks = p.headdim / 8;
  const int64_t idx = int64_t(blockIdx.x) * 256 + threadIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const detail::Sequence seq = detail::sequence_of(p, b);
  if (idx >= seq.sq * chunks) return;
  const int64_t i = idx / chunks, c = (idx % chunks) * 8;
  const float* src = ws_dq + ((b * p.nheads + h) * p.seqlen_q + i) * p.headdim + c;
  const float scale = float(p.scale_softmax);
  float v[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = src[e] * scale;
  store8(static_cast<T*>(p.dq_ptr) + b * p.dq_batch_stride + (seq.q0 + i) * p.dq_row_stride +
             h * p.dq_head_stride + c,
         v, vec_store);
}

// S, dP, then P and dS for the pair (query rows [i0, i0 + rows), keys [j0, j0 + Bc)); the whole
// block's loads are complete and visible. kInRegs: S and dP stay in registers
// (bwd::probs_and_ds_in_registers; map: the accumulator layout), else they go through shared
// memory as floats (more shared-memory traffic and a second barrier, fewer registers).
// bm_all: every block-mask block the pair touches is set; mod: the head's score modifiers.
// Leaves P, dS as T over sS, sdP (kLdP elements a row); ends with a barrier.
template <typename Tr, bool kInRegs>
__device__ __forceinline__ void pair_probs(const typename Tr::T* sQ, const typename Tr::T* sdO,
                                           const typename Tr::T* sK, const typename Tr::T* sV,
                                           float* sS, float* sdP, const FragMap& map,
                                           const float* sL2, const float* sD, int64_t i0, int rows,
                                           int64_t j0, const detail::Mask& mask,
                                           const detail::BlockMask& bm, bool bm_all,
                                           const detail::Dropout& drop, const ScoreModF& mod,
                                           const detail::HeadExtras& ex, const DBiasAcc& dbias) {
  using T = typename Tr::T;
  // With a bias or mask every pair is masked (keys past seqlen_k never read the bias).
  const bool all = bm_all && mask.block_fully_visible(i0, i0 + rows, j0, j0 + Tr::kBlockN) &&
                   !ex.any();
  if constexpr (kInRegs) {
    T* sP = reinterpret_cast<T*>(sS);
    T* sdS = reinterpret_cast<T*>(sdP);
    if (all)
      bwd::probs_and_ds_in_registers<T, Tr::kHeadDim, false, Tr::kFragsM, Tr::kFragsN, Tr::kNWarps,
                                     Tr::kSdPKeyFrags>(sQ, sdO, sK, sV, Tr::kLd, sP, sdS, Tr::kLdP,
                                                       map, sL2, sD, i0, j0, mask, bm, drop, mod,
                                                       ex, dbias);
    else
      bwd::probs_and_ds_in_registers<T, Tr::kHeadDim, true, Tr::kFragsM, Tr::kFragsN, Tr::kNWarps,
                                     Tr::kSdPKeyFrags>(sQ, sdO, sK, sV, Tr::kLd, sP, sdS, Tr::kLdP,
                                                       map, sL2, sD, i0, j0, mask, bm, drop, mod,
                                                       ex, dbias);
  } else {
    bwd::scores_and_dp<T, Tr::kHeadDim>(sQ, sdO, sK, sV, Tr::kLd, sS, sdP, Tr::kLdS, Tr::kFragsM,
                                        Tr::kFragsN, Tr::kNWarps);
    __syncthreads();
    if (all)
      bwd::probs_and_ds<T, false>(sS, sdP, Tr::kLdS, Tr::kBlockM, Tr::kBlockN, sL2, sD, i0, j0,
                                  mask, bm, drop, mod, ex, dbias, Tr::kNWarps);
    else
      bwd::probs_and_ds<T, true>(sS, sdP, Tr::kLdS, Tr::kBlockM, Tr::kBlockN, sL2, sD, i0, j0, mask,
                                 bm, drop, mod, ex, dbias, Tr::kNWarps);
  }
  __syncthreads();
}

// One dQ tile (16 query rows rf, 16 columns df of the head dim) of dS K_j, accumulated into acc.
template <typename Tr>
__device__ __forceinline__ void dq_tile(const typename Tr::T* sdS, const typename Tr::T* sK, int rf,
                                        int df, FragAcc& acc) {
  using T = typename Tr::T;
#pragma unroll
  for (int kf = 0; kf < Tr::kFragsN; ++kf) {
    FragA<T> a;
    FragB<T> b;
    load_frag(a, sdS + rf * kFrag * Tr::kLdP + kf * kFrag, Tr::kLdP);
    load_frag(b, sK + kf * kFrag * Tr::kLd + df * kFrag, Tr::kLd);
    wmma::mma_sync(acc, a, b, acc);
  }
}

// dQ_i += dS K_j for this warp's dQ tiles (tile t = (query fragment t / kFragsD, column fragment
// t % kFragsD), t = warp, warp + kNWarps, ...), added by atomics into the float32 accumulator at
// gdq (query row r of the block at gdq + r * kD), rows < `rows` only. Where every tile of a warp
// lies in one column fragment (kNWarps a multiple of kFragsD: head dims 32, 64, 128) the warp's
// products run side by side, each K fragment loaded once for all of them, and a block of kBlockM
// rows adds without a bounds test, at offsets known at compile time where the map is the
// m16n8k16 layout (mma_layout), two adjacent columns per atomic (atomic_add_pair). Before, one
// tile at a time, each product waited for and each atomic behind its own branch and address
// arithmetic: a quarter of the d 128 backward's stall samples on the H100 (source-level profile,
// 2026-11-27); after, the atomics' queue was 16% (single-float atomics, run 10).
template <typename Tr>
__device__ __forceinline__ void add_dq_tiles(const typename Tr::T* sdS, const typename Tr::T* sK,
                                             const FragMap& map, bool mma_layout, float* gdq,
                                             int rows, int warp) {
  using T = typename Tr::T;
  // A warp's tiles: kRows query fragments (rg, rg + kRowStep, ...) by kCols column fragments
  // (cg * kCols, ...): per key fragment kCols K and kRows dS fragment loads feed kRows x kCols
  // products (2 x 2: 4 loads for 4 products, against 5 for 4 with one column of 4).
  constexpr int kPer = Tr::kDqTilesPerWarp;
  constexpr int kCols = kPer % 2 == 0 && Tr::kFragsD % 2 == 0 ? 2 : 1, kRows = kPer / kCols;
  constexpr int kColGroups = Tr::kFragsD / kCols, kRowStep = Tr::kNWarps / kColGroups;
  if constexpr (Tr::kNWarps % kColGroups == 0 && Tr::kDqTiles % Tr::kNWarps == 0 &&
                kRowStep * kRows == Tr::kFragsM) {
    const int cg = warp % kColGroups, rg = warp / kColGroups;
    FragAcc acc[kRows][kCols];
#pragma unroll
    for (int i = 0; i < kRows; ++i)
#pragma unroll
      for (int j = 0; j < kCols; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
#pragma unroll
    for (int kf = 0; kf < Tr::kFragsN; ++kf) {
      FragB<T> b[kCols];
#pragma unroll
      for (int j = 0; j < kCols; ++j)
        load_frag(b[j], sK + kf * kFrag * Tr::kLd + (cg * kCols + j) * kFrag, Tr::kLd);
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        FragA<T> a;
        load_frag(a, sdS + (rg + i * kRowStep) * kFrag * Tr::kLdP + kf * kFrag, Tr::kLdP);
#pragma unroll
        for (int j = 0; j < kCols; ++j) wmma::mma_sync(acc[i][j], a, b[j], acc[i][j]);
      }
    }
    float* corner = gdq + cg * kCols * kFrag + rg * kFrag * Tr::kHeadDim;
    if (rows >= Tr::kBlockM && mma_layout) {  // offsets known at compile time, no bounds test
      const int lane = threadIdx.x % 32;
      float* base = corner + acc_row(lane, 0) * Tr::kHeadDim + acc_col(lane, 0);
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          float* tile = base + i * kRowStep * kFrag * Tr::kHeadDim + j * kFrag;
#pragma unroll
          for (int e = 0; e < FragAcc::num_elements; e += 2)  // (e, e + 1): columns c, c + 1
            atomic_add_pair(tile + (acc_row(lane, e) - acc_row(lane, 0)) * Tr::kHeadDim +
                                (acc_col(lane, e) - acc_col(lane, 0)),
                            acc[i][j].x[e], acc[i][j].x[e + 1]);
        }
    } else {
#pragma unroll
      for (int i = 0; i < kRows; ++i)
#pragma unroll
        for (int j = 0; j < kCols; ++j) {
          const int r0 = (rg + i * kRowStep) * kFrag;
          float* col = gdq + (cg * kCols + j) * kFrag;
#pragma unroll
          for (int e = 0; e < FragAcc::num_elements; ++e) {
            const int r = r0 + map.r[e];
            if (r < rows) atomicAdd(col + r * Tr::kHeadDim + map.c[e], acc[i][j].x[e]);
          }
        }
    }
  } else {
    for (int t = warp; t < Tr::kDqTiles; t += Tr::kNWarps) {
      const int rf = t / Tr::kFragsD, df = t % Tr::kFragsD;
      FragAcc acc;
      wmma::fill_fragment(acc, 0.0f);
      dq_tile<Tr>(sdS, sK, rf, df, acc);
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) {
        const int r = rf * kFrag + map.r[e];
        if (r < rows) atomicAdd(gdq + r * Tr::kHeadDim + df * kFrag + map.c[e], acc.x[e]);
      }
    }
  }
}

// K with every NaN and Inf replaced by 0, in place (each thread its share; the caller
// synchronises): the K of dQ += dS K in a masked pair whose K holds such a value. dS is exactly 0
// where a row cannot see a key (prob_and_ds's select), and 0 times the tensor cores' NaN would
// still be NaN; a row that sees such a key has a non-finite score there, hence a non-finite dS,
// and keeps a non-finite dQ (NaN, where the reference may give NaN or Inf; a score of -Inf gives
// P = dS = 0 and so a finite dQ, where the reference's 0 * Inf is NaN). No registers stay live
// across it, unlike a scalar product over the visible keys (ptxas, sm_80 float16 d 128: the
// deterministic dQ kernel 116 -> 230 registers with 32 x 64 tiles, 128 -> 255 and 252 bytes of
// spill stores with 64 x 64).
template <int kD, int kThreads, typename T>
__device__ __forceinline__ void zero_nonfinite(T* s, int ld, int tile_rows) {
  for (int idx = threadIdx.x; idx < tile_rows * kD; idx += kThreads) {
    T& x = s[(idx / kD) * ld + idx % kD];
    if (!(fabsf(to_float(x)) <= 3.40282347e38f)) x = from_float<T>(0.0f);  // NaN, +-Inf
  }
}

// One CTA per SM is what the shared memory allows for most head dims; the bound lets ptxas use
// the registers that leaves instead of spilling to fit two.
// kCall: what the call has, one instantiation each (bwd_call, on the host):
// - BwdCall::extras: a bias or a boolean mask (Options::bias, mask; detail::has_extras). Their code
//   in every call cost the plain kernel registers and time (ptxas sm_90 float16 d 128, 64 x 64
//   tiles: 218 -> 230 registers; H100, the main kernel of a d 128 / d 64 backward at seqlen 4096:
//   +8% / +16%, 2026-11-27);
// - BwdCall::features: a block mask, dropout or score modifiers, tested per pair at run time;
// - BwdCall::dense: none of them (the dense, causal and windowed backward): the dense block mask,
//   no dropout and unmodified scores are constants there, so none of their per-pair work (the
//   block-mask lookups, the masks' 64-bit divisions, the dropout and modifier tests) is compiled
//   in, and Q / dO come through the loader's unrolled whole-tile copies.
template <typename Tr, BwdCall kCall>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    backward_kernel(const __grid_constant__ Params p, const ScoreModF mods, const float* ws_l2,
                    const float* ws_d, float* ws_dq, float* dbias_acc, const bool vec_load) {
  constexpr bool kExtras = kCall == BwdCall::extras, kDense = kCall == BwdCall::dense;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  using T = typename Tr::T;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kLd = Tr::kLd;
  constexpr Fa2BwdLayout L = Tr::kMain;
  FLASHDL_DYNAMIC_SMEM(smem);
  T* sK = reinterpret_cast<T*>(smem + L.off_k);
  T* sV = reinterpret_cast<T*>(smem + L.off_v);
  float* sS = reinterpret_cast<float*>(smem + L.off_s);
  float* sdP = reinterpret_cast<float*>(smem + L.off_dp);
  auto q_stage = [&](std::size_t off, int stage) {
    return reinterpret_cast<T*>(smem + off + stage * L.q_stage_bytes);
  };
  auto stat_stage = [&](std::size_t off, int stage) {
    return reinterpret_cast<float*>(smem + off + stage * L.stat_stage_bytes);
  };
  const int warp = threadIdx.x / 32;

  const int64_t batch = blockIdx.z, kv_head = blockIdx.y, group = p.h_h_k_ratio;
  const int64_t n0 = int64_t(blockIdx.x) * kN;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  if (n0 >= seqlen_k) return;  // a varlen sequence shorter than the grid's max_seqlen_k
  const int kv_rows = int(seqlen_k - n0 < kN ? seqlen_k - n0 : kN);

  // The query blocks some key of this block is visible to, for each head of the group.
  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const detail::BlockRange qb = detail::query_blocks_for_keys(mask, n0, n0 + kv_rows, kM);
  const int64_t m_begin = qb.begin, nm = qb.size(), total = group * nm;

  // Pair `it` is (query head kv_head * group + it / nm, query block m_begin + it % nm); pairs that
  // only zero blocks of the head's block mask cover are skipped, never loaded or computed.
  auto block_mask = [&](int64_t h) {
    return kDense ? detail::BlockMask{} : detail::block_mask_of(p, batch, h);
  };
  struct PairAt {
    int64_t h, i0;  // the query head and the pair's first query row
  };
  auto pair_at = [&](int64_t it) {
    return PairAt{kv_head * group + it / nm, (m_begin + it % nm) * kM};
  };
  // The pair after `a` in the walk order (query blocks inner, heads outer) without the 64-bit
  // divisions of pair_at: the dense kernel visits every pair, one after another.
  auto pair_after = [&](PairAt a) {
    a.i0 += kM;
    if (a.i0 == (m_begin + nm) * kM) {
      a.i0 = m_begin * kM;
      ++a.h;
    }
    return a;
  };
  auto cover = [&](int64_t it) {
    const PairAt a = pair_at(it);
    const int64_t i1 = a.i0 + kM < seqlen_q ? a.i0 + kM : seqlen_q;
    return block_mask(a.h).cover(a.i0, i1, n0, n0 + kv_rows);
  };
  auto next_pair = [&](int64_t it) {
    while (it < total && !cover(it).any) ++it;
    return it;
  };

  auto load_q = [&](PairAt a, int stage) {
    const int64_t h = a.h, i0 = a.i0;
    const int rows = int(seqlen_q - i0 < kM ? seqlen_q - i0 : kM);
    const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride + h * p.q_head_stride +
                  (seq.q0 + i0) * p.q_row_stride;
    const T* gdO = static_cast<const T*>(p.do_ptr) + batch * p.do_batch_stride +
                   h * p.do_head_stride + (seq.q0 + i0) * p.do_row_stride;
    // Query rows the head's block mask hides from every key of this block: zero-filled.
    const detail::BlockMask bm = block_mask(h);
    auto keep = [&](int r) { return bm.row_any(i0 + r, n0, n0 + kv_rows); };
    if constexpr (kDense) {  // every row: the loader's unrolled copies
      load_tile_rows<kM, kD, Tr::kThreads>(q_stage(L.off_q, stage), kLd, gQ, p.q_row_stride, rows,
                                           vec_load);
      load_tile_rows<kM, kD, Tr::kThreads>(q_stage(L.off_do, stage), kLd, gdO, p.do_row_stride,
                                           rows, vec_load);
    } else {
      load_tile<kD, Tr::kThreads>(q_stage(L.off_q, stage), kLd, gQ, p.q_row_stride, kM, rows,
                                  vec_load, keep);
      load_tile<kD, Tr::kThreads>(q_stage(L.off_do, stage), kLd, gdO, p.do_row_stride, kM, rows,
                                  vec_load, keep);
    }
    const int64_t row0 = (batch * p.nheads + h) * p.seqlen_q;  // workspace rows: max_seqlen_q
    bwd::load_stats(stat_stage(L.off_l2, stage), stat_stage(L.off_d, stage), ws_l2 + row0,
                    ws_d + row0, i0, kM, seqlen_q, Tr::kThreads);
  };

  int64_t it = next_pair(0);
  if (it < total) {
    const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                  kv_head * p.k_head_stride + (seq.k0 + n0) * p.k_row_stride;
    const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                  kv_head * p.v_head_stride + (seq.k0 + n0) * p.v_row_stride;
    // Keys that only zero blocks cover for every head and query block visited: zero-filled.
    unsigned char* flags = reinterpret_cast<unsigned char*>(sS);
    const int64_t rows_end = (m_begin + nm) * kM < seqlen_q ? (m_begin + nm) * kM : seqlen_q;
    needed_key_rows(p, batch, kv_head * group, group, m_begin * kM, rows_end, n0, kv_rows, flags,
                    Tr::kThreads);
    auto keep = [&](int r) { return flags[r] != 0; };
    load_tile<kD, Tr::kThreads>(sK, kLd, gK, p.k_row_stride, kN, kv_rows, vec_load, keep);
    load_tile<kD, Tr::kThreads>(sV, kLd, gV, p.v_row_stride, kN, kv_rows, vec_load, keep);
    load_q(pair_at(it), 0);
  }
  __pipeline_commit();
  __syncthreads();  // the flags in S are read before the fragment map overwrites them

  fill_fragment_map(sS, sdP, Tr::kLdS, Tr::kThreads);
  T* codes_t = reinterpret_cast<T*>(sS + kFrag * Tr::kLdS);  // below the map's tiles
  fill_code_tile(codes_t, Tr::kThreads);
  __syncthreads();
  const FragMap learnt = accumulator_map(sS, sdP, Tr::kLdS);
  const bool mma_layout = map_is_mma_layout(learnt);
  // load_frag's bfloat16 loads (as float16) are those of wmma on every architecture they are
  // compiled for (SASS, sm_80 and sm_90): a failure here is a compiler change, not a fallback.
  // The dense kernel takes the layout as known (a lane's lse2 / D two loads per 16-row fragment
  // instead of one per element, its P / dS offsets constants): it holds on the same terms.
  if (!twin_loads_hold_backward<T>(codes_t) || (kDense && !mma_layout)) __trap();
  const FragMap map = kDense ? mma_frag_map() : learnt;
  __syncthreads();  // S and dP are overwritten below

  const int band = warp % Tr::kKeyBands, split = warp / Tr::kKeyBands;
  constexpr int kB = Tr::kBandFrags;
  FragAcc acc_dk[kB][Tr::kFragsDW], acc_dv[kB][Tr::kFragsDW];
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int f = 0; f < Tr::kFragsDW; ++f) {
      wmma::fill_fragment(acc_dk[b][f], 0.0f);
      wmma::fill_fragment(acc_dv[b][f], 0.0f);
    }

  // Two barriers per pair: this one (the pair's block visible to all; every warp done with the
  // previous pair's stage, P and dS) and pair_probs' (P and dS visible).
  bool first = true, k_nonfinite = false;
  PairAt at = it < total ? pair_at(it) : PairAt{0, 0};  // nm is 0 where no query sees a key
  for (int stage = 0; it < total; first = false) {
    const int64_t next = next_pair(it + 1);
    const PairAt at_next = kDense ? pair_after(at) : pair_at(next);
    if constexpr (Tr::kStages == 2) {
      __pipeline_wait_prior(0);  // this pair's block has landed: the only copy in flight
      __syncthreads();
    } else {
      if (!first) {
        __syncthreads();  // every warp done with the previous pair's block
        load_q(at, 0);
      }
      __pipeline_commit();
      __pipeline_wait_prior(0);
      __syncthreads();
    }

    // Whether K holds a NaN or Inf: masked pairs then zero them for dQ. Once, when K has
    // landed (the first pair): one more barrier per CTA (first is the same in every thread).
    if (first) k_nonfinite = __syncthreads_or(tile_has_nonfinite<kD, Tr::kThreads>(sK, kLd, kN));
    const int64_t h = at.h, i0 = at.i0;
    const int rows = int(seqlen_q - i0 < kM ? seqlen_q - i0 : kM);
    const T* sQ = q_stage(L.off_q, stage);
    const T* sdO = q_stage(L.off_do, stage);
    ScoreModF mod = mods;  // dense: the call's scale, no cap, no slope (constants)
    if constexpr (kDense) {
      mod.cap = 0.0f;
      mod.slope = 0.0f;
    } else {
      mod = head_score_mods(mods, p, batch, h);
    }
    pair_probs<Tr, true>(sQ, sdO, sK, sV, sS, sdP, map, stat_stage(L.off_l2, stage),
                         stat_stage(L.off_d, stage), i0, rows, n0, mask, block_mask(h),
                         cover(it).all,
                         kDense ? detail::Dropout{} : detail::dropout_of(p, batch, h), mod,
                         kExtras ? head_extras(p, batch, h, seq.q0) : detail::HeadExtras{},
                         kExtras ? head_dbias(p, dbias_acc, batch, h, seq.q0) : DBiasAcc{});
    // The next pair's prefetch into the previous pair's stage, which every warp finished with
    // before this pair's first barrier: issued here, after this pair's S/dP products and P/dS,
    // rather than between that barrier and the first products (SASS model: -4% at d 128).
    if constexpr (Tr::kStages == 2) {
      if (next < total) load_q(at_next, stage ^ 1);
      __pipeline_commit();
    }
    const T* sP = reinterpret_cast<const T*>(sS);
    const T* sdS = reinterpret_cast<const T*>(sdP);

    // dV_j += P^T dO_i and dK_j += dS^T Q_i: this warp's kB * 16 keys x kFragsDW * 16 columns.
    // Not unrolled over kf: hoisting every fragment load made ptxas spill (bfloat16, d = 128).
#pragma unroll 1
    for (int kf = 0; kf < Tr::kFragsM; ++kf) {
      FragAt<T> a_p[kB], a_ds[kB];
#pragma unroll
      for (int b = 0; b < kB; ++b) {
        load_frag(a_p[b], sP + kf * kFrag * Tr::kLdP + (band * kB + b) * kFrag, Tr::kLdP);
        load_frag(a_ds[b], sdS + kf * kFrag * Tr::kLdP + (band * kB + b) * kFrag, Tr::kLdP);
      }
#pragma unroll
      for (int f = 0; f < Tr::kFragsDW; ++f) {
        const int col = (split * Tr::kFragsDW + f) * kFrag;
        FragB<T> b_do, b_q;
        load_frag(b_do, sdO + kf * kFrag * kLd + col, kLd);
        load_frag(b_q, sQ + kf * kFrag * kLd + col, kLd);
#pragma unroll
        for (int b = 0; b < kB; ++b) {
          wmma::mma_sync(acc_dv[b][f], a_p[b], b_do, acc_dv[b][f]);
          wmma::mma_sync(acc_dk[b][f], a_ds[b], b_q, acc_dk[b][f]);
        }
      }
    }

    // dQ_i += dS K_j into the float32 accumulator (the deterministic mode has a pass of its own).
    if (ws_dq != nullptr) {
      // A masked pair with a NaN or Inf in K: dQ from K with those zeroed, then K reloaded for
      // the next pairs' scores (keys the flags zero-filled come back as they are: every pair with
      // them is masked, and so takes this path too).
      const bool slow_dq = k_nonfinite && !(cover(it).all &&
                                            mask.block_fully_visible(i0, i0 + rows, n0, n0 + kN) &&
                                            !(kExtras && detail::has_extras(p)));
      if (slow_dq) {
        __syncthreads();  // every warp done with K's scores
        zero_nonfinite<kD, Tr::kThreads>(sK, kLd, kN);
        __syncthreads();
      }
      add_dq_tiles<Tr>(sdS, sK, map, mma_layout,
                       ws_dq + ((batch * p.nheads + h) * p.seqlen_q + i0) * kD, rows, warp);
      if (slow_dq) {
        __syncthreads();  // every warp done with the zeroed K
        load_tile<kD, Tr::kThreads>(sK, kLd,
                                    static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                                        kv_head * p.k_head_stride + (seq.k0 + n0) * p.k_row_stride,
                                    p.k_row_stride, kN, kv_rows, false);
        __syncthreads();  // K whole again for the next pairs' scores
      }
    }
    it = next;
    at = at_next;
    if constexpr (Tr::kStages == 2) stage ^= 1;
  }
  __pipeline_wait_prior(0);  // no copy may still be in flight when the CTA retires

  // dK_j = scale * dS^T Q summed, dV_j: straight from the registers, keys past seqlen_k dropped.
  const float scale = float(p.scale_softmax);
  T* gdK = static_cast<T*>(p.dk_ptr) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
           seq.k0 * p.dk_row_stride;
  T* gdV = static_cast<T*>(p.dv_ptr) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
           seq.k0 * p.dv_row_stride;
#pragma unroll
  for (int b = 0; b < kB; ++b)
#pragma unroll
    for (int f = 0; f < Tr::kFragsDW; ++f) {
      const int col = (split * Tr::kFragsDW + f) * kFrag;
#pragma unroll
      for (int e = 0; e < FragAcc::num_elements; ++e) {
        const int64_t key = n0 + (band * kB + b) * kFrag + map.r[e];
        if (key >= seqlen_k) continue;
        gdK[key * p.dk_row_stride + col + map.c[e]] = from_float<T>(acc_dk[b][f].x[e] * scale);
        gdV[key * p.dv_row_stride + col + map.c[e]] = from_float<T>(acc_dv[b][f].x[e]);
      }
    }
#endif
}

// deterministic=True: dQ_i = scale * sum_j dS_ij K_j for one query block, in registers, key
// blocks in order. K_j and V_j are loaded one block at a time (no double buffer). kExtras: as
// backward_kernel's.
template <typename Tr, bool kExtras>
__global__ void __launch_bounds__(Tr::kThreads, 1)
    dq_kernel(const __grid_constant__ Params p, const ScoreModF mods, const float* ws_l2,
              const float* ws_d, const bool vec_load) {
  static_assert(!Tr::kPOnly, "the dQ pass keeps float S and dP");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using T = typename Tr::T;
  constexpr int kM = Tr::kBlockM, kN = Tr::kBlockN, kD = Tr::kHeadDim, kLd = Tr::kLd;
  constexpr Fa2BwdLayout L = Tr::kDqPass;
  FLASHDL_DYNAMIC_SMEM(smem);
  T* sK = reinterpret_cast<T*>(smem + L.off_k);
  T* sV = reinterpret_cast<T*>(smem + L.off_v);
  T* sQ = reinterpret_cast<T*>(smem + L.off_q);
  T* sdO = reinterpret_cast<T*>(smem + L.off_do);
  float* sS = reinterpret_cast<float*>(smem + L.off_s);
  float* sdP = reinterpret_cast<float*>(smem + L.off_dp);
  float* sL2 = reinterpret_cast<float*>(smem + L.off_l2);
  float* sD = reinterpret_cast<float*>(smem + L.off_d);
  const int warp = threadIdx.x / 32;

  const int64_t batch = blockIdx.z, h = blockIdx.y, kv_head = h / p.h_h_k_ratio;
  const int64_t m0 = int64_t(blockIdx.x) * kM;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  if (m0 >= seqlen_q) return;  // a varlen sequence shorter than the grid's max_seqlen_q
  const int rows = int(seqlen_q - m0 < kM ? seqlen_q - m0 : kM);
  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const detail::BlockRange kb = detail::key_blocks_for_queries(mask, m0, m0 + rows, kN);
  const detail::Dropout drop = detail::dropout_of(p, batch, h);
  const detail::BlockMask bm = detail::block_mask_of(p, batch, h);
  const ScoreModF mod = head_score_mods(mods, p, batch, h);  // varlen: the sequence's
  auto cover = [&](int64_t n) {
    const int64_t n0 = n * kN;
    return bm.cover(m0, m0 + rows, n0, n0 + kN < seqlen_k ? n0 + kN : seqlen_k);
  };
  const int64_t n_begin = kb.begin, n_end = kb.end;

  const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                kv_head * p.k_head_stride + seq.k0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                kv_head * p.v_head_stride + seq.k0 * p.v_row_stride;
  if (n_begin < n_end) {
    load_tile<kD, Tr::kThreads>(sQ, kLd,
                                static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride +
                                    h * p.q_head_stride + (seq.q0 + m0) * p.q_row_stride,
                                p.q_row_stride, kM, rows, vec_load);
    load_tile<kD, Tr::kThreads>(sdO, kLd,
                                static_cast<const T*>(p.do_ptr) + batch * p.do_batch_stride +
                                    h * p.do_head_stride + (seq.q0 + m0) * p.do_row_stride,
                                p.do_row_stride, kM, rows, vec_load);
    const int64_t row0 = (batch * p.nheads + h) * p.seqlen_q;
    bwd::load_stats(sL2, sD, ws_l2 + row0, ws_d + row0, m0, kM, seqlen_q, Tr::kThreads);
  }
  fill_fragment_map(sS, sdP, Tr::kLdS, Tr::kThreads);
  T* codes_t = reinterpret_cast<T*>(sS + kFrag * Tr::kLdS);  // below the map's tiles
  fill_code_tile(codes_t, Tr::kThreads);
  __syncthreads();
  const FragMap map = accumulator_map(sS, sdP, Tr::kLdS);
  if (!twin_loads_hold_backward<T>(codes_t)) __trap();  // as in backward_kernel
  __syncthreads();

  FragAcc acc[Tr::kDqTilesPerWarp];
#pragma unroll
  for (int u = 0; u < Tr::kDqTilesPerWarp; ++u) wmma::fill_fragment(acc[u], 0.0f);

  for (int64_t n = n_begin; n < n_end; ++n) {
    const detail::BlockMask::Cover c = cover(n);
    if (!c.any) continue;  // a zero block of the block mask: never loaded
    const int64_t n0 = n * kN;
    const int kv_rows = int(seqlen_k - n0 < kN ? seqlen_k - n0 : kN);
    // Keys no row of this query block may see through the block mask: zero-filled, never read.
    auto keep = [&](int r) { return bm.col_any(n0 + r, m0, m0 + rows); };
    load_tile<kD, Tr::kThreads>(sK, kLd, gK + n0 * p.k_row_stride, p.k_row_stride, kN, kv_rows,
                                vec_load, keep);
    load_tile<kD, Tr::kThreads>(sV, kLd, gV + n0 * p.v_row_stride, p.v_row_stride, kN, kv_rows,
                                vec_load, keep);
    __pipeline_commit();
    __pipeline_wait_prior(0);
    __syncthreads();
    // S and dP through shared memory here: in registers they cost this kernel up to twice the
    // registers (ptxas, sm_90, float16: d 128 116 -> 203, d 256 125 -> 251), one CTA per SM
    // where the shared memory allows two, and this pass does not overlap its K/V loads with
    // compute: the second CTA does.
    pair_probs<Tr, false>(sQ, sdO, sK, sV, sS, sdP, map, sL2, sD, m0, rows, n0, mask, bm, c.all,
                          drop, mod,
                          kExtras ? head_extras(p, batch, h, seq.q0) : detail::HeadExtras{},
                          DBiasAcc{});
    // A masked block whose K holds a NaN or Inf: dS K from K with those zeroed (zero_nonfinite);
    // the vote is one more barrier, in masked blocks only (masked is the same in every thread).
    const bool masked = !(c.all && mask.block_fully_visible(m0, m0 + rows, n0, n0 + kN)) ||
                        (kExtras && detail::has_extras(p));
    if (masked && __syncthreads_or(tile_has_nonfinite<kD, Tr::kThreads>(sK, kLd, kN))) {
      zero_nonfinite<kD, Tr::kThreads>(sK, kLd, kN);  // K's last use: dS K below
      __syncthreads();
    }
    const T* sdS = reinterpret_cast<const T*>(sdP);
#pragma unroll
    for (int u = 0; u < Tr::kDqTilesPerWarp; ++u) {
      const int t = warp + u * Tr::kNWarps;
      if (t < Tr::kDqTiles) dq_tile<Tr>(sdS, sK, t / Tr::kFragsD, t % Tr::kFragsD, acc[u]);
    }
    __syncthreads();  // K, V, S and dP are overwritten by the next block
  }
  __pipeline_wait_prior(0);

  const float scale = float(p.scale_softmax);
  T* gdQ = static_cast<T*>(p.dq_ptr) + batch * p.dq_batch_stride + h * p.dq_head_stride +
           seq.q0 * p.dq_row_stride;
#pragma unroll
  for (int u = 0; u < Tr::kDqTilesPerWarp; ++u) {
    const int t = warp + u * Tr::kNWarps;
    if (t >= Tr::kDqTiles) continue;
    const int rf = t / Tr::kFragsD, df = t % Tr::kFragsD;
#pragma unroll
    for (int e = 0; e < FragAcc::num_elements; ++e) {
      const int r = rf * kFrag + map.r[e];
      if (r < rows)
        gdQ[(m0 + r) * p.dq_row_stride + df * kFrag + map.c[e]] = from_float<T>(acc[u].x[e] *
                                                                                scale);
    }
  }
#endif
}

}  // namespace fa2bwd

// The main kernel's instantiation for a call (backward_kernel's kCall).
inline BwdCall bwd_call(const Params& p) {
  if (detail::has_extras(p)) return BwdCall::extras;
  if (p.p_dropout > 0.0f || p.block_mask_ptr != nullptr || detail::has_score_mod(p))
    return BwdCall::features;
  return BwdCall::dense;
}

// The main kernel of one instantiation, a CTA per (key block, kv head, batch).
template <typename Tr, BwdCall kCall>
void launch_bwd_main(const Params& p, const LaunchContext& ctx, const ScoreModF& mods,
                     const float* l2, const float* d, float* dq, float* dbias_acc) {
  const auto n_blocks = static_cast<unsigned>(detail::ceil_div(p.seqlen_k, Tr::kBlockN));
  const auto kernel = fa2bwd::backward_kernel<Tr, kCall>;
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(Tr::kMain.bytes)));
  FLASHDL_LAUNCH(dim3(n_blocks, static_cast<unsigned>(p.nheads_kv), static_cast<unsigned>(p.batch)),
                 Tr::kThreads, Tr::kMain.bytes, ctx.stream,
                 kernel)(p, mods, l2, d, dq, dbias_acc, ctx.vec_load);
  FLASHDL_CUDA_CHECK_LAUNCH("fa2 backward kernel launch");
}

// Launches for one tile variant: preprocess, the main kernel, then the dQ conversion or the
// deterministic dQ pass, all on the caller's stream with one stream-ordered workspace. Tr: the
// tiles of every kernel but the dense call's main kernel, which has TrDense's where the device
// has their shared memory (else Tr's, through the features instantiation: the dense one is
// compiled for TrDense only).
template <typename Tr, typename TrDense>
void launch_fa2_bwd(const Params& p, const LaunchContext& ctx) {
  static_assert(TrDense::kBlockN >= Tr::kBlockN, "the grid checks below hold for both");
  const int64_t n_blocks = detail::ceil_div(p.seqlen_k, Tr::kBlockN);
  const int64_t m_blocks = detail::ceil_div(p.seqlen_q, Tr::kBlockM);
  const int64_t pre_blocks = detail::ceil_div(p.seqlen_q, fa2bwd::kPreRows);
  const int64_t cvt_blocks = detail::ceil_div(p.seqlen_q * (Tr::kHeadDim / 8), 256);
  if (p.nheads > ctx.max_grid_y || p.batch > ctx.max_grid_z || n_blocks > INT32_MAX ||
      pre_blocks > INT32_MAX || cvt_blocks > INT32_MAX)
    throw Error(ErrorKind::unsupported,
                "q: too large for one fa2 backward launch: nheads " + std::to_string(p.nheads) +
                    " (max " + std::to_string(ctx.max_grid_y) + "), batch " +
                    std::to_string(p.batch) + " (max " + std::to_string(ctx.max_grid_z) +
                    "), seqlen_q " + std::to_string(p.seqlen_q));
  const Fa2BwdWorkspace w = fa2_bwd_workspace(p.batch, p.nheads, p.seqlen_q, Tr::kHeadDim,
                                              p.deterministic);
  StreamWorkspace ws(static_cast<std::size_t>(w.floats() > 0 ? w.floats() : 1) * sizeof(float),
                     ctx.stream);
  float* l2 = ws.get<float>();
  float* d = l2 + w.stats;
  // dq at an even float offset (2 * stats) from the allocation: 8-byte aligned, as the main
  // kernel's paired atomics (atomic_add_pair) need.
  float* dq = w.dq > 0 ? d + w.stats : nullptr;
  if (dq != nullptr)
    FLASHDL_CUDA_CHECK(
        cudaMemsetAsync(dq, 0, static_cast<std::size_t>(w.dq) * sizeof(float), ctx.stream));
  const auto y = static_cast<unsigned>(p.nheads), z = static_cast<unsigned>(p.batch);
  const ScoreModF mods = call_score_mods(p);
  const bool extras = detail::has_extras(p);
  // deterministic=True with a broadcast dBias: the main kernel adds none, fa2dbias sums it.
  const bool dbias_tiles = fa2dbias::wanted(p, ctx.dbias_acc);
  float* const dbias_acc = dbias_tiles ? nullptr : ctx.dbias_acc;
  if (p.seqlen_q > 0) {
    FLASHDL_LAUNCH(dim3(static_cast<unsigned>(pre_blocks), y, z), fa2bwd::kPreRows * 32, 0,
                   ctx.stream, fa2bwd::preprocess_kernel<typename Tr::T>)(p, l2, d);
    FLASHDL_CUDA_CHECK_LAUNCH("fa2 backward preprocess kernel launch");
  }
  if (p.seqlen_k > 0) {
    const BwdCall call = bwd_call(p);
    if (call == BwdCall::extras) {
      launch_bwd_main<Tr, BwdCall::extras>(p, ctx, mods, l2, d, dq, dbias_acc);
    } else if (call == BwdCall::features) {
      launch_bwd_main<Tr, BwdCall::features>(p, ctx, mods, l2, d, dq, dbias_acc);
    } else if constexpr (std::is_same_v<Tr, TrDense>) {
      launch_bwd_main<Tr, BwdCall::dense>(p, ctx, mods, l2, d, dq, dbias_acc);
    } else if (TrDense::kMain.bytes <= static_cast<std::size_t>(ctx.smem_optin)) {
      launch_bwd_main<TrDense, BwdCall::dense>(p, ctx, mods, l2, d, dq, dbias_acc);
    } else {
      launch_bwd_main<Tr, BwdCall::features>(p, ctx, mods, l2, d, dq, dbias_acc);
    }
  }
  if (p.seqlen_q > 0 && p.deterministic) {
    const auto kernel = extras ? fa2bwd::dq_kernel<Tr, true> : fa2bwd::dq_kernel<Tr, false>;
    FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(Tr::kDqPass.bytes)));
    FLASHDL_LAUNCH(dim3(static_cast<unsigned>(m_blocks), y, z), Tr::kThreads, Tr::kDqPass.bytes,
                   ctx.stream, kernel)(p, mods, l2, d, ctx.vec_load);
    FLASHDL_CUDA_CHECK_LAUNCH("fa2 backward dQ kernel launch");
  } else if (p.seqlen_q > 0) {
    FLASHDL_LAUNCH(dim3(static_cast<unsigned>(cvt_blocks), y, z), 256, 0, ctx.stream,
                   fa2bwd::convert_dq_kernel<typename Tr::T>)(p, dq, ctx.vec_store);
    FLASHDL_CUDA_CHECK_LAUNCH("fa2 backward dQ conversion launch");
  }
  if (dbias_tiles) fa2dbias::launch<typename Tr::T, Tr::kHeadDim>(p, mods, l2, d, ctx);
  ws.release();
}

// The standard tiles where the device has the shared memory, else the 99 KiB fallback (compiled
// only for the head dims whose standard tiles exceed the smallest sm_80+ opt-in, as the forward
// does), else a clear error. bwd_plan.hpp sizes both.
template <typename T, int kHeadDim>
void launch_fa2_backward(const Params& p, const LaunchContext& ctx) {
  constexpr bool kHasFallback = fa2_bwd_smem_bytes(kHeadDim, fa2_bwd_config(kHeadDim)) >
                                kFa2SmallestOptin;
  const Fa2BwdVariant v = pick_fa2_bwd(kHeadDim, ctx.smem_optin);
  if (v == Fa2BwdVariant::standard)
    return launch_fa2_bwd<Fa2BwdStandard<T, kHeadDim>, Fa2BwdDense<T, kHeadDim>>(p, ctx);
  if constexpr (kHasFallback) {
    if (v == Fa2BwdVariant::fallback)
      return launch_fa2_bwd<Fa2BwdFallback<T, kHeadDim>, Fa2BwdFallback<T, kHeadDim>>(p, ctx);
  }
  const Fa2BwdConfig needed = kHasFallback ? fa2_bwd_fallback(kHeadDim) : fa2_bwd_config(kHeadDim);
  throw Error(ErrorKind::unsupported,
              "q: the fa2 backward kernel for headdim " + std::to_string(kHeadDim) + " needs " +
                  std::to_string(fa2_bwd_smem_bytes(kHeadDim, needed)) +
                  " bytes of shared memory per block; device " + std::to_string(ctx.device) +
                  " offers " + std::to_string(ctx.smem_optin) +
                  " (schedule='fa1' sizes its tiles to the device)");
}

}  // namespace flashdl::cuda
