"""Packed copies of the weights a CPU decode step multiplies by (csrc/packed_linear.h).

A decode step's matmuls read every projection weight once per step for a few dozen rows of
activations. From W laid out in panels of 32 transposed rows, the kernel streams each panel
once and keeps its partial sums in registers, faster than the skinny kernel and oneDNN's
at 1 to 192 rows (csrc/packed_linear.h); and its panels go to the threads as they free
up, so a thread that loses its core mid-matmul leaves its panels to the others (the worker
shares its cores with its I/O threads, Redis and clients).

The price is memory: a packed copy of each matrix it serves, the decoder layers' fused
q/k/v, o, gate/up and down weights and the LM head, about as much again as the model's
float32 weights. ``CONVEYOR_CPU_MATMUL=unpacked`` makes none (the matmuls are then the
skinny kernel's and oneDNN's, as worker/models/linear.py says); so does
``CONVEYOR_CPU_MATMUL=blas``. The copies are made when a CPU engine is built
(worker/models/native_decode.py's ``prepare``), else at a weight's first use, and made again
if the weight, or any parameter a fused weight was joined from, is written in place or given
new data afterwards.
"""

from __future__ import annotations

import torch

from producer import settings
from worker.models.linear import blas_only

# The attribute of a weight tensor that holds its packed copy (so the copy lives as long as
# the weight), under what it was packed from: the weight's version and the address of its
# data (a model moved or cast in place gets new data, not a new version). Not a dict keyed
# by tensors: tensors compare element by element.
_ATTRIBUTE = "_conveyor_packed"

# The attribute of a fused weight that lists the parameters it was joined from.
SOURCES = "_conveyor_sources"


def enabled() -> bool:
    """Whether decode matmuls take packed copies (not with ``CONVEYOR_CPU_MATMUL`` set to
    ``unpacked`` or ``blas``)."""
    return not blas_only() and settings.cpu_matmul() != "unpacked"


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``weight [N, K]`` (made now if it has none, or if the weight was
    written since), or None where packing does not apply: not float32 on the CPU, switched
    off, or the kernels are not built."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not enabled()):
        return None
    entry = getattr(weight, _ATTRIBUTE, None)
    # A fused weight (q/k/v, gate/up) is a view of its parameters' memory, but each of them
    # keeps a version counter of its own: all of them are checked.
    version = tuple((_version(t), t.data_ptr()) for t in _sources(weight))
    if entry is not None and entry[0] == version:
        return entry[1]
    from worker.host.cpu_kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        return None
    with torch.inference_mode(False), torch.no_grad():
        copy = module.pack_weight(weight.detach())
    setattr(weight, _ATTRIBUTE, (version, copy))
    return copy


def versions(weights: list[torch.Tensor]) -> tuple[int, ...]:
    """The version counters of every parameter ``weights`` were made from (each of a fused
    weight's): what moves when one of them is written in place."""
    return tuple(_version(t) for w in weights for t in _sources(w))


def _sources(weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The parameters a fused weight was joined from, or the weight itself."""
    return getattr(weight, SOURCES, (weight,))


def _version(weight: torch.Tensor) -> int:
    """The weight's version counter (moved by every in-place write); an inference tensor
    keeps none, and its copy is made once."""
    return -1 if weight.is_inference() else weight._version


def forget(weight: torch.Tensor) -> None:
    """Drop ``weight``'s packed copy (its memory goes back when nothing else holds it)."""
    if hasattr(weight, _ATTRIBUTE):
        delattr(weight, _ATTRIBUTE)
