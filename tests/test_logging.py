"""Logs: JSON lines off a terminal, and worker and request ids on every line of a request."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import structlog
from fleet_fixtures import MODEL
from structlog.testing import capture_logs

from producer.client.client import Client
from worker.cli.command import build_parser


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=60)


def test_log_lines_are_json_with_level_time_logger_and_thread_bound_ids():
    done = run_python("""
        import logging, threading, structlog
        from producer.logging import bind_thread_context, configure_logging
        configure_logging("info")  # stderr is a pipe here: JSON
        def serve():
            bind_thread_context(worker_id="w7")
            structlog.get_logger("conveyor.test").info("request finished", request_id="r1")
        t = threading.Thread(target=serve); t.start(); t.join()
        structlog.get_logger("conveyor.test").debug("hidden below info")
        logging.getLogger("thirdparty").warning("plain %s", "stdlib")
    """)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["event"] == "request finished" and first["level"] == "info"
    assert (first["worker_id"], first["request_id"]) == ("w7", "r1")
    assert first["logger"] == "conveyor.test" and first["timestamp"].endswith("Z")
    assert "worker_id" not in second  # bound in the other thread only
    assert (second["event"], second["level"], second["logger"]) == (
        "plain stdlib", "warning", "thirdparty")


def test_log_level_option_is_accepted_before_and_after_the_verb():
    parser = build_parser()
    assert parser.parse_args(["top", "--once"]).log_level == "info"
    assert parser.parse_args(["--log-level", "debug", "top"]).log_level == "debug"
    assert parser.parse_args(["top", "--log-level", "WARNING"]).log_level == "warning"
    assert parser.parse_args(["worker", "--model", "m", "--log-level", "error"]).log_level == (
        "error")
    done = run_python("""
        import structlog
        from producer.logging import configure_logging
        configure_logging("warning", json=False)
        structlog.get_logger("x").info("not shown")
        structlog.get_logger("x").warning("shown", request_id="r2")
    """)
    assert "not shown" not in done.stderr
    assert "shown" in done.stderr and "request_id" in done.stderr
    assert not done.stderr.lstrip().startswith("{")  # console format when asked


def test_every_line_about_a_request_names_the_request_and_the_worker(redis_url, start_worker):
    client = Client(redis_url)
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        start_worker("w-log")
        ok = client.submit([1, 2, 3], model=MODEL, max_tokens=3, ignore_eos=True)
        too_long = client.submit(list(range(2048)), model=MODEL, max_tokens=3)
        assert client.result(ok, timeout=60).finish_reason == "length"
        assert client.result(too_long, timeout=60).finish_reason == "error"
    about = [e for e in logs if "request_id" in e]
    events = {(e["event"], e["request_id"]) for e in about}
    assert {("request admitted", ok), ("request finished", ok),
            ("request rejected", too_long)} <= events
    assert all(e.get("worker_id") == "w-log" for e in about)
