"""The embedded server's folder on disk: its file names, socket path, URLs and redis.conf.

Also home to :class:`RedisServerError`, the one error every embedded-server module raises.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import quote

from producer import paths
from producer.defaults import UNIX_SOCKET_MAX_BYTES

CONF_FILE = "redis.conf"
PID_FILE = "redis.pid"
LOG_FILE = "redis.log"
LOCK_FILE = "redis.lock"
SOCKET_FILE = "redis.sock"


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found, started or stopped."""


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


def prepare_dir(data_dir: Path) -> Path:
    """Create ``data_dir`` (private to this user) if missing; return it."""
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return data_dir


def prepare_socket_dir(data_dir: Path, sock: Path) -> None:
    """Create the /tmp folder of ``sock`` when it lies outside ``data_dir``, and check it is ours.

    Call it just before a start, under the lock: ``remove_leftovers`` removes that folder.
    """
    if sock.parent == data_dir:
        return
    sock.parent.mkdir(mode=0o700, exist_ok=True)
    # A shared /tmp: refuse a folder (or link) another user planted there.
    st = os.lstat(sock.parent)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RedisServerError(f"{sock.parent} is not a private folder of this user")


def base_config(data_dir: Path, sock: Path) -> dict[str, str]:
    """The redis.conf directives every embedded server gets: unix socket only, AOF persistence."""
    # Values are written verbatim (a directive may take several words), so paths are quoted here.
    return {
        "port": "0",  # no TCP: the socket below is reachable only by this user
        "unixsocket": quote_conf(str(sock)),
        "unixsocketperm": "700",
        "dir": quote_conf(str(data_dir)),
        "pidfile": quote_conf(str(data_dir / PID_FILE)),
        "logfile": quote_conf(str(data_dir / LOG_FILE)),
        "appendonly": "yes",
        "appendfsync": "everysec",
        "save": '""',  # the AOF persists every second; RDB snapshots would only duplicate it
    }


def write_config(data_dir: Path, config: Mapping[str, str]) -> None:
    """Write ``config`` as ``data_dir``/redis.conf, one ``directive value`` line each, mode 0600."""
    lines = [f"{key} {value or quote_conf('')}" for key, value in config.items()]
    path = data_dir / CONF_FILE
    # 0600: the file may hold a requirepass.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# Written by conveyor on each start; edits are overwritten.\n")
        fh.write("\n".join(lines) + "\n")


def quote_conf(value: str) -> str:
    """``value`` as one redis.conf argument, whatever spaces or quotes it holds."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
