// cuda_pipeline.h's primitives for flashdl's CUDA host emulator. A cp.async copy is queued per
// thread and happens only when __pipeline_wait_prior retires its commit group (or the thread
// exits), so a tile read before its wait, or by another thread before the barrier that follows the
// wait, holds the old contents, as it may on the hardware. Sizes (4, 8 or 16 bytes), alignment and
// the destination (this block's shared memory) are checked.
#pragma once

#include <cstddef>

#include "runtime.hpp"

namespace flashdl_emu {
void pipeline_memcpy_async(void* dst, const void* src, std::size_t bytes, std::size_t zfill);
void pipeline_commit();
void pipeline_wait_prior(std::size_t prior);
}  // namespace flashdl_emu

inline void __pipeline_memcpy_async(void* dst, const void* src, std::size_t size_and_align,
                                    std::size_t zfill = 0) {
  ::flashdl_emu::pipeline_memcpy_async(dst, src, size_and_align, zfill);
}
inline void __pipeline_commit() { ::flashdl_emu::pipeline_commit(); }
inline void __pipeline_wait_prior(std::size_t prior) { ::flashdl_emu::pipeline_wait_prior(prior); }
