// Every decoder layer of a decode-only step, the final norm and the LM head (where the caller
// gives it) in one native call, float32, on the CPU (worker/models/native_decode.py decides
// when it applies).
//
// A decode step at batch 64 is ~250 small torch ops between its matmuls; from Python each
// costs a dispatch and often an allocation and a thread-team start, several milliseconds a
// step in all. Here the matmuls are the ones the Python path makes (linear.h: the skinny
// kernel for a small batch, else oneDNN's), and everything between them is a handful of
// fused loops: residual add + RMSNorm, rope + the cache write, attention
// (paged_attention.h), SiLU * up. Where the caller gives packed copies of the projections'
// weights (packed_linear.h), the matmuls take them. The numerics follow the Python
// path (worker/models/llama.py): RMSNorm in float32 as weight * (x * rsqrt(mean(x^2) + eps)),
// rope as x * cos + rotate_half(x) * sin from the same float32 tables; only the order of
// additions inside a sum may differ, as in any kernel.
//
// With every projection packed, the stages run as one parallel region whose master takes a
// late thread's tasks over (team_step below, step_team.h); otherwise each matmul and loop
// is a region of its own. Both compute the same bits.

#include "each_task.h"
#include "kernels.h"
#include "linear.h"
#include "packed_linear.h"
#include "paged_attention.h"
#include "step_team.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <tuple>

namespace conveyor {
namespace {

// The tensors of one layer, in this order; an absent bias is an empty tensor. q/k/v come
// as one [q + 2 kv, hidden] matrix and gate/up as one [2 inter, hidden] (views of weights
// the loader laid out back to back): one matmul each, whose output rows hold q, k, v (or
// gate, up) side by side.
enum Weight : int64_t {
  kInputNorm, kQKV, kQKVBias, kO, kOBias,
  kPostNorm, kGateUp, kGateUpBias, kDown, kDownBias, kWeightsPerLayer
};

// The packed copies of one layer's projections, in this order, when given.
enum Packed : int64_t { kPackedQKV, kPackedO, kPackedGateUp, kPackedDown, kPackedPerLayer };

// Rows per task of the elementwise loops: a row is a few hundred floats, so smaller tasks
// would cost more to hand out than to run.
constexpr int64_t kRowGrain = 16;

// One row: res = res_in + delta into res_out (which may be res_in; without delta the
// residual is res_in as it is), then out = weight * (res * rsqrt(mean(res^2) + eps)).
inline void norm_row(const float* res_in, const float* delta, float* res_out,
                     const float* weight, float* out, int64_t width, float eps) {
  const float* res = res_in;
  if (delta != nullptr) {
    for (int64_t i = 0; i < width; ++i) res_out[i] = res_in[i] + delta[i];
    res = res_out;
  }
  const float scale = 1.0f / std::sqrt(dot(res, res, width) / width + eps);
  for (int64_t i = 0; i < width; ++i) out[i] = weight[i] * (res[i] * scale);
}

// x += delta (when given), then out = weight * (x * rsqrt(mean(x^2) + eps)), row by row.
void add_rms_norm(float* x, const float* delta, const float* weight, float* out, int64_t rows,
                  int64_t width, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x + r * width, delta ? delta + r * width : nullptr, x + r * width, weight,
               out + r * width, width, eps);
    }
  });
}

