// Dropout in the CUDA forward kernels.
//
// The exact mask: with q = k = 0 every visible probability of row i is 1 / n_i (n_i its visible
// keys), and with v the identity (seqlen_k <= headdim, v[b, j, hk, c] = (j == c)) the output is
// the dropped probability matrix itself: out[b, i, h, j] = Z_ij / (n_i (1 - p)) for j < seqlen_k,
// 0 for j >= seqlen_k. So out != 0 must equal flashdl::dropout_mask (the CPU's Philox) bit for bit
// on the visible elements, be 0 on the invisible ones (causal) whatever the mask says, and the
// kept values must be 1 / (n_i (1 - p)) up to the dtype's rounding; lse must be log n_i, that of
// the undropped scores.
//
// Accuracy: random inputs against the CPU float64 reference with the same stream (which applies
// the same mask), under the tolerance rule of dropout_common.hpp, and fa1 against fa2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backward_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "dropout_common.hpp"
#include "flashdl/api.hpp"

namespace cuda_test::dropout {

// The comparison of a forward's output with the keep-mask.
struct MaskStats {
  int64_t pattern_errors = 0;  // out != 0 where the element must be 0, or 0 where it is kept
  int64_t value_errors = 0;    // kept, but not 1 / (n_i (1 - p)) to the dtype's rounding
  int64_t visible = 0, kept = 0;
  double worst_rel = 0.0;
  bool lse_ok = true;
  std::string first;  // where the first pattern error is, for the log

  bool ok() const { return pattern_errors == 0 && value_errors == 0 && lse_ok; }
};

// `keep` is dropout_mask's (b, h, sq, sk) array.
inline MaskStats compare_with_mask(const Problem& pr, const bool* keep, const FwdResult& r,
                                   DType dt) {
  const Shape s = pr.shape();
  // Two roundings at most (P, possibly scaled, to the dtype; out to the dtype), each half a unit
  // in the last place: one machine epsilon of the dtype, doubled for the float arithmetic.
  const double rel_tol = 2.0 * (dt == DType::float16 ? 0x1p-10 : 0x1p-7);
  MaskStats m;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i) {
        int64_t n = 0;
        for (int64_t j = 0; j < s.sk; ++j) n += s.visible(i, j);
        const double want = n ? 1.0 / (double(n) * (1.0 - double(pr.drop.p))) : 0.0;
        const float lse = r.lse[size_t((b * s.h + h) * s.sq + i)];
        const double log_n = std::log(double(n));
        m.lse_ok &= n == 0 ? lse == -INFINITY : std::fabs(lse - log_n) <= 1e-3 + 1e-4 * log_n;
        const bool* z = keep + ((b * s.h + h) * s.sq + i) * s.sk;
        const double* o = &r.out[size_t(((b * s.sq + i) * s.h + h) * s.d)];
        for (int64_t c = 0; c < s.d; ++c) {
          const bool visible = c < s.sk && s.visible(i, c);
          const bool kept = visible && z[c];
          m.visible += visible;
          m.kept += visible && o[c] != 0.0;
          if ((o[c] != 0.0) != kept) {  // NaN counts as non-zero
            if (m.pattern_errors++ == 0) {
              char buf[160];
              std::snprintf(buf, sizeof buf, " first at (b %lld, h %lld, i %lld, j %lld): %g, %s",
                            (long long)b, (long long)h, (long long)i, (long long)c, o[c],
                            !visible ? "invisible"
                            : kept   ? "kept"
                                     : "dropped");
              m.first = buf;
            }
          } else if (kept) {
            const double rel = std::fabs(o[c] - want) / want;
            m.worst_rel = std::max(m.worst_rel, rel);
            m.value_errors += !(rel <= rel_tol);
          }
        }
      }
  return m;
}

// q = k = 0 and v the identity on the first seqlen_k columns of the head dim.
inline BwdInputs identity_inputs(const Shape& s) {
  BwdInputs in;
  in.q.assign(size_t(s.b * s.sq * s.h * s.d), 0.0f);
  in.k.assign(size_t(s.b * s.sk * s.hk * s.d), 0.0f);
  in.v.assign(in.k.size(), 0.0f);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t j = 0; j < s.sk; ++j)
      for (int64_t hk = 0; hk < s.hk; ++hk)
        in.v[size_t(((b * s.sk + j) * s.hk + hk) * s.d + j)] = 1.0f;
  return in;
}

