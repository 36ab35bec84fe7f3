"""Steps sized by an inter-token target (scheduler/step_cost.py): the cost model learns a
step's time from the engine's own steps, and a step beside decodes holds only the prefill
that keeps it within the target. Nothing here is timed: steps' seconds are given."""

from __future__ import annotations

import random

import pytest

from kvstore import BlockPool, KVCacheManager
from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from scheduler.step_cost import (
    MIN_PREFILL_STEPS,
    MIN_PREFILL_TOKENS,
    StepCostModel,
    StepFeatures,
    chunk_attention,
    nonnegative_fit,
    prefill_within,
)

# A machine's step: 2 ms, 40 µs a prefill token, 100 µs a decode row, 0.5 µs a context
# token, 20 ns a position a chunk's later tokens attend over.
TRUE = (2e-3, 40e-6, 100e-6, 0.5e-6, 20e-9)


def seconds(f: StepFeatures) -> float:
    a, b, c, d, e = TRUE
    return (a + b * f.prefill_tokens + c * f.decode_rows + d * f.context_tokens
            + e * f.chunk_attention)


def learnt(steps: int = 200, seed: int = 0) -> StepCostModel:
    rng, model = random.Random(seed), StepCostModel()
    for _ in range(steps):
        n, start = rng.choice([0, rng.randint(1, 1024)]), rng.randint(0, 3000)
        f = StepFeatures(n, rng.randint(0, 64), rng.randint(0, 40_000) + n,
                         chunk_attention(start, n) if n else 0)
        model.observe(f, seconds(f))
    return model


def test_the_model_learns_a_steps_cost_from_steps_seen():
    model = learnt()
    assert model.ready
    assert model.coefficients == pytest.approx(TRUE, rel=1e-3, abs=1e-9)
    f = StepFeatures(500, 48, 20_000)
    assert model.predict(f) == pytest.approx(seconds(f), rel=1e-3)


def test_the_fit_is_the_best_with_no_cost_negative():
    """Against every subset of the terms solved alone: the least objective of those whose
    solution is not negative is the constrained optimum."""
    import itertools

    import numpy as np

    for trial in range(40):
        rng = np.random.default_rng(trial)
        x = rng.normal(size=(30, 5)) * rng.uniform(0.1, 1e3, size=5)
        y = x @ rng.normal(size=5) + rng.normal(size=30)
        a, b = x.T @ x, x.T @ y

        def objective(c, a=a, b=b):
            return 0.5 * c @ a @ c - b @ c

        best = 0.0  # (no term at all)
        for k in range(1, 6):
            for terms in map(list, itertools.combinations(range(5), k)):
                c = np.zeros(5)
                c[terms] = np.linalg.solve(a[np.ix_(terms, terms)], b[terms])
                if (c >= 0).all():
                    best = min(best, objective(c))
        got = nonnegative_fit(a, b)
        assert (got >= 0).all()
        assert objective(got) <= best + 1e-6 * abs(best) + 1e-9


def test_a_steady_batch_is_predicted_right_though_its_rows_never_change():
    """A few prompts' large chunks first (on a path that costs 20 ms more past 192 tokens,
    as a CPU's Python layers do), then 48 rows a step, always: the rows' cost cannot be told
    from the step's own. A fit clipped after solving traded one for a negative other and
    predicted the decode-only step at 40 ms for 9; the nonnegative fit predicts the steps it
    saw."""
    def took(f: StepFeatures) -> float:
        return seconds(f) + (0.02 if f.prefill_tokens > 192 else 0.0)

    model, rng = StepCostModel(), random.Random(3)
    for rows in (0, 0, 16, 32):
        f = StepFeatures(1000, rows, rows * 40 + 1000, chunk_attention(0, 1000))
        model.observe(f, took(f))
    for _ in range(300):
        n = rng.choice([0, 0, rng.randint(32, 192)])
        f = StepFeatures(n, 48, 48 * 100 + n, chunk_attention(rng.randint(0, 2000), n))
        model.observe(f, took(f))
    for f in (StepFeatures(0, 48, 4800), StepFeatures(64, 48, 4864, chunk_attention(1000, 64))):
        assert model.predict(f) == pytest.approx(took(f), rel=0.05)
    assert min(model.coefficients) >= 0


