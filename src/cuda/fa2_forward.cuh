// The FlashAttention-2 forward on tensor cores.
//
// Grid: (Q block, head, batch). A CTA of 4 warps owns kBlockM query rows, kWarpRows = 16 or 32 per
// warp (the tile table of fa2_plan.hpp: 128 rows where the registers allow); every warp sees every
// key (no split of K/V between warps). K/V blocks stream through a double buffer in shared memory
// with cp.async, one block barrier per block; per block, each warp computes its kWarpRows x
// kBlockN scores on tensor cores (each K fragment feeding every 16-row band), masks them, runs the
// online softmax per row (exp2 domain, the scale folded into the FMA before exp2) on the score
// accumulators in registers, rescales its output accumulators and adds P V with P converted from
// the scores to A operands in registers (each V fragment feeding every band). Where the fragment
// layout is not the one the register path knows, and for block masks, dropout and score modifiers
// (softcap, ALiBi), the same body runs the softmax through shared memory instead. The division by
// l happens once at the end, which also writes lse (natural log, of the modified scores) for the
// backward pass. The translation units are compiled with -ftz=true (src/cuda/CMakeLists.txt).
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "check.hpp"
#include "fa2_traits.cuh"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/block_range.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/sequence.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"
#include "fragment.cuh"
#include "score_mods.cuh"
#include "tile_io.cuh"

namespace flashdl::cuda {
namespace fa2 {

// S = Q K^T for this warp's 16 rows: sQw (16 x d), sK (kBlockN x d) -> sS (16 x kBlockN, float).
template <typename Tr>
__device__ __forceinline__ void compute_scores(const typename Tr::T* sQw, const typename Tr::T* sK,
                                               float* sS) {
  using T = typename Tr::T;
  FragAcc acc[Tr::kFragsN];
#pragma unroll
  for (int nf = 0; nf < Tr::kFragsN; ++nf) wmma::fill_fragment(acc[nf], 0.0f);
#pragma unroll
  for (int kf = 0; kf < Tr::kFragsD; ++kf) {
    FragA<T> a;
    wmma::load_matrix_sync(a, sQw + kf * kFrag, Tr::kLdQKV);
#pragma unroll
    for (int nf = 0; nf < Tr::kFragsN; ++nf) {
      FragBt<T> b;
      wmma::load_matrix_sync(b, sK + nf * kFrag * Tr::kLdQKV + kf * kFrag, Tr::kLdQKV);
      wmma::mma_sync(acc[nf], a, b, acc[nf]);
    }
  }
#pragma unroll
  for (int nf = 0; nf < Tr::kFragsN; ++nf)
    wmma::store_matrix_sync(sS + nf * kFrag, acc[nf], Tr::kLdS, wmma::mem_row_major);
}

// The score modifiers over this lane's scores of the block at keys [n0, n0 + kBlockN) (the
// elements softmax_step reads: row lane / 2, alternate columns), in place: each raw q.k becomes
// its exp2-domain score, so softmax_step then runs with a scale of 1. diag: Mask::diag of the
// row. Before softmax_step's block-mask pass, whose -inf a cap would turn finite. A loop of its
// own, not unrolled, like the block mask's and dropout's (inlined into the unrolled score loop,
// 32 precise tanhf per lane would only add registers).
template <typename Tr>
__device__ __forceinline__ void apply_score_mods(float* sS, const ScoreModF& mod, int64_t diag,
                                                 int64_t n0) {
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
#pragma unroll 1
  for (int k = 0; k < Tr::kColsPerLane; ++k) {
    const int c = 2 * k + half;
    float& s = sS[r * Tr::kLdS + c];
    s = modified_score(mod, s, diag, n0 + c);
  }
}

// The forward's form of the pass, with the bias and mask of (batch, head) as well, read from the
// kernel parameters here (the decode kernel, which has neither, keeps the one above). Not inlined:
// inlined, with the views held by the caller, it cost the kMods kernel spills (ptxas, sm_90
// float16 d 128: 160 bytes of spill stores; this form 28, against 8 before bias and mask).
// With a bias or a mask (ex.any(); the row clamped into the
// sequence, keys past seqlen_k left alone: the softmax masks them) the bias is added and hidden
// keys become -inf (extras_score), here, before the softmax's max: a NaN or Inf score of a key
// the mask hides never reaches it. Without a modifier the raw q.k is multiplied by `pre`:
// scale * log2(e) with a bias (the softmax then scales by 1), 1 for a mask alone (the softmax
// scales it as without the mask).
// The pass's loop for the row this lane pair owns (row_in of ex's), keys n0 + c read at column
// n0 + c + col0 of the bias and mask (the decode kernel's col0: cache_leftpad[b]).
template <typename Tr>
__device__ __forceinline__ void score_pass(float* sS, const ScoreModF& mod, bool modded,
                                           const detail::HeadExtras& ex, float pre, int64_t diag,
                                           int64_t row_in, int64_t n0, int64_t seqlen_k,
                                           int64_t col0) {
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
#pragma unroll 1
  for (int k = 0; k < Tr::kColsPerLane; ++k) {
    const int c = 2 * k + half;
    float& s = sS[r * Tr::kLdS + c];
    float t = modded ? modified_score(mod, s, diag, n0 + c) : s * pre;
    if (ex.any() && n0 + c < seqlen_k) t = extras_score(ex, t, row_in, n0 + c + col0);
    s = t;
  }
}

template <typename Tr>
__device__ __noinline__ void apply_score_mods(float* sS, const ScoreModF& mod, bool modded,
                                              const Params& p, int64_t batch, int64_t head,
                                              int64_t q0, float pre, int64_t diag, int64_t row_in,
                                              int64_t n0, int64_t seqlen_k) {
  score_pass<Tr>(sS, mod, modded, head_extras(p, batch, head, q0), pre, diag, row_in, n0, seqlen_k,
                 0);
}

// One online-softmax step in shared memory for the row this lane pair owns (lanes 2r and 2r+1
// share row r, taking alternate columns): the fa2 forward's fallback path (fragment layouts other
// than acc_row / acc_col, block masks, dropout, score modifiers) and the decode kernel's step.
// Masks keys outside [col_lo, col_hi) and in zero blocks of the block mask (row_in: the row,
// clamped into the sequence) when kMasked, updates {m, l} (the max over the scores times
// scale_log2) and writes P = exp2(fma(s, scale_log2, -m)) as T over the scores in place, with the
// elements dropout drops set to 0 (l sums the undropped values; the kept ones' 1 / (1 - p) is
// applied with 1 / l in the epilogue, so P is rounded once, as without dropout). Returns the
// factor by which the row's output accumulator must be rescaled. The block mask and dropout run
// in loops of their own, not unrolled: inlined into the unrolled score loop they made ptxas spill.
// Rows r and r + 8 start in the same bank (the row stride is 4 mod 32 words, or 20 for 16-key
// blocks): rows 8 to 15 visit their column pairs rotated by one (smem_softmax_col), so the 32
// loads of a step, and its P stores, hit 32 different banks.
template <typename Tr, bool kMasked>
__device__ __forceinline__ float softmax_step(float* sS, detail::OnlineSoftmax<float>& sm,
                                              float scale_log2, int64_t n0, int64_t col_lo,
                                              int64_t col_hi, const detail::BlockMask& bm,
                                              int64_t row_in, const detail::Dropout& drop,
                                              int64_t row) {
  using T = typename Tr::T;
  constexpr int K = Tr::kColsPerLane;
  static_assert(K <= 32 && (K & (K - 1)) == 0, "a power of two, one visibility bit per column");
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
  if (kMasked && !bm.dense()) {  // zero blocks: -inf before the row max (each lane its own scores)
#pragma unroll 1
    for (int k = 0; k < K; ++k) {
      const int c = 2 * k + half;
      if (n0 + c < col_hi && !bm.visible(row_in, n0 + c)) sS[r * Tr::kLdS + c] = -INFINITY;
    }
  }
  float x[K];
  unsigned visible = 0u;
  float block_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = smem_softmax_col(lane, k, K);
    x[k] = sS[r * Tr::kLdS + c];
    const bool in = !kMasked || (n0 + c >= col_lo && n0 + c < col_hi);
    if (kMasked) visible |= unsigned(in) << k;
    if (in) block_max = fmaxf(block_max, x[k] * scale_log2);
  }
  block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1));
  const float alpha = sm.rescale_factor(block_max);
  const float neg_ref = -sm.reference();  // 0 while the row has seen no key
  __syncwarp();                           // every score is in registers: P may overwrite them
  T* sP = reinterpret_cast<T*>(sS);
  float block_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = smem_softmax_col(lane, k, K);
    const bool in = !kMasked || ((visible >> k) & 1u);
    const float pk = in ? exp2f(fmaf(x[k], scale_log2, neg_ref)) : 0.0f;
    block_sum += pk;
    sP[r * Tr::kLdP + c] = from_float<T>(pk);
  }
  if (drop.on()) {  // this lane's own elements of P: no barrier needed
#pragma unroll 1
    for (int k = 0; k < K; ++k)
      if (!drop.keep(row, n0 + 2 * k + half)) sP[r * Tr::kLdP + 2 * k + half] = from_float<T>(0.0f);
  }
  block_sum += __shfl_xor_sync(kFullMask, block_sum, 1);
  sm.accumulate(alpha, block_sum);
  __syncwarp();  // P complete before the tensor cores read it
  return alpha;
}

