// The public entry points: validate (validate.cpp), fill Params (fill_params.cpp), dispatch to a
// backend (dispatch.cpp).
#include "flashdl/api.hpp"

#include <cstring>
#include <string>

#include "backend.hpp"
#include "dispatch.hpp"
#include "fill_params.hpp"
#include "flashdl/detail/philox.hpp"
#include "validate.hpp"

#ifndef FLASHDL_VERSION
#define FLASHDL_VERSION "0.0.0"
#endif

namespace flashdl {

using namespace validate;

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::automatic: return "auto";
    case Schedule::fa1: return "fa1";
    case Schedule::fa2: return "fa2";
    case Schedule::reference: return "reference";
  }
  return "unknown schedule";
}

Schedule parse_schedule(const std::string& name) {
  for (Schedule s : {Schedule::automatic, Schedule::fa1, Schedule::fa2, Schedule::reference})
    if (name == schedule_name(s)) return s;
  throw Error(ErrorKind::value,
              "schedule: expected 'auto', 'fa1', 'fa2' or 'reference', got '" + name + "'");
}

void forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
             const TensorView& lse, const Options& options) {
  const Shapes s = check_attention_args(q, k, v, out, lse, options);
  check_block_mask(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  check_score_mods(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  check_extras(options, s, q.device, {{"out", &out}, {"lse", &lse}});
  if (options.validate_only) return;
  if (s.batch == 0 || s.seqlen_q == 0 || s.nheads == 0) return;  // nothing to write
  dispatch_forward(make_params(q, k, v, out, lse, options, s));
}

void backward(const TensorView& dout, const TensorView& q, const TensorView& k, const TensorView& v,
              const TensorView& out, const TensorView& lse, const TensorView& dq,
              const TensorView& dk, const TensorView& dv, const Options& options) {
  const Shapes s = check_backward_args(dout, q, k, v, out, lse, dq, dk, dv, options);
  check_block_mask(options, s, q.device, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  check_score_mods(options, s, q.device, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  check_extras(options, s, q.device, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  if (options.validate_only) return;
  if (s.batch == 0 || s.nheads == 0) {
    zero_extra_grads(options);
    // CUDA arrays: the backend writes the zero dsinks (and a batch-broadcast dbias) itself.
    if (s.nheads > 0 && q.device.type != DeviceType::cpu &&
        (options.dsinks.defined() || options.dbias.defined()))
      dispatch_backward(make_backward_params(dout, q, k, v, out, lse, dq, dk, dv, options, s));
    return;
  }
  const Params p = make_backward_params(dout, q, k, v, out, lse, dq, dk, dv, options, s);
  const bool dbias_written = dbias_written_by_kernels(p);
  if (dbias_written) advise_huge_pages(options.dbias);
  zero_extra_grads(options, !dbias_written);
  dispatch_backward(p);
}

void dropout_mask(const TensorView& mask_out, double p, uint64_t seed, uint64_t offset) {
  check_rank("mask_out", mask_out, 4, "(batch, nheads, seqlen_q, seqlen_k)");
  check_dtype("mask_out", mask_out, DType::boolean, "the keep-mask is bool");
  if (mask_out.device.type != DeviceType::cpu)
    fail(ErrorKind::value, std::string("mask_out: expected an array on cpu, got ") +
                               device_name(mask_out.device.type));
  check_last_dim_contiguous("mask_out", mask_out);
  check_no_self_overlap("mask_out", mask_out);
  // The same rounding and range check as Options.dropout_p in forward() and backward().
  const float pf = static_cast<float>(p);
  if (!(pf >= 0.0f && pf < 1.0f))
    fail(ErrorKind::value, "dropout_p: expected a probability in [0, 1), got " + num_str(p));
  if (offset >= (uint64_t{1} << 32))
    fail(ErrorKind::value,
         "offset: expected a dropout stream offset below 2^32, got " + std::to_string(offset));
  const auto& n = mask_out.shape;
  const auto& st = mask_out.strides;
  auto* base = static_cast<bool*>(mask_out.data);
  for (int64_t b = 0; b < n[0]; ++b)
    for (int64_t h = 0; h < n[1]; ++h) {
      const auto bh = static_cast<uint64_t>(b * n[1] + h);
      for (int64_t i = 0; i < n[2]; ++i) {
        bool* row = base + b * st[0] + h * st[1] + i * st[2];
        for (int64_t j = 0; j < n[3]; ++j)
          row[j] = detail::dropout_keep(pf, seed, offset, bh, static_cast<uint64_t>(i),
                                        static_cast<uint64_t>(j));
      }
    }
}

BuildInfo build_info() {
  BuildInfo info;
  info.version = FLASHDL_VERSION;
  info.cuda_compiled = cuda::compiled();
  info.cuda_architectures = cuda::architectures();
  info.cuda_device_count = cuda::device_count(&info.cuda_status);
  info.cpu_isa = cpu::isa_name();
  info.cpu_threads = cpu::num_threads();
  info.cpu_sram_bytes = cpu::default_sram_bytes();
  return info;
}

void copy_to_host(void* dst, const TensorView& src, void* stream, const char* name) {
  int64_t expect = 1;
  for (int i = src.rank - 1; i >= 0; --i) {
    if (src.shape[i] > 1 && src.strides[i] != expect)
      fail(ErrorKind::value, std::string(name) + ": expected a contiguous array");
    expect *= src.shape[i];
  }
  const std::size_t bytes = static_cast<std::size_t>(src.numel()) * dtype_size(src.dtype);
  if (bytes == 0) return;
  if (src.device.type == DeviceType::cpu) {
    std::memcpy(dst, src.data, bytes);
    return;
  }
  cuda::copy_to_host(dst, src.data, bytes, src.device.id, stream);
}

void set_num_threads(int n) {
  if (n < 0)
    fail(ErrorKind::value,
         "n: expected a thread count >= 0 (0: default), got " + std::to_string(n));
  cpu::set_num_threads(n);
}

}  // namespace flashdl
