// Attention over a KV cache on CUDA, the device half of src/kvcache.cpp (which validates
// everything and fills Params). In order, on the caller's stream: the plan (the kernel variant,
// the key splits, the grid; every refusal happens here, before the cache is written), the host
// arrays (seqused_k, block_table, cache_batch_idx, cache_leftpad, rotary positions) copied to the
// device, the append of the new keys and values (append_kernel; keys rotated when rotary is on),
// q rotated into a buffer (rotate_q_kernel), the decode kernel (decode.cuh) and, with several splits, their combine
// (merge_rows.cuh). The stream-ordered buffers are freed on the stream behind that work.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "check.hpp"
#include "decode_launch.hpp"
#include "decode_plan.hpp"
#include "flashdl/detail/kv_cache.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/rotary.hpp"
#include "flashdl/detail/tiles.hpp"
#include "fragment.cuh"
#include "launch.hpp"
#include "merge_rows.cuh"
#include "score_mods.cuh"
#include "static_switch.hpp"

namespace flashdl::cuda {
namespace kvcache {  // named, not anonymous: the ptxas report (tools/kernel_report.sh) names it

constexpr int kAppendThreads = 128;

// One head row rotated by a warp (detail::rotate, in float32, rounded once): src to dst, the
// columns from rotary_dim on copied.
template <typename T>
__device__ void rotate_row(const T* src, T* dst, const KvAppend& a, int64_t pos, int64_t d,
                           int lane) {
  const T* cos = static_cast<const T*>(a.rotary_cos) + pos * a.rotary_cos_stride;
  const T* sin = static_cast<const T*>(a.rotary_sin) + pos * a.rotary_sin_stride;
  for (int64_t m = lane; m < a.rotary_dim / 2; m += 32) {
    const detail::RotaryPair pr = detail::rotary_pair(m, a.rotary_dim, a.rotary_interleaved);
    float y1, y2;
    detail::rotate(to_float(src[pr.first]), to_float(src[pr.second]), to_float(cos[m]),
                   to_float(sin[m]), &y1, &y2);
    dst[pr.first] = from_float<T>(y1);
    dst[pr.second] = from_float<T>(y2);
  }
  for (int64_t c = a.rotary_dim + lane; c < d; c += 32) dst[c] = src[c];
}

// q rotated into dst, contiguous (batch, seqlen_q, nheads, headdim), a warp per head row; row i
// of sequence b at position seqlens[b] + i (rotary_per_row_q) or seqlens[b].
template <typename T>
__global__ void __launch_bounds__(kAppendThreads)
    rotate_q_kernel(const __grid_constant__ Params p, const KvAppend a, const int32_t* seqlens,
                    T* dst) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * p.seqlen_q * p.nheads;
  const int64_t warps = int64_t(gridDim.x) * (kAppendThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kAppendThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const int64_t h = row % p.nheads, i = (row / p.nheads) % p.seqlen_q,
                  b = row / p.nheads / p.seqlen_q;
    const T* src = static_cast<const T*>(p.q_ptr) + b * p.q_batch_stride + i * p.q_row_stride +
                   h * p.q_head_stride;
    rotate_row(src, dst + row * p.headdim, a, seqlens[b] + (a.rotary_per_row_q ? i : 0), p.headdim,
               lane);
  }
}

// Row (b, j, hk) of k_new or v_new into its cache slot (position seqused_k[b] - seqlen_new + j,
// counted from cache_leftpad[b], in cache row cache_batch_idx[b] or through the page table),
// a warp per row: 16-byte chunks when every row involved starts on a 16-byte boundary, else
// 2-byte elements (float16 and bfloat16 alike); with rotary, key rows rotated at position
// seqlens[b] + j. Distinct rows land in distinct slots (kvcache.cpp refuses collisions).
template <typename T>
__global__ void __launch_bounds__(kAppendThreads)
    append_kernel(const __grid_constant__ Params p, const KvAppend a, const bool vec,
                  const int32_t* seqlens) {
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.batch * a.seqlen_new * p.nheads_kv * 2;
  const int64_t warps = int64_t(gridDim.x) * (kAppendThreads / 32);
  for (int64_t row = int64_t(blockIdx.x) * (kAppendThreads / 32) + threadIdx.x / 32; row < rows;
       row += warps) {
    const bool is_v = row % 2 != 0;
    const int64_t hk = (row / 2) % p.nheads_kv, j = (row / 2 / p.nheads_kv) % a.seqlen_new,
                  b = row / 2 / p.nheads_kv / a.seqlen_new;
    const int64_t pos = p.seqused_k[b] - a.seqlen_new + j;
    const int64_t slot = is_v ? detail::v_cache_offset(p, b, pos, hk)
                              : detail::k_cache_offset(p, b, pos, hk);
    auto* dst = static_cast<uint16_t*>(const_cast<void*>(is_v ? p.v_ptr : p.k_ptr)) + slot;
    const auto* src = static_cast<const uint16_t*>(is_v ? a.v_ptr : a.k_ptr) +
                      (is_v ? b * a.v_batch_stride + j * a.v_row_stride + hk * a.v_head_stride
                            : b * a.k_batch_stride + j * a.k_row_stride + hk * a.k_head_stride);
    if (!is_v && a.rotary_dim > 0) {
      rotate_row(reinterpret_cast<const T*>(src), reinterpret_cast<T*>(dst), a, seqlens[b] + j,
                 p.headdim, lane);
    } else if (vec) {
      for (int64_t c = lane * 8; c < p.headdim; c += 32 * 8)
        *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
    } else {
      for (int64_t c = lane; c < p.headdim; c += 32) dst[c] = src[c];
    }
  }
}

}  // namespace kvcache

