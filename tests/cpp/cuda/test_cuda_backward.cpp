// The CUDA backward kernels (fa1, fa1 with an 8 KiB budget, fa2, fa2 deterministic) against the CPU
// float64 reference: dq, dk, dv for both dtypes and every head dim; causal and windows, GQA/MQA,
// seqlen_q != seqlen_k, seqlen 0, empty rows and unseen keys (whose gradients must be exactly 0),
// strided and misaligned inputs and gradients. The backward is given consistent saved tensors: out
// and lse of the float64 forward (out rounded to the dtype). Gradients are poisoned with NaN before
// every call, their gaps must stay untouched and the inputs unchanged. Then dropout
// (dropout_backward.hpp), repeat tests (bitwise equal gradients, with and without dropout) and
// the score modifiers (softcap, ALiBi in each slope layout, both; score_mod_cases.hpp) against the
// reference with the same modifiers. Exit code 77 (skipped) when there is no CUDA device.
//
// FLASHDL_CUDA_SMEM_LIMIT=101376 (bytes) caps the shared memory the launchers plan against, which
// exercises the 99 KiB fallback variants (smaller tiles) that an H100 never selects.
// Command line (cli.hpp): --quick (for compute-sanitizer), --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backward_oracle.hpp"
#include "cli.hpp"
#include "cuda_harness.hpp"
#include "dropout_backward.hpp"
#include "flashdl/api.hpp"
#include "score_mod_cases.hpp"

using namespace cuda_test;
using flashdl::DType;
using flashdl::Schedule;

