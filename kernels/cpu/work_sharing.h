// Work shared out by claiming: each of the pool's threads takes the next unclaimed index from a shared
// counter until none is left, instead of a fixed share decided up front.
//
// On a shared 2-core machine the two threads' speeds differ from moment to moment (another process on
// the core, the main thread's own work between ops), and with fixed shares the faster thread waits at the
// region's end. Batch-64 decode steps (perf, per thread, the same run with fixed shares and with claims
// for the attention's items and the AMX GEMM's strips): the main thread's time in libgomp 6.0% -> 1.2%,
// the pool's second thread's 19.1% -> 15.9% (most of what is left is the main thread's Python between
// steps, which no split of a region can fill). Which thread runs an index never changes its arithmetic,
// so results stay the same bits however the indices fall.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedserve_cpu {

class Claims {
 public:
  explicit Claims(int64_t n) : n_(n) {}
  // The next unclaimed index, or -1 once all are taken.
  int64_t next() {
    const int64_t i = next_.fetch_add(1, std::memory_order_relaxed);
    return i < n_ ? i : -1;
  }

 private:
  const int64_t n_;
  std::atomic<int64_t> next_{0};
};

// fn(claims) on up to `threads` of the pool's threads (the calling thread alone for one thread or one
// index, or inside another parallel region), each calling claims.next() until it returns -1. fn does its
// per-thread set-up once, before its first claim.
template <typename F>
void run_claiming(int64_t n, int64_t threads, F&& fn) {
  Claims claims(n);
  threads = std::min(threads, n);
  if (threads <= 1) {
    fn(claims);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { fn(claims); });
}

}  // namespace pagedserve_cpu
