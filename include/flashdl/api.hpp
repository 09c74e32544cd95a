// The public entry points. Every call validates its arguments before anything else
// (src/validate.cpp), picks the backend from the tensors' device and the schedule from the
// options, and throws flashdl::Error (error.hpp) naming the bad argument. Outputs are written in
// place (destination passing); inputs are never written.
//
// The public API is this header and those it includes (error.hpp, options.hpp, tensor.hpp).
// params.hpp and detail/ are not part of it: they are what the CPU and CUDA kernels share (the
// flat Params a backend receives, and the host+device math both backends run).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashdl/error.hpp"
#include "flashdl/options.hpp"
#include "flashdl/tensor.hpp"

namespace flashdl {

// q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_kv, headdim);
// out like q (dtype of q); lse float32 (batch, nheads, seqlen_q).
void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             const TensorView& lse, const Options& options);

// dq, dk, dv shaped and typed like q, k, v; out and lse as the forward returned them.
void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const TensorView& dq,
              const TensorView& dk, const TensorView& dv, const Options& options);

// Variable-length batches (flash-attn's varlen layout): the batch's sequences are packed along
// the first axis. q (total_q, nheads, headdim); k, v (total_k, nheads_kv, headdim); out like q;
// lse float32 (nheads, total_q). cu_seqlens_q, cu_seqlens_k: int32 (batch + 1,), cu[0] == 0,
// non-decreasing, cu[batch] == total; sequence b is rows [cu[b], cu[b + 1]) and no padding is
// computed. Every sequence length must be <= its
// max_seqlen. Causal masks and windows are aligned per sequence (bottom-right within each one).
// A sequence with no query rows writes nothing (and gets zero dk, dv in the backward); one with
// no keys gets out 0 and lse -inf. CUDA arrays: one launch for the whole batch; cu_seqlens on the
// host (checked, then copied to the device on the call's stream) or on the device of q (read by
// the kernels, not checked: bad offsets give unspecified results but are clamped into the arrays).
// Dropout: the mask of sequence b is keyed (seed, offset, b, head, row, col), rows and columns
// counted within the sequence -- the mask dense batch b would get. Options::block_mask:
// (nblocks_q, nblocks_k) or (batch or 1, nheads or 1, nblocks_q, nblocks_k) with nblocks from
// max_seqlen_q and max_seqlen_k; sequence b uses plane b, blocks counted from its first row/key.
//
// PagedKv (flash-attn's varlen block_table and seqused_k; undefined views: off), forward only.
// seqused_k int32 (batch,): sequence b uses only its first seqused_k[b] keys (<= its length in
// cu_seqlens_k); causal and windows align to that count. block_table int32 (batch,
// max_pages): k, v are paged caches (num_pages, page_size, nheads_kv, headdim) and key j of
// sequence b is row j % page_size of page block_table[b][j / page_size]; sequence b has
// cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys (or seqused_k[b]), which must fit its pages, and
// total_k (cu_seqlens_k[batch]) is not tied to k's first axis. Chunked prefill: the new query
// rows of a sequence against every key in its pages, causal aligned bottom-right. Host arrays
// (as cu_seqlens, which must then be host arrays too), checked; the pages a sequence reads are
// gathered into one contiguous buffer first, so the result equals, bit for bit, that of the same
// call on contiguous k, v. CUDA arrays: the same checks on the host, then the gather on the device
// of q, on options.stream, into stream-ordered buffers (2 * keys used * nheads_kv * headdim
// elements) freed behind the call (written, passes on the CUDA emulator, not yet run on a GPU).
struct PagedKv {
  TensorView block_table{};
  TensorView seqused_k{};
};

void forward_varlen(const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                    int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& out,
                    const TensorView& lse, const Options& options, const PagedKv& paged = {});

// dq, dk, dv shaped and typed like q, k, v; out and lse as forward_varlen returned them.
void backward_varlen(const TensorView& dout, const TensorView& q, const TensorView& k,
                     const TensorView& v, const TensorView& out, const TensorView& lse,
                     const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                     int64_t max_seqlen_q, int64_t max_seqlen_k, const TensorView& dq,
                     const TensorView& dk, const TensorView& dv, const Options& options);

