// flashdl's CUDA host emulator: device memory, the runtime API calls flashdl uses, and kernel
// launches run as cooperative fibers (include/flashdl_emu/runtime.hpp says what is modelled and
// checked).
//
// Environment:
//   FLASHDL_EMU_SEED     the order in which a block's threads resume after every synchronisation
//                        point, and the order of the blocks, are shuffled from this seed and the
//                        launch's number in the process (default 1); 0 runs threads and blocks in
//                        index order.
//   FLASHDL_EMU_THREADS  host threads that run blocks (default: the hardware's).
//   FLASHDL_EMU_ARCH     sm_90 (default: 132 SMs, 227 KiB of opt-in shared memory per block) or
//                        sm_80 (108 SMs, 163 KiB).
//
// Built with -fsanitize=address (FLASHDL_EMU_ASAN=ON), device allocations and shared memory come
// from the sanitizer's heap, so any access outside them, before or after, reading or writing, is
// reported exactly (instead of faulting past a guard page), and fiber switches are announced to it.
#undef _FORTIFY_SOURCE  // _longjmp between fiber stacks is what the fortified longjmp refuses
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <xmmintrin.h>  // _mm_getcsr / _mm_setcsr: the float modes of a launch
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FLASHDL_EMU_ASAN 1
#else
#define FLASHDL_EMU_ASAN 0
#endif

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "flashdl_emu/pipeline.hpp"
#include "flashdl_emu/runtime.hpp"

namespace flashdl_emu {
namespace {

// ---- the emulated device -------------------------------------------------------------------------
struct Arch {
  int major, minor, sms;
  int smem_optin;
};

const Arch& arch() {
  static const Arch a = [] {
    const char* env = std::getenv("FLASHDL_EMU_ARCH");
    if (env && std::string(env) == "sm_80") return Arch{8, 0, 108, 166912};
    if (env && std::string(env) != "sm_90") {
      std::fprintf(stderr,
                   "flashdl CUDA emulator: FLASHDL_EMU_ARCH must be sm_80 or sm_90, got '%s'\n",
                   env);
      std::abort();
    }
    return Arch{9, 0, 132, 232448};
  }();
  return a;
}

std::uint64_t env_u64(const char* name, std::uint64_t fallback) {
  const char* env = std::getenv(name);
  return env && *env ? std::strtoull(env, nullptr, 10) : fallback;
}

thread_local cudaError_t last_error = cudaSuccess;

cudaError_t record(cudaError_t err) {
  if (err != cudaSuccess) last_error = err;
  return err;
}

// ---- memory: every region ends at an inaccessible page ------------------------------------------
const std::size_t kPage = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));

struct Region {
  void* map;
  std::size_t map_bytes;
  std::size_t bytes;
};

std::mutex alloc_mutex;
std::map<std::uintptr_t, Region> allocations;  // by user pointer

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

// `bytes` usable bytes aligned to `align`, ending at most align - 1 bytes before a PROT_NONE page
// (under AddressSanitizer: a heap block, whose bounds it checks exactly).
void* map_guarded(std::size_t bytes, std::size_t align, Region* region) {
#if FLASHDL_EMU_ASAN
  void* p = nullptr;
  if (posix_memalign(&p, align, std::max<std::size_t>(bytes, 1)) != 0) return nullptr;
  *region = Region{p, 0, bytes};
  return p;
#endif
  const std::size_t body = round_up(std::max<std::size_t>(bytes, 1), kPage);
  void* map = mmap(nullptr, body + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                   0);
  if (map == MAP_FAILED) return nullptr;
  mprotect(static_cast<char*>(map) + body, kPage, PROT_NONE);
  *region = Region{map, body + kPage, bytes};
  return static_cast<char*>(map) + body - round_up(std::max<std::size_t>(bytes, 1), align);
}

void unmap_guarded(const Region& r) {
  if (FLASHDL_EMU_ASAN)
    std::free(r.map);
  else
    munmap(r.map, r.map_bytes);
}

