"""Packed copies of the weights a CPU decode step multiplies by (csrc/packed_linear.h).

A decode step's matmuls read every projection weight once per step for a few dozen rows of
activations. From W laid out in panels of 32 transposed rows, the kernel streams each panel
once and keeps its partial sums in registers, at 0.3-0.7x the time of the skinny kernel and
0.84-0.95x oneDNN's at 1 to 192 rows here; and its panels go to the threads as they free
up, so a core lost to another process mid-matmul stalls nothing (the worker shares its
cores with its I/O threads, Redis and clients).

The price is memory: a packed copy of each matrix it serves, the decoder layers' fused
q/k/v, o, gate/up and down weights and the LM head, about as much again as the model's
float32 weights. ``CONVEYOR_CPU_MATMUL=unpacked`` makes none (the matmuls are then the
skinny kernel's and oneDNN's, as worker/models/linear.py says); so does
``CONVEYOR_CPU_MATMUL=blas``. A copy is made at its weight's first use in a step and made
again if the weight is written in place or given new data afterwards.
"""

from __future__ import annotations

import os

import torch

from worker.models.linear import ENV_SWITCH, blas_only

# The attribute of a weight tensor that holds its packed copy (so the copy lives as long as
# the weight), under what it was packed from: the weight's version and the address of its
# data (a model moved or cast in place gets new data, not a new version). Not a dict keyed
# by tensors: tensors compare element by element.
_ATTRIBUTE = "_conveyor_packed"



def enabled() -> bool:
    """Whether decode matmuls take packed copies (not with ``CONVEYOR_CPU_MATMUL`` set to
    ``unpacked`` or ``blas``)."""
    return not blas_only() and os.environ.get(ENV_SWITCH, "").strip().lower() != "unpacked"


def packed(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of ``weight [N, K]`` (made now if it has none, or if the weight was
    written since), or None where packing does not apply: not float32 on the CPU, switched
    off, or the kernels are not built."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not enabled()):
        return None
    entry = getattr(weight, _ATTRIBUTE, None)
    version = (_version(weight), weight.data_ptr())
    if entry is not None and entry[0] == version:
        return entry[1]
    from worker.cpu_kernels import cpu_kernels

    module = cpu_kernels()
    if module is None:
        return None
    with torch.inference_mode(False), torch.no_grad():
        copy = module.pack_weight(weight.detach())
    setattr(weight, _ATTRIBUTE, (version, copy))
    return copy


def _version(weight: torch.Tensor) -> int:
    """The weight's version counter (moved by every in-place write); an inference tensor
    keeps none, and its copy is made once."""
    return -1 if weight.is_inference() else weight._version


def forget(weight: torch.Tensor) -> None:
    """Drop ``weight``'s packed copy (its memory goes back when nothing else holds it)."""
    if hasattr(weight, _ATTRIBUTE):
        delattr(weight, _ATTRIBUTE)
