// Every bad argument throws flashdl::Error of the right kind, with a message that starts with the
// argument's name; no call (failing or not) writes into an input; zero-length problems pass.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "validation.hpp"

using namespace flashdl_test;

namespace {

void test_shapes_and_ranks() {
  Problem p;
  Array q3(DType::float32, {2, 5, 32});
  expect_both("q of rank 3", ErrorKind::value, "q", [&](Call& c) { c.q = q3.view(); }, p, "rank 4");
  expect_both("undefined k", ErrorKind::value, "k", [&](Call& c) { c.k = TensorView{}; }, p);
  expect_both("lse of rank 2", ErrorKind::value, "lse", [&](Call& c) { c.lse.rank = 2; }, p);
  expect_both("rank 5", ErrorKind::value, "v", [&](Call& c) { c.v.rank = 5; }, p);
  expect_both("negative extent", ErrorKind::value, "q", [&](Call& c) { c.q.shape[1] = -1; }, p);
  expect_both("null data", ErrorKind::value, "k", [&](Call& c) { c.k.data = nullptr; }, p);
  Array kb(DType::float32, {3, 7, 2, 8}), kd(DType::float32, {2, 7, 2, 4});
  expect_both("k batch", ErrorKind::value, "k", [&](Call& c) { c.k = kb.view(); }, p, "3");
  expect_both("k headdim", ErrorKind::value, "k", [&](Call& c) { c.k = kd.view(); }, p, "4");
  Array v6(DType::float32, {2, 6, 2, 8});
  expect_both("v seqlen", ErrorKind::value, "v", [&](Call& c) { c.v = v6.view(); }, p);
  Array o1(DType::float32, {2, 5, 4, 9});
  expect_both("out shape", ErrorKind::value, "out", [&](Call& c) { c.out = o1.view(); }, p);
  Array l1(DType::float32, {2, 5, 4});
  expect_both(
      "lse shape (b, s, h)", ErrorKind::value, "lse", [&](Call& c) { c.lse = l1.view(); }, p);
  Array k3(DType::float32, {2, 7, 3, 8}), v3(DType::float32, {2, 7, 3, 8});
  expect_both(
      "nheads % nheads_kv", ErrorKind::value, "k",
      [&](Call& c) {
        c.k = k3.view();
        c.v = v3.view();
      },
      p, "3");
  for (int64_t d : {0, 257}) {
    Array qd(DType::float32, {1, 3, 1, d}), kk(DType::float32, {1, 3, 1, d}),
        vv(DType::float32, {1, 3, 1, d});
    Array od(DType::float32, {1, 3, 1, d}), ld(DType::float32, {1, 1, 3});
    Call c(p);
    c.q = qd.view(), c.k = kk.view(), c.v = vv.view(), c.out = od.view(), c.lse = ld.view();
    expect_error(
        "headdim " + std::to_string(d), ErrorKind::value, "q", [&] { c.forward(); }, p,
        std::to_string(d));
  }
}

void test_dtypes_devices_strides() {
  Problem p;
  Array qi(DType::int32, {2, 5, 4, 8}), oi(DType::int32, {2, 5, 4, 8});
  expect_both(
      "q int32", ErrorKind::type, "q",
      [&](Call& c) {
        c.q = qi.view();
        c.out = oi.view();
      },
      p, "int32");
  Array qb(DType::boolean, {2, 5, 4, 8});
  expect_both("q bool", ErrorKind::type, "q", [&](Call& c) { c.q = qb.view(); }, p);
  Array k16(DType::float16, {2, 7, 2, 8});
  expect_both(
      "k float16 with q float32", ErrorKind::type, "k", [&](Call& c) { c.k = k16.view(); }, p,
      "float16");
  Array o64(DType::float64, {2, 5, 4, 8});
  expect_both("out float64", ErrorKind::type, "out", [&](Call& c) { c.out = o64.view(); }, p);
  Array l64(DType::float64, {2, 4, 5}), l16(DType::float16, {2, 4, 5});
  expect_both("lse float64", ErrorKind::type, "lse", [&](Call& c) { c.lse = l64.view(); }, p);
  expect_both("lse float16", ErrorKind::type, "lse", [&](Call& c) { c.lse = l16.view(); }, p);
  expect_both(
      "v on cuda, q on cpu", ErrorKind::value, "v",
      [&](Call& c) { c.v.device = {flashdl::DeviceType::cuda, 0}; }, p, "cuda");
  expect_both(
      "q last stride 2", ErrorKind::value, "q", [&](Call& c) { c.q.strides[3] = 2; }, p,
      "contiguous");
  expect_both(
      "lse last stride 0", ErrorKind::value, "lse", [&](Call& c) { c.lse.strides[2] = 0; }, p);
  expect_both(
      "out overlapping q", ErrorKind::value, "out", [&](Call& c) { c.out = c.q; }, p, "overlaps q");
  expect_both(
      "lse inside out", ErrorKind::value, "lse", [&](Call& c) { c.lse.data = p.out.view().data; },
      p, "out");
  // Backward-only arguments.
  Call c(p);
  c.dq = c.dout;
  expect_error("dq overlapping dout", ErrorKind::value, "dq", [&] { c.backward(); }, p, "dout");
  c = Call(p);
  c.dv = c.dk;
  expect_error("dk overlapping dv", ErrorKind::value, "dk", [&] { c.backward(); }, p, "dv");
  c = Call(p);
  Array dq16(DType::float16, {2, 5, 4, 8});
  c.dq = dq16.view();
  expect_error("dq float16", ErrorKind::type, "dq", [&] { c.backward(); }, p);
  c = Call(p);
  Array dk1(DType::float32, {2, 7, 1, 8});
  c.dk = dk1.view();
  expect_error("dk shape", ErrorKind::value, "dk", [&] { c.backward(); }, p);
  c = Call(p);
  Array do3(DType::float32, {2, 5, 32});
  c.dout = do3.view();
  expect_error("dout rank 3", ErrorKind::value, "dout", [&] { c.backward(); }, p);
  c = Call(p);
  c.dv.strides[3] = 3;
  expect_error("dv last stride 3", ErrorKind::value, "dv", [&] { c.backward(); }, p);
}

void test_options() {
  Problem p;
  expect_both(
      "window_left -2", ErrorKind::value, "window_size", [](Call& c) { c.o.window_left = -2; }, p,
      "-2");
  expect_both(
      "window_right -5", ErrorKind::value, "window_size", [](Call& c) { c.o.window_right = -5; }, p,
      "-5");
  for (float d : {1.0f, -0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()})
    expect_both(
        "dropout_p " + std::to_string(d), ErrorKind::value, "dropout_p",
        [d](Call& c) { c.o.dropout_p = d; }, p);
  expect_both(
      "offset 2^32", ErrorKind::value, "offset", [](Call& c) { c.o.offset = uint64_t{1} << 32; },
      p);
  expect_both(
      "softmax_scale inf", ErrorKind::value, "softmax_scale",
      [](Call& c) { c.o.softmax_scale = INFINITY; }, p);
  expect_both(
      "softmax_scale above 1e30", ErrorKind::value, "softmax_scale",
      [](Call& c) { c.o.softmax_scale = -1.0000001e30; }, p, "<= 1e30");
  expect_both(
      "sram_bytes -1", ErrorKind::value, "sram_bytes", [](Call& c) { c.o.sram_bytes = -1; }, p);
  expect_both(
      "num_threads -1", ErrorKind::value, "num_threads", [](Call& c) { c.o.num_threads = -1; }, p);
  expect_both(
      "schedule code 9", ErrorKind::value, "schedule",
      [](Call& c) { c.o.schedule = static_cast<flashdl::Schedule>(9); }, p);
  expect_error(
      "parse_schedule('fa3')", ErrorKind::value, "schedule", [] { flashdl::parse_schedule("fa3"); },
      p, "fa3");
  expect_error(
      "parse_schedule('')", ErrorKind::value, "schedule", [] { flashdl::parse_schedule(""); }, p);
  expect_error(
      "set_num_threads(-1)", ErrorKind::value, "n", [] { flashdl::set_num_threads(-1); }, p);
  context() = "parse_schedule names";
  CHECK(flashdl::parse_schedule("auto") == flashdl::Schedule::automatic);
  CHECK(flashdl::parse_schedule("fa1") == flashdl::Schedule::fa1);
  CHECK(flashdl::parse_schedule("fa2") == flashdl::Schedule::fa2);
  CHECK(flashdl::parse_schedule("reference") == flashdl::Schedule::reference);
}

// Numbers in messages read as the caller wrote them (shortest round trip), not std::to_string's
// fixed six decimals ("1.500000", and "0.000000" for 1e-9).
void test_numbers_as_written() {
  Problem p;
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no exception");
  };
  auto ends_with = [](const std::string& msg, const std::string& tail) {
    context() = msg;
    CHECK(msg.size() >= tail.size() &&
          msg.compare(msg.size() - tail.size(), tail.size(), tail) == 0);
  };
  const std::pair<float, const char*> dropouts[] = {
      {1.5f, "got 1.5"}, {-0.1f, "got -0.1"}, {1.0f, "got 1"}, {-1e-9f, "got -1e-09"}};
  for (auto [d, tail] : dropouts) {
    Call c(p);
    c.o.dropout_p = d;
    ends_with(message([&] { c.forward(); }), tail);
  }
  Call c(p);
  c.o.softmax_scale = INFINITY;
  ends_with(message([&] { c.forward(); }), "got inf");
  Array mask(DType::boolean, {1, 1, 2, 2});
  ends_with(message([&] { flashdl::dropout_mask(mask.view(), 2.5, 0, 0); }), "got 2.5");
}

