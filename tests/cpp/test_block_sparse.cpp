// Block-sparse attention (Options::block_mask) on every CPU schedule, forward and backward.
//   * Fixed cases and random ones go through check_forward_case and check_backward_case
//     (case_checks.hpp): the oracles there see the mask through Problem::visible, so every
//     accuracy rule, the empty-row rule (out 0, lse -inf, dq 0) and the unseen-key rule
//     (dk = dv = 0) hold with block masks exactly as without.
//   * An all-true mask gives the dense call's results (within the rule; tiles are cut at block
//     edges, so not necessarily bit for bit).
//   * The thread count does not change results bit for bit (fa2's backward: repeatable at a count).
//   * K and V rows that only zero blocks cover are never read (NaN poison).
// Varlen with a per-sequence mask is in test_block_sparse_varlen.cpp.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

#include "case_checks.hpp"

using namespace flashdl_test;

namespace {

// A block set with probability `density`, drawn from a hash of the block and `seed`, so a mask
// does not depend on the order masks are built in.
auto random_blocks(double density, uint64_t seed) {
  return [=](int64_t b, int64_t h, int64_t qb, int64_t kb) {
    Rng r(seed ^ static_cast<uint64_t>(((b * 131 + h) * 8191 + qb) * 65537 + kb));
    return r.uniform() < density;
  };
}

bool all_blocks(int64_t, int64_t, int64_t, int64_t) { return true; }

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](Case c) {
    c.fa1_sram = {0, 1024, 4096};
    v.push_back(std::move(c));
  };
  Case c;
  // clang-format off
  c = Case{}; c.name = "rank 2, blocks 16 dividing 64"; c.sq = c.sk = 64; c.h = c.hk = 2;
  set_block_mask(c, 16, 16, {}, random_blocks(0.5, 1)); add(c);
  c = Case{}; c.name = "blocks 12 x 20 not dividing 50 x 70"; c.sq = 50; c.sk = 70;
  set_block_mask(c, 12, 20, {}, random_blocks(0.6, 2)); add(c);
  c = Case{}; c.name = "blocks 1 x 1, GQA 2/1"; c.sq = 13; c.sk = 17; c.h = 2; c.hk = 1;
  set_block_mask(c, 1, 1, {1, 2}, random_blocks(0.4, 3)); add(c);
  c = Case{}; c.name = "blocks 1 x 7"; c.sq = 21; c.sk = 40; c.d = 8;
  set_block_mask(c, 1, 7, {}, random_blocks(0.5, 4)); add(c);
  c = Case{}; c.name = "blocks larger than the sequences (one block)"; c.sq = 30; c.sk = 45;
  set_block_mask(c, 128, 64, {}, all_blocks); add(c);
  c = Case{}; c.name = "block_q > seqlen_q, block_k 5"; c.sq = 20; c.sk = 33;
  set_block_mask(c, 64, 5, {}, random_blocks(0.5, 5)); add(c);
  c = Case{}; c.name = "rank 4 (b, h)"; c.b = 2; c.sq = 40; c.sk = 52; c.h = c.hk = 3;
  set_block_mask(c, 8, 12, {2, 3}, random_blocks(0.5, 6)); add(c);
  c = Case{}; c.name = "rank 4 (1, h) broadcast over batches"; c.b = 2; c.sq = 35; c.sk = 44;
  c.h = 2; c.hk = 1; set_block_mask(c, 6, 10, {1, 2}, random_blocks(0.5, 7)); add(c);
  c = Case{}; c.name = "rank 4 (b, 1) broadcast over heads"; c.b = 3; c.sq = 30; c.sk = 30;
  c.h = c.hk = 2; set_block_mask(c, 9, 4, {3, 1}, random_blocks(0.5, 8)); add(c);
  c = Case{}; c.name = "rank 4 (1, 1)"; c.b = 2; c.sq = 26; c.sk = 37; c.h = c.hk = 2;
  set_block_mask(c, 5, 5, {1, 1}, random_blocks(0.6, 9)); add(c);
  c = Case{}; c.name = "zero block rows (empty rows)"; c.b = 2; c.sq = 45; c.sk = 50; c.h = 2;
  c.hk = 2; set_block_mask(c, 10, 16, {2, 2}, [](int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return qb != 1 && qb != 4 - b && random_blocks(0.7, 10)(b, h, qb, kb);
  }); add(c);
  c = Case{}; c.name = "zero block columns (unseen keys), GQA 4/2"; c.sq = 40; c.sk = 64; c.h = 4;
  c.hk = 2; set_block_mask(c, 8, 12, {1, 4}, [](int64_t b, int64_t h, int64_t qb, int64_t kb) {
    return kb != 0 && kb != 2 + h / 2 && random_blocks(0.8, 11)(b, h, qb, kb);
  }); add(c);
  c = Case{}; c.name = "all-zero mask"; c.b = 2; c.sq = 20; c.sk = 25; c.h = 2; c.hk = 1;
  set_block_mask(c, 4, 4, {}, [](int64_t, int64_t, int64_t, int64_t) { return false; }); add(c);
  c = Case{}; c.name = "causal + blocks 16"; c.sq = c.sk = 70; c.causal = true; c.d = 32;
  set_block_mask(c, 16, 16, {}, random_blocks(0.6, 12)); add(c);
  c = Case{}; c.name = "causal sq>sk + blocks 7 x 9"; c.sq = 60; c.sk = 25; c.causal = true;
  set_block_mask(c, 7, 9, {}, random_blocks(0.7, 13)); add(c);
  c = Case{}; c.name = "window (5,3) + blocks 8 x 24"; c.sq = c.sk = 80; c.left = 5; c.right = 3;
  set_block_mask(c, 8, 24, {}, random_blocks(0.7, 14)); add(c);
  c = Case{}; c.name = "window (20,-1) sq<sk + blocks 16 x 10"; c.sq = 50; c.sk = 90; c.left = 20;
  set_block_mask(c, 16, 10, {}, random_blocks(0.6, 15)); add(c);
  c = Case{}; c.name = "GQA 4/2 causal d64 + (b, h) blocks"; c.b = 2; c.sq = 33; c.sk = 65;
  c.h = 4; c.hk = 2; c.d = 64; c.causal = true;
  set_block_mask(c, 11, 13, {2, 4}, random_blocks(0.5, 16)); add(c);
  c = Case{}; c.name = "MQA 4/1 + (1, h) blocks"; c.sq = c.sk = 50; c.h = 4; c.hk = 1;
  set_block_mask(c, 10, 7, {1, 4}, random_blocks(0.5, 17)); add(c);
  c = Case{}; c.name = "dropout 0.3 + (1, h) blocks"; c.sq = 60; c.sk = 70; c.h = c.hk = 2;
  c.dropout = 0.3f; c.seed = 99; c.offset = 5;
  set_block_mask(c, 12, 9, {1, 2}, random_blocks(0.6, 18)); add(c);
  c = Case{}; c.name = "strided bhsd + padded, strided mask"; c.b = 2; c.sq = 45; c.sk = 70;
  c.h = 4; c.hk = 2; c.ql.order = {0, 2, 1}; c.kl.pad = 5; c.vl.order = {0, 2, 1}; c.vl.pad = 3;
  c.ol.order = {2, 0, 1}; c.ol.pad = 1; c.lsel.pad = 3;
  set_block_mask(c, 9, 14, {2, 4}, random_blocks(0.5, 19), Layout{{1, 2, 0}, 3, -1}); add(c);
  c = Case{}; c.name = "negative strides, reversed mask rows"; c.b = 2; c.sq = 30; c.sk = 41;
  c.h = 2; c.hk = 1; c.causal = true; c.ql.reverse = 1; c.kl.reverse = 1; c.vl.reverse = 0;
  c.ol.reverse = 2; c.lsel.reverse = 1;
  set_block_mask(c, 4, 6, {2, 1}, random_blocks(0.6, 20), Layout{{}, 0, 2}); add(c);
  c = Case{}; c.name = "rank 2 mask with a negative row stride"; c.sq = 37; c.sk = 29;
  set_block_mask(c, 5, 3, {}, random_blocks(0.5, 21), Layout{{}, 2, 0}); add(c);
  c = Case{}; c.name = "blocks 48 x 96 (fa2's tile) d128"; c.sq = c.sk = 200; c.d = 128;
  c.dtypes = {DType::float32, DType::bfloat16};
  set_block_mask(c, 48, 96, {}, random_blocks(0.6, 22)); add(c);
  c = Case{}; c.name = "seqlen_k 0"; c.sq = 5; c.sk = 0; c.h = 2; c.hk = 1;
  set_block_mask(c, 2, 3, {}, all_blocks); add(c);
  c = Case{}; c.name = "seqlen_q 0"; c.sq = 0; c.sk = 9; c.h = 2; c.hk = 1;
  set_block_mask(c, 2, 3, {1, 2}, all_blocks); add(c);
  // clang-format on
  return v;
}

