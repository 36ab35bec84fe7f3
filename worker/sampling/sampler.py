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
from worker.cpu_kernels import argmax_rows_kernel, sample_rows_kernel
from worker.sampling.filters import BINS_PER_NAT, NUM_BINS, floors, top_p_keep
from worker.sampling.penalties import apply_logit_bias, apply_penalties
from worker.sampling.rows import DRAW, MIN_P, TEMPERATURE, TOP_P, SamplingRows, StepRows


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
              device: torch.device) -> StepRows:
    """The step's rows from ``state`` (new requests' rows written first)."""
    return state.step(request_ids, [r.params for r in rows], [r.seed for r in rows],
                      [r.output_index for r in rows], [r.prompt_token_ids for r in rows],
                      [r.output_token_ids for r in rows], device)


class Sampler:
    """Picks one token per row; a row's result never depends on its neighbours."""

    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRequest], step: StepRows | None = None,
        scratch: bool = False,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Returns the chosen token per row and, where asked for, its logprobs.

        ``step`` holds the rows' values from the runner's persistent rows; without it they
        are laid out for this call alone. ``scratch``: the caller drops ``logits`` after
        the call, so penalties may change them in place (unless a row wants logprobs).
        """
        if step is None:
            step = step_rows(SamplingRows(len(rows)), [str(i) for i in range(len(rows))], rows,
                             logits.device)
        raw = logits
        params = step.params
        if any(p.penalized or p.logit_bias for p in params):
            # Logprobs stay those of the model's own distribution: kept apart where a row
            # asks for them or the caller still needs the logits (a copy of 64 x 32,000
            # floats is ~1 ms here).
            if not scratch or any(p.logprobs is not None for p in params):
                logits = logits.clone()
            apply_penalties(logits, step.penalties)
            apply_logit_bias(logits, params)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        tokens = [0] * len(rows)
        if len(greedy) == len(rows):
            tokens = _argmax(logits)
        elif greedy:
            picks = _argmax(logits[_index(greedy, logits.device)])
            for i, t in zip(greedy, picks, strict=True):
                tokens[i] = t
        if sampled:
            chosen = logits if len(sampled) == len(rows) else logits[_index(sampled,
                                                                            logits.device)]
            values = step.values if len(sampled) == len(rows) else step.values[
                _index(sampled, logits.device)]
            picks = self._sample(chosen.float(), [params[i] for i in sampled], values)
            for i, t in zip(sampled, picks, strict=True):
                tokens[i] = t
        return tokens, self._logprobs(raw, rows, tokens)

    @staticmethod
    def _sample(logits: torch.Tensor, params: list[SamplingParams],
                values: torch.Tensor) -> list[int]:
        """Draw one token per row; ``values``: the rows' [n, 4] from StepRows."""
        vocab = logits.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
        kernel = sample_rows_kernel() if logits.device.type == "cpu" and \
            logits.dtype == torch.float32 else None
        if kernel is not None:
            # Temperature, softmax, every cut and the draw, each row in one task whose passes
            # stay in cache: no pass over the whole batch's logits here. Float64 values: the
            # parameters and the draw as they arrived.
            return kernel(logits, values[:, TEMPERATURE], values[:, TOP_P],
                          torch.tensor(top_k, device=logits.device), values[:, MIN_P],
                          values[:, DRAW], BINS_PER_NAT, NUM_BINS).tolist()
        values = values.to(logits.dtype)
        temperature = values[:, TEMPERATURE, None]
        # x / 1.0 is x: skip a pass over the batch's logits at the default temperature.
        x = logits if bool((temperature == 1.0).all()) else logits / temperature
        probs = torch.softmax(x, dim=-1)
        floor = floors(x, top_k, [p.top_p for p in params], [p.min_p for p in params])
        # Top-p on rows without top-k: a histogram cut (top-k rows had theirs in the floor).
        nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0 and not top_k[i]]
        keep = None if floor is None else x >= floor
        if nucleus:
            index = _subset(nucleus, x)
            cut = top_p_keep(_rows(x, index), _rows(probs, index),
                             _rows(values[:, TOP_P].contiguous(), index))
            if keep is None and index is None:
                keep = cut
            else:
                keep = torch.ones_like(probs, dtype=torch.bool) if keep is None else keep
                if index is None:
                    keep &= cut
                else:
                    keep.index_copy_(0, index, keep.index_select(0, index) & cut)
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
        logits: torch.Tensor, rows: list[SampleRequest], tokens: list[int]
    ) -> list[TokenLogprob | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        result: list[TokenLogprob | None] = [None] * len(rows)
        if not wanted:
            return result
        # Logprobs of the model's own distribution, before penalties, temperature, filters.
        logp = torch.log_softmax(logits[_index(wanted, logits.device)].float(), dim=-1)
        for row, i in enumerate(wanted):
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


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _rows(t: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``t``'s rows at ``index`` (None: all of them, without a copy)."""
    return t if index is None else t.index_select(0, index)


def _subset(rows: list[int], t: torch.Tensor) -> torch.Tensor | None:
    """The index of ``rows`` in ``t``; None when they are all of its rows."""
    return None if len(rows) == t.shape[0] else _index(rows, t.device)
