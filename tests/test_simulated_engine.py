"""The simulated engine (worker/engine/simulated.py): everything real but the forward, its
tokens a documented function of each request's seed, never mistaken for a real model."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import threading

import httpx
import pytest
from fleet_fixtures import MODEL
from waiting import eventually
from worker_processes import spawn_worker, stop_all, wait_ready

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import Keys
from scheduler.output import NewRequestData, ScheduledChunk, SchedulerOutput
from worker import Engine, SamplingParams
from worker.cli.top import render, take_snapshot
from worker.engine.memory import SIMULATED_KV_TOKENS
from worker.engine.simulated import (
    PRESETS,
    SimulatedRunner,
    StepCost,
    simulated_token,
    simulated_tokens,
)
from worker.fleet.housekeeping.registration import MixedFleet, check_same_kind

KEYS = Keys()


def expected(engine: Engine, seed: int, n: int) -> list[int]:
    return [simulated_token(seed, i, engine.model_config.vocab_size, engine.eos_token_ids)
            for i in range(n)]


def test_the_token_function_is_uniform_over_the_vocabulary_less_what_it_excludes():
    drawn = [simulated_token(3, i, 10, excluded=[0, 4]) for i in range(4000)]
    assert set(drawn) == {1, 2, 3, 5, 6, 7, 8, 9}
    assert min(drawn.count(t) for t in set(drawn)) > 4000 / 8 * 0.8  # no id starved
    assert simulated_token(3, 7, 10, [0, 4]) == drawn[7]  # a pure function
    assert simulated_token(4, 7, 10, [0, 4]) != drawn[7] or drawn[7] != drawn[8]
    with pytest.raises(ValueError):
        simulated_token(1, 0, 2, excluded=[0, 1])


def test_the_runner_draws_a_step_at_once_as_the_function_draws_each_token():
    rng = random.Random(1)
    seeds = [0, 1, 2**63, 2**64 - 1, *(rng.getrandbits(64) for _ in range(300))]
    indexes = [rng.randrange(2**31) for _ in seeds]
    for vocab, excluded in ((32000, [2]), (50, [49, 0, 7]), (1000, []), (5, [1, 2, 3, 4])):
        assert simulated_tokens(seeds, indexes, vocab, excluded) == [
            simulated_token(s, i, vocab, excluded) for s, i in zip(seeds, indexes, strict=True)]


def test_a_simulated_engine_loads_no_weights_and_makes_the_documented_tokens(tiny_llama):
    engine = Engine(tiny_llama, simulate_step_ms=0, num_kv_blocks=64)
    assert engine.simulated and engine.model is None and engine.kv_cache is None
    assert isinstance(engine.runner, SimulatedRunner) and engine.async_scheduling
    prompts = [[5, 6, 7], [8, 9, 10, 11] * 9, "hello"]
    params = [SamplingParams(max_tokens=n, seed=s, temperature=t)
              for n, s, t in ((40, 1, 0.0), (25, 2, 0.7), (30, 3, 1.0))]
    done = engine.generate(prompts, params)
    for completion, p in zip(done, params, strict=True):
        # Sampling settings do not change it; end-of-sequence ids are never drawn.
        assert completion.token_ids == expected(engine, p.seed, p.max_tokens)
        assert completion.finish_reason == FinishReason.LENGTH
        assert completion.text == engine.tokenizer.decode(completion.token_ids)
    # Stop token ids end a simulated request as they end a real one.
    stop_at = expected(engine, 1, 40)[10]
    [stopped] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=40, seed=1,
                                                            stop_token_ids=[stop_at]))
    first = expected(engine, 1, 40).index(stop_at)
    assert stopped.token_ids == expected(engine, 1, first + 1)
    assert stopped.finish_reason == FinishReason.STOP
    # Log-probabilities need logits, which it has none of.
    with pytest.raises(ValueError, match="simulated"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2, logprobs=1))
    assert engine.stats()["simulated"] == 1
    engine.close()


def test_a_simulated_device_runs_the_steps_handed_to_it_back_to_back():
    """A step starts when the one before it ends or when the engine handed it over, whichever
    is later, however late the runner thread comes to it (a GPU's stream)."""
    clock = ManualClock()
    runner = SimulatedRunner(StepCost(base_ms=5), vocab_size=100, eos_token_ids=[0],
                             clock=clock)

    def step(n: int) -> SchedulerOutput:
        rid = f"r{n}"
        return SchedulerOutput(
            chunks=[ScheduledChunk(rid, [5], 3, [0], 0, True, 0)],
            new_requests=[NewRequestData(rid, SamplingParams(), n, [1, 2, 3], [])])

    def ends_after(out: SchedulerOutput, seconds: float) -> bool:
        """Whether ``out``, run on a thread, has ended once the clock moved ``seconds``."""
        worker = threading.Thread(target=runner.execute, args=(out,))
        worker.start()
        clock.advance(seconds)
        worker.join(timeout=30)
        return not worker.is_alive()

    first, second = step(1), step(2)
    runner.queued(first)
    runner.queued(second)  # both handed over at 0
    assert ends_after(first, 0.005)  # the first ended at 5 ms
    clock.advance(0.002)  # the runner thread comes to the second at 7 ms
    assert ends_after(second, 0.003)  # 10 ms: it ran from 5 ms, when the device was free
    assert runner.simulated_ms == 10
    # A step with nothing to compute (swaps only) takes its hand-over time with it: the
    # next step, handed over after an idle 10 ms, starts then and not in the past.
    swaps_only = SchedulerOutput(swap_out=[(1, 1)])
    runner.queued(swaps_only)
    assert runner.execute(swaps_only) == ({}, {}, {})
    clock.advance(0.010)
    third = step(3)
    runner.queued(third)
    assert ends_after(third, 0.005)
    assert runner._device_free_at == pytest.approx(0.025)  # 20 ms + its 5, not 10 + 5


def test_a_simulated_pool_holds_max_num_seqs_full_sequences_unless_told(tiny_llama):
    engine = Engine(tiny_llama, simulate_step_ms=1, max_num_seqs=4)
    full = math.ceil(engine.max_model_len / engine.config.block_size)
    assert engine.stats()["kv_blocks_total"] == 4 * full  # no CPU memory cap: a GPU's pool
    assert 4 * full * engine.config.block_size <= SIMULATED_KV_TOKENS  # (under the cap)
    engine.close()
    seqs = SIMULATED_KV_TOKENS // (full * engine.config.block_size) * 2  # twice the cap
    engine = Engine(tiny_llama, simulate_step_ms=1, max_num_seqs=seqs,
                    max_num_batched_tokens=seqs)
    assert engine.stats()["kv_blocks_total"] == SIMULATED_KV_TOKENS // engine.config.block_size
    engine.close()
    engine = Engine(tiny_llama, simulate_step_ms=1, max_num_seqs=4, num_kv_blocks=10)
    assert engine.stats()["kv_blocks_total"] == 10
    engine.close()


def test_the_step_cost_is_its_formula_and_settings_are_checked(tmp_path):
    cost = StepCost(base_ms=1, prefill_token_ms=0.5, decode_row_ms=0.25, context_token_ms=0.01)
    assert cost.step_ms(prefill_tokens=10, decode_rows=4, context_tokens=100) == 1 + 5 + 1 + 1
    assert StepCost.load("h200-8b") is PRESETS["h200-8b"]
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"base_ms": 2, "decode_row_ms": 0.1}))
    assert StepCost.load(str(path)) == StepCost(base_ms=2, decode_row_ms=0.1)
    path.write_text(json.dumps({"base_ms": 2, "bogus": 1}))
    with pytest.raises(ValueError, match="bogus|some of"):
        StepCost.load(str(path))
    with pytest.raises(ValueError, match="preset"):
        StepCost.load("no-such-preset")
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(base_ms=-1)
    with pytest.raises(ValueError, match="not both"):
        Engine(tmp_path, simulate_step_ms=1, simulate_cost="h200-8b")


