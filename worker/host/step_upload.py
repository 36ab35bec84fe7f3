"""A step's host-made inputs, moved to the device in one copy.

Everything a step computes on the host (token ids, positions, slot mapping and block tables;
the attention backend's gather indices; sampling values, penalty tokens and the row subsets
each sampling pass touches) has to reach the device before the kernels that read it. On
CUDA each small tensor moved on its own is a transfer of its own, from pageable memory a
synchronous one: a profiled step made 2 (greedy) to 14 (penalised) of them. Here the
step's producers each ``add`` their arrays before the forward; ``send`` packs them into one
pinned buffer, copies it once, asynchronously, and hands each producer a view of the device
copy. The pinned buffer comes from torch's caching host allocator, which keeps a block from
reuse until the copy that reads it is done, so the next step may fill a buffer while this
one's copy is still in flight.

On the CPU nothing is packed or copied: an added array is its tensor at once. ``pack=True``
packs there too (tests run the device path's layout on the CPU that way).
"""

from __future__ import annotations

import numpy as np
import torch

# What can be packed: 8-byte values, so every part starts aligned in the int64 buffer.
_PACKED = {np.dtype(np.int64): torch.int64, np.dtype(np.float64): torch.float64}


class Staged:
    """One array added to a StepUpload; its tensor on the step's device once the upload is
    sent (on the CPU, at once)."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor | None = None) -> None:
        self._tensor = tensor

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("a staged input was read before its step's upload was sent")
        return self._tensor


class StepUpload:
    """Collects one step's int64 and float64 host arrays; ``send`` moves them at once."""

    def __init__(self, device: torch.device | str, *, pack: bool | None = None) -> None:
        self.device = torch.device(device)
        # Pack (and copy) unless the arrays are already where they are read.
        self.packs = self.device.type != "cpu" if pack is None else pack
        self._parts: list[tuple[Staged, np.ndarray]] = []
        self._size = 0
        self.sent = False
        # Host-to-device copies this upload made: 0 or 1 (tests and the bench read it).
        self.copies = 0

    def add(self, array: np.ndarray | torch.Tensor) -> Staged:
        """Stage ``array`` (int64 or float64, on the host); read it as ``.tensor`` after
        ``send``. The array is read at ``send``: it must not change before then."""
        if self.sent:
            raise RuntimeError("this step's upload was already sent")
        if isinstance(array, torch.Tensor):
            array = array.numpy()
        if array.dtype not in _PACKED:
            raise TypeError(f"only int64 and float64 arrays are staged, not {array.dtype}")
        if not self.packs:
            return Staged(torch.from_numpy(array))
        staged = Staged()
        self._parts.append((staged, array))
        self._size += array.size
        return staged

    def send(self) -> None:
        """Pack every staged array into one (pinned) buffer and copy it to the device once;
        each Staged then holds its view of the copy."""
        if self.sent:
            raise RuntimeError("this step's upload was already sent")
        self.sent = True
        if not self._parts:
            return
        host = torch.empty(self._size, dtype=torch.int64, device="cpu",
                           pin_memory=self.device.type == "cuda")
        flat = host.numpy()
        offset = 0
        for _, array in self._parts:
            flat[offset:offset + array.size] = array.reshape(-1).view(np.int64)
            offset += array.size
        moved = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        self.copies += self.device.type != "cpu"
        offset = 0
        for staged, array in self._parts:
            part = moved[offset:offset + array.size]
            if array.dtype == np.float64:
                part = part.view(torch.float64)
            staged._tensor = part.view(array.shape)
            offset += array.size
        self._parts = []

