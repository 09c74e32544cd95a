// The host half of the KV-cache test (test_cuda_kvcache.cpp): a case, its values, the cache in
// the layout the library sees (contiguous, or paged with shuffled pages and spare ones; every
// slot that holds no key is NaN, so a kernel that read one would spread it), the cache expected
// after the append, and the float64 oracle and the naive low-precision result of every sequence
// over the keys it holds after the append. Self-contained on purpose: no kernel code.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_harness.hpp"
#include "flashdl/api.hpp"
#include "score_mod_cases.hpp"

namespace cuda_test {

struct KvCase {
  int64_t b, sq, h, hk;
  int64_t capacity;           // keys a sequence can hold (paged: rounded up to whole pages)
  int64_t seqlen_new;         // keys appended by the call (0: none)
  std::vector<int32_t> lens;  // cache_seqlens: keys before the append, per sequence
  int64_t page_size;          // 0: contiguous cache
  bool causal;
  int64_t left, right;  // window as passed; causal adds right = 0
  Kind kind;            // layout of q, out, the caches and the new keys
  ModSpec mods;
  std::vector<int64_t> splits;    // the num_splits values each run takes (0: chosen)
  std::vector<float> sinks = {};  // attention sinks, one per query head (empty: none)

  int64_t used(int64_t bi) const { return lens[size_t(bi)] + seqlen_new; }
  bool paged() const { return page_size > 0; }
};

// The logical values: q (b, sq, h, d); the cache (b, capacity, hk, d), meaningful below lens[b];
// the new keys and values (b, seqlen_new, hk, d). Multiples of 1/64: exact in both dtypes.
struct KvValues {
  std::vector<float> q, k, v, k_new, v_new;
  KvValues(const KvCase& c, int64_t d, std::mt19937& rng)
      : q(random_values(c.b * c.sq * c.h * d, rng)),
        k(random_values(c.b * c.capacity * c.hk * d, rng)),
        v(random_values(c.b * c.capacity * c.hk * d, rng)),
        k_new(random_values(c.b * c.seqlen_new * c.hk * d, rng)),
        v_new(random_values(c.b * c.seqlen_new * c.hk * d, rng)) {}

  // Sequence bi's keys (or values) after the append: (used, hk, d).
  std::vector<float> keys(const KvCase& c, int64_t d, int64_t bi, bool values) const {
    const std::vector<float>& old = values ? v : k;
    const std::vector<float>& fresh = values ? v_new : k_new;
    const int64_t row = c.hk * d, len = c.lens[size_t(bi)];
    std::vector<float> r(size_t(c.used(bi) * row));
    std::copy_n(old.begin() + bi * c.capacity * row, len * row, r.begin());
    std::copy_n(fresh.begin() + bi * c.seqlen_new * row, c.seqlen_new * row, r.begin() + len * row);
    return r;
  }
};

// Where the cache lives: a (batch, capacity) or (num_pages, page_size) layout, and for a paged
// cache the block table: each sequence's pages drawn from a shuffled pool with two spare pages,
// the entries past a sequence's last used page set to -7 (never read).
struct CacheLayout {
  Layout L;
  int64_t max_pages = 0;
  std::vector<int32_t> table;  // (b, max_pages)

  CacheLayout(const KvCase& c, int64_t d, std::mt19937& rng) {
    if (!c.paged()) {
      L = make_layout(c.b, c.capacity, c.hk, d, c.kind);
      return;
    }
    max_pages = detail_ceil(c.capacity, c.page_size);
    const int64_t pages = c.b * max_pages + 2;
    std::vector<int32_t> pool(static_cast<size_t>(pages));
    std::iota(pool.begin(), pool.end(), 0);
    std::shuffle(pool.begin(), pool.end(), rng);
    table.assign(size_t(c.b * max_pages), -7);
    size_t next = 0;
    for (int64_t bi = 0; bi < c.b; ++bi)
      for (int64_t p = 0; p * c.page_size < c.used(bi); ++p)
        table[size_t(bi * max_pages + p)] = pool[next++];
    L = make_layout(pages, c.page_size, c.hk, d, c.kind);
  }

  static int64_t detail_ceil(int64_t a, int64_t b) { return (a + b - 1) / b; }

  // Element offset of key j of sequence bi, kv head hk, column e.
  int64_t offset(const KvCase& c, int64_t bi, int64_t j, int64_t hk, int64_t e) const {
    if (!c.paged()) return L.offset(bi, j, hk, e);
    const int64_t page = table[size_t(bi * max_pages + j / c.page_size)];
    return L.offset(page, j % c.page_size, hk, e);
  }

