// The CUDA forward kernels (fa1 and fa2) against the CPU float64 reference: both dtypes, every head
// dim, causal and windows, GQA/MQA, seqlen_q != seqlen_k, odd lengths, strided and misaligned
// arrays, empty rows; outputs poisoned with NaN before every call and their padding checked to stay
// untouched. Then a race test (100 identical calls, bitwise equal), dropout: the exact keep-mask
// and accuracy with dropout (dropout_forward.hpp), and the score modifiers (softcap, ALiBi with
// (nheads,), (batch, nheads) and padded slopes, both together; score_mod_cases.hpp) against the
// reference with the same modifiers; rows whose scores all lie far below 0. Exit code 77
// (skipped) when there is no CUDA device.
//
// FLASHDL_CUDA_SMEM_LIMIT=101376 (bytes) caps the shared memory the launchers plan against, which
// exercises the 99 KiB fallback variants (smaller tiles) that an H100 never selects.
// Command line (cli.hpp): --quick (for compute-sanitizer), --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cli.hpp"
#include "cuda_harness.hpp"
#include "dropout_forward.hpp"
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
  Kind kind;
  bool strided_lse;
  bool fa1_small_sram;          // also run fa1 with an 8 KiB budget: many K/V and Q blocks
  double scale = std::nan("");  // softmax_scale (NaN: 1 / sqrt(d))
};

const Case kCases[] = {
    {2, 17, 17, 4, 4, false, -1, -1, Kind::contiguous, false, false},
    {2, 17, 17, 4, 4, true, -1, -1, Kind::contiguous, true, false},
    {1, 1, 257, 4, 1, false, -1, -1, Kind::transposed, false, false},  // MQA
    {1, 1, 257, 4, 2, true, -1, -1, Kind::padded, false, false},       // GQA
    {2, 257, 1000, 2, 1, true, -1, -1, Kind::transposed, false, true},
    {1, 1000, 257, 2, 2, true, -1, -1, Kind::contiguous, true, false},  // 743 empty rows
    {1, 1000, 1000, 1, 1, false, -1, -1, Kind::odd, false, false},      // no 16-byte rows
    {1, 257, 257, 2, 1, false, 32, 8, Kind::padded, false, true},       // sliding window
    {1, 100, 130, 2, 2, false, -1, 5, Kind::contiguous, false, false},
    {1, 130, 100, 2, 2, true, 20, -1, Kind::odd, true, false},
    {1, 300, 40, 1, 1, false, 0, 0, Kind::contiguous, false, false},  // diagonal only
    {1, 5, 0, 2, 1, false, -1, -1, Kind::contiguous, false, false},   // no keys at all
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
  o.softmax_scale = c.scale;
  return o;
}

struct Oracle {
  std::vector<double> out;
  std::vector<float> lse;
};

// mods: the score modifiers (their host slopes), or null.
Oracle reference(const Case& c, const Shape& s, const std::vector<float>& q,
                 const std::vector<float>& k, const std::vector<float>& v,
                 const ModArgs* mods = nullptr) {
  std::vector<double> q64(q.begin(), q.end()), k64(k.begin(), k.end()), v64(v.begin(), v.end());
  Oracle r{std::vector<double>(q.size()), std::vector<float>(size_t(s.b * s.h * s.sq))};
  flashdl::Options o = mods ? mods->apply(options_of(c), true) : options_of(c);
  o.schedule = Schedule::reference;
  flashdl::forward(flashdl::make_view(q64.data(), DType::float64, {s.b, s.sq, s.h, s.d}),
                   flashdl::make_view(k64.data(), DType::float64, {s.b, s.sk, s.hk, s.d}),
                   flashdl::make_view(v64.data(), DType::float64, {s.b, s.sk, s.hk, s.d}),
                   flashdl::make_view(r.out.data(), DType::float64, {s.b, s.sq, s.h, s.d}),
                   flashdl::make_view(r.lse.data(), DType::float32, {s.b, s.h, s.sq}), o);
  return r;
}

// Random q, k, v of a case (values drawn from rng) and the float64 reference on them.
struct CaseInputs {
  std::vector<float> q, k, v;
  Oracle ref;
};

