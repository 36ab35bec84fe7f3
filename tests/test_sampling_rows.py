"""Sampling rows kept across steps (worker/sampling/rows.py): the vectorised draws equal the
per-row function bit for bit, a penalised request's distinct tokens and counts follow it step
by step, and a row handed to another request carries nothing of its last holder."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import torch

from producer.wire.params import SamplingParams
from worker.sampling import SampleRequest, uniform
from worker.sampling.randomness import uniforms
from worker.sampling.rows import DRAW, TEMPERATURE, TOP_P, SamplingRows, StepRows
from worker.sampling.sampler import step_rows

CPU = torch.device("cpu")
VOCAB = 32000


def test_vectorised_draws_equal_the_per_row_function_bit_for_bit():
    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(2000)] + [0, (1 << 63) - 1, 1 << 63, 2**64 - 1]
    indices = [rng.getrandbits(rng.choice([4, 32, 64])) for _ in seeds]
    got = uniforms(np.array(seeds, dtype=np.uint64), np.array(indices, dtype=np.uint64))
    assert got.tolist() == [uniform(s, i) for s, i in zip(seeds, indices, strict=True)]


def _context(got: StepRows, row: int) -> list[int]:
    """The distinct ids the repetition penalty reaches in batch row ``row``, sorted."""
    rows, ids = got.penalties.context.tolist()
    return sorted(i for r, i in zip(rows, ids, strict=True) if r == row)


def _outputs(got: StepRows, row: int) -> dict[int, float]:
    """What presence and frequency take off each distinct output id of batch row ``row``."""
    rows, ids = got.penalties.outputs.tolist()
    deltas = got.penalties.output_deltas.tolist()
    return {i: d for r, i, d in zip(rows, ids, deltas, strict=True) if r == row}


def test_a_penalised_request_keeps_its_row_and_gains_only_its_new_tokens():
    state = SamplingRows(num_rows=1)
    params = SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5,
                            frequency_penalty=0.25, repetition_penalty=1.2, seed=3)
    prompt, output = [5, 9, 5, 2], []
    rows_seen = set()
    for token in [7, 7, 3, 5, 7, 30]:
        req = SampleRequest(params, 3, len(output), prompt, output)
        got = step_rows(state, ["a"], [req], CPU, VOCAB)
        rows_seen.add(state.rows["a"])
        assert got.values[0, TEMPERATURE] == 0.7 and got.values[0, TOP_P] == 0.9
        assert got.values[0, DRAW].item() == uniform(3, len(output))
        assert _context(got, 0) == sorted(set(prompt) | set(output))  # distinct, once
        assert got.penalties.context_factors.tolist() == [1.2] * len(_context(got, 0))
        assert _outputs(got, 0) == {t: 0.5 + 0.25 * n for t, n in Counter(output).items()}
        output.append(token)  # what the engine appends after the step
    assert len(rows_seen) == 1


def test_a_released_row_goes_to_the_next_request_clean():
    state = SamplingRows(num_rows=1)
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.1)
    step_rows(state, ["old"], [SampleRequest(penalised, 1, 3, [1, 2, 3, 4, 5], [6, 7, 8])],
              CPU, VOCAB)
    row = state.rows["old"]
    state.release("old")
    got = step_rows(state, ["new", "other"], [
        SampleRequest(penalised, 2, 0, [9], []),
        SampleRequest(SamplingParams(temperature=0.5), 4, 0, [1], []),
    ], CPU, VOCAB)
    assert state.rows["new"] == row and len(state.rows) == 2  # reused, then grown
    assert got.penalties.context.tolist() == [[0], [9]]  # batch row 0, token 9 alone
    assert _outputs(got, 0) == {}
    assert got.values[:, TEMPERATURE].tolist() == [1.0, 0.5]


def test_an_output_cut_back_on_resumption_is_laid_out_again():
    state = SamplingRows()
    params = SamplingParams(temperature=1.0, frequency_penalty=0.2)
    step_rows(state, ["r"], [SampleRequest(params, 1, 4, [1], [4, 4, 5, 6])], CPU, VOCAB)
    got = step_rows(state, ["r"], [SampleRequest(params, 1, 2, [1], [7, 8])], CPU, VOCAB)
    assert _outputs(got, 0) == {7: 0.2, 8: 0.2}
    assert got.penalties.context.shape == (2, 0)  # no repetition penalty: nothing to reach


def test_an_aborted_request_gives_its_rows_back_even_when_nothing_runs_next(tiny_llama):
    from worker import Engine

    engine = Engine(tiny_llama, dtype="float32", num_kv_blocks=64)
    rid = engine.add_request([5, 6, 7], SamplingParams(temperature=1.0, seed=1,
                                                         presence_penalty=0.3, max_tokens=50))
    engine.step()
    engine.step()
    runner = engine.runner
    assert rid in runner.sampling_rows.rows and rid in runner.block_tables.rows  # it sampled
    engine.abort(rid)
    assert engine.step() == []  # the step schedules nothing
    assert rid not in runner.sampling_rows.rows and rid not in runner.block_tables.rows


def test_penalised_rows_that_outgrow_their_buffers_keep_every_token():
    """A penalised row's buffers double as its distinct tokens outgrow them: its tokens
    and counts survive each doubling, and its neighbour's stay its own."""
    rng = random.Random(1)
    state = SamplingRows(num_rows=2)
    params = SamplingParams(temperature=1.0, repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.25)
    prompts = [[rng.randrange(5000) for _ in range(300)], [1, 2, 3]]
    outputs: list[list[int]] = [[], []]
    for _ in range(400):
        reqs = [SampleRequest(params, 7, len(o), p, o)
                for p, o in zip(prompts, outputs, strict=True)]
        got = step_rows(state, ["long", "short"], reqs, CPU, VOCAB)
        for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            assert _context(got, row) == sorted(set(prompt) | set(output))
            assert _outputs(got, row) == {t: 0.5 + 0.25 * n for t, n in Counter(output).items()}
        outputs[0].append(rng.randrange(5000))  # mostly new tokens: the buffers double
        outputs[1].append(rng.randrange(4))  # a few tokens over and over