// Scores outside [lo, hi) of their row (relative to the block) become -inf, so that the unmasked
// softmax_regs gives what the masked one does, bit for bit: -inf leaves the max alone (a row with
// no key left in the block keeps its max and alpha 1), and exp2f(fmaf(-inf, scale_log2 > 0,
// finite)) is 0.
template <typename Tr>
__device__ __forceinline__ void hide_scores(FragAcc (&s)[Tr::kRowFrags][Tr::kFragsN],
                                            const int (&lo)[Tr::kRowFrags][2],
                                            const int (&hi)[Tr::kRowFrags][2]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int rf = 0; rf < Tr::kRowFrags; ++rf)
#pragma unroll
    for (int nf = 0; nf < Tr::kFragsN; ++nf)
#pragma unroll
      for (int i = 0; i < FragAcc::num_elements; ++i) {
        const int h = (i / 2) % 2, c = nf * kFrag + acc_col(lane, i);
        if (c < lo[rf][h] || c >= hi[rf][h]) s[rf][nf].x[i] = -INFINITY;
      }
}

// The online-softmax step of the warp's kRowFrags x 16 rows on the score accumulators themselves
// (the acc_row / acc_col layout, checked at kernel start): lane l holds, of each 16-row band, rows
// l / 4 and l / 4 + 8 (elements with (i / 2) % 2 = 0, 1), 4 of their columns per fragment; the 4
// lanes of a quad hold a row between them, so its max takes two shuffles; its sum l stays split
// over them (each lane's share) until quad_row_sums. The scores become P = exp2(fma(s,
// scale_log2, -m)) in place (0 for masked keys), and the output accumulators acc_o are rescaled
// by each row's factor. kMasked: keys outside [lo, hi) of a row, relative to the block, are
// masked. scale_log2 > 0.
template <typename Tr, bool kMasked>
__device__ __forceinline__ void softmax_regs(FragAcc (&s)[Tr::kRowFrags][Tr::kFragsN],
                                             detail::OnlineSoftmax<float> (&sm)[Tr::kRowFrags][2],
                                             float scale_log2, const int (&lo)[Tr::kRowFrags][2],
                                             const int (&hi)[Tr::kRowFrags][2],
                                             FragAcc (&acc_o)[Tr::kRowFrags][Tr::kFragsD]) {
  const int lane = threadIdx.x % 32;
  float alpha[Tr::kRowFrags][2];
  bool moved = false;
  auto row_max = [&](int rf, int h) {
    // The max of the raw scores, then scaled: with scale_log2 > 0 (the callers' condition)
    // rounding is monotone, so this is the max of the scaled scores bit for bit, without a
    // multiply before each compare.
    float block_max = -INFINITY;
#pragma unroll
    for (int nf = 0; nf < Tr::kFragsN; ++nf)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = (j / 2) * 4 + h * 2 + j % 2;  // the elements of row half h
        const int c = nf * kFrag + acc_col(lane, i);
        if (!kMasked || (c >= lo[rf][h] && c < hi[rf][h]))
          block_max = fmaxf(block_max, s[rf][nf].x[i]);
      }
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1));
    block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 2)) * scale_log2;
    alpha[rf][h] = sm[rf][h].rescale_factor(block_max);
    moved = moved || alpha[rf][h] != 1.0f;
  };
  auto row_exps = [&](int rf, int h) {
    const float neg_ref = -sm[rf][h].reference();
    float block_sum = 0.0f;
#pragma unroll
    for (int nf = 0; nf < Tr::kFragsN; ++nf)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int i = (j / 2) * 4 + h * 2 + j % 2;
        const int c = nf * kFrag + acc_col(lane, i);
        const bool in = !kMasked || (c >= lo[rf][h] && c < hi[rf][h]);
        const float pk = in ? exp2f(fmaf(s[rf][nf].x[i], scale_log2, neg_ref)) : 0.0f;
        s[rf][nf].x[i] = pk;
        block_sum += pk;
      }
    // This lane's share of the row sum: the quad's four shares are added once, after the last
    // block (quad_row_sums), not in every block.
    sm[rf][h].accumulate(alpha[rf][h], block_sum);
  };
  // The output's rescale, skipped where no row of the warp has a new max (every alpha 1: the
  // products would be exact, so the result is the same bit for bit). Past the first blocks a row's
  // max rarely moves; the rescale was an eighth of the instructions the d 128 forward issued on
  // the H100 (source-level profile, 2026-11-27).
  auto rescale = [&] {
    if (__any_sync(kFullMask, moved)) {
#pragma unroll
      for (int rf = 0; rf < Tr::kRowFrags; ++rf)
#pragma unroll
        for (int df = 0; df < Tr::kFragsD; ++df)
#pragma unroll
          for (int i = 0; i < FragAcc::num_elements; ++i)
            acc_o[rf][df].x[i] *= alpha[rf][(i / 2) % 2];
    }
  };
  if constexpr (Tr::kRegsOnly) {
    // Every max, then the rescale, then every exponential: nothing branches between the
    // exponentials and the caller's P V, which ptxas may then start while the last of them issue
    // (SASS model: -8% cycles at d 64, -2% at d 128; benchmarks/results/sass_model_changes.md).
#pragma unroll
    for (int rf = 0; rf < Tr::kRowFrags; ++rf)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_max(rf, h);
    rescale();
#pragma unroll
    for (int rf = 0; rf < Tr::kRowFrags; ++rf)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_exps(rf, h);
  } else {
    // The general kernels: each row half's max and exponentials in turn, then the rescale (in the
    // order above, ptxas sm_90 spilled more there: float16 d 128, 96 / 184 bytes against 48 / 120).
#pragma unroll
    for (int rf = 0; rf < Tr::kRowFrags; ++rf)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        row_max(rf, h);
        row_exps(rf, h);
      }
    rescale();
  }
}

