// Attention over a KV cache on CUDA (forward_kvcache: the append kernel, the decode kernel and
// the combine of its key splits) and merge_states on CUDA arrays, against the CPU float64
// reference: contiguous and paged caches (pages shuffled, spare pages, pages smaller and larger
// than the kernel's tiles), with and without an append, num_splits 1, chosen and several (more
// than the keys allow too), GQA/MQA and groups beyond one 16-row CTA, seqlen_q 1 to 20, causal
// and windows (bottom-right per sequence), softcap and ALiBi, empty sequences and empty rows,
// padded and misaligned layouts, attention sinks (split 0 alone adds them), both dtypes, every
// head dim. Every slot of the cache that holds
// no key is NaN; out and lse are poisoned and their gaps must stay untouched; the cache must hold
// exactly the old rows plus the appended ones, bitwise, and nothing else may change. Then
// merge_states (merge_cases.hpp). Exit code 77 (skipped) when there is no CUDA device.
//
// FLASHDL_CUDA_SMEM_LIMIT=101376 (bytes) makes the launcher pick the 2-warp decode kernels
// (d = 192, 256) that an H100 never selects. Command line (cli.hpp): --quick (for
// compute-sanitizer), --filter SUBSTR, --no-race, --cpu.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cli.hpp"
#include "cuda_harness.hpp"
#include "flashdl/api.hpp"
#include "kvcache_oracle.hpp"
#include "merge_cases.hpp"
#include "score_mod_cases.hpp"

using namespace cuda_test;
using flashdl::DType;

