// Bitwise check of the CPU kernels between two builds (cpu_tuning.md section 48): runs forward
// and backward over a grid of configurations and prints, one line a configuration, a 64-bit
// FNV-1a hash of the bytes of out, lse, dq, dk and dv. Build it against each library and diff the
// outputs:
//   g++ -O2 -std=c++17 -Iinclude benchmarks/bwd_outputs.cpp build/cpu/libflashdl_core.a
//       -lpthread -o bwd_outputs      (one line)
//   ./bwd_outputs > new.txt; ./bwd_outputs_base > base.txt; diff base.txt new.txt
// Inputs: normal values, and in every third configuration a few NaN/Inf keys and values (the
// masked tiles' redo path) and large scores.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "flashdl/api.hpp"
#include "host_values.hpp"

using namespace flashdl;

namespace {
uint64_t fnv(const void* p, size_t n, uint64_t h) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}
}  // namespace

int main() {
  const std::pair<int64_t, int64_t> shapes[] = {{1, 1},     {3, 5},     {16, 16},  {16, 128},
                                                {128, 128}, {17, 33},   {40, 200}, {100, 31},
                                                {2048, 16}, {16, 2048}, {256, 64}, {48, 96}};
  int configs = 0;
  for (const auto& [sq, sk] : shapes)
    for (const char* sched : {"fa2", "fa1"})
      for (bool bf16 : {false, true})
        for (int64_t d : {40, 64, 128})
          for (int mask = 0; mask < 3; ++mask)  // none, causal, window (8, 0)
            for (float drop : {0.0f, 0.1f})
              for (int threads : {1, 2})
                for (int64_t hk : {8, 2}) {
                  const int64_t b = (sq * sk <= 2048) ? 2 : 1, h = 8;
                  const bool special = configs % 3 == 2;
                  const DType dt = bf16 ? DType::bfloat16 : DType::float32;
                  const size_t es = bf16 ? 2 : 4;
                  const size_t nq = static_cast<size_t>(b * sq * h * d),
                               nk = static_cast<size_t>(b * sk * hk * d);
                  std::vector<char> q(nq * es), k(nk * es), v(nk * es), o(nq * es), dout(nq * es),
                      dq(nq * es), dk(nk * es), dv(nk * es);
                  std::vector<float> lse(static_cast<size_t>(b * h * sq));
                  std::mt19937 rng(static_cast<unsigned>(configs));
                  std::normal_distribution<float> dist;
                  for (size_t i = 0; i < nq; ++i)
                    store_value(q, i, dist(rng) * (special ? 4 : 1), bf16);
                  for (size_t i = 0; i < nq; ++i) store_value(dout, i, dist(rng), bf16);
                  for (size_t i = 0; i < nk; ++i) store_value(k, i, dist(rng), bf16);
                  for (size_t i = 0; i < nk; ++i) store_value(v, i, dist(rng), bf16);
                  if (special && sk > 2) {  // the last key of head 0: Inf key, NaN value
                    const size_t at = static_cast<size_t>((sk - 1) * hk * d);
                    store_value(k, at, INFINITY, bf16);
                    store_value(v, at + 1, NAN, bf16);
                  }
                  auto qv = [&](std::vector<char>& x) {
                    return make_view(x.data(), dt, {b, sq, h, d});
                  };
                  auto kv = [&](std::vector<char>& x) {
                    return make_view(x.data(), dt, {b, sk, hk, d});
                  };
                  const TensorView L = make_view(lse.data(), DType::float32, {b, h, sq});
                  Options op;
                  op.schedule = std::strcmp(sched, "fa1") == 0 ? Schedule::fa1 : Schedule::fa2;
                  op.causal = mask == 1;
                  if (mask == 2) {
                    op.window_left = 8;
                    op.window_right = 0;
                  }
                  op.dropout_p = drop;
                  op.seed = 7;
                  op.num_threads = threads;
                  uint64_t hash = 1469598103934665603ull;
                  const char* err = "";
                  try {
                    forward(qv(q), kv(k), kv(v), qv(o), L, op);
                    backward(qv(dout), qv(q), kv(k), kv(v), qv(o), L, qv(dq), kv(dk), kv(dv), op);
                  } catch (const std::exception& e) {
                    err = "error";
                  }
                  for (auto* x : {&o, &dq, &dk, &dv}) hash = fnv(x->data(), x->size(), hash);
                  hash = fnv(lse.data(), lse.size() * 4, hash);
                  std::printf(
                      "%lld x %lld %s %s d %lld mask %d drop %.1f thr %d hk %lld%s: %016llx %s\n",
                      static_cast<long long>(sq), static_cast<long long>(sk), sched,
                      bf16 ? "bf16" : "f32", static_cast<long long>(d), mask, drop, threads,
                      static_cast<long long>(hk), special ? " special" : "",
                      static_cast<unsigned long long>(hash), err);
                  ++configs;
                }
  std::fprintf(stderr, "%d configurations\n", configs);
  return 0;
}
