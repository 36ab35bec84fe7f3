"""What writing and reading one output chunk costs Redis, with nothing else running.

    python -m worker.bench.stream_reads [--streams 256] [--rounds 200] [--tokens 9]

A private redis-server holds STREAMS output streams of chunks as workers write them (each
``TOKENS`` token ids and their text, the wire's own encoding). Each round, 29 of them get a
chunk (one XADD each) and one XREAD names those 29 at their last id and 18 quiet ones, as the
bench's reader does at a GPU's rate (docs/redis.md: ~29 entries and ~47 names a poll in W7);
a stream past 26 chunks starts again. Then the walk: an XREAD of the last entry of streams 2
and 26 chunks long. The figures are Redis's own (INFO commandstats, microseconds of the
command alone, no socket or round trip), to set beside what a whole run costs it a token.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

NAMED_WITH_ENTRIES = 29
NAMED_QUIET = 18
LONGEST = 26


def _chunk(rng: random.Random, number: int, tokens: int) -> bytes:
    from producer.wire.protocol import OutputChunk

    text = "".join(rng.choice("abcdefgh ") for _ in range(4 * tokens))
    return OutputChunk(number * tokens, [rng.randrange(32000) for _ in range(tokens)],
                       text).encode()


def _fill(r: Any, rng: random.Random, lengths: dict[int, int], tokens: int) -> None:
    """Stream ``out{s}`` holds chunks 1 .. ``lengths[s]``, at ids ``{number}-0``."""
    from producer.wire.protocol import FIELD

    for s, n in lengths.items():
        for number in range(1, n + 1):
            r.xadd(f"out{s}", {FIELD: _chunk(rng, number, tokens)}, id=f"{number}-0")


def _usec_per_call(r: Any, command: str) -> float:
    return float(r.info("commandstats")[f"cmdstat_{command}"]["usec_per_call"])


def measure(streams: int, rounds: int, tokens: int) -> dict[str, Any]:
    import redis

    from producer.redis.ephemeral import start_ephemeral
    from producer.wire.protocol import FIELD

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder, \
            start_ephemeral(Path(folder), appendonly="no") as server:
        r = redis.Redis.from_url(server.url)
        length = {s: s % LONGEST for s in range(streams)}  # staggered, as requests are
        _fill(r, rng, length, tokens)
        entry_bytes = len(_chunk(rng, 1, tokens))
        r.config_resetstat()
        for round_ in range(rounds):
            written = [(round_ * NAMED_WITH_ENTRIES + k) % streams
                       for k in range(NAMED_WITH_ENTRIES)]
            for s in written:
                if length[s] == LONGEST:
                    r.delete(f"out{s}")
                    length[s] = 0
                length[s] += 1
                r.xadd(f"out{s}", {FIELD: _chunk(rng, length[s], tokens)}, id=f"{length[s]}-0")
            names = {f"out{s}": f"{length[s] - 1}-0" for s in written}
            for k in range(NAMED_QUIET):
                s = (round_ * NAMED_WITH_ENTRIES + streams // 2 + k) % streams
                names.setdefault(f"out{s}", f"{length[s]}-0")
            r.xread(names, count=64)
        xread_us, xadd_us = _usec_per_call(r, "xread"), _usec_per_call(r, "xadd")
        walk = {}
        for n in (2, LONGEST):
            r.flushall()
            _fill(r, rng, dict.fromkeys(range(streams), n), tokens)
            r.config_resetstat()
            for round_ in range(rounds):
                r.xread({f"out{(round_ * NAMED_WITH_ENTRIES + k) % streams}": f"{n - 1}-0"
                         for k in range(NAMED_WITH_ENTRIES)})
            walk[f"last_of_{n}_us"] = round(_usec_per_call(r, "xread") / NAMED_WITH_ENTRIES, 2)
        version = r.info("server")["redis_version"]
    return {
        "redis": version, "streams": streams, "tokens_a_chunk": tokens,
        "entry_bytes": entry_bytes,
        "xread_us": xread_us,
        "xread_us_an_entry": round(xread_us / NAMED_WITH_ENTRIES, 2),
        "xadd_us": xadd_us,
        "commands_us_a_token": round((xread_us / NAMED_WITH_ENTRIES + xadd_us) / tokens, 3),
        "xread_of_one_entry_by_stream_length": walk,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--tokens", type=int, default=9, help="tokens a chunk (W7's ~9 at 50 ms)")
    args = p.parse_args(argv)
    print(json.dumps(measure(args.streams, args.rounds, args.tokens), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
