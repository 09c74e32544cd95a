// The CPU schedules compiled for the baseline instruction set (SSE2 on x86-64, NEON on ARM); picked at run time by backend.cpp.
#include "cpu/kernels_deps.hpp"

#define FLASHDL_ISA_NS isa_generic
#define FLASHDL_VEC_BYTES 16
#define FLASHDL_HAVE_F16C 0
#include "cpu/kernels.inl"

namespace flashdl::cpu {

const KernelTable& kernels_generic() {
  static const KernelTable table{
      "generic",
      [] {
        return true;
      },
      &isa_generic::fa1_forward, &isa_generic::fa1_backward, &isa_generic::fa2_forward,
      &isa_generic::fa2_backward,
      &isa_generic::kvcache_forward};
  return table;
}

}  // namespace flashdl::cpu
