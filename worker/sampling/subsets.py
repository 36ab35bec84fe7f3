"""Which of a step's rows each sampling pass touches, worked out before the forward.

Every subset (greedy rows, sampled rows, top-k, min-p and top-p rows among the sampled,
rows asking for logprobs, logit-bias entries) follows from the rows' parameters alone, so
it is known on the host before the logits exist. Its device index goes into the step's one
host-to-device copy (worker/host/step_upload.py) with the rest of the step's inputs: on CUDA an
index tensor made from a Python list inside the sampler was a transfer of its own, up to a
dozen a step. A subset that is every row has no index (the pass reads the whole tensor).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload


class RowSubsets:
    """One step's row subsets: host lists for the Python side, staged device indices and
    per-subset parameters for the tensor side. Positions in ``ranked``, ``cut`` and
    ``nucleus`` count among the sampled rows; the others count among all rows."""

    def __init__(self, params: Sequence[SamplingParams], upload: StepUpload, vocab: int) -> None:
        rows = len(params)
        # The logits' width: a top-k of all of it cuts nothing (and topk could not take it).
        self.vocab = vocab
        self.greedy = [i for i, p in enumerate(params) if p.greedy]
        self.sampled = [i for i, p in enumerate(params) if not p.greedy]
        self.greedy_index = _index(self.greedy, rows, upload)
        self.sampled_index = _index(self.sampled, rows, upload)
        drawn = [params[i] for i in self.sampled]
        # Each sampled row's k; 0 where it has none (a k of the whole vocabulary cuts nothing).
        self.top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in drawn]
        # x / 1.0 is x: the torch path skips a pass over the logits at the default.
        self.unit_temperature = all(p.temperature == 1.0 for p in drawn)
        self.top_k_values = _values(self.top_k, np.int64, upload)
        # Top-k rows (their top-p is cut exactly over their k best), min-p rows, and top-p
        # rows without top-k (a histogram cut: worker/sampling/filters.py).
        self.ranked = [j for j, k in enumerate(self.top_k) if k]
        self.ranked_index = _index(self.ranked, len(drawn), upload)
        self.ranked_k = _values([self.top_k[j] for j in self.ranked], np.int64, upload)
        self.ranked_top_p = _values([drawn[j].top_p for j in self.ranked], np.float64, upload)
        self.cut = [j for j, p in enumerate(drawn) if p.min_p > 0.0]
        self.cut_index = _index(self.cut, len(drawn), upload)
        self.cut_min_p = _values([drawn[j].min_p for j in self.cut], np.float64, upload)
        self.nucleus = [j for j, p in enumerate(drawn) if p.top_p < 1.0 and not self.top_k[j]]
        self.nucleus_index = _index(self.nucleus, len(drawn), upload)
        self.logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        self.logprobs_index = _index(self.logprobs, rows, upload)
        # Logits the sampler changes before it picks (min_tokens: EOS and stop tokens out).
        self.adjusted = any(p.penalized or p.logit_bias or p.min_tokens
                            or p.response_format is not None for p in params)
        self.bias = LogitBias.stage(params, upload)


class LogitBias:
    """Every (row, token, bias) of the step's ``logit_bias`` entries, staged."""

    def __init__(self, rows: Staged, tokens: Staged, values: Staged) -> None:
        self.rows, self.tokens, self.values = rows, tokens, values

    @classmethod
    def stage(cls, params: Sequence[SamplingParams], upload: StepUpload) -> LogitBias | None:
        rows, tokens, biases = [], [], []
        for i, p in enumerate(params):
            for token, bias in p.logit_bias:
                rows.append(i)
                tokens.append(token)
                biases.append(bias)
        if not rows:
            return None
        return cls(upload.add(np.array(rows, dtype=np.int64)),
                   upload.add(np.array(tokens, dtype=np.int64)),
                   upload.add(np.array(biases, dtype=np.float64)))


def rows_at(t: torch.Tensor, index: Staged | None) -> torch.Tensor:
    """``t``'s rows at a subset's ``index`` (None: all of them, without a copy)."""
    return t if index is None else t.index_select(0, index.tensor)


def _index(subset: list[int], rows: int, upload: StepUpload) -> Staged | None:
    """The staged index of ``subset`` among ``rows`` rows; None when it is all of them or
    none (then nothing reads it)."""
    if not subset or len(subset) == rows:
        return None
    return upload.add(np.array(subset, dtype=np.int64))


def _values(values: list, dtype: type, upload: StepUpload) -> Staged | None:
    return upload.add(np.array(values, dtype=dtype)) if values else None
