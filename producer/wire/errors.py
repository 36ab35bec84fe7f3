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
