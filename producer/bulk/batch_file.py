"""Batch files in the OpenAI batch format: one request per JSONL line in, one result line per
request out (same ``custom_id``), resumable by running it again.

Input line: ``{"custom_id": "q1", "method": "POST", "url": "/v1/completions",
"body": {"model": "small", "prompt": "...", "max_tokens": 16, "temperature": 0}}``, or with
``"url": "/v1/chat/completions"`` and ``"messages": [{"role": "user", "content": "..."}]``
in the body (``method``, ``url`` and ``body.model`` optional). Bodies are read as the
gateway reads them (producer.wire.openai_api): the same fields, defaults and refusals. Output
lines are written as requests finish, so their order is not the input's; a line that cannot
be run gets an error line instead.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producer.bulk import defaults
from producer.bulk.requests import Outcome, RequestRunner, RetryPolicy, Work
from producer.client.client import Client
from producer.wire.completion import Completion
from producer.wire.errors import ModelNotFound
from producer.wire.openai_api import COMPLETIONS_URL, choice_body, parse_body


@dataclass
class BatchItem:
    """A valid input line."""

    line: int
    custom_id: str
    model: str
    prompt: str | list[int] | None
    sampling: dict[str, Any]
    messages: list[dict[str, str]] | None = None

    @property
    def chat(self) -> bool:
        return self.messages is not None


@dataclass
class BadLine:
    """An input line that cannot be run, and why."""

    line: int
    custom_id: str | None
    code: str
    message: str


@dataclass
class BatchSummary:
    """Counts of one run over a batch file."""

    total: int  # request lines in the input (blank lines aside)
    skipped: int = 0  # already answered in the output by an earlier run
    succeeded: int = 0
    failed: int = 0  # error lines written by this run
    elapsed_s: float = 0.0

    @property
    def done(self) -> int:
        return self.succeeded + self.failed

    @property
    def todo(self) -> int:
        return self.total - self.skipped


def parse_line(text: str, line: int, model: str | None = None,
               default_model: str | None = None) -> BatchItem | BadLine:
    """One input line; ``model`` (when given) replaces the body's model, ``default_model``
    serves bodies without one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, a 5,000-digit int, deep nesting
        return BadLine(line, None, "invalid_json", f"line {line} is not JSON we read: "
                       f"{str(exc)[:200] or type(exc).__name__}")
    if not isinstance(obj, dict):
        return BadLine(line, None, "invalid_request", f"line {line} is not a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(line, None, "invalid_request",
                       f"line {line} has no custom_id (a non-empty string)")
    try:
        if obj.get("method", "POST") != "POST":
            raise ValueError(f"method must be POST, got {obj.get('method')!r}")
        body = obj.get("body")
        if isinstance(body, dict) and model:
            body = {**body, "model": model}
        req = parse_body(obj.get("url", COMPLETIONS_URL), body, default_model)
        if req.stream:
            raise ValueError("stream is not supported in a batch file")
        if req.logprobs:
            raise ValueError("logprobs are not supported in a batch file (the gateway "
                             "returns them)")
        if req.chat_template_kwargs is not None:
            raise ValueError("chat_template_kwargs is not supported in a batch file yet (the "
                             "gateway takes it)")
        if req.tools:
            raise ValueError("tools are not supported in a batch file yet (the gateway "
                             "serves them: it reads the model's tool-call format from its "
                             "chat template)")
        if req.n != 1:
            raise ValueError("n > 1 is not supported in a batch file yet (the gateway "
                             "serves it): one line a choice, with its own seed")
        if req.echo:
            raise ValueError("echo is not supported in a batch file yet (the gateway's "
                             "/v1/completions serves it)")
        if req.priority:
            raise ValueError("priority is the whole batch's in a batch file (conveyor batch "
                             "--priority)")
    except (ValueError, OverflowError) as exc:
        return BadLine(line, custom_id, "invalid_request", str(exc))
    return BatchItem(line, custom_id, req.model, req.prompt, req.sampling, req.messages)


def result_line(item: BatchItem, completion: Completion, created: int) -> dict[str, Any]:
    """The output line of a served request, shaped like OpenAI's batch output."""
    usage = completion.usage
    return {
        "id": f"batch_req_{completion.request_id}",
        "custom_id": item.custom_id,
        "response": {
            "status_code": 200,
            "request_id": completion.request_id,
            "body": {
                "id": completion.request_id,
                "object": "chat.completion" if item.chat else "text_completion",
                "created": created,
                "model": item.model,
                "choices": [choice_body(item.chat, completion.text,
                                        str(completion.finish_reason))],
                "usage": {"prompt_tokens": usage.prompt_tokens,
                          "completion_tokens": usage.completion_tokens,
                          "total_tokens": usage.total_tokens},
            },
        },
        "error": None,
    }


def error_line(custom_id: str | None, code: str, message: str, *, line: int | None = None,
               request_id: str | None = None) -> dict[str, Any]:
    """The output line of a request that failed or could not be read. ``line`` (the input
    line number) marks lines without a usable custom_id, so a rerun skips them too."""
    out: dict[str, Any] = {"id": f"batch_req_{request_id}" if request_id else None,
                           "custom_id": custom_id, "response": None,
                           "error": {"code": code, "message": message}}
    if line is not None:
        out["line"] = line
    return out


