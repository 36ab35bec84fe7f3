"""Test-only fault injection, off by default and wired in only where configured.

CONVEYOR_FAULT_KILL_ON_TOKEN=N: the worker process kills itself (SIGKILL) when it admits
a request whose prompt contains token id N. Tests use it to make a request that really
kills every worker that takes it (a poison request). Read once, when a worker is built:
with it unset the engine loop gets no admission hook, and admission runs no check.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from producer import settings

# Runs on every admission with the request's prompt token ids.
AdmissionHook = Callable[[list[int]], None]


def admission_fault_hook() -> AdmissionHook | None:
    """The fault to inject at each admission, or None when none is configured."""
    poison = settings.fault_kill_on_token()
    if poison is None:
        return None

    def kill_on_poison(prompt_token_ids: list[int]) -> None:
        if poison in prompt_token_ids:
            os.kill(os.getpid(), signal.SIGKILL)

    return kill_on_poison
