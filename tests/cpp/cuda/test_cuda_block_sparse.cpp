// Block-sparse attention (Options::block_mask, a bool view on the device) in the CUDA kernels: fa1,
// fa1 with an 8 KiB budget (16 x 16 tiles), fa2 and fa2 deterministic, forward and backward, both
// dtypes, head dims 64 and 128, against the CPU float64 reference with the same mask (on the
// host), under flash-attn's rule with a masked naive algorithm in the input precision
// (block_sparse_oracle.hpp). Blocks of 64, 48, 100, 32 x 80, ... do not line up with the kernels'
// tiles; masks per (batch, head), broadcast by size-1 dimensions and by a stride of 0, padded;
// causal, GQA/MQA; zero rows and columns of blocks and an all-zero mask, whose rows and keys must
// get exact zeros. Then NaN in q, k, v rows that only zero blocks cover must change nothing (bit
// for bit), and deterministic schedules repeat bitwise; block masks with the score modifiers
// (softcap, ALiBi), whose zero blocks must stay exactly zero under a cap. Outputs are poisoned with
// NaN before every call and their gaps must stay untouched. Exit code 77 (skipped) without a CUDA
// device.
// Command line (cli.hpp): --quick (for compute-sanitizer), --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "backward_oracle.hpp"
#include "block_sparse_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"
#include "score_mod_cases.hpp"

using namespace cuda_test;
using namespace cuda_test::block_sparse;
using flashdl::DType;
using flashdl::Schedule;

