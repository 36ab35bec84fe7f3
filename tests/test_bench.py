"""`conveyor bench`: its math, its arrival plan, its workloads, and quick end-to-end runs."""

from __future__ import annotations

import json
import math
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.bench.results import metrics, report
from worker.bench.results.records import RequestRecord
from worker.bench.run import cpu
from worker.bench.run.arrivals import ArrivalPlan
from worker.bench.run.workloads import (
    WorkItem,
    w1_heavy_tailed,
    w2_long_document_burst,
    with_poisson_arrivals,
)
from worker.cli.command import build_parser, main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _record(submit: float, chunk_times: list[float], finish: float | None = None,
            error: str | None = None, tokens_per_chunk: int = 1) -> RequestRecord:
    r = RequestRecord(0, "all", 10, len(chunk_times) * tokens_per_chunk, submit)
    r.chunks = [(t, tokens_per_chunk) for t in chunk_times]
    r.finish_s = finish if finish is not None else (chunk_times[-1] if chunk_times else None)
    r.error = error
    return r


# ----- percentile and latency math -----

def test_percentile_matches_numpy_linear_interpolation():
    rng = random.Random(0)
    for n in (1, 2, 7, 100, 1001):
        values = [rng.lognormvariate(0, 1) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert metrics.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_percentile_of_nothing_is_nan_and_q_must_be_in_range():
    assert math.isnan(metrics.percentile([], 50))
    with pytest.raises(ValueError):
        metrics.percentile([1.0], 101)


def test_percentile_of_1_to_100():
    values = list(range(1, 101))
    assert metrics.percentile(values, 50) == pytest.approx(50.5)
    assert metrics.percentile(values, 99) == pytest.approx(99.01)


def test_ttft_e2e_and_itl_come_from_chunk_arrival_times():
    r = _record(1.0, [1.5, 1.6, 1.8], finish=1.9)
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.e2e(r) == pytest.approx(0.9)
    assert metrics.itls(r) == pytest.approx([0.1, 0.2])
    assert metrics.tpot(r) == pytest.approx(0.15)


def test_a_chunk_of_several_tokens_shares_its_gap_among_them():
    r = _record(0.0, [1.0, 1.4], tokens_per_chunk=2)  # tokens 0-1 at 1.0, tokens 2-3 at 1.4
    assert metrics.itls(r) == pytest.approx([0.2, 0.2])
    assert metrics.tpot(r) == pytest.approx(0.4 / 3)


def test_summaries_are_in_milliseconds():
    s = metrics.summarize_ms([0.010, 0.020, 0.030])
    assert s["p50"] == 20.0 and s["max"] == 30.0 and s["mean"] == 20.0 and s["count"] == 3


def test_goodput_counts_requests_meeting_both_slos_per_second():
    slo = metrics.SLO(ttft_s=0.5, itl_s=0.1)
    good = _record(0.0, [0.4, 0.45, 0.5])  # TTFT 0.4, mean ITL 0.05
    slow_start = _record(0.0, [0.6, 0.65])  # TTFT 0.6
    slow_tokens = _record(0.0, [0.1, 0.5])  # mean ITL 0.4
    one_stall = _record(0.0, [0.1, 0.15, 0.2, 0.25, 0.45])  # one 0.2 gap, mean 0.0875
    failed = _record(0.0, [0.1, 0.12], error="boom")
    out = metrics.goodput([good, slow_start, slow_tokens, one_stall, failed], 2.0, slo)
    assert out == {"requests": 2, "requests_per_s": 1.0, "fraction": 0.4}


def test_throughput_counts_output_tokens_and_finished_requests():
    records = [_record(0.0, [0.5, 1.0]), _record(0.0, [1.0, 1.5, 2.0])]
    out = metrics.throughput(records, 2.0)
    assert out["output_tokens_per_s"] == 2.5 and out["requests_per_s"] == 1.0
    assert out["total_tokens_per_s"] == (5 + 20) / 2


def test_tokens_over_time_bins_add_up_to_all_tokens():
    records = [_record(0.0, [0.1, 0.2, 0.9, 1.95]), _record(0.5, [1.0, 1.1])]
    series = metrics.tokens_over_time(records, 2.0, bins=4)
    assert sum(v * 0.5 for _, v in series) == pytest.approx(6)
    assert [t for t, _ in series] == [0.25, 0.75, 1.25, 1.75]


def _summary(tok_s: float, itl_p99: float) -> dict:
    itl = {"p50": 10.0, "p99": itl_p99, "p99.9": 1.5 * itl_p99, "max": 2 * itl_p99}
    return {"throughput": {"output_tokens_per_s": tok_s}, "latency_ms": {"itl": itl},
            "groups": {"steady": {"latency_ms": {"itl": itl}}}}


def test_comparisons_divide_the_fleet_by_each_alternative_and_check_the_aims():
    summaries = {"fleet": _summary(500, 40), "hf-static": _summary(100, 20),
                 "offline": _summary(600, 30), "fleet-chunked-off": _summary(480, 80)}
    rows = {r["what"]: r for r in report.comparisons(summaries, "w1")}
    hf = rows["output tokens/s, fleet / hf-static"]
    assert hf["ratio"] == 5.0 and hf["aim"] == 5.0 and hf["met"] is True
    offline = rows["output tokens/s, fleet / offline"]
    assert offline["ratio"] == pytest.approx(0.833) and offline["met"] is False
    assert rows["ITL p99 of the steady requests, chunked prefill on / off"]["ratio"] == 0.5
    assert "aim" not in report.comparisons(summaries, "w1", aims=False)[0]
    assert "aim" not in report.comparisons(summaries, "w2")[0]  # 5x is a W1 aim


def test_repeats_show_each_pair_of_fleet_and_offline_runs():
    summaries = {"fleet": {"repeats": [{"output_tokens_per_s": v} for v in (450.0, 500.0)]},
                 "offline": {"repeats": [{"output_tokens_per_s": v} for v in (500.0, 400.0)]}}
    lines = report.format_repeats(summaries).splitlines()
    assert lines == ["fleet              tok/s of each repeat: 450.0, 500.0",
                     "offline            tok/s of each repeat: 500.0, 400.0",
                     "fleet / offline    of each pair of repeats: 0.90, 1.25"]
    one = {name: {"repeats": s["repeats"][:1]} for name, s in summaries.items()}
    assert report.format_repeats(one) == ""  # a single repeat: nothing to list


def test_repeats_show_the_host_steal_and_a_run_with_much_of_it_is_flagged():
    cpus = os.cpu_count() or 1

    def repeat(tok_s, share):  # a 10 s repeat from which the host took ``share`` of the CPUs
        stolen = None if share is None else share * 10.0 * cpus
        return {"output_tokens_per_s": tok_s, "duration_s": 10.0, "stolen_s": stolen}
    summaries = {"fleet": {"repeats": [repeat(450.0, 0.01), repeat(500.0, 0.0)]},
                 "offline": {"repeats": [repeat(500.0, 0.02), repeat(400.0, 0.0)]}}
    lines = report.format_repeats(summaries).splitlines()
    assert "fleet              host steal of each repeat: 1%, 0%" in lines
    assert "offline            host steal of each repeat: 2%, 0%" in lines
    two_tenths_of_ten_s = {"stolen_s": 0.2, "duration_s": 10.0}  # a recorded run, not a timing
    assert report.steal_share(two_tenths_of_ten_s, cpus=2) == 0.01
    assert report.format_steal_note(summaries) == ""  # 2% at most: under STEAL_FLAG
    summaries["offline"]["repeats"][1] = repeat(400.0, 0.3)
    assert "host took up to 30% of the CPUs' time" in report.format_steal_note(summaries)
    unknown = {"fleet": {"repeats": [repeat(450.0, None), repeat(500.0, 0.0)]}}
    assert "host steal" not in report.format_repeats(unknown)  # not on every repeat: left out


def test_a_perfect_engine_refills_a_freed_slot_at_once_and_the_batch_drains_at_the_end():
    from worker.bench.cli import perfect_engine_steps

    assert perfect_engine_steps([3, 3, 3, 3], rows=2) == 6  # two full rounds
    assert perfect_engine_steps([5, 1, 1, 1, 1], rows=2) == 5  # the short ones share a slot
    assert perfect_engine_steps([2, 8], rows=4) == 8  # the batch drains to the longest
    assert perfect_engine_steps([], rows=4) == 0


def test_simulated_runs_are_set_against_the_ideal_the_best_engine_and_the_step_rate():
    summary = {"throughput": {"output_tokens_per_s": 45_000.0}, "duration_s": 20.0,
               "simulated_busy_s": 19.0}
    rows = report.simulated_rows({"fleet": summary}, {"ideal_output_tokens_per_s": 50_000.0,
                                                      "best_output_tokens_per_s": 47_500.0})
    assert [(r["what"].split(",")[0], r["ratio"]) for r in rows] == [
        ("output tokens/s", 0.9), ("output tokens/s", 0.947), ("steps/s", 0.95)]
    assert "perfect engine" in rows[1]["what"]
    # A run without the busy time (a real engine's) has no step-rate row.
    assert len(report.simulated_rows({"fleet": {**summary, "simulated_busy_s": None}},
                                     {"ideal_output_tokens_per_s": 1.0,
                                      "best_output_tokens_per_s": 1.0})) == 2
    # Without the bound (steps that cost more with more rows, or arrivals spread in time).
    assert len(report.simulated_rows({"fleet": summary},
                                     {"ideal_output_tokens_per_s": 1.0})) == 2


def test_the_cpu_lines_give_redis_cpu_a_generated_token():
    line = report.format_cpu({"fleet": {"cpu_s": {"worker": 10.0, "redis": 1.5},
                                        "duration_s": 20.0, "output_tokens": 1_000_000}})
    assert "Redis CPU a generated token: 1.50 µs" in line


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_stolen_cpu_time_is_read_from_proc_stat():
    first = cpu.stolen_cpu_s()
    assert first is not None and first >= 0.0
    assert cpu.stolen_cpu_s() >= first  # a counter since boot


def test_cpu_line_shows_each_cpus_idle_seconds():
    run = {"cpu_s": {"worker": 12.7, "client": 0.2}, "duration_s": 6.5, "idle_s": [0.14, 0.01]}
    assert report.format_cpu({"fleet": run}).endswith("; CPUs idle 0.14/0.01 s")
    assert "idle" not in report.format_cpu({"fleet": {**run, "idle_s": None}})
    assert cpu.idle_delta([1.0, 2.0], [1.25, 2.0]) == [0.25, 0.0]
    assert cpu.idle_delta([1.0], [1.0, 2.0]) is None  # a CPU came or went: not comparable


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux's /proc/stat")
def test_idle_time_of_each_cpu_is_read_from_proc_stat():
    first = cpu.idle_cpu_s()
    assert first and all(v >= 0.0 for v in first)
    later = cpu.idle_cpu_s()
    assert len(later) == len(first) and all(b >= a for a, b in zip(first, later, strict=True))


def test_results_json_has_no_nan(tmp_path):
    path = tmp_path / "r.json"
    report.write_json({"a": [math.nan, 1.0], "b": {"c": math.nan}}, path)
    assert json.loads(path.read_text()) == {"a": [None, 1.0], "b": {"c": None}}


# ----- arrivals and workloads -----

def _items(n: int, **kw) -> list[WorkItem]:
    return [WorkItem([2, 3], 4, **kw) for _ in range(n)]


def test_the_limit_takes_the_better_of_two_measurements_of_each_peak():
    from worker.bench.results.limits import Peaks

    slow_moment, later = Peaks(1.5e11, 1.1e10, 2), Peaks(3e11, 0.9e10, 2)
    assert slow_moment.best(later) == Peaks(3e11, 1.1e10, 2) == later.best(slow_moment)


def test_the_physical_limit_adds_prefill_output_and_weight_reads():
    from worker.bench.results.limits import ModelSize, Peaks, model_size, physical_limit_s

    small = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
             "num_key_value_heads": 4, "head_dim": 64, "num_hidden_layers": 8,
             "vocab_size": 8192}
    size = model_size(small)
    # Per layer q, o 512x512, k, v 512x256, gate/up/down 512x1408; the head 8192x512.
    assert size.lm_head_weights == 8192 * 512
    assert size.matmul_weights == 8 * (2 * 512 * 512 + 2 * 512 * 256 + 3 * 512 * 1408) \
        + 8192 * 512
    peaks = Peaks(gemm_flops=1e11, copy_bytes_per_s=1e10, threads=1)
    limit = physical_limit_s(ModelSize(1000, 100), peaks, prompt_tokens=50, output_tokens=20,
                             longest_output=7)
    assert limit["prefill_flops_s"] == pytest.approx(2 * 900 * 50 / 1e11)
    assert limit["output_flops_s"] == pytest.approx(2 * 1000 * 20 / 1e11)
    assert limit["weight_reads_s"] == pytest.approx(7 * 4000 / 1e10)
    assert limit["total_s"] == pytest.approx(sum(v for k, v in limit.items() if k != "total_s"))
    # Where the engines run on a GPU, the limits are its own, weights of two bytes (bfloat16).
    from worker.bench.results.limits import limit_report, limits_device

    workload = {"prompt_tokens": 50, "output_tokens": 20, "max_output": 7}
    assert limit_report(small, peaks, workload, device="cuda")["model"]["bytes_per_weight"] == 2
    assert limit_report(small, peaks, workload)["model"]["bytes_per_weight"] == 4
    assert limits_device(simulated=True) == "cpu"  # a simulated engine's limits are its own


