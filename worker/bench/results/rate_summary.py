"""One figure across W5 runs at several document rates: mixed against disaggregated.

    python -m worker.bench.results.rate_summary RESULTS_DIR... --out docs/img/w5_rates.png

Each RESULTS_DIR is a `conveyor bench --workload w5 --disaggregate` folder (its
results.json); the figure shows, per document rate and system, the interactive requests'
ITL p99, the documents' TTFT p50 and the goodput, so where each system wins reads at a
glance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PANELS = (
    ("interactive ITL p99 (ms, log scale)", lambda run: run["groups"]["interactive"]
     ["latency_ms"]["itl"]["p99"], True),
    ("document TTFT p50 (ms)", lambda run: run["groups"]["document"]["latency_ms"]["ttft"]
     ["p50"], False),
    ("goodput (requests/s within both SLOs)", lambda run: run["goodput"]["requests_per_s"],
     False),
)


def rate_rows(folders: list[Path]) -> list[tuple[float, dict[str, Any]]]:
    """(document rate, runs by system name) of each folder, by rate."""
    rows = []
    for folder in folders:
        results = json.loads((Path(folder) / "results.json").read_text())
        if results["workload"]["name"] != "w5" or set(results["runs"]) != {
                "mixed", "disaggregated"}:
            raise ValueError(f"{folder} is not a `--workload w5 --disaggregate` run")
        rows.append((float(results["arguments"]["doc_rate"]), results["runs"]))
    return sorted(rows, key=lambda row: row[0])


def write_rate_summary(folders: list[Path], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rate_rows(folders)
    rates = [rate for rate, _ in rows]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(15, 4.2))
    for ax, (label, value, log) in zip(axes, PANELS, strict=True):
        for system, marker in (("mixed", "o"), ("disaggregated", "s")):
            ax.plot(rates, [value(runs[system]) for _, runs in rows], marker=marker,
                    label=system)
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("documents arriving per second")
        ax.set_title(label, fontsize="medium")
        ax.set_xticks(rates)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("W5: two mixed workers against one prefill + one decode worker")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path, help="w5 --disaggregate results")
    parser.add_argument("--out", type=Path, default=Path("w5_rates.png"),
                        help="the PNG to write")
    args = parser.parse_args(argv)
    print(write_rate_summary(args.folders, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
