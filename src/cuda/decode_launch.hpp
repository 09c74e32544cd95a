// The decode launchers kvcache.cu calls. Each (dtype, head dim) pair is instantiated in its own
// generated translation unit (decode_instantiate.cu.in), like the forward and backward launchers.
#pragma once

#include <cstdint>

#include "check.hpp"
#include "flashdl/params.hpp"
#include "score_mods.cuh"

namespace flashdl::cuda {

// What a decode launch needs beyond Params (whose seqused_k and block_table are device arrays
// by then) and the device: the plan of kvcache.cu.
struct DecodeArgs {
  int64_t splits;      // key splits per (batch, kv head, row chunk); grid.x = splits * row_chunks
  int64_t row_chunks;  // chunks of kDecodeRows query rows per kv head
  float* o_part;       // splits > 1: the partial results (decode_workspace), else null
  float* lse_part;
  ScoreModF mods;  // the call's part of the score modifiers (call_score_mods)
  bool vec_load;   // q and cache rows on 16-byte boundaries: cp.async
  bool vec_store;  // out rows on 16-byte boundaries: 16-byte stores
};

// Attention of every query row over its sequence's keys in the cache, one CTA per (split and row
// chunk, kv head, batch), with `warps` warps (pick_decode_warps: 4, or 2 where compiled).
template <typename T, int kHeadDim>
void launch_decode(const Params& p, const DecodeArgs& a, int warps, const LaunchContext& ctx);

}  // namespace flashdl::cuda