namespace {

const int kHeadDims[] = {32, 64, 96, 128, 192, 256};
const DType kDtypes[] = {DType::float16, DType::bfloat16};
const ModSpec kNoMods{0.0, Alibi::none};
// Sinks near the rows' lse (~log of the keys seen), so they take a large share, and far from it.
const std::vector<float> kSinks4 = {4.5f, 6.0f, -3.0f, 0.25f};
const std::vector<float> kSinks8 = {4.5f, 6.0f, -3.0f, 0.25f, 3.0f, 9.0f, -1.5f, 5.25f};

std::vector<KvCase> cases(const Cli& cli) {
  const Kind C = Kind::contiguous, P = Kind::padded, O = Kind::odd, T = Kind::transposed;
  if (cli.quick)
    return {
        // paged, append, GQA, causal, two splits and the chosen count
        {2, 1, 4, 2, 300, 1, {150, 0}, 16, true, -1, -1, C, kNoMods, {0, 2}},
        // contiguous, groups beyond one CTA (24 rows), window, modifiers, misaligned rows
        {1, 3, 8, 1, 200, 2, {97}, 0, false, 20, 4, O, {2.0, Alibi::batch_heads}, {1, 3}},
        // attention sinks: paged, append, an empty sequence (out 0, lse = sink), split 3 ways
        {2, 1, 4, 2, 300, 1, {150, 0}, 16, true, -1, -1, C, kNoMods, {1, 3}, kSinks4},
    };
  return {
      // one query row, MHA, contiguous, no append
      {3, 1, 4, 4, 520, 0, {1, 257, 520}, 0, false, -1, -1, C, kNoMods, {1, 0, 4}},
      // decoding step with an append, GQA 4, paged (pages of 16 in a 64-key tile)
      {2, 1, 8, 2, 1000, 1, {999, 300}, 16, true, -1, -1, C, kNoMods, {1, 0, 7}},
      // speculative decoding: 4 new rows, causal, MQA with 8 heads (32 rows: two row chunks)
      {2, 4, 8, 1, 700, 4, {600, 33}, 0, true, -1, -1, P, kNoMods, {1, 0, 3}},
      // pages larger than a tile, an empty sequence, a full one, more splits than tiles
      {3, 2, 4, 2, 512, 0, {0, 512, 100}, 256, false, -1, -1, C, kNoMods, {1, 0, 1000}},
      // sliding window: only its keys are read and split
      {2, 3, 4, 2, 900, 3, {800, 40}, 32, true, 64, -1, C, kNoMods, {1, 0, 5}},
      // seqlen_q > keys under causal: empty rows (out 0, lse -inf); odd strides (no cp.async)
      {2, 20, 2, 1, 64, 0, {5, 0}, 0, true, -1, -1, O, kNoMods, {1, 0}},
      // two-sided window, transposed q/out and cache layouts
      {1, 5, 4, 4, 400, 2, {333}, 0, false, 16, 8, T, kNoMods, {1, 3}},
      // softcap and ALiBi (batch, nheads), GQA, paged with pages of 7 (tiles span pages)
      {2, 2, 4, 2, 300, 1, {250, 64}, 7, true, -1, -1, C, {3.0, Alibi::batch_heads}, {1, 0, 3}},
      // ALiBi (nheads,) alone, strided slopes with a window
      {2, 1, 4, 1, 300, 0, {280, 9}, 0, false, 50, 0, P, {0.0, Alibi::heads}, {1, 4}},
      {1, 3, 6, 2, 260, 1, {200}, 13, false, 32, 8, C, {0.0, Alibi::strided}, {0, 2}},
      // no query rows: the append alone
      {2, 0, 4, 2, 64, 3, {10, 61}, 16, false, -1, -1, C, kNoMods, {0}},
      // attention sinks (the sink in each row's denominator once, whatever the splits)
      {2, 1, 4, 2, 300, 1, {150, 0}, 16, true, -1, -1, C, kNoMods, {1, 0, 3}, kSinks4},
      {1,
       3,
       8,
       1,
       900,
       2,
       {800},
       0,
       false,
       40,
       4,
       O,
       {2.0, Alibi::batch_heads},
       {1, 0, 5},
       kSinks8},
      {2, 4, 8, 2, 700, 4, {600, 33}, 0, true, -1, -1, T, kNoMods, {1, 4}, kSinks8},
  };
}

std::string label_of(const KvCase& c, int64_t d, DType dt, int64_t splits) {
  std::string lens;
  for (int32_t l : c.lens) lens += (lens.empty() ? "" : ",") + std::to_string(l);
  char buf[300];
  std::snprintf(buf, sizeof buf,
                "kvcache %s d=%lld b=%lld sq=%lld h=%lld/%lld cap=%lld new=%lld lens=[%s] "
                "cache=%s%s w=(%lld,%lld) %slayout=%s splits=%lld",
                flashdl::dtype_name(dt), (long long)d, (long long)c.b, (long long)c.sq,
                (long long)c.h, (long long)c.hk, (long long)c.capacity, (long long)c.seqlen_new,
                lens.c_str(), c.paged() ? "paged" : "contiguous",
                c.paged() ? std::to_string(c.page_size).c_str() : "", (long long)c.left,
                (long long)c.right, c.causal ? "causal " : "", kind_name(c.kind),
                (long long)splits);
  return std::string(buf) + mod_label(c.mods) + (c.sinks.empty() ? "" : " sinks");
}

struct KvResult {
  std::vector<double> out;
  std::vector<float> lse;
  bool gaps_untouched = true;
  bool cache_ok = true;
};

KvResult run_target(const Target& t, const KvCase& c, int64_t d, DType dt, const KvValues& x,
                    const CacheLayout& cl, const ModArgs& mods, int64_t splits) {
  const Layout lq = make_layout(c.b, c.sq, c.h, d, c.kind);
  const Layout ln = make_layout(c.b, c.seqlen_new, c.hk, d, c.kind);
  const Layout ll = lse_layout(c.b, c.h, c.sq, c.kind == Kind::padded);
  Buffer q(size_t(lq.span) * 2, t.host), out(size_t(lq.span) * 2, t.host),
      lse(size_t(ll.span) * 4, t.host), kc(size_t(cl.L.span) * 2, t.host),
      vc(size_t(cl.L.span) * 2, t.host), kn(size_t(ln.span) * 2, t.host),
      vn(size_t(ln.span) * 2, t.host);
  q.upload(place(x.q, lq, dt));
  kc.upload(cl.place(c, d, x, false, false, dt));
  vc.upload(cl.place(c, d, x, true, false, dt));
  kn.upload(place(x.k_new, ln, dt));
  vn.upload(place(x.v_new, ln, dt));
  out.poison();
  lse.poison();

  flashdl::Options o = mods.apply(flashdl::Options{}, false);
  o.causal = c.causal;
  o.window_left = c.left;
  o.window_right = c.right;
  o.num_splits = splits;
  o.stream = t.stream;
  Buffer sinks(c.sinks.size() * 4, t.host);  // on the target, as q
  if (!c.sinks.empty()) {
    sinks.upload(c.sinks);
    o.sinks = flashdl::make_view(sinks.ptr, DType::float32, {c.h});
    o.sinks.device = sinks.device();
  }
  std::vector<int32_t> lens = c.lens, table = cl.table;  // host arrays, as the API takes them
  const flashdl::TensorView none{};
  const flashdl::TensorView lens_v = flashdl::make_view(lens.data(), DType::int32, {c.b});
  const flashdl::TensorView table_v =
      c.paged() ? flashdl::make_view(table.data(), DType::int32, {c.b, cl.max_pages}) : none;
  const bool append = c.seqlen_new > 0;
  flashdl::forward_kvcache(view_of(q, dt, lq, 4), view_of(kc, dt, cl.L, 4),
                           view_of(vc, dt, cl.L, 4), lens_v, append ? view_of(kn, dt, ln, 4) : none,
                           append ? view_of(vn, dt, ln, 4) : none, table_v, view_of(out, dt, lq, 4),
                           view_of(lse, DType::float32, ll, 3), o);
  t.sync();

  KvResult r;
  r.out = gather(out.download<uint16_t>(), lq, dt, r.gaps_untouched);
  const std::vector<uint32_t> lb = lse.download<uint32_t>();
  std::vector<char> used(lb.size(), 0);
  for (int64_t a = 0; a < c.b; ++a)
    for (int64_t h = 0; h < c.h; ++h)
      for (int64_t i = 0; i < c.sq; ++i) {
        const auto off = size_t(ll.offset(a, h, i, 0));
        used[off] = 1;
        r.lse.push_back(bits_to_float(lb[off]));
      }
  for (size_t i = 0; i < lb.size(); ++i) r.gaps_untouched &= used[i] || lb[i] == 0xffffffffu;
  // The caches: the old rows and the appended ones, bitwise, and the NaN poison everywhere else.
  r.cache_ok = kc.download<uint16_t>() == cl.place(c, d, x, false, true, dt) &&
               vc.download<uint16_t>() == cl.place(c, d, x, true, true, dt);
  return r;
}

// flash-attn's rule for out (max|got - oracle| <= 2 max|naive_lowp - oracle| + eps(dtype)); lse
// -inf exactly where the oracle has it, else within 1e-3 + 1e-4 |lse|.
bool check(const std::string& label, const KvOracle& ref, const KvResult& g, DType dt) {
  const double eps = dt == DType::float16 ? 1e-3 : 8e-3;
  const double err = max_abs_diff(g.out, ref.out);
  const double tol = 2.0 * max_abs_diff(ref.lowp, ref.out) + eps;
  bool lse_ok = g.lse.size() == ref.lse.size();
  for (size_t i = 0; lse_ok && i < ref.lse.size(); ++i) {
    const float want = ref.lse[i], got = g.lse[i];
    lse_ok = std::isinf(want) ? got == want
                              : std::fabs(double(got) - want) <= 1e-3 + 1e-4 * std::fabs(want);
  }
  const bool ok = err <= tol && lse_ok && g.gaps_untouched && g.cache_ok;
  std::printf("%s %s | err %.2e tol %.2e%s%s%s\n", ok ? "ok  " : "FAIL", label.c_str(), err, tol,
              lse_ok ? "" : " [lse]", g.gaps_untouched ? "" : " [wrote outside out/lse]",
              g.cache_ok ? "" : " [cache]");
  return ok;
}

int run_kvcache(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<KvCase> cs = cases(cli);
  for (size_t ci = 0; ci < cs.size(); ++ci) {
    const KvCase& c = cs[ci];
    // Quick: every head dim for the first case, d = 128 for the others.
    std::vector<int> dims(std::begin(kHeadDims), std::end(kHeadDims));
    if (cli.quick && ci > 0) dims = {128};
    for (const int d : dims) {
      auto selected = [&](DType dt) {
        for (const int64_t s : c.splits)
          if (cli.selected(label_of(c, d, dt, s))) return true;
        return false;
      };
      if (!selected(DType::float16) && !selected(DType::bfloat16)) continue;
      // Seeded per (case, head dim): a --filter run sees the same values and pages.
      std::mt19937 rng(uint32_t(6133 * ci + size_t(d)));
      const KvValues x(c, d, rng);
      const CacheLayout cl(c, d, rng);
      const ModArgs mods(t.host, c.mods, c.b, c.h);
      for (const DType dt : kDtypes) {
        if (!selected(dt)) continue;
        const KvOracle ref = kv_oracle(c, d, x, dt);
        for (const int64_t s : c.splits) {
          const std::string label = label_of(c, d, dt, s);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            return check(label, ref, run_target(t, c, d, dt, x, cl, mods, s), dt);
          });
        }
      }
    }
  }
  return failures;
}

