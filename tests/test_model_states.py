"""Nothing hangs: one rule per model state (docs/reliability.md, "Model states").

States are made for real: "never registered" is an empty namespace (or other models only),
"registered, no live worker" a model hash whose worker stopped (a real one, or a hash and a
stale heartbeat written by hand), "live worker" an in-process worker (``start_worker``).
Each test first shows the state it is in, then the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from fleet_fixtures import MODEL
from rq.job import Job
from rq.serializers import JSONSerializer
from structlog.testing import capture_logs
from waiting import eventually

from producer.bulk import AnalysisFailed, bulk_queue, enqueue_analyze, run_batch_file
from producer.bulk.analyze import Progress, wait_for_model
from producer.bulk.requests import RetryPolicy
from producer.client.async_client import AsyncClient
from producer.client.client import Client
from producer.client.models import (
    LIVE,
    NO_LIVE_WORKER,
    NOT_REGISTERED,
    model_states,
    pick_default_model,
)
from producer.clock import ManualClock
from producer.wire.errors import ModelNotFound
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, OutputChunk, error_final
from worker.cli.client_verbs import add_client_parsers, resolve_model, run_client_cmd
from worker.cli.command import build_parser
from worker.cli.top import run_top_cmd

KEYS = Keys()
ROOT = Path(__file__).resolve().parents[1]
GHOST = "ghost"  # registered by hand; its worker is long gone


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def register(r: redis.Redis, name: str, stale_worker: str | None = None) -> None:
    """A model hash as a worker leaves it; with ``stale_worker``, that worker's last heartbeat
    (status ``stopped``: it reads nothing any more)."""
    r.hset(KEYS.model(name), mapping={"name": name, "max_model_len": 64,
                                      "served_by": stale_worker or "w-gone"})
    r.sadd(KEYS.models, name)
    if stale_worker:
        r.hset(KEYS.worker(stale_worker), mapping={"worker_id": stale_worker, "model": name,
                                                   "status": "stopped"})
        r.sadd(KEYS.workers, stale_worker)


def beat(r: redis.Redis, worker_id: str, model: str, status: str = "serving") -> None:
    """A heartbeat hash as a live worker writes it (the fields liveness reads)."""
    r.hset(KEYS.worker(worker_id), mapping={"worker_id": worker_id, "model": model,
                                            "status": status})
    r.expire(KEYS.worker(worker_id), 60)
    r.sadd(KEYS.workers, worker_id)


def queued(r: redis.Redis, model: str, lane: str = "interactive") -> list[GenerationRequest]:
    return [GenerationRequest.decode(f[FIELD]) for _, f in r.xrange(KEYS.requests(model, lane))]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="conveyor")
    add_client_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(list(argv))


def warnings_of(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["log_level"] == "warning" and "no live worker" in e["event"]]



# --- never registered ------------------------------------------------------------------------


def test_never_registered_submit_raises_model_not_found_naming_the_registered_models(
        client, redis_client):
    register(redis_client, GHOST)
    assert client.model_state("nobody").state == NOT_REGISTERED  # precondition

    with pytest.raises(ModelNotFound) as refused:
        client.submit("hi", model="nobody", max_tokens=2)

    error = refused.value
    assert isinstance(error, LookupError) and isinstance(error, ValueError)
    assert (error.model, error.served) == ("nobody", [GHOST])
    assert str(error) == ("model 'nobody' is not registered in namespace 'conveyor': no "
                          "worker serves it (registered models: ghost)")
    assert not redis_client.exists(KEYS.requests("nobody", "interactive"))  # nothing written

    rid = client.submit("hi", model="nobody", max_tokens=2, allow_unregistered=True)
    assert [q.request_id for q in queued(redis_client, "nobody")] == [rid]


def test_never_registered_async_submit_raises_model_not_found(redis_url, redis_client):
    async def scenario() -> tuple[ModelNotFound, str]:
        async with AsyncClient(redis_url) as ac:
            assert (await ac.model_state("nobody")).state == NOT_REGISTERED
            with pytest.raises(ModelNotFound) as refused:
                await ac.submit("hi", model="nobody")
            assert not redis_client.exists(KEYS.requests("nobody", "interactive"))
            return refused.value, await ac.submit("hi", model="nobody",
                                                  allow_unregistered=True)

    error, rid = asyncio.run(scenario())
    assert error.served == [] and "registered models: none" in str(error)
    assert [q.request_id for q in queued(redis_client, "nobody")] == [rid]


def test_never_registered_cli_submit_exits_2_with_the_same_message(
        redis_url, redis_client, capsys):
    register(redis_client, GHOST)

    rc = run_client_cmd(parse("submit", "hi", "--model", "nobody", "--redis", redis_url))

    err = capsys.readouterr().err
    assert rc == 2
    assert str(ModelNotFound("nobody", [GHOST])) in err and "--allow-unregistered" in err
    assert not redis_client.exists(KEYS.requests("nobody", "interactive"))


def test_never_registered_cli_submit_with_allow_unregistered_queues_then_gives_up(
        redis_url, redis_client, capsys):
    rc = run_client_cmd(parse("submit", "hi", "--model", "nobody", "--allow-unregistered",
                              "--wait", "0.2", "--redis", redis_url))

    out, err = capsys.readouterr()
    [req] = queued(redis_client, "nobody")
    assert out == "" and f"request {req.request_id}" in err  # the text goes to stdout
    assert "warning: no live worker serves model 'nobody'" in err
    assert rc == 124 and f"request {req.request_id} did not finish within 0.2 s" in err
    assert redis_client.get(KEYS.cancelled(req.request_id)) == b"1"


def test_never_registered_bulk_wait_is_bounded_and_shown_in_progress(client, redis_client):
    clock = ManualClock()
    progress = Progress(None)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            wait_for_model(client, "nobody", 30, progress, clock=clock, poll_s=1)
        except BaseException as exc:  # handed to the test
            failure.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    eventually(lambda: progress.meta.get("stage") == "waiting_for_model", "the wait to start")
    assert progress.meta["model_state"] == NOT_REGISTERED  # precondition: still waiting
    assert progress.meta["model_wait_limit_s"] == 30 and waiter.is_alive()

    for _ in range(30):
        clock.advance(1)
    waiter.join(10)

    assert not waiter.is_alive()
    [error] = failure
    assert isinstance(error, ModelNotFound)
    assert "model 'nobody' is not registered in namespace 'conveyor' after waiting 30 s" in str(
        error)


def test_never_registered_bulk_job_waits_for_the_registration_then_runs(
        redis_url, redis_client, start_worker):
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    text = " ".join(["The river runs past the stone bridge and the old market."] * 8)
    job = enqueue_analyze(bulk_queue(redis_url), text, "Summarise.", model=MODEL,
                          chunk_tokens=300, overlap_tokens=20, max_tokens=4,
                          model_wait_timeout=300)
    rq_worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "bulk", "worker", "--burst", "--redis", redis_url],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        def meta() -> dict:
            return Job.fetch(job.id, connection=redis_client,
                             serializer=JSONSerializer).get_meta()

        # Precondition: the job runs and waits, saying why, while nothing is registered.
        waiting = eventually(lambda: (m := meta()).get("stage") == "waiting_for_model" and m,
                             "the job to wait for its model")
        assert waiting["model_state"] == NOT_REGISTERED and waiting["model_wait_limit_s"] == 300
        assert not redis_client.exists(KEYS.model(MODEL)) and rq_worker.poll() is None

        start_worker(dtype="float32")
        assert rq_worker.wait(120) == 0, rq_worker.stderr.read().decode()[-2000:]
    finally:
        if rq_worker.poll() is None:
            rq_worker.kill()
            rq_worker.wait(10)

    job = Job.fetch(job.id, connection=redis_client, serializer=JSONSerializer)
    assert job.get_status() == "finished", job.latest_result().exc_string
    done = job.get_meta()
    assert done["stage"] == "done" and done["model_state"] == LIVE
    assert job.return_value()["num_chunks"] == 1


def test_never_registered_batch_line_gets_model_not_found(client, redis_client, tmp_path):
    register(redis_client, GHOST, stale_worker="w-gone")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"custom_id": "a", "body": {"model": "nowhere", "prompt": "x"}}\n'
                   '{"custom_id": "b", "body": {"model": "ghost", "prompt": "x"}}\n')
    out = tmp_path / "out.jsonl"
    states = {s.name: s.state for s in client.model_states()}
    assert states == {GHOST: NO_LIVE_WORKER}  # precondition: "nowhere" is unknown

    policy = RetryPolicy(request_timeout=0.2, max_attempts=1, backoff_base=0.01)
    summary = run_batch_file(client, inp, out, policy=policy)

    lines = {line["custom_id"]: line for line in map(json.loads, out.read_text().splitlines())}
    assert summary.failed == 2
    assert lines["a"]["error"]["code"] == "model_not_found"
    assert lines["a"]["error"]["message"] == str(ModelNotFound("nowhere", [GHOST]))
    # Registered, no live worker: the line was queued (then timed out, as its policy says).
    assert len(queued(redis_client, GHOST, "batch")) == 1
    assert lines["b"]["error"]["code"] == "request_failed"


# --- registered, no live worker --------------------------------------------------------------


def test_registered_without_a_live_worker_submit_queues_and_logs_a_warning(
        client, redis_client):
    register(redis_client, GHOST, stale_worker="w-gone")
    state = Client(connection=redis_client).model_state(GHOST)
    assert (state.registered, state.live_workers, state.state) == (True, (), NO_LIVE_WORKER)

    with capture_logs() as logs:
        first = client.submit("hi", model=GHOST, max_tokens=2)
        second = client.submit("hi", model=GHOST, max_tokens=2)  # same look: no new warning

    assert [q.request_id for q in queued(redis_client, GHOST)] == [first, second]
    [warning] = warnings_of(logs)
    assert warning["model"] == GHOST and warning["request_id"] == first


def test_registered_without_a_live_worker_async_submit_queues_and_logs_a_warning(
        redis_url, redis_client):
    register(redis_client, GHOST, stale_worker="w-gone")

    async def scenario() -> str:
        async with AsyncClient(redis_url) as look:
            assert [s.state for s in await look.model_states()] == [NO_LIVE_WORKER]
        async with AsyncClient(redis_url) as ac:  # a client that has not looked yet
            return await ac.submit("hi", model=GHOST)

    with capture_logs() as logs:
        rid = asyncio.run(scenario())
    assert [q.request_id for q in queued(redis_client, GHOST)] == [rid]
    assert [w["request_id"] for w in warnings_of(logs)] == [rid]


def test_registered_without_a_live_worker_cli_submit_warns_waits_cancels_and_exits_124(
        redis_url, redis_client, capsys):
    register(redis_client, GHOST, stale_worker="w-gone")

    rc = run_client_cmd(parse("submit", "hi", "--wait", "0.3", "--redis", redis_url))

    out, err = capsys.readouterr()
    [req] = queued(redis_client, GHOST)  # the default model: the only registered one
    assert out == "" and f"request {req.request_id}" in err
    assert err.index("warning: no live worker serves model 'ghost'") < err.index("0.3 s")
    assert rc == 124 and "it was cancelled" in err
    assert redis_client.get(KEYS.cancelled(req.request_id)) == b"1"


def test_registered_without_a_live_worker_bulk_wait_ends_when_a_worker_is_live(
        client, redis_client):
    register(redis_client, GHOST, stale_worker="w-gone")
    clock = ManualClock()
    progress = Progress(None)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(
        wait_for_model(client, GHOST, 60, progress, clock=clock, poll_s=1)), daemon=True)
    waiter.start()
    eventually(lambda: progress.meta.get("stage") == "waiting_for_model", "the wait to start")
    assert progress.meta["model_state"] == NO_LIVE_WORKER and waiter.is_alive()

    beat(redis_client, "w-new", GHOST)
    clock.advance(1)
    waiter.join(10)

    [state] = got
    assert state.live_workers == ("w-new",) and progress.meta["model_state"] == LIVE


def test_registered_without_a_live_worker_bulk_wait_is_bounded(client, redis_client):
    register(redis_client, GHOST, stale_worker="w-gone")
    beat(redis_client, "w-draining", GHOST, status="draining")  # reads nothing new either
    clock = ManualClock()
    progress = Progress(None)
    failure: list[BaseException] = []

    def wait() -> None:
        try:
            wait_for_model(client, GHOST, 5, progress, clock=clock, poll_s=1)
        except BaseException as exc:  # handed to the test
            failure.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    eventually(lambda: progress.meta.get("stage") == "waiting_for_model", "the wait to start")
    assert progress.meta["model_state"] == NO_LIVE_WORKER and waiter.is_alive()
    for _ in range(5):
        clock.advance(1)
    waiter.join(10)

    [error] = failure
    assert isinstance(error, AnalysisFailed)
    assert "'ghost' is registered but no live worker served it within 5 s" in str(error)


# --- live worker, and the same model once its worker stopped ---------------------------------


def test_live_worker_then_stopped_every_client_follows_the_state(
        redis_url, redis_client, start_worker, capsys):
    register(redis_client, "old", stale_worker="w-old")  # a registration left long ago
    worker = start_worker("w-live")
    client = Client(redis_url)

    # Live: the stale registration no longer hides the served model.
    states = {s.name: (s.state, s.live_workers) for s in client.model_states()}
    assert states == {MODEL: (LIVE, ("w-live",)), "old": (NO_LIVE_WORKER, ())}
    assert client.models() == ["old", MODEL] and client.models(live_only=True) == [MODEL]
    assert resolve_model(client, None) == MODEL

    with capture_logs() as logs:
        rid = Client(redis_url).submit([5, 6, 7], model=MODEL, max_tokens=3, temperature=0)
    assert warnings_of(logs) == []
    assert client.result(rid, timeout=60).finish_reason in ("length", "stop")

    rc = run_client_cmd(parse("submit", "The river", "--stream", "--max-tokens", "3",
                              "--redis", redis_url))
    captured = capsys.readouterr()
    assert rc == 0 and "tokens, last entry" in captured.err
    assert "warning" not in captured.err

    assert run_top_cmd(build_parser().parse_args(["top", "--once", "--redis", redis_url])) == 0
    frame = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in frame.splitlines()
            if line.split()[:1] in ([MODEL], ["old"]) and len(line.split()) == 4}
    assert rows[MODEL] == [MODEL, "live", "1", "yes"]
    assert rows["old"] == ["old", "NO-LIVE-WORKER", "0", "yes"]

    # Stopped: the registration stays, the heartbeat is gone.
    worker.stop(drain_timeout_s=10)
    assert redis_client.exists(KEYS.model(MODEL)) and not redis_client.exists(
        KEYS.worker("w-live"))
    assert client.model_state(MODEL).state == NO_LIVE_WORKER
    with pytest.raises(ValueError, match=r"several models are registered \(old, tiny\) and "
                                         "none has a live worker"):
        resolve_model(client, None)

    with capture_logs() as logs:
        later = Client(redis_url).submit([5, 6, 7], model=MODEL, max_tokens=3)
    assert later in [q.request_id for q in queued(redis_client, MODEL)]
    assert [w["request_id"] for w in warnings_of(logs)] == [later]

    rc = run_client_cmd(parse("submit", "hi", "--model", MODEL, "--wait", "0.3",
                              "--redis", redis_url))
    out, err = capsys.readouterr()
    [printed] = re.findall(r"^request ([0-9a-f]{32})$", err, flags=re.M)
    assert rc == 124 and "warning: no live worker serves model 'tiny'" in err
    assert redis_client.get(KEYS.cancelled(printed)) == b"1"
    client.close()


# --- conveyor tail ---------------------------------------------------------------------------


def write(r: redis.Redis, request_id: str, *entries: OutputChunk | FinalEntry) -> None:
    for entry in entries:
        r.xadd(KEYS.output(request_id), {FIELD: entry.encode()}, id=entry.entry_id)


def test_tail_of_an_id_without_a_stream_says_so_and_exits_1(redis_url, redis_client, capsys):
    assert not redis_client.exists(KEYS.output("nope"))  # precondition

    rc = run_client_cmd(parse("tail", "nope", "--wait-start", "0", "--redis", redis_url))

    err = capsys.readouterr().err
    assert rc == 1
    assert "request nope has no output stream: the id is unknown, its output expired" in err
    assert "not started yet" in err and "--wait-start" in err


def test_tail_waits_for_a_stream_that_appears_within_wait_start(redis_url, redis_client,
                                                                 capsys):
    def blocked_on_the_stream() -> bool:
        return any(c["cmd"] == "xread" and "b" in c["flags"] for c in redis_client.client_list())

    def late_writer() -> None:
        eventually(blocked_on_the_stream, "tail to wait on the stream")
        write(redis_client, "late", OutputChunk(0, [1, 2], "hi"), FinalEntry("length", 2))

    writer = threading.Thread(target=late_writer)
    writer.start()
    rc = run_client_cmd(parse("tail", "late", "--wait-start", "60", "--redis", redis_url))
    writer.join(10)

    out, err = capsys.readouterr()
    assert rc == 0 and out == "hi\n" and "[length, 2 tokens, last entry 2-1]" in err


def test_tail_from_past_the_end_of_a_finished_stream_returns_at_once(redis_url, redis_client,
                                                                     capsys):
    write(redis_client, "done", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 2))
    write(redis_client, "failed", OutputChunk(0, [1], "a"), error_final("oom", 1))

    assert run_client_cmd(parse("tail", "done", "--from", "2-1", "--redis", redis_url)) == 0
    out, err = capsys.readouterr()
    assert out == "" and "[stop, 2 tokens, last entry 2-1] (finished at or before 2-1)" in err

    assert run_client_cmd(parse("tail", "done", "--from", "99-0", "--redis", redis_url)) == 0
    assert "(finished at or before 99-0)" in capsys.readouterr().err

    assert run_client_cmd(parse("tail", "failed", "--from", "1-1", "--redis", redis_url)) == 1
    assert "error: oom" in capsys.readouterr().err

    # Just before the final: the final still comes, as before.
    assert run_client_cmd(parse("tail", "done", "--from", "2-0", "--redis", redis_url)) == 0
    assert "[stop, 2 tokens" in capsys.readouterr().err


def test_clients_resuming_at_or_after_the_final_yield_nothing_and_return(redis_url,
                                                                          redis_client):
    write(redis_client, "done", OutputChunk(0, [1, 2], "ab"), FinalEntry("stop", 2))

    with Client(redis_url) as client:
        assert list(client.stream("done", from_id="2-1", timeout=30)) == []
        assert list(client.stream("done", from_id="7", timeout=30)) == []
        assert [e.entry_id for e in client.stream("done", from_id="2-0", timeout=30)] == ["2-1"]
        assert client.last_event("done").entry_id == "2-1"
        assert client.last_event("nope") is None

    async def scenario() -> list:
        async with AsyncClient(redis_url) as ac:
            return [e async for e in ac.stream("done", from_id="2-1", timeout=30)]

    assert asyncio.run(scenario()) == []


# --- the pure rules --------------------------------------------------------------------------


def test_model_states_from_registrations_and_heartbeats():
    beats = [{"worker_id": "w1", "model": "a", "status": "serving"},
             {"worker_id": "w2", "model": "a", "status": "degraded"},
             {"worker_id": "w3", "model": "b", "status": "draining"},
             {"worker_id": "w4", "model": "c", "status": "serving"}]  # c's hash was removed
    states = {s.name: s for s in model_states(["a", "b", "old"], beats, also=["queued-only"])}

    assert {n: s.state for n, s in states.items()} == {
        "a": LIVE, "b": NO_LIVE_WORKER, "c": LIVE, "old": NO_LIVE_WORKER,
        "queued-only": NOT_REGISTERED}
    assert states["a"].live_workers == ("w1", "w2") and states["c"].known
    assert not states["c"].registered and not states["queued-only"].known
    assert pick_default_model(list(states.values())) is None  # a and c are both live
    assert pick_default_model(model_states(["a", "old"], beats[:1])) == "a"
    assert pick_default_model(model_states(["old"], [])) == "old"
    assert pick_default_model(model_states([], [])) is None
    # Heartbeats a producer may not read (an ACL without ~{ns}:worker:*): registered is live.
    [unknown] = model_states(["a"], None)
    assert not unknown.liveness_known and unknown.live and unknown.state == LIVE


def test_the_affinity_generation_is_the_one_most_live_affinity_workers_name():
    """Producers read the owners' hash of the generation the workers' heartbeats name (the
    one most live workers with affinity lanes name, the latest of a tie), not one of their
    own clock: one worker's clock running ahead sends nobody to a hash only it writes."""
    beats = [{"worker_id": "w1", "model": "a", "status": "serving", "affinity": "1",
              "affinity_generation": "11994000"},
             {"worker_id": "w2", "model": "a", "status": "serving", "affinity": "1",
              "affinity_generation": "11994001"},
             {"worker_id": "w3", "model": "a", "status": "draining", "affinity": "1",
              "affinity_generation": "11994009"},  # not live
             {"worker_id": "w4", "model": "a", "status": "serving", "affinity": "",
              "affinity_generation": ""},  # --no-affinity
             {"worker_id": "w5", "model": "b", "status": "serving", "affinity": "1"}]
    states = {s.name: s for s in model_states(["a", "b"], beats)}
    assert states["a"].affinity_workers == ("w1", "w2")
    assert states["a"].affinity_generation == 11994001  # a tie: the latest
    ahead = {"worker_id": "w6", "model": "a", "status": "serving", "affinity": "1",
             "affinity_generation": "11994005"}
    [a] = [s for s in model_states(["a"], [*beats, ahead, {**beats[0], "worker_id": "w7"}])
           if s.name == "a"]
    assert a.affinity_generation == 11994000  # two of four name it
    assert states["b"].affinity_generation is None  # (a worker from before: the client's own)
