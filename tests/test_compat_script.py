"""scripts/compat.sh (real OpenAI clients against a local fleet: run by hand, outside CI, as
its tools are heavy): the script parses, its lm-eval task reads local files only, and its
reports fail a run where any request failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPAT = ROOT / "scripts" / "compat"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "compat.sh")], check=True)


def test_the_lm_eval_task_is_local_and_well_formed():
    task = yaml.safe_load((COMPAT / "conveyor_mc.yaml").read_text())
    assert task["output_type"] == "multiple_choice" and task["dataset_path"] == "json"
    data = ROOT / task["dataset_kwargs"]["data_files"]["test"]
    items = [json.loads(line) for line in data.read_text().splitlines()]
    assert items and all(0 <= it["answer"] < len(it["choices"]) for it in items)


def report(tool: str, work: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(COMPAT / "report.py"), tool, str(work)],
                          capture_output=True, text=True)


def test_reports_fail_a_run_with_a_failed_request(tmp_path):
    def guidellm(errored: int) -> None:
        totals = {"successful": 10 - errored, "errored": errored, "incomplete": 0}
        (tmp_path / "guidellm.json").write_text(json.dumps({"benchmarks": [{
            "config": {"strategy": {"type_": "synchronous"}},
            "metrics": {"request_totals": totals}}]}))
        (tmp_path / "guidellm.out").write_text("done\n")

    guidellm(0)
    assert report("guidellm", tmp_path).returncode == 0
    guidellm(1)
    assert report("guidellm", tmp_path).returncode == 1
    (tmp_path / "aiperf").mkdir()
    aiperf = {"request_count": {"avg": 20.0}, "error_summary": [{"code": 400}]}
    (tmp_path / "aiperf" / "profile_export_aiperf.json").write_text(json.dumps(aiperf))
    assert report("aiperf", tmp_path).returncode == 1
    (tmp_path / "lm-eval.out").write_text("|conveyor_mc|1|none|0|acc|↑|0.25|±|0.16|\n")
    assert report("lm-eval", tmp_path).returncode == 0
    assert report("lm-eval", tmp_path / "missing").returncode == 1
