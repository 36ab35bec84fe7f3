"""run_commands: many commands in one round trip, each reply in its place, errors included;
a lost connection raises or is replaced, and what Redis applied stays applied once."""

from __future__ import annotations

import pytest
import redis
from tcp_proxy import TcpProxy

from worker.fleet.publishing.raw_pipeline import run_commands


def test_replies_come_back_in_order_with_refusals_in_their_place(redis_client):
    redis_client.set("plain", "x")
    replies = run_commands(redis_client, [
        ("XADD", "s", "2-0", "f", b"\x81\xa1k\x01"),
        ("XADD", "s", "1-0", "f", "late"),  # below the top id: refused, the rest goes on
        ("XADD", "plain", "*", "f", "v"),  # the wrong type
        ("EXPIRE", "s", 60),
        ("XADD", "s", "3-0", "f", "v"),
    ])
    assert replies[0] == b"2-0" and replies[4] == b"3-0"
    assert isinstance(replies[1], redis.ResponseError) and "equal or smaller" in str(replies[1])
    assert isinstance(replies[2], redis.ResponseError) and "WRONGTYPE" in str(replies[2])
    assert replies[3] == 1  # Redis's own reply: the pipeline's callbacks are not applied
    assert [eid for eid, _ in redis_client.xrange("s")] == [b"2-0", b"3-0"]
    assert 0 < redis_client.ttl("s") <= 60
    assert run_commands(redis_client, []) == []


def test_a_transaction_answers_with_its_results_or_its_refusal(redis_client):
    redis_client.set("plain", "x")
    ok, queued_a, queued_b, done = run_commands(redis_client, [
        ("MULTI",), ("XADD", "t", "1-0", "f", "v"), ("XADD", "plain", "*", "f", "v"),
        ("EXEC",)])
    assert ok == b"OK" and queued_a == queued_b == b"QUEUED"
    assert done[0] == b"1-0" and isinstance(done[1], redis.ResponseError)  # ran, one refused
    # A command refused while queued (here: an unknown one) aborts the whole transaction.
    replies = run_commands(redis_client, [
        ("MULTI",), ("XADD", "t", "2-0", "f", "v"), ("NOSUCHCOMMAND",), ("EXEC",)])
    assert isinstance(replies[2], redis.ResponseError)
    assert isinstance(replies[3], redis.exceptions.ExecAbortError)
    assert redis_client.xlen("t") == 1


def test_a_closed_connection_is_replaced_and_nothing_is_written_twice(redis_client, redis_url):
    writer = redis.Redis.from_url(redis_url, client_name="raw-writer")
    assert run_commands(writer, [("XADD", "u", "1-0", "f", "v")]) == [b"1-0"]
    [conn] = [c for c in redis_client.client_list() if c["name"] == "raw-writer"]
    assert redis_client.client_kill_filter(_id=conn["id"]) == 1  # the fault, for sure
    # The pool finds the connection closed when it hands it out, and connects again.
    assert run_commands(writer, [("XADD", "u", "2-0", "f", "v")]) == [b"2-0"]
    assert [eid for eid, _ in redis_client.xrange("u")] == [b"1-0", b"2-0"]
    writer.close()


def test_an_unreachable_server_raises_and_the_call_after_the_outage_succeeds(
        redis_server, redis_client):
    proxy = TcpProxy(str(redis_server.socket))
    writer = redis.Redis.from_url(proxy.url, socket_timeout=5)
    try:
        assert run_commands(writer, [("XADD", "v", "1-0", "f", "v")]) == [b"1-0"]
        proxy.cut()
        with pytest.raises(redis.ConnectionError):
            run_commands(writer, [("XADD", "v", "2-0", "f", "v")])
        assert redis_client.xlen("v") == 1  # the outage is real: nothing got through
        proxy.restore()
        # A batch retried with the same ids: what Redis has is refused, never doubled.
        again = run_commands(writer, [("XADD", "v", "1-0", "f", "v"),
                                      ("XADD", "v", "2-0", "f", "v")])
        assert isinstance(again[0], redis.ResponseError) and again[1] == b"2-0"
        assert [eid for eid, _ in redis_client.xrange("v")] == [b"1-0", b"2-0"]
    finally:
        writer.close()
        proxy.close()