  // The cache buffer holding `values` below lens[b] (before: rows from the old cache only) or
  // below used(b) (after: the new rows appended); NaN everywhere else.
  std::vector<uint16_t> place(const KvCase& c, int64_t d, const KvValues& x, bool values,
                              bool after, flashdl::DType dt) const {
    std::vector<uint16_t> buf(size_t(L.span), 0xffff);
    const std::vector<float>& old = values ? x.v : x.k;
    const std::vector<float>& fresh = values ? x.v_new : x.k_new;
    for (int64_t bi = 0; bi < c.b; ++bi)
      for (int64_t j = 0; j < (after ? c.used(bi) : c.lens[size_t(bi)]); ++j)
        for (int64_t hk = 0; hk < c.hk; ++hk)
          for (int64_t e = 0; e < d; ++e) {
            const int64_t len = c.lens[size_t(bi)];
            const float val =
                j < len ? old[size_t(((bi * c.capacity + j) * c.hk + hk) * d + e)]
                        : fresh[size_t(((bi * c.seqlen_new + j - len) * c.hk + hk) * d + e)];
            buf[size_t(offset(c, bi, j, hk, e))] = to_bits(val, dt);
          }
    return buf;
  }
};

// The slopes of sequence bi, (nheads,), as test_slope gives them (empty: no ALiBi).
inline std::vector<float> sequence_slopes(const ModSpec& m, int64_t bi, int64_t nheads) {
  std::vector<float> s;
  if (m.alibi == Alibi::none) return s;
  for (int64_t h = 0; h < nheads; ++h) s.push_back(test_slope(m.alibi, bi, h));
  return s;
}

struct KvOracle {
  std::vector<double> out, lowp;  // logical (b, sq, h, d)
  std::vector<float> lse;         // logical (b, h, sq)
};

// Per sequence: the float64 reference (schedule "reference" on the CPU) and the naive algorithm
// in the input precision over its keys after the append, with the case's mask and modifiers.
// With sinks: the reference takes them, and each naive row is scaled by the share the keys keep,
// exp(lse without the sink - lse with it), as the sink weighs the row down in exact arithmetic.
inline KvOracle kv_oracle(const KvCase& c, int64_t d, const KvValues& x, flashdl::DType dt) {
  KvOracle r{std::vector<double>(size_t(c.b * c.sq * c.h * d)),
             std::vector<double>(size_t(c.b * c.sq * c.h * d)),
             std::vector<float>(size_t(c.b * c.h * c.sq))};
  const int64_t qrow = c.sq * c.h * d;
  for (int64_t bi = 0; bi < c.b; ++bi) {
    const int64_t n = c.used(bi);
    const std::vector<float> kb = x.keys(c, d, bi, false), vb = x.keys(c, d, bi, true);
    const std::vector<float> qb(x.q.begin() + bi * qrow, x.q.begin() + (bi + 1) * qrow);
    std::vector<double> q64(qb.begin(), qb.end()), k64(kb.begin(), kb.end()),
        v64(vb.begin(), vb.end()), o64(static_cast<size_t>(qrow));
    std::vector<float> slopes = sequence_slopes(c.mods, bi, c.h), l(size_t(c.h * c.sq));
    flashdl::Options o;
    o.causal = c.causal;
    o.window_left = c.left;
    o.window_right = c.right;
    o.softcap = c.mods.softcap;
    o.schedule = flashdl::Schedule::reference;
    if (!slopes.empty())
      o.alibi_slopes = flashdl::make_view(slopes.data(), flashdl::DType::float32, {c.h});
    flashdl::forward(flashdl::make_view(q64.data(), flashdl::DType::float64, {1, c.sq, c.h, d}),
                     flashdl::make_view(k64.data(), flashdl::DType::float64, {1, n, c.hk, d}),
                     flashdl::make_view(v64.data(), flashdl::DType::float64, {1, n, c.hk, d}),
                     flashdl::make_view(o64.data(), flashdl::DType::float64, {1, c.sq, c.h, d}),
                     flashdl::make_view(l.data(), flashdl::DType::float32, {1, c.h, c.sq}), o);
    std::vector<float> plain_lse = l;
    if (!c.sinks.empty()) {
      o.sinks = flashdl::make_view(const_cast<float*>(c.sinks.data()), flashdl::DType::float32,
                                   {c.h});
      flashdl::forward(flashdl::make_view(q64.data(), flashdl::DType::float64, {1, c.sq, c.h, d}),
                       flashdl::make_view(k64.data(), flashdl::DType::float64, {1, n, c.hk, d}),
                       flashdl::make_view(v64.data(), flashdl::DType::float64, {1, n, c.hk, d}),
                       flashdl::make_view(o64.data(), flashdl::DType::float64, {1, c.sq, c.h, d}),
                       flashdl::make_view(l.data(), flashdl::DType::float32, {1, c.h, c.sq}), o);
    }
    std::copy(o64.begin(), o64.end(), r.out.begin() + bi * qrow);
    std::copy(l.begin(), l.end(), r.lse.begin() + bi * c.h * c.sq);

    ScoreMods mods;
    mods.softcap = float(c.mods.softcap);
    mods.nheads = c.h;
    mods.slopes = slopes;
    std::vector<double> lowp;
    naive_lowp(Shape{1, c.sq, n, c.h, c.hk, d, c.left, c.causal ? 0 : c.right}, qb, kb, vb, dt,
               lowp, &mods);
    if (!c.sinks.empty())  // lowp (sq, h, d); lse (h, sq)
      for (int64_t i = 0; i < c.sq; ++i)
        for (int64_t h = 0; h < c.h; ++h) {
          const size_t at = size_t(h * c.sq + i);
          const double keep = std::isinf(plain_lse[at])
                                  ? 0.0
                                  : std::exp(double(plain_lse[at]) - double(l[at]));
          for (int64_t e = 0; e < d; ++e) lowp[size_t((i * c.h + h) * d + e)] *= keep;
        }
    std::copy(lowp.begin(), lowp.end(), r.lowp.begin() + bi * qrow);
  }
  return r;
}

}  // namespace cuda_test
