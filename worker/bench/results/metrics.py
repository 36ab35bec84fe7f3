"""Latency percentiles, throughput and goodput from what a run recorded (pure math, no I/O).

Definitions (client side, every time measured where the client saw it):
- TTFT: submit to the first output chunk.
- ITL: gap between consecutive chunks of one request, shared evenly among the chunk's tokens.
- TPOT: a request's mean ITL, (last chunk - first chunk) / (tokens - 1).
- E2E: submit to the final entry.
- Goodput: requests per second that met both SLOs: TTFT <= slo_ttft and TPOT <= slo_itl
  (the per-request ITL SLO of DistServe and vLLM's benchmark; one stall does not fail it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from worker.bench.results.records import RequestRecord, RunResult

# p99.9 shows a stall that only a few hundred of W2's ~12,000 token gaps see.
PERCENTILES = (50, 90, 99, 99.9)


@dataclass(frozen=True)
class SLO:
    """Latency objectives of one request, in seconds."""

    ttft_s: float
    itl_s: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between closest ranks (numpy's); NaN if empty."""
    import numpy as np  # here: `conveyor`'s other verbs load this module without numpy

    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    return float(np.percentile(values, q))


def bucket_quantile(before: dict[float, float], after: dict[float, float],
                    q: float) -> float | None:
    """The q-quantile (0-1) of what a Prometheus histogram counted between two readings of
    its cumulative buckets: the upper bound of the bucket it falls in (inf: past the
    last); None when nothing was counted."""
    bounds = sorted(after)
    counted = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counted or counted[-1] <= 0:
        return None
    target = q * counted[-1]
    return next(b for b, n in zip(bounds, counted, strict=True) if n >= target)


def summarize_ms(values_s: Sequence[float]) -> dict[str, float | int]:
    """p50/p90/p99/p99.9, mean and max of seconds, in milliseconds (rounded to 0.01 ms)."""
    out: dict[str, float | int] = {"count": len(values_s)}
    for q in PERCENTILES:
        out[f"p{q:g}"] = _ms(percentile(values_s, q))
    out["mean"] = _ms(sum(values_s) / len(values_s)) if values_s else math.nan
    out["max"] = _ms(max(values_s)) if values_s else math.nan
    return out


def ttft(r: RequestRecord) -> float | None:
    return r.chunks[0][0] - r.submit_s if r.chunks else None


def e2e(r: RequestRecord) -> float | None:
    return r.finish_s - r.submit_s if r.finish_s is not None else None


def itls(r: RequestRecord) -> list[float]:
    """Per-token gaps after the first chunk; a chunk of k tokens gives k gaps of gap/k."""
    gaps = []
    for (t0, _), (t1, n) in zip(r.chunks, r.chunks[1:], strict=False):
        gaps.extend([(t1 - t0) / n] * n)
    return gaps


def chunk_gaps(r: RequestRecord) -> list[float]:
    """Gaps between consecutive chunks as a reader sees them (what --stream-interval-ms
    bounds: at most the interval plus a step where tokens keep coming)."""
    return [t1 - t0 for (t0, _), (t1, _) in zip(r.chunks, r.chunks[1:], strict=False)]


def tpot(r: RequestRecord) -> float | None:
    n = r.output_tokens
    if n < 2:
        return None
    return (r.chunks[-1][0] - r.chunks[0][0]) / (n - 1)


def meets_slo(r: RequestRecord, slo: SLO) -> bool:
    """Finished cleanly, first token within slo.ttft_s and mean ITL within slo.itl_s."""
    if not r.ok:
        return False
    first, mean_itl = ttft(r), tpot(r)
    return first is not None and first <= slo.ttft_s and (mean_itl is None or mean_itl <= slo.itl_s)


def goodput(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, float]:
    """Requests meeting both SLOs: how many, per second of the run, and as a share."""
    good = sum(meets_slo(r, slo) for r in records)
    return {"requests": good, "requests_per_s": _rate(good, duration_s),
            "fraction": round(good / len(records), 4) if records else math.nan}


def latency(records: Sequence[RequestRecord]) -> dict[str, dict[str, float | int]]:
    """TTFT, ITL, TPOT and E2E summaries over the requests that finished cleanly."""
    ok = [r for r in records if r.ok]
    return {
        "ttft": summarize_ms([v for r in ok if (v := ttft(r)) is not None]),
        "itl": summarize_ms([g for r in ok for g in itls(r)]),
        "chunk_gap": summarize_ms([g for r in ok for g in chunk_gaps(r)]),
        "tpot": summarize_ms([v for r in ok if (v := tpot(r)) is not None]),
        "e2e": summarize_ms([v for r in ok if (v := e2e(r)) is not None]),
    }


def throughput(records: Sequence[RequestRecord], duration_s: float) -> dict[str, float]:
    """Output tokens, all tokens (prompt + output) and finished requests per second."""
    out_tokens = sum(r.output_tokens for r in records)
    all_tokens = out_tokens + sum(r.prompt_tokens for r in records if r.ok)
    return {"output_tokens_per_s": _rate(out_tokens, duration_s),
            "total_tokens_per_s": _rate(all_tokens, duration_s),
            "requests_per_s": _rate(sum(r.ok for r in records), duration_s)}


