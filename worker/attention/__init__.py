"""Attention backends, chosen by name and imported only when chosen.

A backend that needs CUDA kernels (flashinfer) lives in its own module, so
importing this package never imports them and a CPU-only install still works.
"""

from __future__ import annotations

import importlib

from worker.attention.base import AttentionBackend
from worker.attention.metadata import AttentionMetadata

# Backend name -> "module:Class"; a module is imported only when its name is asked for.
BACKENDS: dict[str, str] = {
    "torch": "worker.attention.torch_backend:TorchAttention",
}


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name`; ValueError names the known ones if it is unknown."""
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