namespace {

struct Case {
  int64_t b, sq, sk, h, hk;
  bool causal;
  int64_t left, right;  // window as passed; causal adds right = 0
  Kind in;              // layout of q, k, v, dout and out
  Kind grad;            // layout of dq, dk, dv
  bool strided_lse;
};

const Case kCases[] = {
    {1, 1, 1, 2, 2, false, -1, -1, Kind::contiguous, Kind::contiguous, false},
    {2, 17, 17, 4, 4, false, -1, -1, Kind::contiguous, Kind::contiguous, false},
    {2, 17, 17, 4, 4, true, -1, -1, Kind::contiguous, Kind::padded, true},
    {1, 1, 257, 4, 1, false, -1, -1, Kind::transposed, Kind::contiguous, false},  // MQA
    {1, 1, 257, 4, 2, true, -1, -1, Kind::padded, Kind::odd, false},              // GQA
    {2, 257, 1000, 2, 1, true, -1, -1, Kind::transposed, Kind::transposed, false},
    {1, 1000, 257, 2, 2, true, -1, -1, Kind::contiguous, Kind::odd, true},    // 743 empty rows
    {1, 1000, 1000, 1, 1, false, -1, -1, Kind::odd, Kind::padded, false},     // no 16-byte rows
    {1, 257, 257, 2, 1, false, 32, 8, Kind::padded, Kind::contiguous, true},  // sliding window
    {1, 100, 130, 2, 2, false, -1, 5, Kind::contiguous, Kind::transposed, false},
    {1, 130, 100, 4, 2, false, 7, -1, Kind::transposed, Kind::contiguous, false},
    {1, 130, 100, 2, 2, true, 20, -1, Kind::odd, Kind::odd, true},
    {1, 300, 40, 1, 1, false, 0, 0, Kind::contiguous, Kind::padded, false},     // 260 empty rows
    {1, 40, 300, 2, 1, false, 0, 0, Kind::padded, Kind::odd, false},            // 260 unseen keys
    {1, 5, 0, 2, 1, false, -1, -1, Kind::contiguous, Kind::contiguous, false},  // dq = 0
    {1, 0, 9, 2, 1, false, -1, -1, Kind::contiguous, Kind::padded, false},      // dk = dv = 0
};

const int kHeadDims[] = {32, 64, 96, 128, 192, 256};

struct Variant {
  const char* name;
  Schedule schedule;
  int64_t sram_bytes;  // fa1's budget; 8 KiB gives 16 x 16 tiles: many blocks
  bool deterministic;
};

const Variant kVariants[] = {{"fa1", Schedule::fa1, 0, false},
                             {"fa1(8KiB)", Schedule::fa1, 8192, false},
                             {"fa2", Schedule::fa2, 0, false},
                             {"fa2(det)", Schedule::fa2, 0, true}};

// A case with the head dims it runs (both dtypes each).
struct Plan {
  Case c;
  std::vector<int> dims;
};

std::vector<Plan> plans(const Cli& cli) {
  const std::vector<int> all_dims(std::begin(kHeadDims), std::end(kHeadDims));
  if (cli.quick)
    return {
        {{1, 70, 45, 2, 1, false, -1, -1, Kind::contiguous, Kind::contiguous, false}, all_dims},
        // 70 empty rows (a whole empty 64-row block); 79 unseen keys (a whole unseen block).
        {{1, 100, 30, 2, 2, true, -1, -1, Kind::odd, Kind::odd, true}, {128}},
        {{2, 45, 140, 2, 1, false, 16, 8, Kind::transposed, Kind::padded, false}, {64}},
    };
  std::vector<Plan> v;
  for (const Case& c : kCases) v.push_back({c, all_dims});
  return v;
}

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

std::string label_of(const Case& c, int64_t d, DType dt, const char* variant) {
  char buf[240];
  std::snprintf(buf, sizeof buf,
                "%s %s d=%lld b=%lld sq=%lld sk=%lld h=%lld/%lld%s w=(%lld,%lld) in=%s grad=%s%s",
                variant, flashdl::dtype_name(dt), (long long)d, (long long)c.b, (long long)c.sq,
                (long long)c.sk, (long long)c.h, (long long)c.hk, c.causal ? " causal" : "",
                (long long)c.left, (long long)c.right, kind_name(c.in), kind_name(c.grad),
                c.strided_lse ? " lse=strided" : "");
  return buf;
}

BwdInputs random_inputs(const Shape& s, std::mt19937& rng) {
  BwdInputs in;
  in.q = random_values(s.b * s.sq * s.h * s.d, rng);
  in.k = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.v = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.dout = random_values(s.b * s.sq * s.h * s.d, rng);
  return in;
}

std::vector<float> rounded(const std::vector<double>& x, DType dt) {
  std::vector<float> r(x.size());
  for (size_t i = 0; i < x.size(); ++i) r[i] = round_to(float(x[i]), dt);
  return r;
}

// The backward's inputs in the case's layouts (gaps NaN), with host copies of the whole buffers
// to check that nothing wrote into them.
struct Saved {
  Layout lq, lk, ll;
  std::vector<uint16_t> hq, hk, hv, hdout, hout;
  std::vector<float> hlse;
  Buffer q, k, v, dout, out, lse;

  Saved(const Target& t, const Case& c, const Shape& s, DType dt, const BwdInputs& in,
        const std::vector<float>& out_r, const std::vector<float>& lse_r)
      : lq(make_layout(s.b, s.sq, s.h, s.d, c.in)),
        lk(make_layout(s.b, s.sk, s.hk, s.d, c.in)),
        ll(lse_layout(s.b, s.h, s.sq, c.strided_lse)),
        hq(place(in.q, lq, dt)),
        hk(place(in.k, lk, dt)),
        hv(place(in.v, lk, dt)),
        hdout(place(in.dout, lq, dt)),
        hout(place(out_r, lq, dt)),
        hlse(place_lse(lse_r, ll)),
        q(hq.size() * 2, t.host),
        k(hk.size() * 2, t.host),
        v(hv.size() * 2, t.host),
        dout(hdout.size() * 2, t.host),
        out(hout.size() * 2, t.host),
        lse(hlse.size() * 4, t.host) {
    q.upload(hq);
    k.upload(hk);
    v.upload(hv);
    dout.upload(hdout);
    out.upload(hout);
    lse.upload(hlse);
  }

