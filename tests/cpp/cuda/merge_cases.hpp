// merge_states on the target (CUDA arrays, or host arrays with --cpu) against a float64 oracle
// written from the definition (lse = log sum_i exp(lse_i), out = sum_i exp(lse_i - lse) out_i):
// every dtype (float16, bfloat16, float32, float64), 1 to 19 parts (one launch holds 8: 9 and 19
// chain launches through the carried state), head dims that are not multiples of 32 and beyond
// 256, each part in its own layout (padded, misaligned, transposed) with strided lse. A part with
// lse -inf holds NaN in out (it weighs nothing and must not be read); some rows have no part with
// a finite lse (out 0, lse -inf). Outputs are poisoned and their gaps must stay untouched.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

namespace cuda_test::merge {

using flashdl::DType;

inline size_t elem_size(DType dt) {
  return dt == DType::float64 ? 8 : dt == DType::float32 ? 4 : 2;
}

inline void put(std::vector<unsigned char>& buf, int64_t at, double v, DType dt) {
  unsigned char* p = buf.data() + size_t(at) * elem_size(dt);
  if (dt == DType::float64) {
    std::memcpy(p, &v, 8);
  } else if (dt == DType::float32) {
    const float f = float(v);
    std::memcpy(p, &f, 4);
  } else {
    const uint16_t h = to_bits(float(v), dt);
    std::memcpy(p, &h, 2);
  }
}

inline double get(const std::vector<unsigned char>& buf, int64_t at, DType dt) {
  const unsigned char* p = buf.data() + size_t(at) * elem_size(dt);
  if (dt == DType::float64) {
    double v;
    std::memcpy(&v, p, 8);
    return v;
  }
  if (dt == DType::float32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return from_bits(h, dt);
}

// A logical (b, s, h, d) array in layout L as `dt` bytes; the gaps are all-ones bytes (NaN).
inline std::vector<unsigned char> place_any(const std::vector<double>& x, const Layout& L,
                                            DType dt) {
  std::vector<unsigned char> buf(size_t(L.span) * elem_size(dt), 0xff);
  size_t i = 0;
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c)
        for (int64_t e = 0; e < L.shape[3]; ++e) put(buf, L.offset(a, b, c, e), x[i++], dt);
  return buf;
}

inline std::vector<double> gather_any(const std::vector<unsigned char>& buf, const Layout& L,
                                      DType dt, bool& gaps_untouched) {
  std::vector<double> x;
  std::vector<char> used(size_t(L.span), 0);
  for (int64_t a = 0; a < L.shape[0]; ++a)
    for (int64_t b = 0; b < L.shape[1]; ++b)
      for (int64_t c = 0; c < L.shape[2]; ++c)
        for (int64_t e = 0; e < L.shape[3]; ++e) {
          used[size_t(L.offset(a, b, c, e))] = 1;
          x.push_back(get(buf, L.offset(a, b, c, e), dt));
        }
  const size_t es = elem_size(dt);
  for (size_t i = 0; i < used.size(); ++i)
    for (size_t k = 0; k < es && !used[i]; ++k) gaps_untouched &= buf[i * es + k] == 0xff;
  return x;
}

struct MergeCase {
  int64_t b, s, h, d, parts;
};

inline std::string label_of(const MergeCase& c, DType dt) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "merge_states %s b=%lld s=%lld h=%lld d=%lld parts=%lld",
                flashdl::dtype_name(dt), (long long)c.b, (long long)c.s, (long long)c.h,
                (long long)c.d, (long long)c.parts);
  return buf;
}

