// A small persistent thread pool. parallel_for partitions statically and contiguously: thread t
// always gets the same slice of the task range, so per-thread partial results can be reduced in a
// fixed order. parallel_tasks starts from the same slices but lets a thread that finished its own
// take tasks from the end of another's, for loops whose result does not depend on which thread ran
// a task.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

namespace flashdl::cpu {

// Calls fn(begin, end, thread) on `threads` slices of [0, n) (thread 0 on the caller), and returns
// when all are done. The first exception thrown by any slice is rethrown here.
void parallel_for(int64_t n, int threads,
                  const std::function<void(int64_t begin, int64_t end, int thread)>& fn);

// The slice [begin, end) of [0, n) that thread t of `threads` gets.
inline void static_slice(int64_t n, int threads, int t, int64_t& begin, int64_t& end) {
  const int64_t base = n / threads, rem = n % threads;
  begin = t * base + (t < rem ? t : rem);
  end = begin + base + (t < rem ? 1 : 0);
}

int default_num_threads();

// The tasks of one parallel_tasks call: each thread's static slice as a range [begin, end) packed
// in one atomic word, so the owner takes tasks from the front and others from the back.
class TaskQueue {
 public:
  TaskQueue(int64_t n, int threads);
  // The next task for `thread`: the front of its own slice; when that is empty, the back of the
  // slice with the most tasks left (one at a time, so a thief stays within one head's tasks for
  // as long as it can). False when no task is left anywhere.
  bool next(int thread, int64_t& task);

 private:
  struct alignas(64) Range {
    std::atomic<uint64_t> word{0};  // begin in the low 32 bits, end in the high 32
  };
  bool take_front(int t, int64_t& task);
  bool take_back(int t, int64_t& task);
  int threads_;
  std::unique_ptr<Range[]> ranges_;
};

// The tasks of one thread's share of a parallel_tasks call.
class Tasks {
 public:
  Tasks(TaskQueue& queue, int thread) : queue_(queue), thread_(thread) {}
  bool next(int64_t& task) { return queue_.next(thread_, task); }

 private:
  TaskQueue& queue_;
  int thread_;
};

// Calls fn(tasks, thread) once on each of `threads` threads (thread 0 on the caller); each takes
// tasks of [0, n) from `tasks.next` until none is left. Without interference every thread runs
// exactly its parallel_for slice, in order; a thread slowed down (a core shared with another
// process's spinning threads, e.g. an OpenMP runtime's after its region) loses tasks from the end
// of its slice to the others instead of holding up the call. Only for loops whose result does not
// depend on which thread ran which task. n is at most 2^32 - 1.
void parallel_tasks(int64_t n, int threads, const std::function<void(Tasks&, int thread)>& fn);

}  // namespace flashdl::cpu