def test_it_sizes_nothing_until_it_saw_prefill_steps():
    model = StepCostModel()
    for _ in range(50):  # decodes only: a prefill token's cost is unknown
        f = StepFeatures(0, 48, 10_000)
        model.observe(f, seconds(f))
    assert not model.ready
    s = scheduler(5, model)
    decoding(s, 48)
    s.add_request(Request("doc", list(range(1, 2001)), max_tokens=4))
    assert next(len(c.token_ids) for c in step(s).chunks if c.request_id == "doc") == 1024 - 48
    for _ in range(MIN_PREFILL_STEPS):
        f = StepFeatures(256, 48, 10_000)
        model.observe(f, seconds(f))
    assert model.ready


def step_s(n: int, rows: int, context: int, start: int) -> float:
    """A step's seconds with a chunk of ``n`` at ``start`` beside ``rows`` decodes."""
    return seconds(StepFeatures(n, rows, context + start + n, chunk_attention(start, n)))


def within(model: StepCostModel, target_s: float, rows: int, context: int, start: int) -> int:
    """The chunk at ``start`` the target leaves room for beside ``rows`` decodes."""
    left = max(0.0, target_s - model.predict(StepFeatures(0, rows, context)))
    return prefill_within(model, left, start, MIN_PREFILL_TOKENS, 1024)


def test_the_prefill_fits_the_target_and_never_falls_under_the_floor():
    model = learnt()
    rows, context = 48, 48 * 100  # decodes alone: 9.2 ms
    for start in (0, 1500):  # a chunk further on attends over more: it fits fewer tokens
        sizes = []
        for target_ms in (15, 20, 40):
            n = within(model, target_ms / 1000, rows, context, start)
            sizes.append(n)
            assert step_s(n, rows, context, start) <= target_ms / 1000 * 1.001 < \
                step_s(n + 2, rows, context, start)
        assert sizes == sorted(sizes)
    assert within(model, 0.02, rows, context, 1500) < within(model, 0.02, rows, context, 0)
    # A batch whose decodes alone take longer than the target: the prompt still progresses.
    assert within(model, 0.005, rows, context, 0) == MIN_PREFILL_TOKENS
    assert within(model, 10.0, rows, context, 0) == 1024


def scheduler(target_ms: float | None, model: StepCostModel | None = None) -> Scheduler:
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64,
                                  max_model_len=4096, itl_target_ms=target_ms),
                  KVCacheManager(BlockPool(4096), 16))
    if model is not None:
        s.step_cost = model
    return s


def step(s: Scheduler):
    out = s.schedule()
    s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    return out


def decoding(s: Scheduler, n: int) -> None:
    for i in range(n):
        s.add_request(Request(f"d{i}", list(range(1, 33)), max_tokens=10_000))
    while any(r.status is not RequestStatus.RUNNING_GEN for r in s.running) or len(s.running) < n:
        step(s)


@pytest.mark.parametrize("target_ms", [10, 20, 40])
def test_a_long_prompt_beside_decodes_goes_in_chunks_the_target_allows(target_ms):
    s = scheduler(target_ms, learnt())
    decoding(s, 48)
    s.add_request(Request("doc", list(range(1, 2001)), max_tokens=4))
    chunks = []
    while s.requests["doc"].status is not RequestStatus.RUNNING_GEN:
        out = step(s)
        [doc] = [c for c in out.chunks if c.request_id == "doc"]
        chunks.append(len(doc.token_ids))
        features = StepFeatures.of(out.chunks)
        assert features.decode_rows == 48  # every decode in every step
        if len(doc.token_ids) > MIN_PREFILL_TOKENS:
            assert seconds(features) <= target_ms / 1000 * 1.01
    assert sum(chunks) == 2000  # the whole prompt, in order
    assert len(chunks) > 2000 // 1024 + 1  # smaller than the token budget alone makes them


