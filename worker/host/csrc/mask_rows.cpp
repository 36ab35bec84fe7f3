// Structured outputs' token masks on the CPU, in place (worker/sampling/grammar.py calls it
// for float32 CPU logits; its torch path runs elsewhere): every logit of a named row whose
// bit is clear in that row's mask becomes -inf.
//
// The torch path builds a [rows, vocab] bias and adds it: three passes over 8 MB at batch 64
// and vocab 32,000, ~2 ms in a step. Here each row reads its 4 KB of mask: a word with every
// bit set (most of them inside a JSON string) costs one compare, a word with none set
// (most of them where the grammar allows a few tokens) one vectorised fill, and the rest a
// store per clear bit.

#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace conveyor {

void mask_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor mask) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.is_contiguous(),
              "logits are contiguous float32 [rows, vocab] on the CPU");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  rows.is_contiguous(),
              "rows: a contiguous int64 [n] on the CPU");
  const int64_t n = rows.size(0), num_rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(mask.device().is_cpu() && mask.scalar_type() == at::kInt && mask.dim() == 2 &&
                  mask.is_contiguous() && mask.size(0) == n && mask.size(1) * 32 >= vocab,
              "mask: a contiguous int32 [n, words] on the CPU, 32 tokens a word, covering "
              "the vocabulary");
  const int64_t* row = rows.data_ptr<int64_t>();
  // Every row is checked before any logit changes: a bad list leaves the logits as they were.
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(row[i] >= 0 && row[i] < num_rows, "row ", row[i], " is outside the logits");
  }
  const int64_t words = mask.size(1);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  constexpr float kBlocked = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* logit = x + row[i] * vocab;
      const uint32_t* word = bits + i * words;
      for (int64_t w = 0; w < words && 32 * w < vocab; ++w) {
        const uint32_t set = word[w];
        if (set == 0xFFFFFFFFu) continue;
        const int64_t base = 32 * w, span = std::min<int64_t>(32, vocab - base);
        if (set == 0) {
          std::fill_n(logit + base, span, kBlocked);
          continue;
        }
        for (uint32_t clear = ~set; clear != 0; clear &= clear - 1) {
          const int64_t j = __builtin_ctz(clear);
          if (j >= span) break;  // (bits past the vocabulary: the mask's padding)
          logit[base + j] = kBlocked;
        }
      }
    }
  });
}

}  // namespace conveyor
