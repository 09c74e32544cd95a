// The FlashAttention-2 forward on tensor cores.
//
// Grid: (Q block, head, batch). A CTA of 4 warps owns kBlockM = 64 query rows, 16 per warp; every
// warp sees every key (no split of K/V between warps). K/V blocks stream through a double buffer in
// shared memory with cp.async; per block, each warp computes its 16 x kBlockN scores on tensor
// cores, applies the score modifiers (softcap, ALiBi) when the head has any, masks them, runs the
// online softmax per row (exp2 domain, two lanes per row), rescales its output accumulators in
// registers and adds P V, again on tensor cores. The division by l happens once at the end, which
// also writes lse (natural log, of the modified scores) for the backward pass.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>

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
__device__ __forceinline__ void compute_scores(const typename Tr::T* sQw,
                                               const typename Tr::T* sK, float* sS) {
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

// One online-softmax step for the row this lane pair owns (lanes 2r and 2r+1 share row r, taking
// alternate columns). Scales the scores into the exp2 domain, masks keys outside [col_lo, col_hi)
// and in zero blocks of the block mask (row_in: the row, clamped into the sequence) when kMasked,
// updates {m, l} and writes P = exp2(t - m) as T over the scores in place, with the elements
// dropout drops set to 0 (l sums the undropped values; the kept ones' 1 / (1 - p) is applied with
// 1 / l in the epilogue, so P is rounded once, as without dropout). Returns the factor by which
// the row's output accumulator must be rescaled. The block mask and dropout run in loops of their
// own, not unrolled: inlined into the unrolled score loop they made ptxas spill.
template <typename Tr, bool kMasked>
__device__ __forceinline__ float softmax_step(float* sS, detail::OnlineSoftmax<float>& sm,
                                              float scale_log2, int64_t n0, int64_t col_lo,
                                              int64_t col_hi, const detail::BlockMask& bm,
                                              int64_t row_in, const detail::Dropout& drop,
                                              int64_t row) {
  using T = typename Tr::T;
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, half = lane % 2;
  if (kMasked && !bm.dense()) {  // zero blocks: -inf before the row max (each lane its own scores)
#pragma unroll 1
    for (int k = 0; k < Tr::kColsPerLane; ++k) {
      const int c = 2 * k + half;
      if (n0 + c < col_hi && !bm.visible(row_in, n0 + c)) sS[r * Tr::kLdS + c] = -INFINITY;
    }
  }
  float t[Tr::kColsPerLane];
  float block_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < Tr::kColsPerLane; ++k) {
    const int c = 2 * k + half;
    float v = sS[r * Tr::kLdS + c] * scale_log2;
    if (kMasked && (n0 + c < col_lo || n0 + c >= col_hi)) v = -INFINITY;
    t[k] = v;
    block_max = fmaxf(block_max, v);
  }
  block_max = fmaxf(block_max, __shfl_xor_sync(kFullMask, block_max, 1));
  const float alpha = sm.rescale_factor(block_max);
  const float ref = sm.reference();  // 0 while the row has seen no key: exp2(-inf - 0) = 0
  __syncwarp();                      // every score is in registers: P may overwrite them
  T* sP = reinterpret_cast<T*>(sS);
  float block_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < Tr::kColsPerLane; ++k) {
    const float pk = exp2f(t[k] - ref);
    block_sum += pk;
    sP[r * Tr::kLdP + 2 * k + half] = from_float<T>(pk);
  }
  if (drop.on()) {  // this lane's own elements of P: no barrier needed
#pragma unroll 1
    for (int k = 0; k < Tr::kColsPerLane; ++k)
      if (!drop.keep(row, n0 + 2 * k + half)) sP[r * Tr::kLdP + 2 * k + half] = from_float<T>(0.0f);
  }
  block_sum += __shfl_xor_sync(kFullMask, block_sum, 1);
  sm.accumulate(alpha, block_sum);
  __syncwarp();  // P complete before the tensor cores read it
  return alpha;
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

// Epilogue: O / l, converted to T, written to this warp's rows of out (rows >= rows_valid are
// padding and not stored), one 16 x 16 fragment at a time through the warp's scratch.
template <typename Tr>
__device__ __forceinline__ void store_output(FragAcc (&acc)[Tr::kFragsD], const FragRows& rows,
                                             float inv_l, float* scratch, typename Tr::T* gO,
                                             int64_t o_row_stride, int rows_valid, bool vec) {
  scale_rows(acc, rows, inv_l);
  const int lane = threadIdx.x % 32;
  const int r = lane / 2, c0 = (lane % 2) * 8;
#pragma unroll
  for (int df = 0; df < Tr::kFragsD; ++df) {
    wmma::store_matrix_sync(scratch, acc[df], Tr::kLdS, wmma::mem_row_major);
    __syncwarp();
    if (r < rows_valid) store8(gO + r * o_row_stride + df * kFrag + c0, scratch + r * Tr::kLdS + c0, vec);
    __syncwarp();
  }
}