CaseInputs random_inputs(const Case& c, const Shape& s, std::mt19937& rng) {
  CaseInputs in;
  in.q = random_values(s.b * s.sq * s.h * s.d, rng);
  in.k = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.v = random_values(s.b * s.sk * s.hk * s.d, rng);
  in.ref = reference(c, s, in.q, in.k, in.v);
  return in;
}

struct GpuResult {
  std::vector<double> out;  // logical (b, sq, h, d)
  std::vector<float> lse;   // logical (b, h, sq)
  bool gaps_untouched = true;
};

struct GpuInputs {
  Layout lq, lk;
  Buffer q, k, v;
  GpuInputs(const Target& t, const Case& c, const Shape& s, DType dt, const std::vector<float>& hq,
            const std::vector<float>& hk, const std::vector<float>& hv)
      : lq(make_layout(s.b, s.sq, s.h, s.d, c.kind)),
        lk(make_layout(s.b, s.sk, s.hk, s.d, c.kind)),
        q(size_t(lq.span) * 2, t.host),
        k(size_t(lk.span) * 2, t.host),
        v(size_t(lk.span) * 2, t.host) {
    q.upload(place(hq, lq, dt));
    k.upload(place(hk, lk, dt));
    v.upload(place(hv, lk, dt));
  }
};

// mods: the score modifiers (their slopes on the target), or null.
GpuResult run_gpu(const Target& t, const Case& c, const Shape& s, DType dt, const GpuInputs& in,
                  Schedule sched, int64_t sram_bytes, const ModArgs* mods = nullptr) {
  const Layout lo = in.lq;
  const Layout ll = lse_layout(s.b, s.h, s.sq, c.strided_lse);
  Buffer out(size_t(lo.span) * 2, t.host), lse(size_t(ll.span) * 4, t.host);
  out.poison();
  lse.poison();
  flashdl::Options o = mods ? mods->apply(options_of(c), false) : options_of(c);
  o.schedule = sched;
  o.stream = t.stream;
  o.sram_bytes = sram_bytes;
  flashdl::forward(view_of(in.q, dt, in.lq, 4), view_of(in.k, dt, in.lk, 4),
                   view_of(in.v, dt, in.lk, 4), view_of(out, dt, lo, 4),
                   view_of(lse, DType::float32, ll, 3), o);
  t.sync();

  GpuResult r;
  r.out = gather(out.download<uint16_t>(), lo, dt, r.gaps_untouched);
  const std::vector<uint32_t> lb = lse.download<uint32_t>();
  std::vector<char> used(lb.size(), 0);
  for (int64_t a = 0; a < s.b; ++a)
    for (int64_t h = 0; h < s.h; ++h)
      for (int64_t i = 0; i < s.sq; ++i) {
        const auto off = size_t(ll.offset(a, h, i, 0));
        used[off] = 1;
        r.lse.push_back(bits_to_float(lb[off]));
      }
  for (size_t i = 0; i < lb.size(); ++i) r.gaps_untouched &= used[i] || lb[i] == 0xffffffffu;
  return r;
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
  std::printf("%s %s | err %.2e tol %.2e%s%s\n", ok ? "ok  " : "FAIL", label.c_str(), err, tol,
              lse_ok ? "" : " [lse]", g.gaps_untouched ? "" : " [wrote outside out/lse]");
  return ok;
}

std::string label_of(const Case& c, int64_t d, DType dt, Schedule sched, int64_t sram) {
  char buf[200];
  std::snprintf(buf, sizeof buf,
                "%s%s %s d=%lld b=%lld sq=%lld sk=%lld h=%lld/%lld%s w=(%lld,%lld) %s%s",
                flashdl::schedule_name(sched), sram ? "(8KiB)" : "", flashdl::dtype_name(dt),
                (long long)d, (long long)c.b, (long long)c.sq, (long long)c.sk, (long long)c.h,
                (long long)c.hk, c.causal ? " causal" : "", (long long)c.left, (long long)c.right,
                kind_name(c.kind), c.strided_lse ? " lse=strided" : "");
  return buf;
}

// A case with the head dims it runs (both dtypes each).
struct Plan {
  Case c;
  std::vector<int> dims;
};

