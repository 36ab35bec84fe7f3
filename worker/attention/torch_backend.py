"""The reference attention backend: plain torch ops, any device, any float dtype.

Every K/V read goes through a gather of slot indices computed from the block
tables, and every gathered index belongs to the sequence's own context: rows are
padded by repeating the sequence's last real slot, and padded keys are masked with
-inf. Masking alone would not do, because a free slot may hold NaN and
``NaN * 0 = NaN`` would leak through the softmax-weighted sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from worker.attention.base import AttentionHeads
from worker.attention.metadata import AttentionMetadata
from worker.host.step_upload import Staged, StepUpload

# Key under which this backend keeps its per-step plan in `AttentionMetadata.backend_plans`.
_PLAN_KEY = "torch"
# Query rows of a prefill chunk attended at once; bounds the [heads, rows, context] score tensor.
PREFILL_QUERY_TILE = 1024
# Decodes are batched in groups of similar context length, so one long sequence does not pad
# every other one to its length: a group's longest context is at most this many times its
# shortest, unless the group would have fewer than DECODE_GROUP_MIN members.
DECODE_GROUP_SPREAD = 1.5
DECODE_GROUP_MIN = 8


def keep_cudnn_attention_off() -> None:
    """Turn off cuDNN's kernel for ``scaled_dot_product_attention`` in this process (an
    engine on CUDA does, when it is built).

    Torch prefers it for bfloat16 on recent GPUs, but it builds an execution plan for every
    new shape, and a decode's context grows by a token every step, so every call built one
    (docs/gpu.md; figures in docs/benchmarks.md, "On a GPU (H200)"). The flash and
    memory-efficient kernels stay, and the math kernel
    where neither takes the shapes. A switch for the whole process, set once: torch's
    per-call context (``sdpa_kernel``) sets the same process-wide flags on every entry and
    exit, so two engines in one process could leave each other's flags behind.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


@dataclass
class _PrefillPlan:
    """One sequence whose query is longer than a token, attended on its own."""

    # Its new tokens in the flat batch are start:end.
    start: int
    end: int
    # [seq_len] cache slots of its whole context, position order; None for a first chunk
    # that attends to this step's own rows (_make_plan decides), which gathers nothing.
    slots: torch.Tensor | None
    # Tokens already cached before this step.
    context_len: int


@dataclass
class _DecodeGroup:
    """Decode (one-token query) sequences of similar length, attended together."""

    # [Bg] flat-batch index of each sequence's token.
    tokens: torch.Tensor
    # [Bg, max_len] cache slots; past a sequence's length it repeats its last slot.
    slots: torch.Tensor
    # [Bg, max_len] True where the slot is a real context position.
    valid: torch.Tensor


@dataclass
class _KernelDecodes:
    """Every decode of the step, attended by the CPU kernel straight from the cache."""

    # [Bd] flat-batch index of each sequence's token.
    tokens: torch.Tensor
    # [Bd, width] block tables and [Bd] context lengths of those sequences.
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    # The compiled kernel, looked up once per step rather than once per layer.
    kernel: Callable[..., torch.Tensor]


