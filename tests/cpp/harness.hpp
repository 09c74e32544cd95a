// Shared by test_forward and test_backward: a test case (shape, mask, layouts), its inputs, calls
// of flashdl::forward/backward that also check the call contract (inputs never written, every
// output element written, nothing outside an output view written), and the accuracy rule.
//
// Accuracy rule (flash-attn's, DESIGN.md "Tests"): with ref64 the float64 result on the same
// (dtype-rounded) inputs and naive the tests' naive algorithm computed in the input precision
// (float32 accumulation, results rounded to the dtype; float64 for float64),
//     max|x - ref64| <= 2 * max|naive - ref64| + eps(dtype) * max|ref64|,
// eps = 4u with u the unit roundoff (2^-11 float16, 2^-8 bfloat16, 2^-24 float32), and 2^-40 for
// float64 (see rule_eps). The floor covers tiny cases where the naive result happens to be exact.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"
#include "naive.hpp"

namespace flashdl_test {

using flashdl::Options;
using flashdl::Schedule;

// ctest runs some executables again with FLASHDL_CPU_ISA naming a narrower copy of the kernels;
// where the CPU lacks its instructions the library reports cpu_isa "none (...)" and the run is
// skipped (77) instead of failing. 0 to go on.
inline int skip_if_isa_unavailable() {
  const std::string isa = flashdl::build_info().cpu_isa;
  if (isa.rfind("none", 0) != 0) return 0;
  std::printf("skipped: %s\n", isa.c_str());
  return 77;
}

inline const std::vector<DType>& all_dtypes() {
  static const std::vector<DType> d{DType::float32, DType::float16, DType::bfloat16,
                                    DType::float64};
  return d;
}

struct Case {
  std::string name;
  int64_t b = 1, sq = 1, sk = 1, h = 1, hk = 1, d = 16;
  bool causal = false;
  int64_t left = -1, right = -1;
  double scale = std::numeric_limits<double>::quiet_NaN();  // NaN: 1/sqrt(d)
  float dropout = 0.0f;
  uint64_t seed = 0, offset = 0;
  Layout ql, kl, vl, ol, lsel;  // q, dout; k; v; out, dq (and dk, dv like k, v)
  double amp = 2.0;             // magnitude of q and k (v and dout: 1)
  std::vector<DType> dtypes = all_dtypes();
  std::vector<int64_t> fa1_sram = {0};  // Options::sram_bytes values fa1 runs with (0: default)
  // Block-sparse mask (block_q = 0: dense): bool flags of rank 2 (nbq, nbk) or 4 (1 or b, 1 or h,
  // nbq, nbk) in any Array layout, owned here so Options::block_mask can point at them.
  int64_t block_q = 0, block_k = 0;
  Array mask;
};

// Gives c a block mask of block_q x block_k blocks: rank 2 when `lead` is empty, else rank 4 with
// leading extents lead = {mb, mh}; flag(mb, mh, qb, kb) decides each block (mb = mh = 0 at rank 2).
template <typename Flag>
void set_block_mask(Case& c, int64_t block_q, int64_t block_k, const std::vector<int64_t>& lead,
                    Flag flag, const Layout& layout = {}) {
  c.block_q = block_q;
  c.block_k = block_k;
  const int64_t nbq = (c.sq + block_q - 1) / block_q, nbk = (c.sk + block_k - 1) / block_k;
  const int64_t mb = lead.empty() ? 1 : lead[0], mh = lead.empty() ? 1 : lead[1];
  std::vector<int64_t> shape = lead;
  shape.push_back(nbq);
  shape.push_back(nbk);
  c.mask = Array(DType::boolean, shape, layout);
  std::vector<double> flags;
  for (int64_t b = 0; b < mb; ++b)
    for (int64_t h = 0; h < mh; ++h)
      for (int64_t qb = 0; qb < nbq; ++qb)
        for (int64_t kb = 0; kb < nbk; ++kb) flags.push_back(flag(b, h, qb, kb) ? 1.0 : 0.0);
  c.mask.assign(flags);
}

// A random small case: shapes, GQA group, mask, dropout, layouts and dtype all drawn from `rng`.
// fa1 also runs with a 1 KiB budget (blocks of 1 to 4 rows), so block edges land everywhere.
inline Case random_case(Rng& rng, int index) {
  auto pick = [&](int64_t n) {
    return static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n));
  };
  Case c;
  c.b = 1 + pick(2);
  c.sq = 1 + pick(70);
  c.sk = pick(10) == 0 ? 1 + pick(3) : 1 + pick(70);
  c.hk = 1 + pick(2);
  c.h = c.hk * (1 + pick(3));
  const int64_t dims[] = {1, 3, 8, 16, 24, 64, 100};
  c.d = dims[pick(7)];
  switch (pick(4)) {
    case 0: break;
    case 1: c.causal = true; break;
    case 2:
      c.left = pick(12) - 1;
      c.right = pick(12) - 1;
      break;
    default:
      c.causal = true;
      c.left = pick(8);
      break;
  }
  if (pick(5) == 0) c.dropout = 0.2f, c.seed = rng.next(), c.offset = pick(1000);
  Layout* lays[] = {&c.ql, &c.kl, &c.vl, &c.ol};
  for (Layout* l : lays) {
    l->order = {0, 1, 2};
    for (int i = 2; i > 0; --i) std::swap(l->order[i], l->order[pick(i + 1)]);
    l->pad = pick(3);
    l->reverse = pick(4) == 0 ? static_cast<int>(pick(3)) : -1;
  }
  c.lsel.pad = pick(2);
  const DType dts[] = {DType::float32, DType::float16, DType::bfloat16};
  c.dtypes = {dts[pick(3)]};
  c.fa1_sram = {0, 1024};
  c.name = "random #" + std::to_string(index) + ": b" + std::to_string(c.b) + " sq" +
           std::to_string(c.sq) + " sk" + std::to_string(c.sk) + " h" + std::to_string(c.h) + "/" +
           std::to_string(c.hk) + " d" + std::to_string(c.d) + (c.causal ? " causal" : "") +
           " window(" + std::to_string(c.left) + "," + std::to_string(c.right) + ")" +
           (c.dropout > 0 ? " dropout" : "");
  return c;
}

