"""Worker settings are checked once, in WorkerConfig, whoever builds it; the CLI's defaults
are the config dataclasses' own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker.cli.command import build_parser
from worker.cli.worker_verbs import worker_config
from worker.engine.config import EngineConfig, field_default
from worker.fleet.config import WorkerConfig


@pytest.mark.parametrize("bad, message", [
    ({"lease_ms": 0}, "lease_ms"),
    ({"max_deliveries": 0}, "max_deliveries"),
    ({"prefetch": -1}, "prefetch"),
    ({"heartbeat_interval_s": 0}, "heartbeat_interval_s"),
    ({"housekeeping_interval_s": 0}, "housekeeping_interval_s"),
    ({"read_block_ms": 60_000}, "read_block_ms"),
    ({"metrics_port": 70_000}, "metrics_port"),
    ({"gil_switch_interval_s": 0}, "gil_switch_interval_s"),
    ({"namespace": "a b"}, "namespace"),
    ({"worker_id": "w:1"}, "worker id"),
    ({"engine": {"max_num_sqs": 4}}, "unknown engine setting"),
    ({"engine": {"preemption_mode": "drop"}}, "preemption_mode"),
    ({"engine": {"dtype": "int8"}}, "dtype"),
])
def test_bad_worker_settings_are_refused_naming_the_setting(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig(model_dir=tmp_path, **bad)


def test_worker_flags_default_to_the_config_dataclasses():
    args = build_parser().parse_args(["worker", "--model", "m"])
    assert args.max_num_seqs == field_default(EngineConfig, "max_num_seqs")
    assert args.max_num_batched_tokens == field_default(EngineConfig, "max_num_batched_tokens")
    assert args.dtype == field_default(EngineConfig, "dtype")
    assert args.gpu_memory_utilization == field_default(EngineConfig, "gpu_memory_utilization")
    for flag, name in [("lease_ms", "lease_ms"), ("max_deliveries", "max_deliveries"),
                       ("drain_timeout", "drain_timeout_s"), ("namespace", "namespace"),
                       ("heartbeat_interval", "heartbeat_interval_s"),
                       ("housekeeping_interval", "housekeeping_interval_s"),
                       ("metrics_host", "metrics_host"), ("stream_interval", "stream_interval"),
                       ("stream_interval_ms", "stream_interval_ms")]:
        assert getattr(args, flag) == field_default(WorkerConfig, name), flag
    bench = build_parser().parse_args(["bench"])
    assert bench.max_num_seqs == field_default(EngineConfig, "max_num_seqs")
    assert bench.stream_interval_ms == field_default(WorkerConfig, "stream_interval_ms")
    assert bench.stream_interval is None  # deprecated: not passed on unless given


def test_stream_interval_flag_reaches_the_worker_and_the_benchs_workers(tiny_llama):
    from worker.bench.run.systems import choose_systems

    args = build_parser().parse_args(["worker", "--model", str(tiny_llama),
                                      "--stream-interval-ms", "20", "--stream-interval", "4"])
    config = worker_config(args)
    assert (config.stream_interval_ms, config.stream_interval) == (20, 4)
    bench = build_parser().parse_args(["bench", "--stream-interval-ms", "20",
                                       "--stream-interval", "3", "--no-place-threads"])
    (fleet,) = choose_systems(bench, tiny_llama, {}, [], "redis://x", tiny_llama)
    assert fleet.describe.endswith("each stream written at most every 20 ms or 3 tokens")


def test_housekeeping_interval_flag_reaches_the_worker(tiny_llama):
    args = build_parser().parse_args(["worker", "--model", str(tiny_llama),
                                      "--housekeeping-interval", "90"])
    assert worker_config(args).housekeeping_interval_s == 90.0


@pytest.mark.parametrize(("flag", "setting"), [("auto", None), ("on", True), ("off", False)])
def test_async_scheduling_flag_reaches_the_engine_settings(tiny_llama, flag, setting):
    args = build_parser().parse_args(["worker", "--model", str(tiny_llama),
                                      "--async-scheduling", flag])
    engine = worker_config(args).engine
    assert engine.get("async_scheduling") is setting  # absent: the device decides
    assert EngineConfig.from_kwargs(engine).async_scheduling is setting


def test_attention_and_graph_flags_reach_the_engine_and_the_benchs_workers(tiny_llama):
    from worker.bench.run.systems import engine_settings, worker_flags

    args = build_parser().parse_args(["worker", "--model", str(tiny_llama)])
    engine = worker_config(args).engine
    assert engine["attention_backend"] == "auto" and "enforce_eager" not in engine
    args = build_parser().parse_args(["worker", "--model", str(tiny_llama),
                                      "--attention-backend", "paged", "--enforce-eager"])
    config = EngineConfig.from_kwargs(worker_config(args).engine)
    assert (config.attention_backend, config.enforce_eager) == ("paged", True)
    bench = build_parser().parse_args(["bench", "--attention-backend", "torch",
                                       "--enforce-eager"])
    settings = engine_settings(bench)
    assert (settings["attention_backend"], settings["enforce_eager"]) == ("torch", True)
    flags = worker_flags(settings, 1)
    assert flags[flags.index("--attention-backend") + 1] == "torch"
    assert "--enforce-eager" in flags
    assert "attention_backend" not in engine_settings(build_parser().parse_args(["bench"]))


def test_conveyor_worker_with_a_bad_setting_exits_2_with_the_reason(tiny_llama):
    # Its own process: the CLI sets up logging for the process it runs in.
    done = subprocess.run([sys.executable, "-m", "worker.cli", "worker", "--model",
                           str(tiny_llama), "--lease-ms", "0"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "lease_ms must be" in done.stderr
