"""What sampling costs in a decode step: each sampling mode's step against the greedy step.

    python -m worker.bench.sampling_steps [--vocab 8192|32000] [--batch 64] [--threads 2]

One engine per mode, each with ``batch`` requests of 128-token prompts decoding on the
small preset (random weights; another vocabulary size gets its own checkpoint, with the
shipped tokenizer of that size where one ships: 1,024, 8,192, 32,000); the steps of all
modes are interleaved, so a slower moment of the machine weighs on every mode alike, and
each mode's median is printed with its ratio to greedy. The engines' objects are kept off
the garbage collector meanwhile, as a worker process keeps them (producer/long_lived.py).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from producer.long_lived import long_lived_frozen
from worker import Engine, SamplingParams
from worker.modelgen import make_model
from worker.modelgen.presets import TOKENIZER_SHA256

MODES: dict[str, dict[str, object]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 1.0},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
    "top_k+top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "min_p": {"temperature": 1.0, "min_p": 0.1},
    "penalties": {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.2},
    # Structured outputs: a JSON object with one long string (at least 5,000 characters:
    # no request can close it within a run, so the batch stays whole); its masks' time is
    # reported on its own. Needs the model's tokenizer (a shipped vocabulary size).
    "json_schema": {"temperature": 1.0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "bench", "schema": {
            "type": "object", "properties": {"text": {"type": "string", "minLength": 5000}},
            "required": ["text"], "additionalProperties": False}}}},
}
PROMPT_TOKENS = 128


def decoding_engine(model_dir: Path, mode: str, batch: int, threads: int,
                    prompt_tokens: int = PROMPT_TOKENS, **settings: Any) -> Engine:
    """An engine whose ``batch`` requests (sampled as ``mode`` says) all decode; ``settings``:
    more engine settings."""
    engine = Engine(model_dir, dtype="float32", max_num_seqs=batch, num_threads=threads,
                    max_num_batched_tokens=max(1024, prompt_tokens * batch), **settings)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    # (a constrained request ends where its grammar does: it may not ignore EOS)
    ignore_eos = "response_format" not in MODES[mode]
    for i in range(batch):
        engine.add_request([rng.randrange(2, vocab) for _ in range(prompt_tokens)],
                           SamplingParams(max_tokens=100_000, ignore_eos=ignore_eos, seed=i,
                                          **MODES[mode]))
    while engine.scheduler.num_waiting or any(
            r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return engine


def model_with_vocab(vocab: int, folder: Path) -> Path:
    """The small preset with ``vocab`` tokens (made once in ``folder``)."""
    out = folder / f"small-vocab-{vocab}"
    if not (out / "config.json").is_file():
        make_model(out, preset="small", with_tokenizer=vocab in TOKENIZER_SHA256,
                   vocab_size=vocab)
    return out


def measure(model_dir: Path, batch: int, threads: int, rounds: int) -> dict[str, float]:
    """Median step seconds per mode, steps interleaved across modes; "masks": the median
    seconds a constrained step spent making its masks (part of its step)."""
    tokenizer = (model_dir / "tokenizer.json").is_file()
    modes = [m for m in MODES if tokenizer or "response_format" not in MODES[m]]
    engines = {mode: decoding_engine(model_dir, mode, batch, threads) for mode in modes}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    masks: list[float] = []
    with long_lived_frozen():  # as a worker process is once its engine is built
        for _ in range(rounds):
            for mode, engine in engines.items():
                grammars = engine.checks.grammars
                before = grammars.mask_seconds if grammars is not None else 0.0
                start = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - start)
                if grammars is not None and grammars.mask_rows:
                    masks.append(grammars.mask_seconds - before)
    medians = {mode: statistics.median(t) for mode, t in times.items()}
    if masks:
        medians["masks"] = statistics.median(masks)
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", type=Path, default=Path(tempfile.gettempdir()),
                        help="where the checkpoint is made (default: the temp folder)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    medians = measure(model_with_vocab(args.vocab, args.models), args.batch, args.threads,
                      args.rounds)
    greedy = medians["greedy"]
    print(f"vocab {args.vocab}, batch {args.batch}, {args.threads} threads, "
          f"median of {args.rounds} steps")
    masks = medians.pop("masks", None)
    for mode, seconds in medians.items():
        print(f"{mode:12s} {seconds * 1e3:8.2f} ms   x{seconds / greedy:.3f}")
    if "json_schema" in medians:
        # The same draws unconstrained: what a constrained step costs on top.
        print(f"json_schema / temperature: x{medians['json_schema'] / medians['temperature']:.3f}"
              + (f"; its masks {masks * 1e3:.2f} ms a step" if masks is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
