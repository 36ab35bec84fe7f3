"""Security: ACL users limited to their keys, TLS, size limits on every field, ids checked.

The ACL tests apply producer.redis.acl's rules (the ones docs/security.md shows) to Redis 7 (the
selector rules) and to the embedded Redis 6.2 (its fall-back rules), run each attack the
rules forbid as that user, and run a request through a worker and a producer logged in as
those users. The
TLS tests need a redis-server built with TLS and make their own CA and certificates with
the ``openssl`` command.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import socket
import subprocess
from pathlib import Path

import msgpack
import pytest
import redis
import torch
from fleet_fixtures import MODEL, settled_pending
from redis_fixtures import missing, redis_binary, tls_redis_binary
from structlog.testing import capture_logs
from tcp_proxy import TcpProxy

from producer.client.async_client import AsyncClient
from producer.client.client import Client
from producer.client.connection import connect
from producer.client.queues import (
    MAX_ENTRY_ID,
    MAX_ID_SEQUENCE,
    lane_blocked,
    lane_stats,
    trim_request_stream,
)
from producer.redis.acl import ROLES, acl_rules, setuser_args
from producer.redis.functions import (
    ADD_IF_ROOM,
    OURS,
    SOURCE,
    FunctionsMissing,
    install_functions,
    library_state,
)
from producer.redis.server import start_ephemeral
from producer.wire.errors import LaneBlocked
from producer.wire.keys import GROUP, LANES, Keys, as_text
from producer.wire.params import MAX_NEW_TOKENS, MAX_SEED, MAX_TOP_K, SamplingParams
from producer.wire.protocol import (
    MAX_ENTRY_BYTES,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_UNIX_MS,
    GenerationRequest,
    ProtocolError,
)
from producer.wire.validation import MAX_TOKEN_ID, brief
from worker.cli.command import build_parser
from worker.cli.redis_verbs import run_redis_cmd
from worker.cli.top import render, take_snapshot
from worker.fleet.housekeeping.old_lanes import OldLanes

KEYS = Keys()
DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
PASSWORDS = {"producer": "pr0ducer-secret", "worker": "w0rker-secret",
             "observer": "0bserver-secret"}


# --- ACL ---------------------------------------------------------------------------------
# Each ACL test runs on Redis 7 with the selector rules (the default) and on the embedded
# Redis 6.2 with its fall-back rules; the attacks the 6.2 rules cannot stop run on 7 only.

RULES_FOR = {"7": 7, "6.2": 6}


def _acl_server(version: str, folder: Path):
    """A Redis ``version`` with a producer, a worker and an observer user; the default user
    is the administrator."""
    server = start_ephemeral(folder, binary=redis_binary(version))
    server.rules = RULES_FOR[version]
    with connect(server.url) as admin:
        for role in ROLES:
            admin.execute_command("ACL", "SETUSER", *setuser_args(
                role, role, PASSWORDS[role], version=server.rules))
    return server


@pytest.fixture(scope="module", params=["7", "6.2"])
def acl_server(request, tmp_path_factory):
    with _acl_server(request.param, tmp_path_factory.mktemp("acl")) as server:
        yield server


@pytest.fixture(scope="module")
def redis7_acl_server(tmp_path_factory):
    """For the attacks only Redis 7's selector rules and functions stop."""
    with _acl_server("7", tmp_path_factory.mktemp("acl7")) as server:
        yield server


def _admin(server) -> redis.Redis:
    """The administrator of a flushed server, with conveyor's functions loaded where Redis
    has them, as `conveyor redis setup` does."""
    client = connect(server.url)
    client.flushall()
    if server.rules == 7:
        install_functions(client)
    client.acl_log_reset()
    return client


def user_url(server, role: str) -> str:
    return f"unix://{role}:{PASSWORDS[role]}@{server.socket}"


@pytest.fixture
def admin(acl_server):
    with _admin(acl_server) as client:
        yield client


@pytest.fixture
def admin7(redis7_acl_server):
    with _admin(redis7_acl_server) as client:
        yield client


