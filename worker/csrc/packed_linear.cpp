// A matmul from W packed in panels (packed_linear.h says why and how).

#include "packed_linear.h"

#include "each_task.h"
#include "vec.h"

#include <algorithm>

namespace conveyor {
namespace {

static_assert(kPanelWidth == 2 * kWidth, "a panel row is two vectors");

// Rows of x per register block: 12 x 2 accumulators, 2 panel vectors and a broadcast fill
// 27 of AVX-512's 32 vector registers.
constexpr int64_t kBlockRows = 12;

struct NoScratch {};

// tile[r][0..31] = sum over k of x[r][k] * panel[k][0..31] for R rows of x (row stride ldx).
template <int R>
void block(const float* __restrict x, int64_t ldx, const float* __restrict panel,
           int64_t k_len, float* __restrict tile) {
  vec lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = vec{};
  for (int64_t k = 0; k < k_len; ++k) {
    const vec w_lo = load(panel + k * kPanelWidth), w_hi = load(panel + k * kPanelWidth + kWidth);
    for (int r = 0; r < R; ++r) {
      const vec xr = broadcast(x[r * ldx + k]);
      lo[r] += xr * w_lo;
      hi[r] += xr * w_hi;
    }
  }
  for (int r = 0; r < R; ++r) {
    store(tile + r * kPanelWidth, lo[r]);
    store(tile + r * kPanelWidth + kWidth, hi[r]);
  }
}

// The largest block that fits the rows left: 12, 8, 4, then one row at a time.
int64_t block_rows(int64_t left, const float* x, int64_t ldx, const float* panel,
                   int64_t k_len, float* tile) {
  if (left >= 12) return block<12>(x, ldx, panel, k_len, tile), 12;
  if (left >= 8) return block<8>(x, ldx, panel, k_len, tile), 8;
  if (left >= 4) return block<4>(x, ldx, panel, k_len, tile), 4;
  if (left >= 3) return block<3>(x, ldx, panel, k_len, tile), 3;
  if (left >= 2) return block<2>(x, ldx, panel, k_len, tile), 2;
  return block<1>(x, ldx, panel, k_len, tile), 1;
}

}  // namespace

void packed_panel(const float* x, int64_t m_len, int64_t k_len, const float* panel,
                  int64_t cols, const float* bias, float* out, int64_t ld) {
  alignas(64) float tile[kBlockRows * kPanelWidth];
  for (int64_t m = 0; m < m_len;) {
    const int64_t rows = block_rows(m_len - m, x + m * k_len, k_len, panel, k_len, tile);
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + (m + r) * ld;
      const float* t = tile + r * kPanelWidth;
      for (int64_t c = 0; c < cols; ++c) o[c] = bias ? t[c] + bias[c] : t[c];
    }
    m += rows;
  }
}

at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat &&
                  weight.dim() == 2,
              "weight is a float32 [N, K] CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanelWidth - 1) / kPanelWidth;
  at::Tensor padded = weight;
  if (panels * kPanelWidth != n) {
    padded = at::zeros({panels * kPanelWidth, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
  }
  return padded.view({panels, kPanelWidth, k}).transpose(1, 2).contiguous();
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x is a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat &&
                  packed.dim() == 3 &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) &&
                  packed.size(2) == kPanelWidth && n > (packed.size(0) - 1) * kPanelWidth &&
                  n <= packed.size(0) * kPanelWidth,
              "packed is pack_weight of a float32 [N, K] weight");
  TORCH_CHECK(bias.numel() == 0 ||
                  (bias.device().is_cpu() && bias.scalar_type() == at::kFloat &&
               bias.is_contiguous() && bias.numel() == n),
              "bias is empty or float32 [N]");
  const int64_t m_len = x.size(0), k_len = x.size(1);
  at::Tensor y = at::empty({m_len, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for_each_task<NoScratch>(packed.size(0), [&](int64_t p, NoScratch&) {
    const int64_t col = p * kPanelWidth;
    packed_panel(xp, m_len, k_len, wp + p * k_len * kPanelWidth, std::min(kPanelWidth, n - col),
                 bp ? bp + col : nullptr, yp + col, n);
  });
  return y;
}

}  // namespace conveyor
