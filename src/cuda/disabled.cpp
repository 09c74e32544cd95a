// The CUDA half of backend.hpp in a build without the CUDA backend.
#include "backend.hpp"
#include "flashdl/error.hpp"

#ifndef FLASHDL_CUDA_REASON
#define FLASHDL_CUDA_REASON "FLASHDL_CUDA=OFF, FLASHDL_CUDA=ON builds it"
#endif

namespace flashdl::cuda {

bool compiled() { return false; }
std::string architectures() { return ""; }
int device_count(std::string* status) {
  if (status) *status = "flashdl was built without the CUDA backend (" FLASHDL_CUDA_REASON ")";
  return 0;
}

[[noreturn]] static void not_built() {
  throw Error(ErrorKind::unsupported,
              "q: a CUDA array was given but flashdl was built without "
              "the CUDA backend (" FLASHDL_CUDA_REASON ")");
}
void forward(const Params&) { not_built(); }
void backward(const Params&) { not_built(); }
void forward_kvcache(const Params&, const KvAppend&) { not_built(); }
std::unique_ptr<GatheredKv> gather_kv(const KvGather&) { not_built(); }
void copy_to_host(void*, const void*, std::size_t, int, void*) { not_built(); }
void merge_states(const std::vector<TensorView>&, const std::vector<TensorView>&, const TensorView&,
                  const TensorView&, void*) {
  throw Error(ErrorKind::unsupported,
              "out: CUDA arrays were given but flashdl was built without "
              "the CUDA backend (" FLASHDL_CUDA_REASON ")");
}

}  // namespace flashdl::cuda