// Arrays on a CUDA device: in a build without CUDA the call is refused as unsupported.
void test_cuda_arrays() {
  const flashdl::BuildInfo info = flashdl::build_info();
  if (info.cuda_compiled) return;  // would launch on host memory; tests/cpp/cuda covers this build
  Problem p;
  Array q(DType::float16, {1, 4, 2, 64}), k(DType::float16, {1, 4, 2, 64}),
      v(DType::float16, {1, 4, 2, 64});
  Array out(DType::float16, {1, 4, 2, 64}), lse(DType::float32, {1, 2, 4});
  Call c(p);
  c.q = q.view(), c.k = k.view(), c.v = v.view(), c.out = out.view(), c.lse = lse.view();
  c.dout = q.view(), c.dq = out.view(), c.dk = k.view(), c.dv = v.view();
  for (TensorView* t : {&c.q, &c.k, &c.v, &c.out, &c.lse})
    t->device = {flashdl::DeviceType::cuda, 0};
  expect_error(
      "cuda arrays in a CPU-only build", ErrorKind::unsupported, "q", [&] { c.forward(); }, p,
      "CUDA");
  c.o.schedule = flashdl::Schedule::reference;
  expect_error(
      "reference schedule on cuda", ErrorKind::unsupported, "schedule", [&] { c.forward(); }, p);
  CHECK(info.cuda_device_count == 0);
}

