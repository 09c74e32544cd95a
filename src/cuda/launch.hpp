// The launchers runtime.cu dispatches to. Each (dtype, head dim) pair is explicitly instantiated in
// its own generated translation units (fwd_instantiate.cu.in, bwd_instantiate.cu.in), so the CUDA build parallelises and a
// change to one schedule recompiles only what it must.
#pragma once

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

}  // namespace flashdl::cuda
