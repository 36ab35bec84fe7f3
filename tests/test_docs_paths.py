"""Every module, name and file the docs point at exists, and the two walk-through docs stay short.

The README, docs/*.md and scripts/*.sh name modules (`python -m X`, imports in code blocks,
backticked `worker.engine.config.EngineConfig`) and files (`worker/engine/engine.py`). A move
that forgets one of them breaks a reader's command, so all of them are checked here: the
modules are imported in one fresh interpreter (torch may load), names resolved in it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OWN = ("producer", "worker", "scheduler", "kvstore")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))

# Line limits of the docs that walk the house and state the figures (issue 38).
MAX_ARCHITECTURE_LINES = 250
MAX_BENCHMARKS_LINES = 400

# A name no module has: the probe must report it, or the check itself is broken.
MISSING_MODULE = "worker.engine.no_such_module"
MISSING_NAME = "producer.client.client.NoSuchName"

_OWN_ALT = "|".join(OWN)
_RUN_MODULE = re.compile(r"(?:python[\w.]*|py|PY)\"?\s+-m\s+([A-Za-z_][\w.]*)")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
_FROM_IMPORT = re.compile(r"^\s*from\s+([\w.]+)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
_IMPORT = re.compile(r"^\s*import\s+([\w., ]+)", re.M)
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(rf"^(?:{_OWN_ALT})(?:\.\w+)+(?::\w+)?(?:\(\))?$")
_FILE_SPAN = re.compile(rf"^(?:{_OWN_ALT})/[\w./-]+$")
_FILE_IN_SCRIPT = re.compile(rf"\b(?:{_OWN_ALT})/[\w/-]+\.(?:py|cpp|h)\b")

# Runs in a fresh interpreter: imports each module, resolves each dotted name, and prints
# {"kind:name": error} for every one that fails, as one JSON line.
_PROBE = r"""
import dataclasses, importlib, importlib.util, json, sys

def import_longest(parts):
    # The longest importable prefix: a missing submodule reads as an attribute to resolve.
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        try:
            return importlib.import_module(name), parts[end:]
        except ModuleNotFoundError as e:
            if name != e.name and not name.startswith(f"{e.name}."):
                raise
    raise ModuleNotFoundError(parts[0])

def resolve(dotted):
    module_part, _, attr = dotted.partition(":")
    obj, rest = import_longest(module_part.split("."))
    for part in rest + ([attr] if attr else []):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif dataclasses.is_dataclass(obj) and part in {f.name for f in dataclasses.fields(obj)}:
            return
        else:
            raise AttributeError(f"{obj!r} has no {part!r}")

def runnable(name):
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise ModuleNotFoundError(name)
    if spec.submodule_search_locations is not None:
        if importlib.util.find_spec(name + ".__main__") is None:
            raise ModuleNotFoundError(name + ".__main__ (python -m needs one)")
    if name.split(".")[0] in OWN:
        importlib.import_module(name)

OWN = set(sys.argv[2:])
failures = {}
for kind, name in json.loads(sys.argv[1]):
    try:
        if kind == "run":
            runnable(name)
        elif kind == "import":
            importlib.import_module(name)
        else:
            resolve(name)
    except Exception as e:
        failures[f"{kind}:{name}"] = f"{type(e).__name__}: {e}"
print(json.dumps(failures))
"""


def _where(path: Path, text: str, pos: int) -> str:
    return f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, pos) + 1}"


def _import_names(clause: str) -> list[str]:
    clause = clause.strip().strip("()")
    return [n.split(" as ")[0].strip() for n in clause.split(",") if n.strip()]


def collect() -> dict[str, dict[str, list[str]]]:
    """{kind: {name: [file:line, ...]}} for kind run, import, name and file."""
    found: dict[str, dict[str, list[str]]] = {"run": {}, "import": {}, "name": {}, "file": {}}

    def add(kind: str, name: str, where: str) -> None:
        found[kind].setdefault(name, []).append(where)

    for path in DOCS + SCRIPTS:
        text = path.read_text()
        for m in _RUN_MODULE.finditer(text):
            add("run", m.group(1).rstrip("."), _where(path, text, m.start()))
        if path.suffix == ".sh":
            for m in _FILE_IN_SCRIPT.finditer(text):
                add("file", m.group(0), _where(path, text, m.start()))
            continue
        for fence in _FENCE.finditer(text):
            block, start = fence.group(1), fence.start(1)
            for m in _FROM_IMPORT.finditer(block):
                if m.group(1).split(".")[0] not in OWN:
                    continue
                where = _where(path, text, start + m.start())
                add("import", m.group(1), where)
                for name in _import_names(m.group(2)):
                    add("name", f"{m.group(1)}.{name}", where)
            for m in _IMPORT.finditer(block):
                for name in _import_names(m.group(1)):
                    if name.split(".")[0] in OWN:
                        add("import", name, _where(path, text, start + m.start()))
        for m in _CODE_SPAN.finditer(text):
            span = m.group(1).strip()
            if _DOTTED.match(span):
                add("name", span.removesuffix("()"), _where(path, text, m.start()))
            elif _FILE_SPAN.match(span):
                add("file", span.rstrip("/"), _where(path, text, m.start()))
    return found


@pytest.fixture(scope="module")
def named() -> dict[str, dict[str, list[str]]]:
    return collect()


@pytest.fixture(scope="module")
def probe_failures(named) -> dict[str, str]:
    """{kind:name: error} for every module or name of the docs that does not work."""
    checks = [[kind, name] for kind in ("run", "import", "name") for name in named[kind]]
    checks += [["import", MISSING_MODULE], ["name", MISSING_NAME]]
    result = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(checks), *OWN], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _report(failures: dict[str, str], kind: str, named) -> list[str]:
    return [f"{name} ({', '.join(named[kind][name])}): {error}"
            for key, error in sorted(failures.items())
            for k, _, name in [key.partition(":")] if k == kind and name in named[kind]]


def test_the_check_reports_a_module_and_a_name_that_do_not_exist(probe_failures):
    assert f"import:{MISSING_MODULE}" in probe_failures
    assert f"name:{MISSING_NAME}" in probe_failures


def test_every_python_m_module_in_the_docs_and_scripts_runs(named, probe_failures):
    assert "worker.host.cpu_kernels" in named["run"], "the collector missed scripts/setup.sh"
    assert _report(probe_failures, "run", named) == []


def test_every_import_in_the_docs_code_blocks_works(named, probe_failures):
    assert "producer.client" in named["import"], "the collector missed the README"
    assert _report(probe_failures, "import", named) == []


def test_every_dotted_name_in_the_docs_resolves(named, probe_failures):
    assert "worker.Engine" in named["name"], "the collector missed the README's import"
    assert _report(probe_failures, "name", named) == []


def test_every_file_the_docs_and_scripts_name_exists(named):
    assert "worker/engine/engine.py" in named["file"]
    missing = [f"{name} ({', '.join(where)})" for name, where in sorted(named["file"].items())
               if not (ROOT / name).exists()]
    assert missing == []


def test_the_architecture_walk_fits_in_its_line_limit():
    lines = len((ROOT / "docs" / "architecture.md").read_text().splitlines())
    assert lines <= MAX_ARCHITECTURE_LINES


def test_the_benchmark_figures_fit_in_their_line_limit():
    lines = len((ROOT / "docs" / "benchmarks.md").read_text().splitlines())
    assert lines <= MAX_BENCHMARKS_LINES
