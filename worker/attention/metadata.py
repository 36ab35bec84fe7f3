"""What an attention backend needs to know about one step's flat ragged batch."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from worker.host.step_upload import Staged, StepUpload


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
        sequence i's blocks first (what follows them is never read), moved to ``device``
        in one copy. Unchecked (see ``stage``)."""
        upload = StepUpload(device)
        layout = cls.stage(query_lens, seq_lens, block_tables, block_size, upload, input_ids)
        upload.send()
        return layout.metadata()

    @staticmethod
    def stage(
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        upload: StepUpload,
        input_ids: list[int] | None = None,
    ) -> StagedLayout:
        """The step's layout computed on the host and added to ``upload`` (the runner's one
        copy of the step); ``.metadata()`` once it is sent. Unchecked: the runner's
        persistent rows (worker.engine.block_table_rows) call this every step."""
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
        return StagedLayout(
            query_start_loc=upload.add(starts), seq_lens=upload.add(s_lens),
            block_tables=upload.add(tables), slot_mapping=upload.add(slots),
            positions=upload.add(positions),
            # The step's tokens ride along in the same copy.
            input_ids=(None if input_ids is None
                       else upload.add(np.array(input_ids, dtype=np.int64))),
            block_size=block_size, query_lens=list(query_lens), seq_lens_list=list(seq_lens))

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


@dataclass
class StagedLayout:
    """A step's layout added to its upload: AttentionMetadata once the upload is sent."""

    query_start_loc: Staged
    seq_lens: Staged
    block_tables: Staged
    slot_mapping: Staged
    positions: Staged
    input_ids: Staged | None
    block_size: int
    query_lens: list[int]
    seq_lens_list: list[int]

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc.tensor,
            seq_lens=self.seq_lens.tensor,
            block_tables=self.block_tables.tensor,
            slot_mapping=self.slot_mapping.tensor,
            block_size=self.block_size,
            query_lens=self.query_lens,
            seq_lens_list=self.seq_lens_list,
            positions=self.positions.tensor,
            input_ids=None if self.input_ids is None else self.input_ids.tensor,
        )