// Zero-length extents are valid, and a valid call leaves its inputs untouched.
void test_accepted() {
  context() = "valid calls";
  Problem p;
  const auto before = p.inputs();
  for (auto s : {flashdl::Schedule::automatic, flashdl::Schedule::fa1, flashdl::Schedule::fa2,
                 flashdl::Schedule::reference}) {
    Call c(p);
    c.o.schedule = s;
    c.forward();
    c.backward();
  }
  CHECK_MSG(p.inputs() == before, "a valid call wrote an input");
  // Empty arrays may come with any strides (exporters often give 0): nothing is reached.
  {
    context() = "empty k with last stride 0";
    Array q(DType::float32, {1, 3, 2, 8}), k(DType::float32, {1, 0, 2, 8}),
        v(DType::float32, {1, 0, 2, 8});
    Array out(DType::float32, {1, 3, 2, 8}), lse(DType::float32, {1, 2, 3});
    TensorView kv = k.view();
    kv.strides = {0, 0, 0, 0};
    bool ok = true;
    try {
      flashdl::forward(q.view(), kv, v.view(), out.view(), lse.view(), Options{});
    } catch (const std::exception& e) {
      ok = false;
      CHECK_MSG(false, e.what());
    }
    CHECK(ok);
    for (double x : out.values()) CHECK(x == 0.0);
  }
  const int64_t shapes[][4] = {{0, 5, 7, 8}, {2, 0, 7, 8}, {2, 5, 0, 8}, {2, 0, 0, 8}};
  for (const auto& s : shapes) {
    context() = "zero-length b " + std::to_string(s[0]) + " sq " + std::to_string(s[1]) + " sk " +
                std::to_string(s[2]);
    Array q(DType::float32, {s[0], s[1], 4, s[3]}), k(DType::float32, {s[0], s[2], 2, s[3]});
    Array v(DType::float32, {s[0], s[2], 2, s[3]}), out(DType::float32, {s[0], s[1], 4, s[3]});
    Array lse(DType::float32, {s[0], 4, s[1]}), dq(DType::float32, {s[0], s[1], 4, s[3]});
    Array dk(DType::float32, {s[0], s[2], 2, s[3]}), dv(DType::float32, {s[0], s[2], 2, s[3]});
    Array dout(DType::float32, {s[0], s[1], 4, s[3]});
    for (auto sch :
         {flashdl::Schedule::fa1, flashdl::Schedule::fa2, flashdl::Schedule::reference}) {
      Options o;
      o.schedule = sch;
      bool ok = true;
      try {
        flashdl::forward(q.view(), k.view(), v.view(), out.view(), lse.view(), o);
        flashdl::backward(dout.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                          dq.view(), dk.view(), dv.view(), o);
      } catch (const std::exception& e) {
        ok = false;
        CHECK_MSG(false, e.what());
      }
      CHECK(ok);
    }
  }
}

// Varlen: arrays on the device of q (offsets on the host or that device), and cu_seqlens is checked
// before anything runs. Packed q (8, 4, 8), k, v (6, 2, 8), two sequences.
void test_varlen() {
  Problem p;
  Array q(DType::float32, {8, 4, 8}), k(DType::float32, {6, 2, 8}), v(DType::float32, {6, 2, 8});
  Array out(DType::float32, {8, 4, 8}), lse(DType::float32, {4, 8});
  std::vector<int32_t> cq{0, 3, 8}, ck{0, 4, 6}, bad{0, 5, 3};
  const TensorView tcq = flashdl::make_view(cq.data(), DType::int32, {3});
  const TensorView tck = flashdl::make_view(ck.data(), DType::int32, {3});
  const TensorView tbad = flashdl::make_view(bad.data(), DType::int32, {3});
  auto fwd = [&](TensorView tq, TensorView cu_q, int64_t max_q) {
    return [=, &k, &v, &out, &lse, &tck] {
      flashdl::forward_varlen(tq, k.view(), v.view(), cu_q, tck, max_q, 4, out.view(), lse.view(),
                              Options{});
    };
  };
  fwd(q.view(), tcq, 5)();  // valid
  TensorView qc = q.view();
  qc.device = {flashdl::DeviceType::cuda, 0};
  // CUDA q: every array on its device; the offsets on the host or on that same device.
  expect_error("varlen cuda q, cpu k", ErrorKind::value, "k", fwd(qc, tcq, 5), p, "cuda:0");
  TensorView cq_other = tcq;
  cq_other.device = {flashdl::DeviceType::cuda, 1};
  expect_error("varlen offsets on another gpu", ErrorKind::value, "cu_seqlens_q",
               fwd(qc, cq_other, 5), p, "device of q");
  expect_error("varlen offsets on a gpu, cpu q", ErrorKind::value, "cu_seqlens_q",
               fwd(q.view(), cq_other, 5), p, "CPU");
  expect_error("varlen decreasing", ErrorKind::value, "cu_seqlens_q", fwd(q.view(), tbad, 5), p,
               "non-decreasing");
  expect_error("varlen max_seqlen", ErrorKind::value, "max_seqlen_q", fwd(q.view(), tcq, 4), p);
  TensorView f = tcq;
  f.dtype = DType::float32;
  expect_error("varlen cu dtype", ErrorKind::type, "cu_seqlens_q", fwd(q.view(), f, 5), p, "int32");
}

