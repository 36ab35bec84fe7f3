"""Sampling rows kept across steps (worker/sampling/rows.py): the vectorised draws equal the
per-row function bit for bit, a penalised request's distinct tokens and counts follow the
tokens sampled for it step by step, a row handed to another request carries nothing of its
last holder, and the step's row layout is made once per change of the sampled rows: a
steady decode batch reuses it, a request joining or leaving makes it again once, and the
tokens stay those of each request alone."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

from producer.wire.params import SamplingParams
from worker.host.step_upload import StepUpload
from worker.sampling import uniform
from worker.sampling.randomness import uniforms
from worker.sampling.rows import DRAW, TEMPERATURE, TOP_P, SamplingRows, StepRows

CPU = torch.device("cpu")
VOCAB = 32000


def test_vectorised_draws_equal_the_per_row_function_bit_for_bit():
    rng = random.Random(0)
    seeds = [rng.getrandbits(64) for _ in range(2000)] + [0, (1 << 63) - 1, 1 << 63, 2**64 - 1]
    indices = [rng.getrandbits(rng.choice([4, 32, 64])) for _ in seeds]
    got = uniforms(np.array(seeds, dtype=np.uint64), np.array(indices, dtype=np.uint64))
    assert got.tolist() == [uniform(s, i) for s, i in zip(seeds, indices, strict=True)]


def step(state: SamplingRows, request_ids: list[str], output_indices: list[int]) -> StepRows:
    """One step's rows, their upload sent (a CPU one: the arrays are the tensors)."""
    upload = StepUpload(CPU)
    got = state.step(request_ids, output_indices, upload, VOCAB)
    upload.send()
    return got


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
    state.add("a", params, 3, prompt, output)
    row = state.rows["a"]
    for token in [7, 7, 3, 5, 7, 30]:
        got = step(state, ["a"], [len(output)])
        assert state.rows["a"] == row
        assert got.values[0, TEMPERATURE] == 0.7 and got.values[0, TOP_P] == 0.9
        assert got.values[0, DRAW].item() == uniform(3, len(output))
        assert _context(got, 0) == sorted(set(prompt) | set(output))  # distinct, once
        assert got.penalties.context_factors.tolist() == [1.2] * len(_context(got, 0))
        assert _outputs(got, 0) == {t: 0.5 + 0.25 * n for t, n in Counter(output).items()}
        state.record(got, [token])  # what the runner does with the token it sampled
        output.append(token)
    assert state.num_rebuilds == 1  # one request, decoding: one layout


def test_a_released_row_goes_to_the_next_request_clean():
    state = SamplingRows(num_rows=1)
    penalised = SamplingParams(temperature=1.0, repetition_penalty=1.3, presence_penalty=0.1)
    state.add("old", penalised, 1, [1, 2, 3, 4, 5], [6, 7, 8])
    step(state, ["old"], [3])
    row = state.rows["old"]
    state.release("old")
    state.add("new", penalised, 2, [9], [])
    state.add("other", SamplingParams(temperature=0.5), 4, [1], [])
    got = step(state, ["new", "other"], [0, 0])
    assert state.rows["new"] == row and len(state.rows) == 2  # reused, then grown
    assert got.penalties.context.tolist() == [[0], [9]]  # batch row 0, token 9 alone
    assert _outputs(got, 0) == {}
    assert got.values[:, TEMPERATURE].tolist() == [1.0, 0.5]


def test_a_request_added_again_on_resumption_starts_from_the_output_it_brings():
    state = SamplingRows()
    params = SamplingParams(temperature=1.0, frequency_penalty=0.2)
    state.add("r", params, 1, [1], [4, 4, 5, 6])
    step(state, ["r"], [4])
    state.add("r", params, 1, [1], [7, 8])  # resumed with another output (a new holder)
    got = step(state, ["r"], [2])
    assert _outputs(got, 0) == {7: 0.2, 8: 0.2}
    assert got.penalties.context.shape == (2, 0)  # no repetition penalty: nothing to reach


def test_a_penalised_row_out_of_step_with_its_draw_index_is_refused():
    """Its tokens are counted by the runner itself: a draw at another output index than the
    row has counted would penalise with the wrong tokens, so it is an error, not a guess."""
    state = SamplingRows()
    state.add("r", SamplingParams(temperature=1.0, presence_penalty=0.5), 1, [1], [4, 5])
    with pytest.raises(RuntimeError, match="draws output token 3 but its row has 2"):
        step(state, ["r"], [3])
    with pytest.raises(RuntimeError, match="'q' samples without a row"):
        step(state, ["q"], [0])


