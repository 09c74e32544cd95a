// The CPU schedules compiled for one instruction set (avx512); see cmake/FlashdlCpuIsa.cmake.
#define FLASHDL_ISA_NS isa_avx512
#include "cpu/kernels.inl"

namespace flashdl::cpu {

const KernelTable& kernels_avx512() {
  static const KernelTable table{"avx512", [] { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"); }, &isa_avx512::fa1_forward,
                                 &isa_avx512::fa1_backward, &isa_avx512::fa2_forward,
                                 &isa_avx512::fa2_backward};
  return table;
}

}  // namespace flashdl::cpu