std::vector<Plan> plans(const Cli& cli) {
  const std::vector<int> all_dims(std::begin(kHeadDims), std::end(kHeadDims));
  if (cli.quick)
    return {
        {{1, 70, 45, 2, 1, false, -1, -1, Kind::contiguous, false, true}, all_dims},
        // 70 empty rows (a whole empty 64-row block); 79 unseen keys (a whole unseen block).
        {{1, 100, 30, 2, 2, true, -1, -1, Kind::odd, true, true}, {128}},
        {{2, 45, 140, 2, 1, false, 16, 8, Kind::padded, false, true}, {64}},
    };
  std::vector<Plan> v;
  for (const Case& c : kCases) v.push_back({c, all_dims});
  return v;
}

// The schedules a case runs: fa1, fa2, and fa1 with an 8 KiB budget where the case asks for it.
std::vector<std::pair<Schedule, int64_t>> variants(const Case& c) {
  std::vector<std::pair<Schedule, int64_t>> v{{Schedule::fa1, 0}, {Schedule::fa2, 0}};
  if (c.fa1_small_sram) v.push_back({Schedule::fa1, 8192});
  return v;
}

int run_accuracy(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<Plan> ps = plans(cli);
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      auto selected = [&](DType dt) {
        for (const auto& [sched, sram] : variants(c))
          if (cli.selected(label_of(c, d, dt, sched, sram))) return true;
        return false;
      };
      if (!selected(DType::float16) && !selected(DType::bfloat16)) continue;
      const Shape s = shape_of(c, d);
      // Seeded per (case, head dim): a --filter run sees the same values as the full run.
      std::mt19937 rng(uint32_t(7919 * pi + size_t(d)));
      const CaseInputs data = random_inputs(c, s, rng);
      const auto &hq = data.q, &hk = data.k, &hv = data.v;
      const Oracle& ref = data.ref;
      for (const DType dt : kDtypes) {
        if (!selected(dt)) continue;
        std::vector<double> lowp;
        naive_lowp(s, hq, hk, hv, dt, lowp);
        const GpuInputs in(t, c, s, dt, hq, hk, hv);
        for (const auto& [sched, sram] : variants(c)) {
          const std::string label = label_of(c, d, dt, sched, sram);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&, sched = sched, sram = sram] {
            return check(label, ref, lowp, run_gpu(t, c, s, dt, in, sched, sram), dt);
          });
        }
      }
    }
  return failures;
}

// The same inputs 100 times: bitwise equal out and lse (a race would show up as a difference).
int run_race(const Target& t, const Cli& cli) {
  int failures = 0;
  const Case c{2, 1000, 1000, 4, 2, true, -1, -1, Kind::contiguous, false, false};
  for (const int d : {64, 256}) {
    const Shape s = shape_of(c, d);
    auto label_for = [&](Schedule sched) {
      return "race x100 " + label_of(c, d, DType::float16, sched, 0);
    };
    if (!cli.selected(label_for(Schedule::fa1)) && !cli.selected(label_for(Schedule::fa2)))
      continue;
    std::mt19937 rng(uint32_t(99 + d));
    const auto hq = random_values(s.b * s.sq * s.h * d, rng);
    const auto hk = random_values(s.b * s.sk * s.hk * d, rng);
    const auto hv = random_values(s.b * s.sk * s.hk * d, rng);
    const GpuInputs in(t, c, s, DType::float16, hq, hk, hv);
    for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
      const std::string label = label_for(sched);
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        const GpuResult first = run_gpu(t, c, s, DType::float16, in, sched, 0);
        int mismatches = 0;
        for (int rep = 1; rep < 100; ++rep) {
          const GpuResult g = run_gpu(t, c, s, DType::float16, in, sched, 0);
          const bool same = std::memcmp(g.out.data(), first.out.data(), g.out.size() * 8) == 0 &&
                            std::memcmp(g.lse.data(), first.lse.data(), g.lse.size() * 4) == 0;
          mismatches += !same;
        }
        std::printf("%s %s | %d of 99 repeats differ\n", mismatches ? "FAIL" : "ok  ",
                    label.c_str(), mismatches);
        return mismatches == 0;
      });
    }
  }
  return failures;
}

