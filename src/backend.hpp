// The interface dispatch.cpp (and varlen.cpp's per-sequence batches) call. Each backend receives
// a validated Params and trusts it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flashdl/params.hpp"

namespace flashdl {

// The new keys and values of a KV-cache call (src/kvcache.cpp), (batch, seqlen_new, nheads_kv,
// headdim) with element strides, to be written into the cache by the backend (cpu::, cuda::
// forward_kvcache) at positions seqused_k[b] - seqlen_new onward. seqlen_new 0 (or null
// pointers): nothing to append.
struct KvAppend {
  const void* k_ptr = nullptr;
  const void* v_ptr = nullptr;
  int64_t seqlen_new = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  // Rotary embedding (rotary_dim 0: off; src/kvcache.cpp checked it): the new keys are rotated
  // as they are written, row j at position cache_seqlens[b] + j; q is rotated into a buffer at
  // cache_seqlens[b] + row (rotary_per_row_q) or cache_seqlens[b], before the attention.
  // rotary_cos/sin (seqlen_ro, rotary_dim / 2) in the dtype of q on its device, row strides in
  // elements; cache_seqlens a host array (batch,).
  const void* rotary_cos = nullptr;
  const void* rotary_sin = nullptr;
  int64_t rotary_cos_stride = 0, rotary_sin_stride = 0, rotary_dim = 0;
  bool rotary_interleaved = false, rotary_per_row_q = false;
  const int32_t* cache_seqlens = nullptr;
};

// The keys and values a paged (or seqused_k) varlen call reads (src/varlen.cpp checked the tables
// on the host and built these), to be gathered into contiguous (total, nheads_kv, headdim)
// buffers: key j of sequence b (cu_k[b] <= cu_k[b] + j < cu_k[b + 1]) is row j % page_size of
// page table[b * pages + j / page_size] of k (num_pages, page_size, nheads_kv, headdim), or, with
// page_size 0, row table[b] + j of k (total_k, nheads_kv, headdim). Likewise v.
struct KvGather {
  TensorView k, v;
  int64_t page_size = 0;       // 0: not paged
  int64_t pages = 0;           // a row of table (paged): the most pages any sequence reads
  std::vector<int32_t> table;  // (batch, pages) page ids, or (batch,) first rows
  std::vector<int32_t> cu_k;   // (batch + 1,) offsets of the gathered rows
  void* stream = nullptr;      // cudaStream_t
};

// Gathered keys and values in device memory, ordered on the call's stream: release() frees them
// on the stream behind the work queued so far (the destructor does on an error path).
class GatheredKv {
 public:
  virtual ~GatheredKv() = default;
  virtual void release() = 0;
  void* k = nullptr;
  void* v = nullptr;
};

namespace cpu {
void forward(const Params& params);
void backward(const Params& params);
// Independent problems (the sequences of a varlen batch), run over the threads together.
void forward_batch(const std::vector<Params>& problems);
void backward_batch(const std::vector<Params>& problems);
// dsinks[h] = -sum over batches and rows of exp(sink_h - lse) * rowsum(dout * out), from the
// arrays of a backward Params (after its kernels; the same for every schedule). Deterministic.
void sinks_backward(const Params& params);
// Attention over a KV cache (Params.seqused_k and block_table in host memory, checked): the
// rotary embedding and the append (src/cpu/kvcache.cpp), then the attention.
void forward_kvcache(const Params& params, const KvAppend& append);
std::string isa_name();        // the vector kernels picked at run time
int num_threads();             // threads the next call uses
void set_num_threads(int n);   // 0: default
int64_t default_sram_bytes();  // fa1 on-chip budget M: the per-core L2 cache
}  // namespace cpu

namespace cuda {
bool compiled();                        // false in a build without the CUDA backend
std::string architectures();            // the CUDA_ARCHITECTURES compiled in
int device_count(std::string* status);  // never throws; status says why 0
void forward(const Params& params);
void backward(const Params& params);
// Attention over a KV cache (Params.seqused_k and block_table in host memory, checked): the
// append and the attention on the device of q, on params.stream. Plans (and refuses) before it
// writes the cache.
void forward_kvcache(const Params& params, const KvAppend& append);
// The gather of a paged varlen call (KvGather) on the device of k, on g.stream.
std::unique_ptr<GatheredKv> gather_kv(const KvGather& g);
// merge_states (src/merge.cpp, validated there) on the arrays' device, on `stream`.
void merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                  const TensorView& out, const TensorView& lse, void* stream);
// copy_to_host (api.cpp): `bytes` bytes at `src` on CUDA device `device` into host memory `dst`,
// on `stream`, then waits for that stream.
void copy_to_host(void* dst, const void* src, std::size_t bytes, int device, void* stream);
}  // namespace cuda

}  // namespace flashdl