bool is_device_range(const void* p, std::size_t bytes) {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard<std::mutex> lock(alloc_mutex);
  auto it = allocations.upper_bound(u);
  if (it == allocations.begin()) return false;
  --it;
  return u >= it->first && u + bytes <= it->first + it->second.bytes;
}

// ---- fibers ----------------------------------------------------------------------------------------
constexpr std::size_t kStackBytes = 256 * 1024;

struct Copy {
  unsigned char* dst;
  const unsigned char* src;
  std::size_t bytes, zfill;
};

enum class State { runnable, barrier, warp, done };

struct Fiber {
  void* asan_fake_stack = nullptr;
  ucontext_t uc;
  jmp_buf jb;
  unsigned char* stack = nullptr;
  bool started = false;
  State state = State::runnable;
  uint3 tid{0, 0, 0};
  int lane = 0, warp = 0;
  std::vector<Copy> uncommitted;
  std::vector<std::vector<Copy>> groups;  // committed, oldest first
};

struct WarpState {
  int arrived = 0;
  unsigned mask = 0;
  int kind = 0;
  void* slots[32] = {};
};

struct LaunchState {
  LaunchConfig cfg;
  void (*body)(void*);
  void* ctx;
};

// One per host thread: runs one block at a time.
struct Scheduler {
  std::vector<Fiber> fibers;
  unsigned char* stacks = nullptr;
  std::size_t stack_count = 0;
  jmp_buf jb;
  ucontext_t uc;
  const void* stack_bottom = nullptr;  // the host thread's own stack (AddressSanitizer's view)
  std::size_t stack_size = 0;
  void* asan_fake_stack = nullptr;
  Fiber* current = nullptr;
  const LaunchState* launch = nullptr;
  uint3 block{0, 0, 0};
  unsigned char* smem = nullptr;
  std::size_t smem_bytes = 0;
  int live = 0, at_barrier = 0;
  int bar_or = 0,
      bar_or_result = 0;  // __syncthreads_or: this barrier's OR, the last released one's
  std::vector<WarpState> warps;

  ~Scheduler() {
    if (stacks) munmap(stacks, stack_count * kStackBytes);
  }

  void reserve(std::size_t n) {
    if (n <= stack_count) return;
    if (stacks) munmap(stacks, stack_count * kStackBytes);
    void* m = mmap(nullptr, n * kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "flashdl CUDA emulator: cannot map %zu fiber stacks\n", n);
      std::abort();
    }
    stacks = static_cast<unsigned char*>(m);
    stack_count = n;
  }
};

thread_local Scheduler* sched = nullptr;

Scheduler& scheduler() {
  thread_local Scheduler s;
  sched = &s;
  return s;
}

[[noreturn]] void fail_here(const std::string& what) {
  Scheduler* s = sched;
  if (s && s->current) {
    const uint3 t = s->current->tid;
    std::fprintf(stderr, "flashdl CUDA emulator: %s (block (%u, %u, %u), thread (%u, %u, %u))\n",
                 what.c_str(), s->block.x, s->block.y, s->block.z, t.x, t.y, t.z);
  } else if (s && s->launch) {  // the scheduler itself: a deadlock
    std::fprintf(stderr, "flashdl CUDA emulator: %s (block (%u, %u, %u))\n", what.c_str(),
                 s->block.x, s->block.y, s->block.z);
  } else {
    std::fprintf(stderr, "flashdl CUDA emulator: %s\n", what.c_str());
  }
  std::fflush(stderr);
  std::abort();
}

void run_copies(std::vector<Copy>& copies) {
  for (const Copy& c : copies) {
    std::memcpy(c.dst, c.src, c.bytes - c.zfill);
    std::memset(c.dst + (c.bytes - c.zfill), 0, c.zfill);
  }
  copies.clear();
}

