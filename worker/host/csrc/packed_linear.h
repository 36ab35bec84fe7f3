// y = x @ W^T (+ bias) for up to a few hundred rows of x, float32, on the CPU, from a copy of
// W laid out for it: the matmuls of a decode step.
//
// W [N, K] is packed once into panels of 32 of its rows, transposed: panel p holds
// W[32p .. 32p + 31, k] for k = 0 .. K - 1 as K runs of 32 floats, one contiguous stream
// (the last panel padded with zeros). For each panel and each block of up to 12 rows of x,
// the kernel keeps 12 x 2 vectors of partial sums in registers and, per k, loads two vectors
// of the panel and broadcasts one float of each row: no horizontal sums, and the panel is
// read from memory once per matmul. It walks the panel 64 k rows at a time (the row blocks'
// sums wait in a stack buffer between tiles; each sum still runs in k order), and the first
// block's pass over a tile prefetches the next, so the weights' stream from memory overlaps
// the FMAs instead of arriving on demand. Panels go to the threads as they free up
// (each_task.h), so a thread that loses its core mid-matmul to another process leaves its
// panels to its partner instead of stalling the region.
//
// Tuned on AVX-512, 2 cores, the small preset's decode shapes, where it beats the skinny
// kernel and oneDNN up to 192 rows (docs/cpu-kernels.md, "Matmuls"); `python -m
// worker.bench.skinny_linear` measures it. Its 24 accumulators fit AVX-512's 32
// registers; on AVX2 or NEON they spill, and it has not been measured there.

#pragma once

#include "tensor_api.h"

#include <functional>

namespace conveyor {

// Output columns per panel: two 16-float vectors.
constexpr int64_t kPanelWidth = 32;

// Up to this many rows of x, linear.h takes packed_linear where a packed copy is given.
constexpr int64_t kPackedMaxRows = 192;

// W [N, K] float32 -> panels [ceil(N / 32), K, 32], zero-padded.
at::Tensor pack_weight(const at::Tensor& weight);

// x [M, K] contiguous, packed from pack_weight of a [N, K] weight, bias [N] or empty;
// returns [M, N].
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const at::Tensor& bias);

// One panel's columns of y: out[r][c] = x[r] . W[32p + c] (+ bias[c]) for r < m_len, c < cols
// (the panel's real columns), row r at out + r * ld; x [m_len, k_len] contiguous, bias the
// panel's own slice or null. next_panel: the panel this thread will most likely take next
// (its first rows are prefetched while this one ends), or null.
//
// claim, when given (then m_len <= kPackedMaxRows, whose rows' sums all fit the kernel's
// buffer, so every sum is computed before the first is stored), is asked exactly once, when
// every sum is ready and before anything is written to out (for no rows too): out is written
// only if it returns true. The return value says whether out was written. A step team's
// partner publishes a task this way, straight from the sums (step_team.h).
bool packed_panel(const float* x, int64_t m_len, int64_t k_len, const float* panel,
                  const float* next_panel, int64_t cols, const float* bias, float* out,
                  int64_t ld, const std::function<bool()>* claim = nullptr);

}  // namespace conveyor
