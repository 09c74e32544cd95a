// Compile-time dispatch: dtype x head dim, each switch with a default branch that names the bad
// value. Everything else (schedule, causal, window, tails) is a runtime branch.
//
//   FLASHDL_DTYPE_SWITCH(p.dtype, T, [&] {
//     FLASHDL_HEADDIM_SWITCH(p.headdim, kHeadDim, [&] { launch<T, kHeadDim>(p); });
//   });
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "flashdl/error.hpp"
#include "flashdl/tensor.hpp"

#define FLASHDL_DTYPE_SWITCH(DTYPE, T, ...)                                                  \
  [&] {                                                                                      \
    switch (DTYPE) {                                                                         \
      case ::flashdl::DType::float16: {                                                      \
        using T = __half;                                                                    \
        return __VA_ARGS__();                                                                \
      }                                                                                      \
      case ::flashdl::DType::bfloat16: {                                                     \
        using T = __nv_bfloat16;                                                             \
        return __VA_ARGS__();                                                                \
      }                                                                                      \
      default:                                                                               \
        throw ::flashdl::Error(::flashdl::ErrorKind::type,                                   \
                               std::string("q: no CUDA kernel for dtype ") +                 \
                                   ::flashdl::dtype_name(DTYPE) + " (float16 or bfloat16)"); \
    }                                                                                        \
  }()

#define FLASHDL_HEADDIM_CASE(VALUE, NAME, ...) \
  case VALUE: {                                \
    constexpr int NAME = VALUE;                \
    return __VA_ARGS__();                      \
  }

#define FLASHDL_HEADDIM_SWITCH(HEADDIM, NAME, ...)                                                 \
  [&] {                                                                                            \
    switch (HEADDIM) {                                                                             \
      FLASHDL_HEADDIM_CASE(32, NAME, __VA_ARGS__)                                                  \
      FLASHDL_HEADDIM_CASE(64, NAME, __VA_ARGS__)                                                  \
      FLASHDL_HEADDIM_CASE(96, NAME, __VA_ARGS__)                                                  \
      FLASHDL_HEADDIM_CASE(128, NAME, __VA_ARGS__)                                                 \
      FLASHDL_HEADDIM_CASE(192, NAME, __VA_ARGS__)                                                 \
      FLASHDL_HEADDIM_CASE(256, NAME, __VA_ARGS__)                                                 \
      default:                                                                                     \
        throw ::flashdl::Error(::flashdl::ErrorKind::value, "q: no CUDA kernel for headdim " +     \
                                                                std::to_string(HEADDIM) +          \
                                                                " (32, 64, 96, 128, 192 or 256)"); \
    }                                                                                              \
  }()