// Attention over a KV cache, for decoding (flash-attn's flash_attn_with_kvcache). q (batch,
// seqlen_q, nheads, headdim); k_cache, v_cache (batch, seqlen_cache, nheads_kv, headdim), or paged
// (num_pages, page_size, nheads_kv, headdim) with block_table int32 (batch, max_pages) naming each
// sequence's pages in order (vLLM's layout); cache_seqlens int32 (batch,): the tokens already in
// each sequence's cache. cache_seqlens and block_table are host arrays, checked. k_new, v_new
// (batch, seqlen_new, nheads_kv, headdim) or undefined: written into the cache at positions
// cache_seqlens[b] onward -- the one case where flashdl writes a caller's array, done only after
// every check has passed, so a failing call writes nothing. Sequence b then attends to its first
// cache_seqlens[b] + seqlen_new keys; causal and windows align bottom-right per sequence. out like
// q, lse float32 (batch, nheads, seqlen_q). Options used: softmax_scale, causal, window,
// alibi_slopes, softcap, num_splits (key splits per (batch, kv head), merged exactly; 0:
// chosen), num_threads, stream; dropout and block masks are refused. CUDA arrays (float16,
// bfloat16): the append and the attention run on the device of q, on options.stream (k_new,
// v_new and the caches on that device; cache_seqlens and block_table stay host arrays, copied
// to the device on the stream).
//
// KvCacheExtras (flash-attn's names; undefined views: off). rotary_cos, rotary_sin (seqlen_ro,
// rotary_dim / 2), the dtype and device of q, rotary_dim <= headdim: the first rotary_dim
// columns of the new keys are rotated at positions cache_seqlens[b] + row before they are
// written (the cache holds rotated keys), and those of q at cache_seqlens[b] + row when causal or
// windowed, at cache_seqlens[b] for every row otherwise; interleaved: pairs (2i, 2i + 1) (GPT-J),
// else (i, i + rotary_dim / 2) (GPT-NeoX). Computed in float32 (float64 for float64), rounded
// once. cache_batch_idx int32 (batch,): sequence b reads and writes cache row
// cache_batch_idx[b] (contiguous caches only; distinct where k_new is appended). cache_leftpad
// int32 (batch,): the keys of sequence b before cache_leftpad[b] <= cache_seqlens[b] are
// invisible; causal, windows and ALiBi count from it (flash-attn's convention; rotary
// positions do not). Host arrays, checked before anything is written (copied to the device for
// CUDA calls, whose rotary tables are on the device of q).
struct KvCacheExtras {
  TensorView rotary_cos{};
  TensorView rotary_sin{};
  bool rotary_interleaved = false;
  TensorView cache_batch_idx{};
  TensorView cache_leftpad{};
};

void forward_kvcache(const TensorView& q, const TensorView& k_cache, const TensorView& v_cache,
                     const TensorView& cache_seqlens, const TensorView& k_new,
                     const TensorView& v_new, const TensorView& block_table, const TensorView& out,
                     const TensorView& lse, const Options& options,
                     const KvCacheExtras& extras = {});

// Merges attention results over disjoint key sets, exactly: outs[i] (batch, seqlen, nheads,
// headdim), lses[i] float32 (batch, nheads, seqlen), as attention returns them, into out (shape
// and dtype of outs[0]) and lse: lse = log sum_i exp(lses[i]), out = sum_i exp(lses[i] - lse)
// outs[i] (detail::merge_weights, in order). Partials with lse -inf (no key) weigh nothing.
// CUDA arrays (every dtype of the CPU path) are merged on their device, on `stream`
// (cudaStream_t; null: the legacy default stream), accumulating in float32 (float64 for
// float64).
void merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                  const TensorView& out, const TensorView& lse, void* stream = nullptr);

// The dropout keep-mask the kernels apply for (p, seed, offset): mask_out, bool
// (batch, nheads, seqlen_q, seqlen_k) on the CPU, any strides with a contiguous last dimension,
// is set true where element (b, h, i, j) is kept (then scaled by 1 / (1 - p)), i.e.
// detail::dropout_keep(p, seed, offset, b * nheads + h, i, j). p is rounded to float32 as
// Options.dropout_p is; it must lie in [0, 1), and offset below 2^32.
void dropout_mask(const TensorView& mask_out, double p, uint64_t seed, uint64_t offset);

// Copies the contiguous array `src` (CPU or CUDA) into host memory `dst` (src.numel() elements
// of its dtype). CUDA arrays: cudaMemcpyAsync on `stream` (cudaStream_t; null: the legacy
// default stream), then cudaStreamSynchronize(stream), so the host waits for all the work queued
// on that stream before it. For the XLA FFI handlers, which read a few bytes of a traced value
// (the dropout seed, the KV cache's tables) on the host. `name` names src in errors.
void copy_to_host(void* dst, const TensorView& src, void* stream, const char* name);

// "auto", "fa1", "fa2" or "reference"; anything else throws Error(value) naming `schedule`.
Schedule parse_schedule(const std::string& name);

// What this build and machine offer.
struct BuildInfo {
  std::string version;
  bool cuda_compiled;
  std::string cuda_architectures;  // e.g. "80;90", empty without CUDA
  int cuda_device_count;           // 0 when no driver or device; never throws
  std::string cuda_status;         // "ok", or why no device is usable
  std::string cpu_isa;     // the vector kernels in use: avx512, avx2, generic (FLASHDL_CPU_ISA)
  int cpu_threads;         // threads the CPU backend uses
  int64_t cpu_sram_bytes;  // the fa1 on-chip budget M the CPU backend uses by default
};

BuildInfo build_info();

// CPU threads for later calls; 0 restores the default (FLASHDL_NUM_THREADS or the core count).
void set_num_threads(int n);

}  // namespace flashdl
