// Device discovery for the CUDA backend. Kernels are not yet written: forward and backward report
// that clearly instead of computing anything.
#include <cuda_runtime.h>

#include "backend.hpp"
#include "flashdl/api.hpp"

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

void forward(const Params&) {
  throw Error(ErrorKind::unsupported, "q: the CUDA forward kernels are not built yet");
}
void backward(const Params&) {
  throw Error(ErrorKind::unsupported, "q: the CUDA backward kernels are not built yet");
}

}  // namespace flashdl::cuda
