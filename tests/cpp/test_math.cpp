// The math shared by every backend (include/flashdl/detail): the mask predicate and its block
// ranges against brute force, the online softmax and its merge against a direct float64 softmax,
// the FA-1 tile sizes, the axis tiling and block-mask planes of block-sparse attention, the score
// modifiers (softcap, ALiBi) against double math, and Philox4x32-10 against Random123's published
// known answers.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "arrays.hpp"
#include "check.hpp"
#include "flashdl/detail/block_mask.hpp"
#include "flashdl/detail/dropout.hpp"
#include "flashdl/detail/mask.hpp"
#include "flashdl/detail/philox.hpp"
#include "flashdl/detail/score_mod.hpp"
#include "flashdl/detail/softmax.hpp"
#include "flashdl/detail/tiles.hpp"

using namespace flashdl_test;
namespace fd = flashdl::detail;

namespace {

// DESIGN.md, written out: visible iff i + sk - sq - left <= j <= i + sk - sq + right, 0 <= j < sk.
bool brute_visible(int64_t sq, int64_t sk, int64_t left, int64_t right, int64_t i, int64_t j) {
  const int64_t c = i + sk - sq;
  return j >= 0 && j < sk && (left < 0 || j >= c - left) && (right < 0 || j <= c + right);
}

void check_mask(int64_t sq, int64_t sk, int64_t left, int64_t right) {
  context() = "sq " + std::to_string(sq) + " sk " + std::to_string(sk) + " window (" +
              std::to_string(left) + ", " + std::to_string(right) + ")";
  const fd::Mask m = fd::make_mask(sq, sk, left, right);
  auto vis = [&](int64_t i, int64_t j) { return brute_visible(sq, sk, left, right, i, j); };
  for (int64_t i = 0; i < sq; ++i)
    for (int64_t j = -2; j < sk + 2; ++j)
      if (m.visible(i, j) != vis(i, j))
        CHECK_MSG(false, "visible(" + std::to_string(i) + ", " + std::to_string(j) + ")");
  // Per row: [col_begin, col_end) is exactly the visible keys; both non-decreasing in i.
  for (int64_t i = 0; i < sq; ++i) {
    int64_t first = -1, last = -1;
    for (int64_t j = 0; j < sk; ++j)
      if (vis(i, j)) last = j, first = first < 0 ? j : first;
    const int64_t b = m.col_begin(i), e = m.col_end(i);
    CHECK(b >= 0 && b <= sk && e >= 0 && e <= sk);
    if (first >= 0) {
      CHECK(b == first && e == last + 1);
    } else {
      CHECK(b >= e);
    }
    if (i > 0) CHECK(m.col_begin(i - 1) <= b && m.col_end(i - 1) <= e);
  }
  // Per key: [row_begin, row_end) is exactly the rows that see it.
  for (int64_t j = 0; j < sk; ++j) {
    int64_t first = -1, last = -1;
    for (int64_t i = 0; i < sq; ++i)
      if (vis(i, j)) last = i, first = first < 0 ? i : first;
    const int64_t b = m.row_begin(j), e = m.row_end(j);
    CHECK(b >= 0 && b <= sq && e >= 0 && e <= sq);
    if (first >= 0) {
      CHECK(b == first && e == last + 1);
    } else {
      CHECK(b >= e);
    }
  }
  // Blocks: the block ranges cover every visible pair, and block_fully_visible is exact.
  for (int64_t i0 = 0; i0 < sq; ++i0)
    for (int64_t i1 = i0 + 1; i1 <= sq; ++i1)
      for (int64_t j0 = 0; j0 < sk; ++j0)
        for (int64_t j1 = j0 + 1; j1 <= sk; ++j1) {
          bool all = true, any_outside_cols = false, any_outside_rows = false;
          const int64_t cb = m.block_col_begin(i0), ce = m.block_col_end(i1);
          const int64_t rb = m.row_begin(j0), re = m.row_end(j1 - 1);
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t j = j0; j < j1; ++j) {
              const bool v = vis(i, j);
              all = all && v;
              if (v && (j < cb || j >= ce)) any_outside_cols = true;
              if (v && (i < rb || i >= re)) any_outside_rows = true;
            }
          if (m.block_fully_visible(i0, i1, j0, j1) != all || any_outside_cols || any_outside_rows)
            CHECK_MSG(false, "block rows [" + std::to_string(i0) + ", " + std::to_string(i1) +
                                 ") cols [" + std::to_string(j0) + ", " + std::to_string(j1) + ")");
        }
}

