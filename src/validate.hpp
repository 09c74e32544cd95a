// The library's internal validation toolkit: every check that names an argument, the filling of
// Params from validated views, and the dispatch to a backend. Used by api.cpp and varlen.cpp only.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "flashdl/api.hpp"

namespace flashdl::validate {

struct Shapes {
  int64_t batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim;
};

[[noreturn]] void fail(ErrorKind kind, const std::string& msg);
// A number in an error message as the caller wrote it: the shortest text that reads back exactly.
std::string num_str(double x);
std::string num_str(float x);
std::string shape_str(const TensorView& t);
std::string shape_str(std::initializer_list<int64_t> shape);

void check_rank(const char* name, const TensorView& t, int rank, const char* layout);
void check_shape(const char* name, const TensorView& t, std::initializer_list<int64_t> shape,
                 const char* layout);
void check_dtype(const char* name, const TensorView& t, DType expected, const char* why);
// An int32 index table in host memory (block tables, cache lengths, batch indices): its rank,
// dtype and device, named `name` in errors; and its element (i, j), any strides.
void check_host_int32(const char* name, const TensorView& t, int rank, const char* layout);
inline int64_t host_int32(const TensorView& t, int64_t i, int64_t j = 0) {
  const auto* base = static_cast<const int32_t*>(t.data);
  return base[i * t.strides[0] + (t.rank > 1 ? j * t.strides[1] : 0)];
}
void check_device(const char* name, const TensorView& t, Device expected);
void check_last_dim_contiguous(const char* name, const TensorView& t);
// out (written) and in share no byte: their memory spans are disjoint, or they are views of the
// same shape and strides whose elements interleave without a common one (k and v sliced from one
// packed buffer). Otherwise ValueError naming out and in.
void check_no_overlap(const char* out_name, const TensorView& out, const char* in_name,
                      const TensorView& in);
// A written array addresses each element through one index only (a sufficient condition, exact
// for stride 0: see validate.cpp). Otherwise ValueError naming it.
void check_no_self_overlap(const char* name, const TensorView& t);

// The block-sparse mask and block sizes of `o` for a problem of extents `s` (for varlen: the
// batch of sequences and max_seqlen) whose arrays live on `device`, and that none of the call's
// `outputs` overlaps the mask. Only the block sizes when o.block_mask is undefined. Called by each
// entry point, after its other checks.
using NamedView = std::pair<const char*, const TensorView*>;
void check_block_mask(const Options& o, const Shapes& s, Device device,
                      std::initializer_list<NamedView> outputs);

// softcap, and the ALiBi slopes of `o` for a problem of extents `s` (for varlen: the batch of
// sequences) on `device`, that none of `outputs` overlaps them. Called beside check_block_mask.
void check_score_mods(const Options& o, const Shapes& s, Device device,
                      std::initializer_list<NamedView> outputs);

// The bias, mask and sinks (and the backward's dbias, dsinks) of `o` for a problem of extents `s` on `device`, that
// none of `outputs` overlaps them; NotImplementedError on CUDA. Called by the dense and varlen
// entry points beside check_score_mods.
// Bias and mask: broadcastable to (batch, nheads, seqlen_q, seqlen_k), or for varlen
// (varlen_total_q >= 0) to (nheads, varlen_total_q, max_seqlen_k); dbias: the bias's shape and
// dtype.
void check_extras(const Options& o, const Shapes& s, Device device,
                  std::initializer_list<NamedView> outputs, int64_t varlen_total_q = -1);
// The gradients of the extras (dbias, dsinks) zeroed: before the kernels, which add into dbias
// only where some row sees the key, and for calls with nothing to compute.
// With zero_dbias false, dbias is left as it is (dbias_written_by_kernels said the kernels store
// every element of it).
void zero_extra_grads(const Options& o, bool zero_dbias = true);
// Whether the CPU backward of p stores every element of dbias itself, so that zeroing it first
// is wasted (for a (1, 8, 2048, 2048) float32 bias the zeroing was 128 MiB of single-threaded
// page faults and stores, benchmarks/results/bias_mask_sinks_cpu.md): fa1 or fa2 with dbias as
// large as the problem (stored directly, one element per score) and no window, causal, block
// or boolean mask (no tile pair skipped). The reference schedule stores only where P != 0.
bool dbias_written_by_kernels(const Params& p);
// Asks Linux for transparent huge pages on the 2 MiB-aligned interior of a contiguous CPU output
// of at least 4 MiB before its first write (advice only: contents are untouched; elsewhere a
// no-op). For a full-size dBias left unzeroed (dbias_written_by_kernels) the kernels' stores
// then fault 2 MiB pages, not 4 KiB ones, and its rows (one page each at 4 KiB) stop missing the
// TLB.
void advise_huge_pages(const TensorView& t);
// NotImplementedError naming bias or mask given to an entry `path` that does not run them yet (the
// KV cache, which takes sinks).
void refuse_bias_and_mask(const Options& o, const char* path);

// Checks q, k, v, out, lse and the options; returns the problem's extents.
Shapes check_attention_args(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& lse, const Options& o);
// The backward's checks: check_attention_args plus dout, dq, dk, dv.
Shapes check_backward_args(const TensorView& dout, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const TensorView& dq, const TensorView& dk, const TensorView& dv,
                           const Options& options);

Params make_params(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const TensorView& lse, const Options& o,
                   const Shapes& s);
Params make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const Options& options, const Shapes& s);

void dispatch_forward(const Params& p);
void dispatch_backward(const Params& p);

}  // namespace flashdl::validate
