"""The requests a worker has taken from Redis and not yet acknowledged."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from producer.wire.validation import choice_id


@dataclass(slots=True)
class InflightRequest:
    """Where a request came from and how much of it has been published."""

    request_id: str
    stream: str  # the request stream it was read from
    entry_id: str  # its entry there, acknowledged after the final output entry
    num_prompt_tokens: int
    # Token index of the next token to publish.
    next_index: int = 0
    # Where this worker's output entry ids start: 0, or the generation of ids of a request
    # it took over (worker/fleet/intake/resume.py).
    id_base: int = 0
    # Its tokens are held by the engine loop for the stream interval (no stop strings, no
    # log-probabilities: worker/fleet/publishing/token_hold.py): those held now, and when
    # (the loop's clock) its last chunk went to the publisher.
    coalesce: bool = False
    held: list[int] | None = None
    chunk_sent_at: float | None = None
    received: float = field(default_factory=time.monotonic)
    # When the producer created it (its created_ms on this clock); set at admission.
    created: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    # The request as the producer sent it, kept by prefill workers to hand it on.
    message: bytes | None = None
    # Its producer's watch id (producer/client/watch.py): cancelled once the watch lapses.
    watch: str | None = None
    # A choice of a request with n > 1 (params.n): the ids of its request's choices not
    # ended yet, one set shared by them all. The request's entry is acknowledged when the
    # last one ends (``last_choice``); None for a request of one choice.
    choices: set[str] | None = None


def last_choice(item: InflightRequest | None) -> bool:
    """``item`` ended: whether its request's entry is done with it (a request of one choice,
    or the last of its choices to end)."""
    if item is None or item.choices is None:
        return True
    item.choices.discard(item.request_id)
    return not item.choices


class InflightTable:
    """Thread-safe table of in-flight requests with a capacity the intake waits on."""

    def __init__(self, capacity: int, read_batch: int = 1) -> None:
        self.capacity = capacity
        # While fewer than this many places are free, there is no room: requests waiting in
        # the table beyond the engine's seats keep it busy, and reading one entry as each
        # request ends would cost a read (and a wake-up of the intake) per request.
        self.read_batch = max(1, min(read_batch, capacity))
        self._items: dict[str, InflightRequest] = {}
        self._cond = threading.Condition()
        # A suspect request served by itself (nothing else is taken meanwhile), and whether
        # the worker is draining so that one can be (the intake reads nothing new).
        self._alone: str | None = None
        self._held = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        with self._cond:
            return request_id in self._items

    def room(self) -> int:
        with self._cond:
            return self._room()

    def _room(self) -> int:
        if self._alone is not None or self._held:
            return 0
        free = self.capacity - len(self._items)
        return free if free >= self.read_batch else 0

    def add(self, items: list[InflightRequest], alone: bool = False) -> bool:
        """Take a request in (its choices: one item each); ``alone`` only into an empty
        table, and then nothing else until they all leave. False (nothing added) when that
        cannot be."""
        with self._cond:
            if self._alone is not None or (alone and self._items):
                return False
            for item in items:
                self._items[item.request_id] = item
            if alone:
                self._alone = items[0].request_id
            return True

    @property
    def alone(self) -> str | None:
        """The request served by itself right now, if any."""
        with self._cond:
            return self._alone

    def hold(self, held: bool) -> None:
        """Stop (or let) the intake take new requests: a suspect waits for an empty worker."""
        with self._cond:
            self._held = held
            self._cond.notify_all()

    def get(self, request_id: str) -> InflightRequest | None:
        with self._cond:
            return self._items.get(request_id)

    def serving(self, request_id: str, choices: int = 1) -> InflightRequest | None:
        """The item of any of the request's ``choices`` served here, or None."""
        with self._cond:
            return next((item for i in range(choices)
                         if (item := self._items.get(choice_id(request_id, i))) is not None),
                        None)

    def get_each(self, request_ids: list[str]) -> list[InflightRequest | None]:
        """``get`` of each id, under one lock (a step's outputs: hundreds of them)."""
        items = self._items
        with self._cond:
            return [items.get(rid) for rid in request_ids]

    def remove(self, request_id: str) -> InflightRequest | None:
        with self._cond:
            item = self._items.pop(request_id, None)
            if not self._items:  # (alone: the table held that request's choices only)
                self._alone = None
            self._cond.notify_all()
            return item

    def ids(self) -> list[str]:
        with self._cond:
            return list(self._items)

    def wait_for_room(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._room() > 0, timeout)

    def wait_empty(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._items, timeout)
