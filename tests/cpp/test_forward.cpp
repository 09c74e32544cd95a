// Forward pass of every CPU schedule against float64 oracles, over odd shapes, masks, GQA and
// strided layouts: each case goes through check_forward_case (case_checks.hpp, which lists what is
// checked); then fa1's on-chip budgets, thread counts, a negative control and zero-length problems.
#include <cstdio>
#include <string>
#include <vector>

#include "case_checks.hpp"

using namespace flashdl_test;

namespace {

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(std::move(c)); };
  const std::vector<DType> lowp{DType::float32, DType::bfloat16};
  Case c;

  // clang-format off
  c = Case{}; c.name = "seqlen 1, d 1"; add(c);
  c = Case{}; c.name = "s17 d3 b2 h2"; c.b = 2; c.sq = c.sk = 17; c.h = c.hk = 2; c.d = 3; add(c);
  c = Case{}; c.name = "sq<sk d16"; c.sq = 17; c.sk = 130; c.h = c.hk = 2; c.d = 16; add(c);
  c = Case{}; c.name = "sq>sk d64"; c.sq = 130; c.sk = 17; c.d = 64; add(c);
  c = Case{}; c.name = "b3 h3 d100"; c.b = 3; c.sq = c.sk = 31; c.h = c.hk = 3; c.d = 100; add(c);
  c = Case{}; c.name = "d128 s97"; c.sq = c.sk = 97; c.d = 128; add(c);
  c = Case{}; c.name = "d256"; c.sq = 33; c.sk = 70; c.d = 256; add(c);
  c = Case{}; c.name = "causal s97 d64"; c.sq = c.sk = 97; c.h = c.hk = 2; c.d = 64; c.causal = true;
  add(c);
  c = Case{}; c.name = "causal sq>sk (empty rows)"; c.sq = 40; c.sk = 13; c.d = 16; c.causal = true;
  add(c);
  c = Case{}; c.name = "causal sq<sk d100"; c.sq = 13; c.sk = 140; c.d = 100; c.causal = true; add(c);
  c = Case{}; c.name = "window (5,3) d128"; c.sq = c.sk = 150; c.d = 128; c.left = 5; c.right = 3;
  add(c);
  c = Case{}; c.name = "window (20,-1) sq<sk"; c.sq = 100; c.sk = 120; c.left = 20; add(c);
  c = Case{}; c.name = "window (-1,2) sq>sk"; c.sq = 120; c.sk = 100; c.right = 2; add(c);
  c = Case{}; c.name = "window (0,0) sq>sk"; c.sq = 60; c.sk = 25; c.left = 0; c.right = 0; add(c);
  c = Case{}; c.name = "window (3,0) sq<sk"; c.sq = 30; c.sk = 111; c.left = 3; c.right = 0; add(c);
  c = Case{}; c.name = "causal + left 7"; c.sq = c.sk = 100; c.causal = true; c.left = 7; add(c);
  c = Case{}; c.name = "window wider than the sequences"; c.sq = 20; c.sk = 30; c.left = 49;
  c.right = 50; add(c);
  c = Case{}; c.name = "GQA 4/2 causal"; c.sq = 33; c.sk = 65; c.h = 4; c.hk = 2; c.d = 64;
  c.causal = true; add(c);
  c = Case{}; c.name = "MQA 4/1"; c.b = 2; c.sq = c.sk = 50; c.h = 4; c.hk = 1; c.d = 16; add(c);
  c = Case{}; c.name = "strided bhsd + padded"; c.b = 2; c.sq = 45; c.sk = 70; c.h = 4; c.hk = 2;
  c.ql.order = {0, 2, 1}; c.kl.pad = 5; c.vl.order = {0, 2, 1}; c.vl.pad = 3;
  c.ol.order = {2, 0, 1}; c.ol.pad = 1; c.lsel.pad = 3; add(c);
  c = Case{}; c.name = "negative strides"; c.b = 2; c.sq = 30; c.sk = 41; c.h = 2; c.hk = 2;
  c.ql.reverse = 0; c.kl.reverse = 1; c.vl.reverse = 2; c.ol.reverse = 1; c.lsel.reverse = 1;
  c.causal = true; add(c);
  c = Case{}; c.name = "large scores (scale 8)"; c.sq = c.sk = 40; c.scale = 8.0; add(c);
  c = Case{}; c.name = "dropout 0.25"; c.sq = 70; c.sk = 90; c.h = 2; c.hk = 2; c.dropout = 0.25f;
  c.seed = 42; c.offset = 7; add(c);
  c = Case{}; c.name = "dropout 0.5 causal GQA"; c.b = 2; c.sq = c.sk = 50; c.h = 4; c.hk = 2;
  c.causal = true; c.dropout = 0.5f; c.seed = 1ull << 40; c.offset = 3; add(c);
  // seqlen_q <= headdim / 2: fa2 computes S as (K Q^T)^T, K read in place where it is float32
  // and the tile a whole number of micro-kernel rows (96 keys), else converted (the 8-key tail).
  c = Case{}; c.name = "few queries: K Q^T, GQA 4/2 causal"; c.b = 2; c.sq = 9; c.sk = 200;
  c.h = 4; c.hk = 2; c.d = 64; c.causal = true; add(c);
  c = Case{}; c.name = "few queries: K Q^T, strided K, window (30,-1)"; c.sq = 20; c.sk = 250;
  c.h = c.hk = 3; c.d = 128; c.kl.order = {0, 2, 1}; c.kl.pad = 2; c.left = 30; add(c);
  c = Case{}; c.name = "seqlen_k 0"; c.sq = 5; c.sk = 0; c.h = 2; c.hk = 1; add(c);
  c = Case{}; c.name = "seqlen 1000 causal d64"; c.sq = c.sk = 1000; c.d = 64; c.causal = true;
  c.dtypes = lowp; add(c);
  c = Case{}; c.name = "seqlen 1000 GQA 2/1 window (100,0) d32"; c.sq = c.sk = 1000; c.h = 2;
  c.hk = 1; c.d = 32; c.left = 100; c.right = 0; c.dtypes = {DType::float16}; add(c);
  c = Case{}; c.name = "sq 1000 sk 300"; c.sq = 1000; c.sk = 300; c.d = 16;
  c.dtypes = {DType::float16}; add(c);
  // clang-format on
  return v;
}