// random_case (harness.hpp) plus a mask of random block sizes, rank, broadcasting, layout and
// density (from none to all blocks set).
Case random_block_case(Rng& rng, int index) {
  auto pick = [&](int64_t n) {
    return static_cast<int64_t>(rng.next() % static_cast<uint64_t>(n));
  };
  Case c = random_case(rng, index);
  const int64_t sizes[] = {1, 2, 3, 5, 8, 13, 16, 32, 48, 100};
  const int64_t bq = sizes[pick(10)], bk = sizes[pick(10)];
  const double densities[] = {0.0, 0.15, 0.4, 0.7, 1.0};
  const double density = densities[pick(5)];
  const std::vector<int64_t> leads[] = {{}, {1, 1}, {c.b, 1}, {1, c.h}, {c.b, c.h}};
  const std::vector<int64_t>& lead = leads[pick(5)];
  Layout ml;
  ml.order.resize(lead.empty() ? 1 : 3);
  std::iota(ml.order.begin(), ml.order.end(), 0);
  for (size_t i = ml.order.size() - 1; i > 0; --i) std::swap(ml.order[i], ml.order[pick(i + 1)]);
  ml.pad = pick(3);
  ml.reverse = pick(3) == 0 ? static_cast<int>(pick(static_cast<int64_t>(ml.order.size()))) : -1;
  set_block_mask(c, bq, bk, lead, random_blocks(density, rng.next()), ml);
  c.name += " blocks " + std::to_string(bq) + "x" + std::to_string(bk) + " rank " +
            std::to_string(lead.empty() ? 2 : 4) + " density " + num(density);
  return c;
}

