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

#include "vec.h"

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

// What attend_one_f32 keeps between sequences of one task.
struct AttendScratch {
  std::vector<float> scores;
  std::vector<int64_t> rows;  // the cache offset of each context position's slot
  std::vector<vec> partial;   // [query head][position in a block]: the dots' lane vectors
};

namespace detail {

// Context positions ahead of the one being read whose cache row is prefetched: blocks sit
// anywhere in the cache, so the hardware prefetcher loses the stream at every block's end,
// and a row asked for this early arrives while the rows before it are computed with.
constexpr int64_t kAhead = 16;

inline void prefetch_row(const float* p, int64_t floats) {
  for (int64_t f = 0; f < floats; f += kWidth) __builtin_prefetch(p + f, 0, 2);
}


inline float lane_sum(vec v) {
  float total = 0;
  for (int64_t l = 0; l < kWidth; ++l) total += v[l];
  return total;
}

// Query heads [h0, h0 + G) against the context's V rows: G * C accumulators stay in
// registers while the rows stream past once, each read front to back over the heads' span.
template <int C, int G>
void weigh_values(const float* v_cache, const int64_t* rows, int64_t len, int64_t row, int64_t h0,
                  int64_t group, const float* weights, int64_t stride, const float* inv,
                  float* out, int64_t head_dim) {
  vec acc[G][C] = {};
  int64_t offset[G];
  for (int g = 0; g < G; ++g) offset[g] = ((h0 + g) / group) * head_dim;
  for (int64_t p = 0; p < len; ++p) {
    const float* v = v_cache + rows[p];
    if (h0 == 0 && p + kAhead < len) prefetch_row(v_cache + rows[p + kAhead], row);
    for (int g = 0; g < G; ++g) {
      const vec w = broadcast(weights[g * stride + p]);
      const float* vh = v + offset[g];
      for (int c = 0; c < C; ++c) acc[g][c] += w * load(vh + c * kWidth);
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) store(out + g * head_dim + c * kWidth, acc[g][c] * inv[g]);
  }
}

// attend_one for float32 with head_dim = C * kWidth, vectorised: each block of kWidth
// positions is scored for every query head while its K rows sit in L1, the dots' lane sums
// coming out as one vector (lane_sums16); the softmax's exp is vexp; V rows are read once
// per pair of query heads sharing them.
template <int C>
void attend_vec(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                int64_t len, const Shape& s, float scale, float* out, AttendScratch& scratch) {
  const int64_t group = s.num_heads / s.num_kv_heads, row = s.num_kv_heads * s.head_dim;
  const int64_t padded = (len + kWidth - 1) / kWidth * kWidth;
  scratch.scores.resize(s.num_heads * padded);
  scratch.rows.resize(len);
  int64_t* rows = scratch.rows.data();
  for (int64_t p = 0; p < len; ++p) {
    rows[p] = (table[p / s.block_size] * s.block_size + p % s.block_size) * row;
  }
  float* scores = scratch.scores.data();
  const vec scaled = broadcast(scale);
  const vec none = broadcast(-std::numeric_limits<float>::infinity());
  scratch.partial.resize(s.num_heads * kWidth);
  vec* partial = scratch.partial.data();
  for (int64_t p0 = 0; p0 < len; p0 += kWidth) {
    const int64_t n = std::min(kWidth, len - p0);
    // Each K row is read front to back once, every query head scored against it.
    for (int64_t i = 0; i < n; ++i) {
      const float* k = k_cache + rows[p0 + i];
      if (p0 + i + kAhead < len) prefetch_row(k_cache + rows[p0 + i + kAhead], row);
      for (int64_t h = 0; h < s.num_heads; ++h) {
        const float* qh = q + h * s.head_dim;
        const float* kh = k + (h / group) * s.head_dim;
        vec a = load(qh) * load(kh);
        for (int c = 1; c < C; ++c) a += load(qh + c * kWidth) * load(kh + c * kWidth);
        partial[h * kWidth + i] = a;
      }
    }
    for (int64_t h = 0; h < s.num_heads; ++h) {
      for (int64_t i = n; i < kWidth; ++i) partial[h * kWidth + i] = vec{};
      vec dots = lane_sums16(partial + h * kWidth) * scaled;
      if (n < kWidth) {  // past the context: no weight at all
        for (int64_t i = n; i < kWidth; ++i) dots[i] = none[i];
      }
      store(scores + h * padded + p0, dots);
    }
  }
  float inv[64];
  for (int64_t h = 0; h < s.num_heads; ++h) {  // softmax, its maximum subtracted first
    float* w = scores + h * padded;
    vec top = none;
    for (int64_t p = 0; p < padded; p += kWidth) {
      const vec x = load(w + p);
      top = x > top ? x : top;
    }
    float best = top[0];
    for (int64_t l = 1; l < kWidth; ++l) best = std::max(best, top[l]);
    vec total = {};
    for (int64_t p = 0; p < padded; p += kWidth) {
      const vec e = vexp(load(w + p) - broadcast(best));
      store(w + p, e);
      total += e;
    }
    inv[h] = 1.0f / lane_sum(total);
  }
  // Heads in runs of G (16 accumulators), the last ones one by one.
  constexpr int G = 16 / C;
  int64_t h = 0;
  for (; h + G <= s.num_heads; h += G) {
    weigh_values<C, G>(v_cache, rows, len, row, h, group, scores + h * padded, padded, inv + h,
                       out + h * s.head_dim, s.head_dim);
  }
  for (; h < s.num_heads; ++h) {
    weigh_values<C, 1>(v_cache, rows, len, row, h, group, scores + h * padded, padded, inv + h,
                       out + h * s.head_dim, s.head_dim);
  }
}

}  // namespace detail

// The float32 attention of one sequence: vectorised where head_dim is 32, 64 or 128 and the
// query heads number at most 64, else attend_one.
inline void attend_one_f32(const float* q, const float* k_cache, const float* v_cache,
                           const int64_t* table, int64_t len, const Shape& s, float scale,
                           float* out, AttendScratch& scratch) {
  if (s.num_heads <= 64) {
    switch (s.head_dim) {
      case 2 * kWidth:
        return detail::attend_vec<2>(q, k_cache, v_cache, table, len, s, scale, out, scratch);
      case 4 * kWidth:
        return detail::attend_vec<4>(q, k_cache, v_cache, table, len, s, scale, out, scratch);
      case 8 * kWidth:
        return detail::attend_vec<8>(q, k_cache, v_cache, table, len, s, scale, out, scratch);
      default:
        break;
    }
  }
  attend_one<float>(q, k_cache, v_cache, table, len, s, scale, out, scratch.scores);
}

}  // namespace conveyor
