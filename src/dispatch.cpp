// From validated Params to a backend: the device picks the CPU or the CUDA backend; outputs the
// kernels only add into (dbias, dsinks) are zeroed first.
#include "dispatch.hpp"

#include <cstring>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "backend.hpp"
#include "checks.hpp"

namespace flashdl {

using validate::fail;

void advise_huge_pages(const TensorView& t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (!t.defined() || t.device.type != DeviceType::cpu || t.data == nullptr) return;
  const auto es = static_cast<int64_t>(dtype_size(t.dtype));
  int64_t expect = 1;
  for (int a = t.rank - 1; a >= 0; --a) {  // row-major contiguous only
    if (t.shape[a] != 1 && t.strides[a] != expect) return;
    expect *= t.shape[a];
  }
  const int64_t bytes = expect * es;
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (bytes < int64_t{4} << 20) return;
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  const uintptr_t lo = (begin + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (begin + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (hi > lo)
    madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // advice: errors ignored
#else
  (void)t;
#endif
}

void zero_extra_grads(const Options& o, bool zero_dbias) {
  if (o.dsinks.defined() && o.dsinks.device.type == DeviceType::cpu)
    for (int64_t h = 0; h < o.dsinks.shape[0]; ++h)
      static_cast<float*>(o.dsinks.data)[h * o.dsinks.strides[0]] = 0.0f;
  const TensorView& d = o.dbias;
  if (zero_dbias && d.defined() && d.device.type == DeviceType::cpu && d.numel() > 0) {
    // Every float dtype's +0 is all zero bits. Rank 3 (varlen) or 4, any strides.
    const auto es = static_cast<int64_t>(dtype_size(d.dtype));
    int64_t n[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
    for (int a = 0; a < d.rank; ++a) {
      n[4 - d.rank + a] = d.shape[a];
      st[4 - d.rank + a] = d.strides[a];
    }
    for (int64_t a = 0; a < n[0]; ++a)
      for (int64_t b = 0; b < n[1]; ++b)
        for (int64_t c = 0; c < n[2]; ++c) {
          char* row = static_cast<char*>(d.data) + (a * st[0] + b * st[1] + c * st[2]) * es;
          if (st[3] == 1) {  // a contiguous row at once
            std::memset(row, 0, static_cast<size_t>(n[3] * es));
            continue;
          }
          for (int64_t e = 0; e < n[3]; ++e)
            std::memset(row + e * st[3] * es, 0, static_cast<size_t>(es));
        }
  }
}

namespace {

void require_cuda() {
  if (!cuda::compiled())
    fail(ErrorKind::unsupported,
         "q: a CUDA array was given but flashdl was built without the CUDA "
         "backend");
}

}  // namespace

void dispatch_forward(const Params& p) {
  if (p.device.type == DeviceType::cpu) return cpu::forward(p);
  require_cuda();
  cuda::forward(p);
}

void dispatch_backward(const Params& p) {
  if (p.device.type == DeviceType::cpu) {
    cpu::backward(p);  // dbias was zeroed by the entry point (zero_extra_grads)
    if (p.dsinks_ptr != nullptr) cpu::sinks_backward(p);
    return;
  }
  require_cuda();
  cuda::backward(p);
}

void dispatch_kvcache(const Params& p, const KvAppend& append) {
  if (p.device.type == DeviceType::cpu) return cpu::forward_kvcache(p, append);
  require_cuda();
  cuda::forward_kvcache(p, append);
}

}  // namespace flashdl