// Non-interleaved rotation of one head from ``x`` into ``out`` (which may be ``x``):
// (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), where the table row holds head_dim / 2 values
// used for both halves.
inline void rotate_into(const float* x, float* out, const float* cos, const float* sin,
                        int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = x1 * cos[i] - x2 * sin[i];
    out[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

struct StepShape {
  int64_t batch, num_heads, num_kv_heads, head_dim;
  int64_t q_width() const { return num_heads * head_dim; }
  int64_t kv_width() const { return num_kv_heads * head_dim; }
  int64_t qkv_width() const { return q_width() + 2 * kv_width(); }
};

// Rope on token b's q and k heads (a qkv row holds q, k and v side by side) from ``src``
// into ``dst`` (which may be ``src``; v is copied when it is not).
inline void rope_row(const float* src, float* dst, int64_t position, const float* cos,
                     const float* sin, const StepShape& s) {
  const int64_t half = s.head_dim / 2;
  const float* c = cos + position * half;
  const float* sn = sin + position * half;
  for (int64_t h = 0; h < s.num_heads + s.num_kv_heads; ++h) {
    rotate_into(src + h * s.head_dim, dst + h * s.head_dim, c, sn, half);
  }
  if (dst != src) {
    std::copy(src + s.q_width() + s.kv_width(), src + s.qkv_width(),
              dst + s.q_width() + s.kv_width());
  }
}

// Rope on q and k in place, then k and v into the cache at each token's slot; row b of
// ``qkv`` holds that token's q, k and v side by side.
void rope_and_cache(float* qkv, const int64_t* positions, const int64_t* slots,
                    const float* cos, const float* sin, float* k_cache, float* v_cache,
                    const StepShape& s) {
  const int64_t kv_row = s.kv_width();
  at::parallel_for(0, s.batch, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      float* qb = qkv + b * s.qkv_width();
      rope_row(qb, qb, positions[b], cos, sin, s);
      const float* kb = qb + s.q_width();
      const float* vb = kb + kv_row;
      std::copy(kb, kb + kv_row, k_cache + slots[b] * kv_row);
      std::copy(vb, vb + kv_row, v_cache + slots[b] * kv_row);
    }
  });
}

// out[r] = silu(gate[r]) * up[r] for row r of ``gate_up`` [rows, 2 width], which holds gate
// then up; silu(x) = x / (1 + exp(-x)) as torch has it, with vexp (a batch-64 step of the
// small preset takes 720,000 of them).
void silu_mul(const float* gate_up, float* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    const vec one = broadcast(1.0f);
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * width;
      const float* up = gate + width;
      float* o = out + r * width;
      int64_t i = 0;
      for (; i + kWidth <= width; i += kWidth) {
        const vec g = load(gate + i);
        store(o + i, g / (one + vexp(-g)) * load(up + i));
      }
      for (; i < width; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
}

void check_inputs(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                  const at::Tensor& sin, const at::Tensor& slot_mapping,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& packed,
                  const std::vector<at::Tensor>& k_caches,
                  const std::vector<at::Tensor>& v_caches, const StepShape& s,
                  int64_t block_size) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.is_contiguous(),
              "x is a contiguous float32 [B, hidden] CPU tensor");
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(layers > 0 && v_caches.size() == k_caches.size() &&
                  static_cast<int64_t>(weights.size()) == layers * kWeightsPerLayer,
              "one K cache, one V cache and ", kWeightsPerLayer, " weights per layer");
  TORCH_CHECK(packed.empty() || static_cast<int64_t>(packed.size()) == layers * kPackedPerLayer,
              "no packed weights, or ", kPackedPerLayer, " per layer");
  for (const auto* t : {&positions, &slot_mapping, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == s.batch,
                "positions, slots and lengths are int64, one per token");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == s.batch,
              "one int64 block table per token");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) * 2 == s.head_dim && cos.sizes() == sin.sizes(),
              "float32 [positions, head_dim / 2] rope tables");
  TORCH_CHECK(s.num_heads % s.num_kv_heads == 0 && s.head_dim % 2 == 0,
              "query heads group over kv heads; an even head_dim");
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    for (const int64_t i : {kInputNorm, kPostNorm}) {
      TORCH_CHECK(w[i].scalar_type() == at::kFloat && w[i].is_contiguous() &&
                      w[i].numel() == x.size(1),
                  "float32 norm weights of the hidden size");
    }
    TORCH_CHECK(w[kQKV].dim() == 2 && w[kQKV].size(0) == s.qkv_width(),
                "one q/k/v matrix of q + 2 kv rows");
    TORCH_CHECK(w[kGateUp].dim() == 2 && w[kDown].dim() == 2 &&
                    w[kGateUp].size(0) == 2 * w[kDown].size(1) &&
                    w[kDown].size(1) == weights[kDown].size(1),
                "one gate/up matrix of twice the down projection's inputs, alike in every "
                "layer");
  }
  const int64_t slots = k_caches[0].numel() / (s.num_kv_heads * s.head_dim);
  for (int64_t l = 0; l < layers; ++l) {
    for (const auto* c : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(c->scalar_type() == at::kFloat && c->is_contiguous() &&
                      c->numel() == slots * s.num_kv_heads * s.head_dim,
                  "contiguous float32 caches, all of one size");
    }
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slot = slot_mapping.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < s.batch; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] < cos.size(0), "a position outside the rope table");
    TORCH_CHECK(slot[b] >= 0 && slot[b] < slots, "a cache slot outside the cache");
    TORCH_CHECK(lens[b] > 0 && lens[b] <= block_tables.size(1) * block_size,
                "a sequence length outside its block table");
  }
}