def tokens_over_time(records: Sequence[RequestRecord], duration_s: float,
                     bins: int = 40) -> list[tuple[float, float]]:
    """(bin centre s, output tokens/s in that bin) over the run, for the throughput plot."""
    width = max(duration_s, 1e-6) / bins
    counts = [0] * bins
    for r in records:
        for t, n in r.chunks:
            counts[min(bins - 1, max(0, int(t / width)))] += n
    return [(round((i + 0.5) * width, 4), round(c / width, 2)) for i, c in enumerate(counts)]


def summarize_run(run: RunResult, slo: SLO) -> dict[str, Any]:
    """The JSON summary of one run (everything but the raw per-request records)."""
    recs = run.records
    summary: dict[str, Any] = {
        "settings": run.settings,
        "duration_s": round(run.duration_s, 4),
        "requests": len(recs),
        "completed": sum(r.ok for r in recs),
        "errors": sum(r.error is not None for r in recs),
        "output_tokens": sum(r.output_tokens for r in recs),
        "throughput": throughput(recs, run.duration_s),
        "latency_ms": latency(recs),
        "goodput": goodput(recs, run.duration_s, slo),
        "tokens_per_s_over_time": tokens_over_time(recs, run.duration_s),
        "kv": kv_summary(run),
        "cpu_s": run.cpu_s,
        "preempted": run.preempted,
        "taken_over": run.taken_over,
        "thread_cpu_s": run.thread_cpu_s,
        "stolen_s": run.stolen_s,
        "idle_s": run.idle_s,
        "simulated_busy_s": run.simulated_busy_s,
        "notes": run.notes,
    }
    if run.transfers.get("kv_put_count"):  # handoffs happened (a disaggregated run)
        summary["kv_transfer"] = transfer_summary(run)
    groups = sorted({r.group for r in recs})
    if len(groups) > 1:
        summary["groups"] = {g: {"requests": sum(r.group == g for r in recs),
                                 "latency_ms": latency([r for r in recs if r.group == g])}
                             for g in groups}
    return summary


def transfer_summary(run: RunResult) -> dict[str, Any]:
    """KV moved through the tier in a disaggregated run: totals, and the time one
    document's KV takes to put and get at the run's measured rates (the tier's seconds are
    summed over all handoffs, so a document's share is taken in proportion to its bytes)."""
    t = run.transfers
    put_b, get_b = t.get("kv_put_bytes", 0), t.get("kv_get_bytes", 0)
    out: dict[str, Any] = {
        "handoffs_put": int(t.get("kv_put_count", 0)),
        "handoffs_got": int(t.get("kv_get_count", 0)),
        "mb_put": round(put_b / 1e6, 3),
        "put_s": round(t.get("kv_put_s", 0), 4),
        "get_s": round(t.get("kv_get_s", 0), 4),
    }
    tokens = t.get("kv_imported_tokens", 0)
    docs = [r for r in run.records if r.group == "document"]
    if tokens and get_b and put_b and docs:
        bytes_per_token = get_b / tokens
        doc_bytes = bytes_per_token * sum(r.prompt_tokens for r in docs) / len(docs)
        out["document_mb"] = round(doc_bytes / 1e6, 3)
        out["document_put_ms"] = round(1000 * t["kv_put_s"] * doc_bytes / put_b, 2)
        out["document_get_ms"] = round(1000 * t["kv_get_s"] * doc_bytes / get_b, 2)
    return out


def kv_summary(run: RunResult) -> dict[str, Any]:
    """Peak KV use and the samples (t, used, total) behind the KV plot."""
    if not run.kv:
        return {"samples": []}
    peak = max(run.kv, key=lambda s: s.blocks_used)
    return {"peak_blocks_used": peak.blocks_used, "blocks_total": peak.blocks_total,
            "peak_fraction": round(peak.blocks_used / max(1, peak.blocks_total), 4),
            "samples": [[round(s.t, 3), s.blocks_used, s.blocks_total, s.running, s.waiting]
                        for s in run.kv]}


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """One compact row per request, for the JSON file."""
    rows = []
    for r in records:
        first, end, mean_itl = ttft(r), e2e(r), tpot(r)
        rows.append({"index": r.index, "group": r.group, "prompt_tokens": r.prompt_tokens,
                     "max_tokens": r.max_tokens, "output_tokens": r.output_tokens,
                     "submit_s": round(r.submit_s, 4),
                     "ttft_ms": _ms(first) if first is not None else None,
                     "tpot_ms": _ms(mean_itl) if mean_itl is not None else None,
                     "e2e_ms": _ms(end) if end is not None else None,
                     "finish_reason": r.finish_reason, "error": r.error})
    return rows


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2) if not math.isnan(seconds) else math.nan


def _rate(n: float, duration_s: float) -> float:
    return round(n / duration_s, 3) if duration_s > 0 else math.nan
