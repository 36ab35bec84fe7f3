// y = x @ W^T (+ bias) for the model's projections on the CPU, float32: the fastest of the
// matmuls at hand for the number of rows.
//
// - Up to kPackedMaxRows rows, where a packed copy of W is given: packed_linear (W in panels,
//   handed to the threads as they free up; packed_linear.h).
// - Else up to kSkinnyMaxRows rows: skinny_linear (W streamed once from memory,
//   skinny_linear.h).
// - Past it: oneDNN's matmul, the op torch's own compiler emits for CPU linears
//   (mkldnn::_linear_pointwise), faster than at::linear (the BLAS torch's CPU build calls,
//   which repacks W on every call) past 32 rows; `python -m worker.bench.skinny_linear`
//   measures it.
// - at::linear where the build of torch has no oneDNN, or when `blas_only` asks for it.

#pragma once

#include "tensor_api.h"

namespace conveyor {

// x [..., K] float32, weight [N, K] float32, bias [N] or empty, packed pack_weight(weight) or
// empty; returns [..., N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  bool blas_only, const at::Tensor& packed);

// Whether this build of torch has oneDNN's matmul.
bool has_onednn_linear();

}  // namespace conveyor
