"""A redis-server process from the outside: lock its folder, probe it, wait on it, stop it.

Shared by the user's embedded server (``producer.redis.server``) and the private servers of
tests and benchmarks (``producer.redis.ephemeral``).
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ResponseError
from redis.retry import Retry

from producer.defaults import SERVER_START_TIMEOUT, SERVER_STOP_TIMEOUT
from producer.redis.config import LOCK_FILE, PID_FILE, RedisServerError

ProbeState = Literal["up", "loading", "down"]


@contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Hold the exclusive file lock of ``data_dir`` (across processes) while inside."""
    with open(data_dir / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@contextmanager
def probe_client(url: str) -> Iterator[redis.Redis]:
    """A client for quick checks of ``url``: short timeouts, no retries, str replies."""
    # A probe must answer fast: short timeouts and no retries, unlike producer.client.connection.
    client = redis.Redis.from_url(
        url,
        protocol=2,
        socket_timeout=2.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )
    try:
        yield client
    finally:
        client.close()


def probe(url: str) -> ProbeState:
    """``up``, ``loading`` (replaying its AOF) or ``down``."""
    with probe_client(url) as client:
        try:
            client.ping()
        except BusyLoadingError:
            return "loading"
        except (AuthenticationError, ResponseError):
            return "up"  # it answered, only not to us
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return "down"
    return "up"


def wait_ready(url: str, alive: Callable[[], bool], log: Path | None) -> None:
    """Wait until ``url`` answers PING; raise if ``alive()`` turns False or it takes too long.

    ``log`` is the server's log file, whose tail goes in the error (None: it logs to the terminal).
    """
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while (state := probe(url)) != "up":
        if not alive():
            raise RedisServerError(f"redis-server exited while starting{log_tail(log)}")
        if time.monotonic() > deadline:
            raise RedisServerError(
                f"redis-server did not answer on {url} within {SERVER_START_TIMEOUT:.0f} s "
                f"(state: {state}){log_tail(log)}"
            )
        time.sleep(0.02)


def daemon_alive(data_dir: Path, started: float) -> bool:
    """Whether the daemonized server of ``data_dir``, started at monotonic ``started``, lives."""
    pid = read_pid(data_dir)
    if pid is None:
        # The pidfile is written right after the server binds: missing for long means it died.
        return time.monotonic() - started < 3.0
    return pid_alive(pid)


def log_tail(log: Path | None, lines: int = 15) -> str:
    """The last ``lines`` of ``log``, formatted to end an error message."""
    if log is None:
        return " (its output is above)"
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last lines of {log} ---\n" + "\n".join(tail)


def read_pid(data_dir: Path) -> int | None:
    """The pid in ``data_dir``'s pidfile, alive or not; None without a readable one."""
    try:
        return int((data_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def server_pid(data_dir: Path) -> int | None:
    """The pidfile's process if it is a live redis-server (pids get reused after a crash)."""
    pid = read_pid(data_dir)
    if pid is None or not pid_alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid  # no /proc (macOS): trust the pidfile
    return pid if b"redis-server" in cmdline else None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # A zombie (exited, not yet reaped by its parent) counts as gone.
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return proc_stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` s for process ``pid`` to exit; whether it did."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def terminate(pid: int) -> None:
    """End process ``pid``: SIGTERM, then SIGKILL if it lingers; raise if it still lives."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_gone(pid, SERVER_STOP_TIMEOUT):
            return
    raise RedisServerError(f"redis-server pid {pid} did not exit")


def shutdown(url: str) -> int | None:
    """Send SHUTDOWN NOSAVE (the AOF is still flushed); the server's pid, to wait on."""
    with probe_client(url) as client:
        try:
            pid = int(client.info("server")["process_id"])
            client.shutdown(nosave=True)
        except redis.RedisError:
            return None  # the caller falls back to the pidfile and SIGTERM
    return pid


def remove_leftovers(data_dir: Path, sock: Path) -> None:
    """Remove the socket, a stale pidfile and the /tmp socket folder of a stopped server."""
    # A killed server leaves these behind; a clean shutdown removes them itself.
    sock.unlink(missing_ok=True)
    if server_pid(data_dir) is None:
        (data_dir / PID_FILE).unlink(missing_ok=True)
    if sock.parent != data_dir:
        try:
            sock.parent.rmdir()
        except OSError:
            pass


def stop_child(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server child process (SIGTERM, SIGKILL after a timeout) and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_child(proc: subprocess.Popen[bytes]) -> int:
    """Wait for a foreground server child to exit, relaying Ctrl-C and SIGTERM; its exit code."""
    # Forward SIGTERM (a supervisor stopping us) so the server never outlives this process.
    forwarding = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: proc.terminate()) if forwarding else None
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                # A second SIGINT makes redis exit unflushed; SIGTERM only repeats the shutdown.
                proc.terminate()
    finally:
        if forwarding:
            signal.signal(signal.SIGTERM, previous)
