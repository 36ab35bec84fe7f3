"""conveyor's Redis functions (Redis >= 7): the only server-side code a producer may run.

A producer that may EVAL can block the whole server (``while true do end``), so on Redis 7
the producer ACL grants ``FCALL`` and no ``EVAL``: the code it calls is this library,
loaded by an administrator (``conveyor redis setup``). Functions are server-wide, so the
strict ACL gives no tenant ``FUNCTION LOAD``: a worker of one namespace could otherwise
replace the code every producer runs and read other tenants' prompts. Workers check the
library at start and at every heartbeat, load it when it is missing and their user may
(single-tenant servers, or no ACL), never replace it, and report what they found.

Redis 6.2 has no functions; there the producer runs the same logic as an EVAL script
(producer.client.backpressure) and its ACL must grant EVAL (docs/security.md, "Redis 6.2").

Redis checks every command a function runs against the calling user's ACL, so the
function reads a stream with XLEN and XINFO GROUPS only: a producer never needs XRANGE on
request streams, which would show it other producers' prompts.
"""

from __future__ import annotations

import redis
import structlog

from producer.wire.keys import as_text

log = structlog.get_logger(__name__)

LIBRARY = "conveyor"
# Raised whenever the library's functions change (it is part of the code, so a library of
# another version reads as MODIFIED).
VERSION = 2

ADD_IF_ROOM = "conveyor_add_if_room"
VERSION_FUNCTION = "conveyor_version"

SOURCE = f"""#!lua name={LIBRARY}
-- KEYS[1]: a request stream; KEYS[2] (optional): the handoff stream of its lane, whose
-- waiting requests count too (a prefill worker acknowledges the lane entry when it hands a
-- request on: without it, the limit would stop holding once prompts are computed).
-- ARGV: group, limit, field, message. Returns {{"ok", entry id}} after the XADD to KEYS[1],
-- or {{"full", count}} (count >= limit) without writing. "Waiting" is undelivered plus
-- pending; undelivered is the group's lag. Where Redis cannot tell the lag (entries deleted
-- from the middle of the stream) every entry in the stream counts: it may refuse early,
-- never admit past the limit.
local function waiting(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    return 0
  end
  local found = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local info = {{}}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then found = info end
  end
  if found == nil or type(found['lag']) ~= 'number' then
    return redis.call('XLEN', stream)
  end
  return found['lag'] + tonumber(found['pending'])
end

local function add_if_room(keys, args)
  local group, limit = args[1], tonumber(args[2])
  local count = 0
  for _, stream in ipairs(keys) do
    count = count + waiting(stream, group)
    if count >= limit then
      return {{'full', count}}
    end
  end
  return {{'ok', redis.call('XADD', keys[1], '*', args[3], args[4])}}
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
            f"conveyor's Redis functions are not loaded ({detail}): an administrator runs "
            "`conveyor redis setup --redis URL`")


def is_unknown_command(exc: redis.ResponseError) -> bool:
    """Redis < 7 answering FCALL or FUNCTION."""
    return "unknown command" in str(exc).lower()


def is_function_missing(exc: redis.ResponseError) -> bool:
    return "function not found" in str(exc).lower()


# What library_state finds on the server.
OURS = "ours"  # this exact library
MISSING = "missing"  # no library of that name (a fresh or restarted Redis)
MODIFIED = "modified"  # a library of that name with other code: another version, or planted
UNSUPPORTED = "unsupported"  # Redis < 7: no functions at all


def library_state(client: redis.Redis) -> str:
    """Whether the server holds this library, byte for byte (FUNCTION LIST ... WITHCODE).

    Functions are server-wide: whoever may FUNCTION LOAD can replace the library every
    producer calls, so readers compare its code, not a version it claims.
    """
    try:
        libraries = client.execute_command("FUNCTION", "LIST", "LIBRARYNAME", LIBRARY,
                                           "WITHCODE")
    except redis.ResponseError as exc:
        if is_unknown_command(exc):
            return UNSUPPORTED
        raise
    for entry in libraries or []:
        # redis-py parses each library into a dict; a raw reply is a flat list of pairs.
        pairs = entry if isinstance(entry, dict) else dict(zip(entry[::2], entry[1::2],
                                                               strict=True))
        fields = {as_text(k): v for k, v in pairs.items()}
        if as_text(fields.get("library_name", "")) == LIBRARY:
            return OURS if as_text(fields.get("library_code", "")) == SOURCE else MODIFIED
    return MISSING


def install_functions(client: redis.Redis) -> str:
    """The administrator's step (`conveyor redis setup`): load the library, replacing any
    other code under its name. Returns what was there before (see library_state)."""
    before = library_state(client)
    if before in (MISSING, MODIFIED):
        client.execute_command("FUNCTION", "LOAD", "REPLACE", SOURCE)
        log.info("redis functions loaded", library=LIBRARY, version=VERSION, before=before)
    return before


def ensure_functions(client: redis.Redis) -> str:
    """A worker's check: load the library when it is missing and this user may (never
    replacing one: only an administrator replaces code every producer runs). Returns the
    state afterwards: OURS, MISSING (and not allowed to load), MODIFIED or UNSUPPORTED."""
    state = library_state(client)
    if state != MISSING:
        return state
    try:
        client.execute_command("FUNCTION", "LOAD", SOURCE)
    except redis.exceptions.NoPermissionError:
        return MISSING
    except redis.ResponseError as exc:
        if "already exists" not in str(exc):  # another worker loaded it just now
            raise
    return library_state(client)
