"""The one place that opens Redis connections, sync and asyncio, with the project's options."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
import redis.asyncio
import redis.asyncio.retry
import structlog
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import AuthenticationError, ConnectionError, TimeoutError
from redis.retry import Retry

from producer.defaults import (
    DEFAULT_SOCKET_TIMEOUT,
    HEALTH_CHECK_INTERVAL,
    REDIS_PROTOCOL,
    RETRY_ATTEMPTS,
    RETRY_BACKOFF_BASE,
    RETRY_BACKOFF_CAP,
    SOCKET_CONNECT_TIMEOUT,
)
from producer.redis import server as redis_server

SCHEMES = ("redis", "rediss", "unix")
T = TypeVar("T")
log = structlog.get_logger(__name__)

# Errors worth retrying; redis-py's AuthenticationError is a ConnectionError but is never transient.
TRANSIENT_ERRORS = (ConnectionError, TimeoutError)
# Causes that make a ConnectionError permanent: a refused password, a TLS certificate that
# does not verify (wrong CA, wrong host name). Retrying them only delays the error.
PERMANENT_CAUSES = (AuthenticationError, ssl.SSLCertVerificationError)


# Seconds a command of a bounded asyncio pool waits for a free connection before it fails.
POOL_WAIT_S = 10.0


def connect(
    url: str | None = None,
    *,
    decode_responses: bool = False,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    client_name: str | None = None,
    retry_attempts: int = RETRY_ATTEMPTS,
    connect_timeout: float | None = None,
) -> redis.Redis:
    """A Redis client for ``url`` (redis://, rediss:// or unix://, user:password allowed).

    ``url=None`` means the embedded server under the data folder, started if it is not
    running. ``socket_timeout`` must stay above the longest BLOCK a caller uses.
    ``client_name`` names its connections in CLIENT LIST. ``retry_attempts=0`` hands every
    connection error to the caller at once (worker threads retry in their own loop, and say so).
    Each retry logs a warning naming the server and the error. ``connect_timeout``: seconds
    to connect (default: SOCKET_CONNECT_TIMEOUT).
    """
    url = resolve_url(url)
    retry = _TransientRetry(_backoff(), retry_attempts, supported_errors=TRANSIENT_ERRORS,
                            where=describe(url))
    options = _options(url, decode_responses, socket_timeout, retry)
    if connect_timeout is not None:
        options["socket_connect_timeout"] = connect_timeout
    if client_name is not None:
        options["client_name"] = client_name
    return redis.Redis.from_url(url, **options)


def connect_async(
    url: str | None = None,
    *,
    decode_responses: bool = False,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    max_connections: int | None = None,
) -> redis.asyncio.Redis:
    """The asyncio twin of :func:`connect`, with the same URL rules and options.

    With ``url=None`` it checks (and may start) the embedded server synchronously, once here.
    ``max_connections``: at most that many connections, a command waiting up to
    POOL_WAIT_S for one to be free (redis-py's own pool refuses the 101st at once).
    """
    url = resolve_url(url)
    retry = _AsyncTransientRetry(_backoff(), RETRY_ATTEMPTS, supported_errors=TRANSIENT_ERRORS,
                                 where=describe(url))
    options = _options(url, decode_responses, socket_timeout, retry)
    if max_connections is None:
        return redis.asyncio.Redis.from_url(url, **options)
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=POOL_WAIT_S, **options)
    return redis.asyncio.Redis.from_pool(pool)  # (its client closes the pool)


def describe(url: str | None) -> str:
    """``url`` safe for logs: any password (in the userinfo or a ``password=`` query) is masked."""
    if url is None:
        return "embedded"
    scheme, sep, _ = url.partition("://")
    if not sep:
        return f"***@{url.rpartition('@')[2]}" if "@" in url else url
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return f"{scheme}://<unparsable URL>"  # never echo what might hold a password
    netloc = parts.netloc
    if has_password:
        userinfo, _, hostport = netloc.rpartition("@")
        netloc = f"{userinfo.partition(':')[0]}:***@{hostport}"
    query = "&".join(
        f"{k}=***" if k.lower() == "password" else f"{k}{eq}{v}"
        for k, eq, v in (p.partition("=") for p in parts.query.split("&") if p)
    )
    masked = f"{scheme}://{netloc}{parts.path}"
    if query:
        masked += f"?{query}"
    return masked


def resolve_url(url: str | None) -> str:
    """``url`` checked, or for None the embedded server's (started if it is not running)."""
    if url is None:
        return redis_server.ensure_running()
    scheme = url.partition("://")[0].lower()
    if scheme not in SCHEMES:
        raise ValueError(
            f"unsupported Redis URL {describe(url)!r}: use redis://, rediss:// (TLS) or unix://"
        )
    return url


def _transient(error: Exception) -> bool:
    # The asyncio unix-socket client wraps a refused password in a plain ConnectionError, and
    # redis-py raises a certificate failure as a ConnectionError while handling the SSL error.
    return not any(isinstance(e, PERMANENT_CAUSES)
                   for e in (error, error.__cause__, error.__context__))


class _Refused(Exception):
    """Carries a non-transient error through Retry, which would otherwise retry it."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def _log_retry(where: str, error: Exception, retry: int, retries: int) -> None:
    """One warning per retry: which server, which try, and what failed."""
    log.warning("cannot reach Redis, retrying", url=where, retry=f"{retry}/{retries}",
                error=str(error))


class _TransientRetry(Retry):
    """A Retry that gives up at once on a refused password instead of backing off for seconds,
    and logs each retry it makes (``where``: the server, safe for logs)."""

    def __init__(self, backoff: Any, retries: int, *, supported_errors: tuple, where: str) -> None:
        super().__init__(backoff, retries, supported_errors=supported_errors)
        self.where = where

    # Wrapping ``do`` (not redis-py's newer is_retryable hook) works on every redis-py >= 5.
    def call_with_retry(
        self, do: Callable[[], T], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> T:
        failures = 0

        def guarded() -> T:
            try:
                return do()
            except TRANSIENT_ERRORS as error:
                if _transient(error):
                    raise
                raise _Refused(error) from None

        def reporting(error: Exception, *count: int) -> Any:
            nonlocal failures
            failures += 1
            if failures <= self._retries:  # the last failure is raised, not retried
                _log_retry(self.where, error, failures, self._retries)
            return fail(error, *count)

        try:
            return super().call_with_retry(guarded, reporting, *args, **kwargs)
        except _Refused as refused:
            raise refused.error from None


class _AsyncTransientRetry(redis.asyncio.retry.Retry):
    """The asyncio twin of :class:`_TransientRetry`."""

    def __init__(self, backoff: Any, retries: int, *, supported_errors: tuple, where: str) -> None:
        super().__init__(backoff, retries, supported_errors=supported_errors)
        self.where = where

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Callable[..., Awaitable[Any]],
        *args: Any,
        **kwargs: Any,
    ) -> T:
        failures = 0

        async def guarded() -> T:
            try:
                return await do()
            except TRANSIENT_ERRORS as error:
                if _transient(error):
                    raise
                raise _Refused(error) from None

        async def reporting(error: Exception, *count: int) -> Any:
            nonlocal failures
            failures += 1
            if failures <= self._retries:
                _log_retry(self.where, error, failures, self._retries)
            return await fail(error, *count)

        try:
            return await super().call_with_retry(guarded, reporting, *args, **kwargs)
        except _Refused as refused:
            raise refused.error from None


def _backoff() -> ExponentialWithJitterBackoff:
    # Jitter spreads the reconnects of a whole fleet after a Redis restart.
    return ExponentialWithJitterBackoff(cap=RETRY_BACKOFF_CAP, base=RETRY_BACKOFF_BASE)


def _options(url: str, decode_responses: bool, socket_timeout: float, retry: Any) -> dict:
    options: dict[str, Any] = {
        # RESP2: identical reply shapes on Redis 6.2/7/Valkey and proxies without HELLO, and in
        # redis-py's sync and asyncio clients (redis-py 8 would otherwise negotiate RESP3).
        "protocol": REDIS_PROTOCOL,
        "decode_responses": decode_responses,
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": SOCKET_CONNECT_TIMEOUT,
        "health_check_interval": HEALTH_CHECK_INTERVAL,
        # TimeoutError is in the retry's errors: this replaces the deprecated retry_on_timeout.
        "retry": retry,
    }
    if not url.lower().startswith("unix://"):
        # Keepalive is a TCP option; unix socket connections refuse the argument.
        options["socket_keepalive"] = True
    return options