namespace {

using kvcache::kAppendThreads;

bool aligned16(const void* ptr, int64_t s0, int64_t s1, int64_t s2) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && s0 % 8 == 0 && s1 % 8 == 0 &&
         s2 % 8 == 0;
}

template <typename T>
void launch_append(const Params& p, const KvAppend& a, const int32_t* seqlens,
                   cudaStream_t stream) {
  const int64_t rows = p.batch * a.seqlen_new * p.nheads_kv * 2;
  if (rows == 0) return;
  const bool vec = aligned16(p.k_ptr, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
                   aligned16(p.v_ptr, p.v_batch_stride, p.v_row_stride, p.v_head_stride) &&
                   aligned16(a.k_ptr, a.k_batch_stride, a.k_row_stride, a.k_head_stride) &&
                   aligned16(a.v_ptr, a.v_batch_stride, a.v_row_stride, a.v_head_stride);
  const int64_t blocks = std::min<int64_t>(detail::ceil_div(rows, kAppendThreads / 32), 1 << 20);
  FLASHDL_LAUNCH(static_cast<unsigned>(blocks), kAppendThreads, 0, stream,
                 kvcache::append_kernel<T>)(p, a, vec, seqlens);
  FLASHDL_CUDA_CHECK_LAUNCH("kv cache append kernel launch");
}

// q rotated into a stream-ordered buffer, and Params pointed there (contiguous strides).
template <typename T>
std::unique_ptr<StreamWorkspace> rotate_q(Params& p, const KvAppend& a, const int32_t* seqlens,
                                          cudaStream_t stream) {
  const int64_t rows = p.batch * p.seqlen_q * p.nheads;
  auto ws = std::make_unique<StreamWorkspace>(
      static_cast<std::size_t>(rows * p.headdim) * sizeof(T), stream);
  T* dst = ws->get<T>();
  const int64_t blocks = std::min<int64_t>(detail::ceil_div(rows, kAppendThreads / 32), 1 << 20);
  FLASHDL_LAUNCH(static_cast<unsigned>(blocks), kAppendThreads, 0, stream,
                 kvcache::rotate_q_kernel<T>)(p, a, seqlens, dst);
  FLASHDL_CUDA_CHECK_LAUNCH("kv cache rotary kernel launch");
  p.q_ptr = dst;
  p.q_head_stride = p.headdim;
  p.q_row_stride = p.nheads * p.headdim;
  p.q_batch_stride = p.seqlen_q * p.nheads * p.headdim;
  return ws;
}

// seqused_k, the page table, cache_batch_idx, cache_leftpad and the rotary positions
// (cache_seqlens), checked in host memory by kvcache.cpp, copied in one piece to a stream-ordered
// device buffer (as DeviceOffsets does for varlen); Params then points there. Only the pages each
// sequence uses are copied (rows of the most any sequence uses); the page index counts from
// cache_leftpad. From pageable memory the copy waits for the stream's earlier work.
class DeviceKvTables {
 public:
  DeviceKvTables(Params& p, const int32_t* seqlens, cudaStream_t stream) {
    const bool paged = p.block_table != nullptr;
    auto pad = [&](int64_t b) { return p.cache_leftpad ? int64_t{p.cache_leftpad[b]} : 0; };
    int64_t pages = 0;
    for (int64_t b = 0; paged && b < p.batch; ++b)
      pages = std::max(pages, detail::ceil_div(pad(b) + p.seqused_k[b], p.page_size));
    const int64_t B = p.batch;
    std::vector<int32_t> host(static_cast<std::size_t>(B * (1 + pages)), 0);
    for (int64_t b = 0; b < B; ++b) {
      host[b] = p.seqused_k[b];
      const int64_t used = paged ? detail::ceil_div(pad(b) + p.seqused_k[b], p.page_size) : 0;
      for (int64_t pg = 0; pg < used; ++pg)
        host[B + b * pages + pg] = p.block_table[b * p.block_table_batch_stride + pg];
    }
    // Appended per-sequence arrays: their offsets in the buffer, or -1.
    auto add = [&](const int32_t* a) {
      if (a == nullptr) return int64_t{-1};
      const auto at = static_cast<int64_t>(host.size());
      host.insert(host.end(), a, a + B);
      return at;
    };
    const int64_t at_idx = add(p.cache_batch_idx), at_pad = add(p.cache_leftpad),
                  at_pos = add(seqlens);
    ws_ = std::make_unique<StreamWorkspace>(host.size() * sizeof(int32_t), stream);
    int32_t* dev = ws_->get<int32_t>();
    FLASHDL_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream));
    p.seqused_k = dev;
    if (paged) {
      p.block_table = dev + B;
      p.block_table_batch_stride = pages;
    }
    if (at_idx >= 0) p.cache_batch_idx = dev + at_idx;
    if (at_pad >= 0) p.cache_leftpad = dev + at_pad;
    if (at_pos >= 0) seqlens_ = dev + at_pos;
  }
  const int32_t* seqlens() const { return seqlens_; }  // device rotary positions, or null
  void release() { ws_->release(); }

 private:
  std::unique_ptr<StreamWorkspace> ws_;
  const int32_t* seqlens_ = nullptr;
};

