// What a caller asks for (Options) and the one flat struct a backend receives (Params).
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
  void* stream = nullptr;     // cudaStream_t for CUDA work; ignored on the CPU
  int64_t sram_bytes = 0;     // fa1 on-chip budget M in bytes; 0: from the device (CPU: L2 cache)
  int num_threads = 0;        // CPU threads; 0: the library default

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

// One flat POD per call, filled and validated by api.cpp alone. Strides are in elements.
struct Params {
  DType dtype;
  Device device;

  const void* q_ptr;
  const void* k_ptr;
  const void* v_ptr;
  void* o_ptr;
  float* lse_ptr;

  // backward only (null in the forward)
  const void* do_ptr;
  void* dq_ptr;
  void* dk_ptr;
  void* dv_ptr;

  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
  int64_t h_h_k_ratio;  // nheads / nheads_kv

  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;
  int64_t do_batch_stride, do_row_stride, do_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;

  // double so the float64 path keeps its precision; float kernels round them once.
  double scale_softmax;       // applied to QK^T
  double scale_softmax_log2;  // scale_softmax * log2(e): the kernels work in the exp2 domain

  // Visibility window, resolved: causal is (left, 0). -1 = unbounded.
  bool is_causal;
  int64_t window_left, window_right;

  float p_dropout;  // probability of dropping
  uint64_t seed, offset;
  // The dropout plane of element (b, h, i, j) is keyed by
  // (b + dropout_batch_offset) * dropout_nheads + (h + dropout_head_offset) (detail::dropout_bh).
  // From Options (0, 0, nheads by default); varlen runs sequence s as a batch-1 call with s
  // added to the batch offset, so its mask is that of batch s.
  int64_t dropout_batch_offset;
  int64_t dropout_head_offset;
  int64_t dropout_nheads;

  // Variable-length batches in one launch (null: dense). Sequence b is rows [cu_seqlens_q[b],
  // cu_seqlens_q[b + 1]) of the packed q (and out, lse, dout, dq) and [cu_seqlens_k[b],
  // cu_seqlens_k[b + 1]) of k (v, dk, dv); batch counts sequences, seqlen_q and seqlen_k are the
  // max_seqlen bounds (grid sizes, workspace strides), batch strides are 0. Read on the device
  // through detail::sequence_of, which clamps every offset into [0, total] and every length to
  // its bound, so offsets never checked on the host (device arrays) stay memory-safe.
  const int32_t* cu_seqlens_q;
  const int32_t* cu_seqlens_k;
  int64_t cu_seqlens_q_stride, cu_seqlens_k_stride;  // in elements
  bool cu_seqlens_host;  // in host memory (checked by varlen.cpp); the backend copies them over
  int64_t total_q, total_k;

  // Block-sparse mask (null: dense): element (b, h, i, j) may be visible only where
  // block_mask[b, h, i / block_q, j / block_k] is non-zero. Strides in elements (bytes); a stride
  // of 0 broadcasts over batches or heads. Read through detail::block_mask_of.
  const uint8_t* block_mask_ptr;
  int64_t block_q, block_k;
  int64_t block_mask_batch_stride, block_mask_head_stride, block_mask_row_stride;

  // Score modifiers (null / 0: off), read through detail::score_mod_of. Slopes are float32;
  // strides in elements, a batch stride of 0 broadcasts (nheads,) slopes over the batch.
  const float* alibi_slopes_ptr;
  int64_t alibi_batch_stride, alibi_head_stride;
  double softcap;

  // Bias, mask and dBias (Options::bias, mask, dbias; null: none), read through
  // detail::HeadExtras. Strides in elements; a broadcast axis (size 1 or stride 0) has stride 0.
  // bias_batch, bias_heads, bias_rows: the bias's extents on the first three axes after
  // broadcasting (1 or the problem's), the shape dBias sums into.
  const void* bias_ptr;
  DType bias_dtype;
  int64_t bias_batch_stride, bias_head_stride, bias_row_stride, bias_col_stride;
  int64_t bias_batch, bias_heads, bias_rows;
  const uint8_t* mask_ptr;
  int64_t mask_batch_stride, mask_head_stride, mask_row_stride, mask_col_stride;
  void* dbias_ptr;
  int64_t dbias_batch_stride, dbias_head_stride, dbias_row_stride, dbias_col_stride;

  // Attention sinks (Options::sinks; null: none): float32 logit of head h at
  // sinks_ptr[h * sinks_stride], read through detail::sink_of. dsinks (the backward's, null: not
  // wanted) is written by the dispatch layer after the kernels (cpu::sinks_backward).
  const float* sinks_ptr;
  int64_t sinks_stride;
  float* dsinks_ptr;
  int64_t dsinks_stride;

  // Attention over a KV cache (src/kvcache.cpp; null: off). Sequence b attends to its first
  // seqused_k[b] keys (host memory, checked <= seqlen_k, the cache's capacity). Paged caches
  // (block_table non-null, int32 (batch, max_blocks), host memory, checked): key j of sequence b
  // is row j % page_size of page block_table[b][j / page_size], and k/v_batch_stride are the
  // strides between pages. num_splits: key splits per (batch, kv head), merged exactly
  // (split-KV decoding); 0 chooses from the shape and the thread count.
  // cache_batch_idx (contiguous caches): sequence b's cache row is cache_batch_idx[b].
  // cache_leftpad: key j of sequence b is cache position cache_leftpad[b] + j (its first keys
  // invisible; seqused_k counts from there). Host memory, checked; null: off.
  const int32_t* seqused_k;
  const int32_t* cache_batch_idx;
  const int32_t* cache_leftpad;
  const int32_t* block_table;
  int64_t block_table_batch_stride;
  int64_t page_size;
  int64_t num_splits;

  Schedule schedule;  // never automatic here: api.cpp resolves it
  // The caller asked for "auto" (resolved to fa2 above): a backend may pick another kernel for the
  // shape. The CPU runs few query rows over many keys with its KV-cache kernel (cpu/backend.cpp).
  bool auto_schedule;
  bool deterministic;
  void* stream;
  int64_t sram_bytes;
  int num_threads;
};

}  // namespace flashdl
