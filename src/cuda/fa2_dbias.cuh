// dBias of a bias broadcast over an axis with deterministic=True (the fa2 and fa1 backwards).
//
// The main kernel adds each dS into the compact float32 dBias accumulator with atomics; where the
// bias is broadcast over the batch, the heads or the query rows, several scores add into one
// element, in an order that changes from run to run. With deterministic=True the main kernel adds
// nothing and this kernel computes dBias instead: each CTA owns a tile of the compact dBias
// (kRows of its rows, or its one row when the bias has no row axis, by kCols keys, a thread per
// key) and recomputes the dS of every score that adds into it, by scalar dot products, summing in
// a fixed order (batch, then head, then query row), so every run gives the same bits. Cost: the
// two products q.k and dO.v again for every score (scalar FMAs, K and V tiles staged in shared
// memory), about the backward's own arithmetic over again; a bias with every axis its own never
// comes here (each element receives one score: the atomics are exact). The fa2 backward launches
// it with its own workspace's statistics (launch), fa1 with statistics of its own
// (launch_with_stats).
#pragma once

#include <cstdint>

#include "bwd_block.cuh"
#include "bwd_stats.cuh"
#include "check.hpp"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/extras.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/sequence.hpp"
#include "flashdl/detail/tiles.hpp"
#include "fragment.cuh"
#include "score_mods.cuh"

