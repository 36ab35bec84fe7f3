"""Sampling state kept across steps: one preallocated row per request that samples.

Rebuilding it every step cost time in proportion to the batch and, for penalties, to the
whole context of every penalised request: a tensor of each parameter from Python lists, a
draw per row by hashing in Python, and a flat Python list of every prompt and output token.
Here a request's parameters and seed go into its row once, when it first samples; its
distinct prompt tokens once, when it is penalised; its output tokens as they come (one a
step). A step gathers its rows with one index, draws every uniform with one vectorised hash
(:func:`worker.sampling.randomness.uniforms`, the same numbers as the per-row function)
and moves the per-row values to the logits' device in one copy (pinned on CUDA). Token ids
are kept for penalised requests only, in buffers that grow with that request alone. The
runner releases a row when its request finishes or is preempted, as it does the request's
block table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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


# The values of an all-greedy step: argmax reads none (never indexed, so its device is moot).
NO_VALUES = torch.empty(0, 4, dtype=torch.float64, device="cpu")


@dataclass
class StepRows:
    """What one step samples with, row i for the batch's row i."""

    params: list[SamplingParams]
    # [n, 4] float64 on the logits' device: temperature, top_p, min_p and the row's uniform
    # draw for this output index; NO_VALUES in a step where every row is greedy.
    values: torch.Tensor
    penalties: PenaltyTokens | None


class SamplingRows:
    """Per-request sampling rows on the host; the value rows grow (doubling) as needed."""

    def __init__(self, num_rows: int = 16) -> None:
        self.rows: dict[str, int] = {}
        self._free: list[int] = []
        self._params: list[SamplingParams | None] = []
        self.values = torch.zeros(0, 3, dtype=torch.float64, device="cpu")
        self.seeds = torch.zeros(0, dtype=torch.int64, device="cpu")
        # Penalised rows only: distinct prompt ids, and output ids (a buffer with room to
        # grow, of which the first _num_outputs[row] are the request's); numpy arrays,
        # whose small writes cost a tenth of torch's.
        self._prompt_ids: list[np.ndarray | None] = []
        self._output_ids: list[np.ndarray | None] = []
        self._num_outputs: list[int] = []
        self._grow_rows(max(1, num_rows))

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._params[row] = None
            self._prompt_ids[row] = self._output_ids[row] = None
            self._num_outputs[row] = 0
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
        penalties = self._penalty_tokens([index[i] for i in penalised], penalised, device)
        if all(p.greedy for p in params):  # an argmax reads none of the values
            return StepRows(list(params), NO_VALUES, penalties)
        rows = torch.tensor(index, dtype=torch.int64, device="cpu")
        packed = torch.empty(len(index), 4, dtype=torch.float64, device="cpu")
        packed[:, :3] = self.values.index_select(0, rows)
        positions = torch.tensor([as_int64(i) for i in output_indices], dtype=torch.int64,
                                 device="cpu")
        packed[:, DRAW] = uniforms(self.seeds.index_select(0, rows), positions)
        return StepRows(list(params), _to(packed, device), penalties)

    def _admit(self, request_id: str, params: SamplingParams, seed: int) -> int:
        self.release(request_id)
        if not self._free:
            self._grow_rows(2 * len(self._params))
        row = self.rows[request_id] = self._free.pop()
        self._params[row] = params
        self.values[row] = torch.tensor([params.temperature, params.top_p, params.min_p],
                                        dtype=torch.float64, device="cpu")
        self.seeds[row] = as_int64(seed)
        return row

    def _sync_tokens(self, row: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Bring a penalised row's token ids up to date: its distinct prompt ids once, the
        output ids it has not seen yet."""
        if self._prompt_ids[row] is None:
            self._prompt_ids[row] = np.unique(np.asarray(prompt, dtype=np.int64))
        buffer, have, now = self._output_ids[row], self._num_outputs[row], len(output)
        if now < have:  # the request's output was cut back (it resumed): start over
            have = 0
        if now > have:
            if buffer is None or len(buffer) < now:
                grown = np.empty(max(16, 2 * now), dtype=np.int64)
                if buffer is not None:
                    grown[:have] = buffer[:have]
                buffer = self._output_ids[row] = grown
            buffer[have:now] = output[have:now]
        self._num_outputs[row] = now

    def _penalty_tokens(self, rows: list[int], positions: list[int],
                        device: torch.device) -> PenaltyTokens | None:
        """The penalised rows' ids, NO_TOKEN-padded to the longest of this step."""
        if not rows:
            return None
        prompts = [self._prompt_ids[r] for r in rows]
        outputs = [self._output_ids[r] for r in rows]
        counts = [self._num_outputs[r] for r in rows]
        prompt_ids = _padded(prompts, None)
        output_ids = _padded(outputs, counts)
        return PenaltyTokens(positions, prompt_ids.to(device), output_ids.to(device))

    def _grow_rows(self, rows: int) -> None:
        old = len(self._params)
        values = torch.zeros(rows, 3, dtype=torch.float64, device="cpu")
        values[:old] = self.values
        seeds = torch.zeros(rows, dtype=torch.int64, device="cpu")
        seeds[:old] = self.seeds
        self.values, self.seeds = values, seeds
        self._params += [None] * (rows - old)
        self._prompt_ids += [None] * (rows - old)
        self._output_ids += [None] * (rows - old)
        self._num_outputs += [0] * (rows - old)
        self._free += list(range(rows - 1, old - 1, -1))


def _padded(parts: list[np.ndarray | None], counts: list[int] | None) -> torch.Tensor:
    """Rows of ``parts`` (the first ``counts[i]`` of each, or all of it) in one
    ``[len(parts), longest]`` tensor padded with NO_TOKEN."""
    lengths = [0 if t is None else (len(t) if counts is None else counts[i])
               for i, t in enumerate(parts)]
    # numpy: a row's copy costs ~0.5 us here against ~5 us for a torch slice assignment,
    # and a step copies two rows per penalised request.
    out = np.full((len(parts), max(1, max(lengths))), NO_TOKEN, dtype=np.int64)
    for i, (t, n) in enumerate(zip(parts, lengths, strict=True)):
        if n:
            out[i, :n] = t[:n]
    return torch.from_numpy(out)


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """On the CPU as it is; to an accelerator in one copy from pinned memory."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
