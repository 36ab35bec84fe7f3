"""The CLI's client verbs, `conveyor submit` and `conveyor tail`; they need no torch."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from producer.cli_redis import add_connection_args
from producer.client import Client
from producer.stream_events import ChunkEvent, FinalEvent, StreamEvent
from producer.wire.keys import LANES


def add_client_parsers(subparsers: Any) -> None:
    """Add `submit` and `tail` to the `conveyor` command's subparsers."""
    p = subparsers.add_parser("submit", help="enqueue a prompt and print the generated text")
    p.add_argument("text", help="prompt text")
    p.add_argument("--model", metavar="NAME",
                   help="model name (default: the only registered model)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 is greedy (the default)")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--lane", choices=LANES, default="interactive")
    p.add_argument("--stream", action="store_true", help="print tokens' text as they arrive")
    add_connection_args(p)
    p.set_defaults(handler=run_client_cmd)

    p = subparsers.add_parser("tail", help="follow (or resume) a request's output stream")
    p.add_argument("request_id", metavar="ID", help="request id")
    p.add_argument(
        "--from",
        dest="from_id",
        metavar="ENTRY_ID",
        default=None,
        help="resume after this output entry id (default: from the beginning)",
    )
    add_connection_args(p)
    p.set_defaults(handler=run_client_cmd)


def run_client_cmd(args: argparse.Namespace) -> int:
    """Run a client verb parsed by :func:`add_client_parsers`; returns the exit status."""
    handler = {"submit": _submit, "tail": _tail}[args.command]
    try:
        with Client(args.redis, args.namespace) as client:
            return handler(client, args)
    except RedisConnectionError as exc:
        print(f"conveyor {args.command}: cannot reach Redis: {exc}", file=sys.stderr)
        return 1


def resolve_model(client: Client, model: str | None) -> str:
    """``model`` if given, else the only registered model; ValueError when that is ambiguous."""
    if model is not None:
        return model
    names = client.models()
    if len(names) == 1:
        return names[0]
    if not names:
        raise ValueError(
            f"no model is registered in namespace {client.keys.ns!r}: "
            "start a worker or pass --model"
        )
    raise ValueError(f"several models are registered ({', '.join(names)}): pass --model")


def _submit(client: Client, args: argparse.Namespace) -> int:
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    model = resolve_model(client, args.model)
    request_id = client.submit(args.text, model=model, lane=args.lane, **sampling)
    try:
        if args.stream:
            print(f"request {request_id}", file=sys.stderr, flush=True)
            return _print_stream(client.stream(request_id))
        print(request_id, flush=True)
        completion = client.result(request_id)
    except KeyboardInterrupt:
        # Nobody will read the output any more: free the worker's slot.
        client.cancel(request_id)
        print(f"\ncancelled {request_id}", file=sys.stderr)
        return 130
    print(completion.text)
    if completion.error:
        print(f"error: {completion.error}", file=sys.stderr)
        return 1
    return 0


def _tail(client: Client, args: argparse.Namespace) -> int:
    try:
        return _print_stream(client.stream(args.request_id, args.from_id))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _print_stream(events: Iterable[StreamEvent]) -> int:
    """Print chunk text as it arrives, then a summary line on stderr; 1 if it failed."""
    final: FinalEvent | None = None
    for event in events:
        if isinstance(event, ChunkEvent):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        else:
            final = event
            sys.stdout.write(event.text)
    print()
    if final is None:  # stream() ends only after the final entry; never expected
        return 1
    summary = f"[{final.finish_reason}, {final.num_tokens} tokens, last entry {final.entry_id}]"
    print(summary, file=sys.stderr)
    if final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    return 0
