"""Where an engine runs and in what precision: the one place dtype names become torch dtypes.

torch is imported inside the functions: ``DTYPE_NAMES`` is read by settings that load no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# The precisions an engine runs in, by torch's names.
DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name ("float32", "torch.bfloat16", ...)."""
    import torch

    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype.removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, name)


def engine_device(name: str) -> torch.device:
    """The device named; "auto" is CUDA when there is one, else the CPU."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def engine_dtype(name: str, device: torch.device) -> torch.dtype:
    """The dtype named; "auto" is bfloat16 on CUDA and float32 elsewhere."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return resolve_dtype(name)
