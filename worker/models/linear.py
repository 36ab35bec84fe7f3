"""The matmul of every projection and of the LM head: ``y = x @ weight.T (+ bias)``.

On a CPU in float32, where the kernels are built (worker/host/cpu_kernels.py), it is the
kernels' ``linear`` (csrc/linear.h): given a packed copy of the weight
(worker/models/packed_weights.py), the packed kernel for up to 192 rows; else the skinny
kernel for up to 12 rows; oneDNN's matmul past that; all faster here than the BLAS
``F.linear`` calls (docs/cpu-kernels.md, "Matmuls"). The results agree with
``F.linear``'s to float32 rounding (another order of additions). ``CONVEYOR_CPU_MATMUL=blas``
keeps every matmul on ``F.linear`` (to compare), ``CONVEYOR_CPU_MATMUL=unpacked`` makes no
packed copies; anything else, and anything autograd must differentiate, runs ``F.linear``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from producer import settings

# What the kernels take for "no bias" (on the CPU, where they run).
NO_BIAS = torch.empty(0, device="cpu")


def blas_only() -> bool:
    """Whether ``CONVEYOR_CPU_MATMUL=blas`` keeps the CPU matmuls on the BLAS."""
    return settings.cpu_matmul() == "blas"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``; ``packed`` is the weight's packed copy where it has one."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and (bias is None or bias.dtype == torch.float32) and not blas_only()
            and not _needs_grad(x, weight, bias)):
        from worker.host.cpu_kernels import cpu_kernels

        module = cpu_kernels()
        if module is not None:
            return module.linear(x, weight, NO_BIAS if bias is None else bias, False,
                                 NO_BIAS if packed is None else packed)
    return F.linear(x, weight, bias)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd must see this matmul: the kernels have no backward (serving runs
    under inference mode, where this is never so)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose matmul is :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