  bool unchanged() const {
    auto same16 = [](const Buffer& b, const std::vector<uint16_t>& h) {
      return b.download<uint16_t>() == h;
    };
    const std::vector<float> l = lse.download<float>();
    return same16(q, hq) && same16(k, hk) && same16(v, hv) && same16(dout, hdout) &&
           same16(out, hout) && std::memcmp(l.data(), hlse.data(), l.size() * 4) == 0;
  }
};

struct BwdResult {
  Grads g;  // logical contiguous
  bool gaps_untouched = true;
};

// mods: the score modifiers (their slopes on the target), or null.
BwdResult run_backward(const Target& t, const Case& c, const Shape& s, DType dt, const Saved& in,
                       const Variant& var, const ModArgs* mods = nullptr) {
  const Layout lq = make_layout(s.b, s.sq, s.h, s.d, c.grad);
  const Layout lk = make_layout(s.b, s.sk, s.hk, s.d, c.grad);
  Buffer dq(size_t(lq.span) * 2, t.host), dk(size_t(lk.span) * 2, t.host),
      dv(size_t(lk.span) * 2, t.host);
  dq.poison();
  dk.poison();
  dv.poison();
  flashdl::Options o = mods ? mods->apply(options_of(c), false) : options_of(c);
  o.schedule = var.schedule;
  o.sram_bytes = var.sram_bytes;
  o.deterministic = var.deterministic;
  o.stream = t.stream;
  flashdl::backward(view_of(in.dout, dt, in.lq, 4), view_of(in.q, dt, in.lq, 4),
                    view_of(in.k, dt, in.lk, 4), view_of(in.v, dt, in.lk, 4),
                    view_of(in.out, dt, in.lq, 4), view_of(in.lse, DType::float32, in.ll, 3),
                    view_of(dq, dt, lq, 4), view_of(dk, dt, lk, 4), view_of(dv, dt, lk, 4), o);
  t.sync();
  BwdResult r;
  r.g.dq = gather(dq.download<uint16_t>(), lq, dt, r.gaps_untouched);
  r.g.dk = gather(dk.download<uint16_t>(), lk, dt, r.gaps_untouched);
  r.g.dv = gather(dv.download<uint16_t>(), lk, dt, r.gaps_untouched);
  return r;
}

// The tolerance rule for each gradient, exact zeros where the mask leaves no score, no NaN, and
// nothing written outside the gradients' views.
bool check(const std::string& label, const Shape& s, const BwdOracle& ref, const Grads& lowp,
           const BwdResult& r, DType dt) {
  const GradError eq = grad_error(r.g.dq, ref.dq, lowp.dq, dt);
  const GradError ek = grad_error(r.g.dk, ref.dk, lowp.dk, dt);
  const GradError ev = grad_error(r.g.dv, ref.dv, lowp.dv, dt);
  const bool nan = any_nan(r.g.dq) || any_nan(r.g.dk) || any_nan(r.g.dv);
  const int64_t dq_nonzero = nonzero_in_flagged(r.g.dq, s.h, s.d, empty_rows(s));
  const std::vector<char> unseen = unseen_keys(s);
  const int64_t dkv_nonzero = nonzero_in_flagged(r.g.dk, s.hk, s.d, unseen) +
                              nonzero_in_flagged(r.g.dv, s.hk, s.d, unseen);
  const bool ok = eq.ok() && ek.ok() && ev.ok() && !nan && dq_nonzero == 0 && dkv_nonzero == 0 &&
                  r.gaps_untouched;
  std::printf("%s %s | dq %.2e/%.2e dk %.2e/%.2e dv %.2e/%.2e%s%s%s%s\n", ok ? "ok  " : "FAIL",
              label.c_str(), eq.err, eq.tol, ek.err, ek.tol, ev.err, ev.tol, nan ? " [NaN]" : "",
              dq_nonzero ? " [dq of empty rows not 0]" : "",
              dkv_nonzero ? " [dk/dv of unseen keys not 0]" : "",
              r.gaps_untouched ? "" : " [wrote outside dq/dk/dv]");
  return ok;
}

int run_accuracy(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<Plan> ps = plans(cli);
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      auto selected = [&](DType dt) {
        for (const Variant& var : kVariants)
          if (cli.selected(label_of(c, d, dt, var.name))) return true;
        return false;
      };
      // The oracle is the expensive part: only for cases with something selected.
      if (!selected(DType::float16) && !selected(DType::bfloat16)) continue;
      const Shape s = shape_of(c, d);
      // Seeded per (case, head dim): a --filter run sees the same values as the full run.
      std::mt19937 rng(uint32_t(7919 * pi + size_t(d)));
      const BwdInputs in = random_inputs(s, rng);
      const BwdOracle ref = reference_backward(s, options_of(c), in, true);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        if (!selected(dt)) continue;
        const std::vector<float> out_r = rounded(ref.out, dt);
        const Grads lowp = naive_lowp_backward(s, in, out_r, dt);
        const Saved saved(t, c, s, dt, in, out_r, ref.lse);
        for (const Variant& var : kVariants) {
          const std::string label = label_of(c, d, dt, var.name);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            return check(label, s, ref, lowp, run_backward(t, c, s, dt, saved, var), dt);
          });
        }
        if (!saved.unchanged()) {
          std::printf("FAIL %s: an input (q, k, v, dout, out, lse or a gap) was written\n",
                      label_of(c, d, dt, "inputs after all schedules,").c_str());
          ++failures;
        }
      }
    }
  return failures;
}

