// Algorithm 1 of the FlashAttention paper on tensor cores, as written: one CTA per (batch, head);
// the outer loop walks the K/V blocks, the inner loop the Q blocks; O (float32), l and m live in a
// global workspace and are read and written back for every (K/V block, Q block) pair. Blocks no
// query can see (causal, windows) are skipped. This is the paper's IO pattern, kept for study and
// comparison; the FA-2 kernel is the fast path. Pairs that only zero blocks of a block mask cover
// are skipped too, and a K/V block no computed pair needs is never loaded.
#pragma once

#include <cuda_pipeline.h>

#include <cstdint>
#include <string>

#include "check.hpp"
#include "fa1_plan.hpp"
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
#include "zero_blocks.cuh"

namespace flashdl::cuda {
namespace fa1 {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// Line 2: O = 0, l = 0, m = -inf for every row of this (batch, head).
template <int kD>
__device__ void init_state(float* gO, float* gM, float* gL, int64_t seqlen_q) {
  for (int64_t idx = threadIdx.x; idx < seqlen_q * (kD / 4); idx += kThreads)
    reinterpret_cast<float4*>(gO)[idx] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t i = threadIdx.x; i < seqlen_q; i += kThreads) {
    gM[i] = -INFINITY;
    gL[i] = 0.0f;
  }
}

// Line 9: S = Q_i K_j^T (Br x Bc, float), the warps taking 16 x 16 tiles in turn.
template <typename T, int kD>
__device__ void scores(const T* sQ, const T* sK, float* sS, const Fa1Layout& L) {
  const int frags_n = L.Bc / kFrag, tiles = (L.Br / kFrag) * frags_n;
  for (int t = threadIdx.x / 32; t < tiles; t += kWarps) {
    const int rf = t / frags_n, cf = t % frags_n;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
#pragma unroll
    for (int kf = 0; kf < kD / kFrag; ++kf) {
      FragA<T> a;
      FragBt<T> b;
      wmma::load_matrix_sync(a, sQ + rf * kFrag * L.ld_kv + kf * kFrag, L.ld_kv);
      wmma::load_matrix_sync(b, sK + cf * kFrag * L.ld_kv + kf * kFrag, L.ld_kv);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(sS + rf * kFrag * L.ld_s + cf * kFrag, acc, L.ld_s,
                            wmma::mem_row_major);
  }
}

// The score modifiers (softcap, ALiBi) over the scores of rows [0, rows), in place: each raw q.k
// becomes its exp2-domain score (softmax_rows then takes them with a scale of 1). The warps and
// lanes take the rows and columns softmax_rows gives them, so each thread reads back only what it
// wrote itself and no barrier is needed in between.
// With a bias or mask (ex.any()) the bias is added and keys the mask hides become -inf
// (extras_score; keys past seqlen_k, c >= cols, are left to the softmax's mask); without a
// modifier the raw q.k is multiplied by `pre` first (scale * log2(e) with a bias, 1 for a mask
// alone, which the softmax then scales as without it).
__device__ inline void apply_score_mods(float* sS, const Fa1Layout& L, int64_t i0, int rows,
                                        int64_t j0, int cols, const detail::Mask& mask,
                                        const ScoreModF& mod, bool modded,
                                        const detail::HeadExtras& ex, float pre) {
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < rows; r += kWarps) {
    float* s = sS + r * L.ld_s;
    const int64_t diag = mask.diag(i0 + r);
    for (int c = lane; c < L.Bc; c += 32) {
      float t = modded ? modified_score(mod, s[c], diag, j0 + c) : s[c] * pre;
      if (ex.any() && c < cols) t = extras_score(ex, t, i0 + r, j0 + c);
      s[c] = t;
    }
  }
}

// Lines 10, 11 and 13, a warp per row: masked row max, P = exp2(t - m_new) (times the dropout
// multipliers when dropout is on; l sums the undropped values) written as T over S in place, the
// new m and l written back to the workspace, and the two factors of line 12 into sScale:
// O_new = O_old * (alpha * l_old / l_new) + (P V) * (1 / l_new). P is taken relative to m_new
// instead of the block max (the paper's P~ e^(m~ - m_new)): the same numbers with one exp fewer.
template <typename T, bool kMasked>
__device__ void softmax_rows(float* sS, float* sScale, float* gM, float* gL, const Fa1Layout& L,
                             int64_t i0, int rows, int64_t j0, const detail::Mask& mask,
                             const detail::BlockMask& bm, const detail::Dropout& drop,
                             float scale_log2) {
  const int lane = threadIdx.x % 32;
  for (int r = threadIdx.x / 32; r < L.Br; r += kWarps) {
    float* s = sS + r * L.ld_s;
    T* pr = reinterpret_cast<T*>(s);
    if (r >= rows) {  // padding row past seqlen_q: P = 0 keeps its P V finite
      for (int c = lane; c < L.Bc; c += 32) pr[c] = from_float<T>(0.0f);
      if (lane == 0) sScale[r] = sScale[L.Br + r] = 0.0f;
      continue;
    }
    const int64_t i = i0 + r;
    const int64_t lo = mask.col_begin(i) - j0, hi = mask.col_end(i) - j0;  // visible columns
    auto score = [&](int c) {
      const float v = s[c] * scale_log2;
      return kMasked && (c < lo || c >= hi || !bm.visible(i, j0 + c)) ? -INFINITY : v;
    };
    float block_max = -INFINITY;
    for (int c = lane; c < L.Bc; c += 32) block_max = fmaxf(block_max, score(c));
    block_max = warp_max(block_max);

    detail::OnlineSoftmax<float> sm;
    sm.m = gM[i];
    sm.l = gL[i];
    const float l_old = sm.l;
    const float alpha = sm.rescale_factor(block_max);
    const float ref = sm.reference();
    float block_sum = 0.0f;
    for (int c0 = 0; c0 < L.Bc; c0 += 32) {
      const int c = c0 + lane;
      const float pc = c < L.Bc ? exp2f(score(c) - ref) : 0.0f;
      // P[c0, c0 + 32) overwrites S[c0/2, c0/2 + 16): read the whole chunk first.
      __syncwarp();
      if (c < L.Bc) pr[c] = from_float<T>(drop.on() ? pc * drop.multiplier(i, j0 + c) : pc);
      block_sum += pc;
    }
    block_sum = warp_sum(block_sum);
    sm.accumulate(alpha, block_sum);
    if (lane == 0) {
      gM[i] = sm.m;
      gL[i] = sm.l;
      const float inv_l = sm.inv_l();  // 0 while the row has seen no key: O stays 0
      sScale[r] = alpha * l_old * inv_l;
      sScale[L.Br + r] = inv_l;
    }
  }
}

// P V of the block pair (Br x d, float) into sO.
template <typename T, int kD>
__device__ void pv(const T* sP, const T* sV, float* sO, const Fa1Layout& L) {
  constexpr int kFragsD = kD / kFrag;
  const int tiles = (L.Br / kFrag) * kFragsD, ld_p = 2 * L.ld_s;
  for (int t = threadIdx.x / 32; t < tiles; t += kWarps) {
    const int rf = t / kFragsD, df = t % kFragsD;
    FragAcc acc;
    wmma::fill_fragment(acc, 0.0f);
    for (int kf = 0; kf < L.Bc / kFrag; ++kf) {
      FragA<T> a;
      FragB<T> b;
      wmma::load_matrix_sync(a, sP + rf * kFrag * ld_p + kf * kFrag, ld_p);
      wmma::load_matrix_sync(b, sV + kf * kFrag * L.ld_kv + df * kFrag, L.ld_kv);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(sO + rf * kFrag * L.ld_o + df * kFrag, acc, L.ld_o,
                            wmma::mem_row_major);
  }
}

// P V of the pair by scalar FMAs over the keys each row sees: the slow path of a masked pair whose
// V holds a NaN or Inf, where the tensor-core product adds 0 * NaN = NaN to rows that cannot see
// such a key. Per thread Br * d / kThreads outputs of up to Bc FMAs each.
template <typename T, int kD>
__device__ __noinline__ void pv_visible(const T* sP, const T* sV, float* sO, const Fa1Layout& L,
                                        int64_t i0, int rows, int64_t j0, const detail::Mask mask,
                                        const detail::BlockMask bm, const detail::HeadExtras ex) {
  const int ld_p = 2 * L.ld_s;
  for (int idx = threadIdx.x; idx < L.Br * kD; idx += kThreads) {
    const int r = idx / kD, e = idx % kD;
    float sum = 0.0f;
    if (r < rows) {
      const int64_t i = i0 + r;
      const int64_t lo = mask.col_begin(i) - j0, hi = mask.col_end(i) - j0;
      for (int c = 0; c < L.Bc; ++c)
        if (c >= lo && c < hi && bm.visible(i, j0 + c) && ex.kept(i, j0 + c))  // a select
          sum = fmaf(to_float(sP[r * ld_p + c]), to_float(sV[c * L.ld_kv + e]), sum);
    }
    sO[r * L.ld_o + e] = sum;
  }
}

// Line 12: O_i <- O_i * sScale[r] + (P V) * sScale[Br + r], read from and written to the workspace.
template <int kD>
__device__ void update_output(float* gO, const float* sO, const float* sScale, const Fa1Layout& L,
                              int rows) {
  constexpr int kVecs = kD / 4;
  for (int idx = threadIdx.x; idx < rows * kVecs; idx += kThreads) {
    const int r = idx / kVecs, c = (idx % kVecs) * 4;
    float4 o = *reinterpret_cast<const float4*>(gO + int64_t(r) * kD + c);
    const float4 x = *reinterpret_cast<const float4*>(sO + r * L.ld_o + c);
    const float a = sScale[r], b = sScale[L.Br + r];
    o.x = fmaf(o.x, a, x.x * b);
    o.y = fmaf(o.y, a, x.y * b);
    o.z = fmaf(o.z, a, x.z * b);
    o.w = fmaf(o.w, a, x.w * b);
    *reinterpret_cast<float4*>(gO + int64_t(r) * kD + c) = o;
  }
}

// Line 16: out = O in the storage type, lse = m + log l (natural log; -inf for an empty row).
template <typename T, int kD>
__device__ void write_result(const Params& p, const detail::Sequence& seq, const float* gO,
                             const float* gM, const float* gL, int64_t batch, int64_t head,
                             bool vec_store) {
  T* out = static_cast<T*>(p.o_ptr) + batch * p.o_batch_stride + head * p.o_head_stride +
           seq.q0 * p.o_row_stride;
  constexpr int kChunks = kD / 8;
  // With an attention sink the workspace's O (already divided by l) is rescaled by
  // l * o_scale of finalize_with_sink, and lse includes the sink.
  const float sink2 = p.sinks_ptr != nullptr ? detail::sink_of<float>(p, head) : 0.0f;
  for (int64_t idx = threadIdx.x; idx < seq.sq * kChunks; idx += kThreads) {
    const int64_t i = idx / kChunks;
    const int c = int(idx % kChunks) * 8;
    const float f = p.sinks_ptr != nullptr
                        ? gL[i] * detail::finalize_with_sink(gM[i], gL[i], sink2).o_scale
                        : 1.0f;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = gO[i * kD + c + e] * f;
    store8(out + i * p.o_row_stride + c, v, vec_store);
  }
  for (int64_t i = threadIdx.x; i < seq.sq; i += kThreads) {
    detail::OnlineSoftmax<float> sm;
    sm.m = gM[i];
    sm.l = gL[i];
    p.lse_ptr[batch * p.lse_batch_stride + head * p.lse_head_stride +
              (seq.q0 + i) * p.lse_row_stride] =
        p.sinks_ptr != nullptr ? detail::finalize_with_sink(sm.m, sm.l, sink2).lse : sm.lse();
  }
}

template <typename T, int kD>
__global__ void __launch_bounds__(kThreads, 1)
    forward_kernel(const __grid_constant__ Params p, const ScoreModF mods, const Fa1Layout L,
                   float* ws, const bool vec_load, const bool vec_store) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // the launcher refuses devices below sm_80 (bfloat16 wmma, cp.async)
#else
  FLASHDL_DYNAMIC_SMEM(smem);
  T* sK = reinterpret_cast<T*>(smem + L.off_k);
  T* sV = reinterpret_cast<T*>(smem + L.off_v);
  T* sQ = reinterpret_cast<T*>(smem + L.off_q);
  float* sS = reinterpret_cast<float*>(smem + L.off_s);
  float* sO = reinterpret_cast<float*>(smem + L.off_o);
  float* sScale = reinterpret_cast<float*>(smem + L.off_scale);

  const int64_t bh = blockIdx.x, batch = bh / p.nheads, head = bh % p.nheads;
  const int64_t kv_head = head / p.h_h_k_ratio;
  const detail::Sequence seq = detail::sequence_of(p, batch);  // dense: the whole batch entry
  const int64_t seqlen_q = seq.sq, seqlen_k = seq.sk;
  const T* gQ = static_cast<const T*>(p.q_ptr) + batch * p.q_batch_stride + head * p.q_head_stride +
                seq.q0 * p.q_row_stride;
  const T* gK = static_cast<const T*>(p.k_ptr) + batch * p.k_batch_stride +
                kv_head * p.k_head_stride + seq.k0 * p.k_row_stride;
  const T* gV = static_cast<const T*>(p.v_ptr) + batch * p.v_batch_stride +
                kv_head * p.v_head_stride + seq.k0 * p.v_row_stride;
  // The workspace: O (rows, d) for every (batch, head), then m, then l; p.seqlen_q rows each (the
  // max_seqlen_q of a varlen call).
  const int64_t all_rows = p.batch * p.nheads * p.seqlen_q;
  float* gO = ws + bh * p.seqlen_q * kD;
  float* gM = ws + all_rows * kD + bh * p.seqlen_q;
  float* gL = gM + all_rows;

  init_state<kD>(gO, gM, gL, seqlen_q);
  __syncthreads();

  const detail::Mask mask = detail::make_mask(seqlen_q, seqlen_k, p.window_left, p.window_right);
  const detail::Dropout drop = detail::dropout_of(p, batch, head);
  const detail::BlockMask bm = detail::block_mask_of(p, batch, head);
  const ScoreModF mod = head_score_mods(mods, p, batch, head);        // varlen: the sequence's
  const detail::HeadExtras ex = head_extras(p, batch, head, seq.q0);  // bias, mask
  const int64_t Tc = detail::ceil_div(seqlen_k, L.Bc);
  for (int64_t j = 0; j < Tc; ++j) {  // line 5: K/V blocks outer
    const int64_t j0 = j * L.Bc;
    const int kv_rows = int(seqlen_k - j0 < L.Bc ? seqlen_k - j0 : L.Bc);
    const detail::BlockRange qb = detail::query_blocks_for_keys(mask, j0, j0 + kv_rows, L.Br);
    auto cover = [&](int64_t i) {  // the block mask over the pair (query block i, this block)
      const int64_t i0 = i * L.Br, i1 = i0 + L.Br < seqlen_q ? i0 + L.Br : seqlen_q;
      return bm.cover(i0, i1, j0, j0 + kv_rows);
    };
    int64_t first = qb.begin;
    while (first < qb.end && !cover(first).any) ++first;
    if (first >= qb.end) continue;  // no query sees these keys: skipped, not loaded or computed
    // Line 6 (the previous pair's last barrier ordered every read of sK, sV and sS before this).
    // Keys that only zero blocks cover for every query block computed are zero-filled, not read.
    unsigned char* flags = reinterpret_cast<unsigned char*>(sS);
    const int64_t rows_end = qb.end * L.Br < seqlen_q ? qb.end * L.Br : seqlen_q;
    needed_key_rows(p, batch, head, 1, first * L.Br, rows_end, j0, kv_rows, flags, kThreads);
    auto keep = [&](int r) { return flags[r] != 0; };
    load_tile<kD, kThreads>(sK, L.ld_kv, gK + j0 * p.k_row_stride, p.k_row_stride, L.Bc, kv_rows,
                            vec_load, keep);
    load_tile<kD, kThreads>(sV, L.ld_kv, gV + j0 * p.v_row_stride, p.v_row_stride, L.Bc, kv_rows,
                            vec_load, keep);
    for (int64_t i = first; i < qb.end; ++i) {  // line 7: Q blocks inner
      const detail::BlockMask::Cover c = cover(i);
      if (!c.any) continue;  // a zero block of the block mask
      const int64_t i0 = i * L.Br;
      const int rows = int(seqlen_q - i0 < L.Br ? seqlen_q - i0 : L.Br);
      // A pair whose tile of Options::mask is all false is skipped like a zero block (a vote).
      if (ex.keep != nullptr) {
        bool any = false;
        for (int e = threadIdx.x; !any && e < rows * kv_rows; e += kThreads)
          any = ex.kept(i0 + e / kv_rows, j0 + e % kv_rows);
        if (!__syncthreads_or(any)) continue;
      }
      // Line 8: Q_i to shared memory; O_i, l_i, m_i are read from the workspace where used.
      load_tile<kD, kThreads>(sQ, L.ld_kv, gQ + i0 * p.q_row_stride, p.q_row_stride, L.Br, rows,
                              vec_load);
      __pipeline_commit();
      __pipeline_wait_prior(0);
      __syncthreads();
      scores<T, kD>(sQ, sK, sS, L);
      __syncthreads();
      // Softcap, ALiBi: S becomes the exp2-domain scores, taken with a scale of 1.
      // Bias, mask: the same pass (a mask alone leaves the scaling to the softmax).
      const bool modded = modifies(mod), prescaled = modded || ex.bias != nullptr;
      if (modded || ex.any())
        apply_score_mods(sS, L, i0, rows, j0, kv_rows, mask, mod, modded, ex,
                         ex.bias != nullptr ? float(p.scale_softmax_log2) : 1.0f);
      const float scale_log2 = prescaled ? 1.0f : float(p.scale_softmax_log2);
      const bool masked = !(c.all && mask.block_fully_visible(i0, i0 + rows, j0, j0 + L.Bc)) ||
                          ex.keep != nullptr;
      if (!masked)
        softmax_rows<T, false>(sS, sScale, gM, gL, L, i0, rows, j0, mask, bm, drop, scale_log2);
      else
        softmax_rows<T, true>(sS, sScale, gM, gL, L, i0, rows, j0, mask, bm, drop, scale_log2);
      // A masked pair whose V holds a NaN or Inf takes the scalar P V over visible keys; the vote
      // rides on the barrier the pair needs anyway (masked is the same in every thread).
      const bool nonfinite_v = masked ? __syncthreads_or(
                                            tile_has_nonfinite<kD, kThreads>(sV, L.ld_kv, L.Bc))
                                      : (__syncthreads(), false);
      if (nonfinite_v)
        pv_visible<T, kD>(reinterpret_cast<const T*>(sS), sV, sO, L, i0, rows, j0, mask, bm, ex);
      else
        pv<T, kD>(reinterpret_cast<const T*>(sS), sV, sO, L);
      __syncthreads();
      update_output<kD>(gO + i0 * kD, sO, sScale, L, rows);
      // No barrier needed here: the next pair's first barrier orders this update before anything
      // that overwrites sO or sScale, and nothing here reads sQ, sK or sV.
    }
  }
  __syncthreads();  // the last updates of O, l and m are visible to every thread
  write_result<T, kD>(p, seq, gO, gM, gL, batch, head, vec_store);
#endif
}

}  // namespace fa1

template <typename T, int kHeadDim>
void launch_fa1_forward(const Params& p, const LaunchContext& ctx) {
  const Fa1Layout L = plan_fa1(p.sram_bytes, p.seqlen_q, p.seqlen_k, kHeadDim, sizeof(T),
                               ctx.smem_optin);
  const int64_t ctas = p.batch * p.nheads;
  if (ctas > INT32_MAX)
    throw Error(ErrorKind::unsupported,
                "q: batch * nheads = " + std::to_string(ctas) + " is too large for one fa1 launch");
  const auto kernel = fa1::forward_kernel<T, kHeadDim>;
  FLASHDL_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(L.bytes)));
  const std::size_t rows = static_cast<std::size_t>(ctas * p.seqlen_q);
  StreamWorkspace ws(rows * (kHeadDim + 2) * sizeof(float), ctx.stream);  // O, m, l
  FLASHDL_LAUNCH(static_cast<unsigned>(ctas), fa1::kThreads, L.bytes, ctx.stream,
                 kernel)(p, call_score_mods(p), L, ws.get<float>(), ctx.vec_load, ctx.vec_store);
  FLASHDL_CUDA_CHECK_LAUNCH("fa1 forward kernel launch");
  ws.release();
}

}  // namespace flashdl::cuda
