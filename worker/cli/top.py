"""`conveyor top`: a live terminal view of the fleet, read from Redis (no torch, no worker).

Workers come from their heartbeat hashes (``{ns}:worker:*``), models from their
registrations and those heartbeats (which have a live worker), lanes from each model's
request streams and consumer group; one frame is one snapshot of all three.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis

from producer.client.client import Client
from producer.client.connection import describe
from producer.client.models import ModelState, heartbeat_keys, member_names, model_states
from producer.client.queues import BLOCKED_HINT, LaneStats, handoff_stats, lane_stats
from producer.wire.keys import as_text
from producer.wire.protocol import now_ms
from worker.cli.redis_verbs import add_connection_args

DEFAULT_INTERVAL_S = 1.0
# Home the cursor and clear the screen: each frame redraws in place on a terminal.
_CLEAR = "\x1b[H\x1b[J"


@dataclass
class FleetSnapshot:
    """What `top` shows in one frame."""

    taken_ms: int
    # One dict per live worker: its heartbeat hash, decoded to str values.
    workers: list[dict[str, str]] = field(default_factory=list)
    lanes: list[LaneStats] = field(default_factory=list)
    # Every model registered, served or queued for, with its live workers.
    models: list[ModelState] = field(default_factory=list)


def add_top_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``top`` verb to the ``conveyor`` command."""
    p = subparsers.add_parser(
        "top", help="live view of the fleet: workers, lanes, load",
        description="Models (registered or not, and how many live workers serve each), "
        "workers (from their heartbeats) with running / waiting / KV use / tokens per second, "
        "and each model's lanes with the requests waiting and pending.")
    add_connection_args(p)
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.set_defaults(handler=run_top_cmd)
    return p


def run_top_cmd(args: argparse.Namespace) -> int:
    """Draw frames until Ctrl-C (or one with ``--once``); the exit status.

    Live, it shows an unreachable Redis in the frame and keeps trying; with ``--once`` the
    connection error passes to the caller (`conveyor`'s main says it in one line).
    """
    where = describe(args.redis) if args.redis else "embedded"
    live = not args.once and sys.stdout.isatty()
    try:
        with Client(args.redis, args.namespace) as client:
            while True:
                try:
                    frame = render(take_snapshot(client), where, client.keys.ns)
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    if args.once:
                        raise
                    frame = f"conveyor top  {where}: cannot reach Redis ({exc}); retrying"
                if live:  # (a frame taller or wider than the terminal would scroll)
                    frame = clip(frame, *shutil.get_terminal_size())
                sys.stdout.write((_CLEAR if live else "") + frame + "\n")
                sys.stdout.flush()
                if args.once:
                    return 0
                time.sleep(args.interval)
                if not live:
                    print()
    except KeyboardInterrupt:
        return 0


# Model names submitted for without a registration that `top` shows lanes for, at most.
MAX_REQUESTED_SHOWN = 100


def take_snapshot(client: Client) -> FleetSnapshot:
    """Every live worker's heartbeat, and the lanes of every model that is registered, served
    or was requested without a registration (requests may wait for a model no worker serves).

    Reads sets and hashes only (no SCAN, no stream entries): the observer ACL allows no more.
    """
    conn, keys = client.redis, client.keys
    pipe = conn.pipeline(transaction=False)
    pipe.smembers(keys.workers)
    pipe.smembers(keys.models)
    pipe.smembers(keys.requested)
    worker_ids, registered, requested = pipe.execute()
    workers = read_workers(conn, heartbeat_keys(keys, worker_ids))
    registered = set(member_names(registered))
    # Any producer may add a name to ``requested``: only the first few get a lane row.
    requested = sorted(member_names(requested))[:MAX_REQUESTED_SHOWN]
    models = registered | set(requested) | {
        w["model"] for w in workers if w.get("model")}
    lanes = [s for model in sorted(models)
             for s in [*lane_stats(conn, keys, model, tuple(member_names(
                 w["worker_id"] for w in workers if w.get("model") == model
                 and w.get("affinity") and w.get("worker_id")))),
                 *handoff_stats(conn, keys, model)]]
    return FleetSnapshot(now_ms(), workers, lanes, model_states(registered, workers, models))


def read_workers(conn: redis.Redis, worker_keys: list[str]) -> list[dict[str, str]]:
    """The heartbeat hashes behind these keys, sorted by worker id."""
    pipe = conn.pipeline(transaction=False)
    for key in worker_keys:
        pipe.hgetall(key)
    workers = []
    for raw in pipe.execute():
        if raw:  # expired: a worker that died (its reaper-side cleanup removes the member)
            workers.append({as_text(k): as_text(v) for k, v in raw.items()})
    return sorted(workers, key=lambda w: w.get("worker_id", ""))


