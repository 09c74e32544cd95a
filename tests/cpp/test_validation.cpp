// Every bad argument throws flashdl::Error of the right kind, with a message that starts with the
// argument's name; no call (failing or not) writes into an input; zero-length problems pass.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"

using namespace flashdl_test;
using flashdl::Error;
using flashdl::ErrorKind;
using flashdl::Options;
using flashdl::TensorView;

namespace {

const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::value: return "value";
    case ErrorKind::type: return "type";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::runtime: return "runtime";
  }
  return "?";
}

// A valid problem: q (2, 5, 4, 8), k, v (2, 7, 2, 8), all float32, plus outputs and gradients.
struct Problem {
  Array q{DType::float32, {2, 5, 4, 8}}, k{DType::float32, {2, 7, 2, 8}}, v{DType::float32, {2, 7, 2, 8}};
  Array dout{DType::float32, {2, 5, 4, 8}};
  Array out{DType::float32, {2, 5, 4, 8}}, lse{DType::float32, {2, 4, 5}};
  Array dq{DType::float32, {2, 5, 4, 8}}, dk{DType::float32, {2, 7, 2, 8}}, dv{DType::float32, {2, 7, 2, 8}};
  Problem() {
    Rng rng(1);
    for (Array* a : {&q, &k, &v, &dout}) a->fill_random(rng, 1.0);
  }
};

// The views of one call; a test changes some of them.
struct Call {
  TensorView q, k, v, out, lse, dout, dq, dk, dv;
  Options o;
  explicit Call(const Problem& p)
      : q(p.q.view()), k(p.k.view()), v(p.v.view()), out(p.out.view()), lse(p.lse.view()),
        dout(p.dout.view()), dq(p.dq.view()), dk(p.dk.view()), dv(p.dv.view()) {}
  void forward() const { flashdl::forward(q, k, v, out, lse, o); }
  void backward() const { flashdl::backward(dout, q, k, v, out, lse, dq, dk, dv, o); }
};

// Runs fn, expects Error(kind) whose message starts with "<arg>:" (and contains `detail`), and
// that none of the inputs changed.
void expect_error(const std::string& what, ErrorKind kind, const std::string& arg,
                  const std::function<void()>& fn, const Problem& p, const std::string& detail = "") {
  context() = what;
  const auto before = {p.q.byte_copy(), p.k.byte_copy(), p.v.byte_copy(), p.dout.byte_copy()};
  bool thrown = false;
  try {
    fn();
  } catch (const Error& e) {
    thrown = true;
    const std::string msg = e.what();
    CHECK_MSG(e.kind() == kind, std::string("kind ") + kind_name(e.kind()) + ", expected " +
                                    kind_name(kind) + ": " + msg);
    CHECK_MSG(msg.rfind(arg + ":", 0) == 0, "message does not start with '" + arg + ":': " + msg);
    CHECK_MSG(detail.empty() || msg.find(detail) != std::string::npos,
              "message lacks '" + detail + "': " + msg);
  } catch (const std::exception& e) {
    thrown = true;
    CHECK_MSG(false, std::string("not a flashdl::Error: ") + e.what());
  }
  CHECK_MSG(thrown, "no exception");
  const auto after = {p.q.byte_copy(), p.k.byte_copy(), p.v.byte_copy(), p.dout.byte_copy()};
  CHECK_MSG(std::equal(before.begin(), before.end(), after.begin()), "an input was written");
}

// Both entry points see the same forward arguments: check each error on both.
void expect_both(const std::string& what, ErrorKind kind, const std::string& arg,
                 const std::function<void(Call&)>& edit, const Problem& p,
                 const std::string& detail = "") {
  Call c(p);
  edit(c);
  expect_error("forward: " + what, kind, arg, [&] { c.forward(); }, p, detail);
  expect_error("backward: " + what, kind, arg, [&] { c.backward(); }, p, detail);
}

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
  expect_both("lse shape (b, s, h)", ErrorKind::value, "lse", [&](Call& c) { c.lse = l1.view(); }, p);
  Array k3(DType::float32, {2, 7, 3, 8}), v3(DType::float32, {2, 7, 3, 8});
  expect_both("nheads % nheads_kv", ErrorKind::value, "k",
              [&](Call& c) { c.k = k3.view(); c.v = v3.view(); }, p, "3");
  for (int64_t d : {0, 257}) {
    Array qd(DType::float32, {1, 3, 1, d}), kk(DType::float32, {1, 3, 1, d}), vv(DType::float32, {1, 3, 1, d});
    Array od(DType::float32, {1, 3, 1, d}), ld(DType::float32, {1, 1, 3});
    Call c(p);
    c.q = qd.view(), c.k = kk.view(), c.v = vv.view(), c.out = od.view(), c.lse = ld.view();
    expect_error("headdim " + std::to_string(d), ErrorKind::value, "q", [&] { c.forward(); }, p,
                 std::to_string(d));
  }
}