def refused_commands(admin: redis.Redis) -> list[str]:
    """What the ACL refused since the last reset, except CLIENT SETINFO: redis-py announces
    itself on every connection and ignores the refusal."""
    return [f"{e['username']}: {e['object']} ({e['reason']})" for e in admin.acl_log()
            if e["object"] != "client"]


def test_a_request_round_trips_with_producer_worker_and_observer_users(acl_server, admin,
                                                                        start_worker):
    worker = start_worker(url=user_url(acl_server, "worker"))
    with Client(user_url(acl_server, "producer"), max_queue=100) as client:
        rid = client.submit([5, 6, 7], model=MODEL, max_tokens=4, temperature=0,
                            ignore_eos=True)
        done = client.result(rid, timeout=60)
        long = client.submit([5, 6, 7], model=MODEL, max_tokens=500, ignore_eos=True)
        next(client.stream(long, timeout=60))  # in flight: renew its lease as the worker user
        worker.leases.renew_all()
        renewed = worker.leases.renewals
        client.cancel(long)
        cancelled = client.result(long, timeout=60)
        settled_pending(admin, MODEL)  # both acknowledged (a round trip after their finals)
        assert client.models() == [MODEL]
        assert [s.state for s in client.model_states()] == ["live"]
        assert client.model_info(MODEL)["vocab_size"] > 0
        assert client.tokenizer(MODEL) is not None
        stats = lane_stats(client.redis, KEYS, MODEL)
        client.submit([1], model="not-yet", max_tokens=1, allow_unregistered=True)
    with connect(user_url(acl_server, "worker")) as worker_conn:
        trim_request_stream(worker_conn, KEYS.requests(MODEL, "interactive"))
    with Client(user_url(acl_server, "observer")) as observer:
        snapshot = take_snapshot(observer)

    assert done.finish_reason == "length" and len(done.token_ids) == 4
    assert renewed == 1 and cancelled.finish_reason == "cancelled"
    assert stats[0].pending == 0
    assert [w["worker_id"] for w in snapshot.workers] == ["w0"]
    assert {(lane.model, lane.lane) for lane in snapshot.lanes} == {
        (m, lane) for m in (MODEL, "not-yet") for lane in ("interactive", "batch")}
    assert refused_commands(admin) == []


@pytest.mark.parametrize("attempt", [
    lambda r: r.delete(KEYS.worker("x")),
    lambda r: r.xreadgroup(GROUP, "thief", {KEYS.requests(MODEL, "interactive"): ">"}),
    lambda r: r.xack(KEYS.requests(MODEL, "interactive"), GROUP, "1-0"),
    lambda r: r.xadd(KEYS.dead, {"reason": "forged"}),
    lambda r: r.hset(KEYS.model(MODEL), "max_model_len", 1),
    lambda r: r.set("elsewhere:key", 1),
    lambda r: r.publish("elsewhere", "x"),
    lambda r: r.flushall(),
    lambda r: r.config_get("*"),
], ids=["del-worker", "xreadgroup", "xack", "dead-letter", "model-hash",
        "other-key", "other-channel", "flushall", "config"])
def test_the_producer_user_is_refused_worker_and_admin_commands(acl_server, admin, attempt):
    with connect(user_url(acl_server, "producer")) as producer:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(producer)


def _queued_request(admin: redis.Redis) -> str:
    """A request entry in the interactive lane, and its output stream with a chunk."""
    admin.xadd(KEYS.requests(MODEL, "interactive"), {"m": b"someone else's prompt"})
    admin.xadd(KEYS.output("r1"), {"m": b"chunk"}, id="1-0")
    return KEYS.requests(MODEL, "interactive")


