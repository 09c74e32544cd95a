// Framework-free description of an array: pointer, dtype, device, shape and element strides.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace flashdl {

enum class DType : int {
  float16 = 0,
  bfloat16 = 1,
  float32 = 2,
  float64 = 3,
  int32 = 4,
  boolean = 5
};

enum class DeviceType : int { cpu = 0, cuda = 1 };

struct Device {
  DeviceType type = DeviceType::cpu;
  int id = 0;
};

inline bool operator==(Device a, Device b) { return a.type == b.type && a.id == b.id; }
inline bool operator!=(Device a, Device b) { return !(a == b); }

constexpr int kMaxRank = 4;

// A non-owning view. Strides are in elements (not bytes) and may be any int64, but the kernels
// require the last dimension to be contiguous (stride 1) wherever it has more than one element.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::float32;
  Device device{};
  int rank = 0;
  std::array<int64_t, kMaxRank> shape{};
  std::array<int64_t, kMaxRank> strides{};

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank; ++i) n *= shape[i];
    return n;
  }
  bool defined() const { return rank > 0 || data != nullptr; }
};

const char* dtype_name(DType dtype);
const char* device_name(DeviceType type);
std::size_t dtype_size(DType dtype);

// Builds a view of a contiguous (row-major) array; convenient for C++ callers and tests.
TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     Device device = Device{});

}  // namespace flashdl
