// The CPU kernels' fixed costs at small shapes (cpu_tuning.md section 48): flashdl::forward and
// backward called directly, (1, seqlen_q, 8, 64) against (1, seqlen_k, 8, 64), every cell of
// {16 x 16, 16 x 128, 128 x 128} x {float32, bfloat16} x {causal or not}, fa2, the thread count
// of FLASHDL_NUM_THREADS. Rounds of `calls` calls a cell, the cells in turn each round; prints
// each cell's minimum over all calls in us. Built like kernel_time.cpp:
//   g++ -O2 -std=c++17 -Iinclude benchmarks/small_shapes_time.cpp build/cpu/libflashdl_core.a
//       -lpthread -o small_shapes_time      (one line)
//   FLASHDL_NUM_THREADS=1 ./small_shapes_time [rounds] [calls]
// Alternate two such binaries (before / after a change) run after run on a shared machine.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "flashdl/api.hpp"
#include "host_values.hpp"

using namespace flashdl;

namespace {
struct Cell {
  int64_t sq, sk;
  bool bf16, causal;
  std::vector<std::vector<char>> buf;  // q, k, v, out, dout, dq, dk, dv
  std::vector<float> lse;
  double fwd = 1e30, bwd = 1e30;
};

void fill(std::vector<char>& b, size_t n, bool bf16, std::mt19937& rng) {
  std::normal_distribution<float> dist;
  for (size_t i = 0; i < n; ++i) store_value(b, i, dist(rng), bf16);
}
}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
  const int calls = argc > 2 ? std::atoi(argv[2]) : 200;
  const int64_t h = 8, d = 64;
  std::vector<Cell> cells;
  for (auto [sq, sk] : {std::pair<int64_t, int64_t>{16, 16}, {16, 128}, {128, 128}})
    for (bool bf16 : {false, true})
      for (bool causal : {false, true}) cells.push_back(Cell{sq, sk, bf16, causal, {}, {}});
  std::mt19937 rng(0);
  for (Cell& c : cells) {
    const size_t n = static_cast<size_t>(std::max(c.sq, c.sk) * h * d);
    c.buf.assign(8, std::vector<char>(n * (c.bf16 ? 2 : 4)));
    for (int a : {0, 1, 2, 4}) fill(c.buf[a], n, c.bf16, rng);
    c.lse.assign(static_cast<size_t>(h * c.sq), 0.0f);
  }
  for (int r = 0; r < rounds; ++r)
    for (Cell& c : cells) {
      const DType dt = c.bf16 ? DType::bfloat16 : DType::float32;
      auto view = [&](int a) {
        const bool keys = a == 1 || a == 2 || a == 6 || a == 7;
        return make_view(c.buf[a].data(), dt, {1, keys ? c.sk : c.sq, h, d});
      };
      const TensorView L = make_view(c.lse.data(), DType::float32, {1, h, c.sq});
      Options o;
      o.schedule = Schedule::fa2;
      o.causal = c.causal;
      for (int bwd = 0; bwd < 2; ++bwd)
        for (int i = 0; i < calls; ++i) {
          const auto t0 = std::chrono::steady_clock::now();
          if (bwd)
            backward(view(4), view(0), view(1), view(2), view(3), L, view(5), view(6), view(7), o);
          else
            forward(view(0), view(1), view(2), view(3), L, o);
          const double t =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e6;
          double& best = bwd ? c.bwd : c.fwd;
          best = std::min(best, t);
        }
    }
  for (const Cell& c : cells)
    std::printf("%lld x %lld %s %s fwd %.2f bwd %.2f\n", static_cast<long long>(c.sq),
                static_cast<long long>(c.sk), c.bf16 ? "bfloat16" : "float32",
                c.causal ? "causal" : "full", c.fwd, c.bwd);
  return 0;
}
