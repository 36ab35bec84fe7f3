"""Overlapped steps against plain ones, on this machine: does scheduling step N+1 while step N
runs pay here? (It decides ``EngineConfig.async_scheduling``'s default per device.)

    python -m worker.bench.overlap [--threads 2] [--rounds 3] [--batch 1 64]

W1 (all at t=0) on an offline engine with ``async_scheduling`` off and on, in interleaved
rounds in one process, then steady greedy decode steps at each ``--batch`` (prompts of 128
tokens). Reports output tokens/s and the median step, and on / off for each.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker.bench.run.workloads import w1_heavy_tailed
from worker.bench.sampling_steps import decoding_engine
from worker.engine.engine import Engine
from worker.modelgen.ensure import ensure_model

MODES = (False, True)


def w1_tokens_per_s(model_dir, overlap: bool, threads: int) -> float:
    items = w1_heavy_tailed()
    engine = Engine(model_dir, num_threads=threads, async_scheduling=overlap)
    engine.generate([list(range(2, 10))], {"max_tokens": 4, "temperature": 0})  # warm-up
    for i, item in enumerate(items):
        engine.add_request(item.prompt_token_ids, {"max_tokens": item.max_tokens,
                                                   "temperature": 0, "ignore_eos": True},
                           request_id=f"w1-{i}")
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    engine.close()
    return tokens / seconds


def decode_step_ms(model_dir, overlap: bool, threads: int, batch: int, steps: int) -> float:
    engine = decoding_engine(model_dir, "greedy", batch, threads, async_scheduling=overlap)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.close()
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 64])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    model_dir = ensure_model(None, "small")
    saved = torch.get_num_threads()
    try:
        w1 = {m: [] for m in MODES}
        for _ in range(args.rounds):
            for m in MODES:
                w1[m].append(w1_tokens_per_s(model_dir, m, args.threads))
        off, on = (statistics.median(w1[m]) for m in MODES)
        print(f"W1 at t=0, {args.threads} threads, {args.rounds} rounds: off "
              f"{', '.join(f'{v:.1f}' for v in w1[False])} tok/s, on "
              f"{', '.join(f'{v:.1f}' for v in w1[True])} tok/s; median on / off "
              f"{on / off:.3f}")
        for batch in args.batch:
            ms = {m: [decode_step_ms(model_dir, m, args.threads, batch, args.steps)
                      for _ in range(args.rounds)] for m in MODES}
            off, on = (statistics.median(ms[m]) for m in MODES)
            print(f"decode at batch {batch}: step off {off:.2f} ms, on {on:.2f} ms (medians of "
                  f"{args.rounds} rounds of {args.steps} steps); on / off {on / off:.3f}")
    finally:
        torch.set_num_threads(saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