namespace {

struct Case {
  const char* name;
  int64_t b, sq, sk, h, hk;
  bool causal;
  int64_t bq, bk;
  MaskKind kind;
  double density;
  int64_t zero_qb, zero_kb;  // a query block no key is visible to, a key block no query sees; -1
  Kind layout;               // of q, k, v, dout, out and the gradients
};

const Case kCases[] = {
    {"blocks = the fa2 tile", 2, 200, 260, 4, 2, false, 64, 64, MaskKind::full, 0.5, -1, -1,
     Kind::contiguous},
    {"MQA causal", 1, 300, 300, 4, 1, true, 48, 48, MaskKind::heads, 0.5, -1, -1, Kind::transposed},
    {"ragged", 2, 257, 190, 2, 2, false, 100, 100, MaskKind::batch, 0.6, -1, -1, Kind::contiguous},
    {"causal sq<sk", 1, 130, 400, 4, 2, true, 32, 80, MaskKind::shared, 0.5, -1, -1, Kind::padded},
    {"broadcast", 2, 150, 170, 2, 1, false, 48, 100, MaskKind::stride0, 0.5, -1, -1,
     Kind::contiguous},
    {"zero block row+column", 2, 260, 200, 4, 2, false, 64, 48, MaskKind::strided, 0.7, 1, 2,
     Kind::odd},
    {"causal zero blocks", 1, 230, 230, 2, 2, true, 100, 64, MaskKind::full, 0.7, 0, 3,
     Kind::contiguous},
    {"all-zero mask", 1, 70, 90, 2, 1, false, 32, 32, MaskKind::shared, 0.0, -1, -1,
     Kind::contiguous},
};
const Case kQuick = {"quick",         1, 100, 130, 4, 2, true, 48, 80, MaskKind::full, 0.6, 1, -1,
                     Kind::contiguous};

struct Variant {
  const char* name;
  Schedule schedule;
  int64_t sram_bytes;  // fa1's budget; 8 KiB gives 16 x 16 tiles
  bool deterministic;  // the backward's
};
const Variant kVariants[] = {{"fa1", Schedule::fa1, 0, false},
                             {"fa1(8KiB)", Schedule::fa1, 8192, false},
                             {"fa2", Schedule::fa2, 0, false},
                             {"fa2(det)", Schedule::fa2, 0, true}};

Shape shape_of(const Case& c, int64_t d) {
  return Shape{c.b, c.sq, c.sk, c.h, c.hk, d, -1, c.causal ? 0 : -1};
}

// A block set with probability `density`, drawn from a hash of the block (the same in any order).
HostMask mask_of(const Case& c, uint64_t seed) {
  return make_mask(c.kind, c.b, c.h, c.sq, c.sk, c.bq, c.bk,
                   [&](int64_t b, int64_t h, int64_t qb, int64_t kb) {
                     if (qb == c.zero_qb || kb == c.zero_kb) return false;
                     std::mt19937_64 r(seed ^ uint64_t(((b * 131 + h) * 8191 + qb) * 65537 + kb));
                     return double(r() >> 11) * 0x1p-53 < c.density;
                   });
}

std::string label_of(const Case& c, int64_t d, DType dt, const char* variant, const char* pass) {
  char buf[240];
  std::snprintf(buf, sizeof buf,
                "%s %s %s d=%lld b=%lld sq=%lld sk=%lld h=%lld/%lld%s blocks %lldx%lld %s %s [%s]",
                pass, variant, flashdl::dtype_name(dt), (long long)d, (long long)c.b,
                (long long)c.sq, (long long)c.sk, (long long)c.h, (long long)c.hk,
                c.causal ? " causal" : "", (long long)c.bq, (long long)c.bk, mask_kind_name(c.kind),
                kind_name(c.layout), c.name);
  return buf;
}

// The inputs of one case in its layout, the mask on the target, and the saved out and lse (the
// float64 forward's, out rounded to the dtype) the backward is given.
struct Arrays {
  Layout lq, lk, ll;
  Buffer q, k, v, dout, out, lse, mask;
  Arrays(const Target& t, const Case& c, const Shape& s, DType dt, const BwdInputs& in,
         const HostMask& m, const std::vector<float>& out_r, const std::vector<float>& lse_r)
      : lq(make_layout(s.b, s.sq, s.h, s.d, c.layout)),
        lk(make_layout(s.b, s.sk, s.hk, s.d, c.layout)),
        ll(lse_layout(s.b, s.h, s.sq, false)),
        q(size_t(lq.span) * 2, t.host),
        k(size_t(lk.span) * 2, t.host),
        v(size_t(lk.span) * 2, t.host),
        dout(size_t(lq.span) * 2, t.host),
        out(size_t(lq.span) * 2, t.host),
        lse(size_t(ll.span) * 4, t.host),
        mask(m.bytes.size(), t.host) {
    q.upload(place(in.q, lq, dt));
    k.upload(place(in.k, lk, dt));
    v.upload(place(in.v, lk, dt));
    dout.upload(place(in.dout, lq, dt));
    out.upload(place(out_r, lq, dt));
    lse.upload(place_lse(lse_r, ll));
    mask.upload(m.bytes);
  }
};

flashdl::Options options_of(const Case& c, const HostMask& m, const flashdl::TensorView& mask) {
  flashdl::Options o;
  o.causal = c.causal;
  o.block_mask = mask;
  o.block_size_q = m.bq;
  o.block_size_k = m.bk;
  return o;
}

struct Result {
  std::vector<double> out, dq, dk, dv;
  std::vector<float> lse;
  bool gaps_untouched = true;
};

// Forward into poisoned out and lse, or (backward) the gradients from the saved out and lse.
// mods: the score modifiers (their slopes on the target), or null.
Result run(const Target& t, const Case& c, const Shape& s, DType dt, const Arrays& in,
           const HostMask& m, const Variant& var, bool backward, const ModArgs* mods = nullptr) {
  flashdl::Options o = options_of(c, m, m.view(in.mask.ptr, in.mask.device()));
  if (mods) o = mods->apply(o, false);
  o.schedule = var.schedule;
  o.sram_bytes = var.sram_bytes;
  o.deterministic = var.deterministic;
  o.stream = t.stream;
  const auto v4 = [&](const Buffer& b, const Layout& l) { return view_of(b, dt, l, 4); };
  Result r;
  if (!backward) {
    Buffer out(in.out.bytes, t.host), lse(in.lse.bytes, t.host);
    out.poison();
    lse.poison();
    flashdl::forward(v4(in.q, in.lq), v4(in.k, in.lk), v4(in.v, in.lk), v4(out, in.lq),
                     view_of(lse, DType::float32, in.ll, 3), o);
    t.sync();
    r.out = gather(out.download<uint16_t>(), in.lq, dt, r.gaps_untouched);
    r.lse = lse.download<float>();
    return r;
  }
  Buffer dq(in.q.bytes, t.host), dk(in.k.bytes, t.host), dv(in.v.bytes, t.host);
  dq.poison();
  dk.poison();
  dv.poison();
  flashdl::backward(v4(in.dout, in.lq), v4(in.q, in.lq), v4(in.k, in.lk), v4(in.v, in.lk),
                    v4(in.out, in.lq), view_of(in.lse, DType::float32, in.ll, 3), v4(dq, in.lq),
                    v4(dk, in.lk), v4(dv, in.lk), o);
  t.sync();
  r.dq = gather(dq.download<uint16_t>(), in.lq, dt, r.gaps_untouched);
  r.dk = gather(dk.download<uint16_t>(), in.lk, dt, r.gaps_untouched);
  r.dv = gather(dv.download<uint16_t>(), in.lk, dt, r.gaps_untouched);
  return r;
}

const char* flag(bool bad, const char* what) { return bad ? what : ""; }

// A failed forward: how many (batch, row, head) rows of out are off, and the first few of them
// with their lse, so that a failure on a GPU says where the kernel went wrong.
void report_bad_rows(const Shape& s, const BwdOracle& ref, const Result& r, double tol) {
  int64_t bad = 0;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t i = 0; i < s.sq; ++i)
      for (int64_t h = 0; h < s.h; ++h) {
        double e = 0.0;
        for (int64_t c = 0; c < s.d; ++c) {
          const size_t at = size_t(((b * s.sq + i) * s.h + h) * s.d + c);
          e = std::max(e, std::fabs(r.out[at] - ref.out[at]));
        }
        const size_t li = size_t((b * s.h + h) * s.sq + i);
        const float want = ref.lse[li], got = r.lse[li];
        const bool lse_bad = std::isinf(want) ? got != want
                                              : !(std::fabs(double(got) - want) <=
                                                  1e-3 + 1e-4 * std::fabs(want));
        if (!(e <= tol) || lse_bad) {
          if (bad < 8)
            std::printf("     bad row b=%lld i=%lld h=%lld: out err %.3e, lse %.6g want %.6g\n",
                        (long long)b, (long long)i, (long long)h, e, double(got), double(want));
          if (bad == 0) {  // the first one in full: is it zero, or another row's output?
            const size_t at = size_t(((b * s.sq + i) * s.h + h) * s.d);
            int64_t best = -1;
            double best_e = 1e300;
            for (int64_t i2 = 0; i2 < s.sq; ++i2) {
              double e2 = 0.0;
              const size_t at2 = size_t(((b * s.sq + i2) * s.h + h) * s.d);
              for (int64_t c = 0; c < s.d; ++c)
                e2 = std::max(e2, std::fabs(r.out[at + c] - ref.out[at2 + c]));
              if (e2 < best_e) best_e = e2, best = i2;
            }
            std::printf(
                "     out[:4] %.4g %.4g %.4g %.4g want %.4g %.4g %.4g %.4g; closest "
                "reference row i=%lld (max diff %.3e)\n",
                r.out[at], r.out[at + 1], r.out[at + 2], r.out[at + 3], ref.out[at],
                ref.out[at + 1], ref.out[at + 2], ref.out[at + 3], (long long)best, best_e);
          }
          ++bad;
        }
      }
  std::printf("     %lld of %lld rows off\n", (long long)bad, (long long)(s.b * s.sq * s.h));
}