// Block-sparse options, on q (2, 5, 4, 8), k (2, 7, 2, 8) with blocks 2 x 3: a 3 x 3 grid.
void test_block_mask() {
  Problem p;
  auto masked = [](const TensorView& m) {
    return [m](Call& c) {
      c.o.block_mask = m;
      c.o.block_size_q = 2;
      c.o.block_size_k = 3;
    };
  };
  const TensorView m = p.mask.view();
  Array m2(DType::boolean, {3, 3}), b1(DType::boolean, {1, 4, 3, 3}),
      h1(DType::boolean, {2, 1, 3, 3});
  Array strided(DType::boolean, {2, 4, 3, 3}, Layout{{2, 0, 1}, 5, 1});
  for (const Array* a : {&p.mask, &m2, &b1, &h1, &strided}) {  // valid masks first
    context() = "valid mask " + std::to_string(a->view().rank);
    Call c(p);
    masked(a->view())(c);
    c.forward();
    c.backward();
  }
  expect_both(
      "block_size_q 0", ErrorKind::value, "block_size",
      [&](Call& c) {
        masked(m)(c);
        c.o.block_size_q = 0;
      },
      p, "(0, 3)");
  expect_both(
      "block_size_k -1 with no mask", ErrorKind::value, "block_size",
      [](Call& c) { c.o.block_size_k = -1; }, p, "-1");
  Array r3(DType::boolean, {4, 3, 3}), r1(DType::boolean, {9});
  expect_both("mask rank 3", ErrorKind::value, "block_mask", masked(r3.view()), p, "rank 2 or 4");
  expect_both("mask rank 1", ErrorKind::value, "block_mask", masked(r1.view()), p, "rank 2 or 4");
  TensorView neg = m;
  neg.shape[0] = -2;
  expect_both("mask negative extent", ErrorKind::value, "block_mask", masked(neg), p);
  TensorView null = m;
  null.data = nullptr;
  expect_both("mask null data", ErrorKind::value, "block_mask", masked(null), p, "null");
  Array f32(DType::float32, {2, 4, 3, 3}), i32(DType::int32, {3, 3});
  expect_both("mask float32", ErrorKind::type, "block_mask", masked(f32.view()), p, "bool");
  expect_both("mask int32", ErrorKind::type, "block_mask", masked(i32.view()), p, "int32");
  TensorView on_cuda = m;
  on_cuda.device = {flashdl::DeviceType::cuda, 0};
  expect_both("mask on cuda, q on cpu", ErrorKind::value, "block_mask", masked(on_cuda), p, "cuda");
  // The wrong grid, batch or heads (heads are query heads: nheads_kv 2 is wrong).
  Array g1(DType::boolean, {3, 4}), g2(DType::boolean, {2, 3}), g3(DType::boolean, {2, 4, 4, 3});
  Array g4(DType::boolean, {3, 4, 3, 3}), g5(DType::boolean, {2, 2, 3, 3}),
      g6(DType::boolean, {4, 2, 3, 3});
  for (const Array* a : {&g1, &g2, &g3, &g4, &g5, &g6})
    expect_both("mask shape " + std::to_string(a->numel()), ErrorKind::value, "block_mask",
                masked(a->view()), p, "(3, 3) or (2, 4, 3, 3)");
  expect_both(
      "default block sizes 128", ErrorKind::value, "block_mask",
      [&](Call& c) { c.o.block_mask = m; }, p, "(1, 1)");
  Array wide(DType::boolean, {2, 4, 3, 6});
  TensorView gap = wide.view();
  gap.shape[3] = 3;
  gap.strides[3] = 2;
  expect_both("mask last stride 2", ErrorKind::value, "block_mask", masked(gap), p, "contiguous");
  // Outputs overlapping the mask (flags read from the output's own memory).
  auto inside = [&](const Array& a) {
    TensorView v = m2.view();
    v.data = a.view().data;
    return v;
  };
  for (auto [name, a] : {std::pair<const char*, const Array*>{"out", &p.out},
                         {"lse", &p.lse},
                         {"dq", &p.dq},
                         {"dk", &p.dk},
                         {"dv", &p.dv}}) {
    Call c(p);
    masked(inside(*a))(c);
    const bool forward_output = a == &p.out || a == &p.lse;
    expect_error(
        std::string(name) + " overlapping the mask", ErrorKind::value, name,
        [&] {
          if (forward_output)
            c.forward();
          else
            c.backward();
        },
        p, "block_mask");
  }
  // A CUDA q (float16, headdim 64: otherwise valid there) with a mask on the CPU: the mask must be
  // on the device of q (the kernels read it there; no silent copy).
  Array q(DType::float16, {1, 4, 2, 64}), k(DType::float16, {1, 4, 2, 64}),
      v(DType::float16, {1, 4, 2, 64});
  Array out(DType::float16, {1, 4, 2, 64}), lse(DType::float32, {1, 2, 4}),
      cm(DType::boolean, {2, 2});
  Array dq(DType::float16, {1, 4, 2, 64}), dk(DType::float16, {1, 4, 2, 64}),
      dv(DType::float16, {1, 4, 2, 64});
  Call c(p);
  c.q = q.view(), c.k = k.view(), c.v = v.view(), c.out = out.view(), c.lse = lse.view();
  c.dout = q.view(), c.dq = dq.view(), c.dk = dk.view(), c.dv = dv.view();
  for (TensorView* t : {&c.q, &c.k, &c.v, &c.out, &c.lse, &c.dout, &c.dq, &c.dk, &c.dv})
    t->device = {flashdl::DeviceType::cuda, 0};
  masked(cm.view())(c);
  expect_error(
      "forward: cpu mask with cuda q", ErrorKind::value, "block_mask", [&] { c.forward(); }, p,
      "cuda:0");
  expect_error(
      "backward: cpu mask with cuda q", ErrorKind::value, "block_mask", [&] { c.backward(); }, p,
      "cuda:0");
}

