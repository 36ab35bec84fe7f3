"""conveyor's Redis functions (Redis 7): installed by `conveyor redis setup`, loaded by
workers when missing (where their user may), never replaced by a worker."""

from __future__ import annotations

import pytest
from fleet_fixtures import MODEL
from redis_fixtures import redis_binary

from producer.client.client import Client
from producer.client.connection import connect
from producer.redis.functions import (
    MISSING,
    MODIFIED,
    OURS,
    SOURCE,
    ensure_functions,
    install_functions,
    library_state,
)
from producer.redis.server import bundled_binary, start_ephemeral
from worker.cli.command import build_parser
from worker.cli.redis_verbs import run_redis_cmd


@pytest.fixture
def redis7(tmp_path):
    """A Redis 7 without persistence: a restart forgets data and functions alike."""
    with start_ephemeral(tmp_path, binary=redis_binary("7"), appendonly="no") as server:
        yield server


PLANTED = SOURCE.replace("redis.call('XADD', keys[1], '*', args[3], args[4])",
                         "'0-1'")  # a library that would drop every request


def test_ensure_loads_a_missing_library_and_never_replaces_other_code(redis7):
    assert PLANTED != SOURCE
    with connect(redis7.url) as r:
        assert library_state(r) == MISSING
        assert ensure_functions(r) == OURS and ensure_functions(r) == OURS
        r.execute_command("FUNCTION", "LOAD", "REPLACE", PLANTED)
        assert library_state(r) == MODIFIED
        assert ensure_functions(r) == MODIFIED  # reported, not replaced
        assert install_functions(r) == MODIFIED and library_state(r) == OURS


def test_setup_loads_them_and_says_so(redis7, capsys):
    args = build_parser().parse_args(["redis", "setup", "--redis", redis7.url])
    assert run_redis_cmd(args) == 0
    assert "conveyor's functions loaded" in capsys.readouterr().out
    assert run_redis_cmd(args) == 0
    assert "already loaded" in capsys.readouterr().out
    with connect(redis7.url) as r:
        r.execute_command("FUNCTION", "LOAD", "REPLACE", PLANTED)
        assert run_redis_cmd(args) == 0
        assert "replaced" in capsys.readouterr().out and library_state(r) == OURS


def test_setup_on_redis62_explains_the_fallback(tmp_path, capsys):
    binary = bundled_binary() or redis_binary("6.2")
    with start_ephemeral(tmp_path, binary=binary) as server:
        args = build_parser().parse_args(["redis", "setup", "--redis", server.url, "--acl"])
        assert run_redis_cmd(args) == 0
    out = capsys.readouterr().out
    assert "no functions (Redis < 7)" in out
    assert "+eval" in out and "(~" not in out  # the 6.2 rules: no selectors


def test_a_worker_loads_them_and_its_registration_after_a_restart_lost_them(redis7, start_worker):
    with connect(redis7.url) as r:
        assert library_state(r) == MISSING  # precondition: a fresh server has none
        # Heartbeats far apart: the test runs the one after the restart itself.
        worker = start_worker(url=redis7.url, config={"heartbeat_interval_s": 600})
        assert library_state(r) == OURS and worker.status()["functions"] == OURS
        model_key = worker.keys.model(MODEL)
        assert r.hget(model_key, "max_model_len")
        redis7.restart()  # no persistence: functions, streams, groups, registration gone
        assert library_state(r) == MISSING and not r.exists(model_key)
        worker.heartbeat.tick()
        assert library_state(r) == OURS
        # The model's registration is written again (bulk analysis waits for it).
        assert r.hget(model_key, "max_model_len")
        assert MODEL.encode() in r.smembers(worker.keys.models)
    with Client(redis7.url, max_queue=5) as client:
        done = client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=3,
                                           ignore_eos=True), timeout=60)
    assert done.finish_reason == "length" and len(done.token_ids) == 3


def test_a_worker_reports_a_planted_library_and_leaves_it(redis7, start_worker):
    with connect(redis7.url) as r:
        r.execute_command("FUNCTION", "LOAD", PLANTED)
        worker = start_worker(url=redis7.url)
        assert worker.status()["functions"] == MODIFIED
        assert library_state(r) == MODIFIED