def test_a_simulated_worker_serves_the_fleet_and_says_it_is_simulated(
        redis_url, redis_client, start_worker, gateway):
    worker = start_worker(simulate_step_ms=2, metrics_port=0)
    with Client(redis_url) as client:
        rids = [client.submit([5, 6, 7, i], model=MODEL, max_tokens=30, seed=i)
                for i in range(8)]
        results = [client.result(rid, timeout=60) for rid in rids]
    for i, result in enumerate(results):
        assert result.token_ids == expected(worker.engine, i, 30)
    assert redis_client.hget(KEYS.model(MODEL), "simulated") == b"1"
    assert redis_client.hget(KEYS.worker(worker.config.worker_id), "simulated") == b"1"
    assert worker.status()["simulated"] == "1"
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics") as r:
        assert 'conveyor_engine_simulated{model="tiny"} 1.0' in r.read().decode()
    # `conveyor top` and the gateway's model list say so too.
    with Client(redis_url) as client:
        assert "both SIMULATED" in render(take_snapshot(client))
    [entry] = httpx.get(f"{gateway.api}/models").json()["data"]
    assert entry["id"] == MODEL and entry["simulated"] is True
    assert entry["owned_by"] == "conveyor (simulated)"
    assert httpx.get(f"{gateway.api}/models/{MODEL}").json()["simulated"] is True
    # What it cannot serve is a 400 naming the field before anything is queued, streamed
    # or not (not a 200 and an error event).
    asks = [({"logprobs": 1}, "logprobs"), ({"echo": True, "logprobs": 0}, "logprobs"),
            ({"response_format": {"type": "json_object"}}, "response_format")]
    for extra, field in asks:
        for stream in (False, True):
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": stream, **extra}
            refused = httpx.post(f"{gateway.api}/completions", json=body, timeout=30)
            assert refused.status_code == 400, (extra, stream, refused.text)
            error = refused.json()["error"]
            assert error["param"] == field and "simulated" in error["message"]


