// The CPU schedules compiled for avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c,
// with the bfloat16 products of bf16dot.inl; picked at run time by backend.cpp.
#include "cpu/kernels_deps.hpp"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif
#define FLASHDL_ISA_NS isa_avx512bf16
#define FLASHDL_VEC_BYTES 64
#define FLASHDL_HAVE_F16C 1
#define FLASHDL_HAVE_BF16_DOT 1
#include "cpu/kernels.inl"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

namespace flashdl::cpu {

const KernelTable& kernels_avx512bf16() {
  static const KernelTable table{
      "avx512bf16",
      [] {
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
      },
      &isa_avx512bf16::fa1_forward, &isa_avx512bf16::fa1_backward, &isa_avx512bf16::fa2_forward,
      &isa_avx512bf16::fa2_backward,
      &isa_avx512bf16::kvcache_forward};
  return table;
}

}  // namespace flashdl::cpu
