"""Sampling state kept across steps: one preallocated row per request that samples.

Rebuilding it every step cost time in proportion to the batch and, for penalties, to the
whole context of every penalised request: a tensor of each parameter from Python lists, a
draw per row by hashing in Python, and a flat Python list of every prompt and output token.
Here a request's parameters and seed go into its row once, when it first samples. A
penalised request's distinct tokens are kept with it (:class:`PenaltyRow`): its prompt's
once, its output's as they come, one a step, with how often each was generated; a step then
hands the penalties flat lists of (batch row, token, value) with nothing left to sort or
deduplicate. A step gathers its rows with one index, draws every uniform with one vectorised
hash (:func:`worker.sampling.randomness.uniforms`, the same numbers as the per-row function)
and stages the per-row values, penalty tokens and row subsets in the step's upload
(worker/host/step_upload.py), which moves every input of the step in one copy. The runner
releases a row when its request finishes or is preempted, as it does the request's block
table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload
from worker.sampling.randomness import MASK64, uniforms
from worker.sampling.subsets import RowSubsets

# Columns of the per-row values (float64, as the parameters arrived).
TEMPERATURE, TOP_P, MIN_P, DRAW = 0, 1, 2, 3


@dataclass
class PenaltyTokens:
    """What the step's penalised rows do to their logits, as flat lists on the logits'
    device: one entry per distinct (row, token), no padding and nothing to deduplicate."""

    # Repetition: [2, n] the batch row and id of every distinct prompt or output token of a
    # row with a repetition penalty; [n] that row's penalty (divides positive logits).
    context: torch.Tensor
    context_factors: torch.Tensor
    # Presence and frequency: [2, m] every distinct output token of a row with either;
    # [m] what comes off its logit (presence + frequency x occurrences).
    outputs: torch.Tensor
    output_deltas: torch.Tensor


class PenaltyRow:
    """A penalised request's distinct tokens, kept up to date one output token at a time.

    Two torch.unique a step over every penalised row's whole context cost more than the
    rest of sampling; here each new output token costs a set and a dict lookup, and what
    presence and frequency take off each distinct output token is kept as it changes.
    """

    def __init__(self, prompt: Sequence[int], params: SamplingParams) -> None:
        self.repetition = params.repetition_penalty
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        distinct = np.unique(np.asarray(prompt, dtype=np.int64))
        self._seen = set(distinct.tolist())
        # Distinct prompt and output ids (repetition penalty): the first num_context.
        self._context = np.empty(max(64, 2 * len(distinct)), dtype=np.int64)
        self._context[:len(distinct)] = distinct
        self.num_context = len(distinct)
        # Distinct output ids and, beside each, presence + frequency x its occurrences:
        # the first num_distinct.
        self._index: dict[int, int] = {}
        self._outputs = np.empty(64, dtype=np.int64)
        self._deltas = np.empty(64, dtype=np.float64)
        self.num_distinct = 0
        self.num_outputs = 0

    @property
    def context(self) -> np.ndarray:
        return self._context[:self.num_context]

    @property
    def outputs(self) -> np.ndarray:
        return self._outputs[:self.num_distinct]

    @property
    def deltas(self) -> np.ndarray:
        return self._deltas[:self.num_distinct]

    def add(self, output: Sequence[int]) -> None:
        """Take in ``output``'s tokens past the ones already seen."""
        for token in output[self.num_outputs:]:
            if token not in self._seen:
                self._seen.add(token)
                if self.num_context == len(self._context):
                    self._context = _grown(self._context, 2 * len(self._context))
                self._context[self.num_context] = token
                self.num_context += 1
            i = self._index.get(token)
            if i is None:
                i = self._index[token] = self.num_distinct
                if i == len(self._outputs):
                    n = 2 * len(self._outputs)
                    self._outputs, self._deltas = _grown(self._outputs, n), _grown(self._deltas, n)
                self._outputs[i] = token
                self._deltas[i] = self.presence + self.frequency
                self.num_distinct += 1
            else:
                self._deltas[i] += self.frequency
        self.num_outputs = len(output)


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with ``rows`` rows: its own first, zeros after."""
    grown = np.zeros((rows, *a.shape[1:]), dtype=a.dtype)
    grown[:len(a)] = a
    return grown


# The values of an all-greedy step: argmax reads none (never indexed, so its device is moot).
NO_VALUES = torch.empty(0, 4, dtype=torch.float64, device="cpu")


class StepRows:
    """What one step samples with, row i for the batch's row i. Made before the forward,
    its tensors staged in the step's upload: ``values`` and ``penalties`` are read once the
    upload is sent."""

    def __init__(self, params: list[SamplingParams], values: Staged | None,
                 penalties: tuple[Staged, Staged, Staged, Staged] | None,
                 subsets: RowSubsets) -> None:
        self.params = params
        self.subsets = subsets
        self._values = values
        self._penalties = penalties

    @property
    def values(self) -> torch.Tensor:
        """[n, 4] float64 on the logits' device: temperature, top_p, min_p and the row's
        uniform draw for this output index; NO_VALUES in a step where every row is greedy."""
        return NO_VALUES if self._values is None else self._values.tensor

    @property
    def penalties(self) -> PenaltyTokens | None:
        if self._penalties is None:
            return None
        return PenaltyTokens(*(s.tensor for s in self._penalties))


class SamplingRows:
    """Per-request sampling rows on the host; the value rows grow (doubling) as needed."""

    def __init__(self, num_rows: int = 16) -> None:
        self.rows: dict[str, int] = {}
        self._free: list[int] = []
        self._params: list[SamplingParams | None] = []
        # numpy on the host: a step's gather and draws are a few small array ops.
        self.values = np.zeros((0, 3), dtype=np.float64)
        self.seeds = np.zeros(0, dtype=np.uint64)
        # Penalised rows only: their distinct tokens.
        self._penalties: list[PenaltyRow | None] = []
        self._grow_rows(max(1, num_rows))

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._params[row] = None
            self._penalties[row] = None
            self._free.append(row)

    def step(self, request_ids: Sequence[str], params: Sequence[SamplingParams],
             seeds: Sequence[int], output_indices: Sequence[int],
             prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]],
             upload: StepUpload, vocab: int) -> StepRows:
        """The rows of one step's sampled requests (rows of new requests written first),
        their values, penalty tokens and subsets added to ``upload``.

        ``prompts`` and ``outputs`` are the requests' own token lists; only penalised rows
        read them, and only what is new since the last step. ``vocab``: the logits' width
        (a top-k of all of it cuts nothing).
        """
        index = []
        penalised: list[tuple[int, PenaltyRow]] = []
        for i, request_id in enumerate(request_ids):
            row = self.rows.get(request_id)
            if row is None or self._params[row] is not params[i]:
                row = self._admit(request_id, params[i], seeds[i])
            index.append(row)
            if params[i].penalized:
                penalised.append((i, self._sync_tokens(row, params[i], prompts[i], outputs[i])))
        penalties = _penalty_tokens(penalised, upload) if penalised else None
        subsets = RowSubsets(params, upload, vocab)
        if all(p.greedy for p in params):  # an argmax reads none of the values
            return StepRows(list(params), None, penalties, subsets)
        rows = np.asarray(index, dtype=np.int64)
        packed = np.empty((len(index), 4), dtype=np.float64)
        packed[:, :3] = self.values[rows]
        # Output indices are never negative: as uint64 they are the same numbers.
        packed[:, DRAW] = uniforms(self.seeds[rows], np.asarray(output_indices, dtype=np.uint64))
        return StepRows(list(params), upload.add(packed), penalties, subsets)

    def _admit(self, request_id: str, params: SamplingParams, seed: int) -> int:
        self.release(request_id)
        if not self._free:
            self._grow_rows(2 * len(self._params))
        row = self.rows[request_id] = self._free.pop()
        self._params[row] = params
        self.values[row] = (params.temperature, params.top_p, params.min_p)
        self.seeds[row] = seed & MASK64
        return row

    def _sync_tokens(self, row: int, params: SamplingParams, prompt: Sequence[int],
                     output: Sequence[int]) -> PenaltyRow:
        """A penalised row's tokens, brought up to date with its request's output."""
        state = self._penalties[row]
        if state is None or len(output) < state.num_outputs:
            # New, or its output was cut back (it resumed): start over.
            state = self._penalties[row] = PenaltyRow(prompt, params)
        if len(output) > state.num_outputs:
            state.add(output)
        return state

    def _grow_rows(self, rows: int) -> None:
        old = len(self._params)
        self.values, self.seeds = _grown(self.values, rows), _grown(self.seeds, rows)
        self._params += [None] * (rows - old)
        self._penalties += [None] * (rows - old)
        self._free += list(range(rows - 1, old - 1, -1))


def _penalty_tokens(states: list[tuple[int, PenaltyRow]], upload: StepUpload
                    ) -> tuple[Staged, Staged, Staged, Staged]:
    """The penalised rows' distinct tokens as flat lists (batch row, id, value), from each
    row's batch position and its PenaltyRow: one pass over the rows, then a few array ops."""
    context_rows, context_ids, factors = [], [], []
    output_rows, output_ids, deltas = [], [], []
    for k, state in states:
        if state.repetition != 1.0:
            context_rows.append(k)
            context_ids.append(state.context)
            factors.append(state.repetition)
        if state.presence or state.frequency:
            output_rows.append(k)
            output_ids.append(state.outputs)
            deltas.append(state.deltas)
    context, lengths = _flat(context_rows, context_ids)
    context_factors = np.repeat(np.asarray(factors, dtype=np.float64), lengths)
    outputs, _ = _flat(output_rows, output_ids)
    output_deltas = np.concatenate(deltas) if deltas else np.empty(0, dtype=np.float64)
    return tuple(upload.add(a) for a in (context, context_factors, outputs, output_deltas))


def _flat(rows: list[int], ids: list[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """[2, n] (batch row, id) of every id of ``ids`` (row rows[i]'s ids are ids[i]), and how
    many ids each row has."""
    lengths = [len(a) for a in ids]
    index = np.empty((2, sum(lengths)), dtype=np.int64)
    if ids:
        index[0] = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
        np.concatenate(ids, out=index[1])
    return index, lengths
