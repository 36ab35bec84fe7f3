"""Overlapped steps (``async_scheduling``, worker/engine/step_pipeline.py): step N+1 is scheduled
while step N runs on the runner thread, with pending tokens as its inputs. Every output must
be what the plain engine produces, on every path: sampling, seeds, penalties, stop tokens,
preemption by swap and recompute, cancellation, deadlines, KV exports."""

from __future__ import annotations

import random

import pytest
from test_memory_pressure import blocks_needed, pressure_workload, run

from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from scheduler.output import PENDING_TOKEN
from worker import Engine, SamplingParams
from worker.fleet.handoff.engine_kv import add_with_kv, export_kv, export_prefix_blocks


def mixed_params(n: int, seed: int = 0, penalties: bool = False) -> list[SamplingParams]:
    """Greedy, seeded top-p, min-p, top-k with stop tokens, logprobs (and penalties)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 5
        kw: dict = {"max_tokens": rng.randint(1, 40), "seed": i}
        if kind == 0:
            kw.update(temperature=0, ignore_eos=True)
        elif kind == 1:
            kw.update(temperature=1.0, top_p=0.9)
        elif kind == 2 and penalties:
            kw.update(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.3,
                      repetition_penalty=1.2)
        elif kind == 2:
            kw.update(temperature=0.9, min_p=0.1)
        elif kind == 3:  # stop tokens that end some requests early, mid-flight
            kw.update(temperature=0.7, top_k=20,
                      stop_token_ids=[rng.randrange(2, 1000) for _ in range(64)])
        else:
            kw.update(temperature=0, logprobs=2)
        out.append(SamplingParams(**kw))
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(2, 1000) for _ in range(40)]  # prefix-cache hits too
    return [shared[:rng.choice([0, 16, 33, 40])]
            + [rng.randrange(2, 1000) for _ in range(rng.randint(1, 50))] for _ in range(n)]


def completions(engine: Engine, ps, params):
    done = engine.generate(ps, params)
    return [(c.token_ids, c.finish_reason, [lp.logprob for lp in c.logprobs or []])
            for c in done]


def assert_same(got, want) -> None:
    """Tokens and finish reasons equal; logprobs equal to 1e-12: the two engines batch a
    request's steps with other rows, and on some BLAS builds a float64 matmul's last bits
    follow its row count (a wrong row or token is off in the first digits)."""
    assert [(t, r) for t, r, _ in got] == [(t, r) for t, r, _ in want]
    for (_, _, lps), (_, _, want_lps) in zip(got, want, strict=True):
        assert lps == pytest.approx(want_lps, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("penalties", [False, True])
def test_sampled_seeded_and_stopped_requests_match_the_plain_engine(tiny_llama, penalties):
    ps, params = prompts(30), mixed_params(30, penalties=penalties)
    plain = Engine(tiny_llama, dtype="float64", num_kv_blocks=400)
    overlapped = Engine(tiny_llama, dtype="float64", num_kv_blocks=400, async_scheduling=True)
    want = completions(plain, ps, params)
    got = completions(overlapped, ps, params)
    assert_same(got, want)
    assert any(reason == FinishReason.STOP for _, reason, _ in want)  # stop tokens did stop
    assert overlapped.num_overlapped_steps > 0
    if not penalties:
        assert overlapped.num_overlapped_steps >= overlapped.num_steps - 2
    assert overlapped.block_pool.num_free == overlapped.block_pool.num_blocks
    overlapped.close()


@pytest.mark.parametrize(("mode", "swap_blocks"), [("swap", 400), ("recompute", 0),
                                                   ("auto", 12)])
def test_under_memory_pressure_outputs_match_and_preemption_still_happens(tiny_llama, mode,
                                                                         swap_blocks):
    work = pressure_workload()
    expected = run(Engine(tiny_llama, dtype="float64", num_kv_blocks=blocks_needed(work) + 16,
                          max_num_seqs=64, max_num_batched_tokens=512), work)
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=blocks_needed(work) // 4,
                    swap_blocks=swap_blocks, preemption_mode=mode, max_num_seqs=64,
                    max_num_batched_tokens=512, block_shuffle_seed=3, async_scheduling=True)
    starved = []
    schedule = engine.scheduler.schedule

    def recording(**kwargs):
        out = schedule(**kwargs)
        starved.append(out.starved)
        return out

    engine.scheduler.schedule = recording
    assert run(engine, work) == expected
    stats = engine.stats()
    # The pressure was real: overlapped steps left requests out, plain ones preempted.
    assert any(starved) and stats["preemptions"] > 0
    assert engine.num_overlapped_steps > 0
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    engine.block_pool.check_invariants()
    engine.close()


def test_a_request_cancelled_while_its_step_runs_gets_nothing_after_its_final(tiny_llama):
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, async_scheduling=True)
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    keep, drop = engine.add_request([5, 6, 7], params), engine.add_request([8, 9], params)
    got: dict[str, list] = {keep: [], drop: []}
    for _ in range(6):
        for out in engine.step():
            got[out.request_id].append(out)
    assert engine._pipeline.inflight is not None  # a step with both requests is under way
    final = engine.abort(drop)
    assert final is not None and final.finish_reason == FinishReason.CANCELLED
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    assert not got[drop] or not got[drop][-1].finished  # its only final is the abort's
    # Every token computed for it, the running step's in the final itself.
    whole = [t for o in [*got[drop], final] for t in o.new_token_ids]
    assert final.completion.token_ids == whole and final.new_token_ids
    assert got[keep][-1].finished and len([t for o in got[keep] for t in o.new_token_ids]) == 50
    assert engine.block_pool.num_free == engine.block_pool.num_blocks
    engine.close()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("calls", [1, 2, 5])
def test_a_deadline_ends_a_request_with_what_plain_steps_give_it(tiny_llama, calls):
    """The same calls on both engines, then the deadline passes: the same completion (the
    running step's token is kept, not thrown away)."""
    finals = {}
    for overlapped in (False, True):
        clock = ManualClock()
        engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, clock=clock,
                        async_scheduling=overlapped)
        rid = engine.add_request([5, 6, 7], greedy(100), deadline=clock.time() + 10)
        outs = []
        for _ in range(calls):
            outs += engine.step()
        clock.advance(11)
        while engine.has_unfinished():
            outs += engine.step()
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert outs[-1].request_id == rid and outs[-1].finish_reason == FinishReason.EXPIRED
        assert outs[-1].completion.token_ids == [t for o in outs for t in o.new_token_ids]
        finals[overlapped] = outs[-1].completion.token_ids
        engine.close()
    assert finals[True] == finals[False] and len(finals[False]) == calls


