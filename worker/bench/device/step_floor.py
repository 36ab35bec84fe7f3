"""A decode step and a prefill chunk on the device, against what the device itself can do.

    python -m worker.bench.device.step_floor --model DIR [--device cuda] [--dtype bfloat16]
        [--batch 1 8 64 256] [--context 1024] [--steps 100] [--prefill-tokens 2048]
        [--modes graphs eager torch] [--json PATH]

The device's limits, measured first: its bandwidth (the bytes read and written by a
device-to-device copy of ``--copy-gib`` (4) GiB over its time, best of 5) and its GEMM peak
(the best ``--gemm-n`` (8192) cubed matmul in the engine's dtype, of 5). Then, for each
batch, an engine whose ``batch`` requests hold contexts of ``context`` ± 16 tokens decodes
``steps`` steady steps, once for each of ``--modes`` (graphs: attention through the block
tables with decode steps replayed from CUDA graphs, the default on CUDA; eager: the same
launched one kernel at a time; torch: the backend that gathers each context first): the
step is the wall time of ``Engine.step`` (scheduling, sampling
and output processing included), set against its floor, the bytes a decode step must move
over the bandwidth: the weights it reads (every parameter, the input embedding's table
aside, of which it reads a row a request, unless tied to the LM head) and the KV it reads
(every context token's K and V in every layer) and writes (one token's a request). Then a
prompt of two ``--prefill-tokens`` chunks is prefilled, each chunk's step timed, against the
GEMM peak: its FLOPs are 2 x the decoder layers' parameters x its tokens, plus causal
attention (QK and PV: 4 x heads x head_dim x the positions each token attends, a layer);
neither chunk ends the prompt, so neither runs the LM head. Prints each figure as soon as
it has it; runs on a CPU too (the test suite runs it on the tiny model with small buffers).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvstore.kv_tensors import PagedKVCache
from worker.bench.results.limits import copy_bandwidth, gemm_peak, sync
from worker.engine.engine import Engine
from worker.engine.memory import release_device_memory
from worker.host.device import resolve_dtype
from worker.models.config import ModelConfig

# Tokens by which each request's context differs from --context, at most.
CONTEXT_SPREAD = 16


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """One token's K and V across the layers (a KV block of one token)."""
    return PagedKVCache.bytes_per_block(config.num_hidden_layers, 1,
                                        config.num_key_value_heads, config.head_dim, dtype)


def decode_weight_bytes(engine: Engine) -> int:
    """The weights a decode step reads: every parameter but an untied input embedding."""
    config, model = engine.model_config, engine.model
    assert model is not None, "a simulated engine has no weights"
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        total -= config.vocab_size * config.hidden_size * engine.dtype.itemsize
    return total


