"""Attention backends, chosen by name and imported only when chosen.

Each backend lives in its own module, imported by ``get_attention_backend``: a backend
built on a device's own kernels never breaks ``import`` where they are missing.
"""

from __future__ import annotations

import importlib
import importlib.util

from worker.attention.base import AttentionBackend
from worker.attention.metadata import AttentionMetadata

# Backend name -> "module:Class"; a module is imported only when its name is asked for.
BACKENDS: dict[str, str] = {
    "torch": "worker.attention.torch_backend:TorchAttention",
    "paged": "worker.attention.paged_backend:PagedAttention",
}


# What "auto" picks without a device to choose for.
AUTO_BACKEND = "torch"


def auto_backend(device_type: str) -> str:
    """What "auto" means on a device: on CUDA, attention through the block tables in place
    (the "paged" backend's Triton kernel: no gathered copy, and a launch a captured decode
    graph can replay) where triton is installed (CUDA builds of torch bring it); elsewhere
    the torch backend, whose CPU decode kernel reads the cache in place too."""
    if device_type == "cuda" and importlib.util.find_spec("triton") is not None:
        return "paged"
    return AUTO_BACKEND


def get_attention_backend(name: str, device_type: str = "cpu") -> type[AttentionBackend]:
    """The backend class registered as `name` ("auto": the one for ``device_type``, see
    auto_backend); ValueError names the known ones if it is unknown."""
    name = auto_backend(device_type) if name == "auto" else name
    if name not in BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {', '.join(sorted(BACKENDS))}"
        )
    module_name, class_name = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["BACKENDS", "AttentionBackend", "AttentionMetadata", "auto_backend",
           "get_attention_backend"]