// Two CTAs per SM is what the shared memory allows from d = 96 on; the bound lets ptxas use the
// registers that leaves (without it, it capped some variants at 168 and spilled).
// kMods: the call has score modifiers (softcap, ALiBi; detail::has_score_mod). A compile-time
// switch here only: as a run-time branch the modifier pass cost the unmodified kernel up to 9
// registers (ptxas, sm_90; float16 d = 64 went from 160 to 169, 3 to 2 CTAs per SM on an H100),
// while the other kernels branch at run time at no such cost.
template <typename Tr, bool kMods>
__global__ void __launch_bounds__(Tr::kThreads, 2)
    forward_kernel(const __grid_constant__ Params p, const ScoreModF mods, const bool vec_load,
                   const bool vec_store) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  using T = typename Tr::T;
  constexpr int kBlockM = Tr::kBlockM, kBlockN = Tr::kBlockN, kD = Tr::kHeadDim, kLd = Tr::kLdQKV;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  T* sQ = reinterpret_cast<T*>(smem + Tr::kOffQ);
  T* sK = reinterpret_cast<T*>(smem + Tr::kOffK);
  T* sV = reinterpret_cast<T*>(smem + Tr::kOffV);
  float* sS = reinterpret_cast<float*>(smem + Tr::kOffS) + warp * Tr::kWarpRows * Tr::kLdS;

  const int64_t batch = blockIdx.z, head = blockIdx.y, kv_head = head / p.h_h_k_ratio;
  const int64_t m0 = int64_t(blockIdx.x) * kBlockM;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  if (m0 >= seqlen_q) return;  // a varlen sequence shorter than the grid's max_seqlen_q
  const int m_rows = int(seqlen_q - m0 < kBlockM ? seqlen_q - m0 : kBlockM);
  const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride + head * p.q_head_stride +
                seq.q0 * p.q_row_stride;
  const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                kv_head * p.k_head_stride + seq.k0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                kv_head * p.v_head_stride + seq.k0 * p.v_row_stride;

  // K/V blocks that some row of this Q block can see and the block mask does not zero; the
  // others are skipped: never loaded, never computed.
  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const detail::BlockRange kb = detail::key_blocks_for_queries(mask, m0, m0 + m_rows, kBlockN);
  const int n_begin = int(kb.begin), n_end = int(kb.end);
  const detail::BlockMask bm = detail::block_mask_of(p, batch, head);
  auto cover = [&](int n) {
    const int64_t n0 = int64_t(n) * kBlockN;
    return bm.cover(m0, m0 + m_rows, n0, n0 + kBlockN < seqlen_k ? n0 + kBlockN : seqlen_k);
  };
  auto next_block = [&](int n) {  // the first block from n on that is computed
    while (n < n_end && !cover(n).any) ++n;
    return n;
  };

  auto load_kv = [&](int n, int stage) {
    const int64_t n0 = int64_t(n) * kBlockN;
    const int rows = int(seqlen_k - n0 < kBlockN ? seqlen_k - n0 : kBlockN);
    // Keys no row of this Q block may see through the block mask are zero-filled, never read.
    auto keep = [&](int r) { return bm.col_any(n0 + r, m0, m0 + m_rows); };
    load_tile<kD, Tr::kThreads>(sK + stage * kBlockN * kLd, kLd, gK + n0 * p.k_row_stride,
                                p.k_row_stride, kBlockN, rows, vec_load, keep);
    load_tile<kD, Tr::kThreads>(sV + stage * kBlockN * kLd, kLd, gV + n0 * p.v_row_stride,
                                p.v_row_stride, kBlockN, rows, vec_load, keep);
  };

  // Load Q (once) and the first K/V block.
  load_tile<kD, Tr::kThreads>(sQ, kLd, gQ + m0 * p.q_row_stride, p.q_row_stride, kBlockM, m_rows,
                              vec_load);
  int n = next_block(n_begin);
  if (n < n_end) load_kv(n, 0);
  __pipeline_commit();

  const FragRows frag_rows = accumulator_rows(sS, Tr::kLdS);
  const int64_t row = m0 + warp * Tr::kWarpRows + lane / 2;  // the row this lane pair owns
  const int64_t col_lo = mask.col_begin(row), col_hi = mask.col_end(row);
  const int64_t row_in = row < seqlen_q ? row : seqlen_q - 1;
  const detail::Dropout drop = detail::dropout_of(p, batch, head);
  detail::OnlineSoftmax<float> softmax;
  FragAcc acc_o[Tr::kFragsD];