// max|x - y| within the rule's tolerance for x against ref64 (harness.hpp check_rule).
void check_close(const std::string& what, const std::vector<double>& x,
                 const std::vector<double>& y, const std::vector<double>& ref64,
                 const std::vector<double>& naive, DType dt, double magnitude = 0.0) {
  const double tol = 2.0 * max_diff(naive, ref64) +
                     rule_eps(dt) * std::max(max_abs(ref64), magnitude);
  const double diff = max_diff(x, y);
  CHECK_MSG(diff <= tol, what + ": max diff " + num(diff) + " > tol " + num(tol));
}

void test_all_true_is_dense() {
  const int64_t blocks[][2] = {{1, 1}, {7, 13}, {48, 96}, {64, 32}, {500, 500}};
  for (const auto& bs : blocks) {
    Case dense;
    dense.name = "all-true mask " + std::to_string(bs[0]) + "x" + std::to_string(bs[1]);
    // clang-format off
    dense.b = 2; dense.sq = 60; dense.sk = 90; dense.h = 2; dense.hk = 1; dense.d = 32;
    // clang-format on
    dense.causal = bs[0] % 2 == 1;
    Case sparse = dense;
    set_block_mask(sparse, bs[0], bs[1], {2, 1}, all_blocks);
    const Problem p = problem_of(dense);
    for (DType dt : all_dtypes()) {
      context() = dense.name + " " + dtype_str(dt);
      const Inputs in = make_inputs(dense, dt, 5);
      const ForwardOracle fo = forward_oracle(p, in);
      const Oracles bo = oracles(p, in);
      std::vector<std::pair<Schedule, int64_t>> runs{
          {Schedule::fa2, 0}, {Schedule::fa1, 0}, {Schedule::fa1, 1024}, {Schedule::reference, 0}};
      for (auto [s, sram] : runs) {
        const std::string name = run_name(s, sram);
        const Options od = options_of(dense, s, 0, sram), os = options_of(sparse, s, 0, sram);
        const Forward fd = run_forward(dense, in, od), fs = run_forward(sparse, in, os);
        check_close(name + " out", fs.out.values(), fd.out.values(), fo.out64, fo.outl, dt);
        check_close(name + " lse", fs.lse.values(), fd.lse.values(), fo.lse64, fo.lsel,
                    DType::float32);
        const Grads gd = run_backward(dense, in, fd, od), gs = run_backward(sparse, in, fs, os);
        check_close(name + " dq", gs.dq.values(), gd.dq.values(), bo.ref.dq, bo.naive.dq, dt,
                    bo.mag.dq);
        check_close(name + " dk", gs.dk.values(), gd.dk.values(), bo.ref.dk, bo.naive.dk, dt,
                    bo.mag.dk);
        check_close(name + " dv", gs.dv.values(), gd.dv.values(), bo.ref.dv, bo.naive.dv, dt,
                    bo.mag.dv);
      }
    }
  }
}

