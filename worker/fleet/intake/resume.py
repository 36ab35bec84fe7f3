"""What a request's output stream already holds: where a claimed request resumes from."""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, ProtocolError, decode_output


@dataclass
class Published:
    """Tokens (and their text) another worker already published for a request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # The stream already ends with a final entry: only the acknowledgement is missing.
    finished: bool = False


def read_published(client: redis.Redis, keys: Keys, request_id: str) -> Published:
    """Read the request's output stream; the tokens run from index 0 without gaps."""
    out = Published()
    for _entry_id, fields in client.xrange(keys.output(request_id)):
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
