// The per-case checks test_forward, test_backward and test_block_sparse share: one Case (shape,
// window, block mask, layouts, dtypes) run through every CPU schedule and held to float64 oracles.
//
// Forward, per dtype:
//   * the tests' own naive float64 attention (naive.hpp) is the oracle ref64;
//   * Schedule::reference on float64 copies of the inputs must equal it to 1e-12 (relative);
//   * Schedule::reference in the dtype must equal ref64 rounded to the dtype (2u|ref| + 4u max|ref|);
//   * fa1 and fa2 must meet the rule in harness.hpp: max|x - ref64| <= 2 max|naive_dtype - ref64|
//     + 4u max|ref64|, for out (u of the dtype) and lse (u of float32);
//   * rows with no visible key: out exactly 0, lse -inf, for every schedule.
// Backward, per dtype:
//   * ref64: the tests' naive float64 gradients of sum(out * dout) (naive.hpp);
//   * Schedule::reference on float64 copies must equal ref64 to 1e-11 (relative to max|ref64|);
//   * Schedule::reference in the dtype must equal ref64 rounded to the dtype;
//   * fa1 and fa2 (each fed its own forward's out and lse) meet the rule of harness.hpp, with the
//     naive algorithm in the dtype using its own rounded out for D = rowsum(dout * out);
//   * rows with no visible key get dq = 0 exactly; keys no row sees get dk = dv = 0 exactly.
// Every call also checks that inputs are unchanged and nothing outside the outputs is written.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "harness.hpp"

namespace flashdl_test {

inline uint64_t seed_of(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char ch : s) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
  return h;
}

// The schedules a case runs besides the reference: fa2, and fa1 with each of c.fa1_sram.
inline std::vector<std::pair<Schedule, int64_t>> fast_runs(const Case& c) {
  std::vector<std::pair<Schedule, int64_t>> runs{{Schedule::fa2, 0}};
  for (int64_t sram : c.fa1_sram) runs.emplace_back(Schedule::fa1, sram);
  return runs;
}

inline std::string run_name(Schedule s, int64_t sram) {
  return std::string(flashdl::schedule_name(s)) +
         (sram ? " (sram_bytes " + std::to_string(sram) + ")" : "");
}

// ---- forward ----------------------------------------------------------------------------------

inline void check_empty_rows(const Problem& p, const Forward& f, const std::string& who) {
  const auto out = f.out.values(), lse = f.lse.values();
  int64_t bad = 0;
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t h = 0; h < p.h; ++h)
      for (int64_t i = 0; i < p.sq; ++i) {
        bool empty = true;
        for (int64_t j = 0; j < p.sk && empty; ++j) empty = !p.visible(b, h, i, j);
        if (!empty) continue;
        bad += lse[(b * p.h + h) * p.sq + i] == -INFINITY ? 0 : 1;
        for (int64_t c = 0; c < p.d; ++c) bad += out[p.qi(b, i, h) + c] == 0.0 ? 0 : 1;
      }
  CHECK_MSG(bad == 0, who + ": " + std::to_string(bad) + " elements of empty rows not 0 / -inf");
}

// ref64 and the naive algorithm in the dtype (outl, lsel) of a forward pass.
struct ForwardOracle {
  std::vector<double> out64, lse64, outl, lsel;
};

inline ForwardOracle forward_oracle(const Problem& p, const Inputs& in) {
  const DType dt = in.q.dtype();
  const std::vector<double> q = in.q.values(), k = in.k.values(), v = in.v.values();
  ForwardOracle o;
  Naive<double>{p, q, k, v}.forward(DType::float64, o.out64, o.lse64);
  if (dt == DType::float64) {
    o.outl = o.out64, o.lsel = o.lse64;
  } else {
    Naive<float>{p, q, k, v}.forward(dt, o.outl, o.lsel);
  }
  return o;
}

