// The CPU schedules compiled for one instruction set (avx2); see cmake/FlashdlCpuIsa.cmake.
#define FLASHDL_ISA_NS isa_avx2
#include "cpu/kernels.inl"

namespace flashdl::cpu {

const KernelTable& kernels_avx2() {
  static const KernelTable table{"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }, &isa_avx2::fa1_forward,
                                 &isa_avx2::fa1_backward, &isa_avx2::fa2_forward,
                                 &isa_avx2::fa2_backward};
  return table;
}

}  // namespace flashdl::cpu