// Varlen block masks: sized by the batch of sequences and max_seqlen, not by the packed totals.
// Packed q (8, 4, 8), k (6, 2, 8), two sequences, max_seqlen (5, 4), blocks 2 x 3: a 3 x 2 grid.
void test_varlen_block_mask() {
  Problem p;
  Array q(DType::float32, {8, 4, 8}), k(DType::float32, {6, 2, 8}), v(DType::float32, {6, 2, 8});
  Array out(DType::float32, {8, 4, 8}), lse(DType::float32, {4, 8});
  Array dq(DType::float32, {8, 4, 8}), dk(DType::float32, {6, 2, 8}), dv(DType::float32, {6, 2, 8});
  Rng rng(3);
  for (Array* a : {&q, &k, &v}) a->fill_random(rng, 1.0);
  std::vector<int32_t> cq{0, 3, 8}, ck{0, 4, 6};
  const TensorView tcq = flashdl::make_view(cq.data(), DType::int32, {3});
  const TensorView tck = flashdl::make_view(ck.data(), DType::int32, {3});
  Array m2(DType::boolean, {3, 2}), m4(DType::boolean, {2, 4, 3, 2}),
      m1(DType::boolean, {1, 4, 3, 2});
  const auto before = {q.byte_copy(), k.byte_copy(), v.byte_copy(), m2.byte_copy(), m4.byte_copy()};
  // forward_varlen, or backward_varlen (with q as dout) on what the forward left in out and lse.
  auto call = [&](const TensorView& m, int64_t block_q, bool backward) {
    return [&, m, block_q, backward] {
      Options o;
      o.block_mask = m;
      o.block_size_q = block_q;
      o.block_size_k = 3;
      if (!backward)
        flashdl::forward_varlen(q.view(), k.view(), v.view(), tcq, tck, 5, 4, out.view(),
                                lse.view(), o);
      else
        flashdl::backward_varlen(q.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                                 tcq, tck, 5, 4, dq.view(), dk.view(), dv.view(), o);
    };
  };
  for (const Array* a : {&m2, &m4, &m1}) {
    context() = "valid varlen mask of rank " + std::to_string(a->view().rank);
    call(a->view(), 2, false)();
    call(a->view(), 2, true)();
  }
  Array total(DType::boolean, {4, 2}), seqs(DType::boolean, {3, 4, 3, 2}),
      r3(DType::boolean, {2, 3, 2});
  Array f32(DType::float32, {3, 2}), wide(DType::boolean, {3, 4});
  TensorView cuda = m2.view(), gap = wide.view(), in_out = m2.view(), in_dq = m2.view();
  cuda.device = {flashdl::DeviceType::cuda, 0};
  gap.shape[1] = 2, gap.strides[1] = 2;
  in_out.data = out.view().data;
  in_dq.data = dq.view().data;
  for (bool bwd : {false, true}) {
    const std::string pass = bwd ? "backward_varlen: " : "forward_varlen: ";
    expect_error(pass + "block_size 0", ErrorKind::value, "block_size", call(m2.view(), 0, bwd), p);
    expect_error(pass + "grid of the totals", ErrorKind::value, "block_mask",
                 call(total.view(), 2, bwd), p, "(3, 2) or (2, 4, 3, 2)");
    expect_error(pass + "3 planes for 2 sequences", ErrorKind::value, "block_mask",
                 call(seqs.view(), 2, bwd), p);
    expect_error(pass + "rank 3", ErrorKind::value, "block_mask", call(r3.view(), 2, bwd), p);
    expect_error(pass + "float32", ErrorKind::type, "block_mask", call(f32.view(), 2, bwd), p);
    expect_error(pass + "on cuda", ErrorKind::value, "block_mask", call(cuda, 2, bwd), p);
    expect_error(pass + "last stride 2", ErrorKind::value, "block_mask", call(gap, 2, bwd), p,
                 "contiguous");
  }
  // Outputs overlapping the mask: out in the forward, dq in the backward.
  expect_error("forward_varlen: out overlapping", ErrorKind::value, "out", call(in_out, 2, false),
               p, "block_mask");
  expect_error("backward_varlen: dq overlapping", ErrorKind::value, "dq", call(in_dq, 2, true), p,
               "block_mask");
  context() = "varlen block_mask calls";
  const auto after = {q.byte_copy(), k.byte_copy(), v.byte_copy(), m2.byte_copy(), m4.byte_copy()};
  CHECK_MSG(std::equal(before.begin(), before.end(), after.begin()),
            "a varlen call wrote an input");
}

