"""The `conveyor` command: one parser, each verb's arguments defined beside its handler.

Client verbs (worker.cli.client_verbs, cli_bulk, cli_redis, top) need no torch; worker verbs
(worker.cli.worker_verbs, worker.bench.cli) import it only when they run.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence

import redis

from producer.client.connection import describe
from producer.logging import DEFAULT_LEVEL, LEVELS, configure_logging
from producer.redis.config import RedisServerError
from producer.version import conveyor_version
from producer.wire.errors import LaneBlocked
from worker.bench.cli import add_bench_parser
from worker.cli.bulk_verbs import add_bulk_parser
from worker.cli.client_verbs import add_client_parsers
from worker.cli.gateway_verb import add_gateway_parser
from worker.cli.redis_verbs import add_redis_parser, setup_url
from worker.cli.top import add_top_parser
from worker.cli.worker_verbs import add_worker_parsers

EXIT_UNREACHABLE = 1
EXIT_USAGE = 2
# What a shell reports for a process SIGPIPE ended: `conveyor ... | head` closed the pipe.
EXIT_BROKEN_PIPE = 128 + 13


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where "(default: ...)" would say nothing new (a
    help text that already names its default, a flag) or mislead (None is "none")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is False or "default" in text:
            return text
        if action.default is None and not action.required and (
                action.option_strings or action.nargs == "?"):
            return f"{text} (default: none)"
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor",
        description="An LLM inference worker fleet driven by Redis.",
    )
    parser.add_argument("--version", action="version", version=f"conveyor {conveyor_version()}",
                        help="print the installed conveyor's version and exit")
    _add_log_level(parser, default=DEFAULT_LEVEL)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_client_parsers(sub)
    add_redis_parser(sub)
    add_bulk_parser(sub)
    add_top_parser(sub)
    add_gateway_parser(sub)
    add_bench_parser(sub)
    add_worker_parsers(sub)
    for verb in sub.choices.values():  # `conveyor VERB --log-level L` as well as before VERB
        _add_log_level(verb, default=argparse.SUPPRESS)
    for each in walk_parsers(parser):  # every verb's --help shows its options' defaults
        each.formatter_class = HelpFormatter
    return parser


def walk_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every parser below it (verbs, and actions such as `bulk status`)."""
    yield parser
    for action in parser._actions:  # argparse keeps subparsers nowhere public
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):  # aliases: once each
                yield from walk_parsers(child)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--log-level", choices=LEVELS, default=default, type=str.lower,
                        help=f"log lines at this level and above (default: {DEFAULT_LEVEL}); "
                        "JSON lines on stderr unless it is a terminal")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    verb = _verb(args)
    try:
        status = args.handler(args) or 0
        sys.stdout.flush()  # a reader that went away shows here, not at exit
        return status
    except BrokenPipeError:
        # `conveyor ... | head`: the reader has what it wanted. Later writes (the interpreter
        # flushes stdout at exit) go nowhere instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except (ValueError, FileNotFoundError, FileExistsError, IsADirectoryError,
            NotADirectoryError, PermissionError) as exc:
        print(f"conveyor {verb}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except redis.exceptions.NoPermissionError as exc:
        # A Redis user whose ACL does not allow what this verb needs (docs/security.md).
        print(f"conveyor {verb}: Redis refused a command to this user: {exc} (each role's "
              f"rules: `conveyor redis setup --acl`)", file=sys.stderr)
        return EXIT_UNREACHABLE
    except LaneBlocked as exc:
        print(f"conveyor {verb}: error: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        # The retries (one warning each) are behind us: one line, no traceback.
        url = setup_url(args) if args.command == "redis" else getattr(args, "redis", None)
        where = describe(url) if url else "the embedded Redis"
        print(f"conveyor {verb}: cannot reach Redis at {where}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except RedisServerError as exc:
        print(f"conveyor {verb}: the embedded Redis: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


def _verb(args: argparse.Namespace) -> str:
    """The verb as typed, with its action: `bulk status`, `redis setup`, `submit`."""
    action = getattr(args, "bulk_command", None)
    if args.command == "redis":
        action = args.action
    return f"{args.command} {action}" if action else args.command

