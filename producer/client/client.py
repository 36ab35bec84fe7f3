"""The synchronous client: submit requests, stream or wait for their output, cancel them.

The I/O-free parts (building a request, reading a model hash, :class:`ClientBase`) live
here so that :mod:`producer.client.async_client` shares them; following output streams is
:mod:`producer.client.stream_follow`'s, and both clients only add the Redis calls.
"""

from __future__ import annotations

import json
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import redis
import structlog

from producer.affinity.prefix_keys import canonical_bytes, prefix_keys
from producer.affinity.routing import generation, lanes_counted, owner_of
from producer.client.backpressure import QueueFull, add_if_room, check_max_queue  # noqa: F401 (re-export)
from producer.client.connection import connect
from producer.client.models import (
    ModelState,
    decode_hash,
    heartbeat_keys,
    member_names,
    model_states,
    state_of,
)
from producer.client.orphans import (
    MAX_REMEMBERED,
    ORPHAN_TIMEOUT_S,
    OrphanWatch,
    Submitted,
    held_from,
    queue_look,
)
from producer.client.stream_events import (  # noqa: F401 (StreamGapError: re-export)
    StreamEvent,
    StreamGapError,
    completion_from,
    event_from,
)
from producer.client.stream_follow import (  # noqa: F401 (block_ms, deadline_after, timed_out: re-export)
    ManyFollower,
    OutputFollower,
    StreamFollower,
    block_ms,
    deadline_after,
    timed_out,
)
from producer.client.watch import WATCH_TTL_S, WatchKeeper, check_watch_ttl
from producer.clock import SYSTEM_CLOCK, Clock
from producer.wire.completion import Completion
from producer.wire.errors import LaneBlocked, ModelNotFound
from producer.wire.keys import GROUP, Keys
from producer.wire.params import SamplingParams
from producer.wire.protocol import FIELD, GenerationRequest
from producer.wire.validation import choice_id, request_of, validate_request_id

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# How long a cancellation marker outlives the announcement: covers workers that were
# restarting or had the request queued when the message went out.
CANCEL_MARKER_TTL_S = 3600
# Entries fetched per XREAD; a reader that fell behind catches up in few round trips.
READ_COUNT = 512
# "The client's own orphan_timeout" where a call does not give one (None means forever).
CLIENT_DEFAULT = object()
# Streams one XREAD of follow_many covers; the rest wait for the next round.
FOLLOW_MANY_KEYS = 256
# How long (seconds on the client's clock) submit trusts what it last learnt of a registered
# model's state: a burst of submits costs one look at Redis, and logs "no live worker" once.
MODEL_CHECK_TTL_S = 5.0

log = structlog.get_logger(__name__)

# Model hash fields (written by workers) that hold integers, and the one holding a JSON list.
_INT_FIELDS = ("max_model_len", "vocab_size", "updated_ms")
_JSON_FIELDS = ("eos_token_ids",)

T = TypeVar("T")


def new_request_id() -> str:
    """A random request id: 32 hex characters."""
    return uuid.uuid4().hex