def test_arrival_plan_hands_out_timed_requests_once_when_due():
    items = [WorkItem([2], 4, arrival_s=t) for t in (0.0, 0.5, 1.0)]
    plan = ArrivalPlan(items)
    assert plan.due(0.0, 0, 0) == [0]
    assert plan.seconds_to_next(0.2) == pytest.approx(0.3)
    assert plan.due(0.7, 1, 0) == [1]
    assert plan.due(0.7, 1, 0) == []
    assert plan.due(5.0, 0, 0) == [2] and plan.done


def test_arrival_plan_with_concurrency_keeps_that_many_in_flight():
    plan = ArrivalPlan(_items(5), concurrency=2)
    assert plan.due(0.0, 0, 0) == [0, 1]
    assert plan.due(0.1, 2, 0) == []
    assert plan.due(0.2, 1, 0) == [2]
    assert plan.seconds_to_next(0.2) is None


def test_arrival_plan_holds_a_request_until_enough_tokens_were_streamed():
    items = _items(2) + [WorkItem([2] * 50, 4, after_tokens=20, group="burst")]
    plan = ArrivalPlan(items)
    assert plan.due(0.0, 0, 0) == [0, 1]
    assert plan.due(1.0, 2, 19) == []
    assert plan.due(1.1, 2, 20) == [2]