inline void check_forward_case(const Case& c) {
  const Problem p = problem_of(c);
  for (DType dt : c.dtypes) {
    context() = c.name + " " + dtype_str(dt);
    const Inputs in = make_inputs(c, dt, seed_of(c.name));
    const ForwardOracle o = forward_oracle(p, in);

    // The library's oracle, in float64 and in the dtype.
    const Forward r64 = run_forward(c, to_float64(in), options_of(c, Schedule::reference));
    const double ref_err = max_diff(r64.out.values(), o.out64);
    CHECK_MSG(ref_err <= 1e-12 * std::max(1.0, max_abs(o.out64)),
              "reference(float64) out vs naive float64: " + num(ref_err));
    check_rounded("reference(float64) lse", r64.lse.values(), o.lse64, DType::float32);
    const Forward rd = run_forward(c, in, options_of(c, Schedule::reference));
    check_rounded("reference out", rd.out.values(), o.out64, dt);
    check_rounded("reference lse", rd.lse.values(), o.lse64, DType::float32);
    check_empty_rows(p, rd, "reference");

    for (auto [s, sram] : fast_runs(c)) {
      const std::string name = run_name(s, sram);
      const Forward f = run_forward(c, in, options_of(c, s, 0, sram));
      check_rule(name + " out", f.out.values(), o.out64, o.outl, dt);
      check_rule(name + " lse", f.lse.values(), o.lse64, o.lsel, DType::float32);
      check_empty_rows(p, f, name);
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------

struct Oracle {
  std::vector<double> dq, dk, dv;
};

// Sizes of the terms each gradient sums (the floor of the rule where a gradient cancels to ~0,
// e.g. dq with one visible key, where dP - D is 0 up to rounding):
//   dq: scale |dO| |v| z max|k|;  dk: the same with max|q|, times the largest attention mass
//   sum_i P_ij Z_ij a key receives;  dv: max|dO| times that mass.  (|.|: largest row 2-norm.)
struct Magnitudes {
  double dq = 0, dk = 0, dv = 0;
};

inline double max_row_norm(const std::vector<double>& x, int64_t d) {
  double m = 0;
  for (size_t r = 0; d > 0 && r < x.size() / d; ++r) {
    double s = 0;
    for (int64_t c = 0; c < d; ++c) s += x[r * d + c] * x[r * d + c];
    m = std::max(m, std::sqrt(s));
  }
  return m;
}

inline Magnitudes magnitudes(const Problem& p, const Naive<double>& n,
                             const std::vector<double>& dout) {
  const double z = p.dropout > 0 ? 1.0 / (1.0 - p.dropout) : 1.0;
  const double base = p.scale * max_row_norm(dout, p.d) * max_row_norm(n.v, p.d) * z;
  const double mass = n.max_key_mass();
  return {base * max_abs(n.k), base * max_abs(n.q) * mass, max_abs(dout) * mass};
}

// All oracles of a case: ref64 (exact lse) and the naive algorithm in the dtype, whose backward
// uses its own rounded out and its lse rounded to float32, as the library's schedules do.
struct Oracles {
  Oracle ref, naive;
  Magnitudes mag;
};

inline Oracles oracles(const Problem& p, const Inputs& in) {
  const DType dt = in.q.dtype();
  const std::vector<double> q = in.q.values(), k = in.k.values(), v = in.v.values();
  const std::vector<double> dout = in.dout.values();
  Oracles o;
  std::vector<double> out64, lse64, outl, lsel;
  const Naive<double> n64{p, q, k, v};
  n64.forward(DType::float64, out64, lse64);
  n64.backward(dout, out64, DType::float64, DType::float64, o.ref.dq, o.ref.dk, o.ref.dv);
  if (dt == DType::float64) {
    n64.backward(dout, out64, DType::float64, DType::float32, o.naive.dq, o.naive.dk, o.naive.dv);
  } else {
    const Naive<float> nl{p, q, k, v};
    nl.forward(dt, outl, lsel);
    nl.backward(dout, outl, dt, DType::float32, o.naive.dq, o.naive.dk, o.naive.dv);
  }
  o.mag = magnitudes(p, n64, dout);
  return o;
}

inline void check_grads(const std::string& who, const Grads& g, const Oracles& o, DType dt) {
  check_rule(who + " dq", g.dq.values(), o.ref.dq, o.naive.dq, dt, o.mag.dq);
  check_rule(who + " dk", g.dk.values(), o.ref.dk, o.naive.dk, dt, o.mag.dk);
  check_rule(who + " dv", g.dv.values(), o.ref.dv, o.naive.dv, dt, o.mag.dv);
}

// Exact zeros where the mask leaves nothing to differentiate: dq of a row of (b, h) that sees no
// key; dk, dv of a key of (b, kv head) that no row of any query head of its group sees.
inline void check_masked_zeros(const Problem& p, const Grads& g, const std::string& who) {
  const auto dq = g.dq.values(), dk = g.dk.values(), dv = g.dv.values();
  int64_t bad = 0;
  std::vector<char> row_seen(static_cast<size_t>(p.sq)), key_seen(static_cast<size_t>(p.sk));
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t hk = 0; hk < p.hk; ++hk) {
      std::fill(key_seen.begin(), key_seen.end(), 0);
      for (int64_t h = 0; h < p.h; ++h) {
        if (p.kv_head(h) != hk) continue;
        std::fill(row_seen.begin(), row_seen.end(), 0);
        for (int64_t i = 0; i < p.sq; ++i)
          for (int64_t j = 0; j < p.sk; ++j)
            if (p.visible(b, h, i, j)) row_seen[i] = key_seen[j] = 1;
        for (int64_t i = 0; i < p.sq; ++i)
          for (int64_t c = 0; c < p.d && !row_seen[i]; ++c) bad += dq[p.qi(b, i, h) + c] != 0.0;
      }
      for (int64_t j = 0; j < p.sk; ++j)
        for (int64_t c = 0; c < p.d && !key_seen[j]; ++c)
          bad += (dk[p.ki(b, j, hk) + c] != 0.0) + (dv[p.ki(b, j, hk) + c] != 0.0);
    }
  CHECK_MSG(bad == 0, who + ": " + std::to_string(bad) + " masked gradient elements not 0");
}

inline void check_backward_case(const Case& c) {
  const Problem p = problem_of(c);
  for (DType dt : c.dtypes) {
    context() = c.name + " " + dtype_str(dt);
    const Inputs in = make_inputs(c, dt, 1234 + c.sq * 7 + c.sk);
    const Oracles o = oracles(p, in);
    const Oracle& ref = o.ref;

    // The library's oracle in float64 and in the dtype.
    const Inputs in64 = to_float64(in);
    const Options ro = options_of(c, Schedule::reference);
    const Grads r64 = run_backward(c, in64, run_forward(c, in64, ro), ro);
    const double tight = 1e-11;
    CHECK_MSG(max_diff(r64.dq.values(), ref.dq) <= tight * std::max(1.0, max_abs(ref.dq)),
              "reference dq");
    CHECK_MSG(max_diff(r64.dk.values(), ref.dk) <= tight * std::max(1.0, max_abs(ref.dk)),
              "reference dk");
    CHECK_MSG(max_diff(r64.dv.values(), ref.dv) <= tight * std::max(1.0, max_abs(ref.dv)),
              "reference dv");
    const Grads rd = run_backward(c, in, run_forward(c, in, ro), ro);
    check_rounded("reference dq", rd.dq.values(), ref.dq, dt);
    check_rounded("reference dk", rd.dk.values(), ref.dk, dt);
    check_rounded("reference dv", rd.dv.values(), ref.dv, dt);
    check_masked_zeros(p, rd, "reference");

    for (auto [s, sram] : fast_runs(c)) {
      const std::string name = run_name(s, sram);
      const Options so = options_of(c, s, 0, sram);
      const Grads g = run_backward(c, in, run_forward(c, in, so), so);
      check_grads(name, g, o, dt);
      check_masked_zeros(p, g, name);
    }
  }
}

}  // namespace flashdl_test
