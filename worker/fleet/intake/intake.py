"""The intake thread: reads only as many requests as the worker can serve soon."""

from __future__ import annotations

import copy
import functools
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import structlog

from producer.chat_template import ChatTemplate
from producer.client.queues import waiting
from producer.wire.keys import GROUP, LANES, Keys
from producer.wire.params import choice_params
from producer.wire.protocol import (
    FIELD,
    GenerationRequest,
    ProtocolError,
    declared_choices,
    error_final,
)
from producer.wire.validation import choice_id, request_of
from worker.engine.tokenizer import Tokenizer
from worker.fleet.affinity.advertise import Advertiser
from worker.fleet.affinity.busy import BusyOwner, EngineState
from worker.fleet.affinity.fleet_view import FleetView
from worker.fleet.affinity.takeover import Takeover
from worker.fleet.config import WorkerConfig
from worker.fleet.handoff.handoff import KV_STORED_FIELD, HandoffReader, streams_for
from worker.fleet.handoff.prefix_share import PrefixFinder
from worker.fleet.handoff.tier_io import TierReader, resolve
from worker.fleet.housekeeping.heartbeat import heartbeat_ttl_s
from worker.fleet.housekeeping.leases import hand_back
from worker.fleet.inflight import InflightRequest, InflightTable
from worker.fleet.intake.cancellation import cancelled_ids
from worker.fleet.intake.resume import Published, read_published
from worker.fleet.messages import Admission, Publication, Rejection
from worker.fleet.publishing.publisher import Publisher
from worker.fleet.supervised import SupervisedThread
from worker.sampling.grammar import Grammars
from worker.sampling.randomness import stable_seed

log = structlog.get_logger(__name__)

KV_STORED_BYTES = KV_STORED_FIELD.encode()
# A worker that yields new prefixes to lighter ones blocks this long at a time (a worker
# that serves reads for up to --read-block-ms).
YIELDING_BLOCK_MS = 50
# How long a prefill worker whose hand-ons fill its room waits before it looks again.
HAND_ONS_BEHIND_WAIT_S = 0.05


def ensure_groups(client: redis.Redis, streams: list[str]) -> None:
    """Create the consumer group on each request stream if missing (from the stream's start,
    so requests queued before any worker existed are served)."""
    for stream in streams:
        try:
            client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise


@dataclass
class IntakeParts:
    """What the intake works with besides Redis: where admitted requests go, and what turns
    an entry into an admission."""

    # Requests this worker serves now; the intake reads only as many as it has room for.
    inflight: InflightTable
    # The engine loop's inbox: each read's admissions, as one list.
    inbox: queue.Queue[list[Admission]]
    # Writes rejections (malformed entries, ids already in flight).
    publisher: Publisher
    # Ends a request at the engine loop's next step (one already cancelled when read).
    on_cancel: Callable[[str], None]
    # Encodes text prompts (None: the model has none; only token ids are served).
    tokenizer: Tokenizer | None
    # Renders chat messages (None: the model has no chat template).
    chat_template: ChatTemplate | None = None
    # KV of handed-on requests from the tier (decode and `both` workers).
    handoffs: HandoffReader | None = None
    # KV of shared prompt prefixes from the tier (--kv-share-prefixes).
    prefixes: PrefixFinder | None = None
    # Fetches both off this thread (tier_io.py); None: this thread fetches them itself.
    tier_reader: TierReader | None = None
    # A prefill worker's hand-ons waiting for the tier writer: they count against its room,
    # so that a slow tier slows its reads instead of piling up KV in memory.
    hand_ons_waiting: Callable[[], int] | None = None
    # The engine's grammars: a request's response_format is compiled here, off the engine
    # loop's thread (the engine then finds it compiled), and one that cannot be served is
    # refused here.
    grammars: Grammars | None = None
    # Since when the engine loop's step has run and requests have waited: a worker busy
    # that long leaves its own affinity lanes to its peers (None: it never does).
    engine_state: Callable[[], EngineState] | None = None
    # Counts requests it answers with an error final itself (the metrics' finished{error}).
    on_refused: Callable[[int], None] | None = None


