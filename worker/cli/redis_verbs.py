"""argparse wiring for `conveyor redis` (the embedded server) and the shared --redis option."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from producer import settings
from producer.client.connection import describe
from producer.redis import server as redis_server
from producer.wire.keys import LANES, Keys

ACTIONS = ("run", "stop", "status", "setup")
REDIS_URL_ENV = settings.REDIS_URL.name

# `conveyor redis status` exit codes, as init scripts use them: 0 running, 3 not running.
STATUS_NOT_RUNNING = 3


def add_redis_url_option(parser: argparse.ArgumentParser) -> None:
    """Add ``--redis URL`` (default ``$CONVEYOR_REDIS_URL``, else None: the embedded server)."""
    parser.add_argument(
        "--redis",
        metavar="URL",
        default=settings.redis_url(),
        help="Redis >= 6.2 or Valkey: redis://[user:password@]host:port/db, rediss:// (TLS) "
        f"or unix:///path.sock (default: ${REDIS_URL_ENV}, else the embedded server)",
    )


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """Add ``--redis URL`` and ``--namespace NS``: where a client verb finds the fleet."""
    add_redis_url_option(parser)
    parser.add_argument("--namespace", metavar="NS", default="conveyor",
                        help="prefix of every conveyor key: the fleet's namespace")


def add_redis_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``redis`` verb: run (default, foreground), stop or status of the embedded server."""
    p = subparsers.add_parser(
        "redis",
        help="run, stop or inspect the embedded Redis server",
        description="The embedded redis-server kept in the data folder (unix socket, AOF). "
        "`conveyor redis` runs it in the foreground (Ctrl-C stops it); other commands "
        "start it in the background on demand when no --redis URL is given.",
    )
    p.add_argument(
        "action",
        nargs="?",
        choices=ACTIONS,
        default="run",
        help="run in the foreground (default), stop the running server, show its status, "
        "or set up a Redis for conveyor (`setup`: load conveyor's functions, as an "
        "administrator; --acl prints the ACL users for its version)",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        help="server folder (default: the conveyor data folder's redis/)",
    )
    p.add_argument(
        "--port", type=int, metavar="N",
        help="run: also listen on TCP port N, on --bind (default: the unix socket only)"
    )
    p.add_argument("--bind", default="127.0.0.1", metavar="ADDR", help="run: TCP address")
    p.add_argument("--json", action="store_true", help="status: print one JSON object")
    # SUPPRESS: given before the verb (`conveyor --redis URL redis setup`) it still counts.
    p.add_argument("--redis", metavar="URL", default=argparse.SUPPRESS,
                   help=f"setup: the Redis to set up (default: ${REDIS_URL_ENV}, else the "
                   "embedded server)")
    p.add_argument("--acl", action="store_true",
                   help="setup: also print ACL SETUSER lines for a producer, a worker and an "
                   "observer of --namespace, for this server's version (docs/security.md)")
    p.add_argument("--reopen-lanes", action="store_true",
                   help="setup: reopen the request lanes of --namespace that an entry at the "
                   "largest stream id closed to new requests")
    p.add_argument("--namespace", metavar="NS", default="conveyor",
                   help="setup --acl / --reopen-lanes: the fleet's namespace")
    p.set_defaults(handler=run_redis_cmd)
    return p


def run_redis_cmd(args: argparse.Namespace) -> int:
    """Carry out a parsed ``conveyor redis`` command; the process exit code."""
    try:
        if args.action == "stop":
            stopped = redis_server.stop(args.data_dir)
            print("stopped" if stopped else "not running")
            return 0
        if args.action == "status":
            return _print_status(redis_server.status(args.data_dir), as_json=args.json)
        if args.action == "setup":
            return _setup(setup_url(args), args.acl, args.reopen_lanes, args.namespace)
        return redis_server.run_foreground(
            args.data_dir, port=args.port, bind=args.bind, on_ready=_announce
        )
    except redis_server.RedisServerError as exc:
        print(f"conveyor redis: error: {exc}", file=sys.stderr)
        return 1


