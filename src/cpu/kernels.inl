// The CPU schedules, compiled once per instruction set: each isa_*.cpp defines FLASHDL_ISA_NS and
// includes this file with its own compiler flags, so every copy lives in its own namespace and
// none can be merged with another at link time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "cpu/convert.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/philox.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"

#if defined(__AVX512F__)
#define FLASHDL_VEC_BYTES 64
#elif defined(__AVX2__)
#define FLASHDL_VEC_BYTES 32
#else
#define FLASHDL_VEC_BYTES 16
#endif

namespace flashdl::cpu::FLASHDL_ISA_NS {

// clang-format off
#include "cpu/simd.inl"
#include "cpu/gemm.inl"
#include "cpu/pack.inl"
#include "cpu/blocks.inl"
#include "cpu/fa1.inl"
#include "cpu/fa2.inl"
// clang-format on

}  // namespace flashdl::cpu::FLASHDL_ISA_NS
