// Decode attention straight from the paged KV cache, on the CPU (worker/attention/cpu_kernel.py).
//
// One query token per sequence; one task per sequence. A task walks the sequence's block
// table and reads each context row of K once (every query head scored against it), then
// each row of V once. Nothing is gathered into a temporary copy first, which is where the
// torch path spends half of its attention time, and a row's kv heads sit side by side, so
// a block is read front to back. Only slots inside a sequence's own context are read:
// free blocks may hold anything, NaN included.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

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

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens,
                           int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3,
              "q is [B, H, D] and the caches [slots, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q and the caches share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous caches");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "block tables and lengths are int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == q.size(0) &&
                  seq_lens.numel() == q.size(0),
              "one block table and one length per query");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(2) == k_cache.size(2),
              "query heads group over kv heads of the same width");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const Shape s{q.size(1), k_cache.size(1), q.size(2), block_tables.size(1), block_size};
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= s.table_width * block_size,
                "a sequence length outside its block table");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t per_query = s.num_heads * s.head_dim;
    at::parallel_for(0, q.size(0), 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> scores;
      for (int64_t b = begin; b < end; ++b) {
        attend_one<scalar_t>(qp + b * per_query, kp, vp, tables + b * s.table_width, lens[b], s,
                             static_cast<scalar_t>(scale), op + b * per_query, scores);
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (CPU)");
}
