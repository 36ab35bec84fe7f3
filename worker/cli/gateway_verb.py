"""`conveyor gateway`: serve the OpenAI-compatible HTTP API (producer/gateway) with uvicorn."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from worker.cli.redis_verbs import add_connection_args

DEFAULT_PORT = 8000
# GatewaySettings' defaults (producer/gateway/settings.py), written out: the gateway package
# needs the gateway extra, and the parser is built without it (tests/test_gateway.py checks
# that the two agree).
KEEPALIVE_S = 10.0
ORPHAN_TIMEOUT_S = 60.0
WATCH_TTL_S = 20
MAX_CONCURRENT = 512
REDIS_CONNECTIONS = 64
READ_CONNECTIONS = 8
MAX_CONNECTIONS = 4096
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
KEEPALIVE_TIMEOUT_S = 5.0


def add_gateway_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "gateway",
        help="serve the OpenAI-compatible HTTP API (chat and completions) in front of the fleet",
        description="An OpenAI-compatible HTTP server: POST /v1/chat/completions and "
        "/v1/completions (streaming or not), GET /v1/models (models with a live worker), "
        "/health and /metrics. Stateless: run as many as you like (docs/gateway.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    add_connection_args(p)
    keys = p.add_mutually_exclusive_group()
    keys.add_argument("--api-key", metavar="KEY", default=None,
                      help="accept only requests with 'Authorization: Bearer KEY' (visible in "
                      "the process list: prefer --api-key-file)")
    keys.add_argument("--api-key-file", metavar="PATH", default=None,
                      help="accept the keys in this file, one per line")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="answer 429 when the model's interactive lane already holds N "
                   "waiting requests (default: no bound)")
    p.add_argument("--min-priority", type=int, default=0, metavar="P",
                   help="the most urgent priority a client may ask for (lower is more urgent; "
                   "default 0: none goes ahead of requests that ask for nothing; -1000 allows "
                   "the whole range)")
    p.add_argument("--keepalive", type=float, default=KEEPALIVE_S, metavar="S",
                   help="a stream that waits sends an SSE comment every S seconds")
    p.add_argument("--orphan-timeout", type=float, default=ORPHAN_TIMEOUT_S, metavar="S",
                   help="cancel a request whose model has had no live worker for S seconds "
                   "and answer it with no_live_worker (0: wait for a worker however long)")
    p.add_argument("--watch-ttl", type=int, default=WATCH_TTL_S, metavar="S",
                   help="this gateway's requests are cancelled S seconds after it dies (its "
                   "watch key lapses)")
    p.add_argument("--no-affinity", dest="affinity", action="store_false",
                   help="send every request to its model's shared lane (default: to the "
                   "worker that holds its prompt's prefix, when one lives)")
    p.add_argument("--max-concurrent", type=int, default=MAX_CONCURRENT, metavar="N",
                   help="generation requests answered at once; more get 429 gateway_busy "
                   "with Retry-After until one ends")
    p.add_argument("--redis-connections", type=int, default=REDIS_CONNECTIONS, metavar="N",
                   help="Redis connections of this process in all (a command waits for a "
                   "free one)")
    p.add_argument("--read-connections", type=int, default=READ_CONNECTIONS, metavar="N",
                   help="of those, how many read the answers of every request at once (each "
                   "XREAD names up to 256 streams)")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help="open client connections; one past them is closed at once (the "
                   "soft open-files limit is raised to the hard one at start)")
    p.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="close a connection whose request headers take longer")
    p.add_argument("--body-timeout", type=float, default=BODY_TIMEOUT_S, metavar="S",
                   help="answer 408 to a request whose body takes longer (it holds no "
                   "--max-concurrent slot meanwhile)")
    p.add_argument("--keepalive-timeout", type=float, default=KEEPALIVE_TIMEOUT_S, metavar="S",
                   help="close a kept-alive connection idle this long between requests")
    p.set_defaults(handler=gateway_cmd)
    return p


def gateway_cmd(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from producer.gateway import GatewaySettings, create_app
        from producer.gateway.server import raise_open_files_limit, server_config
        from producer.gateway.settings import read_key_file
        from producer.long_lived import freeze_long_lived_objects
    except ImportError as exc:
        print(f"conveyor gateway: error: {exc.name} is missing: pip install "
              "'conveyor[gateway]'", file=sys.stderr)
        return 2
    if not 0 <= args.port <= 65535:
        print(f"conveyor gateway: error: --port must be in [0, 65535], got {args.port}",
              file=sys.stderr)
        return 2
    keys: tuple[str, ...] = ()
    if args.api_key:
        keys = (args.api_key,)
    elif args.api_key_file:
        keys = read_key_file(args.api_key_file)
    settings = GatewaySettings(redis_url=args.redis, namespace=args.namespace, api_keys=keys,
                               max_queue=args.max_queue, keepalive_s=args.keepalive,
                               min_priority=args.min_priority,
                               orphan_timeout_s=args.orphan_timeout or None,
                               watch_ttl_s=args.watch_ttl, max_concurrent=args.max_concurrent,
                               affinity=args.affinity,
                               redis_connections=args.redis_connections,
                               read_connections=args.read_connections,
                               max_connections=args.max_connections,
                               header_timeout_s=args.header_timeout,
                               body_timeout_s=args.body_timeout,
                               keepalive_timeout_s=args.keepalive_timeout)
    if not keys:
        print("conveyor gateway: warning: no API key (--api-key-file): anyone who reaches "
              f"{args.host}:{args.port} may use the fleet", file=sys.stderr)
    raise_open_files_limit(settings.max_connections)
    app = create_app(settings)
    # Imports and the app kept out of the collector's passes, and those rarer: each open
    # stream holds its objects for its whole answer (producer/long_lived.py).
    freeze_long_lived_objects()
    uvicorn.Server(server_config(app, args.host, args.port)).run()
    return 0
