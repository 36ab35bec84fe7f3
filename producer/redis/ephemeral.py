"""Private, throwaway redis-servers for tests and benchmarks, owned by the caller."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from producer.redis.binary import find_binary
from producer.redis.config import (
    CONF_FILE,
    LOG_FILE,
    base_config,
    prepare_dir,
    prepare_socket_dir,
    socket_path,
    tcp_url,
    unix_url,
    write_config,
)
from producer.redis.process import remove_leftovers, stop_child, wait_ready


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
        self.data_dir = prepare_dir(Path(data_dir).resolve())
        # The redis-server to run; None: find_binary() at each start.
        self.binary = binary
        self.socket = socket_path(self.data_dir)
        extra = {key: str(value) for key, value in (config or {}).items()}
        self.config = base_config(self.data_dir, self.socket) | {"daemonize": "no"} | extra
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
        prepare_socket_dir(self.data_dir, self.socket)
        write_config(self.data_dir, self.config)
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
            wait_ready(self.url, lambda: proc.poll() is None, log)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the server (SIGTERM: it flushes the append-only file first) and wait for it."""
        if self._proc is not None:
            stop_child(self._proc)
            self._proc = None
        remove_leftovers(self.data_dir, self.socket)

    def restart(self) -> None:
        """Stop and start again on the same folder; data written before survives."""
        self.stop()
        self.start()

    def __enter__(self) -> EphemeralRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
