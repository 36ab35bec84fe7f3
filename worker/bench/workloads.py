"""The reference workloads of the benchmark document, as plain data (seeded, reproducible)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass
class WorkItem:
    """One request of a workload: token ids, output length and arrival time."""

    prompt_token_ids: list[int]
    max_tokens: int
    # Seconds after the start of the run (0 for everything-at-once workloads).
    arrival_s: float = 0.0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ids 0 and 1 are special (eos, bos) in the checkpoints conveyor makes.
    return [rng.randrange(2, vocab) for _ in range(n)]


def w1_heavy_tailed(num_requests: int = 64, vocab: int = 8192, seed: int = 0,
                    rate: float | None = None) -> list[WorkItem]:
    """W1: prompts lognormal(4.5, 0.8) capped at 1024, outputs lognormal(3.5, 1.0) in [4, 512].

    All at t=0, or Poisson arrivals at ``rate`` requests per second.
    """
    rng = random.Random(seed)
    items, t = [], 0.0
    for _ in range(num_requests):
        prompt = min(1024, max(1, int(round(rng.lognormvariate(4.5, 0.8)))))
        output = min(512, max(4, int(round(rng.lognormvariate(3.5, 1.0)))))
        if rate:
            t += rng.expovariate(rate)
        items.append(WorkItem(_tokens(rng, prompt, vocab), output, t))
    return items


def w3_shared_document(num_questions: int = 16, doc_tokens: int = 2000, vocab: int = 8192,
                       seed: int = 0, output: int = 16) -> list[WorkItem]:
    """W3: one document followed by different questions of 5-15 tokens."""
    rng = random.Random(seed)
    document = _tokens(rng, doc_tokens, vocab)
    return [WorkItem(document + _tokens(rng, rng.randint(5, 15), vocab), output)
            for _ in range(num_questions)]


def kv_blocks_needed(items: list[WorkItem], block_size: int = 16) -> int:
    """Blocks all requests need at their longest, at once (W4 sizes the pool from this)."""
    return sum(math.ceil((len(i.prompt_token_ids) + i.max_tokens) / block_size) for i in items)
