"""Defaults of the producer package, each with its meaning: Redis connections, embedded server."""

from __future__ import annotations

# --- Redis connections -----------------------------------------------------------------------

# Longest BLOCK (ms) any XREAD/XREADGROUP in the project may use; the socket timeout must exceed it.
MAX_BLOCK_MS = 5000

# Socket read timeout (s): a blocking read plus generous slack, so only a dead server times out.
DEFAULT_SOCKET_TIMEOUT = MAX_BLOCK_MS / 1000 + 10.0

# Seconds to wait for a TCP/unix connect before failing (and retrying).
SOCKET_CONNECT_TIMEOUT = 5.0

# A connection idle longer than this (s) is PINGed before use, catching half-open sockets.
HEALTH_CHECK_INTERVAL = 30

# Retries after a ConnectionError/TimeoutError; before retry n it sleeps a random fraction of
# BASE * 2**n, at most CAP (0.1, 0.2, 0.4, 0.8, 1.6, 2 s): up to 5.1 s of waits in all, about
# 3 s on average (full jitter), is the outage a single call rides out.
RETRY_ATTEMPTS = 6
RETRY_BACKOFF_BASE = 0.05
RETRY_BACKOFF_CAP = 2.0

# RESP version spoken to the server (see producer.client.connection for why not RESP3).
REDIS_PROTOCOL = 2

# --- Embedded redis-server -------------------------------------------------------------------

# Seconds to wait for a started server to answer PING (an AOF replay on start counts against it).
SERVER_START_TIMEOUT = 15.0

# Seconds to wait for a stopped server's process to exit.
SERVER_STOP_TIMEOUT = 10.0

# Longest unix socket path we bind: sun_path is 108 bytes on Linux and 104 on macOS, NUL included.
UNIX_SOCKET_MAX_BYTES = 100
