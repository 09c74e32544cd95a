// The CPU backend's entry: picks the instruction set once, the thread count per call, and the
// schedule the validated Params ask for.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "backend.hpp"
#include "cpu/schedules.hpp"
#include "cpu/threads.hpp"
#include "flashdl/api.hpp"
#include "flashdl/detail/mask.hpp"

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

// Below this many multiply-adds (batch x heads x seqlen_q x seqlen_k x headdim) a call runs on the
// calling thread: waking the pool's worker costs more than the work (the (1, 16, 2, 16) forward
// took about 100 us on 2 threads, 57 us inline, on the loaded 2-core VM).
constexpr int64_t kInlineWork = int64_t{1} << 16;

int threads_for(const Params& p) {
  const int threads = p.num_threads > 0 ? p.num_threads : num_threads();
  const int64_t work = p.batch * p.nheads * p.seqlen_q * p.seqlen_k * p.headdim;
  return work < kInlineWork ? 1 : threads;
}

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

// The work of one problem, for balancing a batch of them: its visible (query, key) pairs plus one
// per query and key row (the per-row costs, which dominate short sequences), times its heads.
double problem_cost(const Params& p) {
  const detail::Mask mask{p.seqlen_q, p.seqlen_k, p.window_left, p.window_right};
  double pairs = 0;
  for (int64_t i = 0; i < p.seqlen_q; ++i)
    pairs += static_cast<double>(std::max<int64_t>(0, mask.col_end(i) - mask.col_begin(i)));
  return (pairs + static_cast<double>(p.seqlen_q + p.seqlen_k)) *
         static_cast<double>(p.batch * p.nheads);
}

// Independent problems (a varlen batch's sequences) over the threads together, instead of one
// after another each spread over every thread (which leaves threads idle on short sequences and
// pays a parallel region per sequence). A problem with at least 1/threads of the total work runs
// alone on every thread, as a single call would; the others are dealt, largest first, to the
// thread with the least work so far (longest-processing-time-first), and each thread runs its
// share one thread each. The deal depends only on the shapes, so results are reproducible for a
// given thread count.
void run_batch(const std::vector<Params>& problems, void (*run)(const Params&)) {
  if (problems.empty()) return;
  const int threads = threads_for(problems.front());
  std::vector<double> cost(problems.size());
  for (size_t i = 0; i < problems.size(); ++i) cost[i] = problem_cost(problems[i]);
  const double total = std::accumulate(cost.begin(), cost.end(), 0.0);
  std::vector<size_t> order(problems.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<size_t>> share(static_cast<size_t>(threads));
  std::vector<double> load(static_cast<size_t>(threads), 0.0);
  for (size_t i : order) {
    if (threads == 1 || cost[i] * threads >= total) {
      run(problems[i]);
      continue;
    }
    const auto t = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    share[t].push_back(i);
    load[t] += cost[i];
  }
  parallel_for(threads, threads, [&](int64_t begin, int64_t end, int) {
    for (int64_t t = begin; t < end; ++t)
      for (size_t i : share[static_cast<size_t>(t)]) {
        Params one = problems[i];
        one.num_threads = 1;
        run(one);
      }
  });
}

// "auto" runs few query rows over many keys (decoding through attention()) with the KV-cache
// kernel (kvcache.inl) instead of fa2: it reads key and value rows in place and splits the keys
// over the threads, where fa2 packs every key tile for a query tile of a few rows and has fewer
// tasks than threads. Rows: seqlen_q x the GQA group, per kv head. The bounds are where the
// KV-cache kernel was faster at every head layout and dtype measured (8/8 heads at headdim 64,
// 32/8 at 128, float32 and bfloat16, 1,024 to 65,536 keys: 1.11-9.4x; benchmarks/results/
// cpu_tuning.md has the tables).
bool decode_shaped(const Params& p) {
  const int64_t rows = p.seqlen_q * p.h_h_k_ratio;
  const int64_t max_rows = p.seqlen_k >= 65536  ? 64
                           : p.seqlen_k >= 8192 ? 32
                           : p.seqlen_k >= 1024 ? 4
                                                : 2;
  return p.auto_schedule && p.p_dropout == 0.0f && p.block_mask_ptr == nullptr &&
         p.bias_ptr == nullptr &&
         p.mask_ptr == nullptr &&  // the KV-cache kernel has no bias or mask yet
         rows <= max_rows && p.seqlen_k >= 256 && p.seqlen_k <= std::numeric_limits<int32_t>::max();
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
  if (decode_shaped(p)) {  // as a cache that every sequence fills to seqlen_k
    const std::vector<int32_t> used(static_cast<size_t>(p.batch), static_cast<int32_t>(p.seqlen_k));
    Params cache = p;
    cache.seqused_k = used.data();
    return kernels().kvcache_forward(cache, threads_for(p));
  }
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

void forward_batch(const std::vector<Params>& problems) { run_batch(problems, &forward); }

void backward_batch(const std::vector<Params>& problems) { run_batch(problems, &backward); }

}  // namespace flashdl::cpu