// Score modifiers on q (2, 5, 4, 8): softcap finite and >= 0; ALiBi slopes float32 of shape
// (nheads,) = (4,) or (batch, nheads) = (2, 4), on the device of q, last dimension contiguous,
// finite (CPU slopes are read: only the elements the kernels read), overlapping no output.
void test_score_mods() {
  Problem p;
  Array s1(DType::float32, {4}), s2(DType::float32, {2, 4});
  Array padded(DType::float32, {2, 4}, Layout{{}, 3, -1});  // rows 7 apart, 3 unused
  padded.poison();  // NaN everywhere, then finite slopes in the 8 elements the kernels read
  s1.assign({0.5, 0.25, 0.125, 0.0625});
  s2.assign({0.5, 0.25, 0.125, 0.0625, 1.0, 0.0, -0.5, 2.0});
  padded.assign({0.5, 0.25, 0.125, 0.0625, 1.0, 0.0, -0.5, 2.0});
  TensorView broadcast = s1.view();  // (nheads,) as (batch, nheads) with batch stride 0
  broadcast.rank = 2;
  broadcast.shape[0] = 2, broadcast.shape[1] = 4;
  broadcast.strides[0] = 0, broadcast.strides[1] = 1;
  const auto saved = {s1.byte_copy(), s2.byte_copy(), padded.byte_copy()};
  auto slopes = [](const TensorView& a, double softcap = 0.0) {
    return [a, softcap](Call& c) {
      c.o.alibi_slopes = a;
      c.o.softcap = softcap;
    };
  };
  for (const TensorView& a : {TensorView{}, s1.view(), s2.view(), broadcast, padded.view()})
    for (double softcap : {0.0, 1e-30, 1e-3, 2.5, 1e6, 1e30}) {  // valid: both passes run
      context() = "valid slopes of rank " + std::to_string(a.rank) + ", softcap " + num(softcap);
      Call c(p);
      slopes(a, softcap)(c);
      c.forward();
      c.backward();
    }
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::pair<double, const char*> caps[] = {
      {-1.0, "got -1"},           {-1e-300, "got -1e-300"},
      {-INFINITY, "got -inf"},    {INFINITY, "got inf"},
      {nan, "got nan"},           {1e-300, "[1e-30, 1e30], got 1e-300"},
      {9.99e-31, "got 9.99e-31"}, {1.0000001e30, "got 1.0000001e+30"}};
  for (auto [cap, tail] : caps)
    expect_both("softcap " + num(cap), ErrorKind::value, "softcap", slopes(TensorView{}, cap), p,
                tail);
  // The wrong shapes; the message names both accepted ones.
  Array w3(DType::float32, {3}), w2(DType::float32, {2}), w14(DType::float32, {1, 4});
  Array w42(DType::float32, {4, 2}), w34(DType::float32, {3, 4}), w241(DType::float32, {2, 4, 1});
  Array w0(DType::float32, {0});
  for (const Array* a : {&w3, &w2, &w14, &w42, &w34, &w241, &w0})
    expect_both("slopes shape of " + std::to_string(a->numel()) + " elements, rank " +
                    std::to_string(a->view().rank),
                ErrorKind::value, "alibi_slopes", slopes(a->view()), p, "(4,) or (2, 4)");
  TensorView neg = s1.view();
  neg.shape[0] = -4;
  expect_both("slopes negative extent", ErrorKind::value, "alibi_slopes", slopes(neg), p);
  TensorView null = s1.view();
  null.data = nullptr;
  expect_both("slopes null data", ErrorKind::value, "alibi_slopes", slopes(null), p, "null");
  Array f64(DType::float64, {4}), f16(DType::float16, {4}), bf16(DType::bfloat16, {2, 4});
  Array i32(DType::int32, {4});
  for (const Array* a : {&f64, &f16, &bf16, &i32})
    expect_both("slopes dtype", ErrorKind::type, "alibi_slopes", slopes(a->view()), p, "float32");
  TensorView on_cuda = s1.view();
  on_cuda.device = {flashdl::DeviceType::cuda, 0};
  expect_both("slopes on cuda, q on cpu", ErrorKind::value, "alibi_slopes", slopes(on_cuda), p,
              "cuda");
  Array wide(DType::float32, {8});
  TensorView gap = wide.view();
  gap.shape[0] = 4, gap.strides[0] = 2;
  expect_both("slopes last stride 2", ErrorKind::value, "alibi_slopes", slopes(gap), p,
              "contiguous");
  // Non-finite slopes, named with their index.
  Array n1 = s1, n2 = s2, n3 = padded;
  n1.set(1, nan);
  n2.set(6, INFINITY);   // [1, 2]
  n3.set(3, -INFINITY);  // [0, 3] of the padded layout
  expect_both("slopes nan", ErrorKind::value, "alibi_slopes", slopes(n1.view()), p, "nan at [1]");
  expect_both("slopes inf", ErrorKind::value, "alibi_slopes", slopes(n2.view()), p,
              "inf at [1, 2]");
  expect_both("slopes -inf, padded rows", ErrorKind::value, "alibi_slopes", slopes(n3.view()), p,
              "-inf at [0, 3]");
  // Outputs overlapping the slopes (read from the output's own memory).
  for (auto [name, a] : {std::pair<const char*, const Array*>{"out", &p.out},
                         {"lse", &p.lse},
                         {"dq", &p.dq},
                         {"dk", &p.dk},
                         {"dv", &p.dv}}) {
    TensorView inside = s1.view();
    inside.data = a->view().data;
    Call c(p);
    slopes(inside)(c);
    const bool forward_output = a == &p.out || a == &p.lse;
    expect_error(
        std::string(name) + " overlapping the slopes", ErrorKind::value, name,
        [&] {
          if (forward_output)
            c.forward();
          else
            c.backward();
        },
        p, "alibi_slopes");
  }
  // A CUDA q with CPU slopes: the slopes must be on the device of q (no silent copy).
  Array q(DType::float16, {1, 4, 2, 64}), k(DType::float16, {1, 4, 2, 64}),
      v(DType::float16, {1, 4, 2, 64});
  Array out(DType::float16, {1, 4, 2, 64}), lse(DType::float32, {1, 2, 4}), cs(DType::float32, {2});
  Array dq(DType::float16, {1, 4, 2, 64}), dk(DType::float16, {1, 4, 2, 64}),
      dv(DType::float16, {1, 4, 2, 64});
  Call c(p);
  c.q = q.view(), c.k = k.view(), c.v = v.view(), c.out = out.view(), c.lse = lse.view();
  c.dout = q.view(), c.dq = dq.view(), c.dk = dk.view(), c.dv = dv.view();
  for (TensorView* t : {&c.q, &c.k, &c.v, &c.out, &c.lse, &c.dout, &c.dq, &c.dk, &c.dv})
    t->device = {flashdl::DeviceType::cuda, 0};
  slopes(cs.view())(c);
  expect_error(
      "forward: cpu slopes with cuda q", ErrorKind::value, "alibi_slopes", [&] { c.forward(); }, p,
      "cuda:0");
  expect_error(
      "backward: cpu slopes with cuda q", ErrorKind::value, "alibi_slopes", [&] { c.backward(); },
      p, "cuda:0");
  context() = "score-modifier calls";
  const auto after = {s1.byte_copy(), s2.byte_copy(), padded.byte_copy()};
  CHECK_MSG(std::equal(saved.begin(), saved.end(), after.begin()), "a call wrote the slopes");
}

