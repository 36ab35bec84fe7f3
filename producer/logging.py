"""Log set-up for every `conveyor` process: structlog and stdlib logging, one format.

JSON lines off a terminal (what log collectors read), readable console lines on one. Lines
go to stderr through a queue, so a thread that logs (the engine loop) never waits on a pipe.
Worker threads bind ``worker_id`` with :func:`bind_thread_context`; lines about a request
carry ``request_id``.
"""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import sys
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LEVEL = "info"

# The queue listener of the current configuration; replaced when configure_logging runs again.
_listener: logging.handlers.QueueListener | None = None
_registered_exit = False


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is written, not when logging was
    configured: a caller that swaps stderr (a test capturing output) and closes its stream
    must not break every later log line."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # noqa: D401 (a property of logging.StreamHandler's API)
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str = DEFAULT_LEVEL, json: bool | None = None) -> None:
    """Route structlog and stdlib logging to stderr at ``level``.

    ``json=None`` picks JSON lines unless stderr is a terminal. Safe to call again.
    """
    global _listener, _registered_exit
    if level.lower() not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    numeric = logging.getLevelName(level.upper())
    if json is None:
        json = not sys.stderr.isatty()

    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Any
    if json:
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=True)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,  # lines from stdlib loggers (redis, urllib3, ...)
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )

    if not _registered_exit:
        atexit.register(_stop_listener)  # once: flush what is queued when the process exits
        _registered_exit = True
    _stop_listener()
    handler = _CurrentStderr()
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    enqueue = logging.handlers.QueueHandler(records)
    enqueue.setFormatter(formatter)  # format in the caller, write in the listener thread
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()

    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(enqueue)
    root.setLevel(numeric)

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: module-level loggers follow a later configure_logging (tests, --log-level).
        cache_logger_on_first_use=False,
    )


def bind_thread_context(**values: Any) -> None:
    """Bind values (e.g. ``worker_id``) onto every line this thread logs from now on.

    Threads start with an empty context, so each worker thread calls this first.
    """
    structlog.contextvars.bind_contextvars(**values)


def _stop_listener() -> None:
    """Write out queued lines and stop the listener thread (safe to call twice)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None
