"""conveyor's Redis functions (Redis 7): loaded by `conveyor redis setup` and by workers at
start and after a restart that lost them; never replaced by an older version."""

from __future__ import annotations

import pytest
from fleet_fixtures import MODEL
from redis_fixtures import redis_binary
from waiting import eventually

from producer.cli_redis import run_redis_cmd
from producer.client import Client
from producer.connection import connect
from producer.functions import SOURCE, VERSION, ensure_functions, loaded_version
from producer.redis_server import bundled_binary, start_ephemeral
from worker.cli import build_parser


@pytest.fixture
def redis7(tmp_path):
    """A Redis 7 without persistence: a restart forgets data and functions alike."""
    with start_ephemeral(tmp_path, binary=redis_binary("7"), appendonly="no") as server:
        yield server


def test_ensure_functions_loads_once_and_never_downgrades(redis7):
    with connect(redis7.url) as r:
        assert loaded_version(r) is None
        assert ensure_functions(r) == "loaded" and loaded_version(r) == VERSION
        assert ensure_functions(r) == "present"
        newer = SOURCE.replace(f"return {VERSION} end", f"return {VERSION + 1} end")
        r.execute_command("FUNCTION", "LOAD", "REPLACE", newer)
        assert ensure_functions(r) == "present" and loaded_version(r) == VERSION + 1
        older = SOURCE.replace(f"return {VERSION} end", f"return {VERSION - 1} end")
        r.execute_command("FUNCTION", "LOAD", "REPLACE", older)
        assert ensure_functions(r) == "loaded" and loaded_version(r) == VERSION


def test_setup_loads_them_and_says_so(redis7, capsys):
    args = build_parser().parse_args(["redis", "setup", "--redis", redis7.url])
    assert run_redis_cmd(args) == 0
    assert "conveyor's functions loaded" in capsys.readouterr().out
    assert run_redis_cmd(args) == 0
    assert "already loaded" in capsys.readouterr().out
    with connect(redis7.url) as r:
        assert loaded_version(r) == VERSION


def test_setup_on_redis62_explains_the_fallback(tmp_path, capsys):
    binary = bundled_binary() or redis_binary("6.2")
    with start_ephemeral(tmp_path, binary=binary) as server:
        args = build_parser().parse_args(["redis", "setup", "--redis", server.url, "--acl"])
        assert run_redis_cmd(args) == 0
    out = capsys.readouterr().out
    assert "no functions (Redis < 7)" in out
    assert "+eval" in out and "(~" not in out  # the 6.2 rules: no selectors


def test_a_worker_loads_them_at_start_and_after_a_restart_lost_them(redis7, start_worker):
    with connect(redis7.url) as r:
        assert loaded_version(r) is None  # precondition: a fresh server has none
        start_worker(url=redis7.url)
        assert loaded_version(r) == VERSION
        redis7.restart()  # no persistence: functions, streams and groups are gone
        assert loaded_version(r) is None
        # Within heartbeats of the reconnected worker.
        eventually(lambda: loaded_version(r) == VERSION, "the worker reloads the functions")
    with Client(redis7.url, max_queue=5) as client:
        done = client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=3,
                                           ignore_eos=True), timeout=60)
    assert done.finish_reason == "length" and len(done.token_ids) == 3
