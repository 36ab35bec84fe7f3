"""Waiting in tests for a state that is certain to come: the bound only turns a hang into a
failure, it is never the evidence (time is an input; see producer/clock.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Real seconds a test waits for such a state; generous, for loaded machines.
PATIENCE_S = 60.0


def eventually(condition: Callable[[], object], what: str, patience_s: float = PATIENCE_S,
               poll_s: float = 0.01) -> None:
    """Poll until ``condition()`` holds; fail naming ``what`` if it never does."""
    end = time.monotonic() + patience_s
    while not condition():
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(poll_s)
