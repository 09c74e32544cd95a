// The one flat Params of a call, filled from views and options validate.hpp has checked (and
// nothing checked here). src/fill_params.cpp.
#pragma once

#include "checks.hpp"
#include "flashdl/options.hpp"
#include "flashdl/params.hpp"

namespace flashdl {

// q, k, v, out, lse and the options of a problem of extents s (validate::check_attention_args).
Params make_params(const TensorView& q, const TensorView& k, const TensorView& v,
                   const TensorView& out, const TensorView& lse, const Options& o,
                   const validate::Shapes& s);
// make_params plus the backward's dout, dq, dk, dv (validate::check_backward_args).
Params make_backward_params(const TensorView& dout, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const Options& options, const validate::Shapes& s);

// Whether the CPU backward of p stores every element of dbias itself, so that zeroing it first
// is wasted (for a (1, 8, 2048, 2048) float32 bias the zeroing was 128 MiB of single-threaded
// page faults and stores, benchmarks/results/bias_mask_sinks_cpu.md): fa1 or fa2 with dbias as
// large as the problem (stored directly, one element per score) and no window, causal, block
// or boolean mask (no tile pair skipped). The reference schedule stores only where P != 0.
bool dbias_written_by_kernels(const Params& p);

}  // namespace flashdl
