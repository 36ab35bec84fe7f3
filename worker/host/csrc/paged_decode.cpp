// Decode attention straight from the paged KV cache, on the CPU (worker/cpu_kernels.py):
// one query token per sequence, one task per sequence, handed out as threads free up
// (each_task.h; paged_attention.h does the work).

#include "each_task.h"
#include "kernels.h"
#include "paged_attention.h"

#include <ATen/Parallel.h>

namespace conveyor {
namespace {

// One sequence's attention: the vectorised float32 path, or the plain one for other types.
template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
            const int64_t* table, int64_t len, const Shape& s, scalar_t scale, scalar_t* out,
            std::vector<scalar_t>& scores, AttendScratch&) {
  attend_one<scalar_t>(q, k_cache, v_cache, table, len, s, scale, out, scores);
}

template <>
void attend<float>(const float* q, const float* k_cache, const float* v_cache,
                   const int64_t* table, int64_t len, const Shape& s, float scale, float* out,
                   std::vector<float>&, AttendScratch& scratch) {
  attend_one_f32(q, k_cache, v_cache, table, len, s, scale, out, scratch);
}

}  // namespace

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
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t per_query = s.num_heads * s.head_dim;
    struct Scratch {
      std::vector<scalar_t> scores;
      AttendScratch vectorised;
    };
    for_each_task<Scratch>(q.size(0), [&](int64_t b, Scratch& scratch) {
      attend(qp + b * per_query, kp, vp, tables + b * s.table_width, lens[b], s,
             static_cast<scalar_t>(scale), op + b * per_query, scratch.scores,
             scratch.vectorised);
    });
  });
  return out;
}

}  // namespace conveyor
