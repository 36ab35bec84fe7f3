"""Waiting in tests for a state that is certain to come: the bound only turns a hang into a
failure, it is never the evidence (time is an input; see producer/clock.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Real seconds a test waits for such a state; generous, for loaded machines.
PATIENCE_S = 60.0


def eventually(condition: Callable[[], T], what: str, patience_s: float = PATIENCE_S,
               poll_s: float = 0.01) -> T:
    """Poll until ``condition()`` is truthy and return it; fail naming ``what`` if it never is."""
    end = time.monotonic() + patience_s
    while not (value := condition()):
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(poll_s)
    return value
