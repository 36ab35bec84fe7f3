"""conveyor's Redis functions (Redis >= 7): the only server-side code a producer may run.

A producer that may EVAL can block the whole server (``while true do end``), so on Redis 7
the producer ACL grants ``FCALL`` and no ``EVAL``: the code it calls is this library,
loaded by ``conveyor redis setup`` and by every worker at start and after a Redis restart
(a restart without persistence forgets functions). Redis 6.2 has no functions; there the
producer runs the same logic as an EVAL script (producer.backpressure) and its ACL must
grant EVAL (docs/security.md, "Redis 6.2").

Redis checks every command a function runs against the calling user's ACL, so the
function reads a stream with XLEN and XINFO GROUPS only: a producer never needs XRANGE on
request streams, which would show it other producers' prompts.
"""

from __future__ import annotations

import redis
import structlog

log = structlog.get_logger(__name__)

LIBRARY = "conveyor"
# Raised whenever the library's functions change: a worker replaces an older library
# (never a newer one, so a rolling upgrade does not flip it back and forth).
VERSION = 1

ADD_IF_ROOM = "conveyor_add_if_room"
VERSION_FUNCTION = "conveyor_version"

SOURCE = f"""#!lua name={LIBRARY}
-- KEYS[1]: a request stream. ARGV: group, limit, field, message.
-- Returns {{"ok", entry id}} after the XADD, or {{"full", count}} (count >= limit) without
-- writing. "Waiting" is undelivered plus pending; undelivered is the group's lag. Where
-- Redis cannot tell the lag (entries deleted from the middle of the stream) every entry
-- in the stream counts: it may refuse early, never admit past the limit.
local function add_if_room(keys, args)
  local stream, group, limit = keys[1], args[1], tonumber(args[2])
  local count = 0
  if redis.call('EXISTS', stream) == 1 then
    local found = nil
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
      local info = {{}}
      for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
      if info['name'] == group then found = info end
    end
    if found == nil or type(found['lag']) ~= 'number' then
      count = redis.call('XLEN', stream)
    else
      count = found['lag'] + tonumber(found['pending'])
    end
  end
  if count >= limit then
    return {{'full', count}}
  end
  return {{'ok', redis.call('XADD', stream, '*', args[3], args[4])}}
end

redis.register_function('{ADD_IF_ROOM}', add_if_room)
redis.register_function{{function_name='{VERSION_FUNCTION}',
  callback=function() return {VERSION} end, flags={{'no-writes'}}}}
"""


class FunctionsMissing(RuntimeError):
    """conveyor's functions are not loaded on a Redis 7 whose ACL lets this user run no
    script of its own."""

    def __init__(self, detail: str) -> None:
        super().__init__(
            f"conveyor's Redis functions are not loaded ({detail}): run `conveyor redis "
            "setup --redis URL` as an administrator, or start a worker (workers load them)")


def is_unknown_command(exc: redis.ResponseError) -> bool:
    """Redis < 7 answering FCALL or FUNCTION."""
    return "unknown command" in str(exc).lower()


def is_function_missing(exc: redis.ResponseError) -> bool:
    return "function not found" in str(exc).lower()


def loaded_version(client: redis.Redis) -> int | None:
    """The library version on the server; None when not loaded; -1 on Redis < 7."""
    try:
        return int(client.execute_command("FCALL_RO", VERSION_FUNCTION, 0))
    except redis.ResponseError as exc:
        if is_unknown_command(exc):
            return -1
        if is_function_missing(exc):
            return None
        raise


def ensure_functions(client: redis.Redis) -> str:
    """Load the library unless this version (or a newer one) is there.

    Returns ``"loaded"``, ``"present"`` or ``"unsupported"`` (Redis < 7). Other refusals
    (NOPERM for a user without FUNCTION LOAD) propagate.
    """
    found = loaded_version(client)
    if found == -1:
        return "unsupported"
    if found is not None and found >= VERSION:
        return "present"
    client.execute_command("FUNCTION", "LOAD", "REPLACE", SOURCE)
    log.info("redis functions loaded", library=LIBRARY, version=VERSION, replaced=found)
    return "loaded"
