// The CPU schedules, compiled once per instruction set. Each isa_*.cpp includes kernels_deps.hpp,
// switches the compiler's target on (pragma), defines FLASHDL_ISA_NS, FLASHDL_VEC_BYTES and
// FLASHDL_HAVE_F16C, and includes this file: every copy lives in its own namespace, and only the
// functions defined here carry the wider instructions.
#if !defined(FLASHDL_ISA_NS) || !defined(FLASHDL_VEC_BYTES) || !defined(FLASHDL_HAVE_F16C)
#error \
    "include kernels.inl from an isa_*.cpp that defines FLASHDL_ISA_NS, FLASHDL_VEC_BYTES, FLASHDL_HAVE_F16C"
#endif

// FLASHDL_HAVE_BF16_DOT (AVX512_BF16 copies only): bfloat16 products with vdpbf16ps.
#ifndef FLASHDL_HAVE_BF16_DOT
#define FLASHDL_HAVE_BF16_DOT 0
#endif

namespace flashdl::cpu::FLASHDL_ISA_NS {

// clang-format off
#include "cpu/simd.inl"
#include "cpu/gemm.inl"
#include "cpu/pack.inl"
#include "cpu/blocks.inl"
#if FLASHDL_HAVE_BF16_DOT
#include "cpu/bf16dot.inl"
#endif
#include "cpu/fa1.inl"
#include "cpu/bwd_memory.inl"
#include "cpu/fa2.inl"
#include "cpu/kvcache.inl"
// clang-format on

}  // namespace flashdl::cpu::FLASHDL_ISA_NS