// NaN and Inf planted in the cache at keys that some rows of a warp's 16 keys see and others do
// not (causal speculative rows, a window): the rows blind to them must match the oracle of the
// clean cache (what a row cannot see never reaches it). Before the decode kernel's slow path, the
// tensor-core P V added 0 * NaN to them. The rows that see them must come out non-finite.
int run_nonfinite(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<KvCase> cs = {
      {1, 4, 4, 2, 200, 0, {150}, 0, true, -1, -1, Kind::contiguous, kNoMods, {1}},
      {2, 3, 2, 1, 200, 0, {120, 77}, 16, false, 5, 0, Kind::contiguous, kNoMods, {1, 2}},
  };
  for (size_t ci = 0; ci < cs.size(); ++ci) {
    const KvCase& c = cs[ci];
    for (const int d : {64, 128, 256}) {  // 256: the 2-warp kernel with the 99 KiB limit
      std::mt19937 rng(uint32_t(977 * ci + size_t(d)));
      const KvValues clean(c, d, rng);
      const CacheLayout cl(c, d, rng);
      const ModArgs mods(t.host, c.mods, c.b, c.h);
      // Keys len - 2 and len - 1 of each sequence: the last query rows see them, the first not.
      KvValues x = clean;
      for (int64_t bi = 0; bi < c.b; ++bi) {
        const Shape sh{1, 1, c.capacity, 1, c.hk, d, -1, -1};
        std::vector<float> k(x.k.begin() + bi * c.capacity * c.hk * d,
                             x.k.begin() + (bi + 1) * c.capacity * c.hk * d);
        std::vector<float> v(x.v.begin() + bi * c.capacity * c.hk * d,
                             x.v.begin() + (bi + 1) * c.capacity * c.hk * d);
        const int64_t len = c.lens[size_t(bi)];
        plant_nonfinite(sh, {len - 2, len - 1}, k, v);
        std::copy(k.begin(), k.end(), x.k.begin() + bi * c.capacity * c.hk * d);
        std::copy(v.begin(), v.end(), x.v.begin() + bi * c.capacity * c.hk * d);
      }
      for (const DType dt : kDtypes) {
        const KvOracle ref = kv_oracle(c, d, clean, dt);
        for (const int64_t s : c.splits) {
          const std::string label = "nonfinite " + label_of(c, d, dt, s);
          if (!cli.selected(label)) continue;
          failures += run_case(label, [&] {
            const KvResult g = run_target(t, c, d, dt, x, cl, mods, s);
            // Query i sits at key len - sq + i: rows i < sq - 2 see neither planted key.
            std::vector<char> blind(size_t(c.sq), 0);
            for (int64_t i = 0; i + 2 < c.sq; ++i) blind[size_t(i)] = 1;
            const double err = max_abs_diff_rows(g.out, ref.out, c.b, c.sq, c.h, d, blind);
            const double tol = 2.0 * max_abs_diff(ref.lowp, ref.out) +
                               (dt == DType::float16 ? 1e-3 : 8e-3);
            // The rows that see a planted key are non-finite, as the float64 reference is (V holds
            // NaN at key len - 2, which they all see): a warp whose keys hold the NaN must not pass
            // for an empty one in the merge of the warps and splits (its lse was -inf: 4 to 7 of
            // these 8 rows came out finite).
            int64_t seeing = 0, seeing_finite = 0;
            for (int64_t bi = 0; bi < c.b; ++bi)
              for (int64_t i = 0; i < c.sq; ++i)
                for (int64_t h = 0; h < c.h && !blind[size_t(i)]; ++h) {
                  bool fin = true;
                  for (int64_t e = 0; e < d; ++e)
                    fin &= std::isfinite(g.out[size_t(((bi * c.sq + i) * c.h + h) * d + e)]);
                  ++seeing;
                  seeing_finite += fin;
                }
            const bool ok = err <= tol && g.gaps_untouched && g.cache_ok && seeing > 0 &&
                            seeing_finite == 0;
            std::printf(
                "%s %s | blind rows err %.2e tol %.2e; %lld of %lld rows that see a "
                "planted key finite\n",
                ok ? "ok  " : "FAIL", label.c_str(), err, tol, (long long)seeing_finite,
                (long long)seeing);
            return ok;
          });
        }
      }
    }
  }
  return failures;
}

