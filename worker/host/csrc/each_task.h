// A region's tasks (a step's sequences, a matmul's panels of W) handed to the threads one
// at a time, as each thread finishes one.
//
// Decode attention costs in proportion to a sequence's context, and a step's contexts
// differ (W1's run from a few tokens to hundreds): at::parallel_for's even split of the
// batch would leave one thread waiting for the other at the region's end. And on a machine
// whose cores the engine shares (the worker's I/O threads, Redis, clients), another
// process that takes a core from one thread mid-region would make its partner wait out the
// whole absence; here the partner takes the remaining tasks meanwhile.

#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <exception>

namespace conveyor {

// f(i, scratch) for i in [0, n): ``Scratch`` is default-constructed once per thread. An
// exception thrown by f is rethrown here, after the region, as at::parallel_for does.
template <typename Scratch, typename F>
void for_each_task(int64_t n, const F& f) {
  if (n <= 1 || at::get_num_threads() <= 1 || at::in_parallel_region()) {
    Scratch scratch;
    for (int64_t i = 0; i < n; ++i) f(i, scratch);
    return;
  }
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
  // The whole team, as torch's own regions use it (one libgomp in the process): a
  // num_threads clause below the team's size would make libgomp end the spare threads and
  // start them again at the next full region. Threads past the tasks find no work.
#pragma omp parallel
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        f(i, scratch);
      } catch (...) {
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace conveyor
