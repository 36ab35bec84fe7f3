"""Test-only fault injection, switched on by environment variables and off by default.

CONVEYOR_FAULT_KILL_ON_TOKEN=N: the worker process kills itself (SIGKILL) when it admits
a request whose prompt contains token id N. Tests use it to make a request that really
kills every worker that takes it (a poison request).
"""

from __future__ import annotations

import os
import signal

_KILL_ON_TOKEN = os.environ.get("CONVEYOR_FAULT_KILL_ON_TOKEN")


def maybe_die(prompt_token_ids: list[int]) -> None:
    if _KILL_ON_TOKEN is not None and int(_KILL_ON_TOKEN) in prompt_token_ids:
        os.kill(os.getpid(), signal.SIGKILL)