// ----- the step team (step_team.h): every layer's stages in one parallel region -----

struct TeamScratch {
  AttendScratch attend;
};
using TeamStage = Stage<TeamScratch>;

// Tasks of up to kRowGrain rows each over ``rows`` rows.
int64_t row_tasks(int64_t rows) { return (rows + kRowGrain - 1) / kRowGrain; }

// The stages' kinds (each has its own pace estimate, step_team.h).
enum StageKind : int { kNormStage = 1, kMatmulStage, kRopeStage, kAttentionStage, kSiluStage };

// A stage of row tasks over ``rows`` rows, each writing its rows of ``width`` floats of
// ``out``: its task count, kind, cost hint (rows a task) and blocks (a stage with more
// outputs sets its own).
TeamStage row_stage(int64_t rows, StageKind kind, float* out, int64_t width) {
  TeamStage stage;
  stage.tasks = row_tasks(rows);
  stage.kind = kind;
  stage.cost = [rows](int64_t i) {
    return static_cast<double>(std::min(kRowGrain, rows - i * kRowGrain));
  };
  stage.blocks = [=](int64_t i, Block* blocks) {
    const int64_t r0 = i * kRowGrain;
    blocks[0] = Block{out + r0 * width, std::min(kRowGrain, rows - r0), width, width};
    return 1;
  };
  return stage;
}

// Residual add + RMSNorm without writing in place: res_out = res_in + delta (when delta is
// given; else the residual stays res_in), normed = weight * (res * rsqrt(mean(res^2) + eps)).
TeamStage norm_stage(const float* res_in, const float* delta, float* res_out,
                     const float* weight, float* normed, int64_t rows, int64_t width,
                     float eps) {
  TeamStage stage = row_stage(rows, kNormStage, normed, width);
  stage.blocks = [=](int64_t i, Block* out) {
    const int64_t r0 = i * kRowGrain, n = std::min(kRowGrain, rows - r0);
    out[0] = Block{normed + r0 * width, n, width, width};
    if (delta == nullptr) return 1;
    out[1] = Block{res_out + r0 * width, n, width, width};
    return 2;
  };
  stage.run = [=](int64_t i, const Block* dst, TeamScratch&) {
    const int64_t r0 = i * kRowGrain;
    for (int64_t r = 0; r < dst[0].rows; ++r) {
      norm_row(res_in + (r0 + r) * width, delta ? delta + (r0 + r) * width : nullptr,
               delta ? dst[1].ptr + r * dst[1].ld : nullptr, weight,
               dst[0].ptr + r * dst[0].ld, width, eps);
    }
  };
  return stage;
}