// ---- NaN and Inf at keys a row cannot see ---------------------------------------------------------
// K and V hold NaN / +-Inf at a few keys that some rows of their tile see and others do not (causal,
// window, seqlen_q > seqlen_k). Every row that sees none of them must match the oracle of the clean
// inputs (out within the accuracy rule, lse as there); a 0 * NaN from the masked columns of the
// block's P V product makes them NaN. Both schedules; the shared-memory softmax through ctest's
// FLASHDL_CUDA_FA2_SMEM_SOFTMAX run.
struct PlantPlan {
  Case c;
  std::vector<int64_t> keys;
  std::vector<int> dims;
};

std::vector<PlantPlan> plant_plans(const Cli& cli) {
  std::vector<PlantPlan> v{
      // causal: keys 70 and 97 share the block of rows 64..127, rows 64..69 and 70..96 are blind
      {{1, 100, 100, 2, 1, true, -1, -1, Kind::contiguous, false, true}, {70, 97}, {64}},
      // a window (row i sees keys i + 79 .. i + 103): key 82 is seen by rows 0..3, 130 by 27..44
      {{2, 45, 140, 2, 1, false, 16, 8, Kind::padded, false, false}, {82, 130}, {128}},
  };
  if (cli.quick) return v;
  const std::vector<int> all_dims(std::begin(kHeadDims), std::end(kHeadDims));
  v[0].dims = all_dims;
  v[1].dims = all_dims;
  // seqlen_q > seqlen_k, causal: the last keys are seen by the last rows only; odd strides
  v.push_back(
      {{2, 300, 200, 4, 2, true, -1, -1, Kind::odd, true, false}, {150, 198, 199}, {64, 256}});
  // both window sides, many blocks, transposed storage
  v.push_back({{1, 257, 257, 2, 2, false, 32, 8, Kind::transposed, false, true},
               {0, 40, 129, 256},
               {96, 192}});
  return v;
}

int run_planted(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<PlantPlan> ps = plant_plans(cli);
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      const Shape s = shape_of(c, d);
      std::mt19937 rng(uint32_t(31337 * (pi + 1) + size_t(d)));
      const auto hq = random_values(s.b * s.sq * s.h * d, rng);
      auto hk = random_values(s.b * s.sk * s.hk * d, rng);
      auto hv = random_values(s.b * s.sk * s.hk * d, rng);
      const Oracle ref = reference(c, s, hq, hk, hv);
      const std::vector<char> blind = rows_blind_to(s.sq, ps[pi].keys, [&](int64_t i, int64_t j) {
        return s.visible(i, j);
      });
      size_t n_blind = 0;
      for (char b : blind) n_blind += size_t(b);
      std::vector<float> pk = hk, pv = hv;
      plant_nonfinite(s, ps[pi].keys, pk, pv);
      for (const DType dt : kDtypes) {
        std::vector<double> lowp;
        naive_lowp(s, hq, hk, hv, dt, lowp);
        const GpuInputs in(t, c, s, dt, hq, pk, pv);
        for (const auto& [sched, sram] : variants(c)) {
          const std::string label = "masked NaN/Inf " + label_of(c, d, dt, sched, sram);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&, sched = sched, sram = sram] {
            const GpuResult g = run_gpu(t, c, s, dt, in, sched, sram);
            const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
            const double tol = 2.0 * max_abs_diff(lowp, ref.out) + eps;
            const double err = max_abs_diff_rows(g.out, ref.out, s.b, s.sq, s.h, d, blind);
            const bool lse_ok = lse_matches_rows(g.lse, ref.lse, s.b * s.h, s.sq, blind);
            // The planted values do reach the rows that see them (the test plants what it says).
            const bool seen = any_nan(g.out) || max_abs(g.out) == INFINITY;
            const bool ok = err <= tol && lse_ok && g.gaps_untouched && seen && n_blind > 0 &&
                            n_blind < blind.size();
            std::printf("%s %s | %zu of %zu rows blind, err %.2e tol %.2e%s%s\n",
                        ok ? "ok  " : "FAIL", label.c_str(), n_blind, blind.size(), err, tol,
                        lse_ok ? "" : " [lse]", seen ? "" : " [no row saw the planted values]");
            return ok;
          });
        }
      }
    }
  return failures;
}