// ---- NaN and Inf at keys a row cannot see ---------------------------------------------------------
// K and V hold NaN / +-Inf at a few keys that some rows of their block see and others do not. The
// rows that see none of them must get the dq of the clean inputs, and the keys that only such rows
// see (none of them planted) the dk and dv of the clean inputs, under the accuracy rule; a 0 * NaN
// from a masked column of dQ += dS K (or of dS = P (dP - D)) makes them NaN. The saved out and lse
// are the clean forward's (the rows compared only read their own). Every variant.
struct PlantPlan {
  Case c;
  std::vector<int64_t> keys;
  std::vector<int> dims;
};

int run_planted(const Target& t, const Cli& cli) {
  std::vector<PlantPlan> ps{
      // causal: keys 70 and 97 share the block of rows 64..127, rows 64..69 and 70..96 are blind
      {{1, 100, 100, 2, 1, true, -1, -1, Kind::contiguous, Kind::contiguous, false},
       {70, 97},
       {64}},
      // a window (row i sees keys i + 79 .. i + 103): key 82 is seen by rows 0..3, 139 by 36..44;
      // keys 107..114 only by the blind rows 4..35 (causal leaves no such key: row 99 sees all)
      {{2, 45, 140, 2, 1, false, 16, 8, Kind::padded, Kind::odd, false}, {82, 139}, {128}},
  };
  if (!cli.quick) {
    const std::vector<int> all_dims(std::begin(kHeadDims), std::end(kHeadDims));
    ps[0].dims = ps[1].dims = all_dims;
    ps.push_back({{2, 300, 200, 4, 2, true, -1, -1, Kind::odd, Kind::padded, true},
                  {150, 198, 199},
                  {64, 256}});
    ps.push_back({{1, 257, 257, 2, 2, false, 32, 8, Kind::transposed, Kind::contiguous, false},
                  {0, 40, 129, 256},
                  {96, 192}});
  }
  int failures = 0;
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      const Shape s = shape_of(c, d);
      std::mt19937 rng(uint32_t(31337 * (pi + 1) + size_t(d)));
      const BwdInputs in = random_inputs(s, rng);
      const BwdOracle ref = reference_backward(s, options_of(c), in, true);
      auto vis = [&](int64_t i, int64_t j) { return s.visible(i, j); };
      const std::vector<char> blind = rows_blind_to(s.sq, ps[pi].keys, vis);
      std::vector<char> clean_keys(size_t(s.sk), 1);  // keys only blind rows see, none planted
      for (int64_t j = 0; j < s.sk; ++j)
        for (int64_t i = 0; i < s.sq; ++i) clean_keys[size_t(j)] &= blind[size_t(i)] || !vis(i, j);
      for (const int64_t j : ps[pi].keys) clean_keys[size_t(j)] = 0;
      BwdInputs planted = in;
      plant_nonfinite(s, ps[pi].keys, planted.k, planted.v);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        const std::vector<float> out_r = rounded(ref.out, dt);
        const Grads lowp = naive_lowp_backward(s, in, out_r, dt);
        const Saved saved(t, c, s, dt, planted, out_r, ref.lse);
        for (const Variant& var : kVariants) {
          const std::string label = "masked NaN/Inf " + label_of(c, d, dt, var.name);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            const BwdResult r = run_backward(t, c, s, dt, saved, var);
            auto err = [&](const std::vector<double>& got, const std::vector<double>& want,
                           const std::vector<double>& low, int64_t n, int64_t heads,
                           const std::vector<char>& keep) {
              return grad_error(select_rows(got, s.b, n, heads, s.d, keep),
                                select_rows(want, s.b, n, heads, s.d, keep),
                                select_rows(low, s.b, n, heads, s.d, keep), dt);
            };
            const GradError eq = err(r.g.dq, ref.dq, lowp.dq, s.sq, s.h, blind);
            const GradError ek = err(r.g.dk, ref.dk, lowp.dk, s.sk, s.hk, clean_keys);
            const GradError ev = err(r.g.dv, ref.dv, lowp.dv, s.sk, s.hk, clean_keys);
            const bool seen = any_nan(r.g.dq);  // the rows that see a planted NaN do get it
            const bool ok = eq.ok() && ek.ok() && ev.ok() && seen && r.gaps_untouched &&
                            saved.unchanged();
            std::printf("%s %s | blind rows dq %.2e/%.2e, their keys dk %.2e/%.2e dv %.2e/%.2e%s\n",
                        ok ? "ok  " : "FAIL", label.c_str(), eq.err, eq.tol, ek.err, ek.tol, ev.err,
                        ev.tol, seen ? "" : " [no row saw the planted values]");
            return ok;
          });
        }
      }
    }
  return failures;
}