void test_mask() {
  const int64_t sizes[] = {1, 2, 3, 5, 8};
  const int64_t lefts[] = {-1, 0, 1, 2, 5, 20};
  const int64_t rights[] = {-1, 0, 1, 3, 20};
  for (int64_t sq : sizes)
    for (int64_t sk : sizes)
      for (int64_t l : lefts)
        for (int64_t r : rights) check_mask(sq, sk, l, r);
  check_mask(1, 0, -1, -1);
  check_mask(4, 0, -1, 0);
  // Causal is the window (-1, 0), bottom-right aligned: with sq > sk the first rows see nothing.
  const fd::Mask causal = fd::make_mask(5, 3, -1, 0);
  CHECK(!causal.visible(0, 0) && !causal.visible(1, 0) && causal.visible(2, 0));
  CHECK(causal.visible(4, 2) && !causal.visible(3, 2));
}

// ---- online softmax ----------------------------------------------------------------------------

struct Direct {
  double lse;
  std::vector<double> out;
};

// softmax(s) @ v over the finite scores, in float64.
Direct direct_softmax(const std::vector<double>& s, const std::vector<double>& v, int64_t d) {
  double m = -INFINITY;
  for (double x : s) m = std::fmax(m, x);
  Direct r{-INFINITY, std::vector<double>(static_cast<size_t>(d), 0.0)};
  if (m == -INFINITY) return r;
  double l = 0;
  for (double x : s) l += std::exp(x - m);
  for (size_t j = 0; j < s.size(); ++j)
    for (int64_t c = 0; c < d; ++c) r.out[c] += std::exp(s[j] - m) / l * v[j * d + c];
  r.lse = m + std::log(l);
  return r;
}

// Feeds the scores (natural domain) block by block through OnlineSoftmax<T> as the kernels do.
template <typename T>
Direct online(const std::vector<double>& s, const std::vector<double>& v, int64_t d,
              const std::vector<int64_t>& block_sizes) {
  fd::OnlineSoftmax<T> sm;
  std::vector<T> acc(static_cast<size_t>(d), T(0));
  size_t j0 = 0;
  for (int64_t bs : block_sizes) {
    const size_t j1 = std::min(s.size(), j0 + static_cast<size_t>(bs));
    T bmax = -INFINITY;
    for (size_t j = j0; j < j1; ++j) bmax = std::fmax(bmax, static_cast<T>(s[j] * fd::kLog2e));
    const T alpha = sm.rescale_factor(bmax);
    for (T& a : acc) a *= alpha;
    T bsum = 0;
    for (size_t j = j0; j < j1; ++j) {
      const T e = std::exp2(static_cast<T>(s[j] * fd::kLog2e) - sm.reference());
      bsum += e;
      for (int64_t c = 0; c < d; ++c) acc[c] += e * static_cast<T>(v[j * d + c]);
    }
    sm.accumulate(alpha, bsum);
    j0 = j1;
  }
  Direct r{static_cast<double>(sm.lse()), std::vector<double>(static_cast<size_t>(d))};
  for (int64_t c = 0; c < d; ++c) r.out[c] = static_cast<double>(acc[c] * sm.inv_l());
  return r;
}

