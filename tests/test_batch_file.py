"""Batch files in the OpenAI batch format, run over a real Redis by a worker of the tiny model."""

from __future__ import annotations

import fcntl
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fleet_fixtures import KEEP_SERVED_REQUESTS, MODEL
from waiting import eventually

from producer.bulk import run_batch_file
from producer.bulk.batch_file import parse_line, plan, read_done
from producer.bulk.requests import RetryPolicy
from producer.client.client import Client
from producer.wire.completion import FinishReason
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, decode_output
from worker.cli.bulk_verbs import run_bulk_cmd
from worker.cli.command import build_parser

KEYS = Keys()
ROOT = Path(__file__).resolve().parents[1]
FAST = {"dtype": "float32", "num_kv_blocks": 1024, "max_num_seqs": 64}
WORDS = "river stone bridge lantern harbour orchard meadow signal copper window".split()


@pytest.fixture
def client(redis_url):
    with Client(redis_url) as c:
        yield c


def request_line(custom_id: str, prompt, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                "temperature": 0, **body}})


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def submitted(client: Client) -> int:
    return client.redis.xlen(KEYS.requests(MODEL, "batch"))


def test_a_200_line_batch_round_trips_and_a_rerun_fills_only_the_missing_half(
        client, start_worker, tmp_path):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    rng = random.Random(0)
    lines = []
    for i in range(200):
        prompt = (" ".join(rng.choices(WORDS, k=rng.randint(3, 30))) if i % 4
                  else [rng.randrange(2, 1000) for _ in range(rng.randint(3, 30))])
        lines.append(request_line(f"req-{i}", prompt, seed=i))
    inp = write_lines(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"

    summary = run_batch_file(client, inp, out)

    assert (summary.total, summary.succeeded, summary.failed, summary.skipped) == (200, 200, 0, 0)
    results = read_lines(out)
    assert sorted(r["custom_id"] for r in results) == sorted(f"req-{i}" for i in range(200))
    for r in results:
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["model"] == MODEL and body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        assert 0 < body["usage"]["prompt_tokens"] and body["usage"]["completion_tokens"] <= 4
        assert r["id"] == f"batch_req_{body['id']}"
    assert submitted(client) == 200

    # Lose every other result line, as if the first run had crashed half way.
    kept = [line for i, line in enumerate(out.read_text().splitlines(keepends=True)) if i % 2]
    out.write_text("".join(kept))
    again = run_batch_file(client, inp, out)

    assert (again.total, again.skipped, again.succeeded, again.failed) == (200, 100, 100, 0)
    assert submitted(client) == 300  # only the missing half went out again
    ids = [r["custom_id"] for r in read_lines(out)]
    assert len(ids) == 200 and set(ids) == {f"req-{i}" for i in range(200)}


def test_bad_lines_get_error_lines_and_the_good_ones_still_run(client, start_worker, tmp_path):
    start_worker(config=KEEP_SERVED_REQUESTS, **FAST)
    inp = write_lines(tmp_path / "in.jsonl", [
        request_line("ok-1", "The river"),
        "{not json",
        json.dumps(["a", "list"]),
        json.dumps({"body": {"prompt": "no custom id"}}),
        json.dumps({"custom_id": "no-body"}),
        request_line("no-prompt", ""),
        request_line("bad-max", "x", max_tokens=-1),
        request_line("unsupported", "x", best_of=3),
        json.dumps({"custom_id": "chat", "url": "/v1/chat/completions", "body": {}}),
        request_line("elsewhere", "x", model="not-served"),
        request_line("too-long", [5] * 3000),  # refused by the worker: over 2,048 tokens
        request_line("ok-1", "duplicate id"),
        "",
        request_line("ok-2", [7, 8, 9], n=1, user="me"),
    ])
    out = tmp_path / "out.jsonl"

    summary = run_batch_file(client, inp, out)

    assert (summary.total, summary.succeeded, summary.failed) == (13, 2, 11)
    by_id: dict = {}
    for r in read_lines(out):
        by_id.setdefault(r["custom_id"], []).append(r)
    assert all(r["response"]["status_code"] == 200 for r in by_id["ok-2"])
    [ok1, dup] = sorted(by_id["ok-1"], key=lambda r: r["error"] is not None)
    assert ok1["response"]["status_code"] == 200
    assert dup["error"]["code"] == "duplicate_custom_id" and dup["line"] == 12
    codes = {cid: rs[0]["error"]["code"] for cid, rs in by_id.items() if cid and cid != "ok-1"
             and rs[0]["error"]}
    assert codes == {"no-body": "invalid_request", "no-prompt": "invalid_request",
                     "bad-max": "invalid_request", "unsupported": "invalid_request",
                     "chat": "invalid_request", "elsewhere": "model_not_found",
                     "too-long": "invalid_request"}
    assert "max length" in by_id["too-long"][0]["error"]["message"]
    assert "best_of" in by_id["unsupported"][0]["error"]["message"]
    anonymous = sorted(r["line"] for r in by_id[None])
    assert anonymous == [2, 3, 4]
    assert all(r["response"] is None for r in by_id[None])

    # Every line is answered now: a rerun submits nothing and writes nothing.
    before, size = submitted(client), out.stat().st_size
    again = run_batch_file(client, inp, out)
    assert (again.skipped, again.done) == (13, 0)
    assert submitted(client) == before and out.stat().st_size == size


def test_a_request_that_never_finishes_is_retried_then_reported(client, tmp_path):
    # A registered model with no live worker: requests are never answered.
    client.redis.hset(KEYS.model("ghost"), mapping={"name": "ghost", "max_model_len": 64})
    client.redis.sadd(KEYS.models, "ghost")
    inp = write_lines(tmp_path / "in.jsonl", [request_line("lost", "x", model="ghost")])
    out = tmp_path / "out.jsonl"

    policy = RetryPolicy(request_timeout=0.2, max_attempts=3, backoff_base=0.05)
    summary = run_batch_file(client, inp, out, policy=policy)

    assert summary.failed == 1
    [line] = read_lines(out)
    assert line["error"]["code"] == "request_failed"
    assert "gave up after 3 tries" in line["error"]["message"]
    assert client.redis.xlen(KEYS.requests("ghost", "batch")) == 3
    cancelled = [k for k in client.redis.scan_iter(match=f"{KEYS.ns}:cancelled:*")]
    assert len(cancelled) == 3  # each lost try was cancelled before the next


def test_a_line_cut_short_by_a_crash_is_dropped_before_appending(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a", "error": null}\n{"custom_id": "b", "err')

    assert read_done(out) == ({"a"}, set())
    assert out.read_text() == '{"custom_id": "a", "error": null}\n'


def test_a_line_without_a_model_uses_the_default_and_model_overrides_every_line():
    line = json.dumps({"custom_id": "c", "body": {"prompt": "hi"}})
    assert parse_line(line, 1, default_model="small").model == "small"
    assert parse_line(line, 1).code == "invalid_request"
    with_model = request_line("c", "hi")
    assert parse_line(with_model, 1, model="other").model == "other"
    assert parse_line(with_model, 1).sampling == {"max_tokens": 4, "temperature": 0}


def test_bulk_submit_shows_progress_and_reports_failures_in_its_status(
        redis_url, start_worker, tmp_path, capsys):
    start_worker(**FAST)
    inp = write_lines(tmp_path / "in.jsonl",
                      [request_line(f"q{i}", f"Question {i}") for i in range(10)] + ["oops"])
    out = tmp_path / "out.jsonl"
    argv = ["bulk", "submit", str(inp), "--output", str(out), "--redis", redis_url]

    assert run_bulk_cmd(build_parser().parse_args(argv)) == 1  # the bad line failed
    err = capsys.readouterr().err
    assert "11/11 done, 1 errors" in err and "10 succeeded, 1 failed, 0 skipped" in err
    assert run_bulk_cmd(build_parser().parse_args(argv)) == 0
    assert "0 succeeded, 0 failed, 11 skipped" in capsys.readouterr().err


def test_penalties_and_logit_bias_lines_are_accepted_and_bad_ones_are_error_lines():
    body = {"model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.5,
            "logit_bias": {"50": -100}}
    good = parse_line(json.dumps({"custom_id": "a", "body": body}), 1)
    assert good.sampling["logit_bias"] == {"50": -100} and good.sampling["presence_penalty"] == 0.5
    bad = parse_line(json.dumps({"custom_id": "b", "body": {**body, "presence_penalty": 3}}), 2)
    assert bad.code == "invalid_request" and "presence_penalty" in bad.message


def test_lines_the_gateway_would_refuse_are_error_lines_not_a_crash():
    bad = {
        "huge-int": '{"custom_id": "a", "body": {"prompt": "x", "max_tokens": '
                    + "9" * 5000 + "}}",
        "huge-bias": json.dumps({"custom_id": "b", "body": {"prompt": "x",
                                                           "logit_bias": {"1": 10**400}}}),
        "logprobs": json.dumps({"custom_id": "c", "body": {"prompt": "x", "logprobs": 2}}),
        "tools": json.dumps({"custom_id": "d", "url": "/v1/chat/completions", "body": {
            "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}}),
    }
    for name, line in bad.items():
        parsed = parse_line(line, 1, default_model=MODEL)
        assert parsed.code in ("invalid_json", "invalid_request"), (name, parsed)
    assert "logprobs" in parse_line(bad["logprobs"], 1, default_model=MODEL).message
    assert "tools" in parse_line(bad["tools"], 1, default_model=MODEL).message


def test_lines_with_a_json_schema_answer_json_valid_against_it(client, start_worker,
                                                               tmp_path):
    import jsonschema

    start_worker(**FAST)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    form = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    lines = [request_line(f"s-{i}", f"Item {i}:", max_tokens=64, temperature=1.0, seed=i,
                          response_format=form) for i in range(8)]
    summary = run_batch_file(client, write_lines(tmp_path / "in.jsonl", lines),
                             tmp_path / "out.jsonl")
    assert summary.succeeded == 8
    for r in read_lines(tmp_path / "out.jsonl"):
        choice = r["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_an_output_in_use_or_the_input_itself_is_refused_and_non_utf8_lines_are_errors(
        client, tmp_path):
    """Two runs on one output would each answer every line: the second is refused while
    the first holds it, as is an output that is the input. A line that is not UTF-8 is an
    error line, never run with its bytes replaced (two such ids would seem one)."""
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(json.dumps({"custom_id": cid, "body": {
        "model": MODEL, "prompt": "caf\xe9"}}, ensure_ascii=False).encode("latin-1") + b"\n"
        for cid in ("a\xe9", "a\xe8")))
    items, bad, total, _ = plan(inp, tmp_path / "none.jsonl", None, None, {MODEL})
    assert (items, total) == ([], 2)
    assert [(b.line, b.code) for b in bad] == [(1, "invalid_json"), (2, "invalid_json")]
    assert "not UTF-8: byte 0xe9" in bad[0].message
    with pytest.raises(ValueError, match="is the input"):
        run_batch_file(client, inp, inp)
    out = tmp_path / "out.jsonl"
    with out.open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another run's hold
        with pytest.raises(ValueError, match="another run is writing"):
            run_batch_file(client, inp, out)
    assert out.read_text() == ""  # (nothing written by the refused run)


def test_sigterm_stops_bulk_submit_and_cancels_its_requests_in_flight(
        redis_url, start_worker, tmp_path):
    """SIGTERM (systemd's, Kubernetes', timeout(1)'s) stops a batch run as Ctrl-C does: its
    requests in flight are cancelled, not left to run for nobody."""
    start_worker(**FAST)
    inp = write_lines(tmp_path / "in.jsonl", [
        request_line(f"long-{i}", f"Story {i}", max_tokens=1900, ignore_eos=True)
        for i in range(3)])
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "bulk", "submit", str(inp), "--output",
         str(tmp_path / "out.jsonl"), "--quiet", "--redis", redis_url],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with Client(redis_url) as c:
        try:
            def streaming() -> list[str] | None:
                ids = [GenerationRequest.decode(f[FIELD]).request_id
                       for _, f in c.redis.xrange(KEYS.requests(MODEL, "batch"))]
                return ids if len(ids) == 3 and all(
                    c.redis.xlen(KEYS.output(i)) for i in ids) else None

            ids = eventually(streaming, "the run's three requests streaming")
            # (precondition: none of them is done: 1,900 tokens each)
            assert not any(isinstance(decode_output(
                c.redis.xrevrange(KEYS.output(i), count=1)[0][1][FIELD]), FinalEntry)
                for i in ids)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 130
        finally:
            proc.kill()
        assert "the requests in flight were cancelled" in proc.stderr.read()
        assert [c.result(i, timeout=60).finish_reason for i in ids] == [
            FinishReason.CANCELLED] * 3
