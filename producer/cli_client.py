"""The CLI's client verbs, `conveyor submit` and `conveyor tail`; they need no torch.

Exit statuses: 0 the request finished without an error; 1 it failed (an ``error`` final),
its output has a gap, or (`tail`) it has no output stream; 2 a usage error, such as a
model nobody registered; 124 (`submit`) no final entry within ``--wait`` seconds: the
request was cancelled; 130 interrupted.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from producer.cli_redis import add_connection_args
from producer.client import Client
from producer.models import describe_choice, pick_default_model
from producer.stream_events import (
    ChunkEvent,
    FinalEvent,
    StreamEvent,
    StreamGapError,
    entry_id_key,
    validate_entry_id,
)
from producer.wire.errors import ModelNotFound
from producer.wire.keys import LANES

# Seconds `conveyor submit` waits for the final entry unless told otherwise (--wait).
DEFAULT_WAIT_S = 60.0
# Seconds `conveyor tail` waits for a stream that does not exist yet (--wait-start).
DEFAULT_WAIT_START_S = 5.0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_WAITED_OUT = 124
EXIT_INTERRUPTED = 130


def add_client_parsers(subparsers: Any) -> None:
    """Add `submit` and `tail` to the `conveyor` command's subparsers."""
    p = subparsers.add_parser("submit", help="enqueue a prompt and print the generated text")
    p.add_argument("text", help="prompt text")
    p.add_argument("--model", metavar="NAME",
                   help="model name (default: the only model with a live worker, else the "
                   "only registered model)")
    p.add_argument("--max-tokens", type=int, default=32, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 is greedy (the default), and so is anything below 1e-5")
    p.add_argument("--seed", type=int, default=None, metavar="S")
    p.add_argument("--lane", choices=LANES, default="interactive")
    p.add_argument("--stream", action="store_true", help="print tokens' text as they arrive")
    p.add_argument("--wait", type=_seconds, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="how long to wait for the request to finish (default: "
                   f"{DEFAULT_WAIT_S:g}; 'inf' waits forever); then cancel it and exit "
                   f"{EXIT_WAITED_OUT}. This is the client's patience, not a deadline the "
                   "workers see")
    p.add_argument("--allow-unregistered", action="store_true",
                   help="queue the request even if no worker ever registered the model "
                   f"(otherwise: exit {EXIT_USAGE})")
    add_connection_args(p)
    p.set_defaults(handler=run_client_cmd)

    p = subparsers.add_parser("tail", help="follow (or resume) a request's output stream")
    p.add_argument("request_id", metavar="ID", help="request id")
    p.add_argument(
        "--from",
        dest="from_id",
        metavar="ENTRY_ID",
        default=None,
        help="resume after this output entry id (default: from the beginning); at or past "
        "the end of a finished stream it prints the final's summary and exits at once, "
        "with the status the final gives",
    )
    p.add_argument("--wait-start", type=_seconds, default=DEFAULT_WAIT_START_S,
                   metavar="SECONDS",
                   help="how long to wait for a stream that does not exist yet (default: "
                   f"{DEFAULT_WAIT_START_S:g}; 0: do not wait); then exit {EXIT_FAILED}")
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


def _seconds(text: str) -> float:
    """A non-negative number of seconds ('inf' allowed), for argparse."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if math.isnan(value) or value < 0:
        raise argparse.ArgumentTypeError(f"seconds must be >= 0, got {text!r}")
    return value


def _patience(seconds: float) -> float | None:
    return None if math.isinf(seconds) else seconds


def resolve_model(client: Client, model: str | None) -> str:
    """``model`` if given, else the only model with a live worker, else the only registered
    model; ValueError when that is ambiguous or there is none.

    A registration left behind by a worker long gone does not hide the model that is served.
    """
    if model is not None:
        return model
    states = client.model_states()
    chosen = pick_default_model(states)
    if chosen is None:
        raise ValueError(describe_choice(states, client.keys.ns))
    return chosen


def _submit(client: Client, args: argparse.Namespace) -> int:
    sampling: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.seed is not None:
        sampling["seed"] = args.seed
    try:
        model = resolve_model(client, args.model)
    except ValueError as exc:
        print(f"conveyor submit: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    wait = _patience(args.wait)
    state = client.model_state(model)  # submit trusts this look: it warns only here
    if not state.known and not args.allow_unregistered:
        print(f"conveyor submit: error: {ModelNotFound(model, client.models(), client.keys.ns)}"
              "; pass --allow-unregistered to queue it anyway", file=sys.stderr)
        return EXIT_USAGE
    if not state.live:
        patience = "forever" if wait is None else f"up to {wait:g} s (--wait)"
        print(f"conveyor submit: warning: no live worker serves model {model!r}: the request "
              f"waits in its queue; waiting {patience} for a worker to answer it",
              file=sys.stderr, flush=True)
    request_id = client.submit(args.text, model=model, lane=args.lane,
                               allow_unregistered=args.allow_unregistered, **sampling)
    try:
        if args.stream:
            print(f"request {request_id}", file=sys.stderr, flush=True)
            return _print_stream(client.stream(request_id, timeout=wait), "submit")
        print(request_id, flush=True)
        completion = client.result(request_id, timeout=wait)
    except KeyboardInterrupt:
        # Nobody will read the output any more: free the worker's slot.
        client.cancel(request_id)
        print(f"\ncancelled {request_id}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TimeoutError:
        client.cancel(request_id)
        print(f"\nconveyor submit: error: request {request_id} did not finish within "
              f"{args.wait:g} s (--wait); it was cancelled", file=sys.stderr)
        return EXIT_WAITED_OUT
    except StreamGapError as exc:
        print(f"conveyor submit: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(completion.text)
    if completion.error:
        print(f"error: {completion.error}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _tail(client: Client, args: argparse.Namespace) -> int:
    rid = args.request_id
    from_id = validate_entry_id(args.from_id) if args.from_id is not None else None
    try:
        if not client.wait_for_output(rid, _patience(args.wait_start)):
            print(f"conveyor tail: error: request {rid} has no output stream: the id is "
                  "unknown, its output expired (kept 1 h after the last write), or it has "
                  f"not started yet (waited {args.wait_start:g} s; see --wait-start)",
                  file=sys.stderr)
            return EXIT_FAILED
        last = client.last_event(rid)
        if (from_id is not None and isinstance(last, FinalEvent)
                and entry_id_key(last.entry_id) <= entry_id_key(from_id)):
            # Already past the end: nothing to print but how it ended.
            print(f"{_summary(last)} (finished at or before {from_id})", file=sys.stderr)
            return _final_status(last)
        return _print_stream(client.stream(rid, from_id), "tail")
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return EXIT_INTERRUPTED


def _print_stream(events: Iterable[StreamEvent], verb: str) -> int:
    """Print chunk text as it arrives, then a summary line on stderr; the exit status.

    A gap in the stream stops it: what came before it is printed, then the error (status 1).
    A TimeoutError passes through to the caller.
    """
    final: FinalEvent | None = None
    try:
        for event in events:
            if isinstance(event, ChunkEvent):
                sys.stdout.write(event.text)
                sys.stdout.flush()
            else:
                final = event
                sys.stdout.write(event.text)
    except StreamGapError as exc:
        print()
        print(f"conveyor {verb}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print()
    if final is None:  # the stream was already finished before the resume point
        return EXIT_FAILED
    print(_summary(final), file=sys.stderr)
    return _final_status(final)


def _summary(final: FinalEvent) -> str:
    return f"[{final.finish_reason}, {final.num_tokens} tokens, last entry {final.entry_id}]"


def _final_status(final: FinalEvent) -> int:
    """0 for a request that ended without an error (stop, length, cancelled, expired), else 1."""
    if final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return EXIT_FAILED
    return 0
