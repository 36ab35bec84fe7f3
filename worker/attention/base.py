"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from worker.attention.metadata import AttentionMetadata
from worker.host.step_upload import StepUpload


class AttentionBackend(Protocol):
    """Writes this step's K/V into the paged cache, then attends over it.

    Backends read K/V only through the block tables and slot mapping in
    ``meta``: a cache slot that is not part of a sequence's context is never
    read, whatever it holds (free blocks may be full of NaN).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None: ...

    @staticmethod
    def stage(query_lens: list[int], seq_lens: list[int], upload: StepUpload) -> dict[str, Any]:
        """Before the forward: whatever the backend derives from the step's host-side
        lengths, its indices added to ``upload`` (the step's one host-to-device copy), as
        entries for ``AttentionMetadata.backend_plans``. Every layer's ``forward`` sees
        them there once the upload is sent."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # same shape as k_cache
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        ...


class AttentionHeads:
    """What every backend shares: the head layout, checked once, and the write of a step's
    K/V into the paged cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{num_heads} query heads cannot be grouped over {num_kv_heads} kv heads"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write this step's K/V at ``meta.slot_mapping``; returns the cache as flat
        ``[slots, num_kv_heads, head_dim]`` views and ``k``, ``v`` as the cache holds them."""
        flat_k = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat_v = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k, v = k.to(flat_k.dtype), v.to(flat_v.dtype)
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)
        return flat_k, flat_v, k, v