def test_budgets_follow_the_target_and_the_token_budget_without_one():
    sizes = {}
    for target_ms in (None, 10, 40):
        s = scheduler(target_ms, learnt())
        decoding(s, 48)
        s.add_request(Request("doc", list(range(1, 2001)), max_tokens=4))
        out = step(s)
        sizes[target_ms] = next(len(c.token_ids) for c in out.chunks if c.request_id == "doc")
    assert sizes[None] == 1024 - 48  # the token budget's rest
    assert MIN_PREFILL_TOKENS < sizes[10] < sizes[40] < sizes[None]


def test_with_nothing_decoding_prefill_takes_the_whole_budget():
    s = scheduler(10, learnt())
    s.add_request(Request("doc", list(range(1, 2001)), max_tokens=4))
    assert len(step(s).chunks[0].token_ids) == 1024


def test_a_prompt_progresses_under_any_decode_load():
    s = scheduler(0.001, learnt())  # a target no step meets: decodes alone exceed it
    decoding(s, 63)  # (and one seat left of max_num_seqs)
    s.add_request(Request("doc", list(range(1, 1001)), max_tokens=4))
    steps = 0
    while s.requests["doc"].status is not RequestStatus.RUNNING_GEN:
        out = step(s)
        steps += 1
        assert any(c.request_id == "doc" for c in out.chunks)  # never starved
    assert steps == -(-1000 // MIN_PREFILL_TOKENS)


def test_the_scheduler_learns_from_the_steps_it_is_told_of():
    s = scheduler(20)
    decoding(s, 8)
    rng = random.Random(1)
    for i in range(40):
        if not any(r.request_id.startswith("doc") for r in s.requests.values()):
            s.add_request(Request(f"doc{i}", [rng.randrange(1, 999) for _ in range(2000)],
                                  max_tokens=4))
        out = s.schedule()
        s.observe_step(out, seconds(StepFeatures.of(out.chunks)) * rng.uniform(1, 1.01))
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    assert s.step_cost.ready
    assert s.step_cost.coefficients[1] == pytest.approx(TRUE[1], rel=0.2)


def test_a_negative_target_is_refused():
    with pytest.raises(ValueError, match="itl_target_ms"):
        SchedulerConfig(itl_target_ms=-1)


def test_an_engine_with_a_target_learns_from_its_steps_and_exports_the_cost(tiny_llama):
    from worker import Engine, SamplingParams
    from worker.fleet.metrics import _EngineStatsCollector

    engine = Engine(tiny_llama, dtype="float64", itl_target_ms=50, async_scheduling=False)
    assert not engine.scheduler.cost_stats()  # nothing learnt yet
    list(engine.generate([list(range(2, 300)), list(range(5, 40))],
                         SamplingParams(max_tokens=8, temperature=0)))
    assert engine.scheduler.step_cost.steps == engine.num_steps > 0
    names = {m.name for m in _EngineStatsCollector("m", engine.stats).collect()}
    assert {"conveyor_step_cost_base_seconds", "conveyor_step_cost_prefill_token_seconds",
            "conveyor_step_cost_decode_row_seconds",
            "conveyor_step_cost_context_token_seconds",
            "conveyor_step_cost_chunk_attention_seconds"} <= names
    engine.close()
    untargeted = Engine(tiny_llama, dtype="float64")
    list(untargeted.generate([list(range(2, 40))], SamplingParams(max_tokens=2)))
    assert untargeted.scheduler.step_cost.steps == 0  # (no target: nothing learnt, no cost)
    untargeted.close()


def test_a_spent_target_keeps_the_imported_kv_of_requests_behind():
    """A prompt the target leaves out of a step waits, as one that does not fit in memory
    would not: the imported KV held by requests behind it is kept (dropped only when memory
    is what stops admission)."""
    s = scheduler(0.001, learnt())
    decoding(s, 8)
    s.add_request(Request("doc", list(range(1, 2001)), max_tokens=4))
    s.add_request(Request("next", list(range(3, 500)), max_tokens=4))
    held = Request("held", list(range(5, 200)), max_tokens=4)
    held.preloaded = s.kv.hold_blocks(64)
    s.add_request(held)
    step(s)
    assert s.counters["kv_imports_dropped"] == 0
    assert s.requests["held"].preloaded is not None


def test_a_fit_that_sees_no_prefill_cost_still_holds_a_step_it_cannot_fit():
    model = learnt()
    model.coefficients = (0.5, 0.0, 0.0, 0.0, 0.0)  # (a cold step it has not forgotten yet)
    assert within(model, 0.02, 8, 100, 0) == MIN_PREFILL_TOKENS
    assert within(model, 1.0, 8, 100, 0) == 1024


def test_targets_that_are_no_numbers_are_refused():
    for bad in (-1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="itl_target_ms"):
            SchedulerConfig(itl_target_ms=bad)


def test_overlapped_steps_learn_what_the_runner_thread_took_and_size_by_it():
    """With overlapped steps (a GPU's, a simulated engine's) each step is timed on the runner
    thread that ran it, and the scheduler learns it when the engine applies its tokens."""
    import torch

    from producer.clock import ManualClock
    from worker.engine.step_pipeline import OverlappedSteps

    clock = ManualClock()

    class Runner:  # a device whose steps take what TRUE says, on the clock
        def queued(self, out): pass

        def release(self, out): pass

        def execute(self, out, pending=None):
            took.append(seconds(StepFeatures.of(out.chunks)))
            clock.advance(took[-1])
            return {c.request_id: 7 for c in out.chunks if c.sample}, {}, {}

    took: list[float] = []

    s = scheduler(20)
    pipeline = OverlappedSteps(Runner(), torch.device("cpu"), s, lambda *_: [], clock)
    try:
        for i in range(8):
            s.add_request(Request(f"d{i}", list(range(1, 33)), max_tokens=10_000))
        ran, chunks = 0, {}
        for i in range(60):
            if i == 10:
                s.add_request(Request("doc", list(range(1, 3001)), max_tokens=4))
            pipeline.step([], must_sync=False)
            for c in pipeline.inflight[0].chunks:
                if c.request_id == "doc" and not c.is_decode:
                    chunks[ran] = len(c.token_ids)
            ran += 1
        pipeline.settle()
    finally:
        pipeline.close()
    assert pipeline.num_overlapped_steps > 50  # (the steps did overlap)
    assert s.step_cost.steps == ran  # every step learnt, the first skipped in the fit only
    assert s.step_cost.ready
    for f in (StepFeatures(0, 8, 800), StepFeatures(300, 8, 2000, chunk_attention(1000, 300))):
        assert s.step_cost.predict(f) == pytest.approx(seconds(f), rel=0.02)
    # The document's first chunk is what it learns a prefill token from; the second was
    # scheduled while the first ran (the full budget's rest, as nothing was known yet); the
    # third, with one chunk's start learnt (its attention not yet told from its tokens');
    # the rest are sized by what it learnt, their steps within the target.
    sizes = list(chunks.values())
    assert sum(sizes) == 3000 and sizes[:2] == [1024 - 8] * 2 and len(sizes) > 5
    for step in list(chunks)[3:]:
        assert took[step] <= 0.020 * 1.01 or chunks[step] == MIN_PREFILL_TOKENS


def test_a_more_urgent_prompt_takes_the_targets_share_before_a_running_document():
    """The target's small share goes to the more urgent first: an interactive prompt is not
    held back for a batch document's whole prefill (its ~30 steps where the budget alone
    took 2); a prompt of the same priority keeps its place behind the running one."""
    for chat_priority, chat_first in ((0, True), (1, False)):
        s = scheduler(20, learnt())
        decoding(s, 8)
        s.add_request(Request("doc", list(range(1, 3001)), max_tokens=4, priority=1))
        step(s)
        assert s.requests["doc"].status is RequestStatus.RUNNING_CTX  # (it holds the share)
        s.add_request(Request("chat", list(range(5, 300)), max_tokens=4,
                              priority=chat_priority))
        out = step(s)
        chunks = [c.request_id for c in out.chunks if not c.is_decode]
        assert chunks[0] == ("chat" if chat_first else "doc")
        while s.requests["doc"].status is not RequestStatus.RUNNING_GEN:
            step(s)  # and the document goes on to its end


def test_the_share_never_goes_to_a_prompt_less_urgent_than_the_one_it_puts_after():
    """Put after admission for a more urgent prompt, a running document still comes before
    prompts less urgent than itself (they wait for what it leaves)."""
    s = scheduler(20, learnt())
    decoding(s, 8)
    s.add_request(Request("doc", list(range(1, 3001)), max_tokens=4, priority=1))
    step(s)
    s.add_request(Request("chat", list(range(5, 60)), max_tokens=4, priority=0))
    s.add_request(Request("low", list(range(7, 400)), max_tokens=4, priority=5))
    out = step(s)
    prefills = [c.request_id for c in out.chunks if not c.is_decode]
    assert prefills[:2] == ["chat", "doc"]


@pytest.mark.parametrize("num_blocks", range(4, 9))
def test_a_request_admitted_in_a_step_is_not_preempted_in_it(num_blocks):
    """The prompts put after admission never make room by preempting what was just
    admitted (a step that preempts admits nothing): they wait for the next step instead."""
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8,
                                  max_model_len=4096, itl_target_ms=20, max_prefill_chunk=16),
                  KVCacheManager(BlockPool(num_blocks), 16))
    s.step_cost = learnt()
    s.add_request(Request("d0", list(range(1, 17)), max_tokens=10_000, priority=0))
    step(s)
    step(s)
    s.add_request(Request("doc", list(range(1, 100)), max_tokens=4, priority=1))
    step(s)
    assert s.requests["doc"].status is RequestStatus.RUNNING_CTX
    s.add_request(Request("chat", list(range(5, 21)), max_tokens=4, priority=0))
    s.add_request(Request("b2", list(range(9, 25)), max_tokens=4, priority=5))
    for _ in range(6):
        out = step(s)
        admitted = {n.request_id for n in out.new_requests}
        assert not admitted & set(out.preempted_ids)


def test_a_chunk_is_sized_by_where_it_starts():
    """A prompt whose first 2,000 tokens are a prefix hit: its chunk's tokens attend over
    those too, so fewer fit than of a prompt that starts at 0."""
    sizes = {}
    for name, hit in (("fresh", False), ("after a hit", True)):
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=64,
                                      max_model_len=4096, itl_target_ms=25),
                      KVCacheManager(BlockPool(4096), 16, enable_prefix_caching=True))
        s.step_cost = learnt()
        document = list(range(100, 2100))
        if hit:
            s.add_request(Request("first", document, max_tokens=1))
            while "first" in s.requests:
                step(s)
        decoding(s, 8)
        s.add_request(Request("q", document + list(range(3000, 3400)), max_tokens=4))
        out = step(s)
        [chunk] = [c for c in out.chunks if c.request_id == "q"]
        assert chunk.start_position == (2000 if hit else 0)
        assert seconds(StepFeatures.of(out.chunks)) <= 0.025 * 1.01
        sizes[name] = len(chunk.token_ids)
    assert MIN_PREFILL_TOKENS < sizes["after a hit"] < sizes["fresh"]