// y [rows, n] = x [rows, k] @ W^T (+ bias), a task per panel of the packed W.
TeamStage matmul_stage(const float* x, int64_t rows, int64_t k, const at::Tensor& packed,
                       int64_t n, const at::Tensor& bias, float* y) {
  TeamStage stage;
  stage.tasks = packed.size(0);
  stage.kind = kMatmulStage;
  stage.cost = [=](int64_t p) {  // a panel's columns times its depth
    return static_cast<double>(std::min(kPanelWidth, n - p * kPanelWidth) * k);
  };
  const float* panels = packed.data_ptr<float>();
  const int64_t count = packed.size(0);
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  stage.blocks = [=](int64_t p, Block* out) {
    const int64_t col = p * kPanelWidth;
    out[0] = Block{y + col, rows, std::min(kPanelWidth, n - col), n};
    return 1;
  };
  // Panels go to the team's threads as they free up (step_team.h), so p + 1 is the next
  // this thread may take; where its partner takes it, the prefetch was only wasted.
  auto multiply = [=](int64_t p, const Block* dst, const std::function<bool()>* claim) {
    const int64_t col = p * kPanelWidth;
    const float* panel = panels + p * k * kPanelWidth;
    const float* next = p + 1 < count ? panel + k * kPanelWidth : nullptr;
    return packed_panel(x, rows, k, panel, next, dst[0].cols, b ? b + col : nullptr,
                        dst[0].ptr, dst[0].ld, claim);
  };
  stage.run = [=](int64_t p, const Block* dst, TeamScratch&) { multiply(p, dst, nullptr); };
  // A partner's panel goes from the kernel's sums to the output once claimed: no scratch.
  stage.publish = [=](int64_t p, const Block* real, TeamScratch&,
                      const std::function<bool()>& claim) { return multiply(p, real, &claim); };
  return stage;
}

// rotated = qkv with rope applied to its q and k parts (v as it is).
TeamStage rope_stage(const float* qkv, const int64_t* positions, const float* cos,
                     const float* sin, float* rotated, const StepShape& s) {
  const int64_t width = s.qkv_width();
  TeamStage stage = row_stage(s.batch, kRopeStage, rotated, width);
  stage.run = [=](int64_t i, const Block* dst, TeamScratch&) {
    const int64_t r0 = i * kRowGrain;
    for (int64_t r = 0; r < dst[0].rows; ++r) {
      rope_row(qkv + (r0 + r) * width, dst[0].ptr + r * dst[0].ld, positions[r0 + r], cos, sin,
               s);
    }
  };
  return stage;
}

// Each token's rotated k and its v into the cache at its slot: scattered rows, written by
// the master alone (a few KB a layer).
TeamStage cache_stage(const float* rotated, const int64_t* slots, float* k_cache,
                      float* v_cache, const StepShape& s) {
  TeamStage stage;
  stage.tasks = 1;
  stage.master_only = true;
  stage.blocks = [](int64_t, Block*) { return 0; };
  stage.run = [=](int64_t, const Block*, TeamScratch&) {
    const int64_t kv_row = s.kv_width();
    for (int64_t b = 0; b < s.batch; ++b) {
      const float* k = rotated + b * s.qkv_width() + s.q_width();
      std::copy(k, k + kv_row, k_cache + slots[b] * kv_row);
      std::copy(k + kv_row, k + 2 * kv_row, v_cache + slots[b] * kv_row);
    }
  };
  return stage;
}

// Attention of each sequence, the longest contexts first (``order``): the tasks a stage
// ends with are short, so the master's wait for a partner's last one is too.
TeamStage attention_stage(const float* rotated, const float* k_cache, const float* v_cache,
                          const int64_t* tables, const int64_t* lens, const int64_t* order,
                          const Shape& shape, float scale, float* out, const StepShape& s) {
  TeamStage stage;
  stage.tasks = s.batch;
  stage.kind = kAttentionStage;
  stage.cost = [=](int64_t i) { return static_cast<double>(lens[order[i]] + 16); };
  const int64_t width = s.q_width();
  stage.blocks = [=](int64_t i, Block* blocks) {
    blocks[0] = Block{out + order[i] * width, 1, width, width};
    return 1;
  };
  stage.run = [=](int64_t i, const Block* dst, TeamScratch& scratch) {
    const int64_t b = order[i];
    attend_one_f32(rotated + b * s.qkv_width(), k_cache, v_cache,
                   tables + b * shape.table_width, lens[b], shape, scale, dst[0].ptr,
                   scratch.attend);
  };
  return stage;
}

// out = silu(gate) * up for each row of gate_up [rows, 2 width].
TeamStage silu_stage(const float* gate_up, float* out, int64_t rows, int64_t width) {
  TeamStage stage = row_stage(rows, kSiluStage, out, width);
  stage.run = [=](int64_t i, const Block* dst, TeamScratch&) {
    const int64_t r0 = i * kRowGrain;
    for (int64_t r = 0; r < dst[0].rows; ++r) {
      silu_mul(gate_up + (r0 + r) * 2 * width, dst[0].ptr + r * dst[0].ld, 1, width);
    }
  };
  return stage;
}

