"""The paged K/V tensors themselves: the only module of kvstore that touches torch."""

from __future__ import annotations

import math

import torch

from kvstore.huge_pages import HUGE_PAGE, zeroed_buffer


class PagedKVCache:
    """Per-layer K and V pools of ``num_blocks x block_size`` token slots.

    Layout per layer is ``[num_blocks + spare_blocks, block_size, num_kv_heads, head_dim]``
    (token-major inside a block), the layout flashinfer calls NHD. Spare blocks follow the
    pool's and no pool hands them out: a captured decode graph's padded rows write their
    K/V there (worker/models/decode_graphs.py), where nothing reads it.
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
        untouched: bool = False,
        spare_blocks: int = 0,
    ) -> None:
        shape = (num_blocks + spare_blocks, block_size, num_kv_heads, head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        make = _untouched if untouched and not pin_memory else _zeros
        self.k = [make(shape, dtype, device, pin_memory) for _ in range(num_layers)]
        self.v = [make(shape, dtype, device, pin_memory) for _ in range(num_layers)]

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
        itemsize = dtype.itemsize
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
           pin_memory: bool) -> torch.Tensor:
    """A zeroed pool; in pageable CPU memory, on huge pages where the OS grants them
    (kvstore/huge_pages.py says why). Its pages are faulted in here, at start-up, as
    ``torch.zeros`` does: a machine that cannot hold the pool fails now, not mid-step."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or pin_memory or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    return torch.frombuffer(zeroed_buffer(nbytes), dtype=dtype).view(shape).zero_()


def _untouched(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
               pin_memory: bool) -> torch.Tensor:
    """A pool whose memory is reserved, not touched: its pages come as blocks are first
    written. For a pool whose blocks are always written before they are read (the swap
    tier); faulting in gigabytes at start-up would only delay it (a fresh page costs most on
    a VM, seconds for 0.5 GiB). Where the OS does not overcommit, a pool that cannot fit
    still fails here."""
    return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)


def copy_blocks(src: PagedKVCache, dst: PagedKVCache, pairs: list[tuple[int, int]],
                stream: torch.cuda.Stream | None = None) -> None:
    """Copy whole blocks ``src_id -> dst_id`` in every layer: one gather and one scatter each.

    Swaps decided in one step are batched into a single call. On CUDA (``stream``: a side
    stream) the copies go through pinned staging buffers: device to host, the host waits
    for the copies to finish before it reads the buffers; host to device, the copies are
    queued on ``stream`` and the caller makes the compute stream wait for it.
    """
    if not pairs:
        return
    src_ids = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src.k[0].device)
    dst_ids = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst.k[0].device)
    layers = [*zip(src.k, dst.k, strict=True), *zip(src.v, dst.v, strict=True)]
    if stream is None:  # one device (the CPU): plain gathers and scatters
        for s, d in layers:
            d.index_copy_(0, dst_ids, s.index_select(0, src_ids))
        return
    gpu = src.k[0].device if src.k[0].device.type == "cuda" else dst.k[0].device
    # The source blocks may still be being written by the compute stream's last forward.
    stream.wait_stream(torch.cuda.current_stream(gpu))
    with torch.cuda.stream(stream):
        if dst.k[0].device.type == "cpu":
            _device_to_host(layers, src_ids, dst_ids, stream)
        else:
            for s, d in layers:
                staged = _pinned_like(s, len(pairs))
                torch.index_select(s, 0, src_ids, out=staged)
                # The pinned allocator keeps ``staged`` alive until this copy has run.
                d.index_copy_(0, dst_ids, staged.to(d.device, non_blocking=True))


def _device_to_host(layers: list[tuple[torch.Tensor, torch.Tensor]], src_ids: torch.Tensor,
                    dst_ids: torch.Tensor, stream: torch.cuda.Stream) -> None:
    staged = []
    for s, d in layers:
        buffer = _pinned_like(s, src_ids.numel())
        buffer.copy_(s.index_select(0, src_ids), non_blocking=True)
        staged.append((d, buffer))
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # the host reads the buffers only once every copy has landed
    for d, buffer in staged:
        d.index_copy_(0, dst_ids, buffer)


def _pinned_like(pool: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return torch.empty((num_blocks, *pool.shape[1:]), dtype=pool.dtype, device="cpu",
                       pin_memory=True)


# ----- the bytes of whole blocks, for the fleet KV tier (kvstore/tier) -----


def block_layout(cache: PagedKVCache, fingerprint: str):
    """The tier's description of this cache's blocks (kvstore.tier.BlockLayout)."""
    from kvstore.tier.header import BlockLayout

    k = cache.k[0]
    return BlockLayout(fingerprint=fingerprint, dtype=str(k.dtype).removeprefix("torch."),
                       block_size=cache.block_size, num_layers=cache.num_layers,
                       num_kv_heads=k.shape[2], head_dim=k.shape[3], itemsize=k.element_size())


def export_blocks(cache: PagedKVCache, block_ids: list[int]) -> bytes:
    """The raw bytes of ``block_ids`` in order: K of every layer, then V of every layer,
    each ``[len(block_ids), block_size, kv_heads, head_dim]`` (BlockLayout.layout). Copied
    to the host and finished before the bytes are read."""
    if not block_ids:
        return b""
    device = cache.k[0].device
    ids = torch.tensor(block_ids, dtype=torch.long, device=device)
    parts = [t.index_select(0, ids) for t in (*cache.k, *cache.v)]
    flat = torch.cat([p.reshape(-1) for p in parts]).to("cpu")  # synchronous on CUDA
    return flat.view(torch.uint8).numpy().tobytes()


def import_blocks(cache: PagedKVCache, block_ids: list[int], payload: bytes) -> None:
    """Write bytes made by :func:`export_blocks` (same layout, checked by the caller) into
    ``block_ids`` of ``cache``."""
    if not block_ids:
        return
    k0 = cache.k[0]
    per_layer = len(block_ids) * k0[0].numel()
    expected = 2 * cache.num_layers * per_layer * k0.element_size()
    if len(payload) != expected:
        raise ValueError(f"{len(payload)} bytes for {len(block_ids)} blocks, expected {expected}")
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(k0.dtype)
    ids = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    shape = (len(block_ids), *k0.shape[1:])
    for i, t in enumerate((*cache.k, *cache.v)):
        part = flat[i * per_layer:(i + 1) * per_layer].view(shape)
        t.index_copy_(0, ids, part.to(t.device))
