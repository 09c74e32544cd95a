// The CPU thread pool (src/cpu/threads.hpp): parallel_for's static slices cover [0, n) once, in
// order, thread t always the same slice; parallel_tasks runs every task exactly once, each thread
// its own slice front to back when nothing slows it, and the tasks of a stalled thread's slice
// end up run by the others; regions whose thread counts change run each task once; an exception
// from any thread reaches the caller.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.hpp"
#include "cpu/threads.hpp"

using namespace flashdl_test;
namespace fc = flashdl::cpu;

namespace {

void test_static_slices() {
  for (int64_t n : {0, 1, 2, 7, 64, 1001})
    for (int threads : {1, 2, 3, 8}) {
      context() = "n " + std::to_string(n) + " threads " + std::to_string(threads);
      int64_t next = 0;
      for (int t = 0; t < threads; ++t) {
        int64_t b, e;
        fc::static_slice(n, threads, t, b, e);
        CHECK(b == next && e >= b);
        CHECK(e - b == n / threads || e - b == n / threads + 1);
        next = e;
      }
      CHECK(next == n);
    }
}

void test_parallel_for_runs_slices() {
  for (int threads : {1, 2, 4}) {
    context() = "threads " + std::to_string(threads);
    std::vector<std::atomic<int>> runs(1000);
    std::atomic<bool> wrong_slice{false};
    fc::parallel_for(1000, threads, [&](int64_t b, int64_t e, int t) {
      int64_t sb, se;
      fc::static_slice(1000, threads, t, sb, se);
      if (b != sb || e != se) wrong_slice = true;
      for (int64_t i = b; i < e; ++i) runs[i]++;
    });
    CHECK(!wrong_slice.load());
    for (auto& r : runs) CHECK(r.load() == 1);
  }
}

// Every task once; with nothing slowing a thread down, each runs its own slice in order.
void test_parallel_tasks_once() {
  for (int64_t n : {0, 1, 3, 64, 999})
    for (int threads : {1, 2, 3, 5}) {
      context() = "n " + std::to_string(n) + " threads " + std::to_string(threads);
      std::vector<std::atomic<int>> runs(static_cast<size_t>(n));
      std::atomic<int> calls{0};
      std::atomic<bool> out_of_range{false};
      fc::parallel_tasks(n, threads, [&](fc::Tasks& tasks, int) {
        calls++;
        for (int64_t i = 0; tasks.next(i);) {
          if (i < 0 || i >= n) {
            out_of_range = true;
            continue;
          }
          runs[static_cast<size_t>(i)]++;
        }
      });
      CHECK(!out_of_range.load());
      for (auto& r : runs) CHECK(r.load() == 1);
      CHECK(calls.load() == (n == 0 ? 0 : std::min<int64_t>(threads, n)));
    }
  // One thread: exactly 0, 1, ..., n - 1.
  std::vector<int64_t> order;
  fc::parallel_tasks(10, 1, [&](fc::Tasks& tasks, int) {
    for (int64_t i = 0; tasks.next(i);) order.push_back(i);
  });
  CHECK(order.size() == 10);
  for (size_t i = 0; i < order.size(); ++i) CHECK(order[i] == static_cast<int64_t>(i));
}

// Thread 1 stalls on its first task until thread 0 has run 40 tasks (thread 0 starts once thread 1
// holds that task): thread 0 can only get the last 8 from the back of thread 1's slice. Each task still runs once, thread 1's own tasks are taken
// front to back and thread 0's thefts back to front.
void test_parallel_tasks_steal() {
  const int64_t n = 64;  // slices [0, 32) and [32, 64)
  std::vector<std::atomic<int>> runs(n);
  std::atomic<int> done0{0};
  std::atomic<bool> holds{false};
  std::vector<int64_t> seq0, seq1;
  const auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  fc::parallel_tasks(n, 2, [&](fc::Tasks& tasks, int t) {
    if (t == 0)
      while (!holds.load() && std::chrono::steady_clock::now() < limit) std::this_thread::yield();
    for (int64_t i = 0; tasks.next(i);) {
      if (t == 1 && seq1.empty()) {
        holds = true;
        while (done0.load() < 40 && std::chrono::steady_clock::now() < limit)
          std::this_thread::yield();
      }
      runs[i]++;
      (t == 0 ? seq0 : seq1).push_back(i);
      if (t == 0) done0++;
    }
  });
  for (auto& r : runs) CHECK(r.load() == 1);
  CHECK_MSG(done0.load() >= 40, "thread 0 ran " + std::to_string(done0.load()) + " tasks");
  CHECK(!seq1.empty() && seq1.front() == 32);
  for (size_t i = 1; i < seq1.size(); ++i) CHECK(seq1[i] == seq1[i - 1] + 1);
  // Thread 0: 0..31 in order, then thefts from 63 downwards.
  for (int64_t i = 0; i < 32; ++i) CHECK(seq0[static_cast<size_t>(i)] == i);
  for (size_t i = 32; i < seq0.size(); ++i) CHECK(seq0[i] == 63 - static_cast<int64_t>(i - 32));
}

// Regions back to back with thread counts that change from one to the next (workers outside a
// region must not run it, nor run a later one twice): every task once, every time.
void test_changing_thread_counts() {
  bool all_once = true;
  for (int it = 0; it < 3000; ++it) {
    const int threads = 1 + it % 4;
    const int64_t n = 1 + it % 7;
    std::vector<std::atomic<int>> runs(static_cast<size_t>(3 * n));
    fc::parallel_for(n, threads, [&](int64_t b, int64_t e, int) {
      for (int64_t i = b; i < e; ++i) runs[static_cast<size_t>(i)]++;
    });
    fc::parallel_tasks(2 * n, 4 - it % 4, [&](fc::Tasks& tasks, int) {
      for (int64_t i = 0; tasks.next(i);) runs[static_cast<size_t>(n + i)]++;
    });
    for (auto& r : runs) all_once = all_once && r.load() == 1;
  }
  CHECK(all_once);
}

// Regions of tiny slices back to back: the caller, done with its own slice, runs a worker's
// slice that no worker has claimed yet (a worker whose core is busy elsewhere), and a worker
// that claims it first runs it: either way every slice exactly once, with its own index.
void test_caller_runs_unclaimed_slices() {
  const auto caller = std::this_thread::get_id();
  bool all_once = true, right_slices = true;
  int by_caller = 0, by_worker = 0;
  for (int it = 0; it < 20000; ++it) {
    const int threads = 2 + it % 2;
    std::vector<std::atomic<int>> runs(static_cast<size_t>(threads));
    std::vector<std::atomic<int>> on_caller(static_cast<size_t>(threads));
    fc::parallel_for(threads, threads, [&](int64_t b, int64_t e, int t) {
      if (b != t || e != t + 1) right_slices = false;
      runs[static_cast<size_t>(t)]++;
      if (std::this_thread::get_id() == caller) on_caller[static_cast<size_t>(t)]++;
    });
    for (int t = 0; t < threads; ++t) {
      all_once = all_once && runs[static_cast<size_t>(t)].load() == 1;
      if (t > 0) (on_caller[static_cast<size_t>(t)].load() ? by_caller : by_worker)++;
    }
  }
  context() = "worker slices run by the caller " + std::to_string(by_caller) + ", by workers " +
              std::to_string(by_worker);
  CHECK(all_once);
  CHECK(right_slices);
}

void test_exceptions() {
  // Task 1 is in thread 0's slice, task 6 in thread 1's (whichever thread ends up running it).
  for (int64_t bad : {1, 6}) {
    context() = "failing task " + std::to_string(bad);
    bool caught = false;
    try {
      fc::parallel_tasks(8, 2, [&](fc::Tasks& tasks, int) {
        for (int64_t i = 0; tasks.next(i);)
          if (i == bad) throw std::runtime_error("task failed");
      });
    } catch (const std::runtime_error& e) {
      caught = std::string(e.what()) == "task failed";
    }
    CHECK(caught);
  }
  bool caught = false;
  try {
    fc::parallel_tasks(int64_t{1} << 33, 2, [](fc::Tasks&, int) {});
  } catch (const std::invalid_argument&) {
    caught = true;
  }
  CHECK(caught);
}

}  // namespace

int main() {
  run_test("threads: static slices", test_static_slices);
  run_test("threads: parallel_for runs each static slice", test_parallel_for_runs_slices);
  run_test("threads: parallel_tasks runs every task once", test_parallel_tasks_once);
  run_test("threads: a stalled thread's tasks are taken from its slice's end",
           test_parallel_tasks_steal);
  run_test("threads: regions with changing thread counts", test_changing_thread_counts);
  run_test("threads: the caller runs slices no worker has claimed",
           test_caller_runs_unclaimed_slices);
  run_test("threads: exceptions reach the caller", test_exceptions);
  return finish();
}
