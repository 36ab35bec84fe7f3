"""The benchmark's JSON file, its comparison ratios and the tables printed at the end."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# Aims of the project's acceptance criteria, by comparison.
AIM_FLEET_OVER_HF = 5.0  # continuous batching vs static batches, on the heavy-tailed W1
AIM_FLEET_OVER_OFFLINE = 0.95  # Redis, intake and publishing cost at most 5%
AIM_OFFLINE_OVER_LIMIT = 0.7  # the engine on W1 against the machine's physical limit
# A repeat whose host took more than this share of the CPUs' time (steal) measured the host
# as much as the code: the printout says so beside its ratios.
STEAL_FLAG = 0.05


def comparisons(summaries: dict[str, dict[str, Any]], workload: str,
                aims: bool = True) -> list[dict[str, Any]]:
    """Ratios between the runs present; each row says what it divides and the aim, if any.

    ``aims`` False leaves the aims out (quick runs on the tiny model measure nothing real).
    """
    rows = []
    if "mixed" in summaries and "disaggregated" in summaries:
        return disaggregation_rows(summaries["disaggregated"], summaries["mixed"])
    fleet = summaries.get("fleet")
    if fleet is None:
        return rows
    tput = _get(fleet, "throughput", "output_tokens_per_s")
    if "hf-static" in summaries:
        aim = AIM_FLEET_OVER_HF if aims and workload == "w1" else None
        rows.append(_row("output tokens/s, fleet / hf-static", tput,
                         _get(summaries["hf-static"], "throughput", "output_tokens_per_s"),
                         aim, higher_is_better=True))
    for baseline in ("hf-static", "hf-cb"):  # the engine alone beside transformers
        if baseline in summaries and "offline" in summaries:
            rows.append(_row(f"output tokens/s, offline / {baseline}",
                             _get(summaries["offline"], "throughput", "output_tokens_per_s"),
                             _get(summaries[baseline], "throughput", "output_tokens_per_s"),
                             None, higher_is_better=True))
    if "hf-cb" in summaries:
        rows.append(_row("output tokens/s, fleet / hf-cb", tput,
                         _get(summaries["hf-cb"], "throughput", "output_tokens_per_s"),
                         None, higher_is_better=True))
    if "offline" in summaries:
        rows.append(_row("output tokens/s, fleet / offline", tput,
                         _get(summaries["offline"], "throughput", "output_tokens_per_s"),
                         AIM_FLEET_OVER_OFFLINE if aims else None, higher_is_better=True))
    if "fleet-chunked-off" in summaries:
        off = summaries["fleet-chunked-off"]
        for stat in ("p50", "p99", "p99.9", "max"):
            rows.append(_row(f"ITL {stat}{_group_note(fleet)}, chunked prefill on / off",
                             _itl(fleet, stat), _itl(off, stat), None, higher_is_better=False))
    return rows


def limit_rows(summaries: dict[str, dict[str, Any]], limit_tokens_per_s: float,
               workload: str, aims: bool = True) -> list[dict[str, Any]]:
    """Each run's output tokens/s as a fraction of the workload's physical limit
    (worker/bench/results/limits.py), measured in the same invocation."""
    rows = []
    for name, summary in summaries.items():
        aim = AIM_OFFLINE_OVER_LIMIT if aims and workload == "w1" and name == "offline" else None
        rows.append(_row(f"output tokens/s, {name} / physical limit",
                         _get(summary, "throughput", "output_tokens_per_s"),
                         limit_tokens_per_s, aim, higher_is_better=True))
    return rows


def simulated_rows(summaries: dict[str, dict[str, Any]],
                   simulated: dict[str, Any]) -> list[dict[str, Any]]:
    """Each run against what simulated steps allow (worker/engine/simulated.py), the fleet's
    own overhead at a GPU's speed: its output tokens/s over the ideal at full batch and over
    the best any engine reaches on this workload (the batch drains at its end), and its step
    rate over the simulated one (the share of the run its steps took: the rest of the time
    a GPU would have waited for the host)."""
    rows = []
    for name, summary in summaries.items():
        tokens_per_s = _get(summary, "throughput", "output_tokens_per_s")
        rows.append(_row(f"output tokens/s, {name} / simulated ideal (full batches)",
                         tokens_per_s, simulated["ideal_output_tokens_per_s"], None,
                         higher_is_better=True))
        if simulated.get("best_output_tokens_per_s"):  # (a bound only where steps cost alike)
            rows.append(_row(f"output tokens/s, {name} / a perfect engine on this workload",
                             tokens_per_s, simulated["best_output_tokens_per_s"], None,
                             higher_is_better=True))
        if summary.get("simulated_busy_s"):
            rows.append(_row(f"steps/s, {name} / simulated (seconds of steps / of the run)",
                             summary["simulated_busy_s"], summary["duration_s"], None,
                             higher_is_better=True))
    return rows


def disaggregation_rows(split: dict[str, Any], mixed: dict[str, Any]) -> list[dict[str, Any]]:
    """One prefill + one decode worker against two mixed workers (W5): the interactive
    requests' TTFT and ITL, the documents' TTFT, goodput; each disaggregated / mixed."""
    rows = []
    for group, kind, stats in (("interactive", "ttft", ("p50", "p99")),
                               ("interactive", "itl", ("p50", "p99")),
                               ("document", "ttft", ("p50", "p99"))):
        for stat in stats:
            a = split.get("groups", {}).get(group, {}).get("latency_ms", {}).get(kind, {})
            b = mixed.get("groups", {}).get(group, {}).get("latency_ms", {}).get(kind, {})
            rows.append(_row(f"{group} {kind.upper()} {stat} ms, disaggregated / mixed",
                             a.get(stat, math.nan), b.get(stat, math.nan), None,
                             higher_is_better=False))
    rows.append(_row("goodput req/s, disaggregated / mixed",
                     _get(split, "goodput", "requests_per_s"),
                     _get(mixed, "goodput", "requests_per_s"), None, higher_is_better=True))
    moved = split.get("kv_transfer", {})
    if "document_put_ms" in moved:
        # The price of the split: a document's KV into the tier and out again, against the
        # documents' own TTFT.
        transfer = moved["document_put_ms"] + moved["document_get_ms"]
        rows.append(_row(f"document KV transfer ms ({moved['document_mb']} MB put + get), "
                         "/ disaggregated document TTFT p50",
                         round(transfer, 2),
                         _get(split, "groups", "document", "latency_ms", "ttft", "p50"), None,
                         higher_is_better=False))
    return rows


def _row(what: str, a: float, b: float, aim: float | None, higher_is_better: bool
         ) -> dict[str, Any]:
    ratio = round(a / b, 3) if b and not math.isnan(a) and not math.isnan(b) else math.nan
    row: dict[str, Any] = {"what": what, "numerator": a, "denominator": b, "ratio": ratio,
                           "higher_is_better": higher_is_better}
    if aim is not None:
        row["aim"] = aim
        row["met"] = bool(ratio >= aim) if not math.isnan(ratio) else False
    return row


def _itl(summary: dict[str, Any], stat: str) -> float:
    # W2 measures the steady requests' ITL, not the burst's own.
    latency = summary.get("groups", {}).get("steady", summary)["latency_ms"]
    return latency["itl"][stat]


def _group_note(summary: dict[str, Any]) -> str:
    return " of the steady requests" if "steady" in summary.get("groups", {}) else ""


def _get(summary: dict[str, Any], *path: str) -> float:
    for key in path:
        summary = summary[key]
    return summary  # type: ignore[return-value]


def write_json(results: dict[str, Any], path: Path) -> None:
    """Write ``results``; NaN (no data) becomes null so any JSON reader accepts the file."""
    path.write_text(json.dumps(_no_nan(results), indent=1) + "\n")


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def format_runs(summaries: dict[str, dict[str, Any]]) -> str:
    """One line per run: throughput, latency percentiles and goodput."""
    head = (f"{'run':<18} {'tok/s':>8} {'req/s':>7} {'TTFT p50/p90/p99 ms':>22} "
            f"{'ITL p50/p90/p99 ms':>20} {'E2E p50/p90/p99 ms':>22} {'goodput/s':>10}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        lat, tput = s["latency_ms"], s["throughput"]
        lines.append(f"{name:<18} {tput['output_tokens_per_s']:>8.1f} "
                     f"{tput['requests_per_s']:>7.2f} {_pcts(lat['ttft']):>22} "
                     f"{_pcts(lat['itl']):>20} {_pcts(lat['e2e']):>22} "
                     f"{s['goodput']['requests_per_s']:>10.2f}")
    for name, s in summaries.items():
        if "chunk_gap" in s["latency_ms"]:  # what --stream-interval-ms bounds
            lines.append(f"{name:<18} gaps between a request's chunks p50/p90/p99 ms: "
                         f"{_pcts(s['latency_ms']['chunk_gap'])}")
    for name, s in summaries.items():  # (W6: prefix hits against the possible; a fleet
        # of several workers: their shares and prefix affinity; Redis commands a request)
        lines += [f"{name:<18} {note}" for note in s.get("notes", ())
                  if note.startswith(FLEET_NOTES)]
    return "\n".join(lines)


# The notes of a fleet run the summary table is followed by.
FLEET_NOTES = ("prefix cache hits", "tokens per worker", "Redis commands per request",
               "Redis round trips per request", "a step's output to Redis", "queue wait")


def format_cpu(summaries: dict[str, dict[str, Any]]) -> str:
    """CPU seconds each run's processes used, next to its wall time."""
    lines = []
    for name, s in summaries.items():
        used = ", ".join(f"{who} {v:.1f}" for who, v in s.get("cpu_s", {}).items()
                         if v is not None)
        preempted = ", ".join(f"{who} {n:,}" for who, n in s.get("preempted", {}).items()
                              if n is not None)
        taken = ", ".join(f"{who} {n:,}" for who, n in s.get("taken_over", {}).items()
                          if n is not None)
        share = steal_share(s)
        if used:
            lines.append(f"{name:<18} CPU s: {used} (in {s['duration_s']:.1f} s of wall time)"
                         + (f"; threads preempted: {preempted}" if preempted else "")
                         + (f"; step tasks taken over: {taken}" if taken else "")
                         + (f"; host steal {share:.0%}" if share is not None else "")
                         + _idle(s.get("idle_s")))
        if s.get("thread_cpu_s"):
            lines.append(f"{name:<18} CPU s by worker thread: {_by_thread(s['thread_cpu_s'])}")
        redis_s, tokens = s.get("cpu_s", {}).get("redis"), s.get("output_tokens")
        if redis_s is not None and tokens:  # the wire's cost (docs/redis.md), readers included
            lines.append(f"{name:<18} Redis CPU a generated token: {redis_s * 1e6 / tokens:.2f} "
                         "µs (the run's writers and its client reading every stream)")
    return "\n".join(lines)


