"""Where a decode step's time goes, against the time of its own weight matmuls.

    python -m worker.bench.decode_step [--batch 64] [--threads 2] [--block-size N] [--profile]

Measures, in one process and at one thread count, in interleaved rounds so that both sides
of every ratio see the same machine: the greedy decode step at ``batch`` requests of
128-token prompts on the small preset, once with the native decode layers
(worker/models/native_decode.py) and once with the Python layers, and the same step's
weight matmuls alone (q/k/v/o and gate/up/down of every layer plus the LM head, on random
inputs of the step's shapes), twice: as ``F.linear`` (the BLAS torch's CPU build calls,
the issue's yardstick) and as the step makes them (worker/models/linear.py: the packed
kernel on packed copies of the weights; with ``CONVEYOR_CPU_MATMUL=unpacked`` the skinny
kernel or oneDNN's matmul). Steps are medians over ``--steps`` rounds; matmuls are the
best round. step / matmuls is 1.0 where attention, norms, rope, sampling and Python cost
nothing. The step is measured as a worker runs it: the engine's objects kept off the
garbage collector (producer/long_lived.py), and no detokenizing (a worker's publisher thread
does that, off the engine's thread). ``--profile`` adds torch.profiler's operator table.

Attention must read every running sequence's K and V once a layer, and on a CPU that read
runs at the memory's speed, whatever the kernel: so the bench also times a plain sum over
as many bytes, laid out a buffer per layer on huge pages as the KV cache is (best round),
and prints the step's floor, its own matmuls plus that read.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from producer import settings
from producer.long_lived import long_lived_frozen
from worker.bench.sampling_steps import decoding_engine, model_with_vocab
from worker.models import packed_weights
from worker.models.linear import linear


def weight_shapes(config) -> list[tuple[int, int]]:
    """(out, in) of every weight matmul of one decode step, as transformers lays them out:
    q, k, v, o, gate, up and down of each layer, then the LM head."""
    h, heads, kv, d = (config.hidden_size, config.num_attention_heads,
                       config.num_key_value_heads, config.head_dim)
    layer = [(heads * d, h), (kv * d, h), (kv * d, h), (h, heads * d),
             (config.intermediate_size, h), (config.intermediate_size, h),
             (h, config.intermediate_size)]
    return layer * config.num_hidden_layers + [(config.vocab_size, h)]


def matmul_seconds(weights: list[torch.Tensor], x: dict[int, torch.Tensor],
                   matmul=F.linear) -> float:
    """One run of the step's weight matmuls."""
    with torch.inference_mode():
        start = time.perf_counter()
        for w in weights:
            matmul(x[w.shape[1]], w)
        return time.perf_counter() - start


def as_the_step_makes_them(weights: list[torch.Tensor]):
    """worker/models/linear.py's matmul, on each weight's packed copy where packing is on
    (made here, before any timing)."""
    copies = {id(w): packed_weights.packed(w) for w in weights}
    return lambda x, w: linear(x, w, packed=copies[id(w)])


def kv_buffers(engine, rounds: int) -> list[torch.Tensor]:
    """One buffer a layer holding as many bytes of K and V as a native step of the
    measurement reads: every running sequence's context at the middle round (each round
    steps twice)."""
    from kvstore.huge_pages import zeroed_buffer

    config = engine.model_config
    tokens = sum(r.num_tokens for r in engine.scheduler.running) + rounds * len(
        engine.scheduler.running)
    size = tokens * 2 * config.num_key_value_heads * config.head_dim * engine.dtype.itemsize
    buffers = []
    for _ in range(config.num_hidden_layers):
        buffer = torch.frombuffer(zeroed_buffer(size), dtype=engine.dtype)
        buffer.fill_(1.0)  # touched: its pages exist, as a used cache's do
        buffers.append(buffer)
    return buffers


def read_seconds(buffers: list[torch.Tensor]) -> float:
    """One pass over ``buffers``, a layer's at a time, as the step's attention reads them."""
    start = time.perf_counter()
    for buffer in buffers:
        buffer.sum()
    return time.perf_counter() - start


def step_seconds(engine, native: bool) -> float:
    """One engine step, with the native decode layers on or off."""
    with settings.overridden(settings.CPU_DECODE_LAYERS, "1" if native else "0"):
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start


def measure(engine, batch: int, rounds: int) -> dict[str, float]:
    """Median native and Python step and best matmul seconds over interleaved rounds."""
    dtype = engine.dtype
    weights = [torch.randn(o, i, dtype=dtype) for o, i in weight_shapes(engine.model_config)]
    x = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
    step_matmul = as_the_step_makes_them(weights)
    kv = kv_buffers(engine, rounds)
    times: dict[str, list[float]] = {"native": [], "python": [], "matmuls": [],
                                     "kernel_matmuls": [], "kv_read": []}
    for _ in range(rounds):
        times["native"].append(step_seconds(engine, native=True))
        times["python"].append(step_seconds(engine, native=False))
        times["matmuls"].append(matmul_seconds(weights, x))
        times["kernel_matmuls"].append(matmul_seconds(weights, x, step_matmul))
        times["kv_read"].append(read_seconds(kv))
    return {"native": statistics.median(times["native"]),
            "python": statistics.median(times["python"]), "matmuls": min(times["matmuls"]),
            "kernel_matmuls": min(times["kernel_matmuls"]), "kv_read": min(times["kv_read"]),
            "kv_bytes": sum(b.numel() * b.element_size() for b in kv),
            "native_steps": engine.model.num_native_steps}


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
    parser.add_argument("--block-size", type=int, default=None,
                        help="token slots per KV block (default: the engine's)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    # Detokenizing is the publisher's work in a worker, on its own thread, not the step's.
    blocks = {} if args.block_size is None else {"block_size": args.block_size}
    engine = decoding_engine(model_with_vocab(8192, args.models), "greedy", args.batch,
                             args.threads, detokenize=False, **blocks)
    before = engine.model.num_native_steps
    with long_lived_frozen():  # as a worker process is once its engine is built
        got = measure(engine, args.batch, args.steps)
    mm, km = got["matmuls"], got["kernel_matmuls"]
    print(f"batch {args.batch}, {args.threads} threads, {args.steps} rounds: weight matmuls "
          f"{mm * 1e3:.2f} ms as F.linear, {km * 1e3:.2f} ms as the step makes them "
          f"(best round)")
    for path in ("native", "python"):
        step = got[path]
        print(f"  {path + ' layers:':15} step {step * 1e3:6.2f} ms (median), "
              f"step / F.linear matmuls {step / mm:.2f}x (matmul efficiency {mm / step:.2f}), "
              f"step / its own matmuls {step / km:.2f}x")
    floor = km + got["kv_read"]
    print(f"  floor: its own matmuls + one read of its KV ({got['kv_bytes'] / 1e6:.0f} MB in "
          f"{got['kv_read'] * 1e3:.2f} ms, best round) = {floor * 1e3:.2f} ms, "
          f"{floor / mm:.2f}x F.linear; native step / floor {got['native'] / floor:.2f}x")
    if got["native_steps"] == before:
        print("  (the native layers did not run: kernels unavailable or switched off)")
    if args.profile:
        print(profile_table(engine))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