// Every schedule and dtype on one problem and stream.
inline int mask_problem(const Target& t, const Cli& cli, const Problem& pr) {
  auto label_of = [&](const Variant& var, DType dt) { return pr.label("mask", var.name, dt); };
  bool any = false;
  for (const Variant& var : kForwardVariants)
    for (const DType dt : {DType::float16, DType::bfloat16}) any |= cli.selected(label_of(var, dt));
  if (!any) return 0;
  const Shape s = pr.shape();
  // The mask of the whole call (the problem is a slice of it when it has slice offsets), and
  // the problem's slice of it.
  const int64_t wb = pr.batch_offset + s.b, wh = pr.nheads_total > 0 ? pr.nheads_total : s.h;
  const size_t plane = size_t(s.sq * s.sk);
  const std::unique_ptr<bool[]> whole(new bool[size_t(wb * wh) * plane]);
  flashdl::dropout_mask(flashdl::make_view(whole.get(), DType::boolean, {wb, wh, s.sq, s.sk}),
                        pr.drop.p, pr.drop.seed, pr.drop.offset);
  const std::unique_ptr<bool[]> keep(new bool[size_t(s.b * s.h) * plane]);
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.h; ++h)
      std::copy_n(whole.get() + size_t((b + pr.batch_offset) * wh + h + pr.head_offset) * plane,
                  plane, keep.get() + size_t(b * s.h + h) * plane);
  const BwdInputs in = identity_inputs(s);
  const double keep_rate = 1.0 - double(pr.drop.p);
  int failures = 0;
  for (const DType dt : {DType::float16, DType::bfloat16})
    for (const Variant& var : kForwardVariants) {
      const std::string label = label_of(var, dt);
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        const MaskStats m = compare_with_mask(pr, keep.get(), run_forward(t, pr, dt, in, var), dt);
        const double fraction = m.visible ? double(m.kept) / double(m.visible) : 0.0;
        // Below ~1e5 elements the fraction is too noisy for a +-0.01 bound (at 262,144 and
        // p = 0.5 its standard deviation is 0.001).
        const bool large = m.visible >= 100000;
        const bool fraction_ok = !large || std::fabs(fraction - keep_rate) <= 0.01;
        const bool ok = m.ok() && fraction_ok;
        std::printf(
            "%s %s | kept %.4f of %lld%s, worst rel %.1e, %lld pattern / %lld value "
            "errors%s%s%s\n",
            ok ? "ok  " : "FAIL", label.c_str(), fraction, (long long)m.visible,
            large ? " (checked)" : "", m.worst_rel, (long long)m.pattern_errors,
            (long long)m.value_errors, m.first.c_str(), m.lse_ok ? "" : " [lse]",
            fraction_ok ? "" : " [kept fraction]");
        return ok;
      });
    }
  return failures;
}

inline int run_mask_tests(const Target& t, const Cli& cli) {
  // (b, sq, sk, h, hk, d, causal); the stream is set below.
  std::vector<Problem> problems;
  if (cli.quick) {
    problems = {{1, 100, 40, 4, 2, 64, true, {}},  // GQA, causal, 60 rows see nothing
                // batch 2, heads 4..7 of a call with 10 heads: that slice of its mask
                {1, 100, 40, 4, 2, 64, true, {}, 2, 4, 10}};
  } else {
    problems = {
        {1, 1, 64, 2, 2, 64, false, {}},             // one query row
        {2, 100, 40, 4, 2, 64, false, {}},           // GQA, sq > sk; columns 40..63 stay 0
        {1, 300, 64, 4, 1, 64, false, {}},           // MQA
        {2, 512, 64, 4, 4, 64, false, {}},           // 262,144 elements: the kept fraction
        {1, 130, 64, 2, 1, 64, true, {}},            // causal, 66 rows see nothing
        {2, 40, 64, 2, 2, 64, true, {}},             // causal, sq < sk
        {1, 200, 100, 2, 1, 128, true, {}},          // head dim 128, causal
        {1, 100, 40, 4, 2, 64, true, {}, 2, 4, 10},  // a slice: batch 2, heads 4..7 of 10
        {2, 64, 64, 2, 2, 64, false, {}, 3, 0, 2},   // a batch slice: batches 3..4
    };
  }
  std::vector<float> ps{0.5f};
  // A small key, and one that uses the high 32 bits of the seed with a non-zero offset.
  std::vector<std::pair<uint64_t, uint64_t>> streams{{42, 0}};
  if (!cli.quick) {
    ps.push_back(0.1f);
    streams.push_back({0x9e3779b97f4a7c15ull, 7});
  }
  int failures = 0;
  for (Problem pr : problems)
    for (const float p : ps)
      for (const auto& [seed, offset] : streams) {
        pr.drop = Drop{p, seed, offset};
        failures += mask_problem(t, cli, pr);
      }
  return failures;
}