namespace flashdl::cuda {

namespace fa2dbias {

constexpr int kCols = 64;  // keys per CTA, one a thread
constexpr int kRows = 16;  // compact dBias rows per CTA when the bias has a row axis

// Shared memory: K and V tiles (kCols rows of kD + 2 elements: an odd word stride, so the 32
// threads of a warp reading element e of their own rows hit 32 banks), the query row and its dO
// row, and the kRows x kCols float sums.
template <typename T, int kD>
struct Layout {
  static constexpr int kLd = kD + 2;
  static constexpr std::size_t kOffV = std::size_t(kCols) * kLd * sizeof(T);
  static constexpr std::size_t kOffQ = 2 * kOffV;
  static constexpr std::size_t kOffDo = kOffQ + kD * sizeof(T);
  static constexpr std::size_t kOffAcc = (kOffDo + kD * sizeof(T) + 15) / 16 * 16;
  static constexpr std::size_t kBytes = kOffAcc + std::size_t(kRows) * kCols * sizeof(float);
};

// Whether this call's dBias goes through here: wanted, deterministic, and some element of the
// compact dBias receives more than one score (the bias is broadcast over an axis).
inline bool wanted(const Params& p, const float* dbias_acc) {
  return dbias_acc != nullptr && p.deterministic && !detail::dbias_direct(p);
}

// Grid: x over (bias batch, bias head, row tile), y over key tiles; kCols threads.
template <typename T, int kD>
__global__ void __launch_bounds__(kCols)
    dbias_kernel(const __grid_constant__ Params p, const ScoreModF mods, const float* ws_l2,
                 const float* ws_d, float* dbias_acc) {
  using L = Layout<T, kD>;
  FLASHDL_DYNAMIC_SMEM(smem);
  T* sK = reinterpret_cast<T*>(smem);
  T* sV = reinterpret_cast<T*>(smem + L::kOffV);
  T* sQ = reinterpret_cast<T*>(smem + L::kOffQ);
  T* sdO = reinterpret_cast<T*>(smem + L::kOffDo);
  float* sAcc = reinterpret_cast<float*>(smem + L::kOffAcc);
  const int t = threadIdx.x;

  const int64_t row_tiles = p.bias_rows > 1 ? detail::ceil_div(p.bias_rows, int64_t(kRows)) : 1;
  const int64_t x = blockIdx.x;
  const int64_t bb = x / (p.bias_heads * row_tiles), hh = (x / row_tiles) % p.bias_heads;
  const int64_t r0 = (x % row_tiles) * kRows;  // the tile's first compact row (0: no row axis)
  const int n_rows = p.bias_rows > 1 ? int(p.bias_rows - r0 < kRows ? p.bias_rows - r0 : kRows) : 1;
  const int64_t j0 = int64_t(blockIdx.y) * kCols, j = j0 + t;
  for (int r = 0; r < n_rows; ++r) sAcc[r * kCols + t] = 0.0f;

  // The scores that add into this tile: batch bb (or every batch), head hh (or every head),
  // the query rows of the tile (or every row), in that order.
  const int64_t b_end = p.bias_batch > 1 ? bb + 1 : p.batch;
  const int64_t h_end = p.bias_heads > 1 ? hh + 1 : p.nheads;
  for (int64_t b = p.bias_batch > 1 ? bb : 0; b < b_end; ++b) {
    const detail::Sequence seq = detail::sequence_of(p, b);
    if (j0 >= seq.sk) continue;  // the same in every thread: no key of the tile in this sequence
    // Rows of the sequence whose compact row (seq.q0 + i with a row axis) lies in the tile.
    int64_t i_lo = 0, i_hi = seq.sq;
    if (p.bias_rows > 1) {
      i_lo = r0 - seq.q0 > 0 ? r0 - seq.q0 : 0;
      i_hi = r0 + n_rows - seq.q0 < seq.sq ? r0 + n_rows - seq.q0 : seq.sq;
    }
    if (i_lo >= i_hi) continue;
    const int kv_rows = int(seq.sk - j0 < kCols ? seq.sk - j0 : kCols);
    const detail::Mask mask = detail::make_mask(seq.sq, seq.sk, p.window_left, p.window_right);
    for (int64_t h = p.bias_heads > 1 ? hh : 0; h < h_end; ++h) {
      const int64_t kv_head = h / p.h_h_k_ratio;
      const T* gK = static_cast<const T*>(p.k_ptr) + b * p.k_batch_stride +
                    kv_head * p.k_head_stride + (seq.k0 + j0) * p.k_row_stride;
      const T* gV = static_cast<const T*>(p.v_ptr) + b * p.v_batch_stride +
                    kv_head * p.v_head_stride + (seq.k0 + j0) * p.v_row_stride;
      __syncthreads();  // every thread is done with the previous head's tiles
      for (int e = t; e < kCols * kD; e += kCols) {
        const int r = e / kD, c = e % kD;
        const bool in = r < kv_rows;
        sK[r * L::kLd + c] = in ? gK[r * p.k_row_stride + c] : from_float<T>(0.0f);
        sV[r * L::kLd + c] = in ? gV[r * p.v_row_stride + c] : from_float<T>(0.0f);
      }
      const detail::BlockMask bm = detail::block_mask_of(p, b, h);
      const detail::Dropout drop = detail::dropout_of(p, b, h);
      const ScoreModF mod = head_score_mods(mods, p, b, h);
      const detail::HeadExtras ex = head_extras(p, b, h, seq.q0);
      const bool modded = modifies(mod) || ex.any();
      const int64_t stat0 = (b * p.nheads + h) * p.seqlen_q;
      const T* gQ = static_cast<const T*>(p.q_ptr) + b * p.q_batch_stride + h * p.q_head_stride +
                    seq.q0 * p.q_row_stride;
      const T* gdO = static_cast<const T*>(p.do_ptr) + b * p.do_batch_stride +
                     h * p.do_head_stride + seq.q0 * p.do_row_stride;
      for (int64_t i = i_lo; i < i_hi; ++i) {
        __syncthreads();  // the previous row's q and dO are read (and, first, K and V landed)
        for (int c = t; c < kD; c += kCols) {
          sQ[c] = gQ[i * p.q_row_stride + c];
          sdO[c] = gdO[i * p.do_row_stride + c];
        }
        __syncthreads();
        if (t >= kv_rows) continue;  // past the sequence's keys: no score (barriers above only)
        float qk = 0.0f, dov = 0.0f;
#pragma unroll 8
        for (int c = 0; c < kD; ++c) {
          qk = fmaf(to_float(sQ[c]), to_float(sK[t * L::kLd + c]), qk);
          dov = fmaf(to_float(sdO[c]), to_float(sV[t * L::kLd + c]), dov);
        }
        float prob, ds, ds_bias;
        bwd::prob_and_ds_terms<true>(qk, dov, ws_l2[stat0 + i], ws_d[stat0 + i], i, j, mask.diag(i),
                                     mask, bm, drop, mod, modded, ex, prob, ds, ds_bias);
        sAcc[(p.bias_rows > 1 ? seq.q0 + i - r0 : 0) * kCols + t] += ds_bias;
      }
    }
  }
  // Each element of the tile has one owner: stored, no atomics (the accumulator is zero here).
  if (j < p.seqlen_k)
    for (int r = 0; r < n_rows; ++r)
      dbias_acc[((bb * p.bias_heads + hh) * p.bias_rows + r0 + r) * p.seqlen_k + j] =
          sAcc[r * kCols + t];
}

// Runs after the main kernel (ws_l2, ws_d: its preprocess's lse2 and D), on the caller's stream.
template <typename T, int kD>
void launch(const Params& p, const ScoreModF& mods, const float* ws_l2, const float* ws_d,
            const LaunchContext& ctx) {
  using L = Layout<T, kD>;
  const int64_t row_tiles = p.bias_rows > 1 ? detail::ceil_div(p.bias_rows, int64_t(kRows)) : 1;
  const int64_t grid_x = p.bias_batch * p.bias_heads * row_tiles;
  const int64_t grid_y = detail::ceil_div(p.seqlen_k, int64_t(kCols));
  if (grid_x == 0 || grid_y == 0) return;
  if (grid_x > INT32_MAX || grid_y > ctx.max_grid_y)
    throw Error(ErrorKind::unsupported, "bias: too large for one deterministic dbias launch (" +
                                            std::to_string(grid_x) + " row tiles, " +
                                            std::to_string(grid_y) + " key tiles)");
  if (int(L::kBytes) > ctx.smem_optin)
    throw Error(ErrorKind::unsupported,
                "q: the deterministic dbias kernel for headdim " + std::to_string(kD) + " needs " +
                    std::to_string(L::kBytes) + " bytes of shared memory per block; device " +
                    std::to_string(ctx.device) + " offers " + std::to_string(ctx.smem_optin));
  const auto kernel = dbias_kernel<T, kD>;
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(L::kBytes)));
  FLASHDL_LAUNCH(dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), kCols,
                 L::kBytes, ctx.stream, kernel)(p, mods, ws_l2, ws_d, ctx.dbias_acc);
  FLASHDL_CUDA_CHECK_LAUNCH("deterministic dbias kernel launch");
}