void test_online_softmax() {
  Rng rng(5);
  const int64_t d = 3;
  const double inf = INFINITY;
  struct Row {
    const char* name;
    std::vector<double> s;
    std::vector<int64_t> blocks;
  };
  std::vector<Row> rows;
  std::vector<double> random(37);
  for (double& x : random) x = rng.symmetric(4.0);
  rows.push_back({"random, blocks 5", random, std::vector<int64_t>(8, 5)});
  rows.push_back({"random, one block", random, {37}});
  rows.push_back({"random, blocks 1..", random, {1, 2, 3, 4, 5, 6, 7, 9}});
  std::vector<double> masked_first = random, masked_mid = random, masked_last = random;
  for (int j = 0; j < 10; ++j) masked_first[j] = -inf;
  for (int j = 10; j < 20; ++j) masked_mid[j] = -inf;
  for (int j = 27; j < 37; ++j) masked_last[j] = -inf;
  rows.push_back({"first blocks all -inf", masked_first, {5, 5, 27}});
  rows.push_back({"middle block all -inf", masked_mid, {10, 10, 17}});
  rows.push_back({"last block all -inf", masked_last, {27, 5, 5}});
  std::vector<double> large = random;
  for (double& x : large) x = 800.0 + x * 50.0;  // exp overflows without the running max
  rows.push_back({"large scores", large, {7, 30}});
  rows.push_back({"single key", {1.5}, {1}});
  for (const Row& row : rows) {
    context() = row.name;
    std::vector<double> v(row.s.size() * d);
    for (double& x : v) x = rng.symmetric(1.0);
    const Direct ref = direct_softmax(row.s, v, d);
    const Direct o64 = online<double>(row.s, v, d, row.blocks);
    const Direct o32 = online<float>(row.s, v, d, row.blocks);
    CHECK_NEAR(o64.lse, ref.lse, 1e-12 * std::fabs(ref.lse));
    CHECK_NEAR(o32.lse, ref.lse, 4e-6 * std::fmax(1.0, std::fabs(ref.lse)));
    for (int64_t c = 0; c < d; ++c) {
      CHECK_NEAR(o64.out[c], ref.out[c], 1e-13);
      CHECK_NEAR(o32.out[c], ref.out[c], 1e-5);
    }
  }
  // A row that sees no key: lse -inf, inv_l 0, nothing NaN.
  context() = "all masked";
  const std::vector<double> none(9, -inf), v(27, 1.0);
  for (const Direct& r : {online<double>(none, v, d, {4, 5}), online<float>(none, v, d, {9})}) {
    CHECK(r.lse == -inf);
    for (double x : r.out) CHECK(x == 0.0);
  }
  fd::OnlineSoftmax<float> empty;
  CHECK(empty.inv_l() == 0.0f && empty.lse() == -INFINITY);
  CHECK(fd::softmax_reference_point(-INFINITY) == 0.0);
  CHECK(fd::softmax_reference_point(2.5) == 2.5);
  const float alpha = empty.rescale_factor(-INFINITY);
  CHECK(!std::isnan(alpha) && !std::isnan(empty.reference()));
}

// finalize_with_sink against the direct float64 softmax over the row's scores plus the sink:
// the output weight of the accumulator and the lse, for rows the sink dominates, rows that
// dominate it, and a row that saw no key (out 0, lse = sink).
void test_finalize_with_sink() {
  using flashdl::detail::finalize_with_sink;
  using flashdl::detail::OnlineSoftmax;
  const double ln2 = 0.69314718055994530942;
  for (double sink : {-30.0, -1.0, 0.0, 2.5, 40.0}) {
    for (int n : {0, 1, 5}) {
      std::vector<double> t;  // exp2-domain scores
      for (int j = 0; j < n; ++j) t.push_back(0.7 * j - 1.3);
      OnlineSoftmax<float> sm;
      const float m = n ? static_cast<float>(*std::max_element(t.begin(), t.end())) : -INFINITY;
      sm.rescale_factor(m);
      float l = 0;
      for (double x : t) l += std::exp2(static_cast<float>(x) - sm.reference());
      sm.accumulate(1.0f, l);
      const float sink2 = static_cast<float>(sink / ln2);
      const auto f = finalize_with_sink(sm.m, sm.l, sink2);
      double denom = std::exp2(static_cast<double>(sink2));
      for (double x : t) denom += std::exp2(x);
      const double ref = n ? std::exp2(static_cast<double>(m))
                           : 0.0;  // the accumulator's reference
      const double lse = std::log2(denom) * ln2;
      context() = "sink " + std::to_string(sink) + ", keys " + std::to_string(n);
      CHECK(std::isfinite(f.o_scale) && std::isfinite(f.lse));
      if (n) CHECK(std::fabs(f.o_scale - ref / denom) <= 1e-6 * (ref / denom));
      CHECK(std::fabs(f.lse - lse) <= 1e-5 * std::max(1.0, std::fabs(lse)));
      if (!n) CHECK(std::fabs(f.lse - sink) <= 1e-5 * std::max(1.0, std::fabs(sink)));
    }
  }
}