// After softmax_regs' last block: each row's l, summed over the four lanes of its quad (each
// held the sum over its own columns, all rescaled by the row's common factors).
template <int kRowFrags>
__device__ __forceinline__ void quad_row_sums(detail::OnlineSoftmax<float> (&sm)[kRowFrags][2]) {
#pragma unroll
  for (int rf = 0; rf < kRowFrags; ++rf)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sm[rf][h].l += __shfl_xor_sync(kFullMask, sm[rf][h].l, 1);
      sm[rf][h].l += __shfl_xor_sync(kFullMask, sm[rf][h].l, 2);
    }
}

// Multiplies every output accumulator element by the factor of its row. Lane 2r holds row r's
// factor; the fragment's row map says which rows this lane's elements belong to.
template <int kFrags>
__device__ __forceinline__ void scale_rows(FragAcc (&acc)[kFrags], const FragRows& rows,
                                           float row_factor) {
  float f[FragAcc::num_elements];
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i)
    f[i] = __shfl_sync(kFullMask, row_factor, 2 * rows.r[i]);
#pragma unroll
  for (int d = 0; d < kFrags; ++d)
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; ++i) acc[d].x[i] *= f[i];
}

// O += P V for this warp's 16 rows: sP (16 x kBlockN, T), sV (kBlockN x d).
template <typename Tr>
__device__ __forceinline__ void accumulate_pv(const typename Tr::T* sP, const typename Tr::T* sV,
                                              FragAcc (&acc)[Tr::kFragsD]) {
  using T = typename Tr::T;
#pragma unroll
  for (int kf = 0; kf < Tr::kFragsN; ++kf) {
    FragA<T> a;
    wmma::load_matrix_sync(a, sP + kf * kFrag, Tr::kLdP);
#pragma unroll
    for (int df = 0; df < Tr::kFragsD; ++df) {
      FragB<T> b;
      wmma::load_matrix_sync(b, sV + kf * kFrag * Tr::kLdQKV + df * kFrag, Tr::kLdQKV);
      wmma::mma_sync(acc[df], a, b, acc[df]);
    }
  }
}