// The whole step by the step team, the final norm and the LM head included: the same
// arithmetic as the per-region path below, with the residual kept in two buffers in turn and
// rope writing a rotated copy, so that any task can be computed again (step_team.h). Needs
// every projection packed.
// Returns the final norm's output; ``logits``, when defined, gets the LM head's (from its
// packed copy ``lm_head_packed``).
at::Tensor team_step(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                     const at::Tensor& sin, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const std::vector<at::Tensor>& weights,
                     const std::vector<at::Tensor>& packed, const at::Tensor& final_norm,
                     const at::Tensor& lm_head_packed, at::Tensor logits,
                     const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, const StepShape& s,
                     const Shape& attention, float eps, float scale) {
  const int64_t batch = s.batch, hidden = x.size(1);
  const int64_t inner = weights[kDown].size(1);
  auto buffer = [&](int64_t width) { return at::empty({batch, width}, x.options()); };
  at::Tensor normed = buffer(hidden), qkv = buffer(s.qkv_width()),
             rotated = buffer(s.qkv_width()), attended = buffer(s.q_width()),
             o = buffer(hidden), gate_up = buffer(2 * inner), activated = buffer(inner),
             down = buffer(hidden), post = buffer(hidden), cur = buffer(hidden);
  // Longest context first for attention.
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  std::vector<int64_t> order(batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a] > lens[b]; });
  const float* xp = x.data_ptr<float>();
  std::vector<TeamStage> stages;
  const int64_t layers = static_cast<int64_t>(k_caches.size());
  stages.reserve(layers * 10 + 2);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const at::Tensor* pk = packed.data() + l * kPackedPerLayer;
    // The residual entering the layer: x itself, or the last one plus the MLP's output.
    const float* res = l == 0 ? xp : cur.data_ptr<float>();
    stages.push_back(norm_stage(l == 0 ? xp : post.data_ptr<float>(),
                                l == 0 ? nullptr : down.data_ptr<float>(),
                                cur.data_ptr<float>(), w[kInputNorm].data_ptr<float>(),
                                normed.data_ptr<float>(), batch, hidden, eps));
    stages.push_back(matmul_stage(normed.data_ptr<float>(), batch, hidden, pk[kPackedQKV],
                                  s.qkv_width(), w[kQKVBias], qkv.data_ptr<float>()));
    stages.push_back(rope_stage(qkv.data_ptr<float>(), positions.data_ptr<int64_t>(),
                                cos.data_ptr<float>(), sin.data_ptr<float>(),
                                rotated.data_ptr<float>(), s));
    stages.push_back(cache_stage(rotated.data_ptr<float>(), slot_mapping.data_ptr<int64_t>(),
                                 k_caches[l].data_ptr<float>(), v_caches[l].data_ptr<float>(),
                                 s));
    stages.push_back(attention_stage(rotated.data_ptr<float>(), k_caches[l].data_ptr<float>(),
                                     v_caches[l].data_ptr<float>(),
                                     block_tables.data_ptr<int64_t>(), lens, order.data(),
                                     attention, scale, attended.data_ptr<float>(), s));
    stages.push_back(matmul_stage(attended.data_ptr<float>(), batch, s.q_width(), pk[kPackedO],
                                  hidden, w[kOBias], o.data_ptr<float>()));
    stages.push_back(norm_stage(res, o.data_ptr<float>(), post.data_ptr<float>(),
                                w[kPostNorm].data_ptr<float>(), normed.data_ptr<float>(), batch,
                                hidden, eps));
    stages.push_back(matmul_stage(normed.data_ptr<float>(), batch, hidden, pk[kPackedGateUp],
                                  2 * inner, w[kGateUpBias], gate_up.data_ptr<float>()));
    stages.push_back(silu_stage(gate_up.data_ptr<float>(), activated.data_ptr<float>(), batch,
                                inner));
    stages.push_back(matmul_stage(activated.data_ptr<float>(), batch, inner, pk[kPackedDown],
                                  hidden, w[kDownBias], down.data_ptr<float>()));
  }
  // The final norm of the last residual plus the last MLP output (into ``normed``: the
  // last layer's gate/up stage, its reader, is done by then), then the LM head where its
  // packed copy is given.
  stages.push_back(norm_stage(post.data_ptr<float>(), down.data_ptr<float>(),
                              cur.data_ptr<float>(), final_norm.data_ptr<float>(),
                              normed.data_ptr<float>(), batch, hidden, eps));
  if (logits.defined()) {
    stages.push_back(matmul_stage(normed.data_ptr<float>(), batch, hidden, lm_head_packed,
                                  logits.size(1), at::empty({0}, x.options()),
                                  logits.data_ptr<float>()));
  }
  run_stages(stages);
  return normed;
}