// The same call 50 times: bitwise equal out and lse (each split's CTA merges its warps and the
// combine its splits in a fixed order, so a difference would be a race).
int run_race(const Target& t, const Cli& cli) {
  const KvCase c{2,       2,  8, 2, 2000, 0, {1999, 1500}, 16, true, -1, -1, Kind::contiguous,
                 kNoMods, {0}};
  const int64_t d = 128;
  const std::string label = "race x50 " + label_of(c, d, DType::float16, 0);
  if (!cli.selected(label)) return 0;
  std::mt19937 rng(77);
  const KvValues x(c, d, rng);
  const CacheLayout cl(c, d, rng);
  const ModArgs mods(t.host, c.mods, c.b, c.h);
  return run_case(label, [&] {
    const KvResult first = run_target(t, c, d, DType::float16, x, cl, mods, 0);
    int mismatches = 0;
    for (int rep = 1; rep < 50; ++rep) {
      const KvResult g = run_target(t, c, d, DType::float16, x, cl, mods, 0);
      mismatches += !(g.out == first.out &&
                      std::memcmp(g.lse.data(), first.lse.data(), g.lse.size() * 4) == 0);
    }
    std::printf("%s %s | %d of 49 repeats differ\n", mismatches ? "FAIL" : "ok  ", label.c_str(),
                mismatches);
    return mismatches == 0;
  });
}

// Rotary embedding (both pair styles, rotary_dim below and at the head dim, per-row and shared
// query positions), cache_batch_idx (more cache rows than sequences, permuted) and cache_leftpad,
// contiguous and paged: the device call against the same call on the CPU backend (whose
// float64-oracle tests are tests/python/test_kvcache_serving.py). The caches must come out
// bitwise equal (both round each float32 product, then the sum, once to the dtype) and out within
// the dtype's rounding of the CPU's.
struct ServingCase {
  int64_t b, sq, h, hk, d, cap, rows, seqlen_new, page, rd;
  bool interleaved, causal;
  std::vector<int32_t> lens, idx, pad;
};

