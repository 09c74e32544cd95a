// merge_states on CUDA arrays (validated by src/merge.cpp): the parts go to merge_rows.cuh's
// kernel as kernel parameters, kMergeMaxParts a launch, so nothing is copied from host memory
// (which from pageable memory would wait for the stream). More parts run as a chain of launches
// in order, the running (o, lse) carried between them in a stream-ordered workspace in the
// accumulation type, so the result is the one left-to-right fold of the host loop.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "launch.hpp"
#include "merge_rows.cuh"

namespace flashdl::cuda {
namespace {

MergeView view_of(const TensorView& o, const TensorView& lse) {
  return MergeView{o.data,         static_cast<const float*>(lse.data),
                   o.strides[0],   o.strides[1],
                   o.strides[2],   lse.strides[0],
                   lse.strides[1], lse.strides[2]};
}

// T: the arrays' element type; Acc: float, or double for double.
template <typename T, typename Acc>
void run(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
         const TensorView& out, const TensorView& lse, cudaStream_t stream) {
  MergeArgs m{};
  m.batch = out.shape[0];
  m.seqlen = out.shape[1];
  m.nheads = out.shape[2];
  m.head_dim = out.shape[3];
  m.out = view_of(out, lse);
  const int64_t rows = m.batch * m.seqlen * m.nheads;
  if (rows == 0) return;
  const auto n = static_cast<int64_t>(outs.size());
  std::unique_ptr<StreamWorkspace> carry;
  if (n > kMergeMaxParts)
    carry = std::make_unique<StreamWorkspace>(
        static_cast<std::size_t>(rows * (m.head_dim + 1)) * sizeof(Acc), stream);
  m.carry = carry ? carry->get<void>() : nullptr;
  for (int64_t first = 0; first < n; first += kMergeMaxParts) {
    m.count = static_cast<int>(std::min<int64_t>(kMergeMaxParts, n - first));
    for (int i = 0; i < m.count; ++i) m.part[i] = view_of(outs[first + i], lses[first + i]);
    m.carry_in = first > 0;
    m.carry_out = first + kMergeMaxParts < n;
    launch_merge<T, T, Acc>(m, stream);
  }
  if (carry) carry->release();
}

}  // namespace

void run_merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                      const TensorView& out, const TensorView& lse, cudaStream_t stream) {
  switch (out.dtype) {
    case DType::float16: return run<__half, float>(outs, lses, out, lse, stream);
    case DType::bfloat16: return run<__nv_bfloat16, float>(outs, lses, out, lse, stream);
    case DType::float32: return run<float, float>(outs, lses, out, lse, stream);
    case DType::float64: return run<double, double>(outs, lses, out, lse, stream);
    default:
      throw Error(ErrorKind::type,
                  std::string("out: no CUDA merge for dtype ") + dtype_name(out.dtype));
  }
}

}  // namespace flashdl::cuda
