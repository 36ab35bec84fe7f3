"""The scheduler, driven with fake runner outputs: budget, order, chunking, states, blocks."""

from __future__ import annotations

import random

import pytest

from kvstore import BlockPool, KVCacheManager
from producer.wire.completion import FinishReason
from producer.wire.params import SamplingParams
from scheduler import Request, RequestStatus, Scheduler, SchedulerConfig
from scheduler.deadlines import Deadlines

EOS = 0


def make_scheduler(num_blocks: int = 64, block_size: int = 4, **cfg) -> Scheduler:
    cfg.setdefault("max_model_len", 512)
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(BlockPool(num_blocks), block_size))


def request(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), max_tokens=max_tokens, priority=priority,
                   eos_token_ids=frozenset({EOS}))


def run_step(s: Scheduler, token: int = 7):
    out = s.schedule()
    updates = s.update(out, {c.request_id: token for c in out.chunks if c.sample})
    return out, updates


def test_budget_is_never_exceeded_and_decodes_come_first():
    s = make_scheduler(num_blocks=256, max_num_batched_tokens=32, max_num_seqs=32)
    rng = random.Random(0)
    for i in range(20):
        s.add_request(request(f"r{i}", rng.randint(1, 90), max_tokens=rng.randint(1, 20)))
    steps = 0
    while s.has_unfinished():
        out, _ = run_step(s)
        assert 0 < out.num_batched_tokens <= 32
        kinds = [c.is_decode for c in out.chunks]
        # Once a chunk is a prefill, no decode follows it.
        assert kinds == sorted(kinds, reverse=True)
        steps += 1
        assert steps < 500
    assert s.kv.pool.num_free == 256


def test_long_prompt_is_prefilled_in_chunks_that_advance():
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=16)
    s.add_request(request("long", 50, max_tokens=2))
    starts = []
    for _ in range(4):
        out, updates = run_step(s)
        (chunk,) = out.chunks
        starts.append((chunk.start_position, chunk.num_tokens, chunk.sample))
    assert starts == [(0, 16, False), (16, 16, False), (32, 16, False), (48, 2, True)]
    assert s.requests["long"].status is RequestStatus.RUNNING_GEN
    out, updates = run_step(s)
    assert out.chunks[0].start_position == 50 and out.chunks[0].is_decode
    assert updates[0].finished and updates[0].finish_reason == "length"


def test_prefill_chunk_cap_limits_one_request_but_not_the_step():
    s = make_scheduler(max_num_batched_tokens=64, max_prefill_chunk=8)
    s.add_request(request("a", 30))
    s.add_request(request("b", 30))
    out = s.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 8), ("b", 8)]


def test_state_machine_waiting_ctx_gen_finished():
    s = make_scheduler(max_num_batched_tokens=4, max_num_seqs=4)
    req = request("r", 6, max_tokens=2)
    s.add_request(req)
    assert req.status is RequestStatus.WAITING
    run_step(s)
    assert req.status is RequestStatus.RUNNING_CTX and req.num_computed_tokens == 4
    run_step(s)
    assert req.status is RequestStatus.RUNNING_GEN and req.output_token_ids == [7]
    _, updates = run_step(s)
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert not s.has_unfinished()


def test_eos_stops_unless_ignored_and_stop_token_ids_stop():
    s = make_scheduler()
    s.add_request(request("eos", 3))
    ignoring = request("ignore", 3, max_tokens=3)
    ignoring.ignore_eos = True
    s.add_request(ignoring)
    stopper = request("stop", 3)
    stopper.stop_token_ids = frozenset({5})
    s.add_request(stopper)
    out = s.schedule()
    updates = {u.request_id: u for u in s.update(out, {"eos": EOS, "ignore": EOS, "stop": 5})}
    assert updates["eos"].finish_reason == "stop"
    assert updates["stop"].finish_reason == "stop"
    assert not updates["ignore"].finished