# The attacks issue 11 lists, as the producer on Redis 7: each refused.
PRODUCER_ATTACKS = {
    "eval-busy-loop": lambda r, lane: r.eval("while true do end", 0),
    "function-load": lambda r, lane: r.execute_command(
        "FUNCTION", "LOAD", "REPLACE", "#!lua name=evil\nredis.register_function('e', "
        "function() while true do end end)"),
    "xrange-prompts": lambda r, lane: r.xrange(lane),
    "xread-prompts": lambda r, lane: r.xread({lane: "0"}),
    "xinfo-stream-prompts": lambda r, lane: r.xinfo_stream(lane),
    "scan-keys": lambda r, lane: r.scan(0),
    "keys": lambda r, lane: r.keys("*"),
    "forge-output": lambda r, lane: r.xadd(KEYS.output("r1"), {"m": b"forged final"}),
    "read-cancel-marker": lambda r, lane: r.get(KEYS.cancelled("r1")),
    "forge-model-set": lambda r, lane: r.sadd(KEYS.models, "forged"),
    "other-tenant-submit": lambda r, lane: r.xadd("tenant-b:req:m:interactive", {"m": b"x"}),
    "other-tenant-fcall": lambda r, lane: r.execute_command(
        "FCALL", ADD_IF_ROOM, 1, "tenant-b:req:m:interactive", GROUP, 5, "m", "x"),
}


@pytest.mark.parametrize("attack", sorted(PRODUCER_ATTACKS))
def test_each_producer_attack_is_refused_on_redis7_then_a_request_is_served(
        redis7_acl_server, admin7, start_worker, attack):
    lane = _queued_request(admin7)
    with connect(user_url(redis7_acl_server, "producer")) as producer:
        with pytest.raises(redis.exceptions.NoPermissionError):
            PRODUCER_ATTACKS[attack](producer, lane)
    assert admin7.ping()  # not blocked by a script
    assert admin7.xlen(KEYS.output("r1")) == 1  # nothing forged
    admin7.delete(lane)
    start_worker(url=user_url(redis7_acl_server, "worker"))
    with Client(user_url(redis7_acl_server, "producer"), max_queue=10) as client:
        done = client.result(client.submit([5, 6, 7], model=MODEL, max_tokens=3,
                                           ignore_eos=True), timeout=60)
    assert done.finish_reason == "length" and len(done.token_ids) == 3


