// A decode step's stages run by the OpenMP team in one parallel region, where the master
// never waits for a partner that lost its core: it takes the partner's task over.
//
// Why: on a machine whose cores the engine shares (the worker's publisher, Redis, clients),
// another process takes a core from one of the team's threads at some moment of nearly every
// step. With one parallel region per matmul or loop, the team's master then waits at that
// region's barrier for as long as its partner is off its core, however few tasks the
// partner held: the step loses the whole absence, not the partner's share of it. Here the
// step's stages (norms, matmuls, rope, attention, ...) run in a single region; each stage's
// tasks go to the threads as they free up, and when the master has nothing left of a stage
// but tasks a partner is still on, it waits about the length of one of its own tasks, then
// computes the late ones itself and goes on to the next stage. The partner, back on its
// core, finds its task taken, drops what it computed, and joins the stage the master is in.
//
// How a task's output stays right: the master writes its tasks straight into the stage's
// output. A partner computes into a scratch of its own, then claims the task's publication
// (a compare-and-swap on the task's state) and copies the scratch out; a task the master
// took over can no longer be claimed, so nothing of a partner's late result ever lands. A
// stage whose task keeps its whole result until its last moment (a matmul panel's sums)
// lets the partner claim at that moment and write straight into the output instead. So
// that the master can compute any task again, each task must be a function of inputs the
// stage does not write (decode_layers.cpp keeps its residual in two buffers in turn, and
// rope writes rotated copies). A partner that lost its task may read inputs that later
// stages overwrite meanwhile (a race the C++ model does not bless, on plain floats that
// every buffer of the step keeps until the region ends); that can only change the result
// it drops, never an index or a pointer: those the step does not write.
//
// How long the master waits before taking a task over: twice what the task should take,
// from the partner's claim, at the master's own pace in that stage (its time per unit of
// the stage's cost hint: rows, columns, context length), plus 2 us. Tasks that differ in
// cost (attention over contexts from a few tokens to thousands) are not taken from a
// partner that is simply on the longest one.
//
// The master still waits at the region's end for the partners to leave it: once a step.