void test_merge() {
  Rng rng(9);
  const int64_t d = 4;
  for (int trial = 0; trial < 6; ++trial) {
    context() = "merge trial " + std::to_string(trial);
    std::vector<double> s(20), v(20 * d);
    for (double& x : s) x = rng.symmetric(3.0) + (trial == 3 ? 700.0 : 0.0);
    for (double& x : v) x = rng.symmetric(1.0);
    if (trial == 4) std::fill(s.begin(), s.begin() + 8, -INFINITY);  // part a fully masked
    if (trial == 5) std::fill(s.begin() + 8, s.end(), -INFINITY);    // part b fully masked
    const std::vector<double> sa(s.begin(), s.begin() + 8), sb(s.begin() + 8, s.end());
    const std::vector<double> va(v.begin(), v.begin() + 8 * d), vb(v.begin() + 8 * d, v.end());
    const Direct a = direct_softmax(sa, va, d), b = direct_softmax(sb, vb, d);
    const Direct all = direct_softmax(s, v, d);
    const fd::MergeWeights<double> w = fd::merge_weights(a.lse, b.lse);
    CHECK_NEAR(w.lse, all.lse, 1e-12 * std::fabs(all.lse));
    for (int64_t c = 0; c < d; ++c)
      CHECK_NEAR(w.wa * a.out[c] + w.wb * b.out[c], all.out[c], 1e-13);
  }
  context() = "merge of two empty parts";
  // Double only: merge_weights<float> narrows a double in its braced return (a GCC warning, an
  // error under clang), reported rather than compiled here.
  const fd::MergeWeights<double> w = fd::merge_weights<double>(-INFINITY, -INFINITY);
  CHECK(w.wa == 0.0 && w.wb == 0.0 && w.lse == -INFINITY);
  const fd::MergeWeights<double> one = fd::merge_weights<double>(-INFINITY, 1.25);
  CHECK(one.wa == 0.0 && one.wb == 1.0 && one.lse == 1.25);
}

void test_tiles() {
  for (int64_t m : {0, 1, 63, 64, 100, 256, 1000, 1024, 4096, 65536, 131072, 262144})
    for (int64_t d : {1, 3, 16, 64, 100, 128, 256}) {
      context() = "fa1_tiles M " + std::to_string(m) + " d " + std::to_string(d);
      int64_t bc = m / (4 * d) + (m % (4 * d) != 0 ? 1 : 0);  // ceil(M / 4d)
      if (bc < 1) bc = 1;
      const int64_t br = bc < d ? bc : d;
      const fd::Fa1Tiles t = fd::fa1_tiles(m, d);
      CHECK_EQ(t.Bc, bc);
      CHECK_EQ(t.Br, br);
    }
  CHECK_EQ(fd::ceil_div(7, 3), 3);
  CHECK_EQ(fd::ceil_div(6, 3), 2);
  CHECK_EQ(fd::round_up(7, 4), 8);
  CHECK_EQ(fd::round_up(8, 4), 8);
}

// ---- block-sparse tiling ------------------------------------------------------------------------

// make_axis_tiles(n, segment, tile): tiles partition [0, n) in order, none straddles a multiple of
// the segment (the whole axis when segment <= 0), and each is as long as the tile, the segment's
// end and n allow -- so dense axes get the usual [t * tile, (t + 1) * tile).
void check_axis_tiles(int64_t n, int64_t segment, int64_t tile) {
  context() = "axis tiles n " + std::to_string(n) + " segment " + std::to_string(segment) +
              " tile " + std::to_string(tile);
  const fd::AxisTiles a = fd::make_axis_tiles(n, segment, tile);
  const int64_t seg = segment > 0 ? segment : std::max<int64_t>(n, 1);
  const int64_t longest = std::min(tile, seg);
  int64_t end = 0, bad = 0;
  for (int64_t t = 0; t < a.count(); ++t) {
    const int64_t s = a.start(t), z = a.size(t);
    const int64_t greedy = std::min({longest, (s / seg + 1) * seg - s, n - s});
    bad += s != end || z < 1 || z > tile || z != greedy;
    bad += s / seg != (s + z - 1) / seg;  // inside one segment
    if (segment > 0) bad += a.segment_of(t) != s / segment;
    if (segment <= 0) bad += s != t * longest;
    for (int64_t x = s; x < s + z; ++x) bad += a.tile_of(x) != t;
    end = s + z;
  }
  CHECK_MSG(bad == 0, std::to_string(bad) + " tile properties violated");
  CHECK_EQ(end, n);  // the tiles reach n exactly: no gap at the end, none past it
  for (int64_t x = n; x < n + 3; ++x) CHECK_EQ(a.tile_of(x), a.count());
  if (n == 0) CHECK_EQ(a.count(), 0);
}

void test_axis_tiles() {
  const int64_t segments[] = {-1, 0, 1, 2, 3, 5, 7, 8, 16, 33, 128, 1000};
  const int64_t tiles[] = {1, 2, 3, 4, 5, 8, 48, 96, 200};
  for (int64_t n = 0; n <= 40; ++n)
    for (int64_t seg : segments)
      for (int64_t tile : tiles) check_axis_tiles(n, seg, tile);
  for (int64_t n : {97, 128, 129, 1000, 1025})
    for (int64_t seg : segments)
      for (int64_t tile : tiles) check_axis_tiles(n, seg, tile);
}

