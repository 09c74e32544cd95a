// The harness of test_validation: a valid problem, the views of one call, and expect_error, which
// runs a call that must fail and checks the error's kind, the argument its message starts with,
// and that no input changed.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "arrays.hpp"
#include "check.hpp"
#include "flashdl/api.hpp"

namespace flashdl_test {

using flashdl::Error;
using flashdl::ErrorKind;
using flashdl::Options;
using flashdl::TensorView;

inline const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::value: return "value";
    case ErrorKind::type: return "type";
    case ErrorKind::unsupported: return "unsupported";
    case ErrorKind::runtime: return "runtime";
    case ErrorKind::not_implemented: return "not_implemented";
  }
  return "?";
}

// A valid problem: q (2, 5, 4, 8), k, v (2, 7, 2, 8), all float32, plus outputs and gradients,
// and a block mask (every third block zero) for blocks of 2 x 3: a 3 x 3 grid per batch and head.
struct Problem {
  Array q{DType::float32, {2, 5, 4, 8}}, k{DType::float32, {2, 7, 2, 8}},
      v{DType::float32, {2, 7, 2, 8}};
  Array dout{DType::float32, {2, 5, 4, 8}};
  Array out{DType::float32, {2, 5, 4, 8}}, lse{DType::float32, {2, 4, 5}};
  Array dq{DType::float32, {2, 5, 4, 8}}, dk{DType::float32, {2, 7, 2, 8}},
      dv{DType::float32, {2, 7, 2, 8}};
  Array mask{DType::boolean, {2, 4, 3, 3}};
  Problem() {
    Rng rng(1);
    for (Array* a : {&q, &k, &v, &dout}) a->fill_random(rng, 1.0);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.set(i, i % 3 != 0);
  }
  std::vector<std::vector<unsigned char>> inputs() const {
    return {q.byte_copy(), k.byte_copy(), v.byte_copy(), dout.byte_copy(), mask.byte_copy()};
  }
};

// The views of one call; a test changes some of them.
struct Call {
  TensorView q, k, v, out, lse, dout, dq, dk, dv;
  Options o;
  explicit Call(const Problem& p)
      : q(p.q.view()),
        k(p.k.view()),
        v(p.v.view()),
        out(p.out.view()),
        lse(p.lse.view()),
        dout(p.dout.view()),
        dq(p.dq.view()),
        dk(p.dk.view()),
        dv(p.dv.view()) {}
  void forward() const { flashdl::forward(q, k, v, out, lse, o); }
  void backward() const { flashdl::backward(dout, q, k, v, out, lse, dq, dk, dv, o); }
};

// Runs fn, expects Error(kind) whose message starts with "<arg>:" (and contains `detail`), and
// that none of the inputs changed.
inline void expect_error(const std::string& what, ErrorKind kind, const std::string& arg,
                         const std::function<void()>& fn, const Problem& p,
                         const std::string& detail = "") {
  context() = what;
  const auto before = p.inputs();
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
  CHECK_MSG(p.inputs() == before, "an input was written");
}

// Both entry points see the same forward arguments: check each error on both.
inline void expect_both(const std::string& what, ErrorKind kind, const std::string& arg,
                        const std::function<void(Call&)>& edit, const Problem& p,
                        const std::string& detail = "") {
  Call c(p);
  edit(c);
  expect_error("forward: " + what, kind, arg, [&] { c.forward(); }, p, detail);
  expect_error("backward: " + what, kind, arg, [&] { c.backward(); }, p, detail);
}

}  // namespace flashdl_test