def test_no_worker_may_replace_the_server_wide_functions_on_redis7(redis7_acl_server, admin7):
    """Functions are server-wide: a worker (of this or any namespace) that could load them
    could plant code every producer runs, and read every tenant's prompts."""
    planted = SOURCE.replace("#!lua name=conveyor", "#!lua name=conveyor\n-- planted")
    with connect(user_url(redis7_acl_server, "worker")) as worker:
        for attempt in (("FUNCTION", "LOAD", "REPLACE", planted), ("FUNCTION", "FLUSH"),
                        ("FUNCTION", "DELETE", "conveyor")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                worker.execute_command(*attempt)
        assert library_state(worker) == OURS  # it may still check what is loaded
    assert library_state(admin7) == OURS


OBSERVER_ATTACKS = {
    "xrange-prompts": lambda r, lane: r.xrange(lane),
    "xinfo-stream-prompts": lambda r, lane: r.xinfo_stream(lane),
    "xread-output": lambda r, lane: r.xread({KEYS.output("r1"): "0"}),
    "submit": lambda r, lane: r.xadd(lane, {"m": b"x"}),
    "scan-keys": lambda r, lane: r.scan(0),
}


@pytest.mark.parametrize("attack", sorted(OBSERVER_ATTACKS))
def test_the_observer_reads_counts_only_on_redis7(redis7_acl_server, admin7, attack):
    lane = _queued_request(admin7)
    with connect(user_url(redis7_acl_server, "observer")) as observer:
        with pytest.raises(redis.exceptions.NoPermissionError):
            OBSERVER_ATTACKS[attack](observer, lane)
        assert observer.xlen(lane) == 1  # counts are what it may read


def test_without_functions_a_strict_producer_is_told_how_to_load_them(redis7_acl_server, admin7):
    admin7.execute_command("FUNCTION", "FLUSH")
    with Client(user_url(redis7_acl_server, "producer"), max_queue=10) as client:
        with pytest.raises(FunctionsMissing, match="conveyor redis setup"):
            client.submit([1, 2], model=MODEL, max_tokens=1, allow_unregistered=True)
    assert admin7.xlen(KEYS.requests(MODEL, "interactive")) == 0


def test_a_blocked_lane_is_reported_by_submit_worker_and_top(redis7_acl_server, admin7,
                                                            start_worker, capsys):
    lane = KEYS.requests(MODEL, "interactive")
    worker = start_worker(url=user_url(redis7_acl_server, "worker"))
    with Client(user_url(redis7_acl_server, "producer")) as client:
        # What any user allowed XADD can do to its own namespace's lanes.
        client.redis.xadd(lane, {"m": b"x"}, id=MAX_ENTRY_ID)
        with pytest.raises(LaneBlocked, match="reopen-lanes"):
            client.submit([1, 2], model=MODEL, max_tokens=1)
        assert worker.reaper.check_lanes() == [lane]
        worker.heartbeat.beat()
        with Client(user_url(redis7_acl_server, "observer")) as observer:
            frame = render(take_snapshot(observer))
        assert f"BLOCKED {lane}" in frame and "w0" in frame
        # The remedy the message gives, as an administrator; the lane takes requests again.
        assert run_redis_cmd(build_parser().parse_args(
            ["redis", "setup", "--redis", redis7_acl_server.url, "--reopen-lanes"])) == 0
        assert f"reopened {lane}" in capsys.readouterr().out
        done = client.result(client.submit([1, 2], model=MODEL, max_tokens=2,
                                           ignore_eos=True), timeout=60)
    assert done.finish_reason == "length"
    assert worker.reaper.check_lanes() == []


def test_reopening_a_lane_requeues_requests_written_after_the_blocking_entry(
        redis7_acl_server, admin7, start_worker):
    lane = KEYS.requests(MODEL, "interactive")
    with Client(user_url(redis7_acl_server, "producer")) as client:
        # One id short of the largest: the next honest submit takes the last id there is.
        client.redis.xadd(lane, {"m": b"x"}, id=f"{MAX_ID_SEQUENCE}-{MAX_ID_SEQUENCE - 1}")
        honest = client.submit([1, 2], model=MODEL, max_tokens=2, ignore_eos=True,
                               allow_unregistered=True)
        assert as_text(admin7.xrevrange(lane, count=1)[0][0]) == MAX_ENTRY_ID  # queued there
        with pytest.raises(LaneBlocked):
            client.submit([1, 2], model=MODEL, max_tokens=1, allow_unregistered=True)
        assert run_redis_cmd(build_parser().parse_args(
            ["redis", "setup", "--redis", redis7_acl_server.url, "--reopen-lanes"])) == 0
        assert not lane_blocked(admin7, lane)
        start_worker(url=user_url(redis7_acl_server, "worker"))
        assert client.result(honest, timeout=60).finish_reason == "length"
        assert client.result(client.submit([1, 2], model=MODEL, max_tokens=1),
                             timeout=60).finish_reason == "length"


def test_the_worker_user_may_answer_requests_on_old_layout_lane_keys(acl_server, admin):
    old = KEYS.old_layout_requests(MODEL, "interactive")
    admin.xadd(old, {"m": msgpack.packb({"v": 1, "id": "old-1", "model": MODEL,
                                         "prompt_token_ids": [1], "params": {}})})
    with connect(user_url(acl_server, "worker")) as worker:
        assert OldLanes(worker, KEYS, MODEL, "w0", 3600).answer() == 1
    assert refused_commands(admin) == []
    assert admin.xlen(old) == 0 and admin.xlen(KEYS.dead) == 1
    assert admin.xlen(KEYS.output("old-1")) == 1


@pytest.mark.parametrize("attempt", [
    lambda r: r.set("elsewhere:key", 1),
    lambda r: r.xadd("other:req:m:interactive", {"m": b"x"}),
    lambda r: r.keys("*"),
    lambda r: r.flushall(),
], ids=["other-key", "other-namespace", "keys", "flushall"])
def test_the_worker_user_is_refused_outside_its_keys(acl_server, admin, attempt):
    with connect(user_url(acl_server, "worker")) as worker:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(worker)


@pytest.mark.parametrize("attempt", [
    lambda r: r.xadd(KEYS.requests(MODEL, "interactive"), {"m": b"x"}),
    lambda r: r.xread({KEYS.output("r1"): "0"}),
    lambda r: r.delete(KEYS.worker("w0")),
    lambda r: r.publish(KEYS.cancel_channel, "r1"),
], ids=["submit", "read-output", "del-worker", "cancel"])
def test_the_observer_user_only_reads(acl_server, admin, attempt):
    with connect(user_url(acl_server, "observer")) as observer:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(observer)


def test_a_wrong_password_fails_at_once(acl_server):
    proxy = TcpProxy(str(acl_server.socket))  # counts the connections the client makes
    try:
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://producer:wrong@127.0.0.1:{proxy.port}/0").ping()
        assert proxy.accepted == 1  # refused once, never retried
    finally:
        proxy.close()


@pytest.mark.parametrize("version", [7, 6])
@pytest.mark.parametrize("role", ROLES)
def test_the_documented_acl_is_the_one_tested(role, version):
    doc = " ".join(DOC.read_text().split())
    password = f"{role.upper()}-PASSWORD"
    line = " ".join(setuser_args(role, f"conveyor-{role}", password, version=version))
    assert f"ACL SETUSER {line}" in doc


def test_acl_rules_follow_the_namespace():
    for version in (7, 6):
        for role in ROLES:
            rules = " ".join(acl_rules(role, "tenant-a", version=version))
            assert "tenant-a:req:*" in rules and "conveyor" not in rules
    with pytest.raises(ValueError):
        acl_rules("worker", "bad namespace")
    with pytest.raises(ValueError):
        acl_rules("admin")
    with pytest.raises(ValueError):
        acl_rules("worker", version=5)


# --- TLS ---------------------------------------------------------------------------------


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_certificates(folder: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-subj", "/CN=conveyor test CA", "-keyout", "ca.key", "-out", "ca.crt", cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    (folder / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=conveyor {name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=folder)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext",
                "-out", f"{name}.crt", cwd=folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """A TLS-only (no plain TCP) redis-server; client certificates optional but verified."""
    binary = tls_redis_binary()
    if shutil.which("openssl") is None:
        missing("no openssl command to make test certificates with")
    certs = make_certificates(tmp_path_factory.mktemp("certs"))
    port = free_port()
    config = {"tls-port": port, "tls-cert-file": certs / "server.crt",
              "tls-key-file": certs / "server.key", "tls-ca-cert-file": certs / "ca.crt",
              "tls-auth-clients": "optional"}
    with start_ephemeral(tmp_path_factory.mktemp("tls"), config, binary=binary) as server:
        server.tls_port, server.certs = port, certs
        yield server


def tls_url(server, query: str = "") -> str:
    return f"rediss://127.0.0.1:{server.tls_port}" + (f"?{query}" if query else "")


def test_a_request_round_trips_over_tls(tls_server, start_worker):
    url = tls_url(tls_server, f"ssl_ca_certs={tls_server.certs / 'ca.crt'}")
    with Client(url) as client:
        client.redis.flushall()
        start_worker(url=url)
        rid = client.submit("Over TLS", model=MODEL, max_tokens=5, temperature=0,
                            ignore_eos=True, max_queue=10)
        done = client.result(rid, timeout=60)
    assert done.finish_reason == "length" and len(done.token_ids) == 5


def test_tls_with_a_client_certificate_sync_and_async(tls_server):
    certs = tls_server.certs
    url = tls_url(tls_server, f"ssl_ca_certs={certs / 'ca.crt'}&ssl_certfile="
                              f"{certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}")
    with connect(url) as client:
        assert client.ping()

    async def ping() -> bool:
        async with AsyncClient(url) as ac:
            return await ac.redis.ping()

    assert asyncio.run(ping())


def test_skipping_verification_is_possible_but_explicit(tls_server):
    with connect(tls_url(tls_server, "ssl_cert_reqs=none")) as client:
        assert client.ping()


def test_an_unverifiable_server_certificate_fails_at_once(tls_server):
    proxy = TcpProxy(("127.0.0.1", tls_server.tls_port))  # counts the connections made
    try:
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            # no ssl_ca_certs: the test CA is unknown
            connect(f"rediss://127.0.0.1:{proxy.port}").ping()
        assert proxy.accepted == 1  # a certificate problem is not retried
    finally:
        proxy.close()


def test_plain_tcp_is_not_served(tls_server):
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=tls_server.tls_port, socket_timeout=2,
                    retry=None).ping()


# --- size limits and ids -----------------------------------------------------------------


def good_request(**fields) -> dict:
    return {"v": 1, "id": "r-1", "model": MODEL, "prompt": "hi", "params": {}, "priority": 0,
            "lane": "interactive", "created_ms": 1, "deadline_ms": None, **fields}


OVER_THE_LIMITS = {
    "long prompt": {"prompt": "x" * (MAX_PROMPT_CHARS + 1)},
    "many prompt tokens": {"prompt": None, "prompt_token_ids": [1] * (MAX_PROMPT_TOKENS + 1)},
    "huge token id": {"prompt": None, "prompt_token_ids": [MAX_TOKEN_ID + 1]},
    "negative token id": {"prompt": None, "prompt_token_ids": [-1]},
    "both prompts": {"prompt_token_ids": [1]},
    "no prompt": {"prompt": None},
    "long id": {"id": "x" * 65},
    "id with a separator": {"id": "a:b"},
    "id as bytes": {"id": b"r-1"},
    "long model name": {"model": "m" * 129},
    "model with a separator": {"model": "a:b"},
    "unknown lane": {"lane": "urgent"},
    "lane as a list": {"lane": ["interactive"]},
    "priority too high": {"priority": 1001},
    "priority too low": {"priority": -1001},
    "priority as bool": {"priority": True},
    "deadline after 9999": {"deadline_ms": MAX_UNIX_MS + 1},
    "negative deadline": {"deadline_ms": -1},
    "deadline as float": {"deadline_ms": 1.5},
    "created_ms nil": {"created_ms": None},
    "created_ms huge": {"created_ms": 2**64 - 1},
    "version as bool": {"v": True},
    "version 2": {"v": 2},
    "params as list": {"params": []},
    "params as zero": {"params": 0},
    "unknown field": {"extra": 1},
    "max_tokens huge": {"params": {"max_tokens": MAX_NEW_TOKENS + 1}},
    "top_k huge": {"params": {"top_k": MAX_TOP_K + 1}},
    "seed huge": {"params": {"seed": MAX_SEED + 1}},
    "too many stop strings": {"params": {"stop": ["s"] * 17}},
    "long stop string": {"params": {"stop": ["s" * 257]}},
    "stop as a map": {"params": {"stop": {"a": 1}}},
    "too many stop ids": {"params": {"stop_token_ids": list(range(65))}},
    "huge stop id": {"params": {"stop_token_ids": [MAX_TOKEN_ID + 1]}},
    "too many logprobs": {"params": {"logprobs": 21}},
    "unknown param": {"params": {"beam_width": 4}},
    "param key as bytes": {"params": {b"max_tokens": 4}},
    "temperature nan": {"params": {"temperature": float("nan")}},
}


@pytest.mark.parametrize("fields", OVER_THE_LIMITS.values(), ids=OVER_THE_LIMITS.keys())
def test_workers_refuse_entries_past_any_limit(fields):
    raw = msgpack.packb(good_request(**fields), use_bin_type=True)
    assert GenerationRequest.decode(msgpack.packb(good_request(), use_bin_type=True))
    with pytest.raises(ProtocolError) as refused:
        GenerationRequest.decode(raw)
    assert refused.value.reason and len(refused.value.reason) < 400


SUBMITS_OVER_THE_LIMITS = {
    "long prompt": {"prompt": "x" * (MAX_PROMPT_CHARS + 1)},
    "many prompt tokens": {"prompt": [1] * (MAX_PROMPT_TOKENS + 1)},
    "huge token id": {"prompt": [MAX_TOKEN_ID + 1]},
    "token id past 64 bits": {"prompt": [2**64]},
    "long id": {"request_id": "x" * 65},
    "long model name": {"model": "m" * 129},
    "unknown lane": {"lane": "urgent"},
    "priority too high": {"priority": 1001},
    "deadline after 9999": {"deadline_ms": MAX_UNIX_MS + 1},
    "max_tokens huge": {"max_tokens": MAX_NEW_TOKENS + 1},
    "top_k past 64 bits": {"top_k": 2**64},
    "seed huge": {"seed": MAX_SEED + 1},
    "too many stop strings": {"stop": ["s"] * 17},
    "long stop string": {"stop": ["s" * 257]},
    "stop as a map": {"stop": {"a": 1}},
    "too many stop ids": {"stop_token_ids": list(range(65))},
    "stop id past 64 bits": {"stop_token_ids": [2**64]},
    "too many logprobs": {"logprobs": 21},
}


@pytest.mark.parametrize("args", SUBMITS_OVER_THE_LIMITS.values(),
                         ids=SUBMITS_OVER_THE_LIMITS.keys())
def test_producers_refuse_requests_past_any_limit_and_write_nothing(args, redis_url,
                                                                    redis_client):
    args = {"prompt": "hi", "model": MODEL, **args}
    with Client(redis_url) as client, pytest.raises(ValueError):
        client.submit(args.pop("prompt"), **args)
    assert redis_client.dbsize() == 0


def test_an_entry_over_the_byte_limit_is_refused_unread():
    raw = msgpack.packb(good_request(prompt="x" * MAX_ENTRY_BYTES), use_bin_type=True)
    with pytest.raises(ProtocolError, match="larger than"):
        GenerationRequest.decode(raw)


def test_a_deeply_nested_value_is_refused_without_recursing():
    deep = b"\x91" * 3000 + b"\xc0"  # [[[...[nil]...]]], deeper than Python's recursion limit
    raw = b"\x83\xa1v\x01\xa2id" + deep + b"\xa5model" + deep
    with pytest.raises(ProtocolError):
        GenerationRequest.decode(raw)
    nested: list = []
    for _ in range(5000):
        nested = [nested]
    assert brief(nested) == "a list"
    with pytest.raises(ValueError, match="a list"):
        SamplingParams(stop=[nested])


@pytest.mark.parametrize("bad_id", ["", "a b", "a:b", "../x", "x" * 65, "é", "a\nb", "a*"])
def test_request_ids_are_checked_before_they_become_keys(redis_url, redis_client, bad_id):
    with Client(redis_url) as client:
        for call in (lambda: client.cancel(bad_id), lambda: client.stream(bad_id),
                     lambda: client.submit("hi", model=MODEL, request_id=bad_id),
                     lambda: KEYS.output(bad_id), lambda: KEYS.cancelled(bad_id)):
            with pytest.raises(ValueError, match="request id"):
                call()
    assert redis_client.dbsize() == 0


@pytest.mark.parametrize("bad_name", ["", "a b", "a:b", "a/b", "x" * 129, "é", "a*", "a{b}"])
def test_names_are_checked_before_they_become_keys(bad_name):
    for call in (lambda: KEYS.worker(bad_name), lambda: KEYS.model(bad_name),
                 lambda: KEYS.requests(bad_name, "batch"), lambda: Keys(bad_name)):
        with pytest.raises(ValueError, match="must match"):
            call()


def test_error_messages_quote_untrusted_values_briefly():
    with pytest.raises(ValueError) as refused:
        Keys().output("x" * 10_000)
    assert len(str(refused.value)) < 200
    assert re.search(r"got 'x{40}'\.\.\.", str(refused.value))


def test_the_kv_tier_is_the_workers_alone(acl_server, admin):
    from kvstore.kv_tensors import PagedKVCache, block_layout, export_blocks
    from kvstore.tier.redis_tier import RedisKVTier

    cache = PagedKVCache(num_layers=1, num_blocks=2, block_size=4, num_kv_heads=1, head_dim=4,
                         dtype=torch.float32)
    layout = block_layout(cache, "m")
    with connect(user_url(acl_server, "worker")) as worker:
        tier = RedisKVTier(worker)
        tier.put("r1", layout, export_blocks(cache, [0, 1]), 2, 8)
        assert tier.get("r1", layout)[0].num_blocks == 2
        tier.delete("r1")
        tier.put("r1", layout, export_blocks(cache, [0, 1]), 2, 8)
    for role in ("producer", "observer"):
        with connect(user_url(acl_server, role)) as other:
            with pytest.raises(redis.exceptions.NoPermissionError):
                other.get(tier.header_key("r1"))  # KV reveals prompts
            with pytest.raises(redis.exceptions.NoPermissionError):
                other.set(tier.chunk_key("r1", 0), b"planted")  # and would poison outputs


def test_a_worker_whose_user_predates_the_handoff_stream_still_serves(redis7_acl_server, admin7,
                                                                       start_worker):
    rules = [r for r in acl_rules("worker", version=7) if ":handoff:" not in r]
    admin7.execute_command("ACL", "SETUSER", "older-worker", "reset", "on", ">older", *rules)
    worker = start_worker(url=f"unix://older-worker:older@{redis7_acl_server.socket}")
    assert worker.intake.streams == [s for lane in LANES for s in (  # no handoff stream
        KEYS.affinity_lane(MODEL, "w0", lane), KEYS.requests(MODEL, lane))]
    with Client(user_url(redis7_acl_server, "producer")) as client:
        done = client.result(client.submit([1, 2], model=MODEL, max_tokens=2, ignore_eos=True),
                             timeout=60)
    assert done.finish_reason == "length"


def test_users_that_predate_prefix_affinity_serve_without_it(redis7_acl_server, admin7,
                                                             start_worker):
    """A worker user without ``{ns}:affinity:*`` reads the shared lanes only, and says so; a
    producer user without it sends every request to the shared lane."""
    for role in ("worker", "producer"):
        rules = [r for r in acl_rules(role, version=7) if ":affinity:" not in r]
        admin7.execute_command("ACL", "SETUSER", f"older-{role}", "reset", "on", ">older",
                               *rules)
    worker = start_worker(url=f"unix://older-worker:older@{redis7_acl_server.socket}")
    assert worker.intake.streams == [*(KEYS.handoff(MODEL, lane) for lane in LANES),
                                     *(KEYS.requests(MODEL, lane) for lane in LANES)]
    assert worker.intake.advertiser is None
    with Client(f"unix://older-producer:older@{redis7_acl_server.socket}") as client:
        prompt = list(range(2, 700))  # long enough to carry affinity keys
        done = client.result(client.submit(prompt, model=MODEL, max_tokens=2,
                                           ignore_eos=True), timeout=60)
    assert done.finish_reason == "length"


def test_a_worker_whose_user_cannot_read_heartbeats_starts_unchecked(redis7_acl_server, admin7,
                                                                     start_worker):
    """A worker user made before workers read each other's heartbeats at start (+hgetall):
    its kind check is skipped with a warning, and it serves."""
    rules = [r for r in acl_rules("worker", version=7) if r != "+hgetall"]
    assert not any("hgetall" in r for r in rules)  # precondition: the older rules
    admin7.execute_command("ACL", "SETUSER", "older-worker2", "reset", "on", ">older", *rules)
    with capture_logs() as logs:
        worker = start_worker(url=f"unix://older-worker2:older@{redis7_acl_server.socket}")
    assert worker.state == "serving"
    assert any("heartbeats" in e["event"] and e["log_level"] == "warning" for e in logs)
    with Client(user_url(redis7_acl_server, "producer")) as client:
        done = client.result(client.submit([1, 2], model=MODEL, max_tokens=2, ignore_eos=True),
                             timeout=60)
    assert done.finish_reason == "length"


def test_the_gateway_runs_as_a_producer_user(acl_server, admin, start_worker):
    import openai
    from gateway_fixtures import serve_gateway

    start_worker(url=user_url(acl_server, "worker"))
    with serve_gateway(user_url(acl_server, "producer"), max_queue=100) as running, \
            openai.OpenAI(base_url=running.api, api_key="k", max_retries=0) as oai:
        assert [m.id for m in oai.models.list()] == [MODEL]
        chat = oai.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": "hi"}])
        streamed = list(oai.completions.create(model=MODEL, prompt="hi", max_tokens=3,
                                               temperature=0, stream=True))
    assert chat.usage.completion_tokens == 3 and streamed[-1].choices[0].finish_reason
    assert refused_commands(admin) == []
