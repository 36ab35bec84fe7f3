"""The "paged" attention backend: every layer attends through the block tables in place.

Where the torch backend gathers each sequence's context into a contiguous copy and then
attends, this one hands the cache, the block tables and the lengths to a paged kernel
(the interface: worker/attention/paged_reference.py): on CUDA the Triton kernel of
worker/attention/paged_triton.py, elsewhere the torch reference. No per-step plan, no
gather buffer, no host-side grouping: the launch depends only on the number of sequences
and the longest query, which is what a captured decode graph needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from worker.attention.base import AttentionHeads
from worker.attention.metadata import AttentionMetadata
from worker.host.step_upload import StepUpload

# Key under which the step's longest query (a host int) is kept in ``backend_plans``.
_PLAN_KEY = "paged"


def paged_kernel(device: torch.device) -> Callable[..., torch.Tensor]:
    """The paged interface's implementation for ``device``: Triton's on CUDA (imported
    here, so ``import`` never needs triton), the torch reference elsewhere."""
    if device.type == "cuda":
        from worker.attention.paged_triton import paged_attention
    else:
        from worker.attention.paged_reference import paged_attention
    return paged_attention


class PagedAttention(AttentionHeads):
    """Attention read from the paged cache through the block tables, with no gathered copy."""

    @staticmethod
    def stage(query_lens: list[int], seq_lens: list[int], upload: StepUpload) -> dict[str, Any]:
        """The step's longest query, for the kernel's launch; nothing to upload (the
        metadata's lengths and tables are all the kernel reads)."""
        return {_PLAN_KEY: max(query_lens, default=0)}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V at ``meta.slot_mapping``, then attend in place.

        Returns ``[T, num_heads * head_dim]`` in the dtype of ``q``."""
        self.write_kv(k, v, k_cache, v_cache, meta)
        longest = meta.backend_plans.get(_PLAN_KEY)
        if longest is None:  # metadata built without the runner's staging (tests, tools)
            longest = meta.backend_plans[_PLAN_KEY] = max(meta.query_lens, default=0)
        out = torch.empty_like(q)
        paged_kernel(q.device)(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                               meta.seq_lens, self.scale, longest, out)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
