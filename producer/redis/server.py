"""An embedded, real redis-server for machines with no Redis: find it, start it once, reuse, stop.

One server per data folder (default ``<conveyor data dir>/redis``), reached on a unix socket
only, persisted with an append-only file. ``start_ephemeral`` gives tests a private one.

This is the public API; the parts live in ``redis_config`` (folder, socket, URLs, redis.conf),
``redis_binary`` (which executable), ``redis_process`` (lock, probe, pids) and
``redis_ephemeral`` (private servers), and are re-exported here.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producer.defaults import SERVER_START_TIMEOUT, SERVER_STOP_TIMEOUT
from producer.redis.binary import binary_supports_tls, binary_version, bundled_binary, find_binary
from producer.redis.config import (
    CONF_FILE,
    LOCK_FILE,
    LOG_FILE,
    PID_FILE,
    SOCKET_FILE,
    RedisServerError,
    base_config,
    prepare_dir,
    prepare_socket_dir,
    server_dir,
    socket_path,
    tcp_url,
    unix_url,
    write_config,
)
from producer.redis.ephemeral import EphemeralRedis, start_ephemeral
from producer.redis.process import (
    daemon_alive,
    locked,
    log_tail,
    pid_alive,
    probe,
    probe_client,
    remove_leftovers,
    server_pid,
    shutdown,
    stop_child,
    terminate,
    wait_child,
    wait_gone,
    wait_ready,
)

__all__ = [
    "CONF_FILE",
    "LOCK_FILE",
    "LOG_FILE",
    "PID_FILE",
    "SOCKET_FILE",
    "EphemeralRedis",
    "RedisServerError",
    "binary_supports_tls",
    "binary_version",
    "bundled_binary",
    "ensure_running",
    "find_binary",
    "pid_alive",
    "run_foreground",
    "server_dir",
    "socket_path",
    "start_ephemeral",
    "status",
    "stop",
    "tcp_url",
    "unix_url",
    "wait_gone",
]


def ensure_running(data_dir: Path | None = None) -> str:
    """Start the embedded server for ``data_dir`` unless one already serves it; return its URL.

    Safe to call from many processes at once: a file lock covers check-and-start.
    """
    sdir = prepare_dir(server_dir(data_dir))
    sock = socket_path(sdir)
    url = unix_url(sock)
    with locked(sdir):
        if probe(url) != "down":
            wait_ready(url, lambda: True, sdir / LOG_FILE)
            return url
        if (pid := server_pid(sdir)) is not None:
            # Alive but silent (socket deleted, or wedged): two servers must never share one AOF.
            terminate(pid)
        (sdir / PID_FILE).unlink(missing_ok=True)
        prepare_socket_dir(sdir, sock)
        config = base_config(sdir, sock) | {"daemonize": "yes"}
        write_config(sdir, config)
        done = subprocess.run(
            [find_binary(), str(sdir / CONF_FILE)],
            cwd=sdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=SERVER_START_TIMEOUT,
        )
        if done.returncode != 0:
            raise RedisServerError(
                f"redis-server refused to start in {sdir}:\n{done.stdout}{done.stderr}"
                f"{log_tail(sdir / LOG_FILE)}"
            )
        started = time.monotonic()
        wait_ready(url, lambda: daemon_alive(sdir, started), sdir / LOG_FILE)
    return url


def stop(data_dir: Path | None = None) -> bool:
    """Stop the embedded server of ``data_dir``; False when none was running."""
    sdir = server_dir(data_dir)
    if not sdir.is_dir():
        return False
    sock = socket_path(sdir)
    url = unix_url(sock)
    with locked(sdir):
        pid = server_pid(sdir)
        if probe(url) != "down":
            pid = shutdown(url) or pid
        elif pid is None:
            remove_leftovers(sdir, sock)
            return False
        if pid is not None and not wait_gone(pid, SERVER_STOP_TIMEOUT):
            terminate(pid)
        remove_leftovers(sdir, sock)
    return True


def status(data_dir: Path | None = None) -> dict[str, Any]:
    """Whether the embedded server of ``data_dir`` runs, where, and what it holds."""
    sdir = server_dir(data_dir)
    sock = socket_path(sdir)
    url = unix_url(sock)
    report: dict[str, Any] = {
        "running": False,
        "url": url,
        "data_dir": str(sdir),
        "socket": str(sock),
        "log": str(sdir / LOG_FILE),
        "pid": None,
        "version": None,
        "keys": None,
    }
    if probe(url) == "down":
        return report
    with probe_client(url) as client:
        info = client.info("server")
        report |= {
            "running": True,
            "pid": int(info["process_id"]),
            "version": str(info["redis_version"]),
            "keys": int(client.dbsize()),
        }
        if tcp_port := int(info.get("tcp_port", 0)):
            report["tcp_port"] = tcp_port
    return report


def run_foreground(
    data_dir: Path | None = None,
    port: int | None = None,
    bind: str = "127.0.0.1",
    on_ready: Callable[[list[str]], None] | None = None,
) -> int:
    """Run the server of ``data_dir`` in the foreground until Ctrl-C or SIGTERM; its exit code.

    ``port`` also opens TCP on ``bind`` (loopback by default), for clients that cannot reach
    the socket. ``on_ready`` gets the URLs it serves once it answers PING.
    """
    sdir = prepare_dir(server_dir(data_dir))
    sock = socket_path(sdir)
    url = unix_url(sock)
    # Logs go to the terminal: a foreground server is watched by whoever started it.
    config = base_config(sdir, sock) | {"daemonize": "no", "logfile": '""'}
    urls = [url]
    if port:
        config |= {"port": str(port), "bind": bind}
        urls.append(tcp_url(bind, port))
    with locked(sdir):
        if probe(url) != "down" or server_pid(sdir) is not None:
            raise RedisServerError(
                f"a redis-server already serves {sdir} at {url}: "
                "use it, or stop it first with `conveyor redis stop`"
            )
        prepare_socket_dir(sdir, sock)
        write_config(sdir, config)
        proc = subprocess.Popen(
            [find_binary(), str(sdir / CONF_FILE)], cwd=sdir, stdin=subprocess.DEVNULL
        )
        try:
            wait_ready(url, lambda: proc.poll() is None, None)
        except BaseException:
            stop_child(proc)
            raise
    if on_ready is not None:
        on_ready(urls)
    return wait_child(proc)
