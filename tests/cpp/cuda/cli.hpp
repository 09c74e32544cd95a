// The command line and run target shared by the CUDA tests.
//
//   --quick          one small case per kernel variant (a ragged length, one causal, one windowed
//                    case), no repeat tests: sized for compute-sanitizer (memcheck, racecheck,
//                    synccheck) to finish each executable in a minute or two
//   --filter SUBSTR  run only the cases whose label contains SUBSTR (labels are printed)
//   --no-race        skip the repeat (bitwise equality) tests
//   --cpu            run the same cases on the CPU backend with host arrays: exercises the test's
//                    own host half (oracle, naive, tolerance, layouts, gap checks) with no GPU
//
// Every case prints "run  <label>" (flushed) before it launches, so a device fault names the case,
// and "ok   <label> ..." or "FAIL <label> ..." after it.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "cuda_harness.hpp"

namespace cuda_test {

struct Cli {
  bool quick = false;
  bool race = true;
  bool cpu = false;
  std::string filter;

  bool selected(const std::string& label) const {
    return filter.empty() || label.find(filter) != std::string::npos;
  }
  bool repeats() const { return race && !quick; }
};

// Returns -1 to go on, else the exit code (0 for --help, 2 for a bad argument).
inline int parse_cli(int argc, char** argv, Cli& cli) {
  auto usage = [&](std::FILE* f) {
    std::fprintf(f, "usage: %s [--quick] [--filter SUBSTR] [--no-race] [--cpu]\n", argv[0]);
  };
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      cli.quick = true;
    } else if (a == "--no-race") {
      cli.race = false;
    } else if (a == "--cpu") {
      cli.cpu = true;
    } else if (a == "--filter" && i + 1 < argc) {
      cli.filter = argv[++i];
    } else if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else {
      std::fprintf(stderr, "unknown or incomplete argument '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
  }
  return -1;
}

// Where the library runs: the first CUDA device on a non-blocking stream, or the CPU (--cpu).
struct Target {
  bool host = false;
  cudaStream_t stream = nullptr;

  void sync() const {
    if (!host) CUDA_TEST_CHECK(cudaStreamSynchronize(stream));
  }
};

// Returns -1 to go on, else the exit code (77: no CUDA device, the test is skipped).
inline int open_target(const Cli& cli, Target& t) {
  if (cli.cpu) {
    t.host = true;
    std::printf("running on the CPU backend (--cpu): checks the test, not the CUDA kernels\n");
    return -1;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;
  }
  CUDA_TEST_CHECK(cudaSetDevice(0));
  CUDA_TEST_CHECK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CUDA_TEST_CHECK(cudaGetDeviceProperties(&prop, 0));
  const char* limit = std::getenv("FLASHDL_CUDA_SMEM_LIMIT");
  const char* smem_softmax = std::getenv("FLASHDL_CUDA_FA2_SMEM_SOFTMAX");
  std::printf("device 0: %s (sm_%d%d)%s%s%s%s\n", prop.name, prop.major, prop.minor,
              limit ? ", FLASHDL_CUDA_SMEM_LIMIT=" : "", limit ? limit : "",
              smem_softmax ? ", FLASHDL_CUDA_FA2_SMEM_SOFTMAX=" : "",
              smem_softmax ? smem_softmax : "");
  return -1;
}

// Closes the target; counts a failure when the library left another device current.
inline int close_target(Target& t) {
  if (t.host) return 0;
  int failures = 0, current = -1;
  CUDA_TEST_CHECK(cudaGetDevice(&current));
  if (current != 0) {
    std::printf("FAIL the current device changed to %d\n", current);
    ++failures;
  }
  CUDA_TEST_CHECK(cudaStreamDestroy(t.stream));
  return failures;
}

inline int& cases_run() {
  static int n = 0;
  return n;
}

inline void announce(const std::string& label) {
  ++cases_run();
  std::printf("run  %s\n", label.c_str());
  std::fflush(stdout);
}

// Runs `check` (which launches and returns true when the case passed); an exception is a failure
// of this case only, so one bad variant does not hide the others. Returns 1 on failure.
template <typename F>
int run_case(const std::string& label, F&& check) {
  announce(label);
  bool ok = false;
  try {
    ok = check();
  } catch (const std::exception& e) {
    std::printf("FAIL %s: exception: %s\n", label.c_str(), e.what());
  }
  std::fflush(stdout);
  return ok ? 0 : 1;
}

// The main() of every CUDA test: parses the command line, opens the target, runs body(t, cli)
// (its failure count; an exception counts as one failure), closes the target and prints the tally.
template <typename F>
int test_main(int argc, char** argv, F&& body) {
  Cli cli;
  if (const int rc = parse_cli(argc, argv, cli); rc >= 0) return rc;
  Target t;
  if (const int rc = open_target(cli, t); rc >= 0) return rc;
  int failures = 0;
  try {
    failures += body(static_cast<const Target&>(t), static_cast<const Cli&>(cli));
  } catch (const std::exception& e) {
    std::printf("FAIL unexpected exception: %s\n", e.what());
    ++failures;
  }
  failures += close_target(t);
  std::printf("%d case(s) run, %d failure(s)\n", cases_run(), failures);
  return failures == 0 ? 0 : 1;
}

}  // namespace cuda_test
