"""The house's layering, checked: which package may load which (docs/architecture.md).

Each contract imports every module of a package in a fresh interpreter and inspects
``sys.modules``: an import added anywhere, even deep inside a helper, breaks it.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Runs import jobs, each in a fresh copy of one interpreter: the request (JSON in argv) names
# modules to load first ("preload": torch, which most of the worker may load and which takes
# most of an interpreter's start) and the jobs; each job is run in a child forked from that
# interpreter, so what a job loads is its own and the preload is paid once. A job imports
# every module of its packages (every .py file of the package's folders) but those it
# skips, then reports what got loaded: third-party top-level names and the project's own
# modules. "extend" [PKG, DIR] first adds DIR to PKG's search path: a test plants a module
# there to break a contract.
_PROBE = r"""
import importlib, json, os, sys, traceback

def modules(name):
    # From the files, not pkgutil.walk_packages: that imports every subpackage to walk it,
    # skipped ones too. __main__ modules run a program: never imported.
    pkg = importlib.import_module(name)
    yield name
    for base in getattr(pkg, "__path__", []):
        for folder, dirs, files in os.walk(base):
            rel = os.path.relpath(folder, base)
            parts = [] if rel == "." else rel.split(os.sep)
            if parts and not os.path.isfile(os.path.join(folder, "__init__.py")):
                dirs[:] = []
                continue
            for f in sorted(files):
                if f.endswith(".py") and f != "__main__.py":
                    stem = [] if f == "__init__.py" else [f[:-3]]
                    if parts or stem:
                        yield ".".join([name, *parts, *stem])

def run(job):
    if job["extend"]:
        importlib.import_module(job["extend"][0]).__path__.append(job["extend"][1])
    skip = set(job["skip"])
    imported = []
    for name in job["packages"]:
        for module in modules(name):
            if module in skip or any(module.startswith(s + ".") for s in skip):
                continue
            importlib.import_module(module)
            imported.append(module)
    packages = sorted(n for n, m in sys.modules.items() if hasattr(m, "__path__"))
    return {"imported": imported, "loaded": sorted(sys.modules), "packages": packages}

request = json.loads(sys.argv[1])
for name in request["preload"]:
    importlib.import_module(name)
reports = []
for job in request["jobs"]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            out = {"report": run(job)}
        except BaseException:
            out = {"error": traceback.format_exc()}
        with os.fdopen(write, "w") as pipe:
            json.dump(out, pipe)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        reports.append(json.load(pipe))
    os.waitpid(pid, 0)
print(json.dumps(reports))
"""

OWN = ("producer", "worker", "scheduler", "kvstore")


@dataclass(frozen=True)
class Job:
    """Import every module of ``packages`` but ``skip``; ``torch_allowed``: the job may run
    where torch is loaded already (what it loads of the project is the same)."""

    packages: tuple[str, ...]
    skip: tuple[str, ...] = ()
    extend: tuple[str, str] | None = None
    torch_allowed: bool = False


@dataclass(frozen=True)
class Report:
    imported: list[str]
    loaded: set[str]
    packages: set[str]


def run_jobs(jobs: list[Job]) -> list[Report]:
    """Each job's report, in order: at most two interpreters (one with torch preloaded)."""
    reports: dict[int, Report] = {}
    for preload in ((), ("torch",)):
        batch = [(i, job) for i, job in enumerate(jobs)
                 if job.torch_allowed == bool(preload)]
        if not batch:
            continue
        request = {"preload": list(preload), "jobs": [
            {"packages": list(j.packages), "skip": list(j.skip),
             "extend": list(j.extend) if j.extend else None} for _, j in batch]}
        result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(request)], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        for (i, _), out in zip(batch, json.loads(result.stdout.strip().splitlines()[-1]),
                               strict=True):
            assert "error" not in out, out.get("error")
            report = out["report"]
            reports[i] = Report(report["imported"], set(report["loaded"]),
                                set(report["packages"]))
    return [reports[i] for i in range(len(jobs))]


def probe(*packages: str, skip: tuple[str, ...] = (),
          torch_allowed: bool = False) -> tuple[list[str], set[str]]:
    """(modules imported, modules loaded) after importing every module of ``packages``."""
    report = run_jobs([Job(packages, skip, torch_allowed=torch_allowed)])[0]
    return report.imported, report.loaded


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


# ----- the contracts: each folder, what of the project and of the world it may load -----

# A contract names a folder, the folders its modules may load ("X/" is X with every folder
# under it) and the third-party packages they must not load. Only plain modules count: a
# package's __init__ is loaded on the way to its modules, and whatever it imports shows up
# as modules of its own. Each contract imports every module of its folder in a fresh
# interpreter: an import added anywhere, even deep inside a helper, breaks it.
ENGINE_BELOW = ("worker.models", "worker.attention", "worker.sampling", "worker.host",
                "kvstore/", "producer.wire", "producer")
