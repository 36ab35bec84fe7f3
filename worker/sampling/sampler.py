"""Turn one row of logits per request into the next token: greedy or filtered sampling.

Vectorised over the batch, with every tensor made on the logits' device. Work a row does
not ask for is skipped: no penalty pass without penalties, no filter pass without its
filter, and no sort of the vocabulary at all (worker/sampling/filters.py). A sampled
token is drawn by inverse CDF, in token-id order, at one uniform number per row that is a
pure function of (seed, output index): a seeded request gets the same tokens alone, in any
batch, and after resuming at any token. Per-row values (temperature, top-p, min-p, the
draw), penalty tokens and the row subsets come from rows kept across steps
(worker/sampling/rows.py).
Float32 CPU rows are scaled, cut and drawn by one native kernel (csrc/sample_rows.cpp), each
row's passes in cache: on the torch path temperature, softmax and top-p took a dozen passes
over the batch's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from producer.wire.completion import TokenLogprob
from producer.wire.params import SamplingParams
from worker.host.cpu_kernels import argmax_rows_kernel, sample_rows_kernel
from worker.host.step_upload import StepUpload
from worker.sampling.filters import BINS_PER_NAT, NUM_BINS, floors, top_p_keep
from worker.sampling.grammar import apply_grammar
from worker.sampling.min_tokens import apply_bans
from worker.sampling.penalties import apply_logit_bias, apply_penalties
from worker.sampling.rows import DRAW, MIN_P, TEMPERATURE, TOP_P, SamplingRows, StepRows
from worker.sampling.subsets import RowSubsets, rows_at


@dataclass
class SampleRequest:
    """One row to sample in a call of its own (the engine's runner keeps its rows across
    steps instead: worker/sampling/rows.py): its parameters, seed and the output index
    being drawn. ``prompt_token_ids`` and ``output_token_ids`` are read only by penalties,
    ``eos_token_ids`` (the model's) only by ``min_tokens``.
    """

    params: SamplingParams
    seed: int
    output_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    eos_token_ids: Sequence[int] = ()


def step_rows(rows: Sequence[SampleRequest], device: torch.device, vocab: int) -> StepRows:
    """``rows`` laid out for one call on logits ``vocab`` wide, moved to ``device`` in one
    copy."""
    state = SamplingRows(len(rows), sorted({t for r in rows for t in r.eos_token_ids}))
    request_ids = [str(i) for i in range(len(rows))]
    for request_id, r in zip(request_ids, rows, strict=True):
        state.add(request_id, r.params, r.seed, r.prompt_token_ids, r.output_token_ids)
    upload = StepUpload(device)
    step = state.step(request_ids, [r.output_index for r in rows], upload, vocab,
                      counted=False)
    upload.send()
    return step


class Sampler:
    """Picks one token per row; a row's result never depends on its neighbours."""

    def __call__(
        self, logits: torch.Tensor, rows: StepRows | Sequence[SampleRequest],
        scratch: bool = False,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Returns the chosen token per row and, where asked for, its logprobs.

        ``rows``: the step's rows from the runner's persistent SamplingRows (already on the
        logits' device), or one SampleRequest per row, laid out for this call alone.
        ``scratch``: the caller drops ``logits`` after the call, so penalties may change
        them in place (unless a row wants logprobs).
        """
        step = rows if isinstance(rows, StepRows) else step_rows(rows, logits.device,
                                                                  logits.shape[-1])
        raw = logits
        subsets = step.subsets
        if subsets.vocab != logits.shape[-1]:
            # Its top-k rows were told apart from the others by that width.
            raise ValueError(f"the step's rows were laid out for {subsets.vocab} logits a row, "
                             f"not {logits.shape[-1]}")
        if subsets.adjusted:
            # Logprobs stay those of the model's own distribution: kept apart where a row
            # asks for them or the caller still needs the logits (a copy of 64 x 32,000
            # floats is ~1 ms here).
            if not scratch or subsets.logprobs:
                logits = logits.clone()
            apply_penalties(logits, step.penalties)
            apply_logit_bias(logits, subsets.bias)
            apply_bans(logits, step.bans)
            apply_grammar(logits, *step.grammar)
        num_rows = len(step.params)
        tokens = [0] * num_rows
        if len(subsets.greedy) == num_rows:
            tokens = _argmax(logits)
        elif subsets.greedy:
            picks = _argmax(rows_at(logits, subsets.greedy_index))
            for i, t in zip(subsets.greedy, picks, strict=True):
                tokens[i] = t
        if subsets.sampled:
            chosen = rows_at(logits, subsets.sampled_index)
            values = rows_at(step.values, subsets.sampled_index)
            picks = self._sample(chosen.float(), subsets, values)
            for i, t in zip(subsets.sampled, picks, strict=True):
                tokens[i] = t
        return tokens, self._logprobs(raw, step.params, tokens, subsets)

    @staticmethod
    def _sample(logits: torch.Tensor, subsets: RowSubsets, values: torch.Tensor) -> list[int]:
        """Draw one token per sampled row; ``values``: those rows' [n, 4] from StepRows."""
        vocab = logits.shape[-1]
        kernel = sample_rows_kernel() if logits.device.type == "cpu" and \
            logits.dtype == torch.float32 else None
        if kernel is not None:
            # Temperature, softmax, every cut and the draw, each row in one task whose passes
            # stay in cache: no pass over the whole batch's logits here. Float64 values: the
            # parameters and the draw as they arrived.
            assert subsets.top_k_values is not None  # staged for every step that draws
            return kernel(logits, values[:, TEMPERATURE], values[:, TOP_P],
                          subsets.top_k_values.tensor, values[:, MIN_P],
                          values[:, DRAW], BINS_PER_NAT, NUM_BINS).tolist()
        values = values.to(logits.dtype)
        x = logits if subsets.unit_temperature else logits / values[:, TEMPERATURE, None]
        probs = torch.softmax(x, dim=-1)
        floor = floors(x, subsets)
        # Top-p on rows without top-k: a histogram cut (top-k rows had theirs in the floor).
        keep = None if floor is None else x >= floor
        if subsets.nucleus:
            index = subsets.nucleus_index
            cut = top_p_keep(rows_at(x, index), rows_at(probs, index),
                             rows_at(values[:, TOP_P].contiguous(), index))
            if keep is None and index is None:
                keep = cut
            else:
                keep = torch.ones_like(probs, dtype=torch.bool) if keep is None else keep
                if index is None:
                    keep &= cut
                else:
                    at = index.tensor
                    keep.index_copy_(0, at, keep.index_select(0, at) & cut)
        if keep is not None:
            probs.mul_(keep)
        cdf = probs.cumsum_(dim=-1)
        draws = values[:, DRAW].to(cdf.dtype)
        # Kept strictly below the row's total, and right=True: a draw lands on a token with
        # positive probability, never a dropped one.
        total = cdf[:, -1]
        target = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
        picks = torch.searchsorted(cdf, target[:, None], right=True)
        return picks.clamp_(max=vocab - 1).squeeze(1).tolist()

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], tokens: list[int],
        subsets: RowSubsets,
    ) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = [None] * len(params)
        if not subsets.logprobs:
            return result
        # Logprobs of the model's own distribution, before penalties, temperature, filters,
        # in its dtype (float64 stays float64; half types are widened).
        rows = rows_at(logits, subsets.logprobs_index)
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.float()
        logp = torch.log_softmax(rows, dim=-1)
        for row, i in enumerate(subsets.logprobs):
            n = params[i].logprobs or 0
            top = torch.topk(logp[row], n) if n else None
            result[i] = TokenLogprob(
                token_id=tokens[i],
                logprob=float(logp[row, tokens[i]]),
                top=(list(zip(top.indices.tolist(), top.values.tolist(), strict=True))
                     if top else []),
            )
        return result


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token. Ties go to the lowest id, as the reference implementation
    breaks them; float32 CPU rows go through the native kernel (csrc/argmax_rows.cpp, the
    same picks as torch.argmax at a fraction of its time on this project's CPU build)."""
    kernel = argmax_rows_kernel() if logits.device.type == "cpu" and \
        logits.dtype == torch.float32 else None
    if kernel is not None:
        return kernel(logits).tolist()
    return logits.argmax(dim=-1).tolist()
