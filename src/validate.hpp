// Validation of the attention entry points (forward, backward, their varlen and KV-cache forms):
// their arrays, options, block masks, score modifiers and extras. Only checks: Params are filled
// in fill_params.hpp and dispatched in dispatch.hpp. src/validate.cpp.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "checks.hpp"
#include "flashdl/options.hpp"

namespace flashdl::validate {

// The block-sparse mask and block sizes of `o` for a problem of extents `s` (for varlen: the
// batch of sequences and max_seqlen) whose arrays live on `device`, and that none of the call's
// `outputs` overlaps the mask. Only the block sizes when o.block_mask is undefined. Called by each
// entry point, after its other checks.
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
// Checks q, k, v, out, lse and the options; returns the problem's extents.
Shapes check_attention_args(const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& lse, const Options& o);
// The backward's checks: check_attention_args plus dout, dq, dk, dv.
Shapes check_backward_args(const TensorView& dout, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const TensorView& dq, const TensorView& dk, const TensorView& dv,
                           const Options& options);

}  // namespace flashdl::validate