std::vector<ServingCase> serving_cases() {
  return {
      // decode step, GQA, rotary half the head dim (GPT-NeoX), batch indices, left pads
      {2, 1, 8, 2, 128, 96, 3, 1, 0, 64, false, true, {40, 70}, {2, 0}, {5, 0}},
      // speculative rows, interleaved (GPT-J) over the whole head dim, non-causal (shared
      // positions), no batch index
      {3, 3, 4, 4, 64, 64, 3, 3, 0, 64, true, false, {10, 0, 61}, {}, {2, 0, 30}},
      // paged with left pads, rotary 32 of 96 columns, causal
      {2, 2, 4, 1, 96, 80, 0, 2, 16, 32, false, true, {33, 70}, {}, {17, 0}},
      // no append: q rotated alone, batch indices repeated (reads only)
      {2, 2, 4, 2, 128, 50, 2, 0, 0, 128, true, true, {20, 49}, {1, 1}, {}},
  };
}

int run_serving(const Target& t, const Cli& cli) {
  int failures = 0;
  const std::vector<ServingCase> cs = serving_cases();
  for (size_t ci = 0; ci < cs.size(); ++ci) {
    const ServingCase& c = cs[ci];
    for (const DType dt : kDtypes) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "kvcache serving %s case %zu d=%lld rd=%lld %s%s%s%s",
                    flashdl::dtype_name(dt), ci, (long long)c.d, (long long)c.rd,
                    c.interleaved ? "interleaved " : "", c.page ? "paged " : "",
                    c.idx.empty() ? "" : "batch_idx ", c.pad.empty() ? "" : "leftpad");
      const std::string label = buf;
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        std::mt19937 rng(uint32_t(977 * ci + 13));
        const int64_t npages = c.page ? c.b * CacheLayout::detail_ceil(c.cap, c.page) + 1 : 0;
        const int64_t per = c.page ? CacheLayout::detail_ceil(c.cap, c.page) : 0;
        const Layout lq = make_layout(c.b, c.sq, c.h, c.d, Kind::contiguous);
        const Layout ln = make_layout(c.b, c.seqlen_new, c.hk, c.d, Kind::contiguous);
        const Layout lc = c.page ? make_layout(npages, c.page, c.hk, c.d, Kind::contiguous)
                                 : make_layout(c.rows, c.cap, c.hk, c.d, Kind::contiguous);
        const int64_t ro_rows = c.cap + c.sq, half = c.rd / 2;
        const Layout lr{{ro_rows, half, 1, 1}, {half, 1, 1, 1}, ro_rows * half};
        const Layout ll = lse_layout(c.b, c.h, c.sq, false);
        const auto q = random_values(lq.span, rng), kc = random_values(lc.span, rng),
                   vc = random_values(lc.span, rng), kn = random_values(ln.span, rng),
                   vn = random_values(ln.span, rng);
        std::vector<float> cos = random_values(lr.span, rng), sin = random_values(lr.span, rng);
        for (float& x : cos) x /= 2;
        for (float& x : sin) x /= 2;
        std::vector<int32_t> table;
        for (int64_t i = 0; i < c.b * per; ++i) table.push_back(int32_t((i * 7 + 3) % npages));
        // One run on `host` memory (the CPU backend) or the target's: out, lse, caches.
        auto once = [&](bool host, void* stream) {
          Buffer bq(size_t(lq.span) * 2, host), bo(size_t(lq.span) * 2, host),
              bl(size_t(ll.span) * 4 + 4, host), bkc(size_t(lc.span) * 2, host),
              bvc(size_t(lc.span) * 2, host), bkn(size_t(ln.span) * 2 + 2, host),
              bvn(size_t(ln.span) * 2 + 2, host), bcos(size_t(lr.span) * 2, host),
              bsin(size_t(lr.span) * 2, host);
          bq.upload(place(q, lq, dt));
          bkc.upload(place(kc, lc, dt));
          bvc.upload(place(vc, lc, dt));
          bkn.upload(place(kn, ln, dt));
          bvn.upload(place(vn, ln, dt));
          bcos.upload(place(cos, lr, dt));
          bsin.upload(place(sin, lr, dt));
          bo.poison();
          bl.poison();
          flashdl::Options o;
          o.causal = c.causal;
          o.stream = stream;
          std::vector<int32_t> lens = c.lens, idx = c.idx, pad = c.pad, tab = table;
          flashdl::KvCacheExtras x;
          x.rotary_cos = view_of(bcos, dt, lr, 2);
          x.rotary_sin = view_of(bsin, dt, lr, 2);
          x.rotary_interleaved = c.interleaved;
          if (!idx.empty()) x.cache_batch_idx = flashdl::make_view(idx.data(), DType::int32, {c.b});
          if (!pad.empty()) x.cache_leftpad = flashdl::make_view(pad.data(), DType::int32, {c.b});
          const flashdl::TensorView none{};
          const bool append = c.seqlen_new > 0;
          flashdl::forward_kvcache(
              view_of(bq, dt, lq, 4), view_of(bkc, dt, lc, 4), view_of(bvc, dt, lc, 4),
              flashdl::make_view(lens.data(), DType::int32, {c.b}),
              append ? view_of(bkn, dt, ln, 4) : none, append ? view_of(bvn, dt, ln, 4) : none,
              c.page ? flashdl::make_view(tab.data(), DType::int32, {c.b, per}) : none,
              view_of(bo, dt, lq, 4), view_of(bl, DType::float32, ll, 3), o, x);
          if (!host) t.sync();
          bool gaps = true;
          return std::make_tuple(gather(bo.download<uint16_t>(), lq, dt, gaps),
                                 bl.download<uint32_t>(), bkc.download<uint16_t>(),
                                 bvc.download<uint16_t>());
        };
        const auto [out_d, lse_d, kc_d, vc_d] = once(t.host, t.stream);
        const auto [out_h, lse_h, kc_h, vc_h] = once(true, nullptr);
        const double err = max_abs_diff(out_d, out_h);
        const double tol = dt == DType::float16 ? 4e-3 : 3e-2;
        double lse_err = 0;
        for (int64_t i = 0; i < ll.span; ++i)
          lse_err = std::max(lse_err, std::fabs(double(bits_to_float(lse_d[size_t(i)])) -
                                                bits_to_float(lse_h[size_t(i)])));
        const bool caches = kc_d == kc_h && vc_d == vc_h;
        const bool ok = err <= tol && lse_err <= 1e-3 && caches;
        std::printf("%s %s | out err %.2e tol %.2e lse err %.2e%s\n", ok ? "ok  " : "FAIL",
                    label.c_str(), err, tol, lse_err, caches ? "" : " [caches differ]");
        return ok;
      });
    }
  }
  return failures;
}

