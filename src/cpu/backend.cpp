// The CPU backend's entry: picks the instruction set once, the thread count per call, and the
// schedule the validated Params ask for.
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "backend.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/api.hpp"

namespace flashdl::cpu {

namespace {

// The compiled copies, widest first.
std::vector<const KernelTable*> compiled_tables() {
  std::vector<const KernelTable*> t;
#if defined(FLASHDL_X86_ISAS)
  t.push_back(&kernels_avx512bf16());
  t.push_back(&kernels_avx512());
  t.push_back(&kernels_avx2());
#endif
  t.push_back(&kernels_generic());
  return t;
}

// The widest copy the CPU runs; FLASHDL_CPU_ISA=avx512bf16|avx512|avx2|generic asks for one by
// name (to test or compare the narrower copies on a wider machine). Null, with `why`, when the asked-for copy is
// not compiled in or the CPU lacks its instructions.
const KernelTable* pick_kernels(std::string& why) {
  const char* env = std::getenv("FLASHDL_CPU_ISA");
  const std::string wanted = env ? env : "";
  std::string names;
  for (const KernelTable* t : compiled_tables()) {
    names += std::string(names.empty() ? "" : ", ") + t->name;
    if (wanted.empty() ? t->supported() : wanted == t->name) {
      if (t->supported()) return t;
      why = "FLASHDL_CPU_ISA: this CPU lacks the instructions of '" + wanted + "'";
      return nullptr;
    }
  }
  why = "FLASHDL_CPU_ISA: expected one of " + names + " (or unset), got '" + wanted + "'";
  return nullptr;
}

const KernelTable& kernels() {
  static std::string why;
  static const KernelTable* table = pick_kernels(why);
  if (!table) throw Error(ErrorKind::value, why);
  return *table;
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

// Never throws (build_info reports it): a bad FLASHDL_CPU_ISA shows here and fails the calls.
std::string isa_name() {
  try {
    return kernels().name;
  } catch (const Error& e) {
    return std::string("none (") + e.what() + ")";
  }
}

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
  // A KV-cache call has its own kernel whatever the schedule (src/kvcache.cpp).
  if (p.seqused_k != nullptr) return kernels().kvcache_forward(p, threads_for(p));
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