void test_dtypes_devices_strides() {
  Problem p;
  Array qi(DType::int32, {2, 5, 4, 8}), oi(DType::int32, {2, 5, 4, 8});
  expect_both("q int32", ErrorKind::type, "q", [&](Call& c) { c.q = qi.view(); c.out = oi.view(); },
              p, "int32");
  Array qb(DType::boolean, {2, 5, 4, 8});
  expect_both("q bool", ErrorKind::type, "q", [&](Call& c) { c.q = qb.view(); }, p);
  Array k16(DType::float16, {2, 7, 2, 8});
  expect_both("k float16 with q float32", ErrorKind::type, "k", [&](Call& c) { c.k = k16.view(); },
              p, "float16");
  Array o64(DType::float64, {2, 5, 4, 8});
  expect_both("out float64", ErrorKind::type, "out", [&](Call& c) { c.out = o64.view(); }, p);
  Array l64(DType::float64, {2, 4, 5}), l16(DType::float16, {2, 4, 5});
  expect_both("lse float64", ErrorKind::type, "lse", [&](Call& c) { c.lse = l64.view(); }, p);
  expect_both("lse float16", ErrorKind::type, "lse", [&](Call& c) { c.lse = l16.view(); }, p);
  expect_both("v on cuda, q on cpu", ErrorKind::value, "v",
              [&](Call& c) { c.v.device = {flashdl::DeviceType::cuda, 0}; }, p, "cuda");
  expect_both("q last stride 2", ErrorKind::value, "q", [&](Call& c) { c.q.strides[3] = 2; }, p,
              "contiguous");
  expect_both("lse last stride 0", ErrorKind::value, "lse", [&](Call& c) { c.lse.strides[2] = 0; }, p);
  expect_both("out overlapping q", ErrorKind::value, "out", [&](Call& c) { c.out = c.q; }, p, "overlaps q");
  expect_both("lse inside out", ErrorKind::value, "lse", [&](Call& c) {
    c.lse.data = p.out.view().data;
  }, p, "out");
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
  expect_both("window_left -2", ErrorKind::value, "window_size", [](Call& c) { c.o.window_left = -2; },
              p, "-2");
  expect_both("window_right -5", ErrorKind::value, "window_size",
              [](Call& c) { c.o.window_right = -5; }, p, "-5");
  for (float d : {1.0f, -0.1f, 1.5f, std::numeric_limits<float>::quiet_NaN()})
    expect_both("dropout_p " + std::to_string(d), ErrorKind::value, "dropout_p",
                [d](Call& c) { c.o.dropout_p = d; }, p);
  expect_both("offset 2^32", ErrorKind::value, "offset",
              [](Call& c) { c.o.offset = uint64_t{1} << 32; }, p);
  expect_both("softmax_scale inf", ErrorKind::value, "softmax_scale",
              [](Call& c) { c.o.softmax_scale = INFINITY; }, p);
  expect_both("sram_bytes -1", ErrorKind::value, "sram_bytes", [](Call& c) { c.o.sram_bytes = -1; }, p);
  expect_both("num_threads -1", ErrorKind::value, "num_threads", [](Call& c) { c.o.num_threads = -1; }, p);
  expect_both("schedule code 9", ErrorKind::value, "schedule",
              [](Call& c) { c.o.schedule = static_cast<flashdl::Schedule>(9); }, p);
  expect_error("parse_schedule('fa3')", ErrorKind::value, "schedule",
               [] { flashdl::parse_schedule("fa3"); }, p, "fa3");
  expect_error("parse_schedule('')", ErrorKind::value, "schedule", [] { flashdl::parse_schedule(""); }, p);
  expect_error("set_num_threads(-1)", ErrorKind::value, "n", [] { flashdl::set_num_threads(-1); }, p);
  context() = "parse_schedule names";
  CHECK(flashdl::parse_schedule("auto") == flashdl::Schedule::automatic);
  CHECK(flashdl::parse_schedule("fa1") == flashdl::Schedule::fa1);
  CHECK(flashdl::parse_schedule("fa2") == flashdl::Schedule::fa2);
  CHECK(flashdl::parse_schedule("reference") == flashdl::Schedule::reference);
}