#pragma unroll
  for (int df = 0; df < Tr::kFragsD; ++df) wmma::fill_fragment(acc_o[df], 0.0f);

  for (int stage = 0; n < n_end; stage ^= 1) {
    const int next = next_block(n + 1);
    if (next < n_end) load_kv(next, stage ^ 1);  // prefetch the next block into the other buffer
    __pipeline_commit();
    __pipeline_wait_prior(1);  // block n has landed; block n + 1 may still be in flight
    __syncthreads();

    const T* sKn = sK + stage * kBlockN * kLd;
    const T* sVn = sV + stage * kBlockN * kLd;
    compute_scores<Tr>(sQ + warp * Tr::kWarpRows * kLd, sKn, sS);  // S = Q K^T
    __syncwarp();
    const int64_t n0 = int64_t(n) * kBlockN;
    // Softcap, ALiBi: S becomes the exp2-domain scores in place (each lane its own elements), on
    // full blocks too; the softmax then scales by 1. The head's modifiers are rebuilt here, per
    // block, from `mods` and its slope (one cached load): held across the loop they cost
    // registers. A head with slope 0 and no cap gets S * scale * log2(e) exactly as without.
    if constexpr (kMods)
      apply_score_mods<Tr>(sS, head_score_mods(mods, p, batch, head), mask.diag(row), n0);
    const bool full = mask.block_fully_visible(m0, m0 + m_rows, n0, n0 + kBlockN) && cover(n).all;
    const float scale_log2 = kMods ? 1.0f : float(p.scale_softmax_log2);
    const float alpha =  // mask, online softmax
        full ? softmax_step<Tr, false>(sS, softmax, scale_log2, n0, col_lo, col_hi, bm, row_in,
                                       drop, row)
             : softmax_step<Tr, true>(sS, softmax, scale_log2, n0, col_lo, col_hi, bm, row_in,
                                      drop, row);
    scale_rows(acc_o, frag_rows, alpha);
    accumulate_pv<Tr>(reinterpret_cast<const T*>(sS), sVn, acc_o);  // O += P V
    __syncthreads();  // this stage is refilled by the next iteration's prefetch
    n = next;
  }
  __pipeline_wait_prior(0);  // no copy may still be in flight when the CTA retires

  // Epilogue: O / l and lse.
  const int w0 = warp * Tr::kWarpRows;
  T* gO = static_cast<T*>(p.o_ptr) + batch * p.o_batch_stride + head * p.o_head_stride +
          (seq.q0 + m0 + w0) * p.o_row_stride;
  __syncwarp();
  store_output<Tr>(acc_o, frag_rows, softmax.inv_l() * drop.kept_scale, sS, gO, p.o_row_stride,
                   m_rows - w0, vec_store);
  if (lane % 2 == 0 && row < seqlen_q)
    p.lse_ptr[batch * p.lse_batch_stride + head * p.lse_head_stride +
              (seq.q0 + row) * p.lse_row_stride] =
        softmax.lse();
#endif
}

}  // namespace fa2

template <typename Tr>
void launch_fa2(const Params& p, const LaunchContext& ctx) {
  const auto kernel = detail::has_score_mod(p) ? fa2::forward_kernel<Tr, true>
                                               : fa2::forward_kernel<Tr, false>;  // softcap, ALiBi
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
  kernel<<<grid, Tr::kThreads, Tr::kSmemBytes, ctx.stream>>>(p, call_score_mods(p), ctx.vec_load,
                                                              ctx.vec_store);
  FLASHDL_CUDA_CHECK_LAUNCH("fa2 forward kernel launch");
}

// The tiles of fa2_block_n where the device has the shared memory; else, for the head dims whose
// tiles exceed the smallest opt-in limit of an sm_80+ part (99 KiB: sm_86, sm_89, sm_120), half
// as many keys per block; else a clear error.
template <typename T, int kHeadDim>
void launch_fa2_forward(const Params& p, const LaunchContext& ctx) {
  using Tr = Fa2Traits<T, kHeadDim>;
  using Small = Fa2Traits<T, kHeadDim, Tr::kBlockN / 2>;
  constexpr bool kHasSmall = Tr::kSmemBytes > kFa2SmallestOptin;
  const auto optin = static_cast<std::size_t>(ctx.smem_optin);
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