inline Problem problem_of(const Case& c) {
  Problem p;
  p.b = c.b, p.sq = c.sq, p.sk = c.sk, p.h = c.h, p.hk = c.hk, p.d = c.d;
  p.scale = std::isnan(c.scale) ? 1.0 / std::sqrt(static_cast<double>(c.d)) : c.scale;
  p.left = c.left;
  p.right = c.causal ? 0 : c.right;
  p.dropout = c.dropout, p.seed = c.seed, p.offset = c.offset;
  if (c.block_q > 0) {
    const auto& shape = c.mask.shape();
    p.block_q = c.block_q, p.block_k = c.block_k;
    p.mb = shape.size() == 4 ? shape[0] : 1;
    p.mh = shape.size() == 4 ? shape[1] : 1;
    p.nbq = shape[shape.size() - 2], p.nbk = shape.back();
    for (double f : c.mask.values()) p.blocks.push_back(f != 0.0 ? 1 : 0);
  }
  return p;
}

inline Options options_of(const Case& c, Schedule s, int threads = 0, int64_t sram = 0) {
  Options o;
  o.softmax_scale = c.scale;
  o.causal = c.causal;
  o.window_left = c.left;
  o.window_right = c.right;
  o.dropout_p = c.dropout;
  o.seed = c.seed;
  o.offset = c.offset;
  o.schedule = s;
  o.num_threads = threads;
  o.sram_bytes = sram;
  if (c.block_q > 0) {
    o.block_mask = c.mask.view();
    o.block_size_q = c.block_q;
    o.block_size_k = c.block_k;
  }
  return o;
}

inline std::string dtype_str(DType d) { return flashdl::dtype_name(d); }

struct Inputs {
  Array q, k, v, dout;
};

inline Inputs make_inputs(const Case& c, DType dt, uint64_t seed) {
  Rng rng(seed);
  Inputs in{Array(dt, {c.b, c.sq, c.h, c.d}, c.ql), Array(dt, {c.b, c.sk, c.hk, c.d}, c.kl),
            Array(dt, {c.b, c.sk, c.hk, c.d}, c.vl), Array(dt, {c.b, c.sq, c.h, c.d}, c.ql)};
  in.q.fill_random(rng, c.amp);
  in.k.fill_random(rng, c.amp);
  in.v.fill_random(rng, 1.0);
  in.dout.fill_random(rng, 1.0);
  return in;
}

inline Inputs to_float64(const Inputs& in) {
  return {convert(in.q, DType::float64), convert(in.k, DType::float64),
          convert(in.v, DType::float64), convert(in.dout, DType::float64)};
}

// Every logical element written (no 0xFF NaN left) and the storage around the view untouched.
inline void check_written(const Array& a, const char* name) {
  CHECK_MSG(a.padding_untouched(), std::string(name) + " written outside its view");
  int64_t nan = 0;
  for (int64_t i = 0; i < a.numel(); ++i) nan += std::isnan(a.get(i)) ? 1 : 0;
  CHECK_MSG(nan == 0, std::string(name) + ": " + std::to_string(nan) + " NaN/unwritten elements");
}

struct Forward {
  Array out, lse;
};