// A bias and a boolean mask over the cache's positions (key j of sequence b at column j +
// cache_leftpad[b]), with an append, split or not, paged or not, with sinks: the device call
// against the same call on the CPU backend (whose float64-oracle tests are in
// tests/python/test_bias_mask_sinks.py), out within the dtype's rounding, lse within 1e-3, the
// caches bitwise. Then NaN and Inf planted in K and V at keys the mask hides from every row (and
// NaN in the bias there and past each sequence's keys): the device's out and lse must be those of
// the clean call, bit for bit.
struct ExtrasCase {
  int64_t b, sq, h, hk, d, cap, page, splits;
  bool full_bias, sinks, causal;
  std::vector<int32_t> lens, pad;
};

int run_extras(const Target& t, const Cli& cli) {
  const std::vector<ExtrasCase> cs = {
      {2, 1, 8, 2, 128, 150, 0, 1, true, false, true, {100, 37}, {5, 0}},
      {2, 3, 8, 2, 64, 150, 0, 3, false, true, true, {100, 37}, {}},
      {2, 2, 4, 4, 128, 160, 16, 2, true, true, false, {120, 9}, {}},
      {1, 1, 4, 1, 256, 320, 32, 0, false, false, true, {290}, {}},
  };
  int failures = 0;
  for (size_t ci = 0; ci < cs.size(); ++ci) {
    const ExtrasCase& c = cs[ci];
    for (const DType dt : kDtypes) {
      if (cli.quick && (ci > 1 || dt != DType::float16)) continue;
      char buf[200];
      std::snprintf(buf, sizeof buf, "kvcache bias+mask %s case %zu d=%lld %s%s splits=%lld%s%s",
                    flashdl::dtype_name(dt), ci, (long long)c.d, c.page ? "paged " : "",
                    c.full_bias ? "full bias" : "bias (1, h, 1, cap) stride 0", (long long)c.splits,
                    c.sinks ? " sinks" : "", c.pad.empty() ? "" : " leftpad");
      const std::string label = buf;
      if (!cli.selected(label)) continue;
      failures += run_case(label, [&] {
        std::mt19937 rng(uint32_t(131 * ci + 7));
        const int64_t per = c.page ? CacheLayout::detail_ceil(c.cap, c.page) : 0;
        const int64_t npages = c.page ? c.b * per : 0, seqlen_new = 2;
        const Layout lq = make_layout(c.b, c.sq, c.h, c.d, Kind::contiguous);
        const Layout ln = make_layout(c.b, seqlen_new, c.hk, c.d, Kind::contiguous);
        const Layout lc = c.page ? make_layout(npages, c.page, c.hk, c.d, Kind::contiguous)
                                 : make_layout(c.b, c.cap, c.hk, c.d, Kind::contiguous);
        const Layout ll = lse_layout(c.b, c.h, c.sq, false);
        const auto q = random_values(lq.span, rng), kn = random_values(ln.span, rng),
                   vn = random_values(ln.span, rng);
        auto kc = random_values(lc.span, rng), vc = random_values(lc.span, rng);
        // bias (b, h, sq, cap) float32, or one row (1, h, 1, cap) broadcast by strides of 0
        const int64_t nb = c.full_bias ? c.b * c.h * c.sq * c.cap : c.h * c.cap;
        std::vector<float> bias = random_values(nb, rng);
        std::vector<uint8_t> mask(size_t(c.b * c.sq * c.cap));
        std::uniform_int_distribution<int> coin(0, 9);
        for (auto& m : mask) m = coin(rng) < 8;
        // Keys every row of a sequence is blind to: hidden by the mask, poisoned below.
        std::vector<int64_t> hidden_keys = {2, 17, 18, 33, 60};
        for (int64_t bb = 0; bb < c.b; ++bb)  // (columns are cache positions: j + leftpad)
          for (const int64_t j : hidden_keys)
            for (int64_t i = 0; i < c.sq; ++i)
              mask[size_t((bb * c.sq + i) * c.cap + j + (c.pad.empty() ? 0 : c.pad[size_t(bb)]))] =
                  0;
        std::vector<float> sinks = random_values(c.h, rng);
        std::vector<int32_t> table;
        for (int64_t i = 0; i < c.b * per; ++i) table.push_back(int32_t((i * 7 + 3) % npages));
        // Where key j of sequence bb lives in the cache (its row in the layout's logical array).
        auto slot = [&](int64_t bb, int64_t j, int64_t hk, int64_t e) {
          const int64_t pos = j + (c.pad.empty() ? 0 : c.pad[size_t(bb)]);
          if (!c.page) return lc.offset(bb, pos, hk, e);
          return lc.offset(table[size_t(bb * per + pos / c.page)], pos % c.page, hk, e);
        };
        auto once = [&](bool host, void* stream, bool poisoned) {
          std::vector<float> kp = kc, vp = vc, bp = bias;
          if (poisoned) {
            for (int64_t bb = 0; bb < c.b; ++bb)
              for (size_t n = 0; n < hidden_keys.size(); ++n)
                for (int64_t hk = 0; hk < c.hk; ++hk) {
                  kp[size_t(slot(bb, hidden_keys[n], hk, n % c.d))] = n % 2 ? INFINITY : NAN;
                  vp[size_t(slot(bb, hidden_keys[n], hk, 1))] = NAN;
                  vp[size_t(slot(bb, hidden_keys[n], hk, 2))] = -INFINITY;
                }
            if (c.full_bias)  // NaN bias at the hidden keys and past every sequence's keys
              for (int64_t x = 0; x < c.b * c.h * c.sq; ++x)
                for (int64_t j = 0; j < c.cap; ++j) {
                  const int64_t bb = x / (c.h * c.sq);
                  const int64_t pos0 = c.pad.empty() ? 0 : c.pad[size_t(bb)];
                  const bool past = j >= pos0 + c.lens[size_t(bb)] + seqlen_new;
                  const bool hid = std::find(hidden_keys.begin(), hidden_keys.end(), j - pos0) !=
                                   hidden_keys.end();
                  if (past || hid) bp[size_t(x * c.cap + j)] = NAN;
                }
          }
          Buffer bq(size_t(lq.span) * 2, host), bo(size_t(lq.span) * 2, host),
              bl(size_t(ll.span) * 4, host), bkc(size_t(lc.span) * 2, host),
              bvc(size_t(lc.span) * 2, host), bkn(size_t(ln.span) * 2, host),
              bvn(size_t(ln.span) * 2, host), bb_(bp.size() * 4, host), bm(mask.size(), host),
              bs(sinks.size() * 4, host);
          bq.upload(place(q, lq, dt));
          bkc.upload(place(kp, lc, dt));
          bvc.upload(place(vp, lc, dt));
          bkn.upload(place(kn, ln, dt));
          bvn.upload(place(vn, ln, dt));
          bb_.upload(bp);
          bm.upload(mask);
          bs.upload(sinks);
          bo.poison();
          bl.poison();
          flashdl::Options o;
          o.causal = c.causal;
          o.stream = stream;
          o.num_splits = c.splits;
          const auto dev = bb_.device();
          o.bias = c.full_bias
                       ? flashdl::TensorView{bb_.ptr,
                                             DType::float32,
                                             dev,
                                             4,
                                             {c.b, c.h, c.sq, c.cap},
                                             {c.h * c.sq * c.cap, c.sq * c.cap, c.cap, 1}}
                       : flashdl::TensorView{bb_.ptr, DType::float32,          dev,
                                             4,       {c.b, c.h, c.sq, c.cap}, {0, c.cap, 0, 1}};
          o.mask = flashdl::TensorView{bm.ptr, DType::boolean,        dev,
                                       4,      {c.b, 1, c.sq, c.cap}, {c.sq * c.cap, 0, c.cap, 1}};
          if (c.sinks) o.sinks = flashdl::TensorView{bs.ptr, DType::float32, dev, 1, {c.h}, {1}};
          std::vector<int32_t> lens = c.lens, pad = c.pad, tab = table;
          flashdl::KvCacheExtras x;
          if (!pad.empty()) x.cache_leftpad = flashdl::make_view(pad.data(), DType::int32, {c.b});
          const flashdl::TensorView none{};
          flashdl::forward_kvcache(
              view_of(bq, dt, lq, 4), view_of(bkc, dt, lc, 4), view_of(bvc, dt, lc, 4),
              flashdl::make_view(lens.data(), DType::int32, {c.b}), view_of(bkn, dt, ln, 4),
              view_of(bvn, dt, ln, 4),
              c.page ? flashdl::make_view(tab.data(), DType::int32, {c.b, per}) : none,
              view_of(bo, dt, lq, 4), view_of(bl, DType::float32, ll, 3), o, x);
          if (!host) t.sync();
          bool gaps = true;
          return std::make_tuple(gather(bo.download<uint16_t>(), lq, dt, gaps),
                                 bl.download<uint32_t>(), bkc.download<uint16_t>(),
                                 bvc.download<uint16_t>());
        };
        const auto [out_d, lse_d, kc_d, vc_d] = once(t.host, t.stream, false);
        const auto [out_h, lse_h, kc_h, vc_h] = once(true, nullptr, false);
        const auto [out_p, lse_p, kc_p, vc_p] = once(t.host, t.stream, true);
        (void)kc_p;
        (void)vc_p;
        const double err = max_abs_diff(out_d, out_h);
        const double tol = dt == DType::float16 ? 4e-3 : 3e-2;
        double lse_err = 0;
        for (int64_t i = 0; i < ll.span; ++i)
          lse_err = std::max(lse_err, std::fabs(double(bits_to_float(lse_d[size_t(i)])) -
                                                bits_to_float(lse_h[size_t(i)])));
        const bool caches = kc_d == kc_h && vc_d == vc_h;
        // The poisoned call's warps whose values hold a NaN or Inf take the scalar P V over the
        // keys each row sees (decode.cuh, accumulate_pv_seen): the same terms as the tensor-core
        // product, summed in another order (on an H100 the two differ in the last bit of out; the
        // emulator's products sum in the scalar order). So: lse bitwise, out within one rounding
        // of the dtype and finite.
        const double poison_err = max_abs_diff(out_p, out_d);
        const double one_rounding = (dt == DType::float16 ? 0x1p-10 : 0x1p-7) *
                                    std::max(1.0, max_abs(out_d));
        const bool clean = poison_err <= one_rounding && lse_p == lse_d;
        const bool ok = err <= tol && lse_err <= 1e-3 && caches && clean;
        std::printf("%s %s | out err %.2e tol %.2e lse err %.2e%s%s\n", ok ? "ok  " : "FAIL",
                    label.c_str(), err, tol, lse_err, caches ? "" : " [caches differ]",
                    clean ? "" : " [NaN/Inf at hidden keys reached a row, or changed it]");
        return ok;
      });
    }
  }
  return failures;
}