def setup_url(args: argparse.Namespace) -> str | None:
    """`redis setup`'s Redis: --redis (before or after the verb), else $CONVEYOR_REDIS_URL, else
    None (the embedded server)."""
    return getattr(args, "redis", None) or settings.redis_url()


def _setup(url: str | None, print_acl: bool, reopen: bool, namespace: str) -> int:
    """Load conveyor's functions (Redis >= 7) and report what this server supports."""
    import redis

    from producer.client.connection import connect
    from producer.redis.acl import ROLES, setuser_args
    from producer.redis.functions import MISSING, MODIFIED, UNSUPPORTED, install_functions

    try:
        with connect(url) as client:
            version = str(client.info("server").get("redis_version", "?"))
            before = install_functions(client)
            if reopen:
                _reopen_lanes(client, namespace)
            _report_old_lanes(client, namespace)
    except (redis.ConnectionError, redis.TimeoutError):
        raise  # `conveyor`'s main says it in one line, like every verb's
    except (redis.RedisError, ValueError) as exc:
        print(f"conveyor redis setup: error: {exc}", file=sys.stderr)
        return 1
    major = 7 if version.split(".")[0].isdigit() and int(version.split(".")[0]) >= 7 else 6
    if before == UNSUPPORTED:
        print(f"Redis {version}: no functions (Redis < 7); producers that submit with "
              "max_queue run a script instead, so their ACL must allow EVAL (docs/security.md)")
    elif before == MISSING:
        print(f"Redis {version}: conveyor's functions loaded")
    elif before == MODIFIED:
        print(f"Redis {version}: conveyor's functions replaced (the server held other code "
              "under their name: another version, or someone else's)")
    else:
        print(f"Redis {version}: conveyor's functions already loaded")
    if print_acl:
        for role in ROLES:
            line = setuser_args(role, f"conveyor-{role}", f"{role.upper()}-PASSWORD",
                                namespace, version=major)
            print("ACL SETUSER " + " ".join(line))
    return 0


def _lanes_of_known_models(client: object, keys: Keys) -> Iterator[tuple[str, str]]:
    """(model, lane) of every model a worker registered or a client asked for."""
    from producer.client.models import member_names

    models = set(member_names(client.smembers(keys.models)))
    models |= set(member_names(client.smembers(keys.requested)))
    for model in sorted(models):
        for lane in LANES:
            yield model, lane


def _reopen_lanes(client: object, namespace: str) -> None:
    from producer.client.queues import reopen_lane

    keys = Keys(namespace)
    for model, lane in _lanes_of_known_models(client, keys):
        if reopen_lane(client, keys.requests(model, lane)):
            print(f"reopened {keys.requests(model, lane)}")


def _report_old_lanes(client: object, namespace: str) -> None:
    """Name the lane keys of key layout 1 that hold requests (docs/protocol.md, Changelog)."""
    import redis

    keys = Keys(namespace)
    for model, lane in _lanes_of_known_models(client, keys):
        old = keys.old_layout_requests(model, lane)
        try:
            waiting = client.xlen(old)
        except redis.ResponseError:  # not a stream: nothing a client of ours added
            continue
        if waiting:
            print(f"{old} (key layout 1) holds {waiting} request(s) no worker reads: "
                  f"workers of {model} answer each with an error naming "
                  f"{keys.requests(model, lane)}, where its clients must now add them "
                  "(docs/protocol.md, Changelog)")


def _announce(urls: list[str]) -> None:
    print(f"conveyor redis: serving {', '.join(urls)} (Ctrl-C stops it)", flush=True)


def _print_status(report: dict, *, as_json: bool) -> int:
    if as_json:
        print(json.dumps(report))
    else:
        state = "running" if report["running"] else "not running"
        print(f"{state}: {describe(report['url'])}")
        for key in ("pid", "version", "keys", "tcp_port", "data_dir", "log"):
            if report.get(key) is not None:
                print(f"  {key}: {report[key]}")
    return 0 if report["running"] else STATUS_NOT_RUNNING