// fa1 with tiny on-chip budgets (many blocks, down to Bc = Br = 1) and a large one (one block).
void test_fa1_sram() {
  Case c;
  c.name = "fa1 sram";
  // clang-format off
  c.sq = 37; c.sk = 53; c.h = 2; c.hk = 1; c.d = 16; c.causal = true;
  Case c64 = c;
  c64.name = "fa1 sram d64"; c64.causal = false; c64.sq = 20; c64.sk = 29; c64.d = 64;
  // clang-format on
  for (const Case& cc : {c, c64}) {
    const Problem p = problem_of(cc);
    for (DType dt : {DType::float32, DType::float16, DType::float64}) {
      const Inputs in = make_inputs(cc, dt, 7);
      const std::vector<double> q = in.q.values(), k = in.k.values(), v = in.v.values();
      std::vector<double> out64, lse64, outl, lsel;
      Naive<double>{p, q, k, v}.forward(DType::float64, out64, lse64);
      if (dt == DType::float64)
        outl = out64, lsel = lse64;
      else
        Naive<float>{p, q, k, v}.forward(dt, outl, lsel);
      for (int64_t sram : {int64_t{1024}, int64_t{4096}, int64_t{1} << 18}) {
        context() = cc.name + " " + dtype_str(dt) + " sram_bytes " + std::to_string(sram);
        const Forward f = run_forward(cc, in, options_of(cc, Schedule::fa1, 0, sram));
        check_rule("fa1 out", f.out.values(), out64, outl, dt);
        check_rule("fa1 lse", f.lse.values(), lse64, lsel, DType::float32);
      }
    }
  }
}

// Forward results do not depend on the thread count, bit for bit.
void test_threads() {
  Case c;
  c.name = "threads";
  // clang-format off
  c.b = 2; c.sq = 150; c.sk = 130; c.h = 3; c.hk = 1; c.d = 16; c.causal = true;
  // clang-format on
  for (DType dt : {DType::float32, DType::bfloat16}) {
    const Inputs in = make_inputs(c, dt, 11);
    for (Schedule s : {Schedule::fa1, Schedule::fa2, Schedule::reference}) {
      context() = std::string("threads ") + flashdl::schedule_name(s) + " " + dtype_str(dt);
      const int64_t sram = s == Schedule::fa1 ? 4096 : 0;
      const Forward one = run_forward(c, in, options_of(c, s, 1, sram));
      for (int t : {2, 3}) {
        const Forward many = run_forward(c, in, options_of(c, s, t, sram));
        CHECK_MSG(bitwise_equal(one.out, many.out) && bitwise_equal(one.lse, many.lse),
                  std::to_string(t) + " threads differ from 1");
      }
    }
  }
}

