// merge_states: the exact combination of attention results over disjoint key sets (the seeds'
// softmax decomposition): (o_i, lse_i) -> (o, lse) with lse = log sum_i exp(lse_i) and
// o = sum_i exp(lse_i - lse) o_i, through detail::merge_weights, the function the split-KV
// kernels use. Validated here; the loop runs on the host (CPU arrays) or the CUDA backend's kernel
// (CUDA arrays, src/cuda/merge.cu).
#include <string>
#include <vector>

#include "backend.hpp"
#include "cpu/convert.hpp"
#include "flashdl/api.hpp"
#include "flashdl/detail/softmax.hpp"
#include "checks.hpp"

namespace flashdl {

using namespace validate;

void merge_states(const std::vector<TensorView>& outs, const std::vector<TensorView>& lses,
                  const TensorView& out, const TensorView& lse, void* stream) {
  if (outs.empty()) fail(ErrorKind::value, "outs: expected at least one partial result, got none");
  if (lses.size() != outs.size())
    fail(ErrorKind::value, "lses: expected one lse per output (" + std::to_string(outs.size()) +
                               "), got " + std::to_string(lses.size()));
  const char* olay = "(batch, seqlen, nheads, headdim)";
  const char* llay = "(batch, nheads, seqlen)";
  // The caller's arrays first, by their names: out and lse are allocated from outs[0] and
  // lses[0], so a wrong rank or dtype there is the caller's, not the outputs'.
  for (size_t i = 0; i < outs.size(); ++i) {
    check_rank(("outs[" + std::to_string(i) + "]").c_str(), outs[i], 4, olay);
    check_rank(("lses[" + std::to_string(i) + "]").c_str(), lses[i], 3, llay);
  }
  const DType dt = outs[0].dtype;
  if (dt != DType::float16 && dt != DType::bfloat16 && dt != DType::float32 && dt != DType::float64)
    fail(ErrorKind::type, std::string("outs[0]: expected dtype float16, bfloat16, float32 or "
                                      "float64, got ") +
                              dtype_name(dt));
  const auto& n = outs[0].shape;
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string on = "outs[" + std::to_string(i) + "]",
                      ln = "lses[" + std::to_string(i) + "]";
    check_shape(on.c_str(), outs[i], {n[0], n[1], n[2], n[3]}, "(the shape of outs[0])");
    check_shape(ln.c_str(), lses[i], {n[0], n[2], n[1]}, "(batch, nheads, seqlen) of outs[0]");
    check_dtype(on.c_str(), outs[i], dt, "the dtype of outs[0]");
    check_dtype(ln.c_str(), lses[i], DType::float32, "lse is always float32");
    check_device(on.c_str(), outs[i], outs[0].device);
    check_device(ln.c_str(), lses[i], outs[0].device);
  }
  check_rank("out", out, 4, olay);
  check_rank("lse", lse, 3, llay);
  check_shape("out", out, {n[0], n[1], n[2], n[3]}, "(the shape of outs[0])");
  check_dtype("out", out, dt, "the dtype of outs[0]");
  check_device("out", out, outs[0].device);
  for (size_t i = 0; i < outs.size(); ++i) {
    const std::string on = "outs[" + std::to_string(i) + "]",
                      ln = "lses[" + std::to_string(i) + "]";
    check_no_overlap("out", out, on.c_str(), outs[i]);
    check_no_overlap("out", out, ln.c_str(), lses[i]);
    check_no_overlap("lse", lse, on.c_str(), outs[i]);
    check_no_overlap("lse", lse, ln.c_str(), lses[i]);
  }
  check_shape("lse", lse, {n[0], n[2], n[1]}, "(batch, nheads, seqlen) of out");
  check_dtype("lse", lse, DType::float32, "lse is always float32");
  check_device("lse", lse, out.device);
  check_no_overlap("lse", lse, "out", out);
  check_no_self_overlap("out", out);
  check_no_self_overlap("lse", lse);
  for (size_t i = 0; i < outs.size(); ++i)
    check_last_dim_contiguous(("outs[" + std::to_string(i) + "]").c_str(), outs[i]);
  check_last_dim_contiguous("out", out);
  if (out.device.type != DeviceType::cpu) return cuda::merge_states(outs, lses, out, lse, stream);
  auto at = [&](const TensorView& t, int64_t b, int64_t s, int64_t h) {
    return b * t.strides[0] + s * t.strides[1] + h * t.strides[2];
  };
  auto lse_at = [](const TensorView& t, int64_t b, int64_t h, int64_t s) -> float& {
    return static_cast<float*>(t.data)[b * t.strides[0] + h * t.strides[1] + s * t.strides[2]];
  };
  std::vector<double> acc(static_cast<size_t>(n[3]));
  for (int64_t b = 0; b < n[0]; ++b)
    for (int64_t s = 0; s < n[1]; ++s)
      for (int64_t h = 0; h < n[2]; ++h) {
        double total = -INFINITY;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (size_t i = 0; i < outs.size(); ++i) {
          const detail::MergeWeights<double> w =
              detail::merge_weights<double>(total, lse_at(lses[i], b, h, s));
          const int64_t o = at(outs[i], b, s, h);
          for (int64_t c = 0; c < n[3]; ++c) {
            const double x = w.wb == 0.0
                                 ? 0.0
                                 : w.wb * cpu::load_as_double(outs[i].data, out.dtype, o + c);
            acc[c] = w.wa * acc[c] + x;
          }
          total = w.lse;
        }
        const int64_t o = at(out, b, s, h);
        for (int64_t c = 0; c < n[3]; ++c)
          cpu::store_from_double(out.data, out.dtype, o + c, acc[c]);
        lse_at(lse, b, h, s) = static_cast<float>(total);
      }
}

}  // namespace flashdl