// AddressSanitizer must know which stack runs: before a jump to another stack, and on arrival.
// A null save slot says that the stack left is done with (a fiber that exits).
inline void switching_to(void** save, const void* bottom, std::size_t size) {
#if FLASHDL_EMU_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}
inline void arrived(void* save, const void** old_bottom = nullptr,
                    std::size_t* old_size = nullptr) {
#if FLASHDL_EMU_ASAN
  __sanitizer_finish_switch_fiber(save, old_bottom, old_size);
#else
  (void)save, (void)old_bottom, (void)old_size;
#endif
}

// Back to the scheduler; returns when the scheduler resumes this fiber.
void yield() {
  Scheduler& s = *sched;
  Fiber* f = s.current;
  if (!_setjmp(f->jb)) {
    switching_to(&f->asan_fake_stack, s.stack_bottom, s.stack_size);
    _longjmp(s.jb, 1);
  }
  arrived(f->asan_fake_stack);
}

void release_barrier_if_complete(Scheduler& s) {
  if (s.at_barrier == 0 || s.at_barrier != s.live) return;
  for (Fiber& f : s.fibers)
    if (f.state == State::barrier) f.state = State::runnable;
  s.at_barrier = 0;
  s.bar_or_result = s.bar_or;  // read by every thread it releases before any reaches the next
  s.bar_or = 0;
}

void fiber_entry() {
  Scheduler& s = *sched;
  Fiber* f = s.current;
  arrived(nullptr, &s.stack_bottom, &s.stack_size);
  s.launch->body(s.launch->ctx);
  // A thread's outstanding cp.async copies still land.
  for (auto& g : f->groups) run_copies(g);
  f->groups.clear();
  run_copies(f->uncommitted);
  f->state = State::done;
  --s.live;
  release_barrier_if_complete(s);
  switching_to(nullptr, s.stack_bottom, s.stack_size);
  _longjmp(s.jb, 1);
}

std::string deadlock_report(const Scheduler& s) {
  std::string r = "deadlock: no thread can run;";
  int done = 0;
  for (const Fiber& f : s.fibers) done += f.state == State::done;
  r += " " + std::to_string(s.at_barrier) + " at __syncthreads, " + std::to_string(done) +
       " exited";
  for (std::size_t w = 0; w < s.warps.size(); ++w)
    if (s.warps[w].arrived > 0)
      r += "; warp " + std::to_string(w) + ": " + std::to_string(s.warps[w].arrived) +
           " lanes at a warp collective (kind " + std::to_string(s.warps[w].kind) + ", mask " +
           std::to_string(s.warps[w].mask) + ")";
  return r;
}

// Runs fiber f until it yields or exits (kept apart so that no local of the caller lives across
// the jump).
__attribute__((noinline)) void resume(Scheduler& s, Fiber& f) {
  s.current = &f;
  if (!_setjmp(s.jb)) {
    switching_to(&s.asan_fake_stack, f.stack, kStackBytes);
    if (!f.started) {
      f.started = true;
      setcontext(&f.uc);
    }
    _longjmp(f.jb, 1);
  }
  arrived(s.asan_fake_stack);
  s.current = nullptr;
}

void run_block(Scheduler& s, uint3 block, std::mt19937_64* rng) {
  const dim3 bd = s.launch->cfg.block;
  const int n = static_cast<int>(bd.x * bd.y * bd.z);
  s.block = block;
  s.live = n;
  s.at_barrier = 0;
  s.bar_or = s.bar_or_result = 0;
  s.fibers.resize(static_cast<std::size_t>(n));
  s.warps.assign(static_cast<std::size_t>((n + 31) / 32), WarpState{});
  // Uninitialised shared memory reads as NaN in every float type.
  if (s.smem_bytes) std::memset(s.smem, 0xff, s.smem_bytes);
  for (int i = 0; i < n; ++i) {
    Fiber& f = s.fibers[static_cast<std::size_t>(i)];
    f.stack = s.stacks + static_cast<std::size_t>(i) * kStackBytes;
    f.started = false;
    f.state = State::runnable;
    f.tid = uint3{static_cast<unsigned>(i) % bd.x, (static_cast<unsigned>(i) / bd.x) % bd.y,
                  static_cast<unsigned>(i) / (bd.x * bd.y)};
    f.lane = i % 32;
    f.warp = i / 32;
    f.uncommitted.clear();
    f.groups.clear();
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = f.stack;
    f.uc.uc_stack.ss_size = kStackBytes;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, fiber_entry, 0);
  }
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  while (s.live > 0) {
    if (rng) std::shuffle(order.begin(), order.end(), *rng);
    bool ran = false;
    for (int i : order) {
      Fiber& f = s.fibers[static_cast<std::size_t>(i)];
      if (f.state != State::runnable) continue;
      ran = true;
      resume(s, f);
    }
    if (!ran) fail_here(deadlock_report(s));
  }
}