def read_done(path: Path) -> tuple[set[str], set[int]]:
    """custom_ids and input line numbers an existing output file already answers.

    A last line cut short by a crash is removed from the file, so appending starts clean.
    """
    if not path.exists():
        return set(), set()
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with path.open("r+b") as f:
            f.truncate(cut)
    ids: set[str] = set()
    lines: set[int] = set()
    for raw in data[:cut].splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("line"), int):
            lines.add(obj["line"])
        elif isinstance(obj.get("custom_id"), str):
            ids.add(obj["custom_id"])
    return ids, lines


def plan(input_path: Path, output_path: Path, model: str | None, default_model: str | None,
         served: set[str], namespace: str = "conveyor",
         ) -> tuple[list[BatchItem], list[BadLine], int, int]:
    """What a run has to do: items to submit, bad lines to answer, total lines, skipped.

    ``served``: the models a line may name (registered, or served by a live worker); a line
    naming another gets a ``model_not_found`` error line."""
    done_ids, done_lines = read_done(output_path)
    items: list[BatchItem] = []
    bad: list[BadLine] = []
    seen: set[str] = set()
    total = skipped = 0
    with input_path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            total += 1
            try:  # (JSONL is UTF-8: a line in another encoding is refused, never altered)
                parsed = parse_line(raw.decode("utf-8"), n, model, default_model)
            except UnicodeDecodeError as exc:
                parsed = BadLine(n, None, "invalid_json", f"line {n} is not UTF-8: byte "
                                 f"0x{raw[exc.start]:02x} at offset {exc.start}")
            cid = parsed.custom_id
            if n in done_lines or (cid is not None and cid in done_ids):
                skipped += 1
            elif cid is not None and cid in seen:
                bad.append(BadLine(n, cid, "duplicate_custom_id",
                                   f"custom_id {cid!r} appears on an earlier line"))
            elif isinstance(parsed, BatchItem) and parsed.model not in served:
                bad.append(BadLine(n, cid, "model_not_found",
                                   str(ModelNotFound(parsed.model, sorted(served), namespace))))
            elif isinstance(parsed, BatchItem):
                items.append(parsed)
            else:
                bad.append(parsed)
            if cid is not None:
                seen.add(cid)
    return items, bad, total, skipped


def run_batch_file(
    client: Client,
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    model: str | None = None,
    default_model: str | None = None,
    policy: RetryPolicy | None = None,
    concurrency: int = defaults.CONCURRENCY,
    priority: int = 0,
    on_progress: Callable[[BatchSummary], None] | None = None,
) -> BatchSummary:
    """Run every line of ``input_path`` not yet answered in ``output_path`` on the ``batch``
    lane and append one line per request to ``output_path`` as each finishes.

    ``model`` replaces every body's model; ``default_model`` serves bodies without one.
    A line whose model nobody registered gets a ``model_not_found`` error line; one whose
    model is registered but has no live worker is queued like any other (it waits for a
    worker, retried and then reported as its request timeout says). Invalid lines,
    requests the fleet refuses and requests out of tries get error lines; lines already in
    the output are skipped, so after a crash running it again finishes the rest (delete an
    error line to retry it).
    """
    started = time.monotonic()
    input_path, output_path = Path(input_path), Path(output_path)
    if output_path.exists() and input_path.exists() and os.path.samefile(input_path,
                                                                          output_path):
        raise ValueError(f"the output {output_path} is the input: name another file")
    with output_path.open("a", encoding="utf-8") as out:
        _lock(out, output_path)  # (held to the end: what is done is read under it)
        served = {s.name for s in client.model_states() if s.known}
        items, bad, total, skipped = plan(input_path, output_path, model, default_model,
                                          served, client.keys.ns)
        summary = BatchSummary(total=total, skipped=skipped)
        by_line = {item.line: item for item in items}
        runner = RequestRunner(client, lane="batch", priority=priority, policy=policy,
                               concurrency=concurrency)

        def emit(line: dict[str, Any], ok: bool) -> None:
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()  # a crash loses at most the line being written
            summary.succeeded += ok
            summary.failed += not ok
            summary.elapsed_s = time.monotonic() - started
            if on_progress is not None:
                on_progress(summary)

        for b in bad:
            line_no = b.line if b.custom_id is None or b.code == "duplicate_custom_id" else None
            emit(error_line(b.custom_id, b.code, b.message, line=line_no), False)
        works = [Work(item.line, item.prompt, item.model, item.sampling, item.messages)
                 for item in items]
        for outcome in runner.run(works):
            item = by_line[outcome.key]
            emit(_outcome_line(item, outcome), outcome.ok)
    summary.elapsed_s = time.monotonic() - started
    return summary


def _lock(out: Any, path: Path) -> None:
    """Hold the output file for this run alone: two runs on one output would each answer
    every line (rerunning is how a run resumes, so two may start at once)."""
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"another run is writing {path}: wait for it to end (or name "
                         f"another output)") from None
    except OSError as exc:  # (a file system without locks: NFS without lockd)
        raise ValueError(f"cannot lock {path} for this run alone ({exc.strerror}): name an "
                         f"output on a local file system") from None


def _outcome_line(item: BatchItem, outcome: Outcome) -> dict[str, Any]:
    if outcome.ok:
        return result_line(item, outcome.completion, int(time.time()))
    code = outcome.code or (
        "invalid_request" if outcome.failure == "invalid" else "request_failed")
    rid = outcome.request_ids[-1] if outcome.request_ids else None
    return error_line(item.custom_id, code, outcome.error or "failed", request_id=rid)