bool bitwise_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The same inputs many times. dk and dv must be bitwise equal on every schedule (each is one
// thread block's sum); dq too on fa1 and deterministic fa2. Plain fa2 may add dq with float
// atomics in any order: its differences are reported, not failed.
int run_repeats(const Target& t, const Cli& cli) {
  struct Repeat {
    const Variant& var;
    int calls;
    bool dq_must_match;
  };
  const Repeat repeats[] = {{kVariants[3], 50, true},
                            {kVariants[0], 20, true},
                            {kVariants[2], 20, false}};
  const Case c{2, 1000, 1000, 4, 2, true, -1, -1, Kind::contiguous, Kind::contiguous, false};
  const DType dt = DType::float16;
  int failures = 0;
  for (const int d : {64, 128}) {
    auto label_for = [&](const Repeat& r) {
      return "repeat x" + std::to_string(r.calls) + " " + label_of(c, d, dt, r.var.name);
    };
    bool any = false;
    for (const Repeat& r : repeats) any |= cli.selected(label_for(r));
    if (!any) continue;
    const Shape s = shape_of(c, d);
    std::mt19937 rng(uint32_t(99 + d));
    const BwdInputs in = random_inputs(s, rng);
    const BwdOracle ref = reference_backward(s, options_of(c), in, false);
    const Saved saved(t, c, s, dt, in, rounded(ref.out, dt), ref.lse);
    for (const Repeat& r : repeats) {
      const std::string label = label_for(r);
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        const BwdResult first = run_backward(t, c, s, dt, saved, r.var);
        int dq_differ = 0, dkv_differ = 0;
        for (int i = 1; i < r.calls; ++i) {
          const BwdResult g = run_backward(t, c, s, dt, saved, r.var);
          dq_differ += !bitwise_equal(g.g.dq, first.g.dq);
          dkv_differ += !bitwise_equal(g.g.dk, first.g.dk) || !bitwise_equal(g.g.dv, first.g.dv);
        }
        const bool nan = any_nan(first.g.dq) || any_nan(first.g.dk) || any_nan(first.g.dv);
        const bool ok = dkv_differ == 0 && (!r.dq_must_match || dq_differ == 0) && !nan &&
                        first.gaps_untouched;
        std::printf("%s %s | of %d repeats dq differs in %d%s, dk/dv in %d%s%s\n",
                    ok ? "ok  " : "FAIL", label.c_str(), r.calls - 1, dq_differ,
                    r.dq_must_match ? "" : " (allowed: float atomics)", dkv_differ,
                    nan ? " [NaN]" : "", first.gaps_untouched ? "" : " [wrote outside dq/dk/dv]");
        return ok;
      });
    }
  }
  return failures;
}

