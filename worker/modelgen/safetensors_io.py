"""Write a state dict as model.safetensors or as Hugging Face-style shards plus an index."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save

from worker.modelgen.config_json import dump_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what transformers checks for; nothing time- or host-dependent


def shard_name(index: int, num_shards: int) -> str:
    """HF's shard file name, e.g. model-00001-of-00002.safetensors (index from 0)."""
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def split_into_shards(weights: dict[str, torch.Tensor], num_shards: int) -> list[list[str]]:
    """Cut the tensors, in order, into num_shards non-empty runs of roughly equal bytes."""
    names = list(weights)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in 1..{len(names)}, got {num_shards}")
    total = sum(t.nbytes for t in weights.values())
    shards: list[list[str]] = [[]]
    done = 0  # bytes placed so far
    for i, name in enumerate(names):
        needs_new = len(names) - i <= num_shards - len(shards)  # one tensor per remaining shard
        full = done >= total * len(shards) / num_shards
        if shards[-1] and len(shards) < num_shards and (full or needs_new):
            shards.append([])
        shards[-1].append(name)
        done += weights[name].nbytes
    return shards


def write_weights(weights: dict[str, torch.Tensor], out_dir: Path, num_shards: int) -> list[Path]:
    """Write the weight files (and the index when sharded); return the paths written."""
    if num_shards == 1:
        path = out_dir / SINGLE_FILE
        path.write_bytes(save(weights, metadata=METADATA))
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    groups = split_into_shards(weights, num_shards)
    for index, names in enumerate(groups):
        path = out_dir / shard_name(index, len(groups))
        path.write_bytes(save({n: weights[n] for n in names}, metadata=METADATA))
        weight_map.update((n, path.name) for n in names)
        written.append(path)
    index_doc = {
        "metadata": {
            "total_parameters": sum(t.numel() for t in weights.values()),
            "total_size": sum(t.nbytes for t in weights.values()),
        },
        "weight_map": weight_map,
    }
    index_path = out_dir / INDEX_FILE
    index_path.write_bytes(dump_json(index_doc))
    return [*written, index_path]