def test_a_cancel_after_a_settled_step_gets_its_tokens_in_the_final(tiny_llama):
    """A step finished early (a KV import settles it) holds its outputs for the next step();
    a cancel then must bring them in its final, and nothing may follow that final."""
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, async_scheduling=True)
    source = Engine(tiny_llama, dtype="float64", num_kv_blocks=200)
    source.add_request([20, 21, 22, 23], greedy(5), request_id="s")
    source.step()  # its prompt's KV, to import
    kv = export_kv(source, "s")
    rid = engine.add_request([5, 6, 7], greedy(50))
    seen = []
    for _ in range(4):
        seen += engine.step()
    assert engine._pipeline.inflight is not None
    add_with_kv(engine, source.token_ids("s"), greedy(3), kv)  # settles the running step
    pipeline = engine._pipeline
    assert pipeline.inflight is None and any(o.request_id == rid for o in pipeline.ready)
    final = engine.abort(rid)
    assert final is not None and final.finished and final.new_token_ids
    seen.append(final)
    while engine.has_unfinished():
        seen += engine.step()
    mine = [o for o in seen if o.request_id == rid]
    assert mine[-1] is final  # nothing after the final
    assert final.completion.token_ids == [t for o in mine for t in o.new_token_ids]
    engine.close()


def test_prefix_blocks_are_exported_beside_a_running_step_even_if_it_ends_the_request(
        tiny_llama):
    """What a worker sharing prefixes does right after a request's first token; the step
    running then may be the request's last (max_tokens=2)."""
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, async_scheduling=True)
    plain = Engine(tiny_llama, dtype="float64", num_kv_blocks=200)
    prompt = list(range(30, 70))  # two full blocks and a partial one
    for e in (engine, plain):
        e.add_request(prompt, greedy(2), request_id="p")
    firsts = []
    while not firsts:
        firsts = [o for o in engine.step() if o.request_id == "p"]
    assert engine._pipeline.inflight is not None  # its second (last) token is being computed
    blocks = export_prefix_blocks(engine, "p")
    assert engine._pipeline.inflight is not None  # it did not have to wait for that step
    plain.step()
    assert blocks == export_prefix_blocks(plain, "p") and len(blocks) == 2
    engine.close()


