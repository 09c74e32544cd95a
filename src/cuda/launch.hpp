// The launchers runtime.cu dispatches to. Each (dtype, head dim) pair is explicitly instantiated in
// its own generated translation units (fwd_instantiate.cu.in, bwd_instantiate.cu.in), so the CUDA build parallelises and a
// change to one schedule recompiles only what it must.
#pragma once

#include <vector>

#include "backend.hpp"
#include "check.hpp"
#include "flashdl/params.hpp"

namespace flashdl::cuda {

// Algorithm 1 of FlashAttention: one CTA per (batch, head), K/V blocks outer, Q blocks inner, O, l
// and m in global memory between K/V blocks.
template <typename T, int kHeadDim>
void launch_fa1_forward(const Params& p, const LaunchContext& ctx);

// The FlashAttention-2 forward: one CTA per (Q block, head, batch), K/V streamed through shared
// memory, normalisation deferred to the end, lse for the backward pass.
template <typename T, int kHeadDim>
void launch_fa2_forward(const Params& p, const LaunchContext& ctx);

// Algorithm 4 of FlashAttention: one CTA per (batch, kv head), key blocks outer, query blocks
// inner, dQ read, updated and written back in global memory for every pair.
template <typename T, int kHeadDim>
void launch_fa1_backward(const Params& p, const LaunchContext& ctx);

// The FlashAttention-2 backward: preprocessing (D, lse2), one CTA per (key block, kv head, batch)
// with dK, dV in registers, dQ by float atomics or, deterministic, by a pass over query blocks.
template <typename T, int kHeadDim>
void launch_fa2_backward(const Params& p, const LaunchContext& ctx);

// Attention over a KV cache (kvcache.cu): plans the decode launch (refusing what no kernel
// serves before anything is written), copies seqused_k and block_table to the device, appends the
// new keys and values, then the decode kernel and, with several key splits, their combine.
void run_kvcache(const Params& p, const KvAppend& append, const LaunchContext& ctx);

// dSinks (Params::dsinks_ptr) of a backward call from out, dout and lse, on `stream` after the
// backward kernels (extras.cu): one CTA per head, a fixed summation order.
void run_sinks_backward(const Params& p, cudaStream_t stream);

// dBias (Params::dbias_ptr): the elements of its float32 accumulator (LaunchContext::dbias_acc;
// 0 without dbias), and the conversion into dbias after the backward kernels (extras.cu).
int64_t dbias_acc_elements(const Params& p);
void run_dbias_convert(const Params& p, const float* acc, cudaStream_t stream);

// merge_states on CUDA arrays (merge.cu), validated by src/merge.cpp.
void run_merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                      const TensorView& out, const TensorView& lse, cudaStream_t stream);

}  // namespace flashdl::cuda