// ---- score modifiers ----------------------------------------------------------------------------
// A case, its modifiers and the head dims it runs (both dtypes, the schedules of variants()).
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
        {{2, 70, 45, 2, 1, true, -1, -1, Kind::contiguous, false, true},
         {2.0, Alibi::batch_heads},
         all_dims},
        {{1, 100, 130, 4, 2, false, 16, 8, Kind::padded, true, false}, {0.0, Alibi::strided}, {64}},
    };
  return {
      // softcap alone, no mask: the unmasked (full-block) path, GQA
      {{2, 97, 130, 4, 2, false, -1, -1, Kind::contiguous, false, true},
       {2.0, Alibi::none},
       all_dims},
      // ALiBi (nheads,), causal with seqlen_q > seqlen_k: 33 empty rows
      {{2, 130, 97, 4, 4, true, -1, -1, Kind::transposed, true, false},
       {0.0, Alibi::heads},
       {64, 128}},
      // ALiBi (batch, nheads) with padded rows, MQA, sliding window
      {{2, 257, 300, 4, 1, false, 32, 8, Kind::padded, false, true},
       {0.0, Alibi::strided},
       {64, 256}},
      // both, causal, GQA, every head dim
      {{2, 300, 200, 4, 2, true, -1, -1, Kind::contiguous, true, false},
       {5.0, Alibi::batch_heads},
       all_dims},
      // both, one query row (decoding), rows not 16-byte aligned
      {{2, 1, 257, 4, 2, false, -1, -1, Kind::odd, false, false}, {1.0, Alibi::heads}, {64, 128}},
      // both, a wide window: the blocks inside it take the unmasked path
      {{1, 1000, 1000, 2, 1, false, 200, 100, Kind::contiguous, false, true},
       {2.0, Alibi::batch_heads},
       {64, 128}},
  };
}

// Softcap and ALiBi against the reference with the same modifiers, under the same rule (the naive
// algorithm in the input precision applies them too).
int run_score_mods(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<ModPlan> ps = mod_plans(cli);
  for (size_t pi = 0; pi < ps.size(); ++pi)
    for (const int d : ps[pi].dims) {
      const Case& c = ps[pi].c;
      const std::string mods = mod_label(ps[pi].m);
      auto selected = [&](DType dt) {
        for (const auto& [sched, sram] : variants(c))
          if (cli.selected(label_of(c, d, dt, sched, sram) + mods)) return true;
        return false;
      };
      if (!selected(DType::float16) && !selected(DType::bfloat16)) continue;
      const Shape s = shape_of(c, d);
      std::mt19937 rng(uint32_t(104729 * (pi + 1) + size_t(d)));
      const auto hq = random_values(s.b * s.sq * s.h * d, rng);
      const auto hk = random_values(s.b * s.sk * s.hk * d, rng);
      const auto hv = random_values(s.b * s.sk * s.hk * d, rng);
      const ModArgs m(t.host, ps[pi].m, s.b, s.h);
      const Oracle ref = reference(c, s, hq, hk, hv, &m);
      for (const DType dt : kDtypes) {
        if (!selected(dt)) continue;
        std::vector<double> lowp;
        naive_lowp(s, hq, hk, hv, dt, lowp, &m.naive());
        const GpuInputs in(t, c, s, dt, hq, hk, hv);
        for (const auto& [sched, sram] : variants(c)) {
          const std::string label = label_of(c, d, dt, sched, sram) + mods;
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&, sched = sched, sram = sram] {
            return check(label, ref, lowp, run_gpu(t, c, s, dt, in, sched, sram, &m), dt);
          });
        }
      }
    }
  return failures;
}

