"""The asyncio client: the same verbs as :class:`producer.client.Client`, awaited."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import redis.asyncio

from producer.backpressure import add_if_room_async, check_max_queue
from producer.client import (
    CANCEL_MARKER_TTL_S,
    READ_COUNT,
    block_ms,
    build_request,
    check_bytes_replies,
    deadline_after,
    model_names,
    model_pattern,
    parse_model_info,
    queue_limit,
    timed_out,
)
from producer.connection import connect_async
from producer.stream_events import OutputTracker, StreamEvent, completion_from, validate_entry_id
from producer.wire.completion import Completion
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class AsyncClient:
    """Submit generation requests and read their output from asyncio code.

    ``url`` None means the embedded redis-server; pass ``connection`` to share an
    existing asyncio client instead (it is not closed by ``close``). ``max_queue`` is the
    default for :meth:`submit`'s (None: no limit).
    """

    def __init__(
        self,
        url: str | None = None,
        namespace: str = "conveyor",
        *,
        connection: redis.asyncio.Redis | None = None,
        max_queue: int | None = None,
    ) -> None:
        self.keys = Keys(namespace)
        self.max_queue = check_max_queue(max_queue)
        if connection is not None:
            check_bytes_replies(connection)
        self._owns_connection = connection is None
        self.redis = connection if connection is not None else connect_async(url)

    async def submit(
        self,
        prompt: str | list[int],
        *,
        model: str,
        lane: str = "interactive",
        request_id: str | None = None,
        priority: int = 0,
        deadline_ms: int | None = None,
        timeout: float | None = None,
        pipeline: redis.asyncio.client.Pipeline | None = None,
        max_queue: int | None = None,
        **sampling: Any,
    ) -> str:
        """Enqueue one request and return its id; ValueError (nothing written) when invalid.

        See :meth:`producer.client.Client.submit`; with ``pipeline`` the XADD is only queued,
        and ``max_queue`` raises QueueFull when the stream is full (never checked in a pipeline).
        """
        limit = queue_limit(max_queue, self.max_queue, pipeline is not None)
        request = build_request(
            prompt,
            model=model,
            lane=lane,
            request_id=request_id,
            priority=priority,
            deadline_ms=deadline_ms,
            timeout=timeout,
            sampling=sampling,
        )
        key = self.keys.requests(request.model, request.lane)
        if limit is not None:
            await add_if_room_async(self.redis, key, FIELD, request.encode(), limit)
        elif pipeline is not None:
            pipeline.xadd(key, {FIELD: request.encode()})
        else:
            await self.redis.xadd(key, {FIELD: request.encode()})
        return request.request_id

    def stream(
        self, request_id: str, from_id: str | None = None, *, timeout: float | None = None
    ) -> AsyncIterator[StreamEvent]:
        """Async-iterate a request's ChunkEvents in token order, then its FinalEvent.

        Same resume, each-index-once and timeout rules as :meth:`producer.client.Client.stream`.
        """
        key = self.keys.output(request_id)
        tracker = OutputTracker(validate_entry_id(from_id or "0-0"))
        deadline = deadline_after(timeout)
        return self._follow(request_id, key, tracker, deadline, timeout)

    async def _follow(
        self,
        request_id: str,
        key: str,
        tracker: OutputTracker,
        deadline: float | None,
        timeout: float | None,
    ) -> AsyncIterator[StreamEvent]:
        while True:
            reply = await self.redis.xread(
                {key: tracker.last_id}, count=READ_COUNT, block=block_ms(deadline)
            )
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    event = tracker.feed(entry_id, fields)
                    if event is not None:
                        yield event
                    if tracker.done:
                        return
            if deadline is not None and time.monotonic() >= deadline:
                raise timed_out(request_id, timeout)

    async def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """Wait for a request to finish and return its whole Completion."""
        events = [e async for e in self.stream(request_id, timeout=timeout)]
        return completion_from(request_id, events)

    async def cancel(
        self, request_id: str, *, pipeline: redis.asyncio.client.Pipeline | None = None
    ) -> None:
        """Ask workers to stop a request: a marker key plus an announcement, in one go."""
        marker = self.keys.cancelled(request_id)
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        pipe.set(marker, b"1", ex=CANCEL_MARKER_TTL_S)
        pipe.publish(self.keys.cancel_channel, request_id)
        if pipeline is None:
            await pipe.execute()

    async def models(self) -> list[str]:
        """Names of the models workers have registered, sorted."""
        found = [k async for k in self.redis.scan_iter(match=model_pattern(self.keys), count=100)]
        return model_names(self.keys, found)

    async def model_info(self, name: str) -> dict[str, Any] | None:
        """A registered model's description, or None; see :meth:`Client.model_info`."""
        return parse_model_info(await self.redis.hgetall(self.keys.model(name)))

    async def tokenizer(self, name: str) -> Tokenizer | None:
        """The model's tokenizer, built from its registered tokenizer.json, or None."""
        raw = await self.redis.hget(self.keys.model(name), "tokenizer_json")
        if raw is None:
            return None
        from tokenizers import Tokenizer

        return Tokenizer.from_str(raw.decode())

    async def close(self) -> None:
        """Close the connection, unless it was passed in by the caller."""
        if self._owns_connection:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