std::mutex attr_mutex;
std::map<const void*, int> max_dynamic_smem;  // cudaFuncAttributeMaxDynamicSharedMemorySize

}  // namespace

// ---- device side -------------------------------------------------------------------------------------
uint3 thread_idx() { return sched->current->tid; }
uint3 block_idx() { return sched->block; }
dim3 block_dim() { return sched->launch->cfg.block; }
dim3 grid_dim() { return sched->launch->cfg.grid; }
unsigned char* dynamic_smem() { return sched->smem; }
void fail(const char* what) { fail_here(what); }

int syncthreads_or(int pred) {
  if (pred) sched->bar_or = 1;
  syncthreads();
  return sched->bar_or_result;
}

void syncthreads() {
  Scheduler& s = *sched;
  Fiber* f = s.current;
  f->state = State::barrier;
  ++s.at_barrier;
  release_barrier_if_complete(s);
  yield();
}

void warp_collective(unsigned mask, int kind, void* mine, WarpOp op, void* ctx) {
  Scheduler& s = *sched;
  Fiber* f = s.current;
  WarpState& w = s.warps[static_cast<std::size_t>(f->warp)];
  if (!(mask >> f->lane & 1u))
    fail_here("a warp collective whose mask leaves out the calling lane");
  if (w.arrived == 0) {
    w.kind = kind;
    w.mask = mask;
    std::fill(std::begin(w.slots), std::end(w.slots), nullptr);
  } else if (w.kind != kind || w.mask != mask) {
    fail_here("lanes of a warp at different warp collectives (kind " + std::to_string(w.kind) +
              " and " + std::to_string(kind) + ")");
  }
  w.slots[f->lane] = mine;
  f->state = State::warp;
  if (++w.arrived == __builtin_popcount(mask)) {
    op(w.slots, ctx);
    for (int l = 0; l < 32; ++l)
      if (mask >> l & 1u)
        s.fibers[static_cast<std::size_t>(f->warp * 32 + l)].state = State::runnable;
    w.arrived = 0;
  }
  yield();
}

void pipeline_memcpy_async(void* dst, const void* src, std::size_t bytes, std::size_t zfill) {
  Scheduler& s = *sched;
  const auto d = reinterpret_cast<std::uintptr_t>(dst),
             sm = reinterpret_cast<std::uintptr_t>(s.smem);
  if (bytes != 4 && bytes != 8 && bytes != 16)
    fail_here("cp.async of " + std::to_string(bytes) + " bytes");
  if (d % bytes || reinterpret_cast<std::uintptr_t>(src) % bytes) fail_here("cp.async misaligned");
  if (zfill > bytes) fail_here("cp.async zero-fill larger than the copy");
  if (d < sm || d + bytes > sm + s.smem_bytes)
    fail_here("cp.async destination outside shared memory");
  s.current->uncommitted.push_back(
      Copy{static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes, zfill});
}

void pipeline_commit() {
  Fiber* f = sched->current;
  f->groups.push_back(std::move(f->uncommitted));
  f->uncommitted.clear();
}