inline Forward run_forward(const Case& c, const Inputs& in, const Options& o) {
  const DType dt = in.q.dtype();
  Forward f{Array(dt, {c.b, c.sq, c.h, c.d}, c.ol),
            Array(DType::float32, {c.b, c.h, c.sq}, c.lsel)};
  f.out.poison();
  f.lse.poison();
  const auto q0 = in.q.byte_copy(), k0 = in.k.byte_copy(), v0 = in.v.byte_copy();
  const auto m0 = c.mask.byte_copy();
  flashdl::forward(in.q.view(), in.k.view(), in.v.view(), f.out.view(), f.lse.view(), o);
  CHECK_MSG(in.q.byte_copy() == q0 && in.k.byte_copy() == k0 && in.v.byte_copy() == v0 &&
                c.mask.byte_copy() == m0,
            "forward wrote into an input");
  check_written(f.out, "out");
  check_written(f.lse, "lse");
  return f;
}

struct Grads {
  Array dq, dk, dv;
};

inline Grads run_backward(const Case& c, const Inputs& in, const Forward& f, const Options& o) {
  const DType dt = in.q.dtype();
  Grads g{Array(dt, {c.b, c.sq, c.h, c.d}, c.ol), Array(dt, {c.b, c.sk, c.hk, c.d}, c.kl),
          Array(dt, {c.b, c.sk, c.hk, c.d}, c.vl)};
  g.dq.poison();
  g.dk.poison();
  g.dv.poison();
  const auto before = {in.q.byte_copy(),  in.k.byte_copy(),  in.v.byte_copy(),  in.dout.byte_copy(),
                       f.out.byte_copy(), f.lse.byte_copy(), c.mask.byte_copy()};
  flashdl::backward(in.dout.view(), in.q.view(), in.k.view(), in.v.view(), f.out.view(),
                    f.lse.view(), g.dq.view(), g.dk.view(), g.dv.view(), o);
  const auto after = {in.q.byte_copy(),  in.k.byte_copy(),  in.v.byte_copy(),  in.dout.byte_copy(),
                      f.out.byte_copy(), f.lse.byte_copy(), c.mask.byte_copy()};
  CHECK_MSG(std::equal(before.begin(), before.end(), after.begin()),
            "backward wrote into an input");
  check_written(g.dq, "dq");
  check_written(g.dk, "dk");
  check_written(g.dv, "dv");
  return g;
}

// ---- comparisons ------------------------------------------------------------------------------

// max |a - b| over the elements; equal infinities count as 0, a NaN or a lone infinity as +inf.
inline double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == b[i]) continue;
    const double e = std::fabs(a[i] - b[i]);
    m = std::isnan(e) ? INFINITY : std::max(m, e);
  }
  return a.size() == b.size() ? m : INFINITY;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0;
  for (double x : a)
    if (std::isfinite(x)) m = std::max(m, std::fabs(x));
  return m;
}

// The floor of the rule, relative to max|ref64|: 4u; for float64, where the naive algorithm is the
// oracle itself (its error is 0), 2^-40 ~ 1e-12 leaves room for a different summation order.
inline double rule_eps(DType dt) {
  return dt == DType::float64 ? std::ldexp(1.0, -40) : 4.0 * unit_roundoff(dt);
}

// The accuracy rule of this file's header. `magnitude` (when larger than max|ref64|) scales the
// floor instead: the size of the terms a result is summed from, for results that cancel to ~0.
inline void check_rule(const std::string& what, const std::vector<double>& x,
                       const std::vector<double>& ref64, const std::vector<double>& naive, DType dt,
                       double magnitude = 0.0) {
  const double err = max_diff(x, ref64);
  const double nerr = max_diff(naive, ref64);
  const double tol = 2.0 * nerr + rule_eps(dt) * std::max(max_abs(ref64), magnitude);
  CHECK_MSG(err <= tol, what + ": max err " + num(err) + " > tol " + num(tol) + " (naive err " +
                            num(nerr) + ", max|ref| " + num(max_abs(ref64)) + ")");
}

// |x - r| <= 2u|r| + eps max|r| element by element (eps of rule_eps): a float64 computation
// rounded once (or twice, through float32) to the dtype, as Schedule::reference stores it.
inline void check_rounded(const std::string& what, const std::vector<double>& x,
                          const std::vector<double>& r, DType dt) {
  const double u = unit_roundoff(dt), floor = rule_eps(dt) * max_abs(r) + 1e-300;
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < x.size(); ++i) {
    const bool ok = x[i] == r[i] || std::fabs(x[i] - r[i]) <= 2.0 * u * std::fabs(r[i]) + floor;
    if (!ok && bad++ == 0) first = static_cast<int64_t>(i);
  }
  CHECK_MSG(bad == 0 && x.size() == r.size(),
            what + ": " + std::to_string(bad) + " elements off" +
                (first >= 0 ? " (first #" + std::to_string(first) + ": " + num(x[first]) + " vs " +
                                  num(r[first]) + ")"
                            : std::string()));
}

inline bool bitwise_equal(const Array& a, const Array& b) { return a.byte_copy() == b.byte_copy(); }
inline bool bitwise_equal(const Grads& a, const Grads& b) {
  return bitwise_equal(a.dq, b.dq) && bitwise_equal(a.dk, b.dk) && bitwise_equal(a.dv, b.dv);
}

}  // namespace flashdl_test
