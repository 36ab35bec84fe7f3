"""A client written in Node.js from docs/protocol.md alone gets what the Python client gets.

tests/node_client/client.mjs adds a request (XADD, or FCALL conveyor_add_if_room with a
queue limit) and follows its output stream to the final entry; here it runs against a real
worker, beside producer.client.client.Client, and every output entry the worker wrote is checked
against docs/schema/output.schema.json. Node is required in CI (scripts/setup.sh installs
it with apt and runs ``npm ci``); elsewhere a missing node is a skip that says so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import msgpack
import pytest
from fleet_fixtures import MODEL
from jsonschema import Draft202012Validator
from redis_fixtures import redis_binary
from test_wire_schema import documented_names

from producer.client.client import Client
from producer.client.connection import connect
from producer.redis.acl import setuser_args
from producer.redis.functions import install_functions
from producer.redis.server import start_ephemeral
from producer.wire.keys import Keys
from producer.wire.protocol import FIELD

ROOT = Path(__file__).resolve().parents[1]
NODE_DIR = ROOT / "tests" / "node_client"
OUTPUT_SCHEMA = Draft202012Validator(
    json.loads((ROOT / "docs" / "schema" / "output.schema.json").read_text()))
PROMPT = "The old library by the river"
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
INSTALL_HINT = ("apt-get install nodejs npm, then `npm ci` in tests/node_client (or run "
                "scripts/setup.sh with CONVEYOR_INSTALL_TEST_DEPS=1 as root)")


def _missing(reason: str) -> None:
    """A skip on a developer's machine; a failure in CI, where scripts/setup.sh installs Node
    and the client's packages, so a skip would hide an untested protocol."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{reason} (CI=true: scripts/setup.sh should have installed it)")
    pytest.skip(reason)


def packages_installed() -> bool:
    """Whether node_modules holds exactly what package-lock.json pins (npm ci writes its own
    copy of the lock there)."""
    try:
        wanted = json.loads((NODE_DIR / "package-lock.json").read_text())["packages"]
        have = json.loads((NODE_DIR / "node_modules" / ".package-lock.json").read_text())
    except (OSError, ValueError):
        return False
    wanted.pop("", None)
    return have.get("packages") == wanted


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's packages installed (npm ci when they are not)."""
    found = shutil.which("node")
    if found is None:
        _missing(f"node is not installed: {INSTALL_HINT}")
    if not packages_installed():
        npm = shutil.which("npm")
        if npm is None:
            _missing(f"the Node client's packages are not installed and npm is missing: "
                     f"{INSTALL_HINT}")
        done = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            _missing(f"npm ci failed in tests/node_client: {done.stderr[-2000:]}")
    return found


