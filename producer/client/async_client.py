"""The asyncio client: the same verbs as :class:`producer.client.client.Client`, awaited.

Everything but the Redis calls is shared with the synchronous client
(:class:`producer.client.client.ClientBase`, :mod:`producer.client.stream_follow`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio

from producer.client.backpressure import add_if_room_async
from producer.client.client import (
    CLIENT_DEFAULT,
    READ_COUNT,
    ClientBase,
    parse_model_info,
    tokenizer_from,
)
from producer.client.connection import connect_async
from producer.client.models import (
    ModelState,
    decode_hash,
    heartbeat_keys,
    member_names,
    model_states,
    state_of,
)
from producer.client.orphans import ORPHAN_TIMEOUT_S, OrphanWatch, held_from
from producer.client.stream_events import StreamEvent, completion_from, event_from
from producer.client.stream_follow import OutputFollower, StreamFollower, block_ms, deadline_after
from producer.client.watch import WATCH_TTL_S, AsyncWatchKeeper
from producer.clock import Clock
from producer.wire.completion import Completion
from producer.wire.errors import LaneBlocked
from producer.wire.keys import GROUP
from producer.wire.protocol import FIELD
from producer.wire.validation import choice_id

if TYPE_CHECKING:
    from tokenizers import Tokenizer

T = TypeVar("T")


class AsyncClient(ClientBase):
    """Submit generation requests and read their output from asyncio code.

    ``url`` None means the embedded redis-server; pass ``connection`` to share an
    existing asyncio client instead (it is not closed by ``close``). ``max_queue`` is the
    default for :meth:`submit`'s (None: no limit); ``clock`` (default: the system's)
    decides every timeout and deadline; ``orphan_timeout`` and the watch as Client's.
    ``max_connections`` bounds the connection pool (a command waits for a free one);
    :attr:`shared_reads` can take every follower's XREAD off its own connection.
    """

    def __init__(
        self,
        url: str | None = None,
        namespace: str = "conveyor",
        *,
        connection: redis.asyncio.Redis | None = None,
        max_queue: int | None = None,
        clock: Clock | None = None,
        orphan_timeout: float | None = ORPHAN_TIMEOUT_S,
        watch: bool = False,
        watch_ttl_s: int = WATCH_TTL_S,
        watch_id: str | None = None,
        max_connections: int | None = None,
        affinity: bool = True,
    ) -> None:
        super().__init__(namespace, connection, max_queue, clock, orphan_timeout, watch,
                         watch_ttl_s, watch_id, affinity)
        self.redis = (connection if connection is not None
                      else connect_async(url, max_connections=max_connections))
        # Set by a server that answers many streams at once (the gateway's SharedReads,
        # producer/gateway/shared_reads.py): an object whose ``await xread(streams,
        # block_ms)`` answers as XREAD, through XREADs shared with the other followers;
        # None: each follower reads on its own connection. Its owner closes it.
        self.shared_reads: Any = None
        self._watch_keeper: AsyncWatchKeeper | None = None
        self._watch_lock = asyncio.Lock()

    async def submit(
        self, prompt: str | list[int] | None = None, *, model: str,
        messages: list[dict[str, str]] | None = None, lane: str = "interactive",
        request_id: str | None = None, priority: int = 0, deadline_ms: int | None = None,
        timeout: float | None = None, pipeline: redis.asyncio.client.Pipeline | None = None,
        max_queue: int | None = None, allow_unregistered: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None, **sampling: Any,
    ) -> str:
        """Enqueue one request and return its id; ValueError (nothing written) when invalid.

        See :meth:`producer.client.client.Client.submit`; with ``pipeline`` the XADD is only queued,
        and ``max_queue`` raises QueueFull when the stream is full (never checked in a pipeline).
        A model nobody registered raises ModelNotFound unless ``allow_unregistered``; one
        without a live worker is queued with a warning logged.
        """
        sub = self._submission(
            prompt, max_queue, pipeline is not None, await self._watch_id(), model=model,
            messages=messages, lane=lane, request_id=request_id, priority=priority,
            deadline_ms=deadline_ms, timeout=timeout, sampling=sampling,
            chat_template_kwargs=chat_template_kwargs, tools=tools)
        if allow_unregistered:
            if sub.model not in self._requested:  # so that `conveyor top` shows its lane
                await self.redis.sadd(self.keys.requested, sub.model)
                self._requested.add(sub.model)
        else:
            await self._check_model(sub.model, sub.request_id)
        if sub.lookup or sub.limit is not None:  # (max_queue counts affinity lanes)
            try:
                state = await self._affinity_state(sub.model)
                live = state.affinity_workers
                owners = (await self.redis.hmget(self._owners_hash(sub, state), sub.lookup)
                          if sub.lookup and live else [])
                sub = self._placed(sub, owners, live)
            except redis.exceptions.NoPermissionError:
                self._no_affinity()
        try:
            if sub.limit is not None:
                entry_id = await add_if_room_async(self.redis, sub.counted, FIELD, sub.payload,
                                                   sub.limit)
            elif pipeline is not None:
                pipeline.xadd(sub.key, {FIELD: sub.payload})
                entry_id = None
            else:
                entry_id = await self.redis.xadd(sub.key, {FIELD: sub.payload})
        except redis.ResponseError as exc:
            if LaneBlocked.matches(exc):
                raise LaneBlocked(sub.key) from exc
            raise
        self._put_at(sub.request_id, sub.model, sub.key, entry_id)
        return sub.request_id

    async def _watch_id(self) -> str | None:
        """This client's watch id (its keeper started on first use), or None without one."""
        if not self.watches:
            return None
        async with self._watch_lock:  # many submits at once start one keeper
            if self._watch_keeper is None:
                keeper = AsyncWatchKeeper(self.redis, self.keys, ttl_s=self.watch_ttl_s,
                                          watch_id=self.watch_id)
                await keeper.start()
                self._watch_keeper = keeper
            return self._watch_keeper.id

    async def _affinity_state(self, model: str) -> ModelState:
        """What the model check last read of ``model``'s heartbeats (or now reads): its live
        workers that read affinity lanes, and the generation of their owners' hashes."""
        state = self._recent_state(model)
        if state is None:
            state = await self.model_state(model)
        return state

    async def _check_model(self, model: str, request_id: str) -> None:
        state = self._recent_state(model)
        fresh = state is None
        if state is None:
            state = await self.model_state(model)
        self._judge(state, fresh, request_id, None if state.known else await self.models())

    def stream(
        self, request_id: str, from_id: str | None = None, *, timeout: float | None = None,
        orphan_timeout: float | None | object = CLIENT_DEFAULT, tick_s: float | None = None,
    ) -> AsyncIterator[StreamEvent | None]:
        """Async-iterate a request's ChunkEvents in token order, then its FinalEvent.

        Same resume, each-index-once, gap, timeout and orphan rules as
        :meth:`producer.client.client.Client.stream`. With ``tick_s``, also None each time
        that long (on the client's clock) passed without an event: a server that must speak
        while a stream is quiet (keep-alives) learns of it from the read it waits on anyway,
        with no timer or task of its own per event.
        """
        if tick_s is not None and not tick_s > 0:
            raise ValueError(f"tick_s must be a positive number of seconds, got {tick_s!r}")
        follower = self._follower(request_id, from_id, timeout)
        watch = self._watch(request_id, orphan_timeout)
        if not follower.needs_probe:  # (one generator less between each event and its reader)
            return self._follow(follower, watch, tick_s)
        return self._follow_one(follower, watch, tick_s)

    async def _follow_one(self, follower: StreamFollower, watch: OrphanWatch | None = None,
                          tick_s: float | None = None) -> AsyncIterator[StreamEvent | None]:
        if follower.needs_probe:
            follower.probe(await self.redis.xrevrange(follower.key, count=1))
        async for event in self._follow(follower, watch, tick_s):
            yield event

    async def _follow(self, follower: OutputFollower[T], watch: OrphanWatch | None = None,
                      tick_s: float | None = None) -> AsyncIterator[T | None]:
        # The only I/O of following: the follower decides what to read and what it means,
        # the watch when to look at the model and the request's whereabouts.
        quiet_since = self.clock.monotonic()
        while not follower.done:
            streams, block = follower.streams(), follower.block_ms()
            if watch is not None:
                block = min(block, watch.block_ms())
            if tick_s is not None:
                block = max(1, min(block, math.ceil(
                    (quiet_since + tick_s - self.clock.monotonic()) * 1000)))
            if self.shared_reads is not None:
                reply = await self.shared_reads.xread(streams, block)
            else:
                reply = await self.redis.xread(streams, count=READ_COUNT, block=block)
            items = follower.feed(reply)
            for item in items:
                yield item
            if tick_s is not None:
                now = self.clock.monotonic()
                if items:
                    quiet_since = now
                elif now - quiet_since >= tick_s:
                    quiet_since = now
                    yield None
            if watch is not None and not follower.done:
                if reply:
                    watch.heard()
                elif watch.due():
                    await self._look(watch)
            follower.check_deadline()

    async def _look(self, watch: OrphanWatch) -> None:
        # Without a timeout only the whereabouts matter: no look at the model.
        live = watch.timeout is None or (await self.model_state(watch.submitted.model)).live
        pipe = self.redis.pipeline(transaction=False)
        self._queue_look(pipe, watch)
        watch.judge(live, held_from(await pipe.execute(raise_on_error=False),
                                    watch.submitted.entry_id, GROUP))

    async def result(self, request_id: str, timeout: float | None = None, *,
                     orphan_timeout: float | None | object = CLIENT_DEFAULT) -> Completion:
        """Wait for a request to finish and return its whole Completion (NoLiveWorker or
        RequestLost as :meth:`producer.client.client.Client.result`)."""
        events = [e async for e in self.stream(request_id, timeout=timeout,
                                               orphan_timeout=orphan_timeout)]
        return completion_from(request_id, events)

    async def choices(self, request_id: str, n: int, timeout: float | None = None, *,
                      orphan_timeout: float | None | object = CLIENT_DEFAULT
                      ) -> list[Completion]:
        """The Completions of a request's ``n`` choices, read at once
        (:meth:`producer.client.client.Client.choices`); the first failure to read one is
        raised, and the other reads stop."""
        if n == 1:
            return [await self.result(request_id, timeout, orphan_timeout=orphan_timeout)]
        try:
            async with asyncio.TaskGroup() as group:
                reads = [group.create_task(self.result(
                    choice_id(request_id, i), timeout, orphan_timeout=orphan_timeout))
                    for i in range(n)]
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        return [read.result() for read in reads]

    async def last_event(self, request_id: str) -> StreamEvent | None:
        """The last entry of a request's output stream, decoded; None when it has none."""
        last = await self.redis.xrevrange(self.keys.output(request_id), count=1)
        return event_from(*last[0]) if last else None

    async def wait_for_output(self, request_id: str, timeout: float | None) -> bool:
        """Whether the request's output stream exists, waiting up to ``timeout`` seconds."""
        key = self.keys.output(request_id)
        deadline = deadline_after(timeout, self.clock)
        while not await self.redis.exists(key):
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            await self.redis.xread({key: "0-0"}, count=1, block=block_ms(deadline, self.clock))
        return True

    async def cancel(
        self, request_id: str, *, pipeline: redis.asyncio.client.Pipeline | None = None
    ) -> None:
        """Ask workers to stop a request: a marker key plus an announcement, in one go."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        self._queue_cancel(pipe, request_id)
        if pipeline is None:
            await pipe.execute()

    async def models(self, *, live_only: bool = False) -> list[str]:
        """Names of the models workers have registered, sorted; with ``live_only``, the
        models a live worker serves. See :meth:`producer.client.client.Client.models`."""
        if live_only:
            return [s.name for s in await self.model_states() if s.live]
        return member_names(await self.redis.smembers(self.keys.models))

    async def model_states(self) -> list[ModelState]:
        """Every known model with its live workers; see :meth:`Client.model_states`."""
        states = model_states(await self.models(), await self._heartbeats())
        for state in states:
            self._remember(state)
        return states

    async def model_state(self, name: str) -> ModelState:
        """One model's state: registered or not, and its live workers."""
        registered = bool(await self.redis.exists(self.keys.model(name)))
        return self._remember(state_of(name, registered, await self._heartbeats()))

    async def _heartbeats(self) -> list[dict[str, str]] | None:
        try:
            members = await self.redis.smembers(self.keys.workers)
            pipe = self.redis.pipeline(transaction=False)
            for key in heartbeat_keys(self.keys, members):
                pipe.hgetall(key)
            return [decode_hash(raw) for raw in await pipe.execute() if raw]
        except redis.exceptions.NoPermissionError:
            return None

    async def model_info(self, name: str) -> dict[str, Any] | None:
        """A registered model's description, or None; see :meth:`Client.model_info`."""
        return parse_model_info(await self.redis.hgetall(self.keys.model(name)))

    async def tokenizer(self, name: str) -> Tokenizer | None:
        """The model's tokenizer, built from its registered tokenizer.json, or None."""
        return tokenizer_from(await self.redis.hget(self.keys.model(name), "tokenizer_json"))

    async def close(self) -> None:
        """Stop renewing the watch, if any, and close the connection, unless it was passed
        in by the caller."""
        async with self._watch_lock:
            if self._watch_keeper is not None:
                await self._watch_keeper.stop()
                self._watch_keeper = None  # a later submit starts another watch
        if self._owns_connection:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