// The rule on out (2x) and lse; out exactly 0 and lse -inf exactly where a row sees nothing.
bool check_forward(const std::string& label, const Shape& s, const BwdOracle& ref,
                   const std::vector<double>& lowp, const Dead& dead, const Result& r, DType dt) {
  const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
  const double err = max_abs_diff(r.out, ref.out), tol = 2.0 * max_abs_diff(lowp, ref.out) + eps;
  bool lse_ok = true;
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    const float want = ref.lse[i], got = r.lse[i];
    lse_ok &= std::isinf(want) ? got == want
                               : std::fabs(double(got) - want) <= 1e-3 + 1e-4 * std::fabs(want);
  }
  const int64_t dead_out = nonzero_in(r.out, s.b, s.sq, s.h, s.d, dead.rows);
  const bool ok = err <= tol && lse_ok && dead_out == 0 && r.gaps_untouched;
  std::printf("%s %s | err %.2e tol %.2e%s%s%s\n", ok ? "ok  " : "FAIL", label.c_str(), err, tol,
              flag(!lse_ok, " [lse]"), flag(dead_out != 0, " [out of empty rows not 0]"),
              flag(!r.gaps_untouched, " [wrote outside out]"));
  if (!ok) report_bad_rows(s, ref, r, tol);
  return ok;
}

