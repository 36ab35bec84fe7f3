"""docker-compose.yml, the Dockerfile, Prometheus and Grafana files agree with the code:
the compose file is valid, runs real `conveyor` verbs, and every metric a panel queries is
exported by a live worker."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml
from fleet_fixtures import MODEL

from producer.client.client import Client
from worker.cli.command import build_parser

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DASHBOARDS = sorted((ROOT / "dashboards" / "grafana").glob("*.json"))
PROMETHEUS = ROOT / "dashboards" / "prometheus.yml"
PROVISIONING = ROOT / "dashboards" / "provisioning"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def conveyor_services() -> dict[str, dict]:
    """Services run from the image the Dockerfile builds (its entrypoint is `conveyor`)."""
    return {name: s for name, s in compose()["services"].items() if "build" in s}


def panel_exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query))
    return exprs


def metric_names(expr: str) -> set[str]:
    """conveyor_* series names in a PromQL expression (label values in quotes ignored)."""
    return set(re.findall(r"\b(conveyor_[A-Za-z0-9_:]*)", re.sub(r'"[^"]*"', '""', expr)))


def test_compose_file_validates_against_the_compose_spec():
    done = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         str(COMPOSE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_compose_runs_real_conveyor_verbs_and_options():
    services = conveyor_services()
    assert {"make-model", "worker", "gateway"} <= set(services)
    parser = build_parser()
    args = {name: parser.parse_args(s["command"]) for name, s in services.items()}
    made, worker = args["make-model"], args["worker"]
    assert made.command == "make-model" and worker.command == "worker"
    # The worker serves the folder the one-shot service makes, from a shared volume.
    assert worker.model == made.dir
    assert made.exist_ok  # a second `up` must not fail on the existing folder
    volume = made.dir.split("/")[1]
    assert any(v.endswith(f":/{volume}:ro") or v.endswith(f":/{volume}")
               for v in services["worker"]["volumes"])
    assert worker.redis.startswith("redis://redis:")
    assert worker.metrics_port == 9400
    assert services["worker"]["depends_on"]["make-model"]["condition"] == (
        "service_completed_successfully")
    gateway = args["gateway"]
    assert gateway.command == "gateway" and gateway.redis == worker.redis
    assert gateway.host == "0.0.0.0" and f"{gateway.port}:{gateway.port}" in (
        services["gateway"]["ports"])


def test_compose_bind_mounts_and_build_context_exist():
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
        if "build" in service:
            assert (ROOT / service["build"] / "Dockerfile").is_file()


def test_dockerfile_copies_existing_paths_and_runs_the_conveyor_script():
    text = DOCKERFILE.read_text()
    copies = re.findall(r"^COPY\s+(.+)$", text, flags=re.M)
    assert copies
    for line in copies:
        *sources, _dest = shlex.split(line)
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert 'ENTRYPOINT ["conveyor"]' in text
    assert "conveyor" in pyproject["project"]["scripts"]
    for extra in re.findall(r'pip install "\.\[([a-z,-]+)\]"', text):
        for name in extra.split(","):
            assert name in pyproject["project"]["optional-dependencies"]
    assert "torch==2.13.0" in text
    packages = set(pyproject["tool"]["setuptools"]["packages"]["find"]["include"])
    copied = {shlex.split(line)[0] for line in copies}
    assert {p.rstrip("*") for p in packages} <= copied


def test_prometheus_scrapes_each_worker_on_its_metrics_port():
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    sd = jobs["conveyor-workers"]["dns_sd_configs"][0]
    worker = build_parser().parse_args(conveyor_services()["worker"]["command"])
    assert sd["names"] == ["worker"] and sd["port"] == worker.metrics_port
    services = compose()["services"]
    mounts = services["prometheus"]["volumes"]
    assert "./dashboards/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_grafana_provisions_the_datasource_and_dashboards_the_panels_use():
    datasource = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in datasource["datasources"]}
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "conveyor.yml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert f"./dashboards/grafana:{path}:ro" in compose()["services"]["grafana"]["volumes"]
    assert DASHBOARDS
    for file in DASHBOARDS:
        dashboard = json.loads(file.read_text())
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        assert panels
        for panel in panels:
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] in uids


def test_dashboard_covers_throughput_latency_queues_load_kv_preemptions_and_prefix_hits():
    queried = {m for f in DASHBOARDS for e in panel_exprs(json.loads(f.read_text()))
               for m in metric_names(e)}
    assert {
        "conveyor_generation_tokens_total",
        "conveyor_time_to_first_token_seconds_bucket",
        "conveyor_inter_token_latency_seconds_bucket",
        "conveyor_queue_depth",
        "conveyor_queue_pending",
        "conveyor_requests_running",
        "conveyor_requests_waiting",
        "conveyor_requests_swapped",
        "conveyor_kv_blocks_used",
        "conveyor_preemptions_total",
        "conveyor_prefix_cache_hits_total",
    } <= queried


@pytest.mark.parametrize("dashboard_file", DASHBOARDS, ids=lambda p: p.name)
def test_every_metric_a_panel_queries_is_exported_by_a_live_worker_or_gateway(
        dashboard_file, redis_url, start_worker, gateway):
    worker = start_worker(metrics_port=0)
    client = Client(redis_url)
    client.result(client.submit([3, 4, 5], model=MODEL, max_tokens=4, ignore_eos=True),
                  timeout=60)
    body = json.dumps({"model": MODEL, "prompt": [3, 4], "max_tokens": 2}).encode()
    answered = urllib.request.Request(gateway.api + "/completions", data=body,
                                      headers={"Content-Type": "application/json"})
    urllib.request.urlopen(answered, timeout=60).read()
    exported = set()
    for url in (f"http://127.0.0.1:{worker.metrics_port}/metrics", gateway.url + "/metrics"):
        with urllib.request.urlopen(url, timeout=10) as resp:
            exported |= {line.split("{")[0].split(" ")[0]
                         for line in resp.read().decode().splitlines()
                         if not line.startswith("#")}
    dashboard = json.loads(dashboard_file.read_text())
    queried = {m for expr in panel_exprs(dashboard) for m in metric_names(expr)}
    assert queried, "no conveyor_* metric in any panel"
    assert queried - exported == set()


def test_a_panel_in_seconds_shows_its_other_series_in_their_own_unit():
    """A panel whose unit is seconds and that also draws a count (open streams, tokens)
    overrides that series' unit: 12 open streams must not read "12 s"."""
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text()).get("panels", []):
            config = panel.get("fieldConfig", {})
            if config.get("defaults", {}).get("unit") != "s":
                continue
            overridden = {o["matcher"].get("options") for o in config.get("overrides", [])}
            for target in panel.get("targets", []):
                if "seconds" not in target.get("expr", ""):
                    assert target.get("legendFormat") in overridden, (path.name,
                                                                      panel.get("title"))