// For a backward without the fa2 workspace (fa1, whose kernel keeps lse2 and D in shared memory):
// the row statistics into a workspace of their own first, then the kernel.
template <typename T, int kD>
void launch_with_stats(const Params& p, const LaunchContext& ctx) {
  const int64_t rows = p.batch * p.nheads * p.seqlen_q;
  const int64_t pre_blocks = detail::ceil_div(p.seqlen_q, int64_t(fa2bwd::kPreRows));
  if (p.nheads > ctx.max_grid_y || p.batch > ctx.max_grid_z || pre_blocks > INT32_MAX)
    throw Error(ErrorKind::unsupported,
                "q: too large for the deterministic dbias's statistics launch: nheads " +
                    std::to_string(p.nheads) + ", batch " + std::to_string(p.batch));
  StreamWorkspace ws(static_cast<std::size_t>(rows > 0 ? 2 * rows : 1) * sizeof(float), ctx.stream);
  float* l2 = ws.get<float>();
  float* d = l2 + rows;
  if (rows > 0) {
    FLASHDL_LAUNCH(dim3(static_cast<unsigned>(pre_blocks), static_cast<unsigned>(p.nheads),
                        static_cast<unsigned>(p.batch)),
                   fa2bwd::kPreRows * 32, 0, ctx.stream, fa2bwd::preprocess_kernel<T>)(p, l2, d);
    FLASHDL_CUDA_CHECK_LAUNCH("deterministic dbias statistics launch");
  }
  launch<T, kD>(p, call_score_mods(p), l2, d, ctx);
  ws.release();
}

}  // namespace fa2dbias

}  // namespace flashdl::cuda