// block_mask_of picks the plane of (b, h) through the Params strides (0 broadcasts) and BlockMask
// reads flag (i / block_q, j / block_k) of it; a null pointer is the dense mask.
void test_block_mask_planes() {
  context() = "block_mask_of";
  flashdl::Params p{};
  const fd::BlockMask dense = fd::block_mask_of(p, 1, 2);
  CHECK(dense.dense() && dense.block(3, 4) && dense.visible(100, 7));
  // Flags (2 batches, 3 heads, 4 x 5 blocks), rows padded to 7 flags, planes 4 rows apart.
  const int64_t nb = 2, nh = 3, nbq = 4, nbk = 5, row = 7, head = nbq * row, batch = nh * head;
  std::vector<uint8_t> flags(static_cast<size_t>(nb * batch), 0);
  Rng rng(17);
  for (uint8_t& f : flags) f = static_cast<uint8_t>(rng.next() % 2);
  p.block_mask_ptr = flags.data();
  p.block_mask_row_stride = row;
  p.block_q = 3;
  p.block_k = 2;
  auto flag = [&](int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return flags[static_cast<size_t>(b * batch + h * head + qb * row + kb)] != 0;
  };
  // Full planes, then broadcasting over heads (head stride 0) and over batches (batch stride 0).
  const int64_t strides[][2] = {{batch, head}, {batch, 0}, {0, head}, {0, 0}};
  for (const auto& st : strides) {
    p.block_mask_batch_stride = st[0];
    p.block_mask_head_stride = st[1];
    int64_t bad = 0;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < nh; ++h) {
        const fd::BlockMask m = fd::block_mask_of(p, b, h);
        const int64_t pb = st[0] ? b : 0, ph = st[1] ? h : 0;
        bad += m.dense() || m.block_q != 3 || m.block_k != 2;
        for (int64_t i = 0; i < nbq * 3; ++i)
          for (int64_t j = 0; j < nbk * 2; ++j) {
            bad += m.visible(i, j) != flag(pb, ph, i / 3, j / 2);
            bad += m.block(i / 3, j / 2) != flag(pb, ph, i / 3, j / 2);
          }
      }
    CHECK_MSG(bad == 0, "strides (" + std::to_string(st[0]) + ", " + std::to_string(st[1]) +
                            "): " + std::to_string(bad) + " flags misread");
  }
}

// ---- score modifiers ---------------------------------------------------------------------------

// Params with the softmax scale and the modifiers set as make_params sets them.
flashdl::Params mod_params(double scale, double softcap, const float* slopes = nullptr,
                           int64_t batch_stride = 0, int64_t head_stride = 1) {
  flashdl::Params p{};
  p.scale_softmax = scale;
  p.scale_softmax_log2 = scale * fd::kLog2e;
  p.softcap = softcap;
  p.alibi_slopes_ptr = slopes;
  p.alibi_batch_stride = batch_stride;
  p.alibi_head_stride = head_stride;
  return p;
}

// The modified score of a raw product qk in the natural domain, in double from its definition:
// s = scale qk; s = softcap tanh(s / softcap) with a cap; s -= slope |diag - j|.
double modified_score(double qk, double scale, double softcap, double slope, int64_t diag,
                      int64_t j) {
  double s = scale * qk;
  if (softcap > 0) s = softcap * std::tanh(s / softcap);
  return s - slope * std::fabs(static_cast<double>(diag - j));
}

