// The CUDA forward kernels (fa1 and fa2) against the CPU float64 reference: both dtypes, every head
// dim, causal and windows, GQA/MQA, seqlen_q != seqlen_k, odd lengths, strided and misaligned
// arrays, empty rows; outputs poisoned with NaN before every call and their padding checked to stay
// untouched. Then a race test (100 identical calls, bitwise equal) and the errors CUDA must raise.
// Exit code 77 (skipped) when there is no CUDA device.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

using namespace cuda_test;
using flashdl::DType;
using flashdl::Schedule;

namespace {

struct Case {
  int64_t b, sq, sk, h, hk;
  bool causal;
  int64_t left, right;  // window as passed; causal adds right = 0
  Kind kind;
  bool strided_lse;
  bool fa1_small_sram;  // also run fa1 with an 8 KiB budget: many K/V and Q blocks
};

const Case kCases[] = {
    {2, 17, 17, 4, 4, false, -1, -1, Kind::contiguous, false, false},
    {2, 17, 17, 4, 4, true, -1, -1, Kind::contiguous, true, false},
    {1, 1, 257, 4, 1, false, -1, -1, Kind::transposed, false, false},   // MQA
    {1, 1, 257, 4, 2, true, -1, -1, Kind::padded, false, false},        // GQA
    {2, 257, 1000, 2, 1, true, -1, -1, Kind::transposed, false, true},
    {1, 1000, 257, 2, 2, true, -1, -1, Kind::contiguous, true, false},  // 743 empty rows
    {1, 1000, 1000, 1, 1, false, -1, -1, Kind::odd, false, false},      // no 16-byte rows
    {1, 257, 257, 2, 1, false, 32, 8, Kind::padded, false, true},       // sliding window
    {1, 100, 130, 2, 2, false, -1, 5, Kind::contiguous, false, false},
    {1, 130, 100, 2, 2, true, 20, -1, Kind::odd, true, false},
    {1, 300, 40, 1, 1, false, 0, 0, Kind::contiguous, false, false},    // diagonal only
    {1, 5, 0, 2, 1, false, -1, -1, Kind::contiguous, false, false},     // no keys at all
};

const int kHeadDims[] = {32, 64, 96, 128, 192, 256};
const DType kDtypes[] = {DType::float16, DType::bfloat16};

Shape shape_of(const Case& c, int64_t d) {
  return Shape{c.b, c.sq, c.sk, c.h, c.hk, d, c.left, c.causal ? 0 : c.right};
}

flashdl::Options options_of(const Case& c) {
  flashdl::Options o;
  o.causal = c.causal;
  o.window_left = c.left;
  o.window_right = c.right;
  return o;
}

// Multiples of 1/64 in [-2, 2]: exact in float16 and bfloat16, so one oracle serves both.
std::vector<float> random_values(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int> dist(-128, 128);
  std::vector<float> x(size_t(n > 0 ? n : 0));
  for (float& e : x) e = float(dist(rng)) / 64.0f;
  return x;
}

struct Oracle {
  std::vector<double> out;
  std::vector<float> lse;
};

Oracle reference(const Case& c, const Shape& s, const std::vector<float>& q,
                 const std::vector<float>& k, const std::vector<float>& v) {
  std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end());
  Oracle r{std::vector<double>(q.size()), std::vector<float>(size_t(s.b * s.h * s.sq))};
  flashdl::Options o = options_of(c);
  o.schedule = Schedule::reference;
  flashdl::forward(flashdl::make_view(q64.data(), DType::float64, {s.b, s.sq, s.h, s.d}),
                   flashdl::make_view(k64.data(), DType::float64, {s.b, s.sk, s.hk, s.d}),
                   flashdl::make_view(v64.data(), DType::float64, {s.b, s.sk, s.hk, s.d}),
                   flashdl::make_view(r.out.data(), DType::float64, {s.b, s.sq, s.h, s.d}),
                   flashdl::make_view(r.lse.data(), DType::float32, {s.b, s.h, s.sq}), o);
  return r;
}

// A logical contiguous (b, s, h, d) array placed in `L`'s layout; the gaps hold NaN.
std::vector<uint16_t> place(const std::vector<float>& x, const Layout& L, DType dt) {
  std::vector<uint16_t> buf(size_t(L.span), 0xffff);
  size_t i = 0;
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c)
        for (int64_t d = 0; d < L.shape[3]; ++d) buf[size_t(L.offset(a, b, c, d))] = to_bits(x[i++], dt);
  return buf;
}

struct GpuResult {
  std::vector<double> out;  // logical (b, sq, h, d)
  std::vector<float> lse;   // logical (b, h, sq)
  bool gaps_untouched = true;
};

struct GpuInputs {
  Layout lq, lk;
  DeviceBuffer q, k, v;
  GpuInputs(const Case& c, const Shape& s, DType dt, const std::vector<float>& hq,
            const std::vector<float>& hk, const std::vector<float>& hv)
      : lq(make_layout(s.b, s.sq, s.h, s.d, c.kind)),
        lk(make_layout(s.b, s.sk, s.hk, s.d, c.kind)),
        q(size_t(lq.span) * 2), k(size_t(lk.span) * 2), v(size_t(lk.span) * 2) {
    q.upload(place(hq, lq, dt));
    k.upload(place(hk, lk, dt));
    v.upload(place(hv, lk, dt));
  }
};