// Random inputs against the float64 reference with the same dropout stream; then every schedule
// against fa2 under the same bound (the same mask, so they agree to rounding).
inline int run_forward_accuracy(const Target& t, const Cli& cli) {
  struct Plan {
    Problem pr;  // d is set per head dim
    std::vector<int> dims;
  };
  std::vector<Plan> plans;
  if (cli.quick) {
    plans = {{{1, 70, 45, 2, 1, 0, true, {0.3f, 11, 1}}, {64}}};  // 25 rows see nothing
  } else {
    plans = {
        {{2, 97, 97, 4, 2, 0, false, {0.17f, 1234, 5}}, {64, 128}},  // ragged, GQA
        {{1, 257, 130, 2, 1, 0, true, {0.5f, 77, 0}}, {64, 128}},    // MQA, 127 empty rows
        {{1, 130, 300, 2, 2, 0, true, {0.1f, 0xfeedull << 32, 3}}, {32, 256}},  // sq < sk
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
      for (const Variant& var : kForwardVariants)
        for (const DType dt : {DType::float16, DType::bfloat16})
          any |= cli.selected(label_of(var.name, dt));
      if (!any) continue;
      const Shape s = pr.shape();
      std::mt19937 rng(uint32_t(104729 * pi + size_t(d)));
      BwdInputs in;
      in.q = random_values(s.b * s.sq * s.h * d, rng);
      in.k = random_values(s.b * s.sk * s.hk * d, rng);
      in.v = random_values(s.b * s.sk * s.hk * d, rng);
      const BwdOracle ref = reference_backward(s, pr.options(), in, false);
      const BwdOracle plain = reference_backward(s, pr.options(false), in, false);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        std::vector<double> lowp;
        naive_lowp(s, in.q, in.k, in.v, dt, lowp);
        const double tol = tolerance(2.0, max_abs_diff(lowp, plain.out), pr.drop.p, eps_of(dt));
        std::vector<std::vector<double>> outs(std::size(kForwardVariants));
        for (size_t vi = 0; vi < outs.size(); ++vi) {
          const Variant& var = kForwardVariants[vi];
          const std::string label = label_of(var.name, dt);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            const FwdResult r = run_forward(t, pr, dt, in, var);
            const double err = max_abs_diff(r.out, ref.out);
            const bool lse_ok = lse_matches(r.lse, plain.lse);  // undropped scores
            const bool ok = err <= tol && lse_ok;
            std::printf("%s %s | err %.2e tol %.2e%s\n", ok ? "ok  " : "FAIL", label.c_str(), err,
                        tol, lse_ok ? "" : " [lse]");
            outs[vi] = r.out;
            return ok;
          });
        }
        const std::vector<double>& fa2 = outs.back();
        for (size_t vi = 0; vi + 1 < outs.size(); ++vi) {
          if (outs[vi].empty() || fa2.empty()) continue;  // filtered out, or threw
          const std::string label = label_of(kForwardVariants[vi].name, dt) + " vs fa2";
          failures += run_case(label, [&] {
            const double diff = max_abs_diff(outs[vi], fa2);
            std::printf("%s %s | diff %.2e tol %.2e\n", diff <= tol ? "ok  " : "FAIL",
                        label.c_str(), diff, tol);
            return diff <= tol;
          });
        }
      }
    }
  return failures;
}

}  // namespace cuda_test::dropout
