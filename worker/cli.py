"""The `conveyor` command: one parser, each verb's arguments defined beside its handler.

Client verbs (producer.cli_client, cli_bulk, cli_redis, top) need no torch; worker verbs
(worker.commands, worker.bench.cli) import it only when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from producer.cli_bulk import add_bulk_parser
from producer.cli_client import add_client_parsers
from producer.cli_redis import add_redis_parser
from producer.logging import DEFAULT_LEVEL, LEVELS, configure_logging
from producer.top import add_top_parser
from worker.bench.cli import add_bench_parser
from worker.commands import add_worker_parsers


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
    add_worker_parsers(sub)
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
    try:
        return args.handler(args) or 0
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"conveyor {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
