// Draw one token per row from its logits and sampling parameters, on the CPU
// (worker/sampling/sampler.py calls it for float32 CPU logits).
//
// On the torch path a top-p row costs about ten passes over the batch's probabilities
// (the histogram's bins, its scatter, the kept mask, the masked product, a cumulative sum
// over the whole vocabulary, a search): ~6 ms for 64 rows of 32,000 tokens, a tenth of the
// step; and temperature and softmax are two more passes over the whole batch before it.
// Here each row is one task and its passes stay in L2 (a 32,000-token row is 128 KB):
//
//   1. the row's logits over its temperature, its best scaled logit (vector max), and its
//      unnormalised probabilities e^(x - best) (vexp) with their sum; min-p's floor is
//      best + log(min_p);
//   2. top-k rows: the k largest values, from the maxima of groups of 64 tokens and a second
//      look at the few groups that can hold them (torch.topk took ~0.8 ms for 64 rows of
//      8,192 tokens); their floor is the k-th value, raised by top-p over those k values
//      renormalised, as filters.floors defines it;
//      top-p rows without top-k: the mass histogram over bins of 1/bins_per_nat nat below
//      the best, and from it the last kept bin, exactly the cut filters.top_p_keep defines;
//   3. the kept mass of each block of kBlock tokens (vector sums, then in double);
//   4. the inverse-CDF draw: whole blocks are skipped by their sums, and only the block the
//      draw lands in is scanned token by token.
//
// A row's result depends on its own inputs only (never the batch or the thread count), so a
// seeded request draws the same token alone and in any batch. The sums differ from the torch
// path's in rounding, so where a draw lands within rounding of a token boundary the two
// paths may pick neighbouring tokens: a given build always picks the same one.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace conveyor {
namespace {

typedef ivec mask;
// Tokens per block of the draw's first level: the scan of one block is all the sequential
// work a draw does.
constexpr int64_t kBlock = 256;

inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// The largest lane of `v`: the halves' maxima, down to one lane.
inline float hmax(vec v) {
  v = vmax(v, CONVEYOR_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, CONVEYOR_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3));
  v = vmax(v, CONVEYOR_SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1));
  v = vmax(v, CONVEYOR_SHUFFLE(v, v, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0));
  return v[0];
}

// What a row keeps: x >= floor, and, for a top-p row, a distance below the best of less
// than `limit` bins (bin <= edge is distance < edge + 1: truncation is floor for d >= 0).
struct Keep {
  float best, floor, bins_per_nat, limit;
  bool nucleus;

  bool at(float x) const {
    return x >= floor && (!nucleus || (best - x) * bins_per_nat < limit);
  }
  mask at(vec x) const {
    mask m = x >= broadcast(floor);
    if (nucleus) m &= (broadcast(best) - x) * broadcast(bins_per_nat) < broadcast(limit);
    return m;
  }
};

float row_max(const float* x, int64_t vocab) {
  vec m = broadcast(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kWidth <= vocab; j += kWidth) {
    m = vmax(load(x + j), m);
  }
  float best = hmax(m);
  for (; j < vocab; ++j) best = std::max(best, x[j]);
  return best;
}

// The last bin top-p keeps: the first whose cumulative mass (bins nearest the best first)
// reaches top_p, or the last bin where rounding leaves the whole row short of it.
//
// The last bin's own mass is never needed: when the cumulative mass before it falls short
// of top_p the cut is the last bin whatever it holds. So a token that far down (and an inf
// or NaN distance) is added to one of kSinks spare slots instead, lane by lane: spread, its
// adds never wait on one another as they would queued on one slot, and the bins' loop
// has no branch to mispredict. `mass` has num_bins - 1 + kSinks slots.
constexpr int64_t kSinks = kWidth;

int64_t last_kept_bin(const float* x, const float* p, int64_t vocab, float best,
                      float bins_per_nat, double top_p, std::vector<float>& mass) {
  const int64_t last = static_cast<int64_t>(mass.size()) - kSinks;
  const vec far = broadcast(static_cast<float>(last));
  vec sinks;
  for (int64_t l = 0; l < kWidth; ++l) sinks[l] = static_cast<float>(last + l);
  std::fill(mass.begin(), mass.end(), 0.0f);
  int64_t j = 0;
  for (; j + kWidth <= vocab; j += kWidth) {
    const vec d = (broadcast(best) - load(x + j)) * broadcast(bins_per_nat);
    // d < far is false for inf and NaN too: those go to a sink.
    const auto bins = __builtin_convertvector(d < far ? d : sinks, mask);
    for (int64_t l = 0; l < kWidth; ++l) mass[bins[l]] += p[j + l];
  }
  for (; j < vocab; ++j) {
    const float d = (best - x[j]) * bins_per_nat;
    mass[d < static_cast<float>(last) ? static_cast<int64_t>(d) : last] += p[j];
  }
  double cum = 0.0;
  for (int64_t b = 0; b < last; ++b) {
    cum += mass[b];
    if (cum >= top_p) return b;
  }
  return last;
}