// ---- every score far below 0 ----------------------------------------------------------------------
// Rows whose scores all lie near -40: out is still the softmax of them (the online softmax's
// running max starts at -inf, so P = exp(s - max) stays near 1), but a running max that started
// at 0 would leave P = exp(-40), which float16 and bfloat16 flush to 0 (out 0, or lse -inf where
// the sum underflows too). nvcc 13.0 once compiled the fa2 forward's per-band softmax state so
// that its second 16-row band of every warp started at 0 (detail/softmax.hpp): only rows like
// these showed it. K rows are u plus noise, Q rows -c u plus noise, c chosen so that q.k scale
// is about -40; every warp's two bands, causal rows with one key, both schedules.
int run_negative_scores(const Target& t, const Cli& cli) {
  int failures = 0;
  const Case cases[] = {{1, 200, 150, 2, 1, false, -1, -1, Kind::contiguous, false, false},
                        {2, 130, 130, 2, 2, true, -1, -1, Kind::padded, false, false}};
  for (size_t ci = 0; ci < std::size(cases); ++ci)
    for (const int d : {64, 128}) {
      const Case& c = cases[ci];
      if (cli.quick && (ci != 0 || d != 64)) continue;
      const Shape s = shape_of(c, d);
      std::mt19937 rng(uint32_t(104729 * ci + size_t(d)));
      const auto u = random_values(d, rng);
      double uu = 0.0;
      for (const float x : u) uu += double(x) * x;
      const float cq = float(40.0 * std::sqrt(double(d)) / uu);
      auto rows = [&](int64_t n, float scale) {  // values exact in both dtypes: one oracle
        std::vector<float> x = random_values(n * d, rng);
        for (int64_t i = 0; i < n * d; ++i) {
          float& e = x[size_t(i)];
          e = round_to(round_to(scale * u[size_t(i % d)] + 0.05f * e, DType::bfloat16),
                       DType::float16);
          if (round_to(e, DType::bfloat16) != e) e = 0.0f;
        }
        return x;
      };
      const auto hq = rows(s.b * s.sq * s.h, -cq);
      const auto hk = rows(s.b * s.sk * s.hk, 1.0f);
      const auto hv = random_values(s.b * s.sk * s.hk * d, rng);
      const Oracle ref = reference(c, s, hq, hk, hv);
      for (const DType dt : kDtypes) {
        std::vector<double> lowp;
        naive_lowp(s, hq, hk, hv, dt, lowp);
        const GpuInputs in(t, c, s, dt, hq, hk, hv);
        for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
          const std::string label = "scores near -40: " + label_of(c, d, dt, sched, 0);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&, sched = sched] {
            return check(label, ref, lowp, run_gpu(t, c, s, dt, in, sched, 0), dt);
          });
        }
      }
    }
  return failures;
}

// ---- softmax_scale of any sign ------------------------------------------------------------------
// A caller may give a softmax_scale of 0 or below. The fa2 forward's register softmax takes the max
// of the raw scores and scales it after, which is the max of the scaled scores only for a scale
// above 0: other scales take the shared-memory softmax (the general kernel). Against the reference
// with the same scale, both schedules, both dtypes.
int run_scales(const Target& t, const Cli& cli) {
  int failures = 0;
  const Case bases[] = {{1, 150, 200, 2, 1, false, -1, -1, Kind::contiguous, false, false},
                        {1, 130, 130, 2, 2, true, -1, -1, Kind::padded, false, false}};
  for (size_t ci = 0; ci < std::size(bases); ++ci)
    for (const int d : {64, 128})
      for (const double scale : {-0.3, 0.0, 0.05}) {
        if (cli.quick && (ci != 0 || d != 64 || scale > 0.0)) continue;
        Case c = bases[ci];
        c.scale = scale;
        const Shape s = shape_of(c, d);
        std::mt19937 rng(uint32_t(7907 * ci + size_t(d)));
        const CaseInputs data = random_inputs(c, s, rng);
        const Oracle& ref = data.ref;
        for (const DType dt : kDtypes) {
          std::vector<double> lowp;
          naive_lowp(s, data.q, data.k, data.v, dt, lowp, nullptr, float(scale));
          const GpuInputs in(t, c, s, dt, data.q, data.k, data.v);
          for (const Schedule sched : {Schedule::fa1, Schedule::fa2}) {
            const std::string label = "softmax_scale " + std::to_string(scale) + ": " +
                                      label_of(c, d, dt, sched, 0);
            if (!cli.selected(label)) continue;
            failures += run_case(label, [&, sched = sched] {
              return check(label, ref, lowp, run_gpu(t, c, s, dt, in, sched, 0), dt);
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
    if (cli.repeats()) failures += run_race(t, cli);
    failures += dropout::run_mask_tests(t, cli);
    failures += dropout::run_forward_accuracy(t, cli);
    failures += run_score_mods(t, cli);
    failures += run_planted(t, cli);
    failures += run_negative_scores(t, cli);
    failures += run_scales(t, cli);
    return failures;
  });
}
