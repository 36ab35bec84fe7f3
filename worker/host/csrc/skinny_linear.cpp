// A matmul for a few rows of x (skinny_linear.h says why and how).

#include "skinny_linear.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>

namespace conveyor {
namespace {

// A register tile: 4 rows of W times up to 4 rows of x, 16 vector accumulators (whose lane
// sums lane_sums16 takes in one go).
constexpr int64_t kTileRows = 4;
constexpr int64_t kGroupRows = 4;
// Rows of W per task: enough work to be worth handing to a thread.
constexpr int64_t kTaskRows = 64;

// out[g * R + r] = dot(w row r, x row g) for R rows of W and G rows of x (both of K floats).
template <int R, int G>
void tile(const float* __restrict w, const float* __restrict x, int64_t k_len,
          float* __restrict out) {
  vec acc[R * G] = {};
  int64_t k = 0;
  for (; k + kWidth <= k_len; k += kWidth) {
    vec xv[G];
    for (int g = 0; g < G; ++g) xv[g] = load(x + g * k_len + k);
    for (int r = 0; r < R; ++r) {
      const vec wv = load(w + r * k_len + k);
      for (int g = 0; g < G; ++g) acc[r * G + g] += wv * xv[g];
    }
  }
  float sums[R * G];
  if constexpr (R * G == 16 && kWidth == 16) {
    const vec all = lane_sums16(acc);
    for (int i = 0; i < 16; ++i) sums[i] = all[i];
  } else {
    for (int i = 0; i < R * G; ++i) {
      sums[i] = 0;
      for (int64_t l = 0; l < kWidth; ++l) sums[i] += acc[i][l];
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int g = 0; g < G; ++g) {
      float sum = sums[r * G + g];
      for (int64_t t = k; t < k_len; ++t) sum += w[r * k_len + t] * x[g * k_len + t];
      out[g * R + r] = sum;
    }
  }
}

template <int R>
void tile_rows(int64_t groups, const float* w, const float* x, int64_t k_len, float* out) {
  switch (groups) {
    case 1: return tile<R, 1>(w, x, k_len, out);
    case 2: return tile<R, 2>(w, x, k_len, out);
    case 3: return tile<R, 3>(w, x, k_len, out);
    default: return tile<R, 4>(w, x, k_len, out);
  }
}

}  // namespace

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x is a contiguous float32 [M, K] CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  weight.is_contiguous() && weight.size(1) == x.size(1),
              "weight is a contiguous float32 [N, K] tensor");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() &&
                                    bias.numel() == weight.size(0)),
              "bias is empty or float32 [N]");
  const int64_t m_len = x.size(0), n_len = weight.size(0), k_len = x.size(1);
  at::Tensor y = at::empty({m_len, n_len}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n_len, kTaskRows, [&](int64_t begin, int64_t end) {
    float part[kTileRows * kGroupRows];
    for (int64_t j = begin; j < end; j += kTileRows) {
      const int64_t rows = std::min(kTileRows, end - j);
      // The W tile stays in L1 while every group of x's rows passes over it.
      for (int64_t m = 0; m < m_len; m += kGroupRows) {
        const int64_t groups = std::min(kGroupRows, m_len - m);
        if (rows == kTileRows) {
          tile_rows<kTileRows>(groups, wp + j * k_len, xp + m * k_len, k_len, part);
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            tile_rows<1>(groups, wp + (j + r) * k_len, xp + m * k_len, k_len, part + r * groups);
          }
        }
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t r = 0; r < rows; ++r) {
            // Full tiles lay out [g][r] with stride R; the row-by-row tail [r][g].
            const float v = rows == kTileRows ? part[g * kTileRows + r] : part[r * groups + g];
            yp[(m + g) * n_len + j + r] = bp ? v + bp[j + r] : v;
          }
        }
      }
    }
  });
  return y;
}

}  // namespace conveyor
