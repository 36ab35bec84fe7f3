// y = x @ W^T (+ bias) for a few rows of x, float32, on the CPU: the matmuls of a small decode
// batch.
//
// With 1 to 16 rows a matmul is a pass over W, and the time is how fast W streams from
// memory; the BLAS the CPU build of torch calls reads W at well under the machine's
// bandwidth at these shapes. Here each task takes a tile of W's rows, keeps it in L1 while
// every group of x's rows is multiplied against it, and holds the partial sums of a 4-row
// tile of W times a group of up to 4 rows of x in registers, so W is read from memory once
// and the arithmetic never waits for it. Vectors are GCC/Clang vector extensions: AVX-512,
// AVX2 or NEON, whichever the build targets.

#pragma once

#include "tensor_api.h"

namespace conveyor {

// Up to this many rows of x, linear.h takes skinny_linear: on the CPU it was tuned on
// (AVX-512, 2 cores) oneDNN's matmul catches up with it at 12-16 rows and wins past that
// (`python -m worker.bench.skinny_linear` measures it).
constexpr int64_t kSkinnyMaxRows = 12;

// x [M, K] contiguous, weight [N, K] contiguous, bias [N] or empty; returns [M, N].
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

}  // namespace conveyor
