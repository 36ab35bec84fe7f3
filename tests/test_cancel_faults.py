"""A cancelled request ends `cancelled` whatever worker serves it and whenever it was
cancelled: while its worker was dead, or while the worker's subscription was down."""

from __future__ import annotations

from fleet_fixtures import MODEL
from test_reclaim import STREAM, add_request, held_by
from test_worker_threads import cut, restore
from waiting import eventually

from producer.client.client import Client
from producer.clock import ManualClock
from producer.wire.completion import FinishReason
from producer.wire.keys import GROUP, Keys
from producer.wire.protocol import FIELD, OutputChunk
from worker.fleet.supervised import BACKOFF_CAP_S

KEYS = Keys()



def test_a_request_cancelled_while_its_worker_was_dead_ends_cancelled_on_the_next(
        redis_url, redis_client, start_worker):
    rid = "cancelled-while-orphaned"
    redis_client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
    add_request(redis_client, rid, [5, 6, 7], 50)
    held_by(redis_client, "gone", 1, lapsed=True)
    chunk = OutputChunk(0, [11, 12], "")  # what the dead worker had published
    redis_client.xadd(KEYS.output(rid), {FIELD: chunk.encode()}, id=chunk.entry_id)
    client = Client(redis_url)
    client.cancel(rid)  # nobody is listening: only the marker remains
    start_worker("heir")
    done = client.result(rid, timeout=60)
    assert done.finish_reason is FinishReason.CANCELLED and done.token_ids == [11, 12]
    eventually(lambda: redis_client.xpending(STREAM, GROUP)["pending"] == 0, "acknowledged")


def test_a_cancel_sent_while_the_subscription_is_down_is_not_lost(
        redis_url, redis_client, start_worker, tmp_path):
    clock = ManualClock()
    worker = start_worker("deaf", clock=clock)
    worker.loop.pause()  # the request stays in flight
    client = Client(redis_url)
    rid = client.submit([5, 6, 7], model=MODEL, max_tokens=50, temperature=0, ignore_eos=True)
    eventually(lambda: rid in worker.inflight, "the request was read")
    listener = worker.cancels
    saved, _ = cut(listener.client, redis_client, "deaf:cancel-listener", tmp_path / "gone.sock")
    eventually(lambda: listener.retrying is not None, "the subscription is down")
    assert redis_client.pubsub_numsub(KEYS.cancel_channel) == [(KEYS.cancel_channel.encode(), 0)]
    client.cancel(rid)  # announced to nobody
    restore(listener.client, saved)

    def resubscribed() -> bool:
        clock.advance(BACKOFF_CAP_S)
        return listener.healthy

    eventually(resubscribed, "the listener subscribed again")
    worker.loop.resume()
    assert client.result(rid, timeout=60).finish_reason is FinishReason.CANCELLED
