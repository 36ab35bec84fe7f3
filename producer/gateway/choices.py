"""Several choices of one request (``n``) read as one streamed answer.

Each choice is a request of its own on its own output stream (``{id}.{i}`` after choice
0: docs/protocol.md); a task a choice follows its stream and hands each event on, with the
choice's index, in the order they come. The merged events end once every choice's final
has come; the reader is woken with None when all were quiet for ``tick_s`` (its keep-alive
and orphan looks), as a single stream's read does. A failure reading any choice is the
answer's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from producer.client.stream_events import FinalEvent, StreamEvent
from producer.wire.validation import choice_id


async def merged_events(client: Any, request_id: str, n: int, tick_s: float
                        ) -> AsyncIterator[tuple[int, StreamEvent] | None]:
    """(choice index, event) of every choice of ``request_id``, as they come; None after
    ``tick_s`` without any."""
    queue: asyncio.Queue[tuple[int, StreamEvent | Exception]] = asyncio.Queue()

    async def follow(index: int) -> None:
        try:
            async with contextlib.aclosing(
                    client.stream(choice_id(request_id, index), tick_s=tick_s)) as events:
                async for event in events:
                    if event is not None:
                        queue.put_nowait((index, event))
        except Exception as exc:  # noqa: BLE001 (handed to the reader, who raises it)
            queue.put_nowait((index, exc))

    tasks = [asyncio.ensure_future(follow(i)) for i in range(n)]
    try:
        ended = 0
        while ended < n:
            try:
                index, item = await asyncio.wait_for(queue.get(), tick_s)
            except TimeoutError:
                yield None
                continue
            if isinstance(item, Exception):
                raise item
            yield index, item
            if isinstance(item, FinalEvent):
                ended += 1
    finally:
        for task in tasks:
            task.cancel()
