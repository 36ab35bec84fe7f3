// Decode attention for one sequence, straight from the paged KV cache, on the CPU: shared by
// paged_decode.cpp (attention alone) and decode_layers.cpp (a whole decode step).
//
// A call walks the sequence's block table and reads each context row of K once (every
// query head scored against it), then each row of V once. Nothing is gathered into a
// temporary copy first, and a row's kv heads sit side by side, so a block is read front to
// back. Only slots inside the sequence's own context are read: free blocks may hold
// anything, NaN included.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace conveyor {

// Independent partial sums: without them the compiler may not reorder a floating-point
// sum, and a dot product would run as one serial chain of adds.
constexpr int64_t kLanes = 16;

template <typename scalar_t>
inline scalar_t dot(const scalar_t* __restrict a, const scalar_t* __restrict b, int64_t n) {
  scalar_t part[kLanes] = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) part[l] += a[d + l] * b[d + l];
  }
  scalar_t total = 0;
  for (int64_t l = 0; l < kLanes; ++l) total += part[l];
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, table_width, block_size;
};

template <typename scalar_t>
void attend_one(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                const int64_t* table, int64_t len, const Shape& s, scalar_t scale,
                scalar_t* out, std::vector<scalar_t>& scores) {
  const int64_t group = s.num_heads / s.num_kv_heads;  // query head h reads kv head h / group
  const int64_t row = s.num_kv_heads * s.head_dim;      // elements of one cache slot
  scores.resize(s.num_heads * len);
  for (int64_t p = 0; p < len; ++p) {
    const int64_t slot = table[p / s.block_size] * s.block_size + p % s.block_size;
    const scalar_t* k = k_cache + slot * row;
    for (int64_t h = 0; h < s.num_heads; ++h) {
      scores[h * len + p] = dot(q + h * s.head_dim, k + (h / group) * s.head_dim, s.head_dim) * scale;
    }
  }
  for (int64_t h = 0; h < s.num_heads; ++h) {  // softmax, its maximum subtracted first
    scalar_t* w = scores.data() + h * len;
    scalar_t top = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t p = 0; p < len; ++p) top = std::max(top, w[p]);
    scalar_t total = 0;
    for (int64_t p = 0; p < len; ++p) {
      w[p] = std::exp(w[p] - top);
      total += w[p];
    }
    const scalar_t inv = scalar_t(1) / total;
    for (int64_t p = 0; p < len; ++p) w[p] *= inv;
  }
  std::fill(out, out + s.num_heads * s.head_dim, scalar_t(0));
  for (int64_t p = 0; p < len; ++p) {
    const int64_t slot = table[p / s.block_size] * s.block_size + p % s.block_size;
    const scalar_t* v = v_cache + slot * row;
    for (int64_t h = 0; h < s.num_heads; ++h) {
      const scalar_t w = scores[h * len + p];
      scalar_t* __restrict o = out + h * s.head_dim;
      const scalar_t* __restrict vh = v + (h / group) * s.head_dim;
      for (int64_t d = 0; d < s.head_dim; ++d) o[d] += w * vh[d];
    }
  }
}

}  // namespace conveyor
