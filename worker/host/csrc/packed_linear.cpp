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

// Rows of x whose sums one call keeps in its stack buffer (24 KiB); more go in turns.
constexpr int64_t kChunkRows = 192;

// The panel is walked in tiles of this many of its k rows (8 KiB, in L1 while every row
// block reads it), and the first block's pass over a tile prefetches the next tile (or the
// next panel's first) a row per k, both of its lines: without it each tile arrives from
// memory on demand, behind the hardware prefetcher, which costs most where the matmul is
// bound by the weights' stream (few rows).
constexpr int64_t kTileDepth = 64;

struct NoScratch {};

// Where a tile's first block prefetches: `rows` k rows of a panel, from `at`.
struct Ahead {
  const float* at;
  int64_t rows;
};

// sums[r][0..31] (+)= sum over k in [k0, k1) of x[r][k] * panel[k][0..31] for R rows of x
// (row stride ldx), starting from zero when `first`. The k order is the whole matmul's, tile
// after tile, so the result does not depend on the tiling.
template <int R>
void block(const float* __restrict x, int64_t ldx, const float* __restrict panel, int64_t k0,
           int64_t k1, float* __restrict sums, bool first, Ahead ahead) {
  vec lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? vec{} : load(sums + r * kPanelWidth);
    hi[r] = first ? vec{} : load(sums + r * kPanelWidth + kWidth);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const vec w_lo = load(panel + k * kPanelWidth), w_hi = load(panel + k * kPanelWidth + kWidth);
    if (k - k0 < ahead.rows) {
      const float* next = ahead.at + (k - k0) * kPanelWidth;
      __builtin_prefetch(next, 0, 3);
      __builtin_prefetch(next + kWidth, 0, 3);
    }
    for (int r = 0; r < R; ++r) {
      const vec xr = broadcast(x[r * ldx + k]);
      lo[r] += xr * w_lo;
      hi[r] += xr * w_hi;
    }
  }
  for (int r = 0; r < R; ++r) {
    store(sums + r * kPanelWidth, lo[r]);
    store(sums + r * kPanelWidth + kWidth, hi[r]);
  }
}

// The largest block that fits the rows left: 12, 8, 4, then one row at a time.
int64_t block_rows(int64_t left, const float* x, int64_t ldx, const float* panel, int64_t k0,
                   int64_t k1, float* sums, bool first, Ahead ahead) {
  if (left >= kBlockRows) {
    return block<kBlockRows>(x, ldx, panel, k0, k1, sums, first, ahead), kBlockRows;
  }
  if (left >= 8) return block<8>(x, ldx, panel, k0, k1, sums, first, ahead), 8;
  if (left >= 4) return block<4>(x, ldx, panel, k0, k1, sums, first, ahead), 4;
  if (left >= 3) return block<3>(x, ldx, panel, k0, k1, sums, first, ahead), 3;
  if (left >= 2) return block<2>(x, ldx, panel, k0, k1, sums, first, ahead), 2;
  return block<1>(x, ldx, panel, k0, k1, sums, first, ahead), 1;
}

// out[r][c] = sums[r][c] (+ bias[c]) for r < rows, c < cols. A whole panel's row is two
// vector moves: the compiler made each row's copy a call to memcpy, which cost more than the
// copy (~1% of a batch-64 decode step).
void store_rows(const float* sums, int64_t rows, int64_t cols, const float* bias, float* out,
                int64_t ld) {
  if (cols == kPanelWidth) {
    const vec b_lo = bias ? load(bias) : vec{}, b_hi = bias ? load(bias + kWidth) : vec{};
    for (int64_t r = 0; r < rows; ++r) {
      vec lo = load(sums + r * kPanelWidth), hi = load(sums + r * kPanelWidth + kWidth);
      if (bias) {  // no bias adds nothing, not +0.0 (which would turn a -0.0 into +0.0)
        lo += b_lo;
        hi += b_hi;
      }
      store(out + r * ld, lo);
      store(out + r * ld + kWidth, hi);
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + r * ld;
    const float* t = sums + r * kPanelWidth;
    for (int64_t c = 0; c < cols; ++c) o[c] = bias ? t[c] + bias[c] : t[c];
  }
}

}  // namespace

static_assert(kPackedMaxRows <= kChunkRows, "a claimed panel's sums are all in the buffer");

bool packed_panel(const float* x, int64_t m_len, int64_t k_len, const float* panel,
                  const float* next_panel, int64_t cols, const float* bias, float* out,
                  int64_t ld, const std::function<bool()>* claim) {
  TORCH_CHECK(claim == nullptr || m_len <= kChunkRows, "a claimed panel of too many rows");
  if (m_len == 0) return claim == nullptr || (*claim)();  // no rows: nothing to write
  alignas(64) float sums[kChunkRows * kPanelWidth];
  if (k_len == 0) {  // an empty sum: no tile runs to start the sums at zero
    std::fill(sums, sums + kChunkRows * kPanelWidth, 0.0f);
  }
  for (int64_t m0 = 0; m0 < m_len; m0 += kChunkRows) {
    const int64_t rows = std::min(kChunkRows, m_len - m0);
    for (int64_t k0 = 0; k0 < k_len; k0 += kTileDepth) {
      const int64_t k1 = std::min(k_len, k0 + kTileDepth);
      const Ahead ahead = k1 < k_len
          ? Ahead{panel + k1 * kPanelWidth, std::min(kTileDepth, k_len - k1)}
          : Ahead{next_panel, next_panel ? std::min(kTileDepth, k_len) : 0};
      for (int64_t m = 0; m < rows;) {
        m += block_rows(rows - m, x + (m0 + m) * k_len, k_len, panel, k0, k1,
                        sums + m * kPanelWidth, k0 == 0, m == 0 ? ahead : Ahead{nullptr, 0});
      }
    }
    if (claim != nullptr && !(*claim)()) return false;
    store_rows(sums, rows, cols, bias, out + m0 * ld, ld);
  }
  return true;
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
    const float* panel = wp + p * k_len * kPanelWidth;
    const float* next = p + 1 < packed.size(0) ? panel + k_len * kPanelWidth : nullptr;
    packed_panel(xp, m_len, k_len, panel, next, std::min(kPanelWidth, n - col),
                 bp ? bp + col : nullptr, yp + col, n);
  });
  return y;
}

}  // namespace conveyor