// The rule on dq, dk, dv (3x); exact zeros for empty rows and unseen keys; no NaN.
bool check_backward(const std::string& label, const Shape& s, const BwdOracle& ref,
                    const Grads& lowp, const Dead& dead, const Result& r, DType dt) {
  const GradError eq = grad_error(r.dq, ref.dq, lowp.dq, dt);
  const GradError ek = grad_error(r.dk, ref.dk, lowp.dk, dt);
  const GradError ev = grad_error(r.dv, ref.dv, lowp.dv, dt);
  const bool nan = any_nan(r.dq) || any_nan(r.dk) || any_nan(r.dv);
  const int64_t dq0 = nonzero_in(r.dq, s.b, s.sq, s.h, s.d, dead.rows);
  const int64_t dkv0 = nonzero_in(r.dk, s.b, s.sk, s.hk, s.d, dead.keys) +
                       nonzero_in(r.dv, s.b, s.sk, s.hk, s.d, dead.keys);
  const bool ok = eq.ok() && ek.ok() && ev.ok() && !nan && dq0 == 0 && dkv0 == 0 &&
                  r.gaps_untouched;
  std::printf("%s %s | dq %.2e/%.2e dk %.2e/%.2e dv %.2e/%.2e%s%s%s%s\n", ok ? "ok  " : "FAIL",
              label.c_str(), eq.err, eq.tol, ek.err, ek.tol, ev.err, ev.tol, flag(nan, " [NaN]"),
              flag(dq0 != 0, " [dq of empty rows not 0]"),
              flag(dkv0 != 0, " [dk/dv of unseen keys not 0]"),
              flag(!r.gaps_untouched, " [wrote outside dq/dk/dv]"));
  return ok;
}

BwdInputs random_inputs(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  BwdInputs in;
  in.q = random_values(s.b * s.sq * s.h * s.d, rng);
  in.k = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.v = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.dout = random_values(s.b * s.sq * s.h * s.d, rng);
  return in;
}

int run_accuracy(const Target& t, const Cli& cli) {
  std::vector<const Case*> cases;
  if (cli.quick) {
    cases.push_back(&kQuick);
  } else {
    for (const Case& c : kCases) cases.push_back(&c);
  }
  int failures = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci)
    for (const int d : {64, 128}) {
      const Case& c = *cases[ci];
      if (cli.quick && d != 64) continue;
      bool any = false;
      for (const DType dt : {DType::float16, DType::bfloat16})
        for (const Variant& var : kVariants)
          for (const char* pass : {"fwd", "bwd"})
            any |= cli.selected(label_of(c, d, dt, var.name, pass));
      if (!any) continue;  // the oracle is the expensive part
      const Shape s = shape_of(c, d);
      const HostMask m = mask_of(c, 7919 * ci + 1);
      const Visibility vis{s, m};
      const Dead dead = dead_of(s, vis);
      const BwdInputs in = random_inputs(s, uint32_t(7919 * ci + size_t(d)));
      const BwdOracle ref = reference_backward(
          s, options_of(c, m, m.view(const_cast<uint8_t*>(m.bytes.data()), flashdl::Device{})), in,
          true);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        std::vector<float> out_r(ref.out.size());
        for (size_t i = 0; i < out_r.size(); ++i) out_r[i] = round_to(float(ref.out[i]), dt);
        std::vector<double> lowp_out;
        const Grads lowp = naive_lowp(s, vis, in, out_r, dt, lowp_out);
        const Arrays dev(t, c, s, dt, in, m, out_r, ref.lse);
        for (const Variant& var : kVariants)
          for (const bool bwd : {false, true}) {
            if (!bwd && var.deterministic) continue;  // the same forward as fa2
            const std::string label = label_of(c, d, dt, var.name, bwd ? "bwd" : "fwd");
            if (!cli.selected(label)) continue;
            failures += run_case(label, [&] {
              const Result r = run(t, c, s, dt, dev, m, var, bwd);
              return bwd ? check_backward(label, s, ref, lowp, dead, r, dt)
                         : check_forward(label, s, ref, lowp_out, dead, r, dt);
            });
          }
      }
    }
  return failures;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Forward, then the backward from that forward's out and lse: every result of one call pair.
Result forward_backward(const Target& t, const Case& c, const Shape& s, DType dt,
                        const BwdInputs& in, const HostMask& m, const Variant& var) {
  const std::vector<float> none_out(size_t(s.b * s.sq * s.h * s.d), 0.0f);
  const std::vector<float> none_lse(size_t(s.b * s.h * s.sq), 0.0f);
  const Arrays first(t, c, s, dt, in, m, none_out, none_lse);
  Result f = run(t, c, s, dt, first, m, var, false);
  std::vector<float> out_f(f.out.begin(), f.out.end());
  const Arrays second(t, c, s, dt, in, m, out_f, f.lse);
  Result g = run(t, c, s, dt, second, m, var, true);
  g.out = std::move(f.out);
  g.lse = std::move(f.lse);
  return g;
}