class Intake(SupervisedThread):
    """XREADGROUP up to the room left in the in-flight table; interactive lane first.

    ``config`` gives the model, worker id, role, read block, lease and handoff bound."""

    def __init__(self, client: redis.Redis, config: WorkerConfig, parts: IntakeParts,
                 **supervision: Any) -> None:
        super().__init__("intake", worker_id=config.worker_id, **supervision)
        self.client = client
        self.keys = keys = Keys(config.namespace)
        self.model = model = config.model_name
        self.inflight = parts.inflight
        self.inbox = parts.inbox
        self.publisher = parts.publisher
        self.on_refused = parts.on_refused
        self.tokenizer = parts.tokenizer
        self.read_block_ms = config.read_block_ms
        self.on_cancel = parts.on_cancel
        self.lease_ms = config.lease_ms
        self.role = role = config.role
        # Prefix affinity: its own affinity lanes (read first of each lane), the prefixes
        # it advertises, and other workers' lanes it takes over (decode workers read no lane).
        own = config.worker_id if config.affinity and role != "decode" else None
        self.streams = streams_for(keys, model, role, affinity_of=own)
        self.fleet_view = FleetView(client, keys, model, config.worker_id, self.clock)
        self.advertiser = (Advertiser(client, keys, model, config.worker_id, self.fleet_view,
                                      self.clock) if own else None)
        self.own_lanes = set(keys.affinity_lanes_of(model, own)) if own else set()
        self.leaving_own_lanes = False  # its last read left them to its peers (busy)
        self.busy_owner = (BusyOwner(parts.engine_state, config.affinity_delay_ms, self.clock)
                           if own and parts.engine_state is not None else None)
        self.takeover = (Takeover(client, keys, model, config.worker_id, self.fleet_view,
                                  config.affinity_delay_ms, self.clock)
                         if role != "decode" else None)
        self.handoff_streams = [keys.handoff(model, lane) for lane in LANES]
        self.handoffs = parts.handoffs
        self.prefixes = parts.prefixes
        self.tier_reader = parts.tier_reader
        self.hand_ons_waiting = parts.hand_ons_waiting
        self.chat_template = parts.chat_template
        self.grammars = parts.grammars
        self.handoff_max_waiting = config.handoff_max_waiting if role == "prefill" else None
        # Requests waiting in the handoff streams when a prefill worker last looked.
        self.handoff_backlog = 0
        self.num_read = 0
        self._groups_ready = False
        self._said_full = False  # since the in-flight table last had room
        self.heartbeat_ttl_s = heartbeat_ttl_s(config.heartbeat_interval_s)

    def tick(self) -> None:
        """Read what there is room for and hand it to the engine loop."""
        if not self._groups_ready:
            self.prepare_streams(self.client)
            self._groups_ready = True
        room = self.inflight.room()
        if room == 0:
            self._say_full()
            self.inflight.wait_for_room(timeout=0.2)
            return
        if self.busy_owner is None or not self.busy_owner.busy:
            self._said_full = False
        if self.hand_ons_waiting is not None:
            room -= self.hand_ons_waiting()
            if room <= 0:  # the tier writer is behind: look again in a moment
                self.clock.wait(self.stopping, HAND_ONS_BEHIND_WAIT_S)
                return
        if self.handoff_max_waiting is not None:
            room = min(room, self._handoff_room())
            if room == 0:
                # Decode workers are behind: computing more prompts now would only park
                # their KV in the tier. Look again after a read's worth of time.
                self.clock.wait(self.stopping, self.read_block_ms / 1000)
                return
        try:
            entries = self._read(room)
        except redis.ResponseError as exc:
            # The stream or its group was deleted (a restart without persistence, a
            # flush): Redis 6.2 says NOGROUP, 7 unblocks the read with UNBLOCKED.
            if "NOGROUP" in str(exc) or "UNBLOCKED" in str(exc):
                self._groups_ready = False
                return
            raise  # any other refusal (an ACL change, say): retried by the supervisor
        admitted: list[Admission] = []
        try:
            for stream, entry_id, fields in entries:
                admitted += self.accept(stream, entry_id, fields)
        finally:
            # Even when one entry's reads failed: those accepted before it are in the
            # in-flight table, and only the inbox gets them served.
            self.hand_over(admitted, self.client)
        if self.advertiser is not None and admitted:
            self.advertiser.advertise(admitted)

    def _handoff_room(self) -> int:
        """How many more requests a prefill worker may take before the handoff streams
        hold ``handoff_max_waiting`` (those it is computing add to them: the bound is
        exceeded by at most its own capacity)."""
        self.handoff_backlog = waiting(self.client, self.handoff_streams,
                                       limit=self.handoff_max_waiting)
        return max(0, self.handoff_max_waiting - self.handoff_backlog)

    def prepare_streams(self, client: redis.Redis) -> None:
        """Make the consumer group on each stream this worker reads. A `both` worker whose
        ACL user predates the handoff stream (no ``{ns}:handoff:*``) serves whole requests
        only, and says so, rather than not starting."""
        try:
            ensure_groups(client, self.streams)
        except redis.exceptions.NoPermissionError:
            if self.role != "both" or not set(self.handoff_streams) & set(self.streams):
                raise
            log.warning("this worker's Redis user may not read the handoff streams: it serves "
                        "whole requests only (grant ~NS:handoff:* to take handed-on ones)",
                        streams=self.handoff_streams)
            self.streams[:] = [s for s in self.streams if s not in self.handoff_streams]
            ensure_groups(client, self.streams)
        self._join_affinity(client)

    def _join_affinity(self, client: redis.Redis) -> None:
        """List this worker among those with affinity lanes, once their groups exist (and
        before producers send to them: its heartbeat does not say serving yet). A worker
        user from before affinity (no ``{ns}:affinity:*``) reads the shared lanes only, and
        says so."""
        if self.advertiser is None:
            return
        try:
            self.advertiser.join()
            client.sadd(self.keys.affinity_lanes(self.model), self.worker_id)
        except redis.exceptions.NoPermissionError:
            log.warning("this worker's Redis user may not use prefix affinity: it reads the "
                        "shared lanes only (grant ~NS:affinity:* to join)")
            own = self.keys.affinity_lanes_of(self.model, self.worker_id)
            self.streams[:] = [s for s in self.streams if s not in own]
            self.advertiser = None

    def hand_over(self, admitted: list[Admission], client: redis.Redis) -> None:
        """Send accepted requests to the engine loop, those cancelled already marked so.

        Read fresh or claimed from a dead worker alike: a request cancelled while nobody
        served it (its marker ``{ns}:cancelled:{id}`` is set) ends ``cancelled`` without
        running. The admissions are in the in-flight table already: they reach the inbox even
        when the marker check loses its connection (the caller's supervisor then retries).
        """
        try:
            # (by request: a request's choices share its marker)
            ids = list(dict.fromkeys(request_of(a.request.request_id) for a in admitted))
            for rid in cancelled_ids(client, self.keys, ids):
                self.on_cancel(rid)
        finally:
            ready = [adm for adm in admitted if not self._fetch_later(adm)]
            if ready:  # at once: the engine loop admits them all before its next step
                self.inbox.put(ready)

    def _fetch_later(self, adm: Admission) -> bool:
        """Whether ``adm`` went to the tier reader, to reach the inbox once its KV is
        fetched; without a reader its KV is fetched here, and with a full one not at all."""
        if adm.kv_fetch is None:
            return False
        if self.tier_reader is None:
            resolve(adm)
            return False
        if self.tier_reader.offer(adm):
            return True
        source, adm.kv_fetch = adm.kv_fetch_source, None
        if source == "handoff" and self.handoffs is not None:
            self.handoffs.fallback(adm.request.request_id, "busy",
                                   "the tier reader's queue is full")
        return False

    def _read(self, room: int) -> list[tuple[str, str, dict]]:
        block = self.read_block_ms
        streams = self.streams
        busy = False
        if self.busy_owner is not None and self.advertiser is not None:
            busy = self.busy_owner.check()
            if busy:
                self._say_full()
                self.fleet_view.refresh()
                if self.prefixes is not None or self.fleet_view.peer_with_room():
                    # Its own lanes wait for a peer with room (after the delay) or for the
                    # first worker to be free. Without the fleet KV tier and with every peer
                    # busy they would wait anyway: here, where their prefix is; with it, the
                    # prefix is a fetch away from any worker.
                    streams = [s for s in streams if s not in self.own_lanes]
            if (busy or self.busy_owner.step_running_long()) and self.advertiser.owns_lately():
                # Busy, or in a step long enough that it may soon be: looked at again soon,
                # so that a read blocked since before does not take its own lanes' requests.
                # (Not in every step: on a GPU most reads find one running, briefly.)
                block = min(block, YIELDING_BLOCK_MS)
        # (set here, in the only thread that reads: no read of its own lanes is under way
        # once this says so)
        self.leaving_own_lanes = streams is not self.streams
        # A busy worker takes over only what a worker that is gone or draining left: a
        # busy peer's requests would wait here as long.
        if self.takeover is not None and self.takeover.worth_looking(live_too=not busy):
            # Before the shared lanes: a gone worker's requests must not wait behind a
            # backlog there (at most one look a look interval).
            if self.takeover.due():
                got = self.takeover.take(room, live_too=not busy)
                if got:
                    return got
            block = min(block, max(1, int(self.takeover.look_interval_s * 1000)))
        got = self._read_waiting(room, streams)
        if got:
            return got
        if self._leaves_new_prefixes():
            # Redis hands a new entry to the reader blocked longest: re-blocking often keeps
            # this worker behind the lighter ones, never out (nothing waits for it).
            block = min(block, YIELDING_BLOCK_MS)
        got = self._xreadgroup({s: ">" for s in streams}, room, block=block)
        if got and len(got) < room:
            # Redis answers a blocked read as soon as the first entry lands: of a burst sent
            # in one go (a client's pipeline), the rest is in the stream by now. Taking it
            # with this read lets the engine's next step start with the whole burst, not
            # with its first request alone (an extra, nearly empty prefill step). Only up to
            # the streams that woke the read (the burst is there; more urgent lanes first):
            # the next read looks at all.
            woke = {stream for stream, _, _ in got}
            last = max(i for i, s in enumerate(streams) if s in woke)
            got += self._read_waiting(room - len(got), streams[:last + 1])
        return got

    @property
    def busy(self) -> bool:
        """Whether its engine was busy at its last read (it then says it has no room, and
        ``leaving_own_lanes`` says whether it left its own lanes to its peers)."""
        return self.busy_owner is not None and self.busy_owner.busy

    def _say_full(self) -> None:
        """Tell the fleet at once that this worker reads nothing now (its heartbeat's
        ``room``, until the next beat says otherwise): the others take over what waits in
        its affinity lanes after the delay, rather than after a heartbeat."""
        if self._said_full or self.advertiser is None:
            return
        # Nothing goes to the lanes of a worker that owns nothing of late (what a restarted
        # worker's earlier life owned is taken over once its heartbeat says it is full), and
        # without a live peer with affinity lanes only the next heartbeat tells the others
        # (a --no-affinity peer takes over too, at that pace).
        if not self.advertiser.owns_lately():
            return
        self.fleet_view.refresh()
        if not set(self.fleet_view.now.live) - {self.worker_id}:
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.worker(self.worker_id), "room", 0)
        # (as the heartbeat sets it: a hash written after it lapsed must lapse too)
        pipe.expire(self.keys.worker(self.worker_id), self.heartbeat_ttl_s)
        pipe.execute()
        self._said_full = True

    def _leaves_new_prefixes(self) -> bool:
        """Whether this worker yields new prefixes to a lighter one for now: another live
        worker with room owns fewer prefixes (a new prefix read from the shared lane makes
        its reader the owner; without this, whichever worker's read is first in Redis's
        queue of blocked readers would take most of them)."""
        if self.advertiser is None:
            return False
        self.fleet_view.refresh()
        return self.fleet_view.lighter_with_room(self.advertiser.owned)

    def _read_waiting(self, room: int, streams: list[str]) -> list[tuple[str, str, dict]]:
        """Up to ``room`` entries already waiting in ``streams``, without blocking: in their
        order (interactive first), later ones only get the room left."""
        got: list[tuple[str, str, dict]] = []
        for stream in streams:
            if len(got) < room:
                got += self._xreadgroup({stream: ">"}, room - len(got), block=None)
        return got

    def _xreadgroup(self, streams: dict[str, str], count: int, block: int | None):
        reply = self.client.xreadgroup(GROUP, self.worker_id, streams, count=count, block=block)
        out = []
        for stream, entries in reply or []:
            name = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                out.append((name, eid, fields or {}))
        return out

    def accept(self, stream: str, entry_id: str, fields: dict,
               published: list[Published] | None = None, alone: bool = False
               ) -> list[Admission]:
        """Decode, validate and tokenize an entry: one admission a choice of it (its
        ``params.n``, each seeded seed + i, the first under the request's id); none when it
        is rejected (malformed) or handed back (``alone`` asked for an empty worker, or a
        suspect runs alone here). ``published``: what each choice's stream holds already
        (a claimed request, ``take_over``); a choice whose stream is finished is not served
        again."""
        self.num_read += 1
        raw = fields.get(FIELD)
        req: GenerationRequest | None = None
        try:
            req = GenerationRequest.decode(raw)
            if req.model != self.model:
                raise ProtocolError(f"request for model {req.model!r} on a stream of "
                                    f"{self.model!r}", req.request_id)
            if req.params.n > 1 and self.role == "prefill":
                raise ProtocolError(f"n={req.params.n}: several choices are served by workers "
                                    "of role both, not handed on by a prefill worker",
                                    req.request_id)
            prompt_ids = self._tokenize(req)
            self._compile(req)
        except ProtocolError as exc:
            self.reject(stream, entry_id, exc.reason, exc.request_id, raw, published=published,
                        choices=req.params.n if req else declared_choices(raw))
            return []
        live = self.inflight.serving(req.request_id, req.params.n)
        if live is not None and (live.stream, live.entry_id) == (stream, entry_id):
            return []  # the very entry this worker is serving (claimed back): nothing to do
        if live is not None:
            # A second request with a live id: answering it would corrupt the first one's stream.
            self.reject(stream, entry_id, f"request id {req.request_id!r} is already in flight",
                         req.request_id, raw, write_final=False)
            return []
        if stream in self.handoff_streams and published is None:
            # Handed on by a prefill worker: resume after the tokens it published. Read
            # before the entry counts as in flight here: a failed read leaves it to lapse
            # and be claimed, never held without being served.
            published = [read_published(self.client, self.keys, req.request_id)]
        admissions = self._choices(req, prompt_ids, stream, entry_id, published)
        items = [InflightRequest(adm.request.request_id, stream, entry_id, len(prompt_ids),
                                 len(adm.published.token_ids) if adm.published else 0,
                                 id_base=adm.published.id_base if adm.published else 0,
                                 message=raw if self.role == "prefill" else None,
                                 watch=req.watch)
                 for adm in admissions]
        if req.params.n > 1:
            pending = {item.request_id for item in items}  # shared: see last_choice
            for item in items:
                item.choices = pending
        if not items:  # every choice ended before its worker died: only the ack is missing
            self.publisher.publish([Publication(req.request_id, ack=(stream, entry_id))])
            return []
        if not self.inflight.add(items, alone):
            # A suspect is served alone here now (or this one needs an empty worker): give
            # the entry back as if never delivered here.
            hand_back(self.client, self.worker_id, [(stream, entry_id)], self.lease_ms)
            return []
        if len(admissions) == 1 and req.params.n == 1:
            self._fetch_kv(admissions[0], fields)
        return admissions

    def _choices(self, req: GenerationRequest, prompt_ids: list[int], stream: str,
                 entry_id: str, published: list[Published] | None) -> list[Admission]:
        """One admission a choice not yet finished: choice i under choice_id(id, i), with
        choice_params (seed + i: the request's seed, or one from its id)."""
        n = req.params.n
        if n == 1:
            return [Admission(req, prompt_ids, stream, entry_id,
                              published[0] if published else None)]
        seed = req.params.seed if req.params.seed is not None else stable_seed(req.request_id)
        out = []
        for i in range(n):
            done = published[i] if published else None
            if done is not None and done.finished:
                continue
            # (a copy, not dataclasses.replace: a choice id is no request id a producer may
            # send, and the request's checks would refuse it)
            choice = copy.copy(req)
            choice.request_id = choice_id(req.request_id, i)
            choice.params = choice_params(req.params, i, seed)
            out.append(Admission(choice, prompt_ids, stream, entry_id, done))
        return out

    def _fetch_kv(self, adm: Admission, fields: dict) -> None:
        """Where the request's KV may come from the fleet tier: its fetch, for later."""
        req, prompt_ids, published = adm.request, adm.prompt_token_ids, adm.published
        if adm.stream in self.handoff_streams and self.handoffs is not None and published \
                and published.token_ids and not published.finished:
            if fields.get(KV_STORED_BYTES) == b"0":  # the tier never took it: no lookup
                self.handoffs.fallback(req.request_id, "missing", "the tier did not take "
                                       "its KV when it was handed on")
                return
            adm.kv_fetch = functools.partial(self.handoffs.fetch, req.request_id,
                                             prompt_ids + published.token_ids)
            adm.kv_fetch_source = "handoff"
        elif self.prefixes is not None and not (published and published.token_ids) \
                and req.params.prompt_logprobs is None:  # (those compute their prompt)
            adm.kv_fetch = functools.partial(self.prefixes.find, prompt_ids)
            adm.kv_fetch_source = "prefix"

    def _compile(self, req: GenerationRequest) -> None:
        """Compile the request's response_format now (cached: the engine then copies it)."""
        form = req.params.response_format
        if form is None or self.grammars is None:
            return  # (none to compile, or the engine refuses it with its reason)
        try:
            self.grammars.compile(form)
        except ValueError as exc:
            raise ProtocolError(str(exc), req.request_id) from None

    def _tokenize(self, req: GenerationRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return req.prompt_token_ids
        if self.tokenizer is None:
            raise ProtocolError("this model has no tokenizer: send prompt_token_ids",
                                req.request_id)
        if req.messages is not None:
            return self._render(req)
        ids = self.tokenizer.encode(req.prompt)
        if not ids:
            raise ProtocolError("prompt encodes to no tokens", req.request_id)
        return ids

    def _render(self, req: GenerationRequest) -> list[int]:
        """A chat request's prompt: its messages through the model's chat template."""
        if self.chat_template is None:
            raise ProtocolError(f"model {self.model!r} has no chat template: send a prompt or "
                                "prompt_token_ids instead of messages", req.request_id)
        try:
            text = self.chat_template.render(req.messages, extra=req.chat_template_kwargs,
                                             tools=req.tools)
        except Exception as exc:  # noqa: BLE001 (a template is untrusted code: see render)
            raise ProtocolError(str(exc), req.request_id) from None
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ProtocolError("the messages render to no tokens", req.request_id)
        return ids

    def reject(self, stream, entry_id, reason, request_id, raw, write_final=True,
                published: list[Published] | None = None, choices: int = 1) -> None:
        """Dead-letter the entry and answer ``reason`` on its stream: each choice's, after
        what each holds (``published``: a claimed request's)."""
        log.warning("request rejected", request_id=request_id, entry_id=entry_id, reason=reason)
        held = published or []
        first = held[0] if held else None
        items: list[Publication | Rejection] = [Rejection(
            stream, entry_id, reason, request_id, raw if isinstance(raw, bytes) else None,
            write_final, len(first.token_ids) if first else 0, first.id_base if first else 0)]
        if write_final and request_id is not None:
            for i in range(1, choices):  # the other choices' readers hear it too
                done = held[i] if i < len(held) else None
                if done is None or not done.finished:
                    items.append(Publication(choice_id(request_id, i), final=error_final(
                        reason, len(done.token_ids) if done else 0,
                        done.id_base if done else 0)))
        self.publisher.publish(items)
        if write_final and request_id is not None and self.on_refused is not None:
            self.on_refused(len(items))  # (each choice answered: a request, as the engine's)