def build_request(
    prompt: str | Sequence[int] | None,
    *,
    model: str,
    messages: list[dict[str, str]] | None = None,
    lane: str,
    request_id: str | None,
    priority: int,
    deadline_ms: int | None,
    timeout: float | None,
    sampling: dict[str, Any],
    clock: Clock = SYSTEM_CLOCK,
    watch: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> GenerationRequest:
    """A validated GenerationRequest from ``submit``'s arguments; ValueError when invalid.

    ``timeout`` becomes a ``deadline_ms`` on ``clock``'s unix time.
    """
    params = SamplingParams.from_dict(sampling)
    if timeout is not None:
        if deadline_ms is not None:
            raise ValueError("give at most one of timeout and deadline_ms")
        if (not isinstance(timeout, int | float) or isinstance(timeout, bool)
                or not math.isfinite(timeout) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        deadline_ms = int(clock.time() * 1000) + math.ceil(timeout * 1000)
    rid = new_request_id() if request_id is None else validate_request_id(request_id)
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    if prompt is None:
        text, token_ids = None, None
    elif isinstance(prompt, str):
        text, token_ids = prompt, None
    elif isinstance(prompt, list | tuple):
        text, token_ids = None, list(prompt)
    else:
        kind = type(prompt).__name__
        raise ValueError(f"prompt must be a str or a list of token ids, got {kind}")
    return GenerationRequest(
        request_id=rid,
        model=model,
        params=params,
        prompt=text,
        prompt_token_ids=token_ids,
        # A tuple becomes a list; anything else goes to validation as it is (list() would
        # turn a dict into its keys, and the error would name the wrong thing).
        messages=list(messages) if isinstance(messages, tuple) else messages,
        priority=priority,
        lane=lane,
        deadline_ms=deadline_ms,
        watch=watch,
        chat_template_kwargs=chat_template_kwargs,
        tools=tools,
    )


def queue_limit(given: int | None, default: int | None, pipelined: bool) -> int | None:
    """The ``max_queue`` a submit applies: its own, else the client's; none when pipelined."""
    if pipelined:
        if given is not None:
            raise ValueError("max_queue cannot be checked in a pipeline: submit without one")
        return None
    return check_max_queue(given) if given is not None else default


def parse_model_info(raw: dict[bytes, bytes]) -> dict[str, Any] | None:
    """A model hash as workers register it, decoded; None for an empty (absent) hash."""
    if not raw:
        return None
    info: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
    for name in _INT_FIELDS:
        if name in info:
            info[name] = int(info[name])
    for name in _JSON_FIELDS:
        if name in info:
            info[name] = json.loads(info[name])
    return info


def check_bytes_replies(conn: Any) -> None:
    """Stream entries hold msgpack bytes: a connection that decodes replies would break them."""
    if conn.get_connection_kwargs().get("decode_responses"):
        raise ValueError("the client needs a Redis connection with decode_responses=False")



def tokenizer_from(raw: bytes | None) -> Tokenizer | None:
    """A Tokenizer from a model hash's ``tokenizer_json`` value, or None when there is none."""
    if raw is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(raw.decode())


@dataclass(frozen=True)
class Submission:
    """A validated request, ready to XADD: its stream, its entry and the queue limit to check."""

    request_id: str
    key: str
    payload: bytes
    # None: XADD without counting the queue (no limit, or a pipelined submit).
    limit: int | None
    model: str = ""
    # What ``limit`` counts: the lane (``key``) and its handoff stream.
    counted: tuple[str, ...] = ()
    # The affinity keys to look owners up for, deepest last (none: the shared lane).
    lookup: tuple[str, ...] = ()
    lane: str = "interactive"


def read_heartbeats(r: redis.Redis, keys: Keys) -> list[dict[str, str]]:
    """The heartbeat hash of every worker in ``{ns}:workers`` that has not expired, decoded,
    read in one round trip (the worker's own check at start and Client alike)."""
    pipe = r.pipeline(transaction=False)
    for key in heartbeat_keys(keys, r.smembers(keys.workers)):
        pipe.hgetall(key)
    return [decode_hash(raw) for raw in pipe.execute() if raw]


class ClientBase:
    """What Client and AsyncClient share, all of it without I/O: they add only the Redis calls.

    ``clock`` decides every timeout and deadline (default: the system's).
    """

    def __init__(
        self, namespace: str, connection: Any, max_queue: int | None, clock: Clock | None,
        orphan_timeout: float | None = ORPHAN_TIMEOUT_S, watch: bool = False,
        watch_ttl_s: int = WATCH_TTL_S, watch_id: str | None = None, affinity: bool = True,
    ) -> None:
        # Prefix affinity (producer/affinity/): requests carry their prompt's keys and go to
        # the worker that holds their prefix. False: every request to the shared lane.
        self.affinity = affinity
        # Requests tied to this client's life (producer/client/watch.py): the keeper starts
        # with the first submit.
        self.watches = watch
        self.watch_ttl_s = watch_ttl_s
        check_watch_ttl(watch_ttl_s)
        if watch_id is not None:
            if not watch:
                raise ValueError("watch_id names the watch to keep: it needs watch=True")
            Keys(namespace).watch(watch_id)  # a ValueError now, not at the first submit
        self.watch_id = watch_id
        if orphan_timeout is not None and not orphan_timeout >= 0:
            raise ValueError(f"orphan_timeout must be >= 0 seconds or None, got "
                             f"{orphan_timeout!r}")
        self.orphan_timeout = orphan_timeout
        # Where this client put each request (for the orphan look), the oldest forgotten.
        self._submitted: OrderedDict[str, Submitted] = OrderedDict()
        self.keys = Keys(namespace)
        self.max_queue = check_max_queue(max_queue)
        self.clock = SYSTEM_CLOCK if clock is None else clock
        if connection is not None:
            check_bytes_replies(connection)
        self._owns_connection = connection is None
        # Model name -> (clock.monotonic() when read, its state): see MODEL_CHECK_TTL_S.
        self._model_checks: dict[str, tuple[float, ModelState]] = {}
        # Models this client put into the ``requested`` set (allow_unregistered submits).
        self._requested: set[str] = set()

    def _submission(
        self, prompt: str | Sequence[int] | None, max_queue: int | None, pipelined: bool,
        watch: str | None = None, **request: Any
    ) -> Submission:
        """Check a submit's arguments (``request``: build_request's keywords) and place it."""
        limit = queue_limit(max_queue, self.max_queue, pipelined)
        built = build_request(prompt, clock=self.clock, watch=watch, **request)
        lookup: tuple[str, ...] = ()
        if self.affinity:
            found = prefix_keys(canonical_bytes(
                built.prompt, built.prompt_token_ids, built.messages, built.tools,
                built.chat_template_kwargs))
            built.affinity = list(found.keys) or None
            lookup = found.lookup()
        key = self.keys.requests(built.model, built.lane)
        counted = (key, self.keys.handoff(built.model, built.lane))
        return Submission(built.request_id, key, built.encode(), limit, built.model, counted,
                          lookup, built.lane)

    def _placed(self, sub: Submission, owners: list[Any], live: tuple[str, ...]
                ) -> Submission:
        """``sub`` sent to the affinity lane of its prefix's live owner, if it has one
        (``owners``: what the owners' hash holds of its lookup keys); ``max_queue`` then
        counts every live worker's affinity lane of its lane too."""
        owner = owner_of(sub.lookup, owners, live)
        lanes = lanes_counted(self.keys, sub.model, sub.lane, live)
        if owner is None:
            return replace(sub, counted=(*sub.counted, *lanes))
        key = self.keys.affinity_lane(sub.model, owner, sub.lane)
        return replace(sub, key=key, counted=(key, *sub.counted, *(k for k in lanes if k != key)))

    def _no_affinity(self) -> None:
        """A producer user from before affinity (no ``{ns}:affinity:*``): the shared lanes."""
        log.warning("this producer's Redis user may not read prefix owners: its requests go "
                    "to the shared lanes (grant %R~NS:affinity:* +hmget)")
        self.affinity = False

    def _owners_hash(self, sub: Submission, state: ModelState) -> str:
        """The owners' hash to read: of the generation the workers' heartbeats name (this
        client's clock's where none does)."""
        gen = state.affinity_generation
        return self.keys.affinity_owners(
            sub.model, generation(self.clock.time()) if gen is None else gen)

    def _put_at(self, request_id: str, model: str, key: str, entry_id: Any) -> None:
        """Remember where a request went (``entry_id`` None: a pipelined XADD)."""
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        self._submitted[request_id] = Submitted(model, key, eid)
        if len(self._submitted) > MAX_REMEMBERED:
            self._submitted.popitem(last=False)

    def stream_of(self, request_id: str) -> str | None:
        """The request stream this client added ``request_id`` to (a shared lane, or a
        worker's affinity lane: producer/affinity/); None for one it does not remember."""
        submitted = self._submitted.get(request_of(request_id))
        return submitted.key if submitted is not None else None

    def _watch(self, request_id: str, orphan_timeout: float | None | object
               ) -> OrphanWatch | None:
        """The orphan look of a wait for ``request_id`` (or a choice of it): only for a
        request this client submitted (it knows the model and where the request went)."""
        submitted = self._submitted.get(request_of(request_id))
        if submitted is None:
            return None
        timeout = self.orphan_timeout if orphan_timeout is CLIENT_DEFAULT else orphan_timeout
        return OrphanWatch(request_id, submitted, timeout, self.clock)  # type: ignore[arg-type]

    def _queue_look(self, pipe: Any, watch: OrphanWatch) -> None:
        """Queue a look's reads on ``pipe`` (orphans.held_from reads their replies)."""
        sub = watch.submitted
        queue_look(pipe, sub.key, sub.entry_id, self.keys.output(watch.request_id))

    def _remember(self, state: ModelState) -> ModelState:
        self._model_checks[state.name] = (self.clock.monotonic(), state)
        return state

    def _recent_state(self, model: str) -> ModelState | None:
        """What submit last learnt of ``model``, if it is recent and the model was known
        (an unknown model is looked up again every time: a registration shows at once)."""
        checked = self._model_checks.get(model)
        if checked is None or not checked[1].known:
            return None
        at, state = checked
        return state if self.clock.monotonic() - at < MODEL_CHECK_TTL_S else None

    def _judge(self, state: ModelState, fresh: bool, request_id: str,
               served: list[str] | None) -> None:
        """Refuse a model nobody registered (``served``: the registered names); warn once
        per look at Redis about a model no live worker serves."""
        if not state.known:
            raise ModelNotFound(state.name, served or [], self.keys.ns)
        if fresh and not state.live:
            log.warning("no live worker serves this model: the request waits in its queue "
                        "until a worker starts (or its deadline passes)",
                        model=state.name, request_id=request_id)

    def _follower(
        self, request_id: str, from_id: str | None, timeout: float | None
    ) -> StreamFollower:
        """The follower of one request's stream; ValueError on a bad id or timeout."""
        key = self.keys.output(request_id)
        return StreamFollower(request_id, key, from_id or "0-0", timeout, self.clock)

    def _queue_cancel(self, pipe: Any, request_id: str) -> None:
        """Queue the cancellation marker and its announcement on ``pipe`` (sync or asyncio)."""
        pipe.set(self.keys.cancelled(request_id), b"1", ex=CANCEL_MARKER_TTL_S)
        pipe.publish(self.keys.cancel_channel, request_id)


class Client(ClientBase):
    """Submit generation requests and read their output, over one Redis connection.

    ``url`` None means the embedded redis-server (see :func:`producer.client.connection.connect`);
    pass ``connection`` to share an existing client instead (it is not closed by ``close``).
    ``max_queue`` is the default for :meth:`submit`'s (None: no limit). ``clock`` (default:
    the system's) decides every timeout and deadline. ``orphan_timeout``: how long a wait
    for a request this client submitted goes on while its model has no live worker (see
    :meth:`stream`; None: forever). ``watch``: tie this client's requests to its life: a
    worker cancels them once the client stopped renewing its watch key for ``watch_ttl_s``
    seconds (it died, or closed: producer/client/watch.py); ``watch_id`` keeps a given
    watch instead of a fresh one (a retried bulk job keeps the requests of its first run).
    ``affinity`` (default True): requests carry their prompt's prefix keys and go to the
    worker that holds that prefix, when one lives (docs/affinity.md); False sends every
    request to its shared lane.
    """

    def __init__(
        self,
        url: str | None = None,
        namespace: str = "conveyor",
        *,
        connection: redis.Redis | None = None,
        max_queue: int | None = None,
        clock: Clock | None = None,
        orphan_timeout: float | None = ORPHAN_TIMEOUT_S,
        watch: bool = False,
        watch_ttl_s: int = WATCH_TTL_S,
        watch_id: str | None = None,
        affinity: bool = True,
    ) -> None:
        super().__init__(namespace, connection, max_queue, clock, orphan_timeout, watch,
                         watch_ttl_s, watch_id, affinity)
        self.redis = connection if connection is not None else connect(url)
        self._watch_keeper: WatchKeeper | None = None
        self._watch_lock = threading.Lock()  # threads' first submits start one keeper

    def submit(
        self, prompt: str | list[int] | None = None, *, model: str,
        messages: list[dict[str, str]] | None = None, lane: str = "interactive",
        request_id: str | None = None, priority: int = 0, deadline_ms: int | None = None,
        timeout: float | None = None, pipeline: redis.client.Pipeline | None = None,
        max_queue: int | None = None, allow_unregistered: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None, **sampling: Any,
    ) -> str:
        """Enqueue one request and return its id; ValueError (nothing written) when invalid.

        ``prompt`` is text or token ids; or, instead of it, ``messages`` (chat turns, each
        ``{"role", "content"}``) are rendered by the model's chat template on the worker
        (a model without one refuses them on the request's stream), with
        ``chat_template_kwargs`` as more variables for it and ``tools`` (OpenAI's function
        tools) rendered for the model; the answer is text (the gateway reads calls out of
        it, producer/wire/tools/). ``timeout`` (seconds
        from now on the client's clock) sets ``deadline_ms``, the server-side deadline; other
        keywords are SamplingParams fields (``n``: several choices, one stream each:
        :meth:`choices`). With ``pipeline`` the XADD is only queued (the model check below
        still reads Redis at once).

        The model must be known: a model no worker ever registered (and no live worker
        serves) raises :class:`~producer.wire.errors.ModelNotFound`, naming the registered
        ones, unless ``allow_unregistered`` (then the request waits for a worker of that
        name, and nothing is looked up). A registered model without a live worker is
        queued and a warning is logged. What submit learnt is trusted for
        ``MODEL_CHECK_TTL_S`` seconds of the client's clock, so a burst costs one look.

        ``max_queue`` (default: the client's) refuses the request with
        :class:`~producer.client.backpressure.QueueFull` when its stream already holds that many
        undelivered plus pending requests; the check and the XADD are atomic. A pipelined
        submit is never checked (its answer would come back only at ``execute``): the
        caller bounds what it pipelines, and an explicit ``max_queue`` there is a ValueError.
        """
        sub = self._submission(
            prompt, max_queue, pipeline is not None, self._watch_id(), model=model,
            messages=messages, lane=lane, request_id=request_id, priority=priority,
            deadline_ms=deadline_ms, timeout=timeout, sampling=sampling,
            chat_template_kwargs=chat_template_kwargs, tools=tools)
        if allow_unregistered:
            if sub.model not in self._requested:  # so that `conveyor top` shows its lane
                self.redis.sadd(self.keys.requested, sub.model)
                self._requested.add(sub.model)
        else:
            self._check_model(sub.model, sub.request_id)
        if sub.lookup or sub.limit is not None:  # (max_queue counts affinity lanes)
            try:
                state = self._affinity_state(sub.model)
                live = state.affinity_workers
                owners = (self.redis.hmget(self._owners_hash(sub, state), sub.lookup)
                          if sub.lookup and live else [])  # (no owner to find: no look)
                sub = self._placed(sub, owners, live)
            except redis.exceptions.NoPermissionError:
                self._no_affinity()
        try:
            if sub.limit is not None:
                entry_id = add_if_room(self.redis, sub.counted, FIELD, sub.payload, sub.limit)
            elif pipeline is not None:
                pipeline.xadd(sub.key, {FIELD: sub.payload})
                entry_id = None
            else:
                entry_id = self.redis.xadd(sub.key, {FIELD: sub.payload})
        except redis.ResponseError as exc:
            if LaneBlocked.matches(exc):
                raise LaneBlocked(sub.key) from exc
            raise
        self._put_at(sub.request_id, sub.model, sub.key, entry_id)
        return sub.request_id

    def start_watch(self) -> str | None:
        """Start keeping this client's watch now rather than at its first submit (a retried
        bulk job renews its first run's watch at once); its id, None without ``watch``."""
        return self._watch_id()

    def _watch_id(self) -> str | None:
        """This client's watch id (its keeper started on first use), or None without one."""
        if not self.watches:
            return None
        with self._watch_lock:
            if self._watch_keeper is None:
                keeper = WatchKeeper(self.redis, self.keys, ttl_s=self.watch_ttl_s,
                                     watch_id=self.watch_id)
                keeper.start()
                self._watch_keeper = keeper
            return self._watch_keeper.id

    def _affinity_state(self, model: str) -> ModelState:
        """What the model check last read of ``model``'s heartbeats (or now reads): its live
        workers that read affinity lanes, and the generation of their owners' hashes."""
        state = self._recent_state(model)
        if state is None:
            state = self.model_state(model)
        return state

    def _check_model(self, model: str, request_id: str) -> None:
        state = self._recent_state(model)
        fresh = state is None
        if state is None:
            state = self.model_state(model)
        self._judge(state, fresh, request_id, None if state.known else self.models())

    def stream(
        self, request_id: str, from_id: str | None = None, *, timeout: float | None = None,
        orphan_timeout: float | None | object = CLIENT_DEFAULT,
    ) -> Iterator[StreamEvent]:
        """Yield a request's ChunkEvents in token order, then its FinalEvent, then stop.

        Starts after entry ``from_id`` (default: the beginning), so a reader resumes from
        the last entry id it saw. Each token index is yielded once. ``timeout`` (seconds on
        the client's clock, None = forever) raises TimeoutError when no final entry arrived
        in time. A stream that skips token indexes, or whose final entry disagrees with the
        tokens delivered, raises :class:`~producer.client.stream_events.StreamGapError` after the
        events before the gap. Resuming at or after the final entry yields nothing and
        returns at once.

        For a request this client submitted, the wait does not go on for nothing: once its
        model has had no live worker for ``orphan_timeout`` seconds (default: the client's,
        60; None waits for a worker forever) it raises
        :class:`~producer.wire.errors.NoLiveWorker`, and where nothing holds the request
        any more (neither its lane, a worker's pending list nor its output stream: a
        failover lost it) :class:`~producer.wire.errors.RequestLost`, at once.
        """
        return self._follow_one(self._follower(request_id, from_id, timeout),
                                self._watch(request_id, orphan_timeout))

    def _follow_one(self, follower: StreamFollower,
                    watch: OrphanWatch | None = None) -> Iterator[StreamEvent]:
        if follower.needs_probe:
            follower.probe(self.redis.xrevrange(follower.key, count=1))
        yield from self._follow(follower, watch)

    def follow_many(
        self, request_ids: list[str], *, timeout: float | None = None
    ) -> Iterator[tuple[str, StreamEvent]]:
        """Yield (request id, event) for many requests at once, until every one has finished.

        One XREAD covers up to FOLLOW_MANY_KEYS streams, so a dashboard or a benchmark
        follows hundreds of requests without a thread each. A gap in any stream raises
        :class:`~producer.client.stream_events.StreamGapError`.
        """
        keys = {self.keys.output(rid): rid for rid in request_ids}
        yield from self._follow(ManyFollower(keys, timeout, self.clock, FOLLOW_MANY_KEYS))

    def _follow(self, follower: OutputFollower[T],
                watch: OrphanWatch | None = None) -> Iterator[T]:
        # The only I/O of following: the follower decides what to read and what it means,
        # the watch when to look at the model and the request's whereabouts.
        while not follower.done:
            streams, block = follower.streams(), follower.block_ms()
            if watch is not None:
                block = min(block, watch.block_ms())
            reply = self.redis.xread(streams, count=READ_COUNT, block=block)
            yield from follower.feed(reply)
            if watch is not None and not follower.done:
                if reply:
                    watch.heard()
                elif watch.due():
                    self._look(watch)
            follower.check_deadline()

    def _look(self, watch: OrphanWatch) -> None:
        # Without a timeout only the whereabouts matter: no look at the model.
        live = watch.timeout is None or self.model_state(watch.submitted.model).live
        pipe = self.redis.pipeline(transaction=False)
        self._queue_look(pipe, watch)
        watch.judge(live, held_from(pipe.execute(raise_on_error=False),
                                    watch.submitted.entry_id, GROUP))

    def result(self, request_id: str, timeout: float | None = None, *,
               orphan_timeout: float | None | object = CLIENT_DEFAULT) -> Completion:
        """Wait for a request to finish and return its whole Completion.

        A failed request returns finish_reason ``error`` with the message in ``error``;
        lost tokens raise :class:`~producer.client.stream_events.StreamGapError`; a wait
        for nothing raises NoLiveWorker or RequestLost (see :meth:`stream`).
        """
        return completion_from(request_id, list(self.stream(
            request_id, timeout=timeout, orphan_timeout=orphan_timeout)))

    def choices(self, request_id: str, n: int, timeout: float | None = None, *,
                orphan_timeout: float | None | object = CLIENT_DEFAULT) -> list[Completion]:
        """The Completions of the ``n`` choices of a request submitted with ``n``: choice i
        from its own stream, ``choice_id(request_id, i)`` (``result`` of the request id is
        choice 0's). ``timeout``: seconds for them all."""
        deadline = deadline_after(timeout, self.clock)
        done = []
        for i in range(n):
            left = None if deadline is None else max(0.0, deadline - self.clock.monotonic())
            done.append(self.result(choice_id(request_id, i), left,
                                    orphan_timeout=orphan_timeout))
        return done

    def last_event(self, request_id: str) -> StreamEvent | None:
        """The last entry of a request's output stream, decoded; None when it has no stream
        (an unknown id, output expired, or a request not started yet)."""
        last = self.redis.xrevrange(self.keys.output(request_id), count=1)
        return event_from(*last[0]) if last else None

    def wait_for_output(self, request_id: str, timeout: float | None) -> bool:
        """Whether the request's output stream exists, waiting up to ``timeout`` seconds of
        the client's clock (None: forever, 0: just look) for its first entry."""
        key = self.keys.output(request_id)
        deadline = deadline_after(timeout, self.clock)
        while not self.redis.exists(key):
            if deadline is not None and self.clock.monotonic() >= deadline:
                return False
            # XREAD on a missing key blocks until its first entry is written.
            self.redis.xread({key: "0-0"}, count=1, block=block_ms(deadline, self.clock))
        return True

    def cancel(self, request_id: str, *, pipeline: redis.client.Pipeline | None = None) -> None:
        """Ask workers to stop a request: a marker key plus an announcement, in one go."""
        pipe = pipeline if pipeline is not None else self.redis.pipeline(transaction=True)
        self._queue_cancel(pipe, request_id)
        if pipeline is None:
            pipe.execute()

    def models(self, *, live_only: bool = False) -> list[str]:
        """Names of the models workers have registered, sorted; with ``live_only``, the
        models a live worker serves (see :meth:`model_states`)."""
        if live_only:
            return [s.name for s in self.model_states() if s.live]
        return member_names(self.redis.smembers(self.keys.models))

    def model_states(self) -> list[ModelState]:
        """Every registered model and every model a live worker serves, with its live
        workers (from their heartbeats), sorted by name. A registration left by a worker
        long gone shows as ``no_live_worker``."""
        states = model_states(self.models(), self._heartbeats())
        for state in states:
            self._remember(state)
        return states

    def model_state(self, name: str) -> ModelState:
        """One model's state: registered or not, and its live workers."""
        registered = bool(self.redis.exists(self.keys.model(name)))
        return self._remember(state_of(name, registered, self._heartbeats()))

    def _heartbeats(self) -> list[dict[str, str]] | None:
        """Every worker's heartbeat hash, decoded; None when the ACL does not allow it."""
        try:
            return read_heartbeats(self.redis, self.keys)
        except redis.exceptions.NoPermissionError:
            return None

    def model_info(self, name: str) -> dict[str, Any] | None:
        """A registered model's description (max_model_len, eos_token_ids, vocab_size,
        tokenizer_json, served_by, updated_ms), or None when no worker registered it."""
        return parse_model_info(self.redis.hgetall(self.keys.model(name)))

    def tokenizer(self, name: str) -> Tokenizer | None:
        """The model's tokenizer, built from its registered tokenizer.json, or None."""
        return tokenizer_from(self.redis.hget(self.keys.model(name), "tokenizer_json"))

    def close(self) -> None:
        """Stop renewing the watch, if any (what it marked is cancelled once it lapses), and
        close the connection, unless it was passed in by the caller."""
        with self._watch_lock:
            if self._watch_keeper is not None:
                self._watch_keeper.stop()
                self._watch_keeper = None  # a later submit starts another watch
        if self._owns_connection:
            self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