def test_a_simulated_and_a_real_worker_refuse_to_serve_one_model_together(
        redis_url, tiny_llama, start_worker, tmp_path):
    # A real worker serves "tiny": a simulated process for the same name refuses to start.
    real = start_worker(worker_id="real")
    simulated = spawn_worker(tiny_llama, redis_url, "sim", "--simulate-step-ms", "1",
                             log_dir=tmp_path)
    assert simulated.wait(120) == 2
    log = (tmp_path / "sim.log").read_text()
    assert "served by real worker 'real'" in log and "--served-model-name" in log
    real.stop(drain_timeout_s=5)
    eventually(lambda: real.state == "stopped", "the real worker to stop")

    # A simulated one serves it now: a real process refuses, and says why.
    with Client(redis_url) as client:
        procs = [spawn_worker(tiny_llama, redis_url, "sim2", "--simulate-step-ms", "1")]
        try:
            wait_ready(client, "sim2", procs[0])
            eventually(lambda: client.redis.hget(KEYS.worker("sim2"), "status") == b"serving",
                       "the simulated worker to serve")
            late = subprocess.run(
                [sys.executable, "-m", "worker.cli", "worker", "--model", str(tiny_llama),
                 "--served-model-name", MODEL, "--redis", redis_url, "--name", "late",
                 "--dtype", "float64", "--threads", "1"],
                capture_output=True, text=True, timeout=120)
        finally:
            stop_all(procs)
    assert late.returncode == 2
    assert "served by simulated worker 'sim2'" in late.stderr


