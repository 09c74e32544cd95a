// The CPU schedules and what they share: the kernel table picked by instruction set, the naive
// float64 reference, and the thread count of a call.
#pragma once

#include <cstdint>

#include "flashdl/params.hpp"

namespace flashdl::cpu {

// One instruction set's compiled copy of the fa1 and fa2 schedules and the KV-cache kernel
// (isa_*.cpp).
struct KernelTable {
  const char* name;
  bool (*supported)();  // does the running CPU have the instructions?
  void (*fa1_forward)(const Params& p, int threads, int64_t sram_bytes);
  void (*fa1_backward)(const Params& p, int threads, int64_t sram_bytes);
  void (*fa2_forward)(const Params& p, int threads);
  void (*fa2_backward)(const Params& p, int threads);
  void (*kvcache_forward)(const Params& p, int threads);  // Params.seqused_k set (kvcache.inl)
};

const KernelTable& kernels_generic();
#if defined(FLASHDL_X86_ISAS)
const KernelTable& kernels_avx2();
const KernelTable& kernels_avx512();
const KernelTable& kernels_avx512bf16();
#endif

void reference_forward(const Params& p, int threads);
void reference_backward(const Params& p, int threads);

}  // namespace flashdl::cpu