// The slow path of a masked block whose V tile holds a NaN or Inf (tile_has_nonfinite): O += P V
// for this warp's 16-row band over the keys each row sees, by scalar FMAs, since the tensor-core
// product of the whole tile adds 0 * NaN = NaN to the rows that cannot see such a key. pa: the
// band's P as A operands, which go to the warp's scratch sS as T (ld kLdP) first; the accumulator
// and A layouts are acc_row / acc_col (the caller checked layout_holds): a lane's elements sit in
// rows lane / 4 and lane / 4 + 8. keys(r, lo, hi): the columns row r of the band sees before the
// block mask; shown(r, c): the block mask. One key at a time, its two P values and the lane's V
// values consumed at once: a call (ABI), or a loop per output element, made ptxas spill more in
// a kernel at 253 registers (sm_80 float16 d 128: 528 and 164 bytes of spill stores; this form
// 32). Per lane up to kBlockN x (kFragsD * 8) FMAs.
template <typename Tr, typename Keys, typename Shown>
__device__ __forceinline__ void accumulate_pv_visible(
    float* sS, const FragA<typename Tr::T> (&pa)[Tr::kFragsN], const typename Tr::T* sV,
    FragAcc (&acc)[Tr::kFragsD], const Keys& keys, const Shown& shown) {
  using T = typename Tr::T;
  static_assert(FragAcc::num_elements == 8, "the m16n8k16 accumulator layout of acc_row / acc_col");
  const int lane = threadIdx.x % 32, r0 = lane / 4, r1 = r0 + 8;
  T* sP = reinterpret_cast<T*>(sS);
#pragma unroll
  for (int nf = 0; nf < Tr::kFragsN; ++nf)
#pragma unroll
    for (int i = 0; i < 8; ++i)  // element i of the A fragment: (acc_row, acc_col) of i
      sP[acc_row(lane, i) * Tr::kLdP + nf * kFrag + acc_col(lane, i)] = pa[nf].x[i];
  __syncwarp();
  int lo0, hi0, lo1, hi1;
  keys(r0, lo0, hi0);
  keys(r1, lo1, hi1);
  const T* v0 = sV + (lane % 4) * 2;
#pragma unroll 1
  for (int c = lo0 < lo1 ? lo0 : lo1; c < (hi0 > hi1 ? hi0 : hi1); ++c) {
    const bool in0 = c >= lo0 && c < hi0 && shown(r0, c);
    const bool in1 = c >= lo1 && c < hi1 && shown(r1, c);
    const float p0 = to_float(sP[r0 * Tr::kLdP + c]), p1 = to_float(sP[r1 * Tr::kLdP + c]);
    const T* v = v0 + c * Tr::kLdQKV;
#pragma unroll
    for (int df = 0; df < Tr::kFragsD; ++df)
#pragma unroll
      for (int i = 0; i < 8; ++i) {  // row r0 + 8 ((i / 2) % 2), column acc_col(lane, i)
        const bool hi = (i / 2) % 2 != 0;
        const float x = to_float(v[df * kFrag + i % 2 + 8 * (i / 4)]);
        if (hi ? in1 : in0) acc[df].x[i] = fmaf(hi ? p1 : p0, x, acc[df].x[i]);  // a select
      }
  }
  __syncwarp();  // the next band's P overwrites the scratch
}

// The accumulator row map, learnt from the 16 x 16 tile of row indices at `tile` (ld 16).
__device__ __forceinline__ FragRows load_rows(const float* tile) {
  FragAcc f;
  wmma::load_matrix_sync(f, tile, kFrag, wmma::mem_row_major);
  FragRows rows;
#pragma unroll
  for (int i = 0; i < FragAcc::num_elements; ++i) rows.r[i] = static_cast<int>(f.x[i]);
  return rows;
}