def test_tokens_and_kv_read_from_outside(tiny_llama):
    """token_ids: what steps returned so far, the running step's token not among them;
    export_kv: finishes the running step first, so tokens and KV agree."""
    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, async_scheduling=True)
    plain = Engine(tiny_llama, dtype="float64", num_kv_blocks=200)
    for e in (engine, plain):
        e.add_request([5, 6, 7, 8] * 5, greedy(30), request_id="r")
    seen = []
    for _ in range(8):
        seen += engine.step()
    for _ in range(7):  # the plain engine, to the steps the overlapped one returned
        plain.step()
    assert engine._pipeline.inflight is not None
    tokens = engine.token_ids("r")
    assert PENDING_TOKEN not in tokens and tokens == plain.token_ids("r")
    kv = export_kv(engine, "r")  # finishes the running step first
    assert engine._pipeline.inflight is None
    plain.step()
    assert export_kv(plain, "r") == kv  # the same KV bytes
    assert engine.token_ids("r") == plain.token_ids("r")
    # The settled step's output is not lost: it comes with the next step.
    while engine.has_unfinished():
        seen += engine.step()
    want = Engine(tiny_llama, dtype="float64").generate([[5, 6, 7, 8] * 5], greedy(30))[0]
    assert [t for o in seen for t in o.new_token_ids] == want.token_ids
    engine.close()


def test_it_is_on_by_default_only_on_cuda(tiny_llama):
    engine = Engine(tiny_llama, dtype="float32", num_kv_blocks=16)
    assert engine.device.type == "cpu" and engine.async_scheduling is False


def test_an_id_reused_while_its_stopped_request_is_still_in_a_step(tiny_llama):
    """A stop token ends "r" when its next step is already under way; "r" is then reused by
    a new request, which must get nothing of the old one's step (tokens, KV, cache)."""
    greedy = dict(temperature=0, ignore_eos=True)
    plain = Engine(tiny_llama, dtype="float64", num_kv_blocks=200)
    first = plain.generate([[5, 6, 7]], SamplingParams(max_tokens=20, **greedy))[0].token_ids
    stop_at = first[4]
    new_prompt = [11, 12, 13] * 12  # two full blocks: the prefix cache is at stake too
    want = plain.generate([new_prompt, new_prompt + [40, 41]],
                          SamplingParams(max_tokens=10, **greedy))

    engine = Engine(tiny_llama, dtype="float64", num_kv_blocks=200, async_scheduling=True)
    engine.add_request([9, 10], SamplingParams(max_tokens=40, **greedy))  # keeps steps going
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[stop_at],
                                                 **greedy), request_id="r")
    while not any(o.request_id == "r" and o.finished for o in engine.step()):
        pass
    # The step after the one that stopped it is under way, with the old "r" in it.
    assert engine._pipeline.inflight is not None
    assert "r" in {c.request_id for c in engine._pipeline.inflight[0].chunks}
    engine.add_request(new_prompt, SamplingParams(max_tokens=10, **greedy), request_id="r")
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() if o.request_id == "r" for t in o.new_token_ids]
    assert tokens == want[0].token_ids
    again = engine.generate([new_prompt + [40, 41]], SamplingParams(max_tokens=10, **greedy))
    assert again[0].token_ids == want[1].token_ids
    assert engine.stats()["prefix_cache_hit_tokens"] > 0  # it read the new r's blocks
    engine.close()


def test_the_runner_thread_of_a_cuda_engine_takes_its_device_by_index(monkeypatch):
    """torch.cuda.set_device refuses a device without an index ("cuda", what "auto" picks):
    the runner thread is given the index. Checked here by recording the calls, since this
    machine has no GPU (tests/gpu runs it for real)."""
    import torch

    from worker.engine.step_pipeline import RunnerThread

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    thread = RunnerThread(runner=None, device=torch.device("cuda"))  # type: ignore[arg-type]
    assert thread.submit(lambda: "ran").result() == "ran"
    thread.close()
    assert calls == [3]
