"""Every ``CONVEYOR_*`` environment switch, read here and nowhere else (docs/settings.md).

Each is read when its accessor is called, not at import: tests set variables with
monkeypatch and benchmarks flip them between runs. A switch that was renamed still answers
to its old name, with one DeprecationWarning (and a log line) per process. Loads neither
redis nor torch: the producer, the worker and the CLI parser all read it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

# Values that switch a default-on setting off, and a default-off setting on (any case).
OFF_WORDS = ("0", "false", "no", "off")
ON_WORDS = ("1", "true", "yes", "on")
# What CONVEYOR_CPU_MATMUL may ask for; anything else is the default, "packed".
MATMUL_MODES = ("packed", "unpacked", "blas")


@dataclass(frozen=True)
class Setting:
    """One environment variable: its name, its default (as written in the environment),
    what it switches, and the name it had before, if it was renamed."""

    name: str
    default: str
    switches: str
    old_name: str | None = None


HOME = Setting("CONVEYOR_HOME", "",
               "where conveyor keeps its data (models it makes, the embedded Redis); unset: "
               "`$XDG_DATA_HOME/conveyor`, else `~/.local/share/conveyor`")
REDIS_URL = Setting("CONVEYOR_REDIS_URL", "",
                    "the Redis every `--redis` option and bulk job defaults to; unset: the "
                    "embedded server")
BATCH_PUBLISHER = Setting("CONVEYOR_BATCH_PUBLISHER", "0",
                          "`1` puts a worker's publisher thread under SCHED_BATCH with its other "
                          "I/O threads (`WorkerConfig.batch_publisher`'s default), to compare")
FAULT_KILL_ON_TOKEN = Setting("CONVEYOR_FAULT_KILL_ON_TOKEN", "",
                              "tests only: a worker SIGKILLs itself when it admits a prompt "
                              "holding this token id (a poison request)")
CPU_KERNELS = Setting("CONVEYOR_CPU_KERNELS", "1",
                      "`0` switches off every CPU kernel (attention, decode layers, matmuls, "
                      "sampling): torch ops only, the same results, slower",
                      old_name="CONVEYOR_CPU_ATTENTION_KERNEL")
CPU_MATMUL = Setting("CONVEYOR_CPU_MATMUL", "packed",
                     "`unpacked` makes no packed weight copies; `blas` keeps every CPU matmul "
                     "on `F.linear`")
CPU_DECODE_LAYERS = Setting("CONVEYOR_CPU_DECODE_LAYERS", "1",
                            "`0` runs a CPU decode step's layers in Python instead of one "
                            "native call")
CPU_STEP_TEAM = Setting("CONVEYOR_CPU_STEP_TEAM", "1",
                        "`0` runs one OpenMP region per loop of the native decode step instead "
                        "of one team for the whole step (the same bits)")

SETTINGS = (HOME, REDIS_URL, BATCH_PUBLISHER, FAULT_KILL_ON_TOKEN, CPU_KERNELS, CPU_MATMUL,
            CPU_DECODE_LAYERS, CPU_STEP_TEAM)

# Old names already warned about in this process.
_warned: set[str] = set()


def raw(setting: Setting) -> str | None:
    """The variable's value as set (its old name's where only that is set), else None."""
    value = os.environ.get(setting.name)
    if setting.old_name is not None and setting.old_name in os.environ:
        _warn_renamed(setting)
        if value is None:
            value = os.environ[setting.old_name]
    return value


@contextmanager
def overridden(setting: Setting, value: str) -> Iterator[None]:
    """Set ``setting`` in this process's environment for a block, then put back what was
    there (a benchmark comparing both sides of a switch)."""
    before = os.environ.get(setting.name)
    os.environ[setting.name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(setting.name, None)
        else:
            os.environ[setting.name] = before


def _warn_renamed(setting: Setting) -> None:
    if setting.old_name in _warned:
        return
    _warned.add(setting.old_name)
    message = (f"{setting.old_name} is renamed {setting.name}; the old name still works "
               f"(where {setting.name} is unset) but will go")
    warnings.warn(message, DeprecationWarning, stacklevel=3)
    log.warning("deprecated setting name", old=setting.old_name, new=setting.name)


def _text(setting: Setting) -> str:
    value = raw(setting)
    return (setting.default if value is None else value).strip()


def _on(setting: Setting) -> bool:
    """A switch: off for any of OFF_WORDS when it defaults on, on for ON_WORDS when off."""
    value = _text(setting).lower()
    if setting.default in ON_WORDS:
        return value not in OFF_WORDS
    return value in ON_WORDS


def home() -> Path | None:
    """``$CONVEYOR_HOME``: the folder of conveyor's local data, or None when unset or empty."""
    value = _text(HOME)
    return Path(value) if value else None


def redis_url() -> str | None:
    """``$CONVEYOR_REDIS_URL``: the Redis to reach by default, or None (the embedded one)."""
    return _text(REDIS_URL) or None


def batch_publisher() -> bool:
    """Whether the publisher thread runs under SCHED_BATCH too (default: no)."""
    return _on(BATCH_PUBLISHER)


def fault_kill_on_token() -> int | None:
    """The token id whose admission kills the worker (fault injection), or None."""
    value = _text(FAULT_KILL_ON_TOKEN)
    return int(value) if value else None


def cpu_kernels() -> bool:
    """Whether the CPU kernels are used at all (default: yes, where they build)."""
    return _on(CPU_KERNELS)


def cpu_matmul() -> str:
    """How CPU matmuls run: ``packed`` (default), ``unpacked`` or ``blas``."""
    value = _text(CPU_MATMUL).lower()
    return value if value in MATMUL_MODES else CPU_MATMUL.default


def cpu_decode_layers() -> bool:
    """Whether a CPU decode step's layers run as one native call (default: yes)."""
    return _on(CPU_DECODE_LAYERS)


def cpu_step_team() -> bool:
    """Whether the native decode step runs one OpenMP team for the whole step (default: yes)."""
    return _on(CPU_STEP_TEAM)