// score() (exp2 domain, so times ln 2) against the definition, in double and float; grad() against
// 1 - tanh^2 and against central differences of score().
template <typename T>
void check_score(double scale, double softcap, double tol) {
  const flashdl::Params p = mod_params(scale, softcap);
  const fd::ScoreMod<T> m = fd::score_mod_of<T>(p, 0, 0);
  CHECK(m.capped() == (softcap > 0));
  CHECK(!m.biased());
  CHECK(m.slope == T(0));
  Rng rng(static_cast<uint64_t>(softcap * 1000 + scale * 7));
  for (int n = 0; n < 200; ++n) {
    const double qk = n < 4 ? std::vector<double>{0.0, 1e-30, -1e3, 1e4}[n] : rng.symmetric(60.0);
    context() = std::string(sizeof(T) == 8 ? "double" : "float") + " scale " + num(scale) +
                " softcap " + num(softcap) + " qk " + num(qk);
    const double want = modified_score(qk, scale, softcap, 0.0, 0, 0);
    const double got = static_cast<double>(m.score(static_cast<T>(qk))) * fd::kLn2;
    CHECK_NEAR(got, want, tol * std::fmax(1.0, std::fabs(want)));
    const double th = softcap > 0 ? std::tanh(scale * qk / softcap) : 0.0;
    const double g = static_cast<double>(m.grad(static_cast<T>(qk)));
    CHECK_NEAR(g, softcap > 0 ? 1.0 - th * th : 1.0, tol);
    CHECK(g >= 0.0 && g <= 1.0);
    if (sizeof(T) == 8 && std::fabs(qk) < 1e3) {  // d s / d (scale qk) by central differences
      const double h = 1e-5 / scale;
      const double ds = (static_cast<double>(m.score(static_cast<T>(qk + h))) -
                         static_cast<double>(m.score(static_cast<T>(qk - h)))) *
                        fd::kLn2 / (2 * h * scale);
      CHECK_NEAR(ds, g, 1e-7);
    }
  }
  if (softcap > 0) {  // saturation: +-cap, derivative 0, nothing NaN
    context() = "saturation, softcap " + num(softcap);
    const double big = 1e6 * softcap / scale;
    CHECK_NEAR(static_cast<double>(m.score(static_cast<T>(big))) * fd::kLn2, softcap,
               tol * softcap);
    CHECK_NEAR(static_cast<double>(m.score(static_cast<T>(-big))) * fd::kLn2, -softcap,
               tol * softcap);
    CHECK(m.grad(static_cast<T>(big)) == T(0) && m.grad(static_cast<T>(-big)) == T(0));
    CHECK(m.score(T(0)) == T(0) && m.grad(T(0)) == T(1));
  }
}

void test_score_mod_values() {
  for (double scale : {0.125, 1.0 / std::sqrt(96.0), 1.0})
    for (double softcap : {0.0, 0.5, 5.0, 50.0}) {
      check_score<double>(scale, softcap, 1e-14);
      check_score<float>(scale, softcap, 2e-6);
    }
  // Without a cap, score() is the plain kernels' scaling, bit for bit: qk * scale * log2(e).
  context() = "uncapped is the plain scaling";
  const flashdl::Params p = mod_params(0.3, 0.0);
  const fd::ScoreMod<float> mf = fd::score_mod_of<float>(p, 0, 0);
  const fd::ScoreMod<double> md = fd::score_mod_of<double>(p, 0, 0);
  CHECK(mf.qk_scale == static_cast<float>(p.scale_softmax_log2));
  CHECK(md.qk_scale == p.scale_softmax_log2);
  for (double qk : {-3.5, 0.0, 1.0, 17.25}) {
    CHECK(mf.score(static_cast<float>(qk)) == static_cast<float>(qk) * mf.qk_scale);
    CHECK(md.score(qk) == qk * md.qk_scale);
  }
  // With a cap: qk_scale is scale / softcap, cap is softcap * log2(e).
  const flashdl::Params pc = mod_params(0.3, 2.5);
  const fd::ScoreMod<double> mc = fd::score_mod_of<double>(pc, 0, 0);
  CHECK(mc.qk_scale == 0.3 / 2.5 && mc.cap == 2.5 * fd::kLog2e);
}