// NaN in every q row (or k and v row) that only zero blocks cover: a kernel that loaded such rows
// into a tile and masked their scores afterwards would still spread the NaN (0 * NaN is NaN in
// P V, dS K and dS^T Q). Every result must equal the clean run's bit for bit.
int run_nan(const Target& t, const Cli& cli) {
  struct Blocks {
    int64_t bq, bk;
  };
  const std::vector<Blocks> blocks =
      cli.quick ? std::vector<Blocks>{{48, 80}}
                : std::vector<Blocks>{{64, 64}, {48, 48}, {100, 100}, {32, 80}};
  int failures = 0;
  for (const Blocks& bl : blocks) {
    const Case c{
        "NaN in zero blocks", 2, 300, 330, 4, 2, false, bl.bq, bl.bk, MaskKind::full, 0.6, 1, 2,
        Kind::contiguous};
    const Shape s = shape_of(c, 64);
    const int64_t last_kb = (c.sk - 1) / c.bk;
    // mask_of's random blocks, with the last key block (ragged unless bk divides sk) zero too
    const HostMask m = make_mask(c.kind, c.b, c.h, c.sq, c.sk, c.bq, c.bk,
                                 [&, rnd = mask_of(c, 99)](int64_t b, int64_t h, int64_t qb,
                                                           int64_t kb) {
                                   return kb != last_kb && rnd.block(b, h, qb, kb);
                                 });
    const BwdInputs in = random_inputs(s, uint32_t(bl.bq * 1000 + bl.bk));
    for (const Variant& var : kVariants)
      for (const char* poisoned : {"q", "kv"}) {
        const std::string label = std::string("NaN in ") + poisoned + " rows of zero blocks " +
                                  label_of(c, 64, DType::float16, var.name, "fwd+bwd");
        if (!cli.selected(label)) continue;
        failures += run_case(label, [&] {
          const Result clean = forward_backward(t, c, s, DType::float16, in, m, var);
          BwdInputs dirty = in;
          const float nan = std::numeric_limits<float>::quiet_NaN();
          for (size_t e = 0; e < dirty.q.size() && poisoned[0] == 'q'; ++e)
            if ((int64_t(e) / (s.h * s.d)) % s.sq / c.bq == 1) dirty.q[e] = nan;
          for (size_t e = 0; e < dirty.k.size() && poisoned[0] == 'k'; ++e) {
            const int64_t kb = (int64_t(e) / (s.hk * s.d)) % s.sk / c.bk;
            if (kb == 2 || kb == last_kb) dirty.k[e] = dirty.v[e] = nan;
          }
          const Result r = forward_backward(t, c, s, DType::float16, dirty, m, var);
          const bool fwd_same = same_bits(r.out, clean.out) && same_bits(r.lse, clean.lse);
          // dQ by float atomics (fa2 without deterministic) sums in a different order every
          // run: the same within a float16 rounding of the largest entry, and no NaN.
          const bool dq_same = var.deterministic || var.schedule != Schedule::fa2
                                   ? same_bits(r.dq, clean.dq)
                                   : max_abs_diff(r.dq, clean.dq) <= 2e-3 * max_abs(clean.dq);
          const bool bwd_same = dq_same && same_bits(r.dk, clean.dk) && same_bits(r.dv, clean.dv);
          const bool clean_nan = any_nan(clean.out) || any_nan(clean.dq) || any_nan(clean.dk) ||
                                 any_nan(clean.dv);
          const bool ok = fwd_same && bwd_same && !clean_nan;
          std::printf("%s %s |%s%s%s\n", ok ? "ok  " : "FAIL", label.c_str(),
                      flag(!fwd_same, " [forward read a zero block]"),
                      flag(!bwd_same, " [backward read a zero block]"),
                      flag(clean_nan, " [NaN from clean inputs]"));
          return ok;
        });
      }
  }
  return failures;
}

