"""Sampling state kept across steps: one preallocated row per request that samples.

Rebuilding it every step cost time in proportion to the batch and, for penalties, to the
whole context of every penalised request: a tensor of each parameter from Python lists, a
draw per row by hashing in Python, and a flat Python list of every prompt and output token.
Here a request's parameters and seed go into its row once, when it first samples; its
distinct prompt tokens once, when it is penalised; its output tokens as they come (one a
step). A step gathers its rows with one index, draws every uniform with one vectorised hash
(:func:`worker.sampling.randomness.uniforms`, the same numbers as the per-row function)
and moves the per-row values to the logits' device in one copy (from pinned memory on
CUDA). The runner releases a row when its request finishes or is preempted, as it does the
request's block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from producer.wire.params import SamplingParams
from worker.sampling.randomness import as_int64, uniforms

# Columns of the per-row values (float64, as the parameters arrived).
TEMPERATURE, TOP_P, MIN_P, DRAW = 0, 1, 2, 3
# Padding of the token-id rows: past a row's own tokens.
NO_TOKEN = -1


@dataclass
class PenaltyTokens:
    """The step's penalised rows and their tokens, on the logits' device."""

    # Positions in the step's batch of the penalised rows.
    rows: list[int]
    # [len(rows), width] distinct prompt token ids and output token ids, NO_TOKEN-padded.
    prompt_ids: torch.Tensor
    output_ids: torch.Tensor


@dataclass
class StepRows:
    """What one step samples with, row i for the batch's row i."""

    params: list[SamplingParams]
    # [n, 4] float64 on the logits' device: temperature, top_p, min_p and the row's uniform
    # draw for this output index.
    values: torch.Tensor
    penalties: PenaltyTokens | None


class SamplingRows:
    """Per-request sampling rows on the host; they grow (doubling) as needed."""

    def __init__(self, num_rows: int = 16, *, pin: bool = False) -> None:
        self.pin = pin
        self.rows: dict[str, int] = {}
        self._free: list[int] = []
        self._params: list[SamplingParams | None] = []
        self._num_outputs: list[int] = []
        self._prompt_lens: list[int] = []
        self.values = self._alloc((0, 3), torch.float64)
        self.seeds = self._alloc((0,), torch.int64)
        self.prompt_ids = self._alloc((0, 1), torch.int64, NO_TOKEN)
        self.output_ids = self._alloc((0, 1), torch.int64, NO_TOKEN)
        self._grow_rows(max(1, num_rows))

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._params[row] = None
            self._free.append(row)

    def step(self, request_ids: Sequence[str], params: Sequence[SamplingParams],
             seeds: Sequence[int], output_indices: Sequence[int],
             prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
             device: torch.device) -> StepRows:
        """The rows of one step's sampled requests (rows of new requests written first).

        ``prompts`` and ``outputs`` are the requests' own token lists; only penalised rows
        read them, and only what is new since the last step.
        """
        index = []
        penalised = []
        for i, request_id in enumerate(request_ids):
            row = self.rows.get(request_id)
            if row is None or self._params[row] is not params[i]:
                row = self._admit(request_id, params[i], seeds[i])
            index.append(row)
            if params[i].penalized:
                self._sync_tokens(row, prompts[i], outputs[i])
                penalised.append(i)
        rows = torch.tensor(index, dtype=torch.int64, device="cpu")
        packed = torch.empty(len(index), 4, dtype=torch.float64, device="cpu")
        packed[:, :3] = self.values.index_select(0, rows)
        positions = torch.tensor([as_int64(i) for i in output_indices], dtype=torch.int64,
                                 device="cpu")
        packed[:, DRAW] = uniforms(self.seeds.index_select(0, rows), positions)
        return StepRows(list(params), _to(packed, device, self.pin),
                        self._penalty_tokens(rows, penalised, device))

    def _admit(self, request_id: str, params: SamplingParams, seed: int) -> int:
        self.release(request_id)
        if not self._free:
            self._grow_rows(2 * len(self._params))
        row = self.rows[request_id] = self._free.pop()
        self._params[row] = params
        self.values[row] = torch.tensor([params.temperature, params.top_p, params.min_p],
                                        dtype=torch.float64, device="cpu")
        self.seeds[row] = as_int64(seed)
        # The row's last holder may have left token ids behind.
        if self._num_outputs[row] or self._prompt_lens[row]:
            self.prompt_ids[row].fill_(NO_TOKEN)
            self.output_ids[row].fill_(NO_TOKEN)
        self._num_outputs[row] = self._prompt_lens[row] = 0
        return row

    def _sync_tokens(self, row: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Bring a penalised row's token ids up to date: its distinct prompt ids once, the
        output ids it has not seen yet."""
        if self._prompt_lens[row] == 0 and prompt:
            distinct = torch.unique(torch.tensor(list(prompt), dtype=torch.int64, device="cpu"))
            self._ensure_width("prompt_ids", distinct.numel())
            self.prompt_ids[row, :distinct.numel()] = distinct
            self._prompt_lens[row] = distinct.numel()
        have, now = self._num_outputs[row], len(output)
        if now < have:  # the request's output was cut back (it resumed): start over
            self.output_ids[row].fill_(NO_TOKEN)
            have = 0
        if now > have:
            self._ensure_width("output_ids", now)
            self.output_ids[row, have:now] = torch.tensor(list(output[have:now]),
                                                          dtype=torch.int64, device="cpu")
        self._num_outputs[row] = now

    def _penalty_tokens(self, rows: torch.Tensor, penalised: list[int],
                        device: torch.device) -> PenaltyTokens | None:
        if not penalised:
            return None
        chosen = rows.index_select(0, torch.tensor(penalised, dtype=torch.int64, device="cpu"))
        picked = chosen.tolist()
        prompt_width = max(1, max(self._prompt_lens[r] for r in picked))
        output_width = max(1, max(self._num_outputs[r] for r in picked))
        return PenaltyTokens(
            penalised,
            self.prompt_ids[:, :prompt_width].index_select(0, chosen).to(device),
            self.output_ids[:, :output_width].index_select(0, chosen).to(device))

    def _grow_rows(self, rows: int) -> None:
        old = len(self._params)
        self.values = self._grown(self.values, (rows, 3))
        self.seeds = self._grown(self.seeds, (rows,))
        self.prompt_ids = self._grown(self.prompt_ids, (rows, self.prompt_ids.shape[1]),
                                      NO_TOKEN)
        self.output_ids = self._grown(self.output_ids, (rows, self.output_ids.shape[1]),
                                      NO_TOKEN)
        self._params += [None] * (rows - old)
        self._num_outputs += [0] * (rows - old)
        self._prompt_lens += [0] * (rows - old)
        self._free += list(range(rows - 1, old - 1, -1))

    def _ensure_width(self, name: str, width: int) -> None:
        t = getattr(self, name)
        if width > t.shape[1]:
            setattr(self, name, self._grown(t, (t.shape[0], max(width, 2 * t.shape[1])),
                                            NO_TOKEN))

    def _grown(self, t: torch.Tensor, shape: tuple[int, ...], fill: int = 0) -> torch.Tensor:
        new = self._alloc(shape, t.dtype, fill)
        new[tuple(slice(0, n) for n in t.shape)] = t
        return new

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, fill: int = 0) -> torch.Tensor:
        t = torch.full(shape, fill, dtype=dtype, device="cpu")
        return t.pin_memory() if self.pin and t.numel() else t


def _to(t: torch.Tensor, device: torch.device, pinned: bool) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return (t.pin_memory() if pinned else t).to(device, non_blocking=pinned)
