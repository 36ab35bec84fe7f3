// The slice of torch's C++ API the kernels' sources use: ATen's Tensor, the few ATen ops they
// call and at::parallel_for. Only bindings.cpp includes <torch/extension.h> (pybind11 and all
// of torch): parsing it was most of each source's compile time.

#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

namespace torch {
using at::Tensor;  // the kernels' signatures name torch::Tensor, as torch/extension.h spells it
}  // namespace torch
