"""The summary of one compatibility run (scripts/compat.sh), from the tool's own report:
requests answered and failed, and the figures each tool leads with. Exits 1 when any
request failed or the report is missing. Usage: report.py TOOL WORK_DIR."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def guidellm(work: Path) -> bool:
    bench = json.loads((work / "guidellm.json").read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    print(f"guidellm: {totals['successful']} requests answered, {totals['errored']} errored, "
          f"{totals['incomplete']} incomplete ({bench['config']['strategy']['type_']})")
    lines = (work / "guidellm.out").read_text(errors="replace").splitlines()
    start = next((i for i, line in enumerate(lines) if "Request Latency Statistics" in line), None)
    print("\n".join(lines[start:start + 8] if start is not None else lines[-20:]))
    return totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] > 0


def aiperf(work: Path) -> bool:
    report = json.loads((work / "aiperf" / "profile_export_aiperf.json").read_text())
    count = int(report["request_count"]["avg"])
    errors = report.get("error_summary") or []
    print(f"aiperf: {count} requests answered, {len(errors)} kinds of error {errors}")
    for name in ("time_to_first_token", "inter_token_latency", "request_latency",
                 "output_token_throughput"):
        metric = report.get(name) or {}
        print(f"  {name}: avg {metric.get('avg', float('nan')):.1f}, "
              f"p99 {metric.get('p99', float('nan')):.1f} {metric.get('unit', '')}")
    return count > 0 and not errors


def lm_eval(work: Path) -> bool:
    table = [line for line in (work / "lm-eval.out").read_text(errors="replace").splitlines()
             if line.startswith("|")]
    print("\n".join(table))
    return any(re.search(r"\|\s*acc\s*\|", line) for line in table)


if __name__ == "__main__":
    tool, work = sys.argv[1], Path(sys.argv[2])
    check = {"guidellm": guidellm, "aiperf": aiperf, "lm-eval": lm_eval}[tool]
    try:
        ok = check(work)
    except (OSError, KeyError, IndexError, ValueError) as exc:
        print(f"{tool}: no readable report ({exc!r})")
        ok = False
    sys.exit(0 if ok else 1)