void pipeline_wait_prior(std::size_t prior) {
  Fiber* f = sched->current;
  while (f->groups.size() > prior) {
    run_copies(f->groups.front());
    f->groups.erase(f->groups.begin());
  }
}

// ---- launches ---------------------------------------------------------------------------------------
// The host thread's float modes for one launch: flush-to-zero and denormals-are-zero where the
// launch asks for them (x86's MXCSR bits 15 and 6), the thread's own modes back at the end.
class FloatModes {
 public:
  explicit FloatModes(bool ftz) {
#if defined(__SSE2__)
    saved_ = _mm_getcsr();
    if (ftz) _mm_setcsr(saved_ | 0x8040u);
#else
    (void)ftz;
#endif
  }
  ~FloatModes() {
#if defined(__SSE2__)
    _mm_setcsr(saved_);
#endif
  }
  FloatModes(const FloatModes&) = delete;
  FloatModes& operator=(const FloatModes&) = delete;

 private:
  unsigned saved_ = 0;
};

void launch(const LaunchConfig& cfg, void (*body)(void*), void* ctx) {
  const std::uint64_t threads = std::uint64_t(cfg.block.x) * cfg.block.y * cfg.block.z;
  if (threads == 0 || threads > 1024 || cfg.block.z > 64 || cfg.grid.x == 0 || cfg.grid.y == 0 ||
      cfg.grid.z == 0 || cfg.grid.x > 2147483647u || cfg.grid.y > 65535 || cfg.grid.z > 65535) {
    record(cudaErrorInvalidConfiguration);
    return;
  }
  int allowed = 48 * 1024;
  {
    std::lock_guard<std::mutex> lock(attr_mutex);
    auto it = max_dynamic_smem.find(cfg.func);
    if (it != max_dynamic_smem.end()) allowed = std::max(allowed, it->second);
  }
  if (cfg.smem > static_cast<std::size_t>(allowed) ||
      cfg.smem > static_cast<std::size_t>(arch().smem_optin)) {
    record(cudaErrorInvalidValue);
    return;
  }
  const LaunchState state{cfg, body, ctx};
  const std::uint64_t blocks = std::uint64_t(cfg.grid.x) * cfg.grid.y * cfg.grid.z;
  static std::atomic<std::uint64_t> launches{0};
  const std::uint64_t base_seed = env_u64("FLASHDL_EMU_SEED", 1);
  const std::uint64_t seed = base_seed ? base_seed * 0x2545f4914f6cdd1dull + ++launches : 0;
  std::vector<std::uint64_t> order(blocks);
  for (std::uint64_t i = 0; i < blocks; ++i) order[i] = i;
  if (seed) {
    std::mt19937_64 rng(seed);
    std::shuffle(order.begin(), order.end(), rng);
  }
  std::atomic<std::uint64_t> next{0};
  auto worker = [&] {
    const FloatModes modes(cfg.ftz);  // each fiber's context is taken on this thread, with these
    Scheduler& s = scheduler();
    s.reserve(threads);
    s.launch = &state;
    Region region{};
    s.smem = static_cast<unsigned char*>(map_guarded(cfg.smem, 128, &region));
    s.smem_bytes = cfg.smem;
    for (std::uint64_t i; (i = next.fetch_add(1)) < blocks;) {
      const std::uint64_t b = order[i];
      const uint3 block{static_cast<unsigned>(b % cfg.grid.x),
                        static_cast<unsigned>(b / cfg.grid.x % cfg.grid.y),
                        static_cast<unsigned>(b / (std::uint64_t(cfg.grid.x) * cfg.grid.y))};
      std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + b);
      run_block(s, block, seed ? &rng : nullptr);
    }
    unmap_guarded(region);
    s.smem = nullptr;
    s.launch = nullptr;
  };
  const std::uint64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const std::uint64_t workers = std::min<std::uint64_t>(blocks, env_u64("FLASHDL_EMU_THREADS", hw));
  std::vector<std::thread> pool;
  for (std::uint64_t t = 1; t < workers; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
}

}  // namespace flashdl_emu

