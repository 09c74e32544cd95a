#include "flashdl/tensor.hpp"

#include <string>

#include "flashdl/error.hpp"

namespace flashdl {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::float16: return "float16";
    case DType::bfloat16: return "bfloat16";
    case DType::float32: return "float32";
    case DType::float64: return "float64";
    case DType::int32: return "int32";
    case DType::boolean: return "bool";
  }
  return "unknown dtype";
}

const char* device_name(DeviceType type) {
  switch (type) {
    case DeviceType::cpu: return "cpu";
    case DeviceType::cuda: return "cuda";
  }
  return "unknown device";
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::float16:
    case DType::bfloat16: return 2;
    case DType::float32:
    case DType::int32: return 4;
    case DType::float64: return 8;
    case DType::boolean: return 1;
  }
  throw Error(ErrorKind::type, "unknown dtype code " + std::to_string(static_cast<int>(dtype)));
}

TensorView make_view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device) {
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.rank = static_cast<int>(shape.size());
  if (t.rank > kMaxRank) throw Error(ErrorKind::value, "make_view: rank above 4");
  int i = 0;
  for (int64_t s : shape) t.shape[i++] = s;
  int64_t stride = 1;
  for (int d = t.rank - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

}  // namespace flashdl
