// What a caller asks of an attention call besides its arrays: the schedule and the Options.
#pragma once

#include <cstdint>
#include <limits>

#include "flashdl/tensor.hpp"

namespace flashdl {

// fa1: Algorithm 1/4 of the FlashAttention paper as written. fa2: the FlashAttention-2 schedule.
// reference: naive float64 attention that materialises the N x N matrix (the test oracle).
enum class Schedule : int { automatic = 0, fa1 = 1, fa2 = 2, reference = 3 };

const char* schedule_name(Schedule s);

struct Options {
  double softmax_scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1/sqrt(headdim)
  bool causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded
  Schedule schedule = Schedule::automatic;
  float dropout_p = 0.0f;
  uint64_t seed = 0;
  uint64_t offset = 0;
  // Where this call sits in a larger one, for the dropout mask alone (tensor / data parallelism
  // by hand, flashdl.jax's sharded calls): element (b, h, i, j) of this call is dropped as
  // element (b + dropout_batch_offset, h + dropout_head_offset, i, j) of a call with
  // dropout_nheads_total heads (0: this call's nheads) would be, so a call on a batch / head
  // slice of q, k, v draws exactly that slice of the whole call's mask. Offsets >= 0; the
  // head range [dropout_head_offset, dropout_head_offset + nheads) must fit in
  // dropout_nheads_total.
  int64_t dropout_batch_offset = 0;
  int64_t dropout_head_offset = 0;
  int64_t dropout_nheads_total = 0;
  bool deterministic = false;
  void* stream = nullptr;  // cudaStream_t for CUDA work; ignored on the CPU
  int64_t sram_bytes = 0;  // fa1 on-chip budget M in bytes; 0: from the device (CPU: L2 cache)
  int num_threads = 0;     // CPU threads; 0: the library default

  // Block-sparse attention: a bool view (nblocks_q, nblocks_k) shared by every batch and head, or
  // (batch or 1, nheads or 1, nblocks_q, nblocks_k), over blocks of block_size_q query rows by
  // block_size_k keys (nblocks = ceil(seqlen / block_size)). Key j is visible to query i only
  // where block (i / block_size_q, j / block_size_k) is true, on top of causal and the window;
  // zero blocks are never loaded or computed. Undefined (rank 0, the default): dense.
  TensorView block_mask{};
  int64_t block_size_q = 128;
  int64_t block_size_k = 128;

  // Score modifiers (detail/score_mod.hpp), flash-attn's conventions. alibi_slopes: float32
  // (nheads,) or (batch, nheads) on the device of q; query i of head h gets
  // -slope_h * |i + seqlen_k - seqlen_q - j| added to its scaled score at key j (after the cap,
  // before the mask); not differentiated. Undefined (rank 0, the default): no bias.
  // softcap > 0: scaled scores become softcap * tanh(score / softcap); 0: off.
  TensorView alibi_slopes{};
  double softcap = 0.0;

  // forward_kvcache: key splits per (batch, kv head), merged exactly; 0 chooses.
  int64_t num_splits = 0;

  // An additive attention bias: float32, float16 or bfloat16 (batch or 1, nheads or 1, seqlen_q or
  // 1, seqlen_k), any stride (a stride of 0 broadcasts like a size-1 axis), read tile by tile in
  // place. Added (natural-log units) to the scaled score after the softcap and ALiBi, before the
  // window and causal masks. Varlen calls: (nheads or 1, total_q or 1, max_seqlen_k), row r of
  // the packed queries, columns counted from its sequence's first key. NaN or +inf where a row
  // sees the key poisons that row: the caller's. Undefined (rank 0, the default): none.
  TensorView bias{};
  // A boolean mask (True = keep) with the bias's shapes and broadcasting: key j is visible to
  // query i only where it is true (on top of causal, the window and block masks); a row with no
  // key kept follows the empty-row rule. Tiles whose mask block is all false are skipped.
  TensorView mask{};
  // backward only, with a bias: receives dBias, the bias's shape and dtype (a size-1 axis holds
  // the sum over the axis it broadcasts along). Undefined: not computed.
  TensorView dbias{};

  // Attention sinks (gpt-oss, StreamingLLM): float32 (nheads,), one logit per query head that
  // joins every row's softmax denominator and carries no value: lse includes it (a row that sees
  // no key then has lse = sink and out 0), out excludes it. Finite values (checked on the host).
  // Host sinks are checked finite; device ones are not read on the host. Undefined (rank 0, the
  // default): none.
  TensorView sinks{};
  // backward only, with sinks: float32 (nheads,) receives
  // dSinks[h] = -sum over batches and rows of exp(sink_h - lse_i) * D_i, D_i = rowsum(dO * O).
  // Undefined: not computed.
  TensorView dsinks{};

  // Check the arguments and return without computing or writing anything (forward, backward and
  // their varlen forms). The values in host cu_seqlens are not read then: the check covers
  // shapes, dtypes, devices, strides, overlaps and options, for callers (flashdl.jax at trace
  // time) that know the shapes of arrays whose contents do not exist yet.
  bool validate_only = false;
};

}  // namespace flashdl