GpuResult run_gpu(const Case& c, const Shape& s, DType dt, GpuInputs& in, Schedule sched,
                  int64_t sram_bytes, cudaStream_t stream) {
  const Layout lo = in.lq;
  // lse (b, h, sq), when strided stored as (b, h + 1, sq + 3): gaps after every row and batch.
  Layout ll{{s.b, s.h, s.sq, 1}, {s.h * s.sq, s.sq, 1, 1}, s.b * s.h * s.sq};
  if (c.strided_lse)
    ll = Layout{{s.b, s.h, s.sq, 1}, {(s.h + 1) * (s.sq + 3), s.sq + 3, 1, 1}, s.b * (s.h + 1) * (s.sq + 3)};
  DeviceBuffer out(size_t(lo.span) * 2), lse(size_t(ll.span) * 4);
  out.poison();
  lse.poison();
  flashdl::Options o = options_of(c);
  o.schedule = sched;
  o.stream = stream;
  o.sram_bytes = sram_bytes;
  flashdl::forward(device_view(in.q.ptr, dt, in.lq, 4), device_view(in.k.ptr, dt, in.lk, 4),
                   device_view(in.v.ptr, dt, in.lk, 4), device_view(out.ptr, dt, lo, 4),
                   device_view(lse.ptr, DType::float32, ll, 3), o);
  CUDA_TEST_CHECK(cudaStreamSynchronize(stream));

  GpuResult r;
  std::vector<uint16_t> ob = out.download<uint16_t>();
  std::vector<uint32_t> lb = lse.download<uint32_t>();
  std::vector<char> used_o(ob.size(), 0), used_l(lb.size(), 0);
  for (int64_t a = 0; a < s.b; ++a)
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < s.h; ++h)
        for (int64_t e = 0; e < s.d; ++e) {
          const auto off = size_t(lo.offset(a, i, h, e));
          used_o[off] = 1;
          r.out.push_back(from_bits(ob[off], dt));
        }
  for (int64_t a = 0; a < s.b; ++a)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i) {
        const auto off = size_t(a * ll.strides[0] + h * ll.strides[1] + i * ll.strides[2]);
        used_l[off] = 1;
        r.lse.push_back(bits_to_float(lb[off]));
      }
  for (size_t i = 0; i < ob.size(); ++i) r.gaps_untouched &= used_o[i] || ob[i] == 0xffff;
  for (size_t i = 0; i < lb.size(); ++i) r.gaps_untouched &= used_l[i] || lb[i] == 0xffffffffu;
  return r;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double e = std::fabs(a[i] - b[i]);
    if (!(e <= m)) m = std::isnan(e) ? INFINITY : e;
  }
  return m;
}

// flash-attn's rule: max|gpu - oracle| <= 2 max|naive_lowp - oracle| + eps(dtype). lse: -inf
// exactly where the oracle has it, else within 1e-3 + 1e-4 |lse|.
bool check(const std::string& label, const Oracle& ref, const std::vector<double>& lowp,
           const GpuResult& g, DType dt) {
  const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
  const double err = max_abs_diff(g.out, ref.out), lowp_err = max_abs_diff(lowp, ref.out);
  const double tol = 2.0 * lowp_err + eps;
  bool lse_ok = true;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    const float want = ref.lse[i], got = g.lse[i];
    lse_ok &= std::isinf(want) ? (got == want)
                               : std::fabs(double(got) - want) <= 1e-3 + 1e-4 * std::fabs(want);
  }
  const bool ok = err <= tol && lse_ok && g.gaps_untouched;
  std::printf("%s %-60s err %.2e tol %.2e%s%s\n", ok ? "ok  " : "FAIL", label.c_str(), err, tol,
              lse_ok ? "" : " [lse]", g.gaps_untouched ? "" : " [wrote outside out/lse]");
  return ok;
}

std::string label_of(const Case& c, int64_t d, DType dt, Schedule sched, int64_t sram) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s%s %s d=%lld b=%lld sq=%lld sk=%lld h=%lld/%lld%s w=(%lld,%lld) %s",
                flashdl::schedule_name(sched), sram ? "(8KiB)" : "", flashdl::dtype_name(dt),
                (long long)d, (long long)c.b, (long long)c.sq, (long long)c.sk, (long long)c.h,
                (long long)c.hk, c.causal ? " causal" : "", (long long)c.left, (long long)c.right,
                kind_name(c.kind));
  return buf;
}

