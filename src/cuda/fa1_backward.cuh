// Algorithm 4 of the FlashAttention paper on tensor cores, as written: one CTA per (batch, kv head);
// the outer loop walks the key blocks (K_j, V_j loaded once, dK_j and dV_j accumulated in shared
// memory), the inner loop the query blocks of every head of the group (Q_i, dO_i loaded, D_i
// computed from dO_i and O_i, P recomputed from the saved lse), and dQ_i is read, updated and
// written back to a float32 workspace in global memory for every pair (line 21). The CTA owns
// the dQ rows of its heads, so no atomics are needed and the result is deterministic. Pairs no
// query can see, and pairs only zero blocks of a block mask cover, are skipped. The paper's IO pattern, kept for study; fa2 is the fast path.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>

#include "bwd_block.cuh"
#include "bwd_plan.hpp"
#include "check.hpp"
#include "fa2_dbias.cuh"
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
namespace fa1bwd {

constexpr int kWarps = kBwdWarps;
constexpr int kThreads = kBwdThreads;

// Line 19 and the saved statistics, a warp per row: D_i = rowsum(dO_i * O_i) with dO_i from shared
// memory and O_i from global memory, lse2 = lse * log2(e). Padding rows get lse2 = -inf, D = 0.
template <typename T, int kD>
__device__ void row_stats(const Params& p, const T* sdO, int ld_kv, float* sL2, float* sD,
                          int64_t batch, int64_t head, int64_t q0, int64_t i0, int rows, int br) {
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < br; r += kWarps) {
    if (r >= rows) {
      if (lane == 0) {
        sL2[r] = -INFINITY;
        sD[r] = 0.0f;
      }
      continue;
    }
    const int64_t i = q0 + i0 + r;  // the row in the (packed) arrays
    const T* o = static_cast<const T*>(p.o_ptr) + batch * p.o_batch_stride + i * p.o_row_stride +
                 head * p.o_head_stride;
    float acc = 0.0f;
    for (int c = lane; c < kD; c += 32) acc += to_float(sdO[r * ld_kv + c]) * to_float(o[c]);
    acc = warp_sum(acc);
    if (lane == 0) {
      sD[r] = acc;
      sL2[r] =
          p.lse_ptr[batch * p.lse_batch_stride + head * p.lse_head_stride + i * p.lse_row_stride] *
          float(detail::kLog2e);
    }
  }
}