def test_w2_is_48_steady_decodes_and_one_long_document_after_20_steps():
    items = w2_long_document_burst()
    steady = [i for i in items if i.group == "steady"]
    (burst,) = [i for i in items if i.group == "burst"]
    assert len(steady) == 48
    assert all(len(i.prompt_token_ids) == 32 and i.max_tokens == 256 for i in steady)
    assert len(burst.prompt_token_ids) == 2000 and burst.after_tokens == 20
    assert items == w2_long_document_burst()  # seeded


def test_poisson_arrivals_keep_the_requests_and_spread_them_at_the_rate():
    items = w1_heavy_tailed(400)
    timed = with_poisson_arrivals(items, rate=10.0)
    assert [i.prompt_token_ids for i in timed] == [i.prompt_token_ids for i in items]
    times = [i.arrival_s for i in timed]
    assert times == sorted(times) and times[0] > 0
    assert times[-1] / len(times) == pytest.approx(0.1, rel=0.15)


def test_worker_verb_takes_the_chunked_prefill_flags():
    args = build_parser().parse_args(["worker", "--model", "m", "--no-chunked-prefill",
                                      "--max-prefill-chunk", "64", "--heartbeat-interval", "0.5"])
    assert args.chunked_prefill is False and args.max_prefill_chunk == 64
    assert args.heartbeat_interval == 0.5
    assert build_parser().parse_args(["worker", "--model", "m"]).chunked_prefill is True