inline bool run_one(const Target& t, const MergeCase& c, DType dt, std::mt19937& rng,
                    const std::string& label) {
  const Kind kinds[] = {Kind::contiguous, Kind::padded, Kind::odd, Kind::transposed};
  const int64_t rows = c.b * c.s * c.h;
  std::uniform_int_distribution<int> lse_dist(-400, 400), inf_dist(0, 4);
  std::vector<std::vector<double>> o(size_t(c.parts));
  std::vector<std::vector<float>> l(size_t(c.parts));  // logical (b, h, s)
  std::vector<std::unique_ptr<Buffer>> bufs;
  std::vector<flashdl::TensorView> outs, lses;
  for (int64_t i = 0; i < c.parts; ++i) {
    const std::vector<float> v = random_values(rows * c.d, rng);
    o[size_t(i)].assign(v.begin(), v.end());
    l[size_t(i)].resize(size_t(rows));
    for (int64_t bi = 0; bi < c.b; ++bi)
      for (int64_t h = 0; h < c.h; ++h)
        for (int64_t s = 0; s < c.s; ++s) {
          // Row (s 0, head 0) has no key in any part; elsewhere one lse in five is -inf.
          const bool empty = (s == 0 && h == 0) || inf_dist(rng) == 0;
          const float lse = empty ? -INFINITY : float(lse_dist(rng)) / 64.0f;
          l[size_t(i)][size_t((bi * c.h + h) * c.s + s)] = lse;
          if (empty)  // a partial that weighs nothing may hold anything
            for (int64_t e = 0; e < c.d; ++e)
              o[size_t(i)][size_t(((bi * c.s + s) * c.h + h) * c.d + e)] = NAN;
        }
    const Layout lo = make_layout(c.b, c.s, c.h, c.d, kinds[i % 4]);
    const Layout ll = lse_layout(c.b, c.h, c.s, i % 2 == 1);
    bufs.push_back(std::make_unique<Buffer>(size_t(lo.span) * elem_size(dt), t.host));
    bufs.back()->upload(place_any(o[size_t(i)], lo, dt));
    outs.push_back(view_of(*bufs.back(), dt, lo, 4));
    bufs.push_back(std::make_unique<Buffer>(size_t(ll.span) * 4, t.host));
    bufs.back()->upload(place_lse(l[size_t(i)], ll));
    lses.push_back(view_of(*bufs.back(), DType::float32, ll, 3));
  }
  const Layout lo = make_layout(c.b, c.s, c.h, c.d, Kind::padded);
  const Layout ll = lse_layout(c.b, c.h, c.s, true);
  Buffer out(size_t(lo.span) * elem_size(dt), t.host), lse(size_t(ll.span) * 4, t.host);
  out.poison();
  lse.poison();
  flashdl::merge_states(outs, lses, view_of(out, dt, lo, 4), view_of(lse, DType::float32, ll, 3),
                        t.stream);
  t.sync();

  bool gaps = true;
  const std::vector<double> got = gather_any(out.download<unsigned char>(), lo, dt, gaps);
  const std::vector<uint32_t> lb = lse.download<uint32_t>();
  const double tol = dt == DType::float16    ? 1e-3
                     : dt == DType::bfloat16 ? 8e-3
                     : dt == DType::float32  ? 1e-5
                                             : 1e-12;
  double err = 0.0;
  bool lse_ok = true;
  for (int64_t bi = 0; bi < c.b; ++bi)
    for (int64_t h = 0; h < c.h; ++h)
      for (int64_t s = 0; s < c.s; ++s) {
        const size_t li = size_t((bi * c.h + h) * c.s + s);
        double m = -INFINITY;
        for (const auto& li_ : l) m = std::fmax(m, double(li_[li]));
        double sum = 0.0;
        if (m != -INFINITY)
          for (const auto& li_ : l) sum += std::exp(double(li_[li]) - m);
        const double want_lse = m == -INFINITY ? -INFINITY : m + std::log(sum);
        for (int64_t e = 0; e < c.d; ++e) {
          double want = 0.0;
          for (int64_t i = 0; m != -INFINITY && i < c.parts; ++i) {
            const double w = std::exp(double(l[size_t(i)][li]) - want_lse);
            if (w > 0.0) want += w * o[size_t(i)][size_t(((bi * c.s + s) * c.h + h) * c.d + e)];
          }
          const double diff = std::fabs(got[size_t(((bi * c.s + s) * c.h + h) * c.d + e)] - want);
          if (!(diff <= err)) err = std::isnan(diff) ? INFINITY : diff;
        }
        const float g = bits_to_float(lb[size_t(ll.offset(bi, h, s, 0))]);
        const double lse_tol = 1e-5 + 1e-6 * std::fabs(want_lse);
        lse_ok &= std::isinf(want_lse) ? g == float(want_lse)
                                       : std::fabs(double(g) - want_lse) <= lse_tol;
      }
  std::vector<char> used(lb.size(), 0);
  for (int64_t bi = 0; bi < c.b; ++bi)
    for (int64_t h = 0; h < c.h; ++h)
      for (int64_t s = 0; s < c.s; ++s) used[size_t(ll.offset(bi, h, s, 0))] = 1;
  for (size_t i = 0; i < lb.size(); ++i) gaps &= used[i] || lb[i] == 0xffffffffu;
  const bool ok = err <= tol && lse_ok && gaps;
  std::printf("%s %s | err %.2e tol %.2e%s%s\n", ok ? "ok  " : "FAIL", label.c_str(), err, tol,
              lse_ok ? "" : " [lse]", gaps ? "" : " [wrote outside out/lse]");
  return ok;
}

inline int run_merge_states(const Target& t, const Cli& cli) {
  const std::vector<MergeCase> cs =
      cli.quick ? std::vector<MergeCase>{{2, 3, 4, 64, 2}, {2, 2, 2, 40, 9}}
                : std::vector<MergeCase>{{2, 3, 4, 64, 2},   {1, 5, 3, 128, 8}, {2, 2, 2, 40, 9},
                                         {1, 3, 2, 256, 19}, {3, 1, 5, 1, 3},   {1, 1, 1, 300, 4},
                                         {2, 2, 3, 96, 1}};
  int failures = 0;
  for (size_t ci = 0; ci < cs.size(); ++ci)
    for (const DType dt : {DType::float16, DType::bfloat16, DType::float32, DType::float64}) {
      const std::string label = label_of(cs[ci], dt);
      if (!cli.selected(label)) continue;
      std::mt19937 rng(uint32_t(3001 * ci + size_t(dt)));
      failures += run_case(label, [&] { return run_one(t, cs[ci], dt, rng, label); });
    }
  return failures;
}

}  // namespace cuda_test::merge
