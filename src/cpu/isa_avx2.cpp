// The CPU schedules compiled for avx2,fma,f16c; picked at run time by backend.cpp.
#include "cpu/kernels_deps.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define FLASHDL_ISA_NS isa_avx2
#define FLASHDL_VEC_BYTES 32
#define FLASHDL_HAVE_F16C 1
#include "cpu/kernels.inl"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashdl::cpu {

const KernelTable& kernels_avx2() {
  static const KernelTable table{
      "avx2",
      [] {
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                 __builtin_cpu_supports("f16c");
      },
      &isa_avx2::fa1_forward, &isa_avx2::fa1_backward, &isa_avx2::fa2_forward,
      &isa_avx2::fa2_backward,
      &isa_avx2::kvcache_forward};
  return table;
}

}  // namespace flashdl::cpu