// NaN and Inf at keys that some rows of a kernel tile see and others do not, through the block mask
// alone (48 x 80 mask blocks inside the kernels' 64- and 128-row tiles; no causal or window): a
// block mask is a row's visibility too. Key block 1 is seen by the even query blocks only and holds
// the planted keys (one of them its last, next to key block 2, which every row sees); key block 3
// is seen by the odd (blind) query blocks only. Blind rows must get the out, lse and dq of the
// clean inputs, and key block 3 the clean dk and dv, under the accuracy rule; the rows that see a
// planted value must get it (the test plants what it says). The backward reads the clean
// forward's out and lse (the rows compared only read their own).
int run_planted(const Target& t, const Cli& cli) {
  const Case c{"NaN/Inf at keys blind rows share a tile with",
               2,
               300,
               330,
               4,
               2,
               false,
               48,
               80,
               MaskKind::shared,
               1.0,
               -1,
               -1,
               Kind::contiguous};
  const HostMask m = make_mask(c.kind, c.b, c.h, c.sq, c.sk, c.bq, c.bk,
                               [](int64_t, int64_t, int64_t qb, int64_t kb) {
                                 return kb == 1 ? qb % 2 == 0 : kb == 3 ? qb % 2 == 1 : true;
                               });
  const std::vector<int64_t> keys = {100, 130, 159};
  int failures = 0;
  for (const int d : {64, 128}) {
    if (cli.quick && d != 64) continue;
    const Shape s = shape_of(c, d);
    const Visibility vis{s, m};
    auto row_sees = [&](int64_t i, int64_t j) { return vis(0, 0, i, j); };  // shared mask
    const std::vector<char> blind = rows_blind_to(s.sq, keys, row_sees);
    std::vector<char> clean_keys(size_t(s.sk), 1);  // keys only blind rows see, none planted
    for (int64_t j = 0; j < s.sk; ++j)
      for (int64_t i = 0; i < s.sq; ++i)
        clean_keys[size_t(j)] &= blind[size_t(i)] || !row_sees(i, j);
    for (const int64_t j : keys) clean_keys[size_t(j)] = 0;
    size_t n_blind = 0, n_clean = 0;
    for (char b : blind) n_blind += size_t(b);
    for (char k : clean_keys) n_clean += size_t(k);
    const BwdInputs in = random_inputs(s, uint32_t(2718 + d));
    const BwdOracle ref = reference_backward(
        s, options_of(c, m, m.view(const_cast<uint8_t*>(m.bytes.data()), flashdl::Device{})), in,
        true);
    BwdInputs planted = in;
    plant_nonfinite(s, keys, planted.k, planted.v);
    for (const DType dt : {DType::float16, DType::bfloat16}) {
      std::vector<float> out_r(ref.out.size());
      for (size_t i = 0; i < out_r.size(); ++i) out_r[i] = round_to(float(ref.out[i]), dt);
      std::vector<double> lowp_out;
      const Grads lowp = naive_lowp(s, vis, in, out_r, dt, lowp_out);
      const Arrays dev(t, c, s, dt, planted, m, out_r, ref.lse);
      for (const Variant& var : kVariants)
        for (const bool bwd : {false, true}) {
          if (!bwd && var.deterministic) continue;  // the same forward as fa2
          const std::string label = "masked NaN/Inf " +
                                    label_of(c, d, dt, var.name, bwd ? "bwd" : "fwd");
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            const Result r = run(t, c, s, dt, dev, m, var, bwd);
            auto rows = [&](const std::vector<double>& x, int64_t n, int64_t heads,
                            const std::vector<char>& keep) {
              return select_rows(x, s.b, n, heads, s.d, keep);
            };
            bool ok = r.gaps_untouched && !keys.empty() && n_blind > 0 && n_blind < blind.size();
            char detail[200];
            if (!bwd) {
              const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
              const double tol = 2.0 * max_abs_diff(lowp_out, ref.out) + eps;
              const double err = max_abs_diff_rows(r.out, ref.out, s.b, s.sq, s.h, d, blind);
              const bool lse_ok = lse_matches_rows(r.lse, ref.lse, s.b * s.h, s.sq, blind);
              const bool seen = any_nan(r.out) || max_abs(r.out) == INFINITY;
              ok &= err <= tol && lse_ok && seen;
              std::snprintf(detail, sizeof detail, "blind rows out %.2e/%.2e%s%s", err, tol,
                            flag(!lse_ok, " [lse]"),
                            flag(!seen, " [no row saw the planted values]"));
            } else {
              const GradError eq = grad_error(rows(r.dq, s.sq, s.h, blind),
                                              rows(ref.dq, s.sq, s.h, blind),
                                              rows(lowp.dq, s.sq, s.h, blind), dt);
              const GradError ek = grad_error(rows(r.dk, s.sk, s.hk, clean_keys),
                                              rows(ref.dk, s.sk, s.hk, clean_keys),
                                              rows(lowp.dk, s.sk, s.hk, clean_keys), dt);
              const GradError ev = grad_error(rows(r.dv, s.sk, s.hk, clean_keys),
                                              rows(ref.dv, s.sk, s.hk, clean_keys),
                                              rows(lowp.dv, s.sk, s.hk, clean_keys), dt);
              const bool seen = any_nan(r.dq);
              ok &= eq.ok() && ek.ok() && ev.ok() && seen && n_clean > 0;
              std::snprintf(detail, sizeof detail,
                            "blind rows dq %.2e/%.2e, their %zu keys dk %.2e/%.2e dv %.2e/%.2e%s",
                            eq.err, eq.tol, n_clean, ek.err, ek.tol, ev.err, ev.tol,
                            flag(!seen, " [no row saw the planted values]"));
            }
            std::printf("%s %s | %zu keys planted, %zu of %zu rows blind, %s%s\n",
                        ok ? "ok  " : "FAIL", label.c_str(), keys.size(), n_blind, blind.size(),
                        detail, flag(!r.gaps_untouched, " [wrote outside the outputs]"));
            return ok;
          });
        }
    }
  }
  return failures;
}

