"""The installed conveyor's version, for `conveyor --version` and the gateway's /version."""

from __future__ import annotations

from functools import cache
from importlib import metadata


@cache
def conveyor_version() -> str:
    """The installed conveyor distribution's version ("unknown" when run from a bare tree)."""
    try:
        return metadata.version("conveyor")
    except metadata.PackageNotFoundError:
        return "unknown"
