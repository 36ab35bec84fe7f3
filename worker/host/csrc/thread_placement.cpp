// Each thread of the calling thread's OpenMP team on a CPU of its own (Linux).
//
// A team's threads are libgomp's, made the first time a thread runs a parallel region, and
// they inherit that thread's CPU set: pinning the caller before would put the whole team on
// its CPU. So each thread pins itself, inside one region of the full team, which libgomp
// keeps for the calling thread's later regions. libgomp ends the threads a smaller region
// leaves out and makes them again, from the master, at the next full one: past two threads
// (where torch's small regions run on fewer) the pins would not last, and
// worker/fleet/cpu_placement.py places no larger team.

#include "kernels.h"

#include <ATen/Parallel.h>

#ifdef __linux__
#include <sched.h>
#endif
#include <omp.h>

#include <atomic>

namespace conveyor {

int64_t bind_team(std::vector<int64_t> cpus) {
  TORCH_CHECK(!cpus.empty(), "at least one CPU");
#ifdef __linux__
  for (const int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "a CPU number out of range: ", cpu);
  }
  // torch sets a thread's OpenMP thread count at its first use of torch's threads: do it
  // now, so that the region below is the team torch's regions will use.
  const int64_t threads = at::get_num_threads();
  const int64_t n = static_cast<int64_t>(cpus.size());
  if (threads != n) return 0;  // all or nothing: no team with some threads pinned
  std::atomic<int64_t> bound{0};
  // The whole team, as torch's regions use it (each_task.h says why).
#pragma omp parallel
  {
    if (omp_get_num_threads() == n) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpus[omp_get_thread_num()]), &set);
      // pid 0: the calling thread alone.
      if (sched_setaffinity(0, sizeof(set), &set) == 0) bound.fetch_add(1);
    }
  }
  return bound.load();
#else
  return 0;
#endif
}

}  // namespace conveyor
