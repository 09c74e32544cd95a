// The CUDA backend's entry: device discovery (safe with no driver: the static runtime reports an
// error, never aborts) and the forward dispatch (device guard, device limits, dtype x head dim at
// compile time, schedule at run time). Params arrive validated by api.cpp.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "backend.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"
#include "launch.hpp"
#include "static_switch.hpp"

namespace flashdl::cuda {

bool compiled() { return true; }
std::string architectures() { return FLASHDL_CUDA_ARCHS; }

int device_count(std::string* status) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (status) *status = std::string("no usable GPU: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (status) *status = n > 0 ? "ok" : "no GPU found";
  return n;
}

namespace {

// 16-byte vector access needs the base and every row start on a 16-byte boundary: a 16-byte
// aligned pointer and strides that are multiples of 8 (2-byte) elements.
bool rows_aligned_16(const void* ptr, int64_t batch_stride, int64_t row_stride, int64_t head_stride) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && batch_stride % 8 == 0 &&
         row_stride % 8 == 0 && head_stride % 8 == 0;
}

int device_attribute(cudaDeviceAttr attr, int device, const char* what) {
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, attr, device), what);
  return value;
}

LaunchContext make_context(const Params& p) {
  LaunchContext c{};
  c.stream = static_cast<cudaStream_t>(p.stream);
  c.device = p.device.id;
  c.cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, c.device,
                                "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  c.cc_minor = device_attribute(cudaDevAttrComputeCapabilityMinor, c.device,
                                "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
  c.smem_optin = device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, c.device,
                                  "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)");
  c.max_grid_y = device_attribute(cudaDevAttrMaxGridDimY, c.device,
                                  "cudaDeviceGetAttribute(MaxGridDimY)");
  c.max_grid_z = device_attribute(cudaDevAttrMaxGridDimZ, c.device,
                                  "cudaDeviceGetAttribute(MaxGridDimZ)");
  c.vec_load = rows_aligned_16(p.q_ptr, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
               rows_aligned_16(p.k_ptr, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
               rows_aligned_16(p.v_ptr, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  c.vec_store = rows_aligned_16(p.o_ptr, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  return c;
}

}  // namespace

void forward(const Params& p) {
  if (p.p_dropout > 0.0f)
    throw Error(ErrorKind::unsupported,
                "dropout_p: dropout is not yet on CUDA (got " + std::to_string(p.p_dropout) +
                    "); pass dropout_p=0, or CPU arrays");
  DeviceGuard guard(p.device.id);
  const LaunchContext ctx = make_context(p);
  if (ctx.cc_major < 8)
    throw Error(ErrorKind::unsupported,
                "q: the CUDA kernels need compute capability 8.0 or newer (bfloat16 tensor cores, "
                "cp.async); device " + std::to_string(ctx.device) + " is " +
                    std::to_string(ctx.cc_major) + "." + std::to_string(ctx.cc_minor));
  FLASHDL_DTYPE_SWITCH(p.dtype, T, [&] {
    FLASHDL_HEADDIM_SWITCH(p.headdim, kHeadDim, [&] {
      switch (p.schedule) {
        case Schedule::fa1: return launch_fa1_forward<T, kHeadDim>(p, ctx);
        case Schedule::automatic:  // api.cpp resolves automatic to fa2 already
        case Schedule::fa2: return launch_fa2_forward<T, kHeadDim>(p, ctx);
        default:
          throw Error(ErrorKind::unsupported, std::string("schedule: no CUDA kernel for '") +
                                                  schedule_name(p.schedule) + "'");
      }
    });
  });
}

void backward(const Params&) {
  throw Error(ErrorKind::unsupported, "q: the CUDA backward kernels are not implemented yet");
}

}  // namespace flashdl::cuda
