"""The reference workloads of the benchmark document, as plain data (seeded, reproducible)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace


@dataclass
class WorkItem:
    """One request of a workload: token ids, output length and arrival time."""

    prompt_token_ids: list[int]
    max_tokens: int
    # Seconds after the start of the run (0 for everything-at-once workloads).
    arrival_s: float = 0.0
    # Also wait until some earlier request has streamed this many tokens (W2's "after 20
    # steps": every running request gains one token a step); 0 = no such condition.
    after_tokens: int = 0
    # Which part of the workload it belongs to; latency is also reported per group.
    group: str = "all"
    # Requests with the same prefix_id open with the same prefix_tokens tokens (W6's
    # documents): what a prefix cache can serve again.
    prefix_id: int | None = None
    prefix_tokens: int = 0


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ids 0 and 1 are special (eos, bos) in the checkpoints conveyor makes.
    return [rng.randrange(2, vocab) for _ in range(n)]


def w1_heavy_tailed(num_requests: int = 64, vocab: int = 8192, seed: int = 0,
                    rate: float | None = None, max_prompt: int = 1024,
                    max_output: int = 512) -> list[WorkItem]:
    """W1: prompts lognormal(4.5, 0.8) capped at 1024, outputs lognormal(3.5, 1.0) in [4, 512].

    All at t=0, or Poisson arrivals at ``rate`` requests per second. ``max_prompt`` and
    ``max_output`` lower the caps (quick runs on the tiny model).
    """
    rng = random.Random(seed)
    items, t = [], 0.0
    for _ in range(num_requests):
        prompt = min(max_prompt, max(1, int(round(rng.lognormvariate(4.5, 0.8)))))
        output = min(max_output, max(4, int(round(rng.lognormvariate(3.5, 1.0)))))
        if rate:
            t += rng.expovariate(rate)
        items.append(WorkItem(_tokens(rng, prompt, vocab), output, t))
    return items


def w2_long_document_burst(num_steady: int = 48, vocab: int = 8192, seed: int = 0,
                           steady_prompt: int = 32, steady_output: int = 256,
                           after_steps: int = 20, doc_tokens: int = 2000,
                           doc_output: int = 32) -> list[WorkItem]:
    """W2: ``num_steady`` requests decoding steadily, then one long prompt after ``after_steps``.

    The steady ones are group "steady" (their inter-token latency is what W2 measures); the
    document, group "burst", arrives once one of them has streamed ``after_steps`` tokens.
    """
    rng = random.Random(seed)
    items = [WorkItem(_tokens(rng, steady_prompt, vocab), steady_output, group="steady")
             for _ in range(num_steady)]
    items.append(WorkItem(_tokens(rng, doc_tokens, vocab), doc_output,
                          after_tokens=after_steps, group="burst"))
    return items


def w5_documents_beside_chat(num_interactive: int = 16, vocab: int = 8192, seed: int = 0,
                             doc_rate: float = 0.5, num_docs: int = 6,
                             interactive_prompt: int = 32, interactive_output: int = 200,
                             doc_tokens: int = 2000, doc_output: int = 4) -> list[WorkItem]:
    """W5: ``num_interactive`` requests (short prompts, long outputs; group "interactive")
    at t=0, and ``num_docs`` long documents (group "document") arriving every
    ``1 / doc_rate`` seconds from the first second on: prefill keeps competing with decodes
    (what prefill/decode disaggregation is for)."""
    if doc_rate <= 0:
        raise ValueError(f"doc_rate must be > 0 documents/s, got {doc_rate}")
    rng = random.Random(seed)
    items = [WorkItem(_tokens(rng, interactive_prompt, vocab), interactive_output,
                      group="interactive") for _ in range(num_interactive)]
    items += [WorkItem(_tokens(rng, doc_tokens, vocab), doc_output, arrival_s=1.0 + k / doc_rate,
                       group="document") for k in range(num_docs)]
    return items


def with_poisson_arrivals(items: list[WorkItem], rate: float, seed: int = 0) -> list[WorkItem]:
    """The same requests, arriving as a Poisson process of ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed + 1)  # its own stream: the lengths stay those of the workload
    t, out = 0.0, []
    for item in items:
        t += rng.expovariate(rate)
        out.append(replace(item, arrival_s=t))
    return out


def w3_shared_document(num_questions: int = 16, doc_tokens: int = 2000, vocab: int = 8192,
                       seed: int = 0, output: int = 16) -> list[WorkItem]:
    """W3: one document followed by different questions of 5-15 tokens."""
    rng = random.Random(seed)
    document = _tokens(rng, doc_tokens, vocab)
    return [WorkItem(document + _tokens(rng, rng.randint(5, 15), vocab), output)
            for _ in range(num_questions)]


