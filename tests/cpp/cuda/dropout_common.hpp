// What the dropout checks of both CUDA tests share: the dropout stream of a case, the options of a
// call, the tolerance rule under dropout, and a forward on contiguous arrays. The layout paths are
// covered by the tests without dropout; these checks keep the arrays contiguous and vary the mask,
// the probability and the stream instead.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "backward_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"

namespace cuda_test::dropout {

using flashdl::DType;
using flashdl::Schedule;

// One dropout stream: the probability of dropping and the Philox key.
struct Drop {
  float p;
  uint64_t seed, offset;
};

// A dense problem (no window other than causal) with its dropout stream.
struct Problem {
  int64_t b, sq, sk, h, hk, d;
  bool causal;
  Drop drop;
  // The dropout slice (Options::dropout_batch_offset and siblings): this problem as batches
  // [batch_offset, batch_offset + b) and heads [head_offset, head_offset + h) of a call with
  // nheads_total heads (0: h), whose mask it draws.
  int64_t batch_offset = 0, head_offset = 0, nheads_total = 0;

  Shape shape() const { return Shape{b, sq, sk, h, hk, d, -1, causal ? 0 : -1}; }

  // The call's options; `with_dropout = false` gives the same problem without dropout, whose
  // naive_lowp error sets the tolerance.
  flashdl::Options options(bool with_dropout = true) const {
    flashdl::Options o;
    o.causal = causal;
    if (with_dropout) {
      o.dropout_p = drop.p;
      o.seed = drop.seed;
      o.offset = drop.offset;
      o.dropout_batch_offset = batch_offset;
      o.dropout_head_offset = head_offset;
      o.dropout_nheads_total = nheads_total;
    }
    return o;
  }

  std::string label(const char* what, const char* variant, DType dt) const {
    char buf[240];
    std::snprintf(buf, sizeof buf,
                  "%s p=%g seed=%llu/%llu %s %s d=%lld b=%lld sq=%lld sk=%lld h=%lld/%lld%s", what,
                  double(drop.p), (unsigned long long)drop.seed, (unsigned long long)drop.offset,
                  variant, flashdl::dtype_name(dt), (long long)d, (long long)b, (long long)sq,
                  (long long)sk, (long long)h, (long long)hk, causal ? " causal" : "");
    std::string label = buf;
    if (nheads_total > 0)
      label += " slice(b+" + std::to_string(batch_offset) + ", h+" + std::to_string(head_offset) +
               " of " + std::to_string(nheads_total) + ")";
    return label;
  }
};

// The schedules the dropout checks run. fa1 with an 8 KiB budget (16 x 16 tiles) shows that the
// mask does not depend on the tiling.
struct Variant {
  const char* name;
  Schedule schedule;
  int64_t sram_bytes;
  bool deterministic;
};

const Variant kForwardVariants[] = {{"fa1", Schedule::fa1, 0, false},
                                    {"fa1(8KiB)", Schedule::fa1, 8192, false},
                                    {"fa2", Schedule::fa2, 0, false}};

inline double eps_of(DType dt) { return dt == DType::float16 ? 1e-3 : 8e-3; }

// The tolerance rule under dropout. naive_lowp does not model dropout, so its error is measured
// on the same inputs without dropout and scaled by 1 / (1 - p): the kept probabilities, and with
// them their rounding errors, grow by that factor. `k` is 2 for out and 3 for gradients; `eps` as
// in the rule without dropout.
inline double tolerance(double k, double lowp_err, float p, double eps) {
  return k * lowp_err / (1.0 - double(p)) + eps;
}

// Returns the kernel's lse and out (logical (b, h, sq) and (b, sq, h, d)).
struct FwdResult {
  std::vector<double> out;
  std::vector<float> lse;
};

// One forward on contiguous arrays; out and lse are poisoned with NaN first, so an element the
// kernel never writes fails every check.
inline FwdResult run_forward(const Target& t, const Problem& pr, DType dt, const BwdInputs& in,
                             const Variant& var) {
  const Shape s = pr.shape();
  const Layout lq = make_layout(s.b, s.sq, s.h, s.d, Kind::contiguous);
  const Layout lk = make_layout(s.b, s.sk, s.hk, s.d, Kind::contiguous);
  const Layout ll = lse_layout(s.b, s.h, s.sq, false);
  Buffer q(size_t(lq.span) * 2, t.host), k(size_t(lk.span) * 2, t.host),
      v(size_t(lk.span) * 2, t.host), out(size_t(lq.span) * 2, t.host),
      lse(size_t(ll.span) * 4, t.host);
  q.upload(place(in.q, lq, dt));
  k.upload(place(in.k, lk, dt));
  v.upload(place(in.v, lk, dt));
  out.poison();
  lse.poison();
  flashdl::Options o = pr.options();
  o.schedule = var.schedule;
  o.sram_bytes = var.sram_bytes;
  o.stream = t.stream;
  flashdl::forward(view_of(q, dt, lq, 4), view_of(k, dt, lk, 4), view_of(v, dt, lk, 4),
                   view_of(out, dt, lq, 4), view_of(lse, DType::float32, ll, 3), o);
  t.sync();
  bool unused_gaps = true;  // contiguous: there are no gaps
  return FwdResult{gather(out.download<uint16_t>(), lq, dt, unused_gaps), lse.download<float>()};
}

// lse is that of the undropped scores: -inf exactly where `want` has it, else within
// 1e-3 + 1e-4 |lse| (the rule without dropout).
inline bool lse_matches(const std::vector<float>& got, const std::vector<float>& want) {
  bool ok = got.size() == want.size();
  for (size_t i = 0; ok && i < want.size(); ++i) {
    const double w = want[i];
    ok = std::isinf(w) ? got[i] == want[i] : std::fabs(got[i] - w) <= 1e-3 + 1e-4 * std::fabs(w);
  }
  return ok;
}

inline std::vector<float> rounded(const std::vector<double>& x, DType dt) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = round_to(float(x[i]), dt);
  return r;
}

}  // namespace cuda_test::dropout
