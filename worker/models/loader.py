"""Load a local Hugging Face checkpoint folder into a `CausalLM`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from worker.host.device import resolve_dtype
from worker.models.config import ModelConfig
from worker.models.llama import CausalLM
from worker.models.weight_arena import place_in_arena

# Checkpoint tensors we knowingly drop: old exports saved the rope frequencies.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Names listed at most in an error message.
_MAX_NAMES_SHOWN = 8


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
) -> CausalLM:
    """Build a `CausalLM` from `model_dir` (config.json + safetensors), weights cast to `dtype`.

    Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``.
    Raises ValueError for missing or unexpected tensors and for shape mismatches.
    """
    model_dir = Path(model_dir)
    dtype = resolve_dtype(dtype)
    config = ModelConfig.from_dir(model_dir)
    # Built on "meta" so no time goes into random init; every parameter is then filled from disk.
    with torch.device("meta"):
        model = CausalLM(config, attention_backend=attention_backend,
                         device_type=torch.device(device).type)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    if torch.device(device).type == "cpu":
        # One buffer on huge pages, q/k/v and gate/up back to back (fused matmul views).
        place_in_arena(model)
    _copy_checkpoint(model, model_dir)
    return model.eval()


def _copy_checkpoint(model: CausalLM, model_dir: Path) -> None:
    """Fill every parameter from the checkpoint, refusing any mismatch in names or shapes."""
    tied = model.config.tie_word_embeddings
    params = dict(model.named_parameters(remove_duplicate=False))
    if tied:
        # The head shares embed_tokens; like transformers we ignore any saved copy of it.
        params.pop("lm_head.weight")
    loaded: set[str] = set()
    unexpected: list[str] = []
    with torch.no_grad():
        for name, tensor in _checkpoint_tensors(model_dir):
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            if name not in params:
                unexpected.append(name)
                continue
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{model_dir}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(params[name].shape)}"
                )
            params[name].copy_(tensor)
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ValueError(
            f"{model_dir}: checkpoint does not match {model.config.architecture}: "
            f"missing {_names(missing)}; unexpected {_names(sorted(unexpected))}"
        )


def _checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one file at a time, on the CPU."""
    for file in _safetensors_files(model_dir):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _names(names: list[str]) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    return shown + (
        f" (and {len(names) - _MAX_NAMES_SHOWN} more)" if len(names) > _MAX_NAMES_SHOWN else ""
    )
