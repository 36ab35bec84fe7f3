"""Penalties and logit bias: what the request's own tokens do to its next logits.

Only the rows that ask for them are touched, and only at the tokens they name: the work
grows with the request's tokens, never with the vocabulary (no dense count matrix). Every
tensor is made on the logits' device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from producer.wire.params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> None:
    """Change ``logits`` (one row per request, in place) for the penalised rows."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[-1]
    flat = logits.view(-1)
    repeat = [i for i in rows if params[i].repetition_penalty != 1.0]
    if repeat:
        # Every distinct (row, token) of prompt and output, once.
        seen = _flat_ids([i for i in repeat for _ in (0, 1)],
                         [t for i in repeat for t in (prompts[i], outputs[i])], vocab, device)
        seen = torch.unique(seen)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype,
                               device=device)[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
    if counted:
        ids = _flat_ids(counted, [outputs[i] for i in counted], vocab, device)
        if ids.numel():
            frequency = torch.tensor([params[i].frequency_penalty for i in range(len(params))],
                                     dtype=logits.dtype, device=device)
            presence = torch.tensor([params[i].presence_penalty for i in range(len(params))],
                                    dtype=logits.dtype, device=device)
            # Once per occurrence for frequency; once per distinct token for presence.
            flat.index_add_(0, ids, -frequency[ids // vocab])
            distinct = torch.unique(ids)
            flat.index_add_(0, distinct, -presence[distinct // vocab])


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


def _flat_ids(rows: Sequence[int], token_lists: Sequence[Sequence[int]], vocab: int,
              device: torch.device) -> torch.Tensor:
    """``row * vocab + token`` for every token of each list, as one tensor."""
    flat: list[int] = []
    for row, tokens in zip(rows, token_lists, strict=True):
        base = row * vocab
        flat.extend(base + t for t in tokens)
    return torch.tensor(flat, dtype=torch.long, device=device)