// fa1 and deterministic fa2 with a block mask: 20 calls, every result bitwise equal.
int run_repeats(const Target& t, const Cli& cli) {
  const Case c{"repeat", 2,  1000,           1000, 4,  2,  true,
               48,       80, MaskKind::full, 0.5,  -1, -1, Kind::contiguous};
  const Shape s = shape_of(c, 128);
  const HostMask m = mask_of(c, 4242);
  const BwdInputs in = random_inputs(s, 4242);
  int failures = 0;
  for (const Variant& var : {kVariants[0], kVariants[3]}) {
    const std::string label = "repeat x20 " + label_of(c, 128, DType::float16, var.name, "fwd+bwd");
    if (!cli.selected(label)) continue;
    failures += run_case(label, [&] {
      const Result first = forward_backward(t, c, s, DType::float16, in, m, var);
      int differ = 0;
      for (int i = 1; i < 20; ++i) {
        const Result r = forward_backward(t, c, s, DType::float16, in, m, var);
        differ += !(same_bits(r.out, first.out) && same_bits(r.lse, first.lse) &&
                    same_bits(r.dq, first.dq) && same_bits(r.dk, first.dk) &&
                    same_bits(r.dv, first.dv));
      }
      const bool nan = any_nan(first.dq) || any_nan(first.dk) || any_nan(first.dv);
      std::printf("%s %s | %d of 19 repeats differ%s\n", differ || nan ? "FAIL" : "ok  ",
                  label.c_str(), differ, flag(nan, " [NaN]"));
      return differ == 0 && !nan;
    });
  }
  return failures;
}

// FLASHDL_TEST_DUMP=DIR: a failed forward case of run_score_mods (every one with
// FLASHDL_TEST_DUMP_ALL set) written to DIR/<n>.bin for study off the GPU: one JSON header line (the case and its shape), then the inputs
// as the kernel got them (float32, rounded to the dtype; q (b, sq, h, d), k and v (b, sk, hk, d)),
// the visibility (uint8, (b, h, sq, sk): window and block mask), the slopes (float32, (b, h);
// none without ALiBi), the float64 reference's out (as float32, shaped as q) and lse (float32,
// (b, h, sq)), then the kernel's out and lse (float32).
void dump_forward(const std::string& label, const Shape& s, DType dt, double softcap,
                  const std::vector<float>& slopes, const BwdInputs& in, const Visibility& vis,
                  const BwdOracle& ref, const Result& r) {
  const char* dir = std::getenv("FLASHDL_TEST_DUMP");
  if (dir == nullptr || *dir == '\0') return;
  static int serial = 0;
  const std::string path = std::string(dir) + "/" + std::to_string(serial++) + ".bin";
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) {
    std::printf("     dump: cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f,
               "{\"label\": \"%s\", \"b\": %lld, \"sq\": %lld, \"sk\": %lld, \"h\": %lld, "
               "\"hk\": %lld, \"d\": %lld, \"left\": %lld, \"right\": %lld, \"softcap\": %.17g, "
               "\"slopes\": %zu}\n",
               label.c_str(), (long long)s.b, (long long)s.sq, (long long)s.sk, (long long)s.h,
               (long long)s.hk, (long long)s.d, (long long)s.left, (long long)s.right, softcap,
               slopes.size());
  auto put = [&](const void* p, size_t bytes) { std::fwrite(p, 1, bytes, f); };
  for (const std::vector<float>* x : {&in.q, &in.k, &in.v}) {
    std::vector<float> rounded(x->size());
    for (size_t i = 0; i < x->size(); ++i) rounded[i] = round_to((*x)[i], dt);
    put(rounded.data(), rounded.size() * sizeof(float));
  }
  std::vector<uint8_t> seen(size_t(s.b * s.h * s.sq * s.sk));
  size_t at = 0;
  for (int64_t b = 0; b < s.b; ++b)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i)
        for (int64_t j = 0; j < s.sk; ++j) seen[at++] = vis(b, h, i, j) ? 1 : 0;
  put(seen.data(), seen.size());
  put(slopes.data(), slopes.size() * sizeof(float));
  for (const std::vector<double>* x : {&ref.out, &r.out}) {
    const std::vector<float> narrow(x->begin(), x->end());
    put(narrow.data(), narrow.size() * sizeof(float));
    put((x == &ref.out ? ref.lse : r.lse).data(), ref.lse.size() * sizeof(float));
  }
  std::fclose(f);
  std::printf("     dump: %s\n", path.c_str());
}