// Forward: bitwise equal for 1, 2 and 3 threads. Backward: bitwise equal across counts for fa1 and
// the reference (one task per kv head), bitwise repeatable at a fixed count for fa2 (its dq
// reduction order follows the thread slices).
void test_threads() {
  Case c;
  c.name = "threads";
  // clang-format off
  c.b = 2; c.sq = 150; c.sk = 130; c.h = 3; c.hk = 1; c.d = 16; c.causal = true;
  // clang-format on
  set_block_mask(c, 20, 24, {2, 3}, random_blocks(0.5, 23));
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const Inputs in = make_inputs(c, dt, 11);
    for (Schedule s : {Schedule::fa1, Schedule::fa2, Schedule::reference}) {
      context() = std::string("threads ") + flashdl::schedule_name(s) + " " + dtype_str(dt);
      const int64_t sram = s == Schedule::fa1 ? 4096 : 0;
      const Options o1 = options_of(c, s, 1, sram);
      const Forward one = run_forward(c, in, o1);
      const Grads g1 = run_backward(c, in, one, o1);
      for (int t : {2, 3}) {
        const Options ot = options_of(c, s, t, sram);
        const Forward many = run_forward(c, in, ot);
        CHECK_MSG(bitwise_equal(one.out, many.out) && bitwise_equal(one.lse, many.lse),
                  "forward: " + std::to_string(t) + " threads differ from 1");
        const Grads a = run_backward(c, in, one, ot), b = run_backward(c, in, one, ot);
        CHECK_MSG(bitwise_equal(a, b),
                  "backward: not repeatable with " + std::to_string(t) + " threads");
        if (s != Schedule::fa2)
          CHECK_MSG(bitwise_equal(a, g1),
                    "backward: " + std::to_string(t) + " threads differ from 1");
      }
    }
  }
}

