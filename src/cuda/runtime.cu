// The CUDA backend's entry: device discovery (safe with no driver: the static runtime reports an
// error, never aborts) and the forward and backward dispatch (device guard, device limits, dtype x
// head dim at compile time, schedule at run time), attention over a KV cache and merge_states
// (kvcache.cu, merge.cu). Params arrive validated (validate.cpp, kvcache.cpp, merge.cpp).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "backend.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"
#include "flashdl/detail/extras.hpp"
#include "launch.hpp"
#include "static_switch.hpp"

namespace flashdl::cuda {

bool compiled() { return true; }
std::string architectures() { return FLASHDL_CUDA_ARCHS; }

int device_count(std::string* status) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // With no driver the static runtime reports "CUDA driver version is insufficient for CUDA
    // runtime version", which reads like a version mismatch; say what it means on such machines.
    const char* what = err == cudaErrorNoDevice ? "no NVIDIA GPU found"
                       : err == cudaErrorInsufficientDriver
                           ? "no NVIDIA driver found, or one older than this build's CUDA runtime"
                           : "no usable GPU";
    if (status) *status = std::string(what) + " (" + cudaGetErrorString(err) + ")";
    cudaGetLastError();  // clear the sticky error so later calls start clean
    return 0;
  }
  if (status) *status = n > 0 ? "ok" : "no GPU found";
  return n;
}

namespace {

// 16-byte vector access needs the base and every row start on a 16-byte boundary: a 16-byte
// aligned pointer and strides that are multiples of 8 (2-byte) elements.
bool rows_aligned_16(const void* ptr, int64_t batch_stride, int64_t row_stride,
                     int64_t head_stride) {
  return reinterpret_cast<std::uintptr_t>(ptr) % 16 == 0 && batch_stride % 8 == 0 &&
         row_stride % 8 == 0 && head_stride % 8 == 0;
}

int device_attribute(cudaDeviceAttr attr, int device, const char* what) {
  int value = 0;
  check_cuda(cudaDeviceGetAttribute(&value, attr, device), what);
  return value;
}

// FLASHDL_CUDA_SMEM_LIMIT=<bytes> caps the opt-in shared memory the launchers plan against, so a
// large-memory GPU (an H100) also runs the smaller-tile fallbacks that parts with 99 KiB per
// block select. Unset, empty or unparsable: no cap.
int smem_limit(int device_optin) {
  const char* env = std::getenv("FLASHDL_CUDA_SMEM_LIMIT");
  if (env == nullptr || *env == '\0') return device_optin;
  char* end = nullptr;
  const long long cap = std::strtoll(env, &end, 10);
  if (*end != '\0' || cap <= 0) return device_optin;
  return cap < device_optin ? static_cast<int>(cap) : device_optin;
}

// The device guard is the caller's; this reads the device's limits and refuses pre-sm_80 parts.
LaunchContext make_context(const Params& p, bool backward) {
  LaunchContext c{};
  c.stream = static_cast<cudaStream_t>(p.stream);
  c.device = p.device.id;
  c.cc_major = device_attribute(cudaDevAttrComputeCapabilityMajor, c.device,
                                "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  c.cc_minor = device_attribute(cudaDevAttrComputeCapabilityMinor, c.device,
                                "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
  c.smem_optin = smem_limit(
      device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, c.device,
                       "cudaDeviceGetAttribute(MaxSharedMemoryPerBlockOptin)"));
  c.max_grid_y = device_attribute(cudaDevAttrMaxGridDimY, c.device,
                                  "cudaDeviceGetAttribute(MaxGridDimY)");
  c.max_grid_z = device_attribute(cudaDevAttrMaxGridDimZ, c.device,
                                  "cudaDeviceGetAttribute(MaxGridDimZ)");
  if (c.cc_major < 8)
    throw Error(ErrorKind::unsupported,
                "q: the CUDA kernels need compute capability 8.0 or newer (bfloat16 tensor cores, "
                "cp.async); device " +
                    std::to_string(c.device) + " is " + std::to_string(c.cc_major) + "." +
                    std::to_string(c.cc_minor));
  const bool qkv = rows_aligned_16(p.q_ptr, p.q_batch_stride, p.q_row_stride, p.q_head_stride) &&
                   rows_aligned_16(p.k_ptr, p.k_batch_stride, p.k_row_stride, p.k_head_stride) &&
                   rows_aligned_16(p.v_ptr, p.v_batch_stride, p.v_row_stride, p.v_head_stride);
  // A testing switch: the fa2 forward runs its shared-memory softmax (the path it takes where the
  // fragment layout check fails) everywhere.
  const char* smem_softmax = std::getenv("FLASHDL_CUDA_FA2_SMEM_SOFTMAX");
  c.fa2_smem_softmax = smem_softmax != nullptr && *smem_softmax != '\0' &&
                       std::string(smem_softmax) != "0";
  if (!backward) {  // loads q, k, v; stores out
    c.vec_load = qkv;
    c.vec_store = rows_aligned_16(p.o_ptr, p.o_batch_stride, p.o_row_stride, p.o_head_stride);
  } else {  // loads q, k, v, dout (out is read row by row); stores dq, dk, dv
    c.vec_load = qkv &&
                 rows_aligned_16(p.do_ptr, p.do_batch_stride, p.do_row_stride, p.do_head_stride);
    c.vec_store = rows_aligned_16(p.dq_ptr, p.dq_batch_stride, p.dq_row_stride, p.dq_head_stride) &&
                  rows_aligned_16(p.dk_ptr, p.dk_batch_stride, p.dk_row_stride, p.dk_head_stride) &&
                  rows_aligned_16(p.dv_ptr, p.dv_batch_stride, p.dv_row_stride, p.dv_head_stride);
  }
  return c;
}

[[noreturn]] void no_kernel(const Params& p) {
  throw Error(ErrorKind::unsupported,
              std::string("schedule: no CUDA kernel for '") + schedule_name(p.schedule) + "'");
}

// Offsets of a varlen call that arrived in host memory (checked there by varlen.cpp) are copied to
// a stream-ordered device buffer, so the kernels always read device memory. From pageable memory
// the copy waits for the stream's earlier work: pass device arrays to avoid that round trip.
class DeviceOffsets {
 public:
  DeviceOffsets(Params& p, cudaStream_t stream) {
    if (p.cu_seqlens_q == nullptr || !p.cu_seqlens_host) return;
    const int64_t n = p.batch + 1;
    std::vector<int32_t> host(static_cast<std::size_t>(2 * n));
    for (int64_t i = 0; i < n; ++i) {
      host[i] = p.cu_seqlens_q[i * p.cu_seqlens_q_stride];
      host[n + i] = p.cu_seqlens_k[i * p.cu_seqlens_k_stride];
    }
    ws_ = std::make_unique<StreamWorkspace>(host.size() * sizeof(int32_t), stream);
    int32_t* dev = ws_->get<int32_t>();
    FLASHDL_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), host.size() * sizeof(int32_t),
                                       cudaMemcpyHostToDevice, stream));
    p.cu_seqlens_q = dev;
    p.cu_seqlens_k = dev + n;
    p.cu_seqlens_q_stride = p.cu_seqlens_k_stride = 1;
    p.cu_seqlens_host = false;
  }
  void release() {
    if (ws_) ws_->release();
  }

 private:
  std::unique_ptr<StreamWorkspace> ws_;
};

}  // namespace

