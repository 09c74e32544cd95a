// One-thread kernel timings for tuning logs: flashdl::forward or backward called directly (no
// Python), bfloat16 or float32, q (1, seqlen, 8, headdim) against k, v (1, seqlen_k, 8, headdim)
// (seqlen_k = seqlen unless given), schedule fa2 unless given (fa1, fa2, auto), best of `reps` runs.
//
// Build against a CMake build of the core (e.g. the one pip leaves in build/<dir>):
//   g++ -O2 -std=c++17 -Iinclude benchmarks/kernel_time.cpp build/me/libflashdl_core.a
//       -lpthread -o kernel_time      (one line)
//   FLASHDL_NUM_THREADS=1 FLASHDL_CPU_ISA=avx512bf16 ./kernel_time fwd bfloat16 2048 64 10
//   FLASHDL_NUM_THREADS=1 ./kernel_time fwd float32 2048 64 200 16 auto   (2,048 queries, 16 keys)
// It is also what `perf record` profiles: the core library keeps its symbols.
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

int main(int argc, char** argv) {
  if (argc < 2 || (std::strcmp(argv[1], "fwd") != 0 && std::strcmp(argv[1], "bwd") != 0)) {
    std::fprintf(stderr,
                 "usage: kernel_time fwd|bwd [bfloat16|float32] [seqlen] [headdim] [reps] "
                 "[seqlen_k] [fa1|fa2|auto]\n");
    return 2;
  }
  const bool bwd = std::strcmp(argv[1], "bwd") == 0;
  const bool bf16 = argc < 3 || std::strcmp(argv[2], "float32") != 0;
  const int64_t s = argc > 3 ? std::atoll(argv[3]) : 2048, d = argc > 4 ? std::atoll(argv[4]) : 64;
  const int reps = argc > 5 ? std::atoi(argv[5]) : 5;
  const int64_t sk = argc > 6 ? std::atoll(argv[6]) : s;
  const char* schedule = argc > 7 ? argv[7] : "fa2";
  const int64_t h = 8;
  // Buffers sized for the longer side; q, out, dout, dq use seqlen rows, k, v, dk, dv seqlen_k.
  const size_t n = static_cast<size_t>(std::max(s, sk) * h * d), bytes = n * (bf16 ? 2 : 4);
  const DType dt = bf16 ? DType::bfloat16 : DType::float32;
  std::vector<std::vector<char>> buf(8, std::vector<char>(bytes));
  std::mt19937 rng(0);
  std::normal_distribution<float> dist;
  for (int a : {0, 1, 2, 4})  // q, k, v, dout
    for (size_t i = 0; i < n; ++i) store_value(buf[a], i, dist(rng), bf16);
  auto view = [&](int a) {
    const bool keys = a == 1 || a == 2 || a == 6 || a == 7;
    return make_view(buf[a].data(), dt, {1, keys ? sk : s, h, d});
  };
  std::vector<float> lse(static_cast<size_t>(h * s));
  const TensorView L = make_view(lse.data(), DType::float32, {1, h, s});
  Options o;
  o.schedule = std::strcmp(schedule, "fa1") == 0    ? Schedule::fa1
               : std::strcmp(schedule, "auto") == 0 ? Schedule::automatic
                                                    : Schedule::fa2;
  forward(view(0), view(1), view(2), view(3), L, o);  // out in buffer 3
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    if (bwd)
      backward(view(4), view(0), view(1), view(2), view(3), L, view(5), view(6), view(7), o);
    else
      forward(view(0), view(1), view(2), view(3), L, o);
    best = std::min(best,
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double flops = 4.0 * h * s * sk * d * (bwd ? 2.5 : 1.0);
  std::printf("%s %s seqlen %lld x %lld headdim %lld %s: %.4f ms, %.1f GFLOP/s\n", argv[1],
              bf16 ? "bfloat16" : "float32", static_cast<long long>(s), static_cast<long long>(sk),
              static_cast<long long>(d), schedule, best * 1e3, flops / best / 1e9);
  return 0;
}
