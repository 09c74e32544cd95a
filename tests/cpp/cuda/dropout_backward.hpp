// Dropout in the CUDA backward kernels: dq, dk, dv of random inputs against the CPU float64
// reference with the same dropout stream (which applies the same mask), under the tolerance rule
// of dropout_common.hpp; every schedule against fa2 under the same bound; exact zeros where the
// mask (causal) leaves a row or a key without scores; and deterministic fa2 with dropout bitwise
// reproducible. The saved tensors are those of the float64 forward with the same stream (out
// rounded to the dtype, lse of the undropped scores), as the forward would have returned them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "backward_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "dropout_common.hpp"
#include "flashdl/api.hpp"

namespace cuda_test::dropout {

const Variant kBackwardVariants[] = {{"fa1", Schedule::fa1, 0, false},
                                     {"fa1(8KiB)", Schedule::fa1, 8192, false},
                                     {"fa2(det)", Schedule::fa2, 0, true},
                                     {"fa2", Schedule::fa2, 0, false}};  // last: the comparison

// The backward's inputs and saved tensors on the target, contiguous, uploaded once per dtype.
struct SavedArrays {
  Layout lq, lk, ll;
  Buffer q, k, v, dout, out, lse;

  SavedArrays(const Target& t, const Shape& s, DType dt, const BwdInputs& in,
              const std::vector<float>& out_r, const std::vector<float>& lse_r)
      : lq(make_layout(s.b, s.sq, s.h, s.d, Kind::contiguous)),
        lk(make_layout(s.b, s.sk, s.hk, s.d, Kind::contiguous)),
        ll(lse_layout(s.b, s.h, s.sq, false)),
        q(size_t(lq.span) * 2, t.host),
        k(size_t(lk.span) * 2, t.host),
        v(size_t(lk.span) * 2, t.host),
        dout(size_t(lq.span) * 2, t.host),
        out(size_t(lq.span) * 2, t.host),
        lse(size_t(ll.span) * 4, t.host) {
    q.upload(place(in.q, lq, dt));
    k.upload(place(in.k, lk, dt));
    v.upload(place(in.v, lk, dt));
    dout.upload(place(in.dout, lq, dt));
    out.upload(place(out_r, lq, dt));
    lse.upload(lse_r);
  }
};

// dq, dk, dv poisoned with NaN, then one backward.
inline Grads run_backward(const Target& t, const Problem& pr, DType dt, const SavedArrays& a,
                          const Variant& var) {
  Buffer dq(size_t(a.lq.span) * 2, t.host), dk(size_t(a.lk.span) * 2, t.host),
      dv(size_t(a.lk.span) * 2, t.host);
  dq.poison();
  dk.poison();
  dv.poison();
  flashdl::Options o = pr.options();
  o.schedule = var.schedule;
  o.sram_bytes = var.sram_bytes;
  o.deterministic = var.deterministic;
  o.stream = t.stream;
  flashdl::backward(view_of(a.dout, dt, a.lq, 4), view_of(a.q, dt, a.lq, 4),
                    view_of(a.k, dt, a.lk, 4), view_of(a.v, dt, a.lk, 4),
                    view_of(a.out, dt, a.lq, 4), view_of(a.lse, DType::float32, a.ll, 3),
                    view_of(dq, dt, a.lq, 4), view_of(dk, dt, a.lk, 4), view_of(dv, dt, a.lk, 4),
                    o);
  t.sync();
  bool unused_gaps = true;  // contiguous: there are no gaps
  return Grads{gather(dq.download<uint16_t>(), a.lq, dt, unused_gaps),
               gather(dk.download<uint16_t>(), a.lk, dt, unused_gaps),
               gather(dv.download<uint16_t>(), a.lk, dt, unused_gaps)};
}

// The bound for each gradient: 3 max|lowp - ref| of the problem without dropout, scaled by
// 1 / (1 - p), plus eps max(1, max|ref|) with ref the gradient with dropout.
struct GradBounds {
  double dq, dk, dv;
};

inline GradBounds grad_bounds(const BwdOracle& ref, const BwdOracle& plain, const Grads& lowp,
                              float p, DType dt) {
  auto bound = [&](const std::vector<double>& r, const std::vector<double>& pl,
                   const std::vector<double>& lo) {
    double ref_max = 1.0;
    for (double x : r) ref_max = std::max(ref_max, std::fabs(x));
    return tolerance(3.0, max_abs_diff(lo, pl), p, eps_of(dt) * ref_max);
  };
  return GradBounds{bound(ref.dq, plain.dq, lowp.dq), bound(ref.dk, plain.dk, lowp.dk),
                    bound(ref.dv, plain.dv, lowp.dv)};
}

// The bounds, no NaN, and exact zeros for rows with no visible key and keys no row sees (the mask
// leaves them no score; dropout must not make them non-zero).
inline bool check_grads(const std::string& label, const Shape& s, const Grads& got,
                        const Grads& want, const GradBounds& tol) {
  const double eq = max_abs_diff(got.dq, want.dq), ek = max_abs_diff(got.dk, want.dk),
               ev = max_abs_diff(got.dv, want.dv);
  const bool nan = any_nan(got.dq) || any_nan(got.dk) || any_nan(got.dv);
  const std::vector<char> unseen = unseen_keys(s);
  const int64_t zeros_broken = nonzero_in_flagged(got.dq, s.h, s.d, empty_rows(s)) +
                               nonzero_in_flagged(got.dk, s.hk, s.d, unseen) +
                               nonzero_in_flagged(got.dv, s.hk, s.d, unseen);
  const bool ok = eq <= tol.dq && ek <= tol.dk && ev <= tol.dv && !nan && zeros_broken == 0;
  std::printf("%s %s | dq %.2e/%.2e dk %.2e/%.2e dv %.2e/%.2e%s%s\n", ok ? "ok  " : "FAIL",
              label.c_str(), eq, tol.dq, ek, tol.dk, ev, tol.dv, nan ? " [NaN]" : "",
              zeros_broken ? " [gradient of an empty row or unseen key not 0]" : "");
  return ok;
}

inline BwdInputs random_inputs(const Shape& s, std::mt19937& rng) {
  BwdInputs in;
  in.q = random_values(s.b * s.sq * s.h * s.d, rng);
  in.k = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.v = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.dout = random_values(s.b * s.sq * s.h * s.d, rng);
  return in;
}

inline int run_backward_accuracy(const Target& t, const Cli& cli) {
  struct Plan {
    Problem pr;  // d is set per head dim
    std::vector<int> dims;
  };
  std::vector<Plan> plans;
  // The slice plans are checked against the CPU reference of the same slice, which
  // test_dropout_slice.py shows to be bitwise the slice of the whole call.
  if (cli.quick) {
    plans = {{{1, 70, 45, 2, 1, 0, true, {0.3f, 11, 1}}, {64}},            // 25 rows see nothing
             {{1, 70, 45, 2, 1, 0, true, {0.3f, 11, 1}, 3, 2, 6}, {64}}};  // a slice
  } else {
    plans = {
        {{2, 97, 97, 4, 2, 0, false, {0.17f, 1234, 5}}, {64, 128}},  // ragged, GQA
        {{1, 257, 130, 2, 1, 0, true, {0.5f, 77, 0}}, {64, 128}},    // MQA, 127 empty rows
        {{1, 130, 300, 2, 2, 0, true, {0.1f, 0xfeedull << 32, 3}}, {32, 256}},  // 170 unseen keys
        {{2, 97, 97, 4, 2, 0, false, {0.17f, 1234, 5}, 5, 8, 16}, {64}},        // a slice, GQA
    };
  }
  int failures = 0;
  for (size_t pi = 0; pi < plans.size(); ++pi)
    for (const int d : plans[pi].dims) {
      Problem pr = plans[pi].pr;
      pr.d = d;
      auto label_of = [&](const char* variant, DType dt) {
        return pr.label("dropout", variant, dt);
      };
      bool any = false;
      for (const Variant& var : kBackwardVariants)
        for (const DType dt : {DType::float16, DType::bfloat16})
          any |= cli.selected(label_of(var.name, dt));
      if (!any) continue;
      const Shape s = pr.shape();
      std::mt19937 rng(uint32_t(104729 * pi + size_t(d)));
      const BwdInputs in = random_inputs(s, rng);
      const BwdOracle ref = reference_backward(s, pr.options(), in, true);
      const BwdOracle plain = reference_backward(s, pr.options(false), in, true);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        const GradBounds tol = grad_bounds(ref, plain,
                                           naive_lowp_backward(s, in, rounded(plain.out, dt), dt),
                                           pr.drop.p, dt);
        const SavedArrays saved(t, s, dt, in, rounded(ref.out, dt), ref.lse);
        std::vector<Grads> grads(std::size(kBackwardVariants));
        std::vector<char> ran(grads.size(), 0);
        for (size_t vi = 0; vi < grads.size(); ++vi) {
          const Variant& var = kBackwardVariants[vi];
          const std::string label = label_of(var.name, dt);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            grads[vi] = run_backward(t, pr, dt, saved, var);
            ran[vi] = 1;
            return check_grads(label, s, grads[vi], Grads{ref.dq, ref.dk, ref.dv}, tol);
          });
        }
        for (size_t vi = 0; vi + 1 < grads.size(); ++vi) {
          if (!ran[vi] || !ran.back()) continue;  // filtered out, or threw
          const std::string label = label_of(kBackwardVariants[vi].name, dt) + " vs fa2";
          failures += run_case(label,
                               [&] { return check_grads(label, s, grads[vi], grads.back(), tol); });
        }
      }
    }
  return failures;
}