int run_accuracy(cudaStream_t stream) {
  int failures = 0;
  std::mt19937 rng(1234);
  for (const int d : kHeadDims)
    for (const Case& c : kCases) {
      const Shape s = shape_of(c, d);
      const auto hq = random_values(s.b * s.sq * s.h * d, rng);
      const auto hk = random_values(s.b * s.sk * s.hk * d, rng);
      const auto hv = random_values(s.b * s.sk * s.hk * d, rng);
      const Oracle ref = reference(c, s, hq, hk, hv);
      for (const DType dt : kDtypes) {
        std::vector<double> lowp;
        naive_lowp(s, hq, hk, hv, dt, lowp);
        GpuInputs in(c, s, dt, hq, hk, hv);
        for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
          const GpuResult g = run_gpu(c, s, dt, in, sched, 0, stream);
          failures += !check(label_of(c, d, dt, sched, 0), ref, lowp, g, dt);
        }
        if (c.fa1_small_sram) {
          const GpuResult g = run_gpu(c, s, dt, in, Schedule::fa1, 8192, stream);
          failures += !check(label_of(c, d, dt, Schedule::fa1, 8192), ref, lowp, g, dt);
        }
      }
    }
  return failures;
}

// The same inputs 100 times: bitwise equal out and lse (a race would show up as a difference).
int run_race(cudaStream_t stream) {
  int failures = 0;
  const Case c{2, 1000, 1000, 4, 2, true, -1, -1, Kind::contiguous, false, false};
  std::mt19937 rng(99);
  for (const int d : {64, 256}) {
    const Shape s = shape_of(c, d);
    const auto hq = random_values(s.b * s.sq * s.h * d, rng);
    const auto hk = random_values(s.b * s.sk * s.hk * d, rng);
    const auto hv = random_values(s.b * s.sk * s.hk * d, rng);
    GpuInputs in(c, s, DType::float16, hq, hk, hv);
    for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
      const GpuResult first = run_gpu(c, s, DType::float16, in, sched, 0, stream);
      int mismatches = 0;
      for (int rep = 1; rep < 100; ++rep) {
        const GpuResult g = run_gpu(c, s, DType::float16, in, sched, 0, stream);
        const bool same = std::memcmp(g.out.data(), first.out.data(), g.out.size() * 8) == 0 &&
                          std::memcmp(g.lse.data(), first.lse.data(), g.lse.size() * 4) == 0;
        mismatches += !same;
      }
      std::printf("%s race %s d=%d: %d of 99 repeats differ\n", mismatches ? "FAIL" : "ok  ",
                  flashdl::schedule_name(sched), d, mismatches);
      failures += mismatches != 0;
    }
  }
  return failures;
}

// CUDA-specific errors: dropout and the backward pass are not there yet.
int run_errors(cudaStream_t stream) {
  int failures = 0;
  const Case c{1, 8, 8, 1, 1, false, -1, -1, Kind::contiguous, false, false};
  const Shape s = shape_of(c, 64);
  std::mt19937 rng(5);
  const auto hx = random_values(8 * 64, rng);
  GpuInputs in(c, s, DType::float16, hx, hx, hx);
  DeviceBuffer out(8 * 64 * 2), lse(8 * 4), dq(8 * 64 * 2), dk(8 * 64 * 2), dv(8 * 64 * 2);
  const Layout L = in.lq;
  const Layout ll{{1, 1, 8, 1}, {8, 8, 1, 1}, 8};
  auto view = [&](void* p) { return device_view(p, DType::float16, L, 4); };
  auto expect = [&](const char* what, const char* needle, auto&& call) {
    bool ok = false;
    try {
      call();
    } catch (const flashdl::Error& e) {
      ok = e.kind() == flashdl::ErrorKind::unsupported && std::string(e.what()).find(needle) != std::string::npos;
      std::printf("%s %s -> %s\n", ok ? "ok  " : "FAIL", what, e.what());
    }
    if (!ok) std::printf("FAIL %s: expected Error(unsupported) mentioning '%s'\n", what, needle);
    failures += !ok;
  };
  flashdl::Options o;
  o.stream = stream;
  o.dropout_p = 0.1f;
  expect("dropout on CUDA", "dropout_p", [&] {
    flashdl::forward(view(in.q.ptr), view(in.k.ptr), view(in.v.ptr), view(out.ptr),
                     device_view(lse.ptr, DType::float32, ll, 3), o);
  });
  o.dropout_p = 0.0f;
  expect("backward on CUDA", "backward", [&] {
    flashdl::backward(view(in.q.ptr), view(in.q.ptr), view(in.k.ptr), view(in.v.ptr),
                      view(out.ptr), device_view(lse.ptr, DType::float32, ll, 3), view(dq.ptr),
                      view(dk.ptr), view(dv.ptr), o);
  });
  return failures;
}

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  CUDA_TEST_CHECK(cudaSetDevice(0));
  cudaStream_t stream;
  CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  int failures = 0;
  try {
    failures += run_accuracy(stream);
    failures += run_race(stream);
    failures += run_errors(stream);
  } catch (const std::exception& e) {
    std::printf("FAIL unexpected exception: %s\n", e.what());
    ++failures;
  }
  int current = -1;
  CUDA_TEST_CHECK(cudaGetDevice(&current));
  if (current != 0) {
    std::printf("FAIL the current device changed to %d\n", current);
    ++failures;
  }
  CUDA_TEST_CHECK(cudaStreamDestroy(stream));
  std::printf("%d failure(s)\n", failures);
  return failures == 0 ? 0 : 1;
}