// Lines 16 and 22: dV_j += P^T dO_i and dK_j += dS^T Q_i (dK without the scale), float
// accumulators in shared memory, the warps taking the 2 x (Bc/16) x (d/16) tiles in turn; and
// dS K_j (Br x d, float) into sdQ for line 21. P, dS: T with row stride ld_p.
template <typename T, int kD>
__device__ void pair_products(const T* sP, const T* sdS, int ld_p, const T* sQ, const T* sdO,
                              const T* sK, int ld_kv, float* sdK, float* sdV, float* sdQ, int ld_o,
                              int br, int bc) {
  constexpr int kFragsD = kD / kFrag;
  const int kv_tiles = (bc / kFrag) * kFragsD, q_tiles = (br / kFrag) * kFragsD;
  for (int t = threadIdx.x / 32; t < 2 * kv_tiles + q_tiles; t += kWarps) {
    FragAcc acc;
    if (t < 2 * kv_tiles) {
      const bool is_k = t >= kv_tiles;
      const int u = is_k ? t - kv_tiles : t, nf = u / kFragsD, df = u % kFragsD;
      float* dst = (is_k ? sdK : sdV) + nf * kFrag * ld_o + df * kFrag;
      const T* a_base = (is_k ? sdS : sP) + nf * kFrag;
      const T* b_base = (is_k ? sQ : sdO) + df * kFrag;
      wmma::load_matrix_sync(acc, dst, ld_o, wmma::mem_row_major);
      for (int kf = 0; kf < br / kFrag; ++kf) {
        FragAt<T> a;
        FragB<T> b;
        wmma::load_matrix_sync(a, a_base + kf * kFrag * ld_p, ld_p);
        wmma::load_matrix_sync(b, b_base + kf * kFrag * ld_kv, ld_kv);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(dst, acc, ld_o, wmma::mem_row_major);
    } else {
      const int u = t - 2 * kv_tiles, rf = u / kFragsD, df = u % kFragsD;
      wmma::fill_fragment(acc, 0.0f);
      for (int kf = 0; kf < bc / kFrag; ++kf) {
        FragA<T> a;
        FragB<T> b;
        wmma::load_matrix_sync(a, sdS + rf * kFrag * ld_p + kf * kFrag, ld_p);
        wmma::load_matrix_sync(b, sK + kf * kFrag * ld_kv + df * kFrag, ld_kv);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(sdQ + rf * kFrag * ld_o + df * kFrag, acc, ld_o, wmma::mem_row_major);
    }
  }
}

// dS K_j into sdQ again by scalar FMAs over the keys each row sees: the slow path of a masked pair
// whose K holds a NaN or Inf, where the tensor-core product adds dS = 0 times NaN to rows that
// cannot see such a key (prob_and_ds's condition; row r is query i0 + r, column c key j0 + c).
// Per thread Br * d / kThreads outputs of up to Bc FMAs each.
template <typename T, int kD>
__device__ __noinline__ void dq_visible(const T* sdS, int ld_p, const T* sK, int ld_kv, float* sdQ,
                                        int ld_o, int br, int bc, const float* sL2, int64_t i0,
                                        int64_t j0, const detail::Mask mask,
                                        const detail::BlockMask bm, const detail::HeadExtras ex) {
  for (int idx = threadIdx.x; idx < br * kD; idx += kThreads) {
    const int r = idx / kD, e = idx % kD;
    float sum = 0.0f;
    if (sL2[r] != -INFINITY)
      for (int c = 0; c < bc; ++c)
        if (mask.visible(i0 + r, j0 + c) && bm.visible(i0 + r, j0 + c) &&
            ex.kept(i0 + r, j0 + c))  // never 0 * NaN
          sum = fmaf(to_float(sdS[r * ld_p + c]), to_float(sK[c * ld_kv + e]), sum);
    sdQ[r * ld_o + e] = sum;
  }
}

// Line 21: dQ_i <- dQ_i + dS K_j, read from and written back to the workspace (scale applied at
// the end).
template <int kD>
__device__ void update_dq(float* gdQ, const float* sdQ, int ld_o, int rows) {
  constexpr int kVecs = kD / 4;
  for (int idx = threadIdx.x; idx < rows * kVecs; idx += kThreads) {
    const int r = idx / kVecs, c = (idx % kVecs) * 4;
    float4 q = *reinterpret_cast<const float4*>(gdQ + int64_t(r) * kD + c);
    const float4 x = *reinterpret_cast<const float4*>(sdQ + r * ld_o + c);
    q.x += x.x;
    q.y += x.y;
    q.z += x.z;
    q.w += x.w;
    *reinterpret_cast<float4*>(gdQ + int64_t(r) * kD + c) = q;
  }
}

// Rows [0, rows) of a float tile (row stride ld) times `scale`, converted to T and stored at g
// (row stride g_stride).
template <typename T, int kD>
__device__ void store_rows(T* g, int64_t g_stride, const float* s, int64_t ld, int64_t rows,
                           float scale, bool vec) {
  constexpr int kChunks = kD / 8;
  for (int64_t idx = threadIdx.x; idx < rows * kChunks; idx += kThreads) {
    const int64_t r = idx / kChunks;
    const int c = int(idx % kChunks) * 8;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = s[r * ld + c + e] * scale;
    store8(g + r * g_stride + c, v, vec);
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const __grid_constant__ Params p, const ScoreModF mods, const Fa1BwdLayout L,
                    float* ws, float* dbias_acc, const bool vec_load, const bool vec_store) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  FLASHDL_DYNAMIC_SMEM(smem);
  T* sK = reinterpret_cast<T*>(smem + L.off_k);
  T* sV = reinterpret_cast<T*>(smem + L.off_v);
  float* sdK = reinterpret_cast<float*>(smem + L.off_dk);
  float* sdV = reinterpret_cast<float*>(smem + L.off_dv);
  T* sQ = reinterpret_cast<T*>(smem + L.off_q);
  T* sdO = reinterpret_cast<T*>(smem + L.off_do);
  float* sS = reinterpret_cast<float*>(smem + L.off_s);
  float* sdP = reinterpret_cast<float*>(smem + L.off_dp);
  float* sdQ = reinterpret_cast<float*>(smem + L.off_dq);
  float* sL2 = reinterpret_cast<float*>(smem + L.off_l2);
  float* sD = reinterpret_cast<float*>(smem + L.off_d);
  const int ld_p = 2 * L.ld_s;

  const int64_t bhk = blockIdx.x, batch = bhk / p.nheads_kv, kv_head = bhk % p.nheads_kv;
  const int64_t group = p.h_h_k_ratio, head0 = kv_head * group;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                kv_head * p.k_head_stride + seq.k0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                kv_head * p.v_head_stride + seq.k0 * p.v_row_stride;
  // The dQ workspace (batch, nheads, p.seqlen_q (a varlen call's max_seqlen_q), d): this CTA's
  // heads are `group` consecutive ones.
  float* gdQ = ws + (batch * p.nheads + head0) * p.seqlen_q * kD;

  // Line 5: dQ = 0 (dK, dV are written whole, block by block).
  for (int64_t idx = threadIdx.x; idx < group * p.seqlen_q * (kD / 4); idx += kThreads)
    reinterpret_cast<float4*>(gdQ)[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncthreads();

  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const float scale = float(p.scale_softmax);
  const int64_t Tc = detail::ceil_div(seqlen_k, L.Bc);
  for (int64_t j = 0; j < Tc; ++j) {  // line 6: key blocks outer
    const int64_t j0 = j * L.Bc;
    const int kv_rows = int(seqlen_k - j0 < L.Bc ? seqlen_k - j0 : L.Bc);
    const detail::BlockRange qb = detail::query_blocks_for_keys(mask, j0, j0 + kv_rows, L.Br);
    auto cover = [&](int64_t h, int64_t i) {  // the block mask of head h over (block i, block j)
      const int64_t i0 = i * L.Br, i1 = i0 + L.Br < seqlen_q ? i0 + L.Br : seqlen_q;
      return detail::block_mask_of(p, batch, h).cover(i0, i1, j0, j0 + kv_rows);
    };
    bool needed = false;  // some pair of this key block is computed
    for (int64_t hg = 0; hg < group && !needed; ++hg)
      for (int64_t i = qb.begin; i < qb.end && !needed; ++i) needed = cover(head0 + hg, i).any;
    // Lines 7-8 (a block no query sees keeps dK_j = dV_j = 0 and loads nothing).
    for (int idx = threadIdx.x; idx < L.Bc * L.ld_o; idx += kThreads) sdK[idx] = sdV[idx] = 0.0f;
    if (needed) {  // keys only zero blocks cover for every pair computed: zero-filled
      unsigned char* flags = reinterpret_cast<unsigned char*>(sS);
      const int64_t rows_end = qb.end * L.Br < seqlen_q ? qb.end * L.Br : seqlen_q;
      needed_key_rows(p, batch, head0, group, qb.begin * L.Br, rows_end, j0, kv_rows, flags,
                      kThreads);
      auto keep = [&](int r) { return flags[r] != 0; };
      load_tile<kD, kThreads>(sK, L.ld_kv, gK + j0 * p.k_row_stride, p.k_row_stride, L.Bc, kv_rows,
                              vec_load, keep);
      load_tile<kD, kThreads>(sV, L.ld_kv, gV + j0 * p.v_row_stride, p.v_row_stride, L.Bc, kv_rows,
                              vec_load, keep);
    }
    for (int64_t hg = 0; hg < group && needed; ++hg) {
      const int64_t h = head0 + hg;
      const detail::Dropout drop = detail::dropout_of(p, batch, h);
      const detail::BlockMask bm = detail::block_mask_of(p, batch, h);
      const ScoreModF mod = head_score_mods(mods, p, batch, h);        // varlen: the sequence's
      const detail::HeadExtras ex = head_extras(p, batch, h, seq.q0);  // bias, mask
      const DBiasAcc dbias = head_dbias(p, dbias_acc, batch, h, seq.q0);
      const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride +
                    h * p.q_head_stride + seq.q0 * p.q_row_stride;
      const T* gdO = static_cast<const T*>(p.do_ptr) + batch * p.do_batch_stride +
                     h * p.do_head_stride + seq.q0 * p.do_row_stride;
      for (int64_t i = qb.begin; i < qb.end; ++i) {  // line 9: query blocks inner
        const detail::BlockMask::Cover c = cover(h, i);
        if (!c.any) continue;  // a zero block of the block mask: never loaded or computed
        const int64_t i0 = i * L.Br;
        const int rows = int(seqlen_q - i0 < L.Br ? seqlen_q - i0 : L.Br);
        // Line 10: Q_i, dO_i to shared memory; O_i, lse_i read by row_stats, dQ_i by update_dq.
        // Rows the block mask hides from every key of this block are zero-filled, not read.
        auto keep = [&](int r) { return bm.row_any(i0 + r, j0, j0 + kv_rows); };
        load_tile<kD, kThreads>(sQ, L.ld_kv, gQ + i0 * p.q_row_stride, p.q_row_stride, L.Br, rows,
                                vec_load, keep);
        load_tile<kD, kThreads>(sdO, L.ld_kv, gdO + i0 * p.do_row_stride, p.do_row_stride, L.Br,
                                rows, vec_load, keep);
        __pipeline_commit();
        __pipeline_wait_prior(0);
        __syncthreads();
        row_stats<T, kD>(p, sdO, L.ld_kv, sL2, sD, batch, h, seq.q0, i0, rows, L.Br);
        // Lines 11 and 17: S = Q_i K_j^T, dP = dO_i V_j^T.
        bwd::scores_and_dp<T, kD>(sQ, sdO, sK, sV, L.ld_kv, sS, sdP, L.ld_s, L.Br / kFrag,
                                  L.Bc / kFrag, kWarps);
        __syncthreads();
        // Lines 12-15, 18 and 20: the score modifiers, mask, P, the dropout mask Z, dS.
        const bool masked = !(c.all && mask.block_fully_visible(i0, i0 + rows, j0, j0 + L.Bc)) ||
                            ex.any();
        if (!masked)
          bwd::probs_and_ds<T, false>(sS, sdP, L.ld_s, L.Br, L.Bc, sL2, sD, i0, j0, mask, bm, drop,
                                      mod, ex, dbias, kWarps);
        else
          bwd::probs_and_ds<T, true>(sS, sdP, L.ld_s, L.Br, L.Bc, sL2, sD, i0, j0, mask, bm, drop,
                                     mod, ex, dbias, kWarps);
        // A masked pair whose K holds a NaN or Inf redoes dS K_j over visible keys (dq_visible);
        // the vote rides on the barrier the pair needs anyway (masked: the same in every thread).
        const bool nonfinite_k = masked ? __syncthreads_or(
                                              tile_has_nonfinite<kD, kThreads>(sK, L.ld_kv, L.Bc))
                                        : (__syncthreads(), false);
        // Lines 16, 22 and the product of line 21.
        pair_products<T, kD>(reinterpret_cast<const T*>(sS), reinterpret_cast<const T*>(sdP), ld_p,
                             sQ, sdO, sK, L.ld_kv, sdK, sdV, sdQ, L.ld_o, L.Br, L.Bc);
        __syncthreads();
        if (nonfinite_k) {
          dq_visible<T, kD>(reinterpret_cast<const T*>(sdP), ld_p, sK, L.ld_kv, sdQ, L.ld_o, L.Br,
                            L.Bc, sL2, i0, j0, mask, bm, ex);
          __syncthreads();
        }
        // Line 21: dQ_i written back. The next pair's first barrier orders this before sdQ is
        // overwritten; nothing here reads what the next loads overwrite.
        update_dq<kD>(gdQ + (hg * p.seqlen_q + i0) * kD, sdQ, L.ld_o, rows);
      }
    }
    __syncthreads();
    // Line 24: dK_j (times the scale) and dV_j to global memory.
    T* gdK = static_cast<T*>(p.dk_ptr) + batch * p.dk_batch_stride + kv_head * p.dk_head_stride +
             (seq.k0 + j0) * p.dk_row_stride;
    T* gdV = static_cast<T*>(p.dv_ptr) + batch * p.dv_batch_stride + kv_head * p.dv_head_stride +
             (seq.k0 + j0) * p.dv_row_stride;
    store_rows<T, kD>(gdK, p.dk_row_stride, sdK, L.ld_o, kv_rows, scale, vec_store);
    store_rows<T, kD>(gdV, p.dv_row_stride, sdV, L.ld_o, kv_rows, 1.0f, vec_store);
    __syncthreads();  // the next block zeroes sdK and sdV
  }

  // dq = scale * dQ for the group's heads (this CTA's own workspace rows, visible after the
  // barriers above).
  for (int64_t hg = 0; hg < group; ++hg) {
    T* gdq = static_cast<T*>(p.dq_ptr) + batch * p.dq_batch_stride +
             (head0 + hg) * p.dq_head_stride + seq.q0 * p.dq_row_stride;
    store_rows<T, kD>(gdq, p.dq_row_stride, gdQ + hg * p.seqlen_q * kD, kD, seqlen_q, scale,
                      vec_store);
  }
#endif
}

}  // namespace fa1bwd

template <typename T, int kHeadDim>
void launch_fa1_backward(const Params& p, const LaunchContext& ctx) {
  const Fa1BwdLayout L = plan_fa1_backward(p.sram_bytes, p.seqlen_q, p.seqlen_k, kHeadDim,
                                           sizeof(T), ctx.smem_optin);
  const int64_t ctas = p.batch * p.nheads_kv;
  if (ctas > INT32_MAX)
    throw Error(ErrorKind::unsupported, "q: batch * nheads_kv = " + std::to_string(ctas) +
                                            " is too large for one fa1 backward launch");
  const auto kernel = fa1bwd::backward_kernel<T, kHeadDim>;
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(L.bytes)));
  const std::size_t floats = static_cast<std::size_t>(p.batch * p.nheads * p.seqlen_q) * kHeadDim;
  StreamWorkspace ws((floats > 0 ? floats : 1) * sizeof(float), ctx.stream);  // dQ
  // deterministic=True with a broadcast dBias: the kernel adds none, fa2dbias sums it.
  const bool dbias_tiles = fa2dbias::wanted(p, ctx.dbias_acc);
  FLASHDL_LAUNCH(static_cast<unsigned>(ctas), fa1bwd::kThreads, L.bytes, ctx.stream,
                 kernel)(p, call_score_mods(p), L, ws.get<float>(),
                         dbias_tiles ? nullptr : ctx.dbias_acc, ctx.vec_load, ctx.vec_store);
  FLASHDL_CUDA_CHECK_LAUNCH("fa1 backward kernel launch");
  ws.release();
  if (dbias_tiles) fa2dbias::launch_with_stats<T, kHeadDim>(p, ctx);
}

}  // namespace flashdl::cuda