def test_mixing_is_refused_before_anything_is_registered(redis_url, redis_client,
                                                          start_worker):
    start_worker(worker_id="real")
    sim = start_worker(worker_id="sim", autostart=False, simulate_step_ms=1)
    with pytest.raises(MixedFleet):
        sim.start()
    assert redis_client.hget(KEYS.model(MODEL), "simulated") == b""  # still the real one's


def test_a_worker_checks_the_kind_after_its_own_starting_heartbeat_is_out(
        redis_url, redis_client, start_worker, monkeypatch):
    """Two workers of both kinds starting at once: each checks after its heartbeat says
    "starting" with its model and kind, so at least one sees the other and refuses."""
    from worker.fleet import process

    seen = {}

    def spy(client, keys, name, simulated, worker_id):
        seen.update(redis_client.hgetall(KEYS.worker(worker_id)))
        return check_same_kind(client, keys, name, simulated, worker_id)

    monkeypatch.setattr(process, "check_same_kind", spy)
    sim = start_worker(worker_id="sim-a", autostart=False, simulate_step_ms=1)
    # A real worker for the same name that has only begun to start (its heartbeat is out).
    redis_client.hset(KEYS.worker("real-b"), mapping={"worker_id": "real-b", "model": MODEL,
                                                      "status": "starting", "simulated": ""})
    redis_client.sadd(KEYS.workers, "real-b")
    redis_client.delete(KEYS.model(MODEL))  # (its beats write a lost registration again)
    with pytest.raises(MixedFleet, match="real-b"):
        sim.start()
    assert seen[b"status"] == b"starting" and seen[b"simulated"] == b"1"  # out before it
    assert not redis_client.exists(KEYS.worker("sim-a"))  # taken back when it refused
    assert not redis_client.sismember(KEYS.workers, "sim-a")
    assert not redis_client.exists(KEYS.model(MODEL))  # and it registered nothing


def test_simulated_prefill_and_decode_workers_hand_requests_on_without_kv(
        redis_url, start_worker):
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"},
                           simulate_step_ms=1)
    decode = start_worker(worker_id="decode-0", config={"role": "decode"},
                          simulate_step_ms=1)
    with Client(redis_url) as client:
        rids = [client.submit([5, 6, 7, i] * 5, model=MODEL, max_tokens=12, seed=100 + i)
                for i in range(4)]
        results = [client.result(rid, timeout=60) for rid in rids]
    for i, result in enumerate(results):
        # The first token from the prefill worker, the rest from the decode worker: one
        # function of the seed, as if one worker had made them all.
        assert result.token_ids == expected(decode.engine, 100 + i, 12)
    assert prefill.status()["handed_on"] == 4
    # No KV went with them: the decode side computed each prompt itself.
    assert decode.status()["kv_imported"] == 0
    assert decode.status()["prompt_tokens_computed"] >= sum(4 * 5 for _ in rids)


def test_a_simulated_worker_recomputes_a_handoff_a_real_prefill_worker_left_with_kv(
        redis_url, start_worker):
    # A real prefill worker hands a request on, with its KV, and stops before any decode
    # worker came; the model's workers are simulated from then on.
    prefill = start_worker(worker_id="prefill-0", config={"role": "prefill"})
    with Client(redis_url) as client:
        rid = client.submit([5, 6, 7] * 8, model=MODEL, max_tokens=6, seed=9)
        eventually(lambda: prefill.status()["handed_on"] == 1, "the hand-on")
        prefill.stop(drain_timeout_s=5)
        decode = start_worker(worker_id="decode-0", config={"role": "decode"},
                              simulate_step_ms=1)
        result = client.result(rid, timeout=60)
    # It has no KV to take: it computes the prompt again (a fallback), and goes on serving.
    assert len(result.token_ids) == 6
    assert result.token_ids[1:] == expected(decode.engine, 9, 6)[1:]
    assert "mismatch=1" in decode.status()["kv_fallbacks"]
    assert decode.state == "serving"
