"""Workers running in the test process against the session's real Redis."""

from __future__ import annotations

import pytest

from worker.fleet.config import WorkerConfig

MODEL = "tiny"
# Worker settings for a test that reads back the requests it sent (XRANGE/XLEN of a request
# stream): the reaper trims served entries every housekeeping_interval_s (30 s), and a run
# on a machine slow enough to outlast that would lose them.
KEEP_SERVED_REQUESTS = {"housekeeping_interval_s": 24 * 3600.0}


@pytest.fixture
def start_worker(redis_url, tiny_llama):
    """start_worker(**engine_settings) -> a started Worker (autostart=False: built, not started);
    all are stopped after the test. ``url`` points it at another Redis than the session's
    (e.g. as an ACL user, or over TLS); ``model_dir`` serves another folder as the model."""
    from worker.fleet.process import Worker  # loads torch: only for tests that run a worker

    workers: list[Worker] = []

    def start(worker_id: str | None = None, prefetch: int | None = 8,
              metrics_port: int | None = None, autostart: bool = True,
              url: str | None = None, clock=None,
              config: dict | None = None, model_dir=None, **engine) -> Worker:
        settings = {"dtype": "float64", "num_kv_blocks": 512, "max_num_seqs": 16, **engine}
        fast = {"read_block_ms": 100, "heartbeat_interval_s": 0.5, "queue_poll_interval_s": 0.2}
        config = WorkerConfig(
            model_dir=model_dir or tiny_llama, served_model_name=MODEL, redis_url=url or redis_url,
            worker_id=worker_id or f"w{len(workers)}", engine=settings, prefetch=prefetch,
            metrics_port=metrics_port, metrics_host="127.0.0.1", **{**fast, **(config or {})},
        )
        worker = Worker(config, clock=clock)
        if autostart:
            worker.start()
        workers.append(worker)
        return worker

    yield start
    for w in workers:
        if w.state not in ("stopped", "starting", "failed"):
            w.stop(drain_timeout_s=10)


def settled_pending(r, model: str = MODEL, patience_s: float = 30.0) -> int:
    """Pending entries of ``model``'s lanes once acknowledgements have landed.

    A worker acknowledges a request in a round trip after writing its final (its next
    batch's, or within ACK_DELAY_S), so a client may see the final first: wait (bounded) for
    the count to reach 0, and return what it is then.
    """
    import time

    def count() -> int:
        return pending_now(r, model)

    end = time.monotonic() + patience_s
    while (n := count()) and time.monotonic() < end:
        time.sleep(0.01)
    return n


def request_lanes(r, model: str = MODEL, lane: str | None = None) -> list[str]:
    """The model's shared lane(s) and every worker's affinity lanes of them (prefix
    affinity puts a request on the lane of the worker that holds its prefix)."""
    from producer.wire.keys import LANES, Keys

    keys = Keys()
    lanes = [lane] if lane else list(LANES)
    found = sorted(k.decode() for k in r.keys(keys.affinity_lane_pattern(model)))
    return [keys.requests(model, name) for name in lanes] + [
        s for s in found if keys.lane_of(s) in lanes]


def pending_now(r, model: str = MODEL) -> int:
    """Pending entries of all of ``model``'s request lanes, now."""
    from producer.wire.keys import GROUP

    total = 0
    for lane in request_lanes(r, model):
        try:
            total += r.xpending(lane, GROUP)["pending"]
        except Exception:  # no stream or group: nothing pending there
            continue
    return total


def sent_requests(r, model: str = MODEL, lane: str | None = None) -> list:
    """Every request still on the model's lanes (shared and affinity), in entry-id order."""
    from producer.wire.protocol import FIELD, GenerationRequest

    entries = [(tuple(int(p) for p in e.decode().split("-")), f)
               for stream in request_lanes(r, model, lane) for e, f in r.xrange(stream)]
    return [GenerationRequest.decode(f[FIELD]) for _, f in sorted(entries, key=lambda x: x[0])]


def output_entries(r, request_id: str) -> tuple[list[int], int]:
    """(every token index on the request's output stream, in order; its final entries)."""
    from producer.wire.keys import Keys
    from producer.wire.protocol import FIELD, FinalEntry, decode_output

    indexes, finals = [], 0
    for _, fields in r.xrange(Keys().output(request_id)):
        entry = decode_output(fields[FIELD])
        if isinstance(entry, FinalEntry):
            finals += 1
        else:
            indexes.extend(range(entry.index, entry.index + len(entry.token_ids)))
    return indexes, finals
