// The CPU backend's entry: picks the instruction set once, the thread count per call, and the
// schedule the validated Params ask for.
#include <atomic>
#include <fstream>
#include <string>

#include "backend.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/api.hpp"

namespace flashdl::cpu {

namespace {

const KernelTable& pick_kernels() {
#if defined(FLASHDL_X86_ISAS)
  if (kernels_avx512().supported()) return kernels_avx512();
  if (kernels_avx2().supported()) return kernels_avx2();
#endif
  return kernels_generic();
}

const KernelTable& kernels() {
  static const KernelTable& table = pick_kernels();
  return table;
}

std::atomic<int> g_threads{0};

int threads_for(const Params& p) { return p.num_threads > 0 ? p.num_threads : num_threads(); }

int64_t sram_for(const Params& p) { return p.sram_bytes > 0 ? p.sram_bytes : default_sram_bytes(); }

int64_t read_cache_bytes(const char* path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s.empty()) return 0;
  int64_t value = std::stoll(s);
  const char unit = s.back();
  if (unit == 'K') value *= 1024;
  if (unit == 'M') value *= 1024 * 1024;
  return value;
}

}  // namespace

std::string isa_name() { return kernels().name; }

int num_threads() {
  const int n = g_threads.load();
  return n > 0 ? n : default_num_threads();
}

void set_num_threads(int n) { g_threads.store(n); }

// M of Algorithm 1: the per-core L2 cache (the CPU's nearest memory large enough for the tiles),
// read from sysfs; 256 KiB where the machine does not say.
int64_t default_sram_bytes() {
  static const int64_t bytes = [] {
    const int64_t l2 = read_cache_bytes("/sys/devices/system/cpu/cpu0/cache/index2/size");
    return l2 > 0 ? l2 : int64_t{256} * 1024;
  }();
  return bytes;
}

void forward(const Params& p) {
  switch (p.schedule) {
    case Schedule::reference: return reference_forward(p, threads_for(p));
    case Schedule::fa1: return kernels().fa1_forward(p, threads_for(p), sram_for(p));
    case Schedule::fa2:
    case Schedule::automatic: return kernels().fa2_forward(p, threads_for(p));
  }
  throw Error(ErrorKind::value, "schedule: unknown schedule code");
}

void backward(const Params& p) {
  switch (p.schedule) {
    case Schedule::reference: return reference_backward(p, threads_for(p));
    case Schedule::fa1: return kernels().fa1_backward(p, threads_for(p), sram_for(p));
    case Schedule::fa2:
    case Schedule::automatic: return kernels().fa2_backward(p, threads_for(p));
  }
  throw Error(ErrorKind::value, "schedule: unknown schedule code");
}

}  // namespace flashdl::cpu