// x / t into `out` (vector division, as torch divides), and the largest value.
float scale_row(const float* logits, float t, int64_t vocab, float* out) {
  vec m = broadcast(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + kWidth <= vocab; j += kWidth) {
    const vec v = load(logits + j) / broadcast(t);
    store(out + j, v);
    m = vmax(v, m);
  }
  float best = hmax(m);
  for (; j < vocab; ++j) {
    out[j] = logits[j] / t;
    best = std::max(best, out[j]);
  }
  return best;
}

// e^(x - best) into `p`; returns their sum (a token at -inf gets 0).
double exp_row(const float* x, float best, int64_t vocab, float* p) {
  vec acc = {};
  int64_t j = 0;
  for (; j + kWidth <= vocab; j += kWidth) {
    const vec e = vexp(load(x + j) - broadcast(best));
    store(p + j, e);
    acc += e;
  }
  double sum = 0.0;
  for (int64_t l = 0; l < kWidth; ++l) sum += acc[l];
  for (; j < vocab; ++j) {
    p[j] = std::exp(x[j] - best);
    sum += p[j];
  }
  return sum;
}

// The k largest values of a row, sorted from the largest, into `top` (-inf past the row's
// own values). The row is cut into groups of kGroup tokens: k groups whose maxima are at
// least m hold k values of at least m, so the k-th largest group maximum is a floor under the
// k-th largest value. Only the groups reaching that floor (about k of them) are read again;
// the rest of the row is read once, for its maxima. Rows of fewer than k groups keep all.
void top_k_values(const float* x, int64_t vocab, int64_t k, std::vector<float>& maxima,
                  std::vector<float>& kept, std::vector<float>& top) {
  constexpr int64_t kGroup = 4 * kWidth;
  const int64_t groups = vocab / kGroup;
  maxima.resize(groups);
  for (int64_t g = 0; g < groups; ++g) {
    const float* p = x + g * kGroup;
    maxima[g] = hmax(vmax(vmax(load(p), load(p + kWidth)),
                          vmax(load(p + 2 * kWidth), load(p + 3 * kWidth))));
  }
  float floor = -std::numeric_limits<float>::infinity();
  if (groups >= k) {
    kept.assign(maxima.begin(), maxima.end());
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<float>());
    floor = kept[k - 1];
  }
  kept.clear();
  for (int64_t g = 0; g < groups; ++g) {
    if (!(maxima[g] >= floor)) continue;
    for (int64_t j = g * kGroup; j < (g + 1) * kGroup; ++j) {
      if (x[j] >= floor) kept.push_back(x[j]);
    }
  }
  for (int64_t j = groups * kGroup; j < vocab; ++j) {
    if (x[j] >= floor) kept.push_back(x[j]);
  }
  if (static_cast<int64_t>(kept.size()) > k) {
    std::nth_element(kept.begin(), kept.begin() + (k - 1), kept.end(), std::greater<float>());
    kept.resize(k);
  }
  std::sort(kept.begin(), kept.end(), std::greater<float>());
  top.assign(k, -std::numeric_limits<float>::infinity());
  std::copy(kept.begin(), kept.end(), top.begin());
}

// The floor top-k (and top-p over the k values, renormalised) puts on a row: the k-th
// value, or the value of the smallest prefix of the sorted k whose mass reaches top_p.
float top_k_floor(const float* x, int64_t vocab, int64_t k, double top_p,
                  std::vector<float>& maxima, std::vector<float>& kept,
                  std::vector<float>& top) {
  top_k_values(x, vocab, k, maxima, kept, top);
  const float kth = top[k - 1];
  if (!(top_p < 1.0) || !std::isfinite(top[0])) return kth;
  double total = 0.0;
  for (int64_t i = 0; i < k; ++i) total += std::exp(static_cast<double>(top[i]) - top[0]);
  double cum = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    cum += std::exp(static_cast<double>(top[i]) - top[0]);
    if (cum >= top_p * total) return std::max(kth, top[i]);
  }
  return kth;
}

double block_mass(const float* x, const float* p, int64_t begin, int64_t end, const Keep& keep) {
  vec acc = {};
  int64_t j = begin;
  for (; j + kWidth <= end; j += kWidth) {
    const mask kept = keep.at(load(x + j));
    acc += (vec)((mask)load(p + j) & kept);
  }
  double sum = 0.0;
  for (int64_t l = 0; l < kWidth; ++l) sum += acc[l];
  for (; j < end; ++j) {
    if (keep.at(x[j])) sum += p[j];
  }
  return sum;
}

