// A step's sequences handed to the threads one at a time, as each thread finishes one.
//
// Decode attention costs in proportion to a sequence's context, and a step's contexts
// differ (W1's run from a few tokens to hundreds): at::parallel_for's even split of the
// batch would leave one thread waiting for the other at the region's end. And on a machine
// whose cores the engine shares (the worker's I/O threads, Redis, clients), another
// process that takes a core from one thread mid-region would make its partner wait out the
// whole absence; here the partner takes the remaining sequences meanwhile.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace conveyor {

// f(i, scratch) for i in [0, n): ``Scratch`` is default-constructed once per thread.
template <typename Scratch, typename F>
void for_each_sequence(int64_t n, const F& f) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    Scratch scratch;
    for (int64_t i = 0; i < n; ++i) f(i, scratch);
    return;
  }
  // The same OpenMP runtime as torch's own parallel regions (one libgomp in the process).
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) f(i, scratch);
  }
}

}  // namespace conveyor