// Two CTAs per SM: the tile table (fa2_plan.hpp) keeps the shared memory within half an H100's;
// the bound lets ptxas use the registers that leaves.
// kMods: the call has score modifiers (softcap, ALiBi; detail::has_score_mod). A compile-time
// switch: as a run-time branch the modifier pass cost the unmodified kernel registers.
// smem_softmax: run the shared-memory softmax even where the register one would do (testing).
//
// One body, two softmax paths chosen per CTA at run time (the same choice in every warp):
// - registers: the scores stay in their accumulator fragments, the softmax runs on them (quad
//   shuffles) and P becomes the A operand of P V by conversion; taken where the fragment layout
//   check holds and the block has no block mask, no dropout and an unmodified head;
// - shared memory (fallback): each 16-row band's scores go through the warp's scratch (the
//   modifiers, the block mask and dropout apply there), P comes back as A fragments by wmma loads.
// A head with slope 0 and no cap takes the path, and the arithmetic, of a call without modifiers.
template <typename Tr, bool kMods>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    forward_kernel(const __grid_constant__ Params p, const ScoreModF mods, const bool vec_load,
                   const bool vec_store, const bool smem_softmax) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kLd = Tr::kLdQKV;
  constexpr int R = Tr::kRowFrags, kFragsN = Tr::kFragsN, kFragsD = Tr::kFragsD;
  FLASHDL_DYNAMIC_SMEM(smem);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int w0 = warp * Tr::kWarpRows;  // this warp's first row in the Q block
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  float* sS = reinterpret_cast<float*>(smem + Tr::kOffS) + warp * kFrag * Tr::kLdS;
  float* sRows = reinterpret_cast<float*>(smem + Tr::kOffRows);
  float* sRowF = reinterpret_cast<float*>(smem + Tr::kOffRowF);

  const int64_t batch = blockIdx.z, head = blockIdx.y, kv_head = head / p.h_h_k_ratio;
  const int64_t m0 = int64_t(blockIdx.x) * kBlockM;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  if (m0 >= seqlen_q) return;  // a varlen sequence shorter than the grid's max_seqlen_q
  const int m_rows = int(seqlen_q - m0 < kBlockM ? seqlen_q - m0 : kBlockM);
  const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride + head * p.q_head_stride +
                seq.q0 * p.q_row_stride;
  // The register-only kernel rebuilds the K/V rows' addresses for each block's copies, and the
  // mask for each masked block, from the parameters (constant memory), blockIdx and this 32-bit
  // kv head (< nheads_kv <= 65535, the grid's y extent), instead of holding them across the K/V
  // loop: held, ptxas kept them in local memory and reloaded them every block (SASS model, step
  // 20 of benchmarks/results/sass_model_changes.md: float16 sm_90, 6 -> 4 local accesses a block
  // at d 64 and d 128, -5.6% and -4.4% cycles).
  const int kv_head32 = int(kv_head);
  const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                kv_head * p.k_head_stride + seq.k0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                kv_head * p.v_head_stride + seq.k0 * p.v_row_stride;

  // K/V blocks that some row of this Q block can see and the block mask does not zero; the
  // others are skipped: never loaded, never computed.
  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const detail::BlockRange kb = detail::key_blocks_for_queries(mask, m0, m0 + m_rows, kBlockN);
  const int n_begin = int(kb.begin), n_end = int(kb.end);
  // The register-only kernel serves calls without a block mask or dropout (the launcher checks):
  // the dense mask and no dropout as constants, so none of their tests is compiled into it.
  const detail::BlockMask bm = Tr::kRegsOnly ? detail::BlockMask{}
                                             : detail::block_mask_of(p, batch, head);
  auto window_mask = [&] {  // the causal/window mask, where a masked block needs it (see kv_head32)
    if constexpr (Tr::kRegsOnly) {
      const detail::Sequence s = detail::sequence_of(p, blockIdx.z);
      return detail::make_mask(s.sq, s.sk, p.window_left, p.window_right);
    } else {
      return mask;
    }
  };
  auto cover = [&](int n) {
    const int64_t n0 = int64_t(n) * kBlockN;
    return bm.cover(m0, m0 + m_rows, n0, n0 + kBlockN < seqlen_k ? n0 + kBlockN : seqlen_k);
  };
  // Options::mask: a block whose mask tile (this Q block's rows) is all false is skipped like a
  // zero block of the block mask, by a vote of the CTA (kMods only: calls with a mask run there).
  // The bias and mask views are rebuilt where used from the kernel parameters (constant memory):
  // held across the loop their pointers and strides cost registers (ptxas, sm_90 float16 d 128:
  // 160 bytes of spill stores in the kMods kernel, against 8 without them).
  auto extras = [&] { return head_extras(p, batch, head, seq.q0); };
  auto mask_any = [&](int n) {
    if (!kMods || p.mask_ptr == nullptr) return true;
    const detail::HeadExtras ex = extras();
    const int64_t n0 = int64_t(n) * kBlockN;
    const int cols = int(seqlen_k - n0 < kBlockN ? seqlen_k - n0 : kBlockN);
    bool any = false;
    for (int e = threadIdx.x; !any && e < m_rows * cols; e += Tr::kThreads)
      any = ex.kept(m0 + e / cols, n0 + e % cols);
    return __syncthreads_or(any) != 0;
  };
  auto next_block = [&](int n) {  // the first block from n on that is computed
    while (n < n_end && !(cover(n).any && mask_any(n))) ++n;
    return n;
  };

  auto load_kv = [&](int n, int stage) {
    const int64_t n0 = int64_t(n) * kBlockN;
    const int rows = int(seqlen_k - n0 < kBlockN ? seqlen_k - n0 : kBlockN);
    // Keys no row of this Q block may see through the block mask are zero-filled, never read
    // (the register-only kernel has no block mask: every row, the loader's whole-tile copies).
    auto keep = [&](int r) { return bm.col_any(n0 + r, m0, m0 + m_rows); };
    auto load = [&](T* dst, const T* src, int64_t stride) {
      if constexpr (Tr::kRegsOnly)
        load_tile_rows<kBlockN, kD, Tr::kThreads>(dst, kLd, src, stride, rows, vec_load);
      else
        load_tile_rows<kBlockN, kD, Tr::kThreads>(dst, kLd, src, stride, rows, vec_load, keep);
    };
    if constexpr (Tr::kRegsOnly) {  // (rebuilt: see kv_head32)
      const int64_t bz = blockIdx.z, kh = kv_head32;
      const T* k = static_cast<const T*>(p.k_ptr) + bz * p.k_batch_stride + kh * p.k_head_stride +
                   (seq.k0 + n0) * p.k_row_stride;
      const T* v = static_cast<const T*>(p.v_ptr) + bz * p.v_batch_stride + kh * p.v_head_stride +
                   (seq.k0 + n0) * p.v_row_stride;
      load(sK + stage * kBlockN * kLd, k, p.k_row_stride);
      load(sV + stage * kBlockN * kLd, v, p.v_row_stride);
    } else {
      load(sK + stage * kBlockN * kLd, gK + n0 * p.k_row_stride, p.k_row_stride);
      load(sV + stage * kBlockN * kLd, gV + n0 * p.v_row_stride, p.v_row_stride);
    }
  };

  // Load Q (once) and the first K/V block (stage 0).
  load_tile_rows<kBlockM, kD, Tr::kThreads>(sQ, kLd, gQ + m0 * p.q_row_stride, p.q_row_stride,
                                            m_rows, vec_load);
  int n = next_block(n_begin);
  if (n < n_end) load_kv(n, 0);
  __pipeline_commit();

  // The row map (kept) and the layout check's index tiles, in K's stage 1: first written by the
  // prefetch after the loop's first barrier.
  float* codes_f = reinterpret_cast<float*>(sK + kBlockN * kLd);
  T* codes_t = reinterpret_cast<T*>(codes_f + kFrag * kFrag);
  fill_layout_tiles(codes_f, codes_t, Tr::kThreads);
  for (int e = threadIdx.x; e < kFrag * kFrag; e += Tr::kThreads) sRows[e] = float(e / kFrag);
  __syncthreads();
  const detail::Dropout drop = Tr::kRegsOnly ? detail::Dropout{}
                                             : detail::dropout_of(p, batch, head);
  // Whether the head's modifiers change any score (a slope of 0 and no cap do not): only then do
  // they run, on the shared-memory path. Rebuilt per block there, from `mods` and the slope (one
  // cached load): held across the loop they cost registers.
  // A bias or mask (Options::bias, mask) takes the same pass and path; the scores are prescaled
  // where a modifier or a bias changes them (a mask alone only hides keys).
  const bool modded = kMods && modifies(head_score_mods(mods, p, batch, head));
  const bool has_extras = kMods && detail::has_extras(p);
  const bool prescaled = modded || (kMods && p.bias_ptr != nullptr);
  const bool layout_ok = layout_holds<T>(codes_f, codes_t);
  // The register-only instantiation runs only where the launcher found no reason for the
  // shared-memory path, and it has none to fall back to: a fragment layout other than the one
  // every architecture flashdl compiles for (sm_80, sm_90) checked to hold is a compiler change.
  if (Tr::kRegsOnly && !layout_ok) __trap();
  const float scale_log2 = prescaled ? 1.0f : float(p.scale_softmax_log2);
  // (softmax_regs takes the max of raw scores: a scale of 0 or below, which a caller may give,
  // takes the shared-memory path; the launcher sends such calls to the general kernel)
  const bool in_regs = Tr::kRegsOnly || (layout_ok && !smem_softmax && !drop.on() && bm.dense() &&
                                         !modded && !has_extras && scale_log2 > 0.0f);
  // load_frag's bfloat16 loads (as float16) are those of wmma on every architecture they are
  // compiled for (SASS, sm_80 and sm_90): a failure here is a compiler change, not a fallback.
  if (!twin_loads_hold<T>(codes_t)) __trap();

  detail::OnlineSoftmax<float> sm[R][2];  // [band][row half]; the shared-memory path uses [band][0]
  FragAcc acc_o[R][kFragsD];
