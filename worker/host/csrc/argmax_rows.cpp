// Greedy decoding's pick on the CPU: the index of each row's largest logit, as torch.argmax
// gives it (the first of equal maxima; the first NaN where a row holds one), float32.
//
// Why not torch.argmax: on this project's CPU build it reads a [64, 8,192] batch at ~4 GB/s
// (0.5-1 ms, the largest piece of a greedy decode step's host time); here each row is one
// task, read once with 16 lanes of running maxima and their indices.

#include "each_task.h"
#include "kernels.h"
#include "vec.h"

#include <cmath>
#include <limits>

namespace conveyor {
namespace {

struct NoScratch {};

int64_t argmax_row(const float* x, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t at = 0;
  int64_t j = 0;
  bool nan = false;
  if (n >= kWidth) {
    ivec index;
    for (int l = 0; l < kWidth; ++l) index[l] = l;
    vec lane_best = load(x);
    ivec lane_at = index;
    ivec lane_nan = lane_best != lane_best;
    for (j = kWidth; j + kWidth <= n; j += kWidth) {
      index += static_cast<int32_t>(kWidth);
      const vec v = load(x + j);
      const ivec greater = v > lane_best;  // strictly: a lane keeps its first maximum
      lane_best = greater ? v : lane_best;
      lane_at = greater ? index : lane_at;
      lane_nan |= v != v;
    }
    for (int l = 0; l < kWidth; ++l) nan = nan || lane_nan[l];
    if (!nan) {
      best = lane_best[0];
      at = lane_at[0];
      for (int l = 1; l < kWidth; ++l) {  // the largest, and of equals the lowest index
        if (lane_best[l] > best || (lane_best[l] == best && lane_at[l] < at)) {
          best = lane_best[l];
          at = lane_at[l];
        }
      }
    }
  }
  if (!nan) {
    for (; j < n; ++j) {  // the tail's indices come after every lane's
      if (x[j] > best) {
        best = x[j];
        at = j;
      } else if (std::isnan(x[j])) {
        nan = true;
        break;
      }
    }
  }
  if (nan) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) return i;
    }
  }
  return at;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.size(1) > 0,
              "logits are a float32 [rows, vocab] CPU tensor with vocab > 0");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for_each_task<NoScratch>(rows, [&](int64_t r, NoScratch&) { o[r] = argmax_row(x + r * n, n); });
  return out;
}

}  // namespace conveyor
