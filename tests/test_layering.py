"""The house's layering, checked: which package may load which (docs/architecture.md).

Each contract imports every module of a package in a fresh interpreter and inspects
``sys.modules``: an import added anywhere, even deep inside a helper, breaks it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imports every module of the packages named in argv (all of a package's modules, found
# with pkgutil.walk_packages) except the ones listed after "--skip", then prints what
# got loaded: third-party top-level names and the project's own modules.
_PROBE = r"""
import importlib, json, pkgutil, sys
args = sys.argv[1:]
skip = set(args[args.index("--skip") + 1:]) if "--skip" in args else set()
packages = args[:args.index("--skip")] if "--skip" in args else args
imported = []
for name in packages:
    pkg = importlib.import_module(name)
    imported.append(name)
    for info in pkgutil.walk_packages(getattr(pkg, "__path__", []), prefix=name + "."):
        if info.name in skip or any(info.name.startswith(s + ".") for s in skip):
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
print(json.dumps({"imported": imported, "loaded": sorted(sys.modules)}))
"""

OWN = ("producer", "worker", "scheduler", "kvstore")


def probe(*packages: str, skip: tuple[str, ...] = ()) -> tuple[list[str], set[str]]:
    """(modules imported, modules loaded) after importing every module of ``packages``."""
    argv = [sys.executable, "-c", _PROBE, *packages]
    if skip:
        argv += ["--skip", *skip]
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return report["imported"], set(report["loaded"])


def top_level(loaded: set[str]) -> set[str]:
    return {name.split(".")[0] for name in loaded}


def assert_none_of(forbidden: set[str], loaded: set[str], package: str) -> None:
    """Fail naming what ``package`` loaded of ``forbidden``, and which module pulled it in."""
    leaked = forbidden & top_level(loaded)
    assert not leaked, f"importing {package} loads {sorted(leaked)}"


def own_packages(loaded: set[str]) -> set[str]:
    """Project packages loaded, at the depth the contracts speak of (producer.wire apart)."""
    out = set()
    for name in loaded:
        parts = name.split(".")
        if parts[0] in OWN:
            out.add("producer.wire" if parts[:2] == ["producer", "wire"] else parts[0])
    return out


def test_the_wire_types_load_neither_redis_nor_torch_nor_other_project_code():
    imported, loaded = probe("producer.wire")
    assert "producer.wire.protocol" in imported
    assert_none_of({"redis", "torch"}, loaded, "producer.wire")
    own = {n for n in loaded if n.split(".")[0] in OWN}
    assert own <= {"producer"} | {n for n in own if n.startswith("producer.wire")}, own


def test_scheduler_loads_only_the_wire_types_and_kv_bookkeeping():
    imported, loaded = probe("scheduler")
    assert "scheduler.scheduler" in imported
    assert_none_of({"redis", "torch"}, loaded, "scheduler")
    assert own_packages(loaded) <= {"scheduler", "kvstore", "producer.wire", "producer"}
    assert not {n for n in loaded if n.startswith("producer.") and
                not n.startswith("producer.wire")}


def test_kvstore_bookkeeping_loads_neither_redis_nor_torch():
    # kv_tensors owns the KV tensors (torch) and tier.redis_tier the fleet tier's Redis:
    # the two modules of kvstore allowed I/O.
    imported, loaded = probe("kvstore", skip=("kvstore.kv_tensors", "kvstore.tier.redis_tier"))
    assert "kvstore.kv_manager" in imported
    assert "kvstore.tier.header" in imported
    assert_none_of({"redis", "torch"}, loaded, "kvstore (but kv_tensors, tier.redis_tier)")
    assert own_packages(loaded) <= {"kvstore"}


def test_producer_loads_no_torch_and_nothing_of_the_worker():
    imported, loaded = probe("producer")
    assert {"producer.client.client", "producer.client.async_client",
            "producer.bulk.analyze"} <= set(imported)
    assert_none_of({"torch"}, loaded, "producer")
    assert own_packages(loaded) <= {"producer", "producer.wire"}


def test_import_producer_alone_loads_the_wire_types_only():
    code = ("import json, sys, producer; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_none_of({"redis", "torch", "rq"}, set(json.loads(result.stdout)), "producer")


def test_the_cli_builds_its_whole_parser_without_torch():
    code = ("import sys, worker.cli.command; worker.cli.command.build_parser(); "
            "sys.exit('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr or "building the CLI parser loaded torch"


def test_scheduler_tests_pass_where_importing_torch_fails():
    # Blocked in sys.modules, `import torch` raises ImportError, in the tests and the conftest.
    code = ("import sys; sys.modules['torch'] = None; "
            "import pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider',"
            " 'tests/test_scheduler.py', 'tests/test_kv_properties.py']))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "error" not in result.stdout.lower()


@pytest.mark.parametrize("module", ["worker.engine.config", "worker.fleet.config",
                                    "worker.cli.worker_verbs"])
def test_worker_settings_and_verbs_load_no_torch(module):
    _, loaded = probe(module)
    assert_none_of({"torch"}, loaded, module)


def test_the_kv_tiers_redis_module_loads_no_torch():
    # Workers and tools that only move tier bytes need not load torch for it.
    imported, loaded = probe("kvstore.tier.redis_tier")
    assert_none_of({"torch"}, loaded, "kvstore.tier.redis_tier")
    assert own_packages(loaded) <= {"kvstore"}


# The house's size rules: a reader finds a thing by its folder, and one job per file.
MAX_MODULES_PER_PACKAGE = 10
MAX_ENGINE_FILE_LINES = 300


def test_every_package_level_holds_at_most_ten_modules():
    crowded = {}
    for package in OWN:
        for folder in [ROOT / package, *(ROOT / package).rglob("*/")]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if (folder / "__init__.py").exists() and len(modules) > MAX_MODULES_PER_PACKAGE:
                crowded[str(folder.relative_to(ROOT))] = len(modules)
    assert not crowded, crowded


def test_every_engine_file_is_at_most_300_lines():
    long = {p.name: n for p in (ROOT / "worker" / "engine").glob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_ENGINE_FILE_LINES}
    assert not long, long
