"""Turn one row of logits per request into the next token: greedy or filtered sampling.

Vectorised over the batch, with every tensor made on the logits' device. Work a row does
not ask for is skipped: no penalty pass without penalties, no filter pass without its
filter, and no sort of the vocabulary at all (worker/sampling/filters.py). A sampled
token is drawn by inverse CDF, in token-id order, at one uniform number per row that is a
pure function of (seed, output index): a seeded request gets the same tokens alone, in any
batch, and after resuming at any token. Per-row values (temperature, top-p, min-p, the
draw) and penalty tokens come from rows kept across steps (worker/sampling/rows.py).
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
from worker.sampling.penalties import apply_logit_bias, apply_penalties
from worker.sampling.rows import DRAW, MIN_P, TEMPERATURE, TOP_P, SamplingRows, StepRows
from worker.sampling.subsets import RowSubsets, rows_at


@dataclass
class SampleRequest:
    """One row to sample: its parameters, seed and the output index being drawn.

    ``prompt_token_ids`` and ``output_token_ids`` (the request's own lists, not copies) are
    read only by penalties.
    """

    params: SamplingParams
    seed: int
    output_index: int
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


def step_rows(state: SamplingRows, request_ids: Sequence[str], rows: Sequence[SampleRequest],
              device: torch.device, vocab: int, *, upload: StepUpload | None = None
              ) -> StepRows:
    """The step's rows from ``state`` (new requests' rows written first), for logits
    ``vocab`` wide. With ``upload`` (the runner's, before the forward) they are staged
    there, to be read once it is sent; without, they are moved to ``device`` here, in one
    copy."""
    own = upload is None
    upload = StepUpload(device) if upload is None else upload
    step = state.step(request_ids, [r.params for r in rows], [r.seed for r in rows],
                      [r.output_index for r in rows], [r.prompt_token_ids for r in rows],
                      [r.output_token_ids for r in rows], upload, vocab)
    if own:
        upload.send()
    return step


class Sampler:
    """Picks one token per row; a row's result never depends on its neighbours."""

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRequest], step: StepRows | None = None,
        scratch: bool = False,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Returns the chosen token per row and, where asked for, its logprobs.

        ``step`` holds the rows' values and subsets from the runner's persistent rows
        (already on the logits' device); without it they are laid out for this call alone.
        ``scratch``: the caller drops ``logits`` after the call, so penalties may change
        them in place (unless a row wants logprobs).
        """
        if step is None:
            step = step_rows(SamplingRows(len(rows)), [str(i) for i in range(len(rows))], rows,
                             logits.device, logits.shape[-1])
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
        tokens = [0] * len(rows)
        if len(subsets.greedy) == len(rows):
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
        return tokens, self._logprobs(raw, rows, tokens, subsets)

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
        logits: torch.Tensor, rows: list[SampleRequest], tokens: list[int],
        subsets: RowSubsets,
    ) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = [None] * len(rows)
        if not subsets.logprobs:
            return result
        # Logprobs of the model's own distribution, before penalties, temperature, filters.
        logp = torch.log_softmax(rows_at(logits, subsets.logprobs_index).float(), dim=-1)
        for row, i in enumerate(subsets.logprobs):
            n = rows[i].params.logprobs or 0
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
