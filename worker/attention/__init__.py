"""Attention backends, chosen by name and imported only when chosen.

Each backend lives in its own module, imported by ``get_attention_backend``: a backend
built on a device's own kernels never breaks ``import`` where they are missing.
"""

from __future__ import annotations

import importlib

from worker.attention.base import AttentionBackend
from worker.attention.metadata import AttentionMetadata

# Backend name -> "module:Class"; a module is imported only when its name is asked for.
BACKENDS: dict[str, str] = {
    "torch": "worker.attention.torch_backend:TorchAttention",
    "paged": "worker.attention.paged_backend:PagedAttention",
}


# What "auto" picks: the only backend there is today, on every device.
AUTO_BACKEND = "torch"


def get_attention_backend(name: str) -> type[AttentionBackend]:
    """The backend class registered as `name` ("auto": the default one); ValueError names the
    known ones if it is unknown."""
    name = AUTO_BACKEND if name == "auto" else name
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "get_attention_backend"]
