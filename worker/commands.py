"""Worker-side CLI verbs: make-model, generate, demo. Imported only when one of them runs."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from producer.paths import default_model_dir


def make_model_cmd(args: argparse.Namespace) -> int:
    from worker.modelgen import make_model

    out = Path(args.dir) if args.dir else default_model_dir(args.preset)
    if out.exists() and any(out.iterdir()):
        if not args.force:
            raise FileExistsError(f"{out} exists and is not empty (use --force to overwrite)")
        shutil.rmtree(out)
    make_model(out, preset=args.preset, arch=args.arch, seed=args.seed)
    print(out)
    return 0


def ensure_model(model: str | None, preset: str = "small") -> Path:
    """The given folder, or the preset model in the data folder, made on first use."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        return path
    path = default_model_dir(preset)
    if not (path / "config.json").is_file():
        from worker.modelgen import make_model

        print(f"making the {preset} model in {path} ...", file=sys.stderr)
        make_model(path, preset=preset)
    return path


def generate_cmd(args: argparse.Namespace) -> int:
    from worker import Engine, SamplingParams

    engine = Engine(ensure_model(args.model), dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    for completion in engine.generate(list(args.prompts), params):
        print(f"[{completion.finish_reason}] {completion.text!r}")
    return 0


def demo_cmd(args: argparse.Namespace) -> int:
    from worker.demo import run_offline_demo

    run_offline_demo(ensure_model(args.model), num_questions=args.requests)
    return 0