NO_IO = frozenset({"redis", "rq", "torch"})
NO_REDIS = frozenset({"redis", "rq"})
NO_TORCH = frozenset({"torch"})
CONTRACTS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "producer.wire": (("producer.wire",), NO_IO),
    "scheduler": (("scheduler", "kvstore", "producer.wire"), NO_IO),
    "producer/": (("producer/",), NO_TORCH),
    "producer.redis": (("producer.redis", "producer.wire", "producer"), NO_TORCH),
    # Prefix affinity's keys and placement: pure functions the clients call.
    "producer.affinity": (("producer.affinity", "producer.wire", "producer"), NO_IO),
    "producer.client": (("producer.client", "producer.affinity", "producer.redis",
                         "producer.wire", "producer"), NO_TORCH),
    "producer.bulk": (("producer.bulk", "producer.client", "producer.affinity", "producer.redis",
                       "producer.wire", "producer"), NO_TORCH),
    "producer.gateway": (("producer.gateway", "producer.client", "producer.affinity",
                          "producer.redis", "producer.wire", "producer"), NO_TORCH),
    # worker/__init__ re-exports the wire types: every worker folder may load them.
    "worker.host": (("worker.host", "producer.wire", "producer"), NO_REDIS),
    "worker.modelgen": (("worker.modelgen", "producer.wire", "producer"), NO_REDIS),
    "worker.models": (ENGINE_BELOW, NO_REDIS),
    "worker.attention": (ENGINE_BELOW, NO_REDIS),
    "worker.sampling": (ENGINE_BELOW, NO_REDIS),
    "worker.engine": (("worker.engine", "scheduler", *ENGINE_BELOW), NO_REDIS),
    # The fleet drives engines; only the CLI and the benchmarks stand above it.
    "worker.fleet": (("worker.fleet/", "worker.engine", "scheduler", *ENGINE_BELOW,
                      "producer/"), frozenset()),
    "worker.cli": (("worker/", "scheduler", "kvstore/", "producer/"), frozenset()),
    "worker.bench": (("worker/", "scheduler", "kvstore/", "producer/"), frozenset()),
}
# Folders whose contracts are written out below (kvstore: two of its modules may do I/O).
CHECKED_ELSEWHERE = {"worker", "kvstore", "kvstore.tier"}


def folder_of(module: str, packages: set[str]) -> str:
    """The folder a plain module sits in (a package is its own folder); producer.wire's
    folders are one layer (its tools folder is the wire's as much as its top)."""
    folder = module if module in packages else module.rpartition(".")[0]
    return "producer.wire" if folder.startswith("producer.wire.") else folder


def allowed(folder: str, rules: tuple[str, ...]) -> bool:
    return any(folder == r or (r.endswith("/") and (folder == r[:-1] or
                                                     folder.startswith(r[:-1] + ".")))
               for r in rules)


def contract_job(contract: str, extend: tuple[str, Path] | None = None) -> Job:
    _, forbidden = CONTRACTS[contract]
    return Job((contract.removesuffix("/"),),
               extend=(extend[0], str(extend[1])) if extend is not None else None,
               torch_allowed="torch" not in forbidden)


@functools.cache
def contract_reports() -> dict[str, Report]:
    """Every contract's report, made in one go the first time a test asks."""
    contracts = sorted(CONTRACTS)
    return dict(zip(contracts, run_jobs([contract_job(c) for c in contracts]), strict=True))


def breaches(contract: str, report: Report) -> list[str]:
    """What importing every module of the contract's folder loaded outside the contract:
    project modules (with the folder each belongs to) and forbidden packages."""
    package = contract.removesuffix("/")
    rules, forbidden = CONTRACTS[contract]
    loaded, packages = report.loaded, report.packages
    own = {m for m in loaded if m.split(".")[0] in OWN and m not in packages}
    inside = (package, f"{package}/") if contract.endswith("/") else (package,)
    found = sorted(f"{m} ({folder_of(m, packages)})" for m in own
                   if not allowed(folder_of(m, packages), (*rules, *inside)))
    return found + sorted(forbidden & top_level(loaded))


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_each_folder_loads_only_what_its_contract_allows(contract):
    assert breaches(contract, contract_reports()[contract]) == []


def test_every_folder_of_the_house_has_a_contract():
    folders = {".".join(p.relative_to(ROOT).parts) for top in OWN
               for p in [ROOT / top, *(ROOT / top).rglob("*")]
               if p.is_dir() and (p / "__init__.py").is_file()}
    covered = {c.removesuffix("/") for c in CONTRACTS} | CHECKED_ELSEWHERE
    uncovered = {f for f in folders
                 if not any(f == c or f.startswith(c + ".") for c in covered)}
    assert not uncovered, f"folders without a layering contract: {sorted(uncovered)}"


def test_an_arrow_back_up_breaks_the_contract(tmp_path):
    # A module planted in the engine's folder that imports the fleet above it.
    (tmp_path / "arrow_back_up.py").write_text("import worker.fleet.engine_loop\n")
    planted = run_jobs([contract_job("worker.engine", extend=("worker.engine", tmp_path))])[0]
    found = breaches("worker.engine", planted)
    assert any(b.startswith("worker.fleet.engine_loop ") for b in found), found
    assert "redis" in found  # and the fleet's Redis with it


def test_the_benchmarks_and_the_cli_are_reached_from_nothing_below_them():
    loaded = probe("producer", "scheduler", "kvstore", "worker",
                   skip=("worker.cli", "worker.bench"), torch_allowed=True)[1]
    assert not {m for m in loaded if m.startswith(("worker.bench", "worker.cli"))}


def test_kvstore_bookkeeping_loads_neither_redis_nor_torch():
    # kv_tensors owns the KV tensors (torch) and tier.redis_tier the fleet tier's Redis:
    # the two modules of kvstore allowed I/O.
    imported, loaded = probe("kvstore", skip=("kvstore.kv_tensors", "kvstore.tier.redis_tier"))
    assert "kvstore.kv_manager" in imported
    assert "kvstore.tier.header" in imported
    assert_none_of({"redis", "torch"}, loaded, "kvstore (but kv_tensors, tier.redis_tier)")
    assert own_packages(loaded) <= {"kvstore"}


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
    # Its key names come from the one key builder (producer.wire.keys), a shared wire type
    # like the scheduler's: exactly producer.wire, nothing else of the producer.
    assert own_packages(loaded) <= {"kvstore", "producer.wire", "producer"}
    assert not {n for n in loaded if n.startswith("producer.") and
                not n.startswith("producer.wire")}


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
