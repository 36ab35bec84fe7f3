"""The gateway's HTTP app: OpenAI's completions and chat completions over the fleet.

Stateless: a request is submitted to its model's interactive lane and its answer read from
its output stream, as any producer would; nothing lives in the gateway between requests
but a one-second view of which models have a live worker. Many gateways run side by side.

Errors come back in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``):
400 a field conveyor cannot honour (named), 401 a bad API key, 404 an unknown model, 429 a
full queue (with ``Retry-After``), 503 no live worker for the model or Redis unreachable.
A client that goes away (mid-stream or while waiting) cancels its request on the worker.

Nothing waits in silence: a stream that waits sends an SSE comment every ``keepalive_s``,
and a request whose model has had no live worker for ``orphan_timeout_s`` is cancelled and
answered with ``no_live_worker`` (an error event, or 503 when not streamed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import redis
import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse as StarletteJSON
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from producer.client.async_client import AsyncClient
from producer.client.backpressure import QueueFull
from producer.client.client import READ_COUNT
from producer.client.connection import connect_async
from producer.client.models import ModelState
from producer.client.stream_events import ChunkEvent
from producer.gateway.answers import (
    ChunkWriter,
    TokenSpeller,
    choices_usage,
    completion_body,
    echo_text,
    running_usage,
    sse,
    usage_body,
)
from producer.gateway.choices import merged_events
from producer.gateway.metrics import GatewayMetrics
from producer.gateway.model_facts import ModelFacts, read_facts, registered_int
from producer.gateway.settings import RETRY_AFTER_S, GatewaySettings
from producer.gateway.shared_reads import SharedReads
from producer.gateway.tokenizing import detokenized, tokenized
from producer.version import conveyor_version
from producer.wire.completion import Usage
from producer.wire.errors import LaneBlocked, ModelNotFound, RequestLost
from producer.wire.openai_api import (
    CHAT_URL,
    COMPLETIONS_URL,
    ApiError,
    ApiRequest,
    param_of,
    parse_body,
)
from producer.wire.tools.formats import ended_with_calls
from producer.wire.tools.stream import ToolCallStream

log = structlog.get_logger(__name__)

# How often a request that is not streamed checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# How often a waiting request looks at its model's liveness (the view is shared and cached
# for model_state_ttl_s, so this costs no Redis round trip per request).
LIVENESS_POLL_S = 1.0
KEEPALIVE = ": keep-alive\n\n"
# OpenAI endpoints clients reach for that conveyor does not serve: a 404 that says so.
NOT_SERVED = ("/v1/embeddings", "/v1/images/generations", "/v1/audio/transcriptions",
              "/v1/audio/speech", "/v1/moderations", "/v1/responses")
# How long /health waits for Redis's PONG before it says Redis does not answer.
HEALTH_TIMEOUT_S = 2.0


class Orphaned(Exception):
    """The request's model has had no live worker for the orphan timeout."""