#pragma unroll
  for (int rf = 0; rf < R; ++rf)
#pragma unroll
    for (int df = 0; df < kFragsD; ++df) wmma::fill_fragment(acc_o[rf][df], 0.0f);

  // The K/V loop, instantiated once per softmax path (the choice is made per CTA, before the
  // loop): one loop with a run-time branch inside kept the registers of both paths live at once
  // and spilled (float16 d = 128 with modifiers on sm_80: 180 bytes).
  // The blocks every row of this Q block sees whole (mask.block_fully_visible of each block, as a
  // range: a row's visible keys are an interval whose ends never decrease with the row), counted
  // once rather than per block.
  const int n_full_lo = int((mask.col_begin(m0 + m_rows - 1) + kBlockN - 1) / kBlockN);
  const int n_full_hi = int(mask.col_end(m0) / kBlockN);
  auto kv_loop = [&](auto regs) {
    constexpr bool kRegs = decltype(regs)::value;
    for (int stage = 0; n < n_end; stage ^= 1) {
      // The one barrier per block: block n has landed for every thread, and every warp is done with
      // the other stage (block n - 1), which the prefetch below then refills.
      __pipeline_wait_prior(0);
      __syncthreads();
      const int next = next_block(n + 1);
      auto copy_next = [&] {
        if (next < n_end) {
          load_kv(next, stage ^ 1);
          __pipeline_commit();
        }
      };
      if (!kRegs) copy_next();
      const T* sKn = sK + stage * kBlockN * kLd;
      const T* sVn = sV + stage * kBlockN * kLd;
      const int64_t n0 = int64_t(n) * kBlockN;
      const bool full = n >= n_full_lo && n < n_full_hi && cover(n).all &&
                        !(kMods && p.mask_ptr != nullptr);
      // O += P V with P's A operands pa: each V fragment feeds R products.
      auto accumulate_pv_regs = [&](FragA<T>(&pa)[R][kFragsN]) {
#pragma unroll
        for (int kf = 0; kf < kFragsN; ++kf)
#pragma unroll
          for (int df = 0; df < kFragsD; ++df) {
            FragB<T> b;
            load_frag(b, sVn + kf * kFrag * kLd + df * kFrag, kLd);
#pragma unroll
            for (int rf = 0; rf < R; ++rf)
              wmma::mma_sync(acc_o[rf][df], pa[rf][kf], b, acc_o[rf][df]);
          }
      };
      // S = Q K^T for the warp's R bands: each K fragment feeds R products.
      FragAcc acc_s[R][kFragsN];
#pragma unroll
      for (int rf = 0; rf < R; ++rf)
#pragma unroll
        for (int nf = 0; nf < kFragsN; ++nf) wmma::fill_fragment(acc_s[rf][nf], 0.0f);
#pragma unroll
      for (int kf = 0; kf < kFragsD; ++kf) {
        FragA<T> a[R];
#pragma unroll
        for (int rf = 0; rf < R; ++rf)
          load_frag(a[rf], sQ + (w0 + rf * kFrag) * kLd + kf * kFrag, kLd);
#pragma unroll
        for (int nf = 0; nf < kFragsN; ++nf) {
          FragBt<T> b;
          load_frag(b, sKn + nf * kFrag * kLd + kf * kFrag, kLd);
#pragma unroll
          for (int rf = 0; rf < R; ++rf) wmma::mma_sync(acc_s[rf][nf], a[rf], b, acc_s[rf][nf]);
        }
      }

      // The register softmax's loop issues the next block's copies here, between the products
      // on shared memory (S above, P V below) and the softmax, which reads none (SASS model:
      // -4% at d 128); the shared-memory softmax's loop at the top of the block (issued here in
      // both loops, the general kernels spilled more: ptxas sm_90 float16 d 256, 124 bytes of
      // spill stores against 68).
      if (kRegs) copy_next();
      FragA<T> pa[R][kFragsN];  // P, the A operands of P V
      if (kRegs && full) {
        // A whole block: the softmax and P V with none of the masked path's branches between
        // them (its windows, the non-finite-V vote, the slow P V), so that ptxas may start P V's
        // products while the softmax's exponentials are still issuing.
        const int none[R][2] = {};
        softmax_regs<Tr, false>(acc_s, sm, scale_log2, none, none, acc_o);
#pragma unroll
        for (int rf = 0; rf < R; ++rf)
#pragma unroll
          for (int kf = 0; kf < kFragsN; ++kf) to_a_operand(pa[rf][kf], acc_s[rf][kf]);
        accumulate_pv_regs(pa);
        n = next;
        continue;
      }
      // A masked block whose V holds a NaN or Inf takes the slow P V (accumulate_pv_visible); the
      // vote is a second barrier, in masked blocks only (full is the same in every thread).
      const bool nonfinite_v =
          !full && __syncthreads_or(tile_has_nonfinite<kD, Tr::kThreads>(sVn, kLd, kBlockN));
      if constexpr (kRegs) {  // (a masked block: whole ones took the path above)
        const detail::Mask mk = window_mask();
        const int64_t mq0 = Tr::kRegsOnly ? int64_t(blockIdx.x) * kBlockM : m0;
        int lo[R][2], hi[R][2];  // the window of each row, relative to the block, in [0, kBlockN]
#pragma unroll
        for (int rf = 0; rf < R; ++rf)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int64_t row = mq0 + w0 + rf * kFrag + h * 8 + lane / 4;
            const int64_t b = mk.col_begin(row) - n0, e = mk.col_end(row) - n0;
            lo[rf][h] = int(b < 0 ? 0 : b > kBlockN ? kBlockN : b);
            hi[rf][h] = int(e < 0 ? 0 : e > kBlockN ? kBlockN : e);
          }
        // The register-only kernel hides the masked scores and runs the whole blocks' softmax:
        // the loop then holds one softmax, and ptxas spills less (SASS model, float16 sm_90: d 64
        // 15 -> 6 local accesses a block, -1.6% cycles; d 128 19 -> 6, -1.9%; d 32 -5.5%, no
        // spill). Not at d 96, where it cost 20/44 bytes of spill and +1.3%.
        if constexpr (Tr::kRegsOnly && kD != 96) {
          hide_scores<Tr>(acc_s, lo, hi);
          const int none[R][2] = {};
          softmax_regs<Tr, false>(acc_s, sm, scale_log2, none, none, acc_o);
        } else {
          softmax_regs<Tr, true>(acc_s, sm, scale_log2, lo, hi, acc_o);
        }
#pragma unroll
        for (int rf = 0; rf < R; ++rf)
#pragma unroll
          for (int kf = 0; kf < kFragsN; ++kf) to_a_operand(pa[rf][kf], acc_s[rf][kf]);
      } else {
#pragma unroll
        for (int rf = 0; rf < R; ++rf) {
#pragma unroll
          for (int nf = 0; nf < kFragsN; ++nf)
            wmma::store_matrix_sync(sS + nf * kFrag, acc_s[rf][nf], Tr::kLdS, wmma::mem_row_major);
          __syncwarp();
          const int64_t row = m0 + w0 + rf * kFrag + lane / 2;  // the row this lane pair owns
          // Softcap, ALiBi: S becomes the exp2-domain scores in place (each lane its own elements),
          // on full blocks too; the softmax then scales by 1. With a bias or mask too, one pass
          // (not inlined: inlined, it cost this kernel spills; a second, inlined pass for the
          // modifiers alone cost more).
          if (kMods && (modded || has_extras))
            apply_score_mods<Tr>(sS, head_score_mods(mods, p, batch, head), modded, p, batch, head,
                                 seq.q0, p.bias_ptr != nullptr ? float(p.scale_softmax_log2) : 1.0f,
                                 mask.diag(row), row < seqlen_q ? row : seqlen_q - 1, n0, seqlen_k);
          const int64_t col_lo = mask.col_begin(row), col_hi = mask.col_end(row);
          const int64_t row_in = row < seqlen_q ? row : seqlen_q - 1;
          const float alpha =  // mask, online softmax; P over S in place
              full ? softmax_step<Tr, false>(sS, sm[rf][0], scale_log2, n0, col_lo, col_hi, bm,
                                             row_in, drop, row)
                   : softmax_step<Tr, true>(sS, sm[rf][0], scale_log2, n0, col_lo, col_hi, bm,
                                            row_in, drop, row);
          scale_rows(acc_o[rf], load_rows(sRows), alpha);
          const T* sP = reinterpret_cast<const T*>(sS);
#pragma unroll
          for (int kf = 0; kf < kFragsN; ++kf) load_frag(pa[rf][kf], sP + kf * kFrag, Tr::kLdP);
          __syncwarp();  // the next band's scores overwrite P
        }
      }

      // O += P V: each V fragment feeds R products; the slow path for a masked block whose V
      // holds a NaN or Inf, where the layout is known (every architecture flashdl compiles for;
      // elsewhere such a value still reaches the rows of its block that cannot see it).
      if (nonfinite_v && layout_ok) {
#pragma unroll
        for (int rf = 0; rf < R; ++rf) {
          const int64_t r0 = m0 + w0 + rf * kFrag;
          auto keys = [&](int r, int& lo, int& hi) {
            const int64_t b = mask.col_begin(r0 + r) - n0, e = mask.col_end(r0 + r) - n0;
            lo = int(b < 0 ? 0 : b > kBlockN ? kBlockN : b);
            hi = int(e < 0 ? 0 : e > kBlockN ? kBlockN : e);
          };
          auto shown = [&](int r, int c) {
            const int64_t row = r0 + r, row_in = row < seqlen_q ? row : seqlen_q - 1;
            return (bm.dense() || bm.visible(row_in, n0 + c)) &&
                   (!kMods || extras().kept(row_in, n0 + c));
          };
          accumulate_pv_visible<Tr>(sS, pa[rf], sVn, acc_o[rf], keys, shown);
        }
      } else {
        accumulate_pv_regs(pa);
      }
      n = next;
    }
  };
  if constexpr (Tr::kRegsOnly) {
    kv_loop(std::true_type{});
  } else {
    if (in_regs)
      kv_loop(std::true_type{});
    else
      kv_loop(std::false_type{});
  }
  __pipeline_wait_prior(0);  // no copy may still be in flight when the CTA retires

  // Epilogue: the lanes that own a row put its 1 / l (with dropout's 1 / (1 - p)) in the warp's
  // rows of sRowF and write its lse (natural log, of the modified scores); rows that saw no key
  // get 0 and -inf. Then O / l, converted to T, one 16 x 16 fragment at a time through the scratch
  // (rows past the sequence are padding and not stored).
  // With an attention sink (Params::sinks_ptr) the sink joins l and lse (finalize_with_sink;
  // m is in the exp2 domain on both paths) and a row that saw no key gets out 0 and lse = sink.
  auto finish_row = [&](int local, const detail::OnlineSoftmax<float>& s) {
    float o_scale = s.inv_l(), lse = s.lse();
    if (p.sinks_ptr != nullptr) {
      const auto f = detail::finalize_with_sink(s.m, s.l, detail::sink_of<float>(p, head));
      o_scale = f.o_scale;
      lse = f.lse;
    }
    sRowF[local] = o_scale * drop.kept_scale;
    const int64_t row = m0 + local;
    if (row < seqlen_q)
      p.lse_ptr[batch * p.lse_batch_stride + head * p.lse_head_stride +
                (seq.q0 + row) * p.lse_row_stride] = lse;
  };
  if (in_regs) {
    quad_row_sums(sm);
    if (lane % 4 == 0)
#pragma unroll
      for (int rf = 0; rf < R; ++rf)
#pragma unroll
        for (int h = 0; h < 2; ++h) finish_row(w0 + rf * kFrag + h * 8 + lane / 4, sm[rf][h]);
  } else if (lane % 2 == 0) {
#pragma unroll
    for (int rf = 0; rf < R; ++rf) finish_row(w0 + rf * kFrag + lane / 2, sm[rf][0]);
  }
  __syncwarp();
  const FragRows rows = load_rows(sRows);
  T* gO = static_cast<T*>(p.o_ptr) + batch * p.o_batch_stride + head * p.o_head_stride +
          (seq.q0 + m0 + w0) * p.o_row_stride;
  const int r = lane / 2, c0 = (lane % 2) * 8;
