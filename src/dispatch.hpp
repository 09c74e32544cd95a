// Validated Params to a backend (the CPU's or CUDA's, by the device of the arrays), and the
// preparation of outputs the kernels only add into. src/dispatch.cpp.
#pragma once

#include "flashdl/options.hpp"
#include "flashdl/params.hpp"

namespace flashdl {

struct KvAppend;

// The gradients of the extras (dbias, dsinks) zeroed: before the kernels, which add into dbias
// only where some row sees the key, and for calls with nothing to compute.
// With zero_dbias false, dbias is left as it is (dbias_written_by_kernels said the kernels store
// every element of it).
void zero_extra_grads(const Options& o, bool zero_dbias = true);
// Asks Linux for transparent huge pages on the 2 MiB-aligned interior of a contiguous CPU output
// of at least 4 MiB before its first write (advice only: contents are untouched; elsewhere a
// no-op). For a full-size dBias left unzeroed (dbias_written_by_kernels) the kernels' stores
// then fault 2 MiB pages, not 4 KiB ones, and its rows (one page each at 4 KiB) stop missing the
// TLB.
void advise_huge_pages(const TensorView& t);

void dispatch_forward(const Params& p);
// The backward, then (CPU) dsinks from the kernels' results.
void dispatch_backward(const Params& p);
// Attention over a KV cache (Params.seqused_k set; src/kvcache.cpp checked everything): the
// backend appends `append`'s new keys and values to the cache, then attends.
void dispatch_kvcache(const Params& p, const KvAppend& append);

}  // namespace flashdl
