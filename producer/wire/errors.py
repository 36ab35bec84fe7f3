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