#pragma unroll
  for (int rf = 0; rf < R; ++rf) {
    float f[FragAcc::num_elements];
#pragma unroll
    for (int i = 0; i < FragAcc::num_elements; ++i) f[i] = sRowF[w0 + rf * kFrag + rows.r[i]];
#pragma unroll
    for (int df = 0; df < kFragsD; ++df) {
#pragma unroll
      for (int i = 0; i < FragAcc::num_elements; ++i) acc_o[rf][df].x[i] *= f[i];
      wmma::store_matrix_sync(sS, acc_o[rf][df], Tr::kLdS, wmma::mem_row_major);
      __syncwarp();
      if (rf * kFrag + r < m_rows - w0)
        store8(gO + (rf * kFrag + r) * p.o_row_stride + df * kFrag + c0, sS + r * Tr::kLdS + c0,
               vec_store);
      __syncwarp();
    }
  }
#endif
}

}  // namespace fa2

// Whether a call can run the register-only kernel: nothing that needs the shared-memory softmax.
inline bool fa2_regs_only_call(const Params& p, const LaunchContext& ctx) {
  return !(p.p_dropout > 0.0f) && p.block_mask_ptr == nullptr && !detail::has_score_mod(p) &&
         !detail::has_extras(p) && !ctx.fa2_smem_softmax && float(p.scale_softmax_log2) > 0.0f;
}

