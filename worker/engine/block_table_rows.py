"""Block tables that live across steps: one preallocated row per running request.

Rebuilding every block table from Python lists each step costs time in proportion to
the context of every running request. Here a request keeps its row from admission to
its end; a step writes only what the scheduler changed (the blocks a request gained,
or a whole new table after admission, swap-in or recomputation), and the step's table
is one indexing op on the rows it schedules.

The writes and the gather go through a numpy view of the same memory: numpy's indexing of
a few hundred ints costs microseconds where torch's costs tens (its per-op dispatch).
"""

from __future__ import annotations

import torch

from scheduler.output import ScheduledChunk, SchedulerOutput


class BlockTableRows:
    """Per-request rows of a ``[rows, width]`` block-id tensor on the host.

    Rows and width grow when needed (doubling), so no setting has to bound them. A step's
    tables are gathered from them into a new array, which goes to the device with the rest
    of the step's inputs (worker/host/step_upload.py).
    """

    def __init__(self, num_rows: int = 16, width: int = 16) -> None:
        self.table = self._alloc(max(1, num_rows), max(1, width))
        self._array = self.table.numpy()  # the same memory
        # Blocks each row holds (what the scheduler sent so far).
        self.num_blocks = [0] * self.table.shape[0]
        self.rows: dict[str, int] = {}
        self._free = list(range(self.table.shape[0] - 1, -1, -1))

    def _alloc(self, rows: int, width: int) -> torch.Tensor:
        return torch.zeros(rows, width, dtype=torch.int64, device="cpu")

    def apply(self, out: SchedulerOutput) -> list[int]:
        """Bring the rows up to date with one scheduling step; the row of each chunk."""
        for request_id in (*out.finished_ids, *out.preempted_ids):
            self.release(request_id)
        rows, num_blocks, refresh = self.rows, self.num_blocks, self._refresh
        placed = []
        for chunk in out.chunks:  # every running request, every step: kept lean
            row = rows.get(chunk.request_id)
            if (row is None or chunk.new_block_ids
                    or not chunk.num_known_blocks == num_blocks[row] != 0):
                row = refresh(chunk, row)
            placed.append(row)  # else most decodes: nothing changed
        return placed

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.num_blocks[row] = 0
            self._free.append(row)

    def _refresh(self, chunk: ScheduledChunk, row: int | None) -> int:
        """Take a row for a new request, or write the blocks its request gained."""
        if row is None:
            row = self.rows[chunk.request_id] = self._take_row()
        have = chunk.num_known_blocks
        if have != self.num_blocks[row] and have != 0:
            raise RuntimeError(
                f"request {chunk.request_id!r}: the scheduler assumes {have} blocks in its "
                f"row, the runner holds {self.num_blocks[row]}")
        total = have + len(chunk.new_block_ids)
        if chunk.new_block_ids:
            self._ensure_width(total)
            self._array[row, have:total] = chunk.new_block_ids
        self.num_blocks[row] = total
        return row

    def _take_row(self) -> int:
        if not self._free:
            old = self.table.shape[0]
            self._grow(2 * old, self.table.shape[1])
            self.num_blocks += [0] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        return self._free.pop()

    def _ensure_width(self, width: int) -> None:
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], max(width, 2 * self.table.shape[1]))

    def _grow(self, rows: int, width: int) -> None:
        table = self._alloc(rows, width)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        self.table = table
        self._array = table.numpy()

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """The block tables of ``rows``, ``[len(rows), width]``; past a row's own blocks the
        entries are stale ids or zeros, never to be read (AttentionMetadata's contract)."""
        return torch.from_numpy(self._array[rows, :width])