// bias(diag, j) = -slope log2(e) |diag - j|: symmetric about the diagonal, 0 on it, linear in the
// distance, exact in float far out; both modifiers together add up.
void test_score_mod_bias() {
  const float slopes[] = {0.5f, 0.0625f, 1.0f / 3.0f, 2.0f};
  for (float slope : slopes) {
    context() = "bias, slope " + num(slope);
    const flashdl::Params p = mod_params(0.25, 0.0, &slope, 0, 1);
    const fd::ScoreMod<double> md = fd::score_mod_of<double>(p, 0, 0);
    const fd::ScoreMod<float> mf = fd::score_mod_of<float>(p, 0, 0);
    CHECK(md.biased() && mf.biased() && !md.capped());
    CHECK(md.slope == static_cast<double>(slope) * fd::kLog2e);
    CHECK(mf.slope == static_cast<float>(static_cast<double>(slope) * fd::kLog2e));
    int64_t bad = 0;
    for (int64_t diag : {-3, 0, 5, 40})
      for (int64_t t = 0; t < 50; ++t) {
        bad += md.bias(diag, diag + t) != md.bias(diag, diag - t);  // symmetric in |diag - j|
        bad += mf.bias(diag, diag + t) != mf.bias(diag, diag - t);
        bad += md.bias(diag, diag - t) != -md.slope * static_cast<double>(t);
        bad += mf.bias(diag, diag - t) != -mf.slope * static_cast<float>(t);
        bad += std::fabs(md.bias(diag, diag - t) * fd::kLn2 -
                         modified_score(0.0, 1.0, 0.0, slope, diag, diag - t)) >
               1e-14 * (1.0 + static_cast<double>(t));
      }
    CHECK_MSG(bad == 0, std::to_string(bad) + " bias values wrong");
    CHECK(md.bias(7, 7) == 0.0 && mf.bias(7, 7) == 0.0f);
    // Distances up to 2^24 are exact in float: the bias is the slope times the distance.
    const int64_t far = (int64_t{1} << 24) - 1;
    CHECK(mf.bias(far, 0) == -mf.slope * 16777215.0f);
    CHECK(mf.bias(0, far) == mf.bias(far, 0));
    CHECK(md.bias(int64_t{1} << 40, 0) == -md.slope * 1099511627776.0);
  }
  // The two together: the capped score plus the bias, in flash-attn's order (cap before bias).
  context() = "cap and bias";
  const float slope = 0.75f;
  const flashdl::Params p = mod_params(0.2, 3.0, &slope, 0, 1);
  const fd::ScoreMod<double> m = fd::score_mod_of<double>(p, 0, 0);
  for (double qk : {-40.0, -2.0, 0.5, 9.0, 100.0})
    for (int64_t j : {0, 3, 11}) {
      const double got = (m.score(qk) + m.bias(5, j)) * fd::kLn2;
      CHECK_NEAR(got, modified_score(qk, 0.2, 3.0, 0.75, 5, j), 1e-13);
      CHECK_NEAR(m.grad(qk), 1.0 - std::pow(std::tanh(0.2 * qk / 3.0), 2), 1e-15);
    }
}

// score_mod_of picks slope [b * batch_stride + h * head_stride]: (batch, nheads), (nheads,)
// broadcast with batch stride 0, and a padded layout; has_score_mod is the pointer or the cap.
void test_score_mod_of_slopes() {
  const int64_t nb = 3, nh = 4, padded = 6;
  std::vector<float> slopes(static_cast<size_t>(nb * padded * 2));
  Rng rng(23);
  for (float& x : slopes) x = static_cast<float>(rng.uniform());
  struct Layout {
    const char* name;
    int64_t batch_stride, head_stride;
  };
  const Layout layouts[] = {{"(batch, nheads)", nh, 1},
                            {"(nheads,) broadcast", 0, 1},
                            {"rows padded to 6", padded, 1},
                            {"head stride 2", 2 * padded, 2}};
  for (const Layout& l : layouts) {
    context() = std::string("score_mod_of ") + l.name;
    const flashdl::Params p = mod_params(0.125, 0.0, slopes.data(), l.batch_stride, l.head_stride);
    CHECK(fd::has_score_mod(p));
    int64_t bad = 0;
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t h = 0; h < nh; ++h) {
        const float want = slopes[static_cast<size_t>(b * l.batch_stride + h * l.head_stride)];
        bad += fd::score_mod_of<double>(p, b, h).slope != static_cast<double>(want) * fd::kLog2e;
        bad += fd::score_mod_of<float>(p, b, h).slope !=
               static_cast<float>(static_cast<double>(want) * fd::kLog2e);
        if (l.batch_stride == 0)  // every batch reads row 0
          bad += fd::score_mod_of<double>(p, b, h).slope != fd::score_mod_of<double>(p, 0, h).slope;
      }
    CHECK_MSG(bad == 0, std::to_string(bad) + " slopes misread");
  }
  context() = "has_score_mod";
  CHECK(!fd::has_score_mod(mod_params(0.125, 0.0)));
  CHECK(fd::has_score_mod(mod_params(0.125, 1e-3)));
  const float zero = 0.0f;
  const flashdl::Params pz = mod_params(0.125, 0.0, &zero, 0, 1);
  CHECK(fd::has_score_mod(pz));  // zero slopes still select the modified path...
  CHECK(!fd::score_mod_of<float>(pz, 0, 0).biased());  // ...where they add nothing
  CHECK(fd::score_mod_of<float>(pz, 0, 0).bias(9, 2) == 0.0f);
}

// ---- Philox and dropout ------------------------------------------------------------------------