#pragma once

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace conveyor {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One output block of a task: rows x cols floats, row r at ptr + r * ld.
struct Block {
  float* ptr = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  int64_t size() const { return rows * cols; }
};

// A task writes at most this many blocks (a norm writes the new residual and its norm).
constexpr int kMaxBlocks = 2;

template <typename Scratch>
struct Stage {
  int64_t tasks = 0;
  // What task i costs relative to the stage's other tasks (empty: all alike).
  std::function<double(int64_t i)> cost;
  // Stages of one kind share the master's pace estimate (used when the master ran none of
  // a stage's tasks itself); 0 to 7.
  int kind = 0;
  // The real output blocks of task i; returns how many.
  std::function<int(int64_t i, Block* out)> blocks;
  // Computes task i into dst[0..blocks), each with its own leading dimension.
  std::function<void(int64_t i, const Block* dst, Scratch& scratch)> run;
  // Optional, for a partner: computes task i and, once its result is ready and before
  // writing any of it, asks ``claim`` exactly once; writes it into its real blocks only if
  // that returns true, and then in full, without throwing (the master waits for a claimed
  // task). Returns whether it wrote. Saves the copy out of scratch where a task holds its
  // whole result in registers or on its stack until the end (a matmul panel's sums).
  std::function<bool(int64_t i, const Block* real, Scratch& scratch,
                     const std::function<bool()>& claim)>
      publish;
  // Run by the master alone, in one go (e.g. a scattered write no scratch can stand for).
  bool master_only = false;
};

// What the team did in the calls so far (tests and the bench read them).
struct TeamCounts {
  std::atomic<int64_t> takeovers{0};     // tasks the master computed again for a late partner
  std::atomic<int64_t> partner_tasks{0}; // tasks a partner computed and published
};
TeamCounts& team_counts();

// Test hook: partners sleep ``micros`` before publishing every ``every``-th task they
// compute (0: never), so that a test can make the take-over happen on demand.
struct TeamStall {
  std::atomic<int64_t> every{0}, micros{0};
};
TeamStall& team_stall();

namespace detail {

// Spins between yields of a thread that waits (~1-2 ms): only a wait that long lets another
// thread wanting the core (more threads than cores) have it. A partner that yielded
// whenever it waited ~0.1 ms for the master's next stage gave its core to the worker's I/O
// and came back late: W1 fleet / offline 0.97, 0.97, 0.98 against 1.07, 1.04, 1.07 without.
constexpr int kSpinsPerYield = 1 << 16;

inline void wait_a_moment(int& spins) {
  if (++spins % kSpinsPerYield == 0) {
    std::this_thread::yield();
  } else {
    cpu_relax();
  }
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

enum TaskState : uint8_t { kPending = 0, kDone = 1, kTakenOver = 2, kPublishing = 3 };

struct alignas(64) StageSlot {
  std::atomic<int64_t> next{0};  // the next unclaimed task
};

}  // namespace detail

// Runs ``stages`` in order across the calling thread's OpenMP team (see the top of the file);
// every stage is complete, its outputs written, when this returns. Where a region cannot be
// opened (already inside one, or a team of one), the calling thread runs every task itself.
template <typename Scratch>
void run_stages(const std::vector<Stage<Scratch>>& stages) {
  const int64_t count = static_cast<int64_t>(stages.size());
  if (at::in_parallel_region() || at::get_num_threads() <= 1) {
    Scratch scratch;
    Block out[kMaxBlocks];
    for (const auto& stage : stages) {
      for (int64_t i = 0; i < stage.tasks; ++i) {
        stage.blocks(i, out);
        stage.run(i, out, scratch);
      }
    }
    return;
  }
  std::vector<int64_t> first(count + 1, 0);  // each stage's first slot in ``slots``
  for (int64_t s = 0; s < count; ++s) first[s + 1] = first[s] + stages[s].tasks;
  // A byte of state and the claim time of each task: each is written once or twice in a
  // task's time, so neighbours sharing a cache line cost nothing to speak of.
  std::unique_ptr<std::atomic<uint8_t>[]> slots(new std::atomic<uint8_t>[first[count]]);
  std::unique_ptr<std::atomic<int64_t>[]> claimed_at(new std::atomic<int64_t>[first[count]]);
  for (int64_t t = 0; t < first[count]; ++t) {
    slots[t].store(detail::kPending, std::memory_order_relaxed);
    claimed_at[t].store(0, std::memory_order_relaxed);
  }
  std::unique_ptr<detail::StageSlot[]> claims(new detail::StageSlot[count]);
  alignas(64) std::atomic<int64_t> open{-1};  // the stage the master has opened
  alignas(64) std::atomic<bool> finished{false};
  std::exception_ptr error;
  TeamCounts& counts = team_counts();

  // A partner's loop: claim tasks of the open stage, compute each into scratch (or, for a
  // stage with ``publish``, where that keeps it), publish it
  // unless the master took it over; until the master says the step is finished.
  auto partner = [&]() {
    Scratch scratch;
    std::vector<float> buffer;
    int64_t done_with = -1;  // the last stage this thread found nothing left in
    const TeamStall& stall = team_stall();
    int64_t computed = 0;
    int spins = 0;
    while (!finished.load(std::memory_order_acquire)) {
      const int64_t s = open.load(std::memory_order_acquire);
      if (s < 0 || s == done_with) {
        detail::wait_a_moment(spins);
        continue;
      }
      const Stage<Scratch>& stage = stages[s];
      const int64_t i = claims[s].next.fetch_add(1, std::memory_order_acq_rel);
      if (i >= stage.tasks) {
        done_with = s;
        continue;
      }
      claimed_at[first[s] + i].store(detail::now_ns(), std::memory_order_relaxed);
      auto& state = slots[first[s] + i];
      // Whether this thread may publish task i: the test hook's stall, then the claim
      // (false once the master took the task over).
      auto may_publish = [&]() {
        const int64_t every = stall.every.load(std::memory_order_relaxed);
        if (every > 0 && ++computed % every == 0) {
          std::this_thread::sleep_for(
              std::chrono::microseconds(stall.micros.load(std::memory_order_relaxed)));
        }
        uint8_t expected = detail::kPending;
        return state.compare_exchange_strong(expected, detail::kPublishing,
                                             std::memory_order_acq_rel);
      };
      Block real[kMaxBlocks], mine[kMaxBlocks];
      const int n = stage.blocks(i, real);
      if (stage.publish) {
        // The claim's own result decides, not what publish returns: once claimed, the task
        // is this thread's to finish (the master waits for it), and publish writes it all.
        bool claimed = false;
        // Two references captured: small enough for std::function to hold without
        // allocating.
        const std::function<bool()> claim = [&may_publish, &claimed] {
          return claimed = may_publish();
        };
        stage.publish(i, real, scratch, claim);
        if (claimed) {
          state.store(detail::kDone, std::memory_order_release);
          counts.partner_tasks.fetch_add(1, std::memory_order_relaxed);
        }
        continue;
      }
      int64_t need = 0;
      for (int b = 0; b < n; ++b) need += real[b].size();
      if (static_cast<int64_t>(buffer.size()) < need) buffer.resize(need);
      float* at = buffer.data();
      for (int b = 0; b < n; ++b) {
        mine[b] = Block{at, real[b].rows, real[b].cols, real[b].cols};
        at += real[b].size();
      }
      stage.run(i, mine, scratch);
      if (may_publish()) {
        for (int b = 0; b < n; ++b) {
          for (int64_t r = 0; r < real[b].rows; ++r) {
            std::memcpy(real[b].ptr + r * real[b].ld, mine[b].ptr + r * mine[b].ld,
                        sizeof(float) * real[b].cols);
          }
        }
        state.store(detail::kDone, std::memory_order_release);
        counts.partner_tasks.fetch_add(1, std::memory_order_relaxed);
      }
    }
  };

  // The master: open each stage, take tasks until none is left, then wait out the
  // partners' tasks, taking over those that run late.
  auto master = [&]() {
    Scratch scratch;
    // The master's pace, nanoseconds per unit of cost, by stage kind (the last stage of
    // that kind where it ran tasks; 20 us a task until then).
    double pace[8];
    std::fill(pace, pace + 8, 20'000.0);
    for (int64_t s = 0; s < count; ++s) {
      const Stage<Scratch>& stage = stages[s];
      auto cost = [&](int64_t i) { return stage.cost ? stage.cost(i) : 1.0; };
      Block out[kMaxBlocks];
      if (stage.master_only || stage.tasks < 2) {
        claims[s].next.store(stage.tasks, std::memory_order_relaxed);
        for (int64_t i = 0; i < stage.tasks; ++i) {
          stage.blocks(i, out);
          stage.run(i, out, scratch);
        }
        continue;  // the next stage's opening publishes these writes
      }
      open.store(s, std::memory_order_release);
      const int64_t start = detail::now_ns();
      double done = 0;  // the cost of the tasks the master ran
      for (;;) {
        const int64_t i = claims[s].next.fetch_add(1, std::memory_order_acq_rel);
        if (i >= stage.tasks) break;
        stage.blocks(i, out);
        stage.run(i, out, scratch);
        slots[first[s] + i].store(detail::kDone, std::memory_order_release);
        done += cost(i);
      }
      double& unit = pace[stage.kind & 7];
      if (done > 0) unit = static_cast<double>(detail::now_ns() - start) / done;
      for (int64_t i = 0; i < stage.tasks; ++i) {
        auto& state = slots[first[s] + i];
        uint8_t now = state.load(std::memory_order_acquire);
        if (now == detail::kDone || now == detail::kTakenOver) continue;
        // Twice the task's expected time from its claim (a claim time not seen yet counts
        // from now), plus 2 us.
        const int64_t patience = static_cast<int64_t>(2 * unit * cost(i)) + 2'000;
        const int64_t seen = detail::now_ns();
        int spins = 0;
        while (now == detail::kPending) {
          const int64_t claimed = claimed_at[first[s] + i].load(std::memory_order_relaxed);
          if (detail::now_ns() - (claimed > 0 ? claimed : seen) > patience) break;
          detail::wait_a_moment(spins);
          now = state.load(std::memory_order_acquire);
        }
        uint8_t expected = detail::kPending;
        if (now == detail::kPending &&
            state.compare_exchange_strong(expected, detail::kTakenOver,
                                          std::memory_order_acq_rel)) {
          stage.blocks(i, out);
          stage.run(i, out, scratch);
          counts.takeovers.fetch_add(1, std::memory_order_relaxed);
          continue;
        }
        while (state.load(std::memory_order_acquire) == detail::kPublishing) {
          detail::wait_a_moment(spins);
        }
      }
    }
  };

#pragma omp parallel
  {
    if (omp_get_thread_num() == 0) {
      try {
        master();
      } catch (...) {
        error = std::current_exception();
      }
      finished.store(true, std::memory_order_release);
    } else {
      try {
        partner();
      } catch (...) {
        // A partner that cannot go on (its scratch could not be allocated, a task's check
        // failed before its claim) leaves its claimed task pending: the master takes it
        // over, and every task after it.
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace conveyor
