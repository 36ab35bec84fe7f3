"""How full each request lane is (read by `conveyor top` and the workers' metrics poller),
and trimming what workers have served from a request stream."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from producer.wire.keys import GROUP, LANES, Keys, as_text

# Redis < 7 reports no consumer-group lag: we count undelivered entries instead, up to this many
# (XLEN counts served requests too, until trim_request_stream removes them).
DEPTH_SCAN_CAP = 1000
# The largest sequence part of a stream entry id (an unsigned 64-bit integer).
MAX_ID_SEQUENCE = 2**64 - 1


@dataclass(frozen=True)
class LaneStats:
    """One request stream (a model's lane) as its consumer group sees it."""

    model: str
    lane: str
    # Entries not yet read by any worker (the group's lag); a lower bound when capped.
    depth: int
    # Entries read by a worker and not yet acknowledged (being served, or stranded).
    pending: int
    # Workers that ever read from this lane (consumers of the group).
    consumers: int
    # Entries in the stream, served ones included.
    length: int


def lane_stats(client: redis.Redis, keys: Keys, model: str,
               also_workers: tuple[str, ...] = ()) -> list[LaneStats]:
    """Depth, pending and consumers of each of ``model``'s lanes; zeros for a missing stream.

    A lane's depth and pending count its workers' affinity lanes too (requests waiting for
    the worker that holds their prefix, producer/affinity/): those of the workers listed in
    ``{ns}:affinity:{{model}}:lanes`` where this user may read it, and of ``also_workers``.
    """
    workers = sorted(set(affinity_workers(client, keys, model)) | set(also_workers))
    out = []
    for lane in LANES:
        stats = _one_lane(client, keys.requests(model, lane), model, lane)
        for worker in workers:
            more = _one_lane(client, keys.affinity_lane(model, worker, lane), model, lane)
            stats = LaneStats(model, lane, stats.depth + more.depth,
                              stats.pending + more.pending, stats.consumers,
                              stats.length + more.length)
        out.append(stats)
    return out


def affinity_workers(client: redis.Redis, keys: Keys, model: str) -> list[str]:
    """The workers with affinity lanes of ``model``; none where this user may not ask."""
    try:
        return [as_text(m) for m in client.smembers(keys.affinity_lanes(model))]
    except redis.exceptions.NoPermissionError:
        return []


def handoff_stats(client: redis.Redis, keys: Keys, model: str) -> list[LaneStats]:
    """The model's handoff streams (prefill to decode workers) as lanes named
    ``handoff-interactive`` and ``handoff-batch``; only those that exist (a prefill worker
    ran), and none where this user may not count them."""
    out = []
    for lane in LANES:
        try:
            stats = _one_lane(client, keys.handoff(model, lane), model, f"handoff-{lane}")
        except redis.exceptions.NoPermissionError:
            return []
        if stats.length or stats.consumers:
            out.append(stats)
    return out


def waiting(client: redis.Redis, streams: list[str], limit: int | None = None) -> int:
    """Requests waiting in ``streams`` together: not yet read, or read and not yet
    acknowledged (what ``max_queue`` counts).

    With ``limit``, counting stops once the total reaches it (the total is then a lower
    bound): where Redis tells no lag (< 7), undelivered entries are counted by reading them,
    and a caller that only asks whether ``limit`` is reached reads no more than that many,
    not DEPTH_SCAN_CAP whole requests.
    """
    total = 0
    for stream in streams:
        cap = DEPTH_SCAN_CAP if limit is None else max(0, limit - total)
        stats = _one_lane(client, stream, "", "", cap)
        total += stats.depth + stats.pending
        if limit is not None and total >= limit:
            break
    return total


def _one_lane(client: redis.Redis, stream: str, model: str, lane: str,
              cap: int = DEPTH_SCAN_CAP) -> LaneStats:
    """One stream's counts; its depth counted up to ``cap`` where Redis tells no lag."""
    pipe = client.pipeline(transaction=False)
    pipe.xlen(stream)
    pipe.xinfo_groups(stream)
    length, groups = pipe.execute(raise_on_error=False)
    if isinstance(length, Exception) or isinstance(groups, Exception):  # no such stream yet
        return LaneStats(model, lane, 0, 0, 0, 0 if isinstance(length, Exception) else length)
    group = next((g for g in groups if as_text(g.get("name")) == GROUP), None)
    if group is None:  # no worker has read this lane yet: everything in it waits
        return LaneStats(model, lane, min(length, cap), 0, 0, length)
    lag = group.get("lag")
    depth = lag if isinstance(lag, int) else _count_after(
        client, stream, as_text(group["last-delivered-id"]), cap)
    return LaneStats(model, lane, depth, int(group.get("pending") or 0),
                     int(group.get("consumers") or 0), length)


def _count_after(client: redis.Redis, stream: str, last_delivered: str, cap: int) -> int:
    """Entries after the group's last delivered id, up to ``cap`` (Redis < 7, or lag
    unknown after deletions): each is read whole to be counted.

    A user who may not read entries (the Redis 7 observer) gets an upper bound instead:
    every entry in the stream, capped.
    """
    if cap <= 0:
        return 0
    try:
        return len(client.xrange(stream, min=f"({last_delivered}", count=cap))
    except redis.exceptions.NoPermissionError:
        return min(int(client.xlen(stream)), cap)



# Every XADD to a stream needs an id above its last one: after an entry at this id (which
# any user allowed XADD can write) the stream takes no new entry at all.
MAX_ENTRY_ID = f"{MAX_ID_SEQUENCE}-{MAX_ID_SEQUENCE}"
# Ids from this millisecond on (the year 33658) are never Redis's own: an entry there was
# written with an explicit id, and every later XADD lands after it, so a lane whose last id
# is this far is blocked or one step from it (an entry at MAX_ENTRY_ID minus one still
# leaves room for exactly one more request). No clock is needed to tell.
FAR_FUTURE_MS = 10**15
BLOCKED_HINT = "an administrator reopens it with `conveyor redis setup --reopen-lanes`"


def _entry_ms(entry_id: str) -> int:
    return int(entry_id.partition("-")[0] or 0)


def lane_blocked(client: redis.Redis, stream: str) -> bool:
    """Whether ``stream``'s last id is far in the future (FAR_FUTURE_MS): the lane takes no
    new request, or will not for long.

    Reads XINFO STREAM (a worker's command; it returns the first and last entries too, so
    the observer is not granted it): a lane blocked this way shows on the worker's
    heartbeat, and from there in `conveyor top`.
    """
    try:
        info = client.xinfo_stream(stream)
    except redis.ResponseError:  # no such stream yet
        return False
    return _entry_ms(as_text(info.get("last-generated-id", "0-0"))) >= FAR_FUTURE_MS


def reopen_lane(client: redis.Redis, stream: str) -> bool:
    """Reopen a blocked lane (an administrator's step); whether it was blocked.

    Deletes every entry at a far-future id, moves the stream's last id back to its last
    remaining entry, and the consumer group's last-delivered id with it when the group had
    read past there (it reads in id order, so everything up to there was delivered). A
    far-future entry no worker had read yet (a request some producer's ``*`` id put after
    the blocking entry, or the blocking entry itself) is added again under a new id, so no
    queued request is lost; one a worker was serving is deleted (its acknowledgement still
    lands; were that worker to die, no other could reclaim it). Entries before the far
    future are untouched: undelivered ones stay undelivered, pending ones pending.
    """
    if not lane_blocked(client, stream):
        return False
    group = next((g for g in client.xinfo_groups(stream) if as_text(g["name"]) == GROUP), None)
    delivered = as_text(group["last-delivered-id"]) if group else "0-0"
    future = client.xrange(stream, min=f"{FAR_FUTURE_MS}-0", max="+")
    requeue = [fields for entry_id, fields in future
               if _id_key(as_text(entry_id)) > _id_key(delivered)]
    if future:
        client.xdel(stream, *[entry_id for entry_id, _ in future])
    last = client.xrevrange(stream, count=1)
    last_id = as_text(last[0][0]) if last else "0-1"
    client.execute_command("XSETID", stream, last_id)
    if group is not None and _id_key(delivered) > _id_key(last_id):
        client.xgroup_setid(stream, GROUP, last_id)
    for fields in requeue:
        client.xadd(stream, fields)
    return True


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def trim_request_stream(client: redis.Redis, stream: str) -> int:
    """Remove the entries of a request stream that workers have served; how many went.

    Trims (XTRIM MINID, exact) below the oldest pending entry, or, when nothing is pending,
    up to and including the group's last-delivered id: undelivered and pending requests
    are never removed, so it is safe to call at any time from any worker. A stream
    without the consumer group is left alone (nothing in it was delivered yet).
    """
    # One MULTI so the group's last-delivered id and its pending list are one snapshot;
    # anything delivered afterwards has a larger id than both, so the trim never reaches it.
    pipe = client.pipeline(transaction=True)
    pipe.xinfo_groups(stream)
    pipe.xpending(stream, GROUP)
    groups, pending = pipe.execute(raise_on_error=False)
    if isinstance(groups, Exception) or isinstance(pending, Exception):
        return 0  # no such stream, or no group yet
    group = next((g for g in groups if as_text(g.get("name")) == GROUP), None)
    if group is None:
        return 0
    delivered = as_text(group["last-delivered-id"])
    if _entry_ms(delivered) >= FAR_FUTURE_MS:
        # A blocked lane, maybe being reopened this moment: reopen_lane moves the group back
        # and re-adds entries below this id, which a trim from here would remove unread.
        return 0
    if pending["pending"]:
        min_id = as_text(pending["min"])
    else:
        min_id = _next_id(delivered)
    return int(client.xtrim(stream, minid=min_id, approximate=False))


def _next_id(entry_id: str) -> str:
    """The smallest stream id above ``entry_id`` (the largest id itself: there is none above)."""
    if entry_id == MAX_ENTRY_ID:
        return entry_id
    ms, _, seq = entry_id.partition("-")
    if int(seq) == MAX_ID_SEQUENCE:
        return f"{int(ms) + 1}-0"
    return f"{ms}-{int(seq) + 1}"