// Zero blocks are never read: the K and V rows of (batch, kv head) whose key block is zero for
// every query row block of every query head of the group hold NaN. A schedule that loaded such a
// tile would multiply it into S or P V and spread NaN, so every result must stay finite (run_*
// count NaN as unwritten), match the oracle of the clean inputs, and give those rows dk = dv = 0
// exactly. The reference copies every key (it materialises the score matrix) but uses only visible
// ones, so for it this checks that masked keys never reach a result, not that they are unread.
void check_poison(const Case& c) {
  const Problem p = problem_of(c);
  auto key_block_zero = [&](int64_t b, int64_t hk, int64_t kb) {
    for (int64_t h = 0; h < p.h; ++h)
      for (int64_t qb = 0; qb < p.nbq && p.kv_head(h) == hk; ++qb)
        if (p.block_set(b, h, qb, kb)) return false;
    return true;
  };
  for (DType dt : all_dtypes()) {
    context() = c.name + " " + dtype_str(dt);
    const Inputs clean = make_inputs(c, dt, 31);
    const ForwardOracle fo = forward_oracle(p, clean);
    const Oracles bo = oracles(p, clean);
    Inputs in = clean;
    std::vector<int64_t> poisoned;  // first element of each poisoned row of k and v
    for (int64_t b = 0; b < p.b; ++b)
      for (int64_t hk = 0; hk < p.hk; ++hk)
        for (int64_t j = 0; j < p.sk; ++j) {
          if (!key_block_zero(b, hk, j / p.block_k)) continue;
          poisoned.push_back(p.ki(b, j, hk));
          for (int64_t e = p.ki(b, j, hk); e < p.ki(b, j, hk) + p.d; ++e) {
            in.k.set(e, NAN);
            in.v.set(e, NAN);
          }
        }
    CHECK(static_cast<int64_t>(poisoned.size()) >= p.block_k);
    const std::vector<std::pair<Schedule, int64_t>> runs{
        {Schedule::fa2, 0}, {Schedule::fa1, 0}, {Schedule::fa1, 1024}, {Schedule::reference, 0}};
    for (auto [s, sram] : runs) {
      const std::string name = run_name(s, sram);
      const Options o = options_of(c, s, 0, sram);
      const Forward f = run_forward(c, in, o);
      check_rule(name + " out", f.out.values(), fo.out64, fo.outl, dt);
      check_rule(name + " lse", f.lse.values(), fo.lse64, fo.lsel, DType::float32);
      const Grads g = run_backward(c, in, f, o);
      check_grads(name, g, bo, dt);
      check_masked_zeros(p, g, name);
      const std::vector<double> dk = g.dk.values(), dv = g.dv.values();
      int64_t nonzero = 0;
      for (int64_t row : poisoned)
        for (int64_t e = row; e < row + p.d; ++e) nonzero += (dk[e] != 0.0) + (dv[e] != 0.0);
      CHECK_MSG(nonzero == 0,
                name + ": " + std::to_string(nonzero) + " dk/dv of poisoned rows not 0");
    }
  }
}

void test_nan_poison() {
  // Key block (b + hk + 1) mod nbk and key block 4 are zero for every query head of kv head hk.
  auto zero_columns = [](int64_t nbk, double density, uint64_t seed) {
    return [=](int64_t b, int64_t h, int64_t qb, int64_t kb) {
      const int64_t hk = h / 2;
      return kb != (b + hk + 1) % nbk && kb != 4 && random_blocks(density, seed)(b, h, qb, kb);
    };
  };
  Case c;
  c.name = "poison GQA 4/2 (b, h) blocks 16 x 12";
  // clang-format off
  c.b = 2; c.sq = 70; c.sk = 90; c.h = 4; c.hk = 2; c.d = 16;
  // clang-format on
  set_block_mask(c, 16, 12, {2, 4}, zero_columns(8, 0.7, 24));
  check_poison(c);
  c = Case{};
  c.name = "poison causal, blocks 5 x 7, dropout";
  // clang-format off
  c.sq = 48; c.sk = 64; c.h = 2; c.hk = 1; c.d = 24; c.causal = true;
  c.dropout = 0.2f; c.seed = 3; c.offset = 1;
  // clang-format on
  set_block_mask(c, 5, 7, {1, 2}, zero_columns(10, 0.8, 25));
  check_poison(c);
  c = Case{};
  c.name = "poison window, rank 2, blocks 9 x 10, strided";
  // clang-format off
  c.b = 2; c.sq = 40; c.sk = 75; c.h = c.hk = 2; c.left = 30; c.right = 10;
  c.kl.order = {0, 2, 1}; c.vl.reverse = 1; c.kl.pad = 3;
  // clang-format on
  set_block_mask(c, 9, 10, {}, [](int64_t, int64_t, int64_t, int64_t kb) { return kb % 3 != 1; });
  check_poison(c);
}

}  // namespace

int main() {
  if (const int skip = skip_if_isa_unavailable()) return skip;
  for (const Case& c : cases())
    run_test(("block sparse: " + c.name).c_str(), [&] {
      check_forward_case(c);
      check_backward_case(c);
    });
  Rng rng(8086);
  for (int i = 0; i < 40; ++i) {
    const Case c = random_block_case(rng, i);
    run_test(("block sparse: " + c.name).c_str(), [&] {
      check_forward_case(c);
      check_backward_case(c);
    });
  }
  run_test("block sparse: an all-true mask is the dense problem", test_all_true_is_dense);
  run_test("block sparse: thread count does not change results", test_threads);
  run_test("block sparse: zero blocks are never read (NaN poison)", test_nan_poison);
  return finish();
}
