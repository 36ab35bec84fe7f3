"""How many host-to-device copies a step makes on CUDA, by the kind of step.

    python -m worker.bench.step_copies [--model DIR] [--steps 4]

Each kind of step (greedy decodes; sampled decodes with every filter; penalised, biased
decodes asking logprobs beside greedy ones; decodes beside a prefill chunk) runs on its own
engine on the tiny preset (made in a temporary folder unless ``--model`` names one), with
plain steps (no overlap, so each step's copies fall inside its own window), and
torch.profiler counts the GPU's "Memcpy HtoD" records over ``--steps`` steps. A step's
inputs (token ids, positions, slot mapping, block tables, attention plan, sampling values,
penalty tokens, row subsets) are meant to go in one copy; swaps, which move KV blocks, are
not part of any kind here. Needs CUDA.
"""

from __future__ import annotations

import argparse
import collections
import tempfile
from pathlib import Path

import torch

from worker import Engine, SamplingParams
from worker.modelgen import make_model

# Each kind: the requests' sampling settings (cycled over 8 requests) and whether a long
# prompt arrives while they decode, so the counted steps mix a prefill chunk with decodes.
KINDS: dict[str, tuple[list[dict[str, object]], bool]] = {
    "greedy": ([{"temperature": 0.0}], False),
    "sampled": ([{"temperature": 0.8, "top_p": 0.9}, {"temperature": 1.0, "top_k": 20},
                 {"temperature": 1.0, "min_p": 0.05}, {"temperature": 0.7}], False),
    "penalised": ([{"temperature": 0.0},
                   {"temperature": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.3,
                    "repetition_penalty": 1.1, "logit_bias": {5: 2.0}, "logprobs": 2}],
                  False),
    "prefill": ([{"temperature": 0.0}, {"temperature": 0.8, "top_p": 0.95}], True),
}


def host_to_device_copies(engine: Engine, steps: int) -> collections.Counter[str]:
    """The "Memcpy HtoD" records of the GPU over ``steps`` of ``engine``'s steps, by name
    (the name says pinned or pageable)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("Memcpy HtoD"))


def kind_engine(model_dir: Path, kind: str, dtype: str = "float32") -> Engine:
    """An engine on CUDA whose 8 requests of ``kind`` are all decoding (and, for "prefill",
    with a long prompt queued, to be taken in chunks beside them)."""
    settings, with_prefill = KINDS[kind]
    engine = Engine(model_dir, device="cuda", dtype=dtype, async_scheduling=False,
                    max_num_batched_tokens=64)
    for i in range(8):
        engine.add_request([5 + i] * (20 + 7 * i),
                           SamplingParams(max_tokens=200, ignore_eos=True, seed=i,
                                          **settings[i % len(settings)]))
    while engine.scheduler.num_waiting or any(
            r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    if with_prefill:
        engine.add_request(list(range(2, 400)), SamplingParams(max_tokens=4, temperature=0.0))
        engine.step()  # its first chunk: no prefix of it is cached yet
    return engine


def measure(model_dir: Path, steps: int, dtype: str = "float32") -> dict[str, float]:
    """Host-to-device copies per step, by kind."""
    result = {}
    for kind in KINDS:
        engine = kind_engine(model_dir, kind, dtype)
        copies = host_to_device_copies(engine, steps)
        result[kind] = sum(copies.values()) / steps
        print(f"{kind:>10}: {result[kind]:.2f} copies/step  {dict(copies)}")
        engine.close()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="checkpoint folder (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=4, help="steps counted per kind")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model(Path(tmp) / "tiny", preset="tiny")
        measure(model, args.steps, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