// Arrays on a CUDA device: in a build without CUDA the call is refused as unsupported.
void test_cuda_arrays() {
  const flashdl::BuildInfo info = flashdl::build_info();
  if (info.cuda_compiled) return;  // would launch on host memory; tests/cpp/cuda covers this build
  Problem p;
  Array q(DType::float16, {1, 4, 2, 64}), k(DType::float16, {1, 4, 2, 64}), v(DType::float16, {1, 4, 2, 64});
  Array out(DType::float16, {1, 4, 2, 64}), lse(DType::float32, {1, 2, 4});
  Call c(p);
  c.q = q.view(), c.k = k.view(), c.v = v.view(), c.out = out.view(), c.lse = lse.view();
  c.dout = q.view(), c.dq = out.view(), c.dk = k.view(), c.dv = v.view();
  for (TensorView* t : {&c.q, &c.k, &c.v, &c.out, &c.lse}) t->device = {flashdl::DeviceType::cuda, 0};
  expect_error("cuda arrays in a CPU-only build", ErrorKind::unsupported, "q", [&] { c.forward(); }, p,
               "CUDA");
  c.o.schedule = flashdl::Schedule::reference;
  expect_error("reference schedule on cuda", ErrorKind::unsupported, "schedule", [&] { c.forward(); }, p);
  CHECK(info.cuda_device_count == 0);
}

// Zero-length extents are valid, and a valid call leaves its inputs untouched.
void test_accepted() {
  context() = "valid calls";
  Problem p;
  const auto before = {p.q.byte_copy(), p.k.byte_copy(), p.v.byte_copy(), p.dout.byte_copy()};
  for (auto s : {flashdl::Schedule::automatic, flashdl::Schedule::fa1, flashdl::Schedule::fa2,
                 flashdl::Schedule::reference}) {
    Call c(p);
    c.o.schedule = s;
    c.forward();
    c.backward();
  }
  const auto after = {p.q.byte_copy(), p.k.byte_copy(), p.v.byte_copy(), p.dout.byte_copy()};
  CHECK_MSG(std::equal(before.begin(), before.end(), after.begin()), "a valid call wrote an input");
  // Empty arrays may come with any strides (exporters often give 0): nothing is reached.
  {
    context() = "empty k with last stride 0";
    Array q(DType::float32, {1, 3, 2, 8}), k(DType::float32, {1, 0, 2, 8}), v(DType::float32, {1, 0, 2, 8});
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
    for (auto sch : {flashdl::Schedule::fa1, flashdl::Schedule::fa2, flashdl::Schedule::reference}) {
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

// Varlen: CUDA arrays are refused in every build (CPU only for now), and cu_seqlens is checked
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
  expect_error("varlen on cuda", ErrorKind::unsupported, "q", fwd(qc, tcq, 5), p, "CPU only");
  expect_error("varlen decreasing", ErrorKind::value, "cu_seqlens_q", fwd(q.view(), tbad, 5), p,
               "non-decreasing");
  expect_error("varlen max_seqlen", ErrorKind::value, "max_seqlen_q", fwd(q.view(), tcq, 4), p);
  TensorView f = tcq;
  f.dtype = DType::float32;
  expect_error("varlen cu dtype", ErrorKind::type, "cu_seqlens_q", fwd(q.view(), f, 5), p, "int32");
}

}  // namespace

int main() {
  run_test("validation: ranks and shapes", test_shapes_and_ranks);
  run_test("validation: dtypes, devices, strides, overlaps", test_dtypes_devices_strides);
  run_test("validation: options", test_options);
  run_test("validation: CUDA arrays", test_cuda_arrays);
  run_test("validation: valid and zero-length calls", test_accepted);
  run_test("validation: varlen", test_varlen);
  return finish();
}
