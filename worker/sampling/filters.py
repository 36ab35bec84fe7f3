"""The top-k, top-p and min-p filters, without sorting the vocabulary.

A sort of every sampled row costs far more than the rest of sampling (tens of ms for 64
rows of 8,192 tokens on a CPU). None is needed: each filter only has to find a cut-off
value per row, and the draw then happens in token-id order over what is kept (inverse
CDF), which samples the same distribution as a draw in sorted order.

- top-k: the k-th largest value from ``torch.topk`` (a partial selection); ties with it
  are kept too. Top-p on such a row runs on those k sorted values: exact, and cheap.
- top-p (on a row without top-k): a cut-off on the scaled logit, found from a histogram
  of the probability mass over bins of 1/512 nat below the row's best logit. The kept set
  is the smallest one whose mass reaches p, plus the tokens of its least likely member's
  bin (less than 1/512 nat, a likelihood ratio of 1.002, below it): near-ties are kept
  together. Where p is so close to 1 that the cut lies 16 nats down, everything further
  down is kept too.
- min-p: tokens less likely than ``min_p`` times the most likely one are dropped.

Top-k, min-p and top-p on top-k rows give one floor per row; the sampler then zeroes the
probabilities below it in one pass (no renormalising: the draw scales to what is left).
"""

from __future__ import annotations

import torch

from worker.host.step_upload import Staged
from worker.sampling.subsets import RowSubsets, rows_at

# The top-p histogram: bins of 1/512 nat below the row's best logit, 16 nats in all (the
# last bin also takes everything further down, under 1e-7 of the best token's likelihood).
BINS_PER_NAT = 512.0
NUM_BINS = 8192


def floors(x: torch.Tensor, rows: RowSubsets) -> torch.Tensor | None:
    """Per row, the smallest scaled logit that top-k, min-p, and top-p on a top-k row keep:
    [rows, 1] (-inf: no cut), or None when no row has any of them. ``rows``: the step's
    subsets, ``x`` its sampled rows.

    Top-p on a row that also has top-k is exact and cheap: it runs on the k largest values,
    already sorted by ``torch.topk``. (Top-p alone is :func:`top_p_keep`'s.)
    """
    if not rows.ranked and not rows.cut:
        return None
    floor = torch.full((x.shape[0], 1), float("-inf"), dtype=x.dtype, device=x.device)
    if rows.ranked:
        assert rows.ranked_k is not None and rows.ranked_top_p is not None
        ks, index = rows.ranked_k.tensor, rows.ranked_index
        width = max(rows.top_k[j] for j in rows.ranked)
        # Every row ranked (the usual batch): no gathered copy of the logits (8 MB at
        # 64 x 32,000).
        largest = torch.topk(rows_at(x, index), width, dim=-1, sorted=True).values
        # Columns past a row's own k are out of its top-k.
        outside = torch.arange(width, device=x.device)[None, :] >= ks[:, None]
        largest = largest.masked_fill(outside, float("-inf"))
        kth = largest.gather(1, (ks - 1)[:, None])
        p = rows.ranked_top_p.tensor.to(x.dtype)[:, None]
        # The smallest prefix of the sorted top-k whose (renormalised) mass reaches p.
        mass = torch.softmax(largest, dim=-1).cumsum(dim=-1)
        last = torch.searchsorted(mass, p).clamp_(max=width - 1)
        nucleus = torch.where(p < 1.0, largest.gather(1, torch.minimum(last, ks[:, None] - 1)),
                              kth)
        _put(floor, index, torch.maximum(kth, nucleus))
    if rows.cut:
        assert rows.cut_min_p is not None
        index = rows.cut_index
        ratio = rows.cut_min_p.tensor.to(x.dtype)[:, None]
        # At least min_p times the most likely token's probability.
        relative = rows_at(x, index).amax(dim=-1, keepdim=True) + torch.log(ratio)
        _put(floor, index, torch.maximum(rows_at(floor, index), relative))
    return floor


def _put(t: torch.Tensor, index: Staged | None, rows: torch.Tensor) -> None:
    """Write ``rows`` at ``index`` of ``t`` (None: all of them)."""
    if index is None:
        t.copy_(rows)
    else:
        t.index_copy_(0, index.tensor, rows)


def top_p_keep(x: torch.Tensor, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens top-p keeps: bool [rows, vocab].

    ``x``: scaled logits; ``probs``: their softmax; ``top_p``: [rows], each in (0, 1]. The
    most likely token is always kept.
    """
    rows, device = x.shape[0], x.device
    # Distance below the row's best token, in bins (one fused pass: B*max - B*x).
    scaled = torch.sub(x.amax(dim=-1, keepdim=True) * BINS_PER_NAT, x, alpha=BINS_PER_NAT)
    # Truncation is floor here: every distance is >= 0 (-inf logits are clamped first).
    scaled.clamp_(max=NUM_BINS - 1)
    mass = torch.zeros(rows, NUM_BINS, dtype=probs.dtype, device=device)
    cum = mass.scatter_add_(1, scaled.long(), probs).cumsum_(dim=-1)
    # The first bin where the mass reaches p: it and every bin before it are kept
    # (floor(scaled) <= edge, i.e. scaled < edge + 1).
    edge = torch.searchsorted(cum, top_p.to(probs.dtype)[:, None]).clamp_(max=NUM_BINS - 1)
    return scaled < (edge + 1).to(scaled.dtype)
