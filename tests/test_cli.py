"""The `conveyor` command as a user meets it: cancel, submit's inputs and outputs, --version,
help on every option, an unreachable Redis, make-model --force, and a reader that stops early.

Verbs run in this process through ``worker.cli.main`` against the session's real Redis, or as
subprocesses where what matters is the process's own stderr and exit status.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import threading
from importlib import metadata

import pytest
import redis

from producer.bulk.queue import bulk_queue
from producer.client.client import Client
from producer.defaults import RETRY_ATTEMPTS
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD, FinalEntry, GenerationRequest, OutputChunk
from worker.cli.command import HelpFormatter, build_parser, main

KEYS = Keys()
MODEL = "m"


def requests_on(r: redis.Redis, lane: str = "interactive") -> list[GenerationRequest]:
    return [GenerationRequest.decode(f[FIELD]) for _, f in r.xrange(KEYS.requests(MODEL, lane))]


def answer_next_request(redis_url: str) -> threading.Thread:
    """A stand-in worker: answers the next request on MODEL's stream with fixed tokens."""
    def run() -> None:
        conn = redis.Redis.from_url(redis_url)
        reply = conn.xread({KEYS.requests(MODEL, "interactive"): "0-0"}, block=10_000)
        req = GenerationRequest.decode(reply[0][1][0][1][FIELD])
        for entry in (OutputChunk(0, [1, 2], "Hi "),
                      FinalEntry("stop", 2, {"prompt_tokens": 4, "completion_tokens": 2})):
            conn.xadd(KEYS.output(req.request_id), {FIELD: entry.encode()}, id=entry.entry_id)
        conn.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def submit_argv(redis_url: str, *argv: str) -> list[str]:
    return ["submit", *argv, "--model", MODEL, "--allow-unregistered", "--redis", redis_url]


# --- cancel ----------------------------------------------------------------------------------


def test_cancel_sets_the_marker_and_says_what_it_did(redis_url, redis_client, capsys):
    assert main(["cancel", "req-9", "--redis", redis_url]) == 0

    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("cancelled request req-9")
    assert redis_client.exists(KEYS.cancelled("req-9"))


def test_cancel_leaves_a_finished_request_alone(redis_url, redis_client, capsys):
    redis_client.xadd(KEYS.output("done-1"), {FIELD: FinalEntry("stop", 3).encode()},
                      id=FinalEntry("stop", 3).entry_id)

    assert main(["cancel", "done-1", "--redis", redis_url]) == 0

    out = capsys.readouterr().out.splitlines()
    assert out == ["request done-1 already finished (stop, 3 tokens): nothing to cancel"]
    assert not redis_client.exists(KEYS.cancelled("done-1"))


def test_cancel_with_a_bad_id_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["cancel", "not an id!"])
    assert exited.value.code == 2
    assert "request id must match" in capsys.readouterr().err


# --- submit ----------------------------------------------------------------------------------