def run_node(node: str, url: str, *args: str, model: str = MODEL,
             expect_rc: int = 0) -> dict[str, Any]:
    """Run the Node client; its one JSON line of output."""
    done = subprocess.run([node, "client.mjs", "--redis", url, "--model", model, *args],
                          cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == expect_rc, f"rc {done.returncode}: {done.stderr}{done.stdout}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_outputs_match_schema(r, request_ids: list[str]) -> None:
    for rid in request_ids:
        entries = r.xrange(Keys().output(rid))
        assert entries, rid
        for entry_id, fields in entries:
            message = msgpack.unpackb(fields[FIELD], raw=False)
            errors = [e.message for e in OUTPUT_SCHEMA.iter_errors(message)]
            assert errors == [], (rid, entry_id, message)


def test_node_client_gets_the_python_clients_greedy_answer(node, redis_url, redis_client,
                                                           start_worker):
    start_worker()
    with Client(redis_url) as client:
        want = client.result(client.submit(PROMPT, model=MODEL, **GREEDY), timeout=60)
        prompt_ids = client.tokenizer(MODEL).encode(PROMPT).ids
        want_ids = client.result(client.submit(prompt_ids, model=MODEL, **GREEDY), timeout=60)

    got = run_node(node, redis_url, "--prompt", PROMPT, "--params", json.dumps(GREEDY))
    assert got["finish_reason"] == want.finish_reason == "length"
    assert got["token_ids"] == want.token_ids
    assert got["text"] == want.text
    assert got["num_tokens"] == len(want.token_ids) == GREEDY["max_tokens"]
    assert got["usage"]["prompt_tokens"] == want.usage.prompt_tokens
    assert got["usage"]["completion_tokens"] == want.usage.completion_tokens
    assert got["error"] is None
    assert got["entry_id"] == f"{GREEDY['max_tokens']}-1"

    got_ids = run_node(node, redis_url, "--prompt-token-ids", ",".join(map(str, prompt_ids)),
                       "--params", json.dumps(GREEDY), "--lane", "batch")
    assert got_ids["token_ids"] == want_ids.token_ids
    assert got_ids["text"] == want_ids.text
    assert "logprobs" not in got  # asked for none, none on the wire

    with_logprobs = {**GREEDY, "logprobs": 2}
    with Client(redis_url) as client:
        want_lp = client.result(client.submit(PROMPT, model=MODEL, **with_logprobs), timeout=60)
    got_lp = run_node(node, redis_url, "--prompt", PROMPT, "--params", json.dumps(with_logprobs))
    assert got_lp["token_ids"] == want_lp.token_ids
    assert len(got_lp["logprobs"]) == len(want_lp.logprobs) == GREEDY["max_tokens"]
    for (logprob, top), ours in zip(got_lp["logprobs"], want_lp.logprobs, strict=True):
        assert logprob == pytest.approx(ours.logprob, abs=1e-9)
        assert [t for t, _ in top] == [t for t, _ in ours.top] and len(top) == 2
    assert_outputs_match_schema(redis_client, [want.request_id, want_ids.request_id,
                                               got["id"], got_ids["id"], want_lp.request_id,
                                               got_lp["id"]])


def test_protocol_md_names_every_field_of_the_heartbeat_and_model_hashes(redis_client,
                                                                         start_worker):
    worker = start_worker()
    keys = Keys()
    heartbeat = redis_client.hgetall(keys.worker(worker.config.worker_id))
    assert {k.decode() for k in heartbeat} == documented_names("## The heartbeat hash")
    model = redis_client.hgetall(keys.model(MODEL))
    assert {k.decode() for k in model} == documented_names("## The model hash")


CHAT = [{"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Where is the old library?"}]


def test_node_client_sends_chat_messages_a_stop_string_and_a_refused_request_as_python_does(
        node, redis_url, redis_client, start_worker):
    start_worker()
    with Client(redis_url) as client:
        chat = client.result(client.submit(messages=CHAT, model=MODEL, **GREEDY), timeout=60)
    got_chat = run_node(node, redis_url, "--messages", json.dumps(CHAT),
                        "--params", json.dumps(GREEDY))
    assert chat.finish_reason == got_chat["finish_reason"] == "length", chat.error
    assert (got_chat["token_ids"], got_chat["text"]) == (chat.token_ids, chat.text)
    assert got_chat["usage"]["prompt_tokens"] == chat.usage.prompt_tokens
    # The optional fields a newer producer sends: a name, template kwargs, later params,
    # tools and a tool-call history.
    named = [{**CHAT[0], "name": "ann"}, *CHAT[1:],
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "look", "arguments": '{"q": "library"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "north wing"}]
    tools = [{"type": "function", "function": {"name": "look", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    later = {**GREEDY, "skip_special_tokens": False, "include_stop_str_in_output": True,
             "min_tokens": 2}
    with Client(redis_url) as client:
        want_named = client.result(client.submit(
            messages=named, model=MODEL, chat_template_kwargs={"enable_thinking": False},
            tools=tools, **later), timeout=60)
    got_named = run_node(node, redis_url, "--messages", json.dumps(named),
                         "--chat-template-kwargs", '{"enable_thinking": false}',
                         "--tools", json.dumps(tools),
                         "--params", json.dumps(later))
    assert want_named.finish_reason == got_named["finish_reason"] == "length"
    assert (got_named["token_ids"], got_named["text"]) \
        == (want_named.token_ids, want_named.text)
    # A response_format (structured outputs) travels as a map in params.
    held = {"max_tokens": 12, "temperature": 0,
            "response_format": {"type": "choice", "choices": ["yes", "no"]}}
    with Client(redis_url) as client:
        want_held = client.result(client.submit(PROMPT, model=MODEL, **held), timeout=60)
    got_held = run_node(node, redis_url, "--prompt", PROMPT, "--params", json.dumps(held))
    assert want_held.finish_reason == got_held["finish_reason"] == "stop"
    assert got_held["text"] == want_held.text and want_held.text in ("yes", "no")

    with Client(redis_url) as client:
        free = client.result(client.submit(PROMPT, model=MODEL, **GREEDY), timeout=60)
        # A stop string taken from the greedy text ends both clients' requests at it.
        stop = free.text[len(free.text) // 2:][:2]
        assert stop.strip(), free.text
        params = {**GREEDY, "stop": [stop]}
        want = client.result(client.submit(PROMPT, model=MODEL, **params), timeout=60)
    got = run_node(node, redis_url, "--prompt", PROMPT, "--params", json.dumps(params))
    assert (got["finish_reason"], got["text"]) == (want.finish_reason, want.text) \
        == ("stop", want.text)
    # A map the worker refuses (top_p 0) comes back as an error final entry, id readable.
    bad = run_node(node, redis_url, "--prompt", PROMPT, "--params", '{"top_p": 0}')
    assert bad["finish_reason"] == "error" and "top_p" in bad["error"]
    assert_outputs_match_schema(redis_client, [chat.request_id, got_chat["id"],
                                               want.request_id, got["id"], bad["id"],
                                               want_named.request_id, got_named["id"]])


PASSWORDS = {"producer": "pr0ducer-secret", "worker": "w0rker-secret"}


@pytest.fixture
def strict_redis7(tmp_path):
    """A Redis 7 with conveyor's functions loaded and the strict producer and worker users."""
    with start_ephemeral(tmp_path, binary=redis_binary("7"), appendonly="no") as server:
        with connect(server.url) as admin:
            install_functions(admin)
            for role, password in PASSWORDS.items():
                admin.execute_command("ACL", "SETUSER", *setuser_args(role, role, password))
        yield server


def user_url(server, role: str) -> str:
    return f"unix://{role}:{PASSWORDS[role]}@{server.socket}"


def test_node_client_adds_with_the_function_under_the_strict_acl(node, strict_redis7,
                                                                 start_worker):
    start_worker(url=user_url(strict_redis7, "worker"))
    producer = user_url(strict_redis7, "producer")
    with Client(producer) as client:
        want = client.result(client.submit(PROMPT, model=MODEL, max_queue=4, **GREEDY),
                             timeout=60)
    got = run_node(node, producer, "--prompt", PROMPT, "--params", json.dumps(GREEDY),
                   "--max-queue", "4")
    assert (got["token_ids"], got["text"]) == (want.token_ids, want.text)

    # No worker serves "idle": a limit of 1 takes one request and refuses the next.
    args = ["--prompt", PROMPT, "--max-queue", "1", "--wait-s", "0"]
    added = run_node(node, producer, *args, model="idle", expect_rc=124)  # then cancelled
    full = run_node(node, producer, *args, model="idle", expect_rc=3)
    assert full["error"] == "queue full"
    with connect(strict_redis7.url) as admin:
        assert admin.xlen(Keys().requests("idle", "interactive")) == 1
        assert admin.exists(Keys().cancelled(added["id"]))
        # CLIENT SETINFO, which redis-py sends and shrugs off when refused, aside.
        assert [e for e in admin.acl_log() if e["object"] != "client"] == []