// Varlen slopes: (nheads,) or (sequences, nheads), not sized by the packed totals. Packed q
// (8, 4, 8), k (6, 2, 8), two sequences.
void test_varlen_score_mods() {
  Problem p;
  Array q(DType::float32, {8, 4, 8}), k(DType::float32, {6, 2, 8}), v(DType::float32, {6, 2, 8});
  Array out(DType::float32, {8, 4, 8}), lse(DType::float32, {4, 8});
  Array dq(DType::float32, {8, 4, 8}), dk(DType::float32, {6, 2, 8}), dv(DType::float32, {6, 2, 8});
  Rng rng(5);
  for (Array* a : {&q, &k, &v}) a->fill_random(rng, 1.0);
  std::vector<int32_t> cq{0, 3, 8}, ck{0, 4, 6};
  const TensorView tcq = flashdl::make_view(cq.data(), DType::int32, {3});
  const TensorView tck = flashdl::make_view(ck.data(), DType::int32, {3});
  Array s1(DType::float32, {4}), s2(DType::float32, {2, 4}), total(DType::float32, {8, 4});
  Array three(DType::float32, {3, 4}), nanrow(DType::float32, {2, 4});
  for (Array* a : {&s1, &s2, &total, &three, &nanrow}) a->fill_random(rng, 1.0);
  nanrow.set(5, std::numeric_limits<double>::quiet_NaN());  // [1, 1]
  const auto before = {q.byte_copy(), k.byte_copy(), v.byte_copy(), s2.byte_copy()};
  auto call = [&](const TensorView& a, double softcap, bool backward) {
    return [&, a, softcap, backward] {
      Options o;
      o.alibi_slopes = a;
      o.softcap = softcap;
      if (!backward)
        flashdl::forward_varlen(q.view(), k.view(), v.view(), tcq, tck, 5, 4, out.view(),
                                lse.view(), o);
      else
        flashdl::backward_varlen(q.view(), q.view(), k.view(), v.view(), out.view(), lse.view(),
                                 tcq, tck, 5, 4, dq.view(), dk.view(), dv.view(), o);
    };
  };
  for (const Array* a : {&s1, &s2}) {
    context() = "valid varlen slopes of rank " + std::to_string(a->view().rank);
    call(a->view(), 1.5, false)();
    call(a->view(), 1.5, true)();
  }
  for (bool bwd : {false, true}) {
    const std::string pass = bwd ? "backward_varlen: " : "forward_varlen: ";
    expect_error(pass + "slopes sized by total_q", ErrorKind::value, "alibi_slopes",
                 call(total.view(), 0.0, bwd), p, "(4,) or (2, 4)");
    expect_error(pass + "3 rows for 2 sequences", ErrorKind::value, "alibi_slopes",
                 call(three.view(), 0.0, bwd), p, "(4,) or (2, 4)");
    expect_error(pass + "nan slope", ErrorKind::value, "alibi_slopes",
                 call(nanrow.view(), 0.0, bwd), p, "nan at [1, 1]");
    expect_error(pass + "softcap -2", ErrorKind::value, "softcap", call(TensorView{}, -2.0, bwd),
                 p);
    expect_error(pass + "softcap nan", ErrorKind::value, "softcap",
                 call(s2.view(), std::numeric_limits<double>::quiet_NaN(), bwd), p);
  }
  context() = "varlen score-modifier calls";
  const auto after = {q.byte_copy(), k.byte_copy(), v.byte_copy(), s2.byte_copy()};
  CHECK_MSG(std::equal(before.begin(), before.end(), after.begin()),
            "a varlen call wrote an input");
}

// Written arrays: refused when they address one element twice (stride 0, or strides that may
// collide), or when two of them share an element; interleaved views of one buffer that share no
// element are accepted and computed as separate arrays would be.
void test_written_overlap() {
  Problem p;
  expect_both(
      "out expanded over seqlen", ErrorKind::value, "out", [&](Call& c) { c.out.strides[1] = 0; },
      p, "stride 0 on axis 1");
  expect_both(
      "out rows on top of heads", ErrorKind::value, "out",
      [&](Call& c) { c.out.strides = {40, 8, 8, 1}; }, p, "may address one element");
  {
    Call c(p);
    c.dk.strides[0] = 0;
    expect_error(
        "dk expanded over batch", ErrorKind::value, "dk", [&] { c.backward(); }, p,
        "stride 0 on axis 0");
  }
  // out and dq interleaved in one (2, 5, 8, 8) buffer: heads 0-3 and 4-7.
  Array buf(DType::float32, {2, 5, 8, 8});
  TensorView lo = buf.view(), hi = buf.view();
  lo.shape[2] = hi.shape[2] = 4;
  hi.data = static_cast<char*>(hi.data) + 4 * 8 * sizeof(float);
  {
    context() = "out written into heads 4-7 of a shared buffer";
    Call ref(p);
    ref.forward();
    const std::vector<double> expected = p.out.values();
    Call c(p);
    c.out = hi;  // heads 4-7 of the buffer; heads 0-3 hold other data
    c.forward();
    Array check(DType::float32, {2, 5, 4, 8});
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t s = 0; s < 5; ++s)
        for (int64_t h = 0; h < 4; ++h)
          for (int64_t d = 0; d < 8; ++d)
            CHECK(buf.get(((b * 5 + s) * 8 + h + 4) * 8 + d) ==
                  expected[((b * 5 + s) * 4 + h) * 8 + d]);
  }
  {
    context() = "dq and dk interleaved, disjoint";
    Problem g;  // nheads_kv = nheads so that dq and dk can share the buffer's layout
    Array k4(DType::float32, {2, 5, 4, 8}), v4(DType::float32, {2, 5, 4, 8});
    Rng rng(3);
    k4.fill_random(rng, 1.0);
    v4.fill_random(rng, 1.0);
    Call c(g);
    c.k = k4.view(), c.v = v4.view();
    c.forward();
    c.dq = lo, c.dk = hi;
    Array dv(DType::float32, {2, 5, 4, 8});
    c.dv = dv.view();
    bool ok = true;
    try {
      c.backward();
    } catch (const std::exception& e) {
      ok = false;
      CHECK_MSG(false, e.what());
    }
    CHECK(ok);
    TensorView shifted = lo;  // heads 1-4: shares heads 1-3 with lo
    shifted.data = static_cast<char*>(lo.data) + 8 * sizeof(float);
    c.dk = shifted;
    expect_error(
        "dq and dk sharing heads", ErrorKind::value, "dq", [&] { c.backward(); }, g, "overlaps dk");
  }
}

}  // namespace

