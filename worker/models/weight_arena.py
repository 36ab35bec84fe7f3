"""A CPU model's parameters in one buffer: on huge pages, and with each layer's q/k/v and
gate/up projections back to back, so that each group is also one matrix.

A decode step streams every weight once (~110 MB on the small preset, more than the last-level
cache): in one buffer on 2 MiB pages (kvstore/huge_pages.py) the matmuls spend less on page
walks. And where q, k and v lie back to back, ``joined`` sees them as one [q + k + v, hidden]
matrix, a view that costs no memory: the native decode step (csrc/decode_layers.cpp) makes
one matmul of the three and one of gate and up, fewer and wider calls. The parameters stay
what they were (same names, shapes, state dict); only where their bytes live changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvstore.huge_pages import zeroed_buffer

# Each group starts on a cache line.
ALIGN_BYTES = 64


def fused_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters that must lie back to back: per layer q/k/v weights, their biases,
    gate/up weights and their biases (a bias group only where every projection has one)."""
    groups = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for projections in ((attn.q_proj, attn.k_proj, attn.v_proj),
                            (mlp.gate_proj, mlp.up_proj)):
            groups.append([p.weight for p in projections])
            biases = [p.bias for p in projections if p.bias is not None]
            if len(biases) == len(projections):
                groups.append(biases)
    return groups


def place_in_arena(model: nn.Module) -> int:
    """Move every parameter of a CPU model (all of one dtype) into one zeroed buffer, the
    fused groups back to back; returns the buffer's size in bytes. Call it before the
    parameters are filled: their values are not kept."""
    params = list(model.parameters())  # a tied parameter once
    dtype = params[0].dtype
    if any(p.device.type != "cpu" or p.dtype != dtype for p in params):
        raise ValueError("an arena holds CPU parameters of one dtype")
    groups = fused_groups(model)
    grouped = {id(p) for g in groups for p in g}
    groups += [[p] for p in params if id(p) not in grouped]
    item = dtype.itemsize
    offsets, end = [], 0
    for group in groups:
        end = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        offsets.append(end // item)
        end += sum(p.numel() for p in group) * item
    arena = torch.frombuffer(zeroed_buffer(max(end, item)), dtype=dtype)
    with torch.no_grad():
        for group, start in zip(groups, offsets, strict=True):
            for p in group:
                p.data = arena[start:start + p.numel()].view(p.shape)
                start += p.numel()
    return end


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors (of one dtype and trailing shape) as one, stacked along dim 0, where
    they lie back to back in one storage (place_in_arena lays them out so): a view, no
    copy. None where they do not."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
               and t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
