// Penalties on the CPU: the rows' logits changed in place at their distinct tokens
// (worker/sampling/penalties.py calls it for float32 CPU logits; it defines the order and
// the arithmetic, and its torch path runs elsewhere).
//
// The torch path is a gather, a where, a scatter and a scatter-add over flat indexes, each
// with its own temporaries: ~0.4 ms for 64 rows of ~230 distinct tokens each. Here it is two
// loops over the same lists and no temporaries. Every (row, token) of a list is distinct,
// so the order within a list does not matter and threads may split it anywhere; the lists
// run one after the other
// (repetition first), each value computed in float32 as the torch path computes it.

#include "kernels.h"

#include <ATen/Parallel.h>

namespace conveyor {
namespace {

// Entries per task: each is a load and a store, so a task needs thousands to be worth one.
constexpr int64_t kGrain = 4096;

void check_list(const torch::Tensor& index, const torch::Tensor& values, const char* what) {
  TORCH_CHECK(index.device().is_cpu() && index.scalar_type() == at::kLong && index.dim() == 2 &&
                  index.size(0) == 2 && index.is_contiguous(),
              what, ": a contiguous int64 [2, n] (row, token) index on the CPU");
  TORCH_CHECK(values.device().is_cpu() && values.scalar_type() == at::kDouble &&
                  values.dim() == 1 && values.size(0) == index.size(1) && values.is_contiguous(),
              what, ": one contiguous float64 value per (row, token)");
}

// f(logit, i) for entry i of a [2, n] (row, token) list, the entries split across threads.
template <typename F>
void each_entry(float* x, int64_t vocab, const torch::Tensor& index, const F& f) {
  const int64_t n = index.size(1);
  const int64_t* row = index.data_ptr<int64_t>();
  const int64_t* token = row + n;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(x[row[i] * vocab + token[i]], i);
  });
}

}  // namespace

void penalize(torch::Tensor logits, torch::Tensor context, torch::Tensor context_factors,
              torch::Tensor outputs, torch::Tensor output_deltas) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "logits are contiguous float32 [rows, vocab] on the CPU");
  check_list(context, context_factors, "context");
  check_list(outputs, output_deltas, "outputs");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  float* x = logits.data_ptr<float>();
  // Every index is checked before any logit changes: a bad list leaves the logits as they were.
  for (const torch::Tensor* index : {&context, &outputs}) {
    const int64_t n = index->size(1);
    const int64_t* row = index->data_ptr<int64_t>();
    const int64_t* token = row + n;
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(row[i] >= 0 && row[i] < rows && token[i] >= 0 && token[i] < vocab,
                  "(row, token) (", row[i], ", ", token[i], ") is outside the logits");
    }
  }
  const double* factor = context_factors.data_ptr<double>();
  each_entry(x, vocab, context, [&](float& v, int64_t i) {
    const float f = static_cast<float>(factor[i]);
    v = v > 0 ? v / f : v * f;
  });
  const double* delta = output_deltas.data_ptr<double>();
  each_entry(x, vocab, outputs, [&](float& v, int64_t i) { v -= static_cast<float>(delta[i]); });
}

}  // namespace conveyor
