// A small persistent thread pool with static, contiguous partitioning: thread t always gets the
// same slice of the task range, so per-thread partial results can be reduced in a fixed order.
#pragma once

#include <cstdint>
#include <functional>

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

}  // namespace flashdl::cpu
