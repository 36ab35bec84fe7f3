"""The offline demo: many short questions and one long document through one engine."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from producer.params import SamplingParams
from worker.engine import Engine

_TOPICS = ["the river", "a lighthouse", "the old library", "winter markets", "a clockmaker",
           "the harbour at dawn", "bees", "a mountain railway", "paper lanterns", "tide pools"]


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def run_offline_demo(model_dir: Path, num_questions: int = 24) -> dict[str, float]:
    """Serve a mix of requests, printing progress as tokens stream; returns the summary."""
    rng = random.Random(0)
    engine = Engine(model_dir, max_num_batched_tokens=512)
    document = " ".join(f"Chapter {i}: notes on {rng.choice(_TOPICS)}." for i in range(250))
    prompts = [f"Tell me about {rng.choice(_TOPICS)}." for _ in range(num_questions)]
    prompts.append("Summarise this document. " + document)
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=1, ignore_eos=True)

    start = time.perf_counter()
    ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
    first_token: dict[str, float] = {}
    produced = {rid: 0 for rid in ids}
    texts = {rid: "" for rid in ids}
    finished = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - start
            first_token.setdefault(out.request_id, now)
            produced[out.request_id] += len(out.new_token_ids)
            texts[out.request_id] += out.text_delta
            finished += out.finished
        total = sum(produced.values())
        sys.stderr.write(f"\r{finished}/{len(ids)} done, {total} tokens, "
                         f"{total / (time.perf_counter() - start):.0f} tok/s   ")
    elapsed = time.perf_counter() - start
    sys.stderr.write("\n")
    for rid, i in list(ids.items())[:3] + list(ids.items())[-1:]:
        print(f"{rid} ({len(engine.tokenizer.encode(prompts[i]))} prompt tokens): "
              f"{texts[rid][:70]!r}...")
    total = sum(produced.values())
    ttfts = list(first_token.values())
    summary = {"requests": len(ids), "tokens": total, "seconds": elapsed,
               "tokens_per_s": total / elapsed, "ttft_p50_s": _percentile(ttfts, 0.5),
               "ttft_p99_s": _percentile(ttfts, 0.99)}
    print(f"{summary['requests']} requests, {total} tokens in {elapsed:.1f} s: "
          f"{summary['tokens_per_s']:.0f} tokens/s; TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms,"
          f" p99 {summary['ttft_p99_s'] * 1000:.0f} ms")
    return summary
