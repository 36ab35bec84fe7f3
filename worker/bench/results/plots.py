"""PNG plots of a benchmark: latency CDFs, tokens per second over time, KV use over time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from worker.bench.results import metrics
from worker.bench.results.records import RunResult

PLOT_FILES = ("latency_cdf.png", "tokens_per_s.png", "kv_usage.png")


def write_plots(runs: list[RunResult], out_dir: Path, title: str) -> list[str]:
    """Write the three plots into ``out_dir``; returns their file names."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("conveyor bench plots need matplotlib: pip install 'conveyor[worker]'"
                           ) from exc
    matplotlib.use("Agg")  # files only: no display needed, and no GUI toolkit imported
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    _latency_cdfs(plt, ticker, runs, out_dir / PLOT_FILES[0], title)
    _tokens_per_s(plt, runs, out_dir / PLOT_FILES[1], title)
    _kv_usage(plt, runs, out_dir / PLOT_FILES[2], title)
    return list(PLOT_FILES)


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    s = sorted(values)
    return s, [(i + 1) / len(s) for i in range(len(s))]


def _latency_cdfs(plt: Any, ticker: Any, runs: list[RunResult], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    kinds = [("TTFT", metrics.ttft), ("ITL", None), ("E2E", metrics.e2e)]
    for ax, (name, fn) in zip(axes, kinds, strict=True):
        for run in runs:
            ok = [r for r in run.records if r.ok]
            if fn is None:
                values = [g for r in ok for g in metrics.itls(r)]
            else:
                values = [v for r in ok if (v := fn(r)) is not None]
            values = [v * 1000 for v in values if v > 0]  # log axis: drop exact zeros
            if values:
                ax.plot(*_cdf(values), label=run.name, drawstyle="steps-post")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("fraction of " + ("tokens" if name == "ITL" else "requests"))
        ax.set_ylim(0, 1.01)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"{name} CDF")
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _tokens_per_s(plt: Any, runs: list[RunResult], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in runs:
        series = metrics.tokens_over_time(run.records, run.duration_s)
        ax.plot([t for t, _ in series], [v for _, v in series], label=run.name, marker=".")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Throughput over time: {title}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _kv_usage(plt: Any, runs: list[RunResult], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(10, 4.5))
    plotted = False
    for run in runs:
        if not run.kv:
            continue
        total = max(1, max(s.blocks_total for s in run.kv))
        ax.plot([s.t for s in run.kv], [100 * s.blocks_used / total for s in run.kv],
                label=f"{run.name} ({total} blocks)", drawstyle="steps-post", marker=".")
        plotted = True
    if not plotted:
        ax.text(0.5, 0.5, "no KV samples (hf-static has no paged KV pool)", ha="center",
                transform=ax.transAxes)
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("KV blocks in use (% of the pool)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"KV cache use over time: {title}")
    ax.grid(True, alpha=0.3)
    if plotted:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