def render(snap: FleetSnapshot, where: str = "", namespace: str = "conveyor") -> str:
    """One frame as text: a summary line, the lanes table, the workers table."""
    ws = snap.workers
    clock = time.strftime("%H:%M:%S", time.localtime(snap.taken_ms / 1000))
    summary = (f"conveyor top  {where}  ns={namespace}  {clock}  workers {len(ws)}  "
               f"running {_sum(ws, 'running')}  waiting {_sum(ws, 'waiting')}  "
               f"queued {sum(s.depth for s in snap.lanes)}  "
               f"tokens/s {sum(_float(w, 'tokens_per_s') for w in ws):.1f}")
    states = {"live": "live", "no_live_worker": "NO-LIVE-WORKER",
              "not_registered": "NOT-REGISTERED"}
    models = _table(["model", "state", "live_workers", "registered"],
                    [[m.name, states[m.state], len(m.live_workers),
                      "yes" if m.registered else "no"] for m in snap.models]
                    ) if snap.models else ["(no models)"]
    lanes = _table(["model", "lane", "queued", "pending", "consumers", "length"],
                   [[s.model, s.lane, s.depth, s.pending, s.consumers, s.length]
                    for s in snap.lanes]) if snap.lanes else ["(no models registered)"]
    rows = [[w.get("worker_id", "?"), w.get("model", "?"),
             (w.get("role") or "both") + (" SIMULATED" if w.get("simulated") == "1" else ""),
             w.get("status", "?"),
             w.get("running", "0"), w.get("waiting", "0"), w.get("swapped", "0"),
             w.get("inflight", "0"), _kv(w), f"{_float(w, 'tokens_per_s'):.1f}",
             w.get("tokens_generated", "0"), _age(snap.taken_ms, w)] for w in ws]
    workers = _table(["worker", "model", "role", "status", "running", "waiting", "swapped",
                      "inflight", "kv used", "tokens/s", "tokens", "seen"], rows) if ws else [
        "(no live workers)"]
    return "\n".join([summary, "", "MODELS", *models, "", "LANES", *lanes, *_blocked(ws), "",
                      "WORKERS", *workers])


def clip(frame: str, columns: int, rows: int) -> str:
    """``frame`` cut to a terminal of ``rows`` rows (a line longer than ``columns`` wraps
    onto more than one), as top(1) cuts its own: the lines that do not fit are left out,
    said in the last row. Lines are never cut short: a number cut off would read as
    another number."""
    lines = frame.splitlines()
    heights = [max(1, -(-len(line) // max(1, columns))) for line in lines]
    if sum(heights) <= rows - 1:  # (the cursor's row below it)
        return frame
    kept, used = 0, 0
    while used + heights[kept] <= rows - 2:  # (and a row for the note)
        used += heights[kept]
        kept += 1
    return "\n".join([*lines[:kept],
                      f"({len(lines) - kept} more lines: a taller terminal, or --once)"])


def _blocked(workers: list[dict[str, str]]) -> list[str]:
    """A warning line for each request stream a worker found closed to new requests."""
    seen: dict[str, list[str]] = {}
    for w in workers:
        for stream in filter(None, w.get("blocked_lanes", "").split(",")):
            seen.setdefault(stream, []).append(w.get("worker_id", "?"))
    return [f"BLOCKED {stream}: its last entry id is the largest possible, so every submit "
            f"fails (seen by {', '.join(by)}); {BLOCKED_HINT}"
            for stream, by in sorted(seen.items())]


def _table(headers: Sequence[str], rows: list[list[object]]) -> list[str]:
    """Columns padded to their widest cell; text left-aligned, numbers right-aligned."""
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(r[i]) for r in cells[1:]) for i in range(len(headers))]
    return ["  ".join(c.rjust(w) if num else c.ljust(w)
                      for c, w, num in zip(r, widths, numeric, strict=True)).rstrip()
            for r in cells]


def _kv(w: dict[str, str]) -> str:
    used, total = int(_float(w, "kv_blocks_used")), int(_float(w, "kv_blocks_total"))
    return f"{used}/{total} ({100 * used / total:.0f}%)" if total else "-"


def _age(now: int, w: dict[str, str]) -> str:
    updated = _float(w, "updated_ms")
    return f"{max(0.0, (now - updated) / 1000):.1f}s ago" if updated else "-"


def _sum(workers: list[dict[str, str]], key: str) -> int:
    return sum(int(_float(w, key)) for w in workers)


def _float(w: dict[str, str], key: str) -> float:
    try:
        return float(w.get(key) or 0)
    except ValueError:
        return 0.0


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

