// A matmul for a few rows of x (skinny_linear.h says why and how).

#include "skinny_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace conveyor {
namespace {

constexpr int64_t kWidth = 16;  // floats per vector
typedef float vec __attribute__((vector_size(kWidth * sizeof(float))));
// A register tile: 4 rows of W times up to 4 rows of x, 16 vector accumulators (whose lane
// sums lane_sums16 takes in one go).
constexpr int64_t kTileRows = 4;
constexpr int64_t kGroupRows = 4;
// Rows of W per task: enough work to be worth handing to a thread.
constexpr int64_t kTaskRows = 64;

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The lane sums of 16 vectors as one vector (lane i: the sum of acc[i]), in 15 shuffle-and-add
// steps of a fixed tree instead of 240 scalar adds: at these shapes reducing a tile's
// accumulators one lane at a time costs as much as the tile's multiplications.
#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else  // GCC 11 and older: the same selection from the concatenation of a and b
typedef int32_t lanes __attribute__((vector_size(kWidth * sizeof(int32_t))));
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, lanes{__VA_ARGS__})
#endif

inline vec pair8(vec a, vec b) {  // [a0..7 + a8..15, b0..7 + b8..15]
  return SHUFFLE(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
         SHUFFLE(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                 31);
}
inline vec pair4(vec a, vec b) {  // halves of 8 partial sums each -> quarters of 4
  return SHUFFLE(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
         SHUFFLE(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline vec pair2(vec a, vec b) {  // quarters of 4 -> eighths of 2
  return SHUFFLE(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
         SHUFFLE(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline vec pair1(vec a, vec b) {  // eighths of 2 -> one sum a lane
  return SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}
inline vec lane_sums16(const vec* acc) {
  vec t[8], u[4];
  for (int i = 0; i < 8; ++i) t[i] = pair8(acc[2 * i], acc[2 * i + 1]);
  for (int i = 0; i < 4; ++i) u[i] = pair4(t[2 * i], t[2 * i + 1]);
  return pair1(pair2(u[0], u[1]), pair2(u[2], u[3]));
}

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
