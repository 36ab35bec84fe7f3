"""Write a state dict as model.safetensors or as Hugging Face-style shards plus an index,
drawing the tensors of one file at a time (a real-size model never sits in memory whole)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.modelgen.config_json import dump_json

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what transformers checks for; nothing time- or host-dependent
# Largest file make_model writes unless told how many: a shard is drawn whole in memory.
MAX_SHARD_BYTES = 2 * 2**30


def shard_name(index: int, num_shards: int) -> str:
    """HF's shard file name, e.g. model-00001-of-00002.safetensors (index from 0)."""
    return f"model-{index + 1:05d}-of-{num_shards:05d}.safetensors"


def split_into_shards(sizes: Mapping[str, int], num_shards: int) -> list[list[str]]:
    """Cut the tensors (name -> bytes), in order, into num_shards non-empty runs of roughly
    equal bytes."""
    names = list(sizes)
    if not 1 <= num_shards <= len(names):
        raise ValueError(f"num_shards must be in 1..{len(names)}, got {num_shards}")
    total = sum(sizes.values())
    shards: list[list[str]] = [[]]
    done = 0  # bytes placed so far
    for i, name in enumerate(names):
        needs_new = len(names) - i <= num_shards - len(shards)  # one tensor per remaining shard
        full = done >= total * len(shards) / num_shards
        if shards[-1] and len(shards) < num_shards and (full or needs_new):
            shards.append([])
        shards[-1].append(name)
        done += sizes[name]
    return shards


def shards_needed(total_bytes: int) -> int:
    """How many files a checkpoint of ``total_bytes`` takes at about MAX_SHARD_BYTES each
    (split_into_shards cuts between tensors: a file may pass it by part of one)."""
    return max(1, -(-total_bytes // MAX_SHARD_BYTES))


def write_weights(sizes: Mapping[str, tuple[int, int]], draw: Callable[[str], torch.Tensor],
                  out_dir: Path, num_shards: int) -> list[Path]:
    """Write the weight files (and the index when sharded); return the paths written.

    ``sizes``: each tensor's (elements, bytes), in order; ``draw(name)`` makes it, anywhere:
    the tensors of one file are drawn, moved to the CPU, written and let go before the next.
    """
    def tensors(names: list[str]) -> dict[str, torch.Tensor]:
        return {n: draw(n).cpu().contiguous() for n in names}

    if num_shards == 1:
        path = out_dir / SINGLE_FILE
        save_file(tensors(list(sizes)), path, metadata=METADATA)
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    groups = split_into_shards({n: nbytes for n, (_, nbytes) in sizes.items()}, num_shards)
    for index, names in enumerate(groups):
        path = out_dir / shard_name(index, len(groups))
        save_file(tensors(names), path, metadata=METADATA)  # (no copy of the file in memory)
        weight_map.update((n, path.name) for n in names)
        written.append(path)
    index_doc = {
        "metadata": {
            "total_parameters": sum(numel for numel, _ in sizes.values()),
            "total_size": sum(nbytes for _, nbytes in sizes.values()),
        },
        "weight_map": weight_map,
    }
    index_path = out_dir / INDEX_FILE
    index_path.write_bytes(dump_json(index_doc))
    return [*written, index_path]
