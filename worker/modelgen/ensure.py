"""A model folder to run: the one given, or a preset made on first use (marked, so that a
later ``make-model --force`` may replace it)."""

from __future__ import annotations

import sys
from pathlib import Path

from producer.paths import default_model_dir


def make_marked(out: Path, preset: str, arch: str = "llama", seed: int = 0,
                chat_template: str = "plain", vocab_size: int | None = None,
                dtype: str | None = None, device: str = "cpu") -> None:
    """make_model in a folder marked first: a later ``make-model --force`` may replace it,
    even where this making stopped midway."""
    from worker.modelgen.make_model import check_device, make_model, mark_folder

    check_device(device)  # (before any folder is made)
    out.mkdir(parents=True, exist_ok=True)
    mark_folder(out, preset=preset, arch=arch, seed=seed, chat_template=chat_template,
                vocab_size=vocab_size, dtype=dtype, device=device)
    make_model(out, preset=preset, arch=arch, seed=seed, chat_template=chat_template,
               vocab_size=vocab_size, dtype=dtype, device=device)


def ensure_model(model: str | None, preset: str = "small") -> Path:
    """The given folder, or the preset model in the data folder, made on first use."""
    if model:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        return path
    path = default_model_dir(preset)
    if not (path / "config.json").is_file():
        print(f"making the {preset} model in {path} ...", file=sys.stderr)
        make_marked(path, preset=preset)
    return path