def test_an_out_path_that_is_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    taken = tmp_path / "results"
    taken.write_text("not a folder")
    assert main(["bench", "--quick", "--out", str(taken)]) == 2  # a usage error
    assert f"--out {taken} is a file" in capsys.readouterr().err
    assert taken.read_text() == "not a folder"


def test_the_redis_server_flag_is_checked_before_anything_runs(tmp_path, capsys):
    assert main(["bench", "--quick", "--redis", "redis://x", "--redis-server",
                 sys.executable]) == 2
    assert "not with --redis" in capsys.readouterr().err
    assert main(["bench", "--quick", "--redis-server", str(tmp_path)]) == 2
    assert "is not an executable file" in capsys.readouterr().err


def test_the_private_redis_runs_the_binary_given():
    """Redis's CPU a token depends on its build (the bundled 6.2 uses libc's allocator,
    production builds jemalloc): ``--redis-server`` picks the private Redis's binary."""
    import redis
    from redis_fixtures import redis_binary

    from worker.bench.cli import _redis

    with _redis(None, redis_binary("7")) as url, redis.Redis.from_url(url) as client:
        assert client.info("server")["redis_version"].startswith("7.")


# ----- quick end-to-end runs -----

RUN_KEYS = {"settings", "duration_s", "requests", "completed", "errors", "output_tokens",
            "throughput", "latency_ms", "goodput", "tokens_per_s_over_time", "kv", "cpu_s",
            "preempted", "taken_over"}