def test_submit_reads_stdin_and_detach_prints_only_the_id(redis_url, redis_client, capsys,
                                                          monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt from stdin"))

    assert main(submit_argv(redis_url, "-", "--detach")) == 0  # no worker: returns at once

    [req] = requests_on(redis_client)
    assert capsys.readouterr().out == f"{req.request_id}\n"
    assert req.prompt == "a prompt from stdin"


def test_submit_chat_sends_the_text_as_a_user_message(redis_url, redis_client, capsys):
    assert main(submit_argv(redis_url, "hello there", "--chat", "--system", "be brief",
                            "--detach")) == 0

    [req] = requests_on(redis_client)
    assert req.prompt is None and req.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    assert main(submit_argv(redis_url, "x", "--system", "s", "--detach")) == 2  # needs --chat


def test_submit_reads_a_file_and_prints_one_json_object(redis_url, redis_client, tmp_path,
                                                        capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("a prompt from a file", encoding="utf-8")
    worker = answer_next_request(redis_url)

    rc = main(submit_argv(redis_url, "--file", str(prompt), "--json"))
    worker.join()

    [req] = requests_on(redis_client)
    assert rc == 0 and req.prompt == "a prompt from a file"
    assert json.loads(capsys.readouterr().out) == {
        "request_id": req.request_id, "text": "Hi ", "finish_reason": "stop",
        "usage": {"prompt_tokens": 4, "completion_tokens": 2, "cached_tokens": 0,
                  "kv_transferred_tokens": 0, "total_tokens": 6},
        "error": None}


def test_submit_shows_how_the_request_ended_on_stderr(redis_url, capsys):
    worker = answer_next_request(redis_url)
    rc = main(submit_argv(redis_url, "hello"))
    worker.join()

    captured = capsys.readouterr()
    assert rc == 0 and captured.out == "Hi \n"
    assert "[stop, 2 tokens]" in captured.err


def test_submit_without_sampling_options_matches_client_submit(redis_url, redis_client):
    assert main(submit_argv(redis_url, "same prompt", "--detach")) == 0
    with Client(redis_url) as client:
        client.submit("same prompt", model=MODEL, allow_unregistered=True)

    from_cli, from_client = requests_on(redis_client)
    assert from_cli.params == from_client.params


def test_submit_passes_the_sampling_options_it_is_given(redis_url, redis_client):
    argv = submit_argv(redis_url, "hi", "--detach", "--max-tokens", "7", "--temperature", "0",
                       "--top-p", "0.5", "--stop", "END", "--stop", "\n\n", "--seed", "3")
    assert main(argv) == 0

    [req] = requests_on(redis_client)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (
        7, 0.0, 0.5, ("END", "\n\n"), 3)


@pytest.mark.parametrize("prompt_args", [[], ["text", "--file", "prompt.txt"]])
def test_submit_needs_exactly_one_prompt(redis_url, redis_client, prompt_args, capsys):
    assert main(submit_argv(redis_url, *prompt_args)) == 2
    assert "give the prompt as TEXT" in capsys.readouterr().err
    assert requests_on(redis_client) == []


# --- version and help ------------------------------------------------------------------------


def test_version_prints_the_installed_distributions_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"conveyor {metadata.version('conveyor')}\n"


def every_parser() -> list[tuple[list[str], argparse.ArgumentParser]]:
    """(the words that reach it, the parser) for `conveyor` and every verb and action below."""
    found = []

    def walk(words: list[str], parser: argparse.ArgumentParser) -> None:
        found.append((words, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    walk([*words, name], child)

    walk([], build_parser())
    return found


def test_every_option_of_every_verb_has_help_that_shows_its_default():
    parsers = every_parser()
    assert {"submit", "cancel", "bulk status", "redis", "make-model"} <= {
        " ".join(words) for words, _ in parsers}
    for words, parser in parsers:
        assert parser.formatter_class is HelpFormatter, words
        formatter = HelpFormatter(parser.prog)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            where = f"conveyor {' '.join(words)} {action.option_strings or action.dest}"
            assert action.help, f"{where} has no help"
            if (action.option_strings and not action.required
                    and action.default not in (False, argparse.SUPPRESS)
                    and not isinstance(action, argparse._HelpAction | argparse._VersionAction)):
                assert "default" in formatter._get_help_string(action), (
                    f"{where} does not show its default")


def test_help_of_conveyor_and_every_verb_exits_0(capsys):
    for words, _ in every_parser():
        with pytest.raises(SystemExit) as exited:
            main([*words, "--help"])
        assert exited.value.code == 0, words
        assert capsys.readouterr().out.startswith("usage: conveyor"), words


# --- an unreachable Redis --------------------------------------------------------------------


def closed_port() -> int:
    """A local TCP port nothing listens on: bound, then closed."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def conveyor(*argv: str, **popen: object) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
    return subprocess.Popen([sys.executable, "-m", "worker.cli", *argv], text=True, env=env,
                            **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen})


def test_a_verb_that_cannot_reach_redis_says_so_in_one_line_after_its_retries():
    url = f"redis://127.0.0.1:{closed_port()}"
    verbs = {"submit": ["submit", "hi"], "tail": ["tail", "req-1"],
             "cancel": ["cancel", "req-1"], "top": ["top", "--once"],
             "bulk status": ["bulk", "status", "job-1"], "redis setup": ["redis", "setup"]}
    running = {name: conveyor(*argv, "--redis", url) for name, argv in verbs.items()}

    for name, proc in running.items():  # they ran side by side: one wait for all retries
        _, err = proc.communicate(timeout=120)
        verb = name
        lines = err.splitlines()
        retries = [line for line in lines if "cannot reach Redis, retrying" in line]
        said = [line for line in lines if line not in retries]
        assert proc.returncode == 1, (verb, err)
        assert "Traceback" not in err, (verb, err)
        assert len(retries) == RETRY_ATTEMPTS, (verb, err)
        assert all(url in line for line in retries), (verb, err)
        assert len(said) == 1 and said[0].startswith(
            f"conveyor {name}: cannot reach Redis at {url}: "), (verb, err)


# --- make-model --force ----------------------------------------------------------------------


def test_make_model_force_refuses_a_folder_it_did_not_make(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")

    assert main(["make-model", str(folder), "--preset", "tiny", "--force"]) == 2

    assert ".conveyor-model" in capsys.readouterr().err
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "keep me"


def test_make_model_force_makes_its_own_folder_again(tmp_path, capsys):
    folder = tmp_path / "model"
    assert main(["make-model", str(folder), "--preset", "tiny"]) == 0
    marker = json.loads((folder / ".conveyor-model").read_text())
    assert marker["preset"] == "tiny" and marker["arch"] == "llama"
    (folder / "model.safetensors").write_bytes(b"damaged")

    assert main(["make-model", str(folder), "--preset", "tiny"]) == 2  # not without --force
    assert main(["make-model", str(folder), "--preset", "tiny", "--force"]) == 0
    assert (folder / "model.safetensors").read_bytes() != b"damaged"
    assert (folder / ".conveyor-model").is_file()


# --- a reader that stops early ---------------------------------------------------------------


def test_bulk_status_json_into_a_reader_that_stops_after_one_line(redis_url, redis_client):
    # Megabytes of JSON: far more than a pipe holds, so the reader's close is certain to
    # break the pipe while `bulk status` is still writing.
    queue = bulk_queue(connection=redis_client)
    job = queue.enqueue("producer.bulk.analyze_document", kwargs={})
    job.meta["big"] = list(range(200_000))
    job.save_meta()

    proc = conveyor("bulk", "status", job.id, "--json", "--redis", redis_url)
    assert proc.stdout.readline() == "{\n"
    proc.stdout.close()  # `| head -1`
    err = proc.stderr.read()
    proc.wait(timeout=60)

    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception" not in err, err



def test_submit_n_prints_each_choice_and_tail_follows_one(start_worker, redis_url, capsys):
    from fleet_fixtures import MODEL as SERVED

    start_worker()
    rc = main(["submit", "The river", "--n", "2", "--seed", "3", "--max-tokens", "4",
               "--temperature", "1", "--json", "--model", SERVED, "--redis", redis_url])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert rc == 0 and len(lines) == 2
    first = lines[0]["request_id"]
    assert lines[1]["request_id"] == f"{first}.1"
    assert all(line["usage"]["completion_tokens"] == 4 for line in lines)
    assert main(["tail", f"{first}.1", "--redis", redis_url]) == 0
    assert capsys.readouterr().out.startswith(lines[1]["text"])
    assert main(submit_argv(redis_url, "hi", "--n", "2", "--stream")) == 2
    assert "does not mix with --stream" in capsys.readouterr().err


def test_submit_json_schema_answers_json_valid_against_it(start_worker, redis_url, capsys,
                                                          tmp_path):
    from fleet_fixtures import MODEL as SERVED

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    path = tmp_path / "answer.json"
    path.write_text(json.dumps(schema))
    start_worker()
    rc = main(["submit", "Is it?", "--json-schema", str(path), "--max-tokens", "32",
               "--model", SERVED, "--redis", redis_url])
    out = capsys.readouterr().out
    assert rc == 0 and json.loads(out.splitlines()[-1]) in ({"ok": True}, {"ok": False})
    path.write_text("{not json")
    assert main(["submit", "x", "--json-schema", str(path), "--model", SERVED, "--redis",
                 redis_url]) == 2
    assert "not a JSON file" in capsys.readouterr().err


def test_common_mistakes_are_one_line_not_a_traceback(redis_url, redis_client, tiny_llama,
                                                      tmp_path, capsys):
    """A directory given as a file, a port out of range or in use, a thread count of 0, a
    Redis user without the rights a verb needs, a lane closed to new requests: each is one
    line naming the problem, with the documented exit status."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    busy = held.getsockname()[1]
    try:
        for argv, status, words in [
                (["submit", "--file", str(tmp_path), "--redis", redis_url], 2,
                 "Is a directory"),
                (["gateway", "--port", "70000", "--redis", redis_url], 2,
                 "--port must be in [0, 65535]"),
                (["worker", "--model", str(tiny_llama), "--threads", "0", "--redis",
                  redis_url], 2, "num_threads must be >= 1")]:
            assert main(argv) == status, argv
            err = capsys.readouterr().err
            assert words in err and "Traceback" not in err, err
        # (a worker that starts serving freezes the process's objects and takes its
        # signals: in a process of its own)
        env = {k: v for k, v in os.environ.items() if k != "CONVEYOR_REDIS_URL"}
        done = subprocess.run(
            [sys.executable, "-m", "worker.cli", "worker", "--model", str(tiny_llama),
             "--metrics-port", str(busy), "--metrics-host", "127.0.0.1", "--redis",
             redis_url], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr
        assert f"cannot serve metrics on 127.0.0.1:{busy}" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        held.close()
    assert not redis_client.keys("conveyor:model:*")  # (refused before it registered)
    redis_client.execute_command("ACL", "SETUSER", "pinger", "on", ">pw", "~*", "+ping",
                                 "+hello", "+client")
    try:
        limited = redis_url.replace("unix://", "unix://pinger:pw@")
        assert main(["top", "--once", "--redis", limited]) == 1
        err = capsys.readouterr().err
        assert "Redis refused a command to this user" in err and "Traceback" not in err
    finally:
        redis_client.execute_command("ACL", "DELUSER", "pinger")
    lane = KEYS.requests(MODEL, "interactive")
    redis_client.xadd(lane, {"m": "x"}, id="18446744073709551615-18446744073709551615")
    redis_client.hset(KEYS.model(MODEL), "name", MODEL)  # (registered: no unknown-model exit)
    assert main(["submit", "hi", "--model", MODEL, "--redis", redis_url]) == 1
    assert "is blocked" in capsys.readouterr().err
