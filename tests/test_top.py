"""`conveyor top --once`: one frame of the fleet, read from a real Redis and live workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from fleet_fixtures import MODEL, settled_pending

from producer.client.client import Client
from worker.cli.command import build_parser
from worker.cli.top import run_top_cmd, take_snapshot


def frame(redis_url: str, capsys) -> str:
    assert run_top_cmd(build_parser().parse_args(["top", "--once", "--redis", redis_url])) == 0
    return capsys.readouterr().out


def row(text: str, *first: str) -> list[str]:
    """The table row whose first cells are ``first``."""
    for line in text.splitlines():
        cells = line.split()
        if cells[:len(first)] == list(first):
            return cells
    raise AssertionError(f"no row {first} in:\n{text}")


def test_frame_shows_waiting_requests_then_the_worker_that_served_them(redis_url, start_worker,
                                                                      capsys):
    client = Client(redis_url)
    # Queued before any worker registered the model: allowed explicitly.
    ids = [client.submit([1, 2, 3], model=MODEL, max_tokens=4, ignore_eos=True,
                         allow_unregistered=True) for _ in range(3)]
    client.submit([1, 2, 3], model="nobody-serves-me", lane="batch", max_tokens=4,
                  allow_unregistered=True)

    before = frame(redis_url, capsys)
    assert "(no live workers)" in before and "workers 0" in " ".join(row(before, "conveyor", "top"))
    # model, lane, queued, pending, consumers, length
    assert row(before, MODEL, "interactive") == [MODEL, "interactive", "3", "0", "0", "3"]
    assert row(before, "nobody-serves-me", "batch")[2] == "1"

    worker = start_worker("w-top")
    for rid in ids:
        client.result(rid, timeout=60)
    # Settled: all acknowledged, nothing in flight, and a heartbeat written since (the
    # periodic one may lag on a loaded machine).
    assert settled_pending(client.redis) == 0 and worker.inflight.wait_empty(30)
    worker.heartbeat.beat()
    after = frame(redis_url, capsys)
    assert row(after, MODEL, "interactive") == [MODEL, "interactive", "0", "0", "1", "3"]
    assert row(after, MODEL, "batch")[2:4] == ["0", "0"]
    # worker, model, role, status, running, waiting, swapped, inflight, kv used (2 cells),
    # tokens/s, tokens, seen
    worker = row(after, "w-top")
    assert worker[1:4] == [MODEL, "both", "serving"]
    assert worker[4:8] == ["0", "0", "0", "0"]
    assert worker[8].endswith("/512") and worker[9].endswith("%)")
    assert float(worker[10]) >= 0 and int(worker[11]) >= 0
    assert "workers 1" in " ".join(row(after, "conveyor", "top"))


def test_top_runs_as_a_cli_verb_without_torch(redis_url):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        from worker.cli.command import main
        rc = main(["top", "--once", "--redis", {redis_url!r}])
        assert "torch" not in sys.modules and "worker.engine.engine" not in sys.modules
        sys.exit(rc)
    """)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("conveyor top") and "(no live workers)" in done.stdout


def test_dead_workers_leave_the_workers_set_and_live_ones_stay(redis_url, redis_client):
    from producer.wire.keys import Keys
    from worker.fleet.housekeeping.consumers import prune_worker_set

    keys = Keys()
    redis_client.hset(keys.worker("alive"), mapping={"worker_id": "alive", "status": "serving"})
    redis_client.sadd(keys.workers, "alive", "gone")  # "gone": its hash expired
    with Client(redis_url) as client:
        assert [w["worker_id"] for w in take_snapshot(client).workers] == ["alive"]
    assert prune_worker_set(redis_client, keys) == ["gone"]
    assert redis_client.smembers(keys.workers) == {b"alive"}


def test_a_live_frame_is_cut_to_the_terminal():
    """On a terminal each frame redraws in place: one taller than the terminal would scroll
    its summary away; the lines that do not fit are left out, as top(1) does, saying so.
    A long line wraps (counted as the rows it takes), never cut: a number cut short would
    read as another."""
    from worker.cli.top import clip

    frame = "\n".join(f"row {i} " + "x" * 120 for i in range(30))  # (each takes 2 rows)
    cut = clip(frame, 80, 24).splitlines()
    assert cut[:11] == frame.splitlines()[:11]  # whole lines: 22 rows
    assert cut[-1] == "(19 more lines: a taller terminal, or --once)" and len(cut) == 12
    assert clip("a\nb", 80, 24) == "a\nb"  # (a frame that fits is left as it is)
    assert clip("\n".join("abc" * 3 for _ in range(23)), 80, 24).count("\n") == 22
