"""The CLI's client verbs, `conveyor submit`, `conveyor tail` and `conveyor cancel`; they
need no torch.

Exit statuses: 0 the request finished without an error; 1 it failed (an ``error`` final),
its output has a gap, or (`tail`) it has no output stream; 2 a usage error, such as a
model nobody registered; 124 (`submit`) no final entry within ``--wait`` seconds: the
request was cancelled; 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from producer.client.client import Client
from producer.client.models import describe_choice, pick_default_model
from producer.client.stream_events import (
    ChunkEvent,
    FinalEvent,
    StreamEvent,
    StreamGapError,
    entry_id_key,
    validate_entry_id,
)
from producer.wire.completion import Completion
from producer.wire.errors import ModelNotFound, RequestLost
from producer.wire.keys import LANES
from producer.wire.params import SamplingParams
from producer.wire.validation import validate_choice_id, validate_request_id
from worker.cli.redis_verbs import add_connection_args

# Seconds `conveyor submit` waits for the final entry unless told otherwise (--wait).
DEFAULT_WAIT_S = 60.0
# Seconds `conveyor tail` waits for a stream that does not exist yet (--wait-start).
DEFAULT_WAIT_START_S = 5.0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_WAITED_OUT = 124
EXIT_INTERRUPTED = 130
# The sampling options of `conveyor submit`; each one given is passed to Client.submit, any
# other is left to SamplingParams' default, so the CLI and Client.submit cannot differ.
SAMPLING_OPTIONS = ("max_tokens", "temperature", "top_p", "seed", "stop", "n")


def sampling_default(name: str) -> Any:
    """The default of a SamplingParams field, as Client.submit applies it."""
    spec = next(f for f in dataclasses.fields(SamplingParams) if f.name == name)
    if spec.default_factory is not dataclasses.MISSING:
        return spec.default_factory()
    return spec.default


def add_client_parsers(subparsers: Any) -> None:
    """Add `submit`, `tail` and `cancel` to the `conveyor` command's subparsers."""
    _add_submit_parser(subparsers)

    p = subparsers.add_parser("tail", help="follow (or resume) a request's output stream")
    p.add_argument("request_id", metavar="ID", type=_output_id,
                   help="request id, or ID.I for choice I of a request with several")
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

    p = subparsers.add_parser(
        "cancel", help="cancel a request: workers stop it (or never start it)",
        description="Sets the request's cancel marker and announces it: a worker generating "
        "it ends it `cancelled` at its next step, and one that claims it later ends it at "
        "once. A request that already finished is left as it is.")
    p.add_argument("request_id", metavar="ID", type=_request_id, help="request id")
    add_connection_args(p)
    p.set_defaults(handler=run_client_cmd)


def _add_submit_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "submit", help="enqueue a prompt and print the generated text",
        description="The text goes to stdout, the request id and how it ended "
        "([finish_reason, N tokens]) to stderr. Sampling options not given keep "
        "SamplingParams' defaults, the same as Client.submit's (docs/protocol.md).")
    p.add_argument("text", nargs="?", metavar="TEXT",
                   help="prompt text; '-' reads it from stdin (or give --file)")
    p.add_argument("--file", type=Path, metavar="PATH",
                   help="read the prompt from this file (default: none, TEXT is the prompt)")
    p.add_argument("--chat", action="store_true",
                   help="send the text as a user's chat message, rendered by the model's chat "
                   "template (default: a raw prompt)")
    p.add_argument("--system", metavar="TEXT", default=None,
                   help="with --chat: a system message before the user's (default: none)")
    p.add_argument("--model", metavar="NAME",
                   help="model name (default: the only model with a live worker, else the "
                   "only registered model)")
    p.add_argument("--no-affinity", dest="affinity", action="store_false",
                   help="send the request to its model's shared lane (default: to the "
                   "worker that holds its prompt's prefix, when one lives)")
    max_tokens = sampling_default("max_tokens")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N",
                   help="most tokens to generate (default: "
                   f"{'until the context is full' if max_tokens is None else max_tokens})")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0 is greedy, and so is anything below 1e-5 (default: "
                   f"{sampling_default('temperature'):g})")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the smallest set of tokens whose probabilities add up to "
                   f"P (default: {sampling_default('top_p'):g}, every token)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop before this text; repeatable (default: no stop string)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed: the same tokens in any batch (default: none, random)")
    p.add_argument("--n", type=int, default=None, metavar="N",
                   help="choices to draw, choice i seeded S + i (default: 1); each is printed "
                   "after a line '--- choice I ---' (with --json: one object a line); not "
                   "with --stream")
    p.add_argument("--json-schema", type=Path, metavar="PATH", default=None,
                   help="a JSON Schema file: the answer is JSON valid against it, decoding "
                   "held to its grammar (default: free text)")
    p.add_argument("--lane", choices=LANES, default="interactive",
                   help="the request stream to queue on; workers read batch after interactive")
    output = p.add_mutually_exclusive_group()
    output.add_argument("--stream", action="store_true",
                        help="print tokens' text as they arrive")
    output.add_argument("--detach", action="store_true",
                        help="print the request id and return at once (follow it with "
                        "`conveyor tail ID`)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (request_id, text, finish_reason, usage, error) "
                   "instead of the text; with --detach, only request_id")
    p.add_argument("--wait", type=_seconds, default=DEFAULT_WAIT_S, metavar="SECONDS",
                   help="how long to wait for the request to finish ('inf' waits forever); "
                   f"then cancel it and exit {EXIT_WAITED_OUT}. This is the client's "
                   "patience, not a deadline the workers see")
    p.add_argument("--allow-unregistered", action="store_true",
                   help="queue the request even if no worker ever registered the model "
                   f"(otherwise: exit {EXIT_USAGE})")
    add_connection_args(p)
    p.set_defaults(handler=run_client_cmd)