@pytest.mark.parametrize("overlapped", [False, True], ids=["plain", "overlapped"])
def test_a_request_ends_at_the_model_length_or_max_tokens_whichever_comes_first(overlapped):
    """stop_reason's rules, as the scheduler folds them into each request when it is added:
    the same on plain steps (update) and overlapped ones (advance, then resolve)."""
    s = make_scheduler(max_model_len=16)
    s.add_request(request("model", 12, max_tokens=100))  # 4 tokens reach the model's length
    s.add_request(request("own", 3, max_tokens=2))
    made: dict[str, list[int]] = {"model": [], "own": []}
    reasons = {}
    for _ in range(10):
        out = s.schedule()
        sampled = {c.request_id: 7 for c in out.chunks if c.sample}
        if overlapped:
            s.advance(out)
            updates = s.resolve(out, sampled)
        else:
            updates = s.update(out, sampled)
        for u in updates:
            made[u.request_id] += u.new_token_ids
            if u.finished:
                reasons[u.request_id] = u.finish_reason
    assert (len(made["model"]), len(made["own"])) == (4, 2)
    assert reasons == {"model": "length", "own": "length"} and not s.has_unfinished()


def test_finished_requests_free_their_blocks():
    s = make_scheduler(num_blocks=32)
    s.add_request(request("a", 10, max_tokens=3))
    run_step(s)
    assert s.kv.pool.num_free == 32 - 3
    while s.has_unfinished():
        run_step(s)
    assert s.kv.pool.num_free == 32


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(max_num_seqs=2)
    s.add_request(request("late-low", 4, priority=5))
    s.add_request(request("first", 4))
    s.add_request(request("urgent", 4, priority=-1))
    out = s.schedule()
    assert [c.request_id for c in out.chunks] == ["urgent", "first"]


def test_max_num_seqs_bounds_running_requests():
    s = make_scheduler(max_num_seqs=3)
    for i in range(10):
        s.add_request(request(f"r{i}", 2))
    out = s.schedule()
    assert len(out.chunks) == 3 and s.num_running == 3 and s.num_waiting == 7


def test_cancel_a_waiting_and_a_running_request():
    s = make_scheduler(num_blocks=16, max_num_seqs=1)
    s.add_request(request("running", 4))
    s.add_request(request("waiting", 4))
    run_step(s)
    s.finish_request("waiting", FinishReason.CANCELLED)
    s.finish_request("running", FinishReason.CANCELLED)
    assert not s.has_unfinished() and s.kv.pool.num_free == 16
    assert s.schedule().is_empty


def test_memory_pressure_preempts_least_urgent_and_it_recomputes():
    # 6 blocks of 4 slots: two requests of 8-token prompts that each grow to 16 tokens.
    s = make_scheduler(num_blocks=6, block_size=4)
    s.add_request(request("old", 8, max_tokens=8))
    s.add_request(request("new", 8, max_tokens=8))
    preempted = []
    for _ in range(100):
        if not s.has_unfinished():
            break
        out, _ = run_step(s)
        preempted += out.preempted_ids
        assert s.kv.pool.num_used <= 6
    assert not s.has_unfinished()
    assert preempted and preempted[0] == "new"  # the later arrival yields
    assert s.kv.pool.num_free == 6


def test_step_that_preempts_admits_nothing_new():
    s = make_scheduler(num_blocks=4, block_size=4)
    s.add_request(request("a", 4, max_tokens=10))
    s.add_request(request("b", 4, max_tokens=10))
    for _ in range(3):
        run_step(s)
    s.add_request(request("c", 1))
    for _ in range(20):
        out = s.schedule()
        if out.preempted_ids:
            assert "c" not in [c.request_id for c in out.chunks]
            break
        s.update(out, {c.request_id: 7 for c in out.chunks if c.sample})
    else:
        pytest.fail("expected a preemption")


def test_chunked_prefill_off_schedules_whole_prompts():
    s = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    s.add_request(request("a", 40))
    s.add_request(request("b", 40))
    out = s.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 40)]


def test_chunked_prefill_off_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)


def test_a_budget_below_one_token_per_running_request_is_refused():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16)
    SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=16)  # one token each: enough


