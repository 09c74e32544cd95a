#include "cpu/threads.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define FLASHDL_HAVE_ATFORK 1
#endif
#if defined(__linux__)
#include <sched.h>
#endif

namespace flashdl::cpu {

namespace {

// Waits between regions: a worker spins for kWorkerSpin after its slice before it sleeps on the
// condition variable, and the caller spins for up to kCallerSpin for the workers to finish before
// it sleeps. A sleeping thread's wake-up cost 25-50 us on the 2-vCPU VM measured (a futex wake
// crosses to the other virtual CPU), more than a small call's whole kernel, and a backward runs
// three or four regions back to back.
constexpr auto kWorkerSpin = std::chrono::microseconds(100);
constexpr auto kCallerSpin = std::chrono::microseconds(500);

// The CPU the calling thread runs on, or -1 where the system does not say.
inline int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

// One step of a spin: a few pause instructions, then a yield, so that a thread the scheduler put
// on this CPU's queue (a worker woken onto its waker's CPU) runs instead of waiting for the spin's
// end: with pause alone, regions after an idle millisecond took 0.2-1.2 ms instead of 35-140 us.
inline void spin_step() {
#if defined(__x86_64__) || defined(__i386__)
  for (int i = 0; i < 16; ++i) __builtin_ia32_pause();
#endif
  std::this_thread::yield();
}

class Pool {
 public:
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  void run(int64_t n, int threads, const std::function<void(int64_t, int64_t, int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);  // one parallel region at a time
    threads = std::min(threads, 0xffff);
    ensure_workers(threads - 1);
    // Published to the workers by region_'s release (they read them after its acquire); a
    // region's thread count travels in region_ itself, as a worker outside the region may read it
    // after the caller has gone on to the next region.
    fn_ = &fn;
    n_ = n;
    threads_ = threads;
    error_ = nullptr;
    pending_.store(threads - 1, std::memory_order_relaxed);
    caller_cpu_.store(current_cpu(), std::memory_order_relaxed);
    const uint64_t generation = (region_.load(std::memory_order_relaxed) >> 16) + 1;
    for (int t = 1; t < threads; ++t)
      slots_[static_cast<size_t>(t - 1)].claim.store(open_claim(generation),
                                                     std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);  // a worker checks region_ under mu_ before sleeping
      region_.store(generation << 16 | static_cast<uint64_t>(threads), std::memory_order_release);
      if (sleepers_ > 0) cv_.notify_all();
    }
    run_slice(0);
    // A worker that has not claimed its slice by now started later than a whole slice's time
    // (its core held by another process's threads: an OpenMP runtime spinning after its region,
    // as torch's does between a training step's ops): the caller runs the slice itself rather
    // than wait for the scheduler to give the worker a turn (for parallel_tasks the slice finds
    // its tasks taken already). Slices depend on their index, not on the thread that runs them.
    for (int t = 1; t < threads; ++t) {
      uint64_t open = open_claim(generation);
      if (slots_[static_cast<size_t>(t - 1)].claim.compare_exchange_strong(
              open, open | kByCaller, std::memory_order_acq_rel)) {
        run_slice(t);
        pending_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
    const auto until = std::chrono::steady_clock::now() + kCallerSpin;
    while (pending_.load(std::memory_order_acquire) != 0 &&
           std::chrono::steady_clock::now() < until)
      spin_step();
    if (pending_.load(std::memory_order_acquire) != 0) {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [&] { return pending_.load(std::memory_order_acquire) == 0; });
    }
    fn_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

  // fork() copies only the calling thread: a child would wait forever on workers it does not
  // have. The hooks hold the region lock across fork (no region is half-way through in the
  // child), and the child starts a fresh pool (the old one, its locks and threads, is abandoned).
  void before_fork() { run_mu_.lock(); }
  void after_fork_in_parent() { run_mu_.unlock(); }

 private:
  void ensure_workers(int count) {
    while (static_cast<int>(workers_.size()) < count) {
      const int index = static_cast<int>(workers_.size()) + 1;
      // A deque: a running worker's slot stays where it is as slots are added; the worker keeps
      // its address (only run() touches the deque itself).
      Slot* slot = &slots_.emplace_back();
      workers_.emplace_back([this, index, slot] { worker(index, *slot); });
    }
  }

  // Who runs worker slice t of a region: its claim word, generation << 2 | kOpen (set by the
  // caller before the region is published), kByWorker or kByCaller, whichever side's
  // compare-exchange comes first. The generation keeps a worker that saw an earlier region from
  // claiming a slice of a later one.
  static constexpr uint64_t kOpen = 0, kByWorker = 1, kByCaller = 2;
  static constexpr uint64_t open_claim(uint64_t generation) { return generation << 2 | kOpen; }
  struct Slot {
    std::atomic<uint64_t> claim{0};
  };

  void run_slice(int t) {
    int64_t b, e;
    static_slice(n_, threads_, t, b, e);
    if (b >= e) return;
    try {
      (*fn_)(b, e, t);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) error_ = std::current_exception();
    }
  }

