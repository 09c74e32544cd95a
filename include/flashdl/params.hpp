// The one flat struct a backend receives (Params): not part of the public API (api.hpp) but what
// the CPU and CUDA kernels, and the math they share (detail/), read.
#pragma once

#include <cstdint>

#include "flashdl/options.hpp"
#include "flashdl/tensor.hpp"

namespace flashdl {

// One flat POD per call, filled by src/fill_params.cpp from arguments src/validate.cpp checked.
// Strides are in elements.
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

  Schedule schedule;  // never automatic here: fill_params.cpp resolves it
  // The caller asked for "auto" (resolved to fa2 above): a backend may pick another kernel for the
  // shape. The CPU runs few query rows over many keys with its KV-cache kernel (cpu/backend.cpp).
  bool auto_schedule;
  bool deterministic;
  void* stream;
  int64_t sram_bytes;
  int num_threads;
};

}  // namespace flashdl
