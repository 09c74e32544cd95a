// flashdl's XLA FFI handlers (xla_ffi.cpp): the custom calls flashdl.jax lowers to. Each handler
// decodes XLA's call frame into TensorViews and Options and calls the C++ core, so a jitted JAX
// program runs flashdl's kernels on XLA's buffers (and, on CUDA, XLA's stream) with no host round
// trip. No jax, jaxlib or nanobind headers: the ABI is declared in xla_ffi_abi.hpp.
#pragma once

#include <vector>

#include "xla_ffi_abi.hpp"

namespace flashdl::xla_ffi {

struct Target {
  const char* name;      // the custom-call target name flashdl.jax passes to jax.ffi.ffi_call
  const char* platform;  // "cpu" or "CUDA", as jax.ffi.register_ffi_target takes it
  xla_abi::Handler* handler;
};

// The targets of this build: the CPU handlers always, the CUDA ones when CUDA is compiled in.
//
// flashdl_attention_fwd (q, k, v) -> (out, lse) and flashdl_attention_bwd (dout, q, k, v, out,
// lse) -> (dq, dk, dv): flashdl::forward / backward; every leading axis before the last three of
// q (the last two of lse) folds into the batch, which is how jax.vmap's broadcast_all batching
// reaches them. flashdl_attention_varlen_fwd (q, k, v, cu_seqlens_q, cu_seqlens_k) -> (out, lse)
// and flashdl_attention_varlen_bwd (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k) -> (dq,
// dk, dv): forward_varlen / backward_varlen. Attributes: causal (bool), softmax_scale (float, NaN:
// 1/sqrt(headdim)), window_left, window_right (int), schedule (string), softcap (float),
// deterministic (bool, backward), max_seqlen_q, max_seqlen_k (int, varlen). Optional, after the
// fixed arguments of the four: block_mask (pred, attribute has_block_mask, with block_size_q,
// block_size_k), alibi_slopes (f32, has_alibi), seed (u32 (2,), when the attribute dropout_p > 0;
// attribute offset), folded like q's batch.
//
// flashdl_attention_kvcache (q, k_cache, v_cache, cache_seqlens[, k, v][, block_table]
// [, alibi_slopes]) -> (out, lse[, k_cache, v_cache]): flashdl::forward_kvcache, the updated
// caches aliasing the argument caches (attributes has_new, has_block_table, has_alibi,
// num_splits). flashdl_merge_states (outs..., lses...) -> (out, lse): flashdl::merge_states.
std::vector<Target> targets();

}  // namespace flashdl::xla_ffi
