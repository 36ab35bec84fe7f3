"""Sampling state kept across steps: one preallocated row per request that samples.

Rebuilding it every step cost time in proportion to the batch and, for penalties, to the
whole context of every penalised request. Here a request's parameters and seed go into its
row once, when the scheduler first hands the request to the runner (``add``: admission,
swap-in, resumption); the runner releases the row when the request finishes or is
preempted, as it does the request's block table. A penalised request's distinct tokens are
kept with it (:class:`PenaltyRow`): its prompt's and its output's so far when it is added,
then each token the runner samples for it (``record``), with how often each was generated;
a step hands the penalties flat lists of (batch row, token, value) with nothing left to
sort or deduplicate.

What follows from the order of the step's sampled rows alone (their row index, parameters,
per-row values and the subsets each sampling pass touches, :class:`BatchLayout`) is laid out
when that order changes and reused by every step after it that samples the same rows in
the same order: a steady decode batch lays it out once. Its staged device indices stay
valid while reused (each holds a view of the device copy it came in, which keeps that
copy alive; no host buffer is ever reused). Per step there remain one vectorised hash for
the draws (:func:`worker.sampling.randomness.uniforms`, the same numbers as the per-row
function) and the penalised rows' tokens, staged in the step's one upload
(worker/host/step_upload.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from producer.wire.params import SamplingParams
from worker.host.step_upload import Staged, StepUpload
from worker.sampling.grammar import Grammars
from worker.sampling.min_tokens import banned_ids, stage_bans
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

    def extend(self, tokens: Sequence[int]) -> None:
        """Take in output tokens, in order."""
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Take in the request's next output token."""
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
        self.num_outputs += 1


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    """``a`` with ``rows`` rows: its own first, zeros after."""
    grown = np.zeros((rows, *a.shape[1:]), dtype=a.dtype)
    grown[:len(a)] = a
    return grown


# The values of an all-greedy step: argmax reads none (never indexed, so its device is moot).
NO_VALUES = torch.empty(0, 4, dtype=torch.float64, device="cpu")


@dataclass
class BatchLayout:
    """What follows from which rows a step samples, in which order: laid out when that
    changes, then reused step after step."""

    request_ids: list[str]
    params: list[SamplingParams]
    subsets: RowSubsets
    # The sampled rows' [n, 3] temperature, top_p, min_p and [n] seeds (uint64); None
    # where every row is greedy (an argmax reads none of them).
    values: np.ndarray | None
    seeds: np.ndarray | None
    # (batch row, its tokens) of each penalised row.
    penalised: list[tuple[int, PenaltyRow]]
    # (batch row, min_tokens, banned ids) of each row with min_tokens and ids to ban.
    limited: list[tuple[int, int, np.ndarray]]
    # (batch row, grammar matcher) of each constrained row, and those rows' staged index.
    constrained: list = field(default_factory=list)
    matcher_rows: Staged | None = None


