"""Token chunking with overlap, and grouping answers so each group fits one context. No I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Tokens ``start .. end - 1`` of a document: chunk ``index`` of its split."""

    index: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def check_chunking(chunk_tokens: int, overlap_tokens: int) -> None:
    """ValueError unless chunks are positive and each one advances past the overlap."""
    for name, value in (("chunk_tokens", chunk_tokens), ("overlap_tokens", overlap_tokens)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= overlap_tokens < chunk_tokens:
        raise ValueError(
            f"overlap_tokens must be in [0, chunk_tokens), got {overlap_tokens} "
            f"with chunk_tokens {chunk_tokens}"
        )


def count_chunks(num_tokens: int, chunk_tokens: int, overlap_tokens: int) -> int:
    """How many chunks :func:`split` makes: 1 up to one chunk, then one per stride begun."""
    check_chunking(chunk_tokens, overlap_tokens)
    if num_tokens <= 0:
        return 0
    if num_tokens <= chunk_tokens:
        return 1
    return 1 + math.ceil((num_tokens - chunk_tokens) / (chunk_tokens - overlap_tokens))


def split(num_tokens: int, chunk_tokens: int, overlap_tokens: int) -> list[Span]:
    """Spans covering ``0 .. num_tokens - 1``, each at most ``chunk_tokens`` long and starting
    ``overlap_tokens`` before the previous one ended; the last one ends at the document's end."""
    check_chunking(chunk_tokens, overlap_tokens)
    stride = chunk_tokens - overlap_tokens
    spans: list[Span] = []
    start = 0
    while start < num_tokens:
        end = min(start + chunk_tokens, num_tokens)
        spans.append(Span(len(spans), start, end))
        if end == num_tokens:
            break
        start += stride
    return spans


def group_to_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Consecutive groups of item indexes whose lengths sum to at most ``budget``.

    Every group holds at least two items when there are two (an item longer than half the
    budget must be cut by the caller first, see :func:`item_cap`), so each round of grouping
    at least halves the count and recursive reduction ends.
    """
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    groups: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        if n > budget:
            raise ValueError(f"item {i} has {n} tokens, more than the budget of {budget}")
        if current and used + n > budget:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        groups.append(current)
    # A lone trailing item joins the group before it when both fit; else it waits a round.
    if len(groups) > 1 and len(groups[-1]) == 1:
        last = groups[-1][0]
        if sum(lengths[i] for i in groups[-2]) + lengths[last] <= budget:
            groups[-2].append(last)
            groups.pop()
    return groups


def item_cap(budget: int) -> int:
    """Longest item :func:`group_to_fit` may take so that any two share a group."""
    return max(1, budget // 2)
