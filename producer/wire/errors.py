"""Errors a producer may meet that are part of the contract, not of one transport."""

from __future__ import annotations


class QueueFull(RuntimeError):
    """A request stream already holds ``max_queue`` undelivered plus pending requests."""

    def __init__(self, stream: str, count: int, limit: int) -> None:
        super().__init__(
            f"queue {stream} is full: {count} requests undelivered or pending, "
            f"max_queue is {limit}; nothing was added"
        )
        self.stream = stream
        self.count = count
        self.limit = limit


class LaneBlocked(RuntimeError):
    """A request stream takes no new entry: its last id is the largest possible (someone
    allowed to XADD wrote an entry there). Only an operator can reopen it."""

    MESSAGE = "exhausted the last possible id"

    def __init__(self, stream: str) -> None:
        super().__init__(
            f"request lane {stream} is blocked: an entry at the largest possible id closes it "
            "to new requests, and nothing was added. An administrator reopens it with "
            "`conveyor redis setup --reopen-lanes`"
        )
        self.stream = stream

    @classmethod
    def matches(cls, error: Exception) -> bool:
        """Whether Redis refused an XADD because the stream's ids are used up."""
        return cls.MESSAGE in str(error).lower()


class ModelNotFound(LookupError, ValueError):
    """No worker has registered ``model`` (no ``{ns}:model:{name}`` hash) and none serves it.

    A ``LookupError`` and a ``ValueError``: code that already treats a bad ``model`` argument
    as a ValueError keeps working. ``served`` lists the models that are registered.
    """

    def __init__(self, model: str, served: list[str], namespace: str = "conveyor",
                 detail: str = "") -> None:
        names = ", ".join(served) if served else "none"
        super().__init__(
            f"model {model!r} is not registered in namespace {namespace!r}"
            f"{' ' + detail if detail else ''}: no worker serves it "
            f"(registered models: {names})"
        )
        self.model = model
        self.served = list(served)
        self.namespace = namespace


class NoLiveWorker(RuntimeError):
    """A request's model has had no live worker for the wait the reader allowed: nobody is
    answering it, and nobody may ever (the request is still queued; cancel it, or read it
    again later)."""

    def __init__(self, request_id: str, model: str, waited_s: float) -> None:
        super().__init__(f"request {request_id}: no live worker has served model {model!r} "
                         f"for {waited_s:g} s")
        self.request_id = request_id
        self.model = model
        self.waited_s = waited_s


class RequestLost(NoLiveWorker):
    """Nothing holds the request any more: it is in neither its lane, a worker's pending
    list nor its output stream (a failover lost it, or its output expired). No worker will
    ever answer it: submit it again."""

    def __init__(self, request_id: str, where: str) -> None:
        RuntimeError.__init__(self, f"request {request_id} is lost: it is in neither {where}, "
                              "a worker's pending list nor its output stream")
        self.request_id = request_id
        self.model = ""
        self.waited_s = 0.0