void test_philox_known_answers() {
  // Random123's kat_vectors for philox4x32 with 10 rounds (also used by TensorFlow's tests).
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
       {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u},
       {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const fd::Philox4 r = fd::philox4x32_10(fd::Philox4{{k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]}},
                                            k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) CHECK_EQ(r.x[i], k.out[i]);
  }
}

void test_dropout_draws() {
  const int64_t rows = 200, cols = 500;
  double sum = 0, sum2 = 0;
  bool in_range = true;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const double u = fd::dropout_uniform(1234, 5, 3, i, j);
      in_range = in_range && u >= 0.0 && u < 1.0;
      sum += u, sum2 += u * u;
    }
  const double n = static_cast<double>(rows * cols), mean = sum / n;
  CHECK(in_range);
  CHECK_NEAR(mean, 0.5, 0.005);  // sd of the mean 0.0009
  CHECK_NEAR(sum2 / n - mean * mean, 1.0 / 12, 0.003);
  for (float p : {0.1f, 0.5f, 0.9f}) {
    context() = "kept fraction p " + std::to_string(p);
    int64_t kept = 0, same = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const bool k = fd::dropout_keep(p, 99, 0, 7, i, j);
        kept += k;
        CHECK(k == (fd::dropout_uniform(99, 0, 7, i, j) >= p));
        same += k == fd::dropout_keep(p, 99, 0, 7, i, j);
      }
    CHECK_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.01);
    CHECK_EQ(same, rows * cols);  // a pure function of its arguments
  }
  context() = "streams";
  // Every coordinate, both halves of the seed and the offset change the draw (offsets are below
  // 2^32 by contract: validation rejects larger ones).
  const double base = fd::dropout_uniform(7, 11, 2, 3, 4);
  int64_t differ = 0;
  const double variants[] = {
      fd::dropout_uniform(8, 11, 2, 3, 4), fd::dropout_uniform(7 + (1ull << 32), 11, 2, 3, 4),
      fd::dropout_uniform(7, 12, 2, 3, 4), fd::dropout_uniform(7, 11, 3, 3, 4),
      fd::dropout_uniform(7, 11, 2, 4, 4), fd::dropout_uniform(7, 11, 2, 3, 5),
      fd::dropout_uniform(7, 11, 2, 4, 3)};
  for (double x : variants) differ += x != base;
  CHECK_EQ(differ, 7);
}

// The dropout key of (batch b, head h): (b + batch offset) * nheads_total + (h + head offset),
// the plain b * nheads + h without a slice, and what dropout_of hands the kernels.
void test_dropout_key() {
  flashdl::Params p{};
  p.nheads = 3;
  p.dropout_nheads = 3;
  p.p_dropout = 0.5f;
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t h = 0; h < 3; ++h) {
      CHECK_EQ(fd::dropout_bh(p, b, h), static_cast<uint64_t>(b * 3 + h));
      CHECK_EQ(fd::dropout_of(p, b, h).bh, fd::dropout_bh(p, b, h));
    }
  p.dropout_batch_offset = 5;
  p.dropout_head_offset = 4;
  p.dropout_nheads = 11;
  for (int64_t b = 0; b < 4; ++b)
    for (int64_t h = 0; h < 3; ++h) {
      CHECK_EQ(fd::dropout_bh(p, b, h), static_cast<uint64_t>((b + 5) * 11 + h + 4));
      CHECK_EQ(fd::dropout_of(p, b, h).bh, fd::dropout_bh(p, b, h));
    }
}

}  // namespace

int main() {
  run_test("math: mask vs brute force", test_mask);
  run_test("math: online softmax vs direct float64", test_online_softmax);
  run_test("math: merge_weights", test_merge);
  run_test("math: finalize_with_sink vs direct float64", test_finalize_with_sink);
  run_test("math: fa1_tiles", test_tiles);
  run_test("math: axis tiles cut at block-mask edges", test_axis_tiles);
  run_test("math: block-mask planes and broadcasting", test_block_mask_planes);
  run_test("math: score modifiers: score and grad vs double math", test_score_mod_values);
  run_test("math: score modifiers: the ALiBi bias", test_score_mod_bias);
  run_test("math: score modifiers: score_mod_of, has_score_mod", test_score_mod_of_slopes);
  run_test("math: philox4x32_10 known answers", test_philox_known_answers);
  run_test("math: dropout draws", test_dropout_draws);
  run_test("math: the dropout key of a slice", test_dropout_key);
  return finish();
}