// Bias, mask, sinks and their gradients: each refusal names its argument; CUDA arrays are refused
// with NotImplementedError (ErrorKind::not_implemented) before anything runs, in every build.
void test_extras() {
  Problem p;
  Array bias(DType::float32, {1, 4, 5, 7}), dbias(DType::float32, {1, 4, 5, 7});
  Array ibias(DType::int32, {1, 4, 5, 7}), fmask(DType::float32, {1, 1, 5, 7});
  Array mask(DType::boolean, {2, 1, 5, 7}), sinks(DType::float32, {4}), dsinks(DType::float32, {4});
  Array short_sinks(DType::float32, {3}), wide(DType::float32, {1, 4, 5, 8});
  auto with = [&](auto edit) { return [&, edit](Call& c) { edit(c.o); }; };
  expect_both("sinks of length 3", ErrorKind::value, "sinks",
              with([&](Options& o) { o.sinks = short_sinks.view(); }), p, "(4,)");
  expect_both("bias int32", ErrorKind::type, "bias",
              with([&](Options& o) { o.bias = ibias.view(); }), p, "int32");
  expect_both("bias with seqlen_k 8", ErrorKind::value, "bias",
              with([&](Options& o) { o.bias = wide.view(); }), p, "(2, 4, 5, 7)");
  expect_both("mask float32", ErrorKind::type, "mask",
              with([&](Options& o) { o.mask = fmask.view(); }), p, "bool");
  Call c(p);
  c.o.dbias = dbias.view();
  expect_error("dbias without bias", ErrorKind::value, "dbias", [&] { c.backward(); }, p);
  c.o.bias = bias.view();
  c.o.dbias = wide.view();
  expect_error("dbias of another shape", ErrorKind::value, "dbias", [&] { c.backward(); }, p);
  TensorView spread = bias.view();
  spread.shape[0] = 2;
  spread.strides[0] = 0;  // a batch axis broadcast with stride 0: dbias cannot sum into it
  Array dspread(DType::float32, {2, 4, 5, 7});
  c.o.bias = spread;
  c.o.dbias = dspread.view();
  expect_error(
      "dbias of a stride-0 bias", ErrorKind::value, "bias", [&] { c.backward(); }, p,
      "stride of 0");
  c.o.bias = TensorView{};
  c.o.dbias = TensorView{};
  c.o.dsinks = dsinks.view();
  expect_error("dsinks without sinks", ErrorKind::value, "dsinks", [&] { c.backward(); }, p);

  // CUDA arrays: accepted by the checks (the CUDA kernels take bias, mask and sinks); checked
  // with validate_only, so no device (and no CUDA build) is needed.
  Array q(DType::float16, {1, 4, 2, 64}), k(DType::float16, {1, 4, 2, 64}),
      v(DType::float16, {1, 4, 2, 64});
  Array out(DType::float16, {1, 4, 2, 64}), lse(DType::float32, {1, 2, 4});
  Array cbias(DType::float16, {1, 2, 4, 4}), cmask(DType::boolean, {1, 1, 4, 4}),
      csinks(DType::float32, {2});
  Call g(p);
  g.q = q.view(), g.k = k.view(), g.v = v.view(), g.out = out.view(), g.lse = lse.view();
  for (TensorView* t : {&g.q, &g.k, &g.v, &g.out, &g.lse})
    t->device = {flashdl::DeviceType::cuda, 0};
  const flashdl::Device gpu{flashdl::DeviceType::cuda, 0};
  for (auto [name, view] : {std::pair<const char*, TensorView>{"bias", cbias.view()},
                            {"mask", cmask.view()},
                            {"sinks", csinks.view()}}) {
    Call one = g;
    view.device = gpu;
    if (std::string(name) == "bias") one.o.bias = view;
    if (std::string(name) == "mask") one.o.mask = view;
    if (std::string(name) == "sinks") one.o.sinks = view;
    one.o.validate_only = true;
    bool threw = false;
    try {
      one.forward();
    } catch (const flashdl::Error&) {
      threw = true;
    }
    CHECK(!threw);
  }
}

int main() {
  run_test("validation: ranks and shapes", test_shapes_and_ranks);
  run_test("validation: dtypes, devices, strides, overlaps", test_dtypes_devices_strides);
  run_test("validation: options", test_options);
  run_test("validation: written arrays overlapping themselves or each other", test_written_overlap);
  run_test("validation: numbers as written", test_numbers_as_written);
  run_test("validation: CUDA arrays", test_cuda_arrays);
  run_test("validation: valid and zero-length calls", test_accepted);
  run_test("validation: varlen", test_varlen);
  run_test("validation: block_mask and block sizes", test_block_mask);
  run_test("validation: varlen block_mask", test_varlen_block_mask);
  run_test("validation: softcap and alibi_slopes", test_score_mods);
  run_test("validation: varlen softcap and alibi_slopes", test_varlen_score_mods);
  run_test("validation: bias, mask, sinks and their gradients", test_extras);
  return finish();
}
