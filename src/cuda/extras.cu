// The small kernels around the attention extras (Options::sinks, bias; detail/extras.hpp):
// dSinks from out, dout and lse, one CTA per head with a fixed summation order (bitwise
// reproducible), and dBias from its float32 accumulator, on the caller's stream after the
// backward kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "check.hpp"
#include "flashdl/detail/sequence.hpp"
#include "flashdl/detail/softmax.hpp"
#include "fragment.cuh"
#include "launch.hpp"
#include "static_switch.hpp"

namespace flashdl::cuda {
namespace {

constexpr int kSinkThreads = 256;

// dsinks[h] = -sum over sequences b and their rows i of exp(sink_h - lse_i) * D_i with
// D_i = rowsum(dout_i * out_i) (rows with lse = -inf skipped, as on the CPU). Thread t takes the
// rows t, t + 256, ... of the head in order, then a fixed tree sums the threads: the same order
// on every run. Varlen: sequence b's rows through detail::sequence_of.
template <typename T>
__global__ void __launch_bounds__(kSinkThreads) dsinks_kernel(const __grid_constant__ Params p) {
  FLASHDL_DYNAMIC_SMEM(smem);
  float* part = reinterpret_cast<float*>(smem);  // kSinkThreads floats
  const int64_t h = blockIdx.x;
  const float sink = p.sinks_ptr[h * p.sinks_stride];
  float acc = 0.0f;
  for (int64_t b = 0; b < p.batch; ++b) {
    const detail::Sequence seq = detail::sequence_of(p, b);
    for (int64_t i = threadIdx.x; i < seq.sq; i += kSinkThreads) {
      const int64_t row = seq.q0 + i;
      const float lse =
          p.lse_ptr[b * p.lse_batch_stride + h * p.lse_head_stride + row * p.lse_row_stride];
      if (!(lse > -INFINITY)) continue;
      const T* o = static_cast<const T*>(p.o_ptr) + b * p.o_batch_stride + row * p.o_row_stride +
                   h * p.o_head_stride;
      const T* dout = static_cast<const T*>(p.do_ptr) + b * p.do_batch_stride +
                      row * p.do_row_stride + h * p.do_head_stride;
      float d = 0.0f;
      for (int64_t c = 0; c < p.headdim; ++c) d = fmaf(to_float(dout[c]), to_float(o[c]), d);
      acc = fmaf(expf(sink - lse), d, acc);
    }
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int w = kSinkThreads / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.dsinks_ptr[h * p.dsinks_stride] = -part[0];
}

// dbias (its dtype and strides; 0 along the axes it sums over) from the compact float32
// accumulator (bias_batch, bias_heads, bias_rows, seqlen_k), a grid-stride loop.
__global__ void __launch_bounds__(256)
    dbias_convert_kernel(const __grid_constant__ Params p, const float* acc, int64_t n) {
  for (int64_t e = int64_t(blockIdx.x) * 256 + threadIdx.x; e < n; e += int64_t(gridDim.x) * 256) {
    const int64_t j = e % p.seqlen_k, r = e / p.seqlen_k;
    const int64_t ii = r % p.bias_rows, hh = (r / p.bias_rows) % p.bias_heads,
                  bb = r / p.bias_rows / p.bias_heads;
    const int64_t at = bb * p.dbias_batch_stride + hh * p.dbias_head_stride +
                       ii * p.dbias_row_stride + j * p.dbias_col_stride;
    const float x = acc[e];
    switch (p.bias_dtype) {
      case DType::float16: static_cast<__half*>(p.dbias_ptr)[at] = __float2half_rn(x); break;
      case DType::bfloat16:
        static_cast<__nv_bfloat16*>(p.dbias_ptr)[at] = __float2bfloat16_rn(x);
        break;
      case DType::float64: static_cast<double*>(p.dbias_ptr)[at] = double(x); break;
      default: static_cast<float*>(p.dbias_ptr)[at] = x; break;
    }
  }
}

}  // namespace

int64_t dbias_acc_elements(const Params& p) {
  return p.dbias_ptr == nullptr ? 0 : p.bias_batch * p.bias_heads * p.bias_rows * p.seqlen_k;
}

void run_dbias_convert(const Params& p, const float* acc, cudaStream_t stream) {
  const int64_t n = dbias_acc_elements(p);
  if (n == 0) return;
  const int64_t blocks = (n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535;
  FLASHDL_LAUNCH(dim3(static_cast<unsigned>(blocks)), 256, 0, stream, dbias_convert_kernel)(p, acc,
                                                                                            n);
  FLASHDL_CUDA_CHECK_LAUNCH("dbias conversion launch");
}

void run_sinks_backward(const Params& p, cudaStream_t stream) {
  if (p.dsinks_ptr == nullptr || p.nheads == 0) return;
  if (p.nheads > INT32_MAX)
    throw Error(ErrorKind::unsupported, "dsinks: nheads too large for one launch");
  FLASHDL_DTYPE_SWITCH(p.dtype, T, [&] {
    FLASHDL_LAUNCH(dim3(static_cast<unsigned>(p.nheads)), kSinkThreads,
                   kSinkThreads * sizeof(float), stream, dsinks_kernel<T>)(p);
  });
  FLASHDL_CUDA_CHECK_LAUNCH("dsinks kernel launch");
}

}  // namespace flashdl::cuda