// The LM head's logits of ``normed`` by linear.h's matmul, where a head is given (not
// empty); else ``normed`` itself.
at::Tensor head_or_hidden(const at::Tensor& normed, const at::Tensor& lm_head,
                          const at::Tensor& lm_head_packed, bool blas_only) {
  if (lm_head.numel() == 0) return normed;
  return linear(normed, lm_head, at::empty({0}, normed.options()), blas_only, lm_head_packed);
}

// Whether ``p`` is a packed copy (pack_weight) of an [n, k] float32 weight on the CPU.
bool packed_fits(const at::Tensor& p, int64_t n, int64_t k) {
  return p.defined() && p.device().is_cpu() && p.scalar_type() == at::kFloat && p.dim() == 3 &&
         p.is_contiguous() && p.size(0) == (n + kPanelWidth - 1) / kPanelWidth &&
         p.size(1) == k && p.size(2) == kPanelWidth;
}

// Whether team_step can take this step: every projection packed, of the shapes team_step
// multiplies by (a projection of another shape takes the per-region path, whose matmuls
// check what they are given), float32 biases on the CPU, at most kPackedMaxRows rows.
bool team_applies(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                  const std::vector<at::Tensor>& packed, const StepShape& s, int64_t layers) {
  if (packed.empty() || s.batch > kPackedMaxRows) return false;
  const int64_t hidden = x.size(1), inner = weights[kDown].size(1);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    const at::Tensor* pk = packed.data() + l * kPackedPerLayer;
    // (weight, its packed copy, its rows N, its inputs K) as team_step multiplies them.
    const std::tuple<Weight, Packed, int64_t, int64_t> projections[] = {
        {kQKV, kPackedQKV, s.qkv_width(), hidden}, {kO, kPackedO, hidden, s.q_width()},
        {kGateUp, kPackedGateUp, 2 * inner, hidden}, {kDown, kPackedDown, hidden, inner}};
    for (const auto& [wi, pi, n, k] : projections) {
      if (w[wi].dim() != 2 || w[wi].size(0) != n || w[wi].size(1) != k ||
          !packed_fits(pk[pi], n, k)) {
        return false;
      }
      const at::Tensor& bias = w[wi + 1];
      if (bias.numel() && (!bias.device().is_cpu() || bias.scalar_type() != at::kFloat ||
                           bias.dim() != 1 || !bias.is_contiguous() || bias.numel() != n)) {
        return false;
      }
    }
  }
  return true;
}

}  // namespace

