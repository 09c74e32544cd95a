// Scalar conversions between the storage dtypes and float/double (bit exact, round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

#include "flashdl/tensor.hpp"

namespace flashdl::cpu {

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3ffu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t float_to_fp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to inf
  if (abs < 0x38800000u) {                        // subnormal or zero in half
    if (abs < 0x33000000u) return sign;           // below half of the smallest subnormal
    const uint32_t exp = abs >> 23;
    const uint32_t man = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t total = 126 - exp;  // value / 2^-24, the smallest half subnormal
    uint32_t h = man >> total;
    const uint32_t rem = man & ((1u << total) - 1u);
    const uint32_t half = 1u << (total - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return sign | static_cast<uint16_t>(h);
  }
  uint32_t h = ((abs >> 13) - (112u << 10));
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return sign | static_cast<uint16_t>(h);
}

// Element `i` (flat element offset) of an array of dtype `dt`, as double.
inline double load_as_double(const void* base, DType dt, int64_t i) {
  switch (dt) {
    case DType::float16: return fp16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::bfloat16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::float32: return static_cast<const float*>(base)[i];
    case DType::float64: return static_cast<const double*>(base)[i];
    default: return 0.0;
  }
}

inline void store_from_double(void* base, DType dt, int64_t i, double x) {
  switch (dt) {
    case DType::float16:
      static_cast<uint16_t*>(base)[i] = float_to_fp16(static_cast<float>(x));
      break;
    case DType::bfloat16:
      static_cast<uint16_t*>(base)[i] = float_to_bf16(static_cast<float>(x));
      break;
    case DType::float32: static_cast<float*>(base)[i] = static_cast<float>(x); break;
    case DType::float64: static_cast<double*>(base)[i] = x; break;
    default: break;
  }
}

}  // namespace flashdl::cpu