// Calls in turn on one thread, same shapes, other data: each gets its own result. The fa2
// forward keeps its packed K and V per thread from call to call (ForwardTiles and
// forward_products, fa2.inl); a packed (batch, kv head) kept valid into the next call would hand
// it the previous call's keys. Heads packed together (heads_together), one head at a time, and
// the few-query K Q^T path; float32, bfloat16 (its own packing) and float64.
void test_calls_in_turn() {
  Case together, alone, few;
  // clang-format off
  together.name = "in turn, heads together"; together.sq = 100; together.sk = 40; together.h = 4;
  together.hk = 2; together.d = 16;
  alone.name = "in turn, one head at a time"; alone.b = 2; alone.sq = 60; alone.sk = 130;
  alone.h = 2; alone.hk = 1; alone.d = 32; alone.causal = true;
  few.name = "in turn, few queries"; few.sq = 8; few.sk = 150; few.h = 2; few.hk = 2; few.d = 64;
  // clang-format on
  for (const Case& c : {together, alone, few})
    for (DType dt : {DType::float32, DType::bfloat16, DType::float64}) {
      const Problem p = problem_of(c);
      for (uint64_t seed : {21u, 22u, 21u}) {  // A, then B (A's shapes), then A again
        context() = c.name + " " + dtype_str(dt) + " seed " + std::to_string(seed);
        const Inputs in = make_inputs(c, dt, seed);
        const std::vector<double> q = in.q.values(), k = in.k.values(), v = in.v.values();
        std::vector<double> out64, lse64, outl, lsel;
        Naive<double>{p, q, k, v}.forward(DType::float64, out64, lse64);
        if (dt == DType::float64)
          outl = out64, lsel = lse64;
        else
          Naive<float>{p, q, k, v}.forward(dt, outl, lsel);
        const Forward f = run_forward(c, in, options_of(c, Schedule::fa2, 1));
        check_rule("out", f.out.values(), out64, outl, dt);
        check_rule("lse", f.lse.values(), lse64, lsel, DType::float32);
      }
    }
}

// The comparison can fail: a causal result checked against the full-attention oracle is rejected.
void test_rule_rejects_wrong_mask() {
  Case c;
  c.name = "negative control";
  // clang-format off
  c.sq = c.sk = 40; c.causal = true;
  // clang-format on
  const Inputs in = make_inputs(c, DType::float32, 3);
  Case full = c;
  full.causal = false;
  const Problem p = problem_of(full);
  const std::vector<double> q = in.q.values(), k = in.k.values(), v = in.v.values();
  std::vector<double> out64, lse64, outl, lsel;
  Naive<double>{p, q, k, v}.forward(DType::float64, out64, lse64);
  Naive<float>{p, q, k, v}.forward(DType::float32, outl, lsel);
  const Forward f = run_forward(c, in, options_of(c, Schedule::fa2));
  const double err = max_diff(f.out.values(), out64);
  const double tol = 2.0 * max_diff(outl, out64) + rule_eps(DType::float32) * max_abs(out64);
  CHECK_MSG(err > 100 * tol, "causal output passed as full attention: err " + num(err));
}

// Zero-length problems are accepted; with seqlen_k = 0 every row is empty.
void test_zero_lengths() {
  for (Schedule s : {Schedule::fa1, Schedule::fa2, Schedule::reference}) {
    context() = std::string("zero lengths ") + flashdl::schedule_name(s);
    Case c;
    // clang-format off
    c.sq = 4; c.sk = 0; c.h = 2; c.hk = 2; c.d = 8;
    // clang-format on
    const Inputs in = make_inputs(c, DType::float32, 1);
    const Forward f = run_forward(c, in, options_of(c, s));
    for (double x : f.out.values()) CHECK(x == 0.0);
    for (double x : f.lse.values()) CHECK(x == -INFINITY);
    // Null data is fine for an empty k and v.
    flashdl::TensorView k = in.k.view(), v = in.v.view();
    k.data = v.data = nullptr;
    flashdl::forward(in.q.view(), k, v, f.out.view(), f.lse.view(), options_of(c, s));
    for (double x : f.out.values()) CHECK(x == 0.0);
    // batch 0, seqlen_q 0, nheads 0: nothing to compute, nothing thrown, nothing written.
    Case z = c;
    z.sk = 3;
    for (int which = 0; which < 3; ++which) {
      z.b = which == 0 ? 0 : 1;
      z.sq = which == 1 ? 0 : 4;
      z.h = z.hk = which == 2 ? 0 : 2;
      const Inputs zin = make_inputs(z, DType::float16, 2);
      Forward zf{Array(DType::float16, {z.b, z.sq, z.h, z.d}),
                 Array(DType::float32, {z.b, z.h, z.sq})};
      flashdl::forward(zin.q.view(), zin.k.view(), zin.v.view(), zf.out.view(), zf.lse.view(),
                       options_of(z, s));
    }
  }
}

}  // namespace

int main() {
  if (const int skip = skip_if_isa_unavailable()) return skip;
  for (const Case& c : cases())
    run_test(("forward: " + c.name).c_str(), [&] { check_forward_case(c); });
  Rng rng(2024);
  for (int i = 0; i < 40; ++i) {
    const Case c = random_case(rng, i);
    run_test(("forward: " + c.name).c_str(), [&] { check_forward_case(c); });
  }
  run_test("forward: fa1 tiny and huge sram_bytes", test_fa1_sram);
  run_test("forward: thread count does not change results", test_threads);
  run_test("forward: the rule rejects a wrong mask", test_rule_rejects_wrong_mask);
  run_test("forward: zero-length batch and sequences", test_zero_lengths);
  run_test("forward: calls in turn, same shapes, other data", test_calls_in_turn);
  return finish();
}
