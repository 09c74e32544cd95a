// Backward pass: dq, dk, dv of fa1 and fa2 against float64 oracles, and the oracle itself against
// finite differences. Each case goes through check_backward_case (case_checks.hpp, which lists
// what is checked); then a float64 gradient check, seqlen_q 0, fa1's budgets and thread counts.
#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "case_checks.hpp"

using namespace flashdl_test;

namespace {

std::vector<Case> cases() {
  std::vector<Case> v;
  auto add = [&](Case c) { v.push_back(std::move(c)); };
  Case c;
  // clang-format off
  c = Case{}; c.name = "seqlen 1, d 1"; add(c);
  c = Case{}; c.name = "s17 d3 b2"; c.b = 2; c.sq = c.sk = 17; c.h = c.hk = 2; c.d = 3; add(c);
  c = Case{}; c.name = "sq<sk d16"; c.sq = 17; c.sk = 130; c.d = 16; add(c);
  c = Case{}; c.name = "sq>sk d64"; c.sq = 130; c.sk = 17; c.d = 64; add(c);
  c = Case{}; c.name = "d100"; c.sq = 31; c.sk = 40; c.d = 100; add(c);
  c = Case{}; c.name = "d128 causal"; c.sq = c.sk = 97; c.d = 128; c.causal = true; add(c);
  c = Case{}; c.name = "d256"; c.sq = 20; c.sk = 50; c.d = 256; add(c);
  c = Case{}; c.name = "causal sq>sk (empty rows)"; c.sq = 40; c.sk = 13; c.causal = true; add(c);
  c = Case{}; c.name = "causal sq<sk"; c.sq = 13; c.sk = 140; c.causal = true; add(c);
  c = Case{}; c.name = "window (5,3)"; c.sq = c.sk = 150; c.left = 5; c.right = 3; add(c);
  c = Case{}; c.name = "window (0,0) sq<sk (unseen keys)"; c.sq = 30; c.sk = 111; c.left = 0;
  c.right = 0; add(c);
  c = Case{}; c.name = "window (-1,2) sq>sk"; c.sq = 120; c.sk = 100; c.right = 2; add(c);
  c = Case{}; c.name = "GQA 4/2 causal"; c.b = 2; c.sq = 33; c.sk = 65; c.h = 4; c.hk = 2;
  c.d = 64; c.causal = true; add(c);
  c = Case{}; c.name = "MQA 4/1"; c.sq = c.sk = 50; c.h = 4; c.hk = 1; add(c);
  c = Case{}; c.name = "strided bhsd + padded"; c.b = 2; c.sq = 45; c.sk = 70; c.h = 4; c.hk = 2;
  c.ql.order = {0, 2, 1}; c.kl.pad = 5; c.vl.order = {0, 2, 1}; c.vl.pad = 3; c.ol.pad = 2;
  c.lsel.pad = 3; add(c);
  c = Case{}; c.name = "negative strides"; c.b = 2; c.sq = 30; c.sk = 41; c.h = 2; c.hk = 1;
  c.ql.reverse = 1; c.kl.reverse = 1; c.vl.reverse = 0; c.ol.reverse = 2; c.causal = true; add(c);
  c = Case{}; c.name = "large scores (scale 8)"; c.sq = c.sk = 40; c.scale = 8.0; add(c);
  c = Case{}; c.name = "dropout 0.3 GQA"; c.sq = 60; c.sk = 70; c.h = 4; c.hk = 2; c.dropout = 0.3f;
  c.seed = 99; c.offset = 5; add(c);
  // seqlen_q <= d / 2: S and dP from K and V rows, whole key tiles read in place (float32, 64).
  c = Case{}; c.name = "few queries, K and V in place, GQA"; c.b = 2; c.sq = 20; c.sk = 250;
  c.h = 4; c.hk = 2; c.d = 64; add(c);
  c = Case{}; c.name = "few queries, K and V in place, strided causal"; c.sq = 24; c.sk = 200;
  c.h = 2; c.hk = 2; c.d = 64; c.kl.reverse = 1; c.vl.pad = 3; c.causal = true; c.dropout = 0.2f;
  c.seed = 3; add(c);
  c = Case{}; c.name = "seqlen_k 0"; c.sq = 5; c.sk = 0; c.h = 2; c.hk = 1; add(c);
  c = Case{}; c.name = "seqlen_q 0"; c.sq = 0; c.sk = 9; c.h = 2; c.hk = 1; add(c);
  c = Case{}; c.name = "seqlen 400 causal d64"; c.sq = c.sk = 400; c.d = 64; c.causal = true;
  c.dtypes = {DType::bfloat16}; add(c);
  c = Case{}; c.name = "seqlen 1000 causal d64"; c.sq = c.sk = 1000; c.d = 64; c.causal = true;
  c.dtypes = {DType::float32, DType::float16}; add(c);
  // clang-format on
  return v;
}

// Finite differences of L = sum(out * dout) in float64 against each schedule's gradients.
void gradcheck(const Case& c, Schedule s) {
  context() = std::string("gradcheck ") + flashdl::schedule_name(s) + " " + c.name;
  Inputs in = make_inputs(c, DType::float64, 77);
  const Options o = options_of(c, s);
  const Grads g = run_backward(c, in, run_forward(c, in, o), o);
  const std::vector<double> dout = in.dout.values();
  auto loss = [&] {
    const Forward f = run_forward(c, in, o);
    const std::vector<double> out = f.out.values();
    double l = 0;
    for (size_t i = 0; i < out.size(); ++i) l += out[i] * dout[i];
    return l;
  };
  const double step = 1e-6;
  for (auto [x, gx] :
       {std::pair<Array*, const Array*>{&in.q, &g.dq}, {&in.k, &g.dk}, {&in.v, &g.dv}}) {
    for (int64_t e = 0; e < x->numel(); ++e) {
      const double x0 = x->get(e);
      x->set(e, x0 + step);
      const double lp = loss();
      x->set(e, x0 - step);
      const double lm = loss();
      x->set(e, x0);
      const double numeric = (lp - lm) / (2 * step);
      CHECK_NEAR(gx->get(e), numeric, 1e-7 + 1e-6 * std::fabs(numeric));
    }
  }
}

void test_gradcheck() {
  std::vector<Case> v;
  Case c;
  // clang-format off
  c.name = "GQA 2/1 sq<sk"; c.sq = 3; c.sk = 4; c.h = 2; c.hk = 1; c.d = 3; v.push_back(c);
  c = Case{}; c.name = "causal sq>sk"; c.sq = 5; c.sk = 3; c.d = 2; c.causal = true; v.push_back(c);
  c = Case{}; c.name = "window (1,0) strided"; c.b = 2; c.sq = 4; c.sk = 5; c.h = 2; c.hk = 2;
  c.d = 3; c.left = 1; c.right = 0; c.ql.order = {0, 2, 1}; c.kl.reverse = 1; c.vl.pad = 2;
  c.ol.pad = 1; v.push_back(c);
  c = Case{}; c.name = "dropout 0.3 scale 0.7"; c.sq = 4; c.sk = 6; c.d = 3; c.dropout = 0.3f;
  c.seed = 5; c.scale = 0.7; v.push_back(c);
  // clang-format on
  for (const Case& cc : v)
    for (Schedule s : {Schedule::reference, Schedule::fa1, Schedule::fa2}) gradcheck(cc, s);
}

// seqlen_q = 0 with keys: nothing attends, so dk = dv = 0 (and they must be written).
void test_no_queries() {
  Case c;
  // clang-format off
  c.sq = 0; c.sk = 7; c.h = 2; c.hk = 2; c.d = 8;
  // clang-format on
  for (Schedule s : {Schedule::reference, Schedule::fa1, Schedule::fa2})
    for (DType dt : {DType::float32, DType::float16}) {
      context() = std::string("seqlen_q 0 ") + flashdl::schedule_name(s) + " " + dtype_str(dt);
      const Inputs in = make_inputs(c, dt, 3);
      const Options o = options_of(c, s);
      const Grads g = run_backward(c, in, run_forward(c, in, o), o);
      for (double x : g.dk.values()) CHECK(x == 0.0);
      for (double x : g.dv.values()) CHECK(x == 0.0);
    }
}

// fa1 with tiny on-chip budgets; thread counts: bitwise equal for fa1 and the reference (one
// task per kv head), bitwise repeatable at a fixed count for fa2 (its dq reduction order follows
// the thread slices), and within the rule for every count.
void test_sram_and_threads() {
  Case c;
  c.name = "sram/threads";
  // clang-format off
  c.b = 2; c.sq = 110; c.sk = 130; c.h = 4; c.hk = 2; c.d = 16; c.causal = true;
  // clang-format on
  const Problem p = problem_of(c);
  for (DType dt : {DType::float32, DType::float16}) {
    const Inputs in = make_inputs(c, dt, 21);
    const Oracles ora = oracles(p, in);
    for (int64_t sram : {int64_t{1024}, int64_t{4096}}) {
      context() = "fa1 backward sram_bytes " + std::to_string(sram) + " " + dtype_str(dt);
      const Options o = options_of(c, Schedule::fa1, 0, sram);
      check_grads("fa1", run_backward(c, in, run_forward(c, in, o), o), ora, dt);
    }
    for (Schedule s : {Schedule::fa1, Schedule::fa2, Schedule::reference}) {
      context() = std::string("backward threads ") + flashdl::schedule_name(s) + " " +
                  dtype_str(dt);
      const Options o1 = options_of(c, s, 1);
      const Forward f = run_forward(c, in, o1);
      const Grads one = run_backward(c, in, f, o1);
      for (int t : {2, 3}) {
        const Options ot = options_of(c, s, t);
        const Grads a = run_backward(c, in, f, ot), b = run_backward(c, in, f, ot);
        CHECK_MSG(bitwise_equal(a, b), "not repeatable with " + std::to_string(t) + " threads");
        if (s != Schedule::fa2)
          CHECK_MSG(bitwise_equal(a, one), std::to_string(t) + " threads differ from 1");
        if (s != Schedule::reference) check_grads(flashdl::schedule_name(s), a, ora, dt);
      }
    }
  }
}

// The backward keeps its working memory from call to call (a workspace per call in flight, tile
// buffers per thread): calls of other shapes in between, and calls from two caller threads at
// once, give each call's gradients bit for bit as it gave them alone.
void test_kept_memory() {
  std::vector<Case> cs(3);
  cs[0].name = "by queries";  // 300 queries over one key tile
  // clang-format off
  cs[0].b = 2; cs[0].sq = 300; cs[0].sk = 40; cs[0].h = 4; cs[0].hk = 2; cs[0].d = 64;
  cs[1].name = "small";
  cs[1].sq = 16; cs[1].sk = 16; cs[1].h = 8; cs[1].hk = 8; cs[1].d = 64;
  cs[2].name = "by keys";
  cs[2].sq = 130; cs[2].sk = 200; cs[2].h = 2; cs[2].hk = 1; cs[2].d = 128; cs[2].causal = true;
  // clang-format on
  for (DType dt : {DType::float32, DType::bfloat16}) {
    std::vector<Inputs> ins;
    std::vector<Forward> fs;
    std::vector<Grads> first;
    for (size_t i = 0; i < cs.size(); ++i) {
      ins.push_back(make_inputs(cs[i], dt, 30 + static_cast<int>(i)));
      fs.push_back(run_forward(cs[i], ins[i], options_of(cs[i], Schedule::fa2, 2)));
      first.push_back(run_backward(cs[i], ins[i], fs[i], options_of(cs[i], Schedule::fa2, 2)));
    }
    for (size_t i : {2, 1, 0, 1, 2, 0}) {
      context() = "in turn: " + cs[i].name + " " + dtype_str(dt);
      const Grads g = run_backward(cs[i], ins[i], fs[i], options_of(cs[i], Schedule::fa2, 2));
      CHECK_MSG(bitwise_equal(g, first[i]), "differs from the call alone");
    }
    // Two caller threads, each its cases in another order (no CHECK off the main thread).
    auto calls = [&](std::vector<size_t> order, std::vector<Grads>& out) {
      for (size_t i : order) {
        const Case& c = cs[i];
        Grads g{Array(dt, {c.b, c.sq, c.h, c.d}, c.ol), Array(dt, {c.b, c.sk, c.hk, c.d}, c.kl),
                Array(dt, {c.b, c.sk, c.hk, c.d}, c.vl)};
        flashdl::backward(ins[i].dout.view(), ins[i].q.view(), ins[i].k.view(), ins[i].v.view(),
                          fs[i].out.view(), fs[i].lse.view(), g.dq.view(), g.dk.view(), g.dv.view(),
                          options_of(c, Schedule::fa2, 2));
        out.push_back(std::move(g));
      }
    };
    const std::vector<size_t> order_a{0, 1, 2, 0, 1, 2, 0, 1, 2};
    const std::vector<size_t> order_b{2, 0, 1, 2, 0, 1, 1, 0, 2};
    std::vector<Grads> got_a, got_b;
    std::thread ta(calls, order_a, std::ref(got_a)), tb(calls, order_b, std::ref(got_b));
    ta.join();
    tb.join();
    for (size_t j = 0; j < order_a.size(); ++j) {
      context() = "two callers: " + cs[order_a[j]].name + ", " + cs[order_b[j]].name + " " +
                  dtype_str(dt);
      CHECK_MSG(bitwise_equal(got_a[j], first[order_a[j]]), "first caller's call differs");
      CHECK_MSG(bitwise_equal(got_b[j], first[order_b[j]]), "second caller's call differs");
    }
  }
}

}  // namespace

int main() {
  if (const int skip = skip_if_isa_unavailable()) return skip;
  for (const Case& c : cases())
    run_test(("backward: " + c.name).c_str(), [&] { check_backward_case(c); });
  Rng rng(4048);
  for (int i = 0; i < 40; ++i) {
    const Case c = random_case(rng, i);
    run_test(("backward: " + c.name).c_str(), [&] { check_backward_case(c); });
  }
  run_test("backward: float64 gradient check of every schedule", test_gradcheck);
  run_test("backward: seqlen_q 0 gives dk = dv = 0", test_no_queries);
  run_test("backward: fa1 tiny sram_bytes, thread counts", test_sram_and_threads);
  run_test("backward: kept memory across calls and caller threads", test_kept_memory);
  return finish();
}