def _check_outputs(out_dir, runs: set[str]) -> dict:
    results = json.loads((out_dir / "results.json").read_text())
    assert {"workload", "model", "slo", "host", "runs", "comparisons", "requests",
            "plots"} <= set(results)
    assert set(results["runs"]) == runs
    expected_tokens = results["workload"]["output_tokens"]
    for name, run in results["runs"].items():
        assert RUN_KEYS <= set(run), name
        assert run["completed"] == run["requests"] == results["workload"]["requests"], name
        assert run["output_tokens"] == expected_tokens, name  # greedy, ignore_eos
        assert run["throughput"]["output_tokens_per_s"] > 0
        for kind in ("ttft", "itl", "e2e"):
            assert {"p50", "p90", "p99"} <= set(run["latency_ms"][kind])
            # Chunks the client reads in one XREAD share an arrival time: a fast run's ITL
            # median can be 0, never its TTFT or end-to-end time.
            least = 0 if kind == "itl" else 1e-9
            assert least <= run["latency_ms"][kind]["p50"] <= run["latency_ms"][kind]["p99"]
        assert run["goodput"]["requests"] <= run["requests"]
    for name in results["plots"]:
        data = (out_dir / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 5000, name
    from PIL import Image

    for name in results["plots"]:
        with Image.open(out_dir / name) as image:
            image.verify()
    return results


def test_quick_bench_writes_json_and_plots_for_fleet_offline_and_transformers(
        tiny_llama, tmp_path, capsys):
    out = tmp_path / "results"
    rc = main(["bench", "--quick", "--model", str(tiny_llama), "--threads", "1",
               "--offline", "--baseline", "hf-static", "hf-cb", "--out", str(out)])
    assert rc == 0
    results = _check_outputs(out, {"fleet", "offline", "hf-static", "hf-cb"})
    # transformers where the engine would run ("auto"), its continuous batching with each
    # request's own length, the time of each of its tokens recorded.
    for name in ("hf-static", "hf-cb"):
        assert results["runs"][name]["settings"]["device"] == "cpu"
        assert results["runs"][name]["settings"]["dtype"] == "float32"
    assert results["runs"]["hf-cb"]["settings"]["num_blocks"] > 0
    # (that its run is timed to its last answer and no further, before the manager's
    # shutdown, is the next test's: an order of its clock's readings, not their values)
    assert set(results["plots"]) == {"latency_cdf.png", "tokens_per_s.png", "kv_usage.png"}
    assert results["runs"]["fleet"]["kv"]["samples"]  # from the worker's heartbeats
    assert results["runs"]["offline"]["kv"]["peak_blocks_used"] > 0  # from engine.stats()
    # How often the engine's threads lost their core, from /proc: the worker's, the bench's.
    assert results["runs"]["fleet"]["preempted"]["worker"] >= 0
    assert results["runs"]["offline"]["preempted"]["bench"] >= 0
    # Decode-step tasks taken over from a late thread: the worker's heartbeat, the engine's.
    assert results["runs"]["fleet"]["taken_over"]["worker"] >= 0
    assert results["runs"]["offline"]["taken_over"]["bench"] >= 0
    whats = [row["what"] for row in results["comparisons"]]
    assert whats == ["output tokens/s, fleet / hf-static", "output tokens/s, offline / hf-static",
                     "output tokens/s, offline / hf-cb", "output tokens/s, fleet / hf-cb",
                     "output tokens/s, fleet / offline"] \
        + [f"output tokens/s, {name} / physical limit" for name in results["runs"]]
    limit = results["limits"]
    assert limit["device"] == "cpu"  # where the engines ran ("cuda" where they do)
    assert limit["peaks"]["gemm_gflops"] > 0 and limit["peaks"]["copy_gb_per_s"] > 0
    # Measured before and after the runs; the better of each pair sets the limit.
    before, after = limit["measured"]
    for name in ("gemm_gflops", "copy_gb_per_s"):
        assert limit["peaks"][name] == max(before[name], after[name])
    rows = {row["what"]: row for row in results["comparisons"]}
    offline = rows["output tokens/s, offline / physical limit"]
    assert offline["denominator"] == limit["limit_output_tokens_per_s"] > 0
    assert "aim" not in offline  # a quick run measures nothing real
    printed = capsys.readouterr().out
    assert "fleet / hf-static" in printed and "results.json" in printed
    assert "threads preempted: worker" in printed
    assert "step tasks taken over: worker" in printed
    # From the worker's own /metrics: its publisher's delay, each batch it wrote.
    assert "a step's output to Redis (conveyor_publish_delay_seconds" in printed
    assert any(n.startswith("Redis round trips per request: ")
               for n in results["runs"]["fleet"]["notes"])


def test_transformers_continuous_batching_times_each_token_of_each_request(tiny_llama,
                                                                         monkeypatch):
    """hf-cb: every request answered with its own length, each token a chunk at the time
    transformers recorded it, in order, none after the request's end; the run's clock is
    read for the last time before the manager's shutdown begins (an order of calls: the
    test reads no clock of its own)."""
    from worker.bench.run import baseline_hf

    calls: list[str] = []
    real, manager_of = baseline_hf.time, baseline_hf._manager

    class LoggedTime:
        """baseline_hf's time module, each reading of its run clock logged in order."""

        def __getattr__(self, name: str):
            return getattr(real, name)

        def perf_counter(self) -> float:
            calls.append("clock")
            return real.perf_counter()

    def recording_manager(model, items):
        manager, extra = manager_of(model, items)
        stop = manager.stop

        def recording_stop(*args, **kwargs):
            calls.append("stop")
            return stop(*args, **kwargs)

        manager.stop = recording_stop
        return manager, extra

    monkeypatch.setattr(baseline_hf, "time", LoggedTime())
    monkeypatch.setattr(baseline_hf, "_manager", recording_manager)
    items = [WorkItem(list(range(2, 10 + 7 * i)), 3 + 2 * i) for i in range(6)]
    run = baseline_hf.run_hf_continuous(tiny_llama, items, threads=1, timeout_s=120)
    assert calls.count("stop") == 1 and "clock" in calls[:calls.index("stop")]
    assert "clock" not in calls[calls.index("stop"):]  # its end marked before the shutdown
    assert [r.output_tokens for r in run.records] == [i.max_tokens for i in items]
    for r in run.records:
        times = [t for t, n in r.chunks]
        assert all(n == 1 for _, n in r.chunks) and times == sorted(times)
        # One monotonic clock (perf_counter, transformers' and the run's), read in causal
        # order, each reading less the same start: an ordering, exact, of no time's length.
        assert 0 < times[0] and times[-1] <= r.finish_s <= run.duration_s


def test_a_histograms_quantile_between_two_readings_is_its_buckets_upper_bound():
    before = {0.001: 10.0, 0.005: 10.0, 0.01: 10.0, math.inf: 10.0}
    after = {0.001: 60.0, 0.005: 100.0, 0.01: 109.0, math.inf: 110.0}  # 100 counted since
    assert [metrics.bucket_quantile(before, after, q) for q in (0.5, 0.9, 0.99, 1.0)] == \
        [0.001, 0.005, 0.01, math.inf]
    assert metrics.bucket_quantile(after, after, 0.5) is None  # nothing counted in between


def test_quick_w2_compares_chunked_prefill_on_and_off_through_a_given_redis(
        tiny_llama, tmp_path, redis_url):
    out = tmp_path / "w2"
    rc = main(["bench", "--quick", "--workload", "w2", "--model", str(tiny_llama),
               "--threads", "1", "--redis", redis_url, "--chunked-prefill", "off",
               "--out", str(out)])
    assert rc == 0
    results = _check_outputs(out, {"fleet", "fleet-chunked-off"})
    off = results["runs"]["fleet-chunked-off"]["settings"]["engine"]
    assert off["enable_chunked_prefill"] is False
    assert set(results["runs"]["fleet"]["groups"]) == {"steady", "burst"}
    rows = {row["what"]: row for row in results["comparisons"]}
    assert "ITL p99 of the steady requests, chunked prefill on / off" in rows


def test_quick_w5_compares_disaggregated_with_mixed_workers(tiny_llama, tmp_path, redis_url):
    out = tmp_path / "w5"
    rc = main(["bench", "--quick", "--workload", "w5", "--doc-rate", "4", "--disaggregate",
               "--model", str(tiny_llama), "--threads", "1", "--redis", redis_url,
               "--out", str(out)])
    assert rc == 0
    results = _check_outputs(out, {"mixed", "disaggregated"})
    assert results["runs"]["disaggregated"]["settings"]["roles"] == ["prefill", "decode"]
    assert results["runs"]["mixed"]["settings"]["workers"] == 2
    assert set(results["runs"]["mixed"]["groups"]) == {"interactive", "document"}
    whats = {row["what"] for row in results["comparisons"]}
    assert {"interactive ITL p99 ms, disaggregated / mixed",
            "document TTFT p50 ms, disaggregated / mixed",
            "goodput req/s, disaggregated / mixed"} <= whats
    assert not any("physical limit" in w for w in whats)  # documents arrive over time
    moved = results["runs"]["disaggregated"]["kv_transfer"]
    handed = results["runs"]["disaggregated"]["requests"]
    assert moved["handoffs_put"] == moved["handoffs_got"] == handed  # every request, once
    assert moved["document_mb"] > 0 and moved["document_put_ms"] > 0
    assert any(w.startswith("document KV transfer ms") for w in whats)
    assert "kv_transfer" not in results["runs"]["mixed"]


def test_w5_puts_documents_at_their_rate_beside_interactive_requests():
    from worker.bench.run.workloads import w5_documents_beside_chat

    items = w5_documents_beside_chat(num_interactive=4, vocab=100, doc_rate=2.0, num_docs=3,
                                     doc_tokens=50)
    docs = [i for i in items if i.group == "document"]
    assert [i.arrival_s for i in docs] == [1.0, 1.5, 2.0]
    assert all(len(i.prompt_token_ids) == 50 for i in docs)
    assert [i.group for i in items[:4]] == ["interactive"] * 4


def test_w6_asks_each_document_its_questions_interleaved_and_counts_the_possible_hits():
    from worker.bench.run.workloads import (
        build_workload,
        possible_prefix_hits,
        w6_documents_by_questions,
    )

    items = w6_documents_by_questions(num_docs=4, questions=3, vocab=100, rate=2.0)
    assert len(items) == 12 and sorted({i.prefix_id for i in items}) == [0, 1, 2, 3]
    arrivals = [i.arrival_s for i in items]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0  # Poisson, in order
    assert [i.prefix_id for i in items] != sorted(i.prefix_id for i in items)  # interleaved
    for item in items:
        assert 500 <= item.prefix_tokens <= 800 and 24 <= item.max_tokens <= 64
        question = len(item.prompt_token_ids) - item.prefix_tokens
        assert 8 <= question <= 20
        same = [i for i in items if i.prefix_id == item.prefix_id]
        assert all(i.prompt_token_ids[:i.prefix_tokens] == item.prompt_token_ids[
            :item.prefix_tokens] for i in same)  # each question prefixed by its document
    # Possible: every question after its document's first, the document's whole blocks.
    want = sum(2 * (next(i.prefix_tokens for i in items if i.prefix_id == d) // 16 * 16)
               for d in range(4))
    assert possible_prefix_hits(items, 16) == want
    assert possible_prefix_hits(build_workload("w1", 8, 100), 16) == 0
    assert len(build_workload("w6", 2, 100, quick=True, documents=5)) == 10


def test_the_w5_rate_summary_plots_runs_by_rate_and_refuses_other_runs(tmp_path):
    from worker.bench.results.rate_summary import rate_rows, write_rate_summary

    def run(itl_p99: float, ttft_p50: float, goodput: float) -> dict:
        return {"groups": {"interactive": {"latency_ms": {"itl": {"p99": itl_p99}}},
                           "document": {"latency_ms": {"ttft": {"p50": ttft_p50}}}},
                "goodput": {"requests_per_s": goodput}}

    folders = []
    for rate in (1.0, 0.25):
        folder = tmp_path / f"rate-{rate}"
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({
            "workload": {"name": "w5"}, "arguments": {"doc_rate": rate},
            "runs": {"mixed": run(900, 2000, 1.0), "disaggregated": run(70, 2500, 1.1)}}))
        folders.append(folder)
    assert [rate for rate, _ in rate_rows(folders)] == [0.25, 1.0]
    out = write_rate_summary(folders, tmp_path / "img" / "w5.png")
    assert out.read_bytes().startswith(b"\x89PNG")
    (folders[0] / "results.json").write_text(json.dumps({
        "workload": {"name": "w1"}, "arguments": {}, "runs": {"conveyor": {}}}))
    with pytest.raises(ValueError, match="not a `--workload w5 --disaggregate` run"):
        rate_rows(folders)


def test_cpu_lines_show_the_worker_threads_that_used_cpu():
    run = {"cpu_s": {"worker": 11.0}, "duration_s": 5.7,
           "thread_cpu_s": {"engine-loop": 10.65, "publisher": 0.18, "reaper": 0.001}}
    lines = report.format_cpu({"fleet": run}).splitlines()
    assert lines[1] == ("fleet              CPU s by worker thread: engine-loop 10.65, "
                        "publisher 0.18")
    assert len(report.format_cpu({"fleet": {**run, "thread_cpu_s": {}}}).splitlines()) == 1


def test_stream_reads_reports_what_redis_spent_on_the_chunks_it_wrote_and_read():
    """`python -m worker.bench.stream_reads` (docs/redis.md): Redis's own microseconds for
    each XADD and XREAD of real chunks, and the walk to an entry by the stream's length."""
    from worker.bench.stream_reads import measure

    out = measure(streams=40, rounds=4, tokens=9)
    assert out["redis"] and out["entry_bytes"] > 9  # the wire's own chunk, not a stand-in
    assert out["xread_us"] > 0 and out["xadd_us"] > 0
    assert out["xread_us_an_entry"] == round(out["xread_us"] / 29, 2)
    assert set(out["xread_of_one_entry_by_stream_length"]) == {"last_of_2_us", "last_of_26_us"}
