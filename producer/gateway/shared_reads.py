"""Many followers' blocking XREADs served by a few shared ones (an asyncio server's).

A follower (producer/client/stream_follow.py) waits for its streams with a blocking XREAD.
Alone, each holds a Redis connection for as long as it waits: a server answering a
thousand streams at once would hold a thousand connections (and redis-py's asyncio pool
refuses the 101st). Here every follower's read joins one queue, and at most
``max_readers`` XREADs at a time, each naming at most ``max_keys`` streams, serve them all:
a reply goes to each read whose streams got entries, and a read that got nothing joins
the back of the queue again until its own BLOCK is over (then it gets None, as from XREAD):
past ``max_readers`` x ``max_keys`` waiting streams, XREADs take them in turn.

A blocking XREAD cannot take a stream named after it began. A read queued while a reader is
free starts one at once; so that one queued while every reader waits is not left waiting
long, the reader that takes the last free place blocks at most ``block_cap_ms`` (the others
up to IDLE_BLOCK_MS: an idle gateway does not poll). Under load readers come back far
sooner, at the first entry of any stream they name, and after PACE_MS take everything
queued meanwhile into their next XREAD.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

try:
    from hiredis import pack_command
except ImportError:  # redis-py packs it then (slower, the same bytes)
    pack_command = None

from producer.client.stream_events import entry_id_key
from producer.wire.keys import as_text

# XREADs in flight at once, streams one of them names, and its longest BLOCK (see above).
MAX_READERS = 8
MAX_KEYS = 256
BLOCK_CAP_MS = 10
# The longest BLOCK of a reader that leaves a free place beside it.
IDLE_BLOCK_MS = 250
# A reader whose XREAD brought entries waits this long before its next: an XREAD returns at
# the first entry of any stream it names and costs Redis and this process something for
# every stream it names, so without the pause a reader of hundreds of streams would name
# them all again for each entry.
PACE_MS = 2


@dataclass(eq=False)
class _Read:
    """One follower's XREAD: its streams (key -> id to read after), until when it may wait
    (the event loop's clock), and where its reply goes."""

    streams: dict[str, str]
    deadline: float
    future: asyncio.Future = field(repr=False)


class SharedReads:
    """``await reads.xread(streams, block_ms)`` answers as ``redis.xread(streams, count,
    block=block_ms)`` would, through XREADs shared with every other caller; each entry's
    fields as the raw reply holds them ([field, value, ...]; a dict where hiredis is
    missing: producer.wire.protocol.entry_message reads either)."""

    def __init__(self, redis: Any, *, count: int, max_readers: int = MAX_READERS,
                 max_keys: int = MAX_KEYS, block_cap_ms: int = BLOCK_CAP_MS) -> None:
        for name, value in (("max_readers", max_readers), ("max_keys", max_keys),
                            ("block_cap_ms", block_cap_ms)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.redis = redis
        self.count = count
        self.max_readers = max_readers
        self.max_keys = max_keys
        self.block_cap_ms = block_cap_ms
        self._queue: deque[_Read] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self._starting = False  # a start of readers is due this turn of the loop
        # Called with the number of streams each shared XREAD names (a metric's hook).
        self.on_read: Callable[[int], object] | None = None

    async def xread(self, streams: dict[str, str], block_ms: int) -> list | None:
        """Entries after each stream's id, as XREAD's reply ([(stream, entries), ...]); None
        when none came within ``block_ms``."""
        if self._closed:
            raise RuntimeError("these shared reads are closed")
        loop = asyncio.get_running_loop()
        read = _Read(dict(streams), loop.time() + block_ms / 1000, loop.create_future())
        self._queue.append(read)
        if not self._starting:
            # Readers start once this turn of the loop is over, with every read queued in it:
            # the followers a reply woke come back together, not one small XREAD each.
            self._starting = True
            loop.call_soon(self._start_queued)
        try:
            return await read.future
        finally:
            if not read.future.done():
                read.future.cancel()  # the caller gave up: the readers drop it

    async def close(self) -> None:
        """Stop the XREADs in flight and drop the queued reads: every read waiting ends with
        CancelledError, and later ones raise RuntimeError."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        while self._queue:
            self._queue.popleft().future.cancel()

    def _start_queued(self) -> None:
        self._starting = False
        self._start_readers()

    def _start_readers(self) -> None:
        while not self._closed and len(self._tasks) < self.max_readers:
            batch = self._take()
            if not batch:
                return
            task = asyncio.ensure_future(self._read(batch))
            self._tasks.add(task)  # (the loop keeps only a weak reference to a task)
            task.add_done_callback(self._tasks.discard)

    def _take(self) -> list[_Read]:
        """Queued reads, oldest first, naming at most max_keys streams together (a read that
        names more goes alone)."""
        batch: list[_Read] = []
        keys = 0
        now = asyncio.get_running_loop().time()
        while self._queue:
            read = self._queue[0]
            if read.future.done():  # its caller gave up
                self._queue.popleft()
                continue
            if now >= read.deadline:  # its BLOCK ended while it waited for a reader
                self._queue.popleft().future.set_result(None)
                continue
            if batch and keys + len(read.streams) > self.max_keys:
                break
            batch.append(self._queue.popleft())
            keys += len(read.streams)
        return batch

    async def _read(self, batch: list[_Read]) -> None:
        after: dict[str, str] = {}  # each stream once, after the earliest id asked
        readers: dict[str, list[_Read]] = {}  # and the reads that wait on it
        for read in batch:
            for key, last in read.streams.items():
                if key not in after:
                    after[key] = last
                    readers[key] = [read]
                    continue
                if entry_id_key(last) < entry_id_key(after[key]):
                    after[key] = last
                readers[key].append(read)
        loop = asyncio.get_running_loop()
        left_ms = math.ceil((min(r.deadline for r in batch) - loop.time()) * 1000)
        # (this reader is in _tasks already: the last free place is its own when full)
        cap = self.block_cap_ms if len(self._tasks) >= self.max_readers else IDLE_BLOCK_MS
        if self.on_read is not None:
            self.on_read(len(after))
        try:
            reply = await _raw_command(self.redis, (
                "XREAD", "COUNT", self.count, "BLOCK", max(1, min(cap, left_ms)), "STREAMS",
                *after.keys(), *after.values()))
        except BaseException as exc:
            self._tasks.discard(asyncio.current_task())
            for read in batch:
                if not read.future.done():
                    read.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise  # cancelled (closing): the callers heard of it
            self._start_readers()  # the reads queued meanwhile try on their own
            return
        got = reply.items() if isinstance(reply, dict) else reply or []
        if got:
            self._answer(got, after, readers)
        now = loop.time()
        again: list[_Read] = []
        for read in batch:
            if read.future.done():
                continue
            if now >= read.deadline:
                read.future.set_result(None)
            else:
                again.append(read)
        self._queue.extend(again)  # behind those queued since: in turn, none starved
        if got:  # let entries gather: the reads just answered come back meanwhile
            await asyncio.sleep(PACE_MS / 1000)
        self._tasks.discard(asyncio.current_task())  # a free reader for what follows
        self._start_readers()


    @staticmethod
    def _answer(got: Any, after: dict[str, str], readers: dict[str, list[_Read]]) -> None:
        """Hand each read the entries ``got`` (an XREAD reply) holds for its streams."""
        mine: dict[_Read, list] = {}
        for stream, entries in got:
            key = as_text(stream)
            for read in readers.get(key, ()):
                if read.future.done():  # its caller gave up
                    continue
                theirs = entries
                if read.streams[key] != after[key]:  # another read asked from an earlier id
                    last = entry_id_key(read.streams[key])
                    theirs = [e for e in entries if entry_id_key(as_text(e[0])) > last]
                if theirs:
                    mine.setdefault(read, []).append((stream, theirs))
        for read, replies in mine.items():
            read.future.set_result(replies)


async def _raw_command(redis: Any, args: tuple) -> Any:
    """One command on a connection of ``redis``'s pool (its retry rules kept), packed by
    hiredis and its reply left raw. An XREAD of hundreds of streams is as many arguments:
    redis-py spent ~4 µs of Python a stream packing them and then made a dict of each
    entry's fields, which the followers need not (producer.wire.protocol.entry_message)."""
    if pack_command is None:  # without hiredis: the same command through redis-py
        return await redis.execute_command(*args)
    packed = pack_command(args)  # (before a connection is taken: nothing to leak)
    pool = redis.connection_pool
    conn = await pool.get_connection()

    async def once() -> Any:
        await conn.send_packed_command(packed)
        return await conn.read_response()  # (a failed or cancelled read disconnects)

    async def failed(error: Exception, *count: int) -> None:
        await conn.disconnect()

    try:
        return await conn.retry.call_with_retry(once, failed)
    finally:
        await pool.release(conn)
