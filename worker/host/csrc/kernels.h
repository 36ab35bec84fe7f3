// The CPU kernels this extension exports (bindings.cpp names them for Python).

#pragma once

#include "tensor_api.h"

#include <vector>

namespace conveyor {

// Decode attention over the paged cache: q [B, H, D], caches [slots, Hkv, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens,
                           int64_t block_size, double scale);

// Every decoder layer of a decode-only step and the final norm, in one call
// (decode_layers.cpp); ``packed`` holds pack_weight copies of each layer's q/k/v, o, gate/up
// and down weights, or nothing. Returns the final norm's output [B, hidden], or, where
// ``lm_head`` [vocab, hidden] is given (not empty), the logits [B, vocab] (from
// ``lm_head_packed``, its packed copy, where that is given). With ``team`` (and every
// projection packed) the step runs as one parallel region whose master takes over a late
// partner's tasks (step_team.h), the LM head in it where it is packed; else a region per loop.
torch::Tensor decode_layers(torch::Tensor x, torch::Tensor positions, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor slot_mapping,
                            torch::Tensor block_tables, torch::Tensor seq_lens,
                            std::vector<torch::Tensor> weights, std::vector<torch::Tensor> packed,
                            torch::Tensor final_norm, torch::Tensor lm_head,
                            torch::Tensor lm_head_packed, std::vector<torch::Tensor> k_caches,
                            std::vector<torch::Tensor> v_caches, int64_t num_heads,
                            int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                            double eps, double scale, bool blas_only, bool team);

// The step team's counts so far (step_team.h): (tasks taken over, tasks partners published).
std::tuple<int64_t, int64_t> step_team_counts();

// Test hook: the step team's partners sleep ``micros`` before publishing every ``every``-th
// task they compute (0: never), to make the master's take-over happen on demand.
void step_team_stall(int64_t every, int64_t micros);

// One token per row by inverse CDF over what top-k, top-p (over the top k, or a histogram
// cut) and min-p keep of the row's softmax at its temperature (sample_rows.cpp): logits
// [rows, vocab] float32; temperature (> 0), top_p, top_k (0: none), min_p, draws [rows].
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_p,
                          torch::Tensor top_k, torch::Tensor min_p, torch::Tensor draws,
                          double bins_per_nat, int64_t num_bins);

// The index of each row's largest logit (argmax_rows.cpp), as torch.argmax(dim=-1) gives
// it: the first of equal maxima, the first NaN where a row holds one. logits [rows, vocab]
// float32; returns int64 [rows].
torch::Tensor argmax_rows(torch::Tensor logits);

// Repetition, then presence and frequency penalties, in place (penalize.cpp): logits
// [rows, vocab] float32; context [2, n] distinct (row, token) with a factor each (divides a
// positive logit, multiplies the others); outputs [2, m] distinct (row, token) with what
// comes off each.
void penalize(torch::Tensor logits, torch::Tensor context, torch::Tensor context_factors,
              torch::Tensor outputs, torch::Tensor output_deltas);

// Token masks in place (mask_rows.cpp): logits [rows, vocab] float32; rows [n] int64;
// mask [n, words] int32, bit j of word w of row i for token 32w + j of logits row rows[i]:
// a clear bit makes that logit -inf.
void mask_rows(torch::Tensor logits, torch::Tensor rows, torch::Tensor mask);

// Pins thread i of the calling thread's OpenMP team (torch's threads) to cpus[i], where the
// team has one thread per CPU given (thread_placement.cpp); returns how many threads took
// their CPU (0 off Linux, or where the team is of another size).
int64_t bind_team(std::vector<int64_t> cpus);

}  // namespace conveyor
