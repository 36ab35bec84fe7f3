// The projections' matmul on the CPU (linear.h says which one runs when).

#include "linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>

#include <optional>
#include <string>

#include "packed_linear.h"
#include "skinny_linear.h"

namespace conveyor {
namespace {

// Looked up once: the op is registered when libtorch_cpu loads, or never.
const c10::OperatorHandle* onednn_op() {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  return op.has_value() ? &*op : nullptr;
}

// mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars,
// str? algorithm), called boxed: no post-op ("none").
at::Tensor onednn_linear(const c10::OperatorHandle& op, const at::Tensor& x,
                         const at::Tensor& weight, const at::Tensor& bias) {
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.numel() ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

}  // namespace

bool has_onednn_linear() { return onednn_op() != nullptr; }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& given_bias,
                  bool blas_only, const at::Tensor& packed) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1 &&
                  weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  x.size(-1) == weight.size(1),
              "x [..., K] and weight [N, K], float32 on the CPU");
  TORCH_CHECK(given_bias.numel() == 0 ||
                  (given_bias.scalar_type() == at::kFloat && given_bias.dim() == 1 &&
                   given_bias.size(0) == weight.size(0)),
              "bias is empty or float32 [N]");
  // oneDNN and the native kernels read a bias as packed floats: a strided or expanded one
  // is packed first.
  const at::Tensor& bias = given_bias.numel() ? given_bias.contiguous() : given_bias;
  if (blas_only) return bias.numel() ? at::linear(x, weight, bias) : at::linear(x, weight);
  const int64_t rows = x.numel() / std::max<int64_t>(x.size(-1), 1);
  auto sizes = x.sizes().vec();
  sizes.back() = weight.size(0);
  if (rows > 0 && rows <= kPackedMaxRows && packed.defined() && packed.numel() > 0) {
    return packed_linear(x.reshape({rows, x.size(-1)}).contiguous(), packed, weight.size(0),
                         bias)
        .view(sizes);
  }
  if (rows > 0 && rows <= kSkinnyMaxRows && weight.is_contiguous()) {
    return skinny_linear(x.reshape({rows, x.size(-1)}).contiguous(), weight, bias).view(sizes);
  }
  if (const c10::OperatorHandle* op = onednn_op(); op != nullptr && rows > 0) {
    return onednn_linear(*op, x, weight, bias);
  }
  return bias.numel() ? at::linear(x, weight, bias) : at::linear(x, weight);
}

}  // namespace conveyor
