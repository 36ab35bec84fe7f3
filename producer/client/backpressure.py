"""Backpressure: add a request only while its lane holds fewer than ``max_queue`` waiting.

"Waiting" is undelivered (after the consumer group's last-delivered id) plus pending (read
by a worker, not yet acknowledged), in the lane and in the lane's handoff stream: a prefill
worker acknowledges a request's lane entry when it hands the request on to a decode worker,
and the limit holds across that step only because the handoff stream counts too. The count
and the XADD run in one server-side step (the two streams share the model's hash tag), so
producers racing each other never overshoot the limit. On Redis 7 that step is the
``conveyor_add_if_room`` function (producer.redis.functions), which needs no Lua of the
producer's own; on Redis 6.2, which has neither functions nor the consumer group's
``lag``, it is the script below, which counts undelivered entries with an exclusive
XRANGE, stopping as soon as the limit is reached.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio

from producer.redis.functions import ADD_IF_ROOM as ADD_IF_ROOM_FUNCTION
from producer.redis.functions import FunctionsMissing, is_function_missing, is_unknown_command
from producer.wire.errors import QueueFull
from producer.wire.keys import GROUP, as_text

# KEYS[1]: the request stream; KEYS[2] (optional): its lane's handoff stream, counted too.
# ARGV: group, limit, field, message. Returns {"ok", entry id} after the XADD to KEYS[1], or
# {"full", count} (count is at least the limit) without writing anything.
ADD_IF_ROOM = """
local group, limit = ARGV[1], tonumber(ARGV[2])
local count = 0
for _, stream in ipairs(KEYS) do
  if redis.call('EXISTS', stream) == 1 then
    local last, pending = nil, 0
    -- One call gives the group's last-delivered id and its pending count (what the
    -- XPENDING summary counts), on 6.2 and 7 alike.
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {}
      for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
      if info['name'] == group then
        last, pending = info['last-delivered-id'], tonumber(info['pending'])
      end
    end
    if last == nil then
      -- No worker has read this stream yet: every entry waits.
      count = count + redis.call('XLEN', stream)
    elseif count + pending >= limit then
      count = count + pending
    else
      -- Only whether the limit is reached matters: read at most the room left.
      local room = limit - count - pending
      count = count + pending + #redis.call('XRANGE', stream, '(' .. last, '+', 'COUNT', room)
    end
  end
  if count >= limit then
    return {'full', count}
  end
end
return {'ok', redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])}
"""


def check_max_queue(max_queue: object) -> int | None:
    """``max_queue`` unchanged when None or a positive int, else ValueError."""
    if max_queue is None:
        return None
    if not isinstance(max_queue, int) or isinstance(max_queue, bool) or max_queue < 1:
        raise ValueError(f"max_queue must be a positive integer or None, got {max_queue!r}")
    return max_queue


# Clients whose server has no functions (Redis < 7), or whose user may not FCALL (the
# 6.2 rules used on Redis 7): they go straight to the script.
_SCRIPT_ONLY: weakref.WeakSet[Any] = weakref.WeakSet()


def add_if_room(client: redis.Redis, streams: Sequence[str], field: bytes, message: bytes,
                limit: int) -> str:
    """XADD ``{field: message}`` to ``streams[0]`` unless ``streams`` (a lane, and its
    handoff stream) together hold ``limit`` waiting; the new entry id, or QueueFull.

    FCALL of conveyor's function first; where Redis has no functions, or the function is
    not loaded, the same logic as a script (EVALSHA, reloaded after NOSCRIPT by redis-py's
    registered Script). A user allowed neither gets :class:`FunctionsMissing`.
    """
    args = [GROUP, limit, field, message]
    scripts_chosen_before = client in _SCRIPT_ONLY
    if not scripts_chosen_before:
        try:
            reply = client.execute_command("FCALL", ADD_IF_ROOM_FUNCTION, len(streams), *streams,
                                           *args)
            return _entry_id(reply, streams[0], limit)
        except redis.ResponseError as exc:
            missing = _script_instead(client, exc)
    else:
        missing = None
    try:
        reply = client.register_script(ADD_IF_ROOM)(keys=list(streams), args=args)
    except redis.exceptions.NoPermissionError as exc:
        if missing:
            raise FunctionsMissing(missing) from exc
        if scripts_chosen_before:
            # Scripts were chosen earlier and are refused now: the rules changed (say,
            # from 6.2's to Redis 7's). Forget the choice and try the function again, once:
            # a second refusal puts the client back here with the choice already made.
            _SCRIPT_ONLY.discard(client)
            return add_if_room(client, streams, field, message, limit)
        raise
    return _entry_id(reply, streams[0], limit)


async def add_if_room_async(client: redis.asyncio.Redis, streams: Sequence[str],
                            field: bytes, message: bytes, limit: int) -> str:
    """The asyncio twin of :func:`add_if_room`."""
    args = [GROUP, limit, field, message]
    scripts_chosen_before = client in _SCRIPT_ONLY
    if not scripts_chosen_before:
        try:
            reply = await client.execute_command("FCALL", ADD_IF_ROOM_FUNCTION, len(streams),
                                                 *streams,
                                           *args)
            return _entry_id(reply, streams[0], limit)
        except redis.ResponseError as exc:
            missing = _script_instead(client, exc)
    else:
        missing = None
    try:
        reply = await client.register_script(ADD_IF_ROOM)(keys=list(streams), args=args)
    except redis.exceptions.NoPermissionError as exc:
        if missing:
            raise FunctionsMissing(missing) from exc
        if scripts_chosen_before:
            # Scripts were chosen earlier and are refused now: the rules changed (say,
            # from 6.2's to Redis 7's). Forget the choice and try the function again, once:
            # a second refusal puts the client back here with the choice already made.
            _SCRIPT_ONLY.discard(client)
            return await add_if_room_async(client, streams, field, message, limit)
        raise
    return _entry_id(reply, streams[0], limit)


def _script_instead(client: Any, exc: redis.ResponseError) -> str | None:
    """Whether FCALL's refusal means "use the script": re-raises any other error. Returns
    why the function was not used when it should have been (it is not loaded), else None."""
    if is_function_missing(exc):
        return str(exc)  # Redis 7 without the library: try the script, once per call
    if is_unknown_command(exc) or "'fcall' command" in str(exc):
        _SCRIPT_ONLY.add(client)
        return None
    raise exc


def _entry_id(reply: Any, stream: str, limit: int) -> str:
    status, value = reply
    if as_text(status) == "full":
        raise QueueFull(stream, int(value), limit)
    return as_text(value)

