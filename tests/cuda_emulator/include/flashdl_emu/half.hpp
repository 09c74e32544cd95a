// float16 and bfloat16 for flashdl's CUDA host emulator: storage types with CUDA's conversion
// intrinsics (round to nearest even, subnormals, infinities and NaN as the hardware converts them).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime.hpp"

namespace flashdl_emu {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u)  // inf or NaN (NaN stays a quiet NaN)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), rounded to nearest even
    const float scaled = bits_float(abs) * 16777216.0f;  // units of 2^-24, exact
    const float r = std::nearbyint(scaled);  // the default rounding mode: to nearest even
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(r));
  }
  // normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = (std::uint32_t(h) & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7f800000u | (man << 13));
  return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_bits_to_float(std::uint16_t b) { return bits_float(std::uint32_t(b) << 16); }

}  // namespace flashdl_emu

struct __half {
  std::uint16_t __x;
  __half() = default;
  __half(float f) : __x(flashdl_emu::float_to_half_bits(f)) {}
  operator float() const { return flashdl_emu::half_bits_to_float(__x); }
};
struct __half2 {
  __half x, y;
};
struct __nv_bfloat16 {
  std::uint16_t __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(flashdl_emu::float_to_bf16_bits(f)) {}
  operator float() const { return flashdl_emu::bf16_bits_to_float(__x); }
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
typedef __half half;
typedef __nv_bfloat16 nv_bfloat16;

inline __half __float2half_rn(float f) { return __half(f); }
inline __half __float2half(float f) { return __half(f); }
inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline __half2 __float22half2_rn(float2 v) { return {__half(v.x), __half(v.y)}; }
inline __half __low2half(__half2 h) { return h.x; }
inline __half __high2half(__half2 h) { return h.y; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) {
  __half h;
  h.__x = u;
  return h;
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return static_cast<float>(b); }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return {__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 h) { return h.x; }
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 h) { return h.y; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
  __nv_bfloat16 b;
  b.__x = u;
  return b;
}