// Per-thread buffers of draw_row, sized once for the batch's rows.
struct Scratch {
  std::vector<float> scaled, probs, mass, maxima, kept, top;
  std::vector<double> blocks;
};

int64_t draw_row(const float* logits, int64_t vocab, double temperature, double top_p,
                 int64_t top_k, double min_p, double draw, float bins_per_nat, Scratch& s) {
  // x / 1.0 is x: no pass at the default temperature.
  const float* x = logits;
  float best;
  if (temperature == 1.0) {
    best = row_max(x, vocab);
  } else {
    best = scale_row(logits, static_cast<float>(temperature), vocab, s.scaled.data());
    x = s.scaled.data();
  }
  float* p = s.probs.data();
  const double sum = exp_row(x, best, vocab, p);
  // At least min_p times the most likely token's probability.
  const float floor = min_p > 0.0 ? best + std::log(static_cast<float>(min_p))
                                  : -std::numeric_limits<float>::infinity();
  Keep keep{best, floor, bins_per_nat, 0.0f, false};
  std::vector<float>& mass = s.mass;
  std::vector<double>& blocks = s.blocks;
  if (0 < top_k && top_k < vocab) {
    keep.floor = std::max(floor, top_k_floor(x, vocab, top_k, top_p, s.maxima, s.kept, s.top));
  } else if (top_p < 1.0) {
    // The histogram's mass is unnormalised: top_p of the row's sum.
    const int64_t edge = last_kept_bin(x, p, vocab, best, bins_per_nat, top_p * sum, mass);
    // The last bin holds everything further down: cutting there keeps the whole row.
    keep.nucleus = edge < static_cast<int64_t>(mass.size()) - kSinks;
    keep.limit = static_cast<float>(edge + 1);
  }
  const int64_t num_blocks = (vocab + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    blocks[b] = block_mass(x, p, b * kBlock, std::min(vocab, (b + 1) * kBlock), keep);
    total += blocks[b];
  }
  if (!(total > 0.0)) {  // nothing kept has mass (all -inf or NaN): the best token
    for (int64_t j = 0; j < vocab; ++j) {
      if (x[j] == best) return j;
    }
    return 0;
  }
  // Strictly below the total: a draw lands on a kept token with positive probability.
  const double target = std::min(draw * total, std::nextafter(total, 0.0));
  double cum = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (cum + blocks[b] <= target) {
      cum += blocks[b];
      continue;
    }
    int64_t last = -1;
    for (int64_t j = b * kBlock, end = std::min(vocab, (b + 1) * kBlock); j < end; ++j) {
      if (p[j] > 0.0f && keep.at(x[j])) {
        cum += p[j];
        last = j;
        if (cum > target) return j;
      }
    }
    // The token-by-token sum fell short of the block's vector sum by rounding: the block's
    // last kept token.
    if (last >= 0) return last;
  }
  return vocab - 1;  // unreachable: the blocks' sums add up to the total
}

}  // namespace

torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                          torch::Tensor top_k, torch::Tensor min_p, torch::Tensor draws,
                          double bins_per_nat, int64_t num_bins) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2,
              "logits are float32 [rows, vocab] on the CPU");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(temperature.numel() == rows && top_p.numel() == rows && top_k.numel() == rows &&
                  min_p.numel() == rows && draws.numel() == rows,
              "one temperature, top_p, top_k, min_p and draw per row");
  TORCH_CHECK(num_bins >= 2 && bins_per_nat > 0, "a histogram of at least two bins");
  TORCH_CHECK(vocab > 0, "a row has at least one token");
  logits = logits.contiguous();
  temperature = temperature.to(at::kDouble).contiguous();
  top_p = top_p.to(at::kDouble).contiguous();
  top_k = top_k.to(at::kLong).contiguous();
  min_p = min_p.to(at::kDouble).contiguous();
  draws = draws.to(at::kDouble).contiguous();
  torch::Tensor picks = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* xp = logits.data_ptr<float>();
  const double* tp = temperature.data_ptr<double>();
  const double* pp = top_p.data_ptr<double>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const double* mp = min_p.data_ptr<double>();
  const double* dp = draws.data_ptr<double>();
  int64_t* out = picks.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(tp[r] > 0.0, "a sampled row has a positive temperature");
  }
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    s.scaled.resize(vocab);
    s.probs.resize(vocab);
    s.mass.resize(num_bins - 1 + kSinks);
    s.blocks.resize((vocab + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r) {
      out[r] = draw_row(xp + r * vocab, vocab, tp[r], pp[r], kp[r], mp[r], dp[r],
                        static_cast<float>(bins_per_nat), s);
    }
  });
  return picks;
}

}  // namespace conveyor