// ---- runtime API ----------------------------------------------------------------------------------
using flashdl_emu::record;

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
namespace {
thread_local int current_device = 0;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  const auto& a = flashdl_emu::arch();
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "flashdl CUDA host emulator (sm_%d%d)", a.major,
                a.minor);
  prop->major = a.major;
  prop->minor = a.minor;
  prop->multiProcessorCount = a.sms;
  prop->sharedMemPerBlock = 48 * 1024;
  prop->sharedMemPerBlockOptin = static_cast<std::size_t>(a.smem_optin);
  prop->totalGlobalMem = std::size_t(1) << 34;
  prop->maxThreadsPerBlock = 1024;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return record(cudaErrorInvalidDevice);
  const auto& a = flashdl_emu::arch();
  switch (attr) {
    case cudaDevAttrMaxGridDimX: *value = 2147483647; return cudaSuccess;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ: *value = 65535; return cudaSuccess;
    case cudaDevAttrMultiProcessorCount: *value = a.sms; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor: *value = a.major; return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor: *value = a.minor; return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = a.smem_optin; return cudaSuccess;
  }
  return record(cudaErrorInvalidValue);
}
cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
cudaError_t cudaGetLastError() {
  const cudaError_t e = flashdl_emu::last_error;
  flashdl_emu::last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return flashdl_emu::last_error; }
const char* cudaGetErrorName(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
  }
  return "cudaErrorUnknown";
}
const char* cudaGetErrorString(cudaError_t err) {
  switch (err) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    default: return cudaGetErrorName(err);
  }
}
cudaError_t cudaMalloc(void** ptr, std::size_t bytes) {
  flashdl_emu::Region region{};
  void* p = flashdl_emu::map_guarded(bytes, 256, &region);
  if (!p) return record(cudaErrorMemoryAllocation);
  std::lock_guard<std::mutex> lock(flashdl_emu::alloc_mutex);
  flashdl_emu::allocations[reinterpret_cast<std::uintptr_t>(p)] = region;
  *ptr = p;
  return cudaSuccess;
}
cudaError_t cudaFree(void* ptr) {
  if (!ptr) return cudaSuccess;
  std::lock_guard<std::mutex> lock(flashdl_emu::alloc_mutex);
  auto it = flashdl_emu::allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == flashdl_emu::allocations.end()) return record(cudaErrorInvalidDevicePointer);
  flashdl_emu::unmap_guarded(it->second);
  flashdl_emu::allocations.erase(it);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** ptr, std::size_t bytes, cudaStream_t) {
  return cudaMalloc(ptr, bytes);
}
cudaError_t cudaFreeAsync(void* ptr, cudaStream_t) { return cudaFree(ptr); }

namespace {
cudaError_t checked_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (bytes == 0) return cudaSuccess;
  if ((dst_dev && !flashdl_emu::is_device_range(dst, bytes)) ||
      (src_dev && !flashdl_emu::is_device_range(src, bytes)))
    return record(cudaErrorInvalidValue);
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}
}  // namespace
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  return checked_copy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  return checked_copy(dst, src, bytes, kind);
}
cudaError_t cudaMemset(void* ptr, int value, std::size_t bytes) {
  if (bytes == 0) return cudaSuccess;
  if (!flashdl_emu::is_device_range(ptr, bytes)) return record(cudaErrorInvalidValue);
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* ptr, int value, std::size_t bytes, cudaStream_t) {
  return cudaMemset(ptr, value, bytes);
}
struct CUstream_st {
  unsigned flags;
};
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) {
  *stream = new CUstream_st{flags};
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      value > flashdl_emu::arch().smem_optin)
    return record(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(flashdl_emu::attr_mutex);
  flashdl_emu::max_dynamic_smem[func] = value;
  return cudaSuccess;
}
