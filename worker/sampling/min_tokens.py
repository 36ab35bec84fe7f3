"""``min_tokens``: EOS and the request's stop tokens kept out of its draw until it has that
many output tokens (transformers' ``min_new_tokens`` bans EOS the same way).

Which tokens a request bans is known when it gets its sampling row; whether it bans them in
a step follows from the output index the step draws, so it holds for overlapped steps and
resumed requests alike. A step's bans are a flat list of (batch row, token), staged in its
one upload; the sampler sets those logits to -inf after penalties and bias, so greedy and
sampled rows, with any filter, never pick one.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch

from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload


def banned_ids(params: SamplingParams, eos_token_ids: Collection[int]) -> np.ndarray | None:
    """The ids a request with ``params`` may not draw before its ``min_tokens``-th output
    token: its stop tokens and, unless it ignores EOS, the model's EOS ids. None when it
    bans nothing."""
    if params.min_tokens <= 0:
        return None
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids |= set(eos_token_ids)
    return np.array(sorted(ids), dtype=np.int64) if ids else None


def stage_bans(limited: Sequence[tuple[int, int, np.ndarray]], output_indices: Sequence[int],
               upload: StepUpload) -> Staged | None:
    """[2, n] (batch row, token) of every ban in force this step, staged: ``limited`` holds
    (batch row, its min_tokens, its banned ids) for each row of the step that has any;
    ``output_indices[k]`` is the output index batch row k draws."""
    rows, ids = [], []
    for k, min_tokens, banned in limited:
        if output_indices[k] < min_tokens:
            rows.append(np.full(len(banned), k, dtype=np.int64))
            ids.append(banned)
    if not rows:
        return None
    return upload.add(np.stack([np.concatenate(rows), np.concatenate(ids)]))


def apply_bans(logits: torch.Tensor, bans: torch.Tensor | None) -> None:
    """Set ``logits`` (one row per request, in place) to -inf at each staged (row, token)."""
    if bans is None:
        return
    logits.index_put_((bans[0], bans[1]),
                      torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
