// Host-side plumbing shared by the CUDA launchers: every CUDA call is checked and a failure becomes
// flashdl::Error(runtime) carrying CUDA's own error name and string; the device guard; what a launch
// needs to know about the device and the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "flashdl/error.hpp"

namespace flashdl::cuda {

inline void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so that the next call starts clean
  throw Error(ErrorKind::runtime, std::string("CUDA error in ") + what + ": " +
                                      cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

#define FLASHDL_CUDA_CHECK(expr) ::flashdl::cuda::check_cuda((expr), #expr)

// A kernel launch, written FLASHDL_LAUNCH(grid, block, smem_bytes, stream, kernel)(args...): under
// nvcc kernel<<<grid, block, smem_bytes, stream>>>(args...); built with FLASHDL_CUDA=EMULATE, the
// host emulator's launch (tests/cuda_emulator), which runs the same kernel source on the CPU.
#ifdef FLASHDL_CUDA_EMULATOR
#define FLASHDL_LAUNCH(grid, block, smem, stream, ...) \
  FLASHDL_EMU_LAUNCH(grid, block, smem, stream, __VA_ARGS__)
#else
#define FLASHDL_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#endif

// After every launch: a bad configuration (grid, block, shared memory) surfaces here at once.
#define FLASHDL_CUDA_CHECK_LAUNCH(name) ::flashdl::cuda::check_cuda(cudaGetLastError(), name)

// Makes `device` current for the scope and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FLASHDL_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FLASHDL_CUDA_CHECK(cudaSetDevice(device));
    current_ = device;
  }
  ~DeviceGuard() {
    if (previous_ != current_) cudaSetDevice(previous_);  // a destructor must not throw
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  int current_ = 0;
};

// A scratch allocation ordered on the caller's stream (cudaMallocAsync / cudaFreeAsync): no device
// synchronisation, and the memory returns to the stream's pool once the work queued before the free
// has run. release() checks the free; the destructor frees on the error path.
class StreamWorkspace {
 public:
  StreamWorkspace(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    FLASHDL_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~StreamWorkspace() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);
  }
  StreamWorkspace(const StreamWorkspace&) = delete;
  StreamWorkspace& operator=(const StreamWorkspace&) = delete;

  template <typename U>
  U* get() const {
    return static_cast<U*>(ptr_);
  }

  void release() {
    void* ptr = ptr_;
    ptr_ = nullptr;
    FLASHDL_CUDA_CHECK(cudaFreeAsync(ptr, stream_));
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Everything a launcher needs besides Params: the device's limits and how the arrays are aligned.
struct LaunchContext {
  cudaStream_t stream;  // the caller's stream, passed through (0: the legacy default stream)
  int device;
  int cc_major, cc_minor;
  int smem_optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin, bytes
  int max_grid_y, max_grid_z;
  bool vec_load;          // q, k, v (and dout) rows start on 16-byte boundaries: cp.async copies
  bool vec_store;         // out (or dq, dk, dv) rows start on 16-byte boundaries: 16-byte stores
  bool fa2_smem_softmax;  // FLASHDL_CUDA_FA2_SMEM_SOFTMAX set: the fa2 forward's fallback softmax
  // Backward with dbias: the float32 accumulator of the compact dBias (bias_batch, bias_heads,
  // bias_rows, seqlen_k), zeroed, that the kernels add dS into (runtime.cu); null: none.
  float* dbias_acc;
};

}  // namespace flashdl::cuda
