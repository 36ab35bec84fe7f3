"""One place for each rule: Redis keys come from the key builder, switches from the settings.

Every Redis key name is formatted by producer/wire/keys.py, and every ``CONVEYOR_*``
environment variable is named in producer/settings.py alone. Each rule scans the project's
packages (their syntax trees, so comments and docstrings do not count), and each checker is
itself shown to catch an injected example.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("producer", "worker", "kvstore", "scheduler")
KEY_BUILDER = ROOT / "producer" / "wire" / "keys.py"
SETTINGS = ROOT / "producer" / "settings.py"

# The families of conveyor's keys: the word after the namespace.
FAMILIES = ("req", "handoff", "out", "dead", "worker", "workers", "model", "models",
            "requested", "cancel", "cancelled", "isolated", "kv")
_FAMILY = "(?:" + "|".join(FAMILIES) + r")\b"
# A literal right after a formatted value that goes on as a key does: ":req:", ":dead".
_AFTER_VALUE = re.compile(":" + _FAMILY)
# A literal that is a key of the default namespace, or a %- or {}-template of one.
_WHOLE_KEY = re.compile(r"(?:^conveyor|%s|\{[^{}]*\}):" + _FAMILY)
# Names a namespace goes by, where ``ns + ":..."`` or ``f"{ns}:..."`` builds a key.
_NAMESPACE_NAMES = {"ns", "namespace"}
# What goes on from a namespace in a key: a colon, then no space ("namespace 'x': ..." is prose).
_KEY_GOES_ON = re.compile(r":[\w{*]")


def project_sources() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (not code that builds anything)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _is_namespace(node: ast.AST) -> bool:
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)
    return name in _NAMESPACE_NAMES


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def formatted_keys(source: str) -> list[int]:
    """Line numbers where ``source`` formats a conveyor key: a namespace or a formatted value
    followed by ``:<family>``, a namespace joined to ``:...``, or a literal key."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    in_fstring: set[int] = set()
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = node.values
            in_fstring.update(id(p) for p in parts)
            for before, after in zip(parts, parts[1:], strict=False):
                text = _str(after)
                if isinstance(before, ast.FormattedValue) and text is not None and (
                        _AFTER_VALUE.match(text)
                        or (_is_namespace(before.value) and _KEY_GOES_ON.match(text))):
                    lines.append(node.lineno)
                    break
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            text = _str(node.right)
            if text is not None and (_AFTER_VALUE.match(text)
                                     or (_is_namespace(node.left) and _KEY_GOES_ON.match(text))):
                lines.append(node.lineno)
        elif (text := _str(node)) is not None and id(node) not in docstrings \
                and id(node) not in in_fstring and _WHOLE_KEY.search(text):
            lines.append(node.lineno)
    return sorted(set(lines))


@pytest.mark.parametrize("snippet", [
    'key = f"{ns}:req:{model}:{lane}"',
    'key = f"{self.ns}:kv:{{{name}}}:h"',
    'key = f"{prefix}:out:{rid}"',
    'key = self.namespace + ":dead"',
    'key = ns + ":anything"',
    'key = f"{namespace}:new-family:{x}"',
    'key = "conveyor:req:{small}:interactive"',
    'key = "%s:cancelled:%s" % (ns, rid)',
    'key = "{}:isolated:{}".format(ns, rid)',
    'rules = [f"~{ns}:req:*"]',
])
def test_the_key_checker_catches_a_key_formatted_anywhere(snippet):
    assert formatted_keys(snippet) == [1]


@pytest.mark.parametrize("snippet", [
    'name = f"{worker_id}:{thread}"',
    'url = f"redis://{host}:{port}/0"',
    'key = keys.requests(model, lane)',
    'def f():\n    """Requests go on ``conveyor:req:{tiny}:interactive``."""',
    'hint = "run `conveyor redis setup` first"',
    'why = f"no model is registered in namespace {namespace!r}: start a worker"',
])
def test_the_key_checker_lets_other_strings_be(snippet):
    assert formatted_keys(snippet) == []


def offenders(check: Callable[[str], list[int]], exempt: Path) -> dict[str, list[int]]:
    """The project's modules (``exempt`` apart) where ``check`` finds lines, with those lines."""
    found = {}
    for path in project_sources():
        if path != exempt and (lines := check(path.read_text())):
            found[str(path.relative_to(ROOT))] = lines
    return found


def test_no_module_but_the_key_builder_formats_a_conveyor_key():
    assert offenders(formatted_keys, KEY_BUILDER) == {}, \
        "format these keys in producer/wire/keys.py (Keys)"


def test_the_key_builder_itself_is_seen_formatting_keys():
    # The rule's positive case on the real tree: were the checker blind, this would fail.
    assert formatted_keys(KEY_BUILDER.read_text())


# ----- environment switches: named in producer/settings.py alone -----

_SWITCH_NAME = re.compile("CONVEYOR_")


def named_switches(source: str) -> list[int]:
    """Line numbers of string literals (docstrings apart) that name a CONVEYOR_ variable:
    code that reads, sets or spells out a switch itself instead of asking the settings."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    return sorted({node.lineno for node in ast.walk(tree)
                   if (text := _str(node)) is not None and id(node) not in docstrings
                   and _SWITCH_NAME.search(text)})


@pytest.mark.parametrize("snippet", [
    'flag = os.environ.get("CONVEYOR_CPU_KERNELS", "1")',
    'os.environ["CONVEYOR_CPU_MATMUL"] = "blas"',
    'url = os.getenv(f"CONVEYOR_{what}")',
    'help = "default: $CONVEYOR_REDIS_URL"',
])
def test_the_switch_checker_catches_a_variable_named_anywhere(snippet):
    assert named_switches(snippet) == [1]


def test_the_switch_checker_lets_docstrings_and_comments_be():
    source = ('def f():\n    """``CONVEYOR_CPU_KERNELS=0`` turns the kernels off."""\n'
              '    return settings.cpu_kernels()  # CONVEYOR_CPU_KERNELS\n')
    assert named_switches(source) == []


def test_nothing_outside_the_settings_module_names_a_conveyor_variable():
    assert offenders(named_switches, SETTINGS) == {}, \
        "read CONVEYOR_* variables through producer.settings"
    assert named_switches(SETTINGS.read_text())  # the rule's positive case, on the real tree
