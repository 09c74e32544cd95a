// The CPU schedules compiled for one instruction set (generic); see cmake/FlashdlCpuIsa.cmake.
#define FLASHDL_ISA_NS isa_generic
#include "cpu/kernels.inl"

namespace flashdl::cpu {

const KernelTable& kernels_generic() {
  static const KernelTable table{"generic", [] { return true; }, &isa_generic::fa1_forward,
                                 &isa_generic::fa1_backward, &isa_generic::fa2_forward,
                                 &isa_generic::fa2_backward};
  return table;
}

}  // namespace flashdl::cpu