@dataclass
class _StepPlan:
    """Gather indices and masks derived once per step and reused by every layer."""

    decodes: list[_DecodeGroup]
    prefills: list[_PrefillPlan]
    kernel_decodes: _KernelDecodes | None = None
    # K and V gather buffers, made on first use and reused by every layer of the step:
    # writing into them avoids faulting in fresh pages for each large gather.
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def gather(
        self, flat_k: torch.Tensor, flat_v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows at ``slots [B, L]`` as ``[B, L, Hkv, D]`` views of the step's buffers."""
        if self.buffers is None:
            rows = max([g.slots.numel() for g in self.decodes]
                       + [p.slots.numel() for p in self.prefills if p.slots is not None])
            self.buffers = (
                flat_k.new_empty(rows, *flat_k.shape[1:]),
                flat_v.new_empty(rows, *flat_v.shape[1:]),
            )
        index, rows = slots.reshape(-1), slots.numel()
        k = torch.index_select(flat_k, 0, index, out=self.buffers[0][:rows])
        v = torch.index_select(flat_v, 0, index, out=self.buffers[1][:rows])
        return k.view(*slots.shape, *flat_k.shape[1:]), v.view(*slots.shape, *flat_v.shape[1:])


class TorchAttention(AttentionHeads):
    """Paged attention with torch gathers and fused scaled-dot-product attention."""

    @staticmethod
    def stage(query_lens: list[int], seq_lens: list[int], upload: StepUpload) -> dict[str, Any]:
        """The host half of the step's plan, its indices added to ``upload`` (the step's
        one copy), for ``AttentionMetadata.backend_plans``; the first layer finishes it.
        Only where the upload packs (a device): on the CPU the first layer makes the whole
        plan, and decides there whether the CPU decode kernel takes the decodes."""
        if not upload.packs:
            return {}
        return {_PLAN_KEY: _layout(query_lens, seq_lens, upload, by_kernel=False)}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V at ``meta.slot_mapping``, then attend.

        Returns ``[T, num_heads * head_dim]`` in the dtype of `q`.
        """
        flat_k, flat_v, k, v = self.write_kv(k, v, k_cache, v_cache, meta)
        plan = meta.backend_plans.get(_PLAN_KEY)
        if not isinstance(plan, _StepPlan):  # none yet, or the host half staged (stage)
            plan = meta.backend_plans[_PLAN_KEY] = _make_plan(
                meta, q.device, _decode_kernel(q, flat_k) if plan is None else None, plan)
        out = torch.empty_like(q)
        if plan.kernel_decodes is not None:
            rows = plan.kernel_decodes
            out[rows.tokens] = rows.kernel(
                q[rows.tokens], flat_k, flat_v, rows.block_tables, rows.seq_lens,
                meta.block_size, self.scale)
        for group in plan.decodes:
            self._decode(q, flat_k, flat_v, plan, group, out)
        for prefill in plan.prefills:
            if prefill.slots is None:
                self._first_chunk(q, k, v, prefill, out)
            else:
                self._prefill(q, flat_k, flat_v, plan, prefill, out)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        plan: _StepPlan,
        group: _DecodeGroup,
        out: torch.Tensor,
    ) -> None:
        """One group of one-token queries at once: one padded gather, batched matmuls."""
        keys, values = plan.gather(flat_k, flat_v, group.slots)
        queries = q[group.tokens].unsqueeze(1)
        attended = self._attend(queries, keys, values, group.valid[:, None, :])
        out[group.tokens] = attended[:, 0]

    def _first_chunk(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        prefill: _PrefillPlan,
        out: torch.Tensor,
    ) -> None:
        """A sequence's first chunk (nothing cached before it) attends only to itself.

        Its keys and values are this step's own rows (``k``/``v`` as the cache holds them),
        so no gather; and its mask is the plain causal one, which the fused kernel skips
        block by block instead of reading an [L, L] mask (up to ~2x faster at 800 tokens,
        the same bits).
        """
        rows = slice(prefill.start, prefill.end)
        out[rows] = self._attend(q[rows].unsqueeze(0), k[rows].unsqueeze(0),
                                 v[rows].unsqueeze(0), None)[0]

    def _prefill(
        self,
        q: torch.Tensor,
        flat_k: torch.Tensor,
        flat_v: torch.Tensor,
        plan: _StepPlan,
        prefill: _PrefillPlan,
        out: torch.Tensor,
    ) -> None:
        """One multi-token query over its context, in tiles of query rows."""
        assert prefill.slots is not None  # _make_plan gives every gathering prefill its slots
        keys, values = plan.gather(flat_k, flat_v, prefill.slots[None, :])
        key_pos = torch.arange(prefill.slots.numel(), device=q.device)
        for first in range(prefill.start, prefill.end, PREFILL_QUERY_TILE):
            rows = slice(first, min(first + PREFILL_QUERY_TILE, prefill.end))
            # Flat row r holds the token at absolute position context_len + (r - start).
            offset = prefill.context_len - prefill.start
            query_pos = torch.arange(rows.start + offset, rows.stop + offset, device=q.device)
            causal = key_pos[None, :] <= query_pos[:, None]
            out[rows] = self._attend(q[rows].unsqueeze(0), keys, values, causal.unsqueeze(0))[0]

    def _attend(
        self,
        q: torch.Tensor,  # [B, Lq, H, D]
        k: torch.Tensor,  # [B, Lk, Hkv, D]
        v: torch.Tensor,  # [B, Lk, Hkv, D]
        allowed: torch.Tensor | None,  # [B, Lq, Lk] bool; None: causal, Lq == Lk
    ) -> torch.Tensor:  # [B, Lq, H, D]
        """Grouped-query attention in one fused call for every head of every sequence.

        On the CPU ``scaled_dot_product_attention``'s grouped-query mode reads K and V as
        head-major strided views of the gathered rows (no copy) and maps query head h to KV
        head h // groups, transformers' repeat_kv order. On CUDA the kernel that takes a
        mask has no such mode: see ``attend_by_kv_head``. Masked keys hold real (repeated)
        context rows, never NaN.
        """
        dtype = q.dtype
        q, k, v = q.transpose(1, 2), k.to(dtype).transpose(1, 2), v.to(dtype).transpose(1, 2)
        if q.device.type == "cuda":
            return attend_by_kv_head(q, k, v, allowed, self.scale).transpose(1, 2)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if allowed is None else allowed[:, None],
            is_causal=allowed is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return attended.transpose(1, 2)


def attend_by_kv_head(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      allowed: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention for kernels without a grouped-query mode (CUDA's
    memory-efficient one, the fused kernel that takes a mask): ``q`` [B, H, Lq, D],
    ``k``/``v`` [B, Hkv, Lk, D], ``allowed`` [B, Lq, Lk] bool or None for causal (Lq == Lk);
    returns [B, H, Lq, D], query head h reading KV head h // (H / Hkv).

    Masked: each KV head's queries stacked (``grouped_query_attention``), no copy of K or V.
    Causal: a first chunk attends to its own rows (at most a query tile), so its KV heads
    are repeated, in transformers' order, and the kernel's own causal mask kept."""
    if allowed is not None:
        return grouped_query_attention(q, k, v, allowed, scale)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = (x[:, :, None].expand(-1, -1, groups, -1, -1).flatten(1, 2) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked grouped-query attention with no copy of K or V per query head.

    ``q`` [B, H, Lq, D], ``k``/``v`` [B, Hkv, Lk, D], ``allowed`` [B, Lq, Lk] bool; returns
    [B, H, Lq, D]. Query head h reads KV head h // (H / Hkv), transformers' order. The
    queries of one KV head go along the query axis (Lq x groups rows over that head's keys,
    each with its own row of the mask), so a kernel without a grouped-query mode reads each
    KV head as it is. Repeating the KV heads instead would copy the step's gathered context
    once per query head of a group: at 64 sequences of 4,096 tokens with 32 query and 8 KV
    heads of 128 in bfloat16, 4 GiB of repeated K and V in every layer where the gathered
    rows take 1 GiB.
    """
    batch, heads, lq, dim = q.shape
    kv_heads, lk = k.shape[1], k.shape[2]
    groups = heads // kv_heads
    stacked = q.reshape(batch, kv_heads, groups * lq, dim)
    mask = allowed[:, None, None].expand(batch, 1, groups, lq, lk).reshape(
        batch, 1, groups * lq, lk)
    out = F.scaled_dot_product_attention(stacked, k, v, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, lq, dim)  # the fused kernels may lay it out [B, L, H, D]


def _decode_kernel(q: torch.Tensor, flat_k: torch.Tensor):
    """The CPU decode kernel where it applies (CPU tensors, float32 or float64, cache and
    queries of one dtype, the kernel built and not switched off), else None."""
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) \
            or flat_k.dtype != q.dtype:
        return None
    from worker.host.cpu_kernels import paged_decode_kernel

    return paged_decode_kernel()


@dataclass
class _PlanLayout:
    """The host half of a step's plan: which sequences prefill (and which of those gather
    their context), how the decodes group, and the indices all that needs, added to the
    step's upload."""

    prefills: list[_PrefillPlan]
    # (index in prefills, batch row) of each prefill that gathers its context.
    gathering: list[tuple[int, int]]
    # Every decode goes to the CPU kernel (its rows), or to the torch groups (theirs).
    by_kernel: bool
    grouped: list[list[int]]
    # The gathering prefills' rows and lengths, then each group's rows, lengths and tokens
    # (by_kernel: the decode rows alone).
    staged: list[Staged]


def _layout(query_lens: list[int], seq_lens: list[int], upload: StepUpload,
            by_kernel: bool) -> _PlanLayout:
    """Split the step into batched decodes and per-sequence prefills, from the host-side
    lengths (no device sync), and add the indices they need to ``upload``."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    prefills, gathering = [], []
    for i, n in enumerate(query_lens):
        if n > 1:
            seq_len = seq_lens[i]
            # A first chunk (nothing cached before it) that fits one query tile attends to
            # its own rows in one causal call (TorchAttention._first_chunk): no slots.
            if not (seq_len == n and n <= PREFILL_QUERY_TILE):
                gathering.append((len(prefills), i))
            prefills.append(_PrefillPlan(starts[i], starts[i + 1], None, seq_len - n))
    decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
    by_kernel = by_kernel and bool(decode_rows)
    grouped = [] if by_kernel else _group_by_length(decode_rows, seq_lens)
    host = [[i for _, i in gathering], [seq_lens[i] for _, i in gathering]] if gathering else []
    if by_kernel:
        host.append(decode_rows)
    for rows in grouped:
        host += [rows, [seq_lens[i] for i in rows], [starts[i] for i in rows]]
    staged = [upload.add(np.array(a, dtype=np.int64)) for a in host]
    return _PlanLayout(prefills, gathering, by_kernel, grouped, staged)


def _make_plan(meta: AttentionMetadata, device: torch.device,
               kernel: Callable[..., torch.Tensor] | None = None,
               layout: _PlanLayout | None = None) -> _StepPlan:
    """The step's plan: batched decodes (for the CPU kernel, only their tables and lengths)
    and per-sequence prefills, with their gather indices.

    ``layout``: the host half, staged in the step's upload (TorchAttention.stage); without
    it the layout is made here and its indices moved in one copy of their own. Either way,
    no index goes to the device on its own: on CUDA a copy per small tensor would be a
    transfer each."""
    if layout is None:
        upload = StepUpload(device)
        layout = _layout(meta.query_lens, meta.seq_lens_list, upload, kernel is not None)
        upload.send()
    on_device = [s.tensor for s in layout.staged]
    block_tables = meta.block_tables.to(device)
    prefills = layout.prefills
    if layout.gathering:
        tables = block_tables.index_select(0, on_device[0])
        for k, (j, i) in enumerate(layout.gathering):
            prefills[j].slots = _context_slots(tables[k, None], on_device[1][k, None],
                                               meta.seq_lens_list[i], meta.block_size)[0]
        on_device = on_device[2:]
    if layout.by_kernel:
        assert kernel is not None, "a layout for the CPU decode kernel, without the kernel"
        index = on_device[0]
        return _StepPlan([], prefills, _KernelDecodes(
            tokens=meta.query_start_loc[:-1].index_select(0, index),
            block_tables=block_tables.index_select(0, index),
            seq_lens=meta.seq_lens.to(device).index_select(0, index), kernel=kernel))
    groups = []
    for g, rows in enumerate(layout.grouped):
        rows_t, lens_t, tokens = on_device[3 * g:3 * g + 3]
        slots = _context_slots(block_tables.index_select(0, rows_t), lens_t,
                               max(meta.seq_lens_list[i] for i in rows), meta.block_size)
        valid = torch.arange(slots.shape[1], device=device)[None, :] < lens_t[:, None]
        groups.append(_DecodeGroup(tokens, slots, valid))
    return _StepPlan(groups, prefills)


def _group_by_length(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Split decode rows into groups of similar context length (see DECODE_GROUP_SPREAD)."""
    groups: list[list[int]] = []
    for i in sorted(rows, key=lambda r: seq_lens[r]):
        current = groups[-1] if groups else None
        if (current is None or (seq_lens[i] > DECODE_GROUP_SPREAD * seq_lens[current[0]]
                                and len(current) >= DECODE_GROUP_MIN)):
            groups.append([i])
        else:
            current.append(i)
    return groups


def _context_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, width: int, block_size: int
) -> torch.Tensor:
    """``[B, width]`` cache slots of context positions, ``width`` the longest of ``seq_lens``
    (on the tables' device); short rows repeat their last slot.

    Clamping the position (not the slot) keeps every index inside the sequence's own
    blocks, so padded block-table entries are never even looked at.
    """
    device = block_tables.device
    last = seq_lens - 1
    pos = torch.minimum(torch.arange(width, device=device)[None, :], last[:, None])
    blocks = block_tables.gather(1, pos // block_size)
    return blocks * block_size + pos % block_size
