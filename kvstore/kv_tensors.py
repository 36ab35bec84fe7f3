"""The paged K/V tensors themselves: the only module of kvstore that touches torch."""

from __future__ import annotations

import contextlib

import torch


class PagedKVCache:
    """Per-layer K and V pools of ``num_blocks x block_size`` token slots.

    Layout per layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``
    (token-major inside a block), the layout flashinfer calls NHD.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
                  for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
                  for _ in range(num_layers)]

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def fill_(self, value: float) -> None:
        """Fill every slot (tests fill free blocks with NaN to prove they are never read)."""
        for t in (*self.k, *self.v):
            t.fill_(value)

    def fill_blocks_(self, block_ids: list[int], value: float) -> None:
        """Fill the given blocks in every layer."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.k[0].device)
        for t in (*self.k, *self.v):
            t.index_fill_(0, idx, value)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers, K and V together."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def copy_blocks(src: PagedKVCache, dst: PagedKVCache, pairs: list[tuple[int, int]],
                stream: torch.cuda.Stream | None = None) -> None:
    """Copy whole blocks ``src_id -> dst_id`` in every layer: one gather and one scatter each.

    Swaps decided in one step are batched into a single call. On CUDA the copies run on
    ``stream`` (a side stream); the caller makes the compute stream wait for it.
    """
    if not pairs:
        return
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src.k[0].device)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst.k[0].device)
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with ctx:
        for s, d in ((src.k, dst.k), (src.v, dst.v)):
            for layer in range(len(s)):
                blocks = s[layer].index_select(0, src_ids)
                d[layer].index_copy_(0, dst_ids, blocks.to(d[layer].device, non_blocking=True))