void forward(const Params& params) {
  if (params.seqused_k != nullptr) return forward_kvcache(params, KvAppend{});  // nothing to append
  DeviceGuard guard(params.device.id);
  const LaunchContext ctx = make_context(params, false);
  Params p = params;
  DeviceOffsets offsets(p, ctx.stream);
  FLASHDL_DTYPE_SWITCH(p.dtype, T, [&] {
    FLASHDL_HEADDIM_SWITCH(p.headdim, kHeadDim, [&] {
      switch (p.schedule) {
        case Schedule::fa1: return launch_fa1_forward<T, kHeadDim>(p, ctx);
        case Schedule::automatic:  // fill_params.cpp resolves automatic to fa2 already
        case Schedule::fa2: return launch_fa2_forward<T, kHeadDim>(p, ctx);
        default: no_kernel(p);
      }
    });
  });
  offsets.release();
}

void forward_kvcache(const Params& params, const KvAppend& append) {
  DeviceGuard guard(params.device.id);
  run_kvcache(params, append, make_context(params, false));
}

void merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                  const TensorView& out, const TensorView& lse, void* stream) {
  DeviceGuard guard(out.device.id);
  run_merge_states(outs, lses, out, lse, static_cast<cudaStream_t>(stream));
}

void copy_to_host(void* dst, const void* src, std::size_t bytes, int device, void* stream) {
  DeviceGuard guard(device);
  const auto s = static_cast<cudaStream_t>(stream);
  FLASHDL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  FLASHDL_CUDA_CHECK(cudaStreamSynchronize(s));
}

void backward(const Params& params) {
  // dBias into a float32 accumulator of the bias's (compact) shape, by atomics: a bias broadcast
  // over an axis sums over it in an order that varies from run to run, so with deterministic=True
  // the backwards leave such a dBias to a kernel of its own that sums in a fixed order
  // (fa2_dbias.cuh). A full-size bias receives each element once (exact, reproducible).
  DeviceGuard guard(params.device.id);
  LaunchContext ctx = make_context(params, true);
  Params p = params;
  DeviceOffsets offsets(p, ctx.stream);
  std::unique_ptr<StreamWorkspace> dbias_ws;
  if (const int64_t n = dbias_acc_elements(p); n > 0) {
    const auto bytes = static_cast<std::size_t>(n) * sizeof(float);
    dbias_ws = std::make_unique<StreamWorkspace>(bytes, ctx.stream);
    ctx.dbias_acc = dbias_ws->get<float>();
    FLASHDL_CUDA_CHECK(cudaMemsetAsync(ctx.dbias_acc, 0, bytes, ctx.stream));
  }
  if (p.batch > 0) {  // batch 0 (api.cpp): only the zero dsinks and dbias below
    FLASHDL_DTYPE_SWITCH(p.dtype, T, [&] {
      FLASHDL_HEADDIM_SWITCH(p.headdim, kHeadDim, [&] {
        switch (p.schedule) {
          case Schedule::fa1: return launch_fa1_backward<T, kHeadDim>(p, ctx);
          case Schedule::automatic:
          case Schedule::fa2: return launch_fa2_backward<T, kHeadDim>(p, ctx);
          default: no_kernel(p);
        }
      });
    });
  }
  run_sinks_backward(p, ctx.stream);  // reads the device offsets: before their release
  if (dbias_ws) {
    run_dbias_convert(p, ctx.dbias_acc, ctx.stream);
    dbias_ws->release();
  }
  offsets.release();
}

}  // namespace flashdl::cuda