// ---- score modifiers ----------------------------------------------------------------------------
// A case, its modifiers and the head dims it runs (both dtypes, every variant).
struct ModPlan {
  Case c;
  ModSpec m;
  std::vector<int> dims;
};

std::vector<ModPlan> mod_plans(const Cli& cli) {
  const std::vector<int> all_dims(std::begin(kHeadDims), std::end(kHeadDims));
  if (cli.quick)
    return {
        // both, causal with 25 empty rows, MQA
        {{2, 70, 45, 2, 1, true, -1, -1, Kind::contiguous, Kind::contiguous, false},
         {2.0, Alibi::batch_heads},
         all_dims},
        {{1, 100, 130, 4, 2, false, 16, 8, Kind::padded, Kind::odd, true},
         {0.0, Alibi::strided},
         {64}},
    };
  return {
      // softcap alone, no mask: the unmasked path, GQA
      {{2, 97, 130, 4, 2, false, -1, -1, Kind::contiguous, Kind::contiguous, false},
       {2.0, Alibi::none},
       all_dims},
      // ALiBi (nheads,), causal with seqlen_q > seqlen_k: 33 empty rows
      {{2, 130, 97, 4, 4, true, -1, -1, Kind::transposed, Kind::padded, true},
       {0.0, Alibi::heads},
       {64, 128}},
      // ALiBi (batch, nheads) with padded rows, MQA, sliding window
      {{2, 257, 300, 4, 1, false, 32, 8, Kind::padded, Kind::contiguous, false},
       {0.0, Alibi::strided},
       {64, 256}},
      // both, causal, GQA, every head dim
      {{2, 300, 200, 4, 2, true, -1, -1, Kind::contiguous, Kind::odd, true},
       {5.0, Alibi::batch_heads},
       all_dims},
      // both, the diagonal only: 260 keys no query sees (dk = dv = 0 exactly)
      {{1, 40, 300, 2, 1, false, 0, 0, Kind::padded, Kind::odd, false},
       {1.0, Alibi::heads},
       {64, 128}},
      // both, a wide window: the blocks inside it take the unmasked path
      {{1, 1000, 1000, 2, 1, false, 200, 100, Kind::contiguous, Kind::contiguous, false},
       {2.0, Alibi::batch_heads},
       {64, 128}},
  };
}

// Softcap and ALiBi against the reference with the same modifiers (its out and lse are the saved
// tensors), under the same rule: the naive backward applies them too, dS with the cap's factor.
int run_score_mods(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<ModPlan> ps = mod_plans(cli);
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      const std::string mods = mod_label(ps[pi].m);
      auto selected = [&](DType dt) {
        for (const Variant& var : kVariants)
          if (cli.selected(label_of(c, d, dt, var.name) + mods)) return true;
        return false;
      };
      if (!selected(DType::float16) && !selected(DType::bfloat16)) continue;
      const Shape s = shape_of(c, d);
      std::mt19937 rng(uint32_t(104729 * (pi + 1) + size_t(d)));
      const BwdInputs in = random_inputs(s, rng);
      const ModArgs m(t.host, ps[pi].m, s.b, s.h);
      const BwdOracle ref = reference_backward(s, m.apply(options_of(c), true), in, true);
      for (const DType dt : {DType::float16, DType::bfloat16}) {
        if (!selected(dt)) continue;
        const std::vector<float> out_r = rounded(ref.out, dt);
        const Grads lowp = naive_lowp_backward(s, in, out_r, dt, &m.naive());
        const Saved saved(t, c, s, dt, in, out_r, ref.lse);
        for (const Variant& var : kVariants) {
          const std::string label = label_of(c, d, dt, var.name) + mods;
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            return check(label, s, ref, lowp, run_backward(t, c, s, dt, saved, var, &m), dt);
          });
        }
        if (!saved.unchanged()) {
          std::printf("FAIL %s: an input (q, k, v, dout, out, lse or a gap) was written\n",
                      (label_of(c, d, dt, "inputs after all schedules,") + mods).c_str());
          ++failures;
        }
      }
    }
  return failures;
}

