"""What an attention backend needs to know about one step's flat ragged batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flat batch, shared by every layer.

    The batch holds B sequences whose new tokens are laid end to end (T tokens in
    all, no padding). Sequence i owns query tokens
    ``query_start_loc[i]:query_start_loc[i + 1]``; they sit at the end of its
    context, so its first ``context_lens[i]`` tokens are already in the cache.
    """

    # [B + 1] int64: offsets of each sequence's new tokens in the flat batch.
    query_start_loc: torch.Tensor
    # [B] int64: tokens in the cache after this step's writes (context + new).
    seq_lens: torch.Tensor
    # [B, max_blocks] int64: physical block ids, in order; entries past a
    # sequence's last block are padding and must never be read.
    block_tables: torch.Tensor
    # [T] int64: flat cache slot (block_id * block_size + offset) for each new token.
    slot_mapping: torch.Tensor
    block_size: int
    # The same lengths as plain ints, so backends can loop without syncing a device.
    query_lens: list[int]
    seq_lens_list: list[int]
    # [T] int64: the absolute position of each new token (what rope needs).
    positions: torch.Tensor | None = None
    # [T] int64: the step's token ids, when the caller had them laid out with the rest.
    input_ids: torch.Tensor | None = None
    # Scratch space where a backend keeps work it derives once per step and reuses in
    # every layer (gather indices, masks), keyed by backend name.
    backend_plans: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Lay out one step from per-sequence lengths and block tables.

        Sequence i brings ``query_lens[i]`` new tokens at positions
        ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``; ``block_tables[i]``
        must hold at least ``ceil(seq_lens[i] / block_size)`` blocks. Rows of the
        padded block table tensor are filled with 0 past their last block.
        """
        if not len(query_lens) == len(seq_lens) == len(block_tables):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per sequence"
            )
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 0 < q_len <= s_len:
                raise ValueError(f"need 0 < query_len <= seq_len, got {q_len} and {s_len}")
            if len(table) * block_size < s_len:
                raise ValueError(f"{len(table)} blocks of {block_size} cannot hold {s_len} tokens")
        widths = [len(t) for t in block_tables]
        width = max(widths, default=0)
        flat = torch.tensor(list(itertools.chain.from_iterable(block_tables)),
                            dtype=torch.int64, device="cpu")
        padded = torch.zeros(len(block_tables), width, dtype=torch.int64, device="cpu")
        lens = torch.tensor(widths, dtype=torch.int64, device="cpu")
        padded[torch.arange(width, device="cpu")[None, :] < lens[:, None]] = flat
        return cls.from_block_tables(query_lens, seq_lens, padded, block_size, device)

    @classmethod
    def from_block_tables(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        device: torch.device | str = "cpu",
        input_ids: list[int] | None = None,
    ) -> AttentionMetadata:
        """Lay out one step from a host ``[B, width]`` block-table tensor whose row i holds
        sequence i's blocks first (what follows them is never read). Unchecked: the
        runner's persistent rows (worker.block_table_rows) call this every step."""
        # Per sequence on the host (B numbers), per token by vectorised ops (T numbers):
        # no Python loop over tokens or block-table entries. The arithmetic is numpy's on
        # views of the same memory: at a few hundred entries torch's per-op dispatch would
        # cost more than the work (tens of microseconds an op against a few).
        num_seqs, num_tokens = len(query_lens), sum(query_lens)
        s_lens = np.array(seq_lens, dtype=np.int64)
        tables = block_tables.numpy()
        if num_tokens == num_seqs:
            # Decodes only (the steady state): token i is sequence i's newest.
            starts = np.arange(num_seqs + 1, dtype=np.int64)
            positions = s_lens - 1
            owner = starts[:-1]
        else:
            q_lens = np.array(query_lens, dtype=np.int64)
            starts = np.zeros(num_seqs + 1, dtype=np.int64)
            np.cumsum(q_lens, out=starts[1:])
            # Token t of sequence i sits at position seq_len - query_len + (t - start of i).
            owner = np.repeat(np.arange(num_seqs, dtype=np.int64), q_lens)
            positions = (s_lens - q_lens)[owner] + np.arange(num_tokens, dtype=np.int64) \
                - starts[:-1][owner]
        block_index, offset = np.divmod(positions, block_size)
        slots = tables[owner, block_index] * block_size + offset
        arrays = [starts, s_lens, slots, positions]
        if input_ids is not None:  # the step's tokens ride along in the same copy
            arrays.append(np.array(input_ids, dtype=np.int64))
        parts = [torch.from_numpy(a) for a in arrays]
        parts.insert(2, block_tables)
        on_device = to_device_at_once(parts, device)
        return cls(
            query_start_loc=on_device[0],
            seq_lens=on_device[1],
            block_tables=on_device[2],
            slot_mapping=on_device[3],
            block_size=block_size,
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            positions=on_device[4],
            input_ids=on_device[5] if input_ids is not None else None,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))

    @property
    def context_lens(self) -> list[int]:
        """Tokens of each sequence already in the cache before this step."""
        return [s - q for s, q in zip(self.seq_lens_list, self.query_lens, strict=True)]


def to_device_at_once(parts: list[torch.Tensor],
                      device: torch.device | str) -> list[torch.Tensor]:
    """The int64 host tensors ``parts`` on ``device``, in one host-to-device copy: packed
    into one (pinned) buffer, copied once, and split into views there."""
    if torch.device(device).type == "cpu":
        return parts
    flat = torch.cat([p.reshape(-1) for p in parts])
    if torch.cuda.is_available():
        flat = flat.pin_memory()
    moved = flat.to(device, non_blocking=True)
    out, offset = [], 0
    for p in parts:
        out.append(moved[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return out