// Deterministic fa2 with dropout: 20 calls, bitwise equal dq, dk and dv.
inline int run_backward_repeats(const Target& t, const Cli& cli) {
  const Problem pr{2, 500, 600, 4, 2, 64, true, {0.2f, 2024, 9}};
  const Variant& var = kBackwardVariants[2];
  const DType dt = DType::float16;
  const std::string label = "repeat x20 " + pr.label("dropout", var.name, dt);
  if (!cli.selected(label)) return 0;
  const Shape s = pr.shape();
  std::mt19937 rng(31337);
  const BwdInputs in = random_inputs(s, rng);
  const BwdOracle ref = reference_backward(s, pr.options(), in, false);
  const SavedArrays saved(t, s, dt, in, rounded(ref.out, dt), ref.lse);
  return run_case(label, [&] {
    const Grads first = run_backward(t, pr, dt, saved, var);
    auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
      return a.size() == b.size() &&
             std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
    };
    int differ = 0;
    for (int i = 1; i < 20; ++i) {
      const Grads g = run_backward(t, pr, dt, saved, var);
      differ += !same(g.dq, first.dq) || !same(g.dk, first.dk) || !same(g.dv, first.dv);
    }
    const bool nan = any_nan(first.dq) || any_nan(first.dk) || any_nan(first.dv);
    std::printf("%s %s | %d of 19 repeats differ%s\n", differ || nan ? "FAIL" : "ok  ",
                label.c_str(), differ, nan ? " [NaN]" : "");
    return differ == 0 && !nan;
  });
}

}  // namespace cuda_test::dropout
