"""Penalties and logit bias: what the request's own tokens do to its next logits.

Only the rows that ask for them are touched, and only at the tokens they name: the work
grows with the request's tokens, never with the vocabulary (no dense count matrix). Every
tensor is made on the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from producer.wire.params import SamplingParams
from worker.sampling.rows import NO_TOKEN, PenaltyTokens


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    tokens: PenaltyTokens | None) -> None:
    """Change ``logits`` (one row per request, in place) for the penalised rows, from their
    distinct prompt ids and output ids (worker/sampling/rows.py keeps them across steps)."""
    if tokens is None or not tokens.rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    flat = logits.view(-1)
    chosen = [params[i] for i in tokens.rows]
    base = torch.tensor(tokens.rows, dtype=torch.int64, device=device)[:, None] * vocab
    repeated = [p.repetition_penalty != 1.0 for p in chosen]
    if any(repeated):
        ids = torch.cat((tokens.prompt_ids, tokens.output_ids), dim=1)
        wanted = torch.tensor(repeated, device=device)[:, None]
        # Every distinct (row, token) of prompt and output, once.
        seen = torch.unique((base + ids)[(ids != NO_TOKEN) & wanted])
        penalty = _per_row(logits, [p.repetition_penalty for p in params])[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [bool(p.presence_penalty or p.frequency_penalty) for p in chosen]
    if any(counted):
        ids = tokens.output_ids
        wanted = torch.tensor(counted, device=device)[:, None]
        occurrences = (base + ids)[(ids != NO_TOKEN) & wanted]
        if occurrences.numel():
            frequency = _per_row(logits, [p.frequency_penalty for p in params])
            presence = _per_row(logits, [p.presence_penalty for p in params])
            # Once per occurrence for frequency; once per distinct token for presence.
            flat.index_add_(0, occurrences, -frequency[occurrences // vocab])
            distinct = torch.unique(occurrences)
            flat.index_add_(0, distinct, -presence[distinct // vocab])


def _per_row(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add each row's ``logit_bias`` to its logits, in place (ids were checked against the
    vocabulary when the request was added)."""
    rows, tokens, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in p.logit_bias:
            rows.append(i)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, dtype=torch.long, device=device),
         torch.tensor(tokens, dtype=torch.long, device=device)),
        torch.tensor(biases, dtype=logits.dtype, device=device), accumulate=True)