torch::Tensor decode_layers(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor seq_lens,
                            std::vector<torch::Tensor> weights,
                            std::vector<torch::Tensor> packed, torch::Tensor final_norm,
                            torch::Tensor lm_head, torch::Tensor lm_head_packed,
                            std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            double eps, double scale, bool blas_only, bool team) {
  const StepShape s{x.size(0), num_heads, num_kv_heads, head_dim};
  check_inputs(x, positions, cos, sin, slot_mapping, block_tables, seq_lens, weights, packed,
               k_caches, v_caches, s, block_size);
  const int64_t batch = s.batch, hidden = x.size(1);
  TORCH_CHECK(final_norm.device().is_cpu() && final_norm.scalar_type() == at::kFloat &&
                  final_norm.is_contiguous() && final_norm.numel() == hidden,
              "a float32 CPU final norm weight of the hidden size");
  const bool with_head = lm_head.numel() > 0;
  TORCH_CHECK(!with_head || (lm_head.device().is_cpu() && lm_head.scalar_type() == at::kFloat &&
                             lm_head.dim() == 2 && lm_head.size(1) == hidden),
              "a float32 CPU [vocab, hidden] LM head weight, or none");
  const float epsilon = static_cast<float>(eps);
  const Shape attention{num_heads, num_kv_heads, head_dim, block_tables.size(1), block_size};
  if (team && !blas_only &&
      team_applies(x, weights, packed, s, static_cast<int64_t>(k_caches.size()))) {
    // The LM head joins the team where its packed copy is given; else it follows it.
    const bool head_in_team = with_head && packed_fits(lm_head_packed, lm_head.size(0), hidden);
    at::Tensor logits = head_in_team ? at::empty({batch, lm_head.size(0)}, x.options())
                                     : at::Tensor();
    at::Tensor normed = team_step(x, positions, cos, sin, slot_mapping, block_tables, seq_lens,
                                  weights, packed, final_norm, lm_head_packed, logits,
                                  k_caches, v_caches, s, attention, epsilon,
                                  static_cast<float>(scale));
    return head_in_team ? logits : head_or_hidden(normed, lm_head, lm_head_packed, blas_only);
  }
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();

  at::Tensor normed = at::empty_like(x);
  at::Tensor attended = at::empty({batch, s.q_width()}, x.options());
  at::Tensor activated;  // silu(gate) * up, the down projection's input
  at::Tensor down;       // the previous layer's MLP output, added to x at the next norm
  const at::Tensor none;
  for (size_t l = 0; l < k_caches.size(); ++l) {
    const at::Tensor* w = weights.data() + l * kWeightsPerLayer;
    auto packed_of = [&](Packed i) -> const at::Tensor& {
      return packed.empty() ? none : packed[l * kPackedPerLayer + i];
    };
    add_rms_norm(x.data_ptr<float>(), down.defined() ? down.data_ptr<float>() : nullptr,
                 w[kInputNorm].data_ptr<float>(), normed.data_ptr<float>(), batch, hidden,
                 epsilon);
    at::Tensor qkv = linear(normed, w[kQKV], w[kQKVBias], blas_only, packed_of(kPackedQKV));
    rope_and_cache(qkv.data_ptr<float>(), positions.data_ptr<int64_t>(),
                   slot_mapping.data_ptr<int64_t>(), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), k_caches[l].data_ptr<float>(),
                   v_caches[l].data_ptr<float>(), s);
    const float* qp = qkv.data_ptr<float>();
    const float* kc = k_caches[l].data_ptr<float>();
    const float* vc = v_caches[l].data_ptr<float>();
    float* out = attended.data_ptr<float>();
    for_each_task<AttendScratch>(batch, [&](int64_t b, AttendScratch& scratch) {
      attend_one_f32(qp + b * s.qkv_width(), kc, vc, tables + b * attention.table_width,
                     lens[b], attention, static_cast<float>(scale), out + b * s.q_width(),
                     scratch);
    });
    at::Tensor o = linear(attended, w[kO], w[kOBias], blas_only, packed_of(kPackedO));
    add_rms_norm(x.data_ptr<float>(), o.data_ptr<float>(), w[kPostNorm].data_ptr<float>(),
                 normed.data_ptr<float>(), batch, hidden, epsilon);
    at::Tensor gate_up = linear(normed, w[kGateUp], w[kGateUpBias], blas_only,
                                 packed_of(kPackedGateUp));
    const int64_t inner = gate_up.size(1) / 2;
    if (!activated.defined()) activated = at::empty({batch, inner}, x.options());
    silu_mul(gate_up.data_ptr<float>(), activated.data_ptr<float>(), batch, inner);
    down = linear(activated, w[kDown], w[kDownBias], blas_only, packed_of(kPackedDown));
  }
  // The final norm of x + the last MLP output, then the LM head where it is given.
  add_rms_norm(x.data_ptr<float>(), down.data_ptr<float>(), final_norm.data_ptr<float>(),
               normed.data_ptr<float>(), batch, hidden, epsilon);
  return head_or_hidden(normed, lm_head, lm_head_packed, blas_only);
}

}  // namespace conveyor