# Threads that used less than this in a run are left out of the line (sleeping ones).
THREAD_CPU_SHOWN_S = 0.005


def _by_thread(used: dict[str, float]) -> str:
    """The worker's threads by CPU seconds, most first (an OpenMP team carries the name of
    the engine loop that started it: the engine's threads together)."""
    return ", ".join(f"{who} {v:.2f}" for who, v in sorted(used.items(), key=lambda kv: -kv[1])
                     if v >= THREAD_CPU_SHOWN_S)


def _idle(idle_s: list[float] | None) -> str:
    """Each CPU's idle seconds, as format_cpu appends them."""
    if not idle_s:
        return ""
    return "; CPUs idle " + "/".join(f"{v:.2f}" for v in idle_s) + " s"


def steal_share(run: dict[str, Any], cpus: int | None = None) -> float | None:
    """The share of the CPUs' time the host took during a run or repeat (its ``stolen_s``
    over its wall time on every CPU); None when unknown."""
    stolen, duration = run.get("stolen_s"), run.get("duration_s")
    cpus = cpus or os.cpu_count() or 1
    if stolen is None or not duration:
        return None
    return stolen / (duration * cpus)


def format_steal_note(summaries: dict[str, dict[str, Any]]) -> str:
    """A warning when the host took more than STEAL_FLAG of the CPUs from some repeat."""
    shares = [share for s in summaries.values() for r in (s.get("repeats") or [s])
              if (share := steal_share(r)) is not None]
    if not shares or max(shares) <= STEAL_FLAG:
        return ""
    return (f"note: the host took up to {max(shares):.0%} of the CPUs' time from a repeat "
            "(steal, /proc/stat): its figures measure the host as much as conveyor")


