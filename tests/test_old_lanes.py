"""A client of the key layout before the hash tags is answered, not left waiting.

Layout 1 put requests on ``conveyor:req:tiny:interactive``; layout 2 reads
``conveyor:req:{tiny}:interactive`` only. A raw XADD on the old key, as such a client
sends it, gets an ``error`` final naming the new key, a dead letter, and is taken off
the old key (worker/fleet/housekeeping/old_lanes.py; docs/protocol.md, "Changelog").
"""

from __future__ import annotations

import msgpack
from fleet_fixtures import MODEL
from waiting import eventually

from producer.client.client import Client
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD
from worker.cli.command import build_parser
from worker.cli.redis_verbs import run_redis_cmd
from worker.fleet.housekeeping.old_lanes import OldLanes

KEYS = Keys()
OLD_LANE = "conveyor:req:tiny:interactive"
NEW_LANE = "conveyor:req:{tiny}:interactive"


def layout_1_request(request_id: str) -> bytes:
    """A request message as docs/protocol.md gives it, msgpack-encoded by hand."""
    return msgpack.packb({"v": 1, "id": request_id, "model": MODEL, "prompt_token_ids": [1, 2, 3],
                          "params": {"max_tokens": 2}})


def dead_letters(r) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in r.xrange(KEYS.dead)]


def test_the_old_and_new_lane_keys_are_the_layouts_the_changelog_names():
    assert KEYS.old_layout_requests(MODEL, "interactive") == OLD_LANE
    assert KEYS.requests(MODEL, "interactive") == NEW_LANE


def test_a_raw_xadd_on_an_old_lane_key_gets_an_error_naming_the_new_layout(
        redis_client, redis_url, start_worker):
    worker = start_worker(config={"housekeeping_interval_s": 0.2}, autostart=False)
    entry_id = redis_client.xadd(OLD_LANE, {FIELD: layout_1_request("old-client-1")})
    assert redis_client.xlen(OLD_LANE) == 1  # where no worker reads
    worker.start()
    with Client(redis_url) as client:
        done = client.result("old-client-1", timeout=60)
    assert done.finish_reason == "error"
    assert NEW_LANE in done.error and OLD_LANE in done.error
    # The final goes first (a crash after it answers again, harmlessly), then the entry is
    # taken off the old key and dead-lettered.
    [letter] = eventually(lambda: dead_letters(redis_client), "the entry dead-lettered")
    assert redis_client.xlen(OLD_LANE) == 0
    assert letter[b"stream"] == OLD_LANE.encode() and letter[b"entry_id"] == entry_id
    assert letter[b"request_id"] == b"old-client-1" and NEW_LANE.encode() in letter[b"reason"]
    assert worker.reaper.old_lanes.answered == 1
    # The new lane works as ever beside it.
    with Client(redis_url) as client:
        served = client.result(client.submit([1, 2], model=MODEL, max_tokens=2,
                                             ignore_eos=True), timeout=60)
    assert served.finish_reason == "length"


def test_an_entry_without_a_request_id_is_dead_lettered_only(redis_client):
    entry_id = redis_client.xadd(OLD_LANE, {FIELD: b"\xc1 not msgpack"})
    assert OldLanes(redis_client, KEYS, MODEL, "w0", 3600).answer() == 1
    assert redis_client.xlen(OLD_LANE) == 0
    [letter] = dead_letters(redis_client)
    assert letter[b"entry_id"] == entry_id and letter[b"request_id"] == b""
    assert redis_client.keys(KEYS.output_pattern) == []


def test_two_workers_answer_an_old_entry_once(redis_client):
    old_batch = KEYS.old_layout_requests(MODEL, "batch")
    redis_client.xadd(old_batch, {FIELD: layout_1_request("old-client-2")})
    # Both workers' housekeeping read the entry before either answers it.
    [(entry_id, fields)] = redis_client.xrange(old_batch)
    workers = [OldLanes(redis_client, KEYS, MODEL, wid, 3600) for wid in ("w0", "w1")]
    taken = [w.answer_entry("batch", entry_id.decode(), fields) for w in workers]
    assert sorted(taken) == [False, True]
    assert len(redis_client.xrange(KEYS.output("old-client-2"))) == 1
    assert len(dead_letters(redis_client)) == 1
    assert redis_client.xlen(old_batch) == 0
    assert 0 < redis_client.ttl(KEYS.output("old-client-2")) <= 3600


def test_an_old_key_that_is_not_a_stream_is_left_alone(redis_client):
    redis_client.set(OLD_LANE, b"something else")
    assert OldLanes(redis_client, KEYS, MODEL, "w0", 3600).answer() == 0
    assert redis_client.get(OLD_LANE) == b"something else"


def test_redis_setup_names_old_lane_keys_that_hold_requests(redis_client, redis_url, capsys):
    redis_client.sadd(KEYS.models, MODEL)
    redis_client.xadd(OLD_LANE, {FIELD: layout_1_request("old-client-3")})
    assert run_redis_cmd(build_parser().parse_args(["redis", "setup", "--redis", redis_url])) == 0
    out = capsys.readouterr().out
    assert f"{OLD_LANE} (key layout 1) holds 1 request(s)" in out and NEW_LANE in out
    assert redis_client.xlen(OLD_LANE) == 1  # reported, left for the workers to answer