// Block masks with softcap and ALiBi: the rule against the reference with the same mask and
// modifiers, and exact zeros where only zero blocks reach (a cap applied after the block mask's
// -inf would make those scores finite).
int run_score_mods(const Target& t, const Cli& cli) {
  struct ModCase {
    Case c;
    ModSpec m;
    size_t seed;  // of the mask and inputs: equal seeds, equal masks and inputs
  };
  const std::vector<ModCase> cases =
      cli.quick ? std::vector<ModCase>{{kQuick, {2.0, Alibi::batch_heads}, 0}}
                : std::vector<ModCase>{
                      {{"softcap+alibi, zero blocks", 2, 230, 260, 4, 2, true, 100, 64,
                        MaskKind::full, 0.7, 0, 3, Kind::contiguous},
                       {2.0, Alibi::batch_heads},
                       0},
                      // the same mask and inputs with each modifier alone
                      {{"softcap, zero blocks", 2, 230, 260, 4, 2, true, 100, 64, MaskKind::full,
                        0.7, 0, 3, Kind::contiguous},
                       {2.0, Alibi::none},
                       0},
                      {{"alibi, zero blocks", 2, 230, 260, 4, 2, true, 100, 64, MaskKind::full, 0.7,
                        0, 3, Kind::contiguous},
                       {0.0, Alibi::batch_heads},
                       0},
                      {{"blocks = the fa2 tile, softcap+alibi", 2, 200, 260, 4, 2, false, 64, 64,
                        MaskKind::heads, 0.5, -1, -1, Kind::padded},
                       {5.0, Alibi::heads},
                       1},
                  };
  int failures = 0;
  for (size_t ci = 0; ci < cases.size(); ++ci)
    for (const int d : {64, 128}) {
      const Case& c = cases[ci].c;
      if (cli.quick && d != 64) continue;
      const std::string mods = mod_label(cases[ci].m);
      bool any = false;
      for (const DType dt : {DType::float16, DType::bfloat16})
        for (const Variant& var : kVariants)
          for (const char* pass : {"fwd", "bwd"})
            any |= cli.selected(label_of(c, d, dt, var.name, pass) + mods);
      if (!any) continue;
      const Shape s = shape_of(c, d);
      const size_t seed = cases[ci].seed;
      const HostMask m = mask_of(c, 104729 * seed + 3);
      const Visibility vis{s, m};
      const Dead dead = dead_of(s, vis);
      const BwdInputs in = random_inputs(s, uint32_t(104729 * seed + size_t(d)));
      const ModArgs mod(t.host, cases[ci].m, s.b, s.h);
      const flashdl::TensorView host_mask = m.view(const_cast<uint8_t*>(m.bytes.data()),
                                                   flashdl::Device{});
      const BwdOracle ref = reference_backward(s, mod.apply(options_of(c, m, host_mask), true), in,
                                               true);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        std::vector<float> out_r(ref.out.size());
        for (size_t i = 0; i < out_r.size(); ++i) out_r[i] = round_to(float(ref.out[i]), dt);
        std::vector<double> lowp_out;
        const Grads lowp = naive_lowp(s, vis, in, out_r, dt, lowp_out, &mod.naive());
        const Arrays dev(t, c, s, dt, in, m, out_r, ref.lse);
        for (const Variant& var : kVariants)
          for (const bool bwd : {false, true}) {
            if (!bwd && var.deterministic) continue;  // the same forward as fa2
            const std::string label = label_of(c, d, dt, var.name, bwd ? "bwd" : "fwd") + mods;
            if (!cli.selected(label)) continue;
            failures += run_case(label, [&] {
              const Result r = run(t, c, s, dt, dev, m, var, bwd, &mod);
              if (bwd) return check_backward(label, s, ref, lowp, dead, r, dt);
              const bool ok = check_forward(label, s, ref, lowp_out, dead, r, dt);
              if (!ok || std::getenv("FLASHDL_TEST_DUMP_ALL") != nullptr)
                dump_forward(label, s, dt, cases[ci].m.softcap, mod.naive().slopes, in, vis, ref,
                             r);
              return ok;
            });
          }
      }
    }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  return test_main(argc, argv, [&](const Target& t, const Cli& cli) {
    int failures = 0;
    failures += run_accuracy(t, cli);
    failures += run_nan(t, cli);
    failures += run_planted(t, cli);
    failures += run_score_mods(t, cli);
    if (cli.repeats()) failures += run_repeats(t, cli);
    return failures;
  });
}
