// Planning of attention over a KV cache on CUDA (decode.cuh): the decode kernel's shared-memory
// layout and its variant per device limit, which query rows a CTA owns, how a sequence's keys are
// split (split-KV, "flash-decoding") and how many splits a call gets, and the workspace of the
// partial results. Host code (and two host+device helpers the kernel calls), no CUDA headers:
// unit-tested by tests/cpp/test_cuda_plan.cpp.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "flashdl/detail/macros.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/tiles.hpp"

namespace flashdl::cuda {

// Query rows of one CTA: one 16-row wmma band. A call's rows of a kv head (group * seqlen_q,
// the query rows of every head of its GQA group) are cut into chunks of this many; decoding has
// 1 to 16 of them (seqlen_q 1, groups up to 16), so a kv head's keys are read once.
constexpr int kDecodeRows = 16;
constexpr int kDecodeStages = 2;  // K/V double buffering
// Keys below which a split costs more (a CTA's setup, a partial result written and merged) than
// the parallelism it adds: four 64-key tiles.
constexpr int64_t kDecodeMinSplitKeys = 256;
// The most splits the automatic choice gives; a caller's num_splits is capped by the tiles only.
constexpr int64_t kDecodeMaxSplits = 128;
// The smallest opt-in shared memory per block among sm_80+ parts (sm_86, sm_89, sm_120).
constexpr std::size_t kDecodeSmallestOptin = 99 * 1024;

// The decode kernel's shared memory for a head dim and a warp count (every byte offset 128-byte
// aligned). Each warp owns 16 keys of a K/V tile, so a tile has 16 * warps keys.
struct DecodeLayout {
  int warps, threads, block_n;
  int ld_qkv;  // head_dim + 8 elements of T (2 bytes): Q, K and V rows
  int ld_s;    // 16 + 4 floats: a warp's 16 x 16 scores; P (elements of T) in place, 2 * ld_s
  int ld_o;    // head_dim + 4 floats: a warp's normalised O in the epilogue
  std::size_t off_q, off_k, off_v, off_s, off_rows, off_stats, bytes;
  std::size_t kv_stage_bytes;  // one stage of K (or of V)
  std::size_t merge_bytes;     // the warps' O in the epilogue, laid over the K/V stages from off_k
};

constexpr std::size_t decode_align(std::size_t x) { return (x + 127) / 128 * 128; }

constexpr DecodeLayout decode_layout(int head_dim, int warps) {
  DecodeLayout L{};
  L.warps = warps;
  L.threads = 32 * warps;
  L.block_n = 16 * warps;
  L.ld_qkv = head_dim + 8;
  L.ld_s = 16 + 4;
  L.ld_o = head_dim + 4;
  L.kv_stage_bytes = decode_align(std::size_t(L.block_n) * L.ld_qkv * 2);
  L.merge_bytes = std::size_t(warps) * kDecodeRows * L.ld_o * 4;
  L.off_q = 0;
  L.off_k = decode_align(std::size_t(kDecodeRows) * L.ld_qkv * 2);
  L.off_v = L.off_k + kDecodeStages * L.kv_stage_bytes;
  L.off_s = L.off_v + kDecodeStages * L.kv_stage_bytes;
  // Element offsets of the K and V rows of each stage's tile (int64): the pages are resolved
  // once per row, not per 16-byte chunk.
  L.off_rows = L.off_s + decode_align(std::size_t(warps) * kDecodeRows * L.ld_s * 4);
  // Per warp and row: lse, and the merge weights wa, wb (floats); the CTA's lse per row.
  L.off_stats = L.off_rows + decode_align(std::size_t(kDecodeStages) * 2 * L.block_n * 8);
  L.bytes = L.off_stats + decode_align((3 * std::size_t(warps) + 1) * kDecodeRows * 4);
  return L;
}

// The warps per CTA: 4 (64-key tiles) where the device has the shared memory; else 2 (32-key
// tiles) for the head dims whose 4-warp layout exceeds the smallest sm_80+ opt-in (only those
// have the 2-warp kernel compiled); else 0: no kernel fits.
constexpr bool decode_has_fallback(int head_dim) {
  return decode_layout(head_dim, 4).bytes > kDecodeSmallestOptin;
}
inline int pick_decode_warps(int head_dim, int smem_optin) {
  const auto optin = static_cast<std::size_t>(smem_optin);
  if (decode_layout(head_dim, 4).bytes <= optin) return 4;
  if (decode_has_fallback(head_dim) && decode_layout(head_dim, 2).bytes <= optin) return 2;
  return 0;
}

// Chunks of kDecodeRows rows per kv head (at least one, so that a call with seqlen_q 0 still
// has a valid grid; the launcher does not launch then).
inline int64_t decode_row_chunks(int64_t group, int64_t seqlen_q) {
  return std::max<int64_t>(1, detail::ceil_div(group * seqlen_q, kDecodeRows));
}

// The keys a sequence's query rows see: [col_begin(0), col_end(seqlen_q - 1)) of its mask
// (both are non-decreasing in the row); empty (begin >= end) when none sees any.
struct KeyRange {
  int64_t begin, end;
};
FLASHDL_HD KeyRange visible_keys(const detail::Mask& mask) {
  if (mask.seqlen_q <= 0) return {0, 0};
  return {mask.col_begin(0), mask.col_end(mask.seqlen_q - 1)};
}

// Split s of `splits` of the visible keys: whole tiles from the range's start (the last split
// shorter, trailing ones empty), so the splits partition the range in order and a window's
// keys, not the whole cache, are what gets divided.
FLASHDL_HD KeyRange split_keys(KeyRange visible, int64_t s, int64_t splits, int64_t tile) {
  if (visible.end <= visible.begin) return {visible.begin, visible.begin};
  const int64_t n = visible.end - visible.begin;
  const int64_t chunk = detail::round_up(detail::ceil_div(n, splits), tile);
  const int64_t b = s * chunk < n ? visible.begin + s * chunk : visible.end;
  return {b, b + chunk < visible.end ? b + chunk : visible.end};
}

// Splits per (batch, kv head, row chunk): the caller's num_splits (capped by the longest visible
// range's tiles: more would only be empty), else 1 when the CTAs without splitting already cover
// every SM, else enough to give each SM two CTAs (one loads while the other computes) as long as
// every split keeps kDecodeMinSplitKeys keys, at most kDecodeMaxSplits.
inline int64_t decode_num_splits(int64_t requested, int64_t ctas, int64_t max_keys, int block_n,
                                 int sm_count) {
  const int64_t tiles = std::max<int64_t>(1, detail::ceil_div(max_keys, block_n));
  if (requested > 0) return std::min(requested, tiles);
  if (ctas >= sm_count) return 1;
  const int64_t want = detail::ceil_div(int64_t{2} * sm_count, std::max<int64_t>(ctas, 1));
  const int64_t most = std::max<int64_t>(1, max_keys / kDecodeMinSplitKeys);
  return std::max<int64_t>(1, std::min({want, most, tiles, kDecodeMaxSplits}));
}

// The float32 partial results of a split call: per (batch, split, row), row = head * seqlen_q +
// query (the rows of kv head hk are contiguous: hk * group * seqlen_q onward), the normalised
// O (head_dim floats) and its lse.
struct DecodeWorkspace {
  int64_t rows;    // nheads * seqlen_q
  int64_t o, lse;  // floats of each part
  int64_t floats() const { return o + lse; }
};
inline DecodeWorkspace decode_workspace(int64_t batch, int64_t splits, int64_t nheads,
                                        int64_t seqlen_q, int64_t head_dim) {
  DecodeWorkspace w{};
  w.rows = nheads * seqlen_q;
  w.lse = splits > 1 ? batch * splits * w.rows : 0;
  w.o = w.lse * head_dim;
  return w;
}

}  // namespace flashdl::cuda
