"""Where a decode step's time goes, against the time of its own weight matmuls.

    python -m worker.bench.decode_step [--batch 64] [--threads 2] [--profile]

Measures, in one process and at one thread count: the greedy decode step at ``batch``
requests of 128-token prompts on the small preset (median of ``--steps``), and the same
step's weight matmuls alone (q/k/v/o and gate/up/down of every layer plus the LM head,
``F.linear`` on random inputs of the step's shapes, best of 5). Their ratio is the step's
matmul efficiency: 1.0 would mean attention, norms, rope, sampling and Python cost nothing.
``--profile`` adds torch.profiler's operator table for a few steps.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from worker.bench.sampling_steps import decoding_engine, model_with_vocab


def weight_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every weight matmul of one decode step, as transformers lays them out:
    q, k, v, o, gate, up and down of each layer, then the LM head."""
    h, heads, kv, d = (config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim)
    layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d),
             (config.intermediate_size, h), (config.intermediate_size, h),
             (h, config.intermediate_size)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


def matmul_seconds(engine, batch: int, repeats: int = 5) -> float:
    """Best of ``repeats`` runs of the step's weight matmuls at ``batch`` tokens."""
    dtype = engine.dtype
    weights = [torch.randn(o, i, dtype=dtype) for o, i in weight_shapes(engine.model_config)]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for w in weights:
                F.linear(x[w.shape[1]], w)
            best = min(best, time.perf_counter() - start)
    return best


def step_seconds(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_table(engine, steps: int = 5, rows: int = 25) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = decoding_engine(model_with_vocab(8192, args.models), "greedy", args.batch,
                             args.threads)
    step = step_seconds(engine, args.steps)
    mm = matmul_seconds(engine, args.batch)
    print(f"batch {args.batch}, {args.threads} threads: step {step * 1e3:.2f} ms (median of "
          f"{args.steps}), its weight matmuls {mm * 1e3:.2f} ms (best of 5): "
          f"matmul efficiency {mm / step:.2f}, step / matmuls {step / mm:.2f}x")
    if args.profile:
        print(profile_table(engine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