  // The next region's word (spinning for kWorkerSpin, then asleep), or `seen` on stop. A worker
  // on its caller's CPU sleeps at once: spinning, it stays cache-hot and the scheduler never moves
  // it to the idle CPU, so every region ran its slices one after the other (a 16 x 128 backward
  // took its one-thread time in 5 of 6 processes); woken from sleep, it is placed on an idle CPU.
  uint64_t wait_for_region(uint64_t seen) {
    const auto until = std::chrono::steady_clock::now() + kWorkerSpin;
    for (;;) {
      const uint64_t g = region_.load(std::memory_order_acquire);
      if (g != seen || stop_.load(std::memory_order_relaxed)) return g;
      if (std::chrono::steady_clock::now() >= until) break;
      const int cpu = current_cpu();
      if (cpu >= 0 && cpu == caller_cpu_.load(std::memory_order_relaxed)) break;
      spin_step();
    }
    std::unique_lock<std::mutex> lock(mu_);
    ++sleepers_;
    cv_.wait(lock, [&] {
      return stop_.load(std::memory_order_relaxed) ||
             region_.load(std::memory_order_acquire) != seen;
    });
    --sleepers_;
    return region_.load(std::memory_order_acquire);
  }

  void worker(int index, Slot& slot) {
    uint64_t seen = 0;
    for (;;) {
      seen = wait_for_region(seen);
      if (stop_.load()) return;
      if (index >= static_cast<int>(seen & 0xffff)) continue;  // not part of this region
      uint64_t open = open_claim(seen >> 16);
      if (!slot.claim.compare_exchange_strong(open, open | kByWorker, std::memory_order_acq_rel))
        continue;  // the caller ran this slice (and counted it)
      run_slice(index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller may be asleep on done_cv_
        done_cv_.notify_one();
      }
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  std::deque<Slot> slots_;  // slots_[t - 1]: worker t's
  const std::function<void(int64_t, int64_t, int)>* fn_ = nullptr;
  int64_t n_ = 0;
  int threads_ = 1;
  std::atomic<int> pending_{0};
  std::atomic<uint64_t> region_{0};  // generation << 16 | the region's thread count
  int sleepers_ = 0;                 // workers waiting on cv_ (under mu_)
  std::atomic<int> caller_cpu_{-1};  // the CPU of the last region's caller
  std::atomic<bool> stop_{false};
  std::exception_ptr error_;
};

// Never destroyed: workers may outlive static destruction order; replaced in a forked child.
Pool* g_pool = nullptr;
std::once_flag g_pool_once;

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool();
#ifdef FLASHDL_HAVE_ATFORK
    pthread_atfork([] { g_pool->before_fork(); }, [] { g_pool->after_fork_in_parent(); },
                   [] { g_pool = new Pool(); });
#endif
  });
  return *g_pool;
}

}  // namespace

int default_num_threads() {
  if (const char* env = std::getenv("FLASHDL_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  // Asked once: glibc reads /sys/devices/system/cpu/online for it, about 6 us, which was half of
  // a tiny call's time when no thread count was set.
  static const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

namespace {
constexpr uint64_t pack_range(uint64_t begin, uint64_t end) { return begin | (end << 32); }
constexpr int64_t range_begin(uint64_t w) { return static_cast<int64_t>(w & 0xffffffffu); }
constexpr int64_t range_end(uint64_t w) { return static_cast<int64_t>(w >> 32); }
}  // namespace

TaskQueue::TaskQueue(int64_t n, int threads)
    : threads_(threads), ranges_(new Range[static_cast<size_t>(threads)]) {
  if (n < 0 || n > int64_t{0xffffffff})
    throw std::invalid_argument("parallel_tasks: n must be in [0, 2^32)");
  for (int t = 0; t < threads; ++t) {
    int64_t b, e;
    static_slice(n, threads, t, b, e);
    ranges_[t].word.store(pack_range(static_cast<uint64_t>(b), static_cast<uint64_t>(e)),
                          std::memory_order_relaxed);
  }
}

bool TaskQueue::take_front(int t, int64_t& task) {
  uint64_t w = ranges_[t].word.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t b = range_begin(w), e = range_end(w);
    if (b >= e) return false;
    if (ranges_[t].word.compare_exchange_weak(w, pack_range(b + 1, e), std::memory_order_relaxed)) {
      task = b;
      return true;
    }
  }
}

bool TaskQueue::take_back(int t, int64_t& task) {
  uint64_t w = ranges_[t].word.load(std::memory_order_relaxed);
  for (;;) {
    const int64_t b = range_begin(w), e = range_end(w);
    if (b >= e) return false;
    if (ranges_[t].word.compare_exchange_weak(w, pack_range(b, e - 1), std::memory_order_relaxed)) {
      task = e - 1;
      return true;
    }
  }
}

bool TaskQueue::next(int thread, int64_t& task) {
  if (take_front(thread, task)) return true;
  for (;;) {
    int victim = -1;
    int64_t most = 0;
    for (int t = 0; t < threads_; ++t) {
      const uint64_t w = ranges_[t].word.load(std::memory_order_relaxed);
      if (range_end(w) - range_begin(w) > most) {
        most = range_end(w) - range_begin(w);
        victim = t;
      }
    }
    if (victim < 0) return false;
    if (take_back(victim, task)) return true;  // else emptied meanwhile: look again
  }
}

void parallel_tasks(int64_t n, int threads, const std::function<void(Tasks&, int)>& fn) {
  if (n <= 0) return;
  if (threads > n) threads = static_cast<int>(n);
  if (threads < 1) threads = 1;
  TaskQueue queue(n, threads);
  parallel_for(threads, threads, [&](int64_t begin, int64_t, int t) {
    Tasks tasks(queue, static_cast<int>(begin));
    fn(tasks, t);
  });
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t, int64_t, int)>& fn) {
  if (n <= 0) return;
  if (threads > n) threads = static_cast<int>(n);
  if (threads <= 1) {
    fn(0, n, 0);
    return;
  }
  pool().run(n, threads, fn);
}

}  // namespace flashdl::cpu
