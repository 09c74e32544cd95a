// The C++ benchmarks' inputs (kernel_time.cpp, small_shapes_time.cpp, bwd_outputs.cpp): one float
// stored at element i of a byte buffer as float32, or as bfloat16 (its top 16 bits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

inline void store_value(std::vector<char>& b, std::size_t i, float x, bool bf16) {
  if (bf16) {
    std::uint32_t u;
    std::memcpy(&u, &x, 4);
    const auto h = static_cast<std::uint16_t>(u >> 16);
    std::memcpy(b.data() + 2 * i, &h, 2);
  } else {
    std::memcpy(b.data() + 4 * i, &x, 4);
  }
}
