"""The `conveyor` command. Client verbs need no torch; worker verbs import it when run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from producer.cli_bench import add_bench_parser
from producer.cli_bulk import add_bulk_parser, run_bulk_cmd
from producer.cli_client import CLIENT_COMMANDS, add_client_parsers, run_client_cmd
from producer.cli_redis import add_redis_parser, add_redis_url_option, run_redis_cmd
from producer.logging import DEFAULT_LEVEL, LEVELS, configure_logging
from producer.top import add_top_parser, run_top_cmd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="An LLM inference worker fleet driven by Redis.",
    )
    _add_log_level(parser, default=DEFAULT_LEVEL)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_client_parsers(sub)
    add_redis_parser(sub)
    add_bulk_parser(sub)
    add_top_parser(sub)
    add_bench_parser(sub)

    p = sub.add_parser("make-model", help="write a small deterministic checkpoint (no model hub)")
    p.add_argument("dir", nargs="?",
                   help="output folder (default: the data folder's models/PRESET)")
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--arch", choices=["llama", "qwen2", "mistral"], default="llama")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing folder")
    p.add_argument("--exist-ok", action="store_true",
                   help="do nothing when the folder already holds a model (config.json)")

    p = sub.add_parser("generate", help="run prompts through the offline engine (no Redis)")
    p.add_argument("prompts", nargs="+", help="prompt texts")
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="auto")

    p = sub.add_parser("worker", help="serve a model from Redis until SIGTERM (then drain)")
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--served-model-name", help="name producers address (default: folder name)")
    add_redis_url_option(p)
    p.add_argument("--namespace", default="conveyor")
    p.add_argument("--name", dest="worker_id", help="worker id (default: HOST-PID)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget a step")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="device KV pool in blocks")
    p.add_argument("--no-chunked-prefill", dest="chunked_prefill", action="store_false",
                   help="prefill each prompt in one step (needs --max-num-batched-tokens >= the "
                   "model's max length)")
    p.add_argument("--max-prefill-chunk", type=int, default=None, metavar="N",
                   help="cap on one request's prefill chunk in a step (default: the budget)")
    p.add_argument("--heartbeat-interval", type=float, default=2.0, metavar="S",
                   help="seconds between heartbeats (status and load in Redis)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this process")
    p.add_argument("--lease-ms", type=int, default=30_000,
                   help="in-flight entries idle this long are claimed by other workers")
    p.add_argument("--max-deliveries", type=int, default=5,
                   help="a request delivered more often goes to the dead-letter stream")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics on http://HOST:N/metrics (0: any free port; "
                   "default: not served)")
    p.add_argument("--metrics-host", default="0.0.0.0", metavar="ADDR",
                   help="address the metrics server binds (default: all interfaces)")

    p = sub.add_parser(
        "demo",
        help="start Redis and a worker, stream short questions and one long document live",
        description="Makes the small model if missing, starts the embedded Redis (unless --redis "
        "is given) and a worker process, submits short questions and one long document, shows "
        "them streaming, and ends with a summary (tokens/s, TTFT p50/p99).",
    )
    p.add_argument("--model", help="checkpoint folder (default: the small preset, made if missing)")
    p.add_argument("--requests", type=int, default=24, help="number of short questions")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the worker")
    add_redis_url_option(p)

    for verb in sub.choices.values():  # `conveyor VERB --log-level L` as well as before VERB
        _add_log_level(verb, default=argparse.SUPPRESS)
    return parser


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", choices=LEVELS, default=default, type=str.lower,
                        help=f"log lines at this level and above (default: {DEFAULT_LEVEL}); "
                        "JSON lines on stderr unless it is a terminal")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command == "redis":
        return run_redis_cmd(args)
    if args.command == "top":
        return run_top_cmd(args)
    if args.command in CLIENT_COMMANDS:
        handler = run_client_cmd
    elif args.command == "bulk":
        handler = run_bulk_cmd
    else:
        handler = _worker_handler(args.command)
    try:
        return handler(args) or 0
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"conveyor {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _worker_handler(command: str):
    # Worker verbs live in worker.commands, imported only when one runs (it imports torch).
    from worker import commands

    return {
        "make-model": commands.make_model_cmd,
        "generate": commands.generate_cmd,
        "demo": commands.demo_cmd,
        "worker": commands.worker_cmd,
        "bench": commands.bench_cmd,
    }[command]


if __name__ == "__main__":
    sys.exit(main())