def layer_parameters(config: ModelConfig) -> int:
    """Parameters of the decoder layers alone (no embedding, LM head or final norm)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    per_layer = (h * q + 2 * h * kv + q * h + 3 * h * config.intermediate_size + 2 * h
                 + (q + 2 * kv if config.qkv_bias else 0))
    return per_layer * config.num_hidden_layers


def prefill_flops(config: ModelConfig, start: int, tokens: int) -> float:
    """FLOPs of prefilling positions [start, start + tokens) of a prompt (see the module)."""
    attended = sum(p + 1 for p in range(start, start + tokens))
    attention = (4 * config.num_attention_heads * config.head_dim * attended
                 * config.num_hidden_layers)
    return 2 * layer_parameters(config) * tokens + attention


def _engine(model_dir: Path, device: str, dtype: str, batch: int, budget: int,
            **settings: Any) -> Engine:
    return Engine(model_dir, device=device, dtype=dtype, max_num_seqs=batch,
                  max_num_batched_tokens=max(budget, batch), **settings)


# How decode steps run, by name: attention through the block tables with the steps
# replayed from CUDA graphs (the default on CUDA), the same launched eagerly, and the
# gathering torch backend.
MODES: dict[str, dict[str, Any]] = {
    "graphs": {"attention_backend": "paged"},
    "eager": {"attention_backend": "paged", "enforce_eager": True},
    "torch": {"attention_backend": "torch", "enforce_eager": True},
}


def decode(model_dir: Path, device: str, dtype: str, batch: int, context: int, steps: int,
           bandwidth: float, budget: int, mode: str = "graphs") -> dict[str, Any]:
    """``steps`` steady decode steps of ``batch`` requests at ``context`` ± CONTEXT_SPREAD
    tokens, against the floor of the bytes they move, run as ``mode`` says (MODES)."""
    engine = _engine(model_dir, device, dtype, batch, budget, **MODES[mode])
    try:
        rng = random.Random(batch)
        vocab = engine.model_config.vocab_size
        for _ in range(batch):
            length = max(1, context + rng.randint(-CONTEXT_SPREAD, CONTEXT_SPREAD))
            engine.add_request([rng.randrange(2, vocab) for _ in range(length)],
                               {"max_tokens": 10**6, "ignore_eos": True, "temperature": 0})
        while engine.scheduler.num_waiting or any(
                r.num_output_tokens == 0 for r in engine.scheduler.running):
            engine.step()  # the prompts, until every request decodes
        for _ in range(3):
            engine.step()  # a few steady steps first (allocations, caches)
        contexts = [r.num_tokens for r in engine.scheduler.running]
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        # The KV read grows a token a request a step: the mean context over the steps.
        mean_context = statistics.fmean(contexts) + (steps - 1) / 2
        per_token = kv_bytes_per_token(engine.model_config, engine.dtype)
        moved = (decode_weight_bytes(engine) + batch * mean_context * per_token
                 + batch * per_token)
        step_s = statistics.fmean(times)
        graphs = engine.runner.graphs
        result = {"mode": mode, "batch": batch, "mean_context": round(mean_context, 1),
                  "graph_replays": graphs.replays if graphs is not None else 0,
                  "step_ms": round(step_s * 1000, 3),
                  "step_median_ms": round(statistics.median(times) * 1000, 3),
                  "floor_ms": round(moved / bandwidth * 1000, 3),
                  "step_over_floor": round(step_s / (moved / bandwidth), 2),
                  "bytes_moved": int(moved)}
    finally:
        engine.close()
        del engine
        release_device_memory()
    return result


def prefill(model_dir: Path, device: str, dtype: str, chunk: int, peak: float
            ) -> list[dict[str, Any]]:
    """Two ``chunk``-token chunks of one prompt, each step against the GEMM peak (after a
    prompt of one chunk, to warm up; steps not overlapped, so each is its own chunk's)."""
    engine = _engine(model_dir, device, dtype, 1, chunk, async_scheduling=False)
    try:
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size
        engine.generate([[rng.randrange(2, vocab) for _ in range(chunk)]],
                        {"max_tokens": 1, "ignore_eos": True, "temperature": 0})
        engine.add_request([rng.randrange(2, vocab) for _ in range(2 * chunk + 1)],
                           {"max_tokens": 1, "ignore_eos": True, "temperature": 0})
        out = []
        for i in range(2):
            # (a chunk that samples nothing returns before the device is done with it)
            sync(engine.device)
            start = time.perf_counter()
            engine.step()
            sync(engine.device)
            seconds = time.perf_counter() - start
            flops = prefill_flops(engine.model_config, i * chunk, chunk)
            out.append({"chunk": i, "tokens": chunk, "ms": round(seconds * 1000, 3),
                        "tflops": round(flops / seconds / 1e12, 3),
                        "of_gemm_peak": round(flops / seconds / peak, 3)})
    finally:
        engine.close()
        del engine
        release_device_memory()
    return out


def measure(model_dir: Path, device: str, dtype: str, batches: list[int], context: int,
            steps: int, prefill_tokens: int, copy_gib: float, gemm_n: int,
            say=print, modes: tuple[str, ...] = ("graphs", "eager")) -> dict[str, Any]:
    """The device's limits, then each batch's decode step and the prefill chunks."""
    dev = torch.device(device)
    torch_dtype = resolve_dtype(dtype)
    bandwidth = copy_bandwidth(dev, int(copy_gib * 2**30))
    say(f"bandwidth (a {copy_gib:g} GiB copy, read + written): {bandwidth / 1e9:.1f} GB/s")
    peak = gemm_peak(dev, torch_dtype, gemm_n)
    say(f"GEMM peak ({gemm_n}^3, {dtype}): {peak / 1e12:.1f} TFLOP/s")
    release_device_memory()  # (the copy's and matmul's buffers, before an engine sizes its pool)
    result: dict[str, Any] = {"device": str(dev), "dtype": dtype, "model": str(model_dir),
                              "bandwidth_gb_per_s": round(bandwidth / 1e9, 2),
                              "gemm_tflops": round(peak / 1e12, 2), "decode": []}
    if dev.type == "cuda":
        result["device_name"] = torch.cuda.get_device_name(dev)
    for mode in modes:
        for batch in batches:
            row = decode(model_dir, device, dtype, batch, context, steps, bandwidth,
                         prefill_tokens, mode)
            say(f"decode ({mode}, {row['graph_replays']} replays) batch {batch}, context "
                f"~{row['mean_context']:.0f}: step {row['step_ms']:.2f} ms (median "
                f"{row['step_median_ms']:.2f}), floor {row['floor_ms']:.2f} ms: "
                f"{row['step_over_floor']:.2f}x")
            result["decode"].append(row)
    result["prefill"] = prefill(model_dir, device, dtype, prefill_tokens, peak)
    for row in result["prefill"]:
        say(f"prefill chunk {row['chunk']} ({row['tokens']} tokens): {row['ms']:.1f} ms, "
            f"{row['tflops']:.1f} TFLOP/s, {row['of_gemm_peak']:.2f} of the GEMM peak")
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m worker.bench.device.step_floor",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["graphs", "eager"],
                   help="how decode steps run: graphs (paged attention, CUDA graphs), eager "
                   "(paged, --enforce-eager), torch (the gathering backend, eager); "
                   "default: %(default)s")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    result = measure(Path(args.model), args.device, args.dtype, args.batch, args.context,
                     args.steps, args.prefill_tokens, args.copy_gib, args.gemm_n,
                     modes=tuple(args.modes))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