def format_repeats(summaries: dict[str, dict[str, Any]]) -> str:
    """Output tokens/s of every repeat, when there were several; and fleet / offline of each
    pair of repeats (run one after the other), whose spread is this machine's own noise
    beside the ratio of the medians."""
    lines = []
    tok_s: dict[str, list[float]] = {}
    for name, s in summaries.items():
        values = tok_s[name] = [r["output_tokens_per_s"] for r in s.get("repeats", [])]
        if len(values) > 1:
            lines.append(f"{name:<18} tok/s of each repeat: "
                         + ", ".join(f"{v:.1f}" for v in values))
            shares = [steal_share(r) for r in s["repeats"]]
            if None not in shares:
                lines.append(f"{name:<18} host steal of each repeat: "
                             + ", ".join(f"{v:.0%}" for v in shares))
    fleet, offline = tok_s.get("fleet", []), tok_s.get("offline", [])
    if len(fleet) > 1 and len(fleet) == len(offline) and all(offline):
        lines.append("fleet / offline    of each pair of repeats: "
                     + ", ".join(f"{f / o:.2f}" for f, o in zip(fleet, offline, strict=True)))
    return "\n".join(lines)


def format_comparisons(rows: list[dict[str, Any]]) -> str:
    """The ratio table; an aim shows as met or MISSED."""
    if not rows:
        return ""
    lines = []
    for r in rows:
        aim = ""
        if "aim" in r:
            aim = f"  (aim >= {r['aim']}: {'met' if r['met'] else 'MISSED'})"
        lines.append(f"{r['what']:<55} {r['numerator']:>9.1f} / {r['denominator']:>9.1f} "
                     f"= {r['ratio']:>6.2f}{aim}")
    return "\n".join(lines)


def _pcts(s: dict[str, float]) -> str:
    return "/".join(_num(s[f"p{q}"]) for q in (50, 90, 99))


def _num(v: float) -> str:
    if v is None or math.isnan(v):
        return "-"
    return f"{v:.0f}" if v >= 10 else f"{v:.1f}"