# Largest request body read (a request entry is at most 4 MiB of msgpack; JSON is wordier).
MAX_BODY_BYTES = 16 * 2**20
# Seconds a model's tokenizer (for logprobs' token texts) is kept before it is read again.
TOKENIZER_TTL_S = 60.0
# Redis errors that mean "unreachable now" (503), not "this request is wrong".
UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def create_app(settings: GatewaySettings, client: AsyncClient | None = None) -> Starlette:
    """The ASGI app; ``client`` (default: one made at start-up from ``settings``) is closed
    at shutdown only when the app made it."""
    gateway = Gateway(settings, client)
    routes = [
        Route(CHAT_URL, gateway.chat, methods=["POST"]),
        Route(COMPLETIONS_URL, gateway.completions, methods=["POST"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/models/{model:path}", gateway.model, methods=["GET"]),
        Route("/health", gateway.health, methods=["GET"]),
        Route("/version", gateway.version, methods=["GET"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        *(Route(url, gateway.not_served, methods=["GET", "POST"]) for url in NOT_SERVED),
        Route("/metrics", gateway.metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=gateway.lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.gateway = gateway
    return app


class Gateway:
    """The endpoints, sharing one asyncio client and a short-lived view of the models."""

    def __init__(self, settings: GatewaySettings, client: AsyncClient | None) -> None:
        self.settings = settings
        self._given_client = client
        self.client: AsyncClient | None = client
        self.metrics = GatewayMetrics()
        self._states: dict[str, ModelState] = {}
        self._states_at = -1e9
        # The read of the states in flight (shared by every request that needs it), and when
        # it began.
        self._states_reading: asyncio.Future | None = None
        self._states_read_from = -1e9
        # model -> (when read, what its registration says: producer/gateway/model_facts.py),
        # and the reads of them in flight
        self._model_facts: dict[str, tuple[float, ModelFacts]] = {}
        self._facts_reading: dict[str, asyncio.Future] = {}
        # Generation requests being answered now (streams until their last event).
        self.active = 0
        self._health: Any = None  # its own connection, made at start
        self._reads: SharedReads | None = None  # every request's reads, made at start
        self.metrics.in_flight.set_function(lambda: self.active)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.client is None:
            # The gateway watches for orphans itself (OrphanWatch below: it cancels them);
            # the client still finds lost requests (request_lost). Its requests are tied to
            # its life (a watch: producer/client/watch.py).
            # Every request's stream is read through a few shared XREADs, on a bounded pool.
            self.client = AsyncClient(self.settings.redis_url, self.settings.namespace,
                                      orphan_timeout=None, watch=True,
                                      watch_ttl_s=self.settings.watch_ttl_s,
                                      max_connections=self.settings.redis_connections,
                                      affinity=self.settings.affinity)
            self._reads = SharedReads(self.client.redis, count=READ_COUNT,
                                      max_readers=self.settings.read_connections)
            self._reads.on_read = self.metrics.shared_read.observe
            self.client.shared_reads = self._reads
            # /health's own connection: it answers however busy the pool is.
            self._health = connect_async(self.settings.redis_url, max_connections=1)
        log.info("gateway serving", namespace=self.settings.namespace,
                 api_keys=len(self.settings.api_keys), max_queue=self.settings.max_queue,
                 max_concurrent=self.settings.max_concurrent,
                 redis_connections=self.settings.redis_connections,
                 read_connections=self.settings.read_connections)
        try:
            yield
        finally:
            if self._health is not None:
                await self._health.aclose()
            if self._reads is not None:
                await self._reads.close()
            if self._given_client is None and self.client is not None:
                await self.client.close()

    # --- endpoints ---------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT_URL)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS_URL)

    async def models(self, request: Request) -> Response:
        if (refused := self._authorize(request)) is not None:
            return refused
        try:
            states = await self._model_states(fresh=True)
        except UNREACHABLE as exc:
            return _unreachable(exc)
        names = sorted(s.name for s in states.values() if s.live)
        try:
            registered = await self._registered(names)
        except UNREACHABLE as exc:
            return _unreachable(exc)
        data = [_model_entry(name, *facts) for name, facts in zip(names, registered,
                                                                    strict=True)]
        return JSONResponse({"object": "list", "data": data})

    async def model(self, request: Request) -> Response:
        if (refused := self._authorize(request)) is not None:
            return refused
        name = request.path_params["model"]
        try:
            state = (await self._model_states(fresh=True)).get(name)
        except UNREACHABLE as exc:
            return _unreachable(exc)
        if state is None or not state.live:
            return _error(ApiError(f"The model {name!r} does not exist or no live worker "
                                   "serves it", status=404, param="model",
                                   code="model_not_found"))
        try:
            [facts] = await self._registered([name])
        except UNREACHABLE as exc:
            return _unreachable(exc)
        return JSONResponse(_model_entry(name, *facts))

    async def tokenize(self, request: Request) -> Response:
        """``{"model", "prompt", "add_special_tokens"?}`` or ``{"model", "messages",
        "chat_template_kwargs"?, "tools"?, "add_generation_prompt"?}``: the token ids the model's
        workers would read (its registered tokenizer and template; no worker asked)."""
        return await self._through_tokenizer(request, ("prompt", "messages"), tokenized)

    async def detokenize(self, request: Request) -> Response:
        """``{"model", "tokens"}``: their text, special tokens left out (as a worker's
        answers are written)."""
        return await self._through_tokenizer(request, ("tokens",), detokenized)

    async def _through_tokenizer(self, request: Request, fields: tuple[str, ...],
                                 answer: Any) -> Response:
        if (refused := self._authorize(request)) is not None:
            return refused
        slot = False
        try:
            body = await self._body(request)
            # Tokenizing is the gateway's own work: it takes a slot like a generation.
            self._take_slot()
            slot = True
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                raise ApiError("'model' is required: a model name (GET /v1/models lists "
                               "them)", param="model")
            if not any(field in body for field in fields):
                raise ApiError(f"{' or '.join(repr(f) for f in fields)} is required",
                               param=fields[0])
            await self._check_model(body["model"])
            facts = await self._facts(body["model"])
            if facts.tokenizer is None:
                raise ApiError(f"model {body['model']!r} registered no tokenizer",
                               param="model", code="no_tokenizer")
            return JSONResponse(await answer(facts, body))
        except ApiError as exc:
            return _error(exc)
        except UNREACHABLE as exc:
            return _unreachable(exc)
        finally:
            if slot:
                self.active -= 1

    def _take_slot(self) -> None:
        """One of the --max-concurrent slots, or ApiError 429 gateway_busy (Retry-After)."""
        if self.active >= self.settings.max_concurrent:
            self.metrics.refused.labels("gateway_busy").inc()
            raise ApiError(f"this gateway is answering {self.settings.max_concurrent} requests "
                           "already: try again shortly", status=429,
                           kind="rate_limit_exceeded", code="gateway_busy")
        self.active += 1

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": conveyor_version()})

    async def not_served(self, request: Request) -> Response:
        """Endpoints of OpenAI's API that conveyor does not serve: 404 saying so."""
        return _error(ApiError(f"{request.url.path} is not served by conveyor (it serves "
                               f"{COMPLETIONS_URL}, {CHAT_URL}, /v1/models, /tokenize, "
                               "/detokenize and /version)", status=404, kind="not_found",
                               code="not_served"))

    async def health(self, request: Request) -> Response:
        """200 while Redis answers, busy or not (a load balancer keeps sending: a busy
        gateway answers 429 itself); 503 when Redis does not answer."""
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_S):
                # (a client given to create_app: its own connections)
                await (self._health or self.client.redis).ping()
        except (*UNREACHABLE, TimeoutError) as exc:
            return JSONResponse({"status": "unavailable", "redis": str(exc) or "no answer"},
                                status_code=503)
        return JSONResponse({"status": "ok", "in_flight": self.active,
                             "busy": self.active >= self.settings.max_concurrent})

    async def metrics_page(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition()
        return Response(body, media_type=content_type)

    # --- generation --------------------------------------------------------------------

    async def _generate(self, request: Request, url: str) -> Response:
        started = time.monotonic()
        request.state.slot = False  # taken (in _answer) once the body is read
        streaming = False
        try:
            response = await self._answer(request, url)
            streaming = isinstance(response, StreamingResponse)
        except ApiError as exc:
            response = _error(exc)
        except UNREACHABLE as exc:
            response = _unreachable(exc)
        except ClientDisconnect:
            response = Response(status_code=499)  # gone before its body arrived
        except Exception as exc:  # noqa: BLE001 (answered and counted, never a traceback)
            log.error("gateway request failed", path=url, error=repr(exc), exc_info=exc)
            response = _error(ApiError("internal error in the gateway", status=500,
                                       kind="server_error"))
        finally:
            if request.state.slot and not streaming:  # a stream holds it to its last event
                self.active -= 1
        self.metrics.answered(url, response.status_code, time.monotonic() - started)
        return response

    async def _answer(self, request: Request, url: str) -> Response:
        if (refused := self._authorize(request)) is not None:
            return refused
        body = await self._body(request)
        # The slot is taken once the body is in: a client that sends it slowly holds none.
        self._take_slot()
        request.state.slot = True
        api = parse_body(url, body)
        if api.priority < self.settings.min_priority:
            raise ApiError(f"priority {api.priority} is more urgent than this gateway allows "
                           f"(--min-priority {self.settings.min_priority}; lower is more "
                           "urgent)", param="priority", code="priority_not_allowed")
        await self._check_model(api.model)
        # What can be decided before the request is queued is answered with its status,
        # streamed or not: a prompt over the context, messages the template refuses.
        facts = await self._facts(api.model)
        facts.use_tools(api)
        if (refusal := facts.simulated_refusal(api)) is not None:
            # (facts are up to a minute old: the model may have real workers by now)
            if await self.client.redis.hget(self.client.keys.model(api.model),
                                            "simulated") == b"1":
                raise refusal
        prompt_tokens = await facts.prompt_tokens(api)
        facts.check_context(api, prompt_tokens)
        request_id = await self._submit(api)
        created = int(time.time())
        spelling = facts.tokenizer if api.logprobs else None  # (logprobs' token texts)
        echoed = echo_text(api, facts.tokenizer) if api.echo else None
        if api.stream:
            return StreamingResponse(self._events(request_id, api, created, spelling,
                                                  prompt_tokens, echoed),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache",
                                              "X-Request-Id": request_id})
        choices = await self._wait(request, request_id, api.model, api.n)
        if choices is None:  # the client went away: nobody reads this answer
            return Response(status_code=499)
        for done in choices:
            if not done.error:
                continue
            # Refused before any token (a prompt too long, a template that rejects the
            # messages): the request was wrong. Failed later: the server's fault.
            status = 400 if done.usage.completion_tokens == 0 else 500
            raise ApiError(done.error, status=status, code="request_failed",
                           kind="invalid_request_error" if status == 400 else "server_error",
                           param=param_of(done.error, chat=api.chat) if status == 400
                           else None,
                           request_id=request_id)
        return JSONResponse(completion_body(api, choices, created, spelling, echoed or ""),
                            headers={"X-Request-Id": request_id})

    async def _body(self, request: Request) -> Any:
        """The JSON body, bounded in size; ApiError (400, 413) when it cannot be read."""
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(f"the request body is larger than {MAX_BODY_BYTES} bytes",
                           status=413, code="body_too_large")
        raw = bytearray()
        self.metrics.reading_bodies.inc()
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for piece in request.stream():
                    raw += piece
                    if len(raw) > MAX_BODY_BYTES:
                        raise ApiError(f"the request body is larger than {MAX_BODY_BYTES} "
                                       "bytes", status=413, code="body_too_large")
        except TimeoutError:
            self.metrics.timeouts.labels("body").inc()
            raise ApiError(f"the request body did not arrive within "
                           f"{self.settings.body_timeout_s:g} s", status=408,
                           code="body_timeout") from None
        finally:
            self.metrics.reading_bodies.dec()
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as exc:  # bad JSON, a 5,000-digit int, nesting
            raise ApiError(f"the request body is not JSON we read: "
                           f"{str(exc)[:200] or type(exc).__name__}") from None

    def _authorize(self, request: Request) -> Response | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        presented = token.strip() if scheme.lower() == "bearer" else None
        if self.settings.key_accepted(presented):
            return None
        return _error(ApiError("Incorrect API key provided: pass it as 'Authorization: "
                               "Bearer KEY'", status=401, code="invalid_api_key"))

    async def _registered(self, names: list[str]) -> list[tuple[bool, int | None]]:
        """Each model's registration: whether simulated workers serve it, and its context
        length (max_model_len; None where it is not a number)."""
        if not names:
            return []
        pipe = self.client.redis.pipeline(transaction=False)
        for name in names:  # (HGETs: the producer's ACL has no HMGET)
            pipe.hget(self.client.keys.model(name), "simulated")
            pipe.hget(self.client.keys.model(name), "max_model_len")
        replies = await pipe.execute()
        return [(simulated == b"1", registered_int(length))
                for simulated, length in zip(replies[::2], replies[1::2], strict=True)]

    async def _model_states(self, fresh: bool = False) -> dict[str, ModelState]:
        """Each model's state as last read, read again past model_state_ttl_s (``fresh``:
        by a read that began after the view this call found). One read at a time: the
        thousand requests that come in while it runs share it."""
        asked = time.monotonic()
        if not fresh and asked - self._states_at < self.settings.model_state_ttl_s:
            return self._states
        reading = self._states_reading
        # A fresh look joins a read in flight that began after the view it had (that read
        # is newer than what it saw); otherwise it begins one.
        if reading is None or (fresh and self._states_read_from <= self._states_at):
            reading = self._states_reading = asyncio.ensure_future(self._read_states(asked))
            self._states_read_from = asked
        return await asyncio.shield(reading)

    async def _read_states(self, began: float) -> dict[str, ModelState]:
        try:
            states = {s.name: s for s in await self.client.model_states()}
            if began >= self._states_at:  # (a read begun later may have ended first)
                self._states, self._states_at = states, began
            return states
        finally:
            if self._states_reading is asyncio.current_task():
                self._states_reading = None

    async def _check_model(self, model: str) -> None:
        state = (await self._model_states()).get(model)
        if state is None or not state.live:
            state = (await self._model_states(fresh=True)).get(model)
        if state is None or not state.known:
            raise ApiError(f"The model {model!r} does not exist (GET /v1/models lists those "
                           "served)", status=404, param="model", code="model_not_found")
        if not state.live:
            raise ApiError(f"no live worker serves model {model!r} now: try again later",
                           status=503, kind="service_unavailable", code="no_live_worker")

    async def _submit(self, api: ApiRequest) -> str:
        try:
            return await self.client.submit(
                api.prompt, messages=api.messages, model=api.model, lane=self.settings.lane,
                max_queue=self.settings.max_queue, priority=api.priority,
                chat_template_kwargs=api.chat_template_kwargs, tools=api.tools,
                **api.sampling)
        except QueueFull as exc:
            # The stream's key is the fleet's business, not the API caller's.
            raise ApiError(f"model {api.model!r} has {exc.count} requests waiting, the most "
                           f"this gateway queues is {exc.limit}: try again later", status=429,
                           kind="rate_limit_exceeded", code="queue_full") from None
        except ModelNotFound as exc:
            raise ApiError(str(exc), status=404, param="model", code="model_not_found") from None
        except LaneBlocked as exc:
            raise ApiError(str(exc), status=503, kind="service_unavailable",
                           code="lane_blocked") from None
        except (ValueError, OverflowError) as exc:
            raise ApiError(str(exc), param=param_of(str(exc), chat=api.chat)) from None

    async def _facts(self, model: str) -> ModelFacts:
        """The model's registered tokenizer, chat template and context length, read at most
        once a minute, by one read at a time: requests that come meanwhile wait for it when
        nothing was read yet, and take the facts read before otherwise."""
        now = time.monotonic()
        cached = self._model_facts.get(model)
        if cached is not None and now - cached[0] < TOKENIZER_TTL_S:
            return cached[1]
        reading = self._facts_reading.get(model)
        if reading is None:
            reading = asyncio.ensure_future(self._read_facts(model, now))
            # (a refresh nobody waits for fails quietly: the next request reads again)
            reading.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._facts_reading[model] = reading
        if cached is not None:
            return cached[1]  # (the read in flight refreshes them)
        return await asyncio.shield(reading)

    async def _read_facts(self, model: str, began: float) -> ModelFacts:
        try:
            facts = await read_facts(self.client.redis, self.client.keys.model(model))
            self._model_facts[model] = (began, facts)
            return facts
        finally:
            del self._facts_reading[model]

    async def _wait(self, request: Request, request_id: str, model: str, n: int = 1):
        """The Completions of the request's ``n`` choices, or None (and the request
        cancelled) when the client disconnects first; ApiError 503 (the request cancelled)
        once its model has had no live worker for the orphan timeout."""
        task = asyncio.ensure_future(self.client.choices(request_id, n))
        orphan = OrphanWatch(self, model)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    task.cancel()
                    await self._cancel(request_id, "the client disconnected")
                    return None
                await orphan.check()
        except RequestLost as exc:
            task.cancel()
            if n > 1:  # its other choices may still run: nobody will read them
                await self._cancel(request_id, "a choice of it was lost", gone=False)
            raise ApiError(str(exc), status=500, kind="server_error", code="request_lost",
                           request_id=request_id) from None
        except Orphaned as exc:
            task.cancel()
            await self._cancel(request_id, str(exc), gone=False)
            self.metrics.orphaned.inc()
            raise ApiError(str(exc), status=503, kind="service_unavailable",
                           code="no_live_worker", request_id=request_id) from None
        except BaseException as exc:
            # Reading the answer failed (or the server is stopping): nobody will read it.
            task.cancel()
            with anyio.CancelScope(shield=True):
                await self._cancel(request_id, f"its answer could not be read ({exc!r})",
                                   gone=False)
            raise

    async def _events(self, request_id: str, api: ApiRequest, created: int,
                      spelling: Any | None, prompt_tokens: int | None = None,
                      echoed: str | None = None) -> AsyncIterator[str]:
        """The server-sent events of a streamed answer: a keep-alive comment each
        ``keepalive_s`` without one (the stream's own read wakes it when quiet: no task or
        timer a chunk), an error event once the model has had no live worker for the
        orphan timeout; a disconnect cancels the request. With continuous usage each chunk
        carries the usage so far (``prompt_tokens`` as the gateway counted them; where it
        could not, only the last chunk, with the worker's count). ``echoed``: an echoing
        completion's prompt text, its first chunk before the answer's (with the prompt's
        logprobs, which come with the answer's first tokens). Several choices (``n``): each
        choice's chunks carry its index, in the order they come; the answer ends with the
        last choice's (a failed choice ends it, and the request, at once)."""
        n = api.n
        writers = [ChunkWriter(api, request_id, created, TokenSpeller(spelling), index=i)
                   for i in range(n)]
        writer = writers[0]
        fmt = api.reads_calls
        readers = [None if fmt is None else ToolCallStream(fmt) for _ in range(n)]
        echoing = [echoed is not None] * n
        finals: list[Usage] = []
        finished = False
        broken = False
        orphan = OrphanWatch(self, api.model)
        keepalive_s = self.settings.keepalive_s
        spoke = time.monotonic()
        self.metrics.streams_open.inc()
        try:
            every = api.continuous_usage and prompt_tokens is not None
            for opening in writers:
                if (first := opening.first(running_usage(prompt_tokens, 0) if every
                                           else None)) is not None:
                    yield sse(first)
            tick_s = min(LIVENESS_POLL_S, keepalive_s)
            # (closed here, not by the collector: its read ends when the answer does)
            async with contextlib.aclosing(
                    self.client.stream(request_id, tick_s=tick_s) if n == 1
                    else merged_events(self.client, request_id, n, tick_s)) as events:
                async for item in events:
                    if item is None:  # quiet for a tick
                        if time.monotonic() - spoke >= keepalive_s:
                            yield KEEPALIVE
                            spoke = time.monotonic()
                        await orphan.check()
                        continue
                    orphan.heard()
                    index, event = (0, item) if n == 1 else item
                    writer = writers[index]
                    if isinstance(event, ChunkEvent) and readers[index] is not None:
                        # The answer read for tool calls: what may be a call is held, and
                        # a keep-alive is due meanwhile as when the stream is quiet.
                        chunks = writer.read_calls(
                            readers[index].feed(event.text),
                            event.logprobs if api.logprobs else None,
                            running_usage(prompt_tokens, event.index + len(event.token_ids))
                            if every else None)
                        if not chunks and time.monotonic() - spoke >= keepalive_s:
                            chunks = [KEEPALIVE]
                        for chunk in chunks:
                            yield chunk
                        spoke = time.monotonic() if chunks else spoke
                        continue
                    spoke = time.monotonic()
                    if isinstance(event, ChunkEvent):
                        if echoing[index]:  # (its first chunk: with the prompt's logprobs)
                            yield sse(writer.echo(echoed or "", event.prompt_token_ids,
                                                  event.prompt_logprobs))
                            echoing[index] = False
                        if every and (event.text or (api.logprobs and event.logprobs)):
                            yield sse(writer.text(event.text, event.logprobs, running_usage(
                                prompt_tokens, event.index + len(event.token_ids))))
                        elif api.logprobs and event.logprobs:
                            yield sse(writer.text(event.text, event.logprobs))
                        elif event.text:
                            yield writer.text_event(event.text)
                        continue
                    if event.error:
                        finished = True
                        yield sse(ApiError(event.error, status=500, kind="server_error",
                                           code="request_failed").body())
                        if n > 1 and len(finals) < n - 1:  # the other choices: nobody reads
                            with anyio.CancelScope(shield=True):
                                await self._cancel(request_id, "a choice of it failed",
                                                   gone=False)
                        break
                    done = _usage(event.usage, event.num_tokens)
                    finals.append(done)
                    finished = len(finals) == n
                    reason, text = event.finish_reason, event.text
                    if readers[index] is not None:  # what it held, read now the answer ended
                        reader = readers[index]
                        for chunk in [*writer.read_calls(reader.feed(text)),
                                      *writer.read_calls(reader.finish())]:
                            yield chunk
                        text = ""
                        reason = ended_with_calls(reason) if writer.calls else reason
                    yield sse(writer.last(reason, text,
                                          usage_body(done) if api.continuous_usage else None))
                    if finished and api.include_usage:
                        yield sse(writer.usage(choices_usage(finals)))
            yield "data: [DONE]\n\n"
        except RequestLost as exc:
            finished = True  # nothing to cancel: nothing holds it (but its other choices)
            if n > 1:
                with anyio.CancelScope(shield=True):
                    await self._cancel(request_id, "a choice of it was lost", gone=False)
            yield sse(ApiError(str(exc), status=500, kind="server_error", code="request_lost",
                               request_id=request_id).body())
            yield "data: [DONE]\n\n"
        except Orphaned as exc:
            finished = True  # cancelled here, and said so
            with anyio.CancelScope(shield=True):
                await self._cancel(request_id, str(exc), gone=False)
            self.metrics.orphaned.inc()
            yield sse(ApiError(str(exc), status=503, kind="service_unavailable",
                               code="no_live_worker", request_id=request_id).body())
            yield "data: [DONE]\n\n"
        except Exception as exc:  # noqa: BLE001 (any failure: the client must hear of it)
            # Streaming began: the status line is sent, so the error is an event.
            broken = True
            log.warning("stream broken", request_id=request_id, error=repr(exc))
            yield sse(ApiError(f"the answer's stream broke: {exc}", status=500,
                               kind="server_error", code="stream_failed").body())
            yield "data: [DONE]\n\n"
        finally:
            self.metrics.streams_open.dec()
            self.active -= 1
            if not finished:
                with anyio.CancelScope(shield=True):
                    why = ("its stream broke" if broken
                           else "the client disconnected mid-stream")
                    await self._cancel(request_id, why, gone=not broken)

    async def _live(self, model: str) -> bool:
        """Whether a live worker serves ``model`` (True while Redis cannot say: an outage
        is not an orphan, and the request's own read reports it)."""
        try:
            state = (await self._model_states()).get(model)
        except UNREACHABLE:
            return True
        return state is not None and state.live

    async def _cancel(self, request_id: str, why: str, gone: bool = True) -> None:
        """Cancel a request nobody will read; ``gone``: because its client went away."""
        try:
            await self.client.cancel(request_id)
            if gone:
                self.metrics.cancelled.inc()
            log.info("request cancelled", request_id=request_id, reason=why)
        except UNREACHABLE as exc:
            log.warning("could not cancel a request", request_id=request_id, error=str(exc))


class OrphanWatch:
    """Whether a waiting request's model has had no live worker for the orphan timeout."""

    def __init__(self, gateway: Gateway, model: str) -> None:
        self.gateway = gateway
        self.model = model
        self.timeout = gateway.settings.orphan_timeout_s
        self.alone_since: float | None = None
        self._looked = -1e9

    def heard(self) -> None:
        """The request's stream moved: a worker serves it."""
        self.alone_since = None

    async def check(self) -> None:
        """Look (at most every LIVENESS_POLL_S); raise Orphaned past the timeout."""
        now = time.monotonic()
        if self.timeout is None or now - self._looked < LIVENESS_POLL_S:
            return
        self._looked = now
        if await self.gateway._live(self.model):
            self.alone_since = None
        elif self.alone_since is None:
            self.alone_since = now
        elif now - self.alone_since >= self.timeout:
            raise Orphaned(f"no live worker served model {self.model!r} for "
                           f"{self.timeout:g} s: the request was cancelled")


def _model_entry(name: str, simulated: bool = False, max_model_len: int | None = None
                 ) -> dict[str, Any]:
    entry: dict[str, Any] = {"id": name, "object": "model", "created": 0,
                             "owned_by": "conveyor"}
    if max_model_len is not None:  # (vLLM's field: the context, prompt and output together)
        entry["max_model_len"] = max_model_len
    if simulated:  # its tokens are not the model's (worker/engine/simulated.py)
        entry.update(owned_by="conveyor (simulated)", simulated=True)
    return entry


def _usage(usage: dict[str, Any], num_tokens: int) -> Usage:
    return Usage(int(usage.get("prompt_tokens", 0)),
                 int(usage.get("completion_tokens", num_tokens)),
                 int(usage.get("cached_tokens", 0)),
                 int(usage.get("kv_transferred_tokens", 0)))


class JSONResponse(StarletteJSON):
    """Starlette's JSON answer, written as UTF-8 where it can be: a request's own strings
    come back in errors (an unknown field's name, a bad value), and JSON may carry a lone
    surrogate (``"\\ud800"``) that UTF-8 cannot; such an answer is written with every
    non-ASCII character escaped (still the same JSON) rather than failing as a 500."""

    def render(self, content: Any) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, indent=None,
                              separators=(",", ":")).encode("ascii")


def _unreachable(exc: Exception) -> JSONResponse:
    return _error(ApiError(f"cannot reach Redis: {exc}", status=503,
                           kind="service_unavailable", code="redis_unreachable"))


def _error(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else {}
    if exc.status == 408:  # the rest of its body is not read: the connection ends here
        headers["Connection"] = "close"
    if exc.request_id is not None:
        headers["X-Request-Id"] = exc.request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
    return _error(ApiError(f"{request.method} {request.url.path}: {exc.detail}",
                           status=exc.status_code, kind=kind))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("gateway request failed", path=request.url.path, error=repr(exc), exc_info=exc)
    return _error(ApiError("internal error in the gateway", status=500, kind="server_error"))
