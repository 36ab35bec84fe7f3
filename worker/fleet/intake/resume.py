"""What a request's output stream already holds: where a claimed request resumes from.

A worker that claims a request whose lease lapsed takes its stream over first
(``take_over``): one script moves the stream's last entry id into the next generation of
ids (producer/wire/protocol.py, ``ID_GENERATION``), where this worker then writes. The
worker the request was taken from may still be sending (it was paused, or cut off, and
has not seen its lease go); every id it writes is below that, so Redis refuses all of it,
a chunk joining many tokens as much as a single token's. What the stream holds is read
after the move, so it is exactly what the new writer continues. Each chunk costs its XADD
alone: the fence is paid once a take-over, not once a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from producer.client.stream_events import entry_id_key
from producer.wire.keys import Keys, as_text
from producer.wire.protocol import FIELD, ID_GENERATION, FinalEntry, ProtocolError, decode_output

# KEYS[1]: the output stream; ARGV[1]: the TTL (s) of a stream made here; ARGV[2]:
# ID_GENERATION. Moves the stream's last id (XINFO STREAM's last-generated-id: a take-over
# that wrote nothing since counts too) to the next generation, keeping the tokens it counts,
# and returns where that generation starts. A stream that does not exist (nothing written
# yet) is made empty at that id (XADD then XDEL), with the TTL: a first chunk still on
# its way from the earlier worker is refused too. Lua numbers are doubles, exact to 2**53:
# far past any generation a request reaches.
TAKE_OVER = """
local span = tonumber(ARGV[2])
local info = redis.pcall('XINFO', 'STREAM', KEYS[1])
local exists = type(info) == 'table' and not info.err
local ms = 0
if exists then
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then ms = tonumber(string.match(info[i + 1], '^(%d+)')) end
  end
end
local base = (math.floor(ms / span) + 1) * span
local id = string.format('%.0f-0', base + ms % span)
if exists then
  redis.call('XSETID', KEYS[1], id)
else
  redis.call('XADD', KEYS[1], id, 'x', '')
  redis.call('XDEL', KEYS[1], id)
  redis.call('EXPIRE', KEYS[1], ARGV[1])
end
return string.format('%.0f', base)
"""


@dataclass
class Published:
    """Tokens (and their text) another worker already published for a request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # The stream already ends with a final entry: only the acknowledgement is missing.
    finished: bool = False
    # Where this worker's entry ids start (0: it did not take the stream over).
    id_base: int = 0


def take_over(client: redis.Redis, keys: Keys, request_id: str, ttl_s: int) -> Published:
    """Move the request's output stream to a new generation of ids, then read it."""
    key = keys.output(request_id)
    base = int(client.eval(TAKE_OVER, 1, key, ttl_s, ID_GENERATION))
    published = read_published(client, keys, request_id)
    published.id_base = base  # above every entry there
    return published


def read_published(client: redis.Redis, keys: Keys, request_id: str) -> Published:
    """Read the request's output stream; the tokens run from index 0 without gaps. Its
    ``id_base`` is the generation of the last entry: a decode worker goes on where the
    prefill worker that handed the request on wrote (it writes nothing after), in the
    generation it wrote in (it may have taken the request over)."""
    out = Published()
    entries = client.xrange(keys.output(request_id))
    if entries:
        ms, _ = entry_id_key(as_text(entries[-1][0]))
        out.id_base = ms - ms % ID_GENERATION
    for _entry_id, fields in entries:
        try:
            entry = decode_output(fields.get(FIELD))
        except ProtocolError:
            continue  # not ours to interpret; the fenced ids keep indexes consistent anyway
        if isinstance(entry, FinalEntry):
            out.finished = True
            break
        if entry.index != len(out.token_ids):
            break  # never expected: entry ids fence indexes; trust only the gap-free prefix
        out.token_ids.extend(entry.token_ids)
        out.text += entry.text
    return out