template <typename Tr>
void launch_fa2(const Params& p, const LaunchContext& ctx) {
  // softcap, ALiBi, bias, mask: the modifier instantiation (never the register-only one's)
  auto kernel = fa2::forward_kernel<Tr, false>;
  if constexpr (!Tr::kRegsOnly) {
    if (detail::has_score_mod(p) || detail::has_extras(p)) kernel = fa2::forward_kernel<Tr, true>;
  }
  const int64_t m_blocks = detail::ceil_div(p.seqlen_q, Tr::kBlockM);
  if (p.nheads > ctx.max_grid_y || p.batch > ctx.max_grid_z || m_blocks > INT32_MAX)
    throw Error(ErrorKind::unsupported,
                "q: too large for one fa2 launch: nheads " + std::to_string(p.nheads) + " (max " +
                    std::to_string(ctx.max_grid_y) + "), batch " + std::to_string(p.batch) +
                    " (max " + std::to_string(ctx.max_grid_z) + ")");
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(Tr::kSmemBytes)));
  const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(p.nheads),
                  static_cast<unsigned>(p.batch));
  FLASHDL_LAUNCH(grid, Tr::kThreads, Tr::kSmemBytes, ctx.stream,
                 kernel)(p, call_score_mods(p), ctx.vec_load, ctx.vec_store, ctx.fa2_smem_softmax);
  FLASHDL_CUDA_CHECK_LAUNCH("fa2 forward kernel launch");
}

// The register-only kernel's tile (fa2_fwd_regs_tile) for the calls it serves where the device
// has its shared memory; else the tile of fa2_fwd_tile where the device has the shared memory;
// else, for the head dims whose tile exceeds the smallest opt-in limit of an sm_80+ part (99 KiB:
// sm_86, sm_89, sm_120), half as many keys per block; else a clear error.
template <typename T, int kHeadDim>
void launch_fa2_forward(const Params& p, const LaunchContext& ctx) {
  using Tr = Fa2Traits<T, kHeadDim>;
  constexpr Fa2FwdTile kSmall = fa2_fwd_small_tile(kHeadDim, int(sizeof(T)));
  using Small = Fa2Traits<T, kHeadDim, kSmall.row_frags, kSmall.block_n>;
  constexpr bool kHasSmall = fa2_fwd_has_small(kHeadDim, int(sizeof(T)));
  const auto optin = static_cast<std::size_t>(ctx.smem_optin);
  if constexpr (fa2_fwd_has_regs(kHeadDim, int(sizeof(T)))) {
    constexpr Fa2FwdTile kRegs = fa2_fwd_regs_tile(kHeadDim, int(sizeof(T)));
    using Regs = Fa2Traits<T, kHeadDim, kRegs.row_frags, kRegs.block_n, true>;
    if (Regs::kSmemBytes <= optin && fa2_regs_only_call(p, ctx)) return launch_fa2<Regs>(p, ctx);
  }
  if (Tr::kSmemBytes <= optin) return launch_fa2<Tr>(p, ctx);
  if constexpr (kHasSmall) {
    if (Small::kSmemBytes <= optin) return launch_fa2<Small>(p, ctx);
  }
  throw Error(ErrorKind::unsupported,
              "q: the fa2 kernel for headdim " + std::to_string(kHeadDim) + " needs " +
                  std::to_string(kHasSmall ? Small::kSmemBytes : Tr::kSmemBytes) +
                  " bytes of shared memory per block; device " + std::to_string(ctx.device) +
                  " offers " + std::to_string(ctx.smem_optin) +
                  " (schedule='fa1' sizes its tiles to the device)");
}

}  // namespace flashdl::cuda