// flashdl::copy_to_host, which the XLA FFI handlers use to read the traced dropout seed and the
// KV cache's tables under jax.jit on CUDA: the bytes of a device (or, --cpu, host) array land in
// host memory once the work queued on the stream before has run; an empty array copies nothing;
// a non-contiguous view is refused, naming it.
int run_copy_to_host(const Target& t, const Cli& cli) {
  const std::string label = "copy_to_host int32 (2, 3), empty, strided";
  if (!cli.selected(label)) return 0;
  return run_case(label, [&] {
    const std::vector<int32_t> h = {7, -1, 1 << 30, 42, 0, 5};
    Buffer buf(h.size() * sizeof(int32_t), t.host);
    buf.upload(h);
    const flashdl::TensorView v = flashdl::make_view(buf.ptr, DType::int32, {2, 3}, buf.device());
    std::vector<int32_t> got(h.size(), 0);
    flashdl::copy_to_host(got.data(), v, t.stream, "table");
    bool ok = got == h;
    flashdl::copy_to_host(nullptr, flashdl::make_view(nullptr, DType::int32, {0}, buf.device()),
                          t.stream, "table");
    flashdl::TensorView strided = flashdl::make_view(buf.ptr, DType::int32, {3}, buf.device());
    strided.strides[0] = 2;
    bool refused = false;
    try {
      flashdl::copy_to_host(got.data(), strided, t.stream, "table");
    } catch (const flashdl::Error& e) {
      refused = std::string(e.what()).rfind("table: expected a contiguous array", 0) == 0;
    }
    std::printf("%s %s | bytes %s, strided %s\n", ok && refused ? "ok  " : "FAIL", label.c_str(),
                ok ? "equal" : "DIFFER", refused ? "refused" : "NOT refused by name");
    return ok && refused;
  });
}

}  // namespace

int main(int argc, char** argv) {
  return test_main(argc, argv, [&](const Target& t, const Cli& cli) {
    int failures = 0;
    failures += run_kvcache(t, cli);
    failures += run_nonfinite(t, cli);
    failures += run_serving(t, cli);
    failures += run_extras(t, cli);
    failures += run_copy_to_host(t, cli);
    if (cli.repeats()) failures += run_race(t, cli);
    failures += merge::run_merge_states(t, cli);
    return failures;
  });
}