def test_the_layout_is_made_once_per_change_of_the_sampled_rows():
    state = SamplingRows(num_rows=2)
    kinds = {"g": SamplingParams(temperature=0), "p": SamplingParams(top_p=0.8),
             "k": SamplingParams(top_k=5, logprobs=1), "b": SamplingParams(logit_bias={3: 2})}
    for i, (request_id, params) in enumerate(kinds.items()):
        state.add(request_id, params, i, [1], [])
    ids = list(kinds)
    first = step(state, ids, [0, 0, 0, 0])
    for n in range(1, 101):  # steady decode steps: the layout and its staged subsets stay
        got = step(state, ids, [n] * 4)
        assert got.subsets is first.subsets
        assert got.values[:, DRAW].tolist() == [uniform(i, n) for i in range(4)]
    assert state.num_rebuilds == 1
    state.add("joins", SamplingParams(min_p=0.1), 9, [1], [])
    step(state, ids, [101] * 4)  # added, not sampling yet (a prefill in chunks)
    assert state.num_rebuilds == 1
    step(state, [*ids, "joins"], [102] * 4 + [0])
    step(state, [*ids, "joins"], [103] * 4 + [1])
    assert state.num_rebuilds == 2
    state.release("p")
    left = ["g", "k", "b", "joins"]
    got = step(state, left, [104, 104, 104, 2])
    step(state, left, [105, 105, 105, 3])
    assert state.num_rebuilds == 3
    assert got.subsets.greedy == [0] and got.subsets.logprobs == [1]
    step(state, list(reversed(left)), [3, 105, 105, 105])  # another order: laid out again
    assert state.num_rebuilds == 4


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
    state.add("long", params, 7, prompts[0], [])
    state.add("short", params, 7, prompts[1], [])
    for _ in range(400):
        got = step(state, ["long", "short"], [len(o) for o in outputs])
        for row, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            assert _context(got, row) == sorted(set(prompt) | set(output))
            assert _outputs(got, row) == {t: 0.5 + 0.25 * n for t, n in Counter(output).items()}
        # Mostly new tokens (the buffers double), and a few tokens over and over.
        tokens = [rng.randrange(5000), rng.randrange(4)]
        state.record(got, tokens)
        for output, token in zip(outputs, tokens, strict=True):
            output.append(token)


def mixed_batch() -> list[SamplingParams]:
    """Greedy, sampled with top-p, top-k and min-p, penalised, biased, with logprobs."""
    common = {"max_tokens": 140, "ignore_eos": True}
    return [SamplingParams(temperature=0, **common),
            SamplingParams(temperature=0.8, top_p=0.9, seed=1, **common),
            SamplingParams(temperature=1.0, top_k=20, seed=2, **common),
            SamplingParams(temperature=0.9, min_p=0.1, seed=3, **common),
            SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3,
                           repetition_penalty=1.2, seed=4, **common),
            SamplingParams(temperature=1.0, logit_bias={7: 5.0, 9: -100}, seed=5, **common),
            SamplingParams(temperature=0, logprobs=2, **common)]


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_steady_decode_batch_lays_its_rows_out_once_and_its_tokens_are_each_alone(
        tiny_llama, overlapped):
    """Over 100 steady decode steps (block boundaries crossed on the way) the runner's row
    layout is made 0 times; a request joining makes it once, one leaving once; and every
    request's tokens are those it gets alone in a fresh engine."""
    from worker import Engine

    rng = random.Random(3)
    params = mixed_batch()
    prompts = [[rng.randrange(2, 500) for _ in range(rng.randint(3, 30))] for _ in params]
    settings = dict(dtype="float64", num_kv_blocks=256, block_size=4,
                    async_scheduling=overlapped)
    engine = Engine(tiny_llama, **settings)
    runner = engine.runner
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts[:-1], params[:-1], strict=True)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}

    def steps(n: int) -> None:
        for _ in range(n):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids

    steps(3)  # every prompt in, every request decoding
    assert all(r.num_output_tokens for r in engine.scheduler.running)
    laid_out = runner.sampling_rows.num_rebuilds
    steps(100)
    assert runner.sampling_rows.num_rebuilds == laid_out
    joining = engine.add_request(prompts[-1], params[-1])
    tokens[joining] = []
    steps(10)
    assert runner.sampling_rows.num_rebuilds == laid_out + 1
    engine.abort(ids[1])
    steps(10)
    assert runner.sampling_rows.num_rebuilds == laid_out + 2
    while engine.has_unfinished():
        steps(1)
    engine.close()
    for i, rid in enumerate([*ids, joining]):
        alone = Engine(tiny_llama, **settings).generate([prompts[i]], params[i])[0].token_ids
        if rid == ids[1]:  # aborted: what it had by then
            assert 0 < len(tokens[rid]) < len(alone) and alone[:len(tokens[rid])] == tokens[rid]
        else:
            assert tokens[rid] == alone


def test_min_tokens_bans_follow_the_output_index_with_the_layout_kept():
    """A row bans EOS and its stop tokens while the index it draws is below min_tokens, in
    steps that reuse one layout; ignore_eos leaves EOS drawable; other rows ban nothing."""
    state = SamplingRows(num_rows=2, eos_token_ids=[2, 7])
    state.add("held", SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9]), 1, [1],
              [])
    state.add("free", SamplingParams(temperature=0), 2, [1], [])
    state.add("own", SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[5]), 3,
              [1], [])
    ids = ["free", "held", "own"]
    bans = [step(state, ids, [n, n, n]).bans for n in range(4)]
    assert state.num_rebuilds == 1
    assert bans[0].tolist() == [[1, 1, 1, 2], [2, 7, 9, 5]]
    assert bans[1].tolist() == [[1, 1, 1, 2], [2, 7, 9, 5]]
    assert bans[2].tolist() == [[1, 1, 1], [2, 7, 9]]
    assert bans[3] is None


def test_min_tokens_is_validated_against_max_tokens():
    assert SamplingParams(min_tokens=4, max_tokens=4).to_dict()["min_tokens"] == 4
    assert "min_tokens" not in SamplingParams().to_dict()  # an older worker still reads it
    with pytest.raises(ValueError, match=r"min_tokens \(5\) must be <= max_tokens \(4\)"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="min_tokens must be >= 0"):
        SamplingParams(min_tokens=-1)