// |softmax_scale| = 1e30, the largest accepted: lse is float32, and at scores near 1e30 its
// rounding (an ulp is about 1e23) can put lse2 below the score the backward recomputes, where
// exp2 overflowed (P = inf, gradients NaN). P <= 1 must hold exactly. bfloat16 only: at this scale
// dS * scale reaches about 1e27 from the rounding of D alone, past float16's range (inf there is
// the dtype's limit, not the kernel's). Every gradient must be finite, every variant, causal and
// not, with the saved out and lse of the float64 forward.
int run_scale_limit(const Target& t, const Cli& cli) {
  int failures = 0;
  for (const double scale : {1e30, -1e30})
    for (const bool causal : {false, true}) {
      const Case c{1, 70, 90, 2, 1, causal, -1, -1, Kind::contiguous, Kind::contiguous, false};
      const Shape s = shape_of(c, 64);
      std::mt19937 rng(uint32_t(causal ? 77 : 7));
      const BwdInputs in = random_inputs(s, rng);
      flashdl::Options o = options_of(c);
      o.softmax_scale = scale;
      const BwdOracle ref = reference_backward(s, o, in, true);
      const DType dt = DType::bfloat16;
      const Saved saved(t, c, s, dt, in, rounded(ref.out, dt), ref.lse);
      for (const Variant& var : kVariants) {
        const std::string label = std::string("softmax_scale ") + (scale > 0 ? "1e30 " : "-1e30 ") +
                                  label_of(c, 64, dt, var.name);
        if (!cli.selected(label)) continue;
        failures += run_case(label, [&] {
          flashdl::Options ov = o;
          ov.schedule = var.schedule;
          ov.sram_bytes = var.sram_bytes;
          ov.deterministic = var.deterministic;
          ov.stream = t.stream;
          const Layout lq = make_layout(s.b, s.sq, s.h, s.d, c.grad);
          const Layout lk = make_layout(s.b, s.sk, s.hk, s.d, c.grad);
          Buffer dq(size_t(lq.span) * 2, t.host), dk(size_t(lk.span) * 2, t.host),
              dv(size_t(lk.span) * 2, t.host);
          flashdl::backward(view_of(saved.dout, dt, saved.lq, 4), view_of(saved.q, dt, saved.lq, 4),
                            view_of(saved.k, dt, saved.lk, 4), view_of(saved.v, dt, saved.lk, 4),
                            view_of(saved.out, dt, saved.lq, 4),
                            view_of(saved.lse, DType::float32, saved.ll, 3), view_of(dq, dt, lq, 4),
                            view_of(dk, dt, lk, 4), view_of(dv, dt, lk, 4), ov);
          t.sync();
          bool gaps = true;
          int64_t bad = 0;
          for (const Buffer* b : {&dq, &dk, &dv})
            for (const double x : gather(b->download<uint16_t>(), b == &dq ? lq : lk, dt, gaps))
              bad += !std::isfinite(x);
          std::printf("%s %s | %lld non-finite gradient entries\n", bad ? "FAIL" : "ok  ",
                      label.c_str(), (long long)bad);
          return bad == 0;
        });
      }
    }
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  return test_main(argc, argv, [&](const Target& t, const Cli& cli) {
    int failures = 0;
    failures += run_accuracy(t, cli);
    failures += dropout::run_backward_accuracy(t, cli);
    failures += run_score_mods(t, cli);
    failures += run_planted(t, cli);
    failures += run_scale_limit(t, cli);
    if (cli.repeats()) {
      failures += run_repeats(t, cli);
      failures += dropout::run_backward_repeats(t, cli);
    }
    return failures;
  });
}