def w7_steady_decode(num_requests: int = 4000, vocab: int = 8192, seed: int = 0,
                     prompt: tuple[int, int] = (32, 256),
                     output: tuple[int, int] = (150, 300)) -> list[WorkItem]:
    """W7, decode at a GPU's rate: prompts uniform in [32, 256] tokens, outputs in [150, 300],
    all at t=0: enough work to keep a large batch full (the simulated engine's workload)."""
    rng = random.Random(seed)
    return [WorkItem(_tokens(rng, rng.randint(*prompt), vocab), rng.randint(*output))
            for _ in range(num_requests)]


def w6_documents_by_questions(num_docs: int = 12, questions: int = 6, vocab: int = 8192,
                              seed: int = 0, rate: float = 4.0,
                              doc_tokens: tuple[int, int] = (500, 800),
                              question_tokens: tuple[int, int] = (8, 20),
                              output: tuple[int, int] = (24, 64)) -> list[WorkItem]:
    """W6 (cache-aware pull): ``num_docs`` documents, each asked ``questions`` questions
    (each prompt the document, then the question), the questions of all documents in a
    random interleaving, arriving as a Poisson process of ``rate`` requests per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    documents = [_tokens(rng, rng.randint(*doc_tokens), vocab) for _ in range(num_docs)]
    asked = [d for d in range(num_docs) for _ in range(questions)]
    rng.shuffle(asked)
    items, t = [], 0.0
    for d in asked:
        t += rng.expovariate(rate)
        prompt = documents[d] + _tokens(rng, rng.randint(*question_tokens), vocab)
        items.append(WorkItem(prompt, rng.randint(*output), t, prefix_id=d,
                              prefix_tokens=len(documents[d])))
    return items


def possible_prefix_hits(items: list[WorkItem], block_size: int) -> int:
    """Prompt tokens one shared prefix cache, large enough for all, would serve: each
    request after the first of its prefix (in arrival order) finds that prefix's whole
    blocks."""
    seen: set[int] = set()
    hits = 0
    for item in sorted(items, key=lambda i: i.arrival_s):
        if item.prefix_id is None:
            continue
        if item.prefix_id in seen:
            hits += item.prefix_tokens // block_size * block_size
        seen.add(item.prefix_id)
    return hits


def kv_blocks_needed(items: list[WorkItem], block_size: int = 16) -> int:
    """Blocks all requests need at their longest, at once (W4 sizes the pool from this)."""
    return sum(math.ceil((len(i.prompt_token_ids) + i.max_tokens) / block_size) for i in items)


# Quick runs (tests, smoke checks on the tiny model): few requests, short prompts and outputs.
QUICK_REQUESTS = 8


def build_workload(name: str, num_requests: int | None, vocab: int, seed: int = 0,
                   quick: bool = False, doc_rate: float = 0.5,
                   documents: int | None = None) -> list[WorkItem]:
    """The named reference workload (w1, w2, w3, w5, w6, w7); ``quick`` shrinks it (w6:
    ``documents`` documents of ``num_requests`` questions each)."""
    n = num_requests or (QUICK_REQUESTS if quick else None)
    if name == "w1":
        if quick:
            return w1_heavy_tailed(n, vocab, seed, max_prompt=128, max_output=32)
        return w1_heavy_tailed(n or 64, vocab, seed)
    if name == "w2":
        if quick:
            return w2_long_document_burst(n, vocab, seed, steady_output=48, after_steps=8,
                                          doc_tokens=512, doc_output=8)
        return w2_long_document_burst(n or 48, vocab, seed)
    if name == "w3":
        if quick:
            return w3_shared_document(n, doc_tokens=256, vocab=vocab, seed=seed, output=8)
        return w3_shared_document(n or 16, vocab=vocab, seed=seed)
    if name == "w5":
        if quick:
            return w5_documents_beside_chat(n, vocab, seed, doc_rate, num_docs=2,
                                            interactive_output=24, doc_tokens=300)
        return w5_documents_beside_chat(n or 16, vocab, seed, doc_rate)
    if name == "w6":
        if quick:
            return w6_documents_by_questions(documents or 3, n or 3, vocab, seed,
                                             doc_tokens=(64, 96), output=(4, 8))
        return w6_documents_by_questions(documents or 12, n or 6, vocab, seed)
    if name == "w7":
        if quick:
            return w7_steady_decode(n, vocab, seed, prompt=(8, 32), output=(16, 32))
        return w7_steady_decode(n or 4000, vocab, seed)
    raise ValueError(f"unknown workload {name!r}: w1, w2, w3, w5, w6 or w7")


def describe(items: list[WorkItem]) -> dict[str, int | float]:
    """Sizes of a workload, for the report."""
    prompts = [len(i.prompt_token_ids) for i in items]
    outputs = [i.max_tokens for i in items]
    return {"requests": len(items), "prompt_tokens": sum(prompts), "max_prompt": max(prompts),
            "output_tokens": sum(outputs), "max_output": max(outputs),
            "last_arrival_s": round(max(i.arrival_s for i in items), 3)}