def test_duplicate_request_id_is_rejected():
    s = make_scheduler()
    s.add_request(request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(request("x", 3))


@pytest.fixture
def hashed(monkeypatch) -> list[bytes]:
    """Every block hash computed, in order."""
    import kvstore.prefix_hash as prefix_hash

    seen: list[bytes] = []
    real = prefix_hash.block_hash

    def counting(parent, tokens):
        seen.append(real(parent, tokens))
        return seen[-1]

    monkeypatch.setattr(prefix_hash, "block_hash", counting)
    return seen


def distinct(rid: str, first: int, n: int, max_tokens: int) -> Request:
    return Request(rid, list(range(first, first + n)), max_tokens=max_tokens)


def test_a_waiting_request_hashes_its_prompt_once(hashed):
    kv = KVCacheManager(BlockPool(16), 4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_model_len=512, max_num_batched_tokens=64), kv)
    s.add_request(distinct("big", 100, 36, max_tokens=8))  # up to 11 of the 16 blocks
    run_step(s)
    s.add_request(distinct("blocked", 500, 30, max_tokens=4))  # needs 8: waits
    for _ in range(5):
        run_step(s)
        assert s.requests["blocked"].status is RequestStatus.WAITING
    assert len(hashed) == len(set(hashed))  # 7 prompt blocks hashed once, not 5 times
    while s.has_unfinished():
        run_step(s)
    assert len(hashed) == len(set(hashed))


def test_a_swapped_request_does_not_hash_its_blocks_again(hashed):
    kv = KVCacheManager(BlockPool(10), 4, host_pool=BlockPool(64), enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_model_len=512, max_num_batched_tokens=64,
                                  preemption_mode="swap"), kv)
    s.add_request(distinct("a", 100, 12, max_tokens=20))
    s.add_request(distinct("b", 500, 12, max_tokens=20))  # together they outgrow the pool
    while s.has_unfinished():
        run_step(s)
    assert s.counters["preemptions_swap"] > 0
    assert len(hashed) == len(set(hashed))


def test_deadlines_give_live_overdue_requests_and_forget_finished_ones():
    deadlines = Deadlines()
    first, other, reused = object(), object(), object()
    deadlines.add("a", 1.0, first)
    deadlines.add("b", 5.0, other)
    assert list(deadlines.overdue(0.5)) == []
    deadlines.discard("a")  # finished before its deadline; then its id is used again
    deadlines.add("a", 2.0, reused)
    assert list(deadlines.overdue(1.5)) == []  # the finished request's entry is not live
    assert list(deadlines.overdue(2.0)) == ["a"]
    deadlines.discard("a")
    deadlines.discard("b")
    assert len(deadlines) == 0  # nothing outlives the requests


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_is_handed_to_the_runner_once_and_again_only_after_preemption(mode):
    """``new_requests`` names exactly the chunks that start a table of their own (admission,
    swap-in, resumption), with the request's sampling state and its output so far."""
    s = Scheduler(SchedulerConfig(max_model_len=512, preemption_mode=mode),
                  KVCacheManager(BlockPool(6), 4, host_pool=BlockPool(16)))
    for rid in ("old", "new"):
        s.add_request(Request(rid, list(range(1, 9)), max_tokens=8, seed=len(rid),
                              sampling_params=SamplingParams(temperature=0.5 * len(rid))))
    handed: dict[str, list[list[int]]] = {"old": [], "new": []}
    preempted = []
    while s.has_unfinished():
        out, _ = run_step(s)
        fresh = [c.request_id for c in out.chunks if c.num_known_blocks == 0]
        assert [n.request_id for n in out.new_requests] == fresh
        for n in out.new_requests:
            assert (n.seed, n.sampling_params.temperature) == (len(n.request_id),
                                                               0.5 * len(n.request_id))
            handed[n.request_id].append(n.output_token_ids)
        preempted += out.preempted_ids
    assert preempted == ["new"] and s.counters[f"preemptions_{mode}"] == 1
    assert handed["old"] == [[]]  # once, at admission
    (first, again) = handed["new"]  # and again when it came back, with what it had
    assert first == [] and again and again == [7] * len(again)


def test_a_decode_that_takes_a_new_block_keeps_its_place_in_the_step():
    """Decodes come in the order they run, step after step, whichever of them starts a
    block: the runner lays a steady batch's sampling rows out once."""
    s = make_scheduler(num_blocks=256, max_num_seqs=8)
    for i in range(8):
        s.add_request(request(f"r{i}", 1 + i, max_tokens=40))
    run_step(s)
    order = [c.request_id for c in run_step(s)[0].chunks]
    crossed = 0
    for _ in range(20):
        out, _ = run_step(s)
        assert [c.request_id for c in out.chunks] == order
        crossed += sum(1 for c in out.chunks if c.new_block_ids)
    assert crossed >= 20  # every few steps one of them started a block
