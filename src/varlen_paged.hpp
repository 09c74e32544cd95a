// The paged (or seqused_k) form of forward_varlen (flash-attn's block_table and seqused_k): the
// tables checked on the host, then the keys and values each sequence reads gathered into
// contiguous buffers for the contiguous varlen path. src/varlen_paged.cpp.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend.hpp"
#include "flashdl/api.hpp"

namespace flashdl {

// Keys and values gathered from the pages (or rows) a paged / seqused_k call reads: contiguous
// (total, nheads_kv, headdim) buffers (host memory, or the CUDA backend's stream-ordered device
// buffers) and their offsets, for the contiguous path.
struct Gathered {
  std::unique_ptr<unsigned char[]> k, v;  // not value-initialised: every byte is copied over
  std::unique_ptr<GatheredKv> device;     // CUDA
  std::vector<int32_t> cu_k;
  TensorView kt, vt, cut;
};

// The paged (or seqused_k) form of forward_varlen, checked and gathered: by memcpy on the CPU,
// by the CUDA backend's gather kernel (src/cuda/gather.cu) on the call's stream for CUDA arrays,
// after the same checks of the same host tables. Returns false for validate_only (the layout
// checked, nothing read).
bool gather_paged(const TensorView& q, const TensorView& k, const TensorView& v,
                  const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                  const TensorView& out, const TensorView& lse, const PagedKv& pk,
                  const Options& options, Gathered& g);

}  // namespace flashdl