class StepRows:
    """What one step samples with, row i for the batch's row i. Made before the forward,
    its tensors staged in the step's upload: ``values`` and ``penalties`` are read once the
    upload is sent; the grammars' ``masks`` are made once the forward is under way."""

    def __init__(self, batch: BatchLayout, values: Staged | None,
                 penalties: tuple[Staged, Staged, Staged, Staged] | None,
                 bans: Staged | None = None) -> None:
        self.params = batch.params
        self.subsets = batch.subsets
        self.penalised = batch.penalised
        self.constrained = batch.constrained
        self._values = values
        self._penalties = penalties
        self._bans = bans
        self._matcher_rows = batch.matcher_rows
        # The constrained rows' masks, int32 on the logits' device (SamplingRows.make_masks).
        self.masks: torch.Tensor | None = None

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

    @property
    def grammar(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The constrained rows and their next-token masks (worker/sampling/grammar.py)."""
        if self.masks is None or self._matcher_rows is None:
            return None, None
        return self._matcher_rows.tensor, self.masks

    @property
    def bans(self) -> torch.Tensor | None:
        """[2, n] (row, token) that rows short of their min_tokens may not draw this step."""
        return None if self._bans is None else self._bans.tensor


class SamplingRows:
    """Per-request sampling rows on the host; the value rows grow (doubling) as needed."""

    def __init__(self, num_rows: int = 16, eos_token_ids: Sequence[int] = (),
                 grammars: Grammars | None = None) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        # The model's grammars, for rows with a response_format (None: none can have one).
        self.grammars = grammars
        self.rows: dict[str, int] = {}
        self._free: list[int] = []
        self._params: list[SamplingParams | None] = []
        # numpy on the host: a step's gather and draws are a few small array ops.
        self.values = np.zeros((0, 3), dtype=np.float64)
        self.seeds = np.zeros(0, dtype=np.uint64)
        # Penalised rows only: their distinct tokens.
        self._penalties: list[PenaltyRow | None] = []
        # Rows with min_tokens: it and the ids banned until then.
        self._bans: list[tuple[int, np.ndarray] | None] = []
        # Constrained rows: their grammar matchers.
        self._matchers: list = []
        # The last step's layout: reused while steps sample the same rows in the same order.
        self._batch: BatchLayout | None = None
        # Layouts made so far (tests read it): one per change of the sampled rows.
        self.num_rebuilds = 0
        self._grow_rows(max(1, num_rows))

    def add(self, request_id: str, params: SamplingParams, seed: int, prompt: Sequence[int],
            output: Sequence[int]) -> None:
        """Give ``request_id`` a row (in place of one it had): its parameters and seed and,
        if penalised, the distinct tokens of ``prompt`` and ``output`` (its tokens so far)."""
        self.release(request_id)
        if not self._free:
            self._grow_rows(2 * len(self._params))
        row = self.rows[request_id] = self._free.pop()
        self._params[row] = params
        self.values[row] = (params.temperature, params.top_p, params.min_p)
        self.seeds[row] = seed & MASK64
        if params.penalized:
            state = self._penalties[row] = PenaltyRow(prompt, params)
            state.extend(output)
        banned = banned_ids(params, self.eos_token_ids)
        self._bans[row] = None if banned is None else (params.min_tokens, banned)
        if params.response_format is not None:
            if self.grammars is None:
                raise RuntimeError("a request with a response_format reached sampling rows "
                                   "without grammars (admission refuses it)")
            self._matchers[row] = self.grammars.matcher(params.response_format, output)

    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self._params[row] = None
            self._penalties[row] = None
            self._bans[row] = None
            self._matchers[row] = None
            self._free.append(row)
            self._batch = None  # it may hold this row

    def step(self, request_ids: list[str], output_indices: Sequence[int],
             upload: StepUpload, vocab: int, *, counted: bool = True) -> StepRows:
        """The rows of one step's sampled requests (each added before), drawing output
        token ``output_indices[i]`` in batch row i; what changes each step (the draws,
        penalty tokens) is added to ``upload``, and the layout too when it is new.
        ``vocab``: the logits' width (a top-k of all of it cuts nothing). ``counted``: a
        penalised row must have counted every output token before the one it draws (the
        runner's steps; a call of its own may draw at any index)."""
        batch = self._batch
        if batch is None or batch.request_ids != request_ids or batch.subsets.vocab != vocab:
            batch = self._batch = self._lay_out(list(request_ids), upload, vocab)
        for k, state in batch.penalised if counted else ():
            if state.num_outputs != output_indices[k]:
                raise RuntimeError(f"request {request_ids[k]!r} draws output token "
                                   f"{output_indices[k]} but its row has {state.num_outputs}")
        penalties = _penalty_tokens(batch.penalised, upload) if batch.penalised else None
        bans = stage_bans(batch.limited, output_indices, upload) if batch.limited else None
        if batch.values is None or batch.seeds is None:
            return StepRows(batch, None, penalties, bans)
        packed = np.empty((len(request_ids), 4), dtype=np.float64)
        packed[:, :3] = batch.values
        # Output indices are never negative: as uint64 they are the same numbers.
        packed[:, DRAW] = uniforms(batch.seeds, np.asarray(output_indices, dtype=np.uint64))
        return StepRows(batch, upload.add(packed), penalties, bans)

    def make_masks(self, step: StepRows, device: torch.device) -> dict[int, str]:
        """The constrained rows' next-token masks for ``step``, made now: the model runner
        asks once the step's forward is under way (on a device it runs meanwhile; on a CPU
        it is done: the same work, after it), outside any captured graph. Returns the rows
        whose grammar failed (past its budgets: it then allows only the end) and why: the
        runner ends their requests with an error, never a cut answer as a stop."""
        if not step.constrained:
            return {}
        assert self.grammars is not None  # (admission refuses a format without them)
        step.masks = self.grammars.masks([m for _, m in step.constrained], device)
        return {k: f"the response_format's grammar failed: {m.get_error()[:300]}"
                for k, m in step.constrained if m.is_error()}

    def record(self, step: StepRows, tokens: Sequence[int]) -> None:
        """Take in the tokens a step sampled (``tokens[i]``: batch row i's): its penalised
        rows count them from the next step on."""
        for k, state in step.penalised:
            state.append(tokens[k])
        for k, matcher in step.constrained:
            matcher.consume_token(tokens[k])

    def _lay_out(self, request_ids: list[str], upload: StepUpload, vocab: int) -> BatchLayout:
        try:
            rows = [self.rows[request_id] for request_id in request_ids]
        except KeyError as exc:
            raise RuntimeError(f"request {exc.args[0]!r} samples without a row: it was "
                               "never added, or was released") from None
        params: list[SamplingParams] = [self._params[row] for row in rows]  # type: ignore[misc]
        subsets = RowSubsets(params, upload, vocab)
        index = np.asarray(rows, dtype=np.int64)
        sampled = bool(subsets.sampled)
        penalised = [(k, state) for k, row in enumerate(rows)
                     if (state := self._penalties[row]) is not None]
        limited = [(k, *bans) for k, row in enumerate(rows)
                   if (bans := self._bans[row]) is not None]
        constrained = [(k, m) for k, row in enumerate(rows)
                       if (m := self._matchers[row]) is not None]
        self.num_rebuilds += 1
        return BatchLayout(request_ids, params, subsets,
                           self.values[index] if sampled else None,
                           self.seeds[index] if sampled else None, penalised, limited,
                           constrained,
                           upload.add(np.array([k for k, _ in constrained], dtype=np.int64))
                           if constrained else None)

    def _grow_rows(self, rows: int) -> None:
        old = len(self._params)
        self.values, self.seeds = _grown(self.values, rows), _grown(self.seeds, rows)
        self._params += [None] * (rows - old)
        self._penalties += [None] * (rows - old)
        self._bans += [None] * (rows - old)
        self._matchers += [None] * (rows - old)
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