int sm_count(int device) {
  int n = 0;
  FLASHDL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// The combine of a split call: part s of output row (b, i, h) is row h * seqlen_q + i of split s
// of batch b in the workspace (decode_workspace), so the splits are equally spaced parts.
MergeArgs combine_args(const Params& p, const DecodeArgs& a, const DecodeWorkspace& w) {
  MergeArgs m{};
  m.batch = p.batch;
  m.seqlen = p.seqlen_q;
  m.nheads = p.nheads;
  m.head_dim = p.headdim;
  m.count = static_cast<int>(a.splits);
  const int64_t d = p.headdim;
  m.part[0] =
      MergeView{a.o_part,   a.lse_part, a.splits * w.rows * d, d, p.seqlen_q * d, a.splits * w.rows,
                p.seqlen_q, 1};
  m.o_part_stride = w.rows * d;
  m.lse_part_stride = w.rows;
  m.out = MergeView{p.o_ptr,         p.lse_ptr,          p.o_batch_stride,  p.o_row_stride,
                    p.o_head_stride, p.lse_batch_stride, p.lse_head_stride, p.lse_row_stride};
  return m;
}

template <typename T, int kHeadDim>
void run(Params p, const KvAppend& append, const LaunchContext& ctx) {
  // 1. The plan, and every refusal, before anything is written.
  const int warps = pick_decode_warps(kHeadDim, ctx.smem_optin);
  if (warps == 0) {
    const int smallest = decode_has_fallback(kHeadDim) ? 2 : 4;
    throw Error(ErrorKind::unsupported,
                "q: the decode kernel for headdim " + std::to_string(kHeadDim) + " needs " +
                    std::to_string(decode_layout(kHeadDim, smallest).bytes) +
                    " bytes of shared memory per block; device " + std::to_string(ctx.device) +
                    " offers " + std::to_string(ctx.smem_optin));
  }
  const int64_t chunks = decode_row_chunks(p.h_h_k_ratio, p.seqlen_q);
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const KeyRange r = visible_keys(
        detail::make_mask(p.seqlen_q, p.seqused_k[b], p.window_left, p.window_right));
    max_keys = std::max(max_keys, r.end - r.begin);
  }
  const int64_t splits = decode_num_splits(p.num_splits, p.batch * p.nheads_kv * chunks, max_keys,
                                           16 * warps, sm_count(ctx.device));
  if (p.nheads_kv > ctx.max_grid_y || p.batch > ctx.max_grid_z || splits * chunks > INT32_MAX)
    throw Error(ErrorKind::unsupported,
                "q: too large for one decode launch: nheads_kv " + std::to_string(p.nheads_kv) +
                    " (max " + std::to_string(ctx.max_grid_y) + "), batch " +
                    std::to_string(p.batch) + " (max " + std::to_string(ctx.max_grid_z) + ")");

  // 2. The host arrays on the device; 3. the append; 4. the attention.
  const bool rotary = append.rotary_dim > 0;
  DeviceKvTables tables(p, rotary ? append.cache_seqlens : nullptr, ctx.stream);
  if (append.seqlen_new > 0) launch_append<T>(p, append, tables.seqlens(), ctx.stream);
  if (p.seqlen_q > 0 && p.nheads > 0) {
    std::unique_ptr<StreamWorkspace> q_rot;
    if (rotary) q_rot = rotate_q<T>(p, append, tables.seqlens(), ctx.stream);
    const DecodeWorkspace w = decode_workspace(p.batch, splits, p.nheads, p.seqlen_q, kHeadDim);
    std::unique_ptr<StreamWorkspace> ws;
    if (w.floats() > 0)
      ws = std::make_unique<StreamWorkspace>(static_cast<std::size_t>(w.floats()) * sizeof(float),
                                             ctx.stream);
    float* base = ws ? ws->get<float>() : nullptr;
    const DecodeArgs a{
        splits,       chunks,       base, base ? base + w.o : nullptr, call_score_mods(p),
        ctx.vec_load, ctx.vec_store};
    launch_decode<T, kHeadDim>(p, a, warps, ctx);
    if (splits > 1) launch_merge<float, T, float>(combine_args(p, a, w), ctx.stream);
    if (ws) ws->release();
    if (q_rot) q_rot->release();
  }
  tables.release();
}

}  // namespace

void run_kvcache(const Params& params, const KvAppend& append, const LaunchContext& ctx) {
  if (params.batch == 0 || params.nheads_kv == 0) return;  // no row to append, no query row
  FLASHDL_DTYPE_SWITCH(params.dtype, T, [&] {
    FLASHDL_HEADDIM_SWITCH(params.headdim, kHeadDim,
                           [&] { run<T, kHeadDim>(params, append, ctx); });
  });
}

}  // namespace flashdl::cuda