def run_client_cmd(args: argparse.Namespace) -> int:
    """Run a client verb parsed by :func:`add_client_parsers`; returns the exit status.

    Redis connection errors pass to the caller (`conveyor`'s main says them in one line).
    """
    handler = {"submit": _submit, "tail": _tail, "cancel": _cancel}[args.command]
    with Client(args.redis, args.namespace,
                affinity=getattr(args, "affinity", True)) as client:
        return handler(client, args)


def read_prompt(text: str | None, file: Path | None) -> str:
    """The prompt from TEXT, stdin (TEXT ``-``) or ``--file``; ValueError unless exactly one."""
    if (text is None) == (file is None):
        raise ValueError("give the prompt as TEXT, '-' (stdin) or --file PATH, and only one")
    if file is not None:
        return file.read_text(encoding="utf-8")
    return sys.stdin.read() if text == "-" else text


def _output_id(text: str) -> str:
    """A request id or a choice id (``ID.I``), for argparse."""
    try:
        return validate_choice_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _request_id(text: str) -> str:
    """A valid request id, for argparse (a bad one is a usage error)."""
    try:
        return validate_request_id(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    if args.json and args.stream:
        raise ValueError("--json prints the whole answer at the end: it does not mix with "
                         "--stream")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat")
    choices = args.n or 1
    if choices > 1 and args.stream:
        raise ValueError("--n prints whole answers, one a choice: it does not mix with "
                         "--stream (follow a choice with `conveyor tail ID.I`)")
    prompt = read_prompt(args.text, args.file)
    messages = None
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt, messages = None, [*system, {"role": "user", "content": prompt}]
    sampling = {name: getattr(args, name) for name in SAMPLING_OPTIONS
                if getattr(args, name) is not None}
    if args.json_schema is not None:
        sampling["response_format"] = schema_format(args.json_schema)
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
    request_id = client.submit(prompt, model=model, messages=messages, lane=args.lane,
                               allow_unregistered=args.allow_unregistered, **sampling)
    if args.detach:
        print(json.dumps({"request_id": request_id}) if args.json else request_id)
        return 0
    print(f"request {request_id}", file=sys.stderr, flush=True)
    try:
        # --wait is the patience asked for: no other limit on waiting for a worker.
        if args.stream:
            return _print_stream(client.stream(request_id, timeout=wait, orphan_timeout=None),
                                 "submit")
        completions = client.choices(request_id, choices, timeout=wait, orphan_timeout=None)
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
    except (StreamGapError, RequestLost) as exc:
        print(f"conveyor submit: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    failed = False
    for i, completion in enumerate(completions):
        if args.json:
            print(json.dumps(completion_json(completion), ensure_ascii=False))
            continue
        if choices > 1:
            print(f"--- choice {i} ---")
        print(completion.text, flush=True)
        print(f"[{completion.finish_reason}, {completion.usage.completion_tokens} tokens]",
              file=sys.stderr, flush=True)
    for completion in completions:
        if completion.error:
            print(f"error: {completion.error}", file=sys.stderr)
            failed = True
    return EXIT_FAILED if failed else 0


def schema_format(path: Path) -> dict[str, Any]:
    """The response_format of `--json-schema PATH`: the file's schema, named after it."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"--json-schema {path}: not a JSON file we can read ({exc})") from None
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in path.stem)[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                   "strict": True}}


def completion_json(completion: Completion) -> dict[str, Any]:
    """What `conveyor submit --json` prints: request_id, text, finish_reason, usage, error."""
    usage = {**dataclasses.asdict(completion.usage),
             "total_tokens": completion.usage.total_tokens}
    return {"request_id": completion.request_id, "text": completion.text,
            "finish_reason": str(completion.finish_reason), "usage": usage,
            "error": completion.error}


def _cancel(client: Client, args: argparse.Namespace) -> int:
    rid = args.request_id
    last = client.last_event(rid)
    if isinstance(last, FinalEvent):
        print(f"request {rid} already finished ({last.finish_reason}, {last.num_tokens} "
              "tokens): nothing to cancel")
        return 0
    client.cancel(rid)
    if last is None:
        print(f"cancelled request {rid}: it has no output yet (queued, or an unknown id); "
              "the worker that claims it ends it `cancelled`")
    else:
        print(f"cancelled request {rid}: its worker ends it `cancelled` at its next step")
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
