"""Where an engine runs and in what precision: the one place dtype names become torch dtypes."""

from __future__ import annotations

import torch

from worker.engine.config import DTYPE_NAMES, EngineConfig


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name ("float32", "torch.bfloat16", ...)."""
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def engine_device(config: EngineConfig) -> torch.device:
    """The configured device; "auto" is CUDA when there is one, else the CPU."""
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def engine_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The configured dtype; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(config.dtype)
